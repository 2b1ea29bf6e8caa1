"""Garbage collection of what failed or interrupted saves left (savepoint.runs.gc), on the three
kinds of store: ``MemoryStore(atomic_rename=False)`` (an object store in memory), the local disk
(the rename strategy) and a real S3 server (moto, tests/storage/_s3server.py).

Each leftover is planted the way a killed save leaves it (a generation without a manifest, a
committed generation a crash kept beside a newer one, a step directory whose only save died,
hidden temporaries of dead, live and foreign processes, an open multipart upload), then:
everything old is removed, nothing committed, listed or aliased is, the grace period keeps what
is younger, ``dry_run`` removes nothing, and ``savepoint gc`` prints and exits as documented.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

import savepoint as sp
from savepoint.cli import main
from savepoint.codecs import manifest as mf
from savepoint.commit import names
from savepoint.commit.transaction import resolve as resolve_commit
from savepoint.runs import gc as gc_mod
from savepoint.runs import layout
from savepoint.storage import local, uploads
from savepoint.storage.base import walk
from savepoint.storage.memory import MemoryStore
from savepoint.storage.paths import Location

from ._util import state

BACKENDS = ["memory", "local", "s3"]
HOUR = 3600 * 10**9
OPTIONS: dict[str, Any] = {"keep_last": 2, "best_metric": "val"}


def _s3_store() -> Any:
    from faults._kill_s3_child import make_store

    return make_store()


@pytest.fixture(params=BACKENDS)
def run(request: pytest.FixtureRequest, tmp_path: Path) -> Location:
    """A run of four saves (steps 1, 3, 4 kept: 1 is the best) on each kind of store."""
    if request.param == "memory":
        where = MemoryStore(atomic_rename=False).at("/b/run")
    elif request.param == "local":
        where = local.STORE.at(str(tmp_path / "run"))
    else:
        bucket = request.getfixturevalue("s3_bucket")
        where = _s3_store().at(f"/{bucket}/run")
    with sp.CheckpointManager(where, **OPTIONS) as mgr:
        for step in range(1, 5):
            mgr.save(step, state(step), metrics={"val": float(step)})
    return where


def blobs(where: Location) -> list[str]:
    return list(walk(where.store, where.path))


def step_dir(run: Location, step: int) -> str:
    return layout.step_location(run, step).path


def gen_name(age_s: float, tag: str = "deadbeef") -> str:
    return f"gen-{time.time_ns() - int(age_s * 1e9):020d}-otherhost-1-{tag}"


def plant(store: Any, directory: str, *files: str) -> str:
    store.makedirs(directory)
    for name in files:
        store.put(store.join(directory, name), b"leftover " * 100)
    return directory


def copy_generation(store: Any, checkpoint: str, name: str) -> str:
    """A committed copy of ``checkpoint``'s newest generation under the name ``name``."""
    source = resolve_commit(store, checkpoint)
    assert source is not None
    target = store.join(checkpoint, name)
    store.makedirs(target)
    for entry in store.list(source):
        store.put(store.join(target, entry), store.read_small(store.join(source, entry), cap=None))
    return target


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def check_run_intact(run: Location) -> None:
    """Every checkpoint the run lists loads exactly, and so do latest/ and best/."""
    view = sp.open_run(run)
    assert view.steps() == [1, 3, 4]
    assert view.problems() == []
    for step in (1, 3, 4):
        got = view.load(step)
        assert got["step"] == step and np.array_equal(got["w"], state(step)["w"])
    assert sp.load(run.join("latest"))["step"] == 4
    assert sp.load(run.join("best"))["step"] == 1


def url(where: Location, path: str) -> str:
    return where.store.url(path)


# ---------------------------------------------------------------------------------------------
# every kind of leftover
# ---------------------------------------------------------------------------------------------


