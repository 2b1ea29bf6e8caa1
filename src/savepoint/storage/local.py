"""Local files: the per-file primitives of the local store, and a hostile-safe reader.

Writing. A data file is opened by :func:`_open_for_write` with ``O_DIRECT`` where the filesystem
accepts it: on the development machine an O_DIRECT write of 1 GiB from aligned buffers plus fsync
takes 0.30-0.38 s against 0.45-0.51 s buffered, and it does not fill the page cache with dirty
pages (buffered writes slow down about 5x past the dirty threshold). When O_DIRECT is refused
(tmpfs, some network filesystems, EINVAL on a write: :func:`write_all`), the file is written
buffered. The tail of a file is padded to the 4 KiB block for the last direct write and then
truncated to its real length (:class:`LocalBlobWriter`). Every file is fsynced before it counts.
The pipeline that fills aligned buffers and overlaps copying with these writes is the engine's
(:mod:`savepoint.engine.pipeline`).

Reading. Every file savepoint reads is opened by :func:`open_read`: ``O_NOFOLLOW`` (a data file
may not be a symlink) and ``O_NONBLOCK`` (a FIFO is refused at once instead of blocking until a
writer appears), and only a regular file is accepted. Its refusals and failures are CheckpointError
subclasses (a symlink or a FIFO: CorruptCheckpointError; EACCES/EPERM: CheckpointPermissionError
with the path and errno), so a parser may let them escape; only FileNotFoundError is left for the
caller to word. A small document (a manifest, a JSON file) is read whole by :func:`read_small`,
its size checked against a cap first. Data files' sizes are checked against the manifest before
anything is mapped, and data is read through a read-only ``mmap``: a warm 1 GiB copy out of the
page cache took 0.067 s against 0.16 s for ``preadv``.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import stat
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from savepoint import errors_map
from savepoint.errors import CheckpointError, CheckpointPermissionError, CorruptCheckpointError
from savepoint.storage.base import Capabilities, HardLinks, Kind, Locks, Renames, Stat, Store

__all__ = [
    "LocalBlobReader",
    "LocalBlobWriter",
    "LocalLock",
    "LocalPinned",
    "LocalStore",
    "MappedFile",
    "STORE",
    "fsync_dir",
    "open_dir",
    "open_read",
    "permission_error",
    "read_exact",
    "read_small",
    "write_all",
    "write_small",
]

BLOCK = 4096
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_BINARY = getattr(os, "O_BINARY", 0)


def write_all(fd: int, view: memoryview, direct: bool) -> bool:
    """Write all of ``view``; returns whether the descriptor is still in O_DIRECT mode.

    A filesystem may accept O_DIRECT at open and refuse a write (EINVAL): the descriptor then
    switches to buffered writes and the write is retried."""
    while len(view):
        try:
            n = os.write(fd, view)
        except OSError as exc:
            if not (direct and exc.errno == errno.EINVAL):
                raise
            import fcntl

            flags = fcntl.fcntl(fd, fcntl.F_GETFL)
            fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~_O_DIRECT)
            direct = False
            continue
        if n == 0:
            raise OSError(errno.EIO, "write returned 0 bytes")
        view = view[n:]
    return direct


def _open_for_write(path: str, direct: bool) -> tuple[int, bool]:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_BINARY
    if direct and _O_DIRECT:
        try:
            return os.open(path, flags | _O_DIRECT, 0o644), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
    return os.open(path, flags, 0o644), False


def write_small(path: str, data: bytes) -> None:
    """Write a small file (a manifest) and fsync it. The file must not exist."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_BINARY, 0o644)
    try:
        view = memoryview(data)
        while len(view):
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError as exc:  # pragma: no cover - some filesystems refuse directory fsync
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


from savepoint.errors import NotRegularFileError, SymlinkError  # noqa: E402


def permission_error(exc: OSError, shown: str) -> CheckpointPermissionError:
    """The CheckpointPermissionError for an EACCES/EPERM met while reading ``shown``."""
    return errors_map.permission_error(exc, shown, scheme="file")


def _shown(path: str, dir_fd: int | None, shown: str | None) -> str:
    if shown is not None:
        return shown
    if dir_fd is None or os.path.isabs(path):
        return path
    with contextlib.suppress(OSError):  # Linux names a descriptor's directory; others do not
        return os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path)
    return path


