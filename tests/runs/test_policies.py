"""Retention and save policies: tables of "steps in, steps kept" (pure functions of their input)."""

from __future__ import annotations

import math
import random
from typing import Any

import numpy as np
import pytest

from savepoint.runs import policies as P
from savepoint.runs.policies import (
    AnyOf,
    Entry,
    KeepAll,
    KeepBest,
    KeepEvery,
    KeepLatest,
    SaveAlways,
    SaveAnyOf,
    SaveEvery,
    SaveEverySeconds,
)


def entries(*steps: int) -> list[Entry]:
    return [Entry(s) for s in steps]


def with_metric(values: dict[int, Any], metric: str = "val") -> list[Entry]:
    """Entries whose ``metric`` is the given value; the value ``MISSING`` leaves it out."""
    return [Entry(s, {} if v is MISSING else {metric: v}) for s, v in values.items()]


MISSING = object()

# A table of metric values with every kind of unusable value mixed in.
MIXED = {
    1: 3.0,
    2: 1.0,
    3: 2.0,
    4: MISSING,
    5: float("nan"),
    6: float("-inf"),
    7: True,  # bools are not numbers here
    8: "0.1",  # nor are strings
    9: None,
    10: 1.0,  # ties with step 2: the later step wins
    11: float("inf"),
    12: False,
    13: [0.0],
}


def shuffled(es: list[Entry], seed: int) -> list[Entry]:
    out = list(es)
    random.Random(seed).shuffle(out)
    return out


# -- KeepLatest -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("steps", "n", "kept"),
    [
        ([], 3, set()),
        ([1, 2, 3], 0, set()),
        ([1, 2, 3], 1, {3}),
        ([5, 1, 3], 2, {5, 3}),
        ([10, 30, 20, 40], 3, {40, 30, 20}),
        ([1, 2], 5, {1, 2}),
        ([0], 1, {0}),
        ([100, 7, 99, 1000, 8], 2, {1000, 100}),
    ],
)
def test_keep_latest(steps: list[int], n: int, kept: set[int]) -> None:
    assert KeepLatest(n).keep(entries(*steps)) == kept
    assert KeepLatest(n).keep(shuffled(entries(*steps), 1)) == kept


# -- KeepBest -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "n", "kept"),
    [
        ("min", 0, set()),
        ("min", 1, {10}),  # 1.0 at steps 2 and 10: the later one
        ("min", 2, {10, 2}),
        ("min", 3, {10, 2, 3}),
        ("min", 4, {10, 2, 3, 1}),
        ("min", 100, {10, 2, 3, 1}),  # nothing else is ever chosen
        ("max", 1, {1}),
        ("max", 2, {1, 3}),
        ("max", 3, {1, 3, 10}),
        ("max", 4, {1, 3, 10, 2}),
        ("max", 100, {1, 3, 10, 2}),
    ],
)
def test_keep_best_ignores_unusable_values(mode: Any, n: int, kept: set[int]) -> None:
    es = with_metric(MIXED)
    assert KeepBest(n, "val", mode).keep(es) == kept
    assert KeepBest(n, "val", mode).keep(shuffled(es, n)) == kept


@pytest.mark.parametrize(
    ("values", "mode", "n", "kept"),
    [
        ({1: 5, 2: 5.0, 3: 5}, "min", 1, {3}),
        ({1: 5, 2: 5.0, 3: 5}, "max", 1, {3}),
        ({1: 5, 2: 5.0, 3: 5}, "max", 2, {3, 2}),
        ({3: 1.0, 1: 1.0, 2: 2.0}, "min", 1, {3}),
        ({3: 1.0, 1: 1.0, 2: 2.0}, "max", 1, {2}),
        ({1: 0, 2: -1, 3: 1}, "min", 1, {2}),  # ints count
        ({1: 0, 2: -1, 3: 1}, "max", 2, {3, 1}),
        ({1: np.float64(0.5), 2: 0.7}, "min", 1, {1}),  # a float subclass counts
        ({1: 1e300, 2: -1e300}, "max", 1, {1}),
        ({1: float("nan"), 2: float("inf"), 3: MISSING}, "min", 3, set()),
        ({1: float("nan"), 2: float("-inf"), 3: True}, "max", 3, set()),
        ({}, "min", 2, set()),
    ],
)
def test_keep_best_table(values: dict[int, Any], mode: Any, n: int, kept: set[int]) -> None:
    assert KeepBest(n, "val", mode).keep(with_metric(values)) == kept


