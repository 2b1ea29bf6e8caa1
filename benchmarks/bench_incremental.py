"""Incremental saves through the engine: ``sp.save(..., blobs=...)`` of a LoRA-style state,
or a recommendation-style one through ``CheckpointManager(incremental=True)``.

Usage::

    .venv/bin/python benchmarks/bench_incremental.py [--mib 512] [--dir /tmp/sp-bench-inc]
        [--repeats 3]
    .venv/bin/python benchmarks/bench_incremental.py --state recsys [--mib 512] [--saves 40]
        [--changed 0.01] [--zipf]

A state of ``--mib`` MiB with 95% of its bytes frozen (one big float32 tensor per 64 MiB) and 5%
trainable (adapters, changed before every save). For each repeat: a plain full save
(``sp.save``, the baseline), then incremental saves into one blob store: the first (everything
written), and the second (after the adapters changed: only they are written); then the same
with ``frozen=["frozen"]`` (the caller declares the base frozen: the second save samples one
block per chunk of it instead of reading it all). Reports the bytes
each writes (blob store growth plus the checkpoint directory) and its time, medians over the
repeats, and the second save's fraction of a full save's bytes and time. Also a load of the
incremental checkpoint against a load of the plain one.

``--state recsys``: an embedding table of ``--mib`` MiB (rows of 128 float32, 512 bytes) and a
small dense tower; before each of ``--saves`` saves ``--changed`` of the rows change (uniformly
scattered ids, or ``--zipf``: ids drawn by popularity). Saved by a manager with
``keep_last=3``: plain (every save full), ``incremental=True`` with row patches (the default
policy), and with chunks only (``BlobPolicy(patches=False)``). Reports the bytes
each save adds to the run (mean over every save after the first: rebases included, and the
largest), its time, and the restore of the last checkpoint against a plain load.
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


def files(path: Path) -> dict[Path, tuple[int, int]]:
    out = {}
    for p in path.rglob("*"):
        try:
            st = p.stat()
        except FileNotFoundError:
            continue
        if p.is_file():
            out[p] = (st.st_size, st.st_mtime_ns)
    return out


def written_since(path: Path, before: dict[Path, tuple[int, int]]) -> int:
    """Bytes of the files under ``path`` created since ``before`` was taken, plus the growth of
    those changed (deleted files do not count against it)."""
    total = 0
    for p, (size, mtime) in files(path).items():
        old = before.get(p)
        if old is None:
            total += size
        elif old[1] != mtime:
            total += max(0, size - old[0])
    return total


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


def recsys(args: argparse.Namespace, root: Path) -> int:
    rng = np.random.default_rng(0)
    rows = (args.mib << 20) // 512
    table = rng.standard_normal((rows, 128), dtype=np.float32)
    dense = {f"mlp{i}": rng.standard_normal((256, 256)).astype(np.float32) for i in range(4)}
    popularity = np.arange(1, rows + 1, dtype=np.float64) ** -1.05
    popularity /= popularity.sum()

    def step(i: int) -> dict[str, Any]:
        n = int(rows * args.changed)
        if args.zipf:
            ids = np.unique(rng.choice(rows, n, p=popularity))
        else:
            ids = rng.choice(rows, n, replace=False)
        table[ids] += np.float32(0.01)
        for w in dense.values():
            w += np.float32(0.001)
        return {"emb": table, "dense": dense, "step": i}

    kinds: dict[str, dict[str, Any]] = {
        "full": {},
        "patches": {"incremental": True},
        "chunks only": {"incremental": True, "blob_policy": BlobPolicy(patches=False)},
    }
    sizes: dict[str, list[int]] = {k: [] for k in kinds}
    times: dict[str, list[float]] = {k: [] for k in kinds}
    results: dict[str, dict[str, float]] = {}
    try:
        managers = {
            k: sp.CheckpointManager(root / k.replace(" ", "-"), keep_last=3, **kw)
            for k, kw in kinds.items()
        }
        order = list(kinds)
        for i in range(args.saves):  # in lockstep, the order rotated: they share the noise
            state = step(i)
            for name in order[i % 3 :] + order[: i % 3]:
                run, mgr = root / name.replace(" ", "-"), managers[name]
                before = files(run)
                t0 = time.perf_counter()
                mgr.save(i, state)
                mgr.wait()
                times[name].append(time.perf_counter() - t0)
                sizes[name].append(written_since(run, before))
        for name, mgr in managers.items():
            last = mgr.step_path(args.saves - 1)
            mgr.close()
            loads = []
            for _ in range(3):
                t0 = time.perf_counter()
                out = sp.load(last)
                loads.append(time.perf_counter() - t0)
            assert out["emb"].tobytes() == table.tobytes()
            results[name] = {
                "bytes": statistics.fmean(sizes[name][1:]),
                "median bytes": statistics.median(sizes[name][1:]),
                "max bytes": max(sizes[name][1:]),
                "time": statistics.median(times[name][1:]),
                "mean time": statistics.fmean(times[name][1:]),
                "restore": statistics.median(loads),
            }
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    full = results["full"]
    ids = "Zipf ids" if args.zipf else "uniform ids"
    print(
        f"recommendation-style state: {args.mib} MiB embedding (512-byte rows) + 1 MiB dense; "
        f"{args.changed:.1%} of the rows changed per save ({ids}); {args.saves} saves"
    )
    print(
        f"(cpus: {os.cpu_count()}; CheckpointManager(keep_last=3), save + wait; a full save: "
        f"{full['time']:.3f} s, {full['bytes'] / 2**20:.1f} MiB; its restore "
        f"{full['restore']:.3f} s)"
    )
    print(
        f"  {'':<12} {'bytes/save: mean':>17} {'median':>7} {'max':>7}  "
        f"{'time/save: median':>17} {'mean':>6}  {'restore':>7}"
    )
    for name, r in results.items():
        print(
            f"  {name:<12} {r['bytes'] / full['bytes']:17.2%} "
            f"{r['median bytes'] / full['bytes']:7.2%} {r['max bytes'] / full['bytes']:7.1%}"
            f"  {r['time'] / full['time']:16.2f}x {r['mean time'] / full['time']:5.2f}x  "
            f"{r['restore'] / full['restore']:6.2f}x"
        )
    print(
        "(every save after the first; bytes and times as fractions of the full saves' means and "
        "medians; restore: sp.load of the last checkpoint, median of 3)"
    )
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--state", choices=("lora", "recsys"), default="lora")
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--saves", type=int, default=40)
    parser.add_argument("--changed", type=float, default=0.01)
    parser.add_argument("--zipf", action="store_true")
    args = parser.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="sp-bench-inc-"))
    if args.state == "recsys":
        return recsys(args, root)
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
            for tag, hint in (("", None), (" frozen=", ["frozen"])):
                blobs = run / f"blobs{len(tag)}"
                store = BlobStore.open(blobs)
                for i in range(2):
                    before = dir_bytes(blobs)
                    state = lora_state(frozen, rng)
                    t0 = time.perf_counter()
                    name = f"inc{i}" if not tag else f"frozen{i}"
                    sp.save(run / name, state, blobs=store, blob_policy=policy, frozen=hint)
                    add(f"incremental save {i + 1}{tag} s", time.perf_counter() - t0)
                    written = dir_bytes(blobs) - before + dir_bytes(run / name)
                    add(f"incremental save {i + 1}{tag} bytes", written)
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
    for tag, how in (("", ""), (" frozen=", " with frozen=['frozen'] (the base only sampled)")):
        print(
            f"second incremental save{how}: "
            f"{med[f'incremental save 2{tag} bytes'] / med['full save bytes']:.1%} of a full "
            f"save's bytes, {med[f'incremental save 2{tag} s'] / med['full save s']:.2f}x its time"
        )
    # (the same ratios as lines benchmarks/compare_trees.py collects: no digit in the name)
    for tag, name in (("", "second save"), (" frozen=", "second save, frozen")):
        ratio = med[f"incremental save 2{tag} s"] / med["full save s"]
        print(f"  {name} / full save, time   {ratio:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
