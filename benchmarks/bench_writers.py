"""Async saves: how long training is blocked, how long until durable, and what training keeps.

Usage::

    .venv/bin/python benchmarks/bench_writers.py [--gib 1 4] [--repeats 3] [--dir /tmp/sp-bench]
    .venv/bin/python benchmarks/bench_writers.py --writer both --mib 256 [--repeats 5]
    .venv/bin/python benchmarks/bench_writers.py --loop real [--gib 1 4] [--repeats 5]
        [--no-dcp] [--no-manager] [--compare-hashing] [--compare-verify] [--verbose]
        [--sustained SECONDS] [--fresh-grads]

For each state size (about 300 float32 tensors: a few 64 MiB, many 4 KiB-1 MiB), after one
warm-up round, interleaved rounds measure:

- floors: a memcpy of the state into already-touched memory; an O_DIRECT write of the same bytes
  from an aligned buffer + fsync;
- durable sync saves: ``sp.save``, ``safetensors.torch.save_file`` + fsync,
  ``torch.distributed.checkpoint.save``;
- async saves: ``sp.AsyncCheckpointer().save`` and DCP ``async_save`` with its default stager and
  with a cached stager (``DefaultStager`` with CPU-only options, which keeps its staged copy): the time
  ``save()`` blocks the caller, and the time until the checkpoint is durable;
- a training-like loop (float32 matrix multiplications) run while an async save is being written,
  as a fraction of its throughput with no save running.

Medians are printed with the ratios the async-save issue sets as targets.

``--writer process|thread|both`` or ``--loop matmul|real`` measure the background writers
(issue 27) under a training loop: ``--loop matmul`` (the default) is the loop above (a step is 10
matmuls) saving ``--mib`` of float32 tensors; ``--loop real`` is a small real training loop
(``train_loop.py``: a decoder-only transformer with hashed n-gram embeddings trained with fused
AdamW on random tokens) saving what a user passes, ``{"model", "optimizer", "rng", "step"}``,
whose parameters and AdamW moments are ``--gib`` (1 by default; nothing padded). The savers, each
with the writers of ``--writer`` (both by default): ``sp.AsyncCheckpointer(writer=...)``,
``sp.CheckpointManager(keep_last=2, async_save=True, writer=...)`` (unless ``--no-manager``; a
save is done when its background step is: the new checkpoint read back and verified, the oldest
deleted) and DCP's process-based ``async_save`` (``AsyncCheckpointerType.PROCESS``, on a one-rank
gloo group on 127.0.0.1; unless ``--no-dcp``), and the floor: a bare O_DIRECT writer process
with no savepoint in it (``_bare_writer.py``, normal priority) writing as many bytes, fsynced
(unless ``--no-floor``; each writer's ratio is also printed against its ratio); ``--compare-hashing`` adds each writer with
the writer hashing every tensor itself, nothing hashed while staged (``staging.HASH_WHILE_STAGING``
and ``HASH_WHILE_STAGING_FOR_PROCESS`` off);
``--compare-verify`` adds each manager reading its new checkpoint back in the trainer through
a mapping (``sp.verify(path)``: the behaviour before ``direct=True`` and the writer process's
read-back). For
each round and each saver (the order alternating between rounds): the loop's steps/s alone
(right before), then during the background save, from ``save()``'s return until done (the steps
counted to the fraction of the step running at that moment). Printed, as medians over the
rounds: both rates and their ratio; the CPU time everything but the loop's threads used in that
window (the writer process, the writer thread and savepoint's pools, DCP's process and threads)
and the floor it sets, ``1 - save CPU / (cores x window)``: what the loop keeps if that CPU time
is taken from its cores; the loop's time lost per save (blocked + window x (1 - ratio)); the
time ``save()`` blocks against a memcpy of the state; the minor page faults a step of the loop's
threads, alone and during. Savers stay open across rounds where the
memory holds all their arenas, else each is opened (with a warm-up save) around each measurement.

That single-save ratio is noisy on the real loop (a 1 GiB save's window holds about four steps).
``--sustained SECONDS`` measures instead, for each round, a chain of long windows: the loop alone
for SECONDS, then the first saver saving back to back (the next save started at the first step
boundary after the last is done, its blocking inside the window) until the save in flight at
SECONDS is done, then the loop alone again, the next saver, and so on (the order alternating
between rounds). A saver's ratio ("saving back to back / alone") is its window's steps/s over the
mean of the two alone windows around it: the loop's throughput while it saves continuously,
blocking included, which is at most the single-save ratio's meaning with the saves' gaps left out.
Printed: the medians over rounds, each ratio's range and every round's, the saves a window, what
``save()`` blocked per save, the save CPU outside the loop a GiB saved, the loop's minor faults a
step; steps/s against DCP's in its window.

The real loop's gradients are made once and zeroed in place each step (``train_loop.py``), so its
step cost does not move with page faults; ``--fresh-grads`` allocates them every step as before
2026-12-02 late (the loop of the figures in docs/performance.md up to then).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable

import torch

import savepoint as sp
from savepoint.async_ import staging

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_async import BareWriter, _dcp_process, run_size
from bench_save_load import make_state
from train_loop import (
    CpuClock,
    MatmulLoop,
    Sample,
    Trainer,
    Window,
    measure,
    steps_alone,
    sustained,
)

MiB = 1 << 20


Loop = Trainer | MatmulLoop


class Saver:
    """One way to save the loop's state in the background: ``open()`` (and a warm-up save:
    the arena touched, a writer process started), ``start() -> wait``, ``close()``.
    ``arena``: holds a staging arena the size of the state while open."""

    arena = True

    def __init__(self, name: str, loop: Loop, path: str) -> None:
        self.name, self.loop, self.path = name, loop, path

    def open(self) -> None:
        self.start()()

    def start(self) -> Callable[[], None]:
        raise NotImplementedError

    def close(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


class CheckpointerSaver(Saver):
    """``sp.AsyncCheckpointer(writer=...)``: done when the save is durable. ``staged_hashes``
    (None: the writer's default, hashing while staged) True: host tensors hashed while staged;
    False: the writer hashes every tensor: both ``staging.HASH_WHILE_STAGING`` flags set so
    during ``save()``."""

    def __init__(
        self, writer: str, loop: Loop, path: str, staged_hashes: bool | None = None
    ) -> None:
        label = {None: "", True: " (staged hashes)", False: " (writer hashes)"}[staged_hashes]
        super().__init__(f"sp {writer}{label}", loop, path)
        self.writer, self.staged_hashes = writer, staged_hashes
        self.ck: sp.AsyncCheckpointer | None = None

    def open(self) -> None:
        self.ck = sp.AsyncCheckpointer(writer=self.writer)  # type: ignore[arg-type]
        super().open()

    def start(self) -> Callable[[], None]:
        assert self.ck is not None
        if self.staged_hashes is None:
            return self.ck.save(self.path, self.loop.sp_state()).wait
        before = staging.HASH_WHILE_STAGING, staging.HASH_WHILE_STAGING_FOR_PROCESS
        staging.HASH_WHILE_STAGING = staging.HASH_WHILE_STAGING_FOR_PROCESS = self.staged_hashes
        try:
            return self.ck.save(self.path, self.loop.sp_state()).wait
        finally:
            staging.HASH_WHILE_STAGING, staging.HASH_WHILE_STAGING_FOR_PROCESS = before

    def close(self) -> None:
        if self.ck is not None:
            self.ck.close()
            self.ck = None
        super().close()


class ManagerSaver(Saver):
    """``sp.CheckpointManager(keep_last=2, async_save=True, writer=...)``: done when its
    background step is (the new checkpoint read back and verified, the oldest deleted: every
    save measured is the third or later of its run)."""

    def __init__(self, writer: str, loop: Loop, path: str, mapped: bool = False) -> None:
        super().__init__(f"manager {writer}{' mapped' if mapped else ''}", loop, path)
        self.writer = writer
        self.mapped = mapped  # the read-back before pruning as before: a mapped sp.verify
        self.mgr: sp.CheckpointManager | None = None
        self.step = 0

    def open(self) -> None:
        self.mgr = sp.CheckpointManager(
            self.path,
            keep_last=2,
            async_save=True,
            writer=self.writer,  # type: ignore[arg-type]
        )
        # Two warm-up saves: from the third on, every save verifies and prunes (a run's steady
        # state), the measured ones included.
        super().open()
        super().open()

    def start(self) -> Callable[[], None]:
        assert self.mgr is not None
        self.step += 1
        _mapped_verify(self.mapped)
        return self.mgr.save(self.step, self.loop.sp_state()).wait

    def close(self) -> None:
        # (this method sat on _MappedCheckpoint by mistake: no manager was ever closed, so each
        # kept its arena and writer process to the end, and a 4 GiB run ran out of memory)
        if self.mgr is not None:
            self.mgr.close()
            self.mgr = None
        super().close()


def _mapped_verify(on: bool) -> None:
    """The manager's read-back before pruning: as before this option existed (``on``: a mapped
    ``sp.verify(path)`` in the trainer, whichever writer wrote) or as now (``sp.verify(path,
    direct=True)``, in the writer process where it wrote the checkpoint), for
    ``--compare-verify``."""
    from savepoint import checkpoint
    from savepoint.async_.checkpointer import AsyncCheckpointer
    from savepoint.runs import settle

    settle.checkpoint = _MappedCheckpoint(checkpoint.verify) if on else checkpoint  # type: ignore[assignment]
    if not _REAL_IN_PROCESS:
        _REAL_IN_PROCESS.append(AsyncCheckpointer.verify_in_process)
    AsyncCheckpointer.verify_in_process = _not_in_process if on else _REAL_IN_PROCESS[0]  # type: ignore[method-assign]


_REAL_IN_PROCESS: list[Callable[..., None]] = []


def _not_in_process(self: object, path: object) -> None:
    raise sp.CheckpointWriteError("the read-back before pruning in the trainer (as before)")


class _MappedCheckpoint:
    def __init__(self, verify: Callable[..., object]) -> None:
        self._verify = verify

    def verify(self, path: object, **kwargs: object) -> object:
        return self._verify(path)


class DcpSaver(Saver):
    """DCP's process-based ``async_save`` (see :func:`_dcp_process`); its first save starts
    DCP's checkpoint process (once)."""

    arena = False

    def __init__(self, loop: Loop, path: str) -> None:
        super().__init__("dcp process", loop, path)
        self._start = _dcp_process(path)
        self.warm = False

    def open(self) -> None:
        if not self.warm:
            super().open()
            self.warm = True

    def start(self) -> Callable[[], None]:
        return self._start(self.loop.dcp_state())


