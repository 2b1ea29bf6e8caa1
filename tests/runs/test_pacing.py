"""A manager's save policy as its save route asks it (runs.pacing): should_save's answer reused
by save, the observer hooks of Continuous, save_intervals in report.json."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np

import savepoint as sp
from savepoint.runs.pacing import Pacing, achieved, agreed


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Counting:
    """A save policy that counts its questions."""

    def __init__(self) -> None:
        self.asked = 0

    def should_save(self, step: int, last_saved: int | None) -> bool:
        self.asked += 1
        return step % 2 == 0


def test_should_save_is_reused_by_save(tmp_path: Path) -> None:
    policy = Counting()
    with sp.CheckpointManager(tmp_path / "run", save_policy=policy) as mgr:
        assert mgr.should_save(2)
        assert mgr.save(2, {"w": np.ones(2)}).skipped is False
        assert policy.asked == 1  # save(2) took should_save(2)'s answer
        assert not mgr.should_save(3)
        assert mgr.save(3, {"w": np.ones(2)}).skipped
        assert policy.asked == 2
        mgr.should_save(4)
        mgr.save(5, {"w": np.ones(2)})  # another step: asked again
        assert policy.asked == 4
        assert mgr.steps() == [2]


def test_continuous_sync_saves_and_report(tmp_path: Path) -> None:
    clock = Clock()
    policy = sp.policies.Continuous(min_interval=1.0, clock=clock)
    with sp.CheckpointManager(tmp_path / "run", save_policy=policy) as mgr:
        for step in range(30):
            clock.now = step * 0.25
            mgr.save(step, {"w": np.full(2, step, np.float32)})
        assert mgr.steps() == [0, 4, 8, 12, 16, 20, 24, 28]
    doc = json.loads((tmp_path / "run" / "report.json").read_text())
    got = doc["save_intervals"]
    assert got["policy"] == "continuous" and got["saves"] == 8
    assert got["interval_median_s"] == 1.0 and got["min_interval_s"] == 1.0


def test_continuous_async_waits_for_durable(tmp_path: Path) -> None:
    """With async saves the next save starts only once the previous one committed."""
    gate = threading.Event()
    policy = sp.policies.Continuous()
    state = {"w": np.zeros(4, np.float32)}
    with sp.CheckpointManager(
        tmp_path / "run", save_policy=policy, async_save=True, progress=lambda d, t: gate.wait(5)
    ) as mgr:
        first = mgr.save(0, state)
        assert not first.skipped
        assert mgr.save(1, state).skipped  # in flight: skipped
        gate.set()
        first.wait()
        assert not mgr.save(2, state).skipped  # durable: the next one starts
        mgr.wait()
        assert mgr.steps() == [0, 2]


def test_a_failed_save_frees_continuous(tmp_path: Path) -> None:
    policy = sp.policies.Continuous()
    with sp.CheckpointManager(tmp_path / "run", save_policy=policy) as mgr:
        try:
            mgr.save(0, {"bad": object()})
        except sp.CheckpointError:
            pass
        else:  # pragma: no cover
            raise AssertionError("an object() is not a state")
        assert not mgr.save(1, {"w": np.ones(2)}).skipped  # not stuck "in flight"


def test_agreement_rules() -> None:
    assert agreed(sp.policies.Continuous())
    assert agreed(sp.policies.SaveAnyOf(sp.policies.SaveEvery(5), sp.policies.Continuous()))
    assert not agreed(sp.policies.SaveEvery(5))
    assert achieved(sp.policies.SaveEvery(5)) is None
    pacing = Pacing(sp.policies.SaveEvery(5))
    assert pacing.decide(3, None, force=True) and not pacing.decide(3, None, force=False)


def test_manager_writer_process(tmp_path: Path) -> None:
    """CheckpointManager(async_save=True, writer="process"), plain and incremental: checkpoints
    written by the writer process load bit-exactly; the memo stays in the writer process."""
    big = np.arange(1 << 18, dtype=np.float32)
    for incremental in (False, True):
        run = tmp_path / f"run-{incremental}"
        with sp.CheckpointManager(
            run, async_save=True, writer="process", incremental=incremental, keep_last=2
        ) as mgr:
            for step in range(3):
                big[step] += 1
                mgr.save(step, {"w": big, "step": step})
            mgr.wait()
            assert mgr.steps() == [1, 2]
            pid = mgr._saver.checkpointer._process.pid
            assert pid is not None and pid != __import__("os").getpid()
        with sp.CheckpointManager(run, read_only=True) as reader:
            got = sp.load(reader.step_path(2))
        np.testing.assert_array_equal(got["w"], big)


def test_manager_writer_refusals(tmp_path: Path) -> None:
    import pytest

    with pytest.raises(ValueError, match="writer must be"):
        sp.CheckpointManager(tmp_path / "a", async_save=True, writer="fork")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="without async_save"):
        sp.CheckpointManager(tmp_path / "b", writer="process")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_manager_writer_process_with_tiers(tmp_path: Path) -> None:
    """Checkpoints the writer process commits are copied up to the run's tiers as any other."""
    tier = sp.Tier(str(tmp_path / "disk"), every=1)
    state = {"w": np.arange(1000, dtype=np.float32)}
    with sp.CheckpointManager(
        tmp_path / "run", async_save=True, writer="process", tiers=[tier]
    ) as mgr:
        for step in (1, 2):
            state["w"] += 1
            mgr.save(step, state)
        mgr.wait()
    copies = sorted(p.name for p in (tmp_path / "disk" / "checkpoints").iterdir())
    assert copies[-2:] == ["step-0000000001", "step-0000000002"]
    got = sp.load(tmp_path / "disk" / "checkpoints" / "step-0000000002")
    np.testing.assert_array_equal(got["w"], state["w"])
