"""Exact resume: a run killed with SIGKILL at any moment, then resumed, equals an unbroken run.

Runs examples/demo.py's training in subprocesses (the same code `make demo` runs): a reference
run, then for each kill point a run that is killed and resumed. Final checkpoints (model,
optimizer, scheduler, RNG streams, sampler position) and the loss curve must match bit for bit.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import savepoint as sp
from savepoint.formats.diff import diff

DEMO = Path(__file__).resolve().parents[1] / "examples" / "demo.py"
STEPS = 240


def train(run: Path, *args: str) -> int:
    proc = subprocess.run(
        [sys.executable, str(DEMO), "--train", str(run), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    return proc.returncode


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("reference") / "run"
    assert train(run) == 0
    return run


@pytest.mark.slow
@pytest.mark.parametrize(
    "kill",
    [
        ["--kill-at", "1"],  # before any checkpoint exists: the resume starts from scratch
        ["--kill-at", "37"],  # between two saves
        ["--kill-at", "100"],  # right after a save
        ["--kill-in", "write:140"],  # inside a save, data written, not committed
        ["--kill-in", "prune:180"],  # inside retention, after the commit
    ],
    ids=["step-1", "between-saves", "after-save", "inside-save", "inside-prune"],
)
def test_killed_and_resumed_run_equals_unbroken_run(
    tmp_path: Path, reference: Path, kill: list[str]
) -> None:
    run = tmp_path / "run"
    assert train(run, *kill) == -signal.SIGKILL
    assert train(run) == 0
    ref, res = sp.CheckpointManager(reference), sp.CheckpointManager(run)
    assert res.latest_step() == STEPS
    d = diff(ref.step_path(STEPS), res.step_path(STEPS))
    assert d.identical, d.to_dict()
    assert {t.key.split("/")[0] for t in d.tensors} >= {"model", "optimizer", "rng"}
    assert res.report.loss_history == ref.report.loss_history
    assert len(res.report.loss_history) == STEPS
    # nothing half-written is left behind, and every kept checkpoint verifies
    leftovers = [e for e in os.listdir(run / "checkpoints") if e.startswith(".")]
    assert leftovers == []
    for step in res.steps():
        sp.verify(res.step_path(step))
