"""Flattening a state tree into tensors plus a JSON description of its structure, and back.

The structure is stored in the manifest as nested nodes, so any key survives exactly::

    {"t": "dict", "items": [[key, node], ...]}   key: a JSON string or integer, order preserved
    {"t": "list", "items": [node, ...]}          also "tuple"
    {"t": "tensor", "ref": name, "kind": k}      k: "numpy" | "numpy_scalar" | "torch"
    {"t": "value", "v": json}                    None, bool, int, str, finite float
    {"t": "float", "v": "nan" | "inf" | "-inf"}
    {"t": "bytes", "v": base64}
    {"t": "stateful", "type": "module.Class", "state": node}

Tensors are named by their path: components escaped as in JSON Pointer (RFC 6901: ``~`` becomes
``~0``, ``/`` becomes ``~1``; lone surrogates become ``~u`` + 4 hex digits so names stay valid
UTF-8) and joined by ``/``. A key that would repeat an earlier name (``{0: a, "0": b}``) gets a
``~2``, ``~3``... suffix, which escaping can never produce. Two leaves that are the same view of
the same memory (tied weights) share one tensor record, so they are stored once and come back tied.

What training scripts hold: a ``torch.compile``, DDP or DataParallel wrapper is saved as the model
it wraps (its keys carry no ``_orig_mod.``/``module.`` prefix; see :mod:`savepoint.state.wrappers`),
and a dataclass instance (a config) is saved as a plain ``dict`` node of its fields, in field
order, each field's value stored like any other value. The class is not recorded: a checkpoint
never names code to run, and ``sp.load`` without ``into=`` gives the dict back. A JAX pytree node
of another kind (an ``nnx.Variable``, a ``flax.struct.dataclass``) is saved as a dict of its
children keyed by their JAX key path entries (:func:`pytree_children`; docs/jax.md).
"""

from __future__ import annotations

import base64
import dataclasses
import math
import operator
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from savepoint.codecs.bounded_json import MAX_DEPTH
from savepoint.errors import UnsupportedStateError
from savepoint.state.arrays import TensorSource, make_source
from savepoint.state.stateful import is_stateful
from savepoint.state.wrappers import unwrap

__all__ = [
    "Flat",
    "Key",
    "Node",
    "ROOT_LEVEL",
    "build",
    "child_key",
    "close_matches",
    "escape",
    "flatten",
    "join",
    "keyed_leaves",
    "leaves",
    "nearest",
    "plain_value",
    "pytree_children",
    "refs",
    "select",
    "tensor_nodes",
]

Node = dict[str, Any]
Key = str | int

# JSON nesting a node adds above its parent: a dict node nests its child in an object, the items
# array and a [key, node] pair; a list in the object and the items array; a stateful node in the
# object. The root node sits at level 2 (inside the manifest's object) and the manifest reader
# accepts ``MAX_DEPTH`` levels, so a dict-only tree holds 170 levels, a list-only tree 255, and
# a chain of stateful objects 510 (see :func:`flatten`).
ROOT_LEVEL = 2
DICT_COST, LIST_COST, STATEFUL_COST = 3, 2, 1
_SURROGATE = re.compile("[\ud800-\udfff]")


def escape(component: Key) -> str:
    """One path component as it appears in a tensor name (see the module docstring)."""
    if isinstance(component, int):
        return str(component)
    # Most keys are plain ASCII without "~" or "/": returned as they are (the escaping below,
    # per character, cost a 100,000-tensor save about a second).
    if component.isascii():
        if "~" in component or "/" in component:
            return component.replace("~", "~0").replace("/", "~1")
        return component
    out = component.replace("~", "~0").replace("/", "~1")
    if _SURROGATE.search(out) is not None:
        out = _SURROGATE.sub(lambda m: f"~u{ord(m.group()):04x}", out)
    return out


def join(path: tuple[Key, ...]) -> str:
    return "/".join([escape(c) for c in path])


def child_key(parent: str, is_root: bool, component: Key) -> str:
    """``join((*path, component))`` from ``parent == join(path)``; ``is_root``: ``path == ()``.
    Walks carry keys down this way, so a leaf's name costs one escape, not one per level."""
    return escape(component) if is_root else f"{parent}/{escape(component)}"


@dataclass
class Flat:
    """A flattened state: its structure and its distinct tensors, in first-seen order."""

    tree: Node
    tensors: dict[str, TensorSource] = field(default_factory=dict)


