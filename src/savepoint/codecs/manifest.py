"""``manifest.json``: the record that makes a directory a checkpoint.

A UTF-8 JSON object (ASCII in practice: non-ASCII is escaped)::

    {
     "format": "savepoint",
     "format_version": 1,
     "writer": "savepoint 0.1.0",
     "created": "2026-11-21T07:30:00.123456Z",
     "checksum": "xxh3-64",
     "metadata": {...},                      # the caller's JSON metadata, verbatim
     "files": {"data-00000.safetensors": {"size": 4096, "header_size": 128, "header_xxh3": "..."}},
     "tensors": {"model/w": {"dtype": "F32", "shape": [2, 3], "file": "data-00000.safetensors",
                             "offsets": [128, 152], "xxh3": "..."}},
     "tree": {...},                          # structure, see savepoint.state.tree
     "manifest_xxh3": "0123456789abcdef"
    }

``offsets`` are absolute byte positions in the data file; ``header_size`` counts the 8-byte length
prefix and the header JSON. The last member is always ``manifest_xxh3``, written as the exact bytes
``,\\n "manifest_xxh3": "<16 hex>"\\n}\\n`` at the end of the file; it is the XXH3-64 of every byte
before that trailer, so a flipped bit anywhere in the manifest is detected.

Version 2: sharded checkpoints (written by ``save(..., process_group=...)``, one set of data files
per rank). Unsharded checkpoints are still written as version 1, byte for byte as before. A version 2
manifest has one more top-level member after ``checksum``, ``"world_size": 4`` (how many ranks
saved it), and each tensor entry gives the global ``dtype`` and ``shape`` and where its pieces are::

     "tensors": {"model/w": {"dtype": "F32", "shape": [4, 6], "shards": [
         {"file": "data-r00000-00000.safetensors", "offsets": [128, 176], "xxh3": "...",
          "box": [[0, 2], [0, 6]]},
         {"file": "data-r00001-00000.safetensors", "offsets": [128, 176], "xxh3": "...",
          "box": [[2, 4], [0, 6]]}]}}

A shard holds either a ``box`` (``[start, stop)`` on every dimension, stored contiguously in C order
with shape ``stop - start``: tensor-parallel pieces, replicated tensors as the full box, ``[]`` for
a 0-d tensor) or a ``flat`` range ``[start, stop)`` of the tensor flattened in C order (stored as a
1-D run: FSDP-style flat shards). See :mod:`savepoint.codecs.boxes`. Rules checked by the parser:
every box lies inside the shape and has one ``[start, stop]`` per dimension; a tensor's shards are
all boxes or all flat ranges, none empty (a tensor without elements has exactly one shard), no two
share an element and together they hold every element; each shard's byte count is its element count
times the dtype's itemsize and lies inside the data of its file. In the data file the shard is an
ordinary safetensors tensor with the shard's own shape (box extents, or ``[stop - start]``) under a
name unique in that file (the tensor's key, plus ``@`` and the shard's start for partial shards).

Version 3 (what sharded saves write now; version 2 is still read): a version 2 manifest whose
shards (and whole-stored tensors) larger than 128 KiB may carry per-block checksums, so a rank
that needs part of a shard reads and checks only the blocks holding it::

         {"file": "data-r00000-00000.safetensors", "offsets": [128, 4194432], "xxh3": "...",
          "flat": [0, 1048576], "blocks": {"size": 65536, "xxh3": ["...", "...", ...]}}

``size`` is a power of two (at least 1 KiB); there are ``ceil(bytes / size)`` digests (at least
two), block ``i`` covering bytes ``[i * size, (i + 1) * size)`` of the shard; and the shard's
``xxh3`` is then :func:`savepoint.codecs.checksum.combine` of them (the parser checks that), not
the hash of the bytes. See :mod:`savepoint.codecs.checksum` for the writer's block sizes.

Version 4 (what an incremental save, ``save(..., blobs=...)``, writes; other saves still write
versions 1-3): an unsharded manifest whose tensors may live in a content-addressed blob store
(:mod:`savepoint.blobs`) instead of the data files. Two top-level members follow ``checksum``:
``"blob_store": "../blobs"`` (the store's directory relative to the checkpoint's: plain names,
after at most two leading ``..``; never absolute, never a URL, never further out) and
``"blob_digest": "blake3"`` (the store's digest). A tensor entry is then either a version 1 entry
or one naming a :class:`savepoint.blobs.Recipe` instead of ``file`` and ``offsets``::

     "tensors": {"model/w": {"dtype": "F32", "shape": [1024, 1024], "xxh3": "...",
                             "blobs": {"digest": "blake3", "size": 4194304, "chunk": 4194304,
                                       "blobs": ["<64 hex>"], "xxh3": ["<16 hex>"]}}}

The parser checks the recipe completely (:meth:`savepoint.blobs.Recipe.from_json`), that its
``size`` is the tensor's shape x itemsize, its digest the store's, its chunk a power of two, and
that ``xxh3`` is :meth:`savepoint.blobs.Recipe.checksum` of it (the per-chunk checks are block
checksums with the chunk as block), before anything is allocated.

A sharded incremental save (``save(..., blobs=..., process_group=...)``) writes version 4 with a
``world_size`` member too (after ``blob_digest``); every tensor entry is then a version 3 one
(``dtype``, ``shape``, ``shards``), and a shard may name a recipe instead of a file range::

         {"xxh3": "...", "box": [[0, 512], [0, 1024]], "blobs": {"digest": "blake3", ...}}

with the same checks as a tensor's recipe (its ``size`` is the shard's element count x
itemsize), and the rules of version 3 for the regions (they tile the tensor). Such a shard's
block checksums are the recipe's per-chunk checks: a rank needing part of it reads and checks
only the chunks holding that part.

Version 5 (an incremental save whose recipes carry row patches, :mod:`savepoint.blobs.patch`):
version 4, and a recipe may name ``patches`` (see :class:`savepoint.codecs.recipe.Recipe`).

Version 6 (an async save of a state on a GPU, whose tensors were hashed on the device while they
were staged): an unsharded manifest whose tensor entries are version 1 entries, each with either
``"xxh3"`` or, in its place, ``"mlh64": "<16 hex>"`` (:mod:`savepoint.codecs.devhash`: a
multilinear hash a GPU computes at memory speed and the host computes identically)::

     "tensors": {"model/w": {"dtype": "BF16", "shape": [4096, 4096],
                             "file": "data-00000.safetensors", "offsets": [128, 33554560],
                             "mlh64": "0123456789abcdef"}}

The ``blob_store`` and ``blob_digest`` members are optional from version 6 (present together,
for a version 4 entry set). Readers check each tensor with the algorithm its entry names. Saves
that hash nothing on a device still write versions 1-5, byte for byte as before.

Compatibility: readers accept every ``format_version`` up to their own and refuse newer ones with
an IncompatibleCheckpointError. Version 1 is the first; version 2 adds sharding; version 3 adds
block checksums; version 4 adds blobs; version 5 patches; version 6 device checksums.

A manifest is hostile input: :func:`parse` checks it completely (file names that could leave the
directory, ranges past the recorded file sizes, sizes that disagree with shape x dtype, unknown
tree nodes, dangling references, duplicate JSON keys) before any data file is opened. Its JSON is
read by the bounded reader of :mod:`savepoint.codecs.bounded_json`: at most 512 levels of nesting, and
peak memory at most 24 x the manifest's size + 32 MiB (a real manifest takes about 6.5 x); numbers
are JSON integers where integers belong (no bool, no ``2.0``; sizes and offsets below 2**63,
dimensions below 2**62), and floats are finite (``1e400``, NaN and Infinity are refused).

``MAX_MANIFEST_BYTES`` stays 1 GiB: a 1,000,000-tensor unsharded manifest is about 250 MB, but
sharded ones grow with the shards (about 140 bytes each: a 91,000-tensor model saved 64-way
flat-sharded writes about 815 MB), and the memory a manifest can cost is bounded by its size.
:func:`dumps` refuses (UnsupportedStateError) any manifest a reader would refuse: over the cap,
too deep, or too dense, so a checkpoint that cannot be loaded is never written.
"""

