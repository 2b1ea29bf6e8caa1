"""Save a small PyTorch training state, restore it into fresh objects, and show the resume is exact.

Run with `make demo`. It trains a tiny regression model for a few steps, saves model, optimizer,
LR scheduler, RNG state and counters with `sp.save`, then builds everything again from scratch,
restores it with `sp.load(into=...)`, and checks that the next training steps give bit-identical
losses on both sides.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time

import torch

import savepoint as sp


def make() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=100)
    return model, opt, sched


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, sched) -> float:  # type: ignore[no-untyped-def]
    x = torch.randn(32, 16)  # draws from torch's global RNG, so RNG state is part of the resume
    y = x.sum(dim=1, keepdim=True).sin()
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    return loss.detach().item()


def main() -> None:
    torch.manual_seed(0)
    workdir = tempfile.mkdtemp(prefix="savepoint-demo-")
    path = os.path.join(workdir, "step-20")
    try:
        model, opt, sched = make()
        losses = [train_step(model, opt, sched) for _ in range(20)]
        state = {
            "model": model,
            "optimizer": opt,
            "scheduler": sched,
            "rng": {"torch": torch.get_rng_state()},
            "step": 20,
            "loss_history": losses,
        }
        t0 = time.perf_counter()
        info = sp.save(path, state, metadata={"run": "demo", "note": "tiny regression"})
        t_save = time.perf_counter() - t0
        print(f"trained 20 steps, last loss {losses[-1]:.5f}")
        print(
            f"saved {len(info.tensors)} tensors ({info.total_bytes} bytes) and "
            f"{len(info.values)} plain values to {path} in {t_save * 1000:.1f} ms"
        )
        print(f"stateful objects: {', '.join(f'{k} ({v})' for k, v in info.stateful.items())}")
        sp.verify(path)
        print("verify: every checksum matches")

        # Continue the original run, then resume a fresh copy from the checkpoint.
        expected = [train_step(model, opt, sched) for _ in range(5)]

        torch.manual_seed(12345)  # a different RNG state: the checkpoint must bring it back
        model2, opt2, sched2 = make()
        target = {
            "model": model2,
            "optimizer": opt2,
            "scheduler": sched2,
            "rng": {"torch": torch.get_rng_state()},  # a buffer of the right shape to fill
            "step": 0,
            "loss_history": [],
        }
        t0 = time.perf_counter()
        sp.load(path, into=target)
        torch.set_rng_state(target["rng"]["torch"])
        t_load = time.perf_counter() - t0
        print(
            f"restored into fresh objects in {t_load * 1000:.1f} ms: step {target['step']}, "
            f"{len(target['loss_history'])} losses, lr {sched2.get_last_lr()[0]:.6f}"
        )
        resumed = [train_step(model2, opt2, sched2) for _ in range(5)]
        for i, (a, b) in enumerate(zip(expected, resumed), start=21):
            print(
                f"  step {i}: original {a:.8f}  resumed {b:.8f}  {'identical' if a == b else 'DIFFERENT'}"
            )
        if expected != resumed:
            raise SystemExit("resume was not exact")
        print("resume is bit-exact")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