def flatten(state: Any) -> Flat:
    """Walk ``state`` once, calling ``state_dict()`` on every Stateful it meets.

    Raises UnsupportedStateError, before recursing any further, when the tree would nest deeper
    than the manifest reader's JSON cap (``MAX_DEPTH`` levels, counted as in ``ROOT_LEVEL`` and
    the ``*_COST`` constants): whatever ``flatten`` accepts, ``sp.load`` can read. The walk
    recurses at most about ``MAX_DEPTH`` Python frames deep, well within the default limit.

    Each node's flat key is built from its parent's (:func:`child_key`), so a state of many
    leaves costs one escape per leaf whatever its depth.
    """
    flat = Flat(tree={})
    tensors = flat.tensors
    # Tied tensors: the name first stored for each identity, found by the identity's hash (an
    # int costs a third of the identity tuple: 100 MB less at a million tensors); identities
    # whose hash another one already has go in ``by_identity``.
    by_hash: dict[int, str] = {}
    by_identity: dict[tuple[Any, ...], str] = {}
    active: set[int] = set()  # ids on the current path, to refuse reference cycles

    def leaf_tensor(source: TensorSource, key: str) -> Node:
        ident = source.identity()
        code = 0
        if ident is not None:
            code = hash(ident)
            seen = by_hash.get(code)
            if seen is not None and tensors[seen].identity() != ident:
                seen = by_identity.get(ident)
            if seen is not None:
                return _tensor_node(seen, source.kind)
        name = key
        # "__metadata__" is the safetensors header's reserved key: never a tensor name.
        if name in tensors or name == "__metadata__":
            n = 2
            while f"{name}~{n}" in tensors:
                n += 1
            name = f"{name}~{n}"
        tensors[name] = source
        if ident is not None:
            if code in by_hash:
                by_identity[ident] = name
            else:
                by_hash[code] = name
        return _tensor_node(name, source.kind)

    def child_items(pairs: list[tuple[Key, Any]], key: str, is_root: bool, level: int) -> list[Any]:
        deeper = level + DICT_COST
        return [[k, walk(v, child_key(key, is_root, k), False, deeper)] for k, v in pairs]

    def mapping(obj: Mapping[Any, Any], key: str, is_root: bool, level: int) -> Node:
        if id(obj) in active:
            raise _cycle(key)
        active.add(id(obj))
        try:
            items: list[list[Any]] = []
            deeper = level + DICT_COST
            prefix = "" if is_root else key + "/"
            for k, v in obj.items():
                if type(k) is str:
                    vc = type(v)  # a plain value, inlined (a call per leaf less)
                    if vc is str or vc is int or vc is bool or v is None:
                        items.append([k, {"t": "value", "v": v}])
                        continue
                    # The common case, inlined: escape() returns most keys unchanged.
                    sub = prefix + (
                        k if k.isascii() and "~" not in k and "/" not in k else escape(k)
                    )
                    items.append([k, walk(v, sub, False, deeper)])
                    continue
                k = _plain_key(k, key)  # a str subclass or an int: refused if neither
                items.append([k, walk(v, prefix + escape(k), False, deeper)])
            return {"t": "dict", "items": items}
        finally:
            active.discard(id(obj))

    def walk(obj: Any, key: str, is_root: bool, level: int) -> Node:
        if level > MAX_DEPTH:
            raise _too_deep(key, level)
        cls = type(obj)  # plain values and dicts (never tensors) first: most nodes are
        if cls is str or cls is bool or cls is int or obj is None:
            return {"t": "value", "v": obj}
        if cls is dict:
            return mapping(obj, key, is_root, level)
        type_name = _plain_stateful.get(cls)  # a class met before: no array or wrapper checks
        if type_name is None:
            source = make_source(obj, key)
            if source is not None:
                return leaf_tensor(source, key)
            if (value := _plain_node(obj)) is not None:
                return value
            if isinstance(obj, Mapping):
                return mapping(obj, key, is_root, level)
            if is_stateful(obj):
                bare = unwrap(obj)  # a compiled or DDP model saves the keys of the model inside
                bare_cls = type(bare)
                type_name = f"{bare_cls.__module__}.{bare_cls.__qualname__}"
                if bare is obj and _class_stateful(cls):
                    _plain_stateful[cls] = type_name
                obj = bare
        if id(obj) in active:
            raise _cycle(key)
        active.add(id(obj))
        try:
            if type_name is not None:  # in this frame: a chain of 510 Statefuls fits the stack
                inner = walk(obj.state_dict(), key, is_root, level + STATEFUL_COST)
                return {"t": "stateful", "type": type_name, "state": inner}
            if isinstance(obj, (list, tuple)):
                kind = "list" if isinstance(obj, list) else "tuple"
                deeper = level + LIST_COST
                prefix = "" if is_root else key + "/"
                return {
                    "t": kind,
                    "items": [walk(v, f"{prefix}{i}", False, deeper) for i, v in enumerate(obj)],
                }
            if (pairs := _named_children(obj, key, is_root)) is not None:
                return {"t": "dict", "items": child_items(pairs, key, is_root, level)}
        finally:
            active.discard(id(obj))
        raise _unsupported(obj, key)

    try:
        flat.tree = walk(state, "", True, ROOT_LEVEL)
    finally:
        # The nested functions refer to each other, so these would live until the next garbage
        # collection (a million identities are 300 MB).
        by_hash.clear()
        by_identity.clear()
        active.clear()
    return flat


