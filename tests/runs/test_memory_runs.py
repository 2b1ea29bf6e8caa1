"""Run directories off the local disk: a CheckpointManager, its view and a sweep on the in-memory
store, both as a filesystem (``memory://``: renames, hard links) and as an object store
(``MemoryStore(atomic_rename=False)``: no rename, no links, every commit manifest-last).

The same behaviours as on a local disk: retention, the best checkpoint, the report, restore falling
back past a damaged checkpoint, the writer lock, read-only managers and ``sp.open_run``.
"""

from __future__ import annotations

import contextlib
import json
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import savepoint as sp
from _compare import same
from savepoint.codecs import manifest as mf
from savepoint.commit import pointer
from savepoint.commit.transaction import resolve as resolve_commit
from savepoint.runs import layout
from savepoint.runs.lock import LOCK_FILE
from savepoint.storage import memory
from savepoint.storage.faults import FaultyStore, SimulatedCrash
from savepoint.storage.memory import MemoryStore
from savepoint.storage.paths import Location, resolve

from ._util import blank, full_report, state

STORES = ["memory-url", "object-store"]


@pytest.fixture(params=STORES)
def run(request: pytest.FixtureRequest) -> Iterator[Location]:
    """A fresh run directory: on the shared ``memory://`` store, or on a store of its own that
    behaves as an object store."""
    name = f"/runs/{uuid.uuid4().hex}"
    if request.param == "memory-url":
        yield resolve(f"memory:/{name}")
    else:
        yield MemoryStore(atomic_rename=False).at(name)


def arg(run: Location) -> str | Location:
    """How a user names the run: the URL of the shared store, the Location of one made by hand."""
    return str(run) if run.store is memory.shared() else run


def report_of(run: Location) -> dict[str, Any]:
    return json.loads(run.store.read_small(run.join("report.json").path, cap=None))


def damage(run: Location, step: int) -> None:
    """Flip one data byte of checkpoint ``step`` (in whichever commit layout it has)."""
    store = run.store
    where = resolve_commit(store, layout.step_location(run, step).path)
    assert where is not None
    manifest = json.loads(store.read_small(store.join(where, mf.NAME), cap=None))
    record = manifest["tensors"]["w"]
    path = store.join(where, record["file"])
    data = bytearray(store.read_small(path, cap=None))
    data[record["offsets"][0]] ^= 0xFF
    store.remove(path)
    store.put(path, bytes(data))


def test_retention_best_and_report(run: Location) -> None:
    vals = {1: 0.5, 2: 0.1, 3: 0.4, 4: 0.3, 5: 0.35}
    with sp.CheckpointManager(arg(run), keep_last=2, keep_best=1, best_metric="val") as m:
        assert m.directory == str(run)
        for step, val in vals.items():
            m.log(step, loss=1.0 / step)
            m.save(step, state(step), {"val": val})
        assert m.steps() == [2, 4, 5]
        assert m.best_step() == 2 and m.latest_step() == 5
        assert m.metrics(2) == {"val": 0.1}
    assert layout.committed_steps(run) == [2, 4, 5]
    report = report_of(run)
    assert report["checkpoints"] == [5, 4, 2] and report["latest_step"] == 5
    assert report["best"]["step"] == 2 and report["discarding"] == []
    assert [s for s, _ in full_report(run)["loss_history"]] == [1, 2, 3, 4, 5]
    same(sp.load(run.join("latest")), state(5))
    same(sp.load(run.join("best")), state(2))
    same(sp.load(layout.checkpoint_arg(layout.step_location(run, 4))), state(4))


def test_restore_falls_back_past_a_damaged_checkpoint(run: Location) -> None:
    with sp.CheckpointManager(arg(run)) as m:
        for step in (1, 2, 3):
            m.save(step, state(step))
    damage(run, 3)
    with sp.CheckpointManager(arg(run)) as m:
        into = blank()
        with pytest.warns(UserWarning, match="failed verification"):
            assert m.restore(into) == 2
        same(into, state(2))
        with pytest.raises(sp.CorruptCheckpointError):
            m.restore(blank(), 3)
        m.save(3, state(30))  # the resumed run replaces the damaged checkpoint
        assert m.steps() == [1, 2, 3]
    same(sp.load(run.join("latest")), state(30))
    assert report_of(run)["lineage"][0]["resumed_from"] == 2


