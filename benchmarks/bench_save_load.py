"""Durable save and warm/cold load of a ~300-tensor float32 state, savepoint against its peers.

Usage::

    .venv/bin/python benchmarks/bench_save_load.py [--gib 1] [--repeats 5] [--dir /tmp/sp-bench]

Every contender runs in the same process, interleaved round by round after one warm-up round,
and the medians are compared as ratios. Saves are durable for everyone (each file fsynced). Peers:
``torch.save`` + fsync, ``safetensors.torch.save_file`` + fsync, ``torch.distributed.checkpoint.save``
(single process), and the floor: an O_DIRECT write of the same bytes from an aligned buffer + fsync.
Loads restore into the same, already-allocated parameters: ``sp.load(into=...)`` against
``torch.load(mmap=True)`` + ``copy_``; "cold" evicts the files from the page cache first
(``posix_fadvise(DONTNEED)``, no root needed). Peak extra memory of a save is sampled from
``/proc/self/statm`` in a thread while the save runs (staging buffers released first, so the
first-save cost is counted).
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

import savepoint as sp

try:  # the write pipeline's staging buffers: savepoint.engine since issue 14, storage.local before
    from savepoint.engine.pipeline import POOL
except ImportError:  # pragma: no cover - an older tree, measured for comparison
    from savepoint.storage.local import POOL  # type: ignore[attr-defined,no-redef]

MiB = 1 << 20


def make_state(total_bytes: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A few 64 MiB tensors and many of 4 KiB-1 MiB, about 300 in all, float32."""
    rng = np.random.default_rng(seed)
    n_big = max(1, round(total_bytes * 0.9 / (64 * MiB)))
    sizes = [64 * MiB] * n_big
    small = np.exp(rng.uniform(np.log(4096), np.log(MiB), size=300 - n_big - 1)).astype(np.int64)
    sizes += [int(s) // 4 * 4 for s in small]
    rest = total_bytes - sum(sizes)
    if rest > 0:
        sizes.append(rest // 4 * 4)
    state = {}
    for i, size in enumerate(sizes):
        state[f"layer{i:03d}.weight"] = torch.from_numpy(
            rng.standard_normal(size // 4, dtype=np.float32)
        )
    return state


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def evict(path: str) -> None:
    paths = (
        [path]
        if os.path.isfile(path)
        else [os.path.join(root, f) for root, _, files in os.walk(path) for f in files]
    )
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def rm(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.unlink(path)


class PeakRSS:
    """Samples resident memory every millisecond; ``extra`` is the peak above the start."""

    def __init__(self) -> None:
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.peak = 0
        self._stop = threading.Event()

    def _rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    def __enter__(self) -> PeakRSS:
        self.start = self._rss()
        self.peak = self.start
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._rss())
            time.sleep(0.001)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())

    @property
    def extra(self) -> int:
        return self.peak - self.start


def odirect_floor(nbytes: int, path: str) -> None:
    """The disk's floor: O_DIRECT writes of an already-filled, 4 KiB-aligned 64 MiB buffer + fsync."""
    chunk = 64 * MiB
    buf = mmap.mmap(-1, chunk)
    np.frombuffer(buf, dtype=np.uint8).fill(1)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    try:
        written = 0
        while written < nbytes:
            n = min(chunk, -(-(nbytes - written) // 4096) * 4096)
            written += os.write(fd, memoryview(buf)[:n])
        os.fsync(fd)
    finally:
        os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", default="/tmp/savepoint-bench")
    ap.add_argument("--no-dcp", action="store_true", help="skip torch.distributed.checkpoint")
    ap.add_argument("--writers", type=int, default=sp.SaveOptions().writers)
    ap.add_argument("--max-file-mib", type=int, default=sp.SaveOptions().max_file_bytes // MiB)
    args = ap.parse_args()

    total = int(args.gib * (1 << 30))
    state = make_state(total)
    nbytes = sum(t.numel() * 4 for t in state.values())
    os.makedirs(args.dir, exist_ok=True)
    print(
        f"state: {len(state)} float32 tensors, {nbytes / 2**30:.3f} GiB; dir {args.dir}; "
        f"torch {torch.__version__}, savepoint {sp.__version__}; {os.cpu_count()} cores"
    )

    paths = {
        "savepoint": os.path.join(args.dir, "sp"),
        "torch.save": os.path.join(args.dir, "ts.pt"),
        "safetensors": os.path.join(args.dir, "st.safetensors"),
        "dcp": os.path.join(args.dir, "dcp"),
        "odirect": os.path.join(args.dir, "raw.bin"),
    }

    def sp_save() -> None:
        sp.save(
            paths["savepoint"], state, writers=args.writers, max_file_bytes=args.max_file_mib * MiB
        )

    def torch_save() -> None:
        with open(paths["torch.save"], "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())

    def st_save() -> None:
        from safetensors.torch import save_file

        save_file(state, paths["safetensors"])
        fsync_path(paths["safetensors"])

    def dcp_save() -> None:
        import torch.distributed.checkpoint as dcp

        rm(paths["dcp"])
        dcp.save(state, checkpoint_id=paths["dcp"])
        for root, _, files in os.walk(paths["dcp"]):
            for f in files:
                fsync_path(os.path.join(root, f))

    def raw() -> None:
        rm(paths["odirect"])
        odirect_floor(nbytes, paths["odirect"])

    savers: dict[str, Callable[[], None]] = {
        "savepoint": sp_save,
        "torch.save": torch_save,
        "safetensors": st_save,
        "odirect floor": raw,
    }
    if not args.no_dcp:
        savers["dcp.save"] = dcp_save

    times: dict[str, list[float]] = {k: [] for k in savers}
    for rnd in range(args.repeats + 1):
        for name, fn in savers.items():
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            if rnd:  # round 0 is the warm-up write
                times[name].append(dt)
    med = {k: statistics.median(v) for k, v in times.items()}
    print("\ndurable save, median of", args.repeats, "(s):")
    for k, v in med.items():
        print(
            f"  {k:14s} {v:6.3f}   {nbytes / v / 2**30:5.2f} GiB/s   runs {[round(x, 3) for x in times[k]]}"
        )
    print("ratios:")
    print(
        f"  savepoint / safetensors+fsync   {med['savepoint'] / med['safetensors']:.2f}  (target <= 1.0)"
    )
    print(
        f"  savepoint / torch.save+fsync    {med['savepoint'] / med['torch.save']:.2f}  (target <= 0.6)"
    )
    print(f"  savepoint / O_DIRECT floor      {med['savepoint'] / med['odirect floor']:.2f}")
    if "dcp.save" in med:
        print(f"  savepoint / dcp.save            {med['savepoint'] / med['dcp.save']:.2f}")

    # Peak extra memory of one save, staging buffers released first so their cost is counted.
    POOL.clear()
    with PeakRSS() as mem:
        sp_save()
    limit = 64 * MiB + 0.05 * nbytes
    print(
        f"\npeak extra memory during sp.save: {mem.extra / MiB:.1f} MiB "
        f"(limit 64 MiB + 5% = {limit / MiB:.1f} MiB)"
    )

    # Loads into existing parameters.
    params = {k: torch.empty_like(v) for k, v in state.items()}
    for p in params.values():
        p.zero_()

    def sp_load(verify: bool = True) -> None:
        sp.load(paths["savepoint"], into=params, verify=verify)

    def torch_load() -> None:
        loaded = torch.load(paths["torch.save"], mmap=True, weights_only=True)
        with torch.no_grad():
            for k, p in params.items():
                p.copy_(loaded[k])

    loaders: dict[str, Callable[[], Any]] = {
        "savepoint": sp_load,
        "savepoint verify=False": lambda: sp_load(False),
        "torch.load mmap+copy": torch_load,
    }
    for temp in ("warm", "cold"):
        lt: dict[str, list[float]] = {k: [] for k in loaders}
        for rnd in range(args.repeats + 1):
            for name, fn in loaders.items():
                if temp == "cold":
                    evict(
                        paths["savepoint"] if name.startswith("savepoint") else paths["torch.save"]
                    )
                t0 = time.perf_counter()
                fn()
                dt = time.perf_counter() - t0
                if rnd:
                    lt[name].append(dt)
        lm = {k: statistics.median(v) for k, v in lt.items()}
        print(f"\n{temp} load into existing params, median (s):")
        for k, v in lm.items():
            print(f"  {k:24s} {v:6.3f}   runs {[round(x, 3) for x in lt[k]]}")
        print(
            f"  savepoint / torch.load(mmap)+copy   {lm['savepoint'] / lm['torch.load mmap+copy']:.2f}"
            + ("  (target <= 1.1, issue 16)" if temp == "warm" else "")
        )
        print(
            f"  checksum cost: {(lm['savepoint'] / lm['savepoint verify=False'] - 1) * 100:.0f}% "
            f"of a {temp} load" + ("  (target < 15%)" if temp == "warm" else "")
        )
    ok = all(torch.equal(params[k], state[k]) for k in state)
    print(f"\nrestored state equals saved state: {ok}")
    for p in paths.values():
        rm(p)
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