# Classes whose instances are saved through state_dict() as they are: no array, no mapping, list
# or tuple, no wrapper, both methods defined by the class (so every instance has them). Met once
# by the full checks of :func:`flatten`'s walk, then recognised by their type alone: a state of
# 50,000 Shards (:mod:`savepoint.distributed.shard`) or modules skips five checks each.
_plain_stateful: dict[type, str] = {}


def _class_stateful(cls: type) -> bool:
    # (Called for an instance that failed every check before is_stateful(): those depend on its
    # class alone.)
    return (
        callable(getattr(cls, "state_dict", None))
        and callable(getattr(cls, "load_state_dict", None))
        and len(_plain_stateful) < 4096
    )


def _plain_node(obj: Any) -> Node | None:
    """The node of a plain value (a subclass of str, int, float, bytes...), None otherwise."""
    if obj is None or isinstance(obj, (bool, str)):
        return {"t": "value", "v": obj}
    if isinstance(obj, int):
        return {"t": "value", "v": int(obj)}
    if isinstance(obj, float):
        if math.isfinite(obj):
            return {"t": "value", "v": float(obj)}
        return {"t": "float", "v": repr(float(obj))}
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return {"t": "bytes", "v": base64.b64encode(bytes(obj)).decode("ascii")}
    return None


def _plain_key(k: Any, key: str) -> Key:
    if isinstance(k, bool) or not isinstance(k, (str, int)):
        raise UnsupportedStateError(
            f"{key or '<root>'}: dict key {k!r} of type {type(k).__name__} cannot be "
            "stored; keys must be str or int",
            key=key,
        )
    return k if isinstance(k, str) else int(k)


def _cycle(key: str) -> UnsupportedStateError:
    return UnsupportedStateError(
        f"{key or '<root>'}: the state contains a reference cycle", key=key
    )


def _too_deep(key: str, level: int) -> UnsupportedStateError:
    return UnsupportedStateError(
        f"{(key if len(key) <= 60 else '...' + key[-57:]) or '<root>'}: the state is "
        f"nested deeper than {MAX_DEPTH} levels of JSON in the manifest here ({level}); "
        f"savepoint stores at most {MAX_DEPTH} (a dict level takes "
        f"{DICT_COST}, a list or tuple {LIST_COST}, an object with state_dict() "
        f"{STATEFUL_COST}; at most {(MAX_DEPTH - ROOT_LEVEL) // DICT_COST} nested dicts)",
        key=key,
    )


def _unsupported(obj: Any, key: str) -> UnsupportedStateError:
    return UnsupportedStateError(
        f"{key or '<root>'}: cannot store a value of type {type(obj).__module__}."
        f"{type(obj).__qualname__}; supported leaves are numpy, torch and jax arrays, None, bool, "
        "int, float, str, bytes, dataclasses, JAX pytree nodes, and objects with "
        "state_dict()/load_state_dict()",
        key=key,
    )


