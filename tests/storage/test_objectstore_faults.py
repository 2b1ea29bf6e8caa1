"""The object-store backend under network faults: every request goes through a fault-injecting
proxy (tests/storage/_faultproxy.py) in front of the moto S3 server.

What is held: transient 503/500 answers, resets and cut bodies on every kind of request are
retried and the checkpoint round-trips exactly; a persistent fault fails the save with a
CheckpointWriteError naming the object, the attempts and the cause, leaves no multipart upload
open and the previous checkpoint loadable; a stalled request times out and is retried; a lost
answer to the manifest's create-only put or to a multipart completion (the request took effect,
the client saw an error) is not a failure; a server that ignores If-None-Match is detected once
per bucket, warned about, and served with HEAD-then-put.
"""

from __future__ import annotations

import contextlib
import re
import time
import warnings
from datetime import timedelta
from typing import Any

import numpy as np
import pytest

from . import _s3server
from ._faultproxy import FaultProxy, Rule, fault_proxy

pytestmark = pytest.mark.skipif(not _s3server.AVAILABLE, reason=_s3server.SKIP_REASON)

if _s3server.AVAILABLE:
    import savepoint as sp
    from savepoint.errors import CheckpointError, CheckpointWriteError
    from savepoint.storage.objectstore import MIN_PART_SIZE, PROBE, ObjectStore

__all__ = ["fault_proxy"]  # the fixture, re-exported for pytest

MiB = 1024 * 1024
TRIES = 4  # the first attempt and RETRY's 3 retries
RETRY: dict[str, Any] = {
    "max_retries": TRIES - 1,
    "backoff": {
        "init_backoff": timedelta(milliseconds=5),
        "max_backoff": timedelta(milliseconds=40),
        "base": 2,
    },
    "retry_timeout": timedelta(seconds=20),
}

DATA = r"/gen-[^/]+/data-\d+\.safetensors"
MANIFEST = r"/gen-[^/]+/manifest\.json$"
LIST = r"\?(.*&)?list-type=2"


def proxied(proxy: FaultProxy, **options: Any) -> ObjectStore:
    """An ObjectStore whose every request goes through ``proxy``: 5 MiB parts, few retries."""
    options.setdefault("timeout", "5s")
    return ObjectStore(
        "s3",
        endpoint=proxy.endpoint,
        region=_s3server.REGION,
        access_key_id=_s3server.ENV["AWS_ACCESS_KEY_ID"],
        secret_access_key=_s3server.ENV["AWS_SECRET_ACCESS_KEY"],
        allow_http=True,
        part_size=MIN_PART_SIZE,
        read_chunk=2 * MiB,
        **{"retry": RETRY, **options},
    )


@pytest.fixture
def store(fault_proxy: FaultProxy) -> ObjectStore:
    return proxied(fault_proxy)


def state(step: int) -> dict[str, Any]:
    """A state whose data file (about 12 MiB) is a three-part upload: 5 MiB, 5 MiB, the rest."""
    rng = np.random.default_rng(step)
    return {
        "w": rng.standard_normal(3 * MiB, dtype=np.float32),
        "b": np.arange(1000, dtype=np.int64) * step,
        "step": step,
    }


def assert_loads(store: ObjectStore, path: str, expected: dict[str, Any]) -> None:
    loaded = sp.load(store.at(path))
    assert loaded["step"] == expected["step"]
    for key in ("w", "b"):
        np.testing.assert_array_equal(loaded[key], expected[key])
        assert loaded[key].dtype == expected[key].dtype


def raw_keys(server: _s3server.Server, bucket: str) -> list[str]:
    client = server.client()
    try:
        found = client.list_objects_v2(Bucket=bucket).get("Contents", [])
        return sorted(o["Key"] for o in found)
    finally:
        client.close()


def put_raw(server: _s3server.Server, bucket: str, key: str, body: bytes) -> None:
    """Write ``key`` directly on the server, as another writer would."""
    client = server.client()
    try:
        client.put_object(Bucket=bucket, Key=key, Body=body)
    finally:
        client.close()


def key_of(target: str) -> str:
    """The object key of a request target (``/bucket/key?query``; "" for the bucket's)."""
    parts = target.split("?", 1)[0].split("/", 2)
    return parts[2] if len(parts) > 2 else ""


# ---------------------------------------------------------------------------------------------
# transient faults: retried, the checkpoint round-trips exactly
# ---------------------------------------------------------------------------------------------

