"""One rank of the deadline sessions (launched by ``test_deadlines.py`` through ``_launch``).

Usage: python _deadline_worker.py SCENARIO RANK WORLD PORT WORKDIR

Each scenario makes one rank stall in one phase of a sharded save or load run with
``timeout=DEADLINE``: a sleep injected on that rank alone (``STALL`` seconds, longer than the
deadline, after which it goes on), or its writer process stopped for good
(``writer="process"``). Every rank records the error it raised (``data["error"]``: message,
``phase``, ``stalled``, ``ranks``) and how long its call took (``data["elapsed"]``); the stalled
rank records the phase it stalled in (``data["stalled in"]``). Then every rank meets at a barrier
of the default group and rank 0 checks that the previous checkpoint is intact and nothing was
left staged. Results as in ``_worker.py``.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))

import _worker

import savepoint as sp
from savepoint.distributed import Shard
from savepoint.errors import DistributedCheckpointError

DEADLINE = 2.0  # timeout= of every save and load here
STALL = DEADLINE + 1.2  # how long a stalled rank sleeps before it goes on
STALLED = 2  # the rank that stalls (rank 0 in the commit)
ROWS = 16  # rows of "w" per rank


def tensors(world: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {
        "w": torch.randn(ROWS * world, 64, generator=g),
        "rep": torch.randn(512, 512, generator=g),  # 1 MiB, replicated: read once in 4 chunks
    }


def state(rank: int, world: int, *, empty: bool = False) -> dict[str, Any]:
    full = tensors(world)
    mine = full["w"][rank * ROWS : (rank + 1) * ROWS].clone()
    rep = full["rep"].clone()
    if empty:
        mine, rep = torch.zeros_like(mine), torch.zeros_like(rep)
    return {"w": Shard.split(mine, 0, rank, world, size=ROWS * world), "rep": rep}


def sleepy(fn: Callable[..., Any], s: _worker.Session, phase: str) -> Callable[..., Any]:
    """``fn``, after sleeping ``STALL`` seconds the first time it is called."""
    slept: list[bool] = []

    def stalled(*args: Any, **kwargs: Any) -> Any:
        if not slept:
            slept.append(True)
            s.data["stalled in"] = phase
            time.sleep(STALL)
        return fn(*args, **kwargs)

    return stalled


def attempt(s: _worker.Session, fn: Callable[[], Any]) -> None:
    """Run ``fn`` (a save or load that must fail), recording its error and how long it took."""
    start = time.monotonic()
    try:
        fn()
    except DistributedCheckpointError as error:
        s.data["elapsed"] = time.monotonic() - start
        s.data["error"] = {
            "message": str(error),
            "phase": error.phase,
            "stalled": {str(r): p for r, p in error.stalled.items()},
            "ranks": list(error.ranks),
            "errors": {str(r): e for r, e in error.errors.items()},
        }
        return
    raise AssertionError("no DistributedCheckpointError was raised")


def stall_at(s: _worker.Session, owner: Any, name: str, phase: str, rank: int = STALLED) -> None:
    """On ``rank``: ``owner.name`` (a function or method) sleeps ``STALL`` seconds first."""
    if s.rank == rank:
        setattr(owner, name, sleepy(getattr(owner, name), s, phase))


def session(s: _worker.Session, stall: Callable[[], None], run: Callable[[], Any]) -> None:
    """The previous checkpoint saved (this also sets up savepoint's group for ``DEADLINE``),
    then ``stall`` (on the rank that stalls: its injection) and ``run``, which must fail; then
    every rank waits for the others, and rank 0 checks that the previous checkpoint is intact
    and nothing is left staged."""
    pg = dist.group.WORLD
    path = s.path("ckpt")
    s.data["object"] = path
    sp.save(path, state(s.rank, s.world), process_group=pg, timeout=DEADLINE)
    dist.barrier()
    s.check("previous save", lambda: None)
    stall()
    s.check("stalled", lambda: attempt(s, run))
    dist.barrier()  # the default group, without a deadline: the stalled rank is back by now

    def intact() -> None:
        if s.rank == 0:
            whole = sp.load(path)
            for key, t in tensors(s.world).items():
                assert torch.equal(whole[key], t), key
            left = [n for n in os.listdir(s.workdir) if n.startswith(".ckpt")]
            assert left == [], left

    s.check("previous checkpoint intact", intact)


def saving(s: _worker.Session) -> Callable[[], Any]:
    changed = state(s.rank, s.world)
    changed["rep"].add_(1)
    return lambda: sp.save(
        s.path("ckpt"), changed, process_group=dist.group.WORLD, timeout=DEADLINE
    )


def loading(s: _worker.Session, **options: Any) -> Callable[[], Any]:
    targets = state(s.rank, s.world, empty=True)
    pg = dist.group.WORLD
    return lambda: sp.load(
        s.path("ckpt"), into=targets, process_group=pg, timeout=DEADLINE, **options
    )


# -- scenarios ---------------------------------------------------------------------------------


def scenario_save_plan(s: _worker.Session) -> None:
    from savepoint.distributed import save as dsave

    session(s, lambda: stall_at(s, dsave, "describe_layout", "save: plan"), saving(s))


def scenario_save_write(s: _worker.Session) -> None:
    from savepoint.engine import pipeline

    def stall() -> None:
        if s.rank == STALLED:
            real = pipeline.write_blob
            late = sleepy(real, s, "save: write")

            def write_blob(store: Any, path: str, *args: Any, **kwargs: Any) -> Any:
                writer = late if path.endswith("-00000.safetensors") else real
                return writer(store, path, *args, **kwargs)

            pipeline.write_blob = write_blob  # type: ignore[assignment]

    session(s, stall, saving(s))


def scenario_save_commit(s: _worker.Session) -> None:
    """Rank 0 alone commits: it stalls building the manifest, before its commit."""
    from savepoint.distributed import manifests

    session(s, lambda: stall_at(s, manifests, "manifest", "save: commit", rank=0), saving(s))


def scenario_save_writer_process(s: _worker.Session) -> None:
    """The stalled rank's writer process stops writing for good (``AsyncCheckpointer(writer=
    "process")``): the rank itself must not wait for it either."""
    writing = threading.Event()
    holder: dict[str, Any] = {}

    def stall() -> None:
        if s.rank == STALLED:
            os.environ["SAVEPOINT_WRITER_FAULT"] = "stall"  # its first progress call sleeps
            s.data["stalled in"] = "save: write"
        ck = holder["ck"] = sp.AsyncCheckpointer(
            process_group=dist.group.WORLD,
            timeout=DEADLINE,
            writer="process",
            progress=lambda *_: writing.set(),
        )
        ck._process.ensure()  # started before the timed save (with the fault, on that rank)

    def run() -> None:
        ck = holder["ck"]
        pending = ck.save(s.path("ckpt"), state(s.rank, s.world))
        pid = ck._process.pid
        try:
            pending.wait()
        finally:
            holder["pid"] = pid
            ck.close()

    session(s, stall, run)

    def stopped() -> None:
        # The stalled rank's writer process was stopped (killed) when the others gave up.
        if s.rank == STALLED:
            assert writing.is_set(), "the writer process never started writing"
            try:
                os.kill(holder["pid"], 0)
            except ProcessLookupError:
                return
            raise AssertionError(f"the writer process {holder['pid']} still runs")

    s.check("writer process stopped", stopped)


def scenario_load_plan(s: _worker.Session) -> None:
    from savepoint.distributed import load as dload

    session(s, lambda: stall_at(s, dload, "_tasks", "load: plan"), loading(s))


def scenario_load_read(s: _worker.Session) -> None:
    from savepoint.engine.read import Reader

    def stall() -> None:
        stall_at(s, Reader, "read_shards", "load: read")

    session(s, stall, loading(s, read_once=False))


def scenario_load_read_once(s: _worker.Session) -> None:
    """A read-once load of the replicated 1 MiB tensor, one 256 KiB chunk per round: the stalled
    rank sleeps in the first round from the second on where it reads a chunk."""
    from savepoint.distributed import _fetch, readonce

    readonce.ROUND = 1  # a round per chunk

    def stall() -> None:
        if s.rank != STALLED:
            return
        real = _fetch._Round.read
        rounds: list[int] = []

        def read(self: Any, reader: Any, me: int, verify: bool) -> Any:
            rounds.append(1)
            k = len(rounds)
            if k >= 2 and "stalled in" not in s.data and any(c.reader == me for c in self.chunks):
                s.data["stalled in"] = f"load: read-once round {k}"
                time.sleep(STALL)
            return real(self, reader, me, verify)

        _fetch._Round.read = read  # type: ignore[method-assign]

    session(s, stall, loading(s))


if __name__ == "__main__":
    _worker.main(globals())