def _named_children(obj: Any, key: str, is_root: bool) -> list[tuple[Key, Any]] | None:
    """(name, value) of a JAX pytree node's children (:func:`pytree_children`) or of a
    dataclass instance's fields, saved as a dict; None for anything else."""
    nodes = pytree_children(obj)
    if nodes is not None:
        return nodes
    if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
        return None
    pairs: list[tuple[Key, Any]] = []
    for f in dataclasses.fields(obj):
        if not hasattr(obj, f.name):  # an init=False field nothing has set yet
            sub = child_key(key, is_root, f.name)
            raise UnsupportedStateError(
                f"{sub}: field {f.name!r} of {type(obj).__qualname__} has no value to save",
                key=sub,
            )
        pairs.append((f.name, getattr(obj, f.name)))
    return pairs


class _TensorLeaf:
    """Its instances' ``__dict__`` is a tensor leaf node (see :func:`_tensor_node`)."""

    t: str
    ref: str
    kind: str


def _tensor_node(ref: str, kind: str) -> Node:
    """``{"t": "tensor", "ref": ref, "kind": kind}``, a plain dict, made as the attribute dict of
    a throwaway object: CPython shares the keys of such dicts (a split table), so each costs
    about 110 bytes instead of 190; a state of a million tensors holds a million of these while
    it is saved. It is an ordinary ``dict`` in every other way (a write makes its own table)."""
    leaf = _TensorLeaf()
    leaf.t = "tensor"
    leaf.ref = ref
    leaf.kind = kind
    node: Node = leaf.__dict__
    return node


def pytree_children(obj: Any) -> list[tuple[Key, Any]] | None:
    """The children of a JAX pytree node savepoint does not otherwise know, keyed by their key
    path entries (:func:`savepoint.state.jax_arrays.children`); None when jax is not imported
    (no such node can exist) or JAX takes ``obj`` for a leaf."""
    if "jax" not in sys.modules:
        return None
    from savepoint.state import jax_arrays

    return jax_arrays.children(obj)


def plain_value(node: Node) -> Any:
    t = node["t"]
    if t == "value":
        return node["v"]
    if t == "float":
        return float(node["v"])
    if t == "bytes":
        return base64.b64decode(node["v"])
    raise KeyError(t)


def build(node: Node, tensor: Callable[[str, str], Any]) -> Any:
    """Rebuild the Python tree from a node; ``tensor(ref, kind)`` supplies each tensor leaf."""
    t = node["t"]
    if t == "tensor":
        return tensor(node["ref"], node["kind"])
    if t == "dict":
        return {k: build(child, tensor) for k, child in node["items"]}
    if t == "list":
        return [build(child, tensor) for child in node["items"]]
    if t == "tuple":
        return tuple(build(child, tensor) for child in node["items"])
    if t == "stateful":
        return build(node["state"], tensor)
    return plain_value(node)


def refs(node: Node) -> set[str]:
    """Every tensor name a subtree refers to."""
    return {n["ref"] for n in tensor_nodes(node)}


def leaves(node: Node, path: tuple[Key, ...] = ()) -> list[tuple[tuple[Key, ...], Node]]:
    """(path, node) for every leaf, depth first, in stored order."""
    t = node["t"]
    if t == "dict":
        return [x for k, child in node["items"] for x in leaves(child, (*path, k))]
    if t in ("list", "tuple"):
        return [x for i, child in enumerate(node["items"]) for x in leaves(child, (*path, i))]
    if t == "stateful":
        return leaves(node["state"], path)
    return [(path, node)]


def tensor_nodes(node: Node) -> list[Node]:
    """Every tensor leaf, depth first, in stored order (iterative: any depth)."""
    out: list[Node] = []
    stack = [node]
    pop, push, extend = stack.pop, stack.append, stack.extend
    while stack:
        n = pop()
        t = n["t"]
        if t == "tensor":
            out.append(n)
        elif t == "dict":
            extend([child for _, child in reversed(n["items"])])
        elif t == "list" or t == "tuple":
            extend(reversed(n["items"]))
        elif t == "stateful":
            push(n["state"])
    return out


