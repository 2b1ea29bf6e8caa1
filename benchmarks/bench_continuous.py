"""Continuous checkpointing (issue 27): a training loop whose step takes about 50 ms, saving with
``CheckpointManager(save_policy=sp.policies.Continuous(), async_save=True)`` at every step (the
policy skips the steps while a save is in flight).

Usage::

    .venv/bin/python benchmarks/bench_continuous.py [--mib 64] [--seconds 20] [--rounds 3]
        [--writer thread|process|default] [--priority low|idle|normal] [--min-interval 0] [--no-floor]
        [--compare VARIANT ...] [--dir /tmp/sp-continuous]

Each round runs the loop for ``--seconds`` with no checkpointing, then makes the manager and
saves once, waiting until that save is durable (the warm-up save: the writer process started and
its staging arena made and touched, once a run), then runs the loop for ``--seconds`` with
continuous checkpointing of a ``--mib`` state (float32 tensors, changed a little every step), and
reads what the policy achieved from the run's ``report.json`` (``save_intervals``; the warm-up
save is one of them). Before 2026-12-02 late there was no warm-up save: the first save, with the
writer process's start and the arena's first touch (0.5-2.5 s at 256 MiB), was inside the measured
window of 15 s and counted in the throughput; ``--cold-start`` measures that way. The warm-up
save's blocking and time to durable are printed with each round. Printed, as
medians over the rounds:

- achieved interval / time to durable: the interval between save starts against the time one
  save takes to become durable (target: at most 1.2);
- throughput with continuous saves / without (target: at least 0.95);
- the floor of that cost (unless ``--no-floor``): the loop beside a bare O_DIRECT writer
  process (``_bare_writer.py``, no savepoint, normal priority) writing the state's bytes back
  to back, against the loop alone; and a memcpy of the state per achieved interval, the least
  any snapshot blocks the loop.

``--priority`` sets the writer process's ``writer_priority`` (through
``SAVEPOINT_WRITER_PRIORITY``, which the manager's checkpointer reads).

Where the loop's time goes, per round and as medians (added 2026-12-02 late): the share of the
loop's wall time spent inside ``mgr.save()`` (the staging copy: what a save blocks), the wall
time of a step during the saves over alone (a step is fixed CPU work, so above 1 is CPU or
memory taken from the loop by the rest), and the CPU seconds per save of the trainer process's
other threads (the staging copy's pool, the manager's background thread) and of the writer
process. ``--compare PRIORITY/HASHING ...`` (e.g. ``low/staging low/writer idle/staging``)
measures several writer-process settings in the same run, interleaved (the order alternating
between rounds; each against its own loop alone right before): ``PRIORITY`` is
``writer_priority``, ``HASHING`` ``staging`` (host tensors hashed while staged, the default) or
``writer`` (the writer process hashes everything: ``staging.HASH_WHILE_STAGING_FOR_PROCESS``
off). With ``--compare``, ``--writer`` and ``--priority`` are ignored and the floor is measured
once a round.

A step is a fixed amount of work: matmuls until the training thread has used 50 ms of CPU time
(one torch thread), so a background save shows as a longer wall time per step.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import threading
import time
from dataclasses import dataclass

import torch

import savepoint as sp
from savepoint.async_ import staging

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_async import BareWriter
from train_loop import CpuClock

MiB = 1 << 20


def step_work(a: torch.Tensor, b: torch.Tensor, seconds: float = 0.05) -> torch.Tensor:
    """One training step: matmuls until this thread has used ``seconds`` of CPU time (fixed
    work, whatever else the machine runs: a background save shows as a longer wall time)."""
    t0 = time.thread_time()
    while time.thread_time() - t0 < seconds:
        a = torch.tanh(a @ b) * 0.5
    return a


def make_state(mib: float) -> dict[str, torch.Tensor]:
    n = max(1, int(mib * MiB) // (4 * MiB))
    return {f"layer{i}.weight": torch.randn(MiB) for i in range(n)}


@dataclass
class Run:
    """One run of the loop (see :func:`run`)."""

    rate: float  # steps/s
    step_wall: float  # median wall seconds of a step's work (fixed CPU work: 50 ms alone)
    in_save: float  # share of the wall time spent inside mgr.save()
    other_cpu: float  # CPU s of the trainer process's threads but the loop's (the pools...)
    writer_cpu: float  # CPU s of the child processes (the writer process)


_CLOCK: list[CpuClock] = []


def run(
    seconds: float,
    state: dict[str, torch.Tensor],
    mgr: sp.CheckpointManager | None,
    first_step: int = 0,
) -> Run:
    """The loop for ``seconds``; with ``mgr``, ``mgr.save`` at every step (from ``first_step``)."""
    if not _CLOCK:  # (made before any save: the loop's threads are the ones alive now)
        _CLOCK.append(CpuClock())
    clock = _CLOCK[0]
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    first = next(iter(state.values()))
    steps, in_save, walls = first_step, 0.0, []
    own0, rest0, kids0 = clock.read(), _self_cpu(), _kids_cpu()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        w0 = time.perf_counter()
        a = step_work(a, b)
        walls.append(time.perf_counter() - w0)
        first[steps % first.numel()] += 1.0  # the state changes every step
        if mgr is not None:
            s0 = time.perf_counter()
            mgr.save(steps, state)
            in_save += time.perf_counter() - s0
        steps += 1
    elapsed = time.perf_counter() - t0
    own1, rest1, kids1 = clock.read(), _self_cpu(), _kids_cpu()
    if mgr is not None:
        mgr.wait()
    return Run(
        rate=(steps - first_step) / elapsed,
        step_wall=statistics.median(walls),
        in_save=in_save / elapsed,
        other_cpu=(rest1 - rest0) - (own1[0] - own0[0]),
        writer_cpu=kids1 - kids0,
    )


def _self_cpu() -> float:
    import resource

    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


def _kids_cpu() -> float:
    from train_loop import _process_seconds, descendants

    return sum(_process_seconds(p) for p in descendants(os.getpid()))


def loop(seconds: float, state: dict[str, torch.Tensor], mgr: sp.CheckpointManager | None) -> float:
    """Steps per second for ``seconds``; with ``mgr``, ``mgr.save`` at every step."""
    return run(seconds, state, mgr).rate


def loop_beside_bare(seconds: float, state: dict[str, torch.Tensor], base: str) -> float:
    """Steps per second for ``seconds`` while a bare O_DIRECT writer process (no savepoint,
    normal priority) writes the state's bytes back to back: what writing continuously costs
    this machine's loop whatever writes (the floor of the continuous cost, before the staging
    copy any snapshot pays: see :func:`copy_seconds`)."""
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    bare = BareWriter(os.path.join(base, "bare"), "normal")
    done = threading.Event()

    def writing() -> None:
        while not done.is_set():
            bare.start(nbytes)()

    threading.Thread(target=writing, daemon=True).start()
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    steps = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a = step_work(a, b)
        steps += 1
    elapsed = time.perf_counter() - t0
    done.set()
    bare.close()
    return steps / elapsed


def copy_seconds(state: dict[str, torch.Tensor]) -> float:
    """A memcpy of the state into touched memory (median of 5): the least a snapshot blocks."""
    staging = {k: torch.empty_like(v).fill_(0) for k, v in state.items()}
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for k, v in state.items():
            staging[k].copy_(v)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@dataclass
class Measured:
    """One variant's round: the loop alone, then saving continuously."""

    alone: Run
    during: Run
    saves: int
    interval: float
    durable: float
    first_blocked: float  # the warm-up save's save() (the writer process started, the arena made)
    first_durable: float  # and its time to durable (nan with --cold-start: it is in the window)

    @property
    def ratio(self) -> float:
        return self.during.rate / self.alone.rate


