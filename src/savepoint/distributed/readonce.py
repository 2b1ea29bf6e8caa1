"""Read-once loads: which rank reads which stored bytes, when several ranks need the same ones.

A load on many ranks of a replicated tensor (or of any shard whose bytes several ranks need, or
must read to check: the blocks around their parts) would read those bytes from storage once per
rank. With read-once, rank 0 plans (:func:`plan`, plain data in and out, no I/O) from what each
rank would read (an :class:`Entry` per stored shard it touches):

1. per shard, the ranks' read ranges cut the shard into segments, each covered by a set of
   ranks; a segment covered by two or more is *shared* when reading it once saves at least
   ``min_saving`` bytes (``(ranks - 1) x bytes``); every other byte is read by each rank that
   needs it, as without read-once;
2. shared segments are cut into chunks (whole blocks, so the reader checks each on its own; a
   shard without block checksums that must be checked is one chunk), about ``1/32`` of an even
   share of the shared bytes each, 256 KiB to 16 MiB;
3. each chunk gets one reader among the ranks covering it: largest chunks first onto the one
   with the fewest bytes to read so far (its own unshared reads counted), so the reads are
   spread over the ranks (the heaviest ends at most one chunk above an even share);
4. the chunks are grouped into rounds of about ``round_bytes``, in the checkpoint's order: what
   one round holds in memory on any rank.

Each round (:mod:`._fetch`): every reader reads and checks its chunks; the ranks agree nobody
failed; a chunk every other rank takes whole is broadcast from its reader, any other goes rank to
rank (each taker gets only the bytes it needs); each rank copies its parts into its targets.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "CHUNK_MAX",
    "CHUNK_MIN",
    "Chunk",
    "Entry",
    "MIN_SAVING",
    "Plan",
    "ROUND",
    "plan",
    "uncovered",
]

MIN_SAVING = 64 << 10  # bytes a shared segment must save to be read once (one small block)
CHUNK_MIN = 256 << 10
CHUNK_MAX = 16 << 20
ROUND = 64 << 20  # bytes of chunks per round: the memory a round holds on any rank

Span = tuple[int, int]


@dataclass(frozen=True)
class Entry:
    """What one rank would read of one stored shard (byte offsets into the shard)."""

    ref: str
    shard: int
    need: Span  # the bytes its copies take
    read: Span  # the bytes it would read: ``need`` widened to whole blocks when checked
    unit: int  # chunk boundaries: multiples of this from the shard's start; 0: never split


@dataclass(frozen=True)
class Chunk:
    """Bytes ``[lo, hi)`` of shard ``shard`` of tensor ``ref``, read (and checked) by ``reader``.

    ``broadcast``: every other rank takes all of it. Otherwise ``takers`` lists ``(rank, a, b)``:
    bytes ``[a, b)`` go to ``rank``. The reader takes what it needs itself."""

    ref: str
    shard: int
    lo: int
    hi: int
    reader: int
    broadcast: bool
    takers: tuple[tuple[int, int, int], ...]


@dataclass(frozen=True)
class Plan:
    rounds: tuple[tuple[Chunk, ...], ...]
    reads: tuple[int, ...]  # bytes of the planned shards each rank reads from storage

    def chunks(self) -> list[Chunk]:
        return [c for r in self.rounds for c in r]


def plan(
    entries: Sequence[Sequence[Entry]],
    *,
    min_saving: int | None = None,
    round_bytes: int | None = None,
    chunk: int | None = None,
) -> Plan:
    """The read-once plan for ``entries[rank]`` (see the module docstring); ``min_saving`` and
    ``round_bytes`` default to :data:`MIN_SAVING` and :data:`ROUND`, and ``chunk`` fixes the
    chunk size (rounded to whole units) instead of deriving it."""
    world = len(entries)
    least = MIN_SAVING if min_saving is None else min_saving
    most = ROUND if round_bytes is None else round_bytes
    groups: dict[tuple[str, int], list[tuple[int, Entry]]] = {}
    for rank, mine in enumerate(entries):
        for e in mine:
            groups.setdefault((e.ref, e.shard), []).append((rank, e))
    load = [0] * world
    shared: list[tuple[str, int, int, int, tuple[int, ...], int]] = []
    for (ref, shard), members in groups.items():
        units = {e.unit for _, e in members}
        if len(members) < 2 or len(units) > 1:
            for rank, e in members:
                load[rank] += e.read[1] - e.read[0]
            continue
        unit = members[0][1].unit
        for lo, hi, cover in _segments(members):
            if len(cover) > 1 and (len(cover) - 1) * (hi - lo) >= least:
                shared.append((ref, shard, lo, hi, cover, unit))
            else:
                for rank in cover:
                    load[rank] += hi - lo
    total = sum(hi - lo for _, _, lo, hi, _, _ in shared)
    size = chunk or min(CHUNK_MAX, max(CHUNK_MIN, total // max(1, 32 * world)))
    pieces: list[tuple[str, int, int, int, tuple[int, ...]]] = []
    for ref, shard, lo, hi, cover, unit in shared:
        step = hi - lo if unit == 0 else max(unit, size // unit * unit)
        for a in range(lo, hi, step):
            pieces.append((ref, shard, a, min(hi, a + step), cover))
    readers = [0] * len(pieces)
    for i in sorted(range(len(pieces)), key=lambda i: (pieces[i][2] - pieces[i][3], i)):
        _, _, lo, hi, cover = pieces[i]
        readers[i] = min(cover, key=lambda r: (load[r], r))
        load[readers[i]] += hi - lo
    needs = {
        (ref, shard): {r: e.need for r, e in members} for (ref, shard), members in groups.items()
    }
    rounds: list[tuple[Chunk, ...]] = []
    current: list[Chunk] = []
    held = 0
    for (ref, shard, lo, hi, cover), reader in zip(pieces, readers):
        takers = []
        for rank in cover:
            a, b = needs[(ref, shard)][rank]
            a, b = max(a, lo), min(b, hi)
            if rank != reader and a < b:
                takers.append((rank, a, b))
        if not takers and not _overlaps(needs[(ref, shard)][reader], lo, hi):
            continue
        whole = len(takers) == world - 1 and all((a, b) == (lo, hi) for _, a, b in takers)
        if current and held + hi - lo > most:
            rounds.append(tuple(current))
            current, held = [], 0
        current.append(Chunk(ref, shard, lo, hi, reader, whole, () if whole else tuple(takers)))
        held += hi - lo
    if current:
        rounds.append(tuple(current))
    return Plan(tuple(rounds), tuple(load))


def _overlaps(span: Span, lo: int, hi: int) -> bool:
    return max(span[0], lo) < min(span[1], hi)


def _segments(members: Sequence[tuple[int, Entry]]) -> list[tuple[int, int, tuple[int, ...]]]:
    """The shard's bytes that some member reads, cut where the set of members reading them
    changes: ``(lo, hi, ranks)`` in order, ranks sorted."""
    events = sorted(
        [(e.read[0], 1, r) for r, e in members if e.read[0] < e.read[1]]
        + [(e.read[1], -1, r) for r, e in members if e.read[0] < e.read[1]]
    )
    out: list[tuple[int, int, tuple[int, ...]]] = []
    active: set[int] = set()
    i = 0
    while i < len(events):
        at = events[i][0]
        while i < len(events) and events[i][0] == at:
            _, kind, rank = events[i]
            if kind > 0:
                active.add(rank)
            else:
                active.discard(rank)
            i += 1
        if not active or i == len(events):
            continue
        cover = tuple(sorted(active))
        hi = events[i][0]
        if out and out[-1][1] == at and out[-1][2] == cover:
            out[-1] = (out[-1][0], hi, cover)
        else:
            out.append((at, hi, cover))
    return out


def uncovered(span: Span, covered: Sequence[Span]) -> list[Span]:
    """The parts of ``span`` outside every range of ``covered`` (in order)."""
    out: list[Span] = []
    at, end = span
    for lo, hi in sorted(covered):
        if hi <= at or lo >= end:
            continue
        if lo > at:
            out.append((at, lo))
        at = max(at, hi)
    if at < end:
        out.append((at, end))
    return out
