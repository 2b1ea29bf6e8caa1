"""Reading a checkpoint of DCP's own ``FileSystemWriter`` (issue 30): savepoint's import against
``dcp.load`` of the same checkpoint into the same tensors, same run.

One process saves a state of float32 tensors (``--mib`` MiB in ``--tensors`` tensors, 16 by
default; many small ones show the per-tensor costs: ``.metadata`` and each chunk's ``data.pkl``)
with plain ``dcp.save`` (``FileSystemWriter``, one ``.distcp`` of ``torch.save`` archives). Then,
for ``--repeat`` rounds in alternating order, each reader fills the same preallocated tensors:
``dcp.load(into, checkpoint_id=...)`` (``FileSystemReader``: ``torch.load`` of each item, CRC-32
checked by miniz) and ``sp.load(path, into=flat)`` (savepoint's reader: the archives parsed, each
storage record CRC-32 checked once, then copied into the targets). Cold: the page cache dropped
for the files before each load (``posix_fadvise(DONTNEED)``); warm: read again at once. Medians;
the target ratio is savepoint / DCP time, the median of the per-round ratios (at most 1.0, "at
least as fast as dcp.load"), printed with whether it is met.

Also: ``sp.verify`` (every record's CRC-32) and ``savepoint convert`` into savepoint's format.

    python benchmarks/bench_dcp_import.py [--mib 1024] [--tensors 16] [--repeat 5] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import warnings

from bench_save_load import evict

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--tensors", type=int, default=16, help="how many tensors hold the MiB")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    args = ap.parse_args()

    import torch
    import torch.distributed.checkpoint as dcp

    import savepoint as sp

    n = args.mib * 1024 * 1024 // 4 // args.tensors
    state = {f"layer{i}.weight": torch.randn(n) for i in range(args.tensors)}
    root = tempfile.mkdtemp(dir=args.dir)
    path = os.path.join(root, "dcp")
    dcp.save({"model": state}, checkpoint_id=path, no_dist=True)
    into_dcp = {"model": {k: torch.empty_like(v) for k, v in state.items()}}
    into_sp = {f"model.{k}": torch.empty_like(v) for k, v in state.items()}

    def load_dcp() -> None:
        dcp.load(into_dcp, checkpoint_id=path, no_dist=True)

    def load_sp() -> None:
        sp.load(path, into=into_sp)

    peers = {"savepoint": load_sp, "dcp.load": load_dcp}
    times: dict[str, list[float]] = {f"{k} {m}": [] for k in peers for m in ("cold", "warm")}
    try:
        for rnd in range(args.repeat + 1):
            order = list(peers.items()) if rnd % 2 else list(reversed(peers.items()))
            for name, load in order:
                evict(path)
                t = time.perf_counter()
                load()
                cold = time.perf_counter() - t
                t = time.perf_counter()
                load()
                warm = time.perf_counter() - t
                if rnd:  # round 0 warms up
                    times[f"{name} cold"].append(cold)
                    times[f"{name} warm"].append(warm)
        for k, v in state.items():
            assert torch.equal(into_sp[f"model.{k}"], v) and torch.equal(into_dcp["model"][k], v)
        evict(path)
        t = time.perf_counter()
        sp.verify(path)
        t_verify = time.perf_counter() - t
        t = time.perf_counter()
        sp.convert(path, os.path.join(root, "ckpt"))
        t_convert = time.perf_counter() - t
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    size = args.mib / 1024
    print(
        f"DCP FileSystemWriter checkpoint, {args.mib} MiB in {args.tensors} float32 tensors, "
        "one process,"
    )
    print(f"{args.repeat} rounds, medians")
    verdicts = []
    for mode in ("cold", "warm"):
        ours, theirs = med[f"savepoint {mode}"], med[f"dcp.load {mode}"]
        # Per round: the two loads of one round ran back to back (interleaved).
        rounds = [a / b for a, b in zip(times[f"savepoint {mode}"], times[f"dcp.load {mode}"])]
        ratio = statistics.median(rounds)
        verdicts.append((mode, ratio))
        print(
            f"  load {mode}: sp.load {ours:.3f} s ({size / ours:.2f} GiB/s)   dcp.load "
            f"{theirs:.3f} s ({size / theirs:.2f} GiB/s)   savepoint/dcp per round: "
            + ", ".join(f"{r:.2f}" for r in rounds)
        )
    for mode, ratio in verdicts:
        print(
            f"  TARGET sp.load time <= dcp.load time ({mode}): measured savepoint/dcp {ratio:.2f} "
            f"(median of rounds) -> {'met' if ratio <= 1.0 else 'NOT met'}"
        )
    print(f"  sp.verify (cold, every CRC-32): {t_verify:.3f} s ({size / t_verify:.2f} GiB/s)")
    print(f"  sp.convert into savepoint's format: {t_convert:.3f} s ({size / t_convert:.2f} GiB/s)")


if __name__ == "__main__":
    main()