def plant_manifest_last(run: Location) -> tuple[set[str], set[str]]:
    """Leftovers of killed manifest-last saves: (old ones, young ones) as URLs."""
    store = run.store
    four, three = step_dir(run, 4), step_dir(run, 3)
    old = {
        # a save of step 4 that died before its manifest, two hours ago
        plant(store, store.join(four, gen_name(7200, "00000001")), "data-00000.safetensors"),
        # a committed generation a crash kept beside the newer one (three hours old)
        copy_generation(store, four, gen_name(3 * 3600, "00000002")),
        # a step whose only save died before committing
        store.join(run.path, "checkpoints", "step-0000000099"),
    }
    plant(
        store,
        store.join(run.path, "checkpoints", "step-0000000099", gen_name(7200)),
        "data-00000.safetensors",
    )
    young = {
        # an attempt started a second ago: it may still be running
        plant(store, store.join(three, gen_name(1, "00000003")), "data-00000.safetensors"),
        store.join(run.path, "checkpoints", "step-0000000098"),
    }
    plant(store, store.join(run.path, "checkpoints", "step-0000000098", gen_name(1)), "x.bin")
    return {url(run, p) for p in old}, {url(run, p) for p in young}


def plant_rename(run: Location) -> tuple[set[str], set[str], set[str]]:
    """Leftovers of killed rename-strategy saves on the local disk: (old, young, never)."""
    store = run.store
    ckpts = store.join(run.path, "checkpoints")
    dead = dead_pid()
    here = names.HOST

    def hidden(parent: str, target: str, tag: str, rest: str, age: float = 0) -> str:
        path = plant(store, store.join(parent, f".{target}{tag}{rest}"), "data-00000.safetensors")
        if age:
            aged(path, age)
        return path

    old = {
        hidden(ckpts, "step-0000000004", names.TMP_TAG, f"{here}-{dead}-00000001"),
        hidden(ckpts, "step-0000000004", names.OLD_TAG, f"{here}-{dead}-00000002"),
        hidden(ckpts, "step-0000000003", names.TMP_TAG, "otherhost-77-00000003", age=7200),
        hidden(run.path, "latest", names.TMP_TAG, f"{here}-{dead}-00000004"),
        aged(plant(store, store.join(ckpts, "step-0000000099"), "data-00000.safetensors"), 7200),
    }
    report_tmp = store.join(run.path, f".report.json{names.TMP_TAG}{here}-{dead}-00000005")
    store.put(report_tmp, b"{}")
    old.add(report_tmp)
    young = {hidden(ckpts, "step-0000000003", names.TMP_TAG, "otherhost-77-00000006")}
    never = {
        # this very process is alive: its temporaries are never touched
        hidden(ckpts, "step-0000000004", names.TMP_TAG, f"{here}-{os.getpid()}-00000007"),
        # the only copy of step 7 (a replace died between its renames): readers load it
        hidden(ckpts, "step-0000000007", names.OLD_TAG, f"{here}-{dead}-00000008"),
    }
    for path in never:
        copy_flat(store, step_dir(run, 4), path)
    return (
        {url(run, p) for p in old},
        {url(run, p) for p in young},
        {url(run, p) for p in never},
    )


def aged(path: str, seconds: float) -> str:
    """Set the modification time of ``path`` and everything in it ``seconds`` into the past."""
    when = time.time() - seconds
    for root, _, files in os.walk(path):
        for name in files:
            os.utime(os.path.join(root, name), (when, when))
    os.utime(path, (when, when))
    return path


def copy_flat(store: Any, source: str, target: str) -> None:
    for entry in store.list(source):
        path = store.join(target, entry)
        if store.stat(path) is not None:
            store.remove(path)
        store.put(path, store.read_small(store.join(source, entry), cap=None))


