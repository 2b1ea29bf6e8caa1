"""Pure planning: region geometry, the save-plan merge, and the per-rank read plans (no I/O)."""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np
import pytest

from savepoint.codecs import boxes
from savepoint.codecs.boxes import Flat
from savepoint.distributed import plan
from savepoint.distributed.plan import Item, LocalPlan, PlanError

# ---------------------------------------------------------------------------------------------
# geometry
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "start", "stop", "expected"),
    [
        ((10,), 2, 7, [(((2, 7),), 0)]),
        ((4, 6), 0, 24, [(((0, 4), (0, 6)), 0)]),
        ((4, 6), 6, 18, [(((1, 3), (0, 6)), 0)]),
        ((4, 6), 3, 5, [(((0, 1), (3, 5)), 0)]),
        # partial row, whole rows, partial row
        ((4, 6), 4, 20, [(((0, 1), (4, 6)), 0), (((1, 3), (0, 6)), 2), (((3, 4), (0, 2)), 14)]),
        ((2, 2, 3), 1, 11, [
            (((0, 1), (0, 1), (1, 3)), 0),
            (((0, 1), (1, 2), (0, 3)), 2),
            (((1, 2), (0, 1), (0, 3)), 5),
            (((1, 2), (1, 2), (0, 2)), 8),
        ]),
        ((), 0, 1, [((), 0)]),
        ((3, 0), 0, 0, []),
    ],
)  # fmt: skip
def test_flat_ranges_become_contiguous_pieces(
    shape: tuple[int, ...], start: int, stop: int, expected: list[tuple[Any, int]]
) -> None:
    got = [(p.box, p.offset) for p in boxes.pieces(Flat(start, stop), shape)]
    assert got == expected


def test_flat_pieces_hold_exactly_the_range_in_order() -> None:
    rng = np.random.default_rng(0)
    for _ in range(500):
        shape = tuple(int(n) for n in rng.integers(0, 5, size=rng.integers(0, 5)))
        n = math.prod(shape)
        start = int(rng.integers(0, n + 1))
        stop = int(rng.integers(start, n + 1))
        whole = np.arange(n).reshape(shape)
        buffer = np.full(stop - start, -1)
        ps = boxes.pieces(Flat(start, stop), shape)
        assert len(ps) <= max(1, 2 * len(shape) - 1)
        for p in ps:
            v = boxes.volume(p.box)
            buffer[p.offset : p.offset + v] = whole[tuple(slice(a, b) for a, b in p.box)].ravel()
            assert boxes.span(p.box, p) == (p.offset, p.offset + v)
        assert (buffer == np.arange(start, stop)).all()


def test_split_cuts_a_region_into_bounded_pieces_in_buffer_order() -> None:
    piece = boxes.Piece(((0, 8), (0, 100)), 0)
    parts = list(boxes.split(((2, 7), (10, 90)), piece, 250))
    assert parts == [((2, 4), (10, 90)), ((4, 6), (10, 90)), ((6, 7), (10, 90))]
    # a single row bigger than the limit is cut along the next dimension
    parts = list(boxes.split(((0, 1), (0, 100)), piece, 30))
    assert [p[1] for p in parts] == [(0, 30), (30, 60), (60, 90), (90, 100)]
    spans = [boxes.span(p, piece) for p in boxes.split(((0, 8), (5, 50)), piece, 120)]
    assert spans == sorted(spans)


