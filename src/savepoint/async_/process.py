"""The trainer's end of ``AsyncCheckpointer(writer="process")``: a staging arena in shared memory
and one long-lived writer process (:mod:`savepoint.async_._writer_main`) that hashes, writes and
commits what is staged there.

``save()`` (the caller's thread) starts the writer process if none runs (its start-up overlaps the
copy), copies the state into the :class:`SharedArena` exactly as the thread writer does, and hands
the layout over on the socket before returning: from then on the save no longer depends on the
trainer (it commits even if the trainer raises, calls ``os._exit`` or is SIGKILLed). The
checkpointer's background thread then only waits for the answer (the GIL is free while it waits)
and builds the description from the checksums it carries; the writer process's death is a
CheckpointWriteError naming it (pid, exit status or signal), raised as any background failure, and
the next save starts a new one.

The arena is a ``memfd`` (an unlinked temporary file where there is none) mapped by both
processes: nothing is named in ``/dev/shm``, so nothing can leak when either process is killed,
and its memory is counted once. The writer process maps it when it is new (sent with the save as
``SCM_RIGHTS``) and keeps the mapping.

A sharded save (``process_group=``, :meth:`ProcessWriter.stage_sharded`) is copied into the arena
the same way in ``save()``, but handed over in parts by the background thread: the writer process
is not a member of the process group, so the save's collectives (the plan, the gather of every
rank's records, rank 0's commit and its answer) run in the trainer's background thread, which
sends the writer process only this rank's write step (a ``pieces`` message: the staging
directory, the pieces the plan assigned to this rank and where their bytes are in the arena) and
waits for their records, with the GIL free. Such a save therefore does not outlive its trainer:
a trainer killed after ``save()`` returned leaves its rank's part unreported, and the save fails
on the other ranks (the previous checkpoint stays; its writer process exits once its write is
done, nobody committing it). The writer process's death mid-write is the
CheckpointWriteError naming it, which becomes this rank's failure in the DistributedCheckpointError
every rank raises. An incremental sharded save's blob session stays open in the writer process
until the background thread tells it the commit's outcome (``settle``).

Where it writes: a local path, or a store named by a URL (``s3://``, ``gs://``, ``az://``,
fsspec's), which the writer process makes again from that URL and the environment it inherited
from the trainer (credentials included; nothing is put on its command line): the save's
location and an incremental save's blob store cross as URLs (:mod:`savepoint.async_._place`,
which refuses, in ``save()``, ``memory://`` and stores made by hand).

A forked child does not share its parent's writer process: its copy of the socket is closed at
fork, and a checkpointer it makes starts its own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import mmap
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from savepoint import errors, info
from savepoint.async_ import _place, _priority, _wire, staging
from savepoint.async_.staging import ArenaSource, Staged, StagingArena, on_cuda
from savepoint.codecs import manifest as mf
from savepoint.engine import save as save_engine
from savepoint.engine import sinks
from savepoint.engine.describe import describe
from savepoint.errors import CheckpointWriteError, UnsupportedStateError
from savepoint.options import Progress, SaveOptions
from savepoint.state import tree
from savepoint.state.arrays import TensorSource
from savepoint.storage.paths import Location

if TYPE_CHECKING:
    from savepoint.distributed import plan
    from savepoint.distributed.pieces import Records

log = logging.getLogger(__name__)

__all__ = ["ProcessWriter", "SharedArena"]

_LIVE: weakref.WeakSet[ProcessWriter] = weakref.WeakSet()
_EXIT_WAIT = 60.0  # seconds close() waits for an idle writer process to exit before killing it


class SharedArena(StagingArena):
    """A staging arena whose memory the writer process maps too (``fd``; ``generation`` counts
    the arenas made, so a new one is sent to the writer process once)."""

    def __init__(self) -> None:
        super().__init__()
        self.fd = -1
        self.generation = 0
        self._registered: tuple[Any, int, mmap.mmap] | None = None  # cudaHostRegister'ed

    def _host_map(self, size: int) -> mmap.mmap:
        if hasattr(os, "memfd_create"):
            fd = os.memfd_create("savepoint-arena", os.MFD_CLOEXEC)
        else:
            with tempfile.TemporaryFile() as f:
                fd = os.dup(f.fileno())
        try:
            os.ftruncate(fd, size)
            m = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        self._close_fd()
        self.fd, self.generation = fd, self.generation + 1
        return m

    def _pinned_map(self, size: int) -> Any:
        """The shared memory, page-locked for CUDA (``cudaHostRegister``): device-to-host copies
        into it are as fast and as asynchronous as into ``pin_memory=True`` tensors, and the
        writer process maps the same pages. Unregistered when the arena is released."""
        import torch

        m = self._host_map(size)
        tensor = torch.frombuffer(m, dtype=torch.uint8)
        cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        code = cudart.cudaHostRegister(tensor.data_ptr(), size, 0)
        if int(code) != 0:
            raise CheckpointWriteError(
                f"cannot page-lock the {size}-byte staging arena shared with the writer process "
                f"for CUDA (cudaHostRegister returned {code}); check the memlock limit "
                "(ulimit -l) or use AsyncCheckpointer(writer='thread')"
            )
        self._registered = (cudart, tensor.data_ptr(), m)
        return tensor

    def offset(self, image: np.ndarray[Any, Any]) -> int:
        """Where ``image`` (a view of the arena) starts in it."""
        assert self._array is not None
        base: int = self._array.__array_interface__["data"][0]
        return int(image.__array_interface__["data"][0]) - base

    def _close_fd(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def release(self) -> None:
        super().release()
        if self._registered is not None:
            cudart, pointer, _ = self._registered
            self._registered = None
            cudart.cudaHostUnregister(pointer)
        self._close_fd()


class ProcessWriter:
    """One writer process and its shared arena (see the module docstring). ``priority``: its
    CPU and I/O priority (:mod:`savepoint.async_._priority`; None: ``SAVEPOINT_WRITER_PRIORITY``
    or the default), fixed when it is made."""

    def __init__(self, priority: _priority.Priority | None = None) -> None:
        self.priority = _priority.resolve(priority)
        self.arena = SharedArena()
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._mapped = 0  # the arena generation the writer process has
        _LIVE.add(self)

    @property
    def pid(self) -> int | None:
        """The writer process's pid (None before the first save)."""
        return None if self._proc is None else self._proc.pid

    def stage(
        self,
        location: Location,
        state: Any,
        meta: dict[str, Any],
        options: SaveOptions,
        incremental: Any = None,
    ) -> functools.partial[info.CheckpointInfo]:
        """Copy ``state`` into the arena and hand the save over (the caller's part); the returned
        function waits for the writer process's answer (the background thread's part).
        ``incremental``: the checked blob store, policy and frozen prefixes of an incremental
        save (``AsyncCheckpointer.save(blobs=...)``); the writer process runs its save session
        with the memo and tracker it keeps for that blob store."""
        target = _place.url_of(location, "checkpoint path")
        self.ensure()  # its start-up overlaps the copy
        flat = tree.flatten(state)
        if incremental is not None and save_engine.has_shards(flat.tree):
            raise UnsupportedStateError("blobs= is not supported for sharded states yet")
        hash_host = incremental is None and staging.HASH_WHILE_STAGING_FOR_PROCESS
        staged = self.arena.stage(flat, options.max_file_bytes, hash_host=hash_host)
        message: dict[str, Any] = {
            "op": "save",
            "path": target,
            "arena_size": self.arena.capacity,
            "files": [
                {
                    "name": f.name,
                    "offset": self.arena.offset(f.image),
                    "size": f.size,
                    "header": len(f.header),
                    "entries": [
                        [e.name, e.dtype, list(e.shape), e.start, e.end] for e in f.entries
                    ],
                }
                for f in staged.files
            ],
            "order": staged.order,
            "tree": staged.tree,
            "metadata": meta,
            "direct": options.direct,
            "writers": options.writers,
            "max_file_bytes": options.max_file_bytes,
            "progress": options.progress is not None,
        }
        if incremental is not None:
            message["blobs"] = _blobs_fields(incremental)
            message["kinds"] = {n: [s.kind] for n, s in flat.tensors.items()}
        if any(on_cuda(s) for s in flat.tensors.values()):
            # CUDA copies land in the background: the save is handed over once they have (by
            # the background thread), with the digests hashed on the device.
            return functools.partial(
                self._hand_over_then_answer, message, staged, location, meta, options
            )
        checks = staged.checks()  # host tensors hashed while staged: not hashed again there
        if checks:
            message["checks"] = checks
        self.hand_over(message)
        return functools.partial(self._answer, location, target, staged, meta, options)

    def stage_sharded(
        self,
        location: Location,
        state: Any,
        meta: dict[str, Any],
        options: SaveOptions,
        incremental: Any = None,
    ) -> Callable[[], info.CheckpointInfo]:
        """A sharded save (``process_group=``): copy this rank's part of ``state`` into the arena
        (the caller's part). The returned function (the background thread's part) runs the
        save's collectives here (:func:`savepoint.distributed.save.save_flat`: the writer
        process is not in the process group) and hands this rank's write step to the writer
        process (:class:`_ShardWriter`). ``incremental``: as :meth:`stage`'s."""
        from savepoint.distributed import save as distributed_save

        target = _place.url_of(location, "checkpoint path")
        self.ensure()  # its start-up overlaps the copy
        staged, snapshot = self.arena.snapshot(
            distributed_save.flatten(state), options.max_file_bytes
        )
        sharded = None
        if incremental is not None:  # the writer process keeps the memo and patch tracker
            sharded = distributed_save.Incremental(incremental.blobs, incremental.policy)
        writer = _ShardWriter(self, target, staged, incremental)

        def commit() -> info.CheckpointInfo:
            return distributed_save.save_flat(location, snapshot, meta, options, sharded, writer)

        return commit

    def _hand_over_then_answer(
        self,
        message: dict[str, Any],
        staged: Staged,
        location: Location,
        meta: dict[str, Any],
        options: SaveOptions,
    ) -> info.CheckpointInfo:
        staged.wait()
        message["checks"] = staged.checks()
        self.hand_over(message)
        return self._answer(location, message["path"], staged, meta, options)

    def ensure(self) -> None:
        """A running writer process: a new one if none runs or the last one died while idle."""
        if self._proc is not None and self._proc.poll() is not None:
            log.warning("the savepoint writer process %s %s; starting a new one", *self._status())
            self._forget()
        if self._proc is not None:
            return
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        path = os.environ.get("PYTHONPATH")
        env = {**os.environ, "PYTHONPATH": root + (os.pathsep + path if path else "")}
        try:
            self._proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "savepoint.async_._writer_main",
                    str(theirs.fileno()),
                    self.priority,
                ],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                env=env,
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._sock, self._mapped = ours, 0

    def hand_over(self, message: dict[str, Any]) -> None:
        """Send ``message`` (with the arena's descriptor when the writer process has not mapped
        this arena yet); a writer process that died since the last save is replaced first."""
        for attempt in (1, 2):
            assert self._sock is not None
            fds = [self.arena.fd] if self._mapped != self.arena.generation else []
            try:
                _wire.send(self._sock, message, fds)
            except OSError:
                if attempt == 2:
                    raise
                self._forget()  # it died since the last save: start a new one, send again
                self.ensure()
            else:
                self._mapped = self.arena.generation
                return

    def _answer(
        self,
        location: Location,
        target: str,
        staged: Staged,
        meta: dict[str, Any],
        options: SaveOptions,
    ) -> info.CheckpointInfo:
        message = self.receive(target, options.progress)
        if "manifest" in message:
            # An incremental save: its manifest names blobs the trainer never saw.
            manifest = mf.parse(message["manifest"].encode())
            return describe(location.store.url(message["directory"]), manifest)
        return _described(location, staged, meta, message)

    def receive(
        self,
        target: str,
        progress: Progress | None,
        *,
        abandoned: Callable[[], BaseException | None] | None = None,
        within: float | None = None,
    ) -> dict[str, Any]:
        """The writer process's answer to the message handed over last (``done``, or
        ``settled``), calling ``progress`` as it reports; its ``error`` raised as the error it
        names, its death as a CheckpointWriteError naming it. A ``progress`` that raises cancels
        the save in the writer process; one already done is answered ``done`` all the same.
        Bounded where asked: once ``abandoned()`` returns an error (the other ranks gave up on
        this save), or after ``within`` seconds without an answer, the writer process is
        killed (it cannot be trusted to be in step any more; the next save starts a new one)
        and that error raised."""
        sock = self._sock
        assert sock is not None
        stop: BaseException | None = None
        deadline = None if within is None else time.monotonic() + within
        while True:
            if abandoned is not None or deadline is not None:
                self._await(sock, target, abandoned, deadline, within)
            message = _wire.receive_message(sock)
            if message is None:
                raise self._died(target)
            if message["op"] == "progress" and progress is not None:
                try:
                    progress(int(message["done"]), int(message["total"]))
                except BaseException as exc:
                    # The caller stops this save (save_on_preemption abandoning it): the writer
                    # process stops at its next write unless it has committed already.
                    stop, progress = exc, None
                    with contextlib.suppress(OSError):
                        _wire.send(sock, {"op": "cancel"})
            elif message["op"] == "error":
                if stop is not None:
                    raise stop from _wire.error_from(message)
                raise _wire.error_from(message)
            elif message["op"] in ("done", "settled", "verified"):
                return message

    def verify(self, location: Location) -> None:
        """Have the writer process read back and verify the committed checkpoint at
        ``location`` (``sp.verify(path, direct=True)`` there, at its priority). Called between
        saves (a save's ``on_commit``: the writer process is idle). Raises what the check found;
        CheckpointWriteError when there is no live writer process to ask, or it died."""
        target = _place.url_of(location, "checkpoint path")
        proc, sock = self._proc, self._sock
        if proc is None or sock is None or proc.poll() is not None:
            raise CheckpointWriteError(
                f"no writer process to verify {target}: it is not running", path=target
            )
        try:
            _wire.send(sock, {"op": "verify", "path": target})
        except OSError as exc:
            raise self._died(target) from exc
        self.receive(target, None)

    def _await(
        self,
        sock: socket.socket,
        target: str,
        abandoned: Callable[[], BaseException | None] | None,
        deadline: float | None,
        within: float | None,
    ) -> None:
        """Until the writer process has something to say (see :meth:`receive`)."""
        while True:
            wait = 1.0 if deadline is None else min(1.0, deadline - time.monotonic())
            if wait > 0 and select.select([sock], [], [], wait)[0]:
                return
            error = abandoned() if abandoned is not None else None
            if error is None and deadline is not None and time.monotonic() >= deadline:
                error = CheckpointWriteError(
                    f"the savepoint writer process (pid {self.pid}) did not answer within "
                    f"{within:g} s during the save to {target}; it was stopped and the next "
                    "save starts a new one",
                    path=target,
                )
            if error is not None:
                proc = self._proc
                self._forget()
                if proc is not None:
                    proc.kill()
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(timeout=10)  # a process stuck in the kernel dies on return
                raise error

    def _died(self, target: str) -> CheckpointWriteError:
        """The error for a writer process that ended (or broke its protocol) mid-save."""
        proc = self._proc
        if proc is not None:
            try:
                proc.wait(timeout=10)  # its socket is closed: it is exiting
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        pid, how = self._status()
        self._forget()
        return CheckpointWriteError(
            f"the savepoint writer process (pid {pid}) {how} before the save to {target} was "
            "committed: nothing was committed there and earlier checkpoints are untouched; the "
            "next save starts a new writer process",
            path=target,
        )

    def _status(self) -> tuple[int | None, str]:
        proc = self._proc
        code = None if proc is None else proc.returncode
        if code is None:
            return self.pid, "stopped answering"
        if code < 0:
            try:
                return self.pid, f"was killed by signal {signal.Signals(-code).name}"
            except ValueError:
                return self.pid, f"was killed by signal {-code}"
        return self.pid, f"exited with status {code}"

    def _forget(self) -> None:
        """Drop the writer process (dead, or the parent's in a forked child) and its socket."""
        if self._sock is not None:
            self._sock.close()
        self._sock = self._proc = None

    def close(self) -> None:
        """Stop the writer process (idle: the checkpointer waited for its save) and free the arena."""
        proc = self._proc
        self._forget()  # end of stream: the writer process exits
        if proc is not None:
            try:
                proc.wait(timeout=_EXIT_WAIT)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.arena.release()
        _LIVE.discard(self)


