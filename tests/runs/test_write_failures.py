"""A full disk (ENOSPC) at every write a CheckpointManager does, sync and async.

The contract (manager.py's docstring): a save that fails while recording the new checkpoint (its
report.json, its aliases) has not happened: the checkpoint is removed again, report.json and
latest/ and best/ are byte for byte as before, and the error is CheckpointWriteError with errno
ENOSPC whose message says so. A deletion that fails (retention) does not fail the save. Every
error is a CheckpointError subclass: never a raw OSError, never the bare base class. Faults are
injected by running the manager on the fault-injecting store (savepoint.storage.faults) wrapped
around the local filesystem; test_full_disk_tmpfs in tests/faults sweeps a real full filesystem.
The last test sweeps one EIO over every store call (reads and looks included) of an incremental
save, on the same fault-injecting store around a memory store.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import savepoint as sp
from _compare import same
from savepoint.blobs import BlobPolicy
from savepoint.commit import names
from savepoint.runs import aliases, layout
from savepoint.storage import local
from savepoint.storage.faults import KINDS, MUTATIONS, Call, Fault, FaultyStore
from savepoint.storage.memory import MemoryStore
from savepoint.storage.paths import Location, PathArg

from ._util import blank, full_report, leftovers, read, snapshot, state

TORTURE = os.environ.get("SAVEPOINT_TORTURE") == "1"


class Full:
    """A local disk seen through a fault-injecting store whose calls of ``kinds`` on paths
    matching ``path`` (fnmatch, against the call's path or its destination) raise ENOSPC while
    armed. Open the run on :meth:`at` for the faults to apply."""

    def __init__(self, kinds: str | Iterable[str], path: str | None = None) -> None:
        self.store = FaultyStore(local.STORE)
        self._kinds = kinds
        self._path = path
        self._fault: Fault | None = None
        self._fired = 0

    def at(self, run: Path) -> Location:
        return self.store.at(str(run))

    @property
    def armed(self) -> bool:
        return self._fault is not None

    @armed.setter
    def armed(self, on: bool) -> None:
        if on and self._fault is None:
            self._fault = self.store.fail(self._kinds, path=self._path, times=None)
        elif not on and self._fault is not None:
            self._fired += self._fault.fired
            self.store.disarm()
            self._fault = None

    @property
    def hits(self) -> int:
        return self._fired + (self._fault.fired if self._fault is not None else 0)


# Where a managed save writes after its checkpoint is committed; each failure undoes the save.
UNDONE: dict[str, tuple[str | tuple[str, ...], str]] = {
    # (a save writes it under a temporary name, then renames it over report.json)
    "report.json": (("put", "create_blob"), "*/*report.json*"),
    "staging latest/": ("link", f"*/.latest{names.TMP_TAG}*"),
    "staging best/": ("link", f"*/.best{names.TMP_TAG}*"),
    "swapping latest/": (("rename", "exchange"), "*/latest"),
    "swapping best/": (("rename", "exchange"), "*/best"),
}


def _open(run: PathArg, async_save: bool) -> sp.CheckpointManager:
    return sp.CheckpointManager(run, keep_last=2, best_metric="val", async_save=async_save)


def _prepare(run: PathArg, async_save: bool) -> sp.CheckpointManager:
    """Steps 1-3 saved (1 pruned by keep_last=2); val makes step 2 the best so far."""
    m = _open(run, async_save)
    for step, val in ((1, 0.5), (2, 0.2), (3, 0.4)):
        m.save(step, state(step), {"val": val}).wait()
    assert m.steps() == [2, 3] and m.best_step() == 2
    return m


def _save_fails(m: sp.CheckpointManager, step: int, val: float) -> sp.CheckpointWriteError:
    if m._saver.checkpointer is None:
        with pytest.raises(sp.CheckpointWriteError) as info:
            m.save(step, state(step), {"val": val})
        return info.value
    pending = m.save(step, state(step), {"val": val})
    err = pending.exception(timeout=60)
    assert type(err) is sp.CheckpointWriteError, repr(err)  # not the bare base, not OSError
    with pytest.raises(sp.CheckpointWriteError) as info:
        pending.wait()
    assert info.value is err
    with pytest.raises(sp.CheckpointWriteError) as info:
        m.wait()  # the manager reports the same failure once more, then forgets it
    assert info.value is err
    m.wait()
    return err


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("site", sorted(UNDONE))
def test_enospc_after_the_commit_undoes_the_save(
    tmp_path: Path, site: str, async_save: bool
) -> None:
    run = tmp_path / "run"
    full = Full(*UNDONE[site])
    m = _prepare(full.at(run), async_save)
    before = snapshot(run)
    full.armed = True
    # val=0.1 makes step 4 the new best and latest, and keep_last prunes step 2... had it worked.
    err = _save_fails(m, 4, 0.1)
    assert full.hits >= 1
    assert err.errno == errno.ENOSPC
    assert "the run is as before" in str(err) and "step 4 is not saved" in str(err)
    assert m.steps() == [2, 3] and m.best_step() == 2 and m.latest_step() == 3
    assert layout.committed_steps(str(run)) == [2, 3]
    assert snapshot(run) == before
    assert leftovers(run) == []
    assert m.metrics(4) == {}
    # Space is back: the same save works and the run moves on as if nothing had happened.
    full.armed = False
    m.save(4, state(4), {"val": 0.1}).wait()
    assert m.steps() == [3, 4] and m.best_step() == 4
    same(sp.load(run / "latest"), state(4))
    same(sp.load(run / "best"), state(4))
    report = read(run / "report.json")
    assert report["checkpoints"] == [4, 3] and report["best"]["step"] == 4
    assert full_report(run)["metric_history"]["4"] == {"val": 0.1}
    m.close()
    with _open(run, False) as again:  # and reopens without complaint
        assert again.steps() == [3, 4]


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_enospc_when_resaving_a_step_puts_the_old_checkpoint_back(
    tmp_path: Path, async_save: bool
) -> None:
    """Saving a step that exists (resumed from it, say) replaces it; undoing that save must bring
    the old checkpoint back, not delete the step the run resumed from."""
    run = tmp_path / "run"
    full = Full(("put", "create_blob"), "*/*report.json*")
    m = _prepare(full.at(run), async_save)
    assert m.restore(blank(), 3) == 3
    before = snapshot(run)
    full.armed = True
    changed = state(3)
    changed["w"] += 1
    if async_save:
        err = m.save(3, changed, {"val": 0.3}).exception(timeout=60)
        with pytest.raises(sp.CheckpointWriteError):
            m.wait()
    else:
        with pytest.raises(sp.CheckpointWriteError) as info:
            m.save(3, changed, {"val": 0.3})
        err = info.value
    assert isinstance(err, sp.CheckpointWriteError) and err.errno == errno.ENOSPC
    assert "the run is as before" in str(err)
    assert m.steps() == [2, 3]
    same(sp.load(m.step_path(3)), state(3))  # the original, not the failed replacement
    assert snapshot(run) == before and leftovers(run) == []
    full.armed = False
    m.save(3, changed, {"val": 0.3}).wait()
    same(sp.load(m.step_path(3)), changed)
    same(sp.load(run / "latest"), changed)
    m.close()


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_enospc_while_pruning_does_not_fail_the_save(tmp_path: Path, async_save: bool) -> None:
    """Retention runs after the save is complete: a deletion that fails leaves the old checkpoint
    on disk, outside the run (not listed anywhere), and the next save deletes it."""
    run = tmp_path / "run"
    # Deleting a checkpoint starts by moving it away (transaction.discard).
    full = Full("rename", f"*/{layout.CHECKPOINTS}/{layout.step_name(3)}")
    m = _prepare(full.at(run), async_save)
    m.save(4, state(4), {"val": 0.3}).wait()
    assert m.steps() == [2, 3, 4]  # keep_last=2 keeps 3 and 4, and the best (2) is protected
    full.armed = True
    m.save(5, state(5), {"val": 0.9}).wait()  # no error: step 5 is saved; step 3 should go
    m.wait()
    assert full.hits == 1
    assert m.steps() == [2, 4, 5]
    assert layout.committed_steps(str(run)) == [2, 3, 4, 5]  # 3 is on disk, not in the run
    report = read(run / "report.json")
    assert report["checkpoints"] == [5, 4, 2] and report["discarding"] == [3]
    assert aliases.disagreements(str(run), m.report) == []
    same(sp.load(run / "latest"), state(5))
    full.armed = False
    m.save(6, state(6), {"val": 0.8}).wait()  # deletes 4 (retention) and 3 (left over)
    m.wait()
    assert layout.committed_steps(str(run)) == [2, 5, 6]
    # The report named them before they were deleted; it stops naming them at its next write.
    assert set(read(run / "report.json")["discarding"]) <= {3, 4}
    m.close()
    assert read(run / "report.json")["discarding"] == []


def test_enospc_at_close_is_a_write_error(tmp_path: Path) -> None:
    run = tmp_path / "run"
    full = Full("put", "*/report.json")
    m = _prepare(full.at(run), False)
    full.armed = True
    m.log(4, loss=0.25)
    with pytest.raises(sp.CheckpointWriteError) as info:
        m.close()
    assert info.value.errno == errno.ENOSPC
    assert "checkpoints are intact" in str(info.value)
    full.armed = False
    with _open(run, False) as again:  # the lock was released all the same
        assert again.steps() == [2, 3]


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_restore_writes_nothing(tmp_path: Path, async_save: bool) -> None:
    run = tmp_path / "run"
    full = Full(MUTATIONS)
    m = _prepare(full.at(run), async_save)
    before = snapshot(run)
    full.armed = True
    into = blank()
    assert m.restore(into) == 3
    same(into, state(3))
    assert m.restore(blank(), "best") == 2
    assert full.hits == 0 and snapshot(run) == before
    full.armed = False
    m.save(3, state(3), {"val": 0.4}).wait()  # the deferred books are written by the next save
    assert [e["resumed_from"] for e in read(run / "report.json")["lineage"]] == [3, 2]
    m.close()


def test_enospc_writing_run_json_at_open(tmp_path: Path) -> None:
    full = Full("put", "*/run.json")
    full.armed = True
    with pytest.raises(sp.CheckpointWriteError) as info:
        sp.CheckpointManager(full.at(tmp_path / "run"))
    assert info.value.errno == errno.ENOSPC and "run.json" in str(info.value)
    full.armed = False
    with sp.CheckpointManager(tmp_path / "run") as m:  # the lock was not left held
        m.save(1, state(1))


def test_enospc_creating_the_run_directory_or_its_lock(tmp_path: Path) -> None:
    for kind, run in (("lock", "run"), ("makedirs", "other")):
        full = Full(kind)
        full.armed = True
        with pytest.raises(sp.CheckpointWriteError) as info:
            sp.CheckpointManager(full.at(tmp_path / run))
        assert info.value.errno == errno.ENOSPC, kind


def test_enospc_preparing_a_resave_changes_nothing(tmp_path: Path) -> None:
    """Re-saving a step first hard-links the old checkpoint aside; if even that fails, nothing
    was written."""
    run = tmp_path / "run"
    full = Full("link", f"*/.{layout.step_name(3)}{names.TMP_TAG}*")
    m = _prepare(full.at(run), False)
    before = snapshot(run)
    full.armed = True
    with pytest.raises(sp.CheckpointWriteError) as info:
        m.save(3, state(4), {"val": 0.1})
    assert info.value.errno == errno.ENOSPC and "nothing was saved" in str(info.value)
    same(sp.load(m.step_path(3)), state(3))
    assert snapshot(run) == before and leftovers(run) == []
    m.close()


def test_cleanup_of_stale_temporaries_is_best_effort(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _prepare(run, False).close()
    stale = run / "checkpoints" / f".step-0000000009{names.TMP_TAG}{names.HOST}-999999999-ab"
    stale.mkdir()
    full = Full("remove_tree", "*/.step-0000000009.*")
    full.armed = True
    with _open(full.at(run), False) as m:  # opening does not fail because tidying did
        assert m.steps() == [2, 3]
    assert full.hits >= 1 and stale.exists()


# -- one I/O error at each store call of an incremental save ------------------------------------

_POLICY = BlobPolicy(chunk_size=4096, min_blob_bytes=1024)


def _blob_state(step: int) -> dict[str, Any]:
    """Two blob tensors (one changes at every step) and a small one in the data file."""
    rng = np.random.default_rng(step)
    return {
        "frozen": np.arange(2048, dtype=np.float32),
        "w": rng.standard_normal(1500).astype(np.float32),
        "b": np.full(4, step, np.int64),
    }


def _incremental(atomic_rename: bool) -> tuple[FaultyStore, sp.CheckpointManager]:
    """A run holding steps 1 and 2 (keep_last=2: saving 3 retires 1 and collects its blobs)."""
    store = FaultyStore(MemoryStore(atomic_rename=atomic_rename))
    m = sp.CheckpointManager(store.at("/run"), incremental=True, keep_last=2, blob_policy=_POLICY)
    for step in (1, 2):
        m.save(step, _blob_state(step))
    return store, m


def _save_step_3(m: sp.CheckpointManager) -> None:
    m.save(3, _blob_state(3))
    m.wait()  # its retention and blob collection


@pytest.mark.parametrize("atomic_rename", [True, False], ids=["memory", "object-store"])
def test_an_io_error_at_any_store_call_of_an_incremental_save(atomic_rename: bool) -> None:
    """EIO at the k-th store call of a managed incremental save (its blob session, commit,
    books, retention and collection), for every k: only CheckpointErrors escape, and the run
    then restores its newest checkpoint exactly. The blob session's calls (the stat of its own
    record, the listing of gc/, the removal of its record) are all swept by default; the others
    every third (all under SAVEPOINT_TORTURE=1). Before, those three raised a raw OSError."""
    store, m = _incremental(atomic_rename)
    store.calls.clear()
    _save_step_3(m)
    calls = list(store.calls)
    m.close()
    assert any(c.kind == "remove" and "/blobs/data/" in c.path for c in calls)  # collected

    def protocol(c: Call) -> bool:
        return "/blobs/sessions/" in c.path or "/blobs/gc" in c.path

    ks = [k for k, c in enumerate(calls) if TORTURE or protocol(c) or k % 3 == atomic_rename]
    for k in ks:
        store, m = _incremental(atomic_rename)
        store.calls.clear()
        store.fail(KINDS, nth=k + 1, code=errno.EIO)
        try:
            _save_step_3(m)
        except sp.CheckpointError:
            pass
        except BaseException as exc:
            pytest.fail(f"call {k} ({calls[k].kind} {calls[k].path}) raised {exc!r}")
        store.disarm()
        m.close()
        view = sp.open_run(store.inner.at("/run"))
        step = view.latest_step()
        assert step in (2, 3), k
        same(view.load(step), _blob_state(step))
