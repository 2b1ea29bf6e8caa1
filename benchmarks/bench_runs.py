"""The cost of a managed save (``CheckpointManager.save``): its bookkeeping against the history's
length, and against a plain ``sp.save`` of the same state.

Usage::

    .venv/bin/python benchmarks/bench_runs.py [--history 1000000] [--rounds 15] [--mib 128 1]
                                              [--dir /tmp/sp-bench-runs]

1. **History.** Two runs (``keep_last=2``, ``best_metric``), one fresh and one with ``--history``
   steps logged through the public API (``mgr.log(step, loss=...)``, then a save and a close, as
   a long training run leaves it; the time this takes is printed). Both are reopened, then saved
   to in turn, round after round, with 100 ``log()`` calls before each save. A save is timed from
   the call to its return; its background step (verification, retention) is waited for outside
   the timed region. Printed: the median save at 0 and at ``--history`` steps, and their ratio.
2. **Managed against plain.** For each ``--mib``: per round, a plain ``sp.save`` to a new path
   (the previous one removed outside the timing) and to the same path (a replace), and a managed
   save of the same state to a run (``keep_last=2``, ``best_metric`` improving at every save, so
   that ``latest/`` and ``best/`` both move and one old checkpoint is pruned: the most work a
   managed save does), after two warm-up rounds, in alternating order. Printed: the medians, the
   ratios, and how long the background step took after the save had returned. After each timed
   save, untimed, ``os.sync()`` flushes what it left (a journal commits all pending metadata at
   the next fsync, whoever calls it: without this the next contender pays for the previous
   one's deletions; in training, the seconds between saves do it).
3. **fsyncs.** ``os.fsync`` and ``os.fdatasync`` calls of one plain save and one managed save,
   before the save returns and in its background step.

Every figure is a median over the rounds; compare ratios, not seconds (the disk of a shared
machine changes speed from one minute to the next). Works against an older tree too
(``benchmarks/compare_trees.py``), which has no background step (``wait()`` returns at once).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np

import savepoint as sp

MiB = 1 << 20
LOGS_PER_SAVE = 100


def make_state(mib: float, seed: int = 0) -> dict[str, Any]:
    """``mib`` MiB of float32 in 8 tensors, and a step counter."""
    rng = np.random.default_rng(seed)
    n = max(1, int(mib * MiB) // 4 // 8)
    return {f"layer{i}": rng.standard_normal(n).astype(np.float32) for i in range(8)} | {"step": 0}


def settle() -> None:
    """Between two timed saves: flush what the untimed part left (a removed checkpoint, the
    background step's deletions), as the seconds of training between two saves would, so that
    no contender's fsync pays for another's metadata (a journal commits everything pending)."""
    os.sync()


def median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1000


def open_manager(path: str) -> sp.CheckpointManager:
    return sp.CheckpointManager(path, keep_last=2, best_metric="val")


# -- 1. the history ---------------------------------------------------------------------------------


def build_history(path: str, steps: int, state: dict[str, Any]) -> None:
    t0 = time.perf_counter()
    with open_manager(path) as m:
        for step in range(1, steps + 1):
            m.log(step, loss=1.0 / step)
        logged = time.perf_counter() - t0
        m.save(steps, state, {"val": 1.0})
        m.wait()
    total = time.perf_counter() - t0
    if steps:
        print(
            f"  built {steps} logged steps in {total:.1f} s ({logged / steps * 1e9:.0f} ns per "
            f"log() call, then one save and close: {total - logged:.1f} s)"
        )


def bench_history(root: str, steps: int, rounds: int) -> None:
    print(f"history: a managed save (1 MiB) after 0 and after {steps} logged steps")
    state = make_state(1)
    paths = {0: os.path.join(root, "h0"), steps: os.path.join(root, f"h{steps}")}
    build_history(paths[0], 0, state)
    build_history(paths[steps], steps, state)
    managers = {}
    for n, path in paths.items():
        t0 = time.perf_counter()
        managers[n] = open_manager(path)
        print(f"  reopening the run with {n} logged steps: {time.perf_counter() - t0:.2f} s")
    times: dict[int, list[float]] = {n: [] for n in paths}
    logs: dict[int, list[float]] = {n: [] for n in paths}
    order = list(paths)
    next_step = {n: n + 1 for n in paths}
    for r in range(rounds + 1):
        for n in order if r % 2 == 0 else order[::-1]:
            m, first = managers[n], next_step[n]
            t0 = time.perf_counter()
            for k in range(LOGS_PER_SAVE):
                m.log(first + k, loss=0.5)
            logs[n].append((time.perf_counter() - t0) / LOGS_PER_SAVE)
            step = first + LOGS_PER_SAVE - 1
            t0 = time.perf_counter()
            m.save(step, state, {"val": 1.0 / step})
            elapsed = time.perf_counter() - t0
            m.wait()
            settle()
            next_step[n] = step + 1
            if r > 0:  # the first round warms up
                times[n].append(elapsed)
    for m in managers.values():
        m.close()
    for n in paths:
        size = os.path.getsize(os.path.join(paths[n], "report.json"))
        print(
            f"  after {n:>8} steps: save {median_ms(times[n]):7.1f} ms (rounds "
            f"{min(times[n]) * 1000:.1f}-{max(times[n]) * 1000:.1f}), log() "
            f"{statistics.median(logs[n]) * 1e9:.0f} ns, report.json {size / 1024:.1f} KiB"
        )
    ratio = statistics.median(times[steps]) / statistics.median(times[0])
    print(f"  save with the long history / with none   {ratio:.2f}  (target <= 1.1)")


# -- 2. managed against plain -----------------------------------------------------------------------


def bench_ratio(root: str, mib: float, rounds: int) -> None:
    print(f"managed vs plain ({mib:g} MiB): keep_last=2, best moving at every save")
    state = make_state(mib)
    run = os.path.join(root, f"run-{mib:g}")
    m = open_manager(run)
    fresh: list[float] = []
    replace: list[float] = []
    managed: list[float] = []
    background: list[float] = []

    def plain_new(i: int) -> float:
        path = os.path.join(root, f"plain-{mib:g}-{i}")
        t0 = time.perf_counter()
        sp.save(path, state)
        elapsed = time.perf_counter() - t0
        shutil.rmtree(path)
        settle()
        return elapsed

    def plain_replace(i: int) -> float:
        t0 = time.perf_counter()
        sp.save(os.path.join(root, f"plain-{mib:g}"), state)
        elapsed = time.perf_counter() - t0
        settle()
        return elapsed

    def managed_save(i: int) -> float:
        for k in range(10):
            m.log(i * 10 + k, loss=1.0)
        t0 = time.perf_counter()
        m.save(i, state, {"val": 1.0 / (i + 1)})
        elapsed = time.perf_counter() - t0
        t1 = time.perf_counter()
        m.wait()
        if i >= 2:
            background.append(time.perf_counter() - t1)
        settle()
        return elapsed

    contenders: list[tuple[list[float], Callable[[int], float]]] = [
        (fresh, plain_new),
        (replace, plain_replace),
        (managed, managed_save),
    ]
    for i in range(rounds + 2):
        for out, run_one in contenders if i % 2 == 0 else contenders[::-1]:
            elapsed = run_one(i)
            if i >= 2:  # two warm-up rounds (the run prunes from its third save on)
                out.append(elapsed)
    m.close()
    print(f"  plain sp.save, new path     {median_ms(fresh):8.1f} ms")
    print(f"  plain sp.save, replace      {median_ms(replace):8.1f} ms")
    print(
        f"  managed save                {median_ms(managed):8.1f} ms (then "
        f"{median_ms(background):.1f} ms in the background: verify, prune)"
    )
    target = "1.1" if mib >= 100 else "1.5"
    print(
        f"  managed / plain new path   {median_ms(managed) / median_ms(fresh):.2f}"
        f"  (target <= {target})"
    )
    print(f"  managed / plain replace   {median_ms(managed) / median_ms(replace):.2f}")


# -- 3. fsyncs --------------------------------------------------------------------------------------


class Syncs:
    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._real = os.fsync, os.fdatasync

    def __enter__(self) -> Syncs:
        fsync, fdatasync = self._real

        def counted(real: Callable[[int], None]) -> Callable[[int], None]:
            def call(fd: int) -> None:
                where = (
                    "foreground"
                    if threading.current_thread() is threading.main_thread()
                    else ("background")
                )
                with self._lock:
                    self.counts[where] += 1
                real(fd)

            return call

        os.fsync, os.fdatasync = counted(fsync), counted(fdatasync)  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        os.fsync, os.fdatasync = self._real  # type: ignore[assignment]


def bench_fsyncs(root: str) -> None:
    print("fsyncs of one save (1 MiB; managed: keep_last=2, best moving, pruning)")
    state = make_state(1)
    sp.save(os.path.join(root, "fs-plain"), state)
    with Syncs() as plain:
        sp.save(os.path.join(root, "fs-plain2"), state)
    m = open_manager(os.path.join(root, "fs-run"))
    for i in range(3):
        m.save(i, state, {"val": 1.0 / (i + 1)})
        m.wait()
    with Syncs() as managed:
        m.save(3, state, {"val": 0.1})
        m.wait()
    m.close()
    print(f"  plain sp.save               {plain.counts['foreground']}")
    print(
        f"  managed save                {managed.counts['foreground']} before it returns, "
        f"{managed.counts['background']} in its background step"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--history", type=int, default=1_000_000)
    parser.add_argument("--history-rounds", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--mib", type=float, nargs="+", default=[128, 1])
    parser.add_argument("--dir", default=None)
    parser.add_argument("--skip", nargs="*", default=[], choices=["history", "ratio", "fsyncs"])
    args = parser.parse_args(argv)
    root = tempfile.mkdtemp(prefix="sp-bench-runs-", dir=args.dir)
    print(f"savepoint {sp.__version__} from {os.path.dirname(sp.__file__)}; scratch {root}")
    try:
        if "fsyncs" not in args.skip:
            bench_fsyncs(root)
        if "ratio" not in args.skip:
            for mib in args.mib:
                bench_ratio(root, mib, args.rounds)
        if "history" not in args.skip:
            bench_history(root, args.history, args.history_rounds or args.rounds)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
