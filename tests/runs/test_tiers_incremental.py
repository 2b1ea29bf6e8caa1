"""Tiers of incremental runs (``CheckpointManager(..., incremental=True, tiers=[...])``): each tier
has its own blob store at ``<tier>/blobs``; a copy-up brings only the blobs the tier lacks;
retention on a tier deletes step directories and then exactly the blobs no kept checkpoint there
names; restore falls back tier by tier, bit-exactly, when the run directory is gone."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import savepoint as sp
import savepoint.blobs.store
from _compare import same
from savepoint.blobs import BlobPolicy, BlobStore
from savepoint.codecs import manifest as mf
from savepoint.runs import layout
from savepoint.runs.tiers import Tier, TierCopier
from storage import _s3server

POLICY = BlobPolicy(chunk_size=64 << 10, min_blob_bytes=16 << 10)
RUN = {"name": "t", "created": "2026-11-27T00:00:00Z"}
FROZEN = np.random.default_rng(0).standard_normal(200_000).astype(np.float32)  # 13 chunks


def state(step: int) -> dict[str, Any]:
    rng = np.random.default_rng(step)
    return {
        "frozen": FROZEN,
        "adapter": rng.standard_normal(20_000).astype(np.float32),  # 2 chunks, new every step
        "small": np.full(10, step, np.int64),
        "step": step,
    }


def empty() -> dict[str, Any]:
    return {
        "frozen": np.zeros_like(FROZEN),
        "adapter": np.zeros(20_000, np.float32),
        "small": np.zeros(10, np.int64),
        "step": 0,
    }


def named(where: Any) -> set[str]:
    """The blob digests the committed checkpoint at ``where`` names."""
    from savepoint.engine.read import Reader

    with Reader.open(where) as reader:
        return {d for recipe in mf.recipes(reader.manifest) for d in recipe.names()}


def saved(home: Path, step: int) -> str:
    """An incremental checkpoint of ``step`` in the run layout of ``home``."""
    path = layout.step_path(home, step)
    sp.save(path, state(step), blobs=home / "blobs", blob_policy=POLICY)
    return path


def blob_files(root: Path) -> dict[str, tuple[int, int]]:
    """digest -> (size, inode) of every blob under a local store."""
    return {
        p.name: (p.stat().st_size, p.stat().st_ino)
        for p in (root / "data").rglob("*")
        if p.is_file()
    }


def test_restores_bit_exactly_from_each_tier_once_the_run_directory_is_gone(
    tmp_path: Path,
) -> None:
    tiers = [
        Tier(str(tmp_path / "disk"), name="disk"),
        Tier("memory://t-tiers-inc/run", every=2, name="mem"),
    ]
    run = tmp_path / "run"
    with sp.CheckpointManager(
        run, name="r", incremental=True, keep_last=1, blob_policy=POLICY, tiers=tiers
    ) as mgr:
        for step in (1, 2, 3, 4):
            mgr.save(step, state(step))
        mgr.wait()
    assert layout.committed_steps(tmp_path / "disk") == [1, 2, 3, 4]
    assert layout.committed_steps("memory://t-tiers-inc/run") == [1, 3]
    for step in (1, 2, 3, 4):  # every copy names the tier's own store, which holds its blobs
        copy = layout.step_path(tmp_path / "disk", step)
        assert mf.parse(Path(copy, mf.NAME).read_bytes()).blob_store == "../../blobs"
        assert named(copy) <= set(BlobStore.open(tmp_path / "disk" / "blobs").list())
    shutil.rmtree(run)

    with sp.CheckpointManager(tmp_path / "run2", name="r", incremental=True, tiers=tiers) as again:
        into = empty()
        assert again.restore(into) == 4 and again.restored_from == "disk"
        same(into, state(4))
        into = empty()
        assert again.restore(into, 2, resume=False) == 2
        same(into, state(2))
    # A frozen blob on the disk tier rots: no copy there verifies; the memory tier has 1 and 3.
    disk_blobs = BlobStore.open(tmp_path / "disk" / "blobs", create=False)
    shared = set.intersection(*(named(layout.step_path(tmp_path / "disk", n)) for n in range(1, 5)))
    rotten = Path(disk_blobs.path(min(shared)))
    raw = bytearray(rotten.read_bytes())
    raw[-1] ^= 1
    rotten.chmod(0o644)
    rotten.write_bytes(bytes(raw))
    with sp.CheckpointManager(tmp_path / "run3", name="r", incremental=True, tiers=tiers) as last:
        into = empty()
        with pytest.warns(UserWarning, match=r"\(disk\) failed verification"):
            assert last.restore(into) == 3
        assert last.restored_from == "mem"
        same(into, state(3))
    shutil.rmtree(tmp_path / "disk")  # the disk is gone
    with sp.CheckpointManager(tmp_path / "run4", name="r", incremental=True, tiers=tiers) as last:
        into = empty()
        assert last.restore(into, 1, resume=False) == 1 and last.restored_from == "mem"
        same(into, state(1))


def test_a_second_copy_up_copies_only_the_changed_blobs(tmp_path: Path) -> None:
    home = tmp_path / "home"
    copier = TierCopier([Tier(str(tmp_path / "tier"))], RUN)
    copier.submit(1, saved(home, 1))
    copier.wait()
    copier.raise_error()
    first = blob_files(tmp_path / "tier" / "blobs")
    assert set(first) == named(layout.step_path(home, 1))
    copier.submit(2, saved(home, 2))
    copier.close()
    copier.raise_error()
    second = blob_files(tmp_path / "tier" / "blobs")
    new = set(second) - set(first)
    changed = named(layout.step_path(home, 2)) - named(layout.step_path(home, 1))
    assert new == changed and len(new) == 2  # the adapter's two chunks, nothing else
    assert sum(second[d][0] for d in new) == 32 + 65536 + 32 + (80_000 - 65536)  # headers + bytes
    assert {d: second[d] for d in first} == first  # the frozen blobs were not written again
    same(sp.load(layout.step_path(tmp_path / "tier", 2)), state(2))


def test_tier_retention_keeps_exactly_the_referenced_blobs(tmp_path: Path) -> None:
    tier = Tier(str(tmp_path / "tier"), keep=2)
    run = tmp_path / "run"
    with sp.CheckpointManager(
        run, name="r", incremental=True, keep_last=1, blob_policy=POLICY, tiers=[tier]
    ) as mgr:
        for step in (1, 2, 3, 4, 5):
            mgr.save(step, state(step))
            mgr.wait()
    where = tmp_path / "tier"
    assert layout.committed_steps(where) == [4, 5]
    kept = named(layout.step_path(where, 4)) | named(layout.step_path(where, 5))
    held = set(BlobStore.open(where / "blobs", create=False).list())
    assert held == kept  # the adapters of steps 1-3 are gone, the frozen blobs stay
    assert len(held) == 13 + 2 + 2
    shutil.rmtree(run)
    for step in (4, 5):
        sp.verify(layout.step_path(where, step))
        same(sp.load(layout.step_path(where, step)), state(step))


def test_a_dead_copy_ups_record_does_not_hold_the_tiers_collection_back(
    tmp_path: Path,
) -> None:
    """A copy-up killed on this host left its session record in the tier's store: the next
    copier's first collection there removes it (its pid is gone), instead of being deferred
    for an hour."""
    import json
    import socket
    import subprocess
    import sys

    home = tmp_path / "home"
    tier_dir = tmp_path / "tier"
    tier = Tier(str(tier_dir), keep=1)
    first = TierCopier([tier], RUN)
    first.submit(1, saved(home, 1))
    first.close()
    first.raise_error()
    # the pid of a process that has exited
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], check=True, capture_output=True
    )
    pid = int(done.stdout)
    record = tier_dir / "blobs" / "sessions" / "killed.json"
    record.write_text(json.dumps({"kind": "save", "host": socket.gethostname(), "pid": pid}))
    copier = TierCopier([tier], RUN)
    for step in (2, 3):
        copier.submit(step, saved(home, step))
        copier.wait()
        copier.raise_error()
    copier.close()
    assert not record.exists()
    assert layout.committed_steps(tier_dir) == [3]
    held = set(BlobStore.open(tier_dir / "blobs", create=False).list())
    assert held == named(layout.step_path(tier_dir, 3))


def test_a_failed_copy_up_is_raised_naming_the_tier(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = Tier(str(tmp_path / "tier"), name="scratch")
    real = BlobStore.copy_stored

    def full(self: BlobStore, *args: Any, **kwargs: Any) -> Any:
        raise OSError(28, "No space left on device")

    run = tmp_path / "run"
    mgr = sp.CheckpointManager(run, name="r", incremental=True, blob_policy=POLICY, tiers=[tier])
    monkeypatch.setattr(savepoint.blobs.store.BlobStore, "copy_stored", full)
    mgr.save(1, state(1))
    with pytest.raises(sp.CheckpointWriteError, match="step 1 to tier 'scratch'") as caught:
        mgr.wait()
    assert "No space left" in str(caught.value)
    assert layout.committed_steps(tmp_path / "tier") == []  # nothing committed there
    monkeypatch.setattr(savepoint.blobs.store.BlobStore, "copy_stored", real)
    mgr.save(2, state(2))
    mgr.close()
    assert layout.committed_steps(tmp_path / "tier") == [2]
    same(sp.load(layout.step_path(tmp_path / "tier", 2)), state(2))


def test_a_damaged_run_blob_fails_the_copy_up_naming_tier_and_tensor(tmp_path: Path) -> None:
    home = tmp_path / "home"
    source = saved(home, 1)
    m = mf.parse(Path(source, mf.NAME).read_bytes())
    victim = m.tensors["adapter"].recipe.digests[1]
    Path(BlobStore.open(home / "blobs").path(victim)).unlink()
    copier = TierCopier([Tier(str(tmp_path / "tier"), name="disk")], RUN)
    copier.submit(1, source)
    copier.close()
    with pytest.raises(sp.CheckpointWriteError, match="step 1 to tier 'disk'") as caught:
        copier.raise_error()
    cause = caught.value.__cause__
    assert isinstance(cause, sp.CorruptCheckpointError) and cause.key == "adapter"
    assert layout.committed_steps(tmp_path / "tier") == []


def test_incremental_tiers_are_accepted_by_the_manager(tmp_path: Path) -> None:
    tier = Tier(str(tmp_path / "tier"))
    with sp.CheckpointManager(tmp_path / "run", incremental=True, tiers=[tier]) as mgr:
        assert mgr.incremental


@pytest.mark.skipif(not _s3server.AVAILABLE, reason=_s3server.SKIP_REASON)
def test_an_s3_tier(tmp_path: Path, s3_bucket: str) -> None:
    url = f"s3://{s3_bucket}/run"
    tier = Tier(url, keep=1, name="s3")
    run = tmp_path / "run"
    with sp.CheckpointManager(
        run, name="r", incremental=True, blob_policy=POLICY, tiers=[tier]
    ) as mgr:
        for step in (1, 2):
            mgr.save(step, state(step))
            mgr.wait()
    assert layout.committed_steps(url) == [2]
    held = set(BlobStore.open(f"{url}/blobs", create=False).list())
    assert held == named(layout.step_location(sp_location(url), 2))
    shutil.rmtree(run)
    with sp.CheckpointManager(tmp_path / "run2", name="r", incremental=True, tiers=[tier]) as again:
        into = empty()
        assert again.restore(into) == 2 and again.restored_from == "s3"
        same(into, state(2))


def sp_location(url: str) -> Any:
    from savepoint.storage.paths import resolve

    return resolve(url, what="tier")