def keyed_leaves(node: Node) -> list[tuple[str, Node]]:
    """(flat key, node) for every leaf, depth first, in stored order: ``join(path)`` for each
    (path, node) of :func:`leaves`, without building paths (iterative: any depth)."""
    out: list[tuple[str, Node]] = []
    stack: list[tuple[Node, str, bool]] = [(node, "", True)]
    pop, push, extend = stack.pop, stack.append, stack.extend
    while stack:
        n, key, is_root = pop()
        t = n["t"]
        if t == "dict":
            prefix = "" if is_root else key + "/"
            items = n["items"]
            if _all_leaves(items):
                # Nothing nests below: the leaves go out in order now, not through the stack
                # (the common big node, a state dict of tensors).
                out.extend(
                    [
                        (
                            prefix
                            + (
                                k
                                if type(k) is str and k.isascii() and "~" not in k and "/" not in k
                                else escape(k)
                            ),
                            child,
                        )
                        for k, child in items
                    ]
                )
                continue
            extend(
                [
                    (
                        child,
                        prefix
                        + (
                            k
                            if type(k) is str and k.isascii() and "~" not in k and "/" not in k
                            else escape(k)
                        ),
                        False,
                    )
                    for k, child in reversed(items)
                ]
            )
        elif t == "list" or t == "tuple":
            prefix = "" if is_root else key + "/"
            items = n["items"]
            extend([(items[i], f"{prefix}{i}", False) for i in range(len(items) - 1, -1, -1)])
        elif t == "stateful":
            push((n["state"], key, is_root))
        else:
            out.append((key, n))
    return out


def _all_leaves(items: list[list[Any]]) -> bool:
    """Whether no child of a dict node's ``[key, child]`` items holds nodes below it."""
    return len(items) > 8 and _LEAF_TYPES.issuperset(map(_T, map(_SECOND, items)))


_SECOND = operator.itemgetter(1)
_T = operator.itemgetter("t")
_LEAF_TYPES = frozenset(("tensor", "value", "float", "bytes"))


def select(node: Node, wanted: list[str]) -> Node | None:
    """The subtree holding only paths equal to, or below, one of ``wanted`` (``/``-joined, escaped).

    Returns None when nothing matches. Containers on the way are kept, so the result has the
    same shape as the saved tree, pruned.
    """
    # Split exactly: "/x" is the key "x" under the key "" (empty keys are legal).
    wanted_parts = [tuple(w.split("/")) for w in wanted]

    def walk(n: Node, parts: tuple[str, ...]) -> Node | None:
        depth = len(parts)
        if any(w[:depth] == parts and depth >= len(w) for w in wanted_parts):
            return n  # this subtree is wanted whole
        if not any(w[:depth] == parts for w in wanted_parts):
            return None
        t = n["t"]
        if t == "dict":
            items = [
                [k, s] for k, c in n["items"] if (s := walk(c, (*parts, escape(k)))) is not None
            ]
            return {"t": "dict", "items": items} if items else None
        if t in ("list", "tuple"):
            # Keep positions so indices stay meaningful: unwanted items become None.
            kept = [walk(c, (*parts, str(i))) for i, c in enumerate(n["items"])]
            if all(s is None for s in kept):
                return None
            return {"t": t, "items": [s or {"t": "value", "v": None} for s in kept]}
        if t == "stateful":
            inner = walk(n["state"], parts)
            return None if inner is None else {**n, "state": inner}
        return None

    return walk(node, ())


def _children(n: Node) -> list[tuple[str, Node]]:
    """(escaped key, child) of a container node, through a stateful node."""
    while n["t"] == "stateful":
        n = n["state"]
    if n["t"] == "dict":
        return [(escape(k), c) for k, c in n["items"]]
    if n["t"] in ("list", "tuple"):
        return [(str(i), c) for i, c in enumerate(n["items"])]
    return []


def nearest(node: Node, wanted: str) -> str | None:
    """The key path of ``node`` nearest to ``wanted`` (``/``-joined, escaped), which is not in
    it: the components that are there, then the closest name (``difflib``) among the children
    where ``wanted`` leaves the tree, then the rest of ``wanted`` when that path exists. None
    when no name there is close. Looks at one level's names only, whatever the tree's size."""
    parts = wanted.split("/")
    at: list[str] = []
    n = node
    for i, part in enumerate(parts):
        children = dict(_children(n))
        if part in children:
            at.append(part)
            n = children[part]
            continue
        close = close_matches(part, list(children)[:10_000], n=1, cutoff=0.6)
        if not close:
            return None
        guess = "/".join([*at, close[0], *parts[i + 1 :]])
        return guess if select(node, [guess]) is not None else "/".join([*at, close[0]])
    return None


def close_matches(word: str, names: list[str], *, n: int, cutoff: float) -> list[str]:
    """``difflib.get_close_matches``, imported when a message needs it (not by ``import
    savepoint``)."""
    import difflib

    return difflib.get_close_matches(word, names, n=n, cutoff=cutoff)