def test_resave_of_a_step_and_peek(run: Location) -> None:
    with sp.CheckpointManager(arg(run), best_metric="val") as m:
        m.save(1, state(1), {"val": 1.0})
        m.save(2, state(2), {"val": 2.0})
        assert m.restore(blank(), 1) == 1
        m.save(1, state(10), {"val": 0.5})  # after a resume: step 2 leaves the run
        assert m.steps() == [1]
        assert m.peek("step") == {"step": 10}
    assert layout.committed_steps(run) == [1]
    same(sp.load(run.join("best")), state(10))


def test_one_writer_and_read_only_managers(run: Location) -> None:
    writer = sp.CheckpointManager(arg(run), keep_last=1)
    writer.save(1, state(1))
    with pytest.raises(sp.RunLockedError):
        sp.CheckpointManager(arg(run))
    reader = sp.CheckpointManager(arg(run), read_only=True)
    assert reader.read_only and reader.steps() == [1]
    with pytest.raises(sp.CheckpointWriteError):
        reader.save(2, state(2))
    writer.save(2, state(2))
    into = blank()
    assert reader.restore(into) == 2  # sees the writer's new checkpoint
    same(into, state(2))
    reader.close()
    writer.close()
    with sp.CheckpointManager(arg(run)) as again:  # closing released the lock
        assert again.steps() == [2]


def test_open_run_view(run: Location) -> None:
    with sp.CheckpointManager(arg(run), best_metric="val", name="mem", variant="v") as m:
        for step, val in ((1, 0.3), (2, 0.1), (3, 0.2)):
            m.save(step, state(step), {"val": val})
    with sp.open_run(arg(run)) as view:
        assert view.directory == str(run)
        assert view.info.name == "mem" and view.info.variant == "v"
        assert view.steps() == [1, 2, 3] and view.best_step() == 2 and view.latest_step() == 3
        assert view.metrics(2) == {"val": 0.1}
        assert view.report is not None and view.report.latest_step == 3
        assert view.problems() == []
        view.check()
        same(view.load("best"), state(2))
        assert view.peek("step", 1) == {"step": 1}
        assert view.checkpoint_path(3) == layout.step_path(run, 3)
    # Nothing else: no lock description left behind, no temporaries.
    assert sorted(run.store.list(run.path)) == [
        "best",
        "checkpoints",
        "history",  # the history log's segments (runs.history)
        "latest",
        "report.json",
        "run.json",
    ]


def test_async_saves(run: Location) -> None:
    with sp.CheckpointManager(arg(run), keep_last=2, async_save=True) as m:
        for step in range(1, 5):
            pending = m.save(step, state(step))
            assert pending.step == step
        m.wait()
        assert m.steps() == [3, 4]
    same(sp.load(run.join("latest")), state(4))


def test_sweep(run: Location) -> None:
    sweep = sp.Sweep(arg(run), metric="val")
    for name, vals in (("wide", (0.5, 0.2)), ("deep", (0.4, 0.3))):
        with sweep.run(name) as m:
            for step, val in enumerate(vals, start=1):
                m.save(step, state(step), {"val": val})
    assert sweep.runs() == ["deep", "wide"]
    rows = sweep.compare()
    assert [(r["name"], r["best_step"], r["rank"]) for r in rows] == [
        ("wide", 2, 1),
        ("deep", 2, 2),
    ]
    saved = json.loads(run.store.read_small(run.join("comparison.json").path, cap=None))
    assert [r["name"] for r in saved["runs"]] == ["wide", "deep"]


def test_a_run_url_names_the_shared_store() -> None:
    url = f"memory://runs/{uuid.uuid4().hex}"
    with sp.CheckpointManager(url) as m:
        m.save(7, {"w": np.arange(4.0)})
        assert m.step_path(7) == f"{url}/checkpoints/step-0000000007"
    assert sp.open_run(url).steps() == [7]
    same(sp.load(f"{url}/latest"), {"w": np.arange(4.0)})


def _crashable(atomic_rename: bool) -> tuple[MemoryStore, FaultyStore, sp.CheckpointManager]:
    """A run with steps 1 and 2 on a fault-injecting store over a fresh memory store."""
    inner = MemoryStore(atomic_rename=atomic_rename)
    store = FaultyStore(inner)
    m = sp.CheckpointManager(store.at("/run"), keep_last=2, best_metric="val")
    m.save(1, state(1), {"val": 0.2})
    m.save(2, state(2), {"val": 0.5})
    return inner, store, m