def open_read(path: str, dir_fd: int | None = None, *, shown: str | None = None) -> int:
    """Open a regular file for reading; the one way savepoint opens a file it reads.

    ``path`` is relative to ``dir_fd`` if given; ``shown`` is how messages name the file (by
    default ``path``, joined to the directory of ``dir_fd`` where the platform says which).

    Never blocks (``O_NONBLOCK``: a FIFO is refused, not waited on) and never follows a symlink
    in the last component. Errors: FileNotFoundError (a missing file, or a path through a
    non-directory) for the caller to word; :class:`SymlinkError` and :class:`NotRegularFileError`
    (both CorruptCheckpointError); CheckpointPermissionError for EACCES/EPERM; CheckpointError
    for any other failure to open. No other exception escapes.
    """
    flags = os.O_RDONLY | _O_NOFOLLOW | _O_BINARY | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags, dir_fd=dir_fd)
    except FileNotFoundError:
        raise
    except OSError as exc:
        where = _shown(path, dir_fd, shown)
        if exc.errno == errno.ELOOP:
            raise SymlinkError(path, where) from None
        if exc.errno in (errno.EACCES, errno.EPERM):
            raise permission_error(exc, where) from None
        if exc.errno == errno.ENOTDIR:
            raise FileNotFoundError(exc.errno, exc.strerror, path) from None
        if exc.errno in (errno.ENXIO, errno.ENODEV, errno.EISDIR):  # a socket, a device
            raise NotRegularFileError(path, where) from None
        raise CheckpointError(f"cannot open {where}: {exc.strerror or exc}", path=where) from exc
    return _regular(fd, path, lambda: _shown(path, dir_fd, shown))


def _regular(fd: int, path: str, shown: Callable[[], str]) -> int:
    """``fd`` if it is a regular file; else it is closed and NotRegularFileError raised naming
    ``shown()`` (only worked out then: it may cost a readlink)."""
    try:
        regular = stat.S_ISREG(os.fstat(fd).st_mode)
    except BaseException:
        os.close(fd)
        raise
    if not regular:
        os.close(fd)
        raise NotRegularFileError(path, shown())
    return fd


def open_dir(path: str) -> int | None:
    """A descriptor for a directory, so later opens resolve inside this very directory even if
    it is renamed or replaced meanwhile; None where the platform has no directory descriptors.

    FileNotFoundError and NotADirectoryError pass through for the caller to word; EACCES/EPERM
    become CheckpointPermissionError, any other failure CheckpointError."""
    if os.open not in os.supports_dir_fd:  # pragma: no cover - Windows
        return None
    try:
        return os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except (FileNotFoundError, NotADirectoryError):
        raise
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EPERM):
            raise permission_error(exc, path) from None
        raise CheckpointError(f"cannot open {path}: {exc.strerror or exc}", path=path) from exc


def read_exact(fd: int, offset: int, length: int) -> bytes:
    data = os.pread(fd, length, offset)
    if len(data) != length:
        raise EOFError(f"wanted {length} bytes at {offset}, file ended after {len(data)}")
    return data


_PIECE = 1 << 30  # Linux reads at most 2 GiB - 4 KiB per call


def _amount(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20)):
        if n >= 1 << shift and not n % (1 << shift):
            return f"{n >> shift} {unit}"
    return f"{n}-byte"


def read_small(
    path: str, dir_fd: int | None = None, *, cap: int | None, shown: str | None = None
) -> bytes:
    """The whole content of the regular file at ``path``, opened by :func:`open_read` (same
    ``path``, ``dir_fd`` and ``shown``) and read in one piece.

    Errors: those of :func:`open_read` (FileNotFoundError is left to the caller);
    CorruptCheckpointError when the file is larger than ``cap`` bytes (checked before anything is
    read), shrinks while being read, or a read fails. No other exception escapes."""
    fd = open_read(path, dir_fd, shown=shown)
    where = shown if shown is not None else path
    try:
        size = os.fstat(fd).st_size
        if cap is not None and size > cap:
            raise CorruptCheckpointError(
                f"{where} is {size} bytes, over the {_amount(cap)} cap", path=where
            )
        parts = [read_exact(fd, pos, min(_PIECE, size - pos)) for pos in range(0, size, _PIECE)]
    except EOFError:
        raise CorruptCheckpointError(f"{where} shrank while being read", path=where) from None
    except OSError as exc:
        raise CorruptCheckpointError(
            f"{where} cannot be read: {exc.strerror or exc}", path=where
        ) from None
    finally:
        os.close(fd)
    return parts[0] if len(parts) == 1 else b"".join(parts)