def test_keep_best_default_mode_is_min_and_other_metrics_do_not_count() -> None:
    es = [
        Entry(1, {"val": 2.0, "acc": 0.1}),
        Entry(2, {"val": 3.0, "acc": 0.9}),
        Entry(3, {"acc": 5}),
    ]
    assert KeepBest(1, "val").keep(es) == {1}
    assert KeepBest(1, "acc", "max").keep(es) == {3}
    assert KeepBest(1, "loss").keep(es) == set()


def test_best_entries_order_and_metric_value() -> None:
    es = with_metric(MIXED)
    assert [e.step for e in P.best_entries(es, "val", "min")] == [10, 2, 3, 1]
    assert [e.step for e in P.best_entries(es, "val", "max")] == [1, 3, 10, 2]
    assert P.metric_value(Entry(1, {"v": 2}), "v") == 2.0
    assert isinstance(P.metric_value(Entry(1, {"v": 2}), "v"), float)
    for bad in (True, False, None, "1", float("nan"), float("inf"), -math.inf, [1.0]):
        assert P.metric_value(Entry(1, {"v": bad}), "v") is None
    assert P.metric_value(Entry(1, {}), "v") is None


# -- KeepEvery, KeepAll, AnyOf ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("steps", "n", "kept"),
    [
        (range(0, 13), 5, {0, 5, 10}),
        (range(1, 13), 5, {5, 10}),
        (range(1, 6), 1, {1, 2, 3, 4, 5}),
        ([3, 7, 11], 2, set()),
        ([100, 250, 300, 1000], 100, {100, 300, 1000}),
        ([], 3, set()),
    ],
)
def test_keep_every(steps: Any, n: int, kept: set[int]) -> None:
    assert KeepEvery(n).keep(entries(*steps)) == kept


@pytest.mark.parametrize("steps", [[], [1], [5, 3, 9, 100]])
def test_keep_all(steps: list[int]) -> None:
    assert KeepAll().keep(entries(*steps)) == set(steps)


VALS = {1: 0.9, 2: 0.5, 3: 0.7, 4: 0.2, 5: 0.8, 6: MISSING, 7: 0.6, 8: 0.3, 9: 0.95, 10: 0.4}


@pytest.mark.parametrize(
    ("policy", "kept"),
    [
        (AnyOf(), set()),
        (AnyOf(KeepLatest(2)), {9, 10}),
        (AnyOf(KeepLatest(1), KeepEvery(4)), {10, 4, 8}),
        (AnyOf(KeepLatest(2), KeepBest(1, "val")), {9, 10, 4}),
        (AnyOf(KeepLatest(2), KeepBest(2, "val", "max")), {9, 10, 1}),
        (AnyOf(KeepLatest(1), KeepBest(2, "val"), KeepEvery(3)), {10, 4, 8, 3, 6, 9}),
        (AnyOf(KeepLatest(0), KeepBest(0, "val"), KeepEvery(100)), set()),
        (AnyOf(KeepLatest(3), KeepAll()), set(range(1, 11))),
        (AnyOf(AnyOf(KeepLatest(1)), AnyOf(KeepEvery(5), KeepBest(1, "val"))), {10, 5, 4}),
        (AnyOf(KeepLatest(2), KeepLatest(3)), {8, 9, 10}),
    ],
)
def test_any_of(policy: AnyOf, kept: set[int]) -> None:
    es = with_metric(VALS)
    assert policy.keep(es) == kept
    assert policy.keep(shuffled(es, 7)) == kept


