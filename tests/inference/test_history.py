"""SnapshotHistory: the seed's bounded ring, buffer reuse, and directory-backed persistence."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import savepoint as sp
from savepoint.commit import names as commit_names
from savepoint.inference import InferenceSnapshot, SnapshotHistory


def snap(i: int) -> InferenceSnapshot:
    """The seed's test snapshots: one pushed input [i]."""
    return InferenceSnapshot(
        states=[np.full((2, 3), i, np.float32)],
        history=[np.array([float(i)], np.float32)],
        step_count=i,
        metadata={"timestamp": 0},
    )


def steps(history: SnapshotHistory) -> list[int]:
    out = []
    for i in range(len(history)):
        got = history.get(i)
        assert got is not None
        out.append(got.step_count)
    return out


# -- the seed's CheckpointManager -----------------------------------------------------------


def test_keeps_only_the_last_max_snapshots() -> None:
    history = SnapshotHistory(3)
    for i in range(5):
        history.push(snap(i))
    assert len(history) == 3
    latest = history.latest()
    assert latest is not None and latest.history[0][0] == 4.0
    assert steps(history) == [4, 3, 2]


def test_rollback_pops_the_newest() -> None:
    history = SnapshotHistory(5)
    for i in range(3):
        history.push(snap(i))
    rolled = history.rollback()
    assert rolled is not None and rolled.history[0][0] == 2.0
    assert len(history) == 2 and steps(history) == [1, 0]


def test_get_latest_and_empty() -> None:
    history = SnapshotHistory(4)
    assert history.latest() is None and history.rollback() is None and history.get(0) is None
    assert len(history) == 0 and not history and history.is_empty()
    pushed = [snap(i) for i in range(3)]
    for s in pushed:
        history.push(s)
    assert not history.is_empty()  # the seed's CheckpointManager::is_empty
    assert history.get(0) is pushed[2] and history.get(2) is pushed[0]  # no copy on push
    assert history.get(-1) is pushed[0] and history.get(-3) is pushed[2]
    assert history.get(3) is None and history.get(-4) is None
    with pytest.raises(TypeError):
        history.get("0")  # type: ignore[arg-type]
    history.clear()
    assert len(history) == 0 and history.latest() is None and history.is_empty()
    assert repr(history) == "SnapshotHistory(0/4)"


@pytest.mark.parametrize(
    ("bound", "error"), [(0, ValueError), (-1, ValueError), (True, TypeError), (2.0, TypeError)]
)
def test_bound_must_be_a_positive_int(bound: Any, error: type[Exception]) -> None:
    with pytest.raises(error):
        SnapshotHistory(bound)


def test_push_takes_snapshots_only() -> None:
    with pytest.raises(TypeError):
        SnapshotHistory(2).push({"states": []})  # type: ignore[arg-type]


# -- take and buffer reuse ------------------------------------------------------------------


def live_state(value: float, layers: int = 4) -> tuple[list[np.ndarray], list[np.ndarray]]:
    states = [np.full((256, 64), value + layer, np.float32) for layer in range(layers)]
    inputs = [np.full(64, value - step, np.float32) for step in range(8)]
    return states, inputs


def allocated_during(fn: Any) -> int:
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        fn()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak - before


def test_take_reuses_the_evicted_snapshots_buffers() -> None:
    history = SnapshotHistory(2)
    nbytes = InferenceSnapshot(states=live_state(0)[0], history=live_state(0)[1]).nbytes
    for step in range(3):
        states, inputs = live_state(step)
        history.take(states=states, history=inputs, step_count=step)
    states, inputs = live_state(3)
    used = allocated_during(lambda: history.take(states=states, history=inputs, step_count=3))
    assert used < nbytes / 10, f"a steady-state take allocated {used} bytes for {nbytes}"
    # ... and the values are right in every snapshot the ring holds.
    for i, step in enumerate((3, 2)):
        got = history.get(i)
        assert got is not None and got.step_count == step
        want_states, want_inputs = live_state(step)
        assert all(np.array_equal(a, b) for a, b in zip(got.states, want_states))
        assert all(np.array_equal(a, b) for a, b in zip(got.history, want_inputs))