from __future__ import annotations

import base64
import binascii
import itertools
import json
import math
import operator
import re
import threading
import zlib
from array import array
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from json.encoder import encode_basestring_ascii
from typing import Any

from savepoint.codecs import bounded_json as _json
from savepoint.codecs import boxes, checksum, dtypes
from savepoint.codecs import recipe as _recipe
from savepoint.errors import (
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    UnsupportedStateError,
)

__all__ = [
    "BLOBS",
    "BLOCKED",
    "DEVICE_CHECKS",
    "FORMAT",
    "FileRecord",
    "MAX_MANIFEST_BYTES",
    "MAX_UP",
    "Manifest",
    "ManifestError",
    "ManifestVersionError",
    "NAME",
    "PATCHES",
    "SHARDED",
    "ShardRecord",
    "TRAILER_BYTES",
    "TensorRecord",
    "TensorTable",
    "UNSHARDED",
    "VERSION",
    "check_blob_store",
    "dump",
    "dumps",
    "parse",
    "recipes",
    "shard_name",
    "shard_shape",
    "tree_pieces",
    "whole",
]

FORMAT = "savepoint"
UNSHARDED = 1  # what an unsharded checkpoint is written as
SHARDED = 2  # the first version with sharding
BLOCKED = 3  # the first version with block checksums: what a sharded checkpoint is written as
BLOBS = 4  # the first version with tensors in a blob store: what an incremental save writes
PATCHES = 5  # the first version with patched blob recipes (savepoint.blobs.patch)
DEVICE_CHECKS = 6  # the first version with mlh64 tensor checksums (savepoint.codecs.devhash)
VERSION = DEVICE_CHECKS  # the newest version this reader reads
NAME = "manifest.json"
MAX_MANIFEST_BYTES = 1 << 30
_FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")
_TRAILER = re.compile(rb',\n "manifest_xxh3": "([0-9a-f]{16})"\n}\n\Z')


@dataclass(frozen=True)
class FileRecord:
    size: int
    header_size: int
    header_xxh3: str


@dataclass(frozen=True)
class ShardRecord:
    """One stored piece of a tensor: ``region`` of it, at bytes ``[start, end)`` of ``file``."""

    file: str
    start: int
    end: int
    xxh3: str
    region: boxes.Region
    block: int = 0  # block size of ``blocks`` (0: checked whole against ``xxh3``)
    blocks: tuple[str, ...] = ()
    # Version 4: the shard's bytes are these blobs (a savepoint.blobs.Recipe); ``file`` is then
    # empty, ``start`` 0, ``end`` its byte count, and ``block``/``blocks`` the recipe's checks.
    recipe: Any = None

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class TensorRecord:
    """A tensor. Stored whole (version 1, or a version 2 tensor with one shard): ``file``,
    ``start``, ``end`` and ``xxh3`` locate its bytes. Split over several shards (version 2):
    ``file`` is empty and ``shards`` says where each piece is."""

    dtype: str
    shape: tuple[int, ...]
    file: str
    start: int
    end: int
    xxh3: str
    shards: tuple[ShardRecord, ...] = ()
    block: int = 0  # as ShardRecord's, for a tensor stored whole
    blocks: tuple[str, ...] = ()
    # Version 4: the tensor's bytes are these blobs (a savepoint.blobs.Recipe); ``file`` is then
    # empty, ``start`` 0 and ``end`` its byte count.
    recipe: Any = None

    @classmethod
    def plain(
        cls, dtype: str, shape: tuple[int, ...], file: str, start: int, end: int, xxh3: str
    ) -> TensorRecord:
        """``TensorRecord(dtype, shape, file, start, end, xxh3)``: a tensor stored whole, with
        no shards and no block checksums, its slots set directly (the frozen dataclass
        ``__init__`` goes through ``object.__setattr__`` field by field: 2.5 times the cost, paid
        per tensor when a manifest of many is read)."""
        record = _new_object(cls)
        _SET_DTYPE(record, dtype)
        _SET_SHAPE(record, shape)
        _SET_FILE(record, file)
        _SET_START(record, start)
        _SET_END(record, end)
        _SET_XXH3(record, xxh3)
        _SET_SHARDS(record, ())
        _SET_BLOCK(record, 0)
        _SET_BLOCKS(record, ())
        _SET_RECIPE(record, None)
        return record

    @property
    def is_split(self) -> bool:
        return len(self.shards) > 1

    @property
    def nbytes(self) -> int:
        if self.is_split:
            return math.prod(self.shape) * dtypes.BY_NAME[self.dtype].itemsize
        return self.end - self.start

    def layout(self) -> tuple[ShardRecord, ...]:
        """Its shards; a tensor stored whole is one shard holding the full box."""
        if self.shards:
            return self.shards
        return (
            ShardRecord(
                self.file,
                self.start,
                self.end,
                self.xxh3,
                boxes.full(self.shape),
                self.block,
                self.blocks,
            ),
        )


# The slot setters of TensorRecord (a frozen dataclass refuses ``setattr``; its slots do not).
_new_object = object.__new__
(
    _SET_DTYPE,
    _SET_SHAPE,
    _SET_FILE,
    _SET_START,
    _SET_END,
    _SET_XXH3,
    _SET_SHARDS,
    _SET_BLOCK,
    _SET_BLOCKS,
    _SET_RECIPE,
) = (
    TensorRecord.__dict__[name].__set__
    for name in (
        "dtype",
        "shape",
        "file",
        "start",
        "end",
        "xxh3",
        "shards",
        "block",
        "blocks",
        "recipe",
    )
)


def whole(dtype: str, shape: tuple[int, ...], shards: tuple[ShardRecord, ...]) -> TensorRecord:
    """The record of a sharded tensor (see :class:`TensorRecord`): one shard is a tensor stored
    whole (in a file, or as blobs)."""
    if len(shards) == 1:
        s = shards[0]
        return TensorRecord(
            dtype, shape, s.file, s.start, s.end, s.xxh3, shards, s.block, s.blocks, s.recipe
        )
    return TensorRecord(dtype, shape, "", 0, 0, "", shards)


