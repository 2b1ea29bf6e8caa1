"""savepoint.storage.lease: the writer lock of stores without locks (object stores)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import savepoint as sp
from savepoint.runs.lock import LOCK_FILE
from savepoint.storage.lease import LeaseLock
from savepoint.storage.memory import MemoryStore
from savepoint.storage.paths import resolve

PATH = "/run/.writer.lock"


def store() -> MemoryStore:
    s = MemoryStore(atomic_rename=False)
    s.makedirs("/run")
    return s


def doc(s: MemoryStore) -> dict[str, object]:
    return dict(json.loads(s.read_small(PATH, cap=None)))


def test_one_holder_at_a_time() -> None:
    s = store()
    a, b = LeaseLock(s, PATH), LeaseLock(s, PATH)
    assert a.acquire()
    assert not b.acquire()
    held = doc(s)
    assert held["host"] == socket.gethostname() and isinstance(held["token"], str)
    assert a.check() is None
    a.release()
    assert s.stat(PATH) is None
    assert b.acquire()
    b.release()


def test_an_expired_lease_is_taken_over_and_its_holder_learns_it() -> None:
    s = store()
    a = LeaseLock(s, PATH, ttl=60)
    assert a.acquire()
    a._stop.set()  # a holder that stopped renewing (a stalled process)
    stale = doc(s)
    stale["expires"] = time.time() - 1
    s.put(PATH, json.dumps(stale).encode(), exclusive=False)
    b = LeaseLock(s, PATH)
    assert b.acquire()
    reason = a.check()
    assert reason is not None and "taken over" in reason
    assert b.check() is None
    a.release()  # not its lease any more: b's stays
    assert doc(s)["token"] == b._token
    b.release()


def test_a_lease_of_a_dead_process_of_this_host_is_stale_at_once() -> None:
    s = store()
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    record = {
        "pid": int(dead.stdout),
        "host": socket.gethostname(),
        "since": "2026-11-26T00:00:00Z",
        "expires": time.time() + 3600,
        "token": "x" * 32,
    }
    s.put(PATH, json.dumps(record).encode())
    lock = LeaseLock(s, PATH)
    assert lock.acquire()
    lock.release()


def test_a_live_lease_of_another_host_is_respected_until_it_expires() -> None:
    s = store()
    record = {"pid": 1, "host": "elsewhere", "since": "x", "expires": time.time() + 3600}
    s.put(PATH, json.dumps(record).encode())
    assert not LeaseLock(s, PATH).acquire()
    for damaged in (b"not json", b"[]", b'{"expires": "soon"}'):
        s.put(PATH, damaged, exclusive=False)
        lock = LeaseLock(s, PATH)
        assert lock.acquire(), damaged  # not a lease anyone renews: stale
        lock.release()


def test_the_holder_renews_its_lease() -> None:
    s = store()
    a = LeaseLock(s, PATH, ttl=0.3)
    assert a.acquire()
    first = doc(s)["expires"]
    time.sleep(0.5)  # past the first expiry: the heartbeat has renewed it
    assert isinstance(first, float) and doc(s)["expires"] > first  # type: ignore[operator]
    assert not LeaseLock(s, PATH).acquire()
    assert a.check() is None
    a.release()


def test_a_manager_on_an_object_store_takes_the_lease(s3_bucket: str) -> None:
    """A CheckpointManager on S3 holds its run's lease: a second writer is refused naming the
    holder; after close the run opens again."""
    run = f"s3://{s3_bucket}/run"
    with sp.CheckpointManager(run) as m:
        m.save(1, {"w": np.arange(3.0)})
        with pytest.raises(sp.RunLockedError, match=socket.gethostname()):
            sp.CheckpointManager(run)
        assert sp.CheckpointManager(run, read_only=True).steps() == [1]
    with sp.CheckpointManager(run) as again:
        assert again.steps() == [1]
    assert sp.open_run(run).steps() == [1]
    lease = resolve(f"{run}/{LOCK_FILE}")
    assert lease.store.stat(lease.path) is None  # released at close
