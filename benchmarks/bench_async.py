"""Async saves: how long training is blocked, how long until durable, and what training keeps.

Usage::

    .venv/bin/python benchmarks/bench_async.py [--gib 1 4] [--repeats 3] [--dir /tmp/sp-bench]
    .venv/bin/python benchmarks/bench_async.py --writer both --mib 256 [--repeats 7]
        [--priority low idle normal] [--threads N] [--no-floor] [--no-dcp] [--sharded]

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

``--writer process|thread|both`` (with ``--mib``, the state's size) measures only the writers of
``sp.AsyncCheckpointer(writer=...)`` (issue 27): for each round and each writer, the loop's
throughput with no save (right before), then while a background save writes; medians of the
throughputs, of their ratio, of the time ``save()`` blocks (against a memcpy of the state) and of
the time until durable. DCP's process-based ``async_save`` (``AsyncCheckpointerType.PROCESS``, on
a one-rank gloo group on 127.0.0.1) runs in the same rounds unless ``--no-dcp``; the order of the
writers alternates between rounds. So does the floor (unless ``--no-floor``): a bare O_DIRECT
writer process with no savepoint in it (``_bare_writer.py``, normal priority: 64 MiB writes
from one aligned buffer, then fsync) writing as many bytes; each writer's ratio is printed
against its ratio too. After each measurement the same save runs again with the loop idle (the
trainer waiting on a GPU, say): its time to durable, against the bare writer's (the issue's
target: at most 1.1x). ``--priority`` runs the process writer once per ``writer_priority``
listed; ``--threads`` sets the loop's torch threads (1 leaves a core of a 2-core machine to the
writer: is the loop's loss the cores it shares?); the writer process's and the bare writer's
CPU seconds per GiB (``/proc/<pid>/stat``) are printed beside.

``--sharded`` (with ``--writer``) measures the same for sharded saves: 2 ranks on a gloo group
on 127.0.0.1 (this script started twice), each holding half of every tensor (``FlatShard``,
``--mib`` in all) with one torch thread, every save called on both ranks after a barrier; each
rank prints its own medians (DCP is left out).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import threading
import time
import warnings
from collections.abc import Callable

import numpy as np
import torch

import savepoint as sp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_save_load import fsync_path, make_state, odirect_floor, rm

MiB = 1 << 20


def fsync_tree(path: str) -> None:
    for root, _, files in os.walk(path):
        for f in files:
            fsync_path(os.path.join(root, f))


def train_loop(stop: threading.Event | None, seconds: float | None = None) -> float:
    """Matmul iterations per second until ``stop`` is set (or for ``seconds``)."""
    a = torch.randn(384, 384)
    b = torch.randn(384, 384)
    n = 0
    t0 = time.perf_counter()
    while True:
        for _ in range(10):
            a = torch.tanh(a @ b) * 0.5
        n += 10
        elapsed = time.perf_counter() - t0
        if (stop is not None and stop.is_set()) or (seconds is not None and elapsed >= seconds):
            return n / elapsed


def _set_when_done(pending: sp.PendingSave, stop: threading.Event) -> None:
    pending.wait()
    stop.set()


def run_size(gib: float, repeats: int, base: str) -> None:
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    state = make_state(int(gib * (1 << 30)))
    nbytes = sum(t.numel() * 4 for t in state.values())
    print(f"\n=== {len(state)} float32 tensors, {nbytes / 2**30:.2f} GiB ===")
    # The memcpy floor copies every byte into one reused, already-touched 256 MiB buffer: the same
    # per-byte cost as a touched copy of the whole state, without holding a second state in RAM.
    touched = np.ones(256 * MiB, dtype=np.uint8)
    paths = {k: os.path.join(base, k) for k in ("sp", "spa", "st", "dcp", "dcpa", "dcpc", "raw")}
    ck = sp.AsyncCheckpointer()
    # A stager that keeps its CPU copy between saves (pinned/shared memory and CUDA streams off:
    # they need an accelerator). BlockingAsyncStager(cache_staged_state_dict=True) pins, so it
    # fails on a CPU-only machine.
    cached = DefaultStager(StagingOptions(False, False, False, False))

    def memcpy() -> None:
        for v in state.values():
            src = v.numpy().reshape(-1).view(np.uint8)
            for pos in range(0, len(src), len(touched)):
                piece = src[pos : pos + len(touched)]
                touched[: len(piece)] = piece

    def sp_sync() -> None:
        sp.save(paths["sp"], state)

    def st_sync() -> None:
        save_file(state, paths["st"])
        fsync_path(paths["st"])

    def dcp_sync() -> None:
        rm(paths["dcp"])
        dcp.save(state, checkpoint_id=paths["dcp"], no_dist=True)

    def raw() -> None:
        rm(paths["raw"])
        odirect_floor(nbytes, paths["raw"])

    def sp_async() -> tuple[float, float]:
        t0 = time.perf_counter()
        pending = ck.save(paths["spa"], state)
        blocked = time.perf_counter() - t0
        pending.wait()
        return blocked, time.perf_counter() - t0

    def dcp_async(stager: object | None, key: str) -> tuple[float, float]:
        rm(paths[key])
        t0 = time.perf_counter()
        fut = dcp.async_save(
            state,
            checkpoint_id=paths[key],
            no_dist=True,
            async_stager=stager,  # type: ignore[arg-type]
        )
        blocked = time.perf_counter() - t0
        fut.result()
        fsync_tree(paths[key])
        return blocked, time.perf_counter() - t0

    timed: dict[str, Callable[[], None]] = {
        "memcpy (touched)": memcpy,
        "O_DIRECT floor": raw,
        "sp.save": sp_sync,
        "safetensors": st_sync,
        "dcp.save": dcp_sync,
    }
    asyncs: dict[str, Callable[[], tuple[float, float]]] = {
        "sp async": sp_async,
        "dcp async (default)": lambda: dcp_async(None, "dcpa"),
        "dcp async (cached)": lambda: dcp_async(cached, "dcpc"),
    }
    t: dict[str, list[float]] = {k: [] for k in timed}
    blocks: dict[str, list[float]] = {k: [] for k in asyncs}
    totals: dict[str, list[float]] = {k: [] for k in asyncs}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for rnd in range(repeats + 1):
            for name, fn in timed.items():
                t0 = time.perf_counter()
                fn()
                if rnd:
                    t[name].append(time.perf_counter() - t0)
            for name, afn in asyncs.items():
                b, total = afn()
                if rnd:
                    blocks[name].append(b)
                    totals[name].append(total)

    med = {k: statistics.median(v) for k, v in t.items()}
    mb = {k: statistics.median(v) for k, v in blocks.items()}
    mt = {k: statistics.median(v) for k, v in totals.items()}
    print(f"medians of {repeats} (s):")
    for k, v in med.items():
        print(f"  {k:22s} {v:7.3f}   runs {[round(x, 3) for x in t[k]]}")
    for k in asyncs:
        print(
            f"  {k:22s} blocks {mb[k]:6.3f}  durable after {mt[k]:6.3f}   "
            f"blocks {[round(x, 3) for x in blocks[k]]}"
        )

    # Training throughput while an async save is written (blocking part excluded), each time
    # against a baseline measured right before it, so load from elsewhere cancels out.
    fractions = []
    for _ in range(max(repeats, 5)):
        base_rate = train_loop(None, 0.6)
        pending = ck.save(paths["spa"], state)
        stop = threading.Event()
        threading.Thread(target=_set_when_done, args=(pending, stop), daemon=True).start()
        fractions.append(train_loop(stop) / base_rate)
    frac = statistics.median(fractions)

    print("ratios (target):")
    print(
        f"  async blocking / memcpy                 {mb['sp async'] / med['memcpy (touched)']:5.2f}  (<= 1.5)"
    )
    print(
        f"  async blocking / DCP async default      {mb['sp async'] / mb['dcp async (default)']:5.2f}  (<= 0.3)"
    )
    print(
        f"  async blocking / DCP async cached       {mb['sp async'] / mb['dcp async (cached)']:5.2f}"
    )
    print(
        f"  sync save / O_DIRECT floor              {med['sp.save'] / med['O_DIRECT floor']:5.2f}  (<= 1.25)"
    )
    print(
        f"  sync save / safetensors+fsync           {med['sp.save'] / med['safetensors']:5.2f}  (<= 0.6)"
    )
    print(f"  sync save / dcp.save                    {med['sp.save'] / med['dcp.save']:5.2f}")
    print(
        f"  async durable / sync save               {mt['sp async'] / med['sp.save']:5.2f}  (<= 1.3)"
    )
    print(
        f"  training throughput during async write  {frac:5.2f}  (>= 0.75)  runs {[round(f, 2) for f in fractions]}"
    )
    ck.close()
    for p in paths.values():
        rm(p)


def _finish(wait: Callable[[], None], t0: float, out: list[float], stop: threading.Event) -> None:
    wait()
    out.append(time.perf_counter() - t0)
    stop.set()


def _dcp_process(path: str) -> Callable[[dict[str, torch.Tensor]], Callable[[], None]]:
    """DCP's process-based ``async_save`` (``AsyncCheckpointerType.PROCESS``), which needs a
    process group: a one-rank gloo group on 127.0.0.1. Returns ``start(state) -> wait``."""
    import socket

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        dist.init_process_group("gloo", rank=0, world_size=1)

    def start(state: dict[str, torch.Tensor]) -> Callable[[], None]:
        rm(path)
        fut = dcp.async_save(
            state, checkpoint_id=path, async_checkpointer_type=AsyncCheckpointerType.PROCESS
        )

        def wait() -> None:
            fut.result()  # (DCP's FileSystemWriter fsyncs its files: sync_files=True)

        return wait

    return start


def _sharded_state(
    mib: float, rank: int, world: int
) -> tuple[dict[str, object], list[torch.Tensor]]:
    """This rank's half of every tensor of the state (``FlatShard``), and those halves."""
    from savepoint.distributed import FlatShard

    state: dict[str, object] = {}
    halves = []
    for name, t in make_state(int(mib * MiB)).items():
        a, b = FlatShard.bounds(t.numel(), rank, world)
        half = t[a:b].clone()
        state[name] = FlatShard(half, t.shape, a)
        halves.append(half)
    return state, halves