TRANSIENT = [
    pytest.param("PUT", DATA + r"\?partNumber=2&", "503", 2, id="part-503"),
    pytest.param("PUT", DATA + r"\?partNumber=1&", "500", 1, id="part-500"),
    pytest.param("PUT", DATA + r"\?partNumber=2&", "reset-request", 2, id="part-reset"),
    pytest.param("PUT", DATA + r"\?partNumber=3&", "reset-request", 1, id="last-part-reset"),
    pytest.param("POST", DATA + r"\?uploads", "503", 2, id="create-upload-503"),
    pytest.param("POST", DATA + r"\?uploadId=", "500", 1, id="complete-500"),
    pytest.param("POST", DATA + r"\?uploadId=", "reset-response", 1, id="complete-cut"),
    pytest.param("PUT", MANIFEST, "503", 2, id="manifest-503"),
    pytest.param("PUT", MANIFEST, "reset-request", 2, id="manifest-reset"),
    pytest.param("PUT", r"/\.savepoint-dir$", "reset-request", 2, id="marker-reset"),
    pytest.param("GET", LIST, "503", 3, id="list-503"),
    pytest.param("GET", LIST, "reset-response", 3, id="list-cut"),
    pytest.param("HEAD", r"/run/x", "500", 2, id="head-500"),
    pytest.param("GET", DATA, "reset-response", 2, id="data-get-cut"),
    pytest.param("GET", DATA, "reset-request", 2, id="data-get-reset"),
    pytest.param("GET", MANIFEST, "503", 2, id="manifest-get-503"),
]


@pytest.mark.parametrize(("method", "pattern", "action", "times"), TRANSIENT)
def test_transient_faults_are_retried_and_round_trip_exactly(
    store: ObjectStore,
    fault_proxy: FaultProxy,
    s3_bucket: str,
    s3: _s3server.Server,
    method: str,
    pattern: str,
    action: str,
    times: int,
) -> None:
    path = f"/{s3_bucket}/run/x"
    first, second = state(1), state(2)
    sp.save(store.at(path), first)
    rule = fault_proxy.fail(method, pattern, action, times=times)
    sp.save(store.at(path), second)  # a replace: the faults land in the second save ...
    assert_loads(store, path, second)  # ... or in the loads and verify
    sp.verify(store.at(path))
    assert rule.fired == times, fault_proxy.log  # the faults did happen
    assert s3.open_uploads(s3_bucket) == []
    assert len(store.list(path)) == 1  # one generation: the new one


# ---------------------------------------------------------------------------------------------
# persistent faults: a CheckpointWriteError that says what, how often and why; nothing left
# ---------------------------------------------------------------------------------------------

PERSISTENT = [
    pytest.param(
        "PUT",
        DATA + r"\?partNumber=2&",
        "503",
        "data-00000.safetensors (part 2)",
        "SlowDown",
        id="part",
    ),
    pytest.param(
        "PUT",
        DATA + r"\?partNumber=3&",
        "500",
        "data-00000.safetensors (part 3)",
        "InternalError",
        id="last-part-during-finish",
    ),
    pytest.param(
        "POST",
        DATA + r"\?uploadId=",
        "503",
        "data-00000.safetensors",
        "SlowDown",
        id="completion",
    ),
    pytest.param(
        "PUT",
        DATA + r"\?partNumber=1&",
        "reset-request",
        "data-00000.safetensors (part 1)",
        "error sending request",
        id="part-reset",
    ),
    pytest.param("PUT", MANIFEST, "503", "manifest.json", "SlowDown", id="manifest"),
    pytest.param("PUT", MANIFEST, "reset-request", "manifest.json", "reset", id="manifest-reset"),
]


@pytest.mark.parametrize(("method", "pattern", "action", "named", "cause"), PERSISTENT)
def test_persistent_fault_names_object_attempts_and_cause_and_leaves_nothing(
    store: ObjectStore,
    fault_proxy: FaultProxy,
    s3_bucket: str,
    s3: _s3server.Server,
    method: str,
    pattern: str,
    action: str,
    named: str,
    cause: str,
) -> None:
    path = f"/{s3_bucket}/run/x"
    first = state(1)
    sp.save(store.at(path), first)
    rule = fault_proxy.fail(method, pattern, action, times=None)
    with pytest.raises(CheckpointWriteError) as info:
        sp.save(store.at(path), state(2))
    message = str(info.value)
    assert re.search(rf"s3://{s3_bucket}/run/x/gen-[^/ ]+/{re.escape(named)}", message), message
    assert f"after {TRIES} attempts" in message, message
    assert cause.lower() in message.lower(), message
    assert rule.fired == TRIES, fault_proxy.log
    fault_proxy.clear()
    assert s3.open_uploads(s3_bucket) == []
    assert_loads(store, path, first)  # the previous checkpoint, intact
    assert len(store.list(path)) == 1  # the failed generation is gone