class BareSaver(Saver):
    """The floor: a bare O_DIRECT writer process (``_bare_writer.py``, no savepoint, normal
    priority) writing as many bytes as the state holds; done when they are fsynced."""

    arena = False

    def __init__(self, loop: Loop, path: str) -> None:
        super().__init__("O_DIRECT floor", loop, path)
        self.bare: BareWriter | None = None

    def open(self) -> None:
        os.makedirs(self.path, exist_ok=True)
        self.bare = BareWriter(os.path.join(self.path, "bytes"), "normal")
        super().open()

    def start(self) -> Callable[[], None]:
        assert self.bare is not None
        return self.bare.start(self.loop.nbytes)

    def close(self) -> None:
        if self.bare is not None:
            self.bare.close()
            self.bare = None
        super().close()


def _available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def _settle(limit_s: float = 60.0) -> None:
    """Flush what earlier saves left dirty and wait (at most ``limit_s``) until the kernel's
    writeback is done, so the loop's rate alone is not taken while it runs."""
    os.sync()
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        with open("/proc/meminfo") as f:
            kb = sum(
                int(line.split()[1]) for line in f if line.startswith(("Dirty:", "Writeback:"))
            )
        if kb < 64 << 10:
            return
        time.sleep(0.2)


def _memcpy(loop: Loop, buffer: torch.Tensor) -> float:
    """Seconds to copy the saved tensors through one reused, touched buffer."""
    t0 = time.perf_counter()
    for t in loop.tensors():
        flat = t.detach().reshape(-1).view(torch.uint8)
        for pos in range(0, flat.numel(), buffer.numel()):
            piece = flat[pos : pos + buffer.numel()]
            buffer[: piece.numel()].copy_(piece)
    return time.perf_counter() - t0