def recipes(manifest: Manifest) -> Iterator[Any]:
    """Every blob recipe a (version 4) manifest names: its tensors' and its shards'."""
    for rec in manifest.tensors.values():
        if len(rec.shards) > 1:
            for s in rec.shards:
                if s.recipe is not None:
                    yield s.recipe
        elif rec.recipe is not None:
            yield rec.recipe


def shard_name(key: str, region: boxes.Region, shape: tuple[int, ...]) -> str:
    """The safetensors name of a shard in its data file (see the module docstring)."""
    if boxes.is_full(region, shape):
        return key
    if isinstance(region, boxes.Flat):
        return f"{key}@{region.start}"
    return f"{key}@" + ",".join(str(start) for start, _ in region)


def shard_shape(region: boxes.Region) -> tuple[int, ...]:
    """The shape a shard is stored with in its data file."""
    if isinstance(region, boxes.Flat):
        return (region.stop - region.start,)
    return boxes.extents(region)


@dataclass
class Manifest:
    tree: dict[str, Any]
    files: dict[str, FileRecord] = field(default_factory=dict)
    tensors: Mapping[str, TensorRecord] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    writer: str = ""
    created: str = ""
    format_version: int = UNSHARDED
    world_size: int | None = None  # ranks that wrote a sharded (version 2) checkpoint
    blob_store: str | None = None  # version 4: the blob store, relative to the checkpoint
    blob_digest: str | None = None  # version 4: its digest
    # The tree as its manifest text, zlib-compressed, where a save dropped its dicts (``tree``
    # is then empty until :meth:`root` reads it back): a million-tensor tree is about 190 MB
    # of dicts, 75 MB of text and 6 MB compressed.
    tree_packed: bytes | None = field(default=None, repr=False, compare=False)

    @property
    def sharded(self) -> bool:
        """Written by a sharded save: versions 2 and 3, and version 4 with a ``world_size``."""
        if self.format_version >= BLOBS:
            return self.world_size is not None
        return self.format_version >= SHARDED

    @property
    def has_blobs(self) -> bool:
        return self.format_version >= BLOBS and (
            self.format_version < DEVICE_CHECKS or self.blob_store is not None
        )

    def root(self) -> dict[str, Any]:
        """The tree, read back from ``tree_packed`` the first time where a save kept only that."""
        if self.tree_packed is not None:
            self.tree = json.loads(zlib.decompress(self.tree_packed))
            self.tree_packed = None
        return self.tree


class ManifestError(CorruptCheckpointError):
    """The manifest is malformed (a CorruptCheckpointError, so a ValueError too); the reader
    re-raises it with the checkpoint's path."""


class ManifestVersionError(IncompatibleCheckpointError):
    """The manifest is from a newer format version (an IncompatibleCheckpointError, so a
    ValueError too)."""


