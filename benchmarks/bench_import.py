"""What starting savepoint costs: ``import savepoint``, ``savepoint --help`` and the imports the
first save and load make, each in fresh processes.

Every case runs ``--runs`` times in a new interpreter (``python -c ...``, ``python -m savepoint
--help``), timed from outside (process start to exit, so the interpreter's own start is included:
the ``python -c pass`` row is that floor). Medians, with the minimum beside them. Then one
``python -X importtime`` run per case prints its top offenders: the modules whose own import (not
counting what they import) took longest, and the cumulative time of the largest subtrees.

Budgets (issue 25, item 22, on a quiet machine): ``import savepoint`` at most 0.4 s and
``savepoint --help`` at most 0.5 s; ``--check`` exits 1 when a median is over its budget::

    python benchmarks/bench_import.py [--runs 11] [--top 8] [--check]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

SRC = str(Path(__file__).resolve().parent.parent / "src")

# name -> (argv after the interpreter, budget in seconds or None)
CASES: dict[str, tuple[list[str], float | None]] = {
    "python -c pass": (["-c", "pass"], None),
    "import numpy": (["-c", "import numpy"], None),
    "import savepoint": (["-c", "import savepoint"], 0.4),
    "savepoint --help": (["-m", "savepoint", "--help"], 0.5),
    "sp.save + sp.load imported": (
        ["-c", "import savepoint as sp; sp.save; sp.load; sp.inspect"],
        None,
    ),
    "sp.CheckpointManager imported": (["-c", "import savepoint as sp; sp.CheckpointManager"], None),
    "bfloat16 (ml_dtypes) too": (
        ["-c", "import savepoint as sp; sp.save; import ml_dtypes"],
        None,
    ),
}


def env() -> dict[str, str]:
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": SRC + (os.pathsep + path if path else "")}


def once(argv: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, *argv], env=env(), check=True, stdout=subprocess.DEVNULL, timeout=120
    )
    return time.perf_counter() - start


def offenders(argv: list[str], top: int) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """(self time, module) and (cumulative time, module), in microseconds, largest first."""
    out = subprocess.run(
        [sys.executable, "-X", "importtime", *argv],
        env=env(),
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        timeout=120,
    ).stderr
    rows: list[tuple[int, int, str]] = []
    for line in out.splitlines():
        if not line.startswith("import time:") or "|" not in line:
            continue
        own, cumulative, name = (part.strip() for part in line[12:].split("|"))
        if own.isdigit():
            rows.append((int(own), int(cumulative), name))
    by_self = sorted(((o, n) for o, _, n in rows), reverse=True)[:top]
    by_total = sorted(((c, n) for _, c, n in rows), reverse=True)[:top]
    return by_self, by_total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=11, help="fresh processes per case")
    parser.add_argument("--top", type=int, default=8, help="offenders shown per case")
    parser.add_argument("--check", action="store_true", help="exit 1 when over a budget")
    args = parser.parse_args()
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}")
    print(f"{'case':32} {'median s':>9} {'min s':>7} {'budget':>7}")
    over = []
    for name, (argv, budget) in CASES.items():
        once(argv)  # warm the page cache and the .pyc files
        times = [once(argv) for _ in range(args.runs)]
        median = statistics.median(times)
        flag = "" if budget is None else f"{budget:7.2f}" + (" OVER" if median > budget else "")
        if budget is not None and median > budget:
            over.append(name)
        print(f"{name:32} {median:9.3f} {min(times):7.3f} {flag}")
    for name, (argv, _) in CASES.items():
        if name == "python -c pass":
            continue
        by_self, by_total = offenders(argv, args.top)
        print(f"\n{name}: top imports by own time | by cumulative time (ms)")
        for (own, a), (total, b) in zip(by_self, by_total):
            print(f"  {own / 1000:8.1f}  {a:38} | {total / 1000:8.1f}  {b}")
    if over:
        print(f"\nover budget: {', '.join(over)} (on a busy machine, rerun when it is quiet)")
    return 1 if args.check and over else 0


if __name__ == "__main__":
    sys.exit(main())