_CLOCKS: list[CpuClock] = []


def _clock() -> CpuClock:
    """The CPU clock, made once: after the first loop's first steps and before any save, so the
    threads it counts as the loop's are the main thread and torch's (savepoint's pools, a
    writer thread and DCP's threads start later)."""
    if not _CLOCKS:
        _CLOCKS.append(CpuClock())
    return _CLOCKS[0]


def run_writers(
    loop: Loop, savers: list[Saver], repeats: int, alone_s: float, verbose: bool = False
) -> None:
    """For each round and each saver: the loop's steps/s with no save (right before), then
    during its background save; the order of the savers alternates between rounds. Savers
    stay open for all rounds where the memory allows their arenas, else each is opened (with
    a warm-up save) and closed around each of its measurements."""
    clock = _clock()
    arenas = sum(s.arena for s in savers) * loop.nbytes
    keep_open = arenas + 2 * loop.nbytes < 0.6 * _available()
    print(f"  savers {'stay open' if keep_open else 'reopened for each measurement'}")
    if keep_open:
        for s in savers:
            s.open()
    buffer = torch.ones(256 * MiB, dtype=torch.uint8)
    rows: dict[str, list[Sample]] = {s.name: [] for s in savers}
    copies: list[float] = []
    for rnd in range(repeats):
        copies.append(_memcpy(loop, buffer))
        for s in savers if rnd % 2 == 0 else savers[::-1]:
            if not keep_open:
                s.open()
                _settle()  # (the warm-up saves' writeback is not the loop's "alone")
            sample = measure(loop, clock, s.start, alone_s)
            rows[s.name].append(sample)
            if verbose:
                print(f"    round {rnd + 1} {s.name:15s} {sample}")
            if not keep_open:
                s.close()
    for s in savers:
        s.close()
    _print_rows(rows, statistics.median(copies), loop.nbytes / (1 << 30), clock.cores)


