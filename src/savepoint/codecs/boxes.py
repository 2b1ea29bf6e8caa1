"""Where the bytes of a shard sit in its tensor: boxes, flat ranges, and the pieces they map to.

A sharded tensor of global shape ``S`` is stored as shards, each holding one *region*:

- a **box** ``((start_0, stop_0), ..., (start_{n-1}, stop_{n-1}))``: the elements whose index lies in
  ``[start_d, stop_d)`` on every dimension ``d``, stored contiguously in C order with shape
  ``(stop_0 - start_0, ...)`` (tensor parallel, DTensor ``Shard(dim)``, a replicated tensor: the
  full box). A 0-d tensor has the empty box ``()``, of volume 1;
- a **flat** range ``Flat(start, stop)``: elements ``[start, stop)`` of the tensor flattened in C
  order, stored as a 1-D run (FSDP-style flat parameters, ZeRO-3 partitions).

Both kinds reduce to *pieces*: a piece is a box whose elements, in C order, are one contiguous run
of a buffer starting at element ``offset``. A box region is one piece at offset 0; a flat range is
at most ``2 * ndim - 1`` pieces (a partial row, whole rows, whole blocks..., mirrored at the end).
Copying between any two regions is then copying the intersection of pieces, with numpy views.

Everything here is pure arithmetic on Python integers (no overflow, no I/O): the manifest parser
uses :func:`check_cover` on hostile input, the planners use :func:`pieces` and :func:`overlaps`.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

__all__ = [
    "Box",
    "Flat",
    "Piece",
    "Region",
    "check_cover",
    "extents",
    "full",
    "inside",
    "intersect",
    "is_full",
    "overlaps",
    "pieces",
    "relative",
    "run_pieces",
    "show",
    "size",
    "span",
    "split",
    "volume",
]

Box = tuple[tuple[int, int], ...]


@dataclass(frozen=True, order=True)
class Flat:
    """Elements ``[start, stop)`` of a tensor flattened in C order."""

    start: int
    stop: int


Region = Box | Flat


@dataclass(frozen=True)
class Piece:
    """A box whose elements (in C order) are a contiguous run of a buffer from element ``offset``."""

    box: Box
    offset: int


def full(shape: Sequence[int]) -> Box:
    return tuple((0, int(n)) for n in shape)


def extents(box: Box) -> tuple[int, ...]:
    return tuple(stop - start for start, stop in box)


def volume(box: Box) -> int:
    return math.prod(stop - start for start, stop in box)


def size(region: Region, shape: Sequence[int]) -> int:
    """Number of elements in ``region``."""
    if isinstance(region, Flat):
        return region.stop - region.start
    return volume(region)


def is_full(region: Region, shape: Sequence[int]) -> bool:
    if isinstance(region, Flat):
        return region.start == 0 and region.stop == math.prod(shape)
    return region == full(shape)


def inside(region: Region, shape: Sequence[int]) -> bool:
    """Whether ``region`` is well-formed for a tensor of ``shape`` (bounds, rank, order)."""
    if isinstance(region, Flat):
        return 0 <= region.start <= region.stop <= math.prod(shape)
    return len(region) == len(shape) and all(
        0 <= start <= stop <= n for (start, stop), n in zip(region, shape)
    )


def intersect(a: Box, b: Box) -> Box | None:
    """The common box of ``a`` and ``b``, or None when they share no element."""
    out = []
    for (a0, a1), (b0, b1) in zip(a, b):
        lo, hi = max(a0, b0), min(a1, b1)
        if lo >= hi:
            return None
        out.append((lo, hi))
    return tuple(out)


def _ravel(index: Sequence[int], shape: Sequence[int]) -> int:
    flat = 0
    for i, n in zip(index, shape):
        flat = flat * n + i
    return flat


def pieces(region: Region, shape: Sequence[int]) -> list[Piece]:
    """The pieces of a buffer holding ``region`` of a tensor of ``shape``, in buffer order
    (empty when the region holds no element)."""
    if isinstance(region, Flat):
        found: list[Box] = []
        _decompose(region.start, region.stop, tuple(shape), (), found)
        return [Piece(b, _ravel([s for s, _ in b], shape) - region.start) for b in found]
    return [Piece(region, 0)] if volume(region) else []


def run_pieces(region: Region, shape: Sequence[int], start: int, stop: int) -> list[Piece]:
    """The pieces of elements ``[start, stop)`` of a buffer holding ``region`` of a tensor of
    ``shape`` (a contiguous run of a stored shard: a chunk of it read on its own), boxes in the
    tensor's coordinates, offsets counted from ``start``."""
    if isinstance(region, Flat):
        return pieces(Flat(region.start + start, region.start + stop), shape)
    found: list[Box] = []
    _decompose(start, stop, extents(region), (), found)
    origin = [lo for lo, _ in region]
    ext = extents(region)
    return [
        Piece(
            tuple((lo + o, hi + o) for (lo, hi), o in zip(box, origin)),
            _ravel([s for s, _ in box], ext) - start,
        )
        for box in found
    ]


