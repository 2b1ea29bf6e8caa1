"""Many small tensors: save, load, inspect and verify of a 100,000-tensor state against safetensors.

Usage::

    .venv/bin/python benchmarks/bench_scale.py [--tensors 100000] [--floats 16] [--repeat 3]
        [--dir /tmp/sp-scale] [--no-peers] [--only save,load,inspect,verify]

The state is ``--tensors`` float32 torch tensors of ``--floats`` elements each, named like the
experts of a mixture-of-experts model (``layer12.expert34.w``): the shape issue 16 targets (models
with many experts and their optimizer state). Each round runs every contender once, in the same
process, interleaved, after one warm-up round; medians of ``--repeat`` rounds are compared as
ratios:

- ``sp.save`` against ``safetensors.torch.save_file`` + fsync (both durable);
- ``sp.load`` (the whole tree, checksums checked) against ``safetensors.torch.load_file``;
- ``sp.inspect`` and ``sp.verify``, reading the description's tensor list (target: under 1 s at
  100,000 tensors), beside listing a safetensors file's tensors with dtypes and shapes
  (``safe_open``) and reading all of them (``load_file``).

Peak extra memory of one ``sp.save`` is sampled from ``/proc/self/statm`` while it runs (staging
buffers released first), as in ``bench_save_load.py``. With ``--tensors 1000000`` (minutes; pass
``--repeat 1 --no-peers`` to keep it short) the targets are a save under 30 s and under 0.5 GiB of
extra memory (``--trace-memory`` prints where the memory is at each step of the save instead,
sampled from ``/proc/self/statm``). Not a test: it prints figures and exits 1 only if a loaded
state differs.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import savepoint as sp
from bench_save_load import PeakRSS, fsync_path, rm
from savepoint.engine.pipeline import POOL

MiB = 1 << 20


def make_state(n: int, floats: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    data = torch.randn(n, floats)
    # Separate tensors (not views of one buffer): each has its own storage, as real parameters do.
    return {f"layer{i // 100}.expert{i % 100}.w": data[i].clone() for i in range(n)}


@contextlib.contextmanager
def traced_steps(mem: PeakRSS, t0: float) -> Iterator[None]:
    """Print the time and the extra resident memory before and after each step of a save."""
    from savepoint.codecs import manifest as mf
    from savepoint.commit.transaction import Transaction
    from savepoint.engine import pipeline, sinks
    from savepoint.state import tree

    steps = [
        (tree, "flatten"),
        (sinks, "lay_out"),
        (pipeline, "write_file"),
        (mf, "dump"),
        (Transaction, "commit"),
    ]
    saved = [(owner, name, getattr(owner, name)) for owner, name in steps]

    def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def step(*args: Any, **kwargs: Any) -> Any:
            mark(f"before {name}")
            try:
                return fn(*args, **kwargs)
            finally:
                mark(f"after {name}")

        return step

    def mark(what: str) -> None:
        print(
            f"  {time.perf_counter() - t0:7.2f} s  {what:22s} {(mem._rss() - mem.start) / MiB:8.1f} MiB"
        )

    try:
        for owner, name, fn in saved:
            setattr(owner, name, wrap(name, fn))
        yield
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)
        mark("returned")


def st_list(path: str) -> int:
    """A safetensors file's tensors with their dtypes and shapes, from its header."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        return len([(k, f.get_slice(k).get_dtype(), f.get_slice(k).get_shape()) for k in f.keys()])  # noqa: SIM118


CPU: dict[str, list[float]] = {}  # CPU time of this process per run, beside the wall times


def median_runs(
    contenders: dict[str, Callable[[], Any]], repeat: int, warmup: bool = True
) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {k: [] for k in contenders}
    for rnd in range(repeat + (1 if warmup else 0)):
        for name, fn in contenders.items():
            gc.collect()
            c0 = time.process_time()
            t0 = time.perf_counter()
            out = fn()
            del out
            dt = time.perf_counter() - t0
            if rnd or not warmup:
                times[name].append(dt)
                CPU.setdefault(name, []).append(time.process_time() - c0)
    return times


