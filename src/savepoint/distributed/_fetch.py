"""The read step of a load on several ranks: each rank's own reads, then the read-once rounds.

:func:`entries` says what this rank would read of each stored shard (for :func:`.readonce.plan`);
:func:`read` runs the plan: the bytes no chunk covers are read by this rank as before (copied
straight into its targets, checked by block); then round by round every reader reads and checks
its chunks into buffers, the ranks agree that nobody failed (a failed rank raises its own error,
the others stop and return: the step fails on every rank, naming the ranks that failed), the
chunks travel (broadcast, or rank to rank), and each rank copies its parts into its targets
(none to copy where a chunk goes straight into a target). The next round's reads run while a
round's chunks travel, so storage and network are busy at once; two rounds' buffers at most are
held. With ``verify="first"`` every rank checks all it will read (its own reads and its chunks)
and the ranks agree before anything is copied.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Literal

import numpy as np

from savepoint.codecs import boxes, dtypes
from savepoint.distributed import readonce
from savepoint.distributed.collectives import Coordinator
from savepoint.engine.read import Reader, RegionCopy, ShardTask

Key = tuple[str, int]
Progress = Callable[[int], None]


def entries(
    reader: Reader, tasks: Sequence[ShardTask], verify: bool | Literal["first"]
) -> list[readonce.Entry]:
    """What this rank reads of each shard its tasks touch, for the shards where it reads at
    least :data:`.readonce.MIN_SAVING` bytes (smaller ones are read by every rank needing them)."""
    out = []
    for ref, index, copies in tasks:
        need = reader.needed_span(ref, copies)
        if need[1] <= need[0]:
            continue
        shard = reader.manifest.tensors[ref].layout()[index]
        if verify:
            read, unit = reader.checked_span(ref, index, need), shard.block
        else:
            read, unit = need, dtypes.from_name(reader.manifest.tensors[ref].dtype).itemsize
        if read[1] - read[0] >= readonce.MIN_SAVING:
            out.append(readonce.Entry(ref, index, need, read, unit))
    return out


def read(
    reader: Reader,
    coord: Coordinator,
    plan: readonce.Plan | None,
    tasks: Sequence[ShardTask],
    mine: Sequence[readonce.Entry],
    verify: bool | Literal["first"],
    progress: Progress | None,
) -> None:
    """Fill this rank's targets (``tasks``: its copies, by shard) following ``plan``."""
    rounds = plan.rounds if plan is not None else ()
    by_key: dict[Key, list[readonce.Chunk]] = {}
    for c in (c for r in rounds for c in r):
        by_key.setdefault((c.ref, c.shard), []).append(c)
    spans = {(e.ref, e.shard): e.read for e in mine}
    own: list[ShardTask] = []
    copies: dict[Key, Sequence[RegionCopy]] = {}
    for ref, index, task_copies in tasks:
        key = (ref, index)
        chunks = by_key.get(key)
        if not chunks or key not in spans:
            own.append((ref, index, task_copies))
            continue
        copies[key] = task_copies
        for lo, hi in readonce.uncovered(spans[key], [(c.lo, c.hi) for c in chunks]):
            clipped = _clip(reader, ref, index, task_copies, lo, hi)
            if clipped:
                own.append((ref, index, clipped))
    error: Exception | None = None
    try:
        if verify == "first":
            reader.read_shards(own, check_only=True)
            mine_chunks = [c for r in rounds for c in r if c.reader == coord.rank]
            reader.read_shards([_into(reader, c, None) for c in mine_chunks], check_only=True)
    except Exception as exc:
        error = exc
    checked = verify == "first" and rounds
    if checked and any(coord.all_flags(int(error is not None), phase="load: read")):
        rounds = ()  # a rank failed its checks: nothing is copied anywhere
    elif error is None:
        try:
            reader.read_shards(own, verify=verify is True, progress=progress)
        except Exception as exc:
            error = exc
    if rounds:
        error = _rounds(reader, coord, rounds, copies, verify is True, error, progress)
    if error is not None:
        raise error


