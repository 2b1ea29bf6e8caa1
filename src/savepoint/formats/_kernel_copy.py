"""Writing a safetensors file whose tensors already lie raw in other open files: the kernel
copies the bytes, the process only checks them.

A Hugging Face export of a local savepoint checkpoint (or a single-file export of one) writes
tensors whose bytes are stored raw and contiguous in the source's data files. Streaming them
through staging buffers costs two copies and the buffers' first touch; here instead:

1. the new file is created (``O_EXCL``) and the header written at offset 0;
2. each run of tensors lying back to back in one source file (the usual case: a native data
   file holds a layer's tensors in order) is copied with one ``os.copy_file_range`` (in the
   kernel, page cache to page cache, as ``cp`` does; ``os.sendfile`` where the filesystem
   refuses it), short copies resumed; a source that ends early is a CorruptCheckpointError;
3. the new file is mapped read-only and every tensor is hashed there against its source's
   checksum (:meth:`~savepoint.formats._files.MappedTensor.check`): what is checked is what was
   written, not the source read a second time;
4. the file is fsynced and closed. The caller commits the directory (one rename).

Extra memory: none of the process's own (the bytes are page cache, shared with the source and
the written file), against twice the largest tensor through staging buffers.

Used only when every source of the file has a ``file`` (``(fd, offset)``, see
``MappedTensor``) and its bytes are in the page cache (:func:`cached`); :func:`write` returns False without writing anything when one has not, or
when neither system call copies between these files (another filesystem, an old kernel), and
the caller streams the file through the write pipeline instead. Any other failure removes the
file and raises (the caller's ``atomic_directory`` turns an OSError into CheckpointWriteError).
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import queue
import threading
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from savepoint.errors import CorruptCheckpointError
from savepoint.state.arrays import TensorSource
from savepoint.storage import finishing as finishing_pool

__all__ = ["aligned_header", "runs", "write"]

# What copy_file_range answers where it cannot copy between these two files (then sendfile),
# and sendfile where it cannot either (then the caller's pipeline).
_REFUSED = frozenset(
    getattr(errno, name)
    for name in ("EXDEV", "ENOSYS", "EINVAL", "EOPNOTSUPP", "ENOTSUP", "EPERM", "ETXTBSY")
    if hasattr(errno, name)
)
# Bytes per system call: the checks of a piece's tensors start while the next piece is copied.
_PIECE = 64 << 20
_PAGE = 4096


class _Refused(Exception):
    """Neither system call copies between these files."""


def runs(sources: Sequence[TensorSource]) -> list[tuple[int, int, int]] | None:
    """The ``(fd, offset, length)`` runs that hold ``sources`` back to back, in order, or None
    when one of them lies in no open file (or has no ``check``)."""
    out: list[tuple[int, int, int]] = []
    for source in sources:
        where = getattr(source, "file", None)
        if where is None or not callable(getattr(source, "check", None)):
            return None
        fd, offset = where
        n = source.nbytes
        if out and out[-1][0] == fd and out[-1][1] + out[-1][2] == offset:
            out[-1] = (fd, out[-1][1], out[-1][2] + n)
        elif n:
            out.append((fd, offset, n))
    return out


SAMPLES = 64  # pages probed per run of tensors by :func:`cached`
_PAGE = 4096


def cached(ranges: Sequence[tuple[int, int, int]]) -> bool:
    """Whether the bytes of ``ranges`` are in the page cache, probed at up to :data:`SAMPLES`
    pages a run with reads that may not wait for the disk (``RWF_NOWAIT``: a page not cached
    reads short or fails with EAGAIN). The kernel's copy is the faster path only then: from a
    cold source ``copy_file_range`` reads one stream synchronously (a 4 GiB export of an
    evicted checkpoint took 2x a raw copy's time, where the write pipeline's parallel direct
    reads took 1.0x; warm, the kernel's copy took 0.73x). Where the probe is not available
    (no ``RWF_NOWAIT``, a filesystem that refuses it) the source counts as cached."""
    flag = getattr(os, "RWF_NOWAIT", None)
    if flag is None or not hasattr(os, "preadv"):
        return True
    buf = bytearray(1)
    for fd, offset, length in ranges:
        step = max(length // SAMPLES, _PAGE)
        for at in range(offset, offset + length, step):
            try:
                if os.preadv(fd, [buf], at, flag) < 1:
                    return False
            except BlockingIOError:
                return False
            except OSError as exc:
                if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                    return True
                raise
    return True


def write(
    path: str,
    header: bytes,
    sources: Sequence[TensorSource],
    finishing: list[Callable[[], None]] | None = None,
    *,
    align: bool = False,
) -> bool:
    """Write ``header`` then ``sources``' bytes as the new file ``path``, checked and fsynced;
    False (nothing written) where the kernel cannot copy them (module docstring).

    Each tensor is hashed on another thread as soon as its last byte is copied, while the
    kernel copies the next ones. ``finishing``: the fsync runs on the finishing pool and the
    function that waits for it (and raises its error) is appended; the caller calls it before
    it commits anything naming the file (a Hugging Face export fsyncs one shard while it copies
    the next). ``align``: pad the header (:func:`aligned_header`), for a file whose bytes no one
    compares with another writer's (a conversion keeps them byte for byte)."""
    ranges = runs(sources)
    if ranges is None or not cached(ranges):
        return False
    if align:
        header = aligned_header(header, ranges)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        _write_all(fd, header)
        size = len(header) + sum(s.nbytes for s in sources)
        os.ftruncate(fd, size)  # so that the whole file can be mapped for the checks now
        checks = _Checks(fd, size, len(header), sources)
        try:
            position = len(header)
            for src, offset, length in ranges:
                for done in _copy(src, offset, fd, position, length, path):
                    checks.copied(position + done)
                position += length
        finally:
            checks.close()
    except _Refused:
        os.close(fd)
        os.unlink(path)
        return False
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise
    if finishing is None:
        _sync_close(fd)
    else:
        finishing.append(finishing_pool.later(lambda: _sync_close(fd)))
    return True


def aligned_header(header: bytes, ranges: Sequence[tuple[int, int, int]]) -> bytes:
    """``header`` (length prefix, JSON, spaces) padded with more spaces (up to 4 KiB, as the
    format allows) so that the largest run lands at the same offset within a page as in its
    source: the kernel copies whole pages then, and a misaligned copy measured 1.5x slower
    (copy and fsync) on the development machine. Unchanged where that would break the 8-byte
    alignment of the data."""
    if not ranges:
        return header
    rel = 0
    best = (0, 0, 0)  # length, source offset, offset within the data
    for _, offset, length in ranges:
        best = max(best, (length, offset, rel))
        rel += length
    _, offset, rel = best
    extra = (offset - rel - len(header)) % _PAGE
    if extra % 8:
        return header
    n = len(header) - 8 + extra
    return n.to_bytes(8, "little") + header[8:] + b" " * extra


def _sync_close(fd: int) -> None:
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _Checks:
    """The written file mapped read-only, and a thread that hashes each tensor there once
    :meth:`copied` says its bytes are in (in order)."""

    def __init__(self, fd: int, size: int, start: int, sources: Sequence[TensorSource]) -> None:
        self._ends: list[tuple[int, TensorSource]] = []
        pos = start
        for source in sources:
            pos += source.nbytes
            self._ends.append((pos, source))
        self._next = 0
        self._jobs: queue.SimpleQueue[tuple[int, TensorSource] | None] = queue.SimpleQueue()
        self._map = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="savepoint-check", daemon=True)
        self._thread.start()
        self.copied(start)  # the empty tensors at the front

    def copied(self, upto: int) -> None:
        while self._next < len(self._ends) and self._ends[self._next][0] <= upto:
            self._jobs.put(self._ends[self._next])
            self._next += 1

    def _run(self) -> None:
        written = np.frombuffer(self._map, dtype=np.uint8)
        try:
            while (job := self._jobs.get()) is not None:
                end, source = job
                if self._error is None:
                    try:
                        source.check(written[end - source.nbytes : end])  # type: ignore[attr-defined]
                    except BaseException as exc:  # raised by close(), once the copies stop
                        # Without its traceback, whose frames hold views of the mapping.
                        self._error = exc.with_traceback(None)
        finally:
            del written  # the mapping's last view, so that close() can unmap it

    def close(self) -> None:
        """Wait for the checks of everything copied; raise the first failure."""
        self._jobs.put(None)
        self._thread.join()
        with contextlib.suppress(BufferError):  # a view still alive: unmapped when it goes
            self._map.close()
        if self._error is not None:
            raise self._error


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _copy(src: int, offset: int, dst: int, position: int, length: int, path: str) -> Iterator[int]:
    """Copy ``length`` bytes; yield how many of them are in after each piece."""
    use_sendfile = False
    done = 0
    while done < length:
        n = min(length - done, _PIECE)
        try:
            if use_sendfile:
                os.lseek(dst, position + done, os.SEEK_SET)
                got = os.sendfile(dst, src, offset + done, n)
            else:
                got = os.copy_file_range(src, dst, n, offset + done, position + done)
        except OSError as exc:
            if exc.errno not in _REFUSED:
                raise
            if use_sendfile:
                raise _Refused from None
            use_sendfile = True
            continue
        if got <= 0:
            raise CorruptCheckpointError(
                f"a source file ended while {path} was written from it (was it changed meanwhile?)",
                path=path,
            )
        done += got
        yield done
