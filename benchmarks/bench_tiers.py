"""Storage tiers: a run on a RAM disk with an object-store tier behind it (issue 17's targets).

A state of ``--mib`` MiB (float32, 16 tensors) saved by a ``CheckpointManager`` whose run
directory is on ``/dev/shm`` (the RAM tier) with a ``Tier`` on a moto S3 server on loopback (the
object-store tier, ``every=1``). Measured, medians of ``--repeat`` rounds:

- the staging copy: copying the state into already-touched buffers of the same size (what any
  snapshot of the state costs; the floor of an async save's blocking time);
- an async managed save (``async_save=True``): the time ``save`` blocks the caller, and how much
  that exceeds the staging copy (target: at most 0.05 s);
- the copy-up to the object-store tier in the background (time until ``wait()`` returns);
- ``restore(into=...)`` of the newest step from the RAM tier, and from the object-store tier (a
  fresh manager whose RAM run directory is empty: the node was lost), and their ratio (target:
  RAM at least 5x faster).

    python benchmarks/bench_tiers.py [--mib 1024] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import numpy as np

from bench_objectstore import start_server, use_server


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--ram", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    args = ap.parse_args()

    import savepoint as sp

    proc, endpoint = start_server()
    ram = tempfile.mkdtemp(prefix="bench-tiers-", dir=args.ram)
    try:
        use_server(endpoint)
        n = args.mib * 2**20 // 4 // 16
        rng = np.random.default_rng(0)
        state = {f"w{i}": rng.standard_normal(n, dtype=np.float32) for i in range(16)}
        staging = {k: np.empty_like(v) for k, v in state.items()}
        for v in staging.values():
            v.fill(0)  # touched, as a reused staging arena is

        copies, blocked, copied_up, from_ram, from_s3 = [], [], [], [], []
        home = os.path.join(ram, "run")
        tier = sp.Tier("s3://bench/run", keep=2, name="s3")
        with sp.CheckpointManager(home, keep_last=2, async_save=True, tiers=[tier]) as mgr:
            for step in range(args.repeat + 1):
                for v in state.values():
                    v[:1] = step  # a new state each round
                t = time.perf_counter()
                for k, v in state.items():
                    np.copyto(staging[k], v)
                copy_s = time.perf_counter() - t
                t = time.perf_counter()
                mgr.save(step, state)
                save_s = time.perf_counter() - t
                mgr.wait()
                up_s = time.perf_counter() - t
                if step:  # round 0 warms up (the staging arena is allocated there)
                    copies.append(copy_s)
                    blocked.append(save_s)
                    copied_up.append(up_s)
            target = {k: np.empty_like(v) for k, v in state.items()}
            for _ in range(args.repeat):
                t = time.perf_counter()
                mgr.restore(target, resume=False)
                from_ram.append(time.perf_counter() - t)
                assert mgr.restored_from == "run directory", mgr.restored_from
        assert all(np.array_equal(target[k], state[k]) for k in state)
        lost = os.path.join(ram, "new-node")
        for _ in range(args.repeat):
            shutil.rmtree(lost, ignore_errors=True)
            with sp.CheckpointManager(lost, name="run", tiers=[tier]) as fresh:
                t = time.perf_counter()
                fresh.restore(target, resume=False)
                from_s3.append(time.perf_counter() - t)
                assert fresh.restored_from == "s3", fresh.restored_from

        med = statistics.median
        print(f"tiers: {args.mib} MiB in 16 float32 tensors; RAM tier {ram}; moto S3 on loopback")
        print(f"  staging copy (touched buffers)        {med(copies):7.3f} s")
        print(
            f"  async managed save, caller blocked    {med(blocked):7.3f} s   "
            f"beyond the staging copy: {med(blocked) - med(copies):+.3f} s (target <= 0.05)"
        )
        print(f"  save + copy-up to S3 done (wait())    {med(copied_up):7.3f} s")
        print(f"  restore from the RAM tier             {med(from_ram):7.3f} s")
        print(
            f"  restore from the S3 tier              {med(from_s3):7.3f} s   "
            f"RAM is {med(from_s3) / med(from_ram):.1f}x faster (target >= 5)"
        )
    finally:
        shutil.rmtree(ram, ignore_errors=True)
        proc.kill()


if __name__ == "__main__":
    main()
