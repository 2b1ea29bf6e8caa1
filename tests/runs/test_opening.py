"""The open of a run directory alone (issue 26: ``runs.opening``), on ``memory://``: what the
:class:`~savepoint.runs.opening.Opened` record holds, what a read-only open and a failed open leave
(nothing written, nothing held), the consistency check the read-only view turns off, and where
the config-change warning points."""

from __future__ import annotations

import json
import threading
import uuid
import warnings

import numpy as np
import pytest

import savepoint as sp
from savepoint.runs.books import Books
from savepoint.runs.catalog import Catalog
from savepoint.runs.config import ManagerConfig
from savepoint.runs.manager import reader
from savepoint.runs.opening import Opened, Opening
from savepoint.runs.settle import Settle
from savepoint.storage.paths import Location, resolve


class Owner:
    """Stands for the manager an open belongs to."""


OWNERS: list[Owner] = []  # kept for the whole session: a lock is released by hand


def fresh() -> Location:
    return resolve(f"memory://opening/{uuid.uuid4().hex}", what="run directory")


def open_alone(run: Location, *, check_consistent: bool = True, **arguments: object) -> Opened:
    """An open with no manager around it: the parts it fills in, made by hand."""
    config = ManagerConfig.of(**arguments)  # type: ignore[arg-type]
    catalog = Catalog(run, best_metric=config.best_metric, best_mode=config.best_mode)
    books = Books(run, catalog, retention=config.retention, aliases=config.aliases)
    settle = Settle(
        books,
        threading.RLock(),
        retention=config.retention,
        verify_before_prune=True,
        collect=lambda: None,
        scrub=lambda step: None,
    )
    owner = Owner()  # (the open's finalizers release its locks once the owner is gone)
    OWNERS.append(owner)
    return Opening(run, config, books, settle, check_consistent=check_consistent).open(owner)


def files(run: Location) -> list[str]:
    store = run.store
    return sorted(store.list(run.path)) if store.stat(run.path) is not None else []


def test_a_new_run_is_created_and_locked() -> None:
    run = fresh()
    opened = open_alone(run, name="exp", variant="a", config={"lr": 0.1})
    assert (opened.leader, opened.read_only, opened.read_only_reason) == (True, False, None)
    assert opened.writer is not None and opened.writes_books
    assert opened.run.name == "exp" and opened.run.run_id is not None
    assert opened.tiers is None and opened.preemption is None
    on_disk = json.loads(run.store.read_small(run.join("run.json").path, cap=None))
    assert on_disk["variant"] == "a" and on_disk["config"] == {"lr": 0.1}
    with pytest.raises(sp.RunLockedError):
        open_alone(run)
    opened.release_lock()
    open_alone(run).release_lock()  # (released: another writer may open)


def test_a_read_only_open_writes_nothing_and_takes_no_lock() -> None:
    run = fresh()
    with sp.CheckpointManager(str(run)) as m:
        m.save(1, {"w": np.ones(3, np.float32)})
    before = {p: run.store.read_small(run.join(p).path, cap=None) for p in ("run.json",)}
    listing = files(run)
    opened = open_alone(run, read_only=True)
    assert opened.read_only and opened.read_only_reason == "opened with read_only=True"
    assert opened.writer is None and opened.release is None and not opened.writes_books
    assert files(run) == listing
    assert before["run.json"] == run.store.read_small(run.join("run.json").path, cap=None)


def test_a_failed_open_writes_nothing_and_gives_back_the_lock() -> None:
    run = fresh()
    sp.CheckpointManager(str(run), variant="a").close()
    listing = files(run)
    with pytest.raises(sp.RunMismatchError, match="variant 'b'"):
        open_alone(run, variant="b")
    assert files(run) == listing
    open_alone(run, variant="a").release_lock()  # the failed open's lock is not held


def test_the_view_opens_an_inconsistent_run_that_a_manager_refuses() -> None:
    run = fresh()
    sp.CheckpointManager(str(run), variant="a").close()
    doc = json.loads(run.store.read_small(run.join("run.json").path, cap=None))
    run.store.remove(run.join("run.json").path)
    run.store.put(run.join("run.json").path, json.dumps({**doc, "variant": "b"}).encode())
    with pytest.raises(sp.RunMismatchError):
        reader(str(run))
    with pytest.raises(sp.RunMismatchError):
        open_alone(run, read_only=True)
    assert open_alone(run, read_only=True, check_consistent=False).run.variant == "b"
    view = reader(str(run), check_consistent=False)
    assert view.read_only and view.run.variant == "b"
    view.close()
    with sp.open_run(str(run)) as v:
        assert v.problems()


def test_the_config_change_warning_points_at_the_caller() -> None:
    """Warnings name the line that opened the manager (not a line of savepoint), for a writer
    that records the change and for a read-only manager that only warns."""
    run = fresh()
    sp.CheckpointManager(str(run), config={"lr": 0.1}).close()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sp.CheckpointManager(str(run), config={"lr": 0.2}).close()
        sp.CheckpointManager(str(run), config={"lr": 0.3}, read_only=True).close()
    assert [w.filename for w in caught] == [__file__, __file__], [str(w) for w in caught]
    assert "records nothing" in str(caught[1].message)


def test_a_failed_open_closes_the_async_writer() -> None:
    """The save route is built before the open (all that the arguments make, first); an open
    that fails closes its AsyncCheckpointer again."""
    from savepoint.async_ import checkpointer

    run = fresh()
    sp.CheckpointManager(str(run), variant="a").close()
    before = len(checkpointer._LIVE)
    with pytest.raises(sp.RunMismatchError) as info:
        sp.CheckpointManager(str(run), variant="b", async_save=True)
    assert info.value is not None  # (the failed constructor's frame is still alive here)
    assert len(checkpointer._LIVE) == before
