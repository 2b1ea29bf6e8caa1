"""savepoint.storage.faults: each injection does exactly what it says, on both inner stores.

(The disarmed wrapper is checked against the whole storage contract in test_contract.py.)
"""

from __future__ import annotations

import errno
import threading
from pathlib import Path

import numpy as np
import pytest

import savepoint as sp
from savepoint.storage.base import Store
from savepoint.storage.faults import (
    KINDS,
    MUTATIONS,
    Call,
    FaultyStore,
    SimulatedCrash,
)
from savepoint.storage.local import LocalStore
from savepoint.storage.memory import MemoryStore


@pytest.fixture(params=["memory", "local"])
def inner(request: pytest.FixtureRequest) -> Store:
    return MemoryStore() if request.param == "memory" else LocalStore()


@pytest.fixture
def root(inner: Store, tmp_path: Path) -> str:
    root = str(tmp_path / "root") if inner.scheme == "file" else "/root"
    inner.makedirs(root)
    return root


def content(store: Store, path: str) -> bytes:
    return store.read_small(path, cap=None)


def write_chunks(store: Store, path: str, chunks: list[bytes]) -> None:
    w = store.create_blob(path, size=sum(map(len, chunks)), direct=False)
    try:
        for chunk in chunks:
            w.write(memoryview(chunk))
        w.finish()
    except BaseException:
        w.abort()
        raise


def test_the_nth_write_fails_with_enospc_once(inner: Store, root: str) -> None:
    store = FaultyStore(inner)
    fault = store.fail("write", nth=3)
    path = store.join(root, "b")
    w = store.create_blob(path, size=5, direct=False)
    w.write(memoryview(b"a"))
    w.write(memoryview(b"b"))
    with pytest.raises(OSError) as info:
        w.write(memoryview(b"X"))
    assert info.value.errno == errno.ENOSPC and info.value.filename == path
    w.write(memoryview(b"c"))  # times=1: the next one goes through
    w.write(memoryview(b"d"))
    w.write(memoryview(b"e"))
    w.finish()
    assert content(inner, path) == b"abcde"  # the failed write had no effect
    assert fault.fired == 1


def test_a_fault_can_last(inner: Store, root: str) -> None:
    store = FaultyStore(inner)
    fault = store.fail("put", nth=2, times=None, code=errno.EROFS)
    store.put(store.join(root, "a"), b"1")
    for name in "bcd":
        with pytest.raises(OSError) as info:
            store.put(store.join(root, name), b"1")
        assert info.value.errno == errno.EROFS
    assert inner.list(root) == ["a"]
    assert fault.fired == 3
    store.disarm()
    store.put(store.join(root, "e"), b"1")


def test_eio_on_finish_publishes_nothing_and_abort_cleans(inner: Store, root: str) -> None:
    store = FaultyStore(inner)
    store.fail("finish", code=errno.EIO)
    path = store.join(root, "b")
    with pytest.raises(OSError) as info:
        write_chunks(store, path, [b"data"])
    assert info.value.errno == errno.EIO
    assert inner.list(root) == []


def test_after_lets_the_call_take_effect_first(inner: Store, root: str) -> None:
    store = FaultyStore(inner)
    store.fail("finish", code=errno.EIO, after=True)
    path = store.join(root, "b")
    w = store.create_blob(path, size=4, direct=False)
    w.write(memoryview(b"data"))
    with pytest.raises(OSError):
        w.finish()
    assert content(inner, path) == b"data"  # written, then "the fsync failed"
    w.abort()
    assert inner.list(root) == []


def test_path_patterns_choose_the_calls(inner: Store, root: str) -> None:
    store = FaultyStore(inner)
    store.makedirs(store.join(root, "ckpt"))
    fault = store.fail("put", path="*/manifest.json", code=errno.EIO)
    store.put(store.join(root, "ckpt", "data"), b"x")
    with pytest.raises(OSError):
        store.put(store.join(root, "ckpt", "manifest.json"), b"{}")
    assert fault.fired == 1
    renamed = store.fail("rename", path="*/target")  # matches the destination too
    store.mkdir(store.join(root, "staging"))
    with pytest.raises(OSError):
        store.rename(store.join(root, "staging"), store.join(root, "target"))
    assert renamed.fired == 1


