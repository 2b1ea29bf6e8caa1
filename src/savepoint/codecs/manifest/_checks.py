"""The checks every version's decoder shares: values (sizes, digests, shapes), byte ranges in the
data files, and the ``tree`` member (:func:`check_tree`).

A check that fails raises :class:`~savepoint.codecs.manifest.ManifestError` naming what is wrong
(:func:`require`); hostile values are shown shortened (:func:`show`).
"""

from __future__ import annotations

import base64
import binascii
import math
import operator
import re
from collections.abc import Mapping
from typing import Any

from savepoint.codecs import bounded_json as _json
from savepoint.codecs import dtypes
from savepoint.codecs.manifest._records import FileRecord, ManifestError, TensorRecord, TensorTable

FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")  # a data file's name
ITEMSIZE = {name: d.itemsize for name, d in dtypes.BY_NAME.items()}
MAX_OFFSET = 1 << 63
MIN_BLOCK = 1 << 10  # the smallest block of block checksums, and blob chunk
INT_ONLY = frozenset((int,))
STR_ONLY = frozenset((str,))
DICT_ONLY = frozenset((dict,))
LIST_ONLY = frozenset((list,))
PAIR_ONLY = frozenset((2,))
_DIGEST = re.compile(r"[0-9a-f]{16}")
_THREE = frozenset((3,))
_TENSOR_ONLY = frozenset(("tensor",))
_KEY_TYPES = frozenset((str, int))
_LEAF_FIELDS = operator.itemgetter("t", "ref", "kind")


def natural(x: Any) -> bool:
    """A JSON integer >= 0 of any size (not a bool, not a float such as ``2.0``); dimensions are
    bounded by :func:`dtype_and_shape`, box and flat bounds by the shape."""
    return type(x) is int and x >= 0


def offset(x: Any) -> bool:
    """A byte size or offset: a JSON integer in ``[0, 2**63)`` (what file APIs take)."""
    return type(x) is int and 0 <= x < MAX_OFFSET


def is_digest(x: Any) -> bool:
    return type(x) is str and _DIGEST.fullmatch(x) is not None


def show(x: Any) -> str:
    """``repr(x)``, shortened: hostile numbers can have thousands of digits."""
    text = repr(x)
    return text if len(text) <= 60 else f"{text[:40]}...({len(text)} characters)"


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ManifestError(message)


def dtype_and_shape(name: str, t: dict[str, Any]) -> tuple[tuple[int, ...], int]:
    """The checked shape (a tuple) and the dtype's itemsize of an entry with those members."""
    dtype = t["dtype"]
    itemsize = ITEMSIZE.get(dtype) if type(dtype) is str else None
    require(itemsize is not None, f"tensor {name!r}: unknown dtype {show(dtype)}")
    assert itemsize is not None
    shape = t["shape"]
    require(
        type(shape) is list and len(shape) <= 64 and all(map(natural, shape)),
        f"tensor {name!r}: shape must be a list of at most 64 non-negative integers",
    )
    # Zero-element shapes pass any byte-count check; keep their other dimensions allocatable.
    # (Bounding each dimension first keeps the product of hostile ones cheap.)
    require(
        max(shape, default=0) < 2**62 and math.prod([d or 1 for d in shape]) * itemsize < 2**62,
        f"tensor {name!r}: shape {show(shape)} is too large",
    )
    return tuple(shape), itemsize


def byte_range(what: str, t: dict[str, Any], files: dict[str, FileRecord]) -> tuple[int, int]:
    """The checked ``offsets`` of an entry whose ``file`` and ``offsets`` members exist."""
    file = t["file"]
    record = files.get(file) if type(file) is str else None
    require(record is not None, f"{what}: refers to unknown file {show(file)}")
    assert record is not None
    offsets = t["offsets"]
    require(
        type(offsets) is list and len(offsets) == 2 and all(map(offset, offsets)),
        f"{what}: offsets must be two integers in [0, 2**63), got {show(offsets)}",
    )
    start, end = offsets
    require(
        record.header_size <= start <= end <= record.size,
        f"{what}: byte range {start}..{end} lies outside the data of {file!r}",
    )
    return start, end


_KINDS = {"numpy", "numpy_scalar", "torch"}