def test_collects_every_kind_of_leftover(run: Location) -> None:
    clean = blobs(run)
    if run.store.capabilities.atomic_rename:
        old, young, never = plant_rename(run)
    else:
        (old, young), never = plant_manifest_last(run), set()
    check_run_intact(run)

    report = gc_mod.collect(run, grace=3600)
    assert report.ok and not report.dry_run and report.grace == 3600
    assert set(report.paths) == old
    kept = {s.path for s in report.skipped}
    # (a step directory holding a young attempt is reported through that attempt)
    assert all(any(k == p or k.startswith(p + "/") for k in kept) for p in young | never)
    assert report.bytes_freed > 0
    check_run_intact(run)

    report = gc_mod.collect(run, grace=0)
    assert set(report.paths) == young
    assert never <= {s.path for s in report.skipped}
    check_run_intact(run)
    # What is left beyond the clean run is exactly what must never be collected.
    left = {url(run, p) for p in set(blobs(run)) - set(clean)}
    assert left == {p for p in left if any(p.startswith(n + "/") for n in never)}
    assert {n for n in never if any(p.startswith(n + "/") for p in left)} == never
    assert gc_mod.collect(run, grace=0).removed == ()


def test_nothing_committed_listed_or_aliased_is_removed(run: Location) -> None:
    clean = blobs(run)
    report = gc_mod.collect(run, grace=0)
    assert report.removed == () and report.failures == ()
    assert blobs(run) == clean
    check_run_intact(run)
    # A step the report lists whose checkpoint lost its manifest: kept as it is, and said so.
    store = run.store
    two = resolve_commit(store, step_dir(run, 3))
    assert two is not None
    store.remove(store.join(two, mf.NAME))
    before = blobs(run)
    report = gc_mod.collect(run, grace=0)
    assert report.removed == ()
    assert blobs(run) == before
    kept = {s.path: s.reason for s in report.skipped}
    assert "for inspection" in kept[url(run, step_dir(run, 3))]


def test_grace_period_keeps_young_leftovers(run: Location) -> None:
    store = run.store
    if store.capabilities.atomic_rename:
        young = plant(
            store,
            store.join(run.path, "checkpoints", f".step-0000000004{names.TMP_TAG}far-1-00000001"),
            "data-00000.safetensors",
        )
        aged(young, 600)
    else:
        young = plant(store, store.join(step_dir(run, 4), gen_name(600)), "data.bin")
    assert gc_mod.collect(run, grace=601).removed == ()
    assert store.stat(young) is not None
    report = gc_mod.collect(run, grace=599)
    assert report.paths == (url(run, young),)
    assert store.stat(young) is None


def test_dry_run_removes_nothing(run: Location) -> None:
    if run.store.capabilities.atomic_rename:
        old, _, _ = plant_rename(run)
    else:
        (old, _), _ = plant_manifest_last(run), None
    before = blobs(run)
    report = gc_mod.collect(run, grace=3600, dry_run=True)
    assert report.dry_run and set(report.paths) == old and report.bytes_freed > 0
    assert blobs(run) == before
    real = gc_mod.collect(run, grace=3600)
    assert real.paths == report.paths
    assert real.bytes_freed == report.bytes_freed


# ---------------------------------------------------------------------------------------------
# the manager, the lock, single checkpoints, arguments
# ---------------------------------------------------------------------------------------------


def test_manager_gc_holds_the_lock_and_read_only_refuses(run: Location) -> None:
    store = run.store
    if store.capabilities.atomic_rename:
        leftover = plant(
            store,
            store.join(run.path, "checkpoints", f".step-0000000004{names.TMP_TAG}far-1-00000001"),
            "x",
        )
    else:
        leftover = plant(store, store.join(step_dir(run, 4), gen_name(7200)), "x")
    with sp.CheckpointManager(run, **OPTIONS) as mgr:
        with pytest.raises(sp.RunLockedError):  # (a lease object on S3)
            gc_mod.collect(run, grace=0)
        assert mgr.gc(grace=0, dry_run=True).paths == (url(run, leftover),)
        assert store.stat(leftover) is not None
        report = mgr.gc(grace=0)
        assert isinstance(report, sp.GcReport)
        assert report.paths == (url(run, leftover),)
        mgr.save(5, state(5), metrics={"val": 5.0})  # the manager still writes afterwards
    assert store.stat(leftover) is None
    with sp.CheckpointManager(run, read_only=True) as reader:
        with pytest.raises(sp.CheckpointWriteError, match="does not write the run"):
            reader.gc()