def _shard_json(s: ShardRecord) -> dict[str, Any]:
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
            if len(raw) > MAX_MANIFEST_BYTES:
                raise UnsupportedStateError(
                    f"the manifest would be over {len(raw)} bytes, over the {_CAP} cap readers "
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
    if len(raw) > MAX_MANIFEST_BYTES:
        raise UnsupportedStateError(
            f"the manifest would be {len(raw)} bytes, over the {_CAP} cap readers enforce; "
            "split the state over several checkpoints"
        )
    if not counter.clears(len(raw)):
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
    ``\\u`` escape (wider strings than the text) makes the whole text be checked instead."""

    def __init__(self) -> None:
        self.depth = 0
        self.cost = 0
        self.exact = True

    def add(self, piece: bytes, level: int) -> None:
        if not self.exact:
            return
        if b"\\u" in piece:
            self.exact = False
            return
        depth, cost, _ = _json.quick_counts(piece, 1)
        self.depth = max(self.depth, level + depth)
        self.cost += cost

    def clears(self, size: int) -> bool:
        budget = int(_json.MEMORY_FACTOR * size + _json.MEMORY_SLACK)
        return self.exact and self.depth <= _json.MAX_DEPTH and self.cost <= budget


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
    if m.format_version >= BLOBS and not m.sharded:
        tensors = {name: _v4_json(t) for name, t in m.tensors.items()}
    elif m.sharded:
        body["world_size"] = m.world_size
        tensors = {
            name: {
                "dtype": t.dtype,
                "shape": list(t.shape),
                "shards": [_shard_json(s) for s in t.layout()],
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


class TensorTable(Mapping[str, "TensorRecord"]):
    """The tensor records of an unsharded save, as columns: a mapping of name to
    :class:`TensorRecord` (made when asked for) holding no object per tensor. A million
    records cost about 40 MB here, where records, their digests as text and the dict holding
    them cost about 300 MB.

    ``names`` are in the state's order; row ``i`` holds ``dtypes[dtype_of[i]]``,
    ``shapes[shape_of[i]]``, ``files[file_of[i]]``, ``starts[i]``, ``ends[i]`` and the XXH3-64
    ``digests[i]`` (an integer). Rows are filled by :meth:`set_row` and by assigning
    ``digests``; :meth:`code` numbers the distinct values of a column (thread-safe)."""

    __slots__ = (
        "_cache",
        "_codes",
        "_index",
        "_lock",
        "digests",
        "dtype_of",
        "dtypes",
        "ends",
        "file_of",
        "files",
        "names",
        "shape_of",
        "shapes",
        "starts",
    )

    def __init__(self, names: list[str], *, cached: bool = False) -> None:
        n = len(names)
        self.names = names
        self.dtypes: list[str] = []
        self.shapes: list[tuple[int, ...]] = []
        self.files: list[str] = []
        self.dtype_of = array("B", bytes(n))  # (fewer than 256 dtypes exist)
        self.shape_of = array("I", bytes(4 * n))
        self.file_of = array("I", bytes(4 * n))
        self.starts = array("q", bytes(8 * n))
        self.ends = array("q", bytes(8 * n))
        self.digests = array("Q", bytes(8 * n))
        self._codes: tuple[dict[Any, int], ...] = ({}, {}, {})
        self._lock = threading.Lock()
        self._index: dict[str, int] | None = None
        # A read manifest's records are asked for again and again by a load: each is made once.
        self._cache: dict[str, TensorRecord] | None = {} if cached else None

    @classmethod
    def from_columns(
        cls,
        names: list[str],
        dtypes: Sequence[str],
        shapes: Sequence[tuple[int, ...]],
        files: Sequence[str],
        starts: Sequence[int],
        ends: Sequence[int],
        digests: Sequence[str],
    ) -> TensorTable:
        """A table of checked columns (a parsed manifest's; ``digests`` as hex), whose records
        are made, once each, when asked for."""
        table = cls([], cached=True)
        table.names = names
        for column, values, codes in (
            (0, dtypes, "dtype_of"),
            (1, shapes, "shape_of"),
            (2, files, "file_of"),
        ):
            found = table._codes[column]
            distinct: list[Any] = (table.dtypes, table.shapes, table.files)[column]
            for value in dict.fromkeys(values):
                found[value] = len(distinct)
                distinct.append(value)
            typecode = "B" if column == 0 else "I"
            setattr(table, codes, array(typecode, map(found.__getitem__, values)))
        table.starts = array("q", starts)
        table.ends = array("q", ends)
        table.digests = array("Q", map(int, digests, itertools.repeat(16)))
        return table

    def code(self, column: int, value: Any) -> int:
        """The number of ``value`` in column 0 (dtypes), 1 (shapes) or 2 (files)."""
        codes = self._codes[column]
        found = codes.get(value)
        if found is None:
            with self._lock:
                found = codes.get(value)
                if found is None:
                    values: list[Any] = (self.dtypes, self.shapes, self.files)[column]
                    found = codes[value] = len(values)
                    values.append(value)
        return found

    def set_row(self, row: int, dtype: int, shape: int, file: int, start: int, end: int) -> None:
        """Row ``row``: the codes (:meth:`code`) of its dtype, shape and file, and its offsets."""
        self.dtype_of[row] = dtype
        self.shape_of[row] = shape
        self.file_of[row] = file
        self.starts[row] = start
        self.ends[row] = end

    def record(self, row: int) -> TensorRecord:
        return TensorRecord.plain(
            self.dtypes[self.dtype_of[row]],
            self.shapes[self.shape_of[row]],
            self.files[self.file_of[row]],
            self.starts[row],
            self.ends[row],
            f"{self.digests[row]:016x}",
        )

    def as_dict(self) -> dict[str, TensorRecord]:
        """Every record, in a plain dict (made in one pass over the columns): for a load, which
        asks for each record several times, a dict lookup instead of a method call each."""
        return dict(
            zip(
                self.names,
                map(
                    TensorRecord.plain,
                    map(self.dtypes.__getitem__, self.dtype_of),
                    map(self.shapes.__getitem__, self.shape_of),
                    map(self.files.__getitem__, self.file_of),
                    self.starts,
                    self.ends,
                    map(format, self.digests, itertools.repeat("016x")),
                ),
            )
        )

    def rows(self) -> dict[str, int]:
        """Each name's row (made when first asked for)."""
        if self._index is None:
            self._index = {name: i for i, name in enumerate(self.names)}
        return self._index

    def __getitem__(self, name: str) -> TensorRecord:
        cache = self._cache
        if cache is None:
            return self.record(self.rows()[name])
        found = cache.get(name)
        if found is None:
            found = cache[name] = self.record(self.rows()[name])
        return found

    def __contains__(self, name: object) -> bool:
        return name in self.rows()

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def pieces(self) -> Iterator[bytes]:
        """The ``tensors`` member as :class:`_V1Tensors` writes it, from the columns."""
        dtypes = [_encode(d) for d in self.dtypes]
        shapes = [json.dumps(list(s), separators=(",", ":")) for s in self.shapes]
        files = [_encode(f) for f in self.files]
        dtype_of, shape_of, file_of = self.dtype_of, self.shape_of, self.file_of
        starts, ends, digests = self.starts, self.ends, self.digests
        parts: list[str] = []
        opening = "{"
        for i, name in enumerate(self.names):
            parts.append(
                f'{opening}{_encode(name)}:{{"dtype":{dtypes[dtype_of[i]]},'
                f'"shape":{shapes[shape_of[i]]},"file":{files[file_of[i]]},'
                f'"offsets":[{starts[i]},{ends[i]}],"xxh3":"{digests[i]:016x}"}}'
            )
            opening = ","
            if len(parts) == _PIECE_ENTRIES:
                yield "".join(parts).encode("ascii")
                parts.clear()
        parts.append("{}" if opening == "{" else "}")
        yield "".join(parts).encode("ascii")


class _V1Tensors:
    """The ``tensors`` member of an unsharded manifest, written as compact ASCII JSON: byte for
    byte what ``json.dumps`` gives for the dict of entries (``tests/formats/test_scale_paths.py``
    holds them equal), written entry by entry with the same string encoder, in pieces of
    :data:`_PIECE_ENTRIES` entries. A dict per tensor and the generic encoder cost a
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
                dtype = strings[t.dtype] = _encode(t.dtype)
            file = strings.get(t.file)
            if file is None:
                file = strings[t.file] = _encode(t.file)
            offsets = (
                f"{t.start},{t.end}"
                if type(t.start) is int and type(t.end) is int
                else json.dumps([t.start, t.end], separators=(",", ":"))[
                    1:-1
                ]  # as json.dumps would
            )
            parts.append(
                f'{"{" if first else ","}{_encode(name)}:{{"dtype":{dtype},"shape":{shape},'
                f'"file":{file},"offsets":[{offsets}],"xxh3":{_encode(t.xxh3)}}}'
            )
            first = False
            if len(parts) == _PIECE_ENTRIES:
                out.append("".join(parts).encode("ascii"))
                parts.clear()
        parts.append("{}" if first else "}")
        out.append("".join(parts).encode("ascii"))
        return out


_PIECE_ENTRIES = 8192
_encode = encode_basestring_ascii  # what json.dumps(..., ensure_ascii=True) writes for a string
_CAP = f"{MAX_MANIFEST_BYTES >> 20} MiB"
_DIGEST = re.compile(r"[0-9a-f]{16}")
_ITEMSIZE = {name: d.itemsize for name, d in dtypes.BY_NAME.items()}
_MAX_OFFSET = 1 << 63
_MAX_WORLD = 1 << 31
_V1_TENSOR = frozenset(("dtype", "shape", "file", "offsets", "xxh3"))
_V6_TENSOR = frozenset(("dtype", "shape", "file", "offsets", "mlh64"))
_V2_TENSOR = frozenset(("dtype", "shape", "shards"))
_FILE = frozenset(("size", "header_size", "header_xxh3"))
_BOX_SHARD = frozenset(("file", "offsets", "xxh3", "box"))
_FLAT_SHARD = frozenset(("file", "offsets", "xxh3", "flat"))
_SHARD_KINDS = (_BOX_SHARD, _FLAT_SHARD)
_BLOCKED_KINDS = _SHARD_KINDS + tuple(k | {"blocks"} for k in _SHARD_KINDS)
_BLOB_SHARD_KINDS = (frozenset(("xxh3", "blobs", "box")), frozenset(("xxh3", "blobs", "flat")))
_BLOCKS = frozenset(("size", "xxh3"))
_MIN_BLOCK = 1 << 10
_HEX = "0123456789abcdef"
_INT_ONLY = frozenset((int,))
_STR_ONLY = frozenset((str,))
_DICT_ONLY = frozenset((dict,))
_SIXTEEN = frozenset((16,))
_THREE = frozenset((3,))
_TENSOR_ONLY = frozenset(("tensor",))
_LEAF_FIELDS = operator.itemgetter("t", "ref", "kind")
_V1_FIELDS = operator.itemgetter("dtype", "shape", "file", "offsets", "xxh3")
_FIRST = operator.itemgetter(0)
_SECOND = operator.itemgetter(1)


def _natural(x: Any) -> bool:
    """A JSON integer >= 0 of any size (not a bool, not a float such as ``2.0``); dimensions are
    bounded by :func:`_dtype_and_shape`, box and flat bounds by the shape."""
    return type(x) is int and x >= 0


def _offset(x: Any) -> bool:
    """A byte size or offset: a JSON integer in ``[0, 2**63)`` (what file APIs take)."""
    return type(x) is int and 0 <= x < _MAX_OFFSET


def _is_digest(x: Any) -> bool:
    return type(x) is str and _DIGEST.fullmatch(x) is not None


def _show(x: Any) -> str:
    """``repr(x)``, shortened: hostile numbers can have thousands of digits."""
    text = repr(x)
    return text if len(text) <= 60 else f"{text[:40]}...({len(text)} characters)"


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ManifestError(message)


def parse(raw: bytes, *, columns: bool = True) -> Manifest:
    """Check ``raw`` completely and return the manifest it holds.

    ``columns``: a version 1 manifest's records are kept as a :class:`TensorTable` (no record
    made until asked for: what ``inspect`` and ``verify`` want); otherwise, or where the entries
    need the per-entry checks, as a dict of records (what a load, asking for each several
    times, wants).

    Raises ManifestError (malformed, including JSON the bounded reader refuses: too deep, too
    dense for its size, numbers out of range) or ManifestVersionError (a newer format).
    """
    _require(len(raw) <= MAX_MANIFEST_BYTES, f"manifest is larger than the {_CAP} cap")
    trailer = _TRAILER.search(raw)
    _require(trailer is not None, "manifest has no checksum trailer (truncated or edited)")
    assert trailer is not None
    _require(
        checksum.digest(raw[: trailer.start()]) == trailer.group(1).decode("ascii"),
        "manifest checksum does not match its content",
    )
    # Repeated keys are found by counting members (see bounded_json.loads_counted): the checks
    # below walk every object anyway. Any problem is reported after a parse that names a
    # repeated key first, as the reader always has.
    doc, pairs = _json.loads_counted(raw, ManifestError, "manifest")
    if pairs is None:
        return _manifest(doc, None, columns)
    try:
        return _manifest(doc, pairs, columns)
    except (ManifestError, ManifestVersionError):
        _json.loads(raw, ManifestError, "manifest")
        raise
    except _Repeated:
        # Raises naming the repeated key; were none found, the count was off: check it again.
        return _manifest(_json.loads(raw, ManifestError, "manifest"), None, columns)


class _Repeated(Exception):
    """The document's objects hold fewer members than its text: a key is repeated."""


def _manifest(doc: Any, pairs: int | None, columns: bool = True) -> Manifest:
    """The checks of :func:`parse` on its parsed document; ``pairs``: the members the text holds
    (None: repeated keys already refused), compared with those of the objects found."""
    _require(isinstance(doc, dict), "manifest is not a JSON object")
    _require(
        doc.get("format") == FORMAT,
        f"not a savepoint manifest (format {_show(doc.get('format'))})",
    )
    version = doc.get("format_version")
    _require(
        _natural(version), f"format_version must be a non-negative integer, got {_show(version)}"
    )
    if version > VERSION:
        raise ManifestVersionError(
            f"written in format version {_show(version)} by {_show(doc.get('writer'))}; this "
            f"savepoint reads versions up to {VERSION}: upgrade savepoint to load it"
        )
    _require(
        doc.get("checksum") == checksum.ALGORITHM, f"unknown checksum {_show(doc.get('checksum'))}"
    )
    for key in ("writer", "created"):
        _require(isinstance(doc.get(key), str), f"{key} must be a string")
    _require(isinstance(doc.get("metadata"), dict), "metadata must be an object")

    files: dict[str, FileRecord] = {}
    raw_files = doc.get("files")
    _require(isinstance(raw_files, dict), "files must be an object")
    for name, f in raw_files.items():
        _require(
            bool(_FILE_NAME.fullmatch(name)) and ".." not in name,
            f"data file name {_show(name)} is not a plain file name inside the checkpoint",
        )
        _require(
            type(f) is dict and f.keys() == _FILE,
            f"file {name!r}: entry must have size, header_size, header_xxh3",
        )
        size, header_size = f["size"], f["header_size"]
        _require(
            _offset(size) and _offset(header_size),
            f"file {name!r}: bad sizes (size {_show(size)}, header_size {_show(header_size)}: "
            "integers in [0, 2**63) expected)",
        )
        _require(8 <= header_size <= size, f"file {name!r}: header larger than the file")
        _require(_is_digest(f["header_xxh3"]), f"file {name!r}: bad header checksum")
        files[name] = FileRecord(size, header_size, f["header_xxh3"])

    blob_store = blob_digest = None
    if BLOBS <= version < DEVICE_CHECKS or (version >= DEVICE_CHECKS and "blob_store" in doc):
        blob_store, blob_digest = _blob_members(doc)
    world_size = None
    if SHARDED <= version <= BLOCKED or (version >= BLOBS and "world_size" in doc):
        world_size = doc.get("world_size")
        _require(
            type(world_size) is int and 1 <= world_size < _MAX_WORLD,
            f"world_size must be an integer in [1, 2**31), got {_show(world_size)}",
        )

    tensors: Mapping[str, TensorRecord]
    raw_tensors = doc.get("tensors")
    _require(isinstance(raw_tensors, dict), "tensors must be an object")
    if version >= BLOBS and world_size is None:
        tensors = {
            name: _v4_record(name, t, files, blob_digest, version)
            for name, t in raw_tensors.items()
        }
    elif version >= SHARDED:
        tensors = {
            name: _sharded_tensor(name, t, files, version, blob_digest)
            for name, t in raw_tensors.items()
        }
    else:
        tensors = _v1_records(raw_tensors, files, columns)

    tree = doc.get("tree")
    found = _check_tree(tree, tensors)
    if pairs is not None:
        found += len(doc) + 4 * len(raw_files)
        found += len(raw_tensors) * 6 if version < SHARDED else _json.members(raw_tensors)
        checked = (
            _CHECKED if version < SHARDED else _CHECKED_SHARDED if version <= BLOCKED else _CHECKED
        )
        found += sum(_json.members(v) for k, v in doc.items() if k not in checked)
        if found != pairs:
            raise _Repeated
    return Manifest(
        tree=tree,
        files=files,
        tensors=tensors,
        metadata=doc["metadata"],
        writer=doc["writer"],
        created=doc["created"],
        format_version=version,
        world_size=world_size,
        blob_store=blob_store,
        blob_digest=blob_digest,
    )


_STORE_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,199}")
MAX_UP = 2  # how many leading ``..`` a version 4 blob_store may have