def test_persistent_read_fault_is_a_checkpoint_error_naming_the_object(
    store: ObjectStore, fault_proxy: FaultProxy, s3_bucket: str
) -> None:
    path = f"/{s3_bucket}/run/x"
    sp.save(store.at(path), state(1))
    fault_proxy.fail("GET", DATA, "503", times=None)
    with pytest.raises(CheckpointError) as info:
        sp.load(store.at(path))
    message = str(info.value)
    assert re.search(rf"s3://{s3_bucket}/run/x/gen-[^/ ]+/data-00000\.safetensors", message)
    assert f"after {TRIES} attempts" in message and "SlowDown" in message, message


# ---------------------------------------------------------------------------------------------
# stalls: the per-request timeout, then a retry
# ---------------------------------------------------------------------------------------------


def test_stalled_part_and_read_time_out_and_are_retried(
    fault_proxy: FaultProxy, s3_bucket: str, s3: _s3server.Server
) -> None:
    # obstore's ``timeout`` bounds each request from connect to the end of the response, so a
    # part (5 MiB here) must fit in it at the slowest bandwidth expected; a stalled one is cut
    # off after it and retried (part uploads and reads are idempotent).
    store = proxied(fault_proxy, timeout="1s")
    path = f"/{s3_bucket}/run/x"
    expected = state(1)
    part = fault_proxy.fail("PUT", DATA + r"\?partNumber=2&", "stall", stall=2.5)
    read = fault_proxy.fail("GET", DATA, "stall", nth=2, stall=2.5)
    started = time.monotonic()
    sp.save(store.at(path), expected)
    assert_loads(store, path, expected)
    assert part.fired == 1 and read.fired == 1
    assert len(fault_proxy.requests("PUT", DATA + r"\?partNumber=2&")) == 2  # sent again
    assert time.monotonic() - started < 8
    assert s3.open_uploads(s3_bucket) == []


def test_a_part_that_never_finishes_fails_with_the_knobs_to_turn(
    fault_proxy: FaultProxy, s3_bucket: str, s3: _s3server.Server
) -> None:
    """A part whose every attempt outlasts the timeout (a link too slow for the part size) is a
    clear error naming the object, the part, the attempts and what to change; no upload stays
    open and the previous checkpoint still loads."""
    store = proxied(fault_proxy, timeout="1s")
    path = f"/{s3_bucket}/run/x"
    old = state(1)
    sp.save(store.at(path), old)
    fault_proxy.fail("PUT", DATA + r"\?partNumber=2&", "stall", stall=2.5, times=None)
    with pytest.raises(sp.CheckpointWriteError) as info:
        sp.save(store.at(path), state(2))
    message = str(info.value)
    assert "(part 2)" in message and f"after {TRIES} attempts" in message, message
    assert "larger timeout=" in message and "part_size=" in message and "1s" in message, message
    fault_proxy.clear()
    assert_loads(store, path, old)
    assert s3.open_uploads(s3_bucket) == []


# ---------------------------------------------------------------------------------------------
# lost answers: the request took effect, the client saw an error
# ---------------------------------------------------------------------------------------------


def test_lost_answer_to_the_manifest_put_is_not_a_failure(
    store: ObjectStore, fault_proxy: FaultProxy, s3_bucket: str
) -> None:
    path = f"/{s3_bucket}/run/x"
    expected = state(1)
    rule = fault_proxy.fail("PUT", MANIFEST, "lose")
    sp.save(store.at(path), expected)
    assert rule.fired == 1
    assert_loads(store, path, expected)


@pytest.mark.parametrize("fault", ["lose", "reset-request"])
def test_create_only_put_after_an_error_reads_back_what_is_there(
    store: ObjectStore, fault_proxy: FaultProxy, s3_bucket: str, s3: _s3server.Server, fault: str
) -> None:
    store.makedirs(f"/{s3_bucket}/d")
    # Our own bytes there after an error (the answer was lost): a success.
    fault_proxy.fail("PUT", r"/d/mine$", fault if fault == "lose" else "503")
    store.put(f"/{s3_bucket}/d/mine", b"my manifest")
    assert store.read_small(f"/{s3_bucket}/d/mine", cap=None) == b"my manifest"

    # Another writer's bytes there after an error: the put fails, theirs stay.
    def other_writer(rule: Rule) -> None:
        put_raw(s3, s3_bucket, "d/theirs", b"their manifest")

    fault_proxy.fail("PUT", r"/d/theirs$", fault, then=other_writer)
    with pytest.raises(FileExistsError) as info:
        store.put(f"/{s3_bucket}/d/theirs", b"my manifest")
    assert info.value.filename == f"s3://{s3_bucket}/d/theirs"
    assert store.read_small(f"/{s3_bucket}/d/theirs", cap=None) == b"their manifest"