def test_several_kinds_at_once_and_unknown_kinds(inner: Store, root: str) -> None:
    store = FaultyStore(inner)
    fault = store.fail({"mkdir", "makedirs"}, times=2)
    with pytest.raises(OSError):
        store.mkdir(store.join(root, "a"))
    with pytest.raises(OSError):
        store.makedirs(store.join(root, "b"))
    assert fault.fired == 2
    with pytest.raises(ValueError, match="unknown call kinds"):
        store.fail("fsync")
    with pytest.raises(ValueError):
        store.fail("write", nth=0)
    assert {"write", "finish", "sync_dir", "rename"} <= MUTATIONS <= KINDS


def test_reads_and_views_can_fail(inner: Store, root: str) -> None:
    store = FaultyStore(inner)
    path = store.join(root, "b")
    store.put(path, b"0123456789")
    store.fail("view", code=errno.ENOMEM)
    store.fail("read", code=errno.EIO)
    r = store.open_blob(path)
    try:
        assert r.size == 10
        with pytest.raises(OSError) as info:
            r.view(0, 10)
        assert info.value.errno == errno.ENOMEM
        with pytest.raises(OSError):
            r.read(0, bytearray(2))
        out = bytearray(2)
        r.read(2, out)
        assert bytes(out) == b"23"
    finally:
        r.close()
    with store.pin(root) as pinned:
        store.fail("open_blob", code=errno.EACCES)
        with pytest.raises(PermissionError):
            pinned.open_blob("b")
        assert pinned.read_small("b", cap=None) == b"0123456789"
    assert store.calls[-2:] == [
        Call("open_blob", store.join(root, "b")),
        Call("read_small", store.join(root, "b")),
    ]


def test_reads_are_counted_and_views_can_be_withheld(inner: Store, root: str) -> None:
    """``views=False``: every reader's ``view`` answers None (as an object store's), so what a
    load takes comes through ``read``, each call recorded with its offset and length."""
    store = FaultyStore(inner, views=False)
    path = store.join(root, "b")
    store.put(path, b"0123456789")
    r = store.open_blob(path)
    try:
        assert r.view(0, 10) is None
        out = bytearray(4)
        r.read(3, out)
        assert bytes(out) == b"3456"
    finally:
        r.close()
    assert store.calls[-2:] == [Call("view", path), Call("read", path, None, 4, 3)]
    data = b"0123456789"
    sp.save(store.at(store.join(root, "ckpt")), {"x": np.frombuffer(data * 100, np.uint8)})
    store.calls.clear()
    loaded = sp.load(store.at(store.join(root, "ckpt")))
    assert bytes(loaded["x"]) == data * 100
    reads = [c for c in store.calls if c.kind == "read"]
    assert sum(c.nbytes or 0 for c in reads) >= 1000 and all(c.offset is not None for c in reads)


def test_space_cuts_the_write_that_crosses_it(inner: Store, root: str) -> None:
    store = FaultyStore(inner)
    space = store.space(10)
    store.put(store.join(root, "small"), b"1234")  # 6 bytes left
    with pytest.raises(OSError) as info:
        store.put(store.join(root, "big"), b"1234567")  # does not fit: nothing written
    assert info.value.errno == errno.ENOSPC
    assert inner.stat(store.join(root, "big")) is None
    w = store.create_blob(store.join(root, "b"), direct=False)
    w.write(memoryview(b"abcd"))
    with pytest.raises(OSError):
        w.write(memoryview(b"efgh"))  # 2 of these 4 bytes fit
    with pytest.raises(OSError):
        w.write(memoryview(b"i"))  # full
    w.finish()  # what reached the disk: the part that fit
    assert content(inner, store.join(root, "b")) == b"abcdef"
    assert space.fired == 3


