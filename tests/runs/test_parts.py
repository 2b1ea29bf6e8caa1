"""The manager's parts, alone (issue 26): the run's books on ``memory://``, and the one worker
thread that runs every background step of a manager's saves."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

import savepoint as sp
import savepoint.checkpoint
from savepoint.runs import history
from savepoint.runs.books import Books
from savepoint.runs.catalog import Catalog
from savepoint.runs.policies import AnyOf, KeepAll
from savepoint.runs.report import load_report
from savepoint.runs.settle import Worker
from savepoint.storage.paths import resolve


def test_books_alone_on_memory() -> None:
    run = resolve("memory://parts-books/run", what="run directory")
    run.store.makedirs(run.join("checkpoints").path)
    catalog = Catalog(run, best_metric="val", best_mode="min")
    books = Books(run, catalog, retention=AnyOf(KeepAll()), aliases=True)
    books.history = history.writer(run)  # (a writer's books)
    books.log(1, 0.5, {"lr": 0.1})
    books.log(2, 0.25, {})
    books.fill(books.steps_now())
    books.store_report()
    again = load_report(run)
    assert again is not None
    assert again.loss_history == [(1, 0.5), (2, 0.25)]
    assert again.metric_history == {1: {"lr": 0.1}} and again.checkpoints == []
    books.resume(1)  # a resume nothing followed: forgotten, the report as it was
    books.forget_resume()
    assert books.report.steps_completed == 2 and books.report.lineage == []
    books.history.close()


def test_every_background_step_runs_on_one_worker_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Starting a thread costs a small save a noticeable share of its time: the manager starts
    one, at its first save, and ends it at close()."""
    seen: list[threading.Thread] = []
    real = savepoint.checkpoint.verify

    def verify(path: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(threading.current_thread())
        return real(path, *args, **kwargs)

    monkeypatch.setattr(savepoint.checkpoint, "verify", verify)
    m = sp.CheckpointManager("memory://parts-worker/run", keep_last=1)
    for step in range(1, 5):  # from the second save on, each verifies before it prunes
        m.save(step, {"w": np.full(4, step, np.float32)})
    m.wait()
    assert len(seen) == 3 and len(set(map(id, seen))) == 1, seen
    assert seen[0] is not threading.current_thread()
    m.close()
    seen[0].join(10)
    assert not seen[0].is_alive()  # close() ends it
    assert m.steps() == [4]


def test_a_worker_runs_jobs_in_order_and_restarts_after_stop() -> None:
    worker = Worker("savepoint-test")
    done: list[int] = []
    for i in range(3):
        worker.submit(lambda i=i: done.append(i))
        worker.join()
    assert done == [0, 1, 2] and not worker.busy()
    worker.stop()
    worker.submit(lambda: done.append(3))
    worker.join()
    worker.stop()
    assert done == [0, 1, 2, 3]


def test_a_manager_nobody_closed_is_freed_when_dropped(tmp_path: Any) -> None:
    """Its parts hold no reference back to it: dropped after a save, it is freed at once (no
    cyclic collection needed) and its finalizer releases the run's lock."""
    import gc

    gc.disable()
    try:
        m = sp.CheckpointManager(tmp_path / "run", keep_last=1)
        m.save(1, {"w": np.zeros(4, np.float32)})
        m.save(2, {"w": np.ones(4, np.float32)})
        m.wait()
        del m
        again = sp.CheckpointManager(tmp_path / "run")  # no RunLockedError
        assert again.steps() == [2]
        again.close()
    finally:
        gc.enable()
