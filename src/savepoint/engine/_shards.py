"""Shard assembly: tensors stored as several shards (manifest versions 2 and 3, and 4's shards
stored as blobs), assembled whole or copied region by region into arbitrary targets.

:func:`assemble` makes the tasks that copy every shard of a tensor into its place (a load without
a process group, and ``verify``, read split tensors that way); :func:`shard_work` turns
``(ref, shard index, copies)`` tasks (:data:`ShardTask`, the resharding loads of
:mod:`savepoint.distributed` make their own) into work for the thread pool. Checksums are checked
fused with the copy: a version 3 shard with block checksums is read and checked only over the
blocks holding the bytes a task needs; any other shard is checked whole. See :mod:`.read`.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from savepoint.codecs import boxes, checksum, dtypes
from savepoint.codecs import manifest as mf
from savepoint.engine._blobreads import (
    open_blob_store,
    read_blob_part,
    verify_blob_shard,
)
from savepoint.engine._checks import PIECE, check_bool, check_digest
from savepoint.engine._pin import DataFile, Generation


@dataclass(frozen=True)
class RegionCopy:
    """Copy ``region`` (global coordinates) of a tensor out of one of its shards into ``dst``.

    ``src`` is the piece of the shard's buffer that holds ``region``; ``dst`` is a typed array
    holding the box of the tensor that starts at ``dst_origin`` (global coordinates).
    """

    src: boxes.Piece
    region: boxes.Box
    dst: np.ndarray[Any, Any]
    dst_origin: tuple[int, ...]


ShardTask = tuple[str, int, Sequence[RegionCopy]]  # (tensor ref, shard index, copies)


def _view(array: np.ndarray[Any, Any], index: tuple[slice, ...]) -> np.ndarray[Any, Any]:
    # ``a[()]`` of a 0-d array is a scalar, not a view; ``a[...]`` is a view.
    return array[index] if index else array[...]


def assemble(gen: Generation, ref: str, dst: np.ndarray[Any, Any] | None) -> list[ShardTask]:
    """Tasks that copy every shard of a split tensor into its place in ``dst`` (bytes)."""
    rec = gen.manifest.tensors[ref]
    if dst is None:
        return [(ref, i, ()) for i in range(len(rec.shards))]
    typed = dst.view(dtypes.from_name(rec.dtype).numpy).reshape(rec.shape)
    origin = (0,) * len(rec.shape)
    return [
        (
            ref,
            i,
            [RegionCopy(p, p.box, typed, origin) for p in boxes.pieces(s.region, rec.shape)],
        )
        for i, s in enumerate(rec.shards)
    ]


def shard_work(
    gen: Generation,
    tasks: Sequence[ShardTask],
    *,
    verify: bool,
    progress: Callable[[int], None] | None,
    lock: threading.Lock,
    check_only: bool = False,
) -> list[tuple[int, Callable[[], None]]]:
    """``(bytes, job)`` work for the thread pool, one job per task: see
    ``Reader.read_shards``. Each shard's file is opened (its size and header checked) here,
    before any job runs."""
    work: list[tuple[int, Callable[[], None]]] = []
    for ref, index, copies in tasks:
        shard = gen.manifest.tensors[ref].layout()[index]
        if shard.recipe is not None and not copies and not check_only:
            # A verify pass over a shard stored as blobs: every blob against its name.
            open_blob_store(gen)
            fn = functools.partial(verify_blob_shard, gen, ref, shard, progress, lock)
            work.append((shard.nbytes, fn))
            continue
        opened = None
        if shard.recipe is None:
            opened = gen.open_file(shard.file, check_header=verify)
        else:
            open_blob_store(gen)  # opened here, once, not by the tasks at once
        # The bytes a task reads: those its copies need, widened (``verify``) to the blocks
        # holding them, or to the whole shard where it has no block checksums; a check-only
        # task (no copies) reads the whole shard.
        span = (0, shard.nbytes)
        if copies:
            span = needed_span(gen, ref, copies)
            if verify:
                span = blocks_around(shard, span)
        # Without a view the shard is read when its task runs (not all shards up front), and
        # only ``span`` of it; a shard stored as blobs reads only the chunks holding ``span``
        # (its blocks are its chunks).
        raw: Callable[[], np.ndarray[Any, Any]]
        if opened is None:
            raw = functools.partial(read_blob_part, gen, ref, shard, span)
        elif opened.array is None and span != (0, shard.nbytes):
            raw = functools.partial(_read_part, gen, opened, shard.start, shard.end, span)
        else:
            raw = functools.partial(opened.slice, shard.start, shard.end)
        fn = functools.partial(
            _copy_shard,
            gen,
            ref,
            index,
            raw,
            () if check_only else copies,
            span if verify or check_only else None,
            progress,
            lock,
        )
        work.append((shard.end - shard.start, fn))
    return work


def needed_span(gen: Generation, ref: str, copies: Sequence[RegionCopy]) -> tuple[int, int]:
    """The byte range of a shard's buffer that ``copies`` read."""
    item = dtypes.from_name(gen.manifest.tensors[ref].dtype).numpy.itemsize
    spans = [boxes.span(c.region, c.src) for c in copies if boxes.volume(c.region)]
    if not spans:
        return 0, 0
    return min(lo for lo, _ in spans) * item, max(hi for _, hi in spans) * item