def test_a_stalled_write_waits_for_release(inner: Store, root: str) -> None:
    store = FaultyStore(inner)
    stall = store.stall("write", nth=2)
    path = store.join(root, "b")
    done = threading.Event()

    def run() -> None:
        write_chunks(store, path, [b"ab", b"cd", b"ef"])
        done.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert stall.reached.wait(10)
    assert not done.wait(0.2)  # blocked in the second write
    assert inner.stat(path) is None or store.inner.scheme == "file"
    stall.release()
    t.join(10)
    assert done.is_set() and not stall.timed_out
    assert content(inner, path) == b"abcdef"


def test_a_stall_gives_up_after_its_timeout(inner: Store, root: str) -> None:
    store = FaultyStore(inner)
    stall = store.stall("put", timeout=0.05)
    store.put(store.join(root, "m"), b"x")
    assert stall.reached.is_set() and stall.timed_out
    assert content(inner, store.join(root, "m")) == b"x"


def test_a_stall_then_a_failure(inner: Store, root: str) -> None:
    store = FaultyStore(inner)
    stall = store.stall("sync_dir", timeout=0.01)
    store.fail("sync_dir", code=errno.EIO)
    with pytest.raises(OSError):
        store.sync_dir(root)
    assert stall.timed_out


def test_a_crash_freezes_the_store(inner: Store, root: str) -> None:
    store = FaultyStore(inner)
    a, b = store.join(root, "a"), store.join(root, "b")
    store.mkdir(a)
    w = store.create_blob(store.join(root, "blob"), size=3, direct=False)
    store.put(store.join(a, "m"), b"x")
    r = store.open_blob(store.join(a, "m"))
    store.crash("rename")
    handled: list[BaseException] = []

    def rename_with_cleanup() -> None:
        try:
            store.rename(a, b)
        except Exception as exc:  # cleanup that a dead process would not run
            handled.append(exc)

    with pytest.raises(SimulatedCrash):
        rename_with_cleanup()
    assert not handled
    assert store.crashed == Call("rename", a, b)
    assert inner.list(root) == (["a", "blob"] if inner.scheme == "file" else ["a"])
    # Nothing reaches the inner store any more, through any handle.
    for attempt in (
        lambda: store.stat(a),
        lambda: store.remove_tree(a),
        lambda: w.write(memoryview(b"abc")),
        w.abort,
        lambda: r.read(0, bytearray(1)),
        lambda: store.pin(a),
    ):
        with pytest.raises(SimulatedCrash):
            attempt()
    r.close()  # closing a descriptor is always allowed
    assert inner.stat(a) is not None and inner.stat(b) is None
    assert not isinstance(SimulatedCrash("x"), Exception)


def test_a_crash_after_the_call_took_effect(inner: Store, root: str) -> None:
    store = FaultyStore(inner)
    a, b = store.join(root, "a"), store.join(root, "b")
    store.mkdir(a)
    store.crash("rename", after=True)
    with pytest.raises(SimulatedCrash):
        store.rename(a, b)
    assert inner.list(root) == ["b"]