class MappedFile:
    """A read-only (or copy-on-write) mapping of a whole data file whose size is already checked."""

    def __init__(self, fd: int, size: int, *, copy_on_write: bool = False) -> None:
        access = mmap.ACCESS_COPY if copy_on_write else mmap.ACCESS_READ
        self.map = mmap.mmap(fd, size, access=access)
        with contextlib.suppress(AttributeError, OSError):
            self.map.madvise(mmap.MADV_WILLNEED)
        self.array = np.frombuffer(self.map, dtype=np.uint8)

    def slice(self, start: int, end: int) -> np.ndarray[Any, Any]:
        return self.array[start:end]

    def close(self) -> None:
        # Arrays returned from a copy-on-write mapping keep it alive; the map closes with them.
        del self.array
        with contextlib.suppress(BufferError):
            self.map.close()


# ---------------------------------------------------------------------------------------------
# The local filesystem as a Store (see savepoint.storage.base)
# ---------------------------------------------------------------------------------------------


class LocalBlobReader:
    """An open local file: ``pread`` reads and a lazy ``mmap`` for zero-copy views."""

    def __init__(self, fd: int, name: str, *, copy_on_write: bool = False) -> None:
        self.name = name
        self._fd: int | None = fd
        self._copy_on_write = copy_on_write
        self._map: MappedFile | None = None
        try:
            self.size = os.fstat(fd).st_size
        except BaseException:
            os.close(fd)
            raise

    def _descriptor(self) -> int:
        if self._fd is None:
            raise ValueError(f"{self.name} is closed")
        return self._fd

    def read(self, offset: int, out: Any) -> None:
        view = memoryview(out).cast("B")
        fd = self._descriptor()
        if offset < 0:
            raise ValueError(f"negative offset {offset} into {self.name}")
        if offset + len(view) > self.size:
            raise EOFError(
                f"wanted {len(view)} bytes at {offset} of {self.name}, it has {self.size}"
            )
        while len(view):
            n = os.preadv(fd, [view[:_PIECE]], offset)
            if n == 0:
                raise EOFError(f"{self.name} ended at {offset}")
            view, offset = view[n:], offset + n

    def view(self, start: int, end: int) -> np.ndarray[Any, Any] | None:
        if not 0 <= start <= end <= self.size:
            raise EOFError(f"wanted bytes [{start}, {end}) of {self.name}, it has {self.size}")
        fd = self._descriptor()
        if self.size == 0:  # mmap cannot map an empty file
            return np.empty(0, dtype=np.uint8)
        if self._map is None:
            self._map = MappedFile(fd, self.size, copy_on_write=self._copy_on_write)
        return self._map.slice(start, end)

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class LocalBlobWriter:
    """A new local file, written with O_DIRECT where the filesystem takes it (see the top)."""

    def __init__(self, path: str, size: int | None, direct: bool) -> None:
        self.path = path
        self._size = size
        self._fd: int | None
        self._fd, self._direct = _open_for_write(path, direct)
        self.alignment = BLOCK if self._direct else 1
        self._written = 0
        self._state = "open"  # "open", "finished", "aborted"

    def _open_fd(self, what: str) -> int:
        if self._fd is None:
            raise ValueError(f"{what} after the writer of {self.path} was {self._state}")
        return self._fd

    def write(self, data: memoryview) -> None:
        self._direct = write_all(self._open_fd("write"), data, self._direct)
        self._written += len(data)

    def finish(self) -> None:
        fd = self._open_fd("finish")
        if self._size is not None and self._written < self._size:
            raise ValueError(
                f"{self.path}: {self._written} bytes written of the {self._size} announced"
            )
        try:
            if self._size is not None and self._written != self._size:
                os.ftruncate(fd, self._size)  # cut an aligned tail's padding
            os.fsync(fd)
        finally:
            self._fd = None
            self._state = "finished"
            os.close(fd)

    def abort(self) -> None:
        if self._state == "aborted":
            return
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
        self._state = "aborted"
        with contextlib.suppress(OSError):
            os.unlink(self.path)


