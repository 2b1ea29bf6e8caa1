"""The read-once planner (:mod:`savepoint.distributed.readonce`): plain data, no ranks."""

from __future__ import annotations

import random

import pytest

from savepoint.distributed import readonce
from savepoint.distributed.readonce import Entry

KiB, MiB = 1 << 10, 1 << 20
BLOCK = 64 * KiB


def coverage(plan: readonce.Plan, entries: list[list[Entry]]) -> dict[tuple[str, int], list[int]]:
    """How many times each byte of each shard is read from storage under ``plan``: the chunks
    once each, every other byte of a rank's read range by that rank."""
    size = {(e.ref, e.shard): 0 for es in entries for e in es}
    for es in entries:
        for e in es:
            size[(e.ref, e.shard)] = max(size[(e.ref, e.shard)], e.read[1])
    counts = {key: [0] * n for key, n in size.items()}
    chunks: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for c in plan.chunks():
        chunks.setdefault((c.ref, c.shard), []).append((c.lo, c.hi))
        for i in range(c.lo, c.hi):
            counts[(c.ref, c.shard)][i] += 1
    for es in entries:
        for e in es:
            for lo, hi in readonce.uncovered(e.read, chunks.get((e.ref, e.shard), [])):
                for i in range(lo, hi):
                    counts[(e.ref, e.shard)][i] += 1
    return counts


def test_a_replicated_shard_is_read_once_spread_over_the_ranks_and_broadcast() -> None:
    entries = [[Entry("w", 0, (0, 8 * MiB), (0, 8 * MiB), BLOCK)] for _ in range(8)]
    plan = readonce.plan(entries)
    chunks = plan.chunks()
    assert sum(c.hi - c.lo for c in chunks) == 8 * MiB
    assert all(c.broadcast and not c.takers for c in chunks)
    assert all(c.lo % BLOCK == 0 for c in chunks)
    assert sorted(plan.reads) == [1 * MiB] * 8  # 256 KiB chunks, four per rank
    assert {c.reader for c in chunks} == set(range(8))


def test_neighbours_share_the_block_between_their_parts() -> None:
    """Rank 0 needs bytes 0-150,000 and rank 1 the rest of a 500,000-byte shard: the block
    holding byte 150,000 is read once, by one of them, and the other gets its part of it."""
    entries = [
        [Entry("w", 0, (0, 150_000), (0, 3 * BLOCK), BLOCK)],
        [Entry("w", 0, (150_000, 500_000), (2 * BLOCK, 500_000), BLOCK)],
    ]
    plan = readonce.plan(entries)
    (chunk,) = plan.chunks()
    assert (chunk.lo, chunk.hi, chunk.broadcast) == (2 * BLOCK, 3 * BLOCK, False)
    other = 1 - chunk.reader
    want = (0, 150_000) if other == 0 else (150_000, 500_000)
    assert chunk.takers == ((other, max(want[0], 2 * BLOCK), min(want[1], 3 * BLOCK)),)
    assert sum(plan.reads) == 500_000
    assert all(n == 1 for n in coverage(plan, entries)[("w", 0)])


def test_small_savings_unsplittable_shards_and_disagreeing_units() -> None:
    small = [[Entry("b", 0, (0, 4 * KiB), (0, 4 * KiB), 4)] for _ in range(4)]
    assert readonce.plan(small).rounds == ()  # 12 KiB saved: under MIN_SAVING
    whole = [
        [Entry("v", 0, (0, 1000), (0, 300 * KiB), 0)],
        [Entry("v", 0, (200_000, 300 * KiB), (0, 300 * KiB), 0)],
    ]
    (chunk,) = readonce.plan(whole).chunks()
    assert (chunk.lo, chunk.hi) == (0, 300 * KiB)  # hashed whole: one chunk, never split
    taker = 1 - chunk.reader
    assert chunk.takers == ((taker, *whole[taker][0].need),)
    mixed = [
        [Entry("v", 0, (0, MiB), (0, MiB), BLOCK)],
        [Entry("v", 0, (0, MiB), (0, MiB), 4)],  # a rank that does not verify
    ]
    assert readonce.plan(mixed).rounds == ()


def test_rounds_hold_about_round_bytes() -> None:
    entries = [[Entry(f"t{i}", 0, (0, 4 * MiB), (0, 4 * MiB), BLOCK) for i in range(10)]] * 4
    plan = readonce.plan(entries, round_bytes=8 * MiB, chunk=2 * MiB)
    assert [sum(c.hi - c.lo for c in r) for r in plan.rounds] == [8 * MiB] * 5
    assert [c.ref for c in plan.chunks()] == [f"t{i}" for i in range(10) for _ in range(2)]


@pytest.mark.parametrize("seed", range(20))
def test_every_byte_is_read_once_and_every_need_is_met(seed: int) -> None:
    """Random parts of a few shards on a few ranks: every byte some rank reads is read from
    storage exactly once, and each rank gets every byte it needs (from its own reads, chunks it
    reads or chunks sent to it)."""
    rng = random.Random(seed)
    world = rng.randint(2, 6)
    unit = rng.choice([1024, 4096])
    entries: list[list[Entry]] = [[] for _ in range(world)]
    for shard in range(3):
        size = rng.randint(10, 40) * unit + rng.randint(0, unit - 1)
        for rank in range(world):
            if rng.random() < 0.3:
                continue
            a = rng.randrange(size)
            b = rng.randint(a + 1, size)
            read = (a // unit * unit, min(size, -(-b // unit) * unit))
            entries[rank].append(Entry("w", shard, (a, b), read, unit))
    plan = readonce.plan(entries, min_saving=1, chunk=4 * unit)
    for key, counts in coverage(plan, entries).items():
        spans = [e.read for es in entries for e in es if (e.ref, e.shard) == key]
        for i, n in enumerate(counts):
            assert n == (1 if any(lo <= i < hi for lo, hi in spans) else 0), (key, i)
    chunks = plan.chunks()
    for rank, es in enumerate(entries):
        for e in es:
            got = set()
            mine = [c for c in chunks if (c.ref, c.shard) == (e.ref, e.shard)]
            for lo, hi in readonce.uncovered(e.read, [(c.lo, c.hi) for c in mine]):
                got.update(range(lo, hi))
            for c in mine:
                if c.reader == rank:
                    got.update(range(c.lo, c.hi))
                for r, a, b in c.takers:
                    if r == rank:
                        got.update(range(a, b))
            assert set(range(*e.need)) <= got, (rank, e)


def test_uncovered() -> None:
    assert readonce.uncovered((0, 10), []) == [(0, 10)]
    assert readonce.uncovered((0, 10), [(2, 4), (6, 20)]) == [(0, 2), (4, 6)]
    assert readonce.uncovered((5, 10), [(0, 5), (10, 12)]) == [(5, 10)]
    assert readonce.uncovered((0, 10), [(0, 10)]) == []