def test_lost_answer_to_a_multipart_completion_is_not_a_failure(
    store: ObjectStore, fault_proxy: FaultProxy, s3_bucket: str, s3: _s3server.Server
) -> None:
    # S3 answers a second completion of an upload with 404 NoSuchUpload: object_store's retry of
    # the completion whose answer was lost fails. The object is there, of our size and parts.
    path = f"/{s3_bucket}/run/x"
    expected = state(1)
    lost = fault_proxy.fail("POST", DATA + r"\?uploadId=", "lose")
    again = fault_proxy.fail("POST", DATA + r"\?uploadId=", "404-upload", nth=2, times=None)
    sp.save(store.at(path), expected)
    assert lost.fired == 1 and again.fired >= 1
    assert_loads(store, path, expected)
    sp.verify(store.at(path))
    assert s3.open_uploads(s3_bucket) == []


def test_lost_completion_with_another_object_there_is_a_failure(
    store: ObjectStore, fault_proxy: FaultProxy, s3_bucket: str, s3: _s3server.Server
) -> None:
    # What the HEAD after a failed completion checks: the size and the ETag's part count.
    store.makedirs(f"/{s3_bucket}/d")

    def replaced(rule: Rule) -> None:  # between the lost answer and the retry
        put_raw(s3, s3_bucket, "d/blob", b"another writer's object")

    fault_proxy.fail("POST", r"/d/blob\?uploadId=", "lose")
    fault_proxy.fail("POST", r"/d/blob\?uploadId=", "404-upload", nth=2, times=None, then=replaced)
    payload = np.random.default_rng(3).integers(0, 256, 11 * MiB, dtype=np.uint8).tobytes()
    w = store.create_blob(f"/{s3_bucket}/d/blob", size=len(payload))
    w.write(memoryview(payload))
    with pytest.raises(
        CheckpointWriteError, match=rf"s3://{s3_bucket}/d/blob failed: its completion was refused"
    ):
        w.finish()
    w.abort()


# ---------------------------------------------------------------------------------------------
# servers that ignore If-None-Match
# ---------------------------------------------------------------------------------------------


def test_server_ignoring_if_none_match_is_detected_once_and_warned(
    store: ObjectStore, fault_proxy: FaultProxy, s3_bucket: str, s3: _s3server.Server
) -> None:
    fault_proxy.fail("PUT", r".", "ignore-precondition", times=None)
    with pytest.warns(UserWarning, match=rf"{s3_bucket}.*ignores If-None-Match.*HEAD") as caught:
        store.makedirs(f"/{s3_bucket}/d")
    assert len(caught) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per bucket: never again
        store.put(f"/{s3_bucket}/d/m", b"first")
        with pytest.raises(FileExistsError):
            store.put(f"/{s3_bucket}/d/m", b"second")  # refused by the HEAD
        assert store.read_small(f"/{s3_bucket}/d/m", cap=None) == b"first"
        expected = state(1)
        sp.save(store.at(f"/{s3_bucket}/run/x"), expected)
        sp.save(store.at(f"/{s3_bucket}/run/x"), expected)
        assert_loads(store, f"/{s3_bucket}/run/x", expected)
    assert len(fault_proxy.requests("PUT", PROBE)) == 2  # one probe: put twice
    assert not [k for k in raw_keys(s3, s3_bucket) if PROBE in k]  # and deleted
    # HEAD before each create-only put
    log = [(m, key_of(t)) for m, t, _ in fault_proxy.log]
    put_at = log.index(("PUT", "d/m"))
    assert ("HEAD", "d/m") in log[:put_at]


