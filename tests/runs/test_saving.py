"""The manager's save route alone (issue 26): a :class:`~savepoint.runs.saving.Saver` over the
books of a ``memory://`` run, no manager: the save policy's last save after a failed save, the
checkpoint a failed save replaced put back, one async save in flight and its abandonment."""

from __future__ import annotations

import itertools
import threading
from typing import Any

import numpy as np
import pytest

import savepoint as sp
import savepoint.checkpoint
from savepoint.options import SaveOptions
from savepoint.runs import history, layout
from savepoint.runs.books import Books
from savepoint.runs.catalog import Catalog
from savepoint.runs.policies import AnyOf, KeepAll, SavePolicy
from savepoint.runs.saving import Saver, abandoned
from savepoint.runs.settle import Settle
from savepoint.storage.paths import Location, resolve

_RUNS = itertools.count()


class _Host:
    """A manager as a Saver sees it: open, and a run whose num_params is ``num_params``."""

    def __init__(self, num_params: int | None = 1) -> None:
        self.params, self.adopted, self.closed = num_params, 0, False

    def check_open(self) -> None:
        if self.closed:
            raise RuntimeError("closed")

    def num_params(self) -> int | None:
        return self.params

    def adopt_num_params(self) -> None:
        self.adopted += 1

    def keep(self) -> object:
        return self


class _Gap:
    """Save when at least 10 steps have passed since the last save."""

    def should_save(self, step: int, last_saved: int | None) -> bool:
        return last_saved is None or step - last_saved >= 10


def _saver(
    policy: SavePolicy | None = None,
    *,
    async_save: bool = False,
    host: _Host | None = None,
    **options: Any,
) -> tuple[Saver, Location]:
    run = resolve(f"memory://saving-{next(_RUNS)}/run", what="run directory")
    run.store.makedirs(run.join(layout.CHECKPOINTS).path)
    books = Books(
        run,
        Catalog(run, best_metric=None, best_mode="min"),
        retention=AnyOf(KeepAll()),
        aliases=True,
    )
    books.history = history.writer(run)  # (a writer's books)
    settle = Settle(
        books,
        threading.RLock(),
        retention=books.retention,
        verify_before_prune=True,
        collect=lambda: None,
        scrub=lambda step: None,
    )
    saver = Saver(
        books,
        settle,
        SaveOptions.of(options),
        save_policy=policy or _Gap(),
        leader=True,
        async_save=async_save,
        blobs=None,
        host=host or _Host(),
    )
    saver.opened(False, None, None)
    return saver, run


def _w(value: float, n: int = 1) -> dict[str, Any]:
    return {f"w{i}": np.full((128, 128), value, np.float32) for i in range(n)}


def _refused(*args: Any, **kwargs: Any) -> Any:
    raise sp.CheckpointWriteError("the disk is full")


def _full() -> Any:
    raise OSError(28, "No space left on device")


def _load(saver: Saver, step: int) -> float:
    return float(sp.load(saver.path(step))["w0"][0, 0])