def check_blob_store(value: Any) -> str:
    """A version 4 ``blob_store``, checked: relative, plain names after at most two leading
    ``..`` (a manifest naming a store anywhere else, absolute, a URL, ``a/../..``, is hostile)."""
    _require(
        type(value) is str and 0 < len(value) <= 1024,
        f"blob_store must be a relative path, got {_show(value)}",
    )
    parts = value.split("/")
    up = 0
    while up < len(parts) and parts[up] == "..":
        up += 1
    rest = parts[up:]
    _require(
        up <= MAX_UP
        and bool(rest)
        and all(_STORE_PART.fullmatch(p) and p not in (".", "..") for p in rest),
        f"blob_store {_show(value)} is not a relative path of plain names after at most "
        f"{MAX_UP} '..' (a store outside the run)",
    )
    return str(value)


def _blob_members(doc: dict[str, Any]) -> tuple[str, str]:
    store = check_blob_store(doc.get("blob_store"))
    algorithm = doc.get("blob_digest")
    _require(
        algorithm in _recipe.ALGORITHMS,
        f"blob_digest must be one of {sorted(_recipe.ALGORITHMS)}, got {_show(algorithm)}",
    )
    return store, str(algorithm)


def _v4_record(
    name: str, t: Any, files: dict[str, FileRecord], algorithm: str | None, version: int
) -> TensorRecord:
    """One version 4 tensor entry: a version 1 entry, or one naming a blob recipe."""
    if not (type(t) is dict and "blobs" in t):
        return _v1_record(name, t, files, version)
    _require(
        t.keys() == _V4_BLOB_TENSOR,
        f"tensor {name!r}: a blob entry must have dtype, shape, xxh3, blobs",
    )
    shape, itemsize = _dtype_and_shape(name, t)
    expected = math.prod(shape) * itemsize
    recipe, digest = _recipe_of(
        f"tensor {name!r}", t, expected, f"shape {list(shape)} of {t['dtype']}", algorithm, version
    )
    record = TensorRecord(
        t["dtype"], shape, "", 0, expected, t["xxh3"], (), digest.block, digest.blocks
    )
    _SET_RECIPE(record, recipe)
    return record


