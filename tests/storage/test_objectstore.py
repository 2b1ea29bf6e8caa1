"""What is specific to the object-store backend (savepoint.storage.objectstore), on a real
S3-protocol server (moto, on loopback): multipart part sizing, aborted uploads, create-only puts,
ranged reads of one object version, and saves and loads through s3:// URLs.

(Everything the Store protocol promises is checked by test_contract.py, which includes this
backend as ``s3``.)
"""

from __future__ import annotations

import errno

import numpy as np
import pytest

from . import _s3server

pytestmark = pytest.mark.skipif(not _s3server.AVAILABLE, reason=_s3server.SKIP_REASON)

if _s3server.AVAILABLE:
    import savepoint as sp
    from savepoint.errors import ReplacedWhileReadingError
    from savepoint.storage import objectstore
    from savepoint.storage.objectstore import MAX_PARTS, MIN_PART_SIZE, ObjectStore, part_size_for
    from savepoint.storage.paths import resolve

MiB = 1024 * 1024
RNG = np.random.default_rng(15)


def data(n: int) -> bytes:
    return RNG.integers(0, 256, n, dtype=np.uint8).tobytes()


@pytest.fixture
def server(s3: _s3server.Server) -> _s3server.Server:
    return s3


@pytest.fixture
def store(s3: _s3server.Server) -> ObjectStore:
    return ObjectStore("s3", part_size=MIN_PART_SIZE, prefetch=MiB, read_chunk=2 * MiB)


def read_all(store: ObjectStore, path: str) -> bytes:
    r = store.open_blob(path)
    try:
        out = bytearray(r.size)
        r.read(0, out)
        return bytes(out)
    finally:
        r.close()


def write(store: ObjectStore, path: str, payload: bytes, *, step: int = MiB) -> None:
    w = store.create_blob(path, size=len(payload))
    try:
        for pos in range(0, len(payload), step):
            w.write(memoryview(payload)[pos : pos + step])
        w.finish()
    except BaseException:
        w.abort()
        raise