@pytest.mark.parametrize("atomic_rename", [True, False], ids=["memory", "object-store"])
def test_a_crash_anywhere_in_a_save_leaves_a_run_the_next_open_repairs(
    atomic_rename: bool,
) -> None:
    """The process dies between any two store calls of ``save(3)`` (which commits step 3, makes
    it latest/ and best/, and prunes step 1): the next process finds the old run or the new one,
    and once a writer has opened it the report, the checkpoints and the aliases agree."""
    _, store, m = _crashable(atomic_rename)
    before = len(store.mutations())
    m.save(3, state(3), {"val": 0.1})
    m.wait()  # retention's deletion of step 1 (in the background on an object store)
    calls = len(store.mutations()) - before
    m.close()
    assert calls > 10
    for k in range(calls):
        inner, store, m = _crashable(atomic_rename)
        store.crash_after(k)
        with contextlib.suppress(SimulatedCrash):  # or the background deletion crashed
            m.save(3, state(3), {"val": 0.1})
            m.wait()
        assert store.crashed is not None, k
        assert m._opened.release is not None
        m._opened.release.detach()  # the dead process's lock goes with it (below), not through `store`
        inner.lock(f"/run/{LOCK_FILE}").release()
        with sp.CheckpointManager(inner.at("/run"), keep_last=2, best_metric="val") as again:
            assert again.steps() in ([1, 2], [1, 2, 3], [2, 3]), k
            newest = again.steps()[-1]
            into = blank()
            assert again.restore(into, resume=False) == newest, k
            same(into, state(newest))
        with sp.open_run(inner.at("/run")) as view:
            assert view.problems() == [], k
        same(sp.load(inner.at("/run/latest")), state(newest))


def test_a_crash_anywhere_in_the_first_save_leaves_latest_absent_or_new() -> None:
    """The first save of a run on an object store creates latest/ and best/ as it points them at
    step 1. A process that dies between any two store calls leaves each alias absent (no
    checkpoint: CheckpointNotFoundError) or naming step 1, for a reader that comes before any
    writer repairs the run. Before the fix the pointer's directory was made first (a marker
    object) and the pointer put after it: a death in between left an alias directory holding
    nothing, which sp.load called "no manifest.json: the save that created it did not commit"
    (tests/faults/test_kill_s3.py saw it once, killing the first save to S3)."""

    def crashable() -> tuple[MemoryStore, FaultyStore, sp.CheckpointManager]:
        inner = MemoryStore(atomic_rename=False)
        store = FaultyStore(inner)
        return inner, store, sp.CheckpointManager(store.at("/run"), best_metric="val")

    def held(inner: MemoryStore, alias: str) -> int | None:
        try:
            return int(sp.load(inner.at(f"/run/{alias}"))["step"])
        except sp.CheckpointNotFoundError:
            return None

    _, store, m = crashable()
    before = len(store.mutations())
    m.save(1, state(1), {"val": 0.2})
    m.close()
    calls = len(store.mutations()) - before
    assert calls > 5
    seen = set()
    for k in range(calls):
        inner, store, m = crashable()
        store.crash_after(k)
        with contextlib.suppress(SimulatedCrash):
            m.save(1, state(1), {"val": 0.2})
            m.close()
        assert store.crashed is not None, k
        got = (held(inner, "latest"), held(inner, "best"))
        assert got[0] in (None, 1) and got[1] in (None, 1), (k, store.crashed, got)
        seen.add(got)
        assert m._opened.release is not None
        m._opened.release.detach()
        inner.lock(f"/run/{LOCK_FILE}").release()
        with sp.CheckpointManager(inner.at("/run"), best_metric="val") as again:
            newest = again.latest_step()
        assert newest in (None, 1), k
        with sp.open_run(inner.at("/run")) as view:
            assert view.problems() == [], k
        assert held(inner, "latest") == newest, k
    assert {(None, None), (1, 1)} <= seen, seen


def test_aliases_on_an_object_store_are_pointers_not_copies() -> None:
    """Without hard links, latest/ and best/ hold one small pointer each (a copy would upload the
    whole state again at every save), they load as the step they name, follow a re-save of that
    step, and `savepoint verify RUN`'s consistency check accepts them."""
    store = MemoryStore(atomic_rename=False)
    run = store.at("/run")
    with sp.CheckpointManager(run, keep_last=2, best_metric="val") as m:
        for step, val in ((1, 0.1), (2, 0.5), (3, 0.4)):
            m.save(step, state(step), {"val": val})
        for alias, step in (("latest", 3), ("best", 1)):
            assert store.list(run.join(alias).path) == [pointer.NAME]
            doc = json.loads(store.read_small(run.join(alias, pointer.NAME).path, cap=None))
            assert doc == {"savepoint_alias": 1, "target": f"checkpoints/step-{step:010d}"}
        same(sp.load(run.join("latest")), state(3))
        same(sp.load(run.join("best")), state(1))
        assert sp.inspect(run.join("latest")).metadata["savepoint_run"]["step"] == 3
        m.save(3, state(30), {"val": 0.6})  # a re-save of the step the alias names
        same(sp.load(run.join("latest")), state(30))
    with sp.open_run(run) as view:
        assert view.problems() == []


