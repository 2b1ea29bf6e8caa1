"""Version 7 read lazily: a load that needs part of a checkpoint reads only the index files of the
ranks that wrote that part.

:func:`savepoint.codecs.manifest.parse` with ``lazy=True`` returns a version 7 manifest whose
``tensors`` is a :class:`GridTensors`: the tensor table checked as always, but no index read
yet. A tensor's record holds its pieces as a :class:`GridPieces`, a sequence whose length and
regions come from the grid alone (the distinct non-empty boxes it gives, in region order: the
order of a version 3 record, so piece ``i`` is the same piece on every rank); piece ``i`` itself
(file, byte range, checksums) is read from the index of the rank that wrote it, when first asked
for. :meth:`GridPieces.near` names the pieces meeting a region without reading anything, so a
resharding load plans its reads from the grid and reads the indexes of their writers only. A
tensor that is one piece (replicated, or with one non-empty box) is read when its record is;
one without elements is not (no byte of it is ever read: its piece only when asked for).

Which rank wrote a piece is the save's rule (:func:`savepoint.distributed.layout.writes`): the
piece at mesh coordinate ``c``, ``c`` on the replicated mesh dimensions being the tensor's
position in the table modulo the replica count (unravelled in C order), in the index of rank
``ravel(c)`` (C order over the mesh: how ``init_device_mesh`` numbers ranks). That is a guess,
checked: the index is checked against its record (size and XXH3-64) before it is used, every
piece of the tensor it lists must pass the version 3 rules and be a box of the grid (no two the
same), and it must hold the piece asked for. Where it does not (ranks numbered otherwise than the
mesh, a table reordered by hand, damage), the reader falls back to every index, checked as the
eager reader checks them (:func:`._v7_grid.grid_records`), and takes the piece from there.

An index the load does not need is never read, so its damage does not fail that load;
``sp.verify`` (and every reader but a sharded load's) reads them all. Errors raised here are
ManifestErrors (CorruptCheckpointError) named with :attr:`GridTensors.where` when the reader set
it. No I/O of its own: the indexes come through the caller's ``read_index``.
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, cast, overload

from savepoint.codecs import boxes
from savepoint.codecs.manifest._checks import dtype_and_shape, require, show
from savepoint.codecs.manifest._records import (
    BLOCKED,
    NAME,
    ManifestError,
    ShardRecord,
    TensorRecord,
    whole,
)
from savepoint.codecs.manifest._v2_sharded import shard_record
from savepoint.codecs.manifest._v7_grid import GridTable, from_grid, grid_records, index_name

__all__ = ["GridPieces", "GridTensors"]


class _Axis:
    """One tensor dimension of ``size`` (at least 1) cut by mesh dimensions of sizes ``splits``
    (each over 1, in mesh order, ``torch.chunk`` style one inside the other): its ``count``
    non-empty intervals, in order, found by arithmetic (never listed: a hostile mesh may claim
    2**30 of them)."""

    __slots__ = ("chunk", "count", "full", "last", "parts", "size")

    def __init__(self, size: int, splits: tuple[int, ...]) -> None:
        self.size = size
        self.full: _Axis | None = None
        self.last: _Axis | None = None
        self.chunk = self.parts = self.count = 1
        if splits:
            chunk = -(-size // splits[0])
            self.chunk, self.parts = chunk, -(-size // chunk)
            self.full = _axis(chunk, splits[1:])
            self.last = _axis(size - (self.parts - 1) * chunk, splits[1:])
            self.count = (self.parts - 1) * self.full.count + self.last.count

    def locate(self, k: int) -> tuple[int, int, tuple[int, ...]]:
        """Interval ``k``: its start, stop, and coordinate on each mesh dimension cutting it."""
        if self.full is None or self.last is None:
            return 0, self.size, ()
        c = min(k // self.full.count, self.parts - 1)
        child = self.full if c < self.parts - 1 else self.last
        a, b, coords = child.locate(k - c * self.full.count)
        at = c * self.chunk
        return at + a, at + b, (c, *coords)

    def find(self, x: int) -> int:
        """The interval holding position ``x`` (``0 <= x < size``)."""
        if self.full is None or self.last is None:
            return 0
        c = min(x // self.chunk, self.parts - 1)
        child = self.full if c < self.parts - 1 else self.last
        return c * self.full.count + child.find(x - c * self.chunk)


@functools.lru_cache(maxsize=4096)
def _axis(size: int, splits: tuple[int, ...]) -> _Axis:
    return _Axis(size, splits)


class GridPieces(Sequence[ShardRecord]):
    """The pieces of one tensor of a lazily read version 7 manifest (see the module docstring):
    regions from the grid, records read from their writers' indexes when asked for."""

    __slots__ = ("_axes", "_base", "_cut", "_got", "_mesh", "key", "owner", "shape", "total")

    def __init__(self, owner: GridTensors, key: str, position: int) -> None:
        table = owner.table
        self.owner, self.key = owner, key
        self.shape: tuple[int, ...] = tuple(table.raw[key]["shape"])
        mesh, grid = table.mesh, table.grids[key]
        self._mesh = mesh
        self._got: dict[int, ShardRecord] = {}
        if not math.prod(self.shape):  # no elements: one piece, held whole, written as replicated
            grid = (None,) * len(mesh)
        # per tensor dimension, the mesh dimensions cutting it (a mesh dimension of 1 cuts nothing)
        self._cut = [
            [m for m, (n, d) in enumerate(zip(mesh, grid)) if d == dim and n > 1]
            for dim in range(len(self.shape))
        ]
        if not math.prod(self.shape):
            self._cut = [[] for _ in self.shape]
        self._axes = [
            _axis(size, tuple(mesh[m] for m in cut)) for size, cut in zip(self.shape, self._cut)
        ]
        self.total = math.prod(a.count for a in self._axes)
        base = [0] * len(mesh)
        chosen = position
        for m in reversed(range(len(mesh))):
            if grid[m] is None:
                chosen, base[m] = divmod(chosen, mesh[m])
        self._base = base

    def __len__(self) -> int:
        return self.total

    @overload
    def __getitem__(self, i: int) -> ShardRecord: ...

    @overload
    def __getitem__(self, i: slice) -> tuple[ShardRecord, ...]: ...

    def __getitem__(self, i: int | slice) -> ShardRecord | tuple[ShardRecord, ...]:
        if isinstance(i, slice):
            return tuple(self[j] for j in range(self.total)[i])
        i = operator.index(i)
        if i < 0:
            i += self.total
        if not 0 <= i < self.total:
            raise IndexError(i)
        got = self._got.get(i)
        if got is None:
            got = self._got[i] = self.owner.piece(self, i)
        return got

    def _at(self, ks: Sequence[int]) -> tuple[boxes.Box, list[tuple[int, ...]]]:
        located = [axis.locate(k) for axis, k in zip(self._axes, ks)]
        return tuple((a, b) for a, b, _ in located), [c for _, _, c in located]

    def _ks(self, i: int) -> list[int]:
        ks = []
        for axis in reversed(self._axes):
            i, k = divmod(i, axis.count)
            ks.append(k)
        return ks[::-1]

    def region(self, i: int) -> boxes.Box:
        """Piece ``i``'s box, from the grid (nothing read)."""
        return self._at(self._ks(i))[0]

    def writer(self, i: int) -> int:
        """The rank whose index should hold piece ``i`` (see the module docstring)."""
        coord = list(self._base)
        for cut, coords in zip(self._cut, self._at(self._ks(i))[1]):
            for m, c in zip(cut, coords):
                coord[m] = c
        rank = 0
        for n, c in zip(self._mesh, coord):
            rank = rank * n + c
        return rank

    def near(self, want: boxes.Region) -> list[tuple[int, boxes.Box]]:
        """``(i, region)`` of the pieces that may meet ``want`` (a region inside the tensor): for
        a box exactly those meeting it, for a flat range those meeting its rows; nothing read."""
        if isinstance(want, boxes.Flat):
            if want.stop <= want.start:
                return []
            if not self.shape:
                return [(0, ())]
            inner = math.prod(self.shape[1:]) or 1
            rows = ((want.start // inner, (want.stop - 1) // inner + 1),)
            want = rows + tuple((0, n) for n in self.shape[1:])
        ranges = []
        for axis, (lo, hi) in zip(self._axes, want):
            if hi <= lo:
                return []
            ranges.append(range(axis.find(lo), axis.find(hi - 1) + 1))
        out = []
        for ks in itertools.product(*ranges):
            i = 0
            for axis, k in zip(self._axes, ks):
                i = i * axis.count + k
            out.append((i, self._at(ks)[0]))
        return out

    def __iter__(self) -> Iterator[ShardRecord]:
        for i in range(self.total):
            yield self[i]


class GridTensors(Mapping[str, TensorRecord]):
    """The tensor records of a lazily read version 7 manifest (see the module docstring)."""

    def __init__(self, table: GridTable) -> None:
        self.table = table
        self.where: str | None = None  # how errors name the checkpoint (set by the reader)
        self._position = {key: i for i, key in enumerate(table.raw)}
        self._records: dict[str, TensorRecord] = {}
        self._listed: dict[tuple[str, str], dict[boxes.Region, ShardRecord]] = {}
        self._full: dict[str, TensorRecord] | None = None

    @property
    def read(self) -> list[str]:
        """The index files read so far, in order."""
        return self.table.index_files.read

    def __getitem__(self, key: str) -> TensorRecord:
        found = self._records.get(key)
        if found is not None:
            return found
        t = self.table.raw[key]
        pieces = GridPieces(self, key, self._position[key])
        # Each piece is written by its own rank, each rank's index recorded: a grid giving more
        # pieces than there are indexes is a lie (a mesh claiming 2**30 places), refused before
        # a read plan lists them (``near``: one entry per piece meeting a region).
        indices = len(self.table.indices)
        if len(pieces) > indices:
            self._fail(
                f"tensor {key!r}: its grid {show(list(self.table.grids[key]))} gives "
                f"{len(pieces)} pieces on mesh {show(list(self.table.mesh))}, more than the "
                f"{indices} index files hold (one piece per rank)"
            )
        if len(pieces) == 1 and math.prod(pieces.shape) > 0:
            found = whole(t["dtype"], pieces.shape, (pieces[0],))
        else:  # (without elements: no byte of it is read, nor its writer's index, unless asked)
            found = TensorRecord(t["dtype"], pieces.shape, "", 0, 0, "", cast(Any, pieces))
        self._records[key] = found
        return found

    def __contains__(self, key: object) -> bool:
        return key in self.table.grids

    def __iter__(self) -> Iterator[str]:
        return iter(self.table.raw)

    def __len__(self) -> int:
        return len(self.table.raw)

    def piece(self, pieces: GridPieces, i: int) -> ShardRecord:
        """Piece ``i`` of ``pieces``: from its writer's index, or (the guess failing) from every
        index, checked."""
        try:
            with self.table.index_files.lock:
                return self._piece(pieces, i)
        except ManifestError as exc:
            self._fail(str(exc))
            raise  # unreachable

    def _fail(self, message: str) -> None:
        """Raise a ManifestError saying ``message``, named with :attr:`where` when set."""
        if self.where is None:
            raise ManifestError(message)
        raise ManifestError(f"{self.where}/{NAME}: {message}", path=self.where) from None

    def _piece(self, pieces: GridPieces, i: int) -> ShardRecord:
        region, key = pieces.region(i), pieces.key
        if self._full is None:
            name = index_name(pieces.writer(i))
            if name in self.table.indices:
                found = self._pieces_in(name, key).get(region)
                if found is not None:
                    return found
            self._full = grid_records(self.table)  # the guess failed: every index, checked
        for shard in self._full[key].layout():
            if shard.region == region:
                return shard
        require(False, f"tensor {key!r}: no index holds its piece {boxes.show(region)}")
        raise AssertionError  # unreachable

    def _pieces_in(self, name: str, key: str) -> dict[boxes.Region, ShardRecord]:
        """The pieces of tensor ``key`` that index ``name`` lists, each checked."""
        found = self._listed.get((name, key))
        if found is not None:
            return found
        table = self.table
        t = table.raw[key]
        shape, itemsize = dtype_and_shape(key, t)
        grid, mesh = table.grids[key], table.mesh
        found = {}
        for j, raw in enumerate(table.index_files.shards(name).get(key, ())):
            what = f"index {name!r}: tensor {key!r} shard {j}"
            s = shard_record(what, raw, t["dtype"], shape, itemsize, table.files, BLOCKED)
            require(
                not math.prod(shape) or from_grid(s.region, shape, mesh, grid),
                f"{what}: piece {boxes.show(s.region)} is not a box its grid {list(grid)} "
                f"gives on mesh {list(mesh)}",
            )
            require(s.region not in found, f"{what}: pieces overlap (listed twice)")
            found[s.region] = s
        self._listed[(name, key)] = found
        return found
