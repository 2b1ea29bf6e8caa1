"""The benchmarks' real training loop (``benchmarks/train_loop.py``, issue 27): its gradients made
once (``steady``) compute the same steps as the per-step allocated ones and stop its page faults,
and the back-to-back measurement counts its saves and its window."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str) -> Any:
    # (registered before it runs: its dataclasses look their module up)
    full = f"_bench_{name}"
    spec = importlib.util.spec_from_file_location(full, ROOT / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[full] = module
    spec.loader.exec_module(module)
    return module


train_loop = _load("train_loop")
TINY = train_loop.Shape(vocab=64, d=16, layers=1, heads=2, seq=8, batch=2)


def _params(trainer: Any) -> list[Any]:
    return [p.detach().clone() for p in trainer.model.parameters()]


def test_gradients_made_once_train_exactly_as_the_allocated_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(train_loop, "_steady_malloc", lambda: None)  # (process-wide: not here)
    # (one after the other: each is seeded when made, and its steps draw their tokens)
    fresh = train_loop.Trainer(0.001, TINY, steady=False)
    a = [fresh.step() for _ in range(3)]
    steady = train_loop.Trainer(0.001, TINY, steady=True)
    b = [steady.step() for _ in range(3)]
    assert a == pytest.approx(b, rel=1e-5)
    for a, b in zip(_params(fresh), _params(steady), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # the n-gram tables' gradients stay the buffers made once, zeroed in place
    grad = steady.model.bigram.weight.grad
    steady.step()
    assert steady.model.bigram.weight.grad is grad


_FAULTS = """
import sys
sys.path.insert(0, sys.argv[1])
import train_loop
shape = train_loop.Shape(vocab=64, d=16, layers=1, heads=2, seq=8, batch=2)
for steady in (False, True):  # (the old loop first: steady changes malloc for the process)
    trainer = train_loop.Trainer(0.2, shape, steady=steady)
    trainer.step()
    clock = train_loop.CpuClock()
    train_loop.steps_alone(trainer, clock, 0.0, least=3)
    print(train_loop._LAST_FAULTS[0])
    del trainer
"""


def test_gradients_made_once_stop_the_loops_page_faults() -> None:
    # n-gram tables of ~34 MiB each: above glibc's largest mmap threshold (32 MiB), so a
    # gradient allocated every step is mapped and faulted in every step. In a child process:
    # the steady loop fixes glibc's thresholds for its whole process.
    out = subprocess.run(
        [sys.executable, "-c", _FAULTS, str(ROOT / "benchmarks")],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    fresh, steady = (float(x) for x in out.stdout.split())
    assert fresh > 4000  # two tables' gradients faulted in, page by page
    assert steady < fresh / 20


def test_sustained_saves_back_to_back_until_the_window_is_over() -> None:
    loop = train_loop.MatmulLoop({"w": torch.zeros(4)})
    clock = train_loop.CpuClock()
    started: list[float] = []

    def start() -> Any:
        started.append(time.perf_counter())
        return lambda: time.sleep(0.05)

    w = train_loop.sustained(loop, clock, 0.3, start)
    assert w.saves == len(started) >= 4
    assert w.seconds >= 0.3 and w.rate > 0
    alone = train_loop.sustained(loop, clock, 0.1)
    assert alone.saves == 0 and alone.seconds >= 0.1
