"""The public entry points on every kind of store: ``memory://`` URLs (rename strategy), a
memory store that behaves as an object store (manifest-last), a store without zero-copy views,
and the local disk, all through the same engine."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import savepoint as sp
from _compare import same
from savepoint.codecs import manifest as mf
from savepoint.commit import names
from savepoint.commit.transaction import resolve
from savepoint.engine.read import Reader
from savepoint.formats import detect
from savepoint.storage import memory
from savepoint.storage.base import BlobReader, PinnedContext
from savepoint.storage.memory import MemoryStore
from savepoint.storage.paths import Location
from savepoint.storage.paths import resolve as resolve_path


class NoViews(MemoryStore):
    """A memory store whose readers have no zero-copy views (as an object store's): the read
    engine must read into buffers instead."""

    def pin(self, path: str) -> PinnedContext:
        return _PinnedNoViews(super().pin(path))


class _PinnedNoViews:
    def __init__(self, inner: PinnedContext) -> None:
        self.inner = inner
        self.path = inner.path

    def __enter__(self) -> _PinnedNoViews:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def open_blob(self, name: str, *, copy_on_write: bool = False) -> BlobReader:
        return _ReaderNoViews(self.inner.open_blob(name, copy_on_write=copy_on_write))

    def read_small(self, name: str, *, cap: int | None) -> bytes:
        return self.inner.read_small(name, cap=cap)

    def identity(self) -> Any:
        return self.inner.identity()

    def close(self) -> None:
        self.inner.close()


class _ReaderNoViews:
    def __init__(self, inner: BlobReader) -> None:
        self.inner = inner
        self.name = inner.name
        self.size = inner.size
        self.reads = 0

    def read(self, offset: int, out: Any) -> None:
        self.reads += 1
        self.inner.read(offset, out)

    def view(self, start: int, end: int) -> None:
        return None

    def close(self) -> None:
        self.inner.close()


KINDS = ["url", "object", "no-views", "local"]


@pytest.fixture(params=KINDS)
def where(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    """A checkpoint path argument on one kind of store (the path itself does not exist)."""
    if request.param == "url":
        name = f"test-{id(tmp_path):x}"
        yield f"memory://{name}/ckpt"
        memory.shared().remove_tree(f"/{name}")
    elif request.param == "object":
        yield MemoryStore(atomic_rename=False).at("/bucket/run/ckpt")
    elif request.param == "no-views":
        yield NoViews().at("/run/ckpt")
    else:
        yield tmp_path / "ckpt"


def make_state(seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((64, 32)).astype(np.float32)
    return {
        "model": {"w": w, "tied": w, "b": rng.standard_normal(32)},
        "step": np.int64(seed),
        "flags": np.array([True, False, True]),
        "name": f"state-{seed}",
        "misc": [1, 2.5, None, b"bytes", (3, "x")],
    }


def location(path: Any) -> Location:
    return resolve_path(path)


def test_save_load_verify_inspect(where: Any) -> None:
    state = make_state(1)
    info = sp.save(where, state, metadata={"seed": 1}, max_file_bytes=4096)
    assert len(info.files) > 1
    same(sp.load(where), state)
    assert sp.verify(where).metadata == {"seed": 1}
    described = sp.inspect(where)
    assert described.metadata == {"seed": 1}
    assert {t.key for t in described.tensors} >= {"model/w", "model/b", "step"}
    assert described.path == info.path


def test_replace_keeps_one_checkpoint(where: Any) -> None:
    sp.save(where, make_state(1))
    sp.save(where, make_state(2), metadata={"seed": 2})
    same(sp.load(where), make_state(2))
    loc = location(where)
    store = loc.store
    found = resolve(store, loc.path)
    assert found is not None
    if store.capabilities.atomic_rename:
        assert found == loc.path
        assert store.list(store.parent(loc.path)) == [store.basename(loc.path)]
    else:
        assert store.list(loc.path) == [store.basename(found)]


def test_keys_into_and_mmap(where: Any) -> None:
    state = make_state(3)
    sp.save(where, state)
    assert sp.load(where, keys="model/b")["model"]["b"].tolist() == state["model"]["b"].tolist()
    into = {"model": {"w": np.zeros((64, 32), np.float32), "b": np.zeros(32)}, "step": np.int64(0)}
    sp.load(where, into=into, keys=["model", "step"])
    np.testing.assert_array_equal(into["model"]["w"], state["model"]["w"])
    mapped = sp.load(where, mmap=True)
    np.testing.assert_array_equal(mapped["model"]["w"], state["model"]["w"])
    mapped["model"]["w"][0, 0] = 42.0  # private: the checkpoint does not change
    assert sp.load(where)["model"]["w"][0, 0] == state["model"]["w"][0, 0]
    with pytest.raises(sp.IncompatibleCheckpointError, match="no such key"):
        sp.load(where, keys="nope")


@pytest.mark.parametrize("verify", [True, "first", False])
def test_into_a_mismatch_is_refused_before_anything_changes(where: Any, verify: Any) -> None:
    sp.save(where, make_state(4))
    into = {"model": {"w": np.zeros((3, 3), np.float32)}}
    with pytest.raises(sp.StateMismatchError):
        sp.load(where, into=into, verify=verify)
    assert not into["model"]["w"].any()


def test_a_damaged_tensor_is_caught(where: Any) -> None:
    sp.save(where, make_state(5))
    loc = location(where)
    store = loc.store
    directory = resolve(store, loc.path)
    assert directory is not None
    manifest = mf.parse(store.read_small(store.join(directory, mf.NAME), cap=None))
    rec = manifest.tensors["model/b"]
    blob = store.join(directory, rec.file)
    data = bytearray(store.read_small(blob, cap=None))
    data[rec.start] ^= 0xFF
    store.remove(blob)
    store.put(blob, bytes(data))
    with pytest.raises(sp.CorruptCheckpointError, match="checksum mismatch"):
        sp.load(where)
    with pytest.raises(sp.CorruptCheckpointError):
        sp.verify(where)
    assert sp.inspect(where).metadata == {}  # the manifest alone is intact


def test_missing_checkpoint(where: Any) -> None:
    with pytest.raises(sp.CheckpointNotFoundError):
        sp.load(where)
    with pytest.raises(sp.CheckpointNotFoundError):
        sp.inspect(where)


def test_progress(where: Any) -> None:
    state = make_state(6)
    seen: list[tuple[int, int]] = []
    sp.save(where, state, progress=lambda done, total: seen.append((done, total)))
    assert seen and seen[-1][0] == seen[-1][1]
    seen.clear()
    sp.load(where, progress=lambda done, total: seen.append((done, total)))
    assert seen and seen[-1][0] == seen[-1][1]


def test_a_single_process_sharded_save(where: Any) -> None:
    full = np.arange(24, dtype=np.float32).reshape(4, 6)
    state = {"w": sp.Shard(full, (4, 6), (0, 0)), "b": np.ones(3), "step": 3}
    info = sp.save(where, state)
    assert info.world_size == 1
    np.testing.assert_array_equal(sp.load(where)["w"], full)
    target = {"w": sp.Shard(np.zeros((2, 6), np.float32), (4, 6), (2, 0))}
    sp.load(where, into=target)
    np.testing.assert_array_equal(target["w"].local, full[2:])
    assert sp.verify(where).world_size == 1


def test_consolidate_between_stores(where: Any, tmp_path: Path) -> None:
    from savepoint.distributed.consolidate import consolidate

    full = np.arange(24, dtype=np.float32).reshape(4, 6)
    sp.save(where, {"w": sp.Shard(full, (4, 6), (0, 0))})
    out = tmp_path / "whole"
    assert consolidate(where, out).world_size is None
    np.testing.assert_array_equal(sp.load(out)["w"], full)


def test_async_checkpointer(where: Any) -> None:
    with sp.AsyncCheckpointer(max_file_bytes=4096) as ck:
        info = ck.save(where, make_state(7)).wait()
        ck.save(where, make_state(8)).wait()
    assert len(info.files) > 1
    same(sp.load(where), make_state(8))


def test_the_read_fallback_reads_into_buffers() -> None:
    store = NoViews()
    at = store.at("/run/ckpt")
    sp.save(at, make_state(9))
    with Reader.open(at) as reader:
        out = np.empty(reader.manifest.tensors["model/w"].nbytes, dtype=np.uint8)
        reader.transfer([("model/w", out)])
        np.testing.assert_array_equal(
            out.view(np.float32).reshape(64, 32), make_state(9)["model"]["w"]
        )
        assert all(f.array is None for f in reader._files.values())


def test_a_reader_keeps_its_generation_while_a_writer_replaces_it() -> None:
    for store in (MemoryStore(), MemoryStore(atomic_rename=False)):
        at = store.at("/run/ckpt")
        sp.save(at, make_state(1))
        with Reader.open(at) as reader:
            for seed in (2, 3):
                sp.save(at, make_state(seed))  # replaces, then deletes the previous generation
            out = np.empty(reader.manifest.tensors["model/b"].nbytes, dtype=np.uint8)
            reader.transfer([("model/b", out)])
        np.testing.assert_array_equal(out.view(np.float64), make_state(1)["model"]["b"])
        same(sp.load(at), make_state(3))


def test_concurrent_readers_and_a_writer_on_memory() -> None:
    store = MemoryStore(atomic_rename=False)
    at = store.at("/run/ckpt")
    states = [make_state(0), make_state(1)]
    sp.save(at, states[0])
    stop = threading.Event()
    errors: list[BaseException] = []
    loads: list[int] = []

    def read() -> None:
        while not stop.is_set():
            try:
                got = sp.load(at)
                assert got["name"] in ("state-0", "state-1")
                same(got, states[int(got["name"][-1])])
                loads.append(1)
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)
                return
            time.sleep(0.001)  # let the writer have the GIL now and then (two spinning readers
            # starved it: 30 saves took 80 s); loads still overlap every save

    readers = [threading.Thread(target=read) for _ in range(2)]
    for t in readers:
        t.start()
    for i in range(30):
        sp.save(at, states[i % 2])
    stop.set()
    for t in readers:
        t.join()
    assert not errors, errors[:3]
    assert len(loads) >= 10, len(loads)  # the readers really raced the saves


def test_a_generation_prefix_names_the_attempt() -> None:
    store = MemoryStore(atomic_rename=False)
    info = sp.save(store.at("/b/ckpt"), make_state(1))
    gen = info.path.rsplit("/", 1)[-1]
    assert names.is_generation(gen)
    assert f"-{names.HOST}-" in gen


def _sibling(where: Any, name: str) -> Any:
    """Another checkpoint path beside ``where``, on the same store."""
    if isinstance(where, Location):
        return where.store.at(where.store.join(where.store.parent(where.path), name))
    if isinstance(where, str):
        return where.rsplit("/", 1)[0] + f"/{name}"
    return where.parent / name


def test_convert_and_diff_on_every_store(where: Any, tmp_path: Path) -> None:
    """savepoint's own format converts and compares on any store, to and from the local disk;
    other formats stay local files (a clear refusal names why, and nothing is written)."""
    state = make_state(1)
    sp.save(where, state, metadata={"seed": 1})
    copy = _sibling(where, "copy")
    report = sp.convert(where, copy)
    assert report.destination_format == "savepoint" and report.tensors == 4
    same(sp.load(copy), state)
    assert sp.diff(where, copy).identical
    local_copy = tmp_path / "local-copy"
    sp.convert(where, local_copy)
    same(sp.load(local_copy), state)
    st_file = tmp_path / "weights.safetensors"
    sp.convert(where, st_file, lossy=True)  # plain values have no place in a safetensors file
    assert detect.detect(st_file) == "safetensors"
    keys = {t.key for t in detect.inspect_any(st_file).tensors}
    assert keys == {"model/w", "model/tied", "model/b", "step", "flags"}
    back = _sibling(where, "back")
    sp.convert(local_copy, back)
    same(sp.load(back), state)
    sp.save(copy, make_state(2))
    assert not sp.diff(where, copy).identical
    with pytest.raises(sp.CheckpointWriteError, match="already exists"):
        sp.convert(where, copy)
    with pytest.raises(sp.CheckpointWriteError, match="the source itself"):
        sp.convert(where, where, overwrite=True)
    if not isinstance(where, Path):
        with pytest.raises(sp.UnsupportedStorageError, match="local paths only"):
            sp.convert(local_copy, _sibling(where, "x.shrew"), format="shrew")
        with pytest.raises(sp.UnsupportedStorageError, match="safetensors file is written"):
            sp.convert(local_copy, _sibling(where, "w.safetensors"))  # the name asks for it
        assert sp.diff(where, back).identical


class _Counted:
    """Byte and call counts of every read through a NoViews store's readers."""

    def __init__(self, store: NoViews, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        self.bytes = 0
        counted = self
        real = _ReaderNoViews.read

        def read(self: _ReaderNoViews, offset: int, out: Any) -> None:
            counted.calls += 1
            counted.bytes += memoryview(out).nbytes
            real(self, offset, out)

        monkeypatch.setattr(_ReaderNoViews, "read", read)

    def reset(self) -> None:
        self.calls = self.bytes = 0


def test_ranged_reads_read_what_a_load_needs_and_group_small_tensors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a store without views (an object store) a load reads each tensor's bytes once,
    straight into its destination: many small tensors in one request per neighbourhood, a
    ``keys=`` load only the bytes of the keys asked for, and a corrupt byte is still caught."""
    store = NoViews()
    where = store.at("/run/ckpt")
    rng = np.random.default_rng(0)
    small = {f"s{i:03d}": rng.standard_normal(64).astype(np.float32) for i in range(200)}
    big = rng.standard_normal(3 << 20).astype(np.float32)  # 12 MiB
    state = {"small": small, "big": big}
    sp.save(where, state)
    tensor_bytes = big.nbytes + sum(a.nbytes for a in small.values())
    counted = _Counted(store, monkeypatch)
    into = {"small": {k: np.zeros_like(v) for k, v in small.items()}, "big": np.zeros_like(big)}
    sp.load(where, into=into)
    same(into, state)
    # headers are read once per file on top of the tensors; no byte of a tensor twice
    assert tensor_bytes <= counted.bytes <= tensor_bytes + (64 << 10), counted.bytes
    assert counted.calls <= 8, counted.calls  # not one request per small tensor (201 tensors)
    counted.reset()
    got = sp.load(where, keys="small/s007")
    np.testing.assert_array_equal(got["small"]["s007"], small["s007"])
    assert counted.bytes <= small["s007"].nbytes + (64 << 10), counted.bytes
    counted.reset()
    sp.verify(where)
    assert tensor_bytes <= counted.bytes <= tensor_bytes + (64 << 10)
    # A flipped byte in the big tensor is caught when it is read this way.
    found = resolve(store, where.path)
    assert found is not None
    manifest = mf.parse(store.read_small(store.join(found, mf.NAME), cap=None))
    rec = manifest.tensors[next(r for r, t in manifest.tensors.items() if t.nbytes == big.nbytes)]
    path = store.join(found, rec.file)
    data = bytearray(store.read_small(path, cap=None))
    data[rec.start + 12345] ^= 0xFF
    store.remove(path)
    store.put(path, bytes(data))
    with pytest.raises(sp.CorruptCheckpointError, match="checksum mismatch"):
        sp.load(where, into=into)


def _flip(store: NoViews, where: Any, offset: int) -> None:
    """Flip the byte at ``offset`` of the first data file of the checkpoint at ``where``."""
    found = resolve(store, where.path)
    assert found is not None
    manifest = mf.parse(store.read_small(store.join(found, mf.NAME), cap=None))
    path = store.join(found, sorted(manifest.files)[0])
    data = bytearray(store.read_small(path, cap=None))
    data[offset] ^= 0xFF
    store.remove(path)
    store.put(path, bytes(data))


def test_a_sharded_load_reads_the_rows_it_needs(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a store without views, a rank restoring part of a saved shard reads only the bytes of
    that part (plus headers), verified or not: a verified load reads and checks the blocks
    holding that part (manifest version 3 block checksums), never the whole shard."""
    store = NoViews()
    where = store.at("/run/ckpt")
    full = np.random.default_rng(3).standard_normal((1024, 1024)).astype(np.float32)  # 4 MiB
    sp.save(where, {"w": sp.Shard(full, full.shape, (0, 0))})
    counted = _Counted(store, monkeypatch)
    rows = slice(301, 557)  # 1 MiB, not on a block boundary (blocks of 64 KiB: 16 rows)
    needed = full[rows].nbytes

    def target() -> dict[str, Any]:
        return {"w": sp.Shard(np.zeros((256, 1024), np.float32), full.shape, (301, 0))}

    for verify in (False, True):
        counted.reset()
        into = target()
        sp.load(where, into=into, verify=verify)
        np.testing.assert_array_equal(into["w"].local, full[rows])
        assert counted.bytes <= 1.1 * needed + (64 << 10), (verify, counted.bytes, needed)


def test_a_verified_partial_load_checks_the_blocks_it_reads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A flipped byte in a block the load reads is caught and named; one outside those blocks
    is not read (so not seen) by that load, and ``verify`` (which reads everything) finds it."""
    store = NoViews()
    where = store.at("/run/ckpt")
    full = np.random.default_rng(4).standard_normal((1024, 1024)).astype(np.float32)
    sp.save(where, {"w": sp.Shard(full, full.shape, (0, 0))})
    found = resolve(store, where.path)
    assert found is not None
    manifest = mf.parse(store.read_small(store.join(found, mf.NAME), cap=None))
    assert manifest.format_version == mf.BLOCKED
    rec = manifest.tensors["w"]
    assert rec.block == 64 << 10 and len(rec.blocks) == 64
    _flip(store, where, rec.start + 900 * 4096 + 5)  # row 900: block 57, outside rows 0..255
    into = {"w": sp.Shard(np.zeros((256, 1024), np.float32), full.shape, (0, 0))}
    sp.load(where, into=into)
    np.testing.assert_array_equal(into["w"].local, full[:256])
    with pytest.raises(sp.CorruptCheckpointError, match=r"'w'.*block 57 of 64"):
        sp.verify(where)
    with pytest.raises(sp.CorruptCheckpointError, match=r"block 57 of 64"):
        sp.load(where)
    bottom = {"w": sp.Shard(np.zeros((256, 1024), np.float32), full.shape, (768, 0))}
    with pytest.raises(sp.CorruptCheckpointError, match=r"block 57 of 64"):
        sp.load(where, into=bottom)
