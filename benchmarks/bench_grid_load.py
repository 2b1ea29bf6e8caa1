"""A real resharding load of a version 7 (grid) checkpoint on one rank: what the index files cost.

Usage::

    .venv/bin/python benchmarks/bench_grid_load.py --ranks 256 --tensors 2000 [--dir D] [--rounds 3]

Saves (unless ``--dir`` already holds it) the state of :func:`savepoint.distributed.simulate.model_state`
(small local parts: ``hidden`` 64, 4 experts) by ``--ranks`` simulated ranks with the real
writer (data files and one index file per rank), then loads rank 1 of half the world into its
Shards with ``sp.load(into=...)`` (the sharded loader, no process group) ``--rounds`` times and
prints, as its last line, one JSON object: ``ranks``, ``tensors``, ``load_s`` (the median),
``all_s``, ``index_files`` (written) and ``index_files_read`` (by one load). Before issue 28's
lazy reading every load read and checked all ``--ranks`` index files; now it reads those of the
ranks whose pieces it reads.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from typing import Any

import savepoint as sp
from savepoint.distributed import simulate


def state(rank: int, world: int, tensors: int) -> Any:
    return simulate.model_state(
        rank, world, tensors, data=True, hidden=64, experts=4, expert_ffn=32
    )


def saved(where: str, ranks: int, tensors: int) -> None:
    """The version 7 checkpoint of ``ranks`` simulated ranks at ``where``, saved if absent
    (kept: the benchmarks that read it can share one)."""
    if os.path.exists(os.path.join(where, "manifest.json")):
        return
    sim = simulate.simulate_save(ranks, lambda r, w: state(r, w, tensors), where, writer="real")
    failed = [r for r in sim.results if isinstance(r, BaseException)]
    if failed:
        raise failed[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=256)
    ap.add_argument("--tensors", type=int, default=2000)
    ap.add_argument("--dir", default=None, help="where the checkpoint is (kept; saved if absent)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    where = args.dir or os.path.join(tempfile.mkdtemp(prefix="sp-grid-load-"), "c")
    saved(where, args.ranks, args.tensors)
    indexes = sorted(n for n in os.listdir(where) if n.startswith("index-"))
    read: list[str] = []
    from savepoint.storage import _local_read  # counting the index files a load reads

    real = _local_read.LocalPinned.read_small

    def read_small(self: Any, name: str, *, cap: int | None) -> bytes:
        read.append(name)
        return real(self, name, cap=cap)

    _local_read.LocalPinned.read_small = read_small  # type: ignore[method-assign]
    times = []
    for _ in range(args.rounds):
        into = state(1, max(1, args.ranks // 2), args.tensors)
        read.clear()
        t0 = time.perf_counter()
        sp.load(where, into=into)
        times.append(time.perf_counter() - t0)
    row = {
        "ranks": args.ranks,
        "tensors": args.tensors,
        "load_s": round(statistics.median(times), 4),
        "all_s": [round(t, 4) for t in times],
        "index_files": len(indexes),
        "index_files_read": len({n for n in read if n in set(indexes)}),
    }
    print(json.dumps(row))


if __name__ == "__main__":
    main()
