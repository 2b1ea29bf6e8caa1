"""savepoint.blobs.gc: sessions and collection. A collection never deletes a referenced blob, a
young one, or anything while a save is in flight; a save waits for a running collection; stale
records of dead processes are cleared; the caller's own session is not held back by itself."""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import savepoint as sp
from savepoint.blobs import BlobPolicy, BlobStore, SaveSession, collect
from savepoint.blobs.store import GC, SESSIONS
from savepoint.errors import CheckpointWriteError
from savepoint.storage.local import LocalStore

RNG = np.random.default_rng(5)


def blob(i: int, n: int = 3000) -> bytes:
    return np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8).tobytes()


def age(blobs: BlobStore, path: str, seconds: float) -> None:
    """Make ``path`` look ``seconds`` old (local store: its mtime)."""
    assert isinstance(blobs.store, LocalStore)
    then = time.time() - seconds
    os.utime(path, (then, then))


@pytest.fixture
def local(tmp_path: Path) -> BlobStore:
    return BlobStore(LocalStore(), str(tmp_path / "blobs"))


def test_collect_deletes_only_unreferenced(blobs: BlobStore) -> None:
    kept = {blobs.put(blob(i)).digest for i in range(5)}
    dropped = {blobs.put(blob(i)).digest for i in range(5, 12)}
    report = collect(blobs, lambda: kept, grace=0)
    assert not report.deferred and not report.aborted
    assert set(report.deleted) == dropped and report.kept_referenced == 5
    assert report.bytes_freed == sum(blobs.store.stat(blobs.path(d)) is None for d in dropped) * (
        3000 + 32
    )
    assert set(blobs.list()) == kept
    for d in kept:
        blobs.verify(d)
    assert blobs.store.list(blobs.store.join(blobs.root, GC)) == []  # its record is gone


def test_dry_run_deletes_nothing(blobs: BlobStore) -> None:
    digests = {blobs.put(blob(i)).digest for i in range(3)}
    report = blobs.collect([], grace=0, dry_run=True)
    assert set(report.deleted) == digests and set(blobs.list()) == digests


def test_young_blobs_survive_the_grace_period(blobs: BlobStore) -> None:
    digests = {blobs.put(blob(i)).digest for i in range(4)}
    report = collect(blobs, [], grace=3600)
    assert report.deleted == [] and report.kept_young == 4
    assert set(blobs.list()) == digests


def test_grace_is_measured_on_the_store_clock(local: BlobStore) -> None:
    old = local.put(blob(1)).digest
    young = local.put(blob(2)).digest
    age(local, local.path(old), 120)
    report = collect(local, [], grace=60)
    assert report.deleted == [old] and report.kept_young == 1
    assert list(local.list()) == [young]


def test_a_live_session_defers_collection(blobs: BlobStore) -> None:
    orphan = blobs.put(blob(1)).digest
    with blobs.session() as s:
        report = collect(blobs, [], grace=0)
        assert report.deferred and report.deleted == [] and len(report.live_sessions) == 1
        assert s.id in report.live_sessions[0]
        assert blobs.exists(orphan)
    assert collect(blobs, [], grace=0).deleted == [orphan]


def test_a_session_collects_keeping_its_own_blobs(blobs: BlobStore) -> None:
    old = blobs.put(blob(1)).digest
    with blobs.session() as s:
        mine = s.put(blob(2)).digest
        reused = s.put(blob(1)).digest  # found there: still referenced by this save
        assert reused == old
        recipe = s.put_chunked(blob(3, 20_000), chunk_size=4096)
        s.reuse(["f" * 64])
        report = s.collect([], grace=0)
        assert not report.deferred and report.deleted == []
        assert s.referenced == {mine, old, "f" * 64, *recipe.digests}
    assert set(collect(blobs, [], grace=0).deleted) == {mine, old, *recipe.digests}


def test_stale_session_records_are_cleared(local: BlobStore) -> None:
    dead = SaveSession(local).begin()
    dead_blob = dead.put(blob(9)).digest
    age(local, dead.path, 7200)  # its process died two hours ago
    age(local, local.path(dead_blob), 7200)
    report = collect(local, [], grace=0)
    assert report.stale_sessions_removed == 1 and report.deleted == [dead_blob]
    with pytest.raises(CheckpointWriteError, match="vanished"):
        dead.check()


