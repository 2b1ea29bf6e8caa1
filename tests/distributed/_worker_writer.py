"""Sharded saves through the writer process (``writer="process"``): one rank of a session
launched by ``_launch.py`` (``_launch.run(..., worker=WORKER)``), built on ``_worker.py``'s state
and checks; its scenarios are installed into ``_worker``, whose ``main`` joins the group and
records the checks. Never collected.

Usage: python _worker_writer.py SCENARIO RANK WORLD PORT WORKDIR
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable

import torch
import torch.distributed as dist
from _worker import (
    INC_POLICY_ARGS,
    Session,
    blob_files,
    check_state,
    check_whole,
    expect_failure,
    inc_check,
    inc_state,
    local_of,
    referenced,
    state,
)

import savepoint as sp
from savepoint.errors import DistributedCheckpointError

FAULT = "SAVEPOINT_WRITER_FAULT"


def synced(fn: Callable[[], None]) -> Callable[[], None]:
    """``fn``, then a barrier every rank passes, failed or not (a failed check never hangs the
    next one)."""

    def run() -> None:
        try:
            fn()
        finally:
            dist.barrier()

    return run


def writer_pid(ck: sp.AsyncCheckpointer) -> int:
    process = ck._process
    assert process is not None and process.pid is not None, "no writer process"
    assert process.pid != os.getpid()
    return process.pid


def scenario_writer2(s: Session) -> None:
    """World 2: sharded saves through each rank's writer process, by an AsyncCheckpointer and
    by CheckpointManagers (plain and incremental); the writer process killed mid-write on rank 1."""
    rank, world = s.rank, s.world
    pg = dist.group.WORLD

    def checkpointer() -> None:
        live = state(rank, world)
        with sp.AsyncCheckpointer(process_group=pg, timeout=60, writer="process") as ck:
            pending = ck.save(s.path("async"), live)
            # Training goes on as soon as save() returns: the checkpoint holds the state then.
            for t in (live["model"]["rep"], local_of(live["model"]["tp0"])):
                t.add_(1000)
            local_of(live["model"]["fsdp"]).zero_()
            info = pending.wait()
            assert info.world_size == world and info.format_version == 3, info
            pid = writer_pid(ck)
            # The arena is reused: a second save (the mutated state) through the same process.
            ck.save(s.path("async-2"), live).wait()
            assert writer_pid(ck) == pid
            with open(f"/proc/{pid}/maps", encoding="ascii", errors="replace") as f:
                assert "torch" not in f.read(), "the writer process loaded torch"
        targets = state(rank, world, empty=True)
        sp.load(s.path("async"), into=targets, process_group=pg, timeout=60)
        check_state(targets, rank, world)
        assert sp.inspect(s.path("async")) == info
        if rank == 0:
            sp.verify(s.path("async"))
            check_whole(sp.load(s.path("async")))
            second = sp.load(s.path("async-2"))["model"]
            assert torch.equal(second["rep"], live["model"]["rep"])
            assert not second["fsdp"].any()

    s.check("async checkpointer", synced(checkpointer))

    def manager() -> None:
        run = s.path("run")
        with sp.CheckpointManager(
            run, keep_last=2, process_group=pg, timeout=60, async_save=True, writer="process"
        ) as mgr:
            for step in (1, 2, 3):
                mgr.save(step, state(rank, world), metrics={"loss": 1.0 / step})
            mgr.wait()
            writer_pid(mgr._saver.checkpointer)
        dist.barrier()
        targets = state(rank, world, empty=True)
        with sp.CheckpointManager(run, read_only=True) as reader:
            restored = reader.restore(targets, process_group=pg, timeout=60, resume=False)
            assert restored == 3 and reader.steps() == [2, 3], (restored, reader.steps())
        check_state(targets, rank, world)

    s.check("manager", synced(manager))

    def incremental() -> None:
        from savepoint.blobs import BlobPolicy

        run = s.path("inc-run")
        with sp.CheckpointManager(
            run,
            incremental=True,
            blob_policy=BlobPolicy(**{**INC_POLICY_ARGS, "patches": True}),
            keep_last=2,
            process_group=pg,
            timeout=60,
            async_save=True,
            writer="process",
        ) as mgr:
            for step in (1, 2, 3):
                mgr.save(step, inc_state(rank, world, step))
        dist.barrier()
        for step in (2, 3):
            targets = inc_state(rank, world, step, empty=True)
            path = os.path.join(run, "checkpoints", f"step-{step:010d}")
            sp.load(path, into=targets, process_group=pg, timeout=60)
            inc_check(targets, rank, world, step)
        if rank == 0:
            from savepoint.codecs import manifest as mf

            kept = [os.path.join(run, "checkpoints", f"step-{n:010d}") for n in (2, 3)]
            with open(os.path.join(kept[-1], "manifest.json"), "rb") as f:
                last = mf.parse(f.read())
            # Row patches: the writer process's tracker was told of the commits before.
            assert last.format_version == mf.PATCHES, last.format_version
            assert any(r.patches for r in mf.recipes(last))
            sp.verify(kept[-1])
            assert set(blob_files(os.path.join(run, "blobs"))) == referenced(kept)
            assert os.listdir(os.path.join(run, "blobs", "sessions")) == []

    s.check("incremental manager", synced(incremental))

    def stopped() -> None:
        # Rank 1's caller stops an incremental save (a progress callback that raises, as
        # save_on_preemption does): cancelled in its writer process, or, if its pieces were
        # already written, refused before the commit; the session closed either way.
        from savepoint.blobs import BlobPolicy

        target, blobs = s.path("inc-stop"), s.path("inc-stop-blobs")
        policy = BlobPolicy(**INC_POLICY_ARGS)

        def stop(done: int, total: int) -> None:
            if rank == 1:
                raise RuntimeError("stopped by its caller")

        with sp.AsyncCheckpointer(process_group=pg, timeout=60, writer="process") as ck:
            ck.save(target, inc_state(rank, world, 1), blobs=blobs, blob_policy=policy).wait()
        ck = sp.AsyncCheckpointer(process_group=pg, timeout=60, writer="process", progress=stop)
        pending = ck.save(target, inc_state(rank, world, 2), blobs=blobs, blob_policy=policy)
        words = ["stopped by its caller"]
        s.data["stopped"] = expect_failure(pending.wait, ranks=[1], words=words, within=20)
        try:
            ck.close()
        except DistributedCheckpointError:
            pass
        dist.barrier()
        assert os.listdir(os.path.join(blobs, "sessions")) == []
        targets = inc_state(rank, world, 1, empty=True)
        sp.load(target, into=targets, process_group=pg, timeout=60)
        inc_check(targets, rank, world, 1)  # the previous one

    s.check("an incremental save its caller stops", synced(stopped))

    def killed() -> None:
        target = s.path("kill")
        with sp.AsyncCheckpointer(process_group=pg, timeout=60, writer="process") as ck:
            ck.save(target, state(rank, world)).wait()  # the previous checkpoint
        writing = threading.Event()
        if rank == 1:
            os.environ[FAULT] = "stall"  # its writer process stops at its first progress call
        ck = sp.AsyncCheckpointer(
            process_group=pg, timeout=60, writer="process", progress=lambda *_: writing.set()
        )
        changed = state(rank, world)
        local_of(changed["model"]["tp0"]).add_(1)
        pending = ck.save(target, changed)
        if rank == 1:
            del os.environ[FAULT]
            assert writing.wait(30), "the writer process never started writing"
            pid = writer_pid(ck)
            os.kill(pid, signal.SIGKILL)
        words = ["rank 1", "writer process", "was killed by signal SIGKILL"]
        s.data["killed"] = expect_failure(pending.wait, ranks=[1], words=words, within=20)
        try:
            ck.wait()  # the same failure, reported once more by the checkpointer
        except DistributedCheckpointError:
            pass
        else:
            raise AssertionError("wait() did not report the failed save")
        dist.barrier()
        targets = state(rank, world, empty=True)
        sp.load(target, into=targets, process_group=pg, timeout=60)  # the previous one, intact
        check_state(targets, rank, world)
        staging = [n for n in os.listdir(s.workdir) if n.startswith(".kill")]
        assert staging == [], staging
        ck.save(target, changed).wait()  # the next save starts a new writer process
        if rank == 1:
            assert writer_pid(ck) != pid
        ck.close()
        sp.load(target, into=targets, process_group=pg, timeout=60)
        assert torch.equal(local_of(targets["model"]["tp0"]), local_of(changed["model"]["tp0"]))

    s.check("writer process killed mid-write", synced(killed))

    # Last (rank 1 does not come back): rank 1's trainer dies after save() returned, while its
    # writer process writes. A sharded save does not outlive its trainer: it fails on rank 0,
    # the previous checkpoint stays, and the orphaned writer process exits (the test checks).
    target = s.path("kill")
    before = sp.inspect(target)
    writing = threading.Event()
    if rank == 1:
        os.environ[FAULT] = "crawl"  # 50 ms per progress call: still writing when it dies
    ck = sp.AsyncCheckpointer(
        process_group=pg, timeout=20, writer="process", progress=lambda *_: writing.set()
    )
    pending = ck.save(target, state(rank, world))
    if rank == 1:
        assert writing.wait(30), "the writer process never started writing"
        s.data["orphan"] = writer_pid(ck)
        s.write()
        os._exit(17)

    def trainer_killed() -> None:
        words = ["rank 1 did not finish its part"]
        s.data["trainer killed"] = expect_failure(pending.wait, ranks=[1], words=words, within=25)
        assert sp.inspect(target) == before
        sp.verify(target)

    s.check("a trainer killed after save() returned", trainer_killed)


if __name__ == "__main__":
    import _worker

    _worker.scenario_writer2 = scenario_writer2  # type: ignore[attr-defined]
    _worker.main()