def test_server_honouring_if_none_match_is_probed_once_without_warning(
    store: ObjectStore, fault_proxy: FaultProxy, s3_bucket: str, s3: _s3server.Server
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        store.makedirs(f"/{s3_bucket}/d")
        store.put(f"/{s3_bucket}/d/m", b"first")
        with pytest.raises(FileExistsError):
            store.put(f"/{s3_bucket}/d/m", b"second")  # refused by the server (412)
    assert store.read_small(f"/{s3_bucket}/d/m", cap=None) == b"first"
    probes = fault_proxy.requests("PUT", PROBE)
    assert len(probes) == 2 and len({t for _, t, _ in probes}) == 1
    assert raw_keys(s3, s3_bucket) == ["d/.savepoint-dir", "d/m"]
    # No HEAD-then-put: the create-only put itself is the check.
    assert ("HEAD", "d/m") not in [(m, key_of(t)) for m, t, _ in fault_proxy.log]


def test_put_making_dir_is_one_put_and_no_marker(
    store: ObjectStore, fault_proxy: FaultProxy, s3_bucket: str, s3: _s3server.Server
) -> None:
    # A run's alias pointer is put this way: a marker put first would leave, if the process died
    # before the pointer's put, an alias directory holding nothing (read as an uncommitted
    # checkpoint, tests/runs/test_memory_runs.py).
    store.put_making_dir(f"/{s3_bucket}/run/latest/p.json", b"one", exclusive=False)
    assert raw_keys(s3, s3_bucket) == ["run/latest/p.json"]
    assert [key_of(t) for _, t, _ in fault_proxy.requests("PUT", "")] == ["run/latest/p.json"]
    st = store.stat(f"/{s3_bucket}/run/latest")
    assert st is not None and st.kind == "dir"
    store.put_making_dir(f"/{s3_bucket}/run/latest/p.json", b"two", exclusive=False)
    assert store.read_small(f"/{s3_bucket}/run/latest/p.json", cap=None) == b"two"
    assert raw_keys(s3, s3_bucket) == ["run/latest/p.json"]


# ---------------------------------------------------------------------------------------------
# error answers cut off, failed lookups: never read as "not there" (issue 25, items 10 and 2)
# ---------------------------------------------------------------------------------------------


def test_a_404_answer_cut_off_mid_body_is_retried(
    store: ObjectStore, fault_proxy: FaultProxy, s3_bucket: str
) -> None:
    # obstore reads the body of an error answer to build its error; cut off, that read failed
    # and was not retried: a new run's report.json (a 404) failed the open "after 1 attempt".
    store.makedirs(f"/{s3_bucket}/d")
    rule = fault_proxy.fail("GET", r"/d/absent$", "reset-response")
    with pytest.raises(FileNotFoundError):
        store.read_small(f"/{s3_bucket}/d/absent", cap=None)
    assert rule.fired == 1
    rule = fault_proxy.fail("GET", r"/run/(run|report)\.json$", "reset-response", times=2)
    with sp.CheckpointManager(store.at(f"/{s3_bucket}/run")) as mgr:
        mgr.save(1, state(1))
    assert rule.fired == 2, fault_proxy.log
    rule = fault_proxy.fail("GET", r"/run/report\.json$", "reset-response", times=None)
    with pytest.raises(CheckpointError, match=f"after {TRIES} attempts"):
        sp.CheckpointManager(store.at(f"/{s3_bucket}/run"))


def test_a_failed_lookup_of_a_new_checkpoint_fails_the_save_not_the_alias(
    store: ObjectStore, fault_proxy: FaultProxy, s3_bucket: str
) -> None:
    # Right after step 3's manifest is put, its HEADs answer 503 (SlowDown) through every
    # retry, twice. Before: both lookups of step 3 read as "not committed", so the save returned
    # with report.json and latest/ naming step 2 (until a later open repaired them). Now the
    # first failed lookup fails the save, and the run is as before.
    import json

    from savepoint.runs import layout

    run = f"/{s3_bucket}/run"
    small = {"w": np.arange(50_000, dtype=np.float32)}

    def books() -> tuple[int, str]:
        report = json.loads(store.read_small(f"{run}/report.json", cap=None))
        target = json.loads(store.read_small(f"{run}/latest/savepoint-alias.json", cap=None))
        return report["latest_step"], target["target"]

    with sp.CheckpointManager(store.at(run), keep_last=2, incremental=True) as mgr:
        for step in (1, 2):
            mgr.save(step, {**small, "step": step})
        mgr.wait()
        manifest = r"/step-0000000003/gen-[^/]+/manifest\.json$"

        def slow_down(rule: Rule) -> None:
            fault_proxy.fail("HEAD", manifest, "503", times=2 * TRIES)

        fault_proxy.fail("PUT", manifest, "stall", stall=0.0, then=slow_down)
        with pytest.raises(CheckpointWriteError, match="cannot look at"):
            mgr.save(3, {**small, "step": 3})
        fault_proxy.clear()
        assert books() == (2, f"checkpoints/{layout.step_name(2)}")  # the run as before
        with contextlib.suppress(CheckpointError):
            mgr.wait()
    with sp.CheckpointManager(store.at(run), keep_last=2, incremental=True) as mgr:
        latest = mgr.latest_step()
        assert latest is not None and books() == (latest, f"checkpoints/{layout.step_name(latest)}")
    assert sp.load(store.at(f"{run}/latest"))["step"] == latest
