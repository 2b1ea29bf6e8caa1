"""savepoint.commit.transaction: one transaction, two strategies, on every kind of store.

Each test runs on the local filesystem and on the memory store (rename strategy), and on the memory
store without rename (manifest-last strategy). Crashes are simulated with a FaultyStore around
them: at every change a save makes in turn, the "process dies" (the store freezes, so no cleanup
runs) and what remains must be the previous checkpoint or the new one, and the next save must
succeed.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import savepoint as sp
from savepoint.codecs import manifest as mf
from savepoint.commit import names
from savepoint.commit.transaction import Transaction, discard, resolve
from savepoint.storage.base import Store
from savepoint.storage.faults import FaultyStore, SimulatedCrash
from savepoint.storage.local import LocalStore
from savepoint.storage.memory import MemoryStore

KINDS = ["local", "memory", "memory-object"]


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def make(kind: str) -> Store:
    if kind == "local":
        return LocalStore()
    return MemoryStore(atomic_rename=kind == "memory")


@pytest.fixture
def where(kind: str, tmp_path: Path) -> tuple[Store, str]:
    """A fresh store of ``kind`` and a parent directory in it."""
    store = make(kind)
    parent = str(tmp_path) if kind == "local" else "/parent"
    store.makedirs(parent)
    return store, parent


def save(store: Store, target: str, label: str) -> str:
    """A two-blob "checkpoint" whose manifest and data say ``label``."""
    with Transaction(store, target) as tx:
        store.put(store.join(tx.staging, "data-00000.safetensors"), f"data {label}".encode())
        store.put(store.join(tx.staging, "data-00001.safetensors"), f"more {label}".encode())
        return tx.commit(f"manifest {label}".encode())


def label(store: Store, target: str) -> str | None:
    """What the committed checkpoint at ``target`` says (None: no checkpoint); its blobs must
    agree with each other."""
    found = resolve(store, target)
    if found is None:
        return None
    text = store.read_small(store.join(found, mf.NAME), cap=None).decode()
    which = text.removeprefix("manifest ")
    data = store.read_small(store.join(found, "data-00000.safetensors"), cap=None)
    assert data == f"data {which}".encode(), (text, data)
    return which


def entries(store: Store, parent: str) -> list[str]:
    return sorted(store.list(parent))


# ---------------------------------------------------------------------------------------------
# commit, replace, abort
# ---------------------------------------------------------------------------------------------


def test_commit_into_an_absent_target(where: tuple[Store, str]) -> None:
    store, parent = where
    target = store.join(parent, "ckpt")
    committed = save(store, target, "one")
    assert label(store, target) == "one"
    assert resolve(store, target) == committed
    assert entries(store, parent) == ["ckpt"]
    if store.capabilities.atomic_rename:
        assert committed == target
    else:
        assert store.parent(committed) == target
        assert names.is_generation(store.basename(committed))


def test_the_staging_is_a_hidden_sibling_or_a_generation(where: tuple[Store, str]) -> None:
    store, parent = where
    target = store.join(parent, "ckpt")
    with Transaction(store, target) as tx:
        assert store.stat(tx.staging) is not None
        if tx.strategy == "rename":
            assert store.parent(tx.staging) == parent
            assert store.basename(tx.staging).startswith(f".ckpt{names.TMP_TAG}{names.HOST}-")
        else:
            assert store.parent(tx.staging) == target
            assert names.is_generation(store.basename(tx.staging))
        tx.commit(b"manifest x")
    assert tx.strategy == ("rename" if store.capabilities.atomic_rename else "manifest-last")


def test_replace(where: tuple[Store, str]) -> None:
    store, parent = where
    target = store.join(parent, "ckpt")
    first = save(store, target, "one")
    second = save(store, target, "two")
    assert label(store, target) == "two"
    assert entries(store, parent) == ["ckpt"]
    if not store.capabilities.atomic_rename:
        assert first != second
        assert entries(store, target) == [store.basename(second)]  # the older one is deleted


def test_commit_of_a_staging_that_holds_its_manifest(where: tuple[Store, str]) -> None:
    store, parent = where
    target = store.join(parent, "alias")
    with Transaction(store, target, what="alias") as tx:
        store.put(store.join(tx.staging, "data-00000.safetensors"), b"data x")
        store.put(store.join(tx.staging, mf.NAME), b"manifest x")
        tx.commit(None)
    assert label(store, target) == "x"


@pytest.mark.parametrize("previous", [None, "old"])
def test_an_exception_aborts_and_leaves_nothing(
    where: tuple[Store, str], previous: str | None
) -> None:
    store, parent = where
    target = store.join(parent, "ckpt")
    if previous:
        save(store, target, previous)
    before = {p: entries(store, p) for p in (parent, target)}

    def failing_save() -> None:
        with Transaction(store, target) as tx:
            store.put(store.join(tx.staging, "data-00000.safetensors"), b"data new")
            raise KeyError("the state could not be written")

    with pytest.raises(KeyError):
        failing_save()
    assert {p: entries(store, p) for p in (parent, target)} == before
    assert label(store, target) == previous


def test_an_oserror_becomes_a_write_error(where: tuple[Store, str]) -> None:
    store, parent = where
    target = store.join(parent, "ckpt")
    save(store, target, "old")
    with pytest.raises(sp.CheckpointWriteError) as info, Transaction(store, target):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "data-00000.safetensors")
    assert info.value.errno == errno.ENOSPC
    assert "free disk space" in str(info.value) and store.url(target) in str(info.value)
    assert isinstance(info.value.__cause__, OSError)
    assert label(store, target) == "old"


def test_a_refused_write_says_what_to_check(kind: str, where: tuple[Store, str]) -> None:
    """EACCES on the local filesystem is the parent directory's permissions; on any other store
    (an object store refusing credentials with 403 AccessDenied or 401) no permission bit is the
    cause, so the advice is the credentials and the bucket's access policy (before, every store
    got "check the permissions of the parent directory"). The store's own message and the URL
    stay in the error."""
    inner, parent = where
    target = inner.join(parent, "ckpt")
    save(inner, target, "old")
    store = FaultyStore(inner)
    store.fail({"create_blob", "put"}, code=errno.EACCES, times=None)
    with pytest.raises(sp.CheckpointWriteError) as info:
        save(store, target, "new")
    message = str(info.value)
    assert info.value.errno == errno.EACCES
    assert f"saving {store.url(target)} failed: Permission denied (injected) (" in message
    assert "any previous checkpoint there is intact" in message
    if kind == "local":
        assert message.endswith("; check the permissions of the parent directory"), message
    else:
        assert message.endswith(
            "; the store refused the request: check the credentials and the bucket's access policy"
        ), message
    assert label(inner, target) == "old"


def test_an_object_stores_refusal_keeps_its_message_and_url() -> None:
    """What the object store raises for 403/401 (a PermissionError naming the request, the
    server's answer and the object's URL) reaches the user whole, with the credentials advice."""
    store = MemoryStore(atomic_rename=False)
    target = "/bucket/ckpt"
    refused = "PUT refused: Server returned non-2xx status code: 403 Forbidden (AccessDenied)"
    with pytest.raises(sp.CheckpointWriteError) as info, Transaction(store, target):
        raise PermissionError(errno.EACCES, refused, "s3://bucket/ckpt/gen-1/data.safetensors")
    assert str(info.value) == (
        f"saving {store.url(target)} failed: {refused} (s3://bucket/ckpt/gen-1/data.safetensors); "
        "any previous checkpoint there is intact and no temporary files remain; the store "
        "refused the request: check the credentials and the bucket's access policy"
    )
    assert info.value.errno == errno.EACCES


@pytest.mark.parametrize(
    ("status", "answer"),
    [
        ("403", ("Forbidden", "AccessDenied", "Access Denied")),
        ("401", ("Unauthorized", "InvalidAccessKeyId", "The AWS Access Key Id does not exist.")),
    ],
)
def test_refused_credentials_on_s3(
    status: str,
    answer: tuple[str, str, str],
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same on S3 (the moto server behind the fault proxy, which answers every PUT with
    ``status`` as S3 does to refused credentials): the credentials advice, obstore's answer and
    the object's URL; the previous checkpoint stays."""
    from storage import _faultproxy, _s3server

    if not _s3server.AVAILABLE:
        pytest.skip(_s3server.SKIP_REASON)
    from savepoint.storage.objectstore import ObjectStore

    # The proxy answers 503/500 with S3's error body; teach it this status for the test.
    monkeypatch.setattr(_faultproxy, "ACTIONS", (*_faultproxy.ACTIONS, status))
    monkeypatch.setitem(_faultproxy._ERRORS, status, answer)
    bucket = request.getfixturevalue("s3_bucket")
    proxy = _faultproxy.FaultProxy(request.getfixturevalue("s3").endpoint).start()
    try:
        store = ObjectStore(
            "s3",
            endpoint=proxy.endpoint,
            region=_s3server.REGION,
            access_key_id=_s3server.ENV["AWS_ACCESS_KEY_ID"],
            secret_access_key=_s3server.ENV["AWS_SECRET_ACCESS_KEY"],
            allow_http=True,
        )
        where = store.at(f"/{bucket}/ckpt")
        sp.save(where, {"w": np.zeros(3)})
        proxy.fail("PUT", ".", status, times=None)
        with pytest.raises(sp.CheckpointWriteError) as info:
            sp.save(where, {"w": np.ones(3)})
        proxy.clear()
        np.testing.assert_array_equal(sp.load(where)["w"], np.zeros(3))
    finally:
        proxy.stop()
    message = str(info.value)
    assert message.startswith(f"saving s3://{bucket}/ckpt failed: PUT refused: "), message
    assert f"{status} {answer[0]} ({answer[1]}) (s3://{bucket}/ckpt/" in message, message
    assert message.endswith(
        "; the store refused the request: check the credentials and the bucket's access policy"
    ), message
    assert "parent directory" not in message
    assert info.value.errno == errno.EACCES