def run_sustained(
    loop: Loop, savers: list[Saver], repeats: int, seconds: float, verbose: bool = False
) -> None:
    """``--sustained``: for each round, the loop alone for ``seconds``, then each saver saving
    back to back for at least ``seconds`` (:func:`train_loop.sustained`), each followed by the
    loop alone again (alone, saver 1, alone, saver 2, ..., alone; the savers' order alternating
    between rounds); a saver's ratio is its rate over the mean of the two alone windows around
    it. Savers stay open where the memory holds all their arenas, else each is opened (its
    warm-up saves, then the writeback waited for) before the alone window in front of it."""
    clock = _clock()
    arenas = sum(s.arena for s in savers) * loop.nbytes
    keep_open = arenas + 2 * loop.nbytes < 0.6 * _available()
    print(f"  savers {'stay open' if keep_open else 'reopened for each measurement'}")
    if keep_open:
        for s in savers:
            s.open()
    rows: dict[str, list[tuple[Window, float]]] = {s.name: [] for s in savers}
    alones: list[Window] = []
    for rnd in range(repeats):
        order = savers if rnd % 2 == 0 else savers[::-1]
        if not keep_open:
            order[0].open()
        _settle()
        before = sustained(loop, clock, seconds)
        alones.append(before)
        for i, s in enumerate(order):
            w = sustained(loop, clock, seconds, s.start)
            if not keep_open:
                s.close()
                if i + 1 < len(order):
                    order[i + 1].open()
            _settle()
            after = sustained(loop, clock, seconds)
            alones.append(after)
            rows[s.name].append((w, (before.rate + after.rate) / 2))
            if verbose:
                print(
                    f"    round {rnd + 1} {s.name:21s} alone {before.rate:.3f}/{after.rate:.3f} "
                    f"saving {w.rate:.3f} steps/s ({w.rate * 2 / (before.rate + after.rate):.3f}), "
                    f"{w.saves} saves in {w.seconds:.1f} s, faults a step {before.faults:.0f} "
                    f"alone, {w.faults:.0f} saving",
                    flush=True,
                )
            before = after
    for s in savers:
        s.close()
    _print_sustained(rows, alones, loop.nbytes / (1 << 30), clock.cores)


def _print_sustained(
    rows: dict[str, list[tuple[Window, float]]], alones: list[Window], gib: float, cores: int
) -> None:
    med = statistics.median
    n = len(next(iter(rows.values())))
    rates = [a.rate for a in alones]
    print(
        f"  sustained: medians of {n} rounds; the loop alone {med(rates):.3f} steps/s (windows "
        f"{min(rates):.3f}-{max(rates):.3f}), {med(a.faults for a in alones):.0f} minor faults "
        f"a step, its CPU share {med(a.trainer_share for a in alones):.2f} of {cores} cores"
    )
    print(
        "  saver                 saving/s ratio  (min-max)    saves window  blocks/save "
        "save CPU s/GiB  faults a step  loop's CPU share   ratios"
    )
    for name, r in rows.items():
        ratios = [w.rate / alone for w, alone in r]
        ws = [w for w, _ in r]
        print(
            f"  {name:21s} {med(w.rate for w in ws):8.3f} {med(ratios):5.3f} "
            f"({min(ratios):5.3f}-{max(ratios):5.3f}) {med(w.saves for w in ws):5.0f} "
            f"{med(w.seconds for w in ws):6.1f}  {med(w.blocked / w.saves for w in ws):11.3f} "
            f"{med(w.save_cpu / w.saves for w in ws) / gib:14.3f}  "
            f"{med(w.faults for w in ws):13.0f}  {med(w.trainer_share for w in ws):16.2f}   "
            f"{[round(x, 3) for x in ratios]}"
        )
    dcp = rows.get("dcp process")
    bare = rows.get("O_DIRECT floor")
    for name, r in rows.items():
        if name in ("dcp process", "O_DIRECT floor"):
            continue
        ratio = med(w.rate / alone for w, alone in r)
        line = f"  {name:21s} saving back to back / alone {ratio:5.3f} (target >= 0.93)"
        if bare is not None:
            line += f", / the O_DIRECT writer's {ratio / med(w.rate / a for w, a in bare):5.3f}"
        if dcp is not None:
            ours, theirs = med(w.rate for w, _ in r), med(w.rate for w, _ in dcp)
            line += f", steps/s / DCP process's {ours / theirs:5.2f} (target > 1)"
        print(line)


