"""Run a benchmark against an older savepoint tree and this one, interleaved, and compare.

    python benchmarks/compare_trees.py --old 6dda6cc --rounds 3 -- benchmarks/bench_save_load.py \
        --repeats 3 --no-dcp

The old tree is ``git archive``d into a temporary directory; each round runs the benchmark once
with the old ``src/`` first on ``PYTHONPATH`` and once with this checkout's, alternating which goes
first, so that drift on a shared machine hits both alike. Every line of the benchmark's output that
ends in a ratio (``name   0.52`` or ``name   0.52  (target ...)``) is collected; the medians over
the rounds are printed side by side with new/old. Ratios are against peers measured in the same
process (torch.save, safetensors, the O_DIRECT floor), so they cancel most machine noise; absolute
seconds do not, and are not compared.

This is a benchmark, not a test: it reports numbers and asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RATIO = re.compile(
    r"^\s*(?P<name>[A-Za-z][^\d\n]*?)\s+(?P<value>\d+\.\d+)\s*(\(.*\))?\s*(runs .*)?$"
)


def extract(ref: str, into: str) -> str:
    """``git archive`` of ``ref``'s ``src/`` into ``into``; returns the src path."""
    archive = os.path.join(into, "old.tar")
    subprocess.run(
        ["git", "-C", ROOT, "archive", "--format=tar", "-o", archive, ref, "src"], check=True
    )
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    return os.path.join(into, "src")


def run(src: str, command: list[str]) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=src)
    out = subprocess.run(
        [sys.executable, *command], env=env, cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    ratios: dict[str, float] = {}
    section = ""
    for line in out.splitlines():
        if line and not line.startswith(" "):
            section = line.split(":")[0].strip()
        m = RATIO.match(line)
        if m and ("/" in m["name"] or "throughput" in m["name"]):
            ratios[f"{section}: {m['name'].strip()}"] = float(m["value"])
    return ratios


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--old", required=True, help="git ref of the tree to compare against")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- script.py [its arguments]")
    args = ap.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("give the benchmark to run after --")
    new_src = os.path.join(ROOT, "src")
    results: dict[str, dict[str, list[float]]] = {
        "old": defaultdict(list),
        "new": defaultdict(list),
    }
    with tempfile.TemporaryDirectory() as tmp:
        old_src = extract(args.old, tmp)
        for rnd in range(args.rounds):
            order = [("old", old_src), ("new", new_src)]
            if rnd % 2:
                order.reverse()
            for label, src in order:
                for name, value in run(src, command).items():
                    results[label][name].append(value)
                print(f"round {rnd + 1}/{args.rounds}: {label} done", file=sys.stderr)
    print(f"{' '.join(command)}; old = {args.old}; medians of {args.rounds} rounds")
    print(f"{'ratio':58s} {'old':>6s} {'new':>6s} {'new/old':>8s}")
    for name in results["new"]:
        old = results["old"].get(name)
        new = statistics.median(results["new"][name])
        if old:
            o = statistics.median(old)
            print(
                f"{name[:58]:58s} {o:6.2f} {new:6.2f} {new / o if o else float('nan'):8.2f}"
                f"   old {old} new {results['new'][name]}"
            )
        else:
            print(f"{name[:58]:58s} {'-':>6s} {new:6.2f}")


if __name__ == "__main__":
    main()
