"""The resume demo (`make demo`): kill training with SIGKILL, resume, and match an unbroken run bit for bit.

1. A reference run trains a small PyTorch model on synthetic data for STEPS steps, uninterrupted.
2. A second run with the same seed is started in its own process and kills itself with SIGKILL at a
   random step. A third process resumes it from its latest checkpoint and finishes.
3. The two runs are compared: final parameters, optimizer state, scheduler, RNG and data position
   (every tensor and value of the final checkpoints) and the whole loss curve must be identical.

Each run uses a CheckpointManager (keep the last 3 checkpoints and the best 1 by validation loss).
The state holds everything that decides the future of training: model, optimizer, LR scheduler,
RNG streams (Python, NumPy, torch) and the data sampler's position. Output goes to demo-output/.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

import savepoint as sp
from savepoint import ResumableSampler, RNGState

STEPS = 240
SAVE_EVERY = 20
BATCH = 32
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "demo-output")


def build(seed: int = 0) -> dict:  # type: ignore[type-arg]
    """Everything a run needs, built the same way in every process."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)  # unused by this model, but part of the state: both runs must agree
    data = np.random.default_rng(seed)
    x = torch.from_numpy(data.standard_normal((2048, 16), dtype=np.float32))
    w = torch.tensor([[1.0], [-2.0], [0.5], [1.5]])
    y = x[:, :4] @ w + 0.5 * torch.sin(2 * x[:, 4:5]) + 0.05 * x[:, 5:6]
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Dropout(0.1), torch.nn.Linear(64, 1)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS)
    sampler = ResumableSampler(len(x) - 256, seed=seed)
    # The loader gets its own generator: by default each new DataLoader iterator draws a seed
    # from torch's global RNG, and a resumed run creates its iterator at a different moment.
    loader = DataLoader(
        TensorDataset(x[:-256], y[:-256]),
        batch_size=BATCH,
        sampler=sampler,
        generator=torch.Generator().manual_seed(seed),
    )
    state = {
        "model": model,
        "optimizer": opt,
        "scheduler": sched,
        "rng": RNGState(),
        "sampler": sampler,
        "step": 0,
    }
    return {"state": state, "loader": loader, "val": (x[-256:], y[-256:])}