def _rounds(
    reader: Reader,
    coord: Coordinator,
    rounds: Sequence[Sequence[readonce.Chunk]],
    copies: dict[Key, Sequence[RegionCopy]],
    verify: bool,
    error: Exception | None,
    progress: Progress | None,
) -> Exception | None:
    """Every round in order; the next round's reads run (on a thread of their own) while this
    one's chunks travel and are copied. Returns this rank's error, if it has one."""
    with ThreadPoolExecutor(1, thread_name_prefix="savepoint-read-ahead") as ahead:

        def start(number: int) -> tuple[_Round, Future[Exception | None]]:
            batch = _Round(reader, coord.rank, rounds[number], copies)
            return batch, ahead.submit(batch.read, reader, coord.rank, verify)

        current = start(0) if error is None else None
        for number in range(len(rounds)):
            if current is not None:
                error = current[1].result()
            if any(
                coord.all_flags(int(error is not None), phase=f"load: read-once round {number + 1}")
            ):
                break
            assert current is not None
            following = start(number + 1) if number + 1 < len(rounds) else None
            current[0].exchange(reader, coord, number, copies, progress)
            current = following
    return error


class _Round:
    """One round's chunks on this rank: where each one's bytes go (straight into a target where
    :func:`_direct` finds one, else a buffer), the reads of those it reads, and the exchange."""

    def __init__(
        self,
        reader: Reader,
        me: int,
        chunks: Sequence[readonce.Chunk],
        copies: dict[Key, Sequence[RegionCopy]],
    ) -> None:
        self.chunks = chunks
        self.held: dict[int, np.ndarray[Any, Any]] = {}  # chunk index -> its bytes here
        self.direct: set[int] = set()  # chunks read or received straight into a target
        for i, c in enumerate(chunks):
            if c.broadcast or c.reader == me:
                view = _direct(reader, c, copies)
                if view is not None:
                    self.direct.add(i)
                self.held[i] = view if view is not None else np.empty(c.hi - c.lo, np.uint8)

    def read(self, reader: Reader, me: int, verify: bool) -> Exception | None:
        """Read (and check) the chunks this rank reads; the error, if one failed."""
        try:
            reader.read_shards(
                [
                    _into(reader, c, self.held[i])
                    for i, c in enumerate(self.chunks)
                    if c.reader == me
                ],
                verify=verify,
            )
        except Exception as exc:
            return exc
        return None

    def exchange(
        self,
        reader: Reader,
        coord: Coordinator,
        number: int,
        copies: dict[Key, Sequence[RegionCopy]],
        progress: Progress | None,
    ) -> None:
        """Broadcast or send every chunk (every rank agreed that all were read), then copy
        what this rank takes into its targets."""
        me, chunks, held = coord.rank, self.chunks, self.held
        for i, c in enumerate(chunks):
            if c.broadcast:
                coord.broadcast_bytes(held[i], c.reader)
        sends: dict[int, list[np.ndarray[Any, Any]]] = {}
        takes: dict[int, list[tuple[int, int, int]]] = {}  # from rank -> (chunk index, a, b)
        for i, c in enumerate(chunks):
            for rank, a, b in c.takers:
                if c.reader == me:
                    sends.setdefault(rank, []).append(held[i][a - c.lo : b - c.lo])
                elif rank == me:
                    takes.setdefault(c.reader, []).append((i, a, b))
        received = {r: np.empty(sum(b - a for _, a, b in t), np.uint8) for r, t in takes.items()}
        coord.exchange_bytes(
            [(r, np.concatenate(parts)) for r, parts in sends.items()],
            list(received.items()),
            tag=number,
        )
        for rank, taken in takes.items():
            offset = 0
            for i, a, b in taken:
                data = received[rank][offset : offset + b - a]
                _apply(reader, chunks[i], copies, data, a, progress)
                offset += b - a
        for i, data in held.items():
            if i not in self.direct:
                _apply(reader, chunks[i], copies, data, chunks[i].lo, progress)
            elif progress is not None:
                progress(len(data))


