"""Step 1 of a sharded save on one rank: what it holds, as plain data.

:func:`describe` walks the flattened state (Shard, FlatShard and Partitioned nodes recognised by
type name, :mod:`savepoint.distributed.shard`) and returns the rank's
:class:`~savepoint.distributed.plan.LocalPlan` and the source of each piece;
:func:`describe_layout` also the state's regular layout (:mod:`savepoint.distributed.layout`),
when it has one. No I/O, no collectives.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import threading
from dataclasses import dataclass
from typing import Any

from savepoint.codecs import boxes
from savepoint.distributed import layout, plan, shard
from savepoint.errors import UnsupportedStateError
from savepoint.state import tree
from savepoint.state.arrays import TensorSource

__all__ = ["Described", "describe", "describe_layout", "forget"]


def describe(flat: tree.Flat, path: str) -> tuple[plan.LocalPlan, dict[str, TensorSource]]:
    """This rank's plan (plain data) and the source of each piece it holds, by tensor key."""
    local_plan, sources, _ = describe_layout(flat, path)
    return local_plan, sources


Described = tuple[
    plan.LocalPlan, dict[str, TensorSource], tuple[layout.Layout, tuple[int, ...]] | None
]


@dataclass(frozen=True)
class _Memo:
    """A rank's last description, kept to answer the next save of the same state shape."""

    tree: bytes  # the flattened state's tree it described, as layout.tree_bytes (types kept)
    signature: tuple[list[Any], list[tuple[int, ...]]]  # the tensors' dtypes, shapes, in order
    plan: plan.LocalPlan  # path blanked
    keys: tuple[str, ...]  # the pieces' keys
    refs: tuple[str, ...]  # the flat tensor each piece is
    grid: tuple[layout.Layout, tuple[int, ...]] | None


_memos: dict[Any, _Memo] = {}
_DTYPE, _SHAPE = operator.attrgetter("dtype"), operator.attrgetter("shape")
_lock = threading.Lock()


def describe_layout(flat: tree.Flat, path: str, memo_key: Any = None) -> Described:
    """:func:`describe`, and the state's regular layout and this rank's coordinate in it
    (None: not regular, :mod:`savepoint.distributed.layout`).

    ``memo_key`` (a :func:`savepoint.distributed.plancache.key`; None: nothing kept): the
    description is kept per key, and the next call whose flattened tree is the same (keys,
    nesting, plain values with their types, every Shard's layout and grid: compared as
    :func:`~savepoint.distributed.layout.tree_bytes`, as ``==`` holds ``1`` and ``True`` equal)
    and whose tensors have the same dtypes and shapes in the same order reuses it instead of
    walking the state again: the walk is a few microseconds a tensor in Python, the comparison
    of the trees runs in C (a repeated save of a 50,000-tensor state:
    ``benchmarks/bench_world.py``, ``repeat_plan_s``)."""
    # The tree compared as bytes: ``==`` would take {"step": True} for the {"step": 1} kept.
    tree_key = layout.tree_bytes(flat.tree) if memo_key is not None else None
    signature: Any = None  # (only kept with a memo_key: 2 ms at 50,000 tensors)
    if tree_key is not None:
        values = flat.tensors.values()  # (the loops run in C)
        signature = (list(map(_DTYPE, values)), list(map(_SHAPE, values)))
        with _lock:
            memo = _memos.get(memo_key)
        if memo is not None and memo.signature == signature and memo.tree == tree_key:
            sources = dict(zip(memo.keys, map(flat.tensors.__getitem__, memo.refs)))
            return dataclasses.replace(memo.plan, path=path), sources, memo.grid
    walker = _Describer(flat)
    root = walker.walk(flat.tree, "", True)
    local_plan = plan.LocalPlan(path, root, tuple(walker.items.values()))
    grid = walker.grids.done(root)
    if tree_key is not None:
        ref_of = {id(source): ref for ref, source in flat.tensors.items()}
        refs = tuple(ref_of[id(source)] for source in walker.sources.values())
        blank = dataclasses.replace(local_plan, path="")
        kept = _Memo(tree_key, signature, blank, tuple(walker.sources), refs, grid)
        with _lock:
            _memos[memo_key] = kept
    elif memo_key is not None:  # (not plain data: kept nothing, and keeps no older one)
        forget(memo_key)
    return local_plan, walker.sources, grid


