"""CheckpointManager(directory, incremental=True): the run's checkpoints share a blob store at
<run>/blobs; retention deletes checkpoints, then the blobs none of the remaining ones names."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import savepoint as sp
from savepoint.blobs import BlobPolicy, BlobStore
from savepoint.codecs import manifest as mf

POLICY = BlobPolicy(chunk_size=64 << 10, min_blob_bytes=16 << 10)


def lora(frozen: np.ndarray[Any, Any], step: int) -> dict[str, Any]:
    rng = np.random.default_rng(step)
    return {
        "frozen": frozen,
        "adapter": rng.standard_normal(20000).astype(np.float32),  # changes every save
        "step": step,
    }


def test_retention_deletes_only_unreferenced_blobs_and_every_kept_checkpoint_restores(
    tmp_path: Path,
) -> None:
    frozen = np.random.default_rng(0).standard_normal(500_000).astype(np.float32)
    run = tmp_path / "run"
    with sp.CheckpointManager(run, incremental=True, keep_last=2, blob_policy=POLICY) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, lora(frozen, step))
            mgr.wait()
        assert mgr.steps() == [2, 3]
        blobs = BlobStore.open(run / "blobs", create=False)
        held = set(blobs.list())
        named: set[str] = set()
        for step in (2, 3):
            m = mf.parse((Path(mgr.step_path(step)) / mf.NAME).read_bytes())
            assert m.format_version == mf.BLOBS and m.blob_store == "../../blobs"
            for t in m.tensors.values():
                if t.recipe is not None:
                    named.update(t.recipe.digests)
        assert held == named  # step 1's adapter blobs are gone, the shared frozen ones stay
        for step in (2, 3):
            out = sp.load(mgr.step_path(step))
            assert out["frozen"].tobytes() == frozen.tobytes()
            assert out["adapter"].tobytes() == lora(frozen, step)["adapter"].tobytes()
        state = {"frozen": np.zeros_like(frozen), "adapter": np.zeros(20000, np.float32)}
        assert mgr.restore(state, resume=False) == 3
        assert state["frozen"].tobytes() == frozen.tobytes()
        sp.verify(run / "latest")
        mgr.gc(grace=0)
        assert set(blobs.list()) == named
    # a new manager on the run restores it too
    with sp.CheckpointManager(run, incremental=True) as again:
        state = {"frozen": np.zeros_like(frozen), "adapter": np.zeros(20000, np.float32)}
        assert again.restore(state) == 3
        assert state["adapter"].tobytes() == lora(frozen, 3)["adapter"].tobytes()


def test_an_unchanged_state_writes_no_blob(tmp_path: Path) -> None:
    frozen = np.arange(300_000, dtype=np.float32)
    with sp.CheckpointManager(tmp_path / "run", incremental=True, blob_policy=POLICY) as mgr:
        mgr.save(1, {"w": frozen})
        mgr.wait()
        blobs = BlobStore.open(tmp_path / "run" / "blobs", create=False)
        first = set(blobs.list())
        mgr.save(2, {"w": frozen})
        mgr.wait()
        assert set(blobs.list()) == first


@pytest.mark.parametrize("kw", [{"blob_policy": POLICY}, {"compression": "zstd"}])
def test_blob_options_without_incremental_are_refused(tmp_path: Path, kw: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="without incremental=True"):
        sp.CheckpointManager(tmp_path / "run", **kw)
    assert not (tmp_path / "run").exists()


def test_aliases_find_the_runs_store_when_another_sits_next_to_the_run(tmp_path: Path) -> None:
    """The alias ``<run>/latest`` holds a step directory's manifest (``blob_store`` is
    ``../../blobs`` from there): a blob store of other checkpoints at ``<run>/../blobs`` opens
    too, but the reader takes the one holding this checkpoint's blobs."""
    exp = tmp_path / "exp"
    sp.save(exp / "standalone", {"x": np.ones(1 << 20, np.float32)}, blobs=exp / "blobs")
    emb = np.random.default_rng(10).standard_normal((2048, 256)).astype(np.float32)
    with sp.CheckpointManager(exp / "run", incremental=True, blob_policy=POLICY) as mgr:
        mgr.save(1, {"emb": emb})
    assert sp.load(exp / "run" / "latest")["emb"].tobytes() == emb.tobytes()
    sp.verify(exp / "run" / "latest")
    assert sp.load(exp / "standalone")["x"].sum() == 1 << 20


def test_a_rotten_blob_is_written_again_after_a_checkpoint_fails_to_verify(
    tmp_path: Path,
) -> None:
    """A frozen chunk rots on disk after step 1. Dedupe makes step 2 name it too, so the
    read-back verification before pruning fails; the manager then removes the damaged blob, the
    next save writes its content again, and from then on checkpoints verify and restore."""
    frozen = np.random.default_rng(4).standard_normal((2048, 256)).astype(np.float32)
    run = tmp_path / "run"
    with sp.CheckpointManager(run, incremental=True, keep_last=1, blob_policy=POLICY) as mgr:
        mgr.save(1, {"frozen": frozen, "step": 1})
        m = mf.parse((Path(mgr.step_path(1)) / mf.NAME).read_bytes())
        victim = m.tensors["frozen"].recipe.digests[0]
        path = run / "blobs" / "data" / victim[:2] / victim
        raw = bytearray(path.read_bytes())
        raw[1000] ^= 0xFF
        path.chmod(0o644)
        path.write_bytes(bytes(raw))
        mgr.save(2, {"frozen": frozen, "step": 2})  # verified before step 1 is pruned
        with pytest.raises(sp.CorruptCheckpointError, match="did not verify"):
            mgr.wait()  # (retention runs after the save returns: its error comes here)
        mgr.save(3, {"frozen": frozen, "step": 3})
        mgr.wait()
        assert mgr.steps() == [3]
        sp.verify(mgr.step_path(3))
        state = {"frozen": np.zeros_like(frozen), "step": 0}
        assert mgr.restore(state, resume=False) == 3
        assert state["frozen"].tobytes() == frozen.tobytes()
