"""Writing a manifest: :func:`dump` and :func:`dumps`.

The text is made in pieces (:func:`_pieces`: one top-level member per line, each value compact;
the ``tensors`` member a few thousand entries at a time, big containers of the tree a few
thousand items at a time), each hashed, appended and counted against the reader's limits as it
comes, so a manifest of a million tensors exists once, whole, and never as a second copy.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from savepoint.codecs import bounded_json as _json
from savepoint.codecs import boxes, checksum
from savepoint.codecs.manifest import _records
from savepoint.codecs.manifest._records import (
    BLOBS,
    CAP,
    FORMAT,
    GRID,
    PIECE_ENTRIES,
    Manifest,
    ShardRecord,
    TensorRecord,
    TensorTable,
    encode_string,
)
from savepoint.errors import UnsupportedStateError


def shard_json(s: ShardRecord) -> dict[str, Any]:
    out: dict[str, Any] = (
        {"xxh3": s.xxh3}
        if s.recipe is not None
        else {"file": s.file, "offsets": [s.start, s.end], "xxh3": s.xxh3}
    )
    if isinstance(s.region, boxes.Flat):
        out["flat"] = [s.region.start, s.region.stop]
    else:
        out["box"] = [list(b) for b in s.region]
    if s.recipe is not None:
        out["blobs"] = s.recipe.to_json()  # its checks are the blocks
    elif s.block:
        out["blocks"] = {"size": s.block, "xxh3": list(s.blocks)}
    return out


def _v4_json(t: TensorRecord) -> dict[str, Any]:
    if t.recipe is None:
        algorithm, _, value = t.xxh3.rpartition(":")  # a tagged digest (version 6): "mlh64:..."
        return {
            "dtype": t.dtype,
            "shape": list(t.shape),
            "file": t.file,
            "offsets": [t.start, t.end],
            algorithm or "xxh3": value,
        }
    return {"dtype": t.dtype, "shape": list(t.shape), "xxh3": t.xxh3, "blobs": t.recipe.to_json()}


def dumps(m: Manifest) -> bytes:
    """The manifest's bytes. Raises UnsupportedStateError when readers would refuse them: larger
    than ``MAX_MANIFEST_BYTES``, nested deeper than the JSON reader's depth cap, or denser than
    its memory bound allows (see :mod:`savepoint.codecs.bounded_json`); a checkpoint that cannot be
    loaded is never written. See :func:`dump` for the same bytes in a ``bytearray``."""
    return bytes(dump(m))


def dump(m: Manifest, tree: Iterable[tuple[bytes, int]] | None = None) -> bytearray:
    """:func:`dumps`, as a ``bytearray`` built in place.

    The text is made in pieces of at most a few MB (the ``tensors`` member entry by entry, big
    containers of the tree a few thousand items at a time), each hashed, checked and appended
    as it comes, so the manifest exists once, whole, and never as a second copy: a
    1,000,000-tensor manifest is about 220 MB, and each whole intermediate copy of it (the text,
    its encoding, the pieces and their join) cost that much memory again. The reader's limits
    are checked piece by piece with the first pass of :func:`savepoint.codecs.bounded_json.check`
    (its counts add up over pieces; where they cannot clear the text, the whole is checked).

    ``tree``: the ``tree`` member's pieces as :func:`tree_pieces` made them (then ``m.tree`` is
    not read): a caller can keep them compressed and drop its tree before the manifest is
    built."""
    raw = bytearray()
    hasher = checksum.new()
    counter = _Counter()
    try:
        for piece, level in _pieces(m, tree):
            hasher.update(piece)
            raw += piece
            counter.add(piece, level)
            if len(raw) > _records.MAX_MANIFEST_BYTES:
                raise UnsupportedStateError(
                    f"the manifest would be over {len(raw)} bytes, over the {CAP} cap readers "
                    "enforce; split the state over several checkpoints"
                )
    except RecursionError:
        raise UnsupportedStateError(
            f"the state is nested too deeply to store (readers accept {_json.MAX_DEPTH} levels "
            "of JSON nesting in a manifest)"
        ) from None
    except ValueError as exc:  # an integer too long to write (over 4300 digits)
        raise UnsupportedStateError(f"the state holds a value JSON cannot store: {exc}") from None
    trailer = f',\n "manifest_xxh3": "{checksum.hexdigest(hasher)}"\n}}\n'.encode("ascii")
    raw += trailer
    counter.add(trailer, 1)
    if len(raw) > _records.MAX_MANIFEST_BYTES:
        raise UnsupportedStateError(
            f"the manifest would be {len(raw)} bytes, over the {CAP} cap readers enforce; "
            "split the state over several checkpoints"
        )
    if not counter.clears(len(raw), raw):
        try:
            _json.check(bytes(raw))  # rare: a copy, as the whole text was always checked
        except _json.StrictJSONError as exc:
            raise UnsupportedStateError(
                f"readers would refuse this manifest ({exc}); store long runs of plain values as "
                "arrays, and keep nesting shallower"
            ) from None
    return raw


class _Counter:
    """The first pass of the reader's bound (``bounded_json.quick_counts``), summed over pieces
    that each hold whole strings. Per piece it charges one scalar more than the whole text would
    and a separator ending a piece as a scalar, so the sum never undercharges; a piece with a
    ``\\u`` escape (wider strings than the text) makes the whole text be checked instead.

    Consecutive pieces are counted together, up to :data:`_BATCH` bytes at a time (the text of
    contiguous pieces is one piece, starting at the first one's level): a small manifest is a
    few dozen pieces, and counting each cost 2-3 ms of a 1 MB save in fixed NumPy overheads."""

    def __init__(self) -> None:
        self.depth = 0
        self.cost = 0
        self.exact = True
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self._level = 0

    def add(self, piece: bytes, level: int) -> None:
        if not self.exact:
            return
        if b"\\u" in piece:
            self.exact = False
            self._pending.clear()
            return
        if not self._pending:
            self._level = level
        self._pending.append(piece)
        self._pending_bytes += len(piece)
        if self._pending_bytes >= _BATCH:
            self._count()

    def _count(self) -> None:
        if not self._pending:
            return
        text = self._pending[0] if len(self._pending) == 1 else b"".join(self._pending)
        self._pending.clear()
        self._pending_bytes = 0
        depth, cost, _ = _json.quick_counts(text, 1)
        self.depth = max(self.depth, self._level + depth)
        self.cost += cost

    def clears(self, size: int, text: bytes | bytearray | None = None) -> bool:
        if text is not None and _small_clears(text):
            return True  # (its fixed NumPy costs were a tenth of a 1 MB save)
        self._count()
        budget = int(_json.MEMORY_FACTOR * size + _json.MEMORY_SLACK)
        return self.exact and self.depth <= _json.MAX_DEPTH and self.cost <= budget


_BATCH = 1 << 20  # bytes of manifest text counted at a time

# Whatever its bytes, a text this short costs a reader less than its memory bound: the counts
# charge each byte at most 1 + width + content (<= 9) plus, for a structural byte, the most any
# one of them costs with its slot and a following scalar (an object's '{': 280 + 9 + 32 < 360),
# against a budget of MEMORY_FACTOR * size + MEMORY_SLACK.
_SMALL_TEXT = (_json.MEMORY_SLACK - 1024) // (9 + 360)


def _small_clears(text: bytes | bytearray) -> bool:
    """Whether ``text`` clears the reader's bounds without counting: short enough (above), and
    with fewer opening brackets (counting those inside strings) than the depth cap."""
    return len(text) <= _SMALL_TEXT and text.count(b"{") + text.count(b"[") <= _json.MAX_DEPTH


def tree_pieces(root: dict[str, Any]) -> Iterator[tuple[bytes, int]]:
    """The ``tree`` member of a manifest holding ``root``, in pieces (see :func:`dump`)."""
    return _node_pieces(root, 1)


TRAILER_BYTES = len(',\n "manifest_xxh3": "0123456789abcdef"\n}\n')


def _pieces(
    m: Manifest, tree: Iterable[tuple[bytes, int]] | None = None
) -> Iterator[tuple[bytes, int]]:
    """The manifest's text before its trailer, as (piece, nesting depth where it starts)."""
    body: dict[str, Any] = {
        "format": FORMAT,
        "format_version": m.format_version,
        "writer": m.writer,
        "created": m.created,
        "checksum": checksum.ALGORITHM,
    }
    tensors: Any
    if m.has_blobs:
        body["blob_store"] = m.blob_store
        body["blob_digest"] = m.blob_digest
    if m.format_version >= GRID:
        assert m.mesh is not None and m.indices is not None and m.grids is not None
        body["world_size"] = m.world_size
        body["mesh"] = list(m.mesh)
        tensors = {
            name: {"dtype": t.dtype, "shape": list(t.shape), "grid": list(m.grids[name])}
            for name, t in m.tensors.items()
        }
    elif m.format_version >= BLOBS and not m.sharded:
        tensors = {name: _v4_json(t) for name, t in m.tensors.items()}
    elif m.sharded:
        body["world_size"] = m.world_size
        tensors = {
            name: {
                "dtype": t.dtype,
                "shape": list(t.shape),
                "shards": [shard_json(s) for s in t.layout()],
            }
            for name, t in m.tensors.items()
        }
    elif isinstance(m.tensors, TensorTable):
        tensors = m.tensors
    else:
        tensors = _V1Tensors(m.tensors)
    body["metadata"] = m.metadata
    body["files"] = {
        name: {"size": f.size, "header_size": f.header_size, "header_xxh3": f.header_xxh3}
        for name, f in m.files.items()
    }
    if m.format_version >= GRID:
        assert m.indices is not None
        body["indices"] = {
            name: {"size": r.size, "xxh3": r.xxh3} for name, r in sorted(m.indices.items())
        }
    body["tensors"] = tensors
    body["tree"] = m.tree
    # One top-level member per line, each value compact: readable with `head`, small for big trees.
    for i, (k, v) in enumerate(body.items()):
        yield f"{',' if i else '{'}\n {json.dumps(k)}: ".encode("ascii"), min(i, 1)
        if isinstance(v, (_V1Tensors, TensorTable)):
            for j, piece in enumerate(v.pieces()):
                yield piece, 1 if j == 0 else 2
        elif k == "tree" and tree is not None:
            yield from tree
        elif k == "tree":
            yield from _node_pieces(v, 1)
        else:
            yield _compact(v).encode("ascii"), 1


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


_TREE_PIECE = 4096  # items of the tree encoded per piece (with their children, one level down)


def _weight(node: Any) -> int:
    """Items a tree node holds one level down (through Stateful wrappers)."""
    while type(node) is dict and node.get("t") == "stateful":
        node = node.get("state")
    items = node.get("items") if type(node) is dict else None
    return len(items) if type(items) is list else 0


def _node_pieces(node: Any, level: int) -> Iterator[tuple[bytes, int]]:
    """``_compact(node)`` in pieces, starting at nesting ``level``: containers of more than
    ``_TREE_PIECE`` items a batch of items at a time (byte for byte the same text)."""
    if _weight(node) <= _TREE_PIECE or type(node) is not dict:
        yield _compact(node).encode("ascii"), level
        return
    t = node.get("t")
    if t == "stateful" and list(node) == ["t", "type", "state"]:
        yield f'{{"t":"stateful","type":{_compact(node["type"])},"state":'.encode("ascii"), level
        yield from _node_pieces(node["state"], level + 1)
        yield b"}", level + 1
        return
    if t not in ("dict", "list", "tuple") or list(node) != ["t", "items"]:
        yield _compact(node).encode("ascii"), level
        return
    yield f'{{"t":{_compact(t)},"items":['.encode("ascii"), level
    inner = level + 2  # inside the node's object and its items array
    pairs = t == "dict"
    batch: list[Any] = []
    weight = 0
    first = True
    for item in node["items"]:
        child = item[1] if pairs and type(item) is list and len(item) == 2 else item
        # A leaf holds nothing below it (most of a big tree): no call to ask.
        w = (
            0
            if type(child) is dict and "items" not in child and "state" not in child
            else _weight(child)
        )
        if w > _TREE_PIECE:
            if batch:
                yield _batch(batch, first), inner
                first, batch, weight = False, [], 0
            comma = "" if first else ","
            if child is item:
                if comma:
                    yield b",", inner
                yield from _node_pieces(child, inner)
            else:
                yield f"{comma}[{_compact(item[0])},".encode("ascii"), inner
                yield from _node_pieces(child, inner + 1)
                yield b"]", inner + 1
            first = False
            continue
        batch.append(item)
        weight += 1 + w
        if weight >= _TREE_PIECE:
            yield _batch(batch, first), inner
            first, batch, weight = False, [], 0
    if batch:
        yield _batch(batch, first), inner
    yield b"]}", inner


def _batch(items: list[Any], first: bool) -> bytes:
    """Items of a JSON array, as they appear inside it (a comma first unless ``first``)."""
    text = _compact(items)[1:-1]
    return (text if first else "," + text).encode("ascii")


class _V1Tensors:
    """The ``tensors`` member of an unsharded manifest, written as compact ASCII JSON: byte for
    byte what ``json.dumps`` gives for the dict of entries (``tests/formats/test_scale_paths.py``
    holds them equal), written entry by entry with the same string encoder, in pieces of
    :data:`PIECE_ENTRIES` entries. A dict per tensor and the generic encoder cost a
    100,000-tensor save about a second; this costs about a tenth."""

    def __init__(self, tensors: Mapping[str, TensorRecord]) -> None:
        self.tensors = tensors

    def pieces(self) -> list[bytes]:
        shapes: dict[tuple[int, ...], str] = {}
        strings: dict[str, str] = {}  # dtypes and file names repeat
        out: list[bytes] = []
        parts: list[str] = []
        first = True
        for name, t in self.tensors.items():
            shape = shapes.get(t.shape)
            if shape is None:
                shape = shapes[t.shape] = json.dumps(list(t.shape), separators=(",", ":"))
            dtype = strings.get(t.dtype)
            if dtype is None:
                dtype = strings[t.dtype] = encode_string(t.dtype)
            file = strings.get(t.file)
            if file is None:
                file = strings[t.file] = encode_string(t.file)
            offsets = (
                f"{t.start},{t.end}"
                if type(t.start) is int and type(t.end) is int
                else json.dumps([t.start, t.end], separators=(",", ":"))[
                    1:-1
                ]  # as json.dumps would
            )
            parts.append(
                f'{"{" if first else ","}{encode_string(name)}:{{"dtype":{dtype},"shape":{shape},'
                f'"file":{file},"offsets":[{offsets}],"xxh3":{encode_string(t.xxh3)}}}'
            )
            first = False
            if len(parts) == PIECE_ENTRIES:
                out.append("".join(parts).encode("ascii"))
                parts.clear()
        parts.append("{}" if first else "}")
        out.append("".join(parts).encode("ascii"))
        return out
