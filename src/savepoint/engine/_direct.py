"""A verify that reads past the page cache: every data file streamed once, in order, through one
reused aligned buffer (``O_DIRECT`` where the filesystem takes it), each tensor hashed as its
bytes go by (:func:`check`; ``sp.verify(path, direct=True)``).

Why: the mapped read of :func:`._copies.transfer` faults every page of a checkpoint that is not
in the page cache (one just written with ``O_DIRECT`` is not) into the caller's address space,
and the kernel fills the page cache on the way; a manager's read-back before pruning cost the
training process about 0.4 s of CPU per GiB that way on the development machine, where a
direct read into one touched buffer costs the hash (about 0.035 s per GiB) and a few system
calls. It also checks the bytes the disk holds, not a cached copy of them, and leaves the page
cache as it was.

Where: a checkpoint whose every tensor is stored whole in a local data file (no tensor split
over shards, none stored as blobs): :func:`possible`. Each data file's size and header are
checked first, as the mapped path checks them (:meth:`._pin.Generation.open_file`, opened with
no mapping). A filesystem that refuses ``O_DIRECT`` (tmpfs) is read with ``pread`` into the
same buffer: one kernel copy, no page faults.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import xxhash

from savepoint.codecs import checksum
from savepoint.codecs import manifest as mf
from savepoint.engine._checks import check_bool, check_digest
from savepoint.engine._pin import Generation

__all__ = ["CHUNK", "check", "possible"]

CHUNK = 32 << 20  # bytes per read: large enough that the disk sees deep requests
_ALIGN = 4096
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_INTDIGEST = xxhash.xxh3_64_intdigest

# One buffer, kept for the next verify (first-touch page faults cost more than the read's copy).
_BUFFER: list[mmap.mmap] = []
_BUFFER_LOCK = threading.Lock()


def possible(gen: Generation) -> bool:
    """Whether every tensor of ``gen`` is stored whole in a data file that is a local file."""
    table = gen.manifest.tensors
    whole = isinstance(table, mf.TensorTable) or all(
        r.recipe is None and len(r.shards) <= 1 for r in table.values()
    )
    local = all(hasattr(blob, "fileno") for blob in gen.blobs.values())
    return whole and local and set(gen.blobs) >= set(gen.manifest.files)


def check(gen: Generation, progress: Callable[[int], None] | None) -> None:
    """Check every tensor's checksum (and a BOOL tensor's bytes) by streaming each data file
    once; the files must be open (``gen.open_file(name, view=False)``: size and header
    checked). A mismatch raises CorruptCheckpointError naming the tensor."""
    items = _items(gen)
    with _buffer() as buf:
        for name in gen.manifest.files:
            todo = items.get(name)
            if todo:
                todo.sort(key=lambda it: (it[0], it[1]))
                _stream(gen, name, todo, buf, progress)


# (start, end, ref, expected digest as an int (a column table), or its record)
_Item = tuple[int, int, str, Any]


def _items(gen: Generation) -> dict[str, list[_Item]]:
    table = gen.manifest.tensors
    out: dict[str, list[_Item]] = {}
    if isinstance(table, mf.TensorTable):
        starts, ends, digests = table.starts.tolist(), table.ends.tolist(), table.digests.tolist()
        files = [table.files[i] for i in table.file_of]
        bools = {i for i, d in enumerate(table.dtypes) if d == "BOOL"}
        dtype_of = table.dtype_of.tolist()
        for i, name in enumerate(table.names):
            expect: Any = table[name] if dtype_of[i] in bools else digests[i]
            out.setdefault(files[i], []).append((starts[i], ends[i], name, expect))
        return out
    for ref, rec in table.items():
        out.setdefault(rec.file, []).append((rec.start, rec.end, ref, rec))
    return out


@contextlib.contextmanager
def _buffer() -> Any:
    """The reused aligned buffer (a fresh one while another verify holds it)."""
    mine = _BUFFER_LOCK.acquire(blocking=False)
    try:
        if mine and _BUFFER:
            buf = _BUFFER[0]
        else:
            buf = mmap.mmap(-1, CHUNK)
            np.frombuffer(buf, dtype=np.uint8).fill(0)  # touched once, here
            if mine:
                _BUFFER.append(buf)
        yield buf
    finally:
        if mine:
            _BUFFER_LOCK.release()


def _open(fd: int) -> int | None:
    """A second descriptor of the same file with O_DIRECT (None where it cannot be had)."""
    if not _O_DIRECT:
        return None
    try:
        direct = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | _O_DIRECT | os.O_CLOEXEC)
    except OSError:
        return None
    a, b = os.fstat(fd), os.fstat(direct)
    if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):
        os.close(direct)
        return None
    return direct


def _stream(
    gen: Generation,
    name: str,
    items: list[_Item],
    buf: mmap.mmap,
    progress: Callable[[int], None] | None,
) -> None:
    """Read ``name`` from its first tensor's block to its last tensor's end, a chunk at a time,
    hashing each tensor (``items``, sorted, not overlapping) as its bytes go by."""
    plain: int = gen.files[name].blob.fileno()  # type: ignore[attr-defined]
    direct = _open(plain)
    view = memoryview(buf)
    last = max(end for _, end, _, _ in items)
    pos = items[0][0] - items[0][0] % _ALIGN
    index, hasher = 0, None  # the next tensor; the hasher of one that spans chunks
    try:
        while index < len(items):
            want = min(CHUNK, -(-(last - pos) // _ALIGN) * _ALIGN)
            n = _read(direct, plain, view[:want], pos)
            if direct is not None and n < 0:  # O_DIRECT refused at the read: buffered
                os.close(direct)
                direct = None
                continue
            if n <= 0:
                raise gen.corrupt(f"data file {name} shrank while being read")
            end = pos + n
            while index < len(items) and _reached(items[index], end):
                start, stop, ref, expect = items[index]
                piece = view[max(start, pos) - pos : min(stop, end) - pos]
                if hasher is None and start >= pos and stop <= end:
                    _whole(gen, ref, expect, piece)
                else:
                    if hasher is None:
                        hasher = _hasher(expect)
                    hasher.update(piece)
                    if _is_bool(expect):
                        check_bool(gen, ref, np.frombuffer(piece, dtype=np.uint8))
                    if stop > end:
                        break  # the rest of it is in the next chunk
                    _finish(gen, ref, expect, hasher)
                    hasher = None
                if progress is not None:
                    progress(stop - start)
                index += 1
            pos = end
    finally:
        if direct is not None:
            os.close(direct)


def _reached(item: _Item, end: int) -> bool:
    """Whether a chunk ending at ``end`` holds some of ``item`` (an empty one: its place)."""
    start, stop = item[0], item[1]
    return start < end or start == stop <= end


def _read(direct: int | None, plain: int, into: memoryview, pos: int) -> int:
    """Bytes read at ``pos`` (-1: O_DIRECT was refused, read again without it)."""
    if direct is None:
        return os.preadv(plain, [into], pos)
    try:
        return os.preadv(direct, [into], pos)
    except OSError as exc:
        if exc.errno == 22:  # EINVAL: the filesystem took the open, refuses the read
            return -1
        raise


def _is_bool(expect: Any) -> bool:
    return not isinstance(expect, int) and expect.dtype == "BOOL"


def _hasher(expect: Any) -> Any:
    if isinstance(expect, int):
        return checksum.Hasher()
    return checksum.Hasher(expect.block, expect=expect.xxh3)


def _whole(gen: Generation, ref: str, expect: Any, piece: memoryview) -> None:
    if isinstance(expect, int):
        if _INTDIGEST(piece) != expect:
            raise gen.corrupt(f"checksum mismatch in tensor {ref!r}", key=ref)
        return
    hasher = _hasher(expect)
    hasher.update(piece)
    if expect.dtype == "BOOL":
        check_bool(gen, ref, np.frombuffer(piece, dtype=np.uint8))
    _finish(gen, ref, expect, hasher)


def _finish(gen: Generation, ref: str, expect: Any, hasher: checksum.Hasher) -> None:
    if isinstance(expect, int):
        if int(hasher.result().xxh3, 16) != expect:
            raise gen.corrupt(f"checksum mismatch in tensor {ref!r}", key=ref)
        return
    check_digest(gen, ref, expect.layout()[0], hasher, "")
