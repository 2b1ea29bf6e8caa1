"""The subprocess checks (exact resume after SIGKILL, NCCL beside gloo), for any device; shared by
``test_cuda_runs.py`` and ``test_twins_on_cpu.py``. Not collected."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import _gpu

import savepoint as sp
from savepoint.formats.diff import diff

TRAIN = _gpu.HERE / "_train.py"
DIST = _gpu.HERE / "_dist.py"


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args],
        env=_gpu.child_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def check_resume_after_kill(tmp: Path, device: str, *, steps: int, kill_at: int) -> None:
    """A run SIGKILLed after step ``kill_at`` and resumed equals an unbroken run: model,
    optimizer, RNG streams (dropout's included) and every step's loss, bit for bit."""
    runs = {name: tmp / name for name in ("reference", "resumed")}
    args = [str(TRAIN), str(tmp), "--device", device, "--steps", str(steps)]
    out = _run([*args, "--scenario", str(kill_at)], 600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    statuses = json.loads(out.stdout.strip().splitlines()[-1])
    left = statuses.pop("steps_after_kill")
    assert statuses == {"reference": 0, "killed": -signal.SIGKILL, "resumed": 0}, (
        statuses,
        out.stderr[-4000:],
    )
    assert left and max(left) <= kill_at < steps, left  # the resume starts from a checkpoint
    a, b = (sp.CheckpointManager(runs[n]) for n in ("reference", "resumed"))
    assert a.latest_step() == b.latest_step() == steps
    d = diff(a.step_path(steps), b.step_path(steps))
    assert d.identical, d.to_dict()
    keys = {t.key.split("/")[0] for t in d.tensors}
    assert {"model", "optimizer", "rng", "losses"} <= keys, keys
    if device != "cpu":
        rng = sp.load(b.step_path(steps))["rng"]
        assert "cuda" in rng, "the CUDA generator's state was not saved"
    losses = sp.load(b.step_path(steps))["losses"]
    assert bool((losses > 0).all()), "a step's loss is missing"


def check_process_groups(tmp: Path, device: str) -> None:
    out = _run([str(DIST), str(tmp), "--device", device], 300)
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), (
        out.stdout[-2000:] + out.stderr[-4000:]
    )
