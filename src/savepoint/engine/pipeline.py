"""The write pipeline: one data file streamed into a store, copy and hash overlapping the I/O.

Bytes flow source -> page-aligned staging buffer -> ``BlobWriter.write``. The caller's thread
copies and hashes one buffer while a writer thread hands the previous one to the store, so
copying, checksumming and I/O overlap. Every ``write`` but the last is a whole buffer (a multiple
of 4 KiB, so of any store's ``alignment``); the last is padded with zeros up to the writer's
``alignment``, which ``finish`` cuts off again (on local disks that is what lets O_DIRECT write
the tail). ``finish`` makes the blob durable before it counts.

Staging buffers are allocated once per process (``mmap``: page-aligned, touched at allocation,
since first-touch page faults cost more than the copy itself on the development machine) and
reused by later saves; concurrent writers each take their own set.

Small tensors (up to :data:`SMALL`, the many-expert states of 100,000 and more) are copied
whole, from their host address where the source has one (``pointer()``, one ``memmove``), and
hashed in one call each: per tensor the loop costs about a microsecond, not a view and a hasher.

:func:`write_image` writes an already laid-out file image (the async staging arena) straight from
its memory, with no copy.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import queue
import threading
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import xxhash

from savepoint.codecs import checksum
from savepoint.state.arrays import TensorSource
from savepoint.storage import finishing as finishing_pool
from savepoint.storage.base import BlobWriter, Store

__all__ = ["BLOCK", "POOL", "SMALL", "StagingPool", "write_blob", "write_file", "write_image"]

_memmove = ctypes.memmove
_digest = checksum.digest
_intdigest = xxhash.xxh3_64_intdigest

BLOCK = 4096
# Tensors up to this size take the small-tensor path of the copy loop (never block-hashed: see
# savepoint.codecs.checksum.block_size).
SMALL = 2 * checksum.MIN_BLOCK
DEFAULT_BUFFER_BYTES = 32 << 20
DEFAULT_BUFFER_COUNT = 2
IMAGE_CHUNK = 64 << 20  # bytes per write when writing a file image
_SMALL_SET = 64 << 10  # the smallest buffer of a small save's set


class _Buffer:
    __slots__ = ("address", "array", "map", "view")

    def __init__(self, size: int) -> None:
        self.map = mmap.mmap(-1, size)
        self.array = np.frombuffer(self.map, dtype=np.uint8)
        self.array.fill(0)  # touch every page now, not during the first save
        self.address = int(self.array.ctypes.data)
        self.view = memoryview(self.map)


class StagingPool:
    """Reusable aligned buffers. Concurrent savers each get their own set.

    ``sized=False``: every acquire gets the one full-size set (no set per size class), so a
    caller that writes files of many sizes holds ``count x buffer_bytes`` at most."""

    def __init__(
        self,
        buffer_bytes: int = DEFAULT_BUFFER_BYTES,
        count: int = DEFAULT_BUFFER_COUNT,
        *,
        sized: bool = True,
    ):
        if buffer_bytes % BLOCK or buffer_bytes <= 0 or count < 2:
            raise ValueError("staging buffers must be positive multiples of 4096, at least 2")
        self.buffer_bytes = buffer_bytes
        self.count = count
        self.sized = sized
        self._free: list[list[_Buffer]] = []
        self._small: dict[int, list[list[_Buffer]]] = {}  # size class -> free sets
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def acquire(self, needed: int) -> Iterator[list[_Buffer]]:
        """A set of buffers. A small save gets a set sized for it (the power of two above its
        bytes, at least 64 KiB), kept for the next save of that size class: a training loop
        saving a 5 MB state every few seconds paid more for touching two fresh buffers at each
        save (37 ms for 19 MB) than for writing the file."""
        if self.sized and needed + BLOCK < self.buffer_bytes:
            size = min(max(_SMALL_SET, 1 << (needed + BLOCK - 1).bit_length()), self.buffer_bytes)
            with self._lock:
                free = self._small.get(size)
                buffers = free.pop() if free else None
            if buffers is None:
                buffers = [_Buffer(size) for _ in range(2)]
            try:
                yield buffers
            finally:
                with self._lock:
                    free = self._small.setdefault(size, [])
                    if not free:  # one set per size class: concurrent small saves are rare
                        free.append(buffers)
                    # Only the largest size classes in use are kept (a small multiple of the
                    # state): a state that shrank does not keep its old sets.
                    while len(self._small) > 2:
                        del self._small[min(self._small)]
            return
        with self._lock:
            buffers = self._free.pop() if self._free else None
        if buffers is None:
            buffers = [_Buffer(self.buffer_bytes) for _ in range(self.count)]
        try:
            yield buffers
        finally:
            with self._lock:
                if len(self._free) < 2:
                    self._free.append(buffers)

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self._small.clear()


POOL = StagingPool()

if hasattr(os, "register_at_fork"):
    # The pool's lock may be held by another thread at fork time; a child starts with a fresh pool.
    os.register_at_fork(after_in_child=lambda: globals().__setitem__("POOL", StagingPool()))


class _WriterThread:
    """Hands full buffers to ``BlobWriter.write`` from a background thread; the first error stops
    it and is re-raised by :meth:`finish`."""

    def __init__(self, blob: BlobWriter) -> None:
        self.blob = blob
        self.jobs: queue.Queue[tuple[_Buffer, int] | None] = queue.Queue()
        self.done: queue.Queue[_Buffer] = queue.Queue()
        self.error: BaseException | None = None
        # Started by the first full buffer: a file that fits in one buffer is written by the
        # caller (nothing to overlap, and a thread costs 0.1-3 ms to start and join).
        self.thread: threading.Thread | None = None

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            buf, length = job
            if self.error is None:
                try:
                    self.blob.write(memoryview(buf.map)[:length])
                except BaseException as exc:
                    self.error = exc
            self.done.put(buf)

    def submit(self, buf: _Buffer, length: int, *, last: bool = False) -> None:
        if self.thread is None:
            if last:
                self.blob.write(memoryview(buf.map)[:length])
                return
            self.thread = threading.Thread(target=self._run, name="savepoint-writer", daemon=True)
            self.thread.start()
        self.jobs.put((buf, length))

    def wait_buffer(self) -> _Buffer:
        return self.done.get()

    def finish(self) -> None:
        if self.thread is None:
            return
        self.jobs.put(None)
        self.thread.join()
        if self.error is not None:
            raise self.error


def write_blob(
    store: Store,
    path: str,
    header: bytes,
    sources: Sequence[TensorSource],
    *,
    pool: StagingPool | None = None,
    direct: bool = True,
    progress: Callable[[int], None] | None = None,
    blocked: bool = False,
) -> list[checksum.Digest]:
    """Write ``header`` then every source's bytes as the new blob ``path``, finish it (durable),
    and return each source's checksum (``blocked``: per block where the source is large enough,
    see :func:`savepoint.codecs.checksum.block_size`). ``progress(n)`` is told of tensor bytes as
    they are handed to the store. On any error the blob is aborted (nothing remains at ``path``)."""
    pool = pool or POOL
    total = len(header) + sum(s.nbytes for s in sources)
    blob = store.create_blob(path, size=total, direct=direct)
    try:
        with pool.acquire(total) as buffers:
            digests = _stream(blob, header, sources, buffers, progress, blocked)
        blob.finish()
    except BaseException:
        blob.abort()
        raise
    return digests


def write_file(
    store: Store,
    path: str,
    header: Iterable[bytes],
    header_size: int,
    sources: Iterable[TensorSource],
    size: int,
    *,
    pool: StagingPool | None = None,
    direct: bool = True,
    progress: Callable[[int], None] | None = None,
    finishing: list[Callable[[], None]] | None = None,
) -> array[int]:
    """:func:`write_blob` for a file of ``size`` bytes whose header comes in pieces (made while
    it is written) and whose sources may be a one-pass iterable (each can then be dropped once
    copied), returning the XXH3-64 of each source as an integer
    (no block checksums): a million tensors cost 8 MB here, against about 200 MB of digest
    objects and hex strings.

    ``finishing``: on a local disk, finish the blob (make it durable: an fsync) on the
    finishing pool and append to this list the function that waits for it (and raises its error, the
    blob then aborted). The caller must call it before it publishes anything naming the file;
    meanwhile it can write its manifest, whose own fsync then runs at the same time (one
    journal commit instead of two on ext4: a small save's cost is mostly its fsyncs)."""
    pool = pool or POOL
    blob = store.create_blob(path, size=size, direct=direct)
    digests = array("Q")
    try:
        with pool.acquire(size) as buffers:
            _stream(blob, header, sources, buffers, progress, False, digests, header_size)
        if finishing is None or not store.capabilities.direct_io:
            blob.finish()  # only local disks defer: elsewhere a finish is no fsync to overlap
        else:
            finishing.append(finishing_pool.finish_later(blob))
    except BaseException:
        blob.abort()
        raise
    return digests


def _stream(
    blob: BlobWriter,
    header: bytes | Iterable[bytes],
    sources: Iterable[TensorSource],
    buffers: list[_Buffer],
    progress: Callable[[int], None] | None,
    blocked: bool,
    ints: array[int] | None = None,
    header_size: int = 0,
) -> list[checksum.Digest]:
    """Stream ``header`` and ``sources`` into ``blob``; return each source's digest, or (with
    ``ints``) append them to ``ints`` as integers and return nothing."""
    writer = _WriterThread(blob)
    free = list(buffers)
    digests: list[checksum.Digest] = []
    add = digests.append if ints is None else None
    try:
        buf = free.pop()
        fill = 0
        size = len(buf.array)
        header_left = len(header) if isinstance(header, bytes) else header_size

        def report(written: int) -> None:
            # Progress counts tensor bytes only: the header is not part of the total.
            nonlocal header_left
            skip = min(header_left, written)
            header_left -= skip
            if progress is not None and written > skip:
                progress(written - skip)

        def flush(length: int) -> None:
            nonlocal buf, fill
            writer.submit(buf, length)
            report(fill)
            buf = free.pop() if free else writer.wait_buffer()
            fill = 0

        for piece in [header] if isinstance(header, bytes) else header:
            hb = np.frombuffer(piece, dtype=np.uint8)
            pos = 0
            while pos < len(hb):
                n = min(size - fill, len(hb) - pos)
                buf.array[fill : fill + n] = hb[pos : pos + n]
                fill += n
                pos += n
                if fill == size:
                    flush(size)
        for source in sources:
            n = source.nbytes
            if n <= SMALL and n <= size - fill:
                # A small tensor that fits: copied whole (from its address where it has one: no
                # view objects) and hashed in one call. A 100,000-tensor state spends about
                # 1 us per tensor here instead of 15.
                pointer = getattr(source, "pointer", None)
                address = pointer() if pointer is not None else None
                if address is not None:
                    if n:
                        _memmove(buf.address + fill, address, n)
                else:
                    try:
                        source.copy_to(buf.array[fill : fill + n], 0)
                    finally:
                        source.release()
                if add is not None:
                    add(checksum.Digest(_digest(buf.view[fill : fill + n])))
                else:
                    assert ints is not None
                    ints.append(_intdigest(buf.view[fill : fill + n]))
                fill += n
                if fill == size:
                    flush(size)
                continue
            hasher = checksum.Hasher(checksum.block_size(source.nbytes) if blocked else 0)
            pos = 0
            try:
                while pos < source.nbytes:
                    n = min(size - fill, source.nbytes - pos)
                    dst = buf.array[fill : fill + n]
                    source.copy_to(dst, pos)
                    hasher.update(dst)
                    fill += n
                    pos += n
                    if fill == size:
                        flush(size)
            finally:
                source.release()
            if add is not None:
                add(hasher.result())
            else:
                assert ints is not None
                ints.append(int(hasher.result().xxh3, 16))
        if fill:
            align = max(1, blob.alignment)
            padded = -(-fill // align) * align
            buf.array[fill:padded] = 0
            writer.submit(buf, padded, last=True)
            report(fill)
    finally:
        writer.finish()
    return digests


def write_image(
    store: Store,
    path: str,
    image: np.ndarray[Any, Any],
    size: int,
    *,
    direct: bool = True,
    chunk: int = IMAGE_CHUNK,
    progress: Callable[[int, int], None] | None = None,
) -> None:
    """Write the first ``size`` bytes of a prepared file image as the new blob ``path``, straight
    from that memory (no copy), and finish it; on any error the blob is aborted.
    ``progress(start, stop)`` is told of each range of the image handed to the store.

    ``image`` must start on a 4 KiB boundary and extend to ``size`` rounded up to 4 KiB, so the
    last write can be padded to any store's ``alignment`` (``finish`` cuts the padding off)."""
    blob = store.create_blob(path, size=size, direct=direct)
    try:
        view = memoryview(image.data).cast("B")
        align = max(1, blob.alignment)
        end = -(-size // align) * align
        for pos in range(0, end, chunk):
            stop = min(pos + chunk, end)
            blob.write(view[pos:stop])
            if progress is not None:
                progress(pos, min(stop, size))
        blob.finish()
    except BaseException:
        blob.abort()
        raise
