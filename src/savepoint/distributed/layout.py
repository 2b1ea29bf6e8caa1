"""Regular (grid) layouts: a sharded save planned in O(tensors + ranks), not tensors x ranks.

In SPMD training every rank holds the same keys with the same global shapes and placements
(DTensor ``Shard(d)`` / ``Replicate`` over one device mesh: FSDP2, TP, their product); which
piece a rank holds follows from its mesh coordinate. Such a state is described once, the same on
every rank, as a :class:`Layout` (the state's tree, the mesh shape, and per tensor its key, dtype,
global shape and :class:`Grid` placements), and a rank sends rank 0 only a :class:`Compact`: the
layout's digest, its coordinate and the bytes it writes. Rank 0 checks (:func:`check`) that every
digest is its own and that the coordinates tile the mesh (each coordinate exactly once); the
global plan is then implied: who writes what is a rule every rank applies to its own pieces
(:func:`writes`), so rank 0 neither receives nor sends any rank's list of pieces.

The writer of a piece: a piece is held by every rank whose coordinate agrees on the mesh
dimensions the tensor is sharded over; of these, the one whose coordinate on the replicated
dimensions is the tensor's position in the layout modulo the replica count (unravelled over those
dimensions, C order), so replicated tensors are spread over their holders by count. A tensor
without elements is held whole by every rank, and written by one, as if replicated.

A state is regular when every tensor piece is a ``Shard`` carrying a :class:`Grid` (DTensors read
by :func:`savepoint.distributed.shard.from_dtensor`; the world simulator's) on one mesh with one
coordinate, or a plain tensor (replicated on every mesh dimension), and the tree holds no
``Partitioned`` mapping; at least one tensor must carry a grid (the mesh comes from it). Any other
state (``FlatShard``, a ``Shard`` given by offsets, differing keys) is planned as before
(:func:`savepoint.distributed.plan.merge`), and so is every state when any rank's is irregular or
the digests differ (then rank 0 asks every rank for its whole plan, and ``merge`` names what
differs). No I/O; nothing here imports torch.
"""

from __future__ import annotations

import json
import marshal
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from savepoint.codecs import boxes, checksum

__all__ = [
    "Compact",
    "Grid",
    "Layout",
    "LayoutBuilder",
    "check",
    "grid_box",
    "parse_grid",
    "same_tree",
    "tree_bytes",
    "writes",
    "written",
]


@dataclass(frozen=True)
class Grid:
    """How one tensor is spread over a device mesh: the mesh's shape, this rank's coordinate,
    and per mesh dimension the tensor dimension split over it (``torch.chunk`` style, left to
    right, as DTensor's ``Shard(d)``), or None (``Replicate``)."""

    mesh: tuple[int, ...]
    coord: tuple[int, ...]
    dims: tuple[int | None, ...]

    def text(self) -> str:
        """``"8,2|3,1|0,-"``: mesh, coordinate, dims (``-`` replicated); see :func:`parse_grid`."""
        dims = ",".join("-" if d is None else str(d) for d in self.dims)
        return f"{','.join(map(str, self.mesh))}|{','.join(map(str, self.coord))}|{dims}"


def parse_grid(text: str) -> Grid:
    mesh, coord, dims = text.split("|")
    return Grid(
        tuple(int(n) for n in mesh.split(",")),
        tuple(int(n) for n in coord.split(",")),
        tuple(None if d == "-" else int(d) for d in dims.split(",")),
    )