def _read_part(
    gen: Generation, opened: DataFile, start: int, end: int, needed: tuple[int, int]
) -> np.ndarray[Any, Any]:
    """A shard's buffer with only ``needed`` (a byte range of it) read; the rest is never
    looked at (unverified copies touch only what they need)."""
    buf = np.empty(end - start, dtype=np.uint8)
    lo, hi = needed
    if hi > lo:
        try:
            opened.blob.read(start + lo, buf[lo:hi])
        except EOFError:
            raise gen.corrupt(f"a data file shrank while being read ({start + hi})") from None
    return buf


def _copy_shard(
    gen: Generation,
    ref: str,
    index: int,
    load: Callable[[], np.ndarray[Any, Any]],
    copies: Sequence[RegionCopy],
    check: tuple[int, int] | None,
    progress: Callable[[int], None] | None,
    lock: threading.Lock,
) -> None:
    """Copy the regions ``copies`` need out of a shard's bytes; with ``check`` (a byte range
    of the shard, whole blocks or the whole shard) hash that range first, a piece ahead of
    the copies that read it, and compare it with the manifest."""
    raw = load()
    rec = gen.manifest.tensors[ref]
    numpy_dtype = dtypes.from_name(rec.dtype).numpy
    item = numpy_dtype.itemsize
    typed = raw.view(numpy_dtype)
    steps: list[tuple[int, np.ndarray[Any, Any], np.ndarray[Any, Any]]] = []
    for c in copies:
        src = typed[c.src.offset : c.src.offset + boxes.volume(c.src.box)]
        src = src.reshape(boxes.extents(c.src.box))
        for sub in boxes.split(c.region, c.src, PIECE // item):
            _, hi = boxes.span(sub, c.src)
            into = tuple(slice(a - o, b - o) for (a, b), o in zip(sub, c.dst_origin))
            steps.append((hi * item, _view(src, boxes.relative(sub, c.src)), _view(c.dst, into)))
    steps.sort(key=lambda step: step[0])
    shard = rec.layout()[index]
    hasher = None
    begin = hashed = stop = 0
    if check is not None and (check[1] > check[0] or not shard.nbytes):
        begin, stop = check
        hashed = begin
        hasher = checksum.Hasher(
            shard.block, hashed // shard.block if shard.block else 0, shard.xxh3
        )
    boolean = rec.dtype == "BOOL"
    for end, source, target in steps:
        while hasher is not None and hashed < end:
            n = min(PIECE, end - hashed)
            hasher.update(raw[hashed : hashed + n])
            if boolean:
                check_bool(gen, ref, raw[hashed : hashed + n])
            hashed += n
        if boolean and hasher is None:
            check_bool(gen, ref, source)
        np.copyto(target, source, casting="no")
        if progress is not None:
            with lock:
                progress(target.nbytes)
    if hasher is None:
        return
    for pos in range(hashed, stop, PIECE):
        piece = raw[pos : min(pos + PIECE, stop)]
        hasher.update(piece)
        if boolean:
            check_bool(gen, ref, piece)
    if not copies and progress is not None:
        with lock:
            progress(stop - begin)  # a check-only pass counts the bytes it hashed
    where = ""
    if rec.is_split:
        where = (
            f" (shard {index + 1} of {len(rec.layout())}, {boxes.show(shard.region)} in "
            f"{shard.file or 'blobs'})"
        )
    check_digest(gen, ref, shard, hasher, where)


def blocks_around(shard: mf.ShardRecord, span: tuple[int, int]) -> tuple[int, int]:
    """The byte range a verified read of ``span`` (of ``shard``) reads and checks: the blocks
    holding it, or the whole shard where it has no block checksums (nothing for an empty span)."""
    lo, hi = span
    if hi <= lo:
        return 0, 0
    if not shard.block:
        return 0, shard.nbytes
    b = shard.block
    return lo // b * b, min(-(-hi // b) * b, shard.nbytes)