def test_exhaustive_crashes_leave_every_prefix(inner: Store, root: str) -> None:
    """The recipe the commit tests follow: learn the changes, then crash after each in turn."""

    def operation(store: Store, where: str) -> None:
        store.mkdir(store.join(where, "staging"))
        write_chunks(store, store.join(where, "staging", "data"), [b"12", b"34"])
        store.put(store.join(where, "staging", "manifest.json"), b"{}")
        store.sync_dir(store.join(where, "staging"))
        store.rename(store.join(where, "staging"), store.join(where, "ckpt"))

    def state(where: str) -> tuple[tuple[str, ...], ...]:
        return tuple(tuple(inner.list(inner.join(where, n))) for n in ("", "staging", "ckpt"))

    probe = FaultyStore(inner)
    first = inner.join(root, "probe")
    inner.mkdir(first)
    operation(probe, first)
    changes = probe.mutations()
    assert [c.kind for c in changes] == [
        "mkdir",
        "create_blob",
        "write",
        "write",
        "finish",
        "put",
        "sync_dir",
        "rename",
    ]
    seen = []
    for k in range(len(changes) + 1):
        where = inner.join(root, f"run{k}")
        inner.mkdir(where)
        store = FaultyStore(inner)
        store.crash_after(k)
        with pytest.raises(SimulatedCrash):
            operation(store, where)
        assert len(store.mutations()) == max(k, 1)
        seen.append(state(where))
    assert seen[0] == ((), (), ())  # before the first change
    assert seen[-1] == (("ckpt",), (), ("data", "manifest.json"))  # after the last
    assert seen[2][1] == (("data",) if inner.scheme == "file" else ())  # partly written


def test_exchange_can_be_refused(inner: Store, root: str) -> None:
    store = FaultyStore(inner, exchange=False)
    a, b = store.join(root, "a"), store.join(root, "b")
    store.mkdir(a)
    store.mkdir(b)
    store.put(store.join(a, "x"), b"")
    assert store.exchange(a, b) is False
    assert inner.list(a) == ["x"]
    assert store.calls[-1] == Call("exchange", a, b)


def test_counts_are_exact_across_threads(inner: Store, root: str) -> None:
    store = FaultyStore(inner)
    fault = store.fail("write", nth=50)
    errors: list[int] = []
    writers = [
        store.create_blob(store.join(root, f"b{i}"), size=25, direct=False) for i in range(4)
    ]

    def run(i: int) -> None:
        for _ in range(25):
            try:
                writers[i].write(memoryview(b"x"))
            except OSError as exc:
                errors.append(exc.errno or 0)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for w in writers:
        w.abort()
    assert errors == [errno.ENOSPC] and fault.fired == 1
    assert len([c for c in store.calls if c.kind == "write"]) == 100


def test_crash_in_a_writer_thread_reaches_the_caller_frozen(inner: Store, root: str) -> None:
    store = FaultyStore(inner)
    store.crash("write", nth=2)
    caught: list[BaseException] = []
    w = store.create_blob(store.join(root, "b"), size=2, direct=False)

    def run() -> None:
        try:
            w.write(memoryview(b"a"))
            w.write(memoryview(b"b"))
        except BaseException as exc:
            caught.append(exc)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert isinstance(caught[0], SimulatedCrash)
    with pytest.raises(SimulatedCrash):
        w.finish()


def test_views_pass_through_unchanged(inner: Store, root: str) -> None:
    store = FaultyStore(inner)
    path = store.join(root, "b")
    store.put(path, bytes(range(100)))
    r = store.open_blob(path)
    try:
        view = r.view(10, 20)
        assert view is not None and np.array_equal(view, np.arange(10, 20, dtype=np.uint8))
    finally:
        del view
        r.close()


def test_hooks_run_at_their_call(inner: Store, root: str) -> None:
    store = FaultyStore(inner)
    seen: list[tuple[str, bool]] = []
    path = store.join(root, "m")

    def note(call: Call) -> None:
        seen.append((call.path, inner.stat(call.path) is not None))

    store.hook("put", note)
    store.hook("put", note, after=True)
    store.put(path, b"12345")
    assert seen == [(path, False), (path, True)]  # before, then after it took effect
    assert store.calls[-1] == Call("put", path, None, 5)

    def refuse(call: Call) -> None:
        raise PermissionError(errno.EACCES, "no", call.path)

    store.hook("remove", refuse)
    with pytest.raises(PermissionError):
        store.remove(path)
    assert inner.stat(path) is not None


def test_write_sizes_are_recorded(inner: Store, root: str) -> None:
    store = FaultyStore(inner)
    write_chunks(store, store.join(root, "b"), [b"abc", b"de"])
    assert [c.nbytes for c in store.calls if c.kind == "write"] == [3, 2]
