"""savepoint's read side of gs:// URLs on a GCS-protocol server (fake-gcs-server, on loopback,
through obstore's GCS client): loads and verifies of a checkpoint, ranged reads of one object
generation, listings, stat and deletes, and how an upload the server refuses is reported.

The server does not take object_store's uploads (see :mod:`tests.storage._gcsserver`): the
objects are put through its JSON API, a checkpoint by copying what ``sp.save`` wrote to an
in-memory store that commits as an object store does (``MemoryStore(atomic_rename=False)``). What
a save to gs:// sends (create-only puts with ``x-goog-if-generation-match: 0``, multipart
uploads) is not covered here; test_objectstore.py covers it on S3.
"""

from __future__ import annotations

import errno
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from . import _gcsserver

pytestmark = pytest.mark.skipif(not _gcsserver.AVAILABLE, reason=_gcsserver.SKIP_REASON)

if _gcsserver.AVAILABLE:
    import savepoint as sp
    from savepoint.errors import (
        CheckpointWriteError,
        NotRegularFileError,
        ReplacedWhileReadingError,
    )
    from savepoint.storage import objectstore
    from savepoint.storage.memory import MemoryStore
    from savepoint.storage.objectstore import MARKER, PROBE, ObjectStore
    from savepoint.storage.paths import resolve

MiB = 1024 * 1024
RNG = np.random.default_rng(31)


def data(n: int) -> bytes:
    return RNG.integers(0, 256, n, dtype=np.uint8).tobytes()


@pytest.fixture(scope="session")
def gcs() -> Iterator[_gcsserver.Server]:
    """The fake-gcs-server of the session (the environment set for obstore's GCS client)."""
    yield _gcsserver.server()
    _gcsserver.stop()


@pytest.fixture
def gcs_bucket(gcs: _gcsserver.Server) -> str:
    """A fresh bucket on the session's server."""
    return _gcsserver.fresh_bucket()


@pytest.fixture
def store(gcs: _gcsserver.Server) -> ObjectStore:
    return ObjectStore("gs", prefetch=MiB, read_chunk=MiB)


def mirror(src: MemoryStore, root: str, server: _gcsserver.Server, bucket: str) -> int:
    """Upload every blob under ``root`` of ``src`` to ``bucket`` at the same key; how many."""
    count = 0
    for name in src.list(root):
        path = f"{root.rstrip('/')}/{name}"
        found = src.stat(path)
        assert found is not None
        if found.kind == "dir":
            count += mirror(src, path, server, bucket)
        else:
            server.upload(bucket, path.lstrip("/"), src.read_small(path, cap=None))
            count += 1
    return count


def read_range(store: ObjectStore, path: str, offset: int, n: int) -> bytes:
    r = store.open_blob(path)
    try:
        out = np.empty(n, dtype=np.uint8)
        r.read(offset, out)
        return out.tobytes()
    finally:
        r.close()


# ---------------------------------------------------------------------------------------------
# gs:// URLs
# ---------------------------------------------------------------------------------------------


def test_urls_resolve_to_the_shared_gcs_store(gcs: _gcsserver.Server) -> None:
    location = resolve("gs://bucket/run/step%201")
    assert location.store is objectstore.shared("gs")
    assert location.store.scheme == "gs"
    assert location.path == "/bucket/run/step 1"
    assert str(location) == "gs://bucket/run/step 1"
    assert resolve("gcs://bucket/x").store is location.store


def test_load_verify_and_inspect_a_checkpoint(gcs: _gcsserver.Server, gcs_bucket: str) -> None:
    state: dict[str, Any] = {
        "big": RNG.standard_normal(1_500_000).astype(np.float32),  # 6 MB: ranged reads
        "small": np.arange(10, dtype=np.int64),
        "empty": np.zeros((0, 3), dtype=np.float64),
        "step": 7,
    }
    written = MemoryStore(atomic_rename=False)
    info = sp.save(written.at("/run/ckpt"), state, max_file_bytes=4 * MiB)
    assert mirror(written, "/run", gcs, gcs_bucket) >= 3  # data files and the manifest
    url = f"gs://{gcs_bucket}/run/ckpt"
    loaded = sp.load(url)
    assert set(loaded) == set(state)
    for key in ("big", "small", "empty"):
        np.testing.assert_array_equal(loaded[key], state[key])
        assert loaded[key].dtype == state[key].dtype
    assert loaded["step"] == 7
    verified = sp.verify(url)
    assert {t.key for t in verified.tensors} >= {"big", "small", "empty"}
    generation = info.path.rsplit("/", 1)[-1]
    assert sp.inspect(url).path == f"{url}/{generation}"
    with pytest.raises(FileNotFoundError):
        sp.load(f"gs://{gcs_bucket}/run/missing")


# ---------------------------------------------------------------------------------------------
# ranged reads
# ---------------------------------------------------------------------------------------------


def test_ranged_reads_of_part_of_a_big_object(
    store: ObjectStore, gcs: _gcsserver.Server, gcs_bucket: str
) -> None:
    payload = data(5 * MiB + 123)
    gcs.upload(gcs_bucket, "d/big", payload)
    path = f"/{gcs_bucket}/d/big"
    r = store.open_blob(path)
    try:
        assert r.size == len(payload)
        for offset, n in [(0, 10), (MiB - 3, 6), (MiB + 5, 3 * MiB + 1), (len(payload) - 5, 5)]:
            out = np.empty(n, dtype=np.uint8)
            r.read(offset, out)
            assert out.tobytes() == payload[offset : offset + n], (offset, n)
        with pytest.raises(EOFError):
            r.read(len(payload) - 2, bytearray(3))
        assert r.view(0, 10) is None
    finally:
        r.close()