def _decompose(start: int, stop: int, shape: tuple[int, ...], prefix: Box, out: list[Box]) -> None:
    """Boxes for elements ``[start, stop)`` of a (sub)tensor of ``shape`` reached through the
    fixed outer indices ``prefix``: a partial first row, whole rows, a partial last row."""
    if start >= stop:
        return
    if not shape:  # a 0-d (sub)tensor: its single element
        out.append(prefix)
        return
    inner = math.prod(shape[1:])
    if inner == 0:
        return
    if len(shape) == 1:
        out.append((*prefix, (start, stop)))
        return
    first, last = -(-start // inner), stop // inner  # whole rows are [first, last)
    if first > last:  # start and stop fall inside one row
        row = start // inner
        _decompose(
            start - row * inner, stop - row * inner, shape[1:], (*prefix, (row, row + 1)), out
        )
        return
    if start < first * inner:
        row = first - 1
        _decompose(start - row * inner, inner, shape[1:], (*prefix, (row, row + 1)), out)
    if first < last:
        out.append((*prefix, (first, last), *full(shape[1:])))
    if last * inner < stop:
        _decompose(0, stop - last * inner, shape[1:], (*prefix, (last, last + 1)), out)


def overlaps(src: Sequence[Piece], dst: Sequence[Piece]) -> Iterator[tuple[Piece, Piece, Box]]:
    """Every (source piece, destination piece, common box) with at least one element."""
    for d in dst:
        for s in src:
            common = intersect(s.box, d.box)
            if common is not None:
                yield s, d, common


def relative(box: Box, piece: Piece) -> tuple[slice, ...]:
    """Slices selecting ``box`` inside an array shaped like ``piece.box``."""
    return tuple(slice(b0 - p0, b1 - p0) for (b0, b1), (p0, _) in zip(box, piece.box))


def span(box: Box, piece: Piece) -> tuple[int, int]:
    """Element range ``[lo, hi)`` of the buffer that ``box`` (inside ``piece``) touches."""
    ext = extents(piece.box)
    first = _ravel(tuple(b0 - p0 for (b0, _), (p0, _) in zip(box, piece.box)), ext)
    last = _ravel(tuple(b1 - 1 - p0 for (_, b1), (p0, _) in zip(box, piece.box)), ext)
    return piece.offset + first, piece.offset + last + 1


def split(box: Box, piece: Piece, limit: int) -> Iterator[Box]:
    """Cut ``box`` (inside ``piece``) into boxes that each touch at most about ``limit`` elements
    of the buffer, in buffer order, so a copy can follow a checksum pass while it is in cache."""
    if not box:
        yield box
        return
    yield from _split(box, extents(piece.box), 0, max(1, limit))


def _split(box: Box, ext: tuple[int, ...], dim: int, limit: int) -> Iterator[Box]:
    stride = math.prod(ext[dim + 1 :])  # buffer elements per step along ``dim``
    start, stop = box[dim]
    if stride * (stop - start) <= limit:
        yield box
    elif stride <= limit:
        step = limit // stride
        for lo in range(start, stop, step):
            yield (*box[:dim], (lo, min(stop, lo + step)), *box[dim + 1 :])
    else:  # one step along ``dim`` is already too big: cut each one along the next dimension
        for i in range(start, stop):
            yield from _split((*box[:dim], (i, i + 1), *box[dim + 1 :]), ext, dim + 1, limit)


def check_cover(regions: Sequence[Region], shape: Sequence[int]) -> str | None:
    """Why ``regions`` do not tile a tensor of ``shape`` exactly, or None when they do.

    Rules: every region lies inside the tensor; all are boxes or all flat ranges; none is empty
    (except the single region of a tensor without elements); no two share an element; together
    they hold every element. Runs in O(n log n) for n regions, except boxes irregular in three or
    more dimensions at once (no grid, no sharding scheme writes them), which get at most about
    a second of pair comparisons and are refused as "too many to check" past that.
    """
    total = math.prod(shape)
    if not regions:
        return "no shards"
    for r in regions:
        if not inside(r, shape):
            return f"region {_show(r)} lies outside shape {list(shape)}"
    if total == 0:
        if len(regions) != 1:
            return "a tensor without elements has exactly one shard"
        return None
    if any(size(r, shape) == 0 for r in regions):
        return "a shard holds no element"
    if len({isinstance(r, Flat) for r in regions}) > 1:
        return "mixes flat ranges and boxes"
    if isinstance(regions[0], Flat):
        flats = sorted(r for r in regions if isinstance(r, Flat))
        position = 0
        for f in flats:
            if f.start != position:
                what = "overlap" if f.start < position else "gap"
                return f"flat ranges {what} at element {min(f.start, position)}"
            position = f.stop
        return None if position == total else f"flat ranges end at {position}, not {total}"
    boxes = [r for r in regions if not isinstance(r, Flat)]
    covered = sum(volume(b) for b in boxes)
    try:
        clash = _first_overlap(boxes)
    except _TooIrregular:
        return (
            f"{len(boxes)} boxes irregular in three or more dimensions are too many to check "
            "for overlaps"
        )
    if clash is not None:
        return f"boxes {_show(clash[0])} and {_show(clash[1])} overlap"
    if covered != total:
        return f"boxes hold {covered} of {total} elements"
    return None


def _first_overlap(boxes: Sequence[Box]) -> tuple[Box, Box] | None:
    """Two overlapping boxes, if any, in O(n log n) (O(n * ndim) for boxes on one grid).

    The verdict is defined by a sweep along the dimension with the most distinct starts: boxes in
    order of their start along it (ties in input order), each compared with the earlier boxes
    still *active* (ending after its start) in heap order; the first intersecting pair is
    returned. Comparing each box with every active one is quadratic (a 200 x 200 grid of boxes
    has 200 active at every step), so :func:`_first_clash` finds which box is the first to meet an
    earlier one without comparing pairs, and only that box is compared with the active set.
    Raises :class:`_TooIrregular` when no fast method applies and the comparison budget runs out.
    """
    if len(boxes) < 2 or not boxes[0]:
        return (boxes[0], boxes[1]) if len(boxes) >= 2 else None
    ndim = len(boxes[0])
    dim = max(range(ndim), key=lambda d: len({b[d][0] for b in boxes}))
    order = sorted(boxes, key=lambda b: b[dim][0])
    k = _first_clash(order, dim)
    if k is None:
        return None
    active: list[tuple[int, int, Box]] = []  # (stop along dim, tiebreak, box): a min-heap
    for i, b in enumerate(order[: k + 1]):
        start = b[dim][0]
        while active and active[0][0] <= start:
            heapq.heappop(active)
        if i == k:
            for _, _, other in active:
                if intersect(b, other) is not None:
                    return other, b
        heapq.heappush(active, (b[dim][1], i, b))
    raise AssertionError("unreachable: the first clashing box meets an active box")


class _TooIrregular(Exception):
    """Boxes in three or more irregular dimensions that would take too long to check."""


# Pairwise comparisons allowed where no fast method applies (boxes irregular in 3+ dimensions,
# which no sharding scheme writes): about a second, so a hostile manifest cannot stall a reader.
_BUDGET = 1_000_000


def _first_clash(order: Sequence[Box], dim: int) -> int | None:
    """Index of the first box of ``order`` (sorted by start along ``dim``) that shares an element
    with an earlier one, or None when no two boxes overlap."""
    grid = _grid_clash(order)
    if grid != _NO_GRID:
        return grid
    ndim = len(order[0])
    # A dimension on which every box has the same range decides nothing: leave it out.
    rest = [d for d in range(ndim) if d != dim and len({b[d] for b in order}) > 1]
    if not rest:
        reach = -1  # the furthest stop along ``dim`` of the boxes so far
        for i, b in enumerate(order):
            if b[dim][0] < reach:
                return i
            reach = max(reach, b[dim][1])
        return None
    if len(rest) == 1:
        return _sweep_clash(order, dim, rest[0])
    return _budgeted_clash(order, dim)


_NO_GRID = -1  # what _grid_clash returns when the grid would have too many cells


def _grid_clash(order: Sequence[Box]) -> int | None:
    """:func:`_first_clash` over the grid of every start and stop, cell by cell, when the grid
    has not many more cells than there are boxes (any tiling a sharding scheme writes);
    :data:`_NO_GRID` when the grid is too big. Each cell is marked once, so the cost is O(cells + n * ndim)."""
    ndim = len(order[0])
    cuts = [sorted({c for b in order for c in b[d]}) for d in range(ndim)]
    cells = math.prod(len(c) - 1 for c in cuts)
    if cells > 4 * len(order) + 64:
        return _NO_GRID
    index = [{c: i for i, c in enumerate(cs)} for cs in cuts]
    strides = [math.prod(len(c) - 1 for c in cuts[d + 1 :]) for d in range(ndim)]
    taken = bytearray(cells)
    for i, b in enumerate(order):
        offsets = [0]
        for (lo, hi), at, stride in zip(b, index, strides):
            steps = range(at[lo] * stride, at[hi] * stride, stride)
            offsets = [o + s for o in offsets for s in steps]
        for o in offsets:
            if taken[o]:
                return i
            taken[o] = 1
    return None


def _sweep_clash(order: Sequence[Box], dim: int, other: int) -> int | None:
    """:func:`_first_clash` when boxes differ only along ``dim`` and ``other``: a sweep along
    ``dim`` keeping, in a max segment tree indexed by start along ``other``, the stop of each
    active box. A new box ``[s, e)`` meets an active one exactly when some active box starting
    before ``e`` stops after ``s``. Active boxes never share a start (they would overlap), so one
    slot per start suffices. O(n log n)."""
    starts = sorted({b[other][0] for b in order})
    slot = {s: i for i, s in enumerate(starts)}
    size = 1 << max(0, (len(starts) - 1).bit_length())
    tree = [-1] * (2 * size)

    def put(pos: int, value: int) -> None:
        pos += size
        tree[pos] = value
        pos >>= 1
        while pos:
            tree[pos] = max(tree[2 * pos], tree[2 * pos + 1])
            pos >>= 1

    def reach(stop: int) -> int:
        """The largest stored value in slots ``[0, stop)``."""
        best, lo, hi = -1, size, stop + size
        while lo < hi:
            if lo & 1:
                best = max(best, tree[lo])
                lo += 1
            if hi & 1:
                hi -= 1
                best = max(best, tree[hi])
            lo >>= 1
            hi >>= 1
        return best

    active: list[tuple[int, int]] = []  # (stop along dim, slot along other): a min-heap
    for i, b in enumerate(order):
        while active and active[0][0] <= b[dim][0]:
            put(heapq.heappop(active)[1], -1)
        lo, hi = b[other]
        if reach(bisect.bisect_left(starts, hi)) > lo:
            return i
        put(slot[lo], hi)
        heapq.heappush(active, (b[dim][1], slot[lo]))
    return None


def _budgeted_clash(order: Sequence[Box], dim: int) -> int | None:
    """:func:`_first_clash` by comparing each box with the active ones, within :data:`_BUDGET`."""
    budget = _BUDGET
    active: list[tuple[int, int, Box]] = []
    for i, b in enumerate(order):
        while active and active[0][0] <= b[dim][0]:
            heapq.heappop(active)
        budget -= len(active)
        if budget < 0:
            raise _TooIrregular
        if any(intersect(b, other) is not None for _, _, other in active):
            return i
        heapq.heappush(active, (b[dim][1], i, b))
    return None


def _show(region: Region) -> str:
    if isinstance(region, Flat):
        return f"flat[{region.start}:{region.stop}]"
    return "[" + ", ".join(f"{a}:{b}" for a, b in region) + "]"


def show(region: Region) -> str:
    """``[0:2, 0:6]`` or ``flat[0:12]``: how errors and ``inspect`` print a region."""
    return _show(region)