def test_a_failing_commit_aborts(where: tuple[Store, str]) -> None:
    inner, parent = where
    target = inner.join(parent, "ckpt")
    save(inner, target, "old")
    store = FaultyStore(inner)
    # (a local disk writes the manifest as a blob into the staging directory; others put it)
    store.fail(("put", "write"), path="*/manifest.json", code=errno.EIO)
    with pytest.raises(sp.CheckpointWriteError) as info:
        save(store, target, "new")
    assert info.value.errno == errno.EIO
    assert label(inner, target) == "old"
    assert entries(inner, parent) == ["ckpt"]
    assert inner.capabilities.atomic_rename or len(entries(inner, target)) == 1


@pytest.mark.parametrize("content", ["file", "not-a-checkpoint"])
def test_targets_that_are_not_checkpoints_are_refused(
    where: tuple[Store, str], content: str
) -> None:
    store, parent = where
    target = store.join(parent, "ckpt")
    if content == "file":
        store.put(target, b"user data")
    else:
        store.makedirs(target)
        store.put(store.join(target, "notes.txt"), b"user data")
    with pytest.raises(sp.CheckpointWriteError, match="refusing to replace"):
        save(store, target, "new")
    assert entries(store, parent) == ["ckpt"]
    if content != "file":
        assert entries(store, target) == ["notes.txt"]


