"""The overlap check on shard boxes: same verdicts as the quadratic sweep, in O(n log n)."""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from savepoint.codecs import boxes
from savepoint.codecs.boxes import Box


def reference_overlap(bs: Sequence[Box]) -> tuple[Box, Box] | None:
    """The quadratic sweep that check_cover used before (issue 11): the verdict to keep."""
    if len(bs) < 2 or not bs[0]:
        return (bs[0], bs[1]) if len(bs) >= 2 else None
    ndim = len(bs[0])
    dim = max(range(ndim), key=lambda d: len({b[d][0] for b in bs}))
    order = sorted(bs, key=lambda b: b[dim][0])
    active: list[tuple[int, int, Box]] = []
    for i, b in enumerate(order):
        start = b[dim][0]
        while active and active[0][0] <= start:
            heapq.heappop(active)
        for _, _, other in active:
            if boxes.intersect(b, other) is not None:
                return other, b
        heapq.heappush(active, (b[dim][1], i, b))
    return None


@st.composite
def box_sets(draw: st.DrawFn) -> tuple[list[Box], tuple[int, ...]]:
    ndim = draw(st.integers(1, 4))
    shape = tuple(draw(st.lists(st.integers(1, 7), min_size=ndim, max_size=ndim)))
    # A tiling on a grid (some cells merged, some dropped, some duplicated) or free boxes.
    if draw(st.booleans()):
        cuts = [
            sorted({0, n, *draw(st.lists(st.integers(1, max(1, n - 1)), max_size=3))})
            for n in shape
        ]
        cells: list[Box] = [()]
        for cs in cuts:
            cells = [(*c, (a, b)) for c in cells for a, b in itertools.pairwise(cs)]
        picked = [c for c in cells if draw(st.integers(0, 9)) > 0]
        picked += draw(st.lists(st.sampled_from(cells), max_size=3))
        out = draw(st.permutations(picked)) if picked else [cells[0]]
        return list(out), shape
    one = st.tuples(*[st.tuples(st.integers(0, n - 1), st.integers(1, n)) for n in shape]).map(
        lambda b: tuple((min(a, z - 1), max(a + 1, z)) for a, z in b)
    )
    return draw(st.lists(one, min_size=1, max_size=12)), shape


@settings(max_examples=800, deadline=None)
@given(box_sets())
def test_same_verdict_as_the_quadratic_sweep(case: tuple[list[Box], tuple[int, ...]]) -> None:
    bs, _ = case
    assert boxes._first_overlap(bs) == reference_overlap(bs)


@settings(max_examples=300, deadline=None)
@given(box_sets())
def test_check_cover_agrees_with_brute_force(case: tuple[list[Box], tuple[int, ...]]) -> None:
    bs, shape = case
    problem = boxes.check_cover(bs, shape)
    counts: dict[tuple[int, ...], int] = {}
    for b in bs:
        points: list[tuple[int, ...]] = [()]
        for lo, hi in b:
            points = [(*p, i) for p in points for i in range(lo, hi)]
        for p in points:
            counts[p] = counts.get(p, 0) + 1
    total = 1
    for n in shape:
        total *= n
    tiles = len(counts) == total and all(c == 1 for c in counts.values())
    assert (problem is None) == tiles, problem
    if any(c > 1 for c in counts.values()):
        assert problem is not None and "overlap" in problem


@pytest.mark.parametrize("ndim", [1, 2, 3])
def test_zero_d_and_rank_edge_cases(ndim: int) -> None:
    assert boxes._first_overlap([((0, 1),) * ndim]) is None
    assert boxes._first_overlap([(), ()]) == ((), ())


def grid(n: int, m: int) -> list[Box]:
    return [((i, i + 1), (j, j + 1)) for i in range(n) for j in range(m)]


