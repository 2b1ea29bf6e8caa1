"""Patched tensors through the engine and the manager (issue 17, the recommendation-style
state): an embedding whose scattered rows change between saves is saved as a patch of the
changed rows (a version 5 checkpoint) and loads, verifies, exports and survives retention
bit-exactly."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import savepoint as sp
from savepoint.blobs import BlobPolicy, BlobStore
from savepoint.codecs import manifest as mf
from savepoint.errors import CorruptCheckpointError

POLICY = BlobPolicy(chunk_size=64 << 10, min_blob_bytes=16 << 10)


def embedding(rows: int = 8192, dim: int = 64) -> np.ndarray[Any, Any]:
    return np.random.default_rng(0).standard_normal((rows, dim), dtype=np.float32)


def touch(table: np.ndarray[Any, Any], seed: int, fraction: float = 0.01) -> None:
    rng = np.random.default_rng(seed)
    rows = rng.choice(table.shape[0], int(table.shape[0] * fraction), replace=False)
    table[rows] += rng.standard_normal((rows.size, table.shape[1])).astype(np.float32)


def data_bytes(blobs: Path) -> int:
    return sum(p.stat().st_size for p in (blobs / "data").rglob("*") if p.is_file())


def test_scattered_row_changes_are_saved_as_patches_and_load_exactly(tmp_path: Path) -> None:
    table = embedding()  # 2 MiB: 32 chunks of 64 KiB, rows of 256 bytes
    bias = np.arange(1000, dtype=np.float32)
    blobs = tmp_path / "blobs"
    states = []
    for step in range(4):
        if step:
            touch(table, step)
        state = {"emb": table, "bias": bias, "step": step}
        before = data_bytes(blobs) if blobs.exists() else 0
        info = sp.save(tmp_path / f"ck{step}", state, blobs=blobs, blob_policy=POLICY)
        written = data_bytes(blobs) - before
        states.append({"emb": table.copy(), "bias": bias, "step": step})
        if step == 0:
            assert info.format_version == mf.BLOBS
        else:
            assert info.format_version == mf.PATCHES
            assert written <= 0.015 * table.nbytes  # 1% of the rows, plus the block numbers
    for step, want in enumerate(states):
        ck = tmp_path / f"ck{step}"
        out = sp.load(ck)
        assert out["emb"].tobytes() == want["emb"].tobytes() and out["step"] == step
        sp.verify(ck)
        assert {t.key: t.shape for t in sp.inspect(ck).tensors}["emb"] == (8192, 64)
        into = {"emb": np.zeros_like(table)}
        sp.load(ck, into=into, keys="emb")
        assert into["emb"].tobytes() == want["emb"].tobytes()
        mapped = sp.load(ck, keys="emb", mmap=True)
        assert np.asarray(mapped["emb"]).tobytes() == want["emb"].tobytes()
    m = mf.parse((tmp_path / "ck3" / mf.NAME).read_bytes())
    recipe = m.tensors["emb"].recipe
    assert len(recipe.patches) == 3 and recipe.digests == (
        mf.parse((tmp_path / "ck0" / mf.NAME).read_bytes()).tensors["emb"].recipe.digests
    )


def test_patched_checkpoints_export_to_plain_safetensors(tmp_path: Path) -> None:
    from safetensors.numpy import load_file

    table = embedding()
    sp.save(tmp_path / "a", {"emb": table}, blobs=tmp_path / "blobs", blob_policy=POLICY)
    touch(table, 1)
    sp.save(tmp_path / "b", {"emb": table}, blobs=tmp_path / "blobs", blob_policy=POLICY)
    sp.convert(tmp_path / "b", tmp_path / "out.safetensors", lossy=True)
    assert load_file(str(tmp_path / "out.safetensors"))["emb"].tobytes() == table.tobytes()


def test_a_damaged_patch_blob_is_a_corrupt_checkpoint_naming_the_tensor(tmp_path: Path) -> None:
    table = embedding()
    blobs = tmp_path / "blobs"
    sp.save(tmp_path / "a", {"emb": table}, blobs=blobs, blob_policy=POLICY)
    touch(table, 1)
    sp.save(tmp_path / "b", {"emb": table}, blobs=blobs, blob_policy=POLICY)
    patch = mf.parse((tmp_path / "b" / mf.NAME).read_bytes()).tensors["emb"].recipe.patches[0]
    path = blobs / "data" / patch.blob[:2] / patch.blob
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0x10
    path.chmod(0o644)
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError, match="emb"):
        sp.load(tmp_path / "b")
    with pytest.raises(CorruptCheckpointError):
        sp.verify(tmp_path / "b")
    assert sp.load(tmp_path / "a")["emb"].shape == table.shape  # the base alone is intact


def test_patches_can_be_switched_off(tmp_path: Path) -> None:
    policy = BlobPolicy(chunk_size=64 << 10, min_blob_bytes=16 << 10, patches=False)
    table = embedding()
    sp.save(tmp_path / "a", {"emb": table}, blobs=tmp_path / "blobs", blob_policy=policy)
    touch(table, 1)
    info = sp.save(tmp_path / "b", {"emb": table}, blobs=tmp_path / "blobs", blob_policy=policy)
    assert info.format_version == mf.BLOBS


def test_retention_keeps_the_base_and_patches_of_every_retained_checkpoint(
    tmp_path: Path,
) -> None:
    """keep_last=2 over a dozen saves that each change 1% of the rows: the first checkpoint (the
    base of the chain) is deleted early, yet every retained checkpoint restores bit-exactly and
    the store holds exactly the blobs they name, base and patches."""
    policy = BlobPolicy(chunk_size=64 << 10, min_blob_bytes=16 << 10, max_patches=5)
    table = embedding()
    run = tmp_path / "run"
    history: dict[int, bytes] = {}
    with sp.CheckpointManager(run, incremental=True, keep_last=2, blob_policy=policy) as mgr:
        for step in range(1, 13):
            touch(table, step)
            mgr.save(step, {"emb": table, "step": step})
            mgr.wait()
            history[step] = table.tobytes()
            blobs = BlobStore.open(run / "blobs", create=False)
            named: set[str] = set()
            for kept in mgr.steps():
                m = mf.parse((Path(mgr.step_path(kept)) / mf.NAME).read_bytes())
                for t in m.tensors.values():
                    if t.recipe is not None:
                        named.update(t.recipe.names())
                out = sp.load(mgr.step_path(kept))
                assert out["emb"].tobytes() == history[kept] and out["step"] == kept
            assert set(blobs.list()) == named
        assert mgr.steps() == [11, 12]
        lengths = [
            len(
                mf.parse((Path(mgr.step_path(s)) / mf.NAME).read_bytes())
                .tensors["emb"]
                .recipe.patches
            )
            for s in (11, 12)
        ]
        assert lengths == [4, 5]  # rebased at step 7 (max_patches=5): 7 is the base of 8-12
        sp.verify(mgr.step_path(12))
    with sp.CheckpointManager(run, incremental=True, blob_policy=policy) as again:
        state = {"emb": np.zeros_like(table), "step": 0}
        assert again.restore(state) == 12
        assert state["emb"].tobytes() == history[12]
        touch(table, 99)  # a new process: chunks first (deduped), patches after
        again.save(13, {"emb": table, "step": 13})
        again.wait()
        again.save(14, {"emb": table, "step": 14})
        again.wait()
        assert sp.load(again.step_path(14))["emb"].tobytes() == table.tobytes()


def test_copy_and_materialize_carry_the_patches(tmp_path: Path) -> None:
    table = embedding()
    src = tmp_path / "src"
    sp.save(src / "a", {"emb": table}, blobs=src / "blobs", blob_policy=POLICY)
    touch(table, 1)
    sp.save(src / "b", {"emb": table}, blobs=src / "blobs", blob_policy=POLICY)
    recipe = mf.parse((src / "b" / mf.NAME).read_bytes()).tensors["emb"].recipe
    sp.copy(src / "b", tmp_path / "dst" / "b")
    held = set(BlobStore.open(tmp_path / "dst" / "blobs", create=False).list())
    assert held == set(recipe.names())
    assert sp.load(tmp_path / "dst" / "b")["emb"].tobytes() == table.tobytes()
    sp.verify(tmp_path / "dst" / "b")
    sp.copy(src / "b", tmp_path / "plain", materialize=True)
    assert sp.verify(tmp_path / "plain").format_version < mf.BLOBS
    assert sp.load(tmp_path / "plain")["emb"].tobytes() == table.tobytes()
    # a damaged patch: the copy names the tensor and commits nothing
    path = src / "blobs" / "data" / recipe.patches[0].blob[:2] / recipe.patches[0].blob
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1
    path.chmod(0o644)
    path.write_bytes(bytes(raw))
    for kw in ({}, {"materialize": True}):
        target = tmp_path / f"bad{len(kw)}" / "b"
        with pytest.raises(CorruptCheckpointError, match="emb"):
            sp.copy(src / "b", target, **kw)
        assert not (target / mf.NAME).exists()


def test_background_saves_patch_from_the_staged_copy(tmp_path: Path) -> None:
    """async_save=True: the rows are found changed in the staging arena's copy; the caller
    changes the table as soon as save() returns, and every checkpoint still holds what it was
    given."""
    table = embedding()
    run = tmp_path / "run"
    history: dict[int, bytes] = {}
    with sp.CheckpointManager(
        run,
        incremental=True,
        async_save=True,
        writer="thread",
        keep_last=3,
        blob_policy=POLICY,
    ) as mgr:
        for step in range(1, 7):
            touch(table, step)
            history[step] = table.tobytes()
            mgr.save(step, {"emb": table})
            table[:50] = -1.0  # while the background save runs: never seen by it
            table[:50] = np.frombuffer(history[step], np.float32).reshape(table.shape)[:50]
        mgr.wait()
        versions = [sp.inspect(mgr.step_path(s)).format_version for s in mgr.steps()]
        assert versions == [mf.PATCHES] * 3
        for s in mgr.steps():
            assert sp.load(mgr.step_path(s))["emb"].tobytes() == history[s]
            sp.verify(mgr.step_path(s))


def test_inspect_and_ls_show_where_blob_tensors_are_and_their_size(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from savepoint.cli import main

    table = embedding()
    run = tmp_path / "run"
    with sp.CheckpointManager(run, incremental=True, blob_policy=POLICY) as mgr:
        for step in (1, 2):
            touch(table, step)
            mgr.save(step, {"emb": table})
            mgr.wait()
        files = {t.key: t.file for t in sp.inspect(mgr.step_path(2)).tensors}
        assert files["emb"] == "blobs (32 chunks + 1 patch)"
    out = CliRunner().invoke(main, ["ls", "--json", str(run)], catch_exceptions=False)
    rows = json.loads(out.output)["checkpoints"]
    assert [r["bytes"] for r in rows] == [table.nbytes, table.nbytes]


# -- frozen=: tensors the caller says never change ----------------------------------------------


def test_frozen_keys_match_whole_components() -> None:
    from savepoint.blobs.patch import frozen_keys

    match = frozen_keys(["model/base", "emb/"])
    assert match("model/base") and match("model/base/w") and match("emb/x")
    assert not match("model/baseline") and not match("model") and not match("embedding")
    with pytest.raises(TypeError):
        frozen_keys("model/base")
    with pytest.raises(ValueError, match="not a key prefix"):
        frozen_keys(["model", "/"])


@pytest.mark.parametrize("background", [False, True])
def test_frozen_tensors_are_reused_unread_and_a_broken_promise_is_caught(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, background: bool
) -> None:
    base = np.random.default_rng(1).standard_normal((1024, 512)).astype(np.float32)  # 2 MiB
    adapter = np.zeros((64, 512), np.float32)
    run = tmp_path / "run"
    with sp.CheckpointManager(
        run,
        incremental=True,
        blob_policy=POLICY,
        frozen=["model/base"],
        async_save=background,
        writer="thread" if background else None,  # (its warning is logged in this process)
    ) as mgr:
        mgr.save(1, {"model": {"base": base, "adapter": adapter}})
        mgr.wait()
        before = data_bytes(run / "blobs")
        adapter += 1.0
        mgr.save(2, {"model": {"base": base, "adapter": adapter}})
        mgr.wait()
        assert data_bytes(run / "blobs") - before < adapter.nbytes + 4096  # base not rewritten
        out = sp.load(mgr.step_path(2))["model"]
        assert out["base"].tobytes() == base.tobytes()
        assert out["adapter"].tobytes() == adapter.tobytes()
        # The promise broken everywhere (a LoRA merged into the base, say): the sample sees it.
        base += 0.5
        with caplog.at_level("WARNING", logger="savepoint.blobs.patch"):
            mgr.save(3, {"model": {"base": base, "adapter": adapter}})
            mgr.wait()
        assert "declared frozen but changed" in caplog.text
        assert sp.load(mgr.step_path(3))["model"]["base"].tobytes() == base.tobytes()
        sp.verify(mgr.step_path(3))


def test_frozen_needs_incremental_and_prefixes(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="without incremental=True"):
        sp.CheckpointManager(tmp_path / "a", frozen=["model"])
    with pytest.raises(TypeError, match="iterable of key prefixes"):
        sp.CheckpointManager(tmp_path / "b", incremental=True, frozen="model")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