def _recipe_of(
    what: str,
    entry: dict[str, Any],
    expected: int,
    holding: str,
    algorithm: str | None,
    version: int,
) -> tuple[Any, checksum.Digest]:
    """The checked recipe of a version 4 entry (a tensor's or a shard's) whose bytes are
    ``expected`` (``holding`` says what they are), and its checksum."""
    try:
        recipe = _recipe.Recipe.from_json(entry["blobs"])
    except CorruptCheckpointError as exc:
        raise ManifestError(f"{what}: {exc}") from None
    _require(
        not recipe.patches or version >= PATCHES,
        f"{what}: a patched blob recipe in a version {version} manifest (patches came with "
        f"version {PATCHES})",
    )
    _require(
        recipe.size == expected,
        f"{what}: its blobs hold {recipe.size} bytes, {holding} needs {expected}",
    )
    _require(
        recipe.algorithm == algorithm,
        f"{what}: {recipe.algorithm} blobs in a {_show(algorithm)} blob store",
    )
    _require(
        recipe.chunk & (recipe.chunk - 1) == 0 and recipe.chunk >= _MIN_BLOCK,
        f"{what}: blob chunk {recipe.chunk} is not a power of two of at least 1 KiB",
    )
    digest = recipe.checksum() if recipe.size else checksum.Digest(checksum.digest(b""))
    _require(
        digest is not None and _is_digest(entry["xxh3"]) and digest.xxh3 == entry["xxh3"],
        f"{what}: its xxh3 does not match its blobs' checks",
    )
    assert digest is not None
    return recipe, digest


def _v1_records(
    raw_tensors: dict[str, Any], files: dict[str, FileRecord], columns: bool = True
) -> Mapping[str, TensorRecord]:
    """Check every version 1 tensor entry; return their records.

    The checks of :func:`_v1_record`, made column by column over all the entries at once
    (:func:`_v1_columns`: sets of types and values, numpy over the offsets; a manifest can hold
    millions), the records kept as columns (a :class:`TensorTable`); if any entry fails any of
    them, entry by entry (:func:`_v1_each`), which raises the error naming what is wrong."""
    if columns:
        try:
            table = _v1_columns(raw_tensors, files, columns)
            if table is not None:
                return table
        except (TypeError, ValueError, OverflowError, KeyError):
            pass  # a hostile value the column checks cannot take: the entry checks say which
    # A load's records (a dict), or entries the column checks refused: entry by entry (for a
    # load, as fast as the column checks plus a record each, and gentler on the allocator).
    tensors: dict[str, TensorRecord] = {}
    _v1_each(raw_tensors, files, tensors)
    return tensors


def _v1_columns(
    raw_tensors: dict[str, Any], files: dict[str, FileRecord], columns: bool = True
) -> Mapping[str, TensorRecord] | None:
    """:func:`_v1_records` column by column (a table, or with ``columns=False`` a dict of
    records); None if any entry fails a check."""
    entries = list(raw_tensors.values())
    if not entries:
        return TensorTable([], cached=True) if columns else {}
    if set(map(type, entries)) != _DICT_ONLY or not all(
        map(operator.eq, map(dict.keys, entries), itertools.repeat(_V1_TENSOR))
    ):
        return None
    fields = zip(*map(_V1_FIELDS, entries))
    del entries
    dts, shapes, names, offsets, digests = fields
    itemsizes = _ITEMSIZE
    if not (
        set(map(type, dts)) == _STR_ONLY
        and set(dts) <= itemsizes.keys()
        and set(map(type, names)) == _STR_ONLY
        and set(names) <= files.keys()
        and set(map(type, digests)) == _STR_ONLY
        and set(map(len, digests)) == _SIXTEEN
        and not "".join(digests).strip(_HEX)
        and set(map(type, shapes)) == _LIST_ONLY
        and set(map(type, itertools.chain.from_iterable(shapes))) <= _INT_ONLY
        and set(map(type, offsets)) == _LIST_ONLY
        and set(map(len, offsets)) == _PAIR_ONLY
    ):
        return None
    dims = list(map(tuple, shapes))
    del shapes
    counts: dict[tuple[int, ...], tuple[int, ...]] = {}  # each distinct shape, checked, once
    elements = {}
    for d in set(dims):
        if not (
            len(d) <= 64
            and min(d, default=0) >= 0
            and max(d, default=0) < 2**62
            and math.prod([x or 1 for x in d]) * 16 < 2**62
        ):
            return None
        counts[d] = d
        elements[d] = math.prod(d)
    dims = list(map(counts.__getitem__, dims))  # one tuple per distinct shape
    starts = list(map(_FIRST, offsets))
    ends = list(map(_SECOND, offsets))
    del offsets
    if not set(map(type, starts)) | set(map(type, ends)) <= _INT_ONLY:
        return None
    # Ranges, with C-level maps over Python ints (any size): inside their file's data, and
    # exactly shape x itemsize long.
    le = operator.le
    if len(files) == 1:
        record = next(iter(files.values()))
        if min(starts) < record.header_size or max(ends) > record.size:
            return None
    else:
        firsts = {name: f.header_size for name, f in files.items()}
        lasts = {name: f.size for name, f in files.items()}
        if not all(map(le, map(firsts.__getitem__, names), starts)) or not all(
            map(le, ends, map(lasts.__getitem__, names))
        ):
            return None
    need = map(operator.mul, map(elements.__getitem__, dims), map(itemsizes.__getitem__, dts))
    if not all(map(le, starts, ends)) or list(map(operator.sub, ends, starts)) != list(need):
        return None
    if not columns:
        return dict(
            zip(raw_tensors, map(TensorRecord.plain, dts, dims, names, starts, ends, digests))
        )
    return TensorTable.from_columns(list(raw_tensors), dts, dims, names, starts, ends, digests)


