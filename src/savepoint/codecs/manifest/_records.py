"""The manifest's records and the format's constants: what :func:`~savepoint.codecs.manifest.parse`
returns and :func:`~savepoint.codecs.manifest.dump` writes.

:class:`TensorRecord` and :class:`TensorTable` are on the hot path of reading a manifest of many
tensors (``TensorRecord.plain`` sets a record's slots directly; the table keeps the records of
an unsharded save as columns): they are tuned, see their docstrings before changing them.
"""

from __future__ import annotations

import itertools
import json
import math
import threading
import zlib
from array import array
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from json.encoder import encode_basestring_ascii
from typing import Any

from savepoint.codecs import boxes, dtypes
from savepoint.errors import CorruptCheckpointError, IncompatibleCheckpointError

FORMAT = "savepoint"
UNSHARDED = 1  # what an unsharded checkpoint is written as
SHARDED = 2  # the first version with sharding
BLOCKED = 3  # the first version with block checksums: what a sharded checkpoint is written as
BLOBS = 4  # the first version with tensors in a blob store: what an incremental save writes
PATCHES = 5  # the first version with patched blob recipes (savepoint.blobs.patch)
DEVICE_CHECKS = 6  # the first version with mlh64 tensor checksums (savepoint.codecs.devhash)
GRID = 7  # the first version of regular (grid) layouts: per-rank index files
VERSION = GRID  # the newest version this reader reads
NAME = "manifest.json"
MAX_MANIFEST_BYTES = 1 << 30  # parse and dump read it from here when called (tests lower it)
CAP = f"{MAX_MANIFEST_BYTES >> 20} MiB"  # the cap, as messages name it
PIECE_ENTRIES = 8192  # tensor entries per piece of the text dump() writes
encode_string = encode_basestring_ascii  # what json.dumps(ensure_ascii=True) writes for a str


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
set_xxh3 = _SET_XXH3  # for a decoder re-tagging the checksum of a record it has just made


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
    """The safetensors name of a shard in its data file (see the package docstring)."""
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
    # Version 7 (a regular layout): the device mesh, each rank's index file (name -> its
    # IndexRecord) and each tensor's grid (per mesh dimension: the tensor dimension split over
    # it, or None); ``tensors`` then holds the records read from the indices (version 3's).
    mesh: tuple[int, ...] | None = None
    indices: dict[str, Any] | None = None
    grids: dict[str, tuple[int | None, ...]] | None = None

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
        """The ``tensors`` member as the encoder writes it for a mapping of records
        (:mod:`savepoint.codecs.manifest._encode`), from the columns."""
        dtypes = [encode_string(d) for d in self.dtypes]
        shapes = [json.dumps(list(s), separators=(",", ":")) for s in self.shapes]
        files = [encode_string(f) for f in self.files]
        dtype_of, shape_of, file_of = self.dtype_of, self.shape_of, self.file_of
        starts, ends, digests = self.starts, self.ends, self.digests
        parts: list[str] = []
        opening = "{"
        for i, name in enumerate(self.names):
            parts.append(
                f'{opening}{encode_string(name)}:{{"dtype":{dtypes[dtype_of[i]]},'
                f'"shape":{shapes[shape_of[i]]},"file":{files[file_of[i]]},'
                f'"offsets":[{starts[i]},{ends[i]}],"xxh3":"{digests[i]:016x}"}}'
            )
            opening = ","
            if len(parts) == PIECE_ENTRIES:
                yield "".join(parts).encode("ascii")
                parts.clear()
        parts.append("{}" if opening == "{" else "}")
        yield "".join(parts).encode("ascii")
