"""Version 7: a sharded manifest of a regular (grid) layout, its size O(tensors + ranks).

What a sharded save of a regular state writes (:mod:`savepoint.distributed.layout`: every rank
holds the same keys, each tensor split over one device mesh by ``Shard(d)`` / ``Replicate``
placements). The manifest holds a tensor table and a per-rank table, never a list of pieces;
each rank's pieces (their files, byte ranges, checksums and block checksums) are in that rank's
**index file**, ``index-r<rank>.json`` beside the data files, whose size and XXH3-64 the
manifest records. The members after ``checksum``::

     "world_size": 8,
     "mesh": [4, 2],                                   # the device mesh (product: world_size)
     "metadata": {...},
     "files": {...},                                   # every rank's data files, as version 2
     "indices": {"index-r00000.json": {"size": 1234, "xxh3": "<16 hex>"}, ...},
     "tensors": {"model/w": {"dtype": "F32", "shape": [4096, 1024], "grid": [0, null]}},
     "tree": {...}

``grid`` has one entry per mesh dimension: the tensor dimension split over it (``torch.chunk``
style, left to right, as DTensor's ``Shard(d)``), or null (replicated over it). An index file is
a JSON object ``{"shards": {"<tensor>": [<shard>, ...], ...}}`` whose shards are version 3 shard
objects (``file``, ``offsets``, ``xxh3``, ``box``, optional ``blocks``); index names follow the
rules of data file names and are not data files.

The reader (:func:`grid_manifest`) checks the members, reads every index through the caller's
``read_index`` (the codec does no I/O), checks each against its recorded size and XXH3-64 (so a
flipped bit in an index is caught before any of it is used), parses it with the bounded JSON
reader (repeated keys refused), and checks the union of the shards of each tensor with the
version 3 rules (boxes inside the shape and tiling it, byte ranges inside their data files,
block checksums combining to the shard's), and that each piece of a tensor with elements is
a box its grid gives (:func:`from_grid`). The records it returns are those of a version 3
manifest, so every loader reads a version 7 checkpoint as it reads a version 3 one: a verified
resharding load reads and checks only the blocks it needs, and a corrupt block is found by the
ranks that read it. This reader reads every index (:func:`grid_records`: ``verify``, ``copy``,
loads of whole tensors); a sharded load reads only those of the ranks whose pieces it reads
(:mod:`._v7_lazy`: the grid says which ranks hold which boxes), with the same checks.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from savepoint.codecs import bounded_json as _json
from savepoint.codecs import boxes, checksum
from savepoint.codecs.manifest import _records
from savepoint.codecs.manifest._checks import (
    FILE_NAME,
    dtype_and_shape,
    is_digest,
    offset,
    require,
    show,
)
from savepoint.codecs.manifest._records import (
    BLOCKED,
    FileRecord,
    ShardRecord,
    TensorRecord,
)
from savepoint.codecs.manifest._v2_sharded import sharded_tensor

__all__ = [
    "GRID",
    "GridTable",
    "IndexFiles",
    "IndexRecord",
    "ReadIndex",
    "from_grid",
    "grid_manifest",
    "grid_records",
    "grid_table",
    "index_bytes",
    "index_name",
]

GRID = _records.GRID
ReadIndex = Callable[[str, int], bytes]  # (index file name, cap in bytes) -> its bytes
_INDEX = frozenset(("size", "xxh3"))
_TENSOR = frozenset(("dtype", "shape", "grid"))


@dataclass(frozen=True)
class IndexRecord:
    """A rank's index file, as the manifest records it."""

    size: int
    xxh3: str


def index_name(rank: int) -> str:
    return f"index-r{rank:05d}.json"


def index_bytes(shards: list[tuple[str, ShardRecord]]) -> bytes:
    """A rank's index file: its pieces (by tensor, in the order given) as version 3 shards."""
    from savepoint.codecs.manifest._encode import shard_json

    by_key: dict[str, list[Any]] = {}
    for key, record in shards:
        by_key.setdefault(key, []).append(shard_json(record))
    text = json.dumps({"shards": by_key}, separators=(",", ":"), ensure_ascii=True)
    return text.encode("ascii") + b"\n"