@pytest.mark.parametrize(
    ("regions", "shape", "problem"),
    [
        ([((0, 2), (0, 6)), ((2, 4), (0, 6))], (4, 6), None),
        ([((0, 4), (0, 3)), ((0, 4), (3, 6))], (4, 6), None),
        ([((0, 2), (0, 3)), ((0, 2), (3, 6)), ((2, 4), (0, 6))], (4, 6), None),
        ([Flat(0, 5), Flat(5, 24)], (4, 6), None),
        ([Flat(5, 24), Flat(0, 5)], (4, 6), None),
        ([()], (), None),
        ([((0, 0), (0, 6))], (0, 6), None),
        ([((0, 2), (0, 6)), ((1, 4), (0, 6))], (4, 6), "overlap"),
        ([((0, 4), (0, 4)), ((0, 4), (3, 6))], (4, 6), "overlap"),
        ([((0, 2), (0, 6))], (4, 6), "12 of 24"),
        ([((0, 2), (0, 6)), ((2, 5), (0, 6))], (4, 6), "outside"),
        ([((0, 2),), ((2, 4), (0, 6))], (4, 6), "outside"),
        ([Flat(0, 5), Flat(6, 24)], (4, 6), "gap"),
        ([Flat(0, 6), Flat(5, 24)], (4, 6), "overlap"),
        ([Flat(0, 5)], (4, 6), "end at 5"),
        ([Flat(0, 12), ((2, 4), (0, 6))], (4, 6), "mixes"),
        ([((0, 2), (0, 6)), ((2, 2), (0, 6)), ((2, 4), (0, 6))], (4, 6), "no element"),
        ([(), ()], (), "overlap"),
        ([], (3,), "no shards"),
        ([((0, 0),), ((0, 0),)], (0,), "exactly one"),
    ],
)
def test_check_cover(regions: list[Any], shape: tuple[int, ...], problem: str | None) -> None:
    found = boxes.check_cover(regions, shape)
    if problem is None:
        assert found is None
    else:
        assert found is not None and problem in found


def test_check_cover_finds_overlaps_among_many_boxes() -> None:
    # a 2-d grid of 32 x 32 boxes tiles; moving one corner makes it overlap its neighbour
    grid = [((i, i + 1), (j, j + 1)) for i, j in itertools.product(range(32), range(32))]
    assert boxes.check_cover(grid, (32, 32)) is None
    grid[5] = ((0, 1), (4, 6))
    assert "overlap" in (boxes.check_cover(grid, (32, 32)) or "")


# ---------------------------------------------------------------------------------------------
# save plans
# ---------------------------------------------------------------------------------------------


def _tree(*tensors: str, **values: Any) -> dict[str, Any]:
    items: list[list[Any]] = [[t, {"t": "tensor", "ref": t, "kind": "numpy"}] for t in tensors]
    items += [[k, {"t": "value", "v": v}] for k, v in values.items()]
    return {"t": "dict", "items": items}


def _local(tree: dict[str, Any], *items: Item, path: str = "/ck") -> LocalPlan:
    return LocalPlan(path, tree, items)


def test_replicated_pieces_are_written_once_spread_over_their_holders() -> None:
    full = boxes.full
    plans = [
        _local(
            _tree("a", "b", "c", step=3),
            Item("a", "F32", (100,), full((100,))),
            Item("b", "F32", (60,), full((60,))),
            Item("c", "F32", (50,), full((50,))),
        )
        for _ in range(2)
    ]
    merged = plan.merge(plans)
    written = [{i.key for i in w} for w in merged.writes]
    assert written == [{"a"}, {"b", "c"}]  # largest first onto the least loaded rank
    assert merged.written_bytes() == [400, 440]
    assert list(merged.tensors) == ["a", "b", "c"]


def test_sharded_pieces_go_to_their_holder_and_replicas_balance_around_them() -> None:
    t = ("w", "r")
    plans = [
        _local(
            _tree(*t),
            Item("w", "F32", (4, 6), ((2 * r, 2 * r + 2), (0, 6))),
            Item("r", "F32", (8,), boxes.full((8,))),
        )
        for r in range(2)
    ]
    merged = plan.merge(plans)
    assert [[(i.key, i.region) for i in w] for w in merged.writes] == [
        [("w", ((0, 2), (0, 6))), ("r", ((0, 8),))],
        [("w", ((2, 4), (0, 6)))],
    ]


def test_2d_parallel_duplicates_are_deduplicated() -> None:
    # tensor parallel over ranks {0,1} and {2,3}, replicated across the two pairs
    plans = [
        _local(_tree("w"), Item("w", "BF16", (4, 8), ((0, 4), (4 * (r % 2), 4 * (r % 2) + 4))))
        for r in range(4)
    ]
    merged = plan.merge(plans)
    regions = [i.region for w in merged.writes for i in w]
    assert sorted(regions) == [((0, 4), (0, 4)), ((0, 4), (4, 8))]
    assert sum(len(w) for w in merged.writes) == 2
    assert len({r for r, w in enumerate(merged.writes) if w}) == 2


