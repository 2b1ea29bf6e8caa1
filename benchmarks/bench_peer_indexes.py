"""What a restore from peer memory of a version 7 checkpoint plans before it fetches data files:
the index files it fetches, and the time its planning takes, on one rank, without a wire.

Usage::

    .venv/bin/python benchmarks/bench_peer_indexes.py --ranks 256 --tensors 2000 [--dir D]
        [--rounds 3]

Saves (unless ``--dir`` already holds it) the checkpoint of ``benchmarks/bench_grid_load.py``
(the same state, ``--ranks`` simulated ranks, the real writer), then, for rank 1 of half the
world restoring into its Shards (what ``sp.Tier.peers`` does before its data files:
:mod:`savepoint.runs._peer_indexes` and the plan of :func:`savepoint.distributed.needs.files_needed`),
times ``--rounds`` times each way, the indexes read from the folder as if fetched:

- **every index** (before): every index fetched, the manifest parsed with all of them, the plan;
- **the indexes it reads** (now): the dry run naming them, those fetched, the manifest parsed
  lazily, the plan.

Prints one JSON line: ``ranks``, ``tensors``, the medians ``every_s`` and ``lazy_s``, the
index files each fetches (``every_indexes``, ``lazy_indexes``) and the data files the plan
names (the same both ways: checked).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

from bench_grid_load import saved, state
from savepoint.codecs import manifest as mf
from savepoint.distributed.needs import files_needed
from savepoint.runs._peer_indexes import Indexes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=256)
    ap.add_argument("--tensors", type=int, default=2000)
    ap.add_argument("--dir", default=None, help="where the checkpoint is (kept; saved if absent)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    where = args.dir or os.path.join(tempfile.mkdtemp(prefix="sp-peer-indexes-"), "c")
    saved(where, args.ranks, args.tensors)
    with open(os.path.join(where, mf.NAME), "rb") as f:
        raw = f.read()
    names = sorted(n for n in os.listdir(where) if n.startswith("index-"))
    world = max(1, args.ranks // 2)
    found: dict[str, list[float]] = {"every": [], "lazy": []}
    fetched: dict[str, int] = {}
    files: dict[str, set[str]] = {}
    for _ in range(args.rounds):
        for way in ("every", "lazy"):
            into = state(1, world, args.tensors)
            options = {"into": into}  # (sharded targets: a lazy load)
            t0 = time.perf_counter()
            indexes = Indexes(raw, where, names, options)
            if way == "every":
                indexes.lazy = False  # (as before: every index fetched, the manifest parsed whole)
            first = indexes.first()
            manifest = indexes.parse()
            files[way] = files_needed(manifest, where, into=into)
            found[way].append(time.perf_counter() - t0)
            fetched[way] = len(first)
    assert files["every"] == files["lazy"], "the plans differ"
    row = {
        "ranks": args.ranks,
        "tensors": args.tensors,
        "every_s": round(statistics.median(found["every"]), 4),
        "lazy_s": round(statistics.median(found["lazy"]), 4),
        "every_indexes": fetched["every"],
        "lazy_indexes": fetched["lazy"],
        "data_files": len(files["lazy"]),
    }
    print(json.dumps(row))


if __name__ == "__main__":
    main()
