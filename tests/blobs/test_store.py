"""savepoint.blobs.store: put, dedupe, read whole and by range, recipes, verification, listing,
deleting, configuration; on the memory store (POSIX-like and object-like), the local store and
fsspec's memory filesystem."""

from __future__ import annotations

import json
import os
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from savepoint.blobs import BlobStore, Compression, FastMemo, PutStats, Recipe, frame, referenced_by
from savepoint.errors import (
    CheckpointError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
)
from savepoint.storage.local import LocalStore
from savepoint.storage.memory import MemoryStore

from .conftest import make

RNG = np.random.default_rng(17)
KiB = 1024


def payload(n: int) -> np.ndarray:
    return RNG.integers(0, 256, n, dtype=np.uint8)


def test_put_then_read(blobs: BlobStore) -> None:
    data = payload(100_000)
    result = blobs.put(data)
    assert result.written and result.size == 100_000 and result.stored == 100_000 + frame.HEADER
    assert result.digest == blobs.digest(data) == blobs.digest(data.tobytes())
    assert blobs.exists(result.digest)
    assert blobs.read(result.digest).tobytes() == data.tobytes()
    out = bytearray(100_000)
    blobs.read(result.digest, out=out, size=100_000)
    assert bytes(out) == data.tobytes()
    assert list(blobs.list()) == [result.digest]


def test_a_blob_is_written_once(blobs: BlobStore) -> None:
    data = payload(5000)
    stats = PutStats()
    first = blobs.put(data, stats=stats)
    again = blobs.put(bytes(data), stats=stats)
    assert first.written and not again.written and again.stored == 0
    assert (stats.blobs_written, stats.blobs_reused, stats.bytes_written) == (1, 1, 5000)
    assert (stats.bytes_in, stats.bytes_stored) == (10000, 5000 + frame.HEADER)


def test_empty_blob(blobs: BlobStore) -> None:
    result = blobs.put(b"")
    assert blobs.read(result.digest).size == 0
    recipe = blobs.put_chunked(b"", chunk_size=4 * KiB)
    assert recipe.digests == () and blobs.read_recipe(recipe).size == 0


def test_compressed_blob(blobs: BlobStore) -> None:
    data = (RNG.standard_normal(300_000) * 0.02).astype(np.float32)
    result = blobs.put(data, compression=Compression(level=3))
    assert result.stored < data.nbytes * 0.95
    info = blobs.info(result.digest)
    assert info.codec == "zstd" and info.size == data.nbytes and info.stored == result.stored
    assert blobs.read(result.digest).view(np.float32).tolist() == data.tolist()
    assert blobs.read_range(result.digest, 8, 40).tobytes() == data.tobytes()[8:40]
    # the same content put raw is the same blob: not written again
    assert not blobs.put(data).written


def test_read_range_of_a_raw_blob(blobs: BlobStore) -> None:
    data = payload(70_000)
    d = blobs.put(data).digest
    for start, end in [(0, 0), (0, 70_000), (123, 4567), (69_999, 70_000)]:
        assert blobs.read_range(d, start, end).tobytes() == data[start:end].tobytes()
        assert blobs.read_range(d, start, end, verify=True).tobytes() == data[start:end].tobytes()
    with pytest.raises(ValueError, match="outside"):
        blobs.read_range(d, 5, 70_001)


