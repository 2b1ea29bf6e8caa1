"""Read-once loads on N gloo ranks: storage bytes read and time, read-once against every rank
reading for itself; and the bytes each rank reads in a verified resharding load.

Usage::

    .venv/bin/python benchmarks/bench_readonce.py [--world 8] [--mib 256] [--repeats 3]

Starts ``--world`` processes joined in a gloo group on 127.0.0.1 (one machine: the broadcasts
run over loopback TCP). Two checkpoints of about ``--mib`` MiB each, saved by the ranks:

- **replicated**: float32 tensors of 1-32 MiB plus small ones, every rank holding all of them
  (what data parallelism restores). Each rank loads it into its own zeroed copy with
  ``read_once=True`` and ``read_once=False``, alternating, after one warm-up round of each;
- **resharded**: float32 matrices of 4,096-float rows split by rows over the ranks as saved,
  restored in parts shifted by 37 rows (no part starts on a block or shard boundary), verified,
  with and without read-once.

Bytes are counted at the store: every load reads through ``FaultyStore(LocalStore(),
views=False)``, which records each ``read`` (no zero-copy views: as on an object store). Times
are from a barrier to the last rank done, medians; ``--cold`` evicts the files from the page
cache (``posix_fadvise(DONTNEED)``) before each load, which models storage that every byte
must come from. The ratios: storage bytes / checkpoint bytes (read-once target <= 1.05, every
rank for itself: N), time read-once / every rank, and per rank bytes read / bytes needed
(target <= 1.05). The last line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import savepoint as sp
from savepoint.distributed import FlatShard, Shard
from savepoint.storage.faults import FaultyStore
from savepoint.storage.local import LocalStore

MiB = 1 << 20
COLS = 4096  # floats per row of the resharded matrices: 16 KiB rows


def replicated_state(mib: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    state: dict[str, torch.Tensor] = {}
    left, i = mib * MiB, 0
    sizes = [32, 16, 8, 4, 2, 1]
    while left > 0:
        n = min(left, sizes[i % len(sizes)] * MiB)
        state[f"layer{i:03d}.weight"] = torch.randn(n // 4, generator=g)
        state[f"layer{i:03d}.bias"] = torch.randn(1024, generator=g)  # 4 KiB
        left -= n
        i += 1
    return state


def matrices(mib: int) -> dict[str, int]:
    """Row counts of the resharded matrices: about ``mib`` MiB of 16 KiB rows."""
    rows = mib * MiB // (COLS * 4)
    return {f"m{i}": n for i, n in enumerate([rows // 2, rows // 4, rows // 8, rows // 8])}


def shifted(rows: int, rank: int, world: int) -> tuple[int, int]:
    cuts = [0] + [min(rows, FlatShard.bounds(rows, r, world)[1] + 37) for r in range(world - 1)]
    cuts.append(rows)
    return cuts[rank], cuts[rank + 1]


def data_reads(store: FaultyStore) -> int:
    """Data-file bytes read since the last call (headers included: a few hundred bytes each)."""
    n = sum(c.nbytes or 0 for c in store.calls if c.kind == "read")
    store.calls.clear()
    return n


def throttle(store: FaultyStore, rate: float) -> None:
    """Every read of this rank waits its turn on a link of ``rate`` bytes/s (all its threads
    share it), as a node's link to remote storage."""
    lock = threading.Lock()
    free = [time.monotonic()]

    def wait(call: Any) -> None:
        with lock:
            start = max(free[0], time.monotonic())
            free[0] = start + (call.nbytes or 0) / rate
            until = free[0]
        time.sleep(max(0.0, until - time.monotonic()))

    store.hook("read", wait, times=None)