def test_an_empty_directory_is_a_fine_target(where: tuple[Store, str]) -> None:
    store, parent = where
    target = store.join(parent, "ckpt")
    store.makedirs(target)
    save(store, target, "one")
    assert label(store, target) == "one"


# ---------------------------------------------------------------------------------------------
# crashes between steps: old or new, never a mixture, and the next save works
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "two-renames"])
@pytest.mark.parametrize("previous", [None, "old"], ids=["first-save", "replace"])
def test_a_crash_at_any_step_leaves_old_or_new(
    where: tuple[Store, str], exchange: bool, previous: str | None
) -> None:
    inner, parent = where
    if not exchange and not inner.capabilities.atomic_rename:
        pytest.skip("manifest-last does not rename")
    target = inner.join(parent, "ckpt")

    def start() -> None:
        discard(inner, target)
        if previous:
            save(inner, target, previous)

    start()
    probe = FaultyStore(inner, exchange=exchange)
    save(probe, target, "probe")
    steps = len(probe.mutations())
    assert steps >= 4
    seen = set()
    for k in range(steps + 1):
        start()
        store = FaultyStore(inner, exchange=exchange)
        store.crash_after(k)
        try:
            save(store, target, f"new{k}")
        except SimulatedCrash:
            pass
        found = label(inner, target)
        assert found in (previous, f"new{k}"), (k, store.crashed)
        seen.add(found == f"new{k}")
        # The next process saves again; whatever the crash left does not get in its way.
        save(inner, target, "next")
        assert label(inner, target) == "next"
    assert seen == {False, True}