def measure(
    args: argparse.Namespace, state: dict[str, torch.Tensor], writer: str | None
) -> Measured:
    """The loop alone for ``--seconds``, then with continuous saves (``writer``: the manager's
    ``writer=``, None its default)."""
    shutil.rmtree(args.dir, ignore_errors=True)
    alone = run(args.seconds, state, None)
    policy = sp.policies.Continuous(min_interval=args.min_interval)
    first_blocked = first_durable = float("nan")
    with sp.CheckpointManager(
        args.dir,
        keep_last=2,
        async_save=True,
        writer=writer,  # type: ignore[arg-type]
        save_policy=policy,
    ) as mgr:
        first = 0
        if not args.cold_start:  # the warm-up save, outside the window
            t0 = time.perf_counter()
            mgr.save(0, state, force=True)
            first_blocked = time.perf_counter() - t0
            mgr.wait()
            first_durable = time.perf_counter() - t0
            first = 1
        during = run(args.seconds, state, mgr, first)
    with open(os.path.join(args.dir, "report.json")) as f:
        achieved = json.load(f)["save_intervals"]
    return Measured(
        alone,
        during,
        int(achieved["saves"]),
        achieved.get("interval_median_s", float("nan")),  # (none with fewer than 2 saves)
        achieved.get("durable_median_s", float("nan")),
        first_blocked,
        first_durable,
    )