def test_any_of_is_union_of_parts() -> None:
    es = with_metric(VALS)
    parts = [KeepLatest(3), KeepBest(2, "val", "max"), KeepEvery(4)]
    assert AnyOf(*parts).keep(es) == set().union(*(p.keep(es) for p in parts))
    assert "KeepLatest(n=3)" in repr(AnyOf(*parts))


def test_policies_do_not_modify_input() -> None:
    es = with_metric(VALS)
    before = list(es)
    AnyOf(KeepLatest(2), KeepBest(2, "val"), KeepEvery(2), KeepAll()).keep(es)
    assert es == before


# -- explain --------------------------------------------------------------------------------------


def test_explain_any_of() -> None:
    es = with_metric(VALS)
    policy = AnyOf(KeepLatest(2), KeepBest(1, "val"), KeepEvery(5))
    assert P.explain(policy, es) == {
        1: [],
        2: [],
        3: [],
        4: ["best-1-val"],
        5: ["every-5"],
        6: [],
        7: [],
        8: [],
        9: ["last-2"],
        10: ["last-2", "every-5"],
    }


def test_explain_single_policy_and_custom_labels() -> None:
    es = entries(1, 2, 3)
    assert P.explain(KeepLatest(1), es) == {1: [], 2: [], 3: ["last-1"]}
    assert P.explain(KeepAll(), es) == {1: ["KeepAll"], 2: ["KeepAll"], 3: ["KeepAll"]}

    class OnlyTwo:
        def keep(self, entries: Any) -> set[int]:
            return {2}

    assert P.explain(AnyOf(OnlyTwo(), KeepEvery(3)), es) == {1: [], 2: ["OnlyTwo"], 3: ["every-3"]}
    assert P.explain(AnyOf(), es) == {1: [], 2: [], 3: []}
    assert P.explain(KeepLatest(2), []) == {}


def test_explain_agrees_with_keep() -> None:
    es = with_metric(MIXED)
    policy = AnyOf(KeepLatest(3), KeepBest(2, "val", "max"), KeepEvery(4))
    reasons = P.explain(policy, es)
    assert set(reasons) == {e.step for e in es}
    assert {s for s, why in reasons.items() if why} == policy.keep(es)


def test_spec_round_trip() -> None:
    es = with_metric(MIXED)
    policy = AnyOf(KeepLatest(2), KeepBest(1, "val", "max"), KeepEvery(5), KeepAll())
    spec = P.to_spec(policy)
    assert spec == [
        {"policy": "keep_last", "n": 2},
        {"policy": "keep_best", "n": 1, "metric": "val", "mode": "max"},
        {"policy": "keep_every", "n": 5},
        {"policy": "keep_all"},
    ]
    assert P.from_spec(spec).keep(es) == policy.keep(es)
    no_all = AnyOf(KeepLatest(2), KeepBest(1, "val", "max"), KeepEvery(5))
    assert P.from_spec(P.to_spec(no_all)).keep(es) == no_all.keep(es) == {13, 12, 10, 5, 1}


# -- invalid arguments ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda: KeepLatest(-1),
        lambda: KeepBest(-1, "val"),
        lambda: KeepBest(1, "val", "median"),  # type: ignore[arg-type]
        lambda: KeepBest(1, "val", "MIN"),  # type: ignore[arg-type]
        lambda: KeepEvery(0),
        lambda: KeepEvery(-5),
        lambda: SaveEvery(0),
        lambda: SaveEvery(-1),
        lambda: SaveEverySeconds(0),
        lambda: SaveEverySeconds(-1.5),
        lambda: P.best_entries(entries(1), "val", "avg"),  # type: ignore[arg-type]
    ],
)
def test_invalid_arguments(make: Any) -> None:
    with pytest.raises(ValueError):
        make()


@pytest.mark.parametrize(
    "make",
    [
        lambda: KeepLatest("2"),  # type: ignore[arg-type]
        lambda: KeepLatest(2.0),  # type: ignore[arg-type]
        lambda: KeepBest(True, "val"),
        lambda: KeepEvery(None),  # type: ignore[arg-type]
        lambda: SaveEvery("10"),  # type: ignore[arg-type]
    ],
)
def test_counts_must_be_ints(make: Any) -> None:
    """Before, ``KeepLatest("2")`` was built and failed at the first prune ("'<' not supported
    between instances of 'str' and 'int'")."""
    with pytest.raises(TypeError, match=r"needs an int n >= \d, not (str|float|bool|NoneType)"):
        make()


