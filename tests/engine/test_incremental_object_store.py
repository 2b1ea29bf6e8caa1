"""Incremental checkpoints on stores without rename (object stores): the manifest is committed
in a generation of the checkpoint (``<checkpoint>/gen-.../``), one level below the directory its
``blob_store`` is relative to; readers must find the store from the checkpoint, not from the
generation."""

from __future__ import annotations

from typing import Any

import numpy as np

import savepoint as sp
from savepoint.blobs import BlobPolicy, BlobStore
from savepoint.storage.memory import MemoryStore

POLICY = BlobPolicy(chunk_size=4096, min_blob_bytes=4096, workers=1)


def state(version: int) -> dict[str, Any]:
    w = np.arange(64 * 128, dtype=np.float32).reshape(64, 128)
    w[:2] += version
    return {"w": w, "b": np.arange(5, dtype=np.int32), "step": version}


def test_an_incremental_checkpoint_in_a_generation_loads() -> None:
    store = MemoryStore(atomic_rename=False)
    blobs = BlobStore(store, "/run/blobs")
    sp.save(store.at("/run/ck"), state(1), blobs=blobs, blob_policy=POLICY)
    (generation,) = store.list("/run/ck")
    assert generation.startswith("gen-")
    out = sp.load(store.at("/run/ck"))
    assert out["w"].tobytes() == state(1)["w"].tobytes() and out["step"] == 1
    assert sp.verify(store.at("/run/ck")).format_version == 4


def test_a_run_on_an_object_like_store() -> None:
    store = MemoryStore(atomic_rename=False)
    run = store.at("/runs/a")
    with sp.CheckpointManager(run, incremental=True, blob_policy=POLICY, keep_last=2) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, state(step))
    with sp.CheckpointManager(run, read_only=True) as mgr:
        into = {"w": np.zeros((64, 128), np.float32), "b": np.zeros(5, np.int32), "step": 0}
        assert mgr.restore(into) == 3
        assert into["w"].tobytes() == state(3)["w"].tobytes()
        for step in mgr.steps():
            got = sp.load(mgr.step_path(step))
            assert got["w"].tobytes() == state(step)["w"].tobytes()


def test_an_alias_pointer_finds_the_store() -> None:
    store = MemoryStore(atomic_rename=False)
    run = store.at("/runs/b")
    with sp.CheckpointManager(run, incremental=True, blob_policy=POLICY) as mgr:
        mgr.save(1, state(1))
    out = sp.load(store.at("/runs/b/latest"))  # a pointer to the step's directory
    assert out["w"].tobytes() == state(1)["w"].tobytes()
