"""A native checkpoint described from its manifest alone (:class:`savepoint.info.CheckpointInfo`).

Used by ``sp.inspect`` / ``sp.verify`` and by every save path to describe what it committed
(single-process, async, sharded), so that all of them return the same description.

The per-key part (``tensors``, ``values``, ``stateful``) is deferred until first read
(:meth:`CheckpointInfo.deferred`): a save returns a description that most callers drop, and for a
state of 100,000 tensors building it took longer than writing the data.
"""

from __future__ import annotations

import functools
import itertools
import operator
from collections.abc import Iterable
from typing import Any

from savepoint.codecs import manifest as mf
from savepoint.engine import collector
from savepoint.info import CheckpointInfo, Described, TensorInfo
from savepoint.state import tree

__all__ = ["describe"]


def describe(path: str, manifest: mf.Manifest) -> CheckpointInfo:
    """The description of the checkpoint at ``path`` (as messages show it) with ``manifest``."""
    return CheckpointInfo.deferred(
        functools.partial(_contents, manifest),
        path=path,
        format_version=manifest.format_version,
        writer=manifest.writer,
        created=manifest.created,
        metadata=manifest.metadata,
        files={name: f.size for name, f in manifest.files.items()},
        world_size=manifest.world_size,
    )


def _contents(manifest: mf.Manifest) -> Described:
    """Tensors, plain values and Stateful objects by flat key."""
    with collector.paused():
        manifest.root()
        return _describe_leaves(manifest)


def _describe_leaves(manifest: mf.Manifest) -> Described:
    leaves = tree.keyed_leaves(manifest.tree)
    fast = _describe_plain(manifest, leaves)
    if fast is not None:
        return fast
    return _describe_each(manifest, leaves)


def _describe_plain(manifest: mf.Manifest, leaves: list[tuple[str, tree.Node]]) -> Described | None:
    """:func:`_describe_each` for the common tree, column by column: distinct keys, each
    tensor stored once (no tied leaves) and whole. None for any other tree."""
    if not leaves:
        return None
    keys, nodes = zip(*leaves)
    if len(set(keys)) != len(keys):
        return None
    kinds = list(map(_T, nodes))
    values: dict[str, Any] = {}
    if set(kinds) != _TENSOR_ONLY:
        tensor = [k == "tensor" for k in kinds]
        for key, node, is_tensor in zip(keys, nodes, tensor):
            if not is_tensor:
                values[key] = tree.plain_value(node)
        keys = tuple(itertools.compress(keys, tensor))
        nodes = tuple(itertools.compress(nodes, tensor))
    refs = list(map(_REF, nodes))
    if len(set(refs)) != len(refs):
        return None
    table = manifest.tensors
    if isinstance(table, mf.TensorTable) and refs == table.names:
        # Straight from the columns, in their order (the tree's, as a save writes them).
        dtypes: Iterable[str] = map(table.dtypes.__getitem__, table.dtype_of)
        shapes: Iterable[tuple[int, ...]] = map(table.shapes.__getitem__, table.shape_of)
        files: Iterable[str] = map(table.files.__getitem__, table.file_of)
        nbytes = list(map(operator.sub, table.ends, table.starts))
    elif isinstance(table, mf.TensorTable):
        # Straight from the columns: no record per tensor.
        rows = list(map(table.rows().__getitem__, refs))
        dtypes = map(table.dtypes.__getitem__, map(table.dtype_of.__getitem__, rows))
        shapes = map(table.shapes.__getitem__, map(table.shape_of.__getitem__, rows))
        files = map(table.files.__getitem__, map(table.file_of.__getitem__, rows))
        nbytes = list(
            map(
                operator.sub, map(table.ends.__getitem__, rows), map(table.starts.__getitem__, rows)
            )
        )
    else:
        records = list(map(table.__getitem__, refs))
        if any(map(_SHARDS, records)):
            return None
        nbytes = list(map(operator.sub, map(_END, records), map(_START, records)))
        dtypes, shapes = map(_DTYPE, records), map(_SHAPE, records)
        files = [r.file if r.recipe is None else _blobs_label(r.recipe) for r in records]
    made = tuple(map(TensorInfo.make, keys, dtypes, shapes, nbytes, files, refs))
    return made, values, _stateful(manifest.tree)


_T = operator.itemgetter("t")
_TENSOR_ONLY = {"tensor"}
_REF = operator.itemgetter("ref")
_DTYPE = operator.attrgetter("dtype")
_SHAPE = operator.attrgetter("shape")
_FILE = operator.attrgetter("file")
_START = operator.attrgetter("start")
_END = operator.attrgetter("end")


def _SHARDS(record: mf.TensorRecord) -> bool:
    return len(record.shards) > 1


def _describe_each(manifest: mf.Manifest, leaves: list[tuple[str, tree.Node]]) -> Described:
    tensors = []
    values: dict[str, Any] = {}
    used: set[str] = set()
    seen_refs: set[str] = set()
    records = manifest.tensors
    make = TensorInfo.make
    for key, node in leaves:
        # {0: a, "0": b} share a path; keep both apart, as tensor names do (see state.tree).
        unique = key
        if unique in used:
            n = 2
            while unique in used:
                unique, n = f"{key}~{n}", n + 1
        used.add(unique)
        if node["t"] == "tensor":
            ref = node["ref"]
            rec = records[ref]
            tied = ref if ref in seen_refs else None
            seen_refs.add(ref)
            pieces = len(rec.shards) or 1  # len(rec.layout()), without making one
            if pieces == 1:
                where = rec.file if rec.recipe is None else _blobs_label(rec.recipe)
                tensors.append(
                    make(unique, rec.dtype, rec.shape, rec.end - rec.start, where, ref, tied)
                )
            else:
                tensors.append(
                    make(
                        unique,
                        rec.dtype,
                        rec.shape,
                        rec.nbytes,
                        f"{pieces} shards",
                        ref,
                        tied,
                        pieces,
                    )
                )
        else:
            values[unique] = tree.plain_value(node)
    return tuple(tensors), values, _stateful(manifest.tree)


def _blobs_label(recipe: Any) -> str:
    """Where a tensor held in the blob store is, as ``inspect`` shows it: ``blobs (3 chunks)``,
    ``blobs (64 chunks + 5 patches)``."""
    n = len(recipe.digests)
    label = f"blobs ({n} chunk{'s' if n != 1 else ''}"
    if recipe.patches:
        p = len(recipe.patches)
        label += f" + {p} patch{'es' if p != 1 else ''}"
    return label + ")"


def _stateful(root: tree.Node) -> dict[str, str]:
    """Stateful objects by flat key, with the type name each was saved from (iteratively: the
    tree may be as deep as the manifest allows)."""
    found: dict[str, str] = {}
    stack: list[tuple[tree.Node, str, bool]] = [(root, "", True)]
    while stack:
        node, key, is_root = stack.pop()
        t = node["t"]
        if t == "stateful":
            found[key] = node["type"]
            stack.append((node["state"], key, is_root))
        elif t == "dict":
            stack.extend(
                (child, tree.child_key(key, is_root, k), False)
                for k, child in reversed(node["items"])
                if child["t"] in _CONTAINERS
            )
        elif t in ("list", "tuple"):
            items = node["items"]
            stack.extend(
                (items[i], tree.child_key(key, is_root, i), False)
                for i in range(len(items) - 1, -1, -1)
                if items[i]["t"] in _CONTAINERS
            )
    return found


_CONTAINERS = frozenset(("dict", "list", "tuple", "stateful"))
