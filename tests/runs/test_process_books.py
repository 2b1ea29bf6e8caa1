"""A managed async save handed to the writer process outlives its trainer with the run's history
(issue 27): the records ``log()`` gathered before ``save()`` are appended to the history log
when the save is handed over, so a trainer SIGKILLed after ``save()`` returned, before the
commit and its books, leaves a run whose next open adopts the checkpoint with the losses up to
it (tests/jax_state/test_jax_resume.py[right-after-an-async-save] caught their loss when the
books were the trainer's alone). The manager's default writer is the writer process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import savepoint as sp

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
