"""A managed async save handed to the writer process outlives its trainer with the run's history
(issue 27): the records ``log()`` gathered before ``save()`` are appended to the history log
when the save is handed over, so a trainer SIGKILLed after ``save()`` returned, before the
commit and its books, leaves a run whose next open adopts the checkpoint with the losses up to
it (tests/jax_state/test_jax_resume.py[right-after-an-async-save] caught their loss when the
books were the trainer's alone). The manager's default writer is the writer process, and the
read-back before pruning of what it wrote runs there."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import savepoint as sp
import savepoint.checkpoint
from savepoint.async_.checkpointer import AsyncCheckpointer

CHILD = """
import os, signal, sys
import numpy as np
import savepoint as sp

run, writer = sys.argv[1], sys.argv[2]
kwargs = {} if writer == "default" else {"writer": writer}
mgr = sp.CheckpointManager(run, keep_last=2, async_save=True, **kwargs)
state = {"w": np.arange(1000, dtype=np.float32)}
for step in range(1, 9):
    mgr.log(step, loss=1.0 / step)
    if step % 4 == 0:
        mgr.save(step, state, metrics={"val": float(step)})
        if step == 8:
            os.kill(os.getpid(), signal.SIGKILL)  # save() returned: the commit is the writer's
    if step == 4:
        mgr.wait()
"""


@pytest.mark.parametrize("writer", ["default", "process"])
def test_a_trainer_killed_after_save_returned_keeps_the_history_up_to_it(
    tmp_path: Path, writer: str
) -> None:
    run = tmp_path / "run"
    env = {**os.environ, "SAVEPOINT_WRITER_FAULT": "delay:0.5"}  # the kill lands before the commit
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(run), writer], env=env, timeout=120, check=False
    )
    assert proc.returncode == -signal.SIGKILL
    deadline = time.monotonic() + 60
    while 8 not in sp.CheckpointManager(run, read_only=True).steps():
        assert time.monotonic() < deadline, "the writer process never committed step 8"
        time.sleep(0.1)
    with sp.CheckpointManager(run, keep_last=2) as mgr:
        assert mgr.latest_step() == 8
        assert [s for s, _ in mgr.report.loss_history] == list(range(1, 9))
        assert mgr.report.metric_history[8] == {"val": 8.0}
    again = sp.open_run(run).report
    assert [s for s, _ in again.loss_history] == list(range(1, 9))


def test_the_managers_default_writer_is_the_writer_process(tmp_path: Path) -> None:
    with sp.CheckpointManager(tmp_path / "run", async_save=True) as mgr:
        checkpointer = mgr._saver.checkpointer
        assert checkpointer is not None
        assert checkpointer.writer == "process" and checkpointer.fallback


def _state(step: int) -> dict[str, Any]:
    return {"w": np.full(20_000, step, dtype=np.float32), "step": step}


def test_the_writer_process_reads_the_checkpoint_back_and_its_damage_prunes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flip_byte: Callable[..., None]
) -> None:
    """The read-back before pruning runs in the writer process (the trainer pays nothing for
    it); damage it finds is the manager's CorruptCheckpointError, and nothing is pruned."""
    asked: list[str] = []
    real = AsyncCheckpointer.verify_in_process
    damage = [False]

    def in_process(self: AsyncCheckpointer, path: Any) -> None:
        asked.append(os.fspath(path))
        if damage[0]:
            flip_byte(Path(path), "w", 3)
        real(self, path)

    def not_here(path: Any, **kwargs: Any) -> Any:
        raise AssertionError("the trainer read the checkpoint back")

    monkeypatch.setattr(AsyncCheckpointer, "verify_in_process", in_process)
    monkeypatch.setattr(savepoint.checkpoint, "verify", not_here)
    with sp.CheckpointManager(tmp_path / "run", keep_last=1, async_save=True) as mgr:
        mgr.save(1, _state(1)).wait()
        mgr.save(2, _state(2)).wait()  # verified by the writer process, 1 pruned
        assert asked == [mgr.step_path(2)] and mgr.steps() == [2]
        damage[0] = True
        with pytest.raises(sp.CorruptCheckpointError, match="did not verify"):
            mgr.save(3, _state(3)).wait()
        with pytest.raises(sp.CorruptCheckpointError, match="did not verify"):
            mgr.wait()  # (and once by the manager)
        assert mgr.steps() == [2, 3]
        monkeypatch.undo()
        np.testing.assert_array_equal(sp.load(mgr.step_path(2))["w"], _state(2)["w"])


def test_a_writer_process_that_cannot_answer_leaves_the_read_back_to_the_trainer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flip_byte: Callable[..., None]
) -> None:
    """Its death is no verdict on the checkpoint: the trainer reads it back itself."""

    def dead(self: AsyncCheckpointer, path: Any) -> None:
        flip_byte(Path(path), "w", 3)
        raise sp.CheckpointWriteError("the writer process died (a test)", path=str(path))

    monkeypatch.setattr(AsyncCheckpointer, "verify_in_process", dead)
    with sp.CheckpointManager(tmp_path / "run", keep_last=1, async_save=True) as mgr:
        mgr.save(1, _state(1)).wait()
        with pytest.raises(sp.CorruptCheckpointError, match="did not verify"):
            mgr.save(2, _state(2)).wait()
        with pytest.raises(sp.CorruptCheckpointError, match="did not verify"):
            mgr.wait()
        assert mgr.steps() == [1, 2]