class _ShardWriter:
    """This rank's write step of a sharded save, in the writer process (the
    :class:`~savepoint.distributed.save.RankWriter` of :meth:`ProcessWriter.stage_sharded`): the
    pieces the plan gave this rank are sent as a ``pieces`` message (each piece's place in the
    arena) and the writer process answers with their records, after writing and syncing them
    (:func:`savepoint.distributed.save.write_rank`). An incremental save's session stays open in
    the writer process until :meth:`close` tells it the commit's outcome."""

    def __init__(self, process: ProcessWriter, target: str, staged: Staged, incremental: Any):
        self.process = process
        self.target = target
        self.staged = staged
        self.incremental = incremental
        self.open = False  # the writer process holds this save's blob session
        self.timeout = 1800.0  # the save's timeout=, for the writer process's answers

    def write(
        self,
        location: Location,
        staging: str,
        rank: int,
        items: tuple[plan.Item, ...],
        sources: dict[str, TensorSource],
        options: SaveOptions,
    ) -> Records:
        from savepoint.distributed import collectives, deadlines, pieces

        self.timeout = options.timeout or collectives.DEFAULT_TIMEOUT
        self.staged.wait()  # CUDA copies land (they overlapped the plan step)
        message: dict[str, Any] = {
            "op": "pieces",
            "path": self.target,
            "staging": staging,
            "rank": rank,
            "arena_size": self.process.arena.capacity,
            "pieces": pieces.items_json(items),
            "sources": [self._place(sources[item.key]) for item in items],
            "direct": options.direct,
            "writers": options.writers,
            "max_file_bytes": options.max_file_bytes,
            "progress": options.progress is not None,
        }
        if self.incremental is not None:
            message["blobs"] = _blobs_fields(self.incremental)
        progress, stopped = options.progress, list[BaseException]()

        def watched(done: int, total: int) -> None:
            assert progress is not None
            try:
                progress(done, total)
            except BaseException as exc:
                stopped.append(exc)
                raise

        self.process.hand_over(message)
        with deadlines.working_on(f"its writer process (pid {self.process.pid}) writing"):
            answer = self.process.receive(
                self.target,
                watched if progress is not None else None,
                abandoned=deadlines.abandoned,
            )
        # Done: an incremental save's session is open in the writer process until close().
        self.open = self.incremental is not None
        if stopped:  # the caller stopped the save once the pieces were written: not committed
            raise stopped[0]
        return pieces.records_from_json(answer)

    def _place(self, source: TensorSource) -> list[Any]:
        """Where a piece's bytes are in the arena, and the shape and kind of what was staged."""
        assert isinstance(source, ArenaSource)
        return [self.process.arena.offset(source.view), list(source.shape), source.kind]

    def close(self, committed: bool) -> None:
        if not self.open:
            return
        self.open = False
        try:
            sock = self.process._sock
            assert sock is not None
            _wire.send(sock, {"op": "settle", "committed": committed})
            self.process.receive(self.target, None, within=self.timeout)
        except (OSError, errors.CheckpointError) as exc:
            log.warning(
                "%s: the writer process could not close this rank's blob session (%s); blob "
                "collections wait until its record is stale",
                self.target,
                exc,
            )


