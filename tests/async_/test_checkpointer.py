"""Background saves: AsyncCheckpointer, PendingSave, and CheckpointManager(async_save=True).

What is committed is the state at the moment ``save()`` returned; one save is in flight at a time
(``on_busy``); a background failure is raised exactly once, by the next save(), wait() or close(),
and by its own PendingSave.wait().
"""

from __future__ import annotations

import copy
import dataclasses
import errno
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import savepoint as sp
import savepoint.checkpoint
import savepoint.engine.save
from _compare import same
from _concurrency import CountingStore
from _support import stable_id
from savepoint.async_.checkpointer import AsyncCheckpointer
from savepoint.async_.pending import PendingSave
from savepoint.options import DEFAULT_MAX_FILE_BYTES, SaveOptions

# -- helpers ----------------------------------------------------------------------------------------


class Gate:
    """Replaces ``savepoint.engine.save.save_staged``: background writes wait until ``open()``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.real = savepoint.engine.save.save_staged
        self.opened = threading.Event()
        self.entered = threading.Event()
        self.calls: list[str] = []
        monkeypatch.setattr(savepoint.engine.save, "save_staged", self)

    def __call__(self, location: Any, staged: Any, meta: Any, **kwargs: Any) -> Any:
        self.calls.append(location.path)
        self.entered.set()
        assert self.opened.wait(20), "the test never opened the gate"
        return self.real(location, staged, meta, **kwargs)

    def open(self) -> None:
        self.opened.set()


class FailOnce:
    """Replaces ``savepoint.engine.save.save_staged``: the first call raises ``exc``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, exc: BaseException) -> None:
        self.real = savepoint.engine.save.save_staged
        self.exc = exc
        self.calls = 0
        monkeypatch.setattr(savepoint.engine.save, "save_staged", self)

    def __call__(self, location: Any, staged: Any, meta: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls == 1:
            raise self.exc
        return self.real(location, staged, meta, **kwargs)


FAILURES = [
    pytest.param(lambda: OSError(errno.EIO, "input/output error", "data-00000"), id="OSError"),
    pytest.param(
        lambda: sp.CheckpointWriteError("disk full", path="x", errno=errno.ENOSPC), id="write"
    ),
    pytest.param(lambda: sp.CorruptCheckpointError("bad bytes", path="x"), id="corrupt"),
]


def check_reported(raised: BaseException, original: BaseException) -> None:
    """What wait()/save()/close() and PendingSave.wait() raise for a background failure: a
    CheckpointError, the original one if it was already one, else one caused by it; an OSError
    becomes a CheckpointWriteError with its errno (never the base class: a full disk must be
    catchable as a write error)."""
    assert isinstance(raised, sp.CheckpointError)
    if isinstance(original, sp.CheckpointError):
        assert raised is original
    else:
        assert raised.__cause__ is original
    if isinstance(original, OSError):
        assert isinstance(raised, sp.CheckpointWriteError), repr(raised)
        assert raised.errno == original.errno


class Holder:
    """A Stateful whose state_dict hands out its live arrays."""

    def __init__(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.weights = rng.standard_normal((40, 30)).astype(np.float32)
        self.counts = np.arange(12, dtype=np.int64)
        self.steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {"weights": self.weights, "counts": self.counts, "steps": self.steps}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.weights, self.counts, self.steps = d["weights"], d["counts"], d["steps"]


def make_state(seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    big = rng.standard_normal((64, 64)).astype(np.float32)
    return {
        "w": rng.standard_normal((128, 96)).astype(np.float32),
        "ids": rng.integers(0, 1 << 40, size=300, dtype=np.int64),
        "mask": rng.integers(0, 2, size=50).astype(bool),
        "half": rng.standard_normal(77).astype(np.float16),
        "strided": big[:, ::3],  # a non-contiguous view
        "transposed": big.T,
        "zero_d": np.array(seed, dtype=np.float64),
        "scalar": np.float32(seed),
        "holder": Holder(seed),
        "nested": {"list": [1, 2.5, "x", [seed]], "b": np.ones((3, 3), np.int16)},
        "step": seed,
    }


def expected(state: dict[str, Any]) -> dict[str, Any]:
    """What loading the checkpoint of ``state`` gives back, copied now."""
    return {
        k: copy.deepcopy(v.state_dict() if isinstance(v, Holder) else v) for k, v in state.items()
    }


def mutate(state: dict[str, Any]) -> None:
    """Change every array in place, and every mutable container, the way training would."""
    state["w"] += 1.0
    state["ids"][:] = -1
    state["mask"] ^= True
    state["half"] *= 2
    state["strided"] += 3.0  # writes through to the base array
    state["transposed"][0, :] = 99.0
    state["zero_d"][...] = -1.0
    state["holder"].weights -= 5.0
    state["holder"].counts[::2] = 7
    state["holder"].steps += 1
    state["nested"]["list"][3].append(1)
    state["nested"]["list"][0] = "changed"
    state["nested"]["b"][1, 1] = 42
    state["nested"]["new"] = 1
    state["step"] = -1


# -- AsyncCheckpointer --------------------------------------------------------------------------------


def test_save_returns_pending_and_commits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = Gate(monkeypatch)
    with AsyncCheckpointer(writer="thread") as ck:
        state = make_state(1)
        want = expected(state)
        pending = ck.save(tmp_path / "a", state, metadata={"note": "hi"})
        assert isinstance(pending, PendingSave)
        assert pending.path == str(tmp_path / "a") and not pending.skipped
        assert gate.entered.wait(10)
        assert not pending.done() and "pending" in repr(pending)
        assert not (tmp_path / "a").exists()
        gate.open()
        info = pending.wait(timeout=20)
        assert isinstance(info, sp.CheckpointInfo) and info.metadata == {"note": "hi"}
        assert pending.done() and pending.exception() is None and "done" in repr(pending)
    same(sp.load(tmp_path / "a"), want)
    sp.verify(tmp_path / "a")


def test_mutation_after_save_returns_is_not_saved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = Gate(monkeypatch)
    ck = AsyncCheckpointer(writer="thread")
    state = make_state(2)
    want = expected(state)
    pending = ck.save(tmp_path / "a", state)
    mutate(state)  # the background write has not even started
    assert not pending.done()
    gate.open()
    ck.close()
    same(sp.load(tmp_path / "a"), want)
    assert not np.array_equal(state["w"], want["w"])


def test_many_saves_with_in_place_mutation(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    state = {
        "w": rng.standard_normal((512, 512)).astype(np.float32),  # 1 MiB: writes take a while
        "v": rng.standard_normal((256, 256)).astype(np.float64),
        "t": rng.standard_normal((300, 200)).astype(np.float32).T,
        "step": 0,
    }
    copies = {}
    with AsyncCheckpointer(writer="thread") as ck:
        for i in range(16):
            state["step"] = i
            ck.save(tmp_path / f"s{i}", state)
            copies[i] = copy.deepcopy(state)
            state["w"] += 1.0
            state["v"] *= -1.0
            state["t"][:, 0] = i
    for i, want in copies.items():
        same(sp.load(tmp_path / f"s{i}"), want)


@pytest.mark.torch
def test_torch_state_is_snapshotted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)

    def train_step() -> None:
        opt.zero_grad()
        model(torch.randn(5, 8)).pow(2).sum().backward()
        opt.step()

    train_step()
    gate = Gate(monkeypatch)
    with AsyncCheckpointer(writer="thread") as ck:
        want_model = {k: v.clone() for k, v in model.state_dict().items()}
        want_opt = copy.deepcopy(opt.state_dict())
        pending = ck.save(tmp_path / "a", {"model": model, "opt": opt})
        for _ in range(3):
            train_step()  # in-place updates of parameters and optimizer state
        with torch.no_grad():
            for p in model.parameters():
                p.add_(100.0)
        gate.open()
        pending.wait()
    loaded = sp.load(tmp_path / "a")
    assert loaded["model"].keys() == want_model.keys()
    for k, v in want_model.items():
        assert torch.equal(loaded["model"][k], v)
    for i, st in want_opt["state"].items():
        for k, v in st.items():
            assert torch.equal(loaded["opt"]["state"][i][k], v)


def test_on_busy_wait_blocks_until_the_previous_save_commits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = Gate(monkeypatch)
    ck = AsyncCheckpointer(writer="thread")  # on_busy="wait" is the default
    assert ck.on_busy == "wait"
    first = ck.save(tmp_path / "a", make_state(1))
    assert gate.entered.wait(10)
    result: dict[str, Any] = {}

    def second() -> None:
        result["pending"] = ck.save(tmp_path / "b", make_state(2))
        result["first_done"] = first.done()

    t = threading.Thread(target=second)
    t.start()
    time.sleep(0.3)
    assert t.is_alive(), "save() did not wait for the save in flight"
    assert gate.calls == [str(tmp_path / "a")]
    gate.open()
    t.join(20)
    assert not t.is_alive()
    assert result["first_done"] is True
    result["pending"].wait()
    ck.close()
    assert gate.calls == [str(tmp_path / "a"), str(tmp_path / "b")]
    same(sp.load(tmp_path / "b"), expected(make_state(2)))


def test_on_busy_skip_warns_and_skips(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = Gate(monkeypatch)
    ck = AsyncCheckpointer(writer="thread", on_busy="skip")
    first = ck.save(tmp_path / "a", make_state(1))
    with pytest.warns(UserWarning, match="still writing"):
        skipped = ck.save(tmp_path / "b", make_state(2))
    assert skipped.skipped and skipped.done() and skipped.path is None
    assert skipped.wait() is None and "skipped" in repr(skipped)
    gate.open()
    first.wait()
    ck.wait()
    assert not (tmp_path / "b").exists()
    # Nothing in flight: no warning now.
    ck.save(tmp_path / "c", make_state(3)).wait()
    ck.close()
    assert gate.calls == [str(tmp_path / "a"), str(tmp_path / "c")]


@pytest.mark.parametrize("make_error", FAILURES)
def test_failure_raised_by_pending_wait_and_next_wait_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, make_error: Any
) -> None:
    error = make_error()
    FailOnce(monkeypatch, error)
    ck = AsyncCheckpointer(writer="thread")
    pending = ck.save(tmp_path / "a", make_state(1))
    with pytest.raises(sp.CheckpointError) as info:
        pending.wait(20)
    check_reported(info.value, error)
    assert pending.exception() is info.value and pending.done()
    with pytest.raises(sp.CheckpointError) as info2:
        ck.wait()
    assert info2.value is info.value  # the handle and the checkpointer report one error
    ck.wait()  # reported once
    with pytest.raises(sp.CheckpointError):
        pending.wait()  # the handle keeps its error
    ck.save(tmp_path / "b", make_state(2)).wait()
    ck.close()
    assert not (tmp_path / "a").exists()
    same(sp.load(tmp_path / "b"), expected(make_state(2)))
    assert [e for e in os.listdir(tmp_path) if e.startswith(".")] == []


@pytest.mark.parametrize("make_error", FAILURES)
def test_failure_raised_by_next_save_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, make_error: Any
) -> None:
    error = make_error()
    FailOnce(monkeypatch, error)
    ck = AsyncCheckpointer(writer="thread")
    ck.save(tmp_path / "a", make_state(1))  # fails in the background
    with pytest.raises(sp.CheckpointError) as info:
        ck.save(tmp_path / "b", make_state(2))  # waits for it, then reports it
    check_reported(info.value, error)
    ck.wait()
    ck.save(tmp_path / "c", make_state(3)).wait()
    ck.close()
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    same(sp.load(tmp_path / "c"), expected(make_state(3)))


@pytest.mark.parametrize("make_error", FAILURES)
def test_failure_raised_by_close_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, make_error: Any
) -> None:
    error = make_error()
    FailOnce(monkeypatch, error)
    ck = AsyncCheckpointer(writer="thread")
    ck.save(tmp_path / "a", make_state(1))
    with pytest.raises(sp.CheckpointError) as info:
        ck.close()
    check_reported(info.value, error)
    ck.close()  # idempotent, and the error is not raised again
    ck.wait()
    with pytest.raises(RuntimeError):
        ck.save(tmp_path / "b", make_state(2))


def test_on_commit_runs_after_commit_and_its_failure_is_reported(tmp_path: Path) -> None:
    seen: list[tuple[str, bool]] = []

    def on_commit(info: sp.CheckpointInfo) -> None:
        seen.append((info.path, os.path.isfile(os.path.join(info.path, "manifest.json"))))

    with AsyncCheckpointer(writer="thread") as ck:
        ck.save(tmp_path / "a", make_state(1), on_commit=on_commit).wait()
        assert seen == [(str(tmp_path / "a"), True)]

        def boom(info: sp.CheckpointInfo) -> None:
            raise ValueError("callback failed")

        pending = ck.save(tmp_path / "b", make_state(2), on_commit=boom)
        with pytest.raises(sp.CheckpointError) as info:
            pending.wait()
        assert isinstance(info.value.__cause__, ValueError)
        with pytest.raises(sp.CheckpointError) as info2:
            ck.wait()
        assert info2.value is info.value
        ck.wait()


def test_errors_in_the_caller_are_raised_at_once(tmp_path: Path) -> None:
    with AsyncCheckpointer(writer="thread") as ck:
        with pytest.raises(sp.UnsupportedStateError):
            ck.save(tmp_path / "a", {"x": object()})
        with pytest.raises(sp.UnsupportedStateError):
            ck.save(tmp_path / "a", {"x": np.zeros(2)}, metadata={"v": float("nan")})
        ck.wait()  # nothing was queued
    assert not (tmp_path / "a").exists()


def test_close_waits_and_is_idempotent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = Gate(monkeypatch)
    ck = AsyncCheckpointer(writer="thread")
    pending = ck.save(tmp_path / "a", make_state(1))
    t = threading.Thread(target=ck.close)
    t.start()
    time.sleep(0.2)
    assert t.is_alive() and not pending.done()
    gate.open()
    t.join(20)
    assert pending.done() and (tmp_path / "a" / "manifest.json").is_file()
    ck.close()
    ck.close()
    with pytest.raises(RuntimeError):
        ck.save(tmp_path / "b", make_state(2))
    with AsyncCheckpointer(writer="thread") as ck2:
        ck2.save(tmp_path / "c", make_state(3))
    assert (tmp_path / "c" / "manifest.json").is_file()
    with pytest.raises(RuntimeError):
        ck2.save(tmp_path / "d", make_state(3))


def test_save_options_are_passed_to_the_writer(tmp_path: Path) -> None:
    with AsyncCheckpointer(writer="thread", max_file_bytes=20_000) as ck:
        info = ck.save(tmp_path / "a", make_state(1)).wait()
    assert len(info.files) > 1
    same(sp.load(tmp_path / "a"), expected(make_state(1)))


@pytest.mark.parametrize("writers", [1, 3])
def test_writers_write_file_images_at_once(writers: int) -> None:
    store = CountingStore()
    state = {f"w{i}": np.full(1000, i, np.float32) for i in range(6)}
    with AsyncCheckpointer(writer="thread", max_file_bytes=4000, writers=writers) as ck:
        info = ck.save(store.at("/run/ckpt"), state).wait()
    assert len(info.files) == 6
    assert store.most == writers
    same(sp.load(store.at("/run/ckpt")), state)


def test_progress_counts_tensor_bytes_from_the_background() -> None:
    store = CountingStore()
    seen: list[tuple[int, int]] = []
    state = {f"w{i}": np.full(1000, i, np.float32) for i in range(5)}
    with AsyncCheckpointer(
        writer="thread", max_file_bytes=8000, progress=lambda d, t: seen.append((d, t))
    ) as ck:
        ck.save(store.at("/run/ckpt"), state).wait()
    assert seen[-1] == (20_000, 20_000)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)


