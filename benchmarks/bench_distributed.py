"""Sharded save over 2 processes and resharding load 2 -> 1, savepoint against its peers.

Usage::

    .venv/bin/python benchmarks/bench_distributed.py [--gib 1] [--repeats 5] [--dir /tmp/sp-bench-dist]

Starts ``--world`` (2) processes joined in a gloo group on 127.0.0.1. The state is the one of
``bench_save_load.py`` (about 300 float32 tensors, a few of 64 MiB, many small), every tensor
split along dim 0 over the ranks as a DTensor with a ``Shard(0)`` placement, so each rank holds
half of the bytes (each rank allocates its own parts; the one-process save gets whole tensors). Timed, interleaved round by round after a warm-up round, medians compared:

- ``sharded``: ``sp.save(path, state, process_group=WORLD)`` on both ranks, from a barrier until
  both have returned (the checkpoint is committed and durable: every file fsynced);
- ``single``: ``sp.save`` of the same bytes, whole tensors, by one process (the other waits);
- ``dcp``: ``torch.distributed.checkpoint.save`` of the same DTensors on both ranks (its
  ``FileSystemWriter`` fsyncs every file), from a barrier until both have returned;
- ``reshard load 2 -> 1``: one process loads the sharded checkpoint into whole, already
  allocated tensors (``sp.load(into=...)``, every shard checksummed) against a plain read of the
  same data files into one already allocated buffer (``readinto``), warm (page cache) and cold
  (``posix_fadvise(DONTNEED)`` first).

Checkpoints are deleted outside the timed windows.
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
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import savepoint as sp

MiB = 1 << 20


def make_sizes(total_bytes: int, seed: int = 0) -> list[int]:
    """Element counts: a few 64 MiB tensors and many of 4 KiB-1 MiB, about 300, float32, every
    count even so that a 2-way Shard(0) split is exact."""
    rng = np.random.default_rng(seed)
    n_big = max(1, round(total_bytes * 0.9 / (64 * MiB)))
    sizes = [64 * MiB] * n_big
    small = np.exp(rng.uniform(np.log(4096), np.log(MiB), size=300 - n_big - 1)).astype(np.int64)
    sizes += [int(s) // 8 * 8 for s in small]
    rest = total_bytes - sum(sizes)
    if rest > 0:
        sizes.append(rest // 8 * 8)
    return [s // 4 for s in sizes]


def piece(i: int, n: int, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s part of tensor ``i`` (``n`` elements in all), generated where it lives,
    as a training process allocates its own shard."""
    g = torch.Generator().manual_seed(i * world + rank)
    return torch.randn(n // world, generator=g)


def evict(path: str) -> None:
    for root, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def plain_read(path: str, buffer: np.ndarray[Any, Any]) -> int:
    """Read every data file of a checkpoint into ``buffer`` (already allocated)."""
    view = memoryview(buffer)
    pos = 0
    for name in sorted(os.listdir(path)):
        if not name.endswith(".safetensors"):
            continue
        with open(os.path.join(path, name), "rb", buffering=0) as f:
            while True:
                n = f.readinto(view[pos : pos + (64 * MiB)])
                if not n:
                    break
                pos += n
    return pos


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import Shard as Placement

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    mesh = init_device_mesh("cpu", (world,))
    sizes = make_sizes(int(args.gib * (1 << 30)))
    state: dict[str, Any] = {}
    whole: dict[str, torch.Tensor] = {}
    for i, n in enumerate(sizes):
        key = f"layer{i:03d}.weight"
        state[key] = DTensor.from_local(
            piece(i, n, rank, world), mesh, [Placement(0)], run_check=False, shape=(n,), stride=(1,)
        )
        if rank == 0:  # the same bytes, whole, for the one-process save and the 2 -> 1 check
            whole[key] = torch.cat([piece(i, n, r, world) for r in range(world)])
    total = sum(sizes) * 4
    base = args.dir
    if rank == 0:
        shutil.rmtree(base, ignore_errors=True)
        os.makedirs(base)
    dist.barrier()

    def timed_all(fn: Any) -> float:
        dist.barrier()
        start = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - start

    def cleanup(*paths: str) -> None:
        dist.barrier()
        if rank == 0:
            for p in paths:
                shutil.rmtree(p, ignore_errors=True)
        dist.barrier()

    results: dict[str, list[float]] = {"sharded": [], "single": [], "dcp": []}
    for round_ in range(args.repeats + 1):
        order = ["sharded", "single", "dcp"]
        order = order[round_ % 3 :] + order[: round_ % 3]
        for name in order:
            path = os.path.join(base, f"{name}-{round_}")
            if name == "sharded":
                t = timed_all(lambda p=path: sp.save(p, state, process_group=dist.group.WORLD))
            elif name == "dcp":
                t = timed_all(lambda p=path: dcp.save(state, checkpoint_id=p))
            else:
                t = timed_all(lambda p=path: sp.save(p, whole) if rank == 0 else None)
            if round_ > 0:  # round 0 warms up
                results[name].append(t)
            keep = name == "sharded" and round_ == args.repeats
            if not keep:
                cleanup(path)

    loads: dict[str, list[float]] = {}
    if rank == 0:
        sharded = os.path.join(base, f"sharded-{args.repeats}")
        data_bytes = sum(
            os.path.getsize(os.path.join(sharded, f))
            for f in os.listdir(sharded)
            if f.endswith(".safetensors")
        )
        targets = {k: torch.empty_like(v) for k, v in whole.items()}
        buffer = np.empty(data_bytes, dtype=np.uint8)
        buffer.fill(0)
        for t in targets.values():
            t.zero_()
        loads = {"load warm": [], "read warm": [], "load cold": [], "read cold": []}
        for round_ in range(args.repeats + 1):
            for kind in ("warm", "cold"):
                for name in ("load", "read"):
                    if kind == "cold":
                        evict(sharded)
                    start = time.perf_counter()
                    if name == "load":
                        sp.load(sharded, into=targets)
                    else:
                        plain_read(sharded, buffer)
                    elapsed = time.perf_counter() - start
                    if round_ > 0:
                        loads[f"{name} {kind}"].append(elapsed)
        for k, v in whole.items():
            assert torch.equal(targets[k], v), k
    dist.barrier()
    if rank == 0:
        shutil.rmtree(base, ignore_errors=True)
        gib = total / (1 << 30)
        print(f"state: {len(sizes)} float32 tensors, {gib:.2f} GiB over {world} ranks (Shard(0))")
        print(f"repeats: {args.repeats} (after one warm-up round), medians:")
        sharded, single, dcp_t = (median(results[k]) for k in ("sharded", "single", "dcp"))
        print(f"  sharded sp.save, {world} ranks    {sharded:6.3f} s")
        print(f"  sp.save, 1 process             {single:6.3f} s")
        print(f"  dcp.save, {world} ranks           {dcp_t:6.3f} s")
        print(f"  ratio sharded / single         {sharded / single:6.2f}x   (target <= 1.1x)")
        print(f"  ratio sharded / dcp            {sharded / dcp_t:6.2f}x   (target <= 0.6x)")
        for kind in ("warm", "cold"):
            load = median(loads[f"load {kind}"])
            read = median(loads[f"read {kind}"])
            print(
                f"  reshard load 2->1 {kind}: sp.load {load:6.3f} s, plain read {read:6.3f} s, "
                f"ratio {load / read:5.2f}x   (target <= 1.3x)"
            )
        print("raw:", {k: [round(x, 3) for x in v] for k, v in {**results, **loads}.items()})
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--dir", default="/tmp/sp-bench-dist")
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