def test_a_save_waits_for_a_running_collection(local: BlobStore) -> None:
    gc_dir = local.store.join(local.root, GC)
    record = local.store.join(gc_dir, "other.json")
    local.store.put(record, json.dumps({"kind": "gc"}).encode())
    with pytest.raises(CheckpointWriteError, match="collection is running"):
        SaveSession(local, wait=0.2).begin()
    assert local.store.list(local.store.join(local.root, SESSIONS)) == []  # gave up cleanly

    threading.Timer(0.3, lambda: local.store.remove(record)).start()
    t0 = time.monotonic()
    with SaveSession(local, wait=10) as s:
        assert time.monotonic() - t0 >= 0.25
        s.put(b"after")


def test_by_default_a_save_outwaits_a_dead_collectors_record(local: BlobStore) -> None:
    """The default wait is longer than gc_stale_after: a collector that died (its record stops
    being refreshed) delays a save until the record is stale, then the save removes it and
    goes on, instead of giving up first."""
    record = local.store.join(local.root, GC, "dead-elsewhere.json")
    local.store.put(record, b"{}")
    t0 = time.monotonic()
    with SaveSession(local, gc_stale_after=0.5, poll=0.05) as s:
        assert time.monotonic() - t0 >= 0.4
        s.put(b"after")
    assert local.store.stat(record) is None


def test_a_dead_collectors_record_does_not_block_saves(local: BlobStore) -> None:
    record = local.store.join(local.root, GC, "dead.json")
    local.store.put(record, b"{}")
    age(local, record, 3600)
    with local.session(wait=0.1) as s:
        s.put(b"x")
    assert local.store.stat(record) is None


def test_session_refreshes_its_record(local: BlobStore) -> None:
    s = SaveSession(local, refresh_every=0.0).begin()
    age(local, s.path, 5000)
    s.put(b"refresh me")
    st = local.store.stat(s.path)
    assert st is not None and time.time() - st.mtime < 60
    s.close()
    s.close()  # twice is fine
    with pytest.raises(ValueError, match="closed"):
        s.put(b"x")


def test_temporaries_of_crashed_writers_are_collected(local: BlobStore) -> None:
    d = local.put(blob(1)).digest
    tmp = local.path(d) + ".tmp-deadbeef0000"
    with open(tmp, "wb") as f:
        f.write(b"half a blob")
    stray = os.path.join(local.root, "data", d[:2], "README")
    with open(stray, "wb") as f:
        f.write(b"not ours")
    assert collect(local, [d], grace=60).temporaries_removed == 0  # young: maybe being written
    age(local, tmp, 120)
    report = collect(local, [d], grace=60)
    assert report.temporaries_removed == 1 and report.deleted == []
    assert not os.path.exists(tmp) and os.path.exists(stray)  # foreign names are never touched


def test_collection_racing_saves_never_loses_a_committed_blob(blobs: BlobStore) -> None:
    """Saves (reusing and writing blobs, committing "manifests", retention keeping the last two)
    and collections run concurrently; after every commit every kept manifest's blobs exist."""
    manifests: dict[int, set[str]] = {}
    lock = threading.Lock()
    stop = threading.Event()
    errors: list[BaseException] = []

    def kept() -> set[str]:
        with lock:
            return set().union(*manifests.values()) if manifests else set()

    def saver() -> None:
        try:
            for step in range(25):
                with blobs.session(wait=30) as s:
                    # half the content is shared with earlier saves, half new
                    digests = {s.put(blob(i % 7)).digest for i in range(step, step + 4)}
                    digests |= {s.put(blob(1000 + step * 10 + i)).digest for i in range(3)}
                    s.sync()
                    s.check()
                    with lock:  # the commit
                        manifests[step] = digests
                        for old in [k for k in manifests if k < step - 1]:
                            del manifests[old]  # retention: manifest first, then collect
                for d in kept():
                    assert blobs.exists(d), f"kept blob {d} was deleted"
                time.sleep(0.005)  # a window for collections between saves
        except BaseException as exc:
            errors.append(exc)
        finally:
            stop.set()

    ran: list[int] = []

    def collector() -> None:
        try:
            while not stop.is_set():
                report = collect(blobs, kept, grace=0)
                if not report.deferred:
                    ran.append(len(report.deleted))
                time.sleep(0.001)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=saver), threading.Thread(target=collector)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    print(f"{len(ran)} collections ran between saves, deleting {sum(ran)} blobs")
    for d in kept():
        blobs.verify(d)
    collect(blobs, kept, grace=0)
    assert set(blobs.list()) == kept()