@pytest.mark.parametrize("compressed", [False, True])
def test_chunked_round_trip_and_ranges(blobs: BlobStore, compressed: bool) -> None:
    data = (RNG.standard_normal(50_000) * 0.01).astype(np.float32)  # 200,000 bytes
    policy = Compression(level=1) if compressed else None
    recipe = blobs.put_chunked(data, chunk_size=16 * KiB, compression=policy, workers=3)
    assert recipe.size == data.nbytes and len(recipe.digests) == -(-data.nbytes // (16 * KiB))
    raw = data.view(np.uint8)
    assert blobs.read_recipe(recipe, workers=2).tobytes() == raw.tobytes()
    for start, end in [(0, 1), (16 * KiB - 3, 16 * KiB + 5), (1000, 199_999), (200_000, 200_000)]:
        got = blobs.read_recipe(recipe, start=start, end=end)
        assert got.tobytes() == raw[start:end].tobytes()
    blobs.verify_recipe(recipe)
    assert referenced_by([recipe]) == set(recipe.digests)


def test_unchanged_chunks_are_not_written_again(blobs: BlobStore) -> None:
    rows = np.ascontiguousarray(RNG.standard_normal((1024, 64)).astype(np.float32))  # 256 KiB
    first = blobs.put_chunked(rows, chunk_size=16 * KiB)
    rows[5] += 1.0  # one row: one chunk changes
    stats = PutStats()
    second = blobs.put_chunked(rows, chunk_size=16 * KiB, stats=stats)
    changed = [i for i, (a, b) in enumerate(zip(first.digests, second.digests)) if a != b]
    assert changed == [0]
    assert (stats.blobs_written, stats.blobs_reused, stats.bytes_written) == (1, 15, 16 * KiB)


def test_memo_names_unchanged_chunks_without_rehashing(blobs: BlobStore) -> None:
    data = payload(64 * KiB)
    memo = FastMemo()
    a = blobs.put_chunked(data, chunk_size=16 * KiB, memo=memo)
    b = blobs.put_chunked(data, chunk_size=16 * KiB, memo=memo)
    assert a == b and memo.hits == 4
    data[0] ^= 1
    c = blobs.put_chunked(data, chunk_size=16 * KiB, memo=memo)
    assert c.digests[1:] == a.digests[1:] and c.digests[0] == blobs.digest(data[: 16 * KiB])


def test_inputs_numpy_views_and_dtypes(blobs: BlobStore) -> None:
    bf16 = RNG.standard_normal(1000).astype(ml_dtypes.bfloat16)
    recipe = blobs.put_chunked(bf16, chunk_size=4 * KiB, compression=Compression(min_saving=0.0))
    assert blobs.read_recipe(recipe).view(ml_dtypes.bfloat16).tolist() == bf16.tolist()
    strided = np.arange(100, dtype=np.int64)[::2]  # not contiguous: copied
    d = blobs.put(strided).digest
    assert blobs.read(d).view(np.int64).tolist() == strided.tolist()
    two_d = np.arange(12, dtype=np.float64).reshape(3, 4)
    assert blobs.put(two_d).digest == blobs.digest(two_d.tobytes())
    assert blobs.put(memoryview(two_d)).digest == blobs.digest(two_d.tobytes())
    with pytest.raises(ValueError, match="chunk_size"):
        blobs.put_chunked(b"x", chunk_size=100)


def test_missing_and_malformed_names(blobs: BlobStore) -> None:
    absent = "0" * 64
    assert not blobs.exists(absent)
    with pytest.raises(CorruptCheckpointError, match="missing"):
        blobs.read(absent)
    with pytest.raises(CorruptCheckpointError, match="not a blake3"):
        blobs.read("../../etc/passwd")
    assert blobs.delete(absent) is False


def test_delete_and_list(blobs: BlobStore) -> None:
    digests = {blobs.put(payload(100 + i)).digest for i in range(20)}
    assert set(blobs.list()) == digests
    gone = sorted(digests)[:5]
    for d in gone:
        assert blobs.delete(d)
    blobs.sync()
    assert set(blobs.list()) == digests - set(gone)


def _corrupt(blobs: BlobStore, digest: str, offset: int) -> None:
    """Rewrite blob ``digest`` with one byte flipped (through the store: any backend)."""
    path = blobs.path(digest)
    reader = blobs.store.open_blob(path)
    buf = bytearray(reader.size)
    reader.read(0, buf)
    reader.close()
    buf[offset] ^= 0x01
    blobs.store.remove(path)
    blobs.store.put(path, bytes(buf), exclusive=True)


@pytest.mark.parametrize("compressed", [False, True])
def test_corruption_is_detected(blobs: BlobStore, compressed: bool) -> None:
    data = (RNG.standard_normal(20_000) * 0.01).astype(np.float32)
    policy = Compression(min_saving=0.0) if compressed else None
    d = blobs.put(data, compression=policy).digest
    _corrupt(blobs, d, frame.HEADER + 500)
    with pytest.raises(CorruptCheckpointError):
        blobs.verify(d)
    with pytest.raises(CorruptCheckpointError):
        blobs.read(d)
    _corrupt(blobs, d, 3)  # the header's magic
    with pytest.raises(CorruptCheckpointError, match="magic"):
        blobs.read_range(d, 0, 4)


def test_a_damaged_blob_is_written_again(blobs: BlobStore) -> None:
    data = payload(10_000)
    d = blobs.put(data).digest
    path = blobs.path(d)
    blobs.store.remove(path)
    blobs.store.put(path, b"partial", exclusive=True)  # as a crash on a weak store leaves
    assert blobs.put(data).written
    blobs.verify(d)


def test_recipe_json_round_trip_and_hostile_recipes() -> None:
    recipe = Recipe("blake3", 10, 4, ("a" * 64, "b" * 64, "c" * 64))
    assert Recipe.from_json(json.loads(json.dumps(recipe.to_json()))) == recipe
    checked = Recipe("blake3", 10, 4, recipe.digests, ("0" * 16, "1" * 16, "2" * 16))
    assert Recipe.from_json(json.loads(json.dumps(checked.to_json()))) == checked
    assert recipe.checksum() is None
    assert [s for _, s, _ in recipe.spans()] == [0, 4, 8]
    good = recipe.to_json()
    for bad in [
        [],
        {**good, "extra": 1},
        {**good, "digest": "md5"},
        {**good, "size": True},
        {**good, "size": 13},
        {**good, "size": -1},
        {**good, "chunk": 0},
        {**good, "chunk": 1 << 40},
        {**good, "blobs": "abc"},
        {**good, "blobs": ["a" * 64, "b" * 64, "../" + "c" * 61]},
        {**good, "xxh3": ["0" * 16]},
        {**good, "xxh3": ["0" * 16, "1" * 16, "Z" * 16]},
        {**good, "xxh3": "0" * 48},
    ]:
        with pytest.raises(CorruptCheckpointError):
            Recipe.from_json(bad)


def test_recipe_must_match_the_store(blobs: BlobStore) -> None:
    recipe = Recipe("xxh3-128", 1, 4096, ("a" * 32,))
    with pytest.raises(IncompatibleCheckpointError, match="recipe"):
        blobs.read_recipe(recipe)


def test_configuration(tmp_path: Path) -> None:
    store, root = make("memory", tmp_path)
    with pytest.raises(CorruptCheckpointError, match="no blob store"):
        BlobStore(store, root, create=False)
    fast = BlobStore(store, root, algorithm="xxh3-128")
    assert BlobStore(store, root).algorithm == "xxh3-128"  # an existing store keeps its own
    with pytest.raises(IncompatibleCheckpointError, match="names its blobs by xxh3-128"):
        BlobStore(store, root, algorithm="blake3")
    with pytest.raises(IncompatibleCheckpointError):
        BlobStore(store, "/other", algorithm="sha1")
    d = fast.put(b"hello").digest
    assert len(d) == 32 and fast.read(d).tobytes() == b"hello"

    store.makedirs("/bad")
    store.makedirs("/worse")
    store.put("/bad/store.json", b'{"format": "savepoint-blobs", "version": 9, "digest": "blake3"}')
    with pytest.raises(IncompatibleCheckpointError, match="Upgrade"):
        BlobStore(store, "/bad")
    store.put("/worse/store.json", b"[1, 2]")
    with pytest.raises(CorruptCheckpointError, match="not a savepoint blob store"):
        BlobStore(store, "/worse")


def test_open_by_url(tmp_path: Path) -> None:
    local = BlobStore.open(tmp_path / "b")
    assert isinstance(local.store, LocalStore)
    d = local.put(b"abc").digest
    local.sync()
    assert os.path.isfile(tmp_path / "b" / "data" / d[:2] / d)
    mem = BlobStore.open("memory://blob-url-test/b")
    assert mem.read(mem.put(b"xyz").digest).tobytes() == b"xyz"


def test_local_layout_and_no_temporaries_left(tmp_path: Path) -> None:
    blobs = BlobStore(LocalStore(), str(tmp_path / "b"))
    recipe = blobs.put_chunked(payload(40 * KiB), chunk_size=8 * KiB, workers=2)
    blobs.sync()
    names = sorted(p.name for p in (tmp_path / "b" / "data").rglob("*") if p.is_file())
    assert names == sorted(recipe.digests)
    assert sorted(os.listdir(tmp_path / "b")) == ["data", "gc", "sessions", "store.json"]


def test_errors_are_checkpoint_errors(tmp_path: Path) -> None:
    from savepoint.storage.faults import FaultyStore

    store = FaultyStore(MemoryStore())
    blobs = BlobStore(store, "/b")
    store.fail("write")
    with pytest.raises(CheckpointError) as info:
        blobs.put(b"q" * 100)
    assert isinstance(info.value, OSError)
    assert list(blobs.entries()) == []  # nothing half-written left


def test_copy_from_another_store(blobs: BlobStore, tmp_path: Path) -> None:
    source = BlobStore(LocalStore(), str(tmp_path / "source"))
    data = (RNG.standard_normal(40_000) * 0.01).astype(np.float32)
    recipe = source.put_chunked(data, chunk_size=16 * KiB)
    blobs.put(data.view(np.uint8)[: 16 * KiB])  # the first chunk is there already
    stats = blobs.copy_from(source, recipe.digests, compression=Compression(min_saving=0.0))
    assert (stats.blobs_reused, stats.blobs_written) == (1, len(recipe.digests) - 1)
    assert blobs.read_recipe(recipe).tobytes() == data.tobytes()


def test_recipe_checks_are_manifest_block_checksums(blobs: BlobStore) -> None:
    from savepoint.codecs import checksum

    data = payload(100_000)
    recipe = blobs.put_chunked(data, chunk_size=16 * KiB)
    assert recipe.checksum() == checksum.of(memoryview(data), block=16 * KiB)
    single = blobs.put_chunked(data[:1000], chunk_size=16 * KiB)
    assert single.checksum() == checksum.of(memoryview(data[:1000]))


@pytest.mark.parametrize("full", [False, True])
def test_loads_check_chunks_by_their_checks(blobs: BlobStore, full: bool) -> None:
    data = payload(50_000)
    recipe = blobs.put_chunked(data, chunk_size=16 * KiB)
    _corrupt(blobs, recipe.digests[1], frame.HEADER + 7)
    with pytest.raises(CorruptCheckpointError, match="digest" if full else "checksum"):
        blobs.read_recipe(recipe, full=full)
    with pytest.raises(CorruptCheckpointError):
        blobs.read_recipe(recipe, start=16 * KiB + 1, end=16 * KiB + 2)
    blobs.read_recipe(recipe, start=0, end=16 * KiB)  # chunk 0 is fine
    with pytest.raises(CorruptCheckpointError):
        blobs.verify_recipe(recipe)
    # a wrong check in a recipe (a damaged manifest) is caught as well
    bad = Recipe(
        recipe.algorithm, recipe.size, recipe.chunk, recipe.digests, ("0" * 16, *recipe.checks[1:])
    )
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        blobs.read_recipe(bad, end=10)