def _where(m: Measured) -> str:
    """Where the loop's time went in one measurement."""
    per = max(m.saves, 1)
    return (
        f"in save() {m.during.in_save:.3f} of the time, a step's wall "
        f"{m.during.step_wall / m.alone.step_wall:.3f}x alone's, CPU a save: the trainer's "
        f"other threads {m.during.other_cpu / per:.3f} s, the writer process "
        f"{m.during.writer_cpu / per:.3f} s; the warm-up save blocked {m.first_blocked:.3f} s, "
        f"durable after {m.first_durable:.3f} s"
    )


def _variant(name: str) -> tuple[str, str]:
    priority, _, hashing = name.partition("/")
    if priority not in ("low", "idle", "normal") or hashing not in ("staging", "writer"):
        raise SystemExit(f"--compare: PRIORITY/HASHING, e.g. low/staging or idle/writer: {name!r}")
    return priority, hashing


def compare(args: argparse.Namespace, state: dict[str, torch.Tensor]) -> None:
    """``--compare``: the writer-process settings interleaved in each round."""
    variants = [(v, *_variant(v)) for v in args.compare]
    rows: dict[str, list[Measured]] = {v: [] for v, _, _ in variants}
    floors, copies = [], []
    for rnd in range(args.rounds):
        for name, priority, hashing in variants if rnd % 2 == 0 else variants[::-1]:
            os.environ["SAVEPOINT_WRITER_PRIORITY"] = priority
            staging.HASH_WHILE_STAGING_FOR_PROCESS = hashing == "staging"
            m = measure(args, state, "process")
            rows[name].append(m)
            copies.append(copy_seconds(state) / m.interval)
            print(
                f"round {rnd + 1} {name:13s}: {m.alone.rate:.2f} steps/s alone, "
                f"{m.during.rate:.2f} saving ({m.ratio:.3f}); {m.saves} saves, interval "
                f"{m.interval:.3f} s, durable after {m.durable:.3f} s; {_where(m)}",
                flush=True,
            )
        if not args.no_floor:
            alone = loop(args.seconds, state, None)
            floors.append(loop_beside_bare(args.seconds, state, args.dir) / alone)
    med = statistics.median
    print(
        "  variant        throughput/none (min-max)   interval/durable  in save()  step wall x  "
        "CPU a save: trainer's other threads, writer process"
    )
    for name, ms in rows.items():
        ratios = [m.ratio for m in ms]
        print(
            f"  {name:13s}  {med(ratios):5.3f} ({min(ratios):5.3f}-{max(ratios):5.3f})"
            f"        {med(m.interval / m.durable for m in ms):5.2f}        "
            f"{med(m.during.in_save for m in ms):6.3f}   "
            f"{med(m.during.step_wall / m.alone.step_wall for m in ms):6.3f}       "
            f"{med(m.during.other_cpu / max(m.saves, 1) for m in ms):6.3f} s, "
            f"{med(m.during.writer_cpu / max(m.saves, 1) for m in ms):6.3f} s"
        )
    print("  targets: throughput >= 0.95, interval / durable <= 1.2")
    if floors:
        print(f"  floor: beside a bare O_DIRECT writer back to back / none  {med(floors):5.3f}")
    print(f"  a memcpy of the state per interval, as a share of it  {med(copies):5.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--mib", type=float, default=64.0)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--writer", choices=["thread", "process", "default"], default="default")
    ap.add_argument("--min-interval", type=float, default=0.0)
    ap.add_argument("--dir", default="/tmp/sp-continuous")
    ap.add_argument(
        "--priority",
        choices=["normal", "low", "idle"],
        default=None,
        help="the writer process's writer_priority (SAVEPOINT_WRITER_PRIORITY; default: its own)",
    )
    ap.add_argument("--no-floor", action="store_true", help="leave out the bare writer's floor")
    ap.add_argument(
        "--cold-start",
        action="store_true",
        help="no warm-up save: the manager's first save (the writer process started, the arena "
        "made) inside the measured window, as before 2026-12-02 late",
    )
    ap.add_argument(
        "--compare",
        nargs="+",
        metavar="PRIORITY/HASHING",
        default=None,
        help="writer-process settings measured interleaved, e.g. low/staging low/writer",
    )
    args = ap.parse_args()
    torch.set_num_threads(1)  # (a step's CPU time is its thread's: one intra-op thread)
    if args.priority is not None:  # (the manager's checkpointer takes it from the environment)
        os.environ["SAVEPOINT_WRITER_PRIORITY"] = args.priority
    state = make_state(args.mib)
    print(
        f"torch {torch.__version__}, savepoint {sp.__version__}, {os.cpu_count()} cores; "
        f"{len(state)} tensors, {args.mib:.0f} MiB; a step is 50 ms of one thread's CPU time; "
        f"writer={args.writer}, priority {args.priority or 'default'}"
    )
    if args.compare:
        compare(args, state)
        shutil.rmtree(args.dir, ignore_errors=True)
        return
    ratios, speeds, floors, copies, where = [], [], [], [], []
    for rnd in range(args.rounds):
        m = measure(args, state, None if args.writer == "default" else args.writer)
        ratios.append(m.interval / m.durable)
        speeds.append(m.ratio)
        copies.append(copy_seconds(state) / m.interval)
        where.append(m)
        bare = ""
        if not args.no_floor:
            beside = loop_beside_bare(args.seconds, state, args.dir)
            floors.append(beside / m.alone.rate)
            bare = f", {beside:.1f} beside a bare writer"
        print(
            f"round {rnd + 1}: {m.alone.rate:.1f} steps/s alone, {m.during.rate:.1f} with saves"
            f"{bare}; {m.saves} saves, interval {m.interval:.3f} s, durable after "
            f"{m.durable:.3f} s; {_where(m)}"
        )
    med = statistics.median
    print(f"  achieved interval / time to durable      {med(ratios):5.2f}  (target <= 1.2)")
    print(f"  throughput with continuous saves / none  {med(speeds):5.2f}  (target >= 0.95)")
    if floors:
        print(
            f"  floor: beside a bare O_DIRECT writer writing the same bytes back to back / none  "
            f"{med(floors):5.2f}"
        )
        print(f"  continuous saves / that floor            {med(speeds) / med(floors):5.2f}")
    print(
        f"  a memcpy of the state per interval (the least a snapshot blocks the loop), as a "
        f"share of the interval  {med(copies):5.3f}"
    )
    print(
        f"  where the loop's time went: in save() {med(m.during.in_save for m in where):.3f} of "
        f"it; a step's wall {med(m.during.step_wall / m.alone.step_wall for m in where):.3f}x "
        f"alone's; CPU a save: the trainer's other threads "
        f"{med(m.during.other_cpu / max(m.saves, 1) for m in where):.3f} s, the writer process "
        f"{med(m.during.writer_cpu / max(m.saves, 1) for m in where):.3f} s"
    )
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
