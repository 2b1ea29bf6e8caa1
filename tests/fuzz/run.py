"""``make fuzz``: run every parser's campaign for a given time, each in a child with a memory cap.

    python tests/fuzz/run.py --seconds 60 --memory-mib 2048 [--seed N] [target ...]

Each target runs in its own process under ``RLIMIT_AS`` (an allocation past the cap is a
``MemoryError``, which counts as a failure), with peak traced memory checked against the
target's bound for every input. Failing inputs are written to ``fuzz-crashes/<target>/``.
Exit status: 0 when no target failed.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # makes ``fuzz`` importable

from fuzz._harness import all_targets, describe, run, save_failures


def _child(name: str, seconds: float, seed: int, crashes: Path) -> int:
    target = all_targets()[name]
    with tempfile.TemporaryDirectory(prefix=f"fuzz-{name.replace(':', '-')}-") as scratch:
        result = run(target, Path(scratch), seconds=seconds, seed=seed, trace_memory=True)
    save_failures(result, crashes)
    print(describe(result), flush=True)
    print(
        json.dumps(
            {
                "target": name,
                "inputs": result.inputs,
                "failures": len(result.failures),
                "peak_ratio": round(result.peak_ratio, 2),
            }
        ),
        flush=True,
    )
    return 1 if result.failures else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("targets", nargs="*", help="target names (default: all)")
    parser.add_argument("--seconds", type=float, default=60.0, help="time per target")
    parser.add_argument("--memory-mib", type=int, default=2048, help="address-space cap per target")
    parser.add_argument("--seed", type=int, default=int(time.time()))
    parser.add_argument("--crashes", type=Path, default=Path("fuzz-crashes"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return _child(args.child, args.seconds, args.seed, args.crashes)

    names = args.targets or list(all_targets())
    unknown = set(names) - set(all_targets())
    if unknown:
        parser.error(f"unknown targets: {sorted(unknown)}; known: {sorted(all_targets())}")
    cap = args.memory_mib << 20

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    failed = []
    print(
        f"fuzzing {len(names)} targets, {args.seconds:g} s each, seed {args.seed}, "
        f"{args.memory_mib} MiB address space",
        flush=True,
    )
    for name in names:
        cmd = [
            sys.executable,
            __file__,
            "--child",
            name,
            "--seconds",
            str(args.seconds),
            "--seed",
            str(args.seed),
            "--crashes",
            str(args.crashes),
        ]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        code = subprocess.call(cmd, preexec_fn=limit, env=env)
        if code != 0:
            failed.append(name)
    print("failed: " + (", ".join(failed) if failed else "none"), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