def test_a_large_grid_is_checked_quickly() -> None:
    """A 300 x 300 grid (90,000 shards) took minutes with the quadratic sweep (200 x 200: 5.6 s)."""
    bs = grid(300, 300)
    began = time.perf_counter()
    assert boxes.check_cover(bs, (300, 300)) is None
    clash = boxes.check_cover([*bs, ((150, 151), (7, 8))], (300, 300))
    hole = boxes.check_cover(bs[:-1], (300, 300))
    elapsed = time.perf_counter() - began
    assert clash == "boxes [150:151, 7:8] and [150:151, 7:8] overlap"
    assert hole == "boxes hold 89999 of 90000 elements"
    assert elapsed < 5.0, elapsed  # about 0.5 s here; the old sweep needs minutes


def test_bricks_off_any_grid_are_checked_quickly() -> None:
    """Rows of bricks, each row cut at different places, have no small grid: the sweep with a
    segment tree handles them (the quadratic sweep compared 90,000 x 300 pairs)."""
    rows, per = 300, 300
    width = per * rows
    bs: list[Box] = []
    for r in range(rows):
        cuts = [0, *range(r + 1, width, rows), width]
        bs += [((r, r + 1), (a, b)) for a, b in itertools.pairwise(cuts)]
    # Sweep along dim 1 (the one with most distinct starts): every row is active at once.
    began = time.perf_counter()
    assert boxes.check_cover(bs, (rows, width)) is None
    assert boxes.check_cover([*bs, ((5, 6), (10, 12))], (rows, width)) is not None
    assert time.perf_counter() - began < 5.0  # about 2 s here
    small = [b for b in bs if b[0][0] < 20 and b[1][1] <= 400]
    extra = ((5, 6), (10, 12))
    assert boxes._first_overlap([*small, extra]) == reference_overlap([*small, extra]) is not None


def test_irregular_boxes_in_three_dimensions_are_refused_quickly() -> None:
    """No fast method applies to boxes irregular in three dimensions; past a budget of pair
    comparisons the tiling is refused instead of stalling the reader."""
    n = 3000
    # All active at once along dim 0, disjoint along dim 1, irregular along dim 2: n * n / 2 pairs.
    bs: list[Box] = [((i, n), (i, i + 1), (i % 7, i % 7 + 1 + i % 3)) for i in range(n)]
    began = time.perf_counter()
    problem = boxes.check_cover(bs, (n, n, 10))
    assert problem is not None and "too many to check" in problem
    assert time.perf_counter() - began < 5.0


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_run_pieces_hold_exactly_the_run(data: st.DataObject) -> None:
    """The pieces of a contiguous run of a stored shard (a box or a flat range) are the boxes
    whose elements sit, in C order, at those offsets of the run: what a read-once chunk holds."""
    import numpy as np

    shape = tuple(data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
    full = np.arange(int(np.prod(shape))).reshape(shape)
    region: boxes.Region
    if data.draw(st.booleans()):
        lo = data.draw(st.integers(0, full.size - 1))
        region = boxes.Flat(lo, data.draw(st.integers(lo + 1, full.size)))
        stored = full.reshape(-1)[region.start : region.stop]
    else:
        region = tuple(
            (a, data.draw(st.integers(a + 1, n)))
            for n in shape
            for a in [data.draw(st.integers(0, n - 1))]
        )
        stored = full[tuple(slice(a, b) for a, b in region)].reshape(-1)
    start = data.draw(st.integers(0, stored.size - 1))
    stop = data.draw(st.integers(start + 1, stored.size))
    found = []
    for p in boxes.run_pieces(region, shape, start, stop):
        n = boxes.volume(p.box)
        assert p.offset >= 0 and p.offset + n <= stop - start
        want = full[tuple(slice(a, b) for a, b in p.box)].reshape(-1)
        assert (stored[start + p.offset : start + p.offset + n] == want).all()
        found.extend(range(p.offset, p.offset + n))
    assert sorted(found) == list(range(stop - start))