def test_flat_shards_and_a_whole_copy_agree() -> None:
    plans = [
        _local(_tree("f"), Item("f", "F32", (3, 4), Flat(0, 7))),
        _local(_tree("f"), Item("f", "F32", (3, 4), Flat(7, 12))),
    ]
    merged = plan.merge(plans)
    assert [i.region for w in merged.writes for i in w] == [Flat(0, 7), Flat(7, 12)]


def test_partitioned_entries_are_united() -> None:
    def part(*keys: str) -> dict[str, Any]:
        return {
            "t": "dict",
            "items": [
                [
                    "opt",
                    {
                        "t": plan.PARTITIONED_NODE,
                        "items": [
                            [k, {"t": "tensor", "ref": f"opt/{k}", "kind": "numpy"}] for k in keys
                        ],
                    },
                ]
            ],
        }

    plans = [
        _local(
            part("p0", "p2"),
            Item("opt/p0", "F32", (2,), ((0, 2),)),
            Item("opt/p2", "F32", (2,), ((0, 2),)),
        ),
        _local(part("p1"), Item("opt/p1", "F32", (3,), ((0, 3),))),
    ]
    merged = plan.merge(plans)
    opt = merged.tree["items"][0][1]
    assert opt["t"] == "dict"
    assert [k for k, _ in opt["items"]] == ["p0", "p2", "p1"]
    assert [[i.key for i in w] for w in merged.writes] == [["opt/p0", "opt/p2"], ["opt/p1"]]

    with pytest.raises(PlanError) as info:
        plan.merge([plans[0], _local(part("p2"), Item("opt/p2", "F32", (2,), ((0, 2),)))])
    assert "opt/p2" in str(info.value) and "ranks 0, 1" in str(info.value)
    assert info.value.ranks == [1]


@pytest.mark.parametrize(
    ("second", "words", "ranks"),
    [
        (_local(_tree("a"), Item("a", "F32", (4,), ((0, 4),))), ["b: missing on rank 1"], [1]),
        (
            _local(_tree("a", "b"), Item("a", "F64", (4,), ((0, 4),)), Item("b", "F32", (2,), ((0, 2),))),
            ["a: ranks disagree about dtype and shape", "rank 1: F64[4]"],
            [1],
        ),
        (
            _local(_tree("a", "b", step=2), Item("a", "F32", (4,), ((0, 4),)), Item("b", "F32", (2,), ((0, 2),))),
            ["step: missing on rank 0"],
            [0],
        ),
        (
            _local(_tree("a", "b"), Item("a", "F32", (4,), ((0, 4),)), Item("b", "F32", (2,), ((0, 2),)), path="/other"),
            ["different paths", "rank 1: /other"],
            [1],
        ),
    ],
)  # fmt: skip
def test_disagreements_are_all_reported(
    second: LocalPlan, words: list[str], ranks: list[int]
) -> None:
    first = _local(
        _tree("a", "b"), Item("a", "F32", (4,), ((0, 4),)), Item("b", "F32", (2,), ((0, 2),))
    )
    with pytest.raises(PlanError) as info:
        plan.merge([first, second])
    for w in words:
        assert w in str(info.value)
    assert info.value.ranks == ranks


def test_values_must_agree() -> None:
    plans = [_local(_tree(lr=0.1)), _local(_tree(lr=0.2))]
    with pytest.raises(PlanError, match="lr: the value differs between ranks"):
        plan.merge(plans)


def test_an_uncovered_tensor_is_refused_with_a_hint() -> None:
    plans = [_local(_tree("w"), Item("w", "F32", (4, 6), ((0, 2), (0, 6))))]
    with pytest.raises(PlanError, match=r"12 of 24 elements.*without its process_group"):
        plan.merge(plans)


# ---------------------------------------------------------------------------------------------
# read plans: which shard bytes land where
# ---------------------------------------------------------------------------------------------