def test_a_collection_whose_record_went_stale_while_it_read_the_manifests_deletes_nothing(
    local: BlobStore,
) -> None:
    """``referenced()`` takes longer than a save's ``gc_stale_after`` (here 0.5 s): the save
    removes the collector's record as stale and reuses a blob the collector is about to judge
    unreferenced. The collector finds its record gone before deleting, and stops."""
    with local.session() as s:
        digest = s.put(b"x" * 5000).digest
    reports: list[Any] = []

    def slow_referenced() -> set[str]:
        time.sleep(1.5)
        return set()

    collector = threading.Thread(
        target=lambda: reports.append(collect(local, slow_referenced, grace=0))
    )
    collector.start()
    time.sleep(0.2)
    with SaveSession(local, gc_stale_after=0.5, poll=0.05) as s:
        assert not s.put(b"x" * 5000).written  # reused
        s.sync()
        s.check()
        collector.join()
    assert reports[0].aborted and reports[0].deleted == []
    assert local.exists(digest)


def test_a_long_collection_keeps_its_record_young(local: BlobStore) -> None:
    """While ``referenced()`` runs for several refresh periods, a save waiting for the
    collection does not judge its record stale (and waits for it instead)."""
    record_ages: list[float] = []

    def slow_referenced() -> set[str]:
        gc_dir = local.store.join(local.root, GC)
        for _ in range(6):
            time.sleep(0.2)
            for name in local.store.list(gc_dir):
                st = local.store.stat(local.store.join(gc_dir, name))
                if st is not None:
                    record_ages.append(time.time() - st.mtime)
        return set()

    report = collect(local, slow_referenced, grace=0, refresh_every=0.1)
    assert not report.aborted and record_ages and max(record_ages) < 0.6


def _not_a_record(path: str, kind: str) -> None:
    if kind == "junk":
        Path(path).write_bytes(b"\x00junk, not JSON")
    elif kind == "list":
        Path(path).write_bytes(b'[{"kind": "gc"}]\n')
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        os.mkdir(path)
        Path(path, "inside").write_bytes(b"{}")


@pytest.mark.parametrize("kind", ["junk", "list", "fifo", "directory"])
def test_what_is_no_collection_record_does_not_hold_saves_and_gc_removes_it(
    tmp_path: Path, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A file under gc/ that is no collection's record (savepoint cannot parse it, or it is no
    file) is no collection: the next save (default wait: 10.5 minutes) goes on at once, with
    one warning naming it, and the next collection removes it. Before, the save waited as for
    a live collection."""
    run = tmp_path / "run"
    policy = BlobPolicy(chunk_size=4096, min_blob_bytes=1024)
    m = sp.CheckpointManager(run, incremental=True, keep_last=1, blob_policy=policy)
    m.save(1, {"w": np.arange(2048, dtype=np.float32)})
    stray = str(run / "blobs" / GC / f"{kind}.json")
    _not_a_record(stray, kind)

    def too_slow(*_: object) -> None:
        raise TimeoutError("the save waited for what is no collection")

    previous = signal.signal(signal.SIGALRM, too_slow)
    signal.alarm(20)
    t0 = time.monotonic()
    try:
        with caplog.at_level(logging.WARNING, logger="savepoint.blobs.gc"):
            m.save(2, {"w": np.arange(2048, dtype=np.float32) + 1})  # retires 1: a collection
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert time.monotonic() - t0 < 10
    assert m.steps() == [2]
    warned = [r.getMessage() for r in caplog.records if stray in r.getMessage()]
    assert warned and "not a blob collection's record" in warned[0], warned
    # The save's own collection (retention of step 1) removed it; nothing else is under gc/.
    assert not os.path.lexists(stray)
    assert os.listdir(run / "blobs" / GC) == []
    m.close()
    assert sp.load(run / "latest")["w"][0] == 1