def _v1_each(
    raw_tensors: dict[str, Any], files: dict[str, FileRecord], tensors: dict[str, TensorRecord]
) -> None:
    """:func:`_v1_records` entry by entry: the checks of :func:`_v1_record`, inlined for the
    entries that pass them (shapes are checked once per distinct shape, digests without a
    regular expression); an entry that fails any of them goes through :func:`_v1_record`."""
    v1_keys = _V1_TENSOR
    itemsizes = _ITEMSIZE
    int_only = _INT_ONLY
    counts: dict[tuple[int, ...], int] = {}  # shapes already checked -> element count
    make = TensorRecord.plain
    for name, t in raw_tensors.items():
        if type(t) is dict and t.keys() == v1_keys:
            dtype, shape, file, offsets, xxh3 = (
                t["dtype"],
                t["shape"],
                t["file"],
                t["offsets"],
                t["xxh3"],
            )
            itemsize = itemsizes.get(dtype) if type(dtype) is str else None
            record = files.get(file) if type(file) is str else None
            if (
                itemsize is not None
                and record is not None
                and type(shape) is list
                and type(offsets) is list
                and len(offsets) == 2
                and type(xxh3) is str
                and len(xxh3) == 16
                and not xxh3.strip(_HEX)
            ):
                dims = tuple(shape)
                # Types first: (True,) == (1,), so the cache is only asked about int tuples.
                count = counts.get(dims) if int_only.issuperset(map(type, dims)) else None
                if (
                    count is None
                    and len(dims) <= 64
                    and int_only.issuperset(map(type, dims))
                    and min(dims, default=0) >= 0
                    and max(dims, default=0) < 2**62
                    and math.prod([d or 1 for d in dims]) * itemsize < 2**62
                ):
                    count = counts[dims] = math.prod(dims)
                start, end = offsets
                if (
                    count is not None
                    and type(start) is int
                    and type(end) is int
                    and record.header_size <= start <= end <= record.size
                    and end - start == count * itemsize
                ):
                    tensors[name] = make(dtype, dims, file, start, end, xxh3)
                    continue
        tensors[name] = _v1_record(name, t, files)


def _v1_record(
    name: str, t: Any, files: dict[str, FileRecord], version: int = UNSHARDED
) -> TensorRecord:
    """One version 1 tensor entry, checked, with a message naming the first problem. From
    version 6 the checksum may be an ``mlh64`` one instead (``"mlh64": "<16 hex>"`` in place
    of ``xxh3``), held as the tagged digest ``"mlh64:<16 hex>"``."""
    if version >= DEVICE_CHECKS and type(t) is dict and t.keys() == _V6_TENSOR:
        _require(_is_digest(t["mlh64"]), f"tensor {name!r}: bad mlh64 checksum")
        plain = {k: v for k, v in t.items() if k != "mlh64"}
        plain["xxh3"] = t["mlh64"]
        record = _v1_record(name, plain, files)
        _SET_XXH3(record, "mlh64:" + t["mlh64"])
        return record
    _require(
        type(t) is dict and t.keys() == _V1_TENSOR,
        f"tensor {name!r}: entry must have dtype, shape, file, offsets, xxh3",
    )
    shape, itemsize = _dtype_and_shape(name, t)
    start, end = _byte_range(f"tensor {name!r}", t, files)
    expected = math.prod(shape) * itemsize
    _require(
        end - start == expected,
        f"tensor {name!r}: {end - start} bytes recorded, shape {list(shape)} of {t['dtype']} "
        f"needs {expected}",
    )
    _require(_is_digest(t["xxh3"]), f"tensor {name!r}: bad checksum")
    return TensorRecord(t["dtype"], shape, t["file"], start, end, t["xxh3"])


def _dtype_and_shape(name: str, t: dict[str, Any]) -> tuple[tuple[int, ...], int]:
    """The checked shape (a tuple) and the dtype's itemsize of an entry with those members."""
    dtype = t["dtype"]
    itemsize = _ITEMSIZE.get(dtype) if type(dtype) is str else None
    _require(itemsize is not None, f"tensor {name!r}: unknown dtype {_show(dtype)}")
    assert itemsize is not None
    shape = t["shape"]
    _require(
        type(shape) is list and len(shape) <= 64 and all(map(_natural, shape)),
        f"tensor {name!r}: shape must be a list of at most 64 non-negative integers",
    )
    # Zero-element shapes pass any byte-count check; keep their other dimensions allocatable.
    # (Bounding each dimension first keeps the product of hostile ones cheap.)
    _require(
        max(shape, default=0) < 2**62 and math.prod([d or 1 for d in shape]) * itemsize < 2**62,
        f"tensor {name!r}: shape {_show(shape)} is too large",
    )
    return tuple(shape), itemsize


def _byte_range(what: str, t: dict[str, Any], files: dict[str, FileRecord]) -> tuple[int, int]:
    """The checked ``offsets`` of an entry whose ``file`` and ``offsets`` members exist."""
    file = t["file"]
    record = files.get(file) if type(file) is str else None
    _require(record is not None, f"{what}: refers to unknown file {_show(file)}")
    assert record is not None
    offsets = t["offsets"]
    _require(
        type(offsets) is list and len(offsets) == 2 and all(map(_offset, offsets)),
        f"{what}: offsets must be two integers in [0, 2**63), got {_show(offsets)}",
    )
    start, end = offsets
    _require(
        record.header_size <= start <= end <= record.size,
        f"{what}: byte range {start}..{end} lies outside the data of {file!r}",
    )
    return start, end


def _pair(x: Any) -> bool:
    return type(x) is list and len(x) == 2 and all(map(_natural, x)) and x[0] <= x[1]