def grid_box(
    shape: Sequence[int], mesh: Sequence[int], coord: Sequence[int], dims: Sequence[int | None]
) -> boxes.Box:
    """The box of ``coord`` (as :func:`savepoint.distributed.shard.dtensor_box`)."""
    start = [0] * len(shape)
    size = list(shape)
    for n, c, d in zip(mesh, coord, dims):
        if d is None:
            continue
        chunk = -(-size[d] // n)
        first = min(c * chunk, size[d])
        size[d] = max(0, min(chunk, size[d] - first))
        start[d] += first
    return tuple((a, a + n) for a, n in zip(start, size))


def tree_bytes(node: Any) -> bytes | None:
    """A flattened state's or plan's tree (plain data) as bytes that differ whenever the trees
    do, the types of plain values included: ``==`` holds ``1``, ``1.0`` and ``True`` equal, and
    ``0.0`` and ``-0.0``, which a manifest writes differently. Marshal version 0 (no references:
    the bytes depend on the values alone; C speed, about ``==``'s); a tree holding a subclass
    of str (an enum's value or key, written as its string), which marshal refuses, as JSON.
    None: not plain data."""
    try:
        return marshal.dumps(node, 0)
    except ValueError:
        pass
    try:
        text = json.dumps(node, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError):
        return None
    return b"json:" + text.encode()


def same_tree(a: Any, b: Any) -> bool:
    """Whether two trees are the same, value types included (:func:`tree_bytes`)."""
    if a is b:
        return True
    left = tree_bytes(a)
    return left is not None and left == tree_bytes(b)


@dataclass(frozen=True)
class Compact:
    """What a rank with a regular state sends rank 0 in the plan step (a few dozen bytes)."""

    digest: str  # its Layout's
    coord: tuple[int, ...]
    nbytes: int  # what it writes

    def __reduce__(self) -> tuple[Any, ...]:
        return (Compact, (self.digest, self.coord, self.nbytes))


@dataclass
class Layout:
    """A regular state's description, the same on every rank (see the module docstring)."""

    tree: dict[str, Any]
    mesh: tuple[int, ...]
    keys: list[str]
    dtypes: list[str]
    shapes: list[tuple[int, ...]]
    dims: list[tuple[int | None, ...]]
    _digest: str | None = field(default=None, repr=False)

    @property
    def digest(self) -> str:
        """XXH3-64 of the layout (marshal version 0: plain values, no references, so the bytes
        depend on the values only)."""
        if self._digest is None:
            data = tree_bytes(
                (self.tree, self.mesh, self.keys, self.dtypes, self.shapes, self.dims)
            )
            if data is None:
                raise ValueError("a layout holds something other than plain data")
            self._digest = checksum.digest(data)
        return self._digest

    def tensors(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        return {k: (d, s) for k, d, s in zip(self.keys, self.dtypes, self.shapes)}


class LayoutBuilder:
    """Collects a rank's tensors while :func:`savepoint.distributed.save.describe` walks its
    state; :meth:`done` is the :class:`Layout` (and this rank's coordinate), or None for an
    irregular state."""

    def __init__(self) -> None:
        self.regular = True
        self.mesh: tuple[int, ...] | None = None
        self.coord: tuple[int, ...] | None = None
        self.keys: list[str] = []
        self.dtypes: list[str] = []
        self.shapes: list[tuple[int, ...]] = []
        self.dims: list[tuple[int | None, ...] | None] = []

    def irregular(self) -> None:
        self.regular = False

    def add(self, key: str, dtype: str, shape: tuple[int, ...], grid: Grid | None) -> None:
        if not self.regular:
            return
        self.keys.append(key)
        self.dtypes.append(dtype)
        self.shapes.append(shape)
        if grid is None:  # a plain tensor: replicated on every mesh dimension
            self.dims.append(None)
            return
        if self.mesh is None:
            self.mesh, self.coord = grid.mesh, grid.coord
        elif grid.mesh != self.mesh or grid.coord != self.coord:
            self.regular = False
            return
        self.dims.append(grid.dims)

    def done(self, tree: dict[str, Any]) -> tuple[Layout, tuple[int, ...]] | None:
        if not self.regular or self.mesh is None or self.coord is None:
            return None
        every: tuple[None, ...] = (None,) * len(self.mesh)
        dims = [every if d is None else d for d in self.dims]
        layout = Layout(tree, self.mesh, self.keys, self.dtypes, self.shapes, dims)
        return layout, self.coord


def writes(layout: Layout, coord: Sequence[int]) -> set[int]:
    """The positions (in ``layout.keys``) of the tensors whose piece at ``coord`` this rank
    writes (see the module docstring); pieces without elements are the caller's to skip."""
    return set(written(layout, coord))


def written(layout: Layout, coord: Sequence[int]) -> list[int]:
    """:func:`writes`, in ascending order: computed with numpy for a layout of many tensors
    (about 2 ms at 50,000 instead of 50), tensor by tensor for a few (or odd values)."""
    if len(layout.dims) >= _VECTOR_FROM:
        try:
            return _written_vector(layout, coord)
        except (TypeError, ValueError, OverflowError):  # not plain ints: as below, exactly
            pass
    out: list[int] = []
    mesh = layout.mesh
    replicated = (None,) * len(mesh)
    for i, dims in enumerate(layout.dims):
        if not math.prod(layout.shapes[i]):  # no elements: every rank holds it whole; one writes
            dims = replicated
        chosen = i
        mine = True
        for n, c, d in zip(reversed(mesh), reversed(coord), reversed(dims)):
            if d is not None:
                continue
            if c != chosen % n:
                mine = False
                break
            chosen //= n
        if mine:
            out.append(i)
    return out


_VECTOR_FROM = 64  # tensors (below, the loop is as fast)
_BOUND = 1 << 62


def _written_vector(layout: Layout, coord: Sequence[int]) -> list[int]:
    """:func:`written` with numpy: the loop's arithmetic per mesh dimension (last first) over
    every tensor at once; a tensor's replicated dimensions looked up per distinct ``dims``."""
    mesh, dims = layout.mesh, layout.dims
    if len(dims) != len(layout.shapes):
        raise ValueError("dims and shapes differ in length")
    sizes = [int(n) for n in reversed(mesh)]
    coords = [int(c) for c in reversed(coord)]
    if any(type(n) is not int or n <= 0 for n in mesh) or any(
        type(c) is not int and not isinstance(c, np.integer) for c in coord
    ):
        raise TypeError("not positive ints")
    if any(abs(c) >= _BOUND for c in coords) or len(dims) >= _BOUND:
        raise OverflowError("too large for int64")
    depth = min(len(sizes), len(coords))
    distinct = {d: i for i, d in enumerate(dict.fromkeys(dims))}  # (TypeError: unhashable)
    table = np.zeros((len(distinct), depth), dtype=bool)  # replicated, by reversed position
    for d, row in distinct.items():
        tail = list(reversed(d))[:depth]
        table[row, : len(tail)] = [x is None for x in tail]
    count = len(dims)
    codes = np.fromiter(map(distinct.__getitem__, dims), dtype=np.intp, count=count)
    has = np.fromiter(map(bool, map(math.prod, layout.shapes)), dtype=bool, count=count)
    replicated = table[codes]
    replicated[~has] = True  # no elements: replicated on every mesh dimension
    chosen = np.arange(count, dtype=np.int64)
    mine = np.ones(count, dtype=bool)
    for j in range(depth):
        n, c, rep = sizes[j], coords[j], replicated[:, j]
        mine &= ~rep | (chosen % n == c)
        chosen = np.where(rep, chosen // n, chosen)
    return np.flatnonzero(mine).tolist()  # type: ignore[no-any-return]


def check(sent: Sequence[Compact], layout: Layout) -> list[tuple[str, str]]:
    """Rank 0: the problems (key, what) that keep ``sent`` (index = rank) from being one
    regular save of ``layout``; empty when the global plan is implied. O(ranks): checked with
    sets and numpy first (a few ms at 8,192 ranks), rank by rank only to say what is wrong."""
    coords = [c.coord for c in sent]
    if _tiles(coords, layout.mesh) and {c.digest for c in sent} == {layout.digest}:
        return []
    problems: list[tuple[str, str]] = []
    differ = [r for r, c in enumerate(sent) if c.digest != layout.digest]
    if differ:
        problems.append(("", f"ranks {differ[:20]} describe a different layout"))
    world = math.prod(layout.mesh)
    if world != len(sent):
        problems.append(("", f"mesh {list(layout.mesh)} has {world} places, {len(sent)} ranks"))
    seen: dict[tuple[int, ...], int] = {}
    for r, c in enumerate(sent):
        if len(c.coord) != len(layout.mesh) or not all(
            0 <= x < n for x, n in zip(c.coord, layout.mesh)
        ):
            problems.append(("", f"rank {r}: coordinate {list(c.coord)} is outside the mesh"))
        elif c.coord in seen:
            problems.append(("", f"ranks {seen[c.coord]} and {r} share coordinate {c.coord}"))
        else:
            seen[c.coord] = r
    return problems


def _tiles(coords: list[tuple[int, ...]], mesh: tuple[int, ...]) -> bool:
    """Whether ``coords`` (index = rank) are every place of ``mesh`` once (vectorised)."""
    if not coords or math.prod(mesh) != len(coords) or len(set(coords)) != len(coords):
        return False
    try:
        grid = np.asarray(coords, dtype=np.int64)
    except (ValueError, TypeError, OverflowError):  # ragged or not integers
        return False
    bounds = np.asarray(mesh, dtype=np.int64)
    return grid.shape == (len(coords), len(mesh)) and bool(
        (grid >= 0).all() and (grid < bounds).all()
    )