@pytest.mark.parametrize(
    ("doc", "why"),
    [
        (
            b'{"savepoint_alias": 1, "target": "../other/run/checkpoints/step-0000000001"}',
            "has a bad target, '../other/run/checkpoints/step-0000000001': not a relative path "
            "inside the run",
        ),
        (
            b'{"savepoint_alias": 1, "target": "/run/checkpoints/step-0000000001"}',
            "has a bad target, '/run/checkpoints/step-0000000001'",
        ),
        (
            b'{"savepoint_alias": 1, "target": "checkpoints//step-0000000001"}',
            "has a bad target, 'checkpoints//step-0000000001'",
        ),
        (
            b'{"savepoint_alias": 2, "target": "checkpoints/step-0000000001"}',
            "is an alias pointer of version 2; this savepoint reads version 1",
        ),
        (b'{"savepoint_alias": 1, "target": 7}', 'has no target path ("target" is 7)'),
        (b"[1, 2]", 'is JSON but not an alias pointer (no "savepoint_alias" member)'),
        (b"not json", "is not valid JSON"),
        (b"[" * 60000, "is not valid JSON: nested deeper than 512 levels"),
        (
            b'{"savepoint_alias": 1, "target": "' + b"a/" * 40000 + b'x"}',
            "bytes, over the 65536-byte cap",
        ),
        (
            b'{"savepoint_alias": 1, "target": "checkpoints/step-0000000009"}',
            "names {run}/checkpoints/step-0000000009, which holds no committed checkpoint",
        ),
    ],
    ids=[
        "dotdot",
        "absolute",
        "empty-part",
        "version",
        "type",
        "list",
        "garbage",
        "deep",
        "huge",
        "no-target",
    ],
)
def test_a_hostile_or_damaged_pointer_is_no_checkpoint(doc: bytes, why: str) -> None:
    """A damaged pointer is never followed outside its run and never taken for a checkpoint;
    loading the alias says that the pointer is damaged and how (CorruptCheckpointError naming the
    pointer object), not that the alias "has no manifest.json" (as it did before), and a nesting
    too deep for Python's JSON parser is no RecursionError."""
    store = MemoryStore(atomic_rename=False)
    run = store.url("/run")
    sp.save(store.at("/other/run/checkpoints/step-0000000001"), state(1))
    sp.save(store.at("/run/checkpoints/step-0000000001"), state(1))
    store.makedirs("/run/latest")
    store.put(f"/run/latest/{pointer.NAME}", doc)
    assert resolve_commit(store, "/run/latest", strict=False) is None
    with pytest.raises(sp.CorruptCheckpointError):
        resolve_commit(store, "/run/latest")
    for load in (sp.load, sp.inspect, sp.verify):
        with pytest.raises(sp.CorruptCheckpointError) as info:
            load(store.at("/run/latest"))
        message = str(info.value)
        assert message.startswith(
            f"{run}/latest is a damaged alias pointer: {run}/latest/{pointer.NAME} "
        ), message
        assert why.format(run=run) in message, message
        assert "manifest.json" not in message
        assert info.value.path == f"{run}/latest"