def _print_rows(rows: dict[str, list[Sample]], memcpy: float, gib: float, cores: int) -> None:
    med = statistics.median
    n = len(next(iter(rows.values())))
    print(
        f"  medians of {n}; window: save() returned -> done (durable; a manager's: verified and "
        f"pruned); floor: 1 - save CPU in the window / ({cores} cores x window); lost: the loop's "
        f"time lost to a save, blocked + window x (1 - ratio); memcpy of the state {memcpy:.3f} s"
    )
    print(
        "  saver                 alone/s during/s ratio floor  blocks (xmemcpy) window  lost  "
        "save CPU s (s/GiB)  loop's CPU share alone/during, CPU a step during/alone"
    )
    for name, r in rows.items():
        blocked = med(x.blocked for x in r)
        cpu = med(x.save_cpu for x in r)
        lost = med(x.blocked + x.window * (1 - x.ratio) for x in r)
        shares = f"{med(x.trainer_share_alone for x in r):4.2f}/"
        shares += (
            f"{med(x.trainer_share_during for x in r):4.2f}, {med(x.cpu_per_step for x in r):4.2f}"
        )
        print(
            f"  {name:21s} {med(x.alone for x in r):7.2f} {med(x.during for x in r):8.2f} "
            f"{med(x.ratio for x in r):5.2f} {med(x.floor for x in r):5.2f}  "
            f"{blocked:6.3f} ({blocked / memcpy:4.2f}) {med(x.window for x in r):6.2f} "
            f"{lost:5.2f}  {cpu:6.3f} ({cpu / gib:5.3f})  {shares}"
            f"   ratios {[round(x.ratio, 2) for x in r]}"
        )
        print(
            f"  {'':21s} minor faults a step of the loop's threads: alone "
            f"{med(x.faults_alone for x in r):.0f}, during {med(x.faults_during for x in r):.0f}"
        )
    dcp = rows.get("dcp process")
    bare = rows.get("O_DIRECT floor")
    for name, r in rows.items():
        if name in ("dcp process", "O_DIRECT floor"):
            continue
        ratio = med(x.ratio for x in r)
        line = f"  {name:21s} during a save / no save {ratio:5.2f} (target >= 0.93)"
        line += f", / its floor {ratio / med(x.floor for x in r):5.2f}"
        if bare is not None:
            line += f", / the O_DIRECT writer's {ratio / med(x.ratio for x in bare):5.2f}"
        if dcp is not None:
            ours, theirs = med(x.during for x in r), med(x.during for x in dcp)
            line += f", / DCP process's {ours / theirs:5.2f} (target > 1)"
        print(line)