def _report(done: int, total: int) -> None:
    pass


# (options, keyword arguments given as well): the keywords win, even when they are the defaults.
MERGES: list[tuple[SaveOptions | None, dict[str, Any]]] = [
    (SaveOptions(writers=3), {"writers": 1}),
    (SaveOptions(writers=3), {"writers": 2}),
    (SaveOptions(direct=False), {"direct": True}),
    (SaveOptions(max_file_bytes=4096), {"max_file_bytes": DEFAULT_MAX_FILE_BYTES}),
    (SaveOptions(timeout=5.0), {"timeout": None}),
    (SaveOptions(progress=_report), {"progress": None}),
    (SaveOptions(writers=3, direct=False), {}),
    (None, {"writers": 1, "direct": True}),
]


@pytest.mark.parametrize(("options", "keywords"), MERGES, ids=stable_id)
def test_keywords_override_options_as_in_the_manager(
    tmp_path: Path, options: SaveOptions | None, keywords: dict[str, Any]
) -> None:
    """Before, a keyword equal to its default was dropped: ``AsyncCheckpointer(options=
    SaveOptions(writers=3), writers=1).writers`` was 3 where the manager gives 1."""
    wanted = dataclasses.replace(options or SaveOptions(), **keywords)
    with AsyncCheckpointer(writer="thread", options=options, **keywords) as ck:
        assert ck.options == wanted
        assert (ck.writers, ck.direct, ck.max_file_bytes, ck.timeout, ck.progress) == (
            wanted.writers,
            wanted.direct,
            wanted.max_file_bytes,
            wanted.timeout,
            wanted.progress,
        )
    with sp.CheckpointManager(tmp_path / "run", options=options, **keywords) as m:
        assert m.save_options == wanted
    with sp.CheckpointManager(tmp_path / "run", async_save=True, options=options, **keywords) as m:
        assert m.save_options == wanted
        assert m._saver.checkpointer is not None
        # The manager's writer reports progress through its own callback (it calls the user's,
        # and lets save_on_preemption abandon a save in flight); every other option is passed on.
        assert (
            dataclasses.replace(m._saver.checkpointer.options, progress=wanted.progress) == wanted
        )
        assert m._saver.checkpointer.options.progress == m._saver.abandon.progress