def test_a_failed_write_or_books_do_not_count_as_the_last_save(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    saver, _ = _saver()
    saver.save(10, _w(10), None, False, None).wait()
    assert saver.last_saved == 10
    assert saver.save(15, _w(15), None, False, None).skipped  # (the policy: 10 steps apart)

    with monkeypatch.context() as patch:  # the write fails: nothing committed
        patch.setattr(savepoint.checkpoint, "save_with", _refused)
        with pytest.raises(sp.CheckpointWriteError):
            saver.save(20, _w(20), None, False, None)
    assert saver.last_saved == 10
    with monkeypatch.context() as patch:  # committed, then the books fail: undone
        patch.setattr(saver.books, "stage_report", _full)
        with pytest.raises(sp.CheckpointWriteError):
            saver.save(20, _w(20), None, False, None)
    assert saver.last_saved == 10 and saver.books.steps_now() == [10]
    again = saver.save(21, _w(21), None, False, None)  # not skipped: 20 was never saved
    assert not again.skipped
    again.wait()
    assert saver.last_saved == 21 and saver.books.steps_now() == [10, 21]
    assert saver.write_seconds is not None and saver.write_seconds >= 0


def test_the_checkpoint_a_failed_save_replaced_is_put_back(monkeypatch: pytest.MonkeyPatch) -> None:
    saver, run = _saver()
    saver.save(5, _w(1.0), None, True, None).wait()
    assert saver._before_commit(7, preempt=False) is None  # nothing of step 7 to keep
    with monkeypatch.context() as patch:
        patch.setattr(saver.books, "stage_report", _full)
        with pytest.raises(sp.CheckpointWriteError):
            saver.save(5, _w(2.0), None, True, None)
    assert _load(saver, 5) == 1.0  # the first checkpoint of step 5, back
    assert saver.books.steps_now() == [5] and saver.last_saved == 5
    left = run.store.list(run.join(layout.CHECKPOINTS).path)
    assert left == [layout.step_location(run, 5).path.rsplit("/", 1)[-1]]  # no backup left
    saver.save(5, _w(3.0), None, True, None).wait()  # replaced for good
    assert _load(saver, 5) == 3.0


def test_one_async_save_in_flight_and_its_abandonment() -> None:
    go = threading.Event()
    calls: list[int] = []

    def progress(done: int, total: int) -> None:
        calls.append(done)
        go.wait(30)

    saver, _ = _saver(async_save=True, max_file_bytes=64 * 1024, progress=progress)
    host = saver.host
    assert isinstance(host, _Host)
    assert saver.checkpointer is not None
    first = saver.save(10, _w(10, 4), None, False, None)
    flight = saver.last_async
    assert flight is not None and flight.step == 10 and flight.previous is None
    assert saver.last_saved == 10 and not flight.booked.is_set()
    go.set()
    first.wait()
    assert flight.committed and flight.booked.is_set() and calls  # the user's hook was called
    # The next save is abandoned at its next write (what save_on_preemption does): nothing of it
    # is committed, and the save policy counts from step 10 again.
    go.clear()
    second = saver.save(20, _w(20, 4), None, False, None)
    assert saver.last_async is not None and saver.last_async.step == 20
    saver.abandon.step = 20
    go.set()
    error = second.exception(timeout=30)
    assert abandoned(error) and not saver.last_async.committed
    saver.abandon.step = None
    taken = saver.take_background_error()
    assert abandoned(taken)
    assert saver.last_saved == 10 and saver.last_async is None
    assert saver.books.steps_now() == [10]
    saver.save(20, _w(20, 4), None, False, None).wait()  # saved this time
    assert saver.books.steps_now() == [10, 20]
    saver.close()
    assert not abandoned(None) and not abandoned(sp.CheckpointError("other"))


def test_a_run_without_num_params_takes_its_first_state_s() -> None:
    host = _Host(num_params=None)
    saver, _ = _saver(host=host)
    saver.save(1, _w(1.0, 2), {"loss": 0.5}, False, None).wait()
    assert host.adopted == 1 and saver.books.report.num_params == 2 * 128 * 128
    host.closed = True
    with pytest.raises(RuntimeError):
        saver.save(11, _w(1.0), None, False, None)
    host.closed = False
    saver.opened(True, "opened with read_only=True", None)
    with pytest.raises(sp.CheckpointWriteError, match=r"read-only.*read_only=True"):
        saver.save(11, _w(1.0), None, False, None)
    with pytest.raises(ValueError, match="non-negative int"):
        saver.save(-1, _w(1.0), None, False, None)
    with pytest.raises(sp.CheckpointArgumentError, match=r"int, not '5'"):  # a TypeError too
        saver.save("5", _w(1.0), None, False, None)  # type: ignore[arg-type]


def test_the_unranked_warning_points_at_the_caller(tmp_path: Any) -> None:
    """Once per manager, at the line that called save() (or save_on_preemption())."""
    with sp.CheckpointManager(tmp_path / "run", best_metric="val") as m:
        with pytest.warns(UserWarning, match="never ranked as the best") as caught:
            m.save(1, _w(1.0), {"loss": 0.5})
        assert [w.filename for w in caught] == [__file__]
    with sp.CheckpointManager(tmp_path / "run2", best_metric="val") as m:
        with pytest.warns(UserWarning, match="never ranked as the best") as caught:
            m.save_on_preemption(1, _w(1.0), {"loss": 0.5})
        assert [w.filename for w in caught] == [__file__]