def test_a_pointer_moved_on_while_it_was_followed_is_not_damaged(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A run's writer points an alias at the new step before it deletes the step the alias named:
    a reader that read the old pointer finds the old step gone, reads the pointer again and loads
    the new step (only a pointer that still names nothing is damaged)."""
    store = MemoryStore(atomic_rename=False)
    run = store.at("/run")
    with sp.CheckpointManager(run, keep_last=1) as m:
        m.save(1, state(1))
    stale = store.join("/run/checkpoints", "step-0000000001")
    reads = iter([stale])
    real = pointer.read

    def read(store_: Any, alias: str) -> str | None:
        return next(reads, None) or real(store_, alias)

    with sp.CheckpointManager(run, keep_last=1) as m:
        m.save(2, state(2))  # latest/ -> step 2, step 1 deleted
    monkeypatch.setattr(pointer, "read", read)
    same(sp.load(run.join("latest")), state(2))


@pytest.mark.parametrize(
    "doc",
    [
        b"not json",
        b'{"savepoint_alias": 1, "target": "checkpoints/step-0000000009"}',
        b"[" * 60000,
    ],
    ids=["garbage", "no-target", "deep"],
)
def test_a_damaged_latest_pointer_does_not_stop_restore(doc: bytes) -> None:
    """restore("latest") chooses among the checkpoints, never through latest/ (the manager's
    promise): a damaged pointer costs it nothing, read-only too (no warning: the pytest
    configuration makes warnings errors). Loading run/latest says the pointer is damaged, the
    run's consistency check lists latest/, and a manager that may write rewrites the pointer
    (before, a pointer nested too deep for Python's JSON parser made opening the run fail with
    RecursionError)."""
    store = MemoryStore(atomic_rename=False)
    run = store.at("/run")
    with sp.CheckpointManager(run, keep_last=2) as m:
        for step in (1, 2, 3):
            m.save(step, state(step))
    where = run.join("latest", pointer.NAME).path
    store.put(where, doc, exclusive=False)
    with pytest.raises(sp.CorruptCheckpointError, match="is a damaged alias pointer"):
        sp.load(run.join("latest"))
    with sp.open_run(run) as view:
        assert [p for p in view.problems() if p.startswith("latest/")], view.problems()
    with sp.CheckpointManager(run, read_only=True) as reader:
        into = blank()
        assert reader.restore(into) == 3
        same(into, state(3))
        assert reader.peek("step") == {"step": 3}
    assert store.read_small(where, cap=None) == doc  # a read-only manager writes nothing
    with sp.CheckpointManager(run, keep_last=2) as m:
        into = blank()
        assert m.restore(into) == 3
        same(into, state(3))
    same(sp.load(run.join("latest")), state(3))
    with sp.open_run(run) as view:
        assert view.problems() == []


class _ShortListing(MemoryStore):
    """An object store whose listing of a run's checkpoints/ comes back empty (a paginated
    listing cut short, an eventually consistent store) while ``short`` is set."""

    short = False

    def list(self, path: str) -> list[str]:
        if self.short and path.rstrip("/").endswith("/checkpoints"):
            return []
        return super().list(path)


def test_an_empty_listing_does_not_make_checkpoints_disappear() -> None:
    """The steps report.json lists are looked up directly when a listing lacks them: opening,
    saving, retention and restore behave as with the full listing, and nothing is dropped from
    the report or deleted."""
    store = _ShortListing(atomic_rename=False)
    run = store.at("/run")
    with sp.CheckpointManager(run, keep_last=3) as m:
        for step in (1, 2, 3):
            m.save(step, state(step))
    store.short = True
    with sp.CheckpointManager(run, keep_last=3) as m:
        assert m.steps() == [1, 2, 3]
        into = blank()
        assert m.restore(into) == 3
        same(into, state(3))
        m.save(4, state(4))
        assert m.steps() == [2, 3, 4]
    store.short = False
    assert report_of(run)["checkpoints"] == [4, 3, 2]
    assert layout.committed_steps(run) == [2, 3, 4]


class _GatedDeletes(MemoryStore):
    """An object store whose deletion of checkpoint directories waits for ``gate``."""

    def __init__(self) -> None:
        super().__init__(atomic_rename=False)
        self.gate = threading.Event()
        self.waiting = threading.Event()

    def remove_tree(self, path: str) -> None:
        if "/checkpoints/step-" in path:
            self.waiting.set()
            assert self.gate.wait(30), "the deletion was never let through"
        super().remove_tree(path)


def test_retention_deletes_in_the_background_on_an_object_store() -> None:
    """On an object store a save returns once its checkpoint and the report are written; the
    checkpoints retention drops are deleted behind it (the report names them as leaving until
    then), and wait()/close() let the deletion finish."""
    store = _GatedDeletes()
    run = store.at("/run")
    m = sp.CheckpointManager(run, keep_last=1)
    m.save(1, state(1))
    done = threading.Event()
    saver = threading.Thread(target=lambda: (m.save(2, state(2)), done.set()))
    saver.start()
    assert done.wait(30), "the save waited for retention's deletion"
    assert store.waiting.wait(30)
    with sp.open_run(run) as view:  # (m.steps() would wait for the deletion)
        assert view.steps() == [2]
    assert report_of(run)["discarding"] == [1]  # a crash now: the next open finishes it
    same(sp.load(run.join("latest")), state(2))
    store.gate.set()
    m.wait()
    assert layout.committed_steps(run) == [2]
    m.close()
    assert report_of(run)["discarding"] == [] and report_of(run)["checkpoints"] == [2]
    saver.join()
