"""The writer lock of a run directory: one ``CheckpointManager`` writes a run at a time.

A run directory has one writer. Two writers would each prune by their own view of the run, so one
process's retention could delete the checkpoint the other has just committed. A writing manager
therefore holds an exclusive ``flock(2)`` on ``run/.writer.lock`` from the moment it opens until
``close()`` (or until it is garbage collected, or its process dies: the kernel drops the lock with
the last descriptor, so a SIGKILLed writer never leaves a stale lock behind). A second writer, in
this process or another, gets :class:`~savepoint.errors.RunLockedError` naming the holder.

While held, the lock file holds one JSON line describing the holder
(``{"pid": 123, "host": "node7", "since": "2026-11-25T12:00:00Z"}``); it is only informative, the
lock itself is the ``flock``. Readers (``sp.load``, a read-only manager, ``savepoint ls``,
``report`` and ``verify``) never take the lock.

Why ``fcntl.flock`` directly rather than the ``filelock`` package: ``filelock``'s
``UnixFileLock._acquire`` opens the lock file with ``O_RDWR | O_TRUNC`` *before* trying the lock
in the 3.x releases (checked in their ``_unix.py``), so each refused contender would wipe the
holder description written into the file, and the error could no longer say who holds the run.
The 4.3.1 release installed here opens without ``O_TRUNC``, but it unlinks the lock file on
release unless ``preserve_lock_file`` is set, can fall back to "soft" marker files where
``flock`` is missing, and these details have changed between releases. What savepoint needs is a
few lines of ``flock`` with the behaviour pinned here, and no new dependency: never truncate
before holding the lock, never delete the lock file (deleting a flock'ed file lets two processes
lock two different inodes), and never unlock explicitly (``LOCK_UN`` on a descriptor a forked
child inherited would release the parent's lock too; closing our copy does not).

A forked child (a data-loader worker, say) closes its inherited copy of the descriptor at once
(``os.register_at_fork``): otherwise a child outliving a killed writer would keep the run locked.
The child's manager then no longer holds the lock, and :meth:`WriterLock.check` refuses to let it
write (RunLockedError naming the parent).

The lock file is an ordinary file anyone may delete or replace. Deleting it under a live writer
would let a second writer lock a new file of the same name, so the writer calls
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
import fcntl
import json
import os
import socket
import stat
import time
import weakref

from savepoint.errors import CheckpointWriteError, RunLockedError
from savepoint.runs.report import now_iso

LOCK_FILE = ".writer.lock"
_HOLDER_MAX = 4096
_HELD: weakref.WeakSet[WriterLock] = weakref.WeakSet()


def _open_lock_file(path: str, *, exclusive: bool = False) -> int:
    """Open (or create) the lock file; raises CheckpointWriteError when something that is not a
    regular file is in the way, OSError for anything else (no permission, read-only media)."""
    # No O_TRUNC: the file may describe the current holder, which a refused writer must read.
    # O_NOFOLLOW: a symbolic link is refused, never followed; O_NONBLOCK: a FIFO never blocks.
    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
    try:
        fd = os.open(path, flags | (os.O_EXCL if exclusive else 0), 0o644)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO, errno.ENOTDIR):
            raise _wrong_kind(path, exc.errno) from None
        raise
    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        os.close(fd)
        raise
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise _wrong_kind(path, errno.EINVAL)
    return fd


def _wrong_kind(path: str, code: int) -> CheckpointWriteError:
    return CheckpointWriteError(
        f"{path} is not a regular file, so it cannot be this run's writer lock (a directory, "
        "symbolic link or FIFO put there by hand?): remove it, and savepoint creates it again (at "
        "the writer's next save, or when a manager next opens the run)",
        path=path,
        errno=code,
    )


class WriterLock:
    """An exclusive, non-blocking lock on a run directory (see the module docstring).

    :meth:`acquire` raises RunLockedError when another writer holds it, CheckpointWriteError when
    something other than a regular file is at the lock file's path, and OSError when the lock file
    cannot be created or opened (a read-only directory, say): the caller decides what that means.
    :meth:`check` (before every save) says whether it is still held. :meth:`release` is
    idempotent.
    """

    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self.directory = os.path.dirname(path)
        self._fd: int | None = fd
        self._pid = os.getpid()
        self._lost: str | None = None  # why this writer stopped for good (see check())
        _HELD.add(self)

    @classmethod
    def acquire(cls, directory: str) -> WriterLock:
        path = os.path.join(directory, LOCK_FILE)
        return cls(path, _lock(path, _open_lock_file(path)))

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
        if self._lost is None and self._fd is not None:
            try:
                self._still_mine(self._fd)
            except CheckpointWriteError:
                # Not a regular file in the way: no other writer can have taken the run through
                # it either; once it is removed, the next check recreates the lock file.
                raise
            except OSError as exc:
                self._lost = f"its lock file {self.path} cannot be checked ({exc.strerror or exc})"
        if self._lost is not None:
            holder = read_holder(self.directory)
            raise RunLockedError(
                f"this CheckpointManager no longer writes {self.directory}: {self._lost}, so "
                f"another writer may have changed the run since (now holding it: "
                f"{holder or 'nobody'}); nothing was written. Close this manager and open a new "
                "one (which reads what the run holds now)",
                path=self.directory,
                holder=holder,
            )

    def _still_mine(self, fd: int) -> None:
        """Set ``_lost`` when the lock file is no longer ours; relock a deleted one."""
        mine = os.fstat(fd)
        try:
            there = os.lstat(self.path)
        except FileNotFoundError:
            # Gone, and nobody created a new one: no other writer can have opened the run.
            # O_EXCL: if one appears meanwhile, it is someone else's (replaced, below).
            try:
                new = _lock(self.path, _open_lock_file(self.path, exclusive=True))
            except FileExistsError:
                self._lost = f"its lock file {self.path} was deleted and created again by another"
                return
            except RunLockedError:
                self._lost = f"its lock file {self.path} was deleted and taken by another writer"
                return
            self._fd = new
            with contextlib.suppress(OSError):
                os.close(fd)  # the deleted inode's lock: nobody else can reach it
            return
        if (there.st_dev, there.st_ino) == (mine.st_dev, mine.st_ino):
            return
        if not stat.S_ISREG(there.st_mode):
            raise _wrong_kind(self.path, errno.EINVAL)
        self._lost = f"its lock file {self.path} was deleted or replaced while it held the run"

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Drop the lock (closing the descriptor; see the module docstring for why not LOCK_UN)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        _HELD.discard(self)
        if os.getpid() == self._pid:
            with contextlib.suppress(OSError):  # the description must not outlive the lock
                os.ftruncate(fd, 0)
        with contextlib.suppress(OSError):  # the kernel drops the lock whatever close() says
            os.close(fd)

    def _forget(self) -> None:
        """In a forked child: close the inherited descriptor; the parent keeps the lock."""
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


def _lock(path: str, fd: int) -> int:
    """Take the flock on ``fd`` (closed on failure) and describe this process as the holder."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise
        directory = os.path.dirname(path)
        holder = _wait_for_holder(directory)
        raise RunLockedError(
            f"{directory} is being written by another CheckpointManager "
            f"({holder or 'holder unknown'}); a run directory has one writer at a time. "
            "Close the other manager (or stop that process), open this one read-only "
            "(read_only=True) to only restore, or give this run its own directory",
            path=directory,
            holder=holder,
        ) from None
    record = {"pid": os.getpid(), "host": socket.gethostname(), "since": now_iso()}
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode("utf-8"), 0)
    except OSError:
        # The description is informative only (a full disk, say): the flock is the lock.
        pass
    return fd


def _after_fork_in_child() -> None:
    for held in list(_HELD):
        held._forget()
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _wait_for_holder(directory: str) -> str | None:
    # The holder writes its description just after taking the lock: give it a moment.
    for _ in range(20):
        holder = read_holder(directory)
        if holder is not None:
            return holder
        time.sleep(0.005)
    return None


def read_holder(directory: str) -> str | None:
    """Who holds the writer lock, as "pid 123 on host node7 since <time>", or None if unknown."""
    try:
        fd = os.open(
            os.path.join(directory, LOCK_FILE), os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW
        )
    except OSError:
        return None
    try:
        raw = os.read(fd, _HOLDER_MAX)
    except OSError:
        return None
    finally:
        os.close(fd)
    try:
        doc = json.loads(raw.decode("utf-8"))
        pid, host, since = int(doc["pid"]), str(doc["host"]), str(doc["since"])
    except (ValueError, KeyError, TypeError, OverflowError, RecursionError):
        return None
    here = " (this process)" if pid == os.getpid() and host == socket.gethostname() else ""
    return f"pid {pid}{here} on host {host} since {since}"