def test_a_crash_between_the_fallback_renames_leaves_the_old_checkpoint_findable(
    where: tuple[Store, str],
) -> None:
    inner, parent = where
    if not inner.capabilities.atomic_rename:
        pytest.skip("manifest-last does not rename")
    target = inner.join(parent, "ckpt")
    save(inner, target, "old")
    store = FaultyStore(inner, exchange=False)
    store.crash("rename", nth=2)  # the old one is parked, the new one not yet in place
    with pytest.raises(SimulatedCrash):
        save(store, target, "new")
    assert inner.stat(target) is None
    found = resolve(inner, target)
    assert found is not None and names.OLD_TAG in inner.basename(found)
    assert label(inner, target) == "old"


# ---------------------------------------------------------------------------------------------
# resolve: both layouts on every store
# ---------------------------------------------------------------------------------------------


def test_resolve_reads_both_layouts(where: tuple[Store, str]) -> None:
    store, parent = where
    flat = store.join(parent, "flat")
    store.makedirs(flat)
    store.put(store.join(flat, mf.NAME), b"m")
    assert resolve(store, flat) == flat

    gens = store.join(parent, "gens")
    older, newer, partial = (
        store.join(gens, f"gen-{t:020d}-{names.HOST}-1-0000000{t}") for t in (1, 2, 3)
    )
    for d in (older, newer, partial):
        store.makedirs(d)
    store.put(store.join(older, mf.NAME), b"m")
    store.put(store.join(newer, mf.NAME), b"m")
    assert resolve(store, gens) == newer  # the newest with a manifest; the partial one is not
    store.put(store.join(gens, mf.NAME), b"m")
    assert resolve(store, gens) == gens  # a manifest of its own wins

    assert resolve(store, store.join(parent, "absent")) is None
    empty = store.join(parent, "empty")
    store.makedirs(empty)
    assert resolve(store, empty) is None


def test_manifest_last_replaces_a_flat_checkpoint(tmp_path: Path) -> None:
    # A checkpoint copied from a local disk (flat layout) onto an object store: a save over it
    # commits a generation, then removes the flat manifest (that is the switch) and its data.
    store = MemoryStore(atomic_rename=False)
    target = "/run/ckpt"
    store.makedirs(target)
    store.put(store.join(target, mf.NAME), b"manifest old")
    store.put(store.join(target, "data-00000.safetensors"), b"data old")
    committed = save(store, target, "new")
    assert label(store, target) == "new"
    assert entries(store, target) == [store.basename(committed)]


def test_generations_left_by_crashed_attempts_are_deleted_by_the_next_commit() -> None:
    store = MemoryStore(atomic_rename=False)
    target = "/run/ckpt"
    save(store, target, "one")
    abandoned = store.join(target, names.generation())
    store.mkdir(abandoned)
    store.put(store.join(abandoned, "data-00000.safetensors"), b"half")
    assert label(store, target) == "one"  # no manifest, no checkpoint
    committed = save(store, target, "two")
    assert entries(store, target) == [store.basename(committed)]


def test_a_directory_of_abandoned_generations_is_a_fine_target() -> None:
    store = MemoryStore(atomic_rename=False)
    target = "/run/ckpt"
    abandoned = store.join(target, names.generation())
    store.makedirs(abandoned)
    store.put(store.join(abandoned, "data-00000.safetensors"), b"half")
    assert resolve(store, target) is None
    save(store, target, "one")
    assert label(store, target) == "one"


# ---------------------------------------------------------------------------------------------
# discard
# ---------------------------------------------------------------------------------------------


def test_discard(where: tuple[Store, str]) -> None:
    store, parent = where
    target = store.join(parent, "ckpt")
    save(store, target, "one")
    save(store, target, "two")
    discard(store, target)
    assert resolve(store, target) is None
    assert entries(store, parent) == []
    discard(store, target)  # absent is fine


def test_a_crash_during_discard_never_leaves_a_half_deleted_checkpoint(
    where: tuple[Store, str],
) -> None:
    inner, parent = where
    target = inner.join(parent, "ckpt")
    probe = FaultyStore(inner)
    save(inner, target, "one")
    discard(probe, target)
    steps = len(probe.mutations())
    for k in range(steps + 1):
        save(inner, target, "one")
        store = FaultyStore(inner)
        store.crash_after(k)
        try:
            discard(store, target)
        except SimulatedCrash:
            pass
        assert label(inner, target) in ("one", None), k


def test_location_arguments(where: tuple[Store, str]) -> None:
    store, parent = where
    at: Any = store.at(store.join(parent, "ckpt"))
    sp.save(at, {"x": 1})
    assert sp.load(at) == {"x": 1}
