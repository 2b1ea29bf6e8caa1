"""``sp.copy`` of incremental checkpoints: what a tier's copy-up costs with blobs.

Usage::

    .venv/bin/python benchmarks/bench_copy_blobs.py [--mib 256] [--dir /tmp/sp-bench-copy]
        [--repeats 3]

A LoRA-style state of ``--mib`` MiB (95% frozen float32, 5% adapters changed before every save)
is saved incrementally twice into one run (``<run>/checkpoints/step-N``, ``<run>/blobs``). For
each repeat, into a fresh "tier" directory: a plain ``sp.copy`` of a plain save of the same state
(the baseline), the first copy of step 1 (every blob copied), the copy of step 2 (only the
adapters' blobs), and ``materialize=True`` of step 2 (a plain checkpoint). Reports medians of the
times and the bytes each copy writes (blob store growth plus the checkpoint directory).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

import savepoint as sp
from savepoint.blobs import BlobPolicy, PutStats


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def lora(frozen: list[np.ndarray[Any, Any]], rng: np.random.Generator) -> dict[str, Any]:
    per = sum(f.nbytes for f in frozen) // 19 // 4 // len(frozen)
    return {
        "frozen": {f"layer{i}": f for i, f in enumerate(frozen)},
        "adapters": {
            f"layer{i}": rng.standard_normal(per).astype(np.float32) for i in range(len(frozen))
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="sp-bench-copy-"))
    rng = np.random.default_rng(0)
    layer = min(64, args.mib) << 20
    frozen = [
        rng.standard_normal(layer // 4).astype(np.float32)
        for _ in range(max(1, (args.mib << 20) * 95 // 100 // layer))
    ]
    run = root / "run"
    policy = BlobPolicy()
    steps = {}
    for step in (1, 2):
        steps[step] = run / "checkpoints" / f"step-{step}"
        state = lora(frozen, rng)
        sp.save(steps[step], state, blobs=run / "blobs", blob_policy=policy)
    sp.save(root / "plain", state)
    rows: dict[str, list[tuple[float, int]]] = {}

    def timed(name: str, tier: Path, src: Path, dst: Path, **kw: Any) -> None:
        before = dir_bytes(tier)
        started = time.perf_counter()
        sp.copy(src, dst, **kw)
        rows.setdefault(name, []).append((time.perf_counter() - started, dir_bytes(tier) - before))

    try:
        for _ in range(args.repeats):
            tier = root / "tier"
            shutil.rmtree(tier, ignore_errors=True)
            timed("plain copy (baseline)", tier, root / "plain", tier / "plain")
            into = tier / "checkpoints"
            stats = PutStats()
            timed("first copy (every blob)", tier, steps[1], into / "step-1", stats=stats)
            assert stats.blobs_reused == 0
            timed("second copy (adapters changed)", tier, steps[2], into / "step-2")
            timed("materialize=True", tier, steps[2], tier / "plain-2", materialize=True)
        total = dir_bytes(root / "plain")
        print(f"state: {total / 2**20:.1f} MiB, {len(frozen)} frozen tensors + adapters")
        print(f"{'copy':34} {'median s':>9} {'MiB written':>12} {'of a full copy':>15}")
        for name, values in rows.items():
            seconds = statistics.median(v[0] for v in values)
            written = statistics.median(v[1] for v in values)
            print(f"{name:34} {seconds:9.3f} {written / 2**20:12.1f} {written / total:15.1%}")
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
