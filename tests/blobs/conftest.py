"""Fixtures of the blob store tests: a store of each kind the blob layer must work on."""

from __future__ import annotations

import uuid
import warnings
from pathlib import Path

import pytest

from savepoint.blobs import BlobStore
from savepoint.storage.base import Store
from savepoint.storage.local import LocalStore
from savepoint.storage.memory import MemoryStore

KINDS = ["memory", "memory-object", "local", "fsspec-memory"]


def make(kind: str, tmp_path: Path) -> tuple[Store, str]:
    """A fresh store of ``kind`` and a root for a blob store in it."""
    if kind == "memory":
        return MemoryStore(), "/run/blobs"
    if kind == "memory-object":
        return MemoryStore(atomic_rename=False), "/run/blobs"
    if kind == "local":
        return LocalStore(), str(tmp_path / "run" / "blobs")
    if kind == "fsspec-memory":
        fsspec = pytest.importorskip("fsspec")
        from savepoint.storage.fsspecstore import FsspecStore, WeakCreateWarning

        store = FsspecStore(fsspec.filesystem("memory"))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", WeakCreateWarning)
            store.makedirs("/")
            store.put(f"/warm-{uuid.uuid4().hex}", b"", exclusive=True)
        return store, f"/blobs-{uuid.uuid4().hex}"
    raise ValueError(kind)


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def blobs(kind: str, tmp_path: Path) -> BlobStore:
    store, root = make(kind, tmp_path)
    return BlobStore(store, root)
