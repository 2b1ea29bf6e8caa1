"""A small training run with dropout, for the exact-resume tests (run as a script).

    python tests/cuda/_train.py RUN_DIR --device cuda [--steps 24] [--kill-at N]
    python tests/cuda/_train.py DIR --device cuda --steps 24 --scenario N


An MLP with two dropout layers trains on batches drawn from the device's RNG (on CUDA: the CUDA
generator, which dropout uses too), with AdamW, under a CheckpointManager that saves every
SAVE_EVERY steps in the background (``async_save=True``) and keeps the last two. The state holds
the model, the optimizer, the RNG streams (``sp.RNGState``: CUDA's included), the step, and the
loss of every step as a device tensor. A run resumes from the latest checkpoint in RUN_DIR.
``--kill-at N`` SIGKILLs the process right after step N, once the saves started are committed.
``--scenario N`` runs the whole exact-resume scenario, each run in a process of its own forked
from this one once torch is imported (no CUDA is initialised before the forks): DIR/reference
unbroken, DIR/resumed killed after step N, then DIR/resumed again; it prints the three exit
statuses and the steps checkpointed when the kill came, as JSON.
Its kernels are deterministic on one GPU (cuBLAS with a fixed workspace config, Philox dropout,
no atomics), so a resumed run must equal an unbroken one bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import numpy as np
import torch

import savepoint as sp

SAVE_EVERY = 5


def build(device: str, steps: int) -> dict:  # type: ignore[type-arg]
    torch.manual_seed(0)  # every device's generator
    random.seed(0)  # saved and compared too (sp.RNGState)
    np.random.seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256),
        torch.nn.GELU(),
        torch.nn.Dropout(0.2),
        torch.nn.Linear(256, 256),
        torch.nn.GELU(),
        torch.nn.Dropout(0.1),
        torch.nn.Linear(256, 1),
    ).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    return {
        "model": model,
        "optimizer": opt,
        "rng": sp.RNGState(),
        "step": 0,
        "losses": torch.zeros(steps, device=device),
    }


def train(run: str, device: str, steps: int, kill_at: int | None) -> None:
    if device == "cpu":
        torch.set_num_threads(1)  # a tiny model: threads only contend on a small machine
    state = build(device, steps)
    model, opt = state["model"], state["optimizer"]
    with sp.CheckpointManager(run, keep_last=2, async_save=True) as mgr:
        mgr.restore(state)
        step = state["step"]
        while step < steps:
            model.train()
            x = torch.randn(128, 64, device=device)  # drawn from the device's generator
            y = x[:, :1] * 2.0 - x[:, 1:2] + 0.1 * torch.randn(128, 1, device=device)
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            state["losses"][step] = loss.detach()
            step += 1
            state["step"] = step
            if step % SAVE_EVERY == 0 or step == steps:
                mgr.save(step, state, force=True)
            if step == kill_at:
                mgr.wait()  # the last save committed: the resume starts from a checkpoint
                os.kill(os.getpid(), signal.SIGKILL)


def _forked(fn: object, *args: object) -> int:
    """``fn(*args)`` in a forked child; its exit status (minus the signal that killed it)."""
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            fn(*args)  # type: ignore[operator]
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def scenario(directory: str, device: str, steps: int, kill_at: int) -> dict[str, object]:
    reference = os.path.join(directory, "reference")
    resumed = os.path.join(directory, "resumed")
    out: dict[str, object] = {
        "reference": _forked(train, reference, device, steps, None),
        "killed": _forked(train, resumed, device, steps, kill_at),
    }
    kept = os.path.join(resumed, "checkpoints")
    out["steps_after_kill"] = sorted(
        int(name.split("-")[1]) for name in os.listdir(kept) if name.startswith("step-")
    )
    out["resumed"] = _forked(train, resumed, device, steps, None)
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("run")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--kill-at", type=int, default=None)
    ap.add_argument("--scenario", type=int, default=None, metavar="KILL_AT")
    a = ap.parse_args()
    if a.scenario is not None:
        print(json.dumps(scenario(a.run, a.device, a.steps, a.scenario)), flush=True)
    else:
        train(a.run, a.device, a.steps, a.kill_at)
