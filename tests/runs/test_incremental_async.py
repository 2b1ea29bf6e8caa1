"""CheckpointManager(incremental=True) with async_save=True (the background thread runs the blob
store's save session, then retention and the blob collection) and with compression=."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import savepoint as sp
from savepoint.blobs import BlobPolicy, BlobStore, Compression
from savepoint.codecs import manifest as mf
from savepoint.errors import CheckpointWriteError, IncompatibleCheckpointError
from savepoint.storage.faults import FaultyStore
from savepoint.storage.memory import MemoryStore

CHUNK = 16 << 10
POLICY = BlobPolicy(chunk_size=CHUNK, min_blob_bytes=4 << 10)
FROZEN = np.random.default_rng(0).standard_normal(64 * CHUNK // 4).astype(np.float32)


def state(step: int) -> dict[str, Any]:
    """Step ``step``'s state: a frozen tensor, one that changes at every step, one that changes
    every third step, a non-contiguous view, small tensors kept in data files, and scalars."""
    rng = np.random.default_rng(step)
    grid = np.arange(96 * 128, dtype=np.float64).reshape(96, 128) * (step % 4)
    return {
        "frozen": FROZEN,
        "adapter": rng.standard_normal(3 * CHUNK // 4).astype(np.float32),
        "slow": np.full(2 * CHUNK // 2, step // 3, np.float16),
        "strided": grid[:, ::2],  # not contiguous: copied out by the staging
        "small": np.arange(10, dtype=np.int64) + step,
        "scalar": np.float32(step),
        "step": step,
    }


def blank() -> dict[str, Any]:
    return {
        "frozen": np.zeros_like(FROZEN),
        "adapter": np.zeros(3 * CHUNK // 4, np.float32),
        "slow": np.zeros(2 * CHUNK // 2, np.float16),
        "strided": np.zeros((96, 64), np.float64),
        "small": np.zeros(10, np.int64),
        "scalar": np.float32(0),
        "step": -1,
    }


def same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert set(got) == set(want)
    for key, value in want.items():
        if isinstance(value, (np.ndarray, np.generic)):
            a, b = np.asarray(got[key]), np.asarray(value)
            assert a.dtype == b.dtype and a.shape == b.shape, key
            assert a.tobytes() == b.tobytes(), key  # bit-exact
        else:
            assert got[key] == value, key


def referenced(run: Path, steps: list[int]) -> set[str]:
    named: set[str] = set()
    for step in steps:
        m = mf.parse((run / "checkpoints" / f"step-{step:010d}" / mf.NAME).read_bytes())
        assert m.format_version == mf.BLOBS
        for t in m.tensors.values():
            if t.recipe is not None:
                named.update(t.recipe.digests)
    return named


def records(run: Path) -> list[str]:
    """What saves and collections in flight left in the run's blob store."""
    return sorted(p.name for d in ("sessions", "gc") for p in (run / "blobs" / d).iterdir())


def test_many_async_incremental_saves_keep_every_retained_checkpoint_bit_exact(
    tmp_path: Path,
) -> None:
    run = tmp_path / "run"
    with sp.CheckpointManager(
        run, incremental=True, async_save=True, keep_last=3, blob_policy=POLICY
    ) as mgr:
        for step in range(1, 13):
            live = state(step)
            mgr.save(step, live)
            # The save returned after the staging copy: training may change the state now.
            live["adapter"][:] = np.nan
            live["slow"][:] = -7
            live["small"][:] = -1
        mgr.wait()
        assert mgr.steps() == [10, 11, 12]
        for step in mgr.steps():
            same(sp.load(mgr.step_path(step)), state(step))
            sp.verify(mgr.step_path(step))
        into = blank()
        assert mgr.restore(into, resume=False) == 12
        same(into, state(12))
        # Retention deleted the blobs only the deleted checkpoints named, nothing else.
        blobs = BlobStore.open(run / "blobs", create=False)
        assert set(blobs.list()) == referenced(run, [10, 11, 12])
    assert records(run) == []  # close() leaves no save or collection in flight behind
    with sp.CheckpointManager(run, incremental=True, async_save=True) as again:
        into = blank()
        assert again.restore(into) == 12
        same(into, state(12))
        again.save(13, state(13))
    same(sp.load(run / "latest"), state(13))
    assert records(run) == []


