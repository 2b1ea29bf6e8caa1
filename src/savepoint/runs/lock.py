"""The writer lock of a run directory: one ``CheckpointManager`` writes a run at a time.

A run directory has one writer. Two writers would each prune by their own view of the run, so one
process's retention could delete the checkpoint the other has just committed. A writing manager
therefore holds the lock ``store.lock(run/.writer.lock)`` of the run's store from the moment it
opens until ``close()`` (or until it is garbage collected, or its process dies). A second writer,
in this process or another, gets :class:`~savepoint.errors.RunLockedError` naming the holder.

On a local disk that is an exclusive ``flock(2)`` on ``run/.writer.lock``
(:class:`savepoint.storage.local.LocalLock`, which says why ``flock`` and how it behaves across
``fork`` and ``SIGKILL``); while held, the lock file holds one JSON line describing the holder
(``{"pid": 123, "host": "node7", "since": "2026-11-25T12:00:00Z"}``), only informative. On the
in-memory store (which lives in one process) it is an in-process lock, and the description is a
blob at the same name. On object stores, which have no locks, it is a lease object put create-only
at that name and renewed while held (:class:`savepoint.storage.lease.LeaseLock`: a writer that died
leaves a lease that expires after its ttl, at once where its host sees its pid gone). Readers (``sp.load``, a read-only manager, ``savepoint ls``, ``report``
and ``verify``) never take the lock.

Why ``fcntl.flock`` directly rather than the ``filelock`` package: ``filelock``'s
``UnixFileLock._acquire`` opens the lock file with ``O_RDWR | O_TRUNC`` *before* trying the lock
in the 3.x releases (checked in their ``_unix.py``), so each refused contender would wipe the
holder description written into the file, and the error could no longer say who holds the run.
The 4.3.1 release installed here opens without ``O_TRUNC``, but it unlinks the lock file on
release unless ``preserve_lock_file`` is set, can fall back to "soft" marker files where
``flock`` is missing, and these details have changed between releases.

A forked child (a data-loader worker, say) does not hold the lock: :meth:`WriterLock.check`
refuses to let its manager write (RunLockedError naming the parent).

The local lock file is an ordinary file anyone may delete or replace. Deleting it under a live
writer would let a second writer lock a new file of the same name, so the writer calls
:meth:`WriterLock.check` before every save: a lock file that is simply gone is recreated and locked
again (no other writer can have opened the run, or the file would exist; only deleting it a second
time, after such a writer closed, would hide that writer), while one replaced by
another file means another writer may have written the run since, so this writer stops for good
(RunLockedError naming the current holder when there is one). A directory, symbolic link, FIFO or
anything else that is not a regular file at that path is refused with CheckpointWriteError saying
to remove it; it is never opened as the lock.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import time

from savepoint.codecs import bounded_json
from savepoint.errors import (
    CheckpointError,
    CheckpointWriteError,
    CorruptCheckpointError,
    NotRegularFileError,
    RunLockedError,
)
from savepoint.runs.report import now_iso
from savepoint.storage.base import Lock
from savepoint.storage.lease import LeaseLock
from savepoint.storage.local import LocalLock
from savepoint.storage.paths import Location, PathArg, resolve

__all__ = ["LOCK_FILE", "WriterLock", "read_holder"]

LOCK_FILE = ".writer.lock"
_HOLDER_MAX = 4096


def _wrong_kind(shown: str) -> CheckpointWriteError:
    return CheckpointWriteError(
        f"{shown} is not a regular file, so it cannot be this run's writer lock (a directory, "
        "symbolic link or FIFO put there by hand?): remove it, and savepoint creates it again (at "
        "the writer's next save, or when a manager next opens the run)",
        path=shown,
        errno=errno.EINVAL,
    )


class WriterLock:
    """The writer lock of the run at a :class:`Location` (see the module docstring).

    :meth:`acquire` raises RunLockedError when another writer holds it, CheckpointWriteError when
    something other than a regular file is at the lock file's path, and OSError when the lock file
    cannot be created or opened (a read-only directory, say): the caller decides what that means.
    :meth:`check` (before every save) says whether it is still held. :meth:`release` is
    idempotent.
    """

    def __init__(self, run: Location, lock: Lock) -> None:
        self.run = run
        self.directory = str(run)
        self.path = run.store.join(run.path, LOCK_FILE)
        self._lock: Lock | None = lock
        self._pid = os.getpid()
        self._lost: str | None = None  # why this writer stopped for good (see check())

    @classmethod
    def acquire(cls, run: Location) -> WriterLock:
        store = run.store
        path = store.join(run.path, LOCK_FILE)
        lock = store.lock(path)
        try:
            taken = lock.acquire()
        except NotRegularFileError:
            raise _wrong_kind(store.url(path)) from None
        if not taken:
            holder = _wait_for_holder(run)
            raise RunLockedError(
                f"{run} is being written by another CheckpointManager "
                f"({holder or 'holder unknown'}); a run directory has one writer at a time. "
                "Close the other manager (or stop that process), open this one read-only "
                "(read_only=True) to only restore, or give this run its own directory",
                path=str(run),
                holder=holder,
            )
        writer = cls(run, lock)
        writer._describe()
        return writer

    def _describe(self) -> None:
        record = {"pid": os.getpid(), "host": socket.gethostname(), "since": now_iso()}
        data = (json.dumps(record) + "\n").encode("utf-8")
        if isinstance(self._lock, LocalLock):
            self._lock.describe(data)  # inside the locked file: replacing it would lose the lock
        elif isinstance(self._lock, LeaseLock):
            pass  # the lease object names its holder itself
        elif self._in_process:
            with contextlib.suppress(OSError):  # informative only
                self.run.store.put(self.path, data, exclusive=False)
        # Else a lock across processes this module cannot describe (a wrapped local lock): a
        # description put at its name would replace the very file that is locked.

    @property
    def _in_process(self) -> bool:
        """Whether the lock lives in this process only (memory stores): then its name is free
        for the holder's description."""
        return not self.run.store.capabilities.locks

    def check(self) -> None:
        """Raise unless this process still holds the run's lock through the file at its path.

        A lock file that is gone is recreated and locked again. RunLockedError when the lock file
        was replaced (then always, even if the replacement goes away again: the run may have been
        written by another writer since) or when this is a forked child of the writer;
        CheckpointWriteError when something other than a regular file is at the path now."""
        if os.getpid() != self._pid:
            raise RunLockedError(
                f"this CheckpointManager was opened by process {self._pid}; a process forked from "
                f"it cannot write the run {self.directory} (the writer lock stays with the parent). "
                "Open a manager in this process once the parent has closed its own, or one with "
                "read_only=True to only restore",
                path=self.directory,
                holder=f"pid {self._pid} (the parent of this process)",
            )
        if self._lost is None and isinstance(self._lock, LeaseLock):
            self._lost = self._lock.check()  # renews the lease; why it was lost, if it was
        if self._lost is None and isinstance(self._lock, LocalLock):
            try:
                self._lost = self._lock.check()
            except NotRegularFileError:
                # No other writer can have taken the run through it either; once it is removed,
                # the next check recreates the lock file.
                raise _wrong_kind(self.run.store.url(self.path)) from None
            except OSError as exc:
                shown = self.run.store.url(self.path)
                self._lost = f"its lock file {shown} cannot be checked ({exc.strerror or exc})"
        if self._lost is not None:
            holder = read_holder(self.run)
            raise RunLockedError(
                f"this CheckpointManager no longer writes {self.directory}: {self._lost}, so "
                f"another writer may have changed the run since (now holding it: "
                f"{holder or 'nobody'}); nothing was written. Close this manager and open a new "
                "one (which reads what the run holds now)",
                path=self.directory,
                holder=holder,
            )

    @property
    def held(self) -> bool:
        return self._lock is not None

    def release(self) -> None:
        """Drop the lock and its description; idempotent."""
        lock, self._lock = self._lock, None
        if lock is None:
            return
        if self._in_process and os.getpid() == self._pid and not isinstance(lock, LeaseLock):
            with contextlib.suppress(OSError):
                self.run.store.remove(self.path)
        if os.getpid() == self._pid or isinstance(lock, LocalLock):
            lock.release()


def _wait_for_holder(run: Location) -> str | None:
    # The holder writes its description just after taking the lock: give it a moment.
    for _ in range(20):
        holder = read_holder(run)
        if holder is not None:
            return holder
        time.sleep(0.005)
    return None


def read_holder(directory: PathArg) -> str | None:
    """Who holds the writer lock of the run at ``directory``, as "pid 123 on host node7 since
    <time>", or None if unknown."""
    run = resolve(directory, what="run directory")
    try:
        raw = run.store.read_small(run.store.join(run.path, LOCK_FILE), cap=_HOLDER_MAX)
    except (OSError, CheckpointError):
        return None
    try:
        doc = bounded_json.loads(raw, CorruptCheckpointError, str(run))
        pid, host, since = int(doc["pid"]), str(doc["host"]), str(doc["since"])
    except (ValueError, KeyError, TypeError, OverflowError):  # CorruptCheckpointError too
        return None
    here = " (this process)" if pid == os.getpid() and host == socket.gethostname() else ""
    return f"pid {pid}{here} on host {host} since {since}"