def _fill(shape: tuple[int, ...], shards: list[Any], want: Any) -> np.ndarray[Any, Any]:
    """Execute a read plan with numpy: shards cut from arange, copied into want's buffer."""
    whole = np.arange(math.prod(shape)).reshape(shape)
    buffers = []
    for region in shards:
        if isinstance(region, Flat):
            buffers.append(whole.ravel()[region.start : region.stop].copy())
        else:
            buffers.append(whole[tuple(slice(a, b) for a, b in region)].ravel().copy())
    out = np.full(boxes.size(want, shape), -1)
    for op in plan.plan_reads(shape, shards, want):
        src = buffers[op.shard][op.src.offset : op.src.offset + boxes.volume(op.src.box)]
        src = src.reshape(boxes.extents(op.src.box))[boxes.relative(op.region, op.src)]
        dst = out[op.dst.offset : op.dst.offset + boxes.volume(op.dst.box)]
        dst.reshape(boxes.extents(op.dst.box))[boxes.relative(op.region, op.dst)] = src
    return out


def _expected(shape: tuple[int, ...], want: Any) -> np.ndarray[Any, Any]:
    whole = np.arange(math.prod(shape)).reshape(shape)
    if isinstance(want, Flat):
        return whole.ravel()[want.start : want.stop]
    return whole[tuple(slice(a, b) for a, b in want)].ravel()


def _rows(n: int, world: int, cols: int) -> list[Any]:
    out = []
    for r in range(world):
        chunk = -(-n // world)
        a, b = min(r * chunk, n), min(r * chunk + chunk, n)
        if b > a:
            out.append(((a, b), (0, cols)))
    return out


def _flat(n: int, world: int) -> list[Any]:
    chunk = -(-n // world)
    return [
        Flat(min(r * chunk, n), min(r * chunk + chunk, n)) for r in range(world) if r * chunk < n
    ]


SHAPE = (10, 6)
LAYOUTS = {
    "rows/4": _rows(10, 4, 6),
    "rows/3": _rows(10, 3, 6),
    "cols/4": [((0, 10), c) for c, _ in _rows(6, 4, 1)],
    "flat/3": _flat(60, 3),
    "whole": [boxes.full(SHAPE)],
}
WANTS = {
    "rows 2..7": ((2, 7), (0, 6)),
    "cols 1..5": ((0, 10), (1, 5)),
    "block": ((3, 9), (2, 4)),
    "flat 7..44": Flat(7, 44),
    "everything": boxes.full(SHAPE),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("want", list(WANTS))
def test_read_plans_deliver_every_element_once(layout: str, want: str) -> None:
    got = _fill(SHAPE, LAYOUTS[layout], WANTS[want])
    assert (got == _expected(SHAPE, WANTS[want])).all()


@pytest.mark.parametrize(
    ("layout", "want", "shards", "elements"),
    [
        ("rows/4", "rows 2..7", [0, 1, 2], 30),  # 3,3,3,1 rows: rows 2..7 touch shards 0-2
        ("rows/4", "everything", [0, 1, 2, 3], 60),
        ("cols/4", "rows 2..7", [0, 1, 2], 30),  # 2,2,2 columns: every column shard
        ("cols/4", "cols 1..5", [0, 1, 2], 40),
        ("flat/3", "rows 2..7", [0, 1, 2], 30),  # elements 12..41 of 20-element ranges
        ("whole", "block", [0], 12),
    ],
)
def test_read_plans_touch_only_overlapping_shards(
    layout: str, want: str, shards: list[int], elements: int
) -> None:
    ops = plan.plan_reads(SHAPE, LAYOUTS[layout], WANTS[want])
    assert plan.shards_needed(ops) == shards
    assert plan.elements(ops) == elements


def test_a_region_outside_the_tensor_is_refused() -> None:
    with pytest.raises(ValueError, match="outside"):
        plan.plan_reads((4,), [((0, 4),)], ((2, 6),))


def test_plans_are_plain_data() -> None:
    import pickle

    ops = plan.plan_reads(SHAPE, LAYOUTS["flat/3"], WANTS["block"])
    assert pickle.loads(pickle.dumps(ops)) == ops
