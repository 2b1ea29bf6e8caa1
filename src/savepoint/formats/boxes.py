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

import heapq
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

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
    they hold every element.
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
    clash = _first_overlap(boxes)
    if clash is not None:
        return f"boxes {_show(clash[0])} and {_show(clash[1])} overlap"
    if covered != total:
        return f"boxes hold {covered} of {total} elements"
    return None


def _first_overlap(boxes: Sequence[Box]) -> tuple[Box, Box] | None:
    """Two overlapping boxes, if any: a sweep along the dimension with the most distinct starts,
    comparing only boxes whose ranges along it intersect (linear-ish for tensor-parallel splits)."""
    if len(boxes) < 2 or not boxes[0]:
        return (boxes[0], boxes[1]) if len(boxes) >= 2 else None
    ndim = len(boxes[0])
    dim = max(range(ndim), key=lambda d: len({b[d][0] for b in boxes}))
    order = sorted(boxes, key=lambda b: b[dim][0])
    active: list[tuple[int, int, Box]] = []  # (stop along dim, tiebreak, box)
    for i, b in enumerate(order):
        start = b[dim][0]
        while active and active[0][0] <= start:
            heapq.heappop(active)
        for _, _, other in active:
            if intersect(b, other) is not None:
                return other, b
        heapq.heappush(active, (b[dim][1], i, b))
    return None


def _show(region: Region) -> str:
    if isinstance(region, Flat):
        return f"flat[{region.start}:{region.stop}]"
    return "[" + ", ".join(f"{a}:{b}" for a, b in region) + "]"


def show(region: Region) -> str:
    """``[0:2, 0:6]`` or ``flat[0:12]``: how errors and ``inspect`` print a region."""
    return _show(region)
