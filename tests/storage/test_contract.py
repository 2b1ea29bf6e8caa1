"""The storage contract: every promise of savepoint.storage.base, checked against every backend.

One suite, parametrised over the local filesystem, the in-memory store (POSIX-like and as an
object store) and the fault-injecting wrapper around each with no fault armed. A backend passes
only if each capability flag it claims is honest (the tests under "capabilities").
"""

from __future__ import annotations

import errno
import mmap
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from savepoint.errors import CheckpointError, CorruptCheckpointError
from savepoint.storage.base import BlobWriter, Store, capability_problems, walk
from savepoint.storage.faults import FaultyStore
from savepoint.storage.local import LocalStore
from savepoint.storage.paths import resolve as resolve_path

from ._backends import ASYNC_CLOSE, CHILD_PRELUDE, NAMES, cleanup, make
from ._backends import root as backend_root

RNG = np.random.default_rng(20260101)
PAGE = 4096


@dataclass
class Env:
    name: str
    store: Store
    root: str  # an existing, empty directory of the store

    def path(self, *names: str) -> str:
        return self.store.join(self.root, *names)

    @property
    def local(self) -> bool:
        return self.store.scheme == "file"


@pytest.fixture(params=NAMES)
def env(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Env]:
    store = make(request.param)
    root = backend_root(request.param, tmp_path)
    store.makedirs(root)
    yield Env(request.param, store, root)
    cleanup(request.param, store, root)


def data(n: int) -> bytes:
    return RNG.integers(0, 256, n, dtype=np.uint8).tobytes()


def aligned(n: int) -> np.ndarray:
    """A page-aligned uint8 buffer of ``n`` bytes (what O_DIRECT writes need)."""
    return np.frombuffer(mmap.mmap(-1, max(n, 1)), dtype=np.uint8)[:n]