class BareWriter:
    """A bare O_DIRECT writer process (``_bare_writer.py``: no savepoint in it) at ``priority``:
    ``start(nbytes)`` hands it a write of that many bytes and returns its ``wait``."""

    def __init__(self, path: str, priority: str) -> None:
        import subprocess

        self.path = path
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_bare_writer.py")
        self.proc = subprocess.Popen(
            [sys.executable, script, priority],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def start(self, nbytes: int) -> Callable[[], None]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{self.path} {nbytes}\n")
        self.proc.stdin.flush()
        out = self.proc.stdout

        def wait() -> None:
            line = out.readline()
            if not line.startswith("done"):
                raise RuntimeError(f"the bare writer failed: {line!r}")

        return wait

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait()
        rm(self.path)


def _cpu_seconds(pid: int | None) -> float:
    """utime + stime of process ``pid`` (its threads' too); 0 for None."""
    if pid is None:
        return 0.0
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_writers(
    mib: float,
    writers: list[str],
    repeats: int,
    base: str,
    dcp: bool,
    group: object = None,
    priorities: list[str] | None = None,
    floor: bool = True,
) -> None:
    """Training throughput while each writer's background save writes, against no save; with
    ``dcp``, DCP's process-based async_save in the same rounds; with ``group`` (a process group
    of 2 ranks), sharded saves of this rank's half of the state. ``priorities``: the process
    writer once per ``writer_priority`` listed (None: its default). ``floor``: a bare O_DIRECT
    writer process (normal priority, no savepoint) writing the same bytes, in the same rounds:
    the hardware floor of the ratio. Each saver's time to durable is also measured with the
    loop idle (right after), against the bare writer's."""
    if group is None:
        state: dict[str, object] = dict(make_state(int(mib * MiB)))
        tensors = list(state.values())
        who, barrier = "", lambda: None
    else:
        import torch.distributed as dist

        rank = dist.get_rank()
        state, tensors = _sharded_state(mib, rank, dist.get_world_size())
        who, barrier = f"rank {rank}: ", dist.barrier
    nbytes = sum(t.numel() * 4 for t in tensors)  # type: ignore[attr-defined]
    print(
        f"\n=== {who}writers {writers}: {len(state)} float32 tensors, {nbytes / MiB:.0f} MiB; "
        f"loop: torch threads {torch.get_num_threads()} ==="
    )
    starts: dict[str, Callable[[dict[str, object]], Callable[[], None]]] = {}
    pids: dict[str, Callable[[], int | None]] = {}
    closers: list[Callable[[], None]] = []
    for w in writers:
        for priority in (priorities or [None]) if w == "process" else [None]:
            ck = sp.AsyncCheckpointer(
                writer=w,  # type: ignore[arg-type]
                process_group=group,
                writer_priority=priority,  # type: ignore[arg-type]
            )
            name = f"sp {w}" + (f" ({priority})" if priority else "")
            closers.append(ck.close)
            path = os.path.join(base, f"w-{w}-{priority}")
            starts[name] = lambda st, ck=ck, path=path: ck.save(path, st).wait
            if w == "process":
                pids[name] = lambda ck=ck: ck._process.pid  # type: ignore[union-attr]
    if floor:
        bare = BareWriter(os.path.join(base, f"bare-{who.strip(': ') or 0}"), "normal")
        closers.append(bare.close)
        starts["O_DIRECT floor"] = lambda st: bare.start(nbytes)
        pids["O_DIRECT floor"] = lambda: bare.pid
    if dcp and group is None:
        starts["dcp process"] = _dcp_process(os.path.join(base, "w-dcp"))  # type: ignore[assignment]
    names = list(starts)
    for name in names:  # warm-up: the arenas touched, the writer processes started
        barrier()
        starts[name](state)()
    target = torch.empty(nbytes // 4, dtype=torch.float32)
    target.fill_(0)

    def memcpy() -> float:
        t0 = time.perf_counter()
        pos = 0
        for t in tensors:
            target[pos : pos + t.numel()].copy_(t.reshape(-1))  # type: ignore[attr-defined]
            pos += t.numel()  # type: ignore[attr-defined]
        return time.perf_counter() - t0

    alone: list[float] = []
    copies: list[float] = []
    rows: dict[str, dict[str, list[float]]] = {
        n: {"rate": [], "ratio": [], "blocked": [], "durable": [], "idle": [], "cpu": []}
        for n in names
    }
    for rnd in range(max(repeats, 5)):
        copies.append(memcpy())
        order = names if rnd % 2 == 0 else names[::-1]
        for name in order:
            barrier()
            base_rate = train_loop(None, 0.6)
            alone.append(base_rate)
            stop = threading.Event()
            durable: list[float] = []
            pid = pids[name]() if name in pids else None
            cpu0 = _cpu_seconds(pid)
            barrier()
            t0 = time.perf_counter()
            wait = starts[name](state)
            blocked = time.perf_counter() - t0

            threading.Thread(target=_finish, args=(wait, t0, durable, stop), daemon=True).start()
            rate = train_loop(stop)
            row = rows[name]
            row["cpu"].append(_cpu_seconds(pid) - cpu0)
            row["rate"].append(rate)
            row["ratio"].append(rate / base_rate)
            row["blocked"].append(blocked)
            row["durable"].append(durable[0] if durable else float("nan"))
            # The same save with the loop idle (a trainer waiting on a GPU): the time to durable
            # a lower priority must not stretch.
            barrier()
            t0 = time.perf_counter()
            starts[name](state)()
            row["idle"].append(time.perf_counter() - t0)
    med = statistics.median
    gib = nbytes / (1 << 30)
    print(f"  {who}loop alone                 {med(alone):8.1f} it/s   (median of {len(alone)})")
    print(f"  {who}memcpy of the state        {med(copies):8.3f} s")
    print(
        f"  {who}saver              loop it/s ratio  blocks s  durable s (loop idle)  "
        "writer CPU s/GiB (process)"
    )
    for name in names:
        r = rows[name]
        cpu = f"{med(r['cpu']) / gib:6.3f}" if name in pids else "     -"
        print(
            f"  {who}{name:18s} {med(r['rate']):8.1f} {med(r['ratio']):5.2f}  "
            f"{med(r['blocked']):6.3f}  {med(r['durable']):6.3f} ({med(r['idle']):6.3f})  {cpu}"
            f"   ratios {[round(x, 2) for x in r['ratio']]}"
        )
    floor_rows = rows.get("O_DIRECT floor")
    for name in names:
        if name.startswith("sp "):
            ratio = med(rows[name]["ratio"])
            line = f"  {who}{name}: during a write / no save {ratio:5.2f} (target >= 0.93)"
            if floor_rows is not None:
                line += f"; / the O_DIRECT floor's {ratio / med(floor_rows['ratio']):5.2f}"
                idle = med(rows[name]["idle"]) / med(floor_rows["idle"])
                line += f"; durable (loop idle) / floor's {idle:5.2f} (target <= 1.1)"
            print(line)
            print(
                f"  {who}{name}: blocking / memcpy {med(rows[name]['blocked']) / med(copies):5.2f}"
            )
            if "dcp process" in rows:
                print(
                    f"  {name} throughput / DCP process throughput  "
                    f"{med(rows[name]['rate']) / med(rows['dcp process']['rate']):5.2f}"
                )
    for close in closers:
        close()
    barrier()
    if not who or who == "rank 0: ":
        shutil.rmtree(base, ignore_errors=True)
        os.makedirs(base, exist_ok=True)
    barrier()


def run_sharded(args: argparse.Namespace, writers: list[str]) -> None:
    """``--sharded``: this script on 2 ranks (a gloo group on 127.0.0.1), each running
    :func:`run_writers` on its half of the state."""
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [sys.executable, os.path.abspath(__file__), *sys.argv[1:]]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    env["SP_BENCH_WORLD"] = "2"
    procs = [subprocess.Popen(argv, env={**env, "SP_BENCH_RANK": str(r)}) for r in range(2)]
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"a rank failed: exit codes {codes}")


def rank_main(args: argparse.Namespace, writers: list[str]) -> None:
    """One rank of ``--sharded``."""
    import torch.distributed as dist

    rank, world = int(os.environ["SP_BENCH_RANK"]), int(os.environ["SP_BENCH_WORLD"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    for mib in args.mib:
        run_writers(
            mib, writers, args.repeats, args.dir, False, dist.group.WORLD, args.priority, False
        )
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--gib", type=float, nargs="+", default=[1.0, 4.0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/savepoint-bench")
    ap.add_argument("--writer", choices=["process", "thread", "both"], default=None)
    ap.add_argument("--mib", type=float, nargs="+", default=[256.0])
    ap.add_argument(
        "--no-dcp", action="store_true", help="with --writer: leave out DCP's process-based save"
    )
    ap.add_argument(
        "--sharded", action="store_true", help="with --writer: sharded saves on 2 gloo ranks"
    )
    ap.add_argument(
        "--priority",
        nargs="+",
        choices=["normal", "low", "idle"],
        default=None,
        help="with --writer: the process writer once per writer_priority (default: its default)",
    )
    ap.add_argument(
        "--no-floor", action="store_true", help="with --writer: leave out the bare O_DIRECT writer"
    )
    ap.add_argument(
        "--threads", type=int, default=None, help="torch threads of the loop (default: torch's)"
    )
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    if args.threads:
        torch.set_num_threads(args.threads)
    if "SP_BENCH_RANK" not in os.environ:
        print(
            f"torch {torch.__version__}, savepoint {sp.__version__}, {os.cpu_count()} cores, "
            f"torch threads {torch.get_num_threads()}"
        )
    if args.writer is not None:
        writers = ["thread", "process"] if args.writer == "both" else [args.writer]
        if "SP_BENCH_RANK" in os.environ:
            rank_main(args, writers)
            return
        if args.sharded:
            run_sharded(args, writers)
            shutil.rmtree(args.dir, ignore_errors=True)
            return
        for mib in args.mib:
            run_writers(
                mib,
                writers,
                args.repeats,
                args.dir,
                not args.no_dcp,
                priorities=args.priority,
                floor=not args.no_floor,
            )
        shutil.rmtree(args.dir, ignore_errors=True)
        return
    for gib in args.gib:
        run_size(gib, args.repeats, args.dir)
    shutil.rmtree(args.dir, ignore_errors=True)
    np.random.seed(0)


if __name__ == "__main__":
    main()