@pytest.mark.parametrize("options", [{"writers": 0}, {"max_file_bytes": 0}])
def test_invalid_save_options(options: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        AsyncCheckpointer(writer="thread", **options)  # type: ignore[arg-type]


def test_invalid_on_busy() -> None:
    with pytest.raises(ValueError):
        AsyncCheckpointer(writer="thread", on_busy="queue")  # type: ignore[arg-type]


def test_pending_save_handle() -> None:
    done = PendingSave.finished("p", 3, "result")
    assert done.done() and done.wait() == "result" and done.exception() is None
    assert (done.path, done.step, done.skipped) == ("p", 3, False)
    skipped = PendingSave.finished(None, 4, skipped=True)
    assert skipped.skipped and skipped.wait() is None and "skipped" in repr(skipped)
    waiting = PendingSave("q")
    assert not waiting.done()
    with pytest.raises(TimeoutError):
        waiting.wait(timeout=0.01)
    err = OSError("x")
    waiting.set_exception(err)
    assert waiting.exception() is err
    with pytest.raises(OSError):
        waiting.wait()


# -- CheckpointManager(async_save=True) ---------------------------------------------------------------


def test_async_manager_commits_what_was_passed(tmp_path: Path) -> None:
    run = tmp_path / "run"
    state = make_state(0)
    copies = {}
    with sp.CheckpointManager(run, async_save=True, writer="thread", best_metric="val") as m:
        for step in range(1, 11):
            state["step"] = step
            pending = m.save(step, state, {"val": abs(step - 6) + 0.5})
            assert isinstance(pending, PendingSave) and pending.step == step
            copies[step] = expected(state)
            mutate(state)
            state["nested"].pop("new")
        m.wait()
        assert m.steps() == list(range(1, 11))
        assert m.best_step() == 6
    for step, want in copies.items():
        same(sp.load(run / "checkpoints" / f"step-{step:010d}"), want)
    same(sp.load(run / "latest"), copies[10])
    same(sp.load(run / "best"), copies[6])
    report = json.loads((run / "report.json").read_text())
    assert report["checkpoints"] == list(range(10, 0, -1)) and report["best"]["step"] == 6


def test_async_manager_retention_and_restore_waits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "run"
    with sp.CheckpointManager(run, async_save=True, writer="thread", keep_last=2) as m:
        for step in range(1, 5):
            m.save(step, make_state(step))
        m.wait()
        assert m.steps() == [3, 4]
        gate = Gate(monkeypatch)
        pending = m.save(5, make_state(5))
        assert gate.entered.wait(10)
        assert m.steps() == [3, 4] and not pending.done()
        threading.Timer(0.2, gate.open).start()
        into = {"w": np.zeros((128, 96), np.float32), "step": -1}
        assert m.restore(into) == 5  # waits for the save in flight first
        same(into, {"w": make_state(5)["w"], "step": 5})
        assert m.steps() == [4, 5]
        m.save(6, make_state(6)).wait()
    assert sp.CheckpointManager(run).steps() == [5, 6]


@pytest.mark.parametrize("make_error", FAILURES)
def test_async_manager_background_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, make_error: Any
) -> None:
    run = tmp_path / "run"
    error = make_error()
    m = sp.CheckpointManager(run, async_save=True, writer="thread", keep_last=2)
    m.save(1, make_state(1)).wait()
    FailOnce(monkeypatch, error)
    failed = m.save(2, make_state(2))
    with pytest.raises(sp.CheckpointError) as raised:
        failed.wait()
    check_reported(raised.value, error)
    with pytest.raises(sp.CheckpointError) as info:
        m.save(3, make_state(3))
    check_reported(info.value, error)
    assert m.steps() == [1]
    m.save(4, make_state(4))
    m.wait()
    m.wait()
    assert m.steps() == [1, 4]
    m.close()
    m.close()
    with pytest.raises(RuntimeError):
        m.save(5, make_state(5))


