"""Sharded incremental saves: ``sp.save(..., blobs=..., process_group=...)`` of a LoRA-style state
over ``--world`` (2) processes joined in a gloo group on 127.0.0.1.

Usage::

    .venv/bin/python benchmarks/bench_incremental_sharded.py [--mib 512] [--repeats 3]
        [--world 2] [--dir /tmp/sp-bench-inc-dist]

The state of ``bench_incremental.py`` (``--mib`` MiB, 95% of it frozen float32 tensors of up to
64 MiB, 5% trainable adapters changed before every save), every tensor row-split over the ranks
(``sp.Shard``). For each repeat, timed from a barrier until every rank has returned: a plain
sharded save (the baseline), then two incremental saves into one blob store (the first writes
everything, the second only the adapters' chunks). Reports medians of the time and of the bytes
each writes (blob store growth plus the checkpoint directory), and a resharding load 2 -> 1 of
the incremental checkpoint against one of the plain checkpoint (one process, whole tensors,
every byte checked).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import savepoint as sp
from savepoint.blobs import BlobPolicy
from savepoint.distributed import Shard


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def whole_state(mib: int, seed: int) -> dict[str, Any]:
    """Every rank builds the same whole tensors (``seed``: the adapters' values)."""
    rng = np.random.default_rng(0)
    layer = min(64, mib) << 20
    count = max(1, mib * 95 // 100 * (1 << 20) // layer)
    rows = 1024
    frozen = [
        torch.from_numpy(rng.standard_normal(layer // 4, dtype=np.float32).reshape(rows, -1))
        for _ in range(count)
    ]
    adapters = sum(f.numel() for f in frozen) // 19 // count // rows * rows
    g = torch.Generator().manual_seed(seed)
    return {
        "frozen": {f"layer{i}": f for i, f in enumerate(frozen)},
        "adapters": {
            f"layer{i}": torch.randn(rows, adapters // rows, generator=g) for i in range(count)
        },
    }


def rank_state(whole: dict[str, Any], rank: int, world: int, step: int) -> dict[str, Any]:
    def split(t: torch.Tensor) -> Shard:
        n = t.shape[0] // world
        return Shard.split(t[rank * n : (rank + 1) * n].clone(), 0, rank, world, size=t.shape[0])

    return {
        group: {k: split(t) for k, t in tensors.items()} for group, tensors in whole.items()
    } | {"step": step}


def worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    pg = dist.group.WORLD
    root = Path(args.dir)
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
    dist.barrier()
    policy = BlobPolicy()
    rows: dict[str, list[float]] = {}

    def add(name: str, value: float) -> None:
        rows.setdefault(name, []).append(value)

    def timed(fn: Any) -> float:
        dist.barrier()
        start = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - start

    for r in range(args.repeats):
        run = root / f"r{r}"
        state = rank_state(whole_state(args.mib, 3 * r), rank, world, 0)
        add(
            "plain sharded save s",
            timed(lambda run=run, st=state: sp.save(run / "full", st, process_group=pg)),
        )
        if rank == 0:
            add("plain sharded save bytes", dir_bytes(run / "full"))
        for i in range(2):
            state = rank_state(whole_state(args.mib, 3 * r + 1 + i), rank, world, i)
            before = dir_bytes(run / "blobs") if rank == 0 and (run / "blobs").exists() else 0
            t = timed(
                lambda run=run, i=i, st=state: sp.save(
                    run / f"inc{i}", st, process_group=pg, blobs=run / "blobs", blob_policy=policy
                )
            )
            add(f"incremental save {i + 1} s", t)
            if rank == 0:
                written = dir_bytes(run / "blobs") - before + dir_bytes(run / f"inc{i}")
                add(f"incremental save {i + 1} bytes", written)
        if rank == 0:
            for name in ("full", "inc1"):
                start = time.perf_counter()
                sp.load(run / name)
                add(f"load 2->1 {name} s", time.perf_counter() - start)
            shutil.rmtree(run)
        dist.barrier()
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
        med = {k: statistics.median(v) for k, v in rows.items()}
        print(f"LoRA-style state: about {args.mib} MiB, 95% frozen, over {world} ranks (Shard)")
        print(f"{args.repeats} repeats, medians (cpus: {os.cpu_count()}):")
        for k, v in med.items():
            if k.endswith("bytes"):
                print(f"  {k:<30} {v / 2**20:10.1f} MiB")
            else:
                print(f"  {k:<30} {v:10.3f}")
        print(
            "second incremental save: "
            f"{med['incremental save 2 bytes'] / med['plain sharded save bytes']:.1%} of a plain "
            f"sharded save's bytes, {med['incremental save 2 s'] / med['plain sharded save s']:.2f}x "
            "its time"
        )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--dir", default="/tmp/sp-bench-inc-dist")
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        torch.set_num_threads(1)
        worker(args.rank, args.world, args.port, args)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--port", str(port)]
    procs = [subprocess.Popen([*argv, "--rank", str(r)]) for r in range(args.world)]
    codes = [p.wait() for p in procs]
    if any(codes):
        sys.exit(f"a rank failed: exit codes {codes}")


if __name__ == "__main__":
    main()
