"""A small training run with dropout, for the exact-resume tests (run as a script).

    python tests/gpu/_train.py RUN_DIR --device cuda [--steps 24] [--kill-at N]

An MLP with two dropout layers trains on batches drawn from the device's RNG (on CUDA: the CUDA
generator, which dropout uses too), with AdamW, under a CheckpointManager that saves every
SAVE_EVERY steps in the background (``async_save=True``) and keeps the last two. The state holds
the model, the optimizer, the RNG streams (``sp.RNGState``: CUDA's included), the step, and the
loss of every step as a device tensor. A run resumes from the latest checkpoint in RUN_DIR.
``--kill-at N`` SIGKILLs the process right after step N (a save started at N may be in flight).
Its kernels are deterministic on one GPU (cuBLAS with a fixed workspace config, Philox dropout,
no atomics), so a resumed run must equal an unbroken one bit for bit.
"""

from __future__ import annotations

import argparse
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
                os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("run")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--kill-at", type=int, default=None)
    a = ap.parse_args()
    train(a.run, a.device, a.steps, a.kill_at)