def show(title: str, times: dict[str, list[float]]) -> dict[str, float]:
    """Medians of the wall times (what the targets are), and of the process's CPU time (all its
    threads; on a machine shared with other work it moves less than the wall time)."""
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"\n{title}, median (s):")
    for k, v in med.items():
        cpu = statistics.median(CPU[k]) if CPU.get(k) else float("nan")
        print(f"  {k:28s} {v:7.3f}   cpu {cpu:6.3f}   runs {[round(x, 3) for x in times[k]]}")
    return med


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--tensors", type=int, default=100_000)
    ap.add_argument("--floats", type=int, default=16, help="float32 elements per tensor")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/sp-scale")
    ap.add_argument("--no-peers", action="store_true", help="skip safetensors (1M tensors: slow)")
    ap.add_argument("--no-warmup", action="store_true")
    ap.add_argument(
        "--trace-memory",
        action="store_true",
        help="with memory: print the extra memory after each step of the save",
    )
    ap.add_argument(
        "--only",
        default="memory,save,load,inspect,verify",
        help="comma-separated parts to run (memory runs first: a fresh process's first save)",
    )
    args = ap.parse_args()
    only = set(args.only.split(","))

    state = make_state(args.tensors, args.floats)
    os.makedirs(args.dir, exist_ok=True)
    sp_path = os.path.join(args.dir, "sp")
    st_path = os.path.join(args.dir, "st.safetensors")
    print(
        f"state: {args.tensors} float32 tensors of {args.floats} elements; dir {args.dir}; "
        f"torch {torch.__version__}, savepoint {sp.__version__} ({sp.__file__}); "
        f"{os.cpu_count()} cores"
    )
    from safetensors.torch import load_file, save_file

    def sp_save() -> None:
        sp.save(sp_path, state)

    def st_save() -> None:
        save_file(state, st_path)
        fsync_path(st_path)

    peers = not args.no_peers
    warm = not args.no_warmup
    if "save" in only:
        savers: dict[str, Callable[[], Any]] = {"sp.save": sp_save}
        if peers:
            savers["safetensors save+fsync"] = st_save
        med = show("durable save", median_runs(savers, args.repeat, warm))
        if peers:
            print(
                f"  sp.save / save_file+fsync      {med['sp.save'] / med['safetensors save+fsync']:.2f}"
                "  (target <= 1.0)"
            )
    if peers and not os.path.exists(st_path):
        st_save()
    if "memory" in only:
        # First in a fresh process (no arenas of earlier saves to reuse), so this is the
        # whole cost; timed too (the 1,000,000-tensor figure, when run alone).
        POOL.clear()
        gc.collect()
        with PeakRSS() as mem:
            t0 = time.perf_counter()
            if args.trace_memory:
                with traced_steps(mem, t0):
                    sp_save()
            else:
                sp_save()
            took = time.perf_counter() - t0
        print(f"\none sp.save (memory sampled): {took:.2f} s")
        print(f"peak extra memory during sp.save: {mem.extra / MiB:.1f} MiB")
        if args.tensors >= 1_000_000:
            print("  (target at 1,000,000 tensors: under 30 s and 512 MiB)")
    elif not os.path.exists(os.path.join(sp_path, "manifest.json")):
        sp_save()

    if "load" in only:
        loaders: dict[str, Callable[[], Any]] = {"sp.load": lambda: sp.load(sp_path)}
        if peers:
            loaders["safetensors load_file"] = lambda: load_file(st_path)
        med = show("load (whole state)", median_runs(loaders, args.repeat, warm))
        if peers:
            print(
                f"  sp.load / load_file            {med['sp.load'] / med['safetensors load_file']:.2f}"
                "  (target <= 1.0)"
            )
        loaded = sp.load(sp_path)
        ok = loaded.keys() == state.keys() and all(torch.equal(loaded[k], state[k]) for k in state)
        print(f"  loaded state equals saved state: {ok}")
        if not ok:
            sys.exit(1)

    # Each reads the description's keys too (a CheckpointInfo builds them when first read).
    # Peers: listing a safetensors file's tensors with their dtypes and shapes (inspect), and
    # reading every tensor of it (verify reads every byte and checks every checksum).
    readers: dict[str, Callable[[], Any]] = {}
    if "inspect" in only:
        readers["sp.inspect"] = lambda: len(sp.inspect(sp_path).tensors)
        if peers:
            readers["safetensors safe_open+shapes"] = lambda: st_list(st_path)
    if "verify" in only:
        readers["sp.verify"] = lambda: len(sp.verify(sp_path).tensors)
        if peers:
            readers["safetensors load_file"] = lambda: len(load_file(st_path))
    if readers:
        med = show(
            "inspect / verify (target: each under 1 s at 100k)",
            median_runs(readers, args.repeat, warm),
        )
        for ours, peer in (
            ("sp.inspect", "safetensors safe_open+shapes"),
            ("sp.verify", "safetensors load_file"),
        ):
            if ours in med and peer in med:
                print(f"  {ours} / {peer:28s} {med[ours] / med[peer]:.2f}")

    rm(sp_path)
    rm(st_path)
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
