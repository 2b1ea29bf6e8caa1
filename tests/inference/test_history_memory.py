"""SnapshotHistory off the local disk: a directory on the in-memory store, as a filesystem
(``memory://``) and as an object store (``MemoryStore(atomic_rename=False)``: manifest-last
commits), with the same ring, rollback and reopening as on a local directory."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import numpy as np
import pytest

from savepoint.commit import names
from savepoint.commit.transaction import resolve as resolve_commit
from savepoint.inference import InferenceSnapshot, SnapshotHistory
from savepoint.storage import memory
from savepoint.storage.memory import MemoryStore
from savepoint.storage.paths import Location, resolve


def snap(i: int) -> InferenceSnapshot:
    return InferenceSnapshot(
        states=[np.full((2, 3), i, np.float32)],
        history=[np.array([float(i)], np.float32)],
        step_count=i,
        metadata={"timestamp": 0},
    )


@pytest.fixture(params=["memory-url", "object-store"])
def where(request: pytest.FixtureRequest) -> Iterator[Location]:
    name = f"/histories/{uuid.uuid4().hex}"
    if request.param == "memory-url":
        yield resolve(f"memory:/{name}")
    else:
        yield MemoryStore(atomic_rename=False).at(name)


def arg(where: Location) -> str | Location:
    return str(where) if where.store is memory.shared() else where


def committed(where: Location) -> list[str]:
    store = where.store
    return sorted(
        n for n in store.list(where.path) if resolve_commit(store, store.join(where.path, n))
    )


def test_ring_rollback_and_reopen(where: Location) -> None:
    history = SnapshotHistory(3, directory=arg(where))
    assert history.directory == str(where)
    for i in range(5):
        history.push(snap(i))
    assert len(history) == 3
    assert committed(where) == [f"snapshot-{seq:012d}" for seq in (2, 3, 4)]
    assert history.path(0) == str(where.join("snapshot-000000000004"))
    rolled = history.rollback()
    assert rolled is not None and rolled.step_count == 4
    history.take(states=[np.full((2, 3), 9, np.float32)], history=[], step_count=9)

    reopened = SnapshotHistory(3, directory=arg(where))
    kept = [reopened.get(i) for i in range(len(reopened))]
    assert [s.step_count for s in kept if s is not None] == [9, 3, 2]
    smaller = SnapshotHistory(1, directory=arg(where))  # prunes beyond its bound
    assert len(smaller) == 1 and committed(where) == ["snapshot-000000000005"]
    smaller.clear()
    assert committed(where) == [] and len(SnapshotHistory(2, directory=arg(where))) == 0


def test_stale_temporaries_are_removed_at_open(where: Location) -> None:
    store = where.store
    store.makedirs(where.path)
    stale = store.join(
        where.path, f".snapshot-000000000003{names.TMP_TAG}{names.HOST}-999999999-ab"
    )
    store.mkdir(stale)
    store.put(store.join(stale, "data.safetensors"), b"partial")
    store.mkdir(store.join(where.path, "snapshot-000000000007"))  # never committed
    history = SnapshotHistory(2, directory=arg(where))
    assert store.stat(stale) is None and len(history) == 0
    history.push(snap(1))
    assert history.path(0) == str(where.join("snapshot-000000000008"))  # past every name