def _die(where: str) -> None:
    print(f"  [pid {os.getpid()}] SIGKILL {where}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def _kill_inside(phase: str, at_step: int) -> None:
    """Arrange a SIGKILL inside a save: "write" kills the save of ``at_step`` after its data files
    are written but before the commit; "prune" kills the first deletion of an old checkpoint by
    retention from the save of ``at_step`` on (the new checkpoint is committed by then)."""
    from savepoint.storage import LocalStore

    rename, exchange = LocalStore.rename, LocalStore.exchange
    step = f"step-{at_step:010d}"

    def armed(src: str, dst: str) -> bool:
        if phase == "write":  # the commit: the staging directory renamed (or swapped) into place
            return os.path.basename(dst) == step
        # a deletion by retention: a committed step renamed away to a hidden temporary name
        return os.path.basename(src).startswith("step-") and os.path.basename(dst).startswith(".")

    def kill_rename(store: LocalStore, src: str, dst: str) -> None:
        if armed(src, dst):
            _die(f"inside a save ({phase}, armed at step {at_step})")
        rename(store, src, dst)

    def kill_exchange(store: LocalStore, a: str, b: str) -> bool:
        if armed(a, b):
            _die(f"inside a save ({phase}, armed at step {at_step})")
        return exchange(store, a, b)

    LocalStore.rename = kill_rename  # type: ignore[method-assign]
    LocalStore.exchange = kill_exchange  # type: ignore[method-assign]


def train(run_dir: str, kill_at: int | None = None, kill_in: str | None = None) -> None:
    """Train to STEPS, resuming from the latest checkpoint in run_dir if there is one.

    ``kill_at``: SIGKILL right after that step. ``kill_in``: "write:N" or "prune:N", a SIGKILL
    inside the save of step N (see _kill_inside).
    """
    parts = build()
    state, loader = parts["state"], parts["loader"]
    model, opt, sched = state["model"], state["optimizer"], state["scheduler"]
    num_params = sum(p.numel() for p in model.parameters())
    with sp.CheckpointManager(
        run_dir,
        keep_last=3,
        keep_best=1,
        best_metric="val_loss",
        config={"lr": 3e-3, "batch": BATCH, "steps": STEPS},
        variant="mlp-64",
        num_params=num_params,
    ) as mgr:
        resumed = mgr.restore(state)
        if resumed is not None:
            print(f"  [pid {os.getpid()}] resumed from step {resumed}", flush=True)
        step = state["step"]
        while step < STEPS:
            for xb, yb in loader:  # continues mid-epoch after a restore
                model.train()
                loss = torch.nn.functional.mse_loss(model(xb), yb)
                opt.zero_grad()
                loss.backward()
                opt.step()
                sched.step()
                step += 1
                state["step"] = step
                mgr.log(step, loss=loss.item())
                if step % SAVE_EVERY == 0 or step == STEPS:
                    if kill_in and int(kill_in.split(":")[1]) == step:
                        _kill_inside(kill_in.split(":")[0], step)
                    model.eval()
                    with torch.no_grad():
                        val = torch.nn.functional.mse_loss(model(parts["val"][0]), parts["val"][1])
                    mgr.save(step, state, metrics={"val_loss": val.item()}, force=True)
                if step == kill_at:
                    _die(f"at step {step}")
                if step >= STEPS:
                    break


def run_child(*args: str) -> int:
    return subprocess.run([sys.executable, __file__, *args], check=False).returncode


def main() -> None:
    started = time.perf_counter()
    out = os.path.abspath(OUT)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    reference, resumed = os.path.join(out, "reference"), os.path.join(out, "resumed")
    kill_at = random.SystemRandom().randint(SAVE_EVERY + 1, STEPS - 1)

    print(f"1. reference run: {STEPS} steps, uninterrupted")
    assert run_child("--train", reference) == 0
    print(f"2. second run, same seed, killed with SIGKILL at random step {kill_at}")
    rc = run_child("--train", resumed, "--kill-at", str(kill_at))
    print(f"   process exited with {rc} ({'killed by SIGKILL' if rc == -signal.SIGKILL else '?'})")
    steps_left = sp.CheckpointManager(resumed).steps()
    print(f"   checkpoints on disk after the kill: {steps_left}")
    print("3. resuming the killed run from its latest checkpoint")
    assert run_child("--train", resumed) == 0

    print(f"\nComparison of the final checkpoints (step {STEPS}):")
    ref_mgr, res_mgr = sp.CheckpointManager(reference), sp.CheckpointManager(resumed)
    from savepoint.formats.diff import diff

    d = diff(ref_mgr.step_path(STEPS), res_mgr.step_path(STEPS))
    groups: dict[str, list[bool]] = {}
    for t in d.tensors:
        groups.setdefault(t.key.split("/")[0], []).append(t.equal)
    for group, equal in groups.items():
        print(
            f"  {group:10s} {len(equal):3d} tensors   {'identical' if all(equal) else 'DIFFERENT'}"
        )
    print(
        f"  plain values (step, epoch, lr, positions, ...): "
        f"{'identical' if not d.values else f'{len(d.values)} differ'}"
    )
    ref_loss = ref_mgr.report.loss_history
    res_loss = res_mgr.report.loss_history
    same_curve = ref_loss == res_loss
    print(
        f"  loss curve: {len(ref_loss)} vs {len(res_loss)} steps, "
        f"{'identical bit for bit' if same_curve else 'DIFFERENT'}; final loss {res_loss[-1][1]:.8f}"
    )
    lineage = res_mgr.report.lineage
    print(f"  lineage of the resumed run: {[item['resumed_from'] for item in lineage]}")

    print("\n$ savepoint ls demo-output/resumed")
    subprocess.run([sys.executable, "-m", "savepoint", "ls", resumed], check=True)
    plot = os.path.join(out, "report.png")
    from savepoint.runs import plot_reports

    plot_reports([ref_mgr.report, res_mgr.report], plot, "reference vs killed-and-resumed run")
    print(f"\nreport plot: {os.path.relpath(plot)}")
    print(f"demo took {time.perf_counter() - started:.1f} s")
    if not (d.identical and same_curve):
        raise SystemExit("the resumed run differs from the reference run")
    print("resume is bit-exact: the killed-and-resumed run equals the uninterrupted one")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--train", help="train (or resume) the run in this directory")
    parser.add_argument("--kill-at", type=int, default=None, help="SIGKILL after this step")
    parser.add_argument("--kill-in", default=None, help="write:STEP or prune:STEP")
    args = parser.parse_args()
    if args.train:
        train(args.train, args.kill_at, args.kill_in)
    else:
        main()
