"""The hostile-safe local reader of :mod:`savepoint.storage.local` (implementation, not public
API: import its names from there): every file savepoint reads from a local disk is opened by
:func:`open_read` (``O_NOFOLLOW``, ``O_NONBLOCK``, regular files only), small documents are read
whole against a cap (:func:`read_small`), data through a read-only ``mmap`` (:class:`MappedFile`,
:class:`LocalBlobReader`), and a checkpoint directory is pinned by a descriptor
(:class:`LocalPinned`). See :mod:`savepoint.storage.local`'s docstring, "Reading"."""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import stat
from collections.abc import Callable
from typing import Any

import numpy as np

from savepoint import errors_map
from savepoint.errors import CheckpointError, CheckpointPermissionError, CorruptCheckpointError

__all__ = [
    "LocalBlobReader",
    "LocalPinned",
    "MappedFile",
    "identity",
    "open_dir",
    "open_read",
    "permission_error",
    "read_exact",
    "read_small",
    "regular",
    "special",
]

_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_BINARY = getattr(os, "O_BINARY", 0)

from savepoint.errors import NotRegularFileError, SymlinkError  # noqa: E402  (after the errors above)


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
    return regular(fd, path, lambda: _shown(path, dir_fd, shown))


def regular(fd: int, path: str, shown: Callable[[], str]) -> int:
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

    def fileno(self) -> int:
        """The open descriptor (owned by this reader: valid until :meth:`close`), for copies the
        kernel makes (``copy_file_range``) without the bytes passing through the process."""
        return self._descriptor()

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
                return identity(os.stat(self.path))
            except FileNotFoundError:
                return None
        st = os.fstat(self._fd)
        return None if st.st_nlink == 0 else identity(st)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def special(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "FIFO"
    if stat.S_ISSOCK(mode):
        return "socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "device"
    return ""


def identity(st: os.stat_result) -> tuple[int, int]:
    return (st.st_dev, st.st_ino)