def check_grid_members(doc: dict[str, Any], world_size: int) -> tuple[int, ...]:
    mesh: Any = doc.get("mesh")
    require(
        type(mesh) is list and len(mesh) > 0 and all(type(n) is int and n > 0 for n in mesh),
        f"mesh must be a non-empty list of positive integers, got {show(mesh)}",
    )
    product = 1
    for n in mesh:
        product *= n
        if product > world_size:  # hostile sizes: stop before the product grows (quadratic)
            break
    require(product == world_size, f"mesh {show(mesh)} does not hold world_size {world_size} ranks")
    return tuple(mesh)


def _indices(raw: Any, files: dict[str, FileRecord]) -> dict[str, IndexRecord]:
    require(type(raw) is dict, "indices must be an object")
    out = {}
    for name, entry in raw.items():
        require(
            bool(FILE_NAME.fullmatch(name)) and ".." not in name and name not in files,
            f"index file name {show(name)} is not a plain file name of its own",
        )
        require(
            type(entry) is dict and entry.keys() == _INDEX,
            f"index {name!r}: entry must have size, xxh3",
        )
        require(offset(entry["size"]), f"index {name!r}: bad size {show(entry['size'])}")
        require(is_digest(entry["xxh3"]), f"index {name!r}: bad checksum")
        out[name] = IndexRecord(entry["size"], entry["xxh3"])
    return out


def _grid(name: str, t: Any, mesh: tuple[int, ...]) -> tuple[int | None, ...]:
    require(
        type(t) is dict and t.keys() == _TENSOR,
        f"tensor {name!r}: entry must have dtype, shape, grid",
    )
    shape, _ = dtype_and_shape(name, t)
    grid = t["grid"]
    require(
        type(grid) is list
        and len(grid) == len(mesh)
        and all(d is None or (type(d) is int and 0 <= d < len(shape)) for d in grid),
        f"tensor {name!r}: grid must name a dimension of the tensor or null for each of the "
        f"{len(mesh)} mesh dimensions, got {show(grid)}",
    )
    return tuple(grid)


def _read_index(name: str, record: IndexRecord, read_index: ReadIndex) -> dict[str, Any]:
    require(record.size <= _records.MAX_MANIFEST_BYTES, f"index {name!r} is larger than the cap")
    try:
        data = read_index(name, record.size)
    except FileNotFoundError:
        require(False, f"index {name!r} is missing")
        raise  # unreachable
    require(
        len(data) == record.size and checksum.digest(data) == record.xxh3,
        f"index {name!r} does not match its recorded size and checksum (damaged or replaced)",
    )
    doc, pairs = _json.loads_counted(data, _IndexError, "index")
    require(
        type(doc) is dict and doc.keys() == {"shards"} and type(doc["shards"]) is dict,
        f"index {name!r}: must be an object holding shards",
    )
    require(pairs is None or _json.members(doc) == pairs, f"index {name!r} repeats a key")
    shards: dict[str, Any] = doc["shards"]
    return shards


class _IndexError(ValueError):
    pass


class IndexFiles:
    """A version 7 manifest's index files, each read through ``read_index`` when first asked
    for (:meth:`shards`), checked against its record (size and XXH3-64) before any of it is
    used, and kept. ``read``: the names read so far, in order."""

    def __init__(
        self, indices: dict[str, IndexRecord], read_index: ReadIndex, tensors: Mapping[str, Any]
    ) -> None:
        self.indices = indices
        self.read_index = read_index
        self.tensors = tensors
        self.read: list[str] = []
        self._kept: dict[str, dict[str, Any]] = {}
        self.lock = threading.RLock()  # a lazy load may ask from its reader threads

    def shards(self, name: str) -> dict[str, Any]:
        """Index ``name``'s shards by tensor (each a list of unchecked version 3 shard objects):
        the index checked against its record, its tensors against the manifest's."""
        found = self._kept.get(name)
        if found is not None:
            return found
        with self.lock:
            found = self._kept.get(name)
            if found is not None:
                return found
            try:
                found = _read_index(name, self.indices[name], self.read_index)
            except _IndexError as exc:
                require(False, f"index {name!r}: {exc}")
                raise  # unreachable
            self.read.append(name)
            for key, listed in found.items():
                require(
                    key in self.tensors, f"index {name!r} names tensor {key!r}, not in the manifest"
                )
                require(type(listed) is list, f"index {name!r}: {key!r} must list shards")
            self._kept[name] = found
            return found


@dataclass
class GridTable:
    """A version 7 manifest's checked members, before any index is read."""

    mesh: tuple[int, ...]
    indices: dict[str, IndexRecord]
    grids: dict[str, tuple[int | None, ...]]
    raw: dict[str, Any]  # the tensor entries (checked)
    files: dict[str, FileRecord]
    index_files: IndexFiles