# ---------------------------------------------------------------------------------------------
# part sizes
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "size", [None, 0, 1, 16 * MiB, 10 * 1024 * MiB, 1024**4, 5 * 1024**4, 5 * 1024**4 + 1]
)
def test_part_size_keeps_parts_under_ten_thousand(size: int | None) -> None:
    part = part_size_for(size, 16 * MiB)
    assert part >= 16 * MiB and part % MiB == 0
    if size:
        assert -(-size // part) < MAX_PARTS
    if size is not None and size <= 16 * MiB * (MAX_PARTS - 1):
        assert part == 16 * MiB  # grown only when it has to


def test_part_size_minimum_and_maximum() -> None:
    assert part_size_for(None, 1) == MIN_PART_SIZE
    with pytest.raises(OSError) as info:
        part_size_for(5 * 1024**3 * MAX_PARTS)
    assert info.value.errno == errno.EFBIG
    with pytest.raises(ValueError, match="minimum"):
        ObjectStore("s3", part_size=MiB)


def test_declared_size_picks_the_writer_part_size(store: ObjectStore, s3_bucket: str) -> None:
    store.makedirs(f"/{s3_bucket}/d")
    w = store.create_blob(f"/{s3_bucket}/d/huge", size=200 * 1024**3)
    try:
        assert w.part_size > MIN_PART_SIZE
        assert -(-200 * 1024**3 // w.part_size) < MAX_PARTS
    finally:
        w.abort()


# ---------------------------------------------------------------------------------------------
# multipart uploads
# ---------------------------------------------------------------------------------------------


def test_blob_bigger_than_one_part_is_a_multipart_upload(
    store: ObjectStore, s3_bucket: str, server: _s3server.Server
) -> None:
    payload = data(12 * MiB + 123)
    path = f"/{s3_bucket}/big"
    w = store.create_blob(path, size=len(payload))
    for pos in range(0, len(payload), 3 * MiB):
        w.write(memoryview(payload)[pos : pos + 3 * MiB])
    assert server.open_uploads(s3_bucket) != []  # under way: parts already sent
    w.finish()
    assert w.parts == 3  # 5 MiB, 5 MiB, 2 MiB + 123 bytes
    client = server.client()
    try:
        etag = client.head_object(Bucket=s3_bucket, Key="big")["ETag"]
    finally:
        client.close()
    assert etag.strip('"').endswith("-3")  # S3's ETag of a 3-part upload
    assert read_all(store, path) == payload
    assert server.open_uploads(s3_bucket) == []


def test_small_blob_is_one_put(
    store: ObjectStore, s3_bucket: str, server: _s3server.Server
) -> None:
    payload = data(MIN_PART_SIZE)  # exactly one part: no multipart upload
    w = store.create_blob(f"/{s3_bucket}/one", size=len(payload))
    w.write(memoryview(payload))
    w.finish()
    assert w.parts == 0
    client = server.client()
    try:
        etag = client.head_object(Bucket=s3_bucket, Key="one")["ETag"]
    finally:
        client.close()
    assert "-" not in etag
    assert read_all(store, f"/{s3_bucket}/one") == payload


@pytest.mark.parametrize("how", ["abort", "short-finish", "conflict"])
def test_no_multipart_upload_is_left_open(
    store: ObjectStore, s3_bucket: str, server: _s3server.Server, how: str
) -> None:
    path = f"/{s3_bucket}/blob"
    w = store.create_blob(path, size=14 * MiB)
    w.write(memoryview(data(11 * MiB)))
    assert len(server.open_uploads(s3_bucket)) == 1
    if how == "abort":
        w.abort()
        assert store.stat(path) is None
    elif how == "short-finish":
        with pytest.raises(ValueError, match="written of the"):
            w.finish()
        w.abort()
        assert store.stat(path) is None
    else:
        w.write(memoryview(data(3 * MiB)))
        store.put(path, b"the other writer won")  # a create-only put between create and finish
        with pytest.raises(FileExistsError):
            w.finish()
        w.abort()
        assert read_all(store, path) == b"the other writer won"
    assert server.open_uploads(s3_bucket) == []


def test_unknown_size_over_one_part(store: ObjectStore, s3_bucket: str) -> None:
    payload = data(6 * MiB + 5)
    w = store.create_blob(f"/{s3_bucket}/u")
    w.write(memoryview(payload)[: 4 * MiB])
    w.write(memoryview(payload)[4 * MiB :])
    w.finish()
    assert w.parts == 2
    assert read_all(store, f"/{s3_bucket}/u") == payload


# ---------------------------------------------------------------------------------------------
# create-only puts
# ---------------------------------------------------------------------------------------------


def test_create_only_put_conflict(store: ObjectStore, s3_bucket: str) -> None:
    path = f"/{s3_bucket}/manifest.json"
    store.put(path, b"first")
    with pytest.raises(FileExistsError) as info:
        store.put(path, b"second")
    assert info.value.filename == f"s3://{s3_bucket}/manifest.json"
    assert read_all(store, path) == b"first"
    store.put(path, b"replaced", exclusive=False)
    assert read_all(store, path) == b"replaced"


def test_if_none_match_is_honoured_by_the_server(s3_bucket: str, s3: _s3server.Server) -> None:
    # What create_only_put rests on, asked of the server directly: a second create-only PUT of
    # one key is refused with a precondition error.
    import obstore
    from obstore.store import S3Store

    raw = S3Store(s3_bucket, endpoint=s3.endpoint, client_options={"allow_http": True})
    obstore.put(raw, "k", b"1", mode="create")
    with pytest.raises(
        (obstore.exceptions.AlreadyExistsError, obstore.exceptions.PreconditionError)
    ):
        obstore.put(raw, "k", b"2", mode="create")


# ---------------------------------------------------------------------------------------------
# ranged reads
# ---------------------------------------------------------------------------------------------


def test_ranged_reads_of_part_of_a_big_object(store: ObjectStore, s3_bucket: str) -> None:
    payload = data(20 * MiB + 7)
    path = f"/{s3_bucket}/big"
    write(store, path, payload)
    r = store.open_blob(path)
    try:
        assert r.size == len(payload)
        for offset, n in [(0, 10), (MiB - 3, 6), (7 * MiB + 3, 9 * MiB), (len(payload) - 5, 5)]:
            out = np.empty(n, dtype=np.uint8)
            r.read(offset, out)
            assert out.tobytes() == payload[offset : offset + n], (offset, n)
        assert r.view(0, 10) is None
    finally:
        r.close()


@pytest.mark.parametrize("change", ["replaced", "deleted"])
def test_reader_refuses_another_version(store: ObjectStore, s3_bucket: str, change: str) -> None:
    path = f"/{s3_bucket}/big"
    payload = data(3 * MiB)
    write(store, path, payload)
    r = store.open_blob(path)
    try:
        if change == "replaced":
            store.put(path, data(3 * MiB), exclusive=False)
        else:
            store.remove(path)
        head = bytearray(100)
        r.read(0, head)  # the first ``prefetch`` bytes came with the open
        assert bytes(head) == payload[:100]
        # Not damage: a writer replaced it (loads read the new generation again).
        with pytest.raises(ReplacedWhileReadingError, match="replaced or deleted since it was"):
            r.read(2 * MiB, bytearray(10))
    finally:
        r.close()


def test_errors_name_the_object(store: ObjectStore, s3_bucket: str) -> None:
    with pytest.raises(FileNotFoundError) as info:
        store.open_blob(f"/{s3_bucket}/missing")
    assert info.value.filename == f"s3://{s3_bucket}/missing"
    with pytest.raises(OSError, match="no-such-bucket-here"):
        store.put("/no-such-bucket-here/x", b"x")


def test_remove_tree_deletes_every_object_under_the_prefix(
    store: ObjectStore, s3_bucket: str
) -> None:
    root = f"/{s3_bucket}/t"
    store.makedirs(root)
    for i in range(30):
        store.put(f"{root}/f{i:02d}", b"x")
    store.makedirs(f"{root}/sub/deeper")
    store.put(f"{root}/sub/deeper/g", b"y")
    store.put(f"/{s3_bucket}/t-sibling", b"kept")  # shares the prefix "t", not "t/"
    assert len(store.list(root)) == 31
    store.remove_tree(root)
    assert store.stat(root) is None
    assert store.list(f"/{s3_bucket}") == ["t-sibling"]


# ---------------------------------------------------------------------------------------------
# savepoint over s3:// URLs
# ---------------------------------------------------------------------------------------------


def test_urls_resolve_to_the_shared_store(s3: _s3server.Server) -> None:
    location = resolve("s3://bucket/run/step%201")
    assert location.store is objectstore.shared("s3")
    assert location.path == "/bucket/run/step 1"
    assert str(location) == "s3://bucket/run/step 1"
    assert resolve("s3a://bucket/x").store is location.store


def test_save_load_verify_inspect_and_replace(s3_bucket: str, server: _s3server.Server) -> None:
    url = f"s3://{s3_bucket}/run/x"
    first = {
        "big": RNG.standard_normal(5 * MiB, dtype=np.float32),  # 20 MiB: a multipart upload
        "small": np.arange(10, dtype=np.int64),
        "step": 1,
    }
    info = sp.save(url, first)
    assert info.path.startswith(url)
    loaded = sp.load(url)
    np.testing.assert_array_equal(loaded["big"], first["big"])
    np.testing.assert_array_equal(loaded["small"], first["small"])
    assert loaded["step"] == 1
    verified = sp.verify(url)
    assert {t.key for t in verified.tensors} >= {"big", "small"}
    assert sp.inspect(url).path == info.path

    second = {"big": np.ones(3, dtype=np.float32), "small": np.zeros(2, np.int64), "step": 2}
    again = sp.save(url, second)  # a replace: a new generation, the old one deleted
    assert again.path != info.path
    loaded = sp.load(url)
    np.testing.assert_array_equal(loaded["big"], second["big"])
    assert loaded["step"] == 2
    store = objectstore.shared("s3")
    generations = store.list(f"/{s3_bucket}/run/x")
    assert len(generations) == 1 and generations[0].startswith("gen-")
    assert server.open_uploads(s3_bucket) == []


def test_loads_racing_a_replacing_writer_never_fail_on_s3(s3_bucket: str) -> None:
    """A checkpoint of several data files replaced while two threads load and verify it in a
    loop: every load returns exactly the old state or the new one, and none fails (a
    generation deleted under a read is read again from the new one)."""
    import threading

    import savepoint as sp

    url = f"s3://{s3_bucket}/ck"
    a = {f"t{i}": np.full(1 << 18, 1.0, np.float32) for i in range(6)}  # 6 x 1 MiB
    b = {f"t{i}": np.full(1 << 18, 2.0, np.float32) for i in range(6)}
    sp.save(url, a, max_file_bytes=2 << 20)
    stop = threading.Event()
    errors: list[BaseException] = []
    loads: list[int] = []

    def read() -> None:
        while not stop.is_set():
            try:
                got = sp.load(url)
                first = float(got["t0"][0])
                assert all(np.all(got[k] == first) for k in got), "a mixture"
                sp.verify(url)
                loads.append(1)
            except BaseException as exc:
                errors.append(exc)
                return

    readers = [threading.Thread(target=read) for _ in range(2)]
    for t in readers:
        t.start()
    for i in range(12):
        sp.save(url, b if i % 2 == 0 else a, max_file_bytes=2 << 20)
    stop.set()
    for t in readers:
        t.join()
    assert not errors, errors[:2]
    assert loads, "the readers never finished a load"


def test_a_run_in_a_missing_bucket_is_a_savepoint_error(s3: object) -> None:
    """Opening a manager or a view on a bucket that does not exist says so with a savepoint
    error naming the run, at once (no raw OSError from the store)."""
    import savepoint as sp

    url = "s3://savepoint-no-such-bucket/run"
    for open_ in (
        lambda: sp.CheckpointManager(url),
        lambda: sp.CheckpointManager(url, read_only=True),
    ):
        with pytest.raises(sp.CheckpointError, match="savepoint-no-such-bucket") as info:
            open_()
        assert "NoSuchBucket" in str(info.value) or "bucket" in str(info.value).lower()


def test_a_url_without_a_bucket_is_refused() -> None:
    import savepoint as sp

    for url in ("s3:///x", "s3://", "gs:///run/ckpt"):
        with pytest.raises(sp.UnsupportedStorageError, match="names no bucket"):
            sp.save(url, {"w": np.arange(3.0)})


def test_gc_on_a_missing_bucket_says_why(s3: object) -> None:
    """gc reports the store's own failure, not "no run here"."""
    import savepoint as sp
    from savepoint.runs.gc import collect

    with pytest.raises(sp.CheckpointError, match=r"cannot look at .*(NoSuchBucket|no-such)"):
        collect("s3://savepoint-no-such-bucket/run")