def check_tree(root: Any, records: Mapping[str, TensorRecord]) -> int:
    """Check every node of the tree, depth first (iteratively: any depth).

    Tensor leaves and dict nodes, nearly all of a big tree, are checked inline with set
    operations over each dict's items; any node those checks do not clear goes through
    :func:`check_node`, which raises naming the problem (or accepts a node of another type)."""
    # The names, as a dict (a table's rows): membership and set tests at C speed.
    tensors: Mapping[str, Any] = records.rows() if isinstance(records, TensorTable) else records
    stack = [root]
    pop, extend = stack.pop, stack.extend
    kinds = _KINDS
    lists, pairs, key_types = LIST_ONLY, PAIR_ONLY, _KEY_TYPES
    first, second = operator.itemgetter(0), operator.itemgetter(1)
    members = 0
    while stack:
        node = pop()
        if type(node) is dict:
            t = node.get("t")
            if t == "tensor":
                ref, kind = node.get("ref"), node.get("kind")
                if (
                    len(node) == 3
                    and type(ref) is str
                    and ref in tensors
                    and type(kind) is str
                    and kind in kinds
                ):
                    members += 3
                    continue
            elif t == "dict":
                items = node.get("items")
                if (
                    len(node) == 2
                    and type(items) is list
                    and lists.issuperset(map(type, items))
                    and pairs.issuperset(map(len, items))
                ):
                    keys = list(map(first, items))
                    if key_types.issuperset(map(type, keys)) and len(set(keys)) == len(keys):
                        children = list(map(second, items))
                        members += 2
                        if _tensor_leaves(children, tensors):
                            members += 3 * len(children)
                        else:
                            extend(children)
                        continue
        members += check_node(node, tensors, stack)
    return members


def _tensor_leaves(children: list[Any], tensors: Mapping[str, Any]) -> bool:
    """Whether every node of ``children`` is a valid tensor leaf (``{"t": "tensor", "ref":
    <a tensor's name>, "kind": <a kind>}``), checked together: the many leaves of a big state
    cost a few set operations instead of a pass of the node loop each."""
    if len(children) < 8 or set(map(type, children)) != DICT_ONLY:
        return False
    if set(map(len, children)) != _THREE:
        return False
    try:
        # Three members, "t", "ref" and "kind" among them: exactly those.
        ts, refs, kinds = zip(*map(_LEAF_FIELDS, children))
        return (
            set(ts) == _TENSOR_ONLY
            and set(map(type, refs)) == STR_ONLY
            and set(map(type, kinds)) == STR_ONLY
            and set(kinds) <= _KINDS
            and set(refs) <= tensors.keys()
        )
    except (KeyError, TypeError):  # a member missing, an unhashable value: the node loop says
        return False


def check_node(node: Any, tensors: Mapping[str, Any], stack: list[Any]) -> int:
    """Check one tree node, pushing its children on ``stack``; returns the members of the
    objects it holds other than its children (for the repeated-key count of :func:`parse`)."""
    require(type(node) is dict and type(node.get("t")) is str, "tree: malformed node")
    t = node["t"]
    members = len(node)
    for key, value in node.items():
        if key not in _NODE_MEMBERS.get(t, ()):
            members += _json.members(value)  # a member readers ignore: count what it holds
    if t == "dict":
        items = node.get("items")
        require(type(items) is list, "tree: dict node without items")
        seen: set[tuple[type, Any]] = set()
        for item in items:
            require(type(item) is list and len(item) == 2, "tree: malformed dict item")
            k = item[0]
            require(
                type(k) is str or type(k) is int,
                f"tree: dict key {show(k)} is not a string or integer",
            )
            require((type(k), k) not in seen, f"tree: duplicate dict key {show(k)}")
            seen.add((type(k), k))
            stack.append(item[1])
    elif t in ("list", "tuple"):
        require(type(node.get("items")) is list, f"tree: {t} node without items")
        stack.extend(node["items"])
    elif t == "tensor":
        ref, kind = node.get("ref"), node.get("kind")
        require(
            type(ref) is str and ref in tensors,
            f"tree: reference to unknown tensor {show(ref)}",
        )
        require(type(kind) is str and kind in _KINDS, f"tree: unknown tensor kind {show(kind)}")
    elif t == "stateful":
        require(type(node.get("type")) is str, "tree: stateful node without a type")
        stack.append(node.get("state"))
    elif t == "value":
        # Floats are finite: the reader refuses 1e400, NaN and Infinity (those are "float").
        v = node.get("v", ...)
        require(v is None or type(v) in (bool, int, float, str), "tree: value is not a scalar")
    elif t == "float":
        require(node.get("v") in ("nan", "inf", "-inf"), "tree: bad special float")
    elif t == "bytes":
        require(type(node.get("v")) is str, "tree: bytes node without base64 text")
        try:
            base64.b64decode(node["v"], validate=True)
        except (binascii.Error, ValueError):
            raise ManifestError("tree: bytes node holds invalid base64") from None
    else:
        raise ManifestError(f"tree: unknown node type {show(t)}")
    return members


# The members each node type's check looks at (children are checked as nodes themselves).
_NODE_MEMBERS = {
    "dict": ("t", "items"),
    "list": ("t", "items"),
    "tuple": ("t", "items"),
    "tensor": ("t", "ref", "kind"),
    "stateful": ("t", "type", "state"),
    "value": ("t", "v"),
    "float": ("t", "v"),
    "bytes": ("t", "v"),
}
