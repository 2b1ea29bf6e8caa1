"""The hardware floor of a background save: a bare O_DIRECT writer with no savepoint in it.

Run as ``python _bare_writer.py PRIORITY`` (``normal``, ``low`` or ``idle``: applied to itself
as savepoint's writer process applies its ``writer_priority``) by the benchmarks. For each line
``PATH NBYTES`` on stdin it writes NBYTES to PATH with O_DIRECT, 64 MiB a call, from one
4 KiB-aligned buffer filled once (the same calls as ``bench_save_load.odirect_floor``), fsyncs
it, and answers ``done SECONDS`` on stdout. What a trainer loses while this runs is what any
writer of those bytes costs it on this machine: the floor each writer's ratio is stated against.
"""

from __future__ import annotations

import mmap
import os
import sys
import time

from savepoint.async_ import _priority

CHUNK = 64 << 20


def write(path: str, nbytes: int, buf: mmap.mmap) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0), 0o644)
    try:
        written = 0
        while written < nbytes:
            n = min(CHUNK, -(-(nbytes - written) // 4096) * 4096)
            written += os.write(fd, memoryview(buf)[:n])
        os.fsync(fd)
    finally:
        os.close(fd)


def main() -> int:
    _priority.apply(sys.argv[1] if len(sys.argv) > 1 else "normal")
    buf = mmap.mmap(-1, CHUNK)
    buf.write(b"\x01" * CHUNK)
    for line in sys.stdin:
        path, nbytes = line.split()
        t0 = time.perf_counter()
        write(path, int(nbytes), buf)
        print(f"done {time.perf_counter() - t0:.6f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