@pytest.mark.parametrize("make_error", FAILURES)
def test_async_manager_close_reports_failure_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, make_error: Any
) -> None:
    run = tmp_path / "run"
    error = make_error()
    m = sp.CheckpointManager(run, async_save=True, writer="thread")
    m.log(1, loss=0.5)
    FailOnce(monkeypatch, error)
    m.save(1, make_state(1))
    with pytest.raises(sp.CheckpointError) as info:
        m.close()
    check_reported(info.value, error)
    m.close()
    with pytest.raises(RuntimeError):
        m.save(2, make_state(2))
    from savepoint.runs.report import load_report

    report = load_report(run)  # written at close all the same (report.json and its history log)
    assert report is not None
    assert report.loss_history == [(1, 0.5)] and report.checkpoints == []


def test_async_manager_verification_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "run"

    def failing_verify(path: Any, **kwargs: Any) -> Any:
        raise sp.CorruptCheckpointError("injected", path=path)

    with sp.CheckpointManager(run, async_save=True, writer="thread", keep_last=1) as m:
        m.save(1, make_state(1)).wait()
        monkeypatch.setattr(savepoint.checkpoint, "verify", failing_verify)
        pending = m.save(2, make_state(2))
        with pytest.raises(sp.CorruptCheckpointError):
            pending.wait()
        with pytest.raises(sp.CorruptCheckpointError):
            m.wait()
        assert m.steps() == [1, 2]  # nothing pruned
        monkeypatch.undo()
        m.save(3, make_state(3)).wait()
        assert m.steps() == [3]