def test_collects_a_single_checkpoint() -> None:
    store = MemoryStore(atomic_rename=False)
    where = store.at("/b/ckpt")
    sp.save(where, state(1))
    sp.save(where, state(2))
    stale = plant(store, store.join(where.path, gen_name(7200)), "data-00000.safetensors")
    kept = copy_generation(store, where.path, gen_name(9000))
    report = gc_mod.collect(where, grace=60)
    assert set(report.paths) == {url(where, stale), url(where, kept)}
    assert sp.load(where)["step"] == 2
    assert gc_mod.collect(where, grace=0).removed == ()


def test_collects_hidden_siblings_of_a_local_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    sp.save(path, state(1))
    stale = tmp_path / f".ckpt{names.TMP_TAG}{names.HOST}-{dead_pid()}-00000001"
    stale.mkdir()
    (stale / "data-00000.safetensors").write_bytes(b"x" * 10)
    other = tmp_path / f".other{names.TMP_TAG}{names.HOST}-{dead_pid()}-00000001"
    other.mkdir()  # another checkpoint's: not this one's to collect
    report = gc_mod.collect(path, grace=3600)
    assert report.paths == (str(stale),)
    assert report.removed[0].bytes == 10
    assert not stale.exists() and other.exists()
    assert sp.load(path)["step"] == 1


def test_refuses_what_is_neither_a_run_nor_a_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "notes.txt").write_text("mine")
    for where in (tmp_path / "plain", tmp_path / "absent"):
        with pytest.raises(sp.CheckpointNotFoundError, match="nothing to collect"):
            gc_mod.collect(where)
    assert (tmp_path / "plain" / "notes.txt").exists()


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"grace": -1}, ValueError),
        ({"grace": float("nan")}, ValueError),
        ({"grace": True}, TypeError),
        ({"grace": "1"}, TypeError),
        ({"dry_run": 1}, TypeError),
    ],
)
def test_arguments_are_checked(tmp_path: Path, kwargs: dict[str, Any], error: type) -> None:
    with pytest.raises(error):
        gc_mod.collect(tmp_path, **kwargs)


def test_report_to_dict_is_json() -> None:
    report = gc_mod.GcReport(
        directory="s3://b/run",
        grace=0.0,
        dry_run=False,
        removed=(gc_mod.Removed("s3://b/run/x", "why", 10), gc_mod.Removed("s3://b/run/y", "?")),
        aborted_uploads=(gc_mod.AbortedUpload("s3://b/run/z", "id", "2026-01-01T00:00:00Z"),),
        skipped=(gc_mod.Skipped("s3://b/run/w", "young"),),
    )
    doc = json.loads(json.dumps(report.to_dict()))
    assert doc["bytes_freed"] == 10 and report.bytes_freed == 10
    assert [r["path"] for r in doc["removed"]] == ["s3://b/run/x", "s3://b/run/y"]
    assert doc["aborted_uploads"][0]["upload_id"] == "id"
    assert doc["skipped"] == [{"path": "s3://b/run/w", "reason": "young"}]
    assert report.ok and doc["failures"] == []
    with pytest.raises(AttributeError):
        report.grace = 1.0  # type: ignore[misc]


# ---------------------------------------------------------------------------------------------
# S3: open multipart uploads
# ---------------------------------------------------------------------------------------------


def open_upload(server: Any, bucket: str, key: str) -> str:
    client = server.client()
    try:
        upload = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
        client.upload_part(
            Bucket=bucket, Key=key, UploadId=upload, PartNumber=1, Body=b"x" * (5 << 20)
        )
        return str(upload)
    finally:
        client.close()