def evict(path: str) -> None:
    for name in os.listdir(path):
        fd = os.open(os.path.join(path, name), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def stored(path: str) -> int:
    return sum(
        os.path.getsize(os.path.join(path, f))
        for f in os.listdir(path)
        if f.endswith(".safetensors")
    )


def worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    pg = dist.group.WORLD
    base = args.dir
    if rank == 0:
        shutil.rmtree(base, ignore_errors=True)
        os.makedirs(base)
    dist.barrier()
    store = FaultyStore(LocalStore(), views=False)

    def timed(path: str, fn: Callable[[], None]) -> tuple[float, list[int]]:
        if args.cold and rank == 0:
            evict(path)
        dist.barrier()
        data_reads(store)
        start = time.perf_counter()
        fn()
        dist.barrier()
        took = time.perf_counter() - start
        counts: list[Any] = [None] * world
        dist.all_gather_object(counts, data_reads(store))
        return took, counts

    if args.throttle:
        throttle(store, args.throttle * MiB)

    # -- replicated ------------------------------------------------------------------------
    state = replicated_state(args.mib)
    rep = os.path.join(base, "replicated")
    sp.save(rep, state, process_group=pg)
    targets = {k: torch.zeros_like(v) for k, v in state.items()}
    out: dict[str, Any] = {"world": world, "replicated_bytes": stored(rep)}
    times: dict[bool, list[float]] = {True: [], False: []}
    reads: dict[bool, list[int]] = {}
    for round_ in range(args.repeats + 1):
        for once in (True, False) if round_ % 2 else (False, True):
            took, counts = timed(
                rep,
                lambda once=once, into=targets: sp.load(
                    store.at(rep), into=into, process_group=pg, read_once=once
                ),
            )
            if round_:
                times[once].append(took)
            reads[once] = counts
    for k, v in state.items():
        assert torch.equal(targets[k], v), k
    # The transport's floor: the same bytes broadcast over the world's gloo group, an even
    # share from each rank, no storage, no checks, no copies.
    floor = torch.empty(out["replicated_bytes"] // world, dtype=torch.uint8)
    floors = []
    for _ in range(args.repeats):
        dist.barrier()
        start = time.perf_counter()
        for root in range(world):
            dist.broadcast(floor, src=root)
        dist.barrier()
        floors.append(time.perf_counter() - start)
    out["broadcast_floor_s"] = statistics.median(floors)
    del floor
    for once in (True, False):
        key = "read_once" if once else "each_rank"
        out[f"{key}_s"] = statistics.median(times[once])
        out[f"{key}_storage_bytes"] = sum(reads[once])
        out[f"{key}_per_rank"] = reads[once]
    del state, targets

    # -- resharded, verified ---------------------------------------------------------------
    sizes = matrices(args.mib)
    saved: dict[str, Any] = {}
    for name, rows in sizes.items():
        a, b = FlatShard.bounds(rows, rank, world)
        g = torch.Generator().manual_seed(rows + a)
        saved[name] = Shard.split(torch.randn(b - a, COLS, generator=g), 0, rank, world, size=rows)
    rows_path = os.path.join(base, "rows")
    sp.save(rows_path, saved, process_group=pg)
    needed = 0
    into: dict[str, Any] = {}
    for name, rows in sizes.items():
        lo, hi = shifted(rows, rank, world)
        into[name] = Shard(torch.zeros(hi - lo, COLS), (rows, COLS), (lo, 0))
        needed += (hi - lo) * COLS * 4
    needs: list[Any] = [None] * world
    dist.all_gather_object(needs, needed)
    out["resharded_bytes"] = stored(rows_path)
    out["resharded_needed_per_rank"] = needs
    for once in (False, True):
        key = "resharded_read_once" if once else "resharded_each_rank"
        took, counts = timed(
            rows_path,
            lambda once=once: sp.load(
                store.at(rows_path), into=into, process_group=pg, read_once=once
            ),
        )
        out[f"{key}_s"] = took
        out[f"{key}_per_rank"] = counts
    dist.barrier()
    if rank == 0:
        shutil.rmtree(base, ignore_errors=True)
        report(out, args)
    dist.destroy_process_group()


def report(out: dict[str, Any], args: argparse.Namespace) -> None:
    world = out["world"]
    size = out["replicated_bytes"]
    link = f", reads throttled to {args.throttle:g} MiB/s per rank" if args.throttle else ""
    print(f"{world} gloo ranks on 127.0.0.1, {'cold' if args.cold else 'warm'} page cache{link}")
    print(f"replicated checkpoint: {size / MiB:.1f} MiB, every rank loads all of it")
    for key, label in (("read_once", "read_once=True "), ("each_rank", "read_once=False")):
        total = out[f"{key}_storage_bytes"]
        out[f"{key}_storage_ratio"] = total / size
        print(
            f"  {label}: storage {total / MiB:8.1f} MiB = {total / size:5.2f}x the checkpoint, "
            f"{out[f'{key}_s']:6.3f} s (median of {args.repeats})"
        )
    out["time_ratio"] = out["read_once_s"] / out["each_rank_s"]
    out["floor_ratio"] = out["read_once_s"] / out["broadcast_floor_s"]
    print(f"  storage ratio target <= 1.05x; time read-once / each rank {out['time_ratio']:.2f}x")
    print(
        f"  transport floor (the same bytes broadcast, an even share from each rank): "
        f"{out['broadcast_floor_s']:.3f} s; read-once / floor {out['floor_ratio']:.2f}x"
    )
    needs = out["resharded_needed_per_rank"]
    print(
        f"resharded checkpoint: {out['resharded_bytes'] / MiB:.1f} MiB, row-split as saved, "
        "restored in parts 37 rows off, verified"
    )
    for key, label in (
        ("resharded_each_rank", "read_once=False"),
        ("resharded_read_once", "read_once=True "),
    ):
        ratios = [r / n for r, n in zip(out[f"{key}_per_rank"], needs)]
        out[f"{key}_max_ratio"] = max(ratios)
        total = sum(out[f"{key}_per_rank"]) / out["resharded_bytes"]
        print(
            f"  {label}: bytes read / needed per rank max {max(ratios):.3f}x "
            f"(min {min(ratios):.3f}x), storage {total:.3f}x the checkpoint, "
            f"{out[f'{key}_s']:.3f} s   (target <= 1.05x)"
        )
    print(json.dumps(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cold", action="store_true")
    parser.add_argument(
        "--throttle", type=float, default=0.0, help="MiB/s: each rank's link to the storage"
    )
    parser.add_argument("--dir", default="/tmp/sp-bench-readonce")
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
