"""Incremental saves through the engine: ``sp.save(..., blobs=...)`` of a LoRA-style state.

Usage::

    .venv/bin/python benchmarks/bench_incremental.py [--mib 512] [--dir /tmp/sp-bench-inc]
        [--repeats 3]

A state of ``--mib`` MiB with 95% of its bytes frozen (one big float32 tensor per 64 MiB) and 5%
trainable (adapters, changed before every save). For each repeat: a plain full save
(``sp.save``, the baseline), then incremental saves into one blob store: the first (everything
written), and the second (after the adapters changed: only they are written). Reports the bytes
each writes (blob store growth plus the checkpoint directory) and its time, medians over the
repeats, and the second save's fraction of a full save's bytes and time. Also a load of the
incremental checkpoint against a load of the plain one.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

import savepoint as sp
from savepoint.blobs import BlobPolicy, BlobStore


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def lora_state(frozen: list[np.ndarray[Any, Any]], rng: np.random.Generator) -> dict[str, Any]:
    total = sum(f.nbytes for f in frozen)
    adapters = total // 19 // 4  # float32 elements: 5% of the state's bytes
    per = max(1, adapters // len(frozen))
    return {
        "frozen": {f"layer{i}": f for i, f in enumerate(frozen)},
        "adapters": {
            f"layer{i}": rng.standard_normal(per).astype(np.float32) for i in range(len(frozen))
        },
        "step": int(rng.integers(1 << 20)),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="sp-bench-inc-"))
    rng = np.random.default_rng(0)
    layer = min(64, args.mib) << 20
    frozen = [
        rng.standard_normal(layer // 4).astype(np.float32)
        for _ in range(max(1, args.mib * 95 // 100 * (1 << 20) // layer))
    ]
    policy = BlobPolicy()
    rows: dict[str, list[float]] = {}

    def add(name: str, value: float) -> None:
        rows.setdefault(name, []).append(value)

    try:
        for r in range(args.repeats):
            run = root / f"r{r}"
            run.mkdir(parents=True)
            state = lora_state(frozen, rng)  # made before the clock starts
            t0 = time.perf_counter()
            sp.save(run / "full", state)
            add("full save s", time.perf_counter() - t0)
            add("full save bytes", dir_bytes(run / "full"))
            store = BlobStore.open(run / "blobs")
            for i in range(2):
                before = dir_bytes(run / "blobs")
                state = lora_state(frozen, rng)
                t0 = time.perf_counter()
                sp.save(run / f"inc{i}", state, blobs=store, blob_policy=policy)
                add(f"incremental save {i + 1} s", time.perf_counter() - t0)
                written = dir_bytes(run / "blobs") - before + dir_bytes(run / f"inc{i}")
                add(f"incremental save {i + 1} bytes", written)
            for name in ("full", "inc1"):
                t0 = time.perf_counter()
                sp.load(run / name)
                add(f"load {name} s", time.perf_counter() - t0)
            shutil.rmtree(run)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in rows.items()}
    state_mib = sum(f.nbytes for f in frozen) / 0.95 / 2**20
    print(f"LoRA-style state: {state_mib:.0f} MiB, 95% frozen; {args.repeats} repeats, medians")
    print(f"(cpus: {os.cpu_count()}, directory: {root})")
    for k, v in med.items():
        print(f"  {k:<28} {v / 2**20:10.1f} MiB" if k.endswith("bytes") else f"  {k:<28} {v:10.3f}")
    print(
        f"second incremental save: {med['incremental save 2 bytes'] / med['full save bytes']:.1%} "
        f"of a full save's bytes, {med['incremental save 2 s'] / med['full save s']:.2f}x its time"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