class LocalPinned:
    """A directory pinned by its descriptor (see savepoint.storage.base.Pinned)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = open_dir(path)

    def __enter__(self) -> LocalPinned:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _where(self, name: str) -> tuple[str, int | None]:
        return (name if self._fd is not None else os.path.join(self.path, name)), self._fd

    def open_blob(self, name: str, *, copy_on_write: bool = False) -> LocalBlobReader:
        where, fd = self._where(name)
        shown = os.path.join(self.path, name)
        return LocalBlobReader(
            open_read(where, fd, shown=shown), shown, copy_on_write=copy_on_write
        )

    def read_small(self, name: str, *, cap: int | None) -> bytes:
        where, fd = self._where(name)
        return read_small(where, fd, cap=cap, shown=os.path.join(self.path, name))

    def identity(self) -> Any:
        if self._fd is None:
            try:
                return _identity(os.stat(self.path))
            except FileNotFoundError:
                return None
        st = os.fstat(self._fd)
        return None if st.st_nlink == 0 else _identity(st)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _special(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "FIFO"
    if stat.S_ISSOCK(mode):
        return "socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "device"
    return ""


def _identity(st: os.stat_result) -> tuple[int, int]:
    return (st.st_dev, st.st_ino)


# renameat2(2) (Linux 3.15+, glibc 2.28+): RENAME_NOREPLACE makes ``rename`` refuse an existing
# destination in the same atomic step, RENAME_EXCHANGE swaps two paths. Looked up at first use.
_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2
_UNSUPPORTED = frozenset(
    getattr(errno, name)
    for name in ("ENOSYS", "EINVAL", "ENOTSUP", "EOPNOTSUPP")
    if hasattr(errno, name)
)
_libc_renameat2: list[Callable[..., int] | None] = []


def _renameat2() -> Callable[..., int] | None:
    if not _libc_renameat2:
        import ctypes
        import ctypes.util

        function: Callable[..., int] | None = None
        with contextlib.suppress(OSError, AttributeError):  # other C libraries: fall back
            function = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True).renameat2
            function.argtypes = [
                ctypes.c_int,
                ctypes.c_char_p,
                ctypes.c_int,
                ctypes.c_char_p,
                ctypes.c_uint,
            ]
            function.restype = ctypes.c_int
        _libc_renameat2.append(function)
    return _libc_renameat2[0]


def _rename2(src: str, dst: str, flags: int) -> bool:
    """renameat2 with ``flags``: True when done, False where this platform or filesystem lacks
    it (nothing changed); any other failure raises OSError naming the paths."""
    function = _renameat2()
    if function is None:
        return False
    import ctypes

    if function(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in _UNSUPPORTED and not (err == errno.EINVAL and _into_itself(src, dst)):
        return False
    raise OSError(err, os.strerror(err), src, None, dst)


def _into_itself(src: str, dst: str) -> bool:
    a, b = os.path.abspath(src), os.path.abspath(dst)
    return a != b and (b + os.sep).startswith(a.rstrip(os.sep) + os.sep)


# A temporary of this store (an atomic put) is named like the commit layer's temporaries,
# ``.<name>.savepoint-tmp-<host>-<pid>-<random>``, so its sweep of dead processes' leftovers
# (savepoint.commit) removes one a crash left behind.
_TMP_TAG = ".savepoint-tmp-"

# What os.link raises where a filesystem has no hard links: a create-only put then writes in place.
_NO_LINKS = frozenset(
    getattr(errno, name)
    for name in ("EPERM", "EXDEV", "EMLINK", "ENOTSUP", "EOPNOTSUPP", "ENOSYS")
    if hasattr(errno, name)
)


def _temporary(path: str) -> str:
    import socket

    host = "".join(c if c.isalnum() else "_" for c in socket.gethostname())[:32] or "host"
    parent, name = os.path.split(os.path.abspath(path))
    return os.path.join(parent, f".{name}{_TMP_TAG}{host}-{os.getpid()}-{os.urandom(4).hex()}")


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
        if _identity(there) == _identity(mine):
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
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | _O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0)
        try:
            fd = os.open(self.path, flags | (os.O_EXCL if exclusive else 0), 0o644)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO, errno.ENOTDIR):
                raise NotRegularFileError(self.path, self.path) from None
            raise
        return _regular(fd, self.path, lambda: self.path)

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


class LocalStore(Renames, HardLinks, Locks, Store):
    """The local filesystem: O_DIRECT writes, mmap reads, directory descriptors, renameat2."""

    scheme = "file"
    capabilities = Capabilities(
        atomic_rename=True,
        create_only_put=True,
        direct_io=bool(_O_DIRECT),
        hard_links=True,
        zero_copy=True,
        durable=True,
        locks=True,
    )

    def abspath(self, path: str) -> str:
        return os.path.abspath(path)

    def realpath(self, path: str) -> str:
        return os.path.realpath(path)

    def url(self, path: str) -> str:
        return path

    def join(self, path: str, *names: str) -> str:  # type: ignore[override]
        return os.path.join(path, *names)

    def parent(self, path: str) -> str:  # type: ignore[override]
        return os.path.dirname(os.path.abspath(path))

    def basename(self, path: str) -> str:  # type: ignore[override]
        return os.path.basename(os.path.abspath(path))

    def open_blob(self, path: str, *, copy_on_write: bool = False) -> LocalBlobReader:
        return LocalBlobReader(open_read(path), path, copy_on_write=copy_on_write)

    def create_blob(
        self, path: str, *, size: int | None = None, direct: bool = True
    ) -> LocalBlobWriter:
        return LocalBlobWriter(path, size, direct)

    def read_small(self, path: str, *, cap: int | None) -> bytes:
        return read_small(path, cap=cap)

    def put(self, path: str, data: bytes, *, exclusive: bool = True) -> None:
        """Write ``data`` under a temporary name, fsync, then publish it whole: ``link`` for a
        create-only put (EEXIST if ``path`` exists, atomically), ``replace`` otherwise (then
        the parent is synced too). The temporary is removed whatever happens."""
        tmp = _temporary(path)
        try:
            write_small(tmp, data)
            if not exclusive:
                os.replace(tmp, path)
                fsync_dir(os.path.dirname(os.path.abspath(path)))
                return
            try:
                os.link(tmp, path, follow_symlinks=False)
            except OSError as exc:
                if exc.errno not in _NO_LINKS:
                    raise
                self._put_in_place(path, data)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    @staticmethod
    def _put_in_place(path: str, data: bytes) -> None:
        """A create-only put where hard links are missing: O_EXCL, removed again on failure."""
        try:
            write_small(path, data)
        except FileExistsError:
            raise
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise

    def remove(self, path: str) -> None:
        os.unlink(path)

    def stat(self, path: str) -> Stat | None:
        try:
            st = os.lstat(path)
        except (FileNotFoundError, NotADirectoryError):
            return None
        mode = st.st_mode
        kind: Kind = (
            "dir"
            if stat.S_ISDIR(mode)
            else "file"
            if stat.S_ISREG(mode)
            else "link"
            if stat.S_ISLNK(mode)
            else "other"
        )
        return Stat(kind, st.st_size, _identity(st), st.st_mtime, _special(mode))

    def list(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(path))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def makedirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def mkdir(self, path: str) -> None:
        os.mkdir(path)

    def remove_tree(self, path: str) -> None:
        try:
            st = os.lstat(path)
        except (FileNotFoundError, NotADirectoryError):
            return
        if stat.S_ISDIR(st.st_mode):
            import shutil

            with contextlib.suppress(FileNotFoundError):  # a racing remover finishes the job
                shutil.rmtree(path)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # a symlink (never its target), or a file

    def sync_dir(self, path: str) -> None:
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        except (FileNotFoundError, NotADirectoryError):
            raise
        except OSError:  # pragma: no cover - platforms without directory descriptors
            return
        try:
            os.fsync(fd)
        except OSError as exc:  # some filesystems refuse a directory fsync: nothing to do
            if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
                raise
        finally:
            os.close(fd)

    def pin(self, path: str) -> LocalPinned:
        return LocalPinned(path)

    def rename(self, src: str, dst: str) -> None:
        if _rename2(src, dst, _RENAME_NOREPLACE):
            return
        # Without renameat2 the check and the rename are two steps (a racing creator can slip
        # in between: the commit layer never races itself on one path).
        if os.path.lexists(dst):
            raise FileExistsError(errno.EEXIST, "File exists", dst)
        if _into_itself(src, dst):
            raise OSError(errno.EINVAL, "Invalid argument (a directory into itself)", dst)
        os.rename(src, dst)

    def replace(self, src: str, dst: str) -> None:
        os.replace(src, dst)

    def exchange(self, a: str, b: str) -> bool:
        if not (os.path.lexists(a) and os.path.lexists(b)):
            raise FileNotFoundError(
                errno.ENOENT, "No such file or directory", b if os.path.lexists(a) else a
            )
        return _rename2(a, b, _RENAME_EXCHANGE)

    def link(self, src: str, dst: str) -> None:
        os.link(src, dst, follow_symlinks=False)

    def lock(self, path: str) -> LocalLock:
        """A :class:`LocalLock` on the lock file ``path`` (not taken yet: call ``acquire``)."""
        return LocalLock(path)


STORE = LocalStore()