def test_a_snapshot_handed_out_is_never_overwritten() -> None:
    history = SnapshotHistory(2)
    for step in range(2):
        states, inputs = live_state(step)
        history.take(states=states, history=inputs, step_count=step)
    oldest = history.get(-1)
    assert oldest is not None and oldest.step_count == 0
    states, inputs = live_state(7)
    nbytes = oldest.nbytes
    used = allocated_during(lambda: history.take(states=states, history=inputs, step_count=7))
    assert used >= nbytes  # it had to allocate: the evicted snapshot is the caller's now
    assert oldest.step_count == 0 and oldest.states[0][0, 0] == 0 and oldest.history[0][0] == 0
    rolled = history.rollback()
    assert rolled is not None and rolled.step_count == 7
    states, inputs = live_state(8)
    history.take(states=states, history=inputs, step_count=8)
    history.take(states=states, history=inputs, step_count=9)
    assert rolled.states[0][0, 0] == 7  # rolled back: the caller's, never reused


def test_take_with_changing_shapes_allocates_where_needed() -> None:
    history = SnapshotHistory(1)
    history.take(states=[np.zeros((2, 2), np.float32)], history=[np.zeros(3)])
    history.take(states=[np.ones((3, 2), np.float32), np.ones(1)], history=[])
    got = history.latest()
    assert got is not None
    assert [s.shape for s in got.states] == [(3, 2), (1,)] and got.history == ()
    assert got.states[0].tolist() == [[1, 1]] * 3


def test_a_failed_take_changes_nothing() -> None:
    history = SnapshotHistory(1)
    history.take(states=[np.zeros(4, np.float32)], step_count=1)
    with pytest.raises(sp.UnsupportedStateError):
        history.take(states=[np.ones(4, np.float32), [1.0]], step_count=2)
    with pytest.raises(sp.UnsupportedStateError):
        history.take(states=[np.ones(4, np.float32)], config={"x": float("nan")})
    got = history.latest()
    assert got is not None and got.step_count == 1 and got.states[0].tolist() == [0, 0, 0, 0]


@pytest.mark.torch
def test_take_reuses_torch_buffers() -> None:
    torch = pytest.importorskip("torch")
    history = SnapshotHistory(1)
    history.take(states=[torch.zeros(3)], history=[torch.zeros(2, dtype=torch.bfloat16)])
    history.take(states=[torch.ones(3)], history=[torch.ones(2, dtype=torch.bfloat16)])
    got = history.latest()
    assert got is not None and got.states[0].tolist() == [1, 1, 1]
    assert got.history[0].dtype == torch.bfloat16 and got.history[0].tolist() == [1, 1]


# -- directory-backed -----------------------------------------------------------------------


def names(directory: Path) -> list[str]:
    return sorted(n for n in os.listdir(directory) if not n.startswith("."))


def test_each_push_is_a_committed_checkpoint_and_the_bound_prunes(tmp_path: Path) -> None:
    history = SnapshotHistory(2, directory=tmp_path / "snaps")
    assert history.directory == str(tmp_path / "snaps")
    for i in range(4):
        history.push(snap(i))
    assert names(tmp_path / "snaps") == ["snapshot-000000000002", "snapshot-000000000003"]
    for name in names(tmp_path / "snaps"):
        sp.verify(tmp_path / "snaps" / name)
    assert history.path(0) == str(tmp_path / "snaps" / "snapshot-000000000003")
    assert history.path(5) is None and SnapshotHistory(1).path(0) is None
    assert steps(history) == [3, 2]


def test_a_restarted_process_rebuilds_the_ring_and_rolls_back(tmp_path: Path) -> None:
    first = SnapshotHistory(3, directory=tmp_path)
    for i in range(5):
        first.take(
            states=[np.full((2, 3), i, np.float32)],
            history=[np.full(1, i, np.float32)],
            step_count=i,
        )
    del first  # the process goes away
    second = SnapshotHistory(3, directory=tmp_path)
    assert len(second) == 3 and steps(second) == [4, 3, 2]
    rolled = second.rollback()
    assert rolled is not None and rolled.step_count == 4 and rolled.states[0][0, 0] == 4
    assert names(tmp_path) == ["snapshot-000000000002", "snapshot-000000000003"]
    third = SnapshotHistory(3, directory=tmp_path)
    assert steps(third) == [3, 2]
    third.push(snap(10))
    assert names(tmp_path)[-1] == "snapshot-000000000004"  # numbering continues
    latest = SnapshotHistory(3, directory=tmp_path).latest()
    assert latest == snap(10)


