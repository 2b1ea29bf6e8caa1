"""Readers of an incremental run next to its writer (issue 25, item 3).

A reader pins a checkpoint's directory, not its blobs: the writer's retention may delete the
step being read and then collect its blobs. What the reader gets then is CheckpointNotFoundError
saying the checkpoint was deleted (a step saved again: the new one), never CorruptCheckpointError;
a blob missing from a checkpoint that is still there stays CorruptCheckpointError."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import savepoint as sp
from savepoint.blobs import BlobPolicy, BlobStore
from savepoint.codecs import manifest as mf
from savepoint.storage.faults import FaultyStore
from savepoint.storage.local import LocalStore
from savepoint.storage.memory import MemoryStore

TENSORS = 2  # of 64 KiB, 16 blobs each
POLICY = BlobPolicy(chunk_size=4 << 10, min_blob_bytes=4 << 10, patches=False)


def state(step: int) -> dict[str, Any]:
    rng = np.random.default_rng(step)  # every tensor changes at every step: no blob shared
    return {f"t{i}": rng.standard_normal(16 << 10).astype(np.float32) for i in range(TENSORS)}


def blank() -> dict[str, Any]:
    return {f"t{i}": np.zeros(16 << 10, np.float32) for i in range(TENSORS)}


def same(got: dict[str, Any], step: int) -> None:
    want = state(step)
    assert set(got) == set(want)
    for key, value in want.items():
        assert np.asarray(got[key]).tobytes() == value.tobytes(), key


def _retire_during_first_blob_read(monkeypatch: pytest.MonkeyPatch, act: Any) -> list[bool]:
    """Run ``act()`` (the writer's save and retention) once, after the reader opened its
    checkpoint and just before it reads its first blob."""
    real = BlobStore.read_recipe
    fired: list[bool] = []

    def read_recipe(self: BlobStore, *args: Any, **kwargs: Any) -> Any:
        if not fired:
            fired.append(True)
            act()
        return real(self, *args, **kwargs)

    monkeypatch.setattr(BlobStore, "read_recipe", read_recipe)
    return fired


def test_a_step_deleted_and_collected_between_open_and_read_is_not_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: CorruptCheckpointError "blob ... is missing" for a checkpoint intact when opened."""
    run = tmp_path / "run"
    with sp.CheckpointManager(run, incremental=True, keep_last=1, blob_policy=POLICY) as writer:
        writer.save(1, state(1))
        path = writer.step_path(1)
        fired = _retire_during_first_blob_read(monkeypatch, lambda: writer.save(2, state(2)).wait())
        with pytest.raises(sp.CheckpointNotFoundError) as info:
            sp.load(path)
        assert fired and writer.steps() == [2] and not os.path.exists(path)
        assert "deleted while it was being read" in str(info.value)
        assert not isinstance(info.value, sp.CorruptCheckpointError)
        # The same through a read-only manager restoring that explicit step, and open_run.
        monkeypatch.undo()
        fired = _retire_during_first_blob_read(monkeypatch, lambda: writer.save(3, state(3)).wait())
        reader = sp.CheckpointManager(run, read_only=True)
        with pytest.raises(sp.CheckpointNotFoundError, match="deleted"):
            reader.restore(blank(), 2, resume=False)
        assert fired
        monkeypatch.undo()
        fired = _retire_during_first_blob_read(monkeypatch, lambda: writer.save(4, state(4)).wait())
        with pytest.raises(sp.CheckpointNotFoundError, match="deleted"):
            sp.open_run(run).load(3)
        assert fired
        reader.close()


def test_a_step_saved_again_between_open_and_read_loads_the_new_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The step being read is saved again (its old blobs collected): the load reads the
    checkpoint now at the path, exactly."""
    run = tmp_path / "run"
    with sp.CheckpointManager(run, incremental=True, keep_last=1, blob_policy=POLICY) as writer:
        writer.save(1, state(1))

        def again() -> None:
            writer.save(1, state(7)).wait()
            writer.gc(grace=0)  # collects the blobs only the replaced checkpoint named

        old = mf.parse((Path(writer.step_path(1)) / mf.NAME).read_bytes())
        blobs = BlobStore.open(run / "blobs", create=False)
        fired = _retire_during_first_blob_read(monkeypatch, again)
        got = sp.load(writer.step_path(1))
        assert fired
        assert not any(blobs.exists(d) for r in mf.recipes(old) for d in r.names())
        same(got, 7)


def test_a_blob_missing_from_a_checkpoint_still_there_is_corrupt(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with sp.CheckpointManager(run, incremental=True, blob_policy=POLICY) as writer:
        writer.save(1, state(1))
        path = Path(writer.step_path(1))
    manifest = mf.parse((path / mf.NAME).read_bytes())
    digest = manifest.tensors["t1"].recipe.digests[1]
    (run / "blobs" / "data" / digest[:2] / digest).unlink()
    with pytest.raises(sp.CorruptCheckpointError, match="missing") as info:
        sp.load(path)
    assert info.value.key == "t1" and digest in str(info.value)
    with pytest.raises(sp.CorruptCheckpointError, match="missing"):
        sp.verify(path)


def test_readers_of_explicit_steps_racing_retention_never_see_corruption(tmp_path: Path) -> None:
    """The real race: a writer saving with keep_last=2 (each save deletes the oldest step and
    collects its blobs) and reader threads loading the oldest step they see, by its path (and
    now and then through a read-only manager), on a disk where opening a blob takes 1 ms (so
    that a load spans the writer's deletion and collection). Every read returns exactly the
    state of its step, or CheckpointNotFoundError; before, about one in ten was
    CorruptCheckpointError ("blob ... is missing")."""
    run = tmp_path / "run"
    writer = sp.CheckpointManager(run, incremental=True, keep_last=2, blob_policy=POLICY)
    writer.save(0, state(0))
    slow = FaultyStore(LocalStore())
    slow.hook("open_blob", lambda call: time.sleep(0.001), times=None, path="*/blobs/data/*")
    done = threading.Event()
    failures: list[BaseException] = []
    outcomes = {"loaded": 0, "deleted": 0}
    lock = threading.Lock()

    def read() -> None:
        reader = sp.CheckpointManager(slow.at(str(run)), read_only=True)
        try:
            while not done.is_set():
                steps = reader.steps()
                if not steps:
                    continue
                step = steps[0]  # the next one retention deletes
                try:
                    if outcomes["loaded"] % 4:
                        name = os.path.basename(writer.step_path(step))
                        got = sp.load(slow.at(str(run / "checkpoints" / name)))
                    else:
                        got = blank()
                        reader.restore(got, step, resume=False)
                except sp.CheckpointNotFoundError:  # (not a CorruptCheckpointError)
                    with lock:
                        outcomes["deleted"] += 1
                    continue
                same(got, step)
                with lock:
                    outcomes["loaded"] += 1
        except BaseException as exc:
            failures.append(exc)
            done.set()
        finally:
            reader.close()

    readers = [threading.Thread(target=read) for _ in range(2)]
    for t in readers:
        t.start()
    try:
        for step in range(1, 6):
            if done.is_set():
                break
            writer.save(step, state(step))
    finally:
        done.set()
        for t in readers:
            t.join()
        writer.close()
    if failures:
        raise failures[0]
    assert outcomes["loaded"] > 0


def test_on_an_object_like_store_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """Manifest-last commits (a checkpoint is a generation under its step's prefix): a step
    deleted and collected under the reader is not found; one still there with a blob gone is
    corrupt."""
    store = MemoryStore(atomic_rename=False)
    run = store.at("/run")
    with sp.CheckpointManager(run, incremental=True, keep_last=1, blob_policy=POLICY) as writer:
        writer.save(1, state(1))
        step1 = store.at(writer._step(1).path)
        _retire_during_first_blob_read(monkeypatch, lambda: writer.save(2, state(2)).wait())
        with pytest.raises(sp.CheckpointNotFoundError, match="deleted while it was being read"):
            sp.load(step1)
        monkeypatch.undo()
        step2 = store.at(writer._step(2).path)
        same(sp.load(step2), 2)
        blobs = BlobStore(store, "/run/blobs", create=False)
        digest = next(iter(blobs.list()))
        blobs.delete(digest)
        with pytest.raises(sp.CorruptCheckpointError, match="missing"):
            sp.load(step2)


def test_a_blob_deleted_after_it_was_opened_on_an_object_store_is_missing() -> None:
    """An object store answers a read of an object deleted since it was opened with
    ReplacedWhileReadingError; a blob is never replaced, so that is a missing blob."""
    from savepoint.blobs.store import MissingBlobError

    store = FaultyStore(MemoryStore(atomic_rename=False))
    blobs = BlobStore(store, "/blobs")
    digest = blobs.put(np.arange(4096, dtype=np.uint8)).digest

    def gone(call: Any) -> None:
        raise sp.ReplacedWhileReadingError("deleted since it was opened", path=call.path)

    store.hook("read", gone, path="*/data/*")
    with pytest.raises(MissingBlobError) as info:
        blobs.read(digest)
    assert info.value.digest == digest and isinstance(info.value, sp.CorruptCheckpointError)
