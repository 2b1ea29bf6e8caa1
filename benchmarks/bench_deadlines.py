"""Deadlines of sharded saves and loads on N gloo ranks: what they cost when nothing stalls, and
how soon a stalled rank is named.

Usage::

    .venv/bin/python benchmarks/bench_deadlines.py [--world 3] [--rounds 60] [--deadline 2]

Starts ``--world`` processes joined in a gloo group on 127.0.0.1. A small state (a row-sharded
float32 matrix and a replicated vector: coordination, not bytes, dominates):

- **overhead**: ``sp.save`` and ``sp.load(into=...)`` with a process group, interleaved round by
  round with the same calls where the deadline bookkeeping is switched off (each point's record
  and verdict check, and the watch of each phase, replaced by no-ops: the floor), medians of
  ``--rounds`` each, from a barrier to this rank's return. The ratio: with / without (target:
  within the noise, about 1.0);
- **naming**: a save with ``timeout=--deadline`` in which the last rank sleeps ``deadline + 1.5``
  seconds in its write; the time each waiting rank takes to raise the error naming it, against
  the deadline (target: about 1.0; the waiting ranks name it at once when their wait times out).

The last line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist

import savepoint as sp
from savepoint.distributed import Shard
from savepoint.distributed import collectives as coll
from savepoint.engine import pipeline


def state(rank: int, world: int, *, empty: bool = False) -> dict[str, Any]:
    g = torch.Generator().manual_seed(rank)
    rows = torch.zeros(64, 256) if empty else torch.randn(64, 256, generator=g)
    rep = torch.zeros(1000) if empty else torch.ones(1000)
    return {"w": Shard.split(rows, 0, rank, world, size=64 * world), "rep": rep}


def switch(on: bool, real: tuple[Any, Any]) -> None:
    """The deadline bookkeeping on (the real methods) or off (no-ops)."""
    watch, arrive = real
    off_watch = lambda self, waited_at=0: contextlib.nullcontext()  # noqa: E731
    off_arrive = lambda self, point, own=None: None  # noqa: E731
    setattr(coll.TorchCoordinator, "_watch", watch if on else off_watch)  # noqa: B010
    setattr(coll.TorchCoordinator, "_arrive", arrive if on else off_arrive)  # noqa: B010


def overhead(rank: int, world: int, root: str, rounds: int) -> dict[str, float]:
    pg = dist.group.WORLD
    path = os.path.join(root, "ckpt")
    mine, targets = state(rank, world), state(rank, world, empty=True)
    real = (coll.TorchCoordinator._watch, coll.TorchCoordinator._arrive)
    times: dict[str, list[float]] = {"save on": [], "save off": [], "load on": [], "load off": []}
    for i in range(rounds * 2 + 2):
        on = i % 2 == 0
        switch(on, real)
        for what, call in (
            ("save", lambda: sp.save(path, mine, process_group=pg)),
            ("load", lambda: sp.load(path, into=targets, process_group=pg)),
        ):
            dist.barrier()
            start = time.perf_counter()
            call()
            if i >= 2:  # one warm-up round of each
                times[f"{what} {'on' if on else 'off'}"].append(time.perf_counter() - start)
    switch(True, real)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def naming(rank: int, world: int, root: str, deadline: float) -> float:
    pg = dist.group.WORLD
    path = os.path.join(root, "stalled")
    mine = state(rank, world)
    sp.save(path, mine, process_group=pg, timeout=deadline)  # sets up the group
    real = pipeline.write_blob
    if rank == world - 1:

        def slow(*args: Any, **kwargs: Any) -> Any:
            time.sleep(deadline + 1.5)
            return real(*args, **kwargs)

        pipeline.write_blob = slow  # type: ignore[assignment]
    dist.barrier()
    start = time.perf_counter()
    try:
        sp.save(path, mine, process_group=pg, timeout=deadline)
    except sp.DistributedCheckpointError as exc:
        if exc.stalled != {world - 1: "save: write"}:
            raise AssertionError(f"the wrong rank or phase was named: {exc}") from exc
    else:
        raise AssertionError("the stalled save did not fail")
    finally:
        pipeline.write_blob = real  # type: ignore[assignment]
    return time.perf_counter() - start


def worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    figures: dict[str, Any] = overhead(rank, world, args.dir, args.rounds)
    dist.barrier()
    figures["naming s"] = naming(rank, world, args.dir, args.deadline)
    dist.barrier()
    with open(os.path.join(args.dir, f"rank{rank}.json"), "w") as f:
        json.dump(figures, f)
    os._exit(0)  # a group that lost a collective cannot be torn down cleanly


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--deadline", type=float, default=2.0)
    parser.add_argument("--dir", default="")
    parser.add_argument("--rank", type=int, default=-1)
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    if args.rank >= 0:
        worker(args.rank, args.world, args.port, args)
        return
    root = args.dir or tempfile.mkdtemp(prefix="sp-bench-deadlines-")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--dir", root]
    procs = [
        subprocess.Popen([*argv, "--port", str(port), "--rank", str(r)]) for r in range(args.world)
    ]
    for p in procs:
        p.wait()
    ranks = []
    for r in range(args.world):
        with open(os.path.join(root, f"rank{r}.json")) as f:
            ranks.append(json.load(f))
    shutil.rmtree(root, ignore_errors=True)
    out: dict[str, Any] = {"world": args.world, "deadline_s": args.deadline}
    for what in ("save", "load"):
        on = statistics.median(r[f"{what} on"] for r in ranks)
        off = statistics.median(r[f"{what} off"] for r in ranks)
        out[f"{what}_ms"], out[f"{what}_floor_ms"] = round(on, 2), round(off, 2)
        out[f"{what}_ratio"] = round(on / off, 3)
        print(f"{what}: {on:.2f} ms with deadlines, {off:.2f} ms without: {on / off:.3f}x")
    waited = [r["naming s"] for r in ranks[:-1]]
    out["naming_s"] = round(max(waited), 3)
    out["naming_ratio"] = round(max(waited) / args.deadline, 3)
    print(
        f"a rank stalled in its write named after {max(waited):.2f} s by the slowest waiting "
        f"rank: {max(waited) / args.deadline:.2f}x the {args.deadline:g} s deadline"
    )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