def forget(memo_key: Any) -> None:
    """Drop the description kept for ``memo_key`` (the group is gone)."""
    with _lock:
        _memos.pop(memo_key, None)


class _Describer:
    """One walk over a flattened state: its pieces, their sources, its layout."""

    def __init__(self, flat: tree.Flat) -> None:
        self.flat = flat
        self.items: dict[str, plan.Item] = {}
        self.sources: dict[str, TensorSource] = {}
        self.grids = layout.LayoutBuilder()
        # The layouts of a state repeat (every layer's tensors, a parameter's optimizer
        # moments): parsed once per distinct string, per walk (what the plan's objects share,
        # and so the bytes they pickle to, depends on this state alone).
        self.layouts: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
        self.grid_texts: dict[str, layout.Grid] = {}
        # A Shard's (global shape, region, grid, elements here, elements at all) by (layout
        # text, grid text, local shape), and a plain tensor's full box by its shape: per walk,
        # as the parsed layouts above (the fast path of :meth:`walk`, a few dict look-ups).
        self.shards: dict[tuple[Any, ...], tuple[Any, ...]] = {}
        self.full: dict[tuple[int, ...], boxes.Box] = {}

    def add(
        self,
        key: str,
        source: TensorSource,
        shape: tuple[int, ...],
        region: boxes.Region,
        grid: layout.Grid | None = None,
    ) -> None:
        dtype = source.dtype.name
        self.grids.add(key, dtype, shape, grid)
        if not math.prod(source.shape):  # the piece's elements: the local part's
            if math.prod(shape):
                return  # an empty piece of an uneven split: nothing to write
            region = boxes.full(shape)  # a tensor without elements: every rank agrees on it
        self.items[key] = plan.Item(key, dtype, shape, region)
        self.sources[key] = source

    def parse(self, fields: dict[str, Any]) -> tuple[tuple[int, ...], tuple[int, ...], Any]:
        """(global shape, starts, grid or None) of a Shard's or FlatShard's fields."""
        text = fields["layout"]["v"]
        got = self.layouts.get(text)
        if got is None:
            got = self.layouts[text] = shard.parse_layout(text)
        grid = None
        if "grid" in fields:
            text = fields["grid"]["v"]
            grid = self.grid_texts.get(text)
            if grid is None:
                grid = self.grid_texts[text] = layout.parse_grid(text)
        return got[0], got[1], grid

    def sharded(self, node: tree.Node, key: str) -> tree.Node:
        fields = dict(node["state"]["items"])
        local_node = fields.get("local")
        if type(local_node) is not dict or local_node.get("t") != "tensor":
            raise UnsupportedStateError(f"{key or '<root>'}: malformed {node['type']}", key=key)
        source = self.flat.tensors[local_node["ref"]]
        global_shape, starts, grid = self.parse(fields)
        region: boxes.Region
        if node["type"] == shard.SHARD:
            region = tuple(zip(starts, map(operator.add, starts, source.shape)))
        else:
            region = boxes.Flat(starts[0], starts[0] + source.shape[0])
            grid = None
        if grid is None:
            self.grids.irregular()
        if key in self.items or (key in self.flat.tensors and key != local_node["ref"]):
            raise UnsupportedStateError(
                f"{key or '<root>'}: two tensors of the state would both be named {key!r}; "
                "rename one of the keys (integer and string keys that print alike clash)",
                key=key,
            )
        self.add(key, source, global_shape, region, grid)
        return {"t": "tensor", "ref": key, "kind": local_node["kind"]}

    def shard(self, node: tree.Node, key: str) -> tree.Node:
        """:meth:`sharded` for a Shard whose fields are in ``state_dict``'s order (``local``,
        ``layout``, then ``grid`` or nothing), its parsing kept per distinct texts and local
        shape; any other node (or a malformed one: the same error) through :meth:`sharded`."""
        fields = node["state"]["items"]
        try:
            if len(fields) == 3:
                (k0, local_node), (k1, layout_node), (k2, grid_node) = fields
                if k2 != "grid":
                    return self.sharded(node, key)
            else:
                (k0, local_node), (k1, layout_node) = fields
                grid_node = None
        except (ValueError, TypeError):
            return self.sharded(node, key)
        if k0 != "local" or k1 != "layout" or type(local_node) is not dict:
            return self.sharded(node, key)
        if local_node.get("t") != "tensor":
            raise UnsupportedStateError(f"{key or '<root>'}: malformed {node['type']}", key=key)
        ref = local_node["ref"]
        tensors = self.flat.tensors
        source = tensors[ref]
        text = layout_node["v"]
        grid_text = None
        if grid_node is not None:
            grid_text = grid_node.get("v") if type(grid_node) is dict else None
            if type(grid_text) is not str:
                return self.sharded(node, key)  # (not a string: its errors, as before)
        if type(text) is not str:
            return self.sharded(node, key)
        local_shape = source.shape
        described = self.shards.get((text, grid_text, local_shape))
        if described is None:
            global_shape, starts, grid = self.parse(
                {"layout": layout_node}
                if grid_node is None
                else {"layout": layout_node, "grid": grid_node}
            )
            region = tuple(zip(starts, map(operator.add, starts, local_shape)))
            here, anywhere = math.prod(local_shape) != 0, math.prod(global_shape) != 0
            if not here and not anywhere:
                region = boxes.full(global_shape)
            described = (global_shape, region, grid, here, anywhere)
            self.shards[(text, grid_text, local_shape)] = described
        global_shape, region, grid, here, anywhere = described
        if grid is None:
            self.grids.irregular()
        items = self.items
        if key in items or (key in tensors and key != ref):
            raise UnsupportedStateError(
                f"{key or '<root>'}: two tensors of the state would both be named {key!r}; "
                "rename one of the keys (integer and string keys that print alike clash)",
                key=key,
            )
        dtype = source.dtype.name
        self.grids.add(key, dtype, global_shape, grid)
        if here or not anywhere:  # (else an empty piece of an uneven split: nothing to write)
            items[key] = plan.Item(key, dtype, global_shape, region)
            self.sources[key] = source
        return {"t": "tensor", "ref": key, "kind": local_node["kind"]}

    def walk(self, node: tree.Node, key: str, is_root: bool) -> tree.Node:
        """``node`` of the flattened tree with its Shards replaced by their pieces' tensor nodes;
        ``key``: the node's flat key (``is_root``: the tree's root), carried down as
        :func:`savepoint.state.tree.flatten` builds it (one escape per component)."""
        t = node["t"]
        walk = self.walk
        if t == "stateful":
            if node["type"] == shard.SHARD:
                return self.shard(node, key)
            if node["type"] == shard.FLAT_SHARD:
                return self.sharded(node, key)
            if node["type"] == shard.PARTITIONED:
                self.grids.irregular()
                inner = node["state"]
                return {
                    "t": plan.PARTITIONED_NODE,
                    "items": [
                        [k, walk(c, tree.child_key(key, is_root, k), False)]
                        for k, c in inner["items"]
                    ],
                }
            return {**node, "state": walk(node["state"], key, is_root)}
        if t == "dict":
            prefix = "" if is_root else key + "/"
            escape = tree.escape
            out: list[list[Any]] = []
            append = out.append
            for k, c in node["items"]:
                # escape() inlined for the common key (returned as it is), and a Shard, the most
                # frequent node of a sharded state, passed straight to shard().
                if type(k) is str and k.isascii() and "~" not in k and "/" not in k:
                    sub = prefix + k
                else:
                    sub = prefix + escape(k)
                if c["t"] == "stateful" and c["type"] == _SHARD:
                    append([k, self.shard(c, sub)])
                else:
                    append([k, walk(c, sub, False)])
            return {"t": "dict", "items": out}
        if t in ("list", "tuple"):
            prefix = "" if is_root else key + "/"
            return {
                "t": t,
                "items": [walk(c, f"{prefix}{i}", False) for i, c in enumerate(node["items"])],
            }
        if t == "tensor" and node["ref"] not in self.items:
            ref = node["ref"]
            source = self.flat.tensors[ref]
            shape = source.shape
            full = self.full.get(shape)
            if full is None:
                full = self.full[shape] = boxes.full(shape)
            self.add(ref, source, shape, full)
        return node


_SHARD = shard.SHARD