def grid_table(
    doc: dict[str, Any],
    files: dict[str, FileRecord],
    world_size: int,
    read_index: ReadIndex | None,
) -> GridTable:
    """The checked version 7 members of ``doc``: mesh, indices, each tensor's grid; the index
    files are read later, through ``read_index`` (:func:`grid_records`, or
    :class:`savepoint.codecs.manifest._v7_lazy.GridTensors`)."""
    require(
        read_index is not None,
        "a version 7 manifest is read with its index files (open the checkpoint with "
        "savepoint's loaders, which read them)",
    )
    assert read_index is not None
    mesh = check_grid_members(doc, world_size)
    indices = _indices(doc.get("indices"), files)
    raw_tensors: dict[str, Any] = doc["tensors"] if type(doc.get("tensors")) is dict else {}
    require(type(doc.get("tensors")) is dict, "tensors must be an object")
    grids = {name: _grid(name, t, mesh) for name, t in raw_tensors.items()}
    return GridTable(
        mesh, indices, grids, raw_tensors, files, IndexFiles(indices, read_index, grids)
    )


def grid_records(table: GridTable) -> dict[str, TensorRecord]:
    """Every tensor's record (version 3's), from every index: the union of the shards of each
    tensor checked with the version 3 rules, each piece a box its grid gives."""
    mesh, grids = table.mesh, table.grids
    pieces: dict[str, list[Any]] = {name: [] for name in table.raw}
    for name in sorted(table.indices):
        for key, listed in table.index_files.shards(name).items():
            pieces[key].extend(listed)
    tensors = {}
    for key, t in table.raw.items():
        found = sorted(pieces[key], key=_order)
        require(bool(found), f"tensor {key!r}: no index holds a piece of it")
        entry = {"dtype": t["dtype"], "shape": t["shape"], "shards": found}
        record = tensors[key] = sharded_tensor(key, entry, table.files, BLOCKED)
        if math.prod(record.shape):  # (a tensor without elements is one piece, held whole)
            for shard in record.layout():
                require(
                    from_grid(shard.region, record.shape, mesh, grids[key]),
                    f"tensor {key!r}: piece {boxes.show(shard.region)} is not a box its grid "
                    f"{list(grids[key])} gives on mesh {list(mesh)}",
                )
    return tensors


def grid_manifest(
    doc: dict[str, Any],
    files: dict[str, FileRecord],
    world_size: int,
    read_index: ReadIndex | None,
) -> tuple[
    tuple[int, ...],
    dict[str, IndexRecord],
    dict[str, tuple[int | None, ...]],
    Mapping[str, TensorRecord],
]:
    """The checked version 7 members of ``doc``: mesh, indices, each tensor's grid, and the
    tensor records (version 3 records, from every index read through ``read_index``)."""
    table = grid_table(doc, files, world_size, read_index)
    return table.mesh, table.indices, table.grids, grid_records(table)


def from_grid(
    region: boxes.Region,
    shape: tuple[int, ...],
    mesh: tuple[int, ...],
    grid: tuple[int | None, ...],
) -> bool:
    """Whether ``region`` is the box of some mesh coordinate (as
    :func:`savepoint.distributed.layout.grid_box` makes them): the coordinate solved from the
    box's start, one mesh dimension at a time. The pieces tile the tensor (checked), so when
    each is a grid box they are the grid's boxes that hold elements."""
    if isinstance(region, boxes.Flat):
        return False
    start = [0] * len(shape)
    size = list(shape)
    for n, d in zip(mesh, grid):
        if d is None:
            continue
        chunk = -(-size[d] // n)
        at = (region[d][0] - start[d]) // chunk if chunk else -1
        if not 0 <= at < n:
            return False
        first = min(at * chunk, size[d])
        size[d] = max(0, min(chunk, size[d] - first))
        start[d] += first
    return tuple((a, a + n) for a, n in zip(start, size)) == tuple(region)


def _order(shard: Any) -> tuple[int, list[int]]:
    # Records in region order, as version 3 writes them (a malformed shard: the checks say why).
    box = shard.get("box") if type(shard) is dict else None
    if type(box) is list and all(type(p) is list and all(type(v) is int for v in p) for p in box):
        return 0, [v for p in box for v in p]
    return 1, []
