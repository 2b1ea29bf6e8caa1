"""Checks of a pinned generation's bytes against its manifest (see :mod:`.read`).

A tensor's checksum (whole, or per block where the manifest records blocks), a BOOL tensor's
bytes (0 or 1 only), and the tight loops that check many small tensors in one pass on this
thread (:func:`check_small`). The copies (:mod:`._copies`, :mod:`._shards`) fuse these checks with
the copy, a piece (:data:`PIECE`) at a time. A data file's size and header are checked when it is
opened (:meth:`._pin.Generation.open_file`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import xxhash

from savepoint.codecs import checksum
from savepoint.codecs import manifest as mf
from savepoint.engine._pin import Generation

PIECE = 1 << 20  # hash-then-copy granularity: stays in cache (L2 on most machines) between the two
# Tensors up to this size (savepoint never block-hashes them: see
# savepoint.codecs.checksum.block_size) are checked and copied in tight loops, many per task.
SMALL = 2 * checksum.MIN_BLOCK

_HEXDIGEST = xxhash.xxh3_64_hexdigest
_INTDIGEST = xxhash.xxh3_64_intdigest


def check_small(
    gen: Generation,
    records: Iterable[tuple[str, mf.TensorRecord]] | mf.TensorTable,
    progress: Callable[[int], None] | None = None,
) -> list[str]:
    """Check the checksums of the small tensors among ``(ref, record)`` stored whole in
    files with a zero-copy view (opened and checked already, or now) in one tight loop on
    this thread; return the refs of the others, for :func:`._copies.transfer`. A mismatch raises
    CorruptCheckpointError naming the tensor.

    For a verify of 100,000 small tensors this is 0.5 us a tensor, where a transfer job
    each costs about 2 (work items, runs, a numpy slice and a hex formatting per tensor);
    the hashing holds the GIL for buffers this small anyway."""
    if isinstance(records, mf.TensorTable):
        return _check_small_table(gen, records, progress)
    hexdigest = _HEXDIGEST
    views: dict[str, memoryview | None] = {}
    rest: list[str] = []
    checked = 0
    for ref, rec in records:
        start, end = rec.start, rec.end
        if (
            rec.shards[1:]
            or rec.block
            or end - start > SMALL
            or rec.dtype == "BOOL"
            or rec.recipe is not None
        ):
            rest.append(ref)
            continue
        file = rec.file
        if file in views:
            view = views[file]
        else:
            opened = gen.files.get(file) or gen.open_file(file)
            view = views[file] = None if opened.array is None else opened.array.data
        if view is None:
            rest.append(ref)
            continue
        if hexdigest(view[start:end]) != rec.xxh3 and not checksum.matches(
            view[start:end], rec.xxh3
        ):
            raise gen.corrupt(f"checksum mismatch in tensor {ref!r}", key=ref)
        checked += end - start
    if progress is not None and checked:
        progress(checked)
    return rest


def _check_small_table(
    gen: Generation, table: mf.TensorTable, progress: Callable[[int], None] | None
) -> list[str]:
    """:func:`check_small` of every tensor of a table, from its columns (no records)."""
    intdigest = _INTDIGEST
    views: list[memoryview | None] = []
    for name in table.files:
        opened = gen.files.get(name) or gen.open_file(name)
        views.append(None if opened.array is None else opened.array.data)
    boolean = table.dtypes.index("BOOL") if "BOOL" in table.dtypes else -1
    names, starts, ends, digests = table.names, table.starts, table.ends, table.digests
    file_of, dtype_of = table.file_of, table.dtype_of
    rest: list[str] = []
    checked = 0
    for i, start in enumerate(starts):
        end = ends[i]
        view = views[file_of[i]]
        if end - start > SMALL or view is None or dtype_of[i] == boolean:
            rest.append(names[i])
            continue
        if intdigest(view[start:end]) != digests[i]:
            ref = names[i]
            raise gen.corrupt(f"checksum mismatch in tensor {ref!r}", key=ref)
        checked += end - start
    if progress is not None and checked:
        progress(checked)
    return rest


def check_read(
    gen: Generation,
    ref: str,
    pieces: Iterable[np.ndarray[Any, Any]],
    verify: bool,
    progress: Callable[[int], None] | None,
    lock: threading.Lock,
) -> None:
    """Hash (``verify``), BOOL-check and count bytes already in place, piece by piece."""
    rec = gen.manifest.tensors[ref]
    hasher = checksum.Hasher(rec.block, expect=rec.xxh3) if verify else None
    boolean = rec.dtype == "BOOL"
    for data in pieces:
        for pos in range(0, len(data), PIECE):
            piece = data[pos : pos + PIECE]
            if hasher is not None:
                hasher.update(piece)
            if boolean:
                check_bool(gen, ref, piece)
            if progress is not None:
                with lock:
                    progress(len(piece))
    if hasher is not None:
        check_digest(gen, ref, rec.layout()[0], hasher, "")


def check_digest(
    gen: Generation, ref: str, shard: mf.ShardRecord, hasher: checksum.Hasher, where: str
) -> None:
    """Compare what ``hasher`` saw (the whole shard, or blocks from ``hasher.first`` on) with
    the manifest; a mismatch is a CorruptCheckpointError naming the tensor, ``where`` (the
    shard, for split tensors) and the first bad block."""
    got = hasher.result()
    if not shard.block:
        if got.xxh3 != shard.xxh3:
            raise gen.corrupt(f"checksum mismatch in tensor {ref!r}{where}", key=ref)
        return
    expected = shard.blocks[hasher.first : hasher.first + len(got.blocks)]
    for i, (a, b) in enumerate(zip(got.blocks, expected)):
        if a != b:
            first = (hasher.first + i) * shard.block
            last = min(first + shard.block, shard.nbytes)
            raise gen.corrupt(
                f"checksum mismatch in tensor {ref!r}{where}: block {hasher.first + i + 1} "
                f"of {len(shard.blocks)} (bytes {first}..{last} of it)",
                key=ref,
            )


def check_bool(gen: Generation, ref: str, data: np.ndarray[Any, Any]) -> None:
    """Refuse a BOOL tensor holding a byte other than 0 or 1: numpy and torch would keep the
    odd byte, and the tensor would then differ from its own round trip. The checksum cannot
    catch it (a crafted file can carry a matching one). About 0.08 s per GiB, BOOL tensors only."""
    # max() reduces with SIMD and no temporary: about 3x cheaper than np.any(data > 1).
    if data.size and int(data.view(np.uint8).max()) > 1:
        raise gen.corrupt(f"tensor {ref!r} is BOOL but holds bytes other than 0 and 1", key=ref)
