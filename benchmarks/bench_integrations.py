"""savepoint under other frameworks' checkpointing, against each framework's default, same run.

DCP: ``dcp.save``/``dcp.load`` of a state of float32 tensors (``--mib`` MiB in 16 tensors) with
``SavepointWriter``/``SavepointReader`` against DCP's ``FileSystemWriter``/``FileSystemReader``
(its default, ``sync_files=True``: both durable when ``save`` returns), one process, local disk;
the page cache is dropped for the files before each cold load (``posix_fadvise(DONTNEED)``).
Medians of ``--repeat`` rounds, ratios savepoint / DCP (below 1: savepoint faster).

    python benchmarks/bench_integrations.py [--mib 1024] [--repeat 5] [--dir /tmp]
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
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    args = ap.parse_args()

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    from savepoint.integrations.dcp import SavepointReader, SavepointWriter

    n = args.mib * 1024 * 1024 // 4 // 16
    state = {f"layer{i}.weight": torch.randn(n) for i in range(16)}
    into = {k: torch.empty_like(v) for k, v in state.items()}
    root = tempfile.mkdtemp(dir=args.dir)
    peers = {
        "savepoint": (lambda p: SavepointWriter(p), lambda p: SavepointReader(p)),
        "dcp": (lambda p: FileSystemWriter(p), lambda p: FileSystemReader(p)),
    }
    times: dict[str, list[float]] = {f"{k} {op}": [] for k in peers for op in ("save", "load")}
    try:
        for rnd in range(args.repeat + 1):
            order = list(peers.items()) if rnd % 2 else list(reversed(peers.items()))
            for name, (writer, reader) in order:
                path = os.path.join(root, f"{name}-{rnd}")
                t = time.perf_counter()
                dcp.save(state, storage_writer=writer(path))
                t_save = time.perf_counter() - t
                evict(path)
                t = time.perf_counter()
                dcp.load(into, storage_reader=reader(path))
                t_load = time.perf_counter() - t
                shutil.rmtree(path)
                if rnd:  # round 0 warms up
                    times[f"{name} save"].append(t_save)
                    times[f"{name} load"].append(t_load)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"DCP, {args.mib} MiB in 16 float32 tensors, one process, {args.repeat} rounds, medians")
    for op in ("save", "load"):
        sp_t, dcp_t = med[f"savepoint {op}"], med[f"dcp {op}"]
        print(
            f"  {op}: SavepointWriter/Reader {sp_t:.3f} s   FileSystemWriter/Reader {dcp_t:.3f} s"
            f"   savepoint/dcp {sp_t / dcp_t:.2f}"
        )


if __name__ == "__main__":
    main()
