"""A Flax NNX + optax training loop (_train.py: 8 forced host devices, data parallel) killed
with SIGKILL and resumed through CheckpointManager equals an unbroken run bit for bit: the same
loss at every step and the same final checkpoint (parameters, BatchNorm statistics, the dropout
RNG stream, the adamw state)."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

if any(importlib.util.find_spec(m) is None for m in ("jax", "flax", "optax")):
    pytest.skip("needs jax, flax and optax (the jax extra)", allow_module_level=True)

import savepoint as sp
from savepoint.formats.diff import diff

pytestmark = pytest.mark.jax

SCRIPT = Path(__file__).with_name("_train.py")
STEPS = 24


def train(run: Path, *args: str) -> int:
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "PYTHONPATH": os.pathsep.join(sys.path),
    }
    proc = subprocess.run(
        [sys.executable, "-W", "error", str(SCRIPT), str(run), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )
    assert proc.returncode in (0, -signal.SIGKILL), proc.stdout + proc.stderr
    return proc.returncode


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("reference") / "run"
    assert train(run) == 0
    return run


@pytest.mark.slow
@pytest.mark.parametrize(
    "args",
    [["--kill-at", "13"], ["--kill-at", "15", "--async"]],
    ids=["between-saves", "right-after-an-async-save"],
)
def test_killed_and_resumed_flax_run_equals_unbroken_run(
    tmp_path: Path, reference: Path, args: list[str]
) -> None:
    run = tmp_path / "run"
    assert train(run, *args) == -signal.SIGKILL
    resumed_from = sp.CheckpointManager(run, read_only=True).latest_step()
    assert resumed_from in (10, 15)
    assert train(run, *[a for a in args if a == "--async"]) == 0
    ref, res = sp.CheckpointManager(reference), sp.CheckpointManager(run)
    assert res.latest_step() == STEPS
    d = diff(ref.step_path(STEPS), res.step_path(STEPS))
    assert d.identical, d.to_dict()
    keys = {t.key for t in d.tensors}
    assert {"model/drop/rngs/key/value", "model/bn/mean/value", "opt/0/1/fc/kernel/value"} <= keys
    assert res.report.loss_history == ref.report.loss_history
    assert len(res.report.loss_history) == STEPS
    leftovers = [e for e in os.listdir(run / "checkpoints") if e.startswith(".")]
    assert leftovers == []
