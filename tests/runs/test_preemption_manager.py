"""CheckpointManager(preemption=...): handlers, preempted(), save_on_preemption() in one process.

The campaign with real signals at random moments, real training and two gloo ranks is
test_preemption_campaign.py."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import savepoint as sp
from savepoint.runs import layout
from savepoint.runs.preemption import PreemptionSave

from ._util import blank, leftovers, read, state


def many(step: int, n: int = 24) -> dict[str, Any]:
    """A state of ``n`` 64 KiB tensors: with max_file_bytes=64 KiB, one file (and one progress
    call) each."""
    return {**{f"w{i}": np.full((128, 128), step, np.float32) for i in range(n)}, "step": step}


def in_writer() -> bool:
    return threading.current_thread() is not threading.main_thread()


def test_handlers_installed_at_open_and_removed_at_close(tmp_path: Path) -> None:
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGUSR1)
    with sp.CheckpointManager(tmp_path / "run", preemption=True) as mgr:
        assert signal.getsignal(signal.SIGTERM) not in before
        assert not mgr.preempted() and not mgr.preempted(local=True)
        os.kill(os.getpid(), signal.SIGUSR1)  # the default action would end this process
        assert mgr.preempted() and mgr.preempted(local=True)
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGUSR1)) == before
    # SIGINT's handler before the open: Python's default, or SIG_IGN under nohup or in a
    # background job; close() puts back whichever it was.
    int_before = signal.getsignal(signal.SIGINT)
    with sp.CheckpointManager(tmp_path / "run2", preemption=["SIGINT"]) as mgr:
        assert signal.getsignal(signal.SIGTERM) == before[0]
        assert signal.getsignal(signal.SIGINT) not in (int_before, signal.default_int_handler)
    assert signal.getsignal(signal.SIGINT) is int_before


def test_bad_preemption_arguments_touch_nothing(tmp_path: Path) -> None:
    run = tmp_path / "run"
    cases: list[tuple[dict[str, Any], type[Exception]]] = [
        ({"preemption": "SIGTERM"}, TypeError),
        ({"preemption": ["SIGNOPE"]}, ValueError),
        ({"preemption": True, "preemption_grace": 0}, ValueError),
        ({"preemption": True, "preemption_grace": float("inf")}, ValueError),
        ({"preemption": True, "preemption_grace": "25"}, TypeError),
        ({"preemption": True, "preemption_every": 0}, ValueError),
    ]
    for kwargs, error in cases:
        with pytest.raises(error):
            sp.CheckpointManager(run, **kwargs)
    assert not run.exists()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    with (
        sp.CheckpointManager(run, preemption=False) as mgr,
        pytest.raises(RuntimeError, match="preemption=True"),
    ):
        mgr.preempted()


def test_outside_the_main_thread_a_clear_error(tmp_path: Path) -> None:
    box: dict[str, BaseException] = {}

    def open_run() -> None:
        try:
            sp.CheckpointManager(tmp_path / "run", preemption=True)
        except BaseException as exc:
            box["error"] = exc

    t = threading.Thread(target=open_run)
    t.start()
    t.join()
    assert isinstance(box["error"], RuntimeError) and "main thread" in str(box["error"])
    assert not (tmp_path / "run").exists()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_without_a_signal_it_still_saves_and_defers_retention(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with sp.CheckpointManager(run, keep_last=1, preemption=True) as mgr:
        for step in (1, 2):
            mgr.save(step, state(step)).wait()
        assert mgr.steps() == [2]
        r = mgr.save_on_preemption(3, state(3), {"loss": 0.5})
        assert isinstance(r, PreemptionSave)
        assert (r.step, r.saved, r.signum, r.signal_name, r.exit_code) == (3, True, None, None, 0)
        assert r.in_flight == "none" and r.within_budget and r.since_notice is None
        assert r.budget == 25.0 and 0 <= r.seconds < r.budget and r.errors == ()
        assert r.path == mgr.step_path(3) and any("retention" in d for d in r.deferred)
        # committed, synced and listed; retention (keep_last=1) waits for the next run
        assert mgr.steps() == [2, 3] and mgr.latest_step() == 3
    assert read(run / "report.json")["checkpoints"] == [3, 2]
    sp.verify(run / "latest")
    with sp.CheckpointManager(run, keep_last=1) as mgr:
        out = blank()
        assert mgr.restore(out) == 3 and out["step"] == 3
        mgr.save(4, state(4)).wait()
        assert mgr.steps() == [3, 4]  # 3: resumed from
    assert leftovers(run) == []


def test_a_signal_gives_a_requeue_exit_code_and_a_second_one_changes_nothing(
    tmp_path: Path,
) -> None:
    run = tmp_path / "run"
    seen: list[int] = []

    def progress(done: int, total: int) -> None:
        if not seen:  # a second notice in the middle of the preemption save
            seen.append(done)
            os.kill(os.getpid(), signal.SIGTERM)

    with sp.CheckpointManager(run, preemption=True, progress=progress) as mgr:
        os.kill(os.getpid(), signal.SIGTERM)
        assert mgr.preempted()
        time.sleep(0.01)
        r = mgr.save_on_preemption(7, state(7), grace=5)
        assert seen and mgr.preemption is not None and mgr.preemption.count == 2
    assert (r.signum, r.signal_name, r.exit_code, r.budget) == (15, "SIGTERM", 143, 5.0)
    assert r.since_notice is not None and r.since_notice >= 0.01 and r.within_budget
    with sp.CheckpointManager(run, read_only=True) as mgr:
        assert mgr.steps() == [7]


def test_a_step_already_committed_is_not_saved_again(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with sp.CheckpointManager(run, async_save=True, preemption=True) as mgr:
        mgr.save(5, state(5))  # in flight, finishing well within the budget
        r = mgr.save_on_preemption(5, state(99))
        assert (r.step, r.saved, r.in_flight, r.in_flight_step) == (5, False, "finished", 5)
        again = mgr.save_on_preemption(5, state(99))
        assert not again.saved and again.in_flight == "none"
    out = blank()
    sp.load(run / "checkpoints" / layout.step_name(5), into=out)
    assert out["step"] == 5  # the save in flight's state, not overwritten


def test_a_save_in_flight_that_cannot_finish_is_abandoned_cleanly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = tmp_path / "run"

    def slow(done: int, total: int) -> None:
        if in_writer():
            time.sleep(0.1)  # 24 files: 2.4 s, more than this budget allows

    caplog.set_level(logging.INFO, logger="savepoint.runs.manager")
    with sp.CheckpointManager(
        run,
        async_save=True,
        writer="thread",
        preemption=True,
        preemption_grace=1.5,
        max_file_bytes=64 * 1024,
        progress=slow,
    ) as mgr:
        mgr.save(10, many(10))
        os.kill(os.getpid(), signal.SIGTERM)
        assert mgr.preempted()
        r = mgr.save_on_preemption(11, many(11))
        assert (r.in_flight, r.in_flight_step, r.step, r.saved) == ("abandoned", 10, 11, True)
        assert r.within_budget and r.since_notice is not None and r.since_notice < 1.5
        assert r.errors == ()  # abandoning is not a failure
        assert mgr.steps() == [11]
        mgr.wait()  # nothing left to raise
    assert layout.committed_steps(str(run)) == [11] and leftovers(run) == []
    assert read(run / "report.json")["checkpoints"] == [11]
    assert "abandoning the save of step 10" in caplog.text
    assert "preemption save: step 11 committed" in caplog.text
    with sp.CheckpointManager(run) as mgr:
        assert mgr.steps() == [11]


def test_a_save_in_flight_in_the_writer_process_is_abandoned_cleanly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """writer="process": the save in flight is cancelled in the writer process (it stops at its
    next write; nothing of it is committed) and the preemption save commits in the budget."""
    run = tmp_path / "run"
    monkeypatch.setenv("SAVEPOINT_WRITER_FAULT", "crawl")  # 50 ms per write in the writer
    with sp.CheckpointManager(
        run,
        async_save=True,
        writer="process",
        preemption=True,
        preemption_grace=1.5,
        max_file_bytes=64 * 1024,
    ) as mgr:
        mgr.save(10, many(10))
        os.kill(os.getpid(), signal.SIGTERM)
        assert mgr.preempted()
        r = mgr.save_on_preemption(11, many(11))
        assert (r.in_flight, r.in_flight_step, r.step, r.saved) == ("abandoned", 10, 11, True)
        assert r.within_budget and r.errors == ()
        assert mgr.steps() == [11]
    assert layout.committed_steps(str(run)) == [11] and leftovers(run) == []


def test_a_save_in_flight_that_fails_on_its_own_is_reported_not_raised(tmp_path: Path) -> None:
    run = tmp_path / "run"
    armed = threading.Event()

    def failing(done: int, total: int) -> None:
        if in_writer() and not armed.is_set():
            armed.set()
            raise OSError(28, "No space left on device")

    with sp.CheckpointManager(
        run, async_save=True, writer="thread", preemption=True, progress=failing
    ) as mgr:
        mgr.save(1, state(1))
        r = mgr.save_on_preemption(2, state(2))
        assert (r.in_flight, r.in_flight_step, r.saved) == ("failed", 1, True)
        assert len(r.errors) == 1 and "No space left" in r.errors[0]
        assert mgr.steps() == [2]


def test_preemption_during_pruning_defers_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A notice while retention deletes: the deletions stop, the report names what is left
    under discarding, and the next open deletes it."""
    import savepoint.runs.books as books

    run = tmp_path / "run"
    real = vars(books)["discard"]
    mgr = sp.CheckpointManager(run, keep_last=1, keep_every=1000, preemption=True)
    try:
        for step in (1, 2, 3):
            mgr.save(step, state(step)).wait()
        mgr._catalog.discarding = frozenset({1, 2})  # as if retention had just decided it
        calls: list[str] = []

        def discard(store: Any, path: str) -> None:
            calls.append(path)
            mgr._settle.preempting.set()  # the notice arrives during the first deletion
            real(store, path)

        monkeypatch.setattr(books, "discard", discard)
        mgr._finish_discards()
        assert len(calls) == 1 and mgr._catalog.discarding == {2}  # checked before each deletion
    finally:
        monkeypatch.undo()
        mgr.close()
    assert read(run / "report.json")["discarding"] == [2]
    with sp.CheckpointManager(run, keep_last=1, keep_every=1000) as again:
        assert again.steps() == [3]
    assert layout.committed_steps(str(run)) == [3]