def test_zero_is_a_valid_count() -> None:
    assert KeepLatest(0).keep(entries(1, 2)) == set()
    assert KeepBest(0, "val").keep(with_metric({1: 1.0})) == set()


# -- save policies --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "saved"),
    [
        (1, list(range(0, 13))),
        (3, [0, 3, 6, 9, 12]),
        (5, [0, 5, 10]),
        (20, [0]),
    ],
)
def test_save_every(n: int, saved: list[int]) -> None:
    policy = SaveEvery(n)
    assert [s for s in range(13) if policy.should_save(s, None)] == saved
    assert [s for s in range(13) if policy.should_save(s, s - 1)] == saved


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0
        self.calls = 0

    def __call__(self) -> float:
        self.calls += 1
        return self.t


# (time, step, last_saved, expected)
SECONDS_TABLE = [
    (0.0, 1, None, True),  # nothing saved yet
    (5.0, 2, 1, False),
    (9.999, 3, 1, False),
    (10.0, 4, 1, True),  # exactly the interval counts
    (15.0, 5, 4, False),
    (19.9, 6, 4, False),  # false answers do not move the reference time
    (20.0, 7, 4, True),
    (21.0, 8, None, True),  # a fresh start (nothing saved by this process) always saves
    (25.0, 9, 8, False),  # ...and restarts the interval
    (30.5, 10, 8, False),
    (31.0, 11, 8, True),
    (1000.0, 12, 11, True),
    (1000.0, 13, 12, False),
]


def test_save_every_seconds_with_fake_clock() -> None:
    clock = FakeClock()
    policy = SaveEverySeconds(10, clock=clock)
    got = []
    for t, step, last, _ in SECONDS_TABLE:
        clock.t = t
        got.append(policy.should_save(step, last))
    assert got == [want for *_, want in SECONDS_TABLE]
    assert clock.calls == len(SECONDS_TABLE)


def test_save_every_seconds_default_clock_is_monotonic() -> None:
    policy = SaveEverySeconds(3600)
    assert policy.should_save(1, None) is True
    assert policy.should_save(2, 1) is False


class Recorder:
    """A save policy that answers from a set and records every step it is asked about."""

    def __init__(self, yes: set[int]) -> None:
        self.yes = yes
        self.seen: list[int] = []

    def should_save(self, step: int, last_saved: int | None) -> bool:
        self.seen.append(step)
        return step in self.yes


def test_save_any_of_asks_every_policy_every_step() -> None:
    a, b = Recorder({2, 4}), Recorder({3, 4})
    policy = SaveAnyOf(a, b)
    assert [s for s in range(1, 7) if policy.should_save(s, None)] == [2, 3, 4]
    assert a.seen == b.seen == [1, 2, 3, 4, 5, 6]


def test_save_any_of_with_time_policy_keeps_its_own_clock() -> None:
    clock = FakeClock()
    policy = SaveAnyOf(SaveEvery(10), SaveEverySeconds(60, clock=clock))
    table = [
        (0.0, 1, None, True),  # seconds: first save
        (30.0, 10, 1, True),  # every-10
        (45.0, 11, 10, False),
        (61.0, 12, 11, True),  # 61 s since the time policy last said yes
        (100.0, 13, 12, False),
        (121.0, 14, 13, True),
        (130.0, 20, 14, True),
    ]
    got = []
    for t, step, last, _ in table:
        clock.t = t
        got.append(policy.should_save(step, last))
    assert got == [want for *_, want in table]
    assert clock.calls == len(table)


def test_save_always_and_empty_any_of() -> None:
    assert all(SaveAlways().should_save(s, last) for s, last in [(0, None), (1, 0), (7, 7)])
    assert SaveAnyOf().should_save(1, None) is False
    assert SaveAnyOf(SaveAlways()).should_save(3, 2) is True