@pytest.fixture
def s3_run(s3: Any, s3_bucket: str) -> Location:
    where = _s3_store().at(f"/{s3_bucket}/run")
    with sp.CheckpointManager(where, **OPTIONS) as mgr:
        for step in range(1, 5):
            mgr.save(step, state(step), metrics={"val": float(step)})
    return where


def test_open_uploads_under_the_run_are_aborted_after_the_grace(
    s3: Any, s3_bucket: str, s3_run: Location
) -> None:
    inside = f"run/checkpoints/step-0000000004/{gen_name(0)}/data-00000.safetensors"
    mine = open_upload(s3, s3_bucket, inside)
    outside = open_upload(s3, s3_bucket, "run2/checkpoints/data.bin")
    report = gc_mod.collect(s3_run, grace=3600)
    assert report.uploads_checked and report.aborted_uploads == ()
    assert f"s3://{s3_bucket}/{inside}" in {s.path for s in report.skipped}
    assert len(s3.open_uploads(s3_bucket)) == 2
    dry = gc_mod.collect(s3_run, grace=0, dry_run=True)
    assert [u.upload_id for u in dry.aborted_uploads] == [mine]
    assert len(s3.open_uploads(s3_bucket)) == 2
    report = gc_mod.collect(s3_run, grace=0)
    assert [(u.path, u.upload_id) for u in report.aborted_uploads] == [
        (f"s3://{s3_bucket}/{inside}", mine)
    ]
    assert report.aborted_uploads[0].initiated.endswith("Z")
    assert s3.open_uploads(s3_bucket) == [("run2/checkpoints/data.bin", outside)]
    check_run_intact(s3_run)


