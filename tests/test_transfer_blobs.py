"""sp.copy of incremental (version 4, blob-backed) checkpoints: the blobs they name go to the blob
store at the same relative place from the destination, only those missing there, as stored and
checked on the way, inside a session of that store; ``materialize=True`` writes a plain
checkpoint instead. Damage at the source is a CorruptCheckpointError naming the tensor, and
nothing is committed at the destination."""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

import savepoint as sp
import savepoint.blobs.store
from _compare import same
from savepoint.blobs import BlobPolicy, BlobStore, Compression, PutStats
from savepoint.codecs import manifest as mf
from savepoint.storage.memory import MemoryStore
from savepoint.storage.paths import Location
from storage import _s3server

POLICY = BlobPolicy(chunk_size=64 << 10, min_blob_bytes=16 << 10)
ZSTD = BlobPolicy(chunk_size=64 << 10, min_blob_bytes=16 << 10, compression=Compression())


def state(seed: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {
        "model": {
            "w": rng.standard_normal((512, 300)).astype(np.float32),  # 600 KiB: 10 chunks
            "bf": (rng.standard_normal(40000) * 0.01).astype(np.float16),  # compresses
            "ids": rng.integers(0, 1 << 62, 8192, dtype=np.int64),  # 64 KiB, incompressible
            "b": rng.standard_normal(300).astype(np.float32),  # a data file
            "mask": rng.integers(0, 2, 40000).astype(bool),
        },
        "step": seed,
        "name": "run",
    }


def saved(tmp_path: Path, policy: BlobPolicy = POLICY, seed: int = 0) -> tuple[Path, Any]:
    s = state(seed)
    ck = tmp_path / "src" / "ck"
    sp.save(ck, s, blobs=tmp_path / "src" / "blobs", blob_policy=policy)
    return ck, s


def named(ck: Path | str, where: Any = None) -> set[str]:
    """Every blob digest the manifest at ``ck`` names."""
    raw = Path(ck, mf.NAME).read_bytes() if where is None else where
    found: set[str] = set()
    for rec in mf.parse(raw).tensors.values():
        if rec.recipe is not None:
            found.update(rec.recipe.digests)
    return found


def blob_files(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in (root / "data").rglob("*") if p.is_file()}


def test_a_copy_brings_the_blobs_as_stored_and_then_only_the_missing_ones(
    tmp_path: Path,
) -> None:
    ck, s = saved(tmp_path, ZSTD)
    stats = PutStats()
    info = sp.copy(ck, tmp_path / "dst" / "ck", stats=stats)
    assert info.format_version == mf.BLOBS
    # the manifest is unchanged, the blobs are at ../blobs from the copy
    assert (tmp_path / "dst" / "ck" / mf.NAME).read_bytes() == (ck / mf.NAME).read_bytes()
    copied = blob_files(tmp_path / "dst" / "blobs")
    source = blob_files(tmp_path / "src" / "blobs")
    assert set(copied) == named(ck) and copied == source  # byte for byte: zstd stays zstd
    codecs = {BlobStore.open(tmp_path / "dst" / "blobs").info(d).codec for d in copied}
    assert codecs == {"raw", "zstd"}
    assert stats.blobs_written == len(named(ck)) and stats.blobs_reused == 0
    assert stats.bytes_stored == sum(len(b) for b in copied.values())
    # the destination's store is the source's kind (same digest) and holds no session record
    assert json.loads((tmp_path / "dst" / "blobs" / "store.json").read_bytes())["digest"] == (
        "blake3"
    )
    assert os.listdir(tmp_path / "dst" / "blobs" / "sessions") == []
    shutil_rmtree(tmp_path / "src")  # the copy needs nothing of the source
    same(sp.load(tmp_path / "dst" / "ck"), s)
    sp.verify(tmp_path / "dst" / "ck")

    # A second checkpoint of the run changed one tensor: only its blobs travel.
    s2 = state(0)
    s2["model"]["w"][:16] += 1.0  # the first 16 rows: 19 KiB, inside the first chunk
    sp.save(tmp_path / "src2" / "ck", s2, blobs=tmp_path / "src2" / "blobs", blob_policy=ZSTD)
    again = PutStats()
    sp.copy(tmp_path / "src2" / "ck", tmp_path / "dst" / "ck2", stats=again)
    assert (
        again.blobs_written == 1 and again.blobs_reused == len(named(tmp_path / "dst" / "ck2")) - 1
    )
    assert again.bytes_written == 64 << 10
    same(sp.load(tmp_path / "dst" / "ck2"), s2)
    same(sp.load(tmp_path / "dst" / "ck"), s)


def shutil_rmtree(path: Path) -> None:
    import shutil

    shutil.rmtree(path)


def test_a_copy_next_to_the_source_copies_no_blob(tmp_path: Path) -> None:
    ck, s = saved(tmp_path)
    before = blob_files(tmp_path / "src" / "blobs")
    stats = PutStats()
    sp.copy(ck, tmp_path / "src" / "ck2", stats=stats)
    assert stats.blobs_written == 0 and stats.blobs_reused == len(named(ck))
    assert blob_files(tmp_path / "src" / "blobs") == before
    same(sp.load(tmp_path / "src" / "ck2"), s)


def test_a_blob_store_of_another_digest_is_refused_untouched(tmp_path: Path) -> None:
    ck, _ = saved(tmp_path)
    other = BlobStore.open(tmp_path / "dst" / "blobs", algorithm="xxh3-128")
    other.put(b"x" * 100)
    before = blob_files(tmp_path / "dst" / "blobs")
    with pytest.raises(sp.IncompatibleCheckpointError, match="xxh3-128") as caught:
        sp.copy(ck, tmp_path / "dst" / "ck")
    assert "nothing was copied" in str(caught.value)
    assert not (tmp_path / "dst" / "ck").exists()
    assert blob_files(tmp_path / "dst" / "blobs") == before
    assert sorted(os.listdir(tmp_path / "dst")) == ["blobs"]


def test_overwrite_false_refuses_before_any_blob_is_written(tmp_path: Path) -> None:
    ck, _ = saved(tmp_path)
    sp.save(tmp_path / "dst" / "ck", {"x": np.zeros(3)})
    with pytest.raises(sp.CheckpointWriteError, match="overwrite=False"):
        sp.copy(ck, tmp_path / "dst" / "ck", overwrite=False)
    assert sorted(os.listdir(tmp_path / "dst")) == ["ck"]  # no blob store made


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("damage", ["missing", "flipped", "header"])
@pytest.mark.parametrize("policy", [POLICY, ZSTD], ids=["raw", "zstd"])
def test_a_damaged_source_blob_names_the_tensor_and_commits_nothing(
    tmp_path: Path, verify: bool, damage: str, policy: BlobPolicy
) -> None:
    ck, _ = saved(tmp_path, policy)
    m = mf.parse((ck / mf.NAME).read_bytes())
    digest = m.tensors["model/w"].recipe.digests[3]
    path = BlobStore.open(tmp_path / "src" / "blobs").path(digest)
    if damage == "missing":
        os.remove(path)
    else:
        raw = bytearray(Path(path).read_bytes())
        raw[-5 if damage == "flipped" else 9] ^= 0x10
        os.chmod(path, 0o644)
        Path(path).write_bytes(bytes(raw))
    for materialize in (False, True):
        dst = tmp_path / f"dst-{materialize}" / "ck"
        with pytest.raises(sp.CorruptCheckpointError, match="model/w") as caught:
            sp.copy(ck, dst, verify=verify, materialize=materialize)
        assert caught.value.key == "model/w"
        assert not dst.exists()
        assert os.listdir(dst.parent) in ([], ["blobs"])  # garbage blobs at most, no checkpoint


def test_materialize_writes_a_plain_checkpoint_needing_no_blob_store(tmp_path: Path) -> None:
    ck, s = saved(tmp_path, ZSTD)
    seen: list[tuple[int, int]] = []
    info = sp.copy(
        ck, tmp_path / "plain", materialize=True, progress=lambda d, t: seen.append((d, t))
    )
    assert info.format_version == mf.UNSHARDED
    m = mf.parse((tmp_path / "plain" / mf.NAME).read_bytes())
    assert m.format_version == mf.UNSHARDED and m.blob_store is None
    assert m.metadata == mf.parse((ck / mf.NAME).read_bytes()).metadata
    assert all(rec.recipe is None for rec in m.tensors.values())
    assert seen and seen[-1][0] == seen[-1][1]
    assert all(a[0] <= b[0] for a, b in itertools.pairwise(seen))
    shutil_rmtree(tmp_path / "src")
    same(sp.load(tmp_path / "plain"), s)
    sp.verify(tmp_path / "plain")
    # a plain checkpoint copied with materialize=True is copied as it is
    sp.copy(tmp_path / "plain", tmp_path / "plain2", materialize=True)
    assert (tmp_path / "plain2" / mf.NAME).read_bytes() == (
        tmp_path / "plain" / mf.NAME
    ).read_bytes()


def test_a_collection_during_the_copy_is_held_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The copy runs in a session of the destination's store: a collection there that knows of
    no checkpoint using the reused blobs deletes nothing while the copy is in flight."""
    ck, s = saved(tmp_path)
    sp.copy(ck, tmp_path / "dst" / "first")  # every blob is there now
    dest = BlobStore.open(tmp_path / "dst" / "blobs")
    shutil_rmtree(tmp_path / "dst" / "first")  # ... and referenced by nothing
    reports = []
    real = BlobStore.copy_stored

    def racing(self: BlobStore, *args: Any, **kwargs: Any) -> Any:
        reports.append(dest.collect(set(), grace=0))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(savepoint.blobs.store.BlobStore, "copy_stored", racing)
    sp.copy(ck, tmp_path / "dst" / "ck")
    assert reports and all(r.deferred and not r.deleted for r in reports)
    same(sp.load(tmp_path / "dst" / "ck"), s)


def test_memory_stores_with_and_without_rename_and_back(tmp_path: Path) -> None:
    ck, s = saved(tmp_path, ZSTD)
    sp.copy(ck, "memory://t-copy-blobs/run/ck")
    same(sp.load("memory://t-copy-blobs/run/ck"), s)
    assert set(BlobStore.open("memory://t-copy-blobs/run/blobs").list()) == named(ck)
    objects = MemoryStore(atomic_rename=False)  # an object store: manifest-last generations
    sp.copy("memory://t-copy-blobs/run/ck", Location(objects, "/run/ck"))
    same(sp.load(Location(objects, "/run/ck")), s)
    sp.verify(Location(objects, "/run/ck"))
    assert set(BlobStore(objects, "/run/blobs", create=False).list()) == named(ck)
    sp.copy(Location(objects, "/run/ck"), tmp_path / "back" / "ck")
    same(sp.load(tmp_path / "back" / "ck"), s)
    sp.copy(Location(objects, "/run/ck"), tmp_path / "plain", materialize=True)
    same(sp.load(tmp_path / "plain"), s)


@pytest.mark.skipif(not _s3server.AVAILABLE, reason=_s3server.SKIP_REASON)
def test_s3_and_back(tmp_path: Path, s3_bucket: str) -> None:
    ck, s = saved(tmp_path, ZSTD)
    url = f"s3://{s3_bucket}/run/ck"  # its blobs go to ../blobs from there
    sp.copy(ck, url)
    assert set(BlobStore.open(f"s3://{s3_bucket}/run/blobs", create=False).list()) == named(ck)
    same(sp.load(url), s)
    stats = PutStats()
    sp.copy(ck, f"s3://{s3_bucket}/run/ck2", stats=stats)
    assert stats.blobs_written == 0
    sp.copy(url, tmp_path / "back" / "run" / "ck")
    same(sp.load(tmp_path / "back" / "run" / "ck"), s)
    sp.copy(url, tmp_path / "plain", materialize=True)
    same(sp.load(tmp_path / "plain"), s)


def test_cli_copy_and_materialize(tmp_path: Path) -> None:
    from savepoint.cli import main

    ck, s = saved(tmp_path)
    runner = CliRunner()
    result = runner.invoke(main, ["copy", str(ck), str(tmp_path / "dst" / "ck"), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["version"] == mf.BLOBS and doc["materialized"] is False
    assert doc["blobs_copied"] == len(named(ck)) and doc["blob_bytes"] > 0
    result = runner.invoke(main, ["copy", str(ck), str(tmp_path / "plain"), "--materialize"])
    assert result.exit_code == 0, result.output
    assert "as a plain checkpoint" in result.stdout
    shutil_rmtree(tmp_path / "src")
    same(sp.load(tmp_path / "plain"), s)
    same(sp.load(tmp_path / "dst" / "ck"), s)


def test_a_blob_store_at_the_top_of_the_destination_store_is_refused(tmp_path: Path) -> None:
    run = tmp_path / "run"
    s = state()
    sp.save(run / "checkpoints" / "step-1", s, blobs=run / "blobs", blob_policy=POLICY)
    objects = MemoryStore()
    with pytest.raises(sp.UnsupportedStateError, match="top of the store"):
        sp.copy(run / "checkpoints" / "step-1", Location(objects, "/bucket/ck"))
    assert objects.stat("/bucket/ck") is None and objects.stat("/blobs") is None
    sp.copy(run / "checkpoints" / "step-1", Location(objects, "/bucket/checkpoints/ck"))
    same(sp.load(Location(objects, "/bucket/checkpoints/ck")), s)
    assert objects.stat("/bucket/blobs/store.json") is not None


def test_copy_stored_refuses_another_digest_and_keeps_the_codec() -> None:
    data = np.zeros(100_000, np.float32)
    source = BlobStore(MemoryStore(), "/a")
    put = source.put(data, compression=Compression())
    dest = BlobStore(MemoryStore(), "/b")
    first = dest.copy_stored(source, put.digest, size=data.nbytes)
    assert first.written and first.stored == put.stored
    assert dest.info(put.digest).codec == "zstd"
    assert not dest.copy_stored(source, put.digest, size=data.nbytes).written
    assert dest.read(put.digest).tobytes() == data.tobytes()
    other = BlobStore(MemoryStore(), "/c", algorithm="xxh3-128")
    with pytest.raises(sp.IncompatibleCheckpointError):
        other.copy_stored(source, put.digest)
    with pytest.raises(sp.CorruptCheckpointError, match="checksum"):
        BlobStore(MemoryStore(), "/d").copy_stored(source, put.digest, check="0" * 16)


def test_an_incremental_save_on_a_store_without_rename_reads_back() -> None:
    """The manifest is in a generation directory under the checkpoint's path there; its
    blob_store is relative to the checkpoint's path."""
    objects = MemoryStore(atomic_rename=False)
    s = state()
    sp.save(
        Location(objects, "/run/ck"), s, blobs=BlobStore(objects, "/run/blobs"), blob_policy=POLICY
    )
    assert all(name.startswith("gen-") for name in objects.list("/run/ck"))
    same(sp.load(Location(objects, "/run/ck")), s)
    sp.verify(Location(objects, "/run/ck"))


def test_the_blobs_are_durable_before_the_manifest_commits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from savepoint.commit.transaction import Transaction

    ck, _ = saved(tmp_path)
    events: list[str] = []
    real_sync, real_commit, real_copy = BlobStore.sync, Transaction.commit, BlobStore.copy_stored

    def sync(self: BlobStore) -> None:
        events.append("sync")
        real_sync(self)

    def commit(self: Transaction, manifest: Any) -> str:
        events.append("commit")
        return real_commit(self, manifest)

    def copy_stored(self: BlobStore, *args: Any, **kwargs: Any) -> Any:
        result = real_copy(self, *args, **kwargs)
        events.append("blob")
        return result

    monkeypatch.setattr(BlobStore, "sync", sync)
    monkeypatch.setattr(Transaction, "commit", commit)
    monkeypatch.setattr(BlobStore, "copy_stored", copy_stored)
    sp.copy(ck, tmp_path / "dst" / "ck")
    last_blob = max(i for i, e in enumerate(events) if e == "blob")
    assert "sync" in events[last_blob : events.index("commit")]