def test_async_manager_save_every(tmp_path: Path) -> None:
    with sp.CheckpointManager(
        tmp_path / "run", async_save=True, writer="thread", save_every=2
    ) as m:
        pendings = [m.save(step, make_state(step)) for step in range(1, 6)]
        assert [p.skipped for p in pendings] == [True, False, True, False, True]
        assert all(p.done() for p in pendings if p.skipped)
        m.wait()
        assert m.steps() == [2, 4]


# -- threads and fork ---------------------------------------------------------------------------


def test_saves_from_several_threads_on_one_checkpointer_all_verify(tmp_path: Path) -> None:
    states = {
        t: {f"w{i}": np.full((64, 256), t * 100 + i, np.float32) for i in range(6)}
        for t in range(4)
    }
    errors: list[BaseException] = []
    pendings: list[tuple[int, int, PendingSave]] = []
    start = threading.Barrier(4)

    with AsyncCheckpointer(writer="thread") as ck:

        def worker(t: int) -> None:
            try:
                start.wait()
                for k in range(6):
                    pendings.append((t, k, ck.save(tmp_path / f"t{t}-{k}", states[t])))
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    assert not errors
    assert len(pendings) == 24
    for t, k, pending in pendings:
        pending.wait()
        path = tmp_path / f"t{t}-{k}"
        sp.verify(path)
        same(sp.load(path), states[t])


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_child_forked_during_a_save_exits_and_cannot_use_the_parents_checkpointer(
    tmp_path: Path,
) -> None:
    import subprocess
    import sys

    script = f"""
import os, sys, time
import numpy as np
from savepoint.async_.checkpointer import AsyncCheckpointer
import savepoint as sp

ck = AsyncCheckpointer(writer="thread")
state = {{"w": np.ones((1024, 1024), np.float32)}}
pending = ck.save({str(tmp_path / "a")!r}, state)
pid = os.fork()
if pid == 0:
    try:
        ck.save({str(tmp_path / "child")!r}, state)
    except RuntimeError as exc:
        assert "parent process" in str(exc), exc
        print("refused", flush=True)
    mine = AsyncCheckpointer(writer="thread")
    mine.save({str(tmp_path / "child2")!r}, state).wait()
    sys.exit(0)  # runs the exit hook: must not wait for the parent's save
_, status = os.waitpid(pid, 0)
pending.wait()
ck.close()
sp.verify({str(tmp_path / "a")!r})
sp.verify({str(tmp_path / "child2")!r})
print("child exit", os.waitstatus_to_exitcode(status), flush=True)
"""
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.split() == ["refused", "child", "exit", "0"], result.stdout


def test_each_async_save_logs_what_it_blocked_and_when_it_committed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="savepoint.async_.checkpointer")
    with AsyncCheckpointer(writer="thread") as ckpt:
        ckpt.save(tmp_path / "a", {"w": np.ones(4)}).wait()
    (record,) = [r for r in caplog.records if r.name == "savepoint.async_.checkpointer"]
    assert record.levelname == "INFO"
    assert str(tmp_path / "a") in record.getMessage() and "blocked" in record.getMessage()