def test_logging_tells_what_retention_and_restore_decided(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = tmp_path / "run"
    caplog.set_level(logging.INFO, logger="savepoint.runs")
    with sp.CheckpointManager(run, keep_last=1) as mgr:
        for step in (1, 2):
            mgr.save(step, state(step)).wait()
    assert "retention deletes checkpoints [1]" in caplog.text and "keep_last" in caplog.text
    assert "deleted checkpoint 1" in caplog.text
    with sp.CheckpointManager(run) as mgr:
        mgr.restore(blank())
    assert "restored checkpoint 2 (asked for 'latest')" in caplog.text
    caplog.clear()
    with sp.CheckpointManager(tmp_path / "empty") as mgr:
        assert mgr.restore(blank()) is None
    assert "no checkpoint to restore" in caplog.text


def test_a_forked_child_acts_on_the_signal_as_before(tmp_path: Path) -> None:
    """A data-loader worker forked after the handlers were installed: SIGTERM ends it, as it
    would have without them (the notice is not the job's)."""
    with sp.CheckpointManager(tmp_path / "run", preemption=True) as mgr:
        pid = os.fork()
        if pid == 0:  # the child
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)
            finally:
                os._exit(7)  # reached only if the signal did not end it
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM
        assert not mgr.preempted()


STEP_MISMATCH = textwrap.dedent(
    """
    import os, sys
    import numpy as np
    import torch.distributed as dist
    import savepoint as sp
    rank, port, run = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    mgr = sp.CheckpointManager(run, preemption=True, process_group=dist.group.WORLD)
    try:
        mgr.save_on_preemption(10 + rank, {"w": np.zeros(4, np.float32)})
    except ValueError as exc:
        print("refused", "different steps" in str(exc))
    r = mgr.save_on_preemption(20, {"w": np.full(4, rank, np.float32)})
    print("saved", r.step, r.exit_code, mgr.steps())
    mgr.close()
    sys.stdout.flush()
    os._exit(0)
    """
)


def test_ranks_must_save_the_same_step(tmp_path: Path) -> None:
    import socket

    pytest.importorskip("torch")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    script = tmp_path / "ranks.py"
    script.write_text(STEP_MISMATCH)
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(r), port, str(tmp_path / "run")],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for r in (0, 1)
    ]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    for out in outs:
        lines = [x for x in out.splitlines() if x.startswith(("refused", "saved"))]
        assert lines[0] == "refused True", outs
        assert lines[1].startswith("saved 20 0 "), outs


def test_a_notice_of_your_own(tmp_path: Path) -> None:
    """A notice that is no signal (a spot instance's metadata endpoint): request() it."""
    with sp.CheckpointManager(tmp_path / "run", preemption=True) as mgr:
        assert mgr.preemption is not None and not mgr.preempted()
        mgr.preemption.request()
        assert mgr.preempted()
        r = mgr.save_on_preemption(3, state(3))
        assert r.saved and r.signum is None and r.exit_code == 0 and r.since_notice is not None
