"""sp.policies.Continuous alone, on a fake clock: the next save once the previous is durable,
never sooner than the minimum (or the target), and what it reports."""

from __future__ import annotations

import itertools

import pytest

import savepoint as sp
from savepoint.policies import Continuous, SaveAnyOf, SaveEvery


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_public_name() -> None:
    assert sp.policies.Continuous is Continuous


def test_first_save_then_waits_for_durable() -> None:
    clock = Clock()
    p = Continuous(clock=clock)
    assert p.should_save(0, None)
    p.started(0)
    clock.now += 5
    assert not p.should_save(1, 0)  # in flight: never a second save at once
    p.durable(0)
    assert p.should_save(2, 0)  # durable, no minimum: at once


def test_never_below_min_interval() -> None:
    clock = Clock()
    p = Continuous(min_interval=2.0, clock=clock)
    starts = []
    for step in range(400):  # a 50 ms step; saves durable 0.3 s after they start
        clock.now = 100.0 + 0.05 * step
        if p._in_flight is not None and clock.now - starts[-1] >= 0.3:
            p.durable(p._in_flight)
        if p.should_save(step, None):
            p.started(step)
            starts.append(clock.now)
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    assert gaps and min(gaps) >= 2.0 - 1e-9
    assert max(gaps) < 2.0 + 0.05 + 1e-9  # and no later than the first step past the minimum


def test_interval_follows_durable_time_without_target() -> None:
    clock = Clock()
    p = Continuous(clock=clock)
    starts = []
    for step in range(200):
        clock.now = 100.0 + 0.05 * step
        if p._in_flight is not None and clock.now - starts[-1] >= 0.5:
            p.durable(p._in_flight)
        if p.should_save(step, None):
            p.started(step)
            starts.append(clock.now)
    gaps = [round(b - a, 6) for a, b in itertools.pairwise(starts)]
    assert set(gaps) == {0.5}
    got = p.achieved()
    assert got["interval_median_s"] == pytest.approx(0.5)
    assert got["durable_median_s"] == pytest.approx(0.5)
    assert got["saves"] == len(starts)


def test_target_interval_paces_and_counts_when_behind() -> None:
    clock = Clock()
    p = Continuous(min_interval=0.1, target_interval=1.0, clock=clock)
    assert p.should_save(0, None)
    p.started(0)
    clock.now += 0.2
    p.durable(0)
    assert not p.should_save(1, 0)  # durable, above the minimum, below the target
    clock.now += 0.8
    assert p.should_save(2, 0)
    p.started(2)
    clock.now += 3.0  # a slow save: the storage cannot keep the target
    p.durable(2)
    assert p.should_save(3, 2)
    p.started(3)
    got = p.achieved()
    assert got["behind_target"] == 1
    assert got["target_interval_s"] == 1.0


def test_failed_save_frees_the_policy() -> None:
    clock = Clock()
    p = Continuous(clock=clock)
    p.started(0)
    assert not p.should_save(1, None)
    p.failed(0)
    assert p.should_save(1, None)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"min_interval": -1}, ValueError),
        ({"min_interval": float("nan")}, ValueError),
        ({"min_interval": "1"}, TypeError),
        ({"min_interval": True}, TypeError),
        ({"min_interval": 5, "target_interval": 1}, ValueError),
        ({"target_interval": float("inf")}, ValueError),
        ({"target_interval": 0}, ValueError),  # every interval would be "behind" it
    ],
)
def test_bad_arguments(kwargs: dict, error: type) -> None:
    with pytest.raises(error):
        Continuous(**kwargs)


def test_any_of_forwards_the_saves() -> None:
    clock = Clock()
    c = Continuous(min_interval=10, clock=clock)
    p = SaveAnyOf(SaveEvery(100), c)
    assert p.should_save(0, None)
    p.started(0)
    p.durable(0)
    clock.now += 1
    assert not p.should_save(1, 0)
    assert p.should_save(100, 0)  # SaveEvery's step: a save all the same
    p.started(100)  # ...which Continuous counts as its last start
    clock.now += 9.5
    p.durable(100)
    assert not p.should_save(101, 100)
    assert c.achieved()["saves"] == 2


def test_report_keeps_save_intervals() -> None:
    from savepoint.errors import CorruptCheckpointError
    from savepoint.runs.report import Report

    r = Report(name="r")
    assert "save_intervals" not in r.to_file_json()  # absent until a policy reports
    r.save_intervals = {"policy": "continuous", "saves": 3, "interval_median_s": 0.5}
    doc = r.to_file_json()
    assert Report.from_json(doc, "report.json").save_intervals == r.save_intervals
    with pytest.raises(CorruptCheckpointError, match="save_intervals"):
        Report.from_json({**doc, "save_intervals": [1, 2]}, "report.json")
