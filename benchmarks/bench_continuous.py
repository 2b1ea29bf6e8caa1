"""Continuous checkpointing (issue 27): a training loop whose step takes about 50 ms, saving with
``CheckpointManager(save_policy=sp.policies.Continuous(), async_save=True)`` at every step (the
policy skips the steps while a save is in flight).

Usage::

    .venv/bin/python benchmarks/bench_continuous.py [--mib 64] [--seconds 20] [--rounds 3]
        [--writer thread|process|default] [--priority low|idle|normal] [--min-interval 0] [--no-floor]
        [--dir /tmp/sp-continuous]

Each round runs the loop for ``--seconds`` with no checkpointing, then for ``--seconds`` with
continuous checkpointing of a ``--mib`` state (float32 tensors, changed a little every step), and
reads what the policy achieved from the run's ``report.json`` (``save_intervals``). Printed, as
medians over the rounds:

- achieved interval / time to durable: the interval between save starts against the time one
  save takes to become durable (target: at most 1.2);
- throughput with continuous saves / without (target: at least 0.95);
- the floor of that cost (unless ``--no-floor``): the loop beside a bare O_DIRECT writer
  process (``_bare_writer.py``, no savepoint, normal priority) writing the state's bytes back
  to back, against the loop alone; and a memcpy of the state per achieved interval, the least
  any snapshot blocks the loop.

``--priority`` sets the writer process's ``writer_priority`` (through
``SAVEPOINT_WRITER_PRIORITY``, which the manager's checkpointer reads).

A step is a fixed amount of work: matmuls until the training thread has used 50 ms of CPU time
(one torch thread), so a background save shows as a longer wall time per step.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import threading
import time

import torch

import savepoint as sp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_async import BareWriter

MiB = 1 << 20


def step_work(a: torch.Tensor, b: torch.Tensor, seconds: float = 0.05) -> torch.Tensor:
    """One training step: matmuls until this thread has used ``seconds`` of CPU time (fixed
    work, whatever else the machine runs: a background save shows as a longer wall time)."""
    t0 = time.thread_time()
    while time.thread_time() - t0 < seconds:
        a = torch.tanh(a @ b) * 0.5
    return a


def make_state(mib: float) -> dict[str, torch.Tensor]:
    n = max(1, int(mib * MiB) // (4 * MiB))
    return {f"layer{i}.weight": torch.randn(MiB) for i in range(n)}


def loop(seconds: float, state: dict[str, torch.Tensor], mgr: sp.CheckpointManager | None) -> float:
    """Steps per second for ``seconds``; with ``mgr``, ``mgr.save`` at every step."""
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    first = next(iter(state.values()))
    steps = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a = step_work(a, b)
        first[steps % first.numel()] += 1.0  # the state changes every step
        if mgr is not None:
            mgr.save(steps, state)
        steps += 1
    elapsed = time.perf_counter() - t0
    if mgr is not None:
        mgr.wait()
    return steps / elapsed


def loop_beside_bare(seconds: float, state: dict[str, torch.Tensor], base: str) -> float:
    """Steps per second for ``seconds`` while a bare O_DIRECT writer process (no savepoint,
    normal priority) writes the state's bytes back to back: what writing continuously costs
    this machine's loop whatever writes (the floor of the continuous cost, before the staging
    copy any snapshot pays: see :func:`copy_seconds`)."""
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    bare = BareWriter(os.path.join(base, "bare"), "normal")
    done = threading.Event()

    def writing() -> None:
        while not done.is_set():
            bare.start(nbytes)()

    threading.Thread(target=writing, daemon=True).start()
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    steps = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a = step_work(a, b)
        steps += 1
    elapsed = time.perf_counter() - t0
    done.set()
    bare.close()
    return steps / elapsed


def copy_seconds(state: dict[str, torch.Tensor]) -> float:
    """A memcpy of the state into touched memory (median of 5): the least a snapshot blocks."""
    staging = {k: torch.empty_like(v).fill_(0) for k, v in state.items()}
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for k, v in state.items():
            staging[k].copy_(v)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--mib", type=float, default=64.0)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--writer", choices=["thread", "process", "default"], default="default")
    ap.add_argument("--min-interval", type=float, default=0.0)
    ap.add_argument("--dir", default="/tmp/sp-continuous")
    ap.add_argument(
        "--priority",
        choices=["normal", "low", "idle"],
        default=None,
        help="the writer process's writer_priority (SAVEPOINT_WRITER_PRIORITY; default: its own)",
    )
    ap.add_argument("--no-floor", action="store_true", help="leave out the bare writer's floor")
    args = ap.parse_args()
    torch.set_num_threads(1)  # (a step's CPU time is its thread's: one intra-op thread)
    if args.priority is not None:  # (the manager's checkpointer takes it from the environment)
        os.environ["SAVEPOINT_WRITER_PRIORITY"] = args.priority
    state = make_state(args.mib)
    print(
        f"torch {torch.__version__}, savepoint {sp.__version__}, {os.cpu_count()} cores; "
        f"{len(state)} tensors, {args.mib:.0f} MiB; a step is 50 ms of one thread's CPU time; "
        f"writer={args.writer}, priority {args.priority or 'default'}"
    )
    ratios, speeds, floors, copies = [], [], [], []
    for rnd in range(args.rounds):
        shutil.rmtree(args.dir, ignore_errors=True)
        alone = loop(args.seconds, state, None)
        policy = sp.policies.Continuous(min_interval=args.min_interval)
        with sp.CheckpointManager(
            args.dir,
            keep_last=2,
            async_save=True,
            writer=None if args.writer == "default" else args.writer,  # type: ignore[arg-type]
            save_policy=policy,
        ) as mgr:
            during = loop(args.seconds, state, mgr)
        with open(os.path.join(args.dir, "report.json")) as f:
            achieved = json.load(f)["save_intervals"]
        interval, durable = achieved["interval_median_s"], achieved["durable_median_s"]
        ratios.append(interval / durable)
        speeds.append(during / alone)
        copies.append(copy_seconds(state) / interval)
        bare = ""
        if not args.no_floor:
            beside = loop_beside_bare(args.seconds, state, args.dir)
            floors.append(beside / alone)
            bare = f", {beside:.1f} beside a bare writer"
        print(
            f"round {rnd + 1}: {alone:.1f} steps/s alone, {during:.1f} with saves{bare}; "
            f"{achieved['saves']} saves, interval {interval:.3f} s, durable after {durable:.3f} s"
        )
    med = statistics.median
    print(f"  achieved interval / time to durable      {med(ratios):5.2f}  (target <= 1.2)")
    print(f"  throughput with continuous saves / none  {med(speeds):5.2f}  (target >= 0.95)")
    if floors:
        print(
            f"  floor: beside a bare O_DIRECT writer writing the same bytes back to back / none  "
            f"{med(floors):5.2f}"
        )
        print(f"  continuous saves / that floor            {med(speeds) / med(floors):5.2f}")
    print(
        f"  a memcpy of the state per interval (the least a snapshot blocks the loop), as a "
        f"share of the interval  {med(copies):5.3f}"
    )
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
