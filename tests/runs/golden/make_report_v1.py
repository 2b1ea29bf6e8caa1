"""Regenerate ``tests/runs/golden/report_v1/``: a run written by savepoint before issue 16, whose
``report.json`` (format version 1) holds the whole loss and metric history inline.

It was generated once, with the tree of commit ``b5a6fd9`` (before the history log), by::

    .venv/bin/python tests/runs/golden/make_report_v1.py

and is kept as it was written: ``tests/runs/test_history.py`` checks that today's readers see
exactly the history it holds and that a writer migrates it to the log without losing a value.
Do not regenerate it with a newer savepoint (that would test nothing); the script is kept to say
how the run came about. The checkpoints are small (a 4x3 float32 tensor and a step counter).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import warnings

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
TARGET = os.path.join(HERE, "report_v1")


def state(step: int) -> dict[str, object]:
    return {"w": np.full((4, 3), step, np.float32), "step": step}


def main() -> None:
    import savepoint as sp

    work = tempfile.mkdtemp()
    run = os.path.join(work, "report_v1")
    try:
        with sp.CheckpointManager(
            run, keep_last=2, best_metric="val", config={"lr": 0.1, "optim": {"beta": 0.9}}
        ) as mgr:
            for step in range(1, 9):
                mgr.log(step, loss=10.0 / step, lr=0.1)
                if step % 2 == 0:
                    mgr.save(
                        step, state(step), metrics={"val": abs(step - 4) / 10}, epoch=step // 4
                    )
        # A resume from step 4 (history after it is forgotten), then a second timeline.
        with sp.CheckpointManager(run, keep_last=2, best_metric="val") as mgr:
            assert mgr.restore(state(0), step=4) == 4
            for step in range(5, 8):
                mgr.log(step, loss=float("nan") if step == 6 else 1.0 / step)
            mgr.save(7, state(7), metrics={"val": 0.05, "acc": np.float32(0.5)})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with sp.CheckpointManager(run, config={"lr": 0.05, "optim": {"beta": 0.9}}) as mgr:
                mgr.log(8, loss=0.125)
        shutil.rmtree(TARGET, ignore_errors=True)
        shutil.copytree(run, TARGET, ignore=shutil.ignore_patterns(".writer.lock"))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