def _direct(
    reader: Reader, c: readonce.Chunk, copies: dict[Key, Sequence[RegionCopy]]
) -> np.ndarray[Any, Any] | None:
    """The bytes of this rank's target that hold bytes ``[lo, hi)`` of the chunk's shard, where
    its one copy out of that shard takes all of it into a C-ordered array in which the shard's
    box is one contiguous run (a replicated tensor into a whole one, a row shard into a whole
    tensor or a wider row shard): the chunk then goes straight there."""
    mine = copies.get((c.ref, c.shard))
    if not mine or len(mine) != 1:
        return None
    (copy,) = mine
    rec = reader.manifest.tensors[c.ref]
    region = rec.layout()[c.shard].region
    dst = copy.dst
    if isinstance(region, boxes.Flat) or copy.region != region or copy.src.box != region:
        return None
    if not dst.flags.c_contiguous or not dst.flags.writeable or dst.ndim != len(region):
        return None
    rel = [(a - o, b - o) for (a, b), o in zip(region, copy.dst_origin)]
    # one run: whole extents after the first dimension that is not a single index
    split = next((d for d, (a, b) in enumerate(rel) if b - a != 1), len(rel))
    if any(rel[d] != (0, dst.shape[d]) for d in range(split + 1, len(rel))):
        return None
    first = 0
    for (a, _), n in zip(rel, dst.shape):
        first = first * n + a
    start = first * dst.itemsize
    flat: np.ndarray[Any, Any] = dst.reshape(-1).view(np.uint8)
    return flat[start + c.lo : start + c.hi]


def _into(reader: Reader, c: readonce.Chunk, buf: np.ndarray[Any, Any] | None) -> ShardTask:
    """The task that reads (and checks) bytes ``[lo, hi)`` of a shard into ``buf`` (None: a
    check-only task, whose copies are never carried out)."""
    rec = reader.manifest.tensors[c.ref]
    region = rec.layout()[c.shard].region
    d = dtypes.from_name(rec.dtype)
    if buf is None:
        buf = np.empty(c.hi - c.lo, dtype=np.uint8)  # never written: not even allocated
    typed = buf.view(d.numpy)
    sources = boxes.pieces(region, rec.shape)
    out = []
    for p in boxes.run_pieces(region, rec.shape, c.lo // d.itemsize, c.hi // d.itemsize):
        dst = typed[p.offset : p.offset + boxes.volume(p.box)].reshape(boxes.extents(p.box))
        origin = tuple(lo for lo, _ in p.box)
        for s in sources:
            common = boxes.intersect(s.box, p.box)
            if common is not None:
                out.append(RegionCopy(s, common, dst, origin))
    return (c.ref, c.shard, out)


def _clip(
    reader: Reader, ref: str, index: int, copies: Sequence[RegionCopy], lo: int, hi: int
) -> list[RegionCopy]:
    """``copies`` cut down to the elements held in bytes ``[lo, hi)`` of the shard."""
    rec = reader.manifest.tensors[ref]
    item = dtypes.from_name(rec.dtype).itemsize
    runs = boxes.run_pieces(rec.layout()[index].region, rec.shape, lo // item, hi // item)
    out = []
    for c in copies:
        for p in runs:
            common = boxes.intersect(c.region, p.box)
            if common is not None:
                out.append(RegionCopy(c.src, common, c.dst, c.dst_origin))
    return out


def _apply(
    reader: Reader,
    c: readonce.Chunk,
    copies: dict[Key, Sequence[RegionCopy]],
    data: np.ndarray[Any, Any],
    start: int,
    progress: Progress | None,
) -> None:
    """Copy what this rank's targets take out of ``data``, bytes ``[start, start + len)`` of the
    chunk's shard."""
    mine = copies.get((c.ref, c.shard))
    if not mine:
        return
    rec = reader.manifest.tensors[c.ref]
    d = dtypes.from_name(rec.dtype)
    typed = data.view(d.numpy)
    region = rec.layout()[c.shard].region
    first = start // d.itemsize
    done = 0
    for p in boxes.run_pieces(region, rec.shape, first, first + len(typed)):
        src = typed[p.offset : p.offset + boxes.volume(p.box)].reshape(boxes.extents(p.box))
        for copy in mine:
            common = boxes.intersect(copy.region, p.box)
            if common is None:
                continue
            into = tuple(slice(a - o, b - o) for (a, b), o in zip(common, copy.dst_origin))
            target = copy.dst[into] if into else copy.dst[...]
            source = src[boxes.relative(common, p)] if common else src[...]
            np.copyto(target, source, casting="no")
            done += target.nbytes
    if progress is not None and done:
        progress(done)
