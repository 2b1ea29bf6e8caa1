"""A repeated sharded save's description, kept: what a rank pays to find its state unchanged.

Usage::

    PYTHONPATH=src .venv/bin/python benchmarks/bench_describe_memo.py [--tensors 47000] [--rounds 7]

Flattens the state of :func:`savepoint.distributed.simulate.model_state` (zero-byte tensors, a
2-d mesh) twice, describes the first with a memo key, then times the description of the second
(``describe_memo_hit_ms``: the tree compared with the one kept, the kept description reused), and
beside it the two ways of comparing two such trees: ``tree_eq_ms`` (``==``, which takes ``1`` for
``True``) and ``tree_bytes_ms`` (:func:`savepoint.distributed.layout.tree_bytes` of the new
tree, then a bytes comparison: what the memo does). Prints one JSON line of medians. To compare
two checkouts, run this in each, interleaved (``docs/distributed.md``, "Regular layouts").
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

from savepoint.distributed import describe, layout, save, simulate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tensors", type=int, default=47000)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()

    def flat() -> Any:
        return save.flatten(simulate.model_state(3, 64, args.tensors, tp=2))

    kept, new = flat(), flat()
    kept_bytes = layout.tree_bytes(kept.tree)
    key = ("bench", "describe-memo")
    describe.describe_layout(kept, "a", key)

    def timed(fn: Callable[[], Any]) -> float:
        samples = []
        for _ in range(args.rounds):
            t = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t)
        return round(statistics.median(samples) * 1000, 2)

    out = {
        "tensors": len(new.tensors),
        "tree_bytes": len(kept_bytes or b""),
        "describe_memo_hit_ms": timed(lambda: describe.describe_layout(new, "b", key)),
        "tree_eq_ms": timed(lambda: kept.tree == new.tree),
        "tree_bytes_ms": timed(lambda: layout.tree_bytes(new.tree) == kept_bytes),
    }
    describe.forget(key)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