def test_without_boto3_open_uploads_are_reported_unchecked(
    s3_run: Location, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = uploads.importlib.util.find_spec
    monkeypatch.setattr(
        uploads.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "boto3" else real(name, *a),
    )
    report = gc_mod.collect(s3_run, grace=0)
    assert not report.uploads_checked
    (note,) = report.notes
    assert "were not checked" in note and "boto3 is not installed" in note
    assert report.ok


def test_a_store_configured_by_hand_configures_boto3(
    s3: Any, s3_bucket: str, s3_run: Location, monkeypatch: pytest.MonkeyPatch
) -> None:
    from savepoint.storage.objectstore import ObjectStore

    given = {
        "endpoint": s3.endpoint,
        "aws_region": "us-east-1",
        "access_key_id": os.environ["AWS_ACCESS_KEY_ID"],
        "AWS_SECRET_ACCESS_KEY": os.environ["AWS_SECRET_ACCESS_KEY"],
        "allow_http": True,
    }
    for name in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    store = ObjectStore("s3", **given)
    options = uploads.s3_options(store)
    assert options["endpoint"] == s3.endpoint and options["region"] == "us-east-1"
    assert options["secret_access_key"] == given["AWS_SECRET_ACCESS_KEY"]
    key = f"run/checkpoints/step-0000000003/{gen_name(0)}/data-00000.safetensors"
    upload = open_upload(s3, s3_bucket, key)
    report = gc_mod.collect(store.at(s3_run.path), grace=0)
    assert report.uploads_checked, report.notes
    assert [u.upload_id for u in report.aborted_uploads] == [upload]
    assert s3.open_uploads(s3_bucket) == []
    assert uploads.s3_options(ObjectStore("s3"))["region"] == "us-east-1"  # from AWS_REGION


def test_a_store_without_locks_is_collected_under_the_grace_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = MemoryStore(atomic_rename=False)
    where = store.at("/b/run")
    with sp.CheckpointManager(where, **OPTIONS) as mgr:
        mgr.save(1, state(1))
    stale = plant(store, store.join(step_dir(where, 1), gen_name(7200)), "data.bin")

    def no_locks(self: Any, path: str) -> Any:
        raise NotImplementedError("no locks here")

    monkeypatch.setattr(MemoryStore, "lock", no_locks)
    report = gc_mod.collect(where, grace=3600)
    assert report.paths == (url(where, stale),)
    assert any("has no locks" in n and "grace period" in n for n in report.notes), report.notes


def test_uploads_are_only_checked_on_s3() -> None:
    with pytest.raises(uploads.UploadsUnavailable, match="S3 only"):
        uploads.client_for(MemoryStore(atomic_rename=False))


# ---------------------------------------------------------------------------------------------
# savepoint gc
# ---------------------------------------------------------------------------------------------


def invoke(*args: str) -> Any:
    return CliRunner().invoke(main, list(args))


def local_run(tmp_path: Path) -> tuple[Path, Path]:
    path = tmp_path / "run"
    with sp.CheckpointManager(path, **OPTIONS) as mgr:
        for step in range(1, 5):
            mgr.save(step, state(step), metrics={"val": float(step)})
    stale = path / "checkpoints" / f".step-0000000004{names.TMP_TAG}far-9-{uuid.uuid4().hex[:8]}"
    stale.mkdir()
    (stale / "data-00000.safetensors").write_bytes(b"x" * 2048)
    aged(str(stale), 7200)
    return path, stale


def test_cli_gc_prints_what_it_removed(tmp_path: Path) -> None:
    path, stale = local_run(tmp_path)
    dry = invoke("gc", str(path), "--dry-run")
    assert dry.exit_code == 0, dry.output
    assert f"would remove {stale} (2.0 KiB): hidden temporary of host far" in dry.output
    assert "dry run: " in dry.output.splitlines()[-1]
    assert stale.exists()
    result = invoke("gc", str(path))
    assert result.exit_code == 0, result.output
    assert f"removed {stale} (2.0 KiB)" in result.output
    assert result.output.splitlines()[-1] == (
        f"{path}: removed 1 item(s), 2.0 KiB; 0 open upload(s) aborted; 0 kept"
    )
    assert not stale.exists()
    check_run_intact(local.STORE.at(str(path)))


def test_cli_gc_json_and_grace(tmp_path: Path) -> None:
    path, stale = local_run(tmp_path)
    kept = invoke("gc", str(path), "--grace", "8000", "--json")
    assert kept.exit_code == 0, kept.output
    doc = json.loads(kept.output)
    assert doc["removed"] == [] and [s["path"] for s in doc["skipped"]] == [str(stale)]
    result = invoke("gc", str(path), "--grace", "60", "--json")
    doc = json.loads(result.output)
    assert result.exit_code == 0
    assert [r["path"] for r in doc["removed"]] == [str(stale)]
    assert doc["bytes_freed"] == 2048 and doc["dry_run"] is False and doc["grace"] == 60


def test_cli_gc_on_s3_url(s3: Any, s3_bucket: str, s3_run: Location) -> None:
    store = s3_run.store
    leftover = plant(store, store.join(step_dir(s3_run, 3), gen_name(7200)), "data.bin")
    result = invoke("gc", f"s3://{s3_bucket}/run", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert [r["path"] for r in doc["removed"]] == [store.url(leftover)]
    assert doc["uploads_checked"] is True


def test_cli_gc_errors_exit_1(tmp_path: Path) -> None:
    result = invoke("gc", str(tmp_path / "absent"))
    assert result.exit_code == 1
    assert result.output.startswith("error: ") and "nothing to collect" in result.output
    assert invoke("gc", str(tmp_path), "--grace", "-1").exit_code == 2  # a usage error


def test_cli_gc_exit_1_when_a_leftover_cannot_be_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, stale = local_run(tmp_path)

    def refuse(self: Any, target: str) -> None:
        raise PermissionError(13, "Permission denied", target)

    monkeypatch.setattr(type(local.STORE), "remove_tree", refuse)
    result = invoke("gc", str(path))
    assert result.exit_code == 1
    assert f"failed {stale}: hidden temporary" in result.output
    assert "removing it failed: Permission denied" in result.output
    assert "error: 1 item(s) could not be removed" in result.output
    assert stale.exists()
