"""Time to durable of one background save with nothing else running, against the disk's floor.

Usage::

    .venv/bin/python benchmarks/bench_durable.py [--mib 4096] [--rounds 4] [--variants default w2 m8192]

For each round (the first a warm-up, not counted), each variant of
``sp.AsyncCheckpointer(writer="process")`` saves the same state (about 300 float32 tensors: four
big ones holding three quarters of the bytes) and waits until it is durable (``save()`` +
``wait()``: the staging copy included), then the bare O_DIRECT writer of ``bench_async.py``
(``_bare_writer.py``: 64 MiB writes from one aligned buffer, fsync) writes as many bytes.
Variants: ``default``; ``wN``: ``writers=N`` files at once; ``mN``: ``max_file_bytes`` N MiB.
Prints each one's median and rounds, and the ratio to the bare writer's (issue 27: time to
durable at most 1.1x the O_DIRECT floor). ``bench_async.py --writer`` measures the same after a
loop has run; this one isolates the save, so the two show how much of a difference is the disk's
minute-to-minute speed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def state_of(mib: int) -> dict:
    import torch

    torch.manual_seed(0)
    total = mib << 20
    big = total * 3 // 4 // 4 // 4  # float32 elements of each of the four big tensors
    state = {f"b{i}": torch.randn(big) for i in range(4)}
    rest = (total - sum(t.nbytes for t in state.values())) // 4 // 296
    state.update({f"s{i}": torch.randn(max(rest, 1)) for i in range(296)})
    return state


def main() -> int:
    import savepoint as sp
    from bench_async import BareWriter

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--dir", default="/tmp/sp-bench-durable")
    parser.add_argument("--variants", nargs="+", default=["default"])
    args = parser.parse_args()
    state = state_of(args.mib)
    nbytes = sum(t.nbytes for t in state.values())
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    bare = BareWriter(os.path.join(args.dir, "bare"), "normal")
    checkpointers = {}
    for v in args.variants:
        kw = {}
        if v.startswith("w"):
            kw["writers"] = int(v[1:])
        elif v.startswith("m"):
            kw["max_file_bytes"] = int(v[1:]) << 20
        elif v != "default":
            parser.error(f"unknown variant {v!r}")
        checkpointers[v] = sp.AsyncCheckpointer(writer="process", **kw)
    times: dict[str, list[float]] = {v: [] for v in [*args.variants, "O_DIRECT floor"]}
    try:
        for r in range(args.rounds):
            for v, ck in checkpointers.items():
                path = os.path.join(args.dir, f"{v}-{r}")
                t0 = time.perf_counter()
                ck.save(path, state)
                ck.wait()
                if r:
                    times[v].append(time.perf_counter() - t0)
                shutil.rmtree(path, ignore_errors=True)
            t0 = time.perf_counter()
            bare.start(nbytes)()
            if r:
                times["O_DIRECT floor"].append(time.perf_counter() - t0)
    finally:
        for ck in checkpointers.values():
            ck.close()
        bare.close()
        shutil.rmtree(args.dir, ignore_errors=True)
    floor = statistics.median(times["O_DIRECT floor"])
    print(f"{nbytes / 2**30:.2f} GiB, medians of {args.rounds - 1} rounds after a warm-up")
    for v, ts in times.items():
        med = statistics.median(ts)
        print(f"  {v:16} {med:7.3f} s  / floor {med / floor:5.2f}   {[round(t, 3) for t in ts]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