def savers_for(
    loop: Loop,
    writers: list[str],
    base: str,
    dcp: bool,
    manager: bool,
    old: bool,
    floor: bool = True,
    mapped: bool = False,
) -> list[Saver]:
    savers: list[Saver] = [
        CheckpointerSaver(w, loop, os.path.join(base, f"ck-{w}")) for w in writers
    ]
    if old:
        savers += [
            CheckpointerSaver(w, loop, os.path.join(base, f"alt-{w}"), staged_hashes=False)
            for w in writers
        ]
    if manager:
        savers += [ManagerSaver(w, loop, os.path.join(base, f"run-{w}")) for w in writers]
    if mapped:
        savers += [
            ManagerSaver(w, loop, os.path.join(base, f"run-mapped-{w}"), mapped=True)
            for w in writers
        ]
    if dcp:
        savers.append(DcpSaver(loop, os.path.join(base, "dcp")))
    if floor:
        savers.append(BareSaver(loop, os.path.join(base, "bare")))
    return savers


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--gib", type=float, nargs="+", default=None)
    ap.add_argument("--mib", type=float, nargs="+", default=None)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--dir", default="/tmp/savepoint-bench")
    ap.add_argument("--writer", choices=["process", "thread", "both"], default=None)
    ap.add_argument("--loop", choices=["matmul", "real"], default=None)
    ap.add_argument("--alone", type=float, default=None, help="seconds of the loop before a save")
    ap.add_argument("--no-dcp", action="store_true", help="leave out DCP's process-based save")
    ap.add_argument("--no-manager", action="store_true", help="leave out CheckpointManager")
    ap.add_argument(
        "--no-floor", action="store_true", help="leave out the bare O_DIRECT writer (the floor)"
    )
    ap.add_argument("--verbose", action="store_true", help="print every measurement")
    ap.add_argument(
        "--sustained",
        type=float,
        default=None,
        metavar="SECONDS",
        help="instead of one save per measurement: each saver saving back to back for at least "
        "SECONDS, against the loop alone for SECONDS before and after (interleaved)",
    )
    ap.add_argument(
        "--fresh-grads",
        action="store_true",
        help="--loop real: every step allocates its gradients anew (the loop before its "
        "gradients were made once; its step cost moves with the memory's state)",
    )
    ap.add_argument(
        "--compare-verify",
        action="store_true",
        help="also each manager reading its checkpoint back mapped (sp.verify without direct=)",
    )
    ap.add_argument(
        "--compare-hashing",
        action="store_true",
        help="also each writer hashing every tensor itself (nothing hashed while staged)",
    )
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    print(
        f"torch {torch.__version__}, savepoint {sp.__version__}, {os.cpu_count()} cores, "
        f"torch threads {torch.get_num_threads()}"
    )
    if args.writer is None and args.loop is None:
        for gib in args.gib or [1.0, 4.0]:
            run_size(gib, args.repeats or 3, args.dir)
        shutil.rmtree(args.dir, ignore_errors=True)
        return
    writers = ["thread", "process"] if args.writer in ("both", None) else [args.writer]
    if args.loop == "real":
        sizes = [g * 1024 for g in args.gib] if args.gib else args.mib or [1024.0]
    else:
        sizes = [g * 1024 for g in args.gib] if args.gib else args.mib or [256.0]
    for mib in sizes:
        _writers_at(args, mib, writers)
    shutil.rmtree(args.dir, ignore_errors=True)


def _writers_at(args: argparse.Namespace, mib: float, writers: list[str]) -> None:
    """The writers' measurement at one size (``args``: the command line's)."""
    if args.loop == "real":
        t0 = time.perf_counter()
        trainer = Trainer(mib / 1024, steady=not args.fresh_grads)
        build = time.perf_counter() - t0
        for _ in range(3):
            trainer.step()
        alone, _, _ = steps_alone(trainer, _clock(), 2.0)
        print(
            f"\n=== real loop: {_describe(trainer)}; {trainer.nbytes / MiB:.0f} MiB saved; "
            f"{1000 / alone:.0f} ms a step (built in {build:.1f} s) ==="
        )
        loop: Loop = trainer
    else:
        loop = MatmulLoop(make_state(int(mib * MiB)))
        loop.step()
        _clock()
        print(
            f"\n=== matmul loop (10 matmuls a step): {len(loop.state)} float32 tensors, "
            f"{loop.nbytes / MiB:.0f} MiB ==="
        )
    savers = savers_for(
        loop,
        writers,
        args.dir,
        not args.no_dcp,
        not args.no_manager,
        args.compare_hashing,
        not args.no_floor,
        args.compare_verify,
    )
    if args.sustained:
        run_sustained(loop, savers, max(args.repeats or 3, 1), args.sustained, args.verbose)
        return
    alone_s = args.alone or (2.0 if args.loop == "real" else 0.6)
    run_writers(loop, savers, max(args.repeats or 5, 1), alone_s, args.verbose)


def _describe(loop: Trainer) -> str:
    s, m = loop.shape, loop.model
    params = sum(p.numel() for p in m.parameters())
    return (
        f"{params / 1e6:.1f}M parameters ({m.buckets} n-gram buckets x 2, width {s.d}, "
        f"{s.layers} blocks, vocab {s.vocab}), batch {s.batch}x{s.seq}, fused AdamW, "
        f"{'gradients made once' if loop.steady else 'gradients allocated every step'}"
    )


if __name__ == "__main__":
    main()