def _blocks(what: str, raw: Any, nbytes: int, xxh3: str) -> tuple[int, tuple[str, ...]]:
    """The checked ``blocks`` member of a shard of ``nbytes`` bytes whose ``xxh3`` is given."""
    _require(
        type(raw) is dict and raw.keys() == _BLOCKS,
        f"{what}: blocks must be an object with size and xxh3",
    )
    size, digests = raw["size"], raw["xxh3"]
    _require(
        type(size) is int and _MIN_BLOCK <= size < _MAX_OFFSET and size & (size - 1) == 0,
        f"{what}: block size must be a power of two of at least 1 KiB, got {_show(size)}",
    )
    count = -(-nbytes // size)
    _require(
        count >= 2 and type(digests) is list and len(digests) == count,
        f"{what}: {nbytes} bytes in blocks of {size} need {count} block checksums (at least 2)",
    )
    _require(all(map(_is_digest, digests)), f"{what}: bad block checksum")
    _require(checksum.combine(digests) == xxh3, f"{what}: block checksums disagree with its xxh3")
    return size, tuple(digests)


def _sharded_tensor(
    name: str, t: Any, files: dict[str, FileRecord], version: int, algorithm: str | None = None
) -> TensorRecord:
    _require(
        type(t) is dict and t.keys() == _V2_TENSOR,
        f"tensor {name!r}: entry must have dtype, shape, shards",
    )
    shape, itemsize = _dtype_and_shape(name, t)
    raw_shards = t["shards"]
    _require(
        type(raw_shards) is list and len(raw_shards) > 0,
        f"tensor {name!r}: shards must be a non-empty list",
    )
    shards = []
    for i, sh in enumerate(raw_shards):
        what = f"tensor {name!r} shard {i}"
        if version >= BLOBS and type(sh) is dict and "blobs" in sh:
            _require(
                sh.keys() in _BLOB_SHARD_KINDS,
                f"{what}: a blob shard must have xxh3, blobs and one of box, flat",
            )
            start, end = 0, -1  # from its recipe, once its region is checked
        else:
            kinds = _BLOCKED_KINDS if version >= BLOCKED else _SHARD_KINDS
            _require(
                type(sh) is dict and sh.keys() in kinds,
                f"{what}: entry must have file, offsets, xxh3 and one of box, flat"
                + (" (and may have blocks)" if version >= BLOCKED else "")
                + (" (or xxh3, blobs and one of box, flat)" if version >= BLOBS else ""),
            )
            start, end = _byte_range(what, sh, files)
            _require(_is_digest(sh["xxh3"]), f"{what}: bad checksum")
        region: boxes.Region
        if "flat" in sh:
            _require(_pair(sh["flat"]), f"{what}: flat must be [start, stop] with start <= stop")
            region = boxes.Flat(*sh["flat"])
        else:
            box = sh["box"]
            _require(
                type(box) is list and len(box) == len(shape) and all(map(_pair, box)),
                f"{what}: box must hold one [start, stop] (start <= stop) per dimension of "
                f"{list(shape)}",
            )
            region = tuple((a, b) for a, b in box)
        _require(
            boxes.inside(region, shape),
            f"{what}: {boxes.show(region)} lies outside shape {list(shape)}",
        )
        expected = boxes.size(region, shape) * itemsize
        if end < 0:
            recipe, digest = _recipe_of(
                what, sh, expected, f"{boxes.show(region)} of {t['dtype']}", algorithm, version
            )
            shards.append(
                ShardRecord(
                    "", 0, expected, sh["xxh3"], region, digest.block, digest.blocks, recipe
                )
            )
            continue
        _require(
            end - start == expected,
            f"{what}: {end - start} bytes recorded, {boxes.show(region)} of {t['dtype']} needs "
            f"{expected}",
        )
        block = 0
        digests: tuple[str, ...] = ()
        if "blocks" in sh:
            block, digests = _blocks(what, sh["blocks"], end - start, sh["xxh3"])
        shards.append(ShardRecord(sh["file"], start, end, sh["xxh3"], region, block, digests))
    problem = boxes.check_cover([s.region for s in shards], shape)
    _require(problem is None, f"tensor {name!r}: shards do not tile shape {list(shape)}: {problem}")
    return whole(t["dtype"], shape, tuple(shards))


_KINDS = {"numpy", "numpy_scalar", "torch"}


def _check_tree(root: Any, records: Mapping[str, TensorRecord]) -> int:
    """Check every node of the tree, depth first (iteratively: any depth).

    Tensor leaves and dict nodes, nearly all of a big tree, are checked inline with set
    operations over each dict's items; any node those checks do not clear goes through
    :func:`_check_node`, which raises naming the problem (or accepts a node of another type)."""
    # The names, as a dict (a table's rows): membership and set tests at C speed.
    tensors: Mapping[str, Any] = records.rows() if isinstance(records, TensorTable) else records
    stack = [root]
    pop, extend = stack.pop, stack.extend
    kinds = _KINDS
    lists, pairs, key_types = _LIST_ONLY, _PAIR_ONLY, _KEY_TYPES
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
        members += _check_node(node, tensors, stack)
    return members


def _tensor_leaves(children: list[Any], tensors: Mapping[str, Any]) -> bool:
    """Whether every node of ``children`` is a valid tensor leaf (``{"t": "tensor", "ref":
    <a tensor's name>, "kind": <a kind>}``), checked together: the many leaves of a big state
    cost a few set operations instead of a pass of the node loop each."""
    if len(children) < 8 or set(map(type, children)) != _DICT_ONLY:
        return False
    if set(map(len, children)) != _THREE:
        return False
    try:
        # Three members, "t", "ref" and "kind" among them: exactly those.
        ts, refs, kinds = zip(*map(_LEAF_FIELDS, children))
        return (
            set(ts) == _TENSOR_ONLY
            and set(map(type, refs)) == _STR_ONLY
            and set(map(type, kinds)) == _STR_ONLY
            and set(kinds) <= _KINDS
            and set(refs) <= tensors.keys()
        )
    except (KeyError, TypeError):  # a member missing, an unhashable value: the node loop says
        return False


def _check_node(node: Any, tensors: Mapping[str, Any], stack: list[Any]) -> int:
    """Check one tree node, pushing its children on ``stack``; returns the members of the
    objects it holds other than its children (for the repeated-key count of :func:`parse`)."""
    _require(type(node) is dict and type(node.get("t")) is str, "tree: malformed node")
    t = node["t"]
    members = len(node)
    for key, value in node.items():
        if key not in _NODE_MEMBERS.get(t, ()):
            members += _json.members(value)  # a member readers ignore: count what it holds
    if t == "dict":
        items = node.get("items")
        _require(type(items) is list, "tree: dict node without items")
        seen: set[tuple[type, Any]] = set()
        for item in items:
            _require(type(item) is list and len(item) == 2, "tree: malformed dict item")
            k = item[0]
            _require(
                type(k) is str or type(k) is int,
                f"tree: dict key {_show(k)} is not a string or integer",
            )
            _require((type(k), k) not in seen, f"tree: duplicate dict key {_show(k)}")
            seen.add((type(k), k))
            stack.append(item[1])
    elif t in ("list", "tuple"):
        _require(type(node.get("items")) is list, f"tree: {t} node without items")
        stack.extend(node["items"])
    elif t == "tensor":
        ref, kind = node.get("ref"), node.get("kind")
        _require(
            type(ref) is str and ref in tensors,
            f"tree: reference to unknown tensor {_show(ref)}",
        )
        _require(type(kind) is str and kind in _KINDS, f"tree: unknown tensor kind {_show(kind)}")
    elif t == "stateful":
        _require(type(node.get("type")) is str, "tree: stateful node without a type")
        stack.append(node.get("state"))
    elif t == "value":
        # Floats are finite: the reader refuses 1e400, NaN and Infinity (those are "float").
        v = node.get("v", ...)
        _require(v is None or type(v) in (bool, int, float, str), "tree: value is not a scalar")
    elif t == "float":
        _require(node.get("v") in ("nan", "inf", "-inf"), "tree: bad special float")
    elif t == "bytes":
        _require(type(node.get("v")) is str, "tree: bytes node without base64 text")
        try:
            base64.b64decode(node["v"], validate=True)
        except (binascii.Error, ValueError):
            raise ManifestError("tree: bytes node holds invalid base64") from None
    else:
        raise ManifestError(f"tree: unknown node type {_show(t)}")
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
# Top-level members whose objects parse counts itself (the others are counted by walking them).
_CHECKED = frozenset(
    ("format", "format_version", "writer", "created", "checksum", "files", "tensors", "tree")
)
_CHECKED_SHARDED = _CHECKED | {"world_size"}
_V4_BLOB_TENSOR = {"dtype", "shape", "xxh3", "blobs"}
_LIST_ONLY = frozenset((list,))
_PAIR_ONLY = frozenset((2,))
_KEY_TYPES = frozenset((str, int))