def test_async_incremental_torch_state_round_trips(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(0)
    weights = {
        "bf16": torch.randn(64, 256, generator=g).to(torch.bfloat16),
        "fp32": torch.randn(128, 64, generator=g),
        "view": torch.randn(64, 128, generator=g).t(),  # not contiguous
        "int": torch.arange(5000, dtype=torch.int32),
    }
    with sp.CheckpointManager(
        tmp_path / "run", incremental=True, async_save=True, blob_policy=POLICY
    ) as mgr:
        mgr.save(1, weights)
        mgr.wait()
        out = sp.load(mgr.step_path(1))
    for key, value in weights.items():
        assert out[key].dtype == value.dtype and out[key].shape == value.shape, key
        assert torch.equal(out[key], value), key


def test_the_second_async_save_writes_only_the_changed_tensors() -> None:
    inner = MemoryStore()
    store = FaultyStore(inner)
    with sp.CheckpointManager(
        store.at("/run"), incremental=True, async_save=True, blob_policy=POLICY
    ) as mgr:

        def blob_bytes() -> int:
            return sum(
                c.nbytes or 0
                for c in store.calls
                if c.kind in ("write", "put") and c.path.startswith("/run/blobs/data/")
            )

        first = {"frozen": FROZEN, "adapter": np.arange(3 * CHUNK // 4, dtype=np.float32)}
        mgr.save(1, first)
        mgr.wait()
        written = blob_bytes()
        assert written >= FROZEN.nbytes + first["adapter"].nbytes  # everything, once
        second = {"frozen": FROZEN, "adapter": first["adapter"] + 1}
        mgr.save(2, second)
        mgr.wait()
        chunks = -(-second["adapter"].nbytes // CHUNK)
        # Only the adapter's chunks, each with its 32-byte header; the frozen tensor's are reused.
        assert blob_bytes() - written == second["adapter"].nbytes + 32 * chunks
        same(sp.load(inner.at("/run/checkpoints/step-0000000002")), second)


def test_a_collection_during_a_background_save_deletes_nothing_it_reuses() -> None:
    """While the background save of step 2 is stalled half-way (it has found the frozen
    tensor's blobs there and is writing the adapter's), a collection by another party that
    references nothing at all is deferred by the save's session: afterwards step 2 restores
    bit-exactly, its reused blobs included."""
    inner = MemoryStore()
    store = FaultyStore(inner)
    with sp.CheckpointManager(
        store.at("/run"), incremental=True, async_save=True, blob_policy=POLICY
    ) as mgr:
        first = {"frozen": FROZEN, "adapter": np.arange(3 * CHUNK // 4, dtype=np.float32)}
        mgr.save(1, first)
        mgr.wait()
        stall = store.stall(("create_blob", "put"), path="/run/blobs/data/*", timeout=30)
        second = {"frozen": FROZEN, "adapter": first["adapter"] + 1}
        pending = mgr.save(2, second)
        assert stall.reached.wait(30)
        report = BlobStore(inner, "/run/blobs", create=False).collect(set(), grace=0)
        assert report.deferred and not report.deleted and len(report.live_sessions) == 1
        stall.release()
        pending.wait()
        assert not stall.timed_out
        same(sp.load(inner.at("/run/checkpoints/step-0000000002")), second)
        same(sp.load(inner.at("/run/checkpoints/step-0000000001")), first)


def test_a_background_failure_is_raised_by_wait_and_the_run_is_unchanged() -> None:
    inner = MemoryStore()
    store = FaultyStore(inner)
    with sp.CheckpointManager(
        store.at("/run"), incremental=True, async_save=True, keep_last=2, blob_policy=POLICY
    ) as mgr:
        mgr.save(1, state(1))
        mgr.wait()
        fault = store.fail(("create_blob", "put"), path="/run/blobs/data/*")
        pending = mgr.save(2, state(2))  # returns: the failure happens in the background
        with pytest.raises(CheckpointWriteError):
            pending.wait()
        with pytest.raises(CheckpointWriteError):
            mgr.wait()
        assert fault.fired == 1
        assert mgr.steps() == [1]
        assert inner.list("/run/blobs/sessions") == [] and inner.list("/run/blobs/gc") == []
        mgr.wait()  # raised once
        mgr.save(2, state(2))  # the save policy counts it as not saved: it saves again
        mgr.save(3, state(3))
        mgr.wait()
        assert mgr.steps() == [2, 3]
        for step in (2, 3):
            same(sp.load(inner.at(f"/run/checkpoints/step-{step:010d}")), state(step))
    assert inner.list("/run/blobs/sessions") == []


def test_a_background_failure_is_raised_by_the_next_save_which_saves_nothing() -> None:
    inner = MemoryStore()
    store = FaultyStore(inner)
    mgr = sp.CheckpointManager(
        store.at("/run"), incremental=True, async_save=True, blob_policy=POLICY
    )
    mgr.save(1, state(1))
    mgr.wait()
    store.fail("sync_dir", path="/run/blobs/data/*", code=5)  # EIO making the blobs durable
    mgr.save(2, state(2))
    with pytest.raises(CheckpointWriteError):
        mgr.save(3, state(3))
    assert mgr.steps() == [1]
    mgr.save(3, state(3))
    mgr.close()
    assert inner.list("/run/blobs/sessions") == []
    with sp.CheckpointManager(inner.at("/run"), incremental=True) as again:
        assert again.steps() == [1, 3]
        into = blank()
        assert again.restore(into) == 3
        same(into, state(3))


def test_close_finishes_the_save_in_flight_and_leaves_no_records(tmp_path: Path) -> None:
    run = tmp_path / "run"
    mgr = sp.CheckpointManager(
        run, incremental=True, async_save=True, keep_last=1, blob_policy=POLICY
    )
    mgr.save(1, state(1))
    mgr.save(2, state(2))
    mgr.close()  # no wait(): close finishes step 2, its retention and its collection
    assert records(run) == []
    assert sp.open_run(run).steps() == [2]
    blobs = BlobStore.open(run / "blobs", create=False)
    assert set(blobs.list()) == referenced(run, [2])
    same(sp.load(run / "latest"), state(2))


def test_gc_waits_for_the_save_in_flight(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with sp.CheckpointManager(
        run, incremental=True, async_save=True, keep_last=1, blob_policy=POLICY
    ) as mgr:
        mgr.save(1, state(1))
        mgr.save(2, state(2))
        mgr.gc(grace=0)
        assert records(run) == []
        blobs = BlobStore.open(run / "blobs", create=False)
        assert set(blobs.list()) == referenced(run, [2])
        same(sp.load(mgr.step_path(2)), state(2))


# -- compression ----------------------------------------------------------------------------------


def codecs(run: Path, step: int) -> dict[str, set[str]]:
    """The codec of each blob-backed tensor's chunks (from the blob headers)."""
    blobs = BlobStore.open(run / "blobs", create=False)
    m = mf.parse((run / "checkpoints" / f"step-{step:010d}" / mf.NAME).read_bytes())
    return {
        name: {blobs.info(d).codec for d in t.recipe.digests}
        for name, t in m.tensors.items()
        if t.recipe is not None
    }


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_compression_zstd_stores_compressed_blobs_that_restore_bit_exactly(
    tmp_path: Path, async_save: bool
) -> None:
    pytest.importorskip("zstandard")
    run = tmp_path / "run"
    noise = np.random.default_rng(1).integers(0, 256, 4 * CHUNK, dtype=np.uint8)
    with sp.CheckpointManager(
        run,
        incremental=True,
        async_save=async_save,
        compression="zstd",
        keep_last=2,
        blob_policy=POLICY,
    ) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {**state(step), "noise": noise})
        mgr.wait()
        assert mgr.steps() == [2, 3]
        for step in (2, 3):
            same(sp.load(mgr.step_path(step)), {**state(step), "noise": noise})
            sp.verify(mgr.step_path(step))
        found = codecs(run, 3)
    assert found["frozen"] == {"zstd"}  # float weights compress (byte-plane shuffle)
    assert found["slow"] == {"zstd"}
    assert found["noise"] == {"raw"}  # incompressible: stored raw
    blobs = BlobStore.open(run / "blobs", create=False)
    assert set(blobs.list()) == referenced(run, [2, 3])


def test_compression_merges_into_a_blob_policy_without_one(tmp_path: Path) -> None:
    pytest.importorskip("zstandard")
    mgr = sp.CheckpointManager(
        tmp_path / "run", incremental=True, compression="zstd", blob_policy=POLICY
    )
    with mgr:
        assert mgr._blob_handles.policy == dataclasses.replace(POLICY, compression=Compression())
    level3 = Compression(level=3)
    with sp.CheckpointManager(
        tmp_path / "run", incremental=True, compression=level3, blob_policy=POLICY
    ) as mgr:
        mgr.save(1, state(1))
        assert mgr._blob_handles.policy.compression == level3
    same(sp.load(tmp_path / "run" / "latest"), state(1))
    # the same compression twice is no conflict
    sp.CheckpointManager(
        tmp_path / "run",
        incremental=True,
        compression="zstd",
        blob_policy=BlobPolicy.of("zstd"),
    ).close()


@pytest.mark.parametrize(
    ("kw", "error", "says"),
    [
        ({"compression": "zstd"}, ValueError, "without incremental=True"),
        ({"incremental": True, "compression": "gzip"}, ValueError, "'gzip'"),
        ({"incremental": True, "compression": "zstd:3"}, ValueError, "Compression(level=3)"),
        ({"incremental": True, "compression": 3}, TypeError, "not int"),
        (
            {
                "incremental": True,
                "compression": "zstd",
                "blob_policy": BlobPolicy.of("zstd", level=9),
            },
            ValueError,
            "conflicts with blob_policy",
        ),
    ],
)
def test_bad_compression_arguments_are_refused_before_anything_is_written(
    tmp_path: Path, kw: dict[str, Any], error: type[Exception], says: str
) -> None:
    pytest.importorskip("zstandard")
    with pytest.raises(error) as raised:
        sp.CheckpointManager(tmp_path / "run", **kw)
    assert says in str(raised.value)
    assert not (tmp_path / "run").exists()


def test_compression_without_zstandard_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "zstandard" else real(name)
    )
    with pytest.raises(IncompatibleCheckpointError, match="pip install zstandard"):
        sp.CheckpointManager(tmp_path / "run", incremental=True, compression="zstd")
    assert not (tmp_path / "run").exists()


def test_the_run_files_record_nothing_about_compression(tmp_path: Path) -> None:
    """Compression is a property of each blob (its header), not of the run: a run saved with
    compression opens, restores and saves without it, and the other way round."""
    pytest.importorskip("zstandard")
    run = tmp_path / "run"
    with sp.CheckpointManager(run, incremental=True, compression="zstd", blob_policy=POLICY) as m:
        m.save(1, state(1))
    with sp.CheckpointManager(run, incremental=True, blob_policy=POLICY) as m:
        into = blank()
        assert m.restore(into) == 1
        same(into, state(1))
        m.save(2, state(2))
    assert "compression" not in json.loads((run / "run.json").read_text())
    same(sp.load(run / "latest"), state(2))


def test_async_incremental_run_on_an_object_store() -> None:
    """Without atomic rename each checkpoint is a generation directory inside its step
    directory (manifest last): its manifest's blob store path still leads to <run>/blobs."""
    inner = MemoryStore(atomic_rename=False)
    run = inner.at("/run")
    with sp.CheckpointManager(
        run, incremental=True, async_save=True, keep_last=2, blob_policy=POLICY
    ) as mgr:
        for step in range(1, 6):
            mgr.save(step, state(step))
        mgr.wait()
        assert mgr.steps() == [4, 5]
        into = blank()
        assert mgr.restore(into, resume=False) == 5
        same(into, state(5))
        for step in (4, 5):
            where = run.join("checkpoints", f"step-{step:010d}")
            same(sp.load(where), state(step))
            sp.verify(where)
        same(sp.load(run.join("latest")), state(5))  # a pointer to step 5
    assert inner.list("/run/blobs/sessions") == [] and inner.list("/run/blobs/gc") == []


def test_save_on_preemption_with_an_async_incremental_save_in_flight(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with sp.CheckpointManager(
        run, incremental=True, async_save=True, keep_last=2, blob_policy=POLICY
    ) as mgr:
        mgr.save(1, state(1))
        mgr.save(2, state(2))  # in flight, or committed by now
        result = mgr.save_on_preemption(3, state(3))
        assert result.saved and result.exit_code == 0
        assert mgr.steps()[-1] == 3
    assert records(run) == []
    with sp.CheckpointManager(run, incremental=True, keep_last=2) as again:
        into = blank()
        assert again.restore(into) == 3
        same(into, state(3))
        for step in again.steps():
            same(sp.load(again.step_path(step)), state(step))
        again.save(4, state(4))  # the deferred retention runs now
        again.wait()
        assert again.steps() == [3, 4]
        again.gc(grace=0)
        blobs = BlobStore.open(run / "blobs", create=False)
        assert set(blobs.list()) == referenced(run, [3, 4])


def test_async_checkpointer_incremental_saves(tmp_path: Path) -> None:
    """AsyncCheckpointer.save(..., blobs=, blob_policy=) without a manager: the second save of
    an unchanged frozen tensor writes only the changed one's blobs; bad arguments are refused
    in the caller's thread."""
    from savepoint.async_.checkpointer import AsyncCheckpointer
    from savepoint.errors import UnsupportedStateError

    store = tmp_path / "blobs"
    with AsyncCheckpointer() as writer:
        first = writer.save(tmp_path / "a", state(1), blobs=store, blob_policy=POLICY)
        first.wait()
        held = set(BlobStore.open(store, create=False).list())
        live = state(2)
        writer.save(tmp_path / "b", live, blobs=str(store), blob_policy=POLICY)
        live["adapter"][:] = 0  # after the snapshot: not saved
        writer.wait()
        added = set(BlobStore.open(store, create=False).list()) - held
        m = mf.parse((tmp_path / "b" / mf.NAME).read_bytes())
        changed = {"adapter", "strided", "slow"}  # the tensors state(2) changes (in blobs)
        expect = {d for n in changed if (r := m.tensors[n].recipe) is not None for d in r.digests}
        assert added <= expect and added  # nothing of the frozen tensor again
        assert m.tensors["frozen"].recipe is not None
        assert set(m.tensors["frozen"].recipe.digests) <= held
        with pytest.raises(ValueError, match="without blobs="):
            writer.save(tmp_path / "c", state(3), blob_policy=POLICY)
        with pytest.raises(UnsupportedStateError, match="blob store"):
            writer.save(tmp_path / "far" / "away" / "c", state(3), blobs=store)
        with pytest.raises(TypeError):
            writer.save(tmp_path / "c", state(3), blobs=store, blob_policy="zstd")
    same(sp.load(tmp_path / "a"), state(1))
    same(sp.load(tmp_path / "b"), state(2))
    assert not (tmp_path / "c").exists()


def test_sp_save_with_blobs_on_an_object_store_loads_back() -> None:
    """The blob store path of a manifest is relative to the checkpoint's directory, also where
    the manifest lies in a generation directory inside it (stores without atomic rename)."""
    inner = MemoryStore(atomic_rename=False)
    blobs = BlobStore(inner, "/x/blobs")
    sp.save(inner.at("/x/ckpt"), state(1), blobs=blobs, blob_policy=POLICY)
    assert any(n.startswith("gen-") for n in inner.list("/x/ckpt"))
    same(sp.load(inner.at("/x/ckpt")), state(1))
    sp.verify(inner.at("/x/ckpt"))
    sp.save(inner.at("/x/ckpt"), state(2), blobs=blobs, blob_policy=POLICY)  # a new generation
    same(sp.load(inner.at("/x/ckpt")), state(2))