def _blobs_fields(incremental: Any) -> dict[str, Any]:
    """An incremental save's blob store, policy and frozen prefixes, as a message's fields."""
    policy = dataclasses.asdict(incremental.policy)
    blobs = incremental.blobs
    return {
        "url": _place.url_of(Location(blobs.store, blobs.root), "blob store"),
        "algorithm": incremental.blobs.algorithm,
        "policy": policy,
        "frozen": None if incremental.prefixes is None else list(incremental.prefixes),
    }


def _described(
    location: Location, staged: Staged, meta: dict[str, Any], answer: dict[str, Any]
) -> info.CheckpointInfo:
    """The description of the checkpoint the writer process committed, from its answer (the
    checksums) and what the trainer staged: the manifest it wrote, without reading it back."""
    files = {
        f.name: mf.FileRecord(f.size, len(f.header), answer["files"][f.name]) for f in staged.files
    }
    digests = dict(zip(staged.order, answer["digests"]))
    where = {e.name: (f.name, e) for f in staged.files for e in f.entries}
    tensors = {
        name: mf.TensorRecord(e.dtype, e.shape, file, e.start, e.end, digests[name])
        for name in staged.order
        for file, e in [where[name]]
    }
    written = sinks.Written(files, tensors, answer["format_version"])
    manifest = save_engine.new_manifest(staged.tree, [written], meta)
    manifest.created = answer["created"]
    return describe(location.store.url(answer["directory"]), manifest)


def _forget_in_child() -> None:
    # The parent's writer process stays the parent's: close this copy of each socket (the
    # parent's end stays open) and forget the process, so the child neither waits for nor kills it.
    for writer in list(_LIVE):
        writer._forget()
    _LIVE.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