def test_reopening_with_a_smaller_bound_prunes_the_oldest(tmp_path: Path) -> None:
    history = SnapshotHistory(4, directory=tmp_path)
    for i in range(4):
        history.push(snap(i))
    smaller = SnapshotHistory(2, directory=tmp_path)
    assert steps(smaller) == [3, 2]
    assert names(tmp_path) == ["snapshot-000000000002", "snapshot-000000000003"]


def test_clear_deletes_every_snapshot(tmp_path: Path) -> None:
    history = SnapshotHistory(3, directory=tmp_path)
    for i in range(3):
        history.push(snap(i))
    history.clear()
    assert len(history) == 0 and names(tmp_path) == []
    assert len(SnapshotHistory(3, directory=tmp_path)) == 0


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_foreign_entries_are_left_alone_and_stale_temporaries_removed(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "snapshot-abc").mkdir()
    (tmp_path / "snapshot-000000000009").mkdir()  # never committed: no manifest
    stale = (
        tmp_path
        / f".snapshot-000000000011{commit_names.TMP_TAG}{commit_names.HOST}-{dead_pid()}-0badc0de"
    )
    stale.mkdir()
    (stale / "data-00000.safetensors").write_bytes(b"partial")
    history = SnapshotHistory(3, directory=tmp_path)
    assert len(history) == 0
    assert not stale.exists()
    history.push(snap(1))
    assert history.path(0) == str(tmp_path / "snapshot-000000000010")  # past every name
    assert (tmp_path / "notes.txt").read_text() == "mine" and (tmp_path / "snapshot-abc").is_dir()


def test_a_damaged_snapshot_is_reported_and_kept(tmp_path: Path, flip_byte: Any) -> None:
    history = SnapshotHistory(3, directory=tmp_path)
    for i in range(2):
        history.push(snap(i))
    flip_byte(tmp_path / "snapshot-000000000001", "states/0", 0)
    reopened = SnapshotHistory(3, directory=tmp_path)
    with pytest.raises(sp.CorruptCheckpointError):
        reopened.rollback()
    assert len(reopened) == 2 and (tmp_path / "snapshot-000000000001").is_dir()
    older = reopened.get(1)
    assert older is not None and older.step_count == 0


def test_a_file_in_the_way_is_a_write_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(sp.CheckpointWriteError):
        SnapshotHistory(2, directory=tmp_path / "file")


CHILD = """
import sys
import numpy as np
from savepoint.inference import SnapshotHistory
history = SnapshotHistory(3, directory=sys.argv[1])
step = len(history) and history.latest().step_count + 1
first = True
while True:
    history.take(states=[np.full((64, 64), step, np.float32)], history=[np.full(8, step, np.float32)],
                 step_count=step)
    if first:
        print("ready", flush=True)  # this run has committed a snapshot
        first = False
    step += 1
"""


@pytest.mark.slow
@pytest.mark.parametrize("delay", [0.05, 0.2, 0.5])
def test_killed_mid_push_leaves_a_usable_history(tmp_path: Path, delay: float) -> None:
    for _ in range(2):  # kill it twice: the second run starts from what the first left
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(tmp_path)], stdout=subprocess.PIPE, text=True
        )
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        time.sleep(delay)
        child.send_signal(signal.SIGKILL)
        child.wait()
        child.stdout.close()
    history = SnapshotHistory(3, directory=tmp_path)
    assert 1 <= len(history) <= 3
    found = steps(history)
    assert found == list(range(found[0], found[0] - len(found), -1))  # consecutive, newest first
    for i in range(len(history)):
        got = history.get(i)
        assert got is not None and got.states[0][0, 0] == got.step_count
    while history.rollback() is not None:
        pass
    assert names(tmp_path) == []