def write_blob(store: Store, path: str, payload: bytes, *, chunk: int = 3 * PAGE) -> None:
    """The documented call order: create, sequential aligned writes, a padded last one, finish."""
    w = store.create_blob(path, size=len(payload))
    try:
        step = max(chunk - chunk % w.alignment, w.alignment)
        padded = -(-len(payload) // PAGE) * PAGE if payload else 0
        buf = aligned(padded)
        buf[: len(payload)] = np.frombuffer(payload, dtype=np.uint8)
        for pos in range(0, padded, step):
            w.write(memoryview(buf[pos : pos + step]))
        w.finish()
    except BaseException:
        w.abort()
        raise


def read_all(store: Store, path: str) -> bytes:
    r = store.open_blob(path)
    try:
        out = bytearray(r.size)
        r.read(0, out)
        return bytes(out)
    finally:
        r.close()


def child(name: str, code: str, *args: str) -> str:
    """Run ``code`` in a fresh process that has ``make`` (of _backends) and ``store = make(name)``."""
    script = CHILD_PRELUDE + "\nstore = make(sys.argv[1])\n" + code
    done = subprocess.run(
        [sys.executable, "-c", script, name, *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


# ---------------------------------------------------------------------------------------------
# writing a blob
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 4097, 3 * PAGE * 2 + 17])
def test_written_blob_reads_back_exactly(env: Env, size: int) -> None:
    payload = data(size)
    write_blob(env.store, env.path("b"), payload)
    st = env.store.stat(env.path("b"))
    assert st is not None and st.kind == "file" and st.size == size
    assert read_all(env.store, env.path("b")) == payload
    assert env.store.list(env.root) == ["b"]


def test_padded_last_write_is_cut_back_by_finish(env: Env) -> None:
    payload = data(10_000)
    w = env.store.create_blob(env.path("b"), size=len(payload))
    buf = aligned(3 * PAGE)  # 2,288 bytes of zero padding past the payload
    buf[: len(payload)] = np.frombuffer(payload, dtype=np.uint8)
    w.write(memoryview(buf))
    w.finish()
    assert read_all(env.store, env.path("b")) == payload


def test_unknown_size_keeps_every_byte_written(env: Env) -> None:
    payload = data(5000)
    w = env.store.create_blob(env.path("b"))
    w.write(memoryview(payload)[:1234])
    w.write(memoryview(payload)[1234:])
    w.finish()
    assert read_all(env.store, env.path("b")) == payload


def test_write_takes_the_buffer_synchronously(env: Env) -> None:
    # The engine reuses its staging buffer as soon as write returns.
    w = env.store.create_blob(env.path("b"), size=2 * PAGE, direct=False)
    buf = aligned(PAGE)
    buf[:] = 1
    w.write(memoryview(buf))
    buf[:] = 2
    w.write(memoryview(buf))
    w.finish()
    assert read_all(env.store, env.path("b")) == b"\x01" * PAGE + b"\x02" * PAGE


def test_writes_from_another_thread(env: Env) -> None:
    payload = data(5 * PAGE)
    w = env.store.create_blob(env.path("b"), size=len(payload))
    errors: list[BaseException] = []

    def run() -> None:
        try:
            for pos in range(0, len(payload), PAGE):
                w.write(memoryview(payload)[pos : pos + PAGE])
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert not errors
    w.finish()
    assert read_all(env.store, env.path("b")) == payload


def test_create_blob_is_exclusive(env: Env) -> None:
    env.store.put(env.path("b"), b"old")
    with pytest.raises(FileExistsError):
        env.store.create_blob(env.path("b"), size=3)
    assert read_all(env.store, env.path("b")) == b"old"


def test_create_blob_needs_its_directory(env: Env) -> None:
    with pytest.raises(FileNotFoundError):
        env.store.create_blob(env.path("missing", "b"), size=1)


def test_two_writers_of_one_path_only_one_wins(env: Env) -> None:
    first = env.store.create_blob(env.path("b"), size=5)
    try:
        second: BlobWriter | None = env.store.create_blob(env.path("b"), size=5)
    except FileExistsError:
        second = None  # local files: refused at once
    first.write(memoryview(b"first"))
    first.finish()
    if second is not None:  # memory, object stores: refused at the latest at finish
        second.write(memoryview(b"other"))
        with pytest.raises(FileExistsError):
            second.finish()
        second.abort()
    assert read_all(env.store, env.path("b")) == b"first"


def test_finish_refuses_fewer_bytes_than_announced(env: Env) -> None:
    w = env.store.create_blob(env.path("b"), size=10)
    w.write(memoryview(b"12345"))
    with pytest.raises(ValueError, match="5 bytes written of the 10"):
        w.finish()
    w.abort()
    assert env.store.stat(env.path("b")) is None


@pytest.mark.parametrize("stage", ["created", "written", "finished"])
def test_abort_leaves_nothing_and_never_raises(env: Env, stage: str) -> None:
    w = env.store.create_blob(env.path("b"), size=PAGE)
    if stage != "created":
        w.write(memoryview(aligned(PAGE)))
    if stage == "finished":
        w.finish()
    w.abort()
    w.abort()  # twice: still quiet
    assert env.store.stat(env.path("b")) is None
    assert env.store.list(env.root) == []


def test_abort_after_a_failed_finish_leaves_nothing(env: Env) -> None:
    w = env.store.create_blob(env.path("b"), size=4)
    w.write(memoryview(b"ab"))
    with pytest.raises(ValueError):
        w.finish()
    w.abort()
    assert env.store.list(env.root) == []


def test_writer_takes_no_calls_after_finish_or_abort(env: Env) -> None:
    w = env.store.create_blob(env.path("b"), size=1)
    w.write(memoryview(b"x"))
    w.finish()
    with pytest.raises(ValueError):
        w.write(memoryview(b"y"))
    with pytest.raises(ValueError):
        w.finish()
    w2 = env.store.create_blob(env.path("c"), size=1)
    w2.abort()
    with pytest.raises(ValueError):
        w2.write(memoryview(b"y"))
    assert read_all(env.store, env.path("b")) == b"x"


# ---------------------------------------------------------------------------------------------
# reading a blob
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def blob(env: Env) -> tuple[str, bytes]:
    payload = data(3 * PAGE + 123)
    write_blob(env.store, env.path("blob"), payload)
    return env.path("blob"), payload


def test_reader_size_and_reads_at_offsets(env: Env, blob: tuple[str, bytes]) -> None:
    path, payload = blob
    r = env.store.open_blob(path)
    try:
        assert r.size == len(payload)
        assert isinstance(r.name, str) and r.name
        for offset, n in [(0, 1), (1, 4096), (4095, 2), (len(payload) - 5, 5), (100, 0)]:
            out = bytearray(n)
            r.read(offset, out)
            assert bytes(out) == payload[offset : offset + n]
        # Any writable contiguous buffer, taken as bytes.
        arr = np.empty(16, dtype=np.float32)
        r.read(8, arr)
        assert arr.tobytes() == payload[8 : 8 + 64]
        mv = memoryview(bytearray(10))
        r.read(len(payload) - 10, mv)
        assert bytes(mv) == payload[-10:]
        r.read(len(payload), bytearray(0))  # nothing, at the very end: fine
    finally:
        r.close()


def test_read_past_the_end_is_eof(env: Env, blob: tuple[str, bytes]) -> None:
    path, payload = blob
    r = env.store.open_blob(path)
    try:
        with pytest.raises(EOFError):
            r.read(len(payload) - 3, bytearray(4))
        with pytest.raises(EOFError):
            r.read(len(payload) + 1, bytearray(0))
        with pytest.raises(ValueError):
            r.read(-1, bytearray(1))
    finally:
        r.close()


def test_view_is_exact_and_bounded(env: Env, blob: tuple[str, bytes]) -> None:
    path, payload = blob
    r = env.store.open_blob(path)
    try:
        view = r.view(10, 5000)
        if not env.store.capabilities.zero_copy:
            assert view is None
            return
        assert view is not None and view.dtype == np.uint8
        assert view.tobytes() == payload[10:5000]
        assert not view.flags.writeable
        empty = r.view(0, 0)
        assert empty is not None and len(empty) == 0
        with pytest.raises(EOFError):
            r.view(0, len(payload) + 1)
        with pytest.raises(EOFError):
            r.view(5, 4)
    finally:
        r.close()


def test_view_of_an_empty_blob(env: Env) -> None:
    env.store.put(env.path("empty"), b"")
    r = env.store.open_blob(env.path("empty"))
    try:
        assert r.size == 0
        view = r.view(0, 0)
        assert view is None or len(view) == 0
    finally:
        r.close()


def test_copy_on_write_views_are_writable_and_private(env: Env, blob: tuple[str, bytes]) -> None:
    if not env.store.capabilities.zero_copy:
        pytest.skip("no views on this backend")
    path, payload = blob
    a = env.store.open_blob(path, copy_on_write=True)
    b = env.store.open_blob(path, copy_on_write=True)
    try:
        va, vb = a.view(0, 100), b.view(0, 100)
        assert va is not None and vb is not None
        assert va.flags.writeable
        va[:] = 7
        assert vb.tobytes() == payload[:100]
    finally:
        a.close()
        b.close()
    assert read_all(env.store, path) == payload
    assert bytes(va) == b"\x07" * 100  # a copy-on-write view outlives its reader


def test_open_reader_keeps_its_bytes_after_replace_and_delete(env: Env) -> None:
    env.store.put(env.path("b"), b"old bytes")
    r = env.store.open_blob(env.path("b"))
    try:
        env.store.put(env.path("b"), b"new bytes!", exclusive=False)
        out = bytearray(9)
        r.read(0, out)
        assert bytes(out) == b"old bytes"
        env.store.remove(env.path("b"))
        r.read(0, out)
        assert bytes(out) == b"old bytes"
    finally:
        r.close()


def test_open_blob_errors(env: Env) -> None:
    env.store.put(env.path("file"), b"x")
    env.store.mkdir(env.path("dir"))
    with pytest.raises(FileNotFoundError):
        env.store.open_blob(env.path("missing"))
    with pytest.raises(FileNotFoundError):
        env.store.open_blob(env.path("file", "under-a-blob"))
    with pytest.raises(FileNotFoundError):
        env.store.read_small(env.path("file", "under-a-blob"), cap=None)
    with pytest.raises(CorruptCheckpointError):
        env.store.open_blob(env.path("dir"))


def test_local_refusals_are_checkpoint_errors(env: Env) -> None:
    if not env.local:
        pytest.skip("symlinks and FIFOs exist on local filesystems")
    target = env.path("target")
    env.store.put(target, b"x")
    os.symlink(target, env.path("link"))
    os.mkfifo(env.path("fifo"))
    for name in ("link", "fifo"):
        with pytest.raises(CorruptCheckpointError) as info:
            env.store.open_blob(env.path(name))
        assert info.value.path == env.path(name)
        with pytest.raises(CorruptCheckpointError):
            env.store.read_small(env.path(name), cap=None)
        with env.store.pin(env.root) as pinned, pytest.raises(CheckpointError):
            pinned.open_blob(name)


def test_read_small(env: Env) -> None:
    env.store.put(env.path("doc"), b"0123456789")
    assert env.store.read_small(env.path("doc"), cap=None) == b"0123456789"
    assert env.store.read_small(env.path("doc"), cap=10) == b"0123456789"
    with pytest.raises(CorruptCheckpointError, match="over the"):
        env.store.read_small(env.path("doc"), cap=9)
    with pytest.raises(FileNotFoundError):
        env.store.read_small(env.path("missing"), cap=None)


# ---------------------------------------------------------------------------------------------
# put
# ---------------------------------------------------------------------------------------------


def test_put_exclusive_creates_once(env: Env) -> None:
    env.store.put(env.path("m"), b"first")
    with pytest.raises(FileExistsError):
        env.store.put(env.path("m"), b"second")
    assert read_all(env.store, env.path("m")) == b"first"
    with pytest.raises(FileNotFoundError):
        env.store.put(env.path("missing", "m"), b"x")
    assert env.store.list(env.root) == ["m"]  # no temporary left beside it


def test_put_replace_is_atomic_and_leaves_no_temporary(env: Env) -> None:
    env.store.put(env.path("m"), b"first", exclusive=False)  # absent: created
    before = env.store.open_blob(env.path("m"))
    try:
        env.store.put(env.path("m"), b"second, longer", exclusive=False)
        out = bytearray(5)
        before.read(0, out)
        assert bytes(out) == b"first"
    finally:
        before.close()
    assert read_all(env.store, env.path("m")) == b"second, longer"
    assert env.store.list(env.root) == ["m"]


def test_put_over_a_directory_fails_and_keeps_it(env: Env) -> None:
    env.store.mkdir(env.path("d"))
    env.store.put(env.path("d", "x"), b"x")
    for exclusive in (True, False):
        with pytest.raises(OSError):
            env.store.put(env.path("d"), b"blob", exclusive=exclusive)
    st = env.store.stat(env.path("d"))
    assert st is not None and st.kind == "dir"
    assert env.store.list(env.path("d")) == ["x"]


def test_put_making_dir(env: Env) -> None:
    store = env.store
    store.put_making_dir(env.path("a", "b", "m"), b"first")  # both directories made
    assert store.list(env.root) == ["a"] and store.list(env.path("a", "b")) == ["m"]
    st = store.stat(env.path("a", "b"))
    assert st is not None and st.kind == "dir"
    assert read_all(store, env.path("a", "b", "m")) == b"first"
    with pytest.raises(FileExistsError):
        store.put_making_dir(env.path("a", "b", "m"), b"second")
    store.put_making_dir(env.path("a", "b", "m"), b"second", exclusive=False)  # existing: put
    assert read_all(store, env.path("a", "b", "m")) == b"second"
    assert store.list(env.path("a", "b")) == ["m"]
    store.put(env.path("f"), b"x")
    with pytest.raises(OSError):  # a blob where the directory would be
        store.put_making_dir(env.path("f", "d", "m"), b"y")
    assert read_all(store, env.path("f")) == b"x"
    assert store.list(env.root) == ["a", "f"]


# ---------------------------------------------------------------------------------------------
# stat, list, directories, removal
# ---------------------------------------------------------------------------------------------


def test_stat_kinds_and_identity(env: Env) -> None:
    env.store.put(env.path("f"), b"12345")
    env.store.mkdir(env.path("d"))
    assert env.store.stat(env.path("missing")) is None
    assert env.store.stat(env.path("f", "under-a-blob")) is None
    f, d = env.store.stat(env.path("f")), env.store.stat(env.path("d"))
    assert f is not None and f.kind == "file" and f.size == 5 and f.mtime > 0
    assert d is not None and d.kind == "dir"
    assert f.identity != d.identity
    again = env.store.stat(env.path("f"))
    assert again is not None and again.identity == f.identity
    if env.local:
        os.symlink(env.path("d"), env.path("link"))
        os.mkfifo(env.path("fifo"))
        link, fifo = env.store.stat(env.path("link")), env.store.stat(env.path("fifo"))
        assert link is not None and link.kind == "link"
        assert fifo is not None and fifo.kind == "other"


def test_list_is_sorted_and_forgiving(env: Env) -> None:
    for name in ["b", "a", "c"]:
        env.store.put(env.path(name), b"")
    env.store.mkdir(env.path("0dir"))
    assert env.store.list(env.root) == ["0dir", "a", "b", "c"]
    assert env.store.list(env.path("missing")) == []
    assert env.store.list(env.path("a")) == []


def test_makedirs_and_mkdir(env: Env) -> None:
    env.store.makedirs(env.path("a", "b", "c"))
    env.store.makedirs(env.path("a", "b", "c"))  # existing: fine
    st = env.store.stat(env.path("a", "b", "c"))
    assert st is not None and st.kind == "dir"
    with pytest.raises(FileExistsError):
        env.store.mkdir(env.path("a"))
    with pytest.raises(FileNotFoundError):
        env.store.mkdir(env.path("x", "y"))
    env.store.put(env.path("f"), b"")
    with pytest.raises(FileExistsError):
        env.store.makedirs(env.path("f"))
    with pytest.raises(FileExistsError):
        env.store.mkdir(env.path("f"))


def test_remove(env: Env) -> None:
    env.store.put(env.path("f"), b"x")
    env.store.mkdir(env.path("d"))
    env.store.remove(env.path("f"))
    assert env.store.stat(env.path("f")) is None
    with pytest.raises(FileNotFoundError):
        env.store.remove(env.path("f"))
    with pytest.raises(OSError):  # a directory is not a blob (EISDIR, EPERM)
        env.store.remove(env.path("d"))
    assert env.store.stat(env.path("d")) is not None


def test_remove_tree(env: Env) -> None:
    env.store.makedirs(env.path("t", "a", "b"))
    env.store.put(env.path("t", "a", "b", "f"), b"x")
    env.store.put(env.path("t", "g"), b"y")
    env.store.put(env.path("keep"), b"z")
    assert list(walk(env.store, env.path("t"))) == [
        env.path("t", "a", "b", "f"),
        env.path("t", "g"),
    ]
    env.store.remove_tree(env.path("t"))
    assert env.store.stat(env.path("t")) is None
    env.store.remove_tree(env.path("t"))  # absent: fine
    env.store.remove_tree(env.path("keep"))  # a blob: removed too
    assert env.store.list(env.root) == []


def test_remove_tree_of_a_link_removes_only_the_link(env: Env) -> None:
    if not env.local:
        pytest.skip("links are local")
    env.store.makedirs(env.path("target"))
    env.store.put(env.path("target", "f"), b"x")
    os.symlink(env.path("target"), env.path("link"))
    env.store.remove_tree(env.path("link"))
    assert env.store.stat(env.path("link")) is None
    assert read_all(env.store, env.path("target", "f")) == b"x"


def test_sync_dir(env: Env) -> None:
    env.store.sync_dir(env.root)
    with pytest.raises(FileNotFoundError):
        env.store.sync_dir(env.path("missing"))


# ---------------------------------------------------------------------------------------------
# pinned directories
# ---------------------------------------------------------------------------------------------


def fill(env: Env, directory: str, tag: bytes) -> None:
    env.store.makedirs(directory)
    env.store.put(env.store.join(directory, "manifest.json"), b"manifest " + tag)
    write_blob(env.store, env.store.join(directory, "data"), tag * 1000)


def test_pinned_directory_reads_and_identity(env: Env) -> None:
    ckpt = env.path("ckpt")
    fill(env, ckpt, b"A")
    with env.store.pin(ckpt) as pinned:
        st = env.store.stat(ckpt)
        assert st is not None and pinned.identity() == st.identity
        assert pinned.read_small("manifest.json", cap=100) == b"manifest A"
        with pytest.raises(CorruptCheckpointError):
            pinned.read_small("manifest.json", cap=5)
        r = pinned.open_blob("data")
        try:
            assert r.size == 1000
            out = bytearray(1000)
            r.read(0, out)
            assert bytes(out) == b"A" * 1000
        finally:
            r.close()
        with pytest.raises(FileNotFoundError):
            pinned.open_blob("missing")


def test_pinned_names_may_reach_into_subdirectories(env: Env) -> None:
    env.store.makedirs(env.path("ckpt", "sub"))
    env.store.put(env.path("ckpt", "sub", "f"), b"nested")
    with env.store.pin(env.path("ckpt")) as pinned:
        assert pinned.read_small("sub/f", cap=None) == b"nested"
        r = pinned.open_blob("sub/f")
        r.close()
        with pytest.raises(FileNotFoundError):
            pinned.open_blob("sub/missing")


def test_pin_errors(env: Env) -> None:
    env.store.put(env.path("f"), b"x")
    with pytest.raises(FileNotFoundError):
        env.store.pin(env.path("missing"))
    with pytest.raises(NotADirectoryError):
        env.store.pin(env.path("f"))


def test_pinned_directory_survives_a_replace(env: Env) -> None:
    if not env.store.capabilities.atomic_rename:
        pytest.skip("a replace needs renames")
    ckpt, aside = env.path("ckpt"), env.path("aside")
    fill(env, ckpt, b"A")
    with env.store.pin(ckpt) as pinned:
        before = pinned.identity()
        env.store.rename(ckpt, aside)  # renamed away ...
        assert pinned.identity() == before
        assert env.store.stat(ckpt) is None
        fill(env, ckpt, b"B")  # ... and replaced by another generation
        now = env.store.stat(ckpt)
        assert now is not None and now.identity != pinned.identity()
        assert pinned.read_small("manifest.json", cap=None) == b"manifest A"
        r = pinned.open_blob("data")
        try:
            out = bytearray(3)
            r.read(0, out)
            assert bytes(out) == b"AAA"
        finally:
            r.close()


def test_pinned_directory_after_exchange(env: Env) -> None:
    if not env.store.capabilities.atomic_rename:
        pytest.skip("no exchange")
    ckpt, staging = env.path("ckpt"), env.path("staging")
    fill(env, ckpt, b"A")
    fill(env, staging, b"B")
    with env.store.pin(ckpt) as pinned:
        if not env.store.exchange(staging, ckpt):
            pytest.skip("this filesystem cannot exchange")
        assert pinned.read_small("manifest.json", cap=None) == b"manifest A"
        assert (
            env.store.read_small(env.store.join(ckpt, "manifest.json"), cap=None) == b"manifest B"
        )


def test_pinned_directory_once_deleted(env: Env) -> None:
    ckpt = env.path("ckpt")
    fill(env, ckpt, b"A")
    with env.store.pin(ckpt) as pinned:
        r = pinned.open_blob("data")
        try:
            env.store.remove_tree(ckpt)
            assert pinned.identity() is None
            with pytest.raises(FileNotFoundError):
                pinned.open_blob("data")
            with pytest.raises(FileNotFoundError):
                pinned.read_small("manifest.json", cap=None)
            out = bytearray(2)
            r.read(998, out)  # opened before: still readable
            assert bytes(out) == b"AA"
        finally:
            r.close()


# ---------------------------------------------------------------------------------------------
# rename, replace, exchange, link: by capability
# ---------------------------------------------------------------------------------------------


def test_rename(env: Env) -> None:
    fill(env, env.path("a"), b"A")
    env.store.put(env.path("f"), b"f")
    if not env.store.capabilities.atomic_rename:
        with pytest.raises(NotImplementedError):
            env.store.rename(env.path("a"), env.path("b"))
        assert env.store.list(env.root) == ["a", "f"]
        return
    env.store.rename(env.path("a"), env.path("b"))
    assert env.store.list(env.root) == ["b", "f"]
    assert env.store.read_small(env.path("b", "manifest.json"), cap=None) == b"manifest A"
    env.store.rename(env.path("f"), env.path("g"))
    assert read_all(env.store, env.path("g")) == b"f"
    fill(env, env.path("c"), b"C")
    with pytest.raises(FileExistsError):
        env.store.rename(env.path("c"), env.path("b"))
    with pytest.raises(FileExistsError):
        env.store.rename(env.path("g"), env.path("b"))
    with pytest.raises(FileNotFoundError):
        env.store.rename(env.path("missing"), env.path("x"))
    with pytest.raises(OSError) as info:
        env.store.rename(env.path("c"), env.path("c", "inside"))
    assert info.value.errno == errno.EINVAL
    assert env.store.read_small(env.path("b", "manifest.json"), cap=None) == b"manifest A"
    assert env.store.read_small(env.path("c", "manifest.json"), cap=None) == b"manifest C"


def test_replace(env: Env) -> None:
    env.store.put(env.path("tmp"), b"new")
    env.store.put(env.path("doc"), b"old")
    if not env.store.capabilities.atomic_rename:
        with pytest.raises(NotImplementedError):
            env.store.replace(env.path("tmp"), env.path("doc"))
        return
    env.store.replace(env.path("tmp"), env.path("doc"))
    assert env.store.list(env.root) == ["doc"]
    assert read_all(env.store, env.path("doc")) == b"new"
    with pytest.raises(FileNotFoundError):
        env.store.replace(env.path("tmp"), env.path("doc"))


def test_exchange(env: Env) -> None:
    fill(env, env.path("a"), b"A")
    fill(env, env.path("b"), b"B")
    swapped = env.store.exchange(env.path("a"), env.path("b"))
    if not env.store.capabilities.atomic_rename:
        assert swapped is False
    a = env.store.read_small(env.path("a", "manifest.json"), cap=None)
    b = env.store.read_small(env.path("b", "manifest.json"), cap=None)
    assert (a, b) == ((b"manifest B", b"manifest A") if swapped else (b"manifest A", b"manifest B"))
    if env.store.capabilities.atomic_rename:
        with pytest.raises(FileNotFoundError):
            env.store.exchange(env.path("a"), env.path("missing"))


def test_link(env: Env) -> None:
    env.store.put(env.path("src"), b"shared bytes")
    if not env.store.capabilities.hard_links:
        with pytest.raises(NotImplementedError):
            env.store.link(env.path("src"), env.path("dst"))
        return
    env.store.link(env.path("src"), env.path("dst"))
    a, b = env.store.stat(env.path("src")), env.store.stat(env.path("dst"))
    assert a is not None and b is not None and a.identity == b.identity
    env.store.remove(env.path("src"))
    assert read_all(env.store, env.path("dst")) == b"shared bytes"
    env.store.put(env.path("other"), b"")
    with pytest.raises(FileExistsError):
        env.store.link(env.path("other"), env.path("dst"))
    with pytest.raises(FileNotFoundError):
        env.store.link(env.path("missing"), env.path("x"))


# ---------------------------------------------------------------------------------------------
# capabilities: each flag is honest
# ---------------------------------------------------------------------------------------------


def test_capability_atomic_rename(env: Env) -> None:
    # A renamed directory is never seen half-moved: the old path and the new one answer
    # consistently at every instant (checked by a reader thread racing the renames).
    fill(env, env.path("a"), b"A")
    if not env.store.capabilities.atomic_rename:
        with pytest.raises(NotImplementedError):
            env.store.rename(env.path("a"), env.path("b"))
        assert env.store.exchange(env.path("a"), env.path("a")) is False
        return
    stop = threading.Event()
    seen: list[bytes] = []

    def reader() -> None:
        while not stop.is_set():
            for name in ("a", "b"):
                try:
                    seen.append(env.store.read_small(env.path(name, "manifest.json"), cap=None))
                except FileNotFoundError:
                    pass

    t = threading.Thread(target=reader)
    t.start()
    try:
        for i in range(200):
            src, dst = ("a", "b") if i % 2 == 0 else ("b", "a")
            env.store.rename(env.path(src), env.path(dst))
    finally:
        stop.set()
        t.join()
    assert set(seen) <= {b"manifest A"}


def test_capability_create_only_put(env: Env) -> None:
    if not env.store.capabilities.create_only_put:
        # fsspec filesystems without an atomic exclusive create (check, then write): racing
        # creators are not excluded, and the store says so (a warning at its first write).
        pytest.skip("create_only_put=False: racing creators are not excluded")
    winners: list[int] = []
    start = threading.Barrier(8)

    def racer(i: int) -> None:
        start.wait()
        try:
            env.store.put(env.path("m"), b"writer %d" % i + b"." * 10_000)
        except FileExistsError:
            return
        winners.append(i)

    threads = [threading.Thread(target=racer, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(winners) == 1
    assert read_all(env.store, env.path("m")) == b"writer %d" % winners[0] + b"." * 10_000
    assert env.store.list(env.root) == ["m"]


def _takes_o_direct(directory: str) -> bool:
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    try:
        fd = os.open(os.path.join(directory, "probe"), os.O_WRONLY | os.O_CREAT | flag, 0o644)
    except OSError:
        return False
    os.close(fd)
    os.unlink(os.path.join(directory, "probe"))
    return True


def test_capability_direct_io(env: Env) -> None:
    buffered = env.store.create_blob(env.path("b"), size=0, direct=False)
    assert buffered.alignment == 1
    buffered.abort()
    w = env.store.create_blob(env.path("d"), size=0, direct=True)
    try:
        if not env.store.capabilities.direct_io:
            assert w.alignment == 1
        elif env.local and _takes_o_direct(env.root):
            assert w.alignment == PAGE
        else:
            assert w.alignment in (1, PAGE)
    finally:
        w.abort()


def test_capability_hard_links(env: Env) -> None:
    env.store.put(env.path("src"), b"x")
    if env.store.capabilities.hard_links:
        env.store.link(env.path("src"), env.path("dst"))
        a, b = env.store.stat(env.path("src")), env.store.stat(env.path("dst"))
        assert a is not None and b is not None and a.identity == b.identity
    else:
        with pytest.raises(NotImplementedError):
            env.store.link(env.path("src"), env.path("dst"))


def test_capability_zero_copy(env: Env, blob: tuple[str, bytes]) -> None:
    path, _ = blob
    r = env.store.open_blob(path)
    try:
        one, two = r.view(0, 200), r.view(100, 300)
        if env.store.capabilities.zero_copy:
            assert one is not None and two is not None
            assert not one.flags.owndata
            assert np.shares_memory(one, two)  # both views of the same stored bytes
        else:
            assert one is None and two is None
    finally:
        r.close()


def test_capability_durable(env: Env) -> None:
    env.store.put(env.path("durable"), b"still here")
    write_blob(env.store, env.path("blob"), b"and this")
    # A fresh process with a fresh store of the same kind: does it find the bytes?
    found = child(
        env.name,
        "print(store.stat(sys.argv[2]) is not None and store.stat(sys.argv[3]) is not None)",
        env.path("durable"),
        env.path("blob"),
    )
    assert found == str(env.store.capabilities.durable)


def _lock_or_skip(store: Store, path: str) -> Any:
    try:
        return store.lock(path)
    except NotImplementedError:
        if store.capabilities.locks:
            pytest.fail("capabilities.locks is True but lock() is not implemented")
        pytest.skip("this backend has no lock")


def test_lock_excludes_other_holders_in_this_process(env: Env) -> None:
    first = _lock_or_skip(env.store, env.path("writer.lock"))
    second = env.store.lock(env.path("writer.lock"))
    assert first.acquire()
    try:
        assert not second.acquire()
    finally:
        first.release()
    assert second.acquire()
    second.release()


def test_capability_locks(env: Env) -> None:
    if not env.store.capabilities.locks:
        pytest.skip("locks=False: nothing promised beyond this process")
    lock = _lock_or_skip(env.store, env.path("writer.lock"))
    assert lock.acquire()
    try:
        code = "print(store.lock(sys.argv[2]).acquire())"
        assert child(env.name, code, env.path("writer.lock")) == "False"
    finally:
        lock.release()
    assert child(env.name, code, env.path("writer.lock")) == "True"


def test_capability_flags_and_methods_agree(env: Env) -> None:
    # Each flag claimed is backed by its mixin's methods (capability_problems), and each flag
    # not claimed is refused by those methods, whether the class has the mixin (chosen per
    # instance: the memory store's object-store mode, a FaultyStore around a store without) or
    # not (Store's own refusals).
    store = env.store
    assert capability_problems(store) == []
    a, b = env.path("a"), env.path("b")
    store.put(a, b"x")
    if not store.capabilities.atomic_rename:
        for method in (store.rename, store.replace):
            with pytest.raises(NotImplementedError):
                method(a, b)
        assert store.exchange(a, b) is False
    if not store.capabilities.hard_links:
        with pytest.raises(NotImplementedError):
            store.link(a, b)
    assert store.list(env.root) == ["a"]  # nothing refused changed anything


def test_disarmed_faulty_store_reports_its_inner_store(env: Env) -> None:
    store = env.store
    if isinstance(store, FaultyStore):
        assert store.capabilities == store.inner.capabilities
        assert store.scheme == store.inner.scheme
        assert store.url(env.root) == store.inner.url(env.root)
        assert store.calls  # the fixture's makedirs, at least
    location = store.at(env.root)
    assert location.store is store and location.path == env.root
    assert location.is_local == isinstance(store, LocalStore)


# ---------------------------------------------------------------------------------------------
# paths and URLs of a store
# ---------------------------------------------------------------------------------------------


def test_path_helpers(env: Env) -> None:
    store = env.store
    child_path = store.join(env.root, "a", "b")
    assert store.parent(child_path) == store.join(env.root, "a")
    assert store.basename(child_path) == "b"
    assert store.abspath(child_path) == child_path
    assert store.join(env.root) == env.root
    if not env.local:
        assert store.abspath("x/../y") == "/y"
        assert store.parent("/") == "/"
        url = store.url("/run/step 1")
        assert url.endswith("://run/step 1") and url.startswith(store.scheme)
        if store.scheme == "memory":  # a URL names this very store (not the shared one)
            again = resolve_path(url)
            assert again.path == "/run/step 1"
            assert again.store is getattr(store, "inner", store)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 0


@pytest.fixture(autouse=True)
def _no_fd_leak(request: pytest.FixtureRequest) -> Iterator[None]:
    before = _open_fds()
    yield
    after = _open_fds()
    callspec = getattr(request.node, "callspec", None)
    if after > before and callspec is not None and callspec.params.get("env") in ASYNC_CLOSE:
        # An object store's HTTP client closes a connection on its own runtime threads, a moment
        # after the call that used it has returned: give it that moment (these backends only).
        deadline = time.monotonic() + 2
        while after > before and time.monotonic() < deadline:
            time.sleep(0.01)
            after = _open_fds()
    assert after <= before, f"{after - before} file descriptors left open"