def test_empty_and_small_objects(
    store: ObjectStore, gcs: _gcsserver.Server, gcs_bucket: str
) -> None:
    gcs.upload(gcs_bucket, "empty", b"")
    gcs.upload(gcs_bucket, "small", b"0123456789")
    r = store.open_blob(f"/{gcs_bucket}/empty")  # GCS answers a range of it with 416
    try:
        assert r.size == 0
        r.read(0, bytearray(0))
    finally:
        r.close()
    assert store.read_small(f"/{gcs_bucket}/empty", cap=None) == b""
    assert read_range(store, f"/{gcs_bucket}/small", 3, 4) == b"3456"
    assert store.read_small(f"/{gcs_bucket}/small", cap=10) == b"0123456789"


@pytest.mark.parametrize("change", ["replaced", "deleted"])
def test_reader_refuses_another_generation(
    store: ObjectStore, gcs: _gcsserver.Server, gcs_bucket: str, change: str
) -> None:
    payload = data(3 * MiB)
    created = gcs.upload(gcs_bucket, "big", payload)
    path = f"/{gcs_bucket}/big"
    r = store.open_blob(path)
    try:
        if change == "replaced":
            assert (
                gcs.upload(gcs_bucket, "big", data(3 * MiB))["generation"]
                != (created["generation"])
            )
        else:
            store.remove(path)
        head = bytearray(100)
        r.read(0, head)  # the first ``prefetch`` bytes came with the open
        assert bytes(head) == payload[:100]
        # The reader asks for its generation: another one's bytes are never returned.
        with pytest.raises(ReplacedWhileReadingError, match="replaced or deleted since it was"):
            r.read(2 * MiB, bytearray(10))
    finally:
        r.close()


# ---------------------------------------------------------------------------------------------
# listings, stat, deletes
# ---------------------------------------------------------------------------------------------


def test_list_and_stat(store: ObjectStore, gcs: _gcsserver.Server, gcs_bucket: str) -> None:
    for key in ("run/a", "run/d/x", f"run/d/{MARKER}", f"run/e/{MARKER}", "run/dd", "runs"):
        gcs.upload(gcs_bucket, key, b"x")
    gcs.upload(gcs_bucket, f"{PROBE}0123", b"")  # another writer's probe: never listed
    root = f"/{gcs_bucket}"
    assert store.list(root) == ["run", "runs"]
    assert store.list(f"{root}/run") == ["a", "d", "dd", "e"]
    assert store.list(f"{root}/run/e") == []  # an empty directory: its marker only
    assert store.list(f"{root}/nothing") == []
    found = store.stat(f"{root}/run/a")
    assert found is not None and (found.kind, found.size) == ("file", 1)
    for directory in ("run", "run/d", "run/e"):
        found = store.stat(f"{root}/{directory}")
        assert found is not None and found.kind == "dir", directory
    assert store.stat(f"{root}/run/missing") is None
    assert store.stat(f"{root}/ru") is None  # a prefix of names is no directory
    with pytest.raises(NotRegularFileError):
        store.read_small(f"{root}/run/d", cap=None)
    with pytest.raises(NotRegularFileError):
        store.open_blob(f"{root}/run")


def test_remove_and_remove_tree(
    store: ObjectStore, gcs: _gcsserver.Server, gcs_bucket: str
) -> None:
    for i in range(12):
        gcs.upload(gcs_bucket, f"t/f{i:02d}", b"x")
    gcs.upload(gcs_bucket, f"t/{MARKER}", b"")
    gcs.upload(gcs_bucket, "t/sub/deeper/g", b"y")
    gcs.upload(gcs_bucket, "t-sibling", b"kept")  # shares the prefix "t", not "t/"
    root = f"/{gcs_bucket}/t"
    store.remove(f"{root}/f00")
    assert "t/f00" not in gcs.keys(gcs_bucket)
    with pytest.raises(FileNotFoundError) as info:
        store.remove(f"{root}/f00")  # GCS answers a DELETE of a missing object with 404
    assert info.value.filename == f"gs://{gcs_bucket}/t/f00"
    with pytest.raises(IsADirectoryError):
        store.remove(f"{root}/sub")
    store.remove_tree(root)
    assert gcs.keys(gcs_bucket) == ["t-sibling"]
    assert store.stat(root) is None
    store.remove_tree(root)  # nothing left: nothing to do


def test_errors_name_the_gs_object(store: ObjectStore, gcs_bucket: str) -> None:
    with pytest.raises(FileNotFoundError) as info:
        store.open_blob(f"/{gcs_bucket}/missing")
    assert info.value.filename == f"gs://{gcs_bucket}/missing"
    with pytest.raises(FileNotFoundError) as info:
        store.read_small(f"/{gcs_bucket}/missing", cap=None)
    assert info.value.filename == f"gs://{gcs_bucket}/missing"


def test_a_refused_upload_is_a_write_error_naming_the_object(
    gcs: _gcsserver.Server, gcs_bucket: str
) -> None:
    # This server refuses object_store's XML-API uploads (400): what a user sees of any
    # server's refusal of a save's PUT.
    with pytest.raises(CheckpointWriteError) as info:
        sp.save(f"gs://{gcs_bucket}/run/ckpt", {"w": np.arange(3.0)})
    assert info.value.errno == errno.EIO
    message = str(info.value)
    assert f"gs://{gcs_bucket}/run" in message and "400" in message, message
    assert gcs.keys(gcs_bucket) == []  # the probe of If-None-Match left nothing behind
