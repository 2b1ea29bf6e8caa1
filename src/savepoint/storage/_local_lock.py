"""The local store's writer lock (implementation, not public API: import :class:`LocalLock` from
:mod:`savepoint.storage.local`): an exclusive, non-blocking ``flock(2)`` on a lock file, checked
against the file now at its path, forgotten by a forked child."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import weakref

from savepoint.errors import NotRegularFileError
from savepoint.storage._local_read import identity, regular

__all__ = ["LocalLock"]


class LocalLock:
    """An exclusive, non-blocking ``flock(2)`` on a lock file: :meth:`LocalStore.lock`.

    It excludes other processes as well as other threads of this one (each lock opens its own
    file description). The lock file is created if absent and is never truncated before the lock
    is held (a refused contender must not wipe the holder's description), never deleted (deleting
    a locked file lets two processes lock two different inodes of one name) and never unlocked
    explicitly: ``LOCK_UN`` on a descriptor a forked child inherited would release the parent's
    lock too, while closing our copy does not. A forked child closes its inherited copy at once,
    so a child outliving its parent never keeps the lock; the kernel drops the lock when the
    holder dies, so a SIGKILLed holder leaves no stale lock.

    Beyond ``acquire``/``release``: :meth:`describe` writes a description of the holder into the
    file while it is held (``release`` empties it), and :meth:`check` says whether the file at the
    path is still the one locked. Something other than a regular file at the path (a directory,
    symlink, FIFO) is refused with :class:`NotRegularFileError`, never opened as the lock.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd: int | None = None
        self._pid = os.getpid()
        self._description = b""

    def acquire(self) -> bool:
        if self._fd is not None:
            return False
        fd = self._open()
        if not _flock(fd):
            return False
        self._fd, self._pid = fd, os.getpid()
        _HELD_LOCKS.add(self)
        self._write_description()
        return True

    def describe(self, data: bytes) -> None:
        """Record ``data`` in the lock file (informative only: failures are ignored)."""
        self._description = data
        self._write_description()

    def check(self) -> str | None:
        """None while this process holds the lock through the file at :attr:`path`, else why
        not. A lock file that is simply gone is recreated (create-only) and locked again: nobody
        else can have locked it meanwhile, or the file would exist. OSError when the file cannot
        be checked; NotRegularFileError when something other than a regular file is there now."""
        fd = self._fd
        if fd is None:
            return f"its lock file {self.path} is not held"
        mine = os.fstat(fd)
        try:
            there = os.lstat(self.path)
        except FileNotFoundError:
            try:
                new = self._open(exclusive=True)
            except FileExistsError:
                return f"its lock file {self.path} was deleted and created again by another"
            if not _flock(new):
                return f"its lock file {self.path} was deleted and taken by another writer"
            self._fd = new
            with contextlib.suppress(OSError):
                os.close(fd)  # the deleted inode's lock: nobody else can reach it
            self._write_description()
            return None
        if identity(there) == identity(mine):
            return None
        if not stat.S_ISREG(there.st_mode):
            raise NotRegularFileError(self.path, self.path)
        return f"its lock file {self.path} was deleted or replaced while it held the lock"

    def release(self) -> None:
        """Drop the lock by closing the descriptor (see the class docstring for why not LOCK_UN);
        idempotent."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        _HELD_LOCKS.discard(self)
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

    def _open(self, *, exclusive: bool = False) -> int:
        # No O_TRUNC: the file may describe the current holder, which a refused one must read.
        # O_NOFOLLOW: a symlink is refused, never followed; O_NONBLOCK: a FIFO never blocks.
        flags = (
            os.O_RDWR
            | os.O_CREAT
            | os.O_CLOEXEC
            | getattr(os, "O_NOFOLLOW", 0)
            | getattr(os, "O_NONBLOCK", 0)
        )
        try:
            fd = os.open(self.path, flags | (os.O_EXCL if exclusive else 0), 0o644)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO, errno.ENOTDIR):
                raise NotRegularFileError(self.path, self.path) from None
            raise
        return regular(fd, self.path, lambda: self.path)

    def _write_description(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(OSError):  # informative only (a full disk, say)
            os.ftruncate(self._fd, 0)
            if self._description:
                os.pwrite(self._fd, self._description, 0)


def _flock(fd: int) -> bool:
    """Take an exclusive flock on ``fd`` without blocking; False (``fd`` closed) if another
    holds it. Other failures close ``fd`` and raise."""
    import fcntl

    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


_HELD_LOCKS: weakref.WeakSet[LocalLock] = weakref.WeakSet()


def _forget_locks_in_child() -> None:
    for held in list(_HELD_LOCKS):
        held._forget()
    _HELD_LOCKS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_locks_in_child)
