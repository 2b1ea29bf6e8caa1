"""``AsyncCheckpointer(writer="process")``: the writer process (issue 27).

The same promises as the thread writer (snapshot at ``save()``'s return, one save in flight,
errors raised once), plus the process's own: its death is an error naming it and the next save
starts a new one; it never imports torch; no writer process outlives its trainer, and a save
handed over before the trainer is SIGKILLed still commits, bit-exactly. ``make torture`` runs the
kill campaign 50 times (``tests/_torture.py``).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import random
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

import _torture
import savepoint as sp
from _compare import same
from savepoint.async_ import _priority, _wire, process
from savepoint.blobs import BlobPolicy, FastMemo

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="checks processes through /proc"
)
FAULT = "SAVEPOINT_WRITER_FAULT"


def state(seed: int, n: int = 2000) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {
        "w": rng.standard_normal((n // 40, 40)).astype(np.float32),
        "nested": {"ids": np.arange(n, dtype=np.int64) * seed, "half": np.ones(7, np.float16)},
        "empty": np.zeros((0, 3), np.float64),
        "step": seed,
        "lr": 0.5,
        "name": "run",
    }


def gone(pid: int) -> bool:
    """The process ended (a zombie nobody reaped counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def wait_gone(pid: int, seconds: float = 30) -> bool:
    deadline = time.monotonic() + seconds
    while not gone(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.fixture
def ckpt() -> Any:
    with sp.AsyncCheckpointer(writer="process") as c:
        yield c


def test_round_trip_and_the_description_match_a_thread_save(tmp_path: Path, ckpt: Any) -> None:
    s = state(1)
    info = ckpt.save(tmp_path / "p", s, metadata={"step": 1}).wait()
    same(sp.load(tmp_path / "p"), s)
    assert info == sp.inspect(tmp_path / "p")
    assert info.metadata == {"step": 1}
    with sp.AsyncCheckpointer(writer="thread") as thread:
        other = thread.save(tmp_path / "t", s, metadata={"step": 1}).wait()
    assert [t for t in info.tensors] == [t for t in other.tensors]
    assert info.files == other.files
    sp.verify(tmp_path / "p")


def test_the_writer_process_is_reused_and_never_imports_torch(tmp_path: Path, ckpt: Any) -> None:
    ckpt.save(tmp_path / "a", state(1)).wait()
    pid = ckpt._process.pid
    ckpt.save(tmp_path / "b", state(2, 50_000)).wait()  # a bigger arena: a new one is sent
    assert ckpt._process.pid == pid
    same(sp.load(tmp_path / "b"), state(2, 50_000))
    with open(f"/proc/{pid}/maps", encoding="ascii", errors="replace") as f:
        assert "torch" not in f.read()
    ckpt.close()
    assert wait_gone(pid, 10), "close() left the writer process running"


def test_what_is_saved_is_the_state_when_save_returned(tmp_path: Path, ckpt: Any) -> None:
    s = state(3, 200_000)
    expected = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in s.items()}
    expected["nested"] = {k: v.copy() for k, v in s["nested"].items()}
    pending = ckpt.save(tmp_path / "p", s)
    s["w"][:] = -7
    s["nested"]["ids"] += 1
    pending.wait()
    same(sp.load(tmp_path / "p"), expected)


def test_one_save_in_flight(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAULT, "delay:0.5")
    with sp.AsyncCheckpointer(writer="process") as c:
        first = c.save(tmp_path / "a", state(1))
        assert not first.done()
        second = c.save(tmp_path / "b", state(2))  # waits for the first
        assert first.done()
        second.wait()
    with sp.AsyncCheckpointer(writer="process", on_busy="skip") as c:
        c.save(tmp_path / "c", state(1))
        with pytest.warns(UserWarning, match="still writing"):
            assert c.save(tmp_path / "d", state(2)).skipped
    same(sp.load(tmp_path / "b"), state(2))
    assert not (tmp_path / "d").exists()


def test_an_error_in_the_writer_process_is_raised_once_as_the_same_class(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_bytes(b"x")
    with sp.AsyncCheckpointer(writer="thread") as c:
        c.save(blocker / "ckpt", state(1))
        with pytest.raises(sp.CheckpointError) as by_thread:
            c.wait()
    with sp.AsyncCheckpointer(writer="process") as c:
        pending = c.save(blocker / "ckpt", state(1))  # a directory inside a file
        with pytest.raises(sp.CheckpointWriteError) as raised:
            c.wait()
        assert type(raised.value) is type(by_thread.value)
        assert raised.value.errno == by_thread.value.errno == errno.EEXIST
        assert str(raised.value) == str(by_thread.value)
        with pytest.raises(sp.CheckpointWriteError):
            pending.wait()
        c.wait()  # reported once
        c.save(tmp_path / "ok", state(2)).wait()  # the same writer process goes on
    same(sp.load(tmp_path / "ok"), state(2))


@pytest.mark.parametrize(
    ("fault", "cls", "number"),
    [
        ("raise:CorruptCheckpointError", sp.CorruptCheckpointError, None),
        ("raise:UnsupportedStateError", sp.UnsupportedStateError, None),
        ("oserror:ENOSPC", sp.CheckpointWriteError, errno.ENOSPC),
    ],
)
def test_injected_errors_cross_with_their_class(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault: str, cls: type, number: int | None
) -> None:
    monkeypatch.setenv(FAULT, fault)
    c = sp.AsyncCheckpointer(writer="process")
    c.save(tmp_path / "p", state(1))
    with pytest.raises(cls) as raised:
        c.close()  # close() reports it too
    assert type(raised.value) is cls
    # what happened in the writer process, as its traceback (the cause of the error here)
    assert isinstance(raised.value.__cause__, _wire.WriterProcessTraceback)
    assert "_fault_before" in str(raised.value.__cause__)
    assert getattr(raised.value, "errno", None) == number
    assert not (tmp_path / "p").exists()


def test_an_unknown_error_type_becomes_a_write_error() -> None:
    error = _wire.error_from({"type": "KeyError", "message": "'x'", "path": "/p", "errno": None})
    assert type(error) is sp.CheckpointWriteError
    assert str(error) == "KeyError: 'x'" and error.path == "/p"
    fields = _wire.error_fields(sp.RunLockedError("held", path="/r", holder="pid 1"))
    back = _wire.error_from(fields)
    assert type(back) is sp.RunLockedError and back.errno == errno.EWOULDBLOCK


def test_a_writer_process_error_carries_its_traceback() -> None:
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device", "/p/x.safetensors")
        except OSError as exc:
            raise _wire.reported(exc, "/p") from exc
    except sp.CheckpointWriteError as exc:
        fields = _wire.error_fields(exc)
    back = _wire.error_from(fields)
    assert isinstance(back.__cause__, _wire.WriterProcessTraceback)
    text = str(back.__cause__)
    assert "in the savepoint writer process" in text and "No space left on device" in text
    assert "Traceback" in text


def test_the_writer_process_killed_mid_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "p"
    with sp.AsyncCheckpointer(writer="process") as c:
        c.save(target, state(1)).wait()  # the previous checkpoint
    monkeypatch.setenv(FAULT, "stall")
    writing = threading.Event()
    c = sp.AsyncCheckpointer(writer="process", progress=lambda done, total: writing.set())
    pending = c.save(target, state(2, 100_000))
    assert writing.wait(30), "the writer process never started writing"
    pid = c._process.pid
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(
        sp.CheckpointWriteError, match=rf"writer process \(pid {pid}\) was killed by signal SIGKILL"
    ):
        pending.wait(30)
    with pytest.raises(sp.CheckpointWriteError):
        c.wait()
    same(sp.load(target), state(1))  # intact
    monkeypatch.delenv(FAULT)
    c.save(target, state(3)).wait()  # a new writer process
    assert c._process.pid != pid
    c.close()
    same(sp.load(target), state(3))


def test_the_writer_process_dead_while_idle_is_replaced(tmp_path: Path, ckpt: Any) -> None:
    ckpt.save(tmp_path / "a", state(1)).wait()
    pid = ckpt._process.pid
    os.kill(pid, signal.SIGKILL)
    # Until its last thread has exited it is not yet reported dead (a save sent then fails).
    ckpt._process._proc.wait(30)
    ckpt.save(tmp_path / "b", state(2)).wait()
    assert ckpt._process.pid != pid
    same(sp.load(tmp_path / "b"), state(2))


def test_a_misspelt_writer_names_the_nearest(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(sp.CheckpointArgumentError, match=r"not 'proces' \(did you mean 'process'"):
        sp.AsyncCheckpointer(writer="proces")  # type: ignore[arg-type]
    with pytest.raises(sp.CheckpointArgumentError, match=r"not 'idel' \(did you mean 'idle'"):
        sp.AsyncCheckpointer(writer_priority="idel")  # type: ignore[arg-type]
    monkeypatch.setenv("SAVEPOINT_WRITER_PRIORITY", "Low")  # named: no writer_priority= given
    with pytest.raises(
        sp.CheckpointArgumentError, match=r"^SAVEPOINT_WRITER_PRIORITY .* mean 'low'"
    ):
        sp.AsyncCheckpointer()


def test_refused_combinations(tmp_path: Path, ckpt: Any) -> None:
    with pytest.raises(ValueError, match="writer must be"):
        sp.AsyncCheckpointer(writer="fork")  # type: ignore[arg-type]
    with pytest.raises(sp.UnsupportedStorageError, match="checkpoint path memory://x/p: an in-"):
        ckpt.save("memory://x/p", state(1))
    with pytest.raises(ValueError, match="keeps its own"):
        ckpt.save(tmp_path / "p", state(1), blobs=tmp_path / "blobs", memo=FastMemo())
    with pytest.raises(ValueError, match="blob store memory://x/blobs: an in-memory store"):
        ckpt.save("memory://x/p", state(1), blobs="memory://x/blobs")
    ckpt.save(tmp_path / "p", state(1)).wait()  # still usable


def test_the_default_writer_is_the_process_with_the_thread_for_what_it_refuses(
    tmp_path: Path,
) -> None:
    """writer=None (the default): the writer process writes what it can reach; a save it
    refuses with writer="process" (memory://, a store made by hand, memo=/tracker=) is
    written by the thread writer instead, silently, and loads back; the writer process stays
    in use for the next save it can write."""
    from savepoint.storage.faults import FaultyStore
    from savepoint.storage.local import LocalStore
    from savepoint.storage.paths import Location

    with sp.AsyncCheckpointer() as ck:
        assert ck.writer == "process" and ck.fallback
        assert ck.writes_in_process(tmp_path / "a") and not ck.writes_in_process("memory://d/a")
        ck.save(tmp_path / "a", state(1)).wait()
        pid = ck._process.pid
        assert pid is not None
        saves = [
            ("memory://d/m", {}),
            (Location(FaultyStore(LocalStore()), str(tmp_path / "faulty")), {}),
            (tmp_path / "inc", {"blobs": tmp_path / "blobs", "memo": FastMemo()}),
            ("memory://d/inc", {"blobs": "memory://d/blobs"}),
        ]
        for i, (where, extra) in enumerate(saves):
            info = ck.save(where, state(i + 2), **extra).wait()  # type: ignore[arg-type]
            same(sp.load(info.path), state(i + 2))
        ck.save(tmp_path / "b", state(9)).wait()
        assert ck._process.pid == pid  # the same writer process wrote the local saves
        same(sp.load(tmp_path / "b"), state(9))
    with sp.CheckpointManager("memory://d/run", async_save=True) as mgr:  # falls back too
        saved = mgr.save(1, state(3)).wait()
        same(sp.load(saved.path), state(3))
    with sp.AsyncCheckpointer(writer="thread") as ck:
        assert ck._process is None and not ck.writes_in_process(tmp_path / "c")


def test_the_default_writer_falls_back_when_the_writer_process_cannot_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.ENOENT, "no interpreter here")

    monkeypatch.setattr(process.subprocess, "Popen", refuse)
    with sp.AsyncCheckpointer() as ck:
        ck.save(tmp_path / "a", state(1)).wait()
        assert ck._process.pid is None
    same(sp.load(tmp_path / "a"), state(1))
    with sp.AsyncCheckpointer(writer="process") as ck, pytest.raises(OSError):
        ck.save(tmp_path / "b", state(1))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_does_not_share_the_writer_process(tmp_path: Path, ckpt: Any) -> None:
    ckpt.save(tmp_path / "a", state(1)).wait()
    parent_writer = ckpt._process.pid
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child reports through the pipe
        code = 1
        try:
            assert ckpt._process.pid is None
            try:
                ckpt.save(tmp_path / "x", state(5))
            except RuntimeError:
                pass
            else:
                raise AssertionError("the parent's checkpointer saved in the child")
            with sp.AsyncCheckpointer(writer="process") as own:
                own.save(tmp_path / "child", state(6)).wait()
                os.write(write, str(own._process.pid).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    child_writer = int(os.read(read, 64) or b"0")
    os.close(read)
    assert os.waitpid(child, 0)[1] == 0
    assert child_writer and child_writer != parent_writer
    assert not gone(parent_writer)
    ckpt.save(tmp_path / "b", state(2)).wait()
    assert ckpt._process.pid == parent_writer
    same(sp.load(tmp_path / "child"), state(6))
    same(sp.load(tmp_path / "b"), state(2))


# -- the trainer dies after save() returned -----------------------------------------------------

TRAINER = textwrap.dedent(
    """
    import os, sys, time
    sys.path.insert(0, {tests!r})
    import savepoint as sp
    from test_process_writer import state
    path, mode = sys.argv[1], sys.argv[2]
    c = sp.AsyncCheckpointer(writer="process")
    c.save(path, state(1)).wait()
    c.save(path, state(2, {n}))
    print(c._process.pid, flush=True)
    if mode == "kill":
        time.sleep(600)
    elif mode == "_exit":
        os._exit(3)
    elif mode == "raise":
        raise SystemExit("the training loop failed")
    """
)
BIG = 400_000  # 3.2 MiB of float32 and as much int64: a few ms of writing to hit


def trainer(tmp_path: Path, mode: str) -> tuple[subprocess.Popen[str], int]:
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER.format(tests=str(Path(__file__).parent), n=BIG), encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    env.pop(FAULT, None)
    proc = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "p"), mode],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip().isdigit(), f"the trainer printed {line!r}"
    return proc, int(line)


def check_committed(tmp_path: Path, proc: subprocess.Popen[str], writer: int) -> None:
    proc.wait(60)
    assert proc.stdout is not None
    proc.stdout.close()
    assert wait_gone(writer), f"the writer process {writer} outlived its trainer"
    same(sp.load(tmp_path / "p"), state(2, BIG))


@pytest.mark.parametrize("mode", ["_exit", "raise", "exit"])
def test_a_save_outlives_its_trainer_ending(tmp_path: Path, mode: str) -> None:
    proc, writer = trainer(tmp_path, mode)
    check_committed(tmp_path, proc, writer)


def test_a_save_outlives_its_trainer_killed(tmp_path: Path) -> None:
    """SIGKILL of the trainer alone at random moments after save() returned: the step commits,
    bit-exactly, and no writer process remains (2 kills here, 50 in ``make torture``)."""
    rng = random.Random(27)
    for i in range(50 if _torture.ENABLED else 2):
        where = tmp_path / str(i)
        where.mkdir()
        proc, writer = trainer(where, "kill")
        time.sleep(rng.uniform(0, 0.02))
        proc.kill()
        check_committed(where, proc, writer)


def test_incremental_saves_through_the_writer_process(tmp_path: Path, ckpt: Any) -> None:
    """The writer process runs the blob store's save session: chunks unchanged since its last
    save are not written again (its memo and tracker live there), and each checkpoint loads
    bit-exactly."""
    blobs = tmp_path / "blobs"
    policy = BlobPolicy(min_blob_bytes=1 << 10, chunk_size=1 << 16)
    rng = np.random.default_rng(0)
    big = rng.standard_normal(1 << 17).astype(np.float32)  # 512 KiB: 8 chunks
    first = {"w": big.copy(), "b": np.ones(4, np.float32)}
    info = ckpt.save(tmp_path / "s1", first, blobs=blobs, blob_policy=policy).wait()
    assert info.format_version >= 4
    chunks = sorted(p.name for p in blobs.rglob("*") if p.is_file())
    second = {"w": big.copy(), "b": np.full(4, 2, np.float32)}
    second["w"][:16] += 1  # one chunk changes
    ckpt.save(tmp_path / "s2", second, blobs=blobs, blob_policy=policy).wait()
    grown = sorted(p.name for p in blobs.rglob("*") if p.is_file())
    assert 0 < len(set(grown) - set(chunks)) <= 2  # the changed chunk (or its patch) only
    same(sp.load(tmp_path / "s1"), first)
    same(sp.load(tmp_path / "s2"), second)
    sp.verify(tmp_path / "s2")  # every checksum, blobs included (raises otherwise)


def test_a_save_the_caller_stops_is_cancelled_in_the_writer_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A progress callback that raises (save_on_preemption abandoning the save) cancels it in
    the writer process: its next write stops, nothing is committed, the caller gets its own
    error, and the same writer process writes the next save."""
    monkeypatch.setenv(FAULT, "crawl")

    class Stop(Exception):
        pass

    def stop(done: int, total: int) -> None:
        raise Stop("abandoned")

    big = {f"t{i}": np.full(1 << 16, i, np.float32) for i in range(24)}
    c = sp.AsyncCheckpointer(writer="process", progress=stop, max_file_bytes=1 << 18)
    pending = c.save(tmp_path / "p", big)
    with pytest.raises(Exception) as raised:
        pending.wait()
    assert isinstance(raised.value, Stop) or isinstance(raised.value.__cause__, Stop)
    proc = c._process._proc
    assert proc is not None and proc.poll() is None  # the writer process lives on
    with contextlib.suppress(Exception):
        c.close()  # (the background error is reported by close() too)
    # Closed: the writer process has exited, so a save it had not cancelled would be there now.
    assert proc.poll() is not None
    assert not (tmp_path / "p").exists()


def test_the_writer_process_runs_below_the_trainers_priority(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """writer_priority="low" (the default) nices the writer process (SAVEPOINT_WRITER_NICE,
    default 10) and gives it the lowest best-effort I/O level; "idle" makes it SCHED_IDLE in the
    idle I/O class; "normal" keeps the trainer's. SAVEPOINT_WRITER_PRIORITY chooses where the
    argument is not given."""
    ours = os.getpriority(os.PRIO_PROCESS, 0)
    monkeypatch.delenv("SAVEPOINT_WRITER_NICE", raising=False)
    monkeypatch.delenv("SAVEPOINT_WRITER_PRIORITY", raising=False)
    cases: list[tuple[str | None, str | None, int, int, tuple[int, int] | None]] = [
        # (argument, environment, nice, scheduling policy, I/O (class, level) or None: unchanged)
        (None, None, min(ours + 10, 19), os.SCHED_OTHER, (2, 7)),
        ("normal", None, ours, os.SCHED_OTHER, None),
        ("idle", None, 19, os.SCHED_IDLE, (3, 0)),
        (None, "normal", ours, os.SCHED_OTHER, None),
        ("low", "idle", min(ours + 10, 19), os.SCHED_OTHER, (2, 7)),
    ]
    mine = _priority.current_ioprio()
    for argument, environment, nice, policy, io in cases:
        if environment is None:
            monkeypatch.delenv("SAVEPOINT_WRITER_PRIORITY", raising=False)
        else:
            monkeypatch.setenv("SAVEPOINT_WRITER_PRIORITY", environment)
        with sp.AsyncCheckpointer(writer="process", writer_priority=argument) as c:  # type: ignore[arg-type]
            c.save(tmp_path / f"p{argument}{environment}", state(1)).wait()
            pid = c._process.pid
            assert os.getpriority(os.PRIO_PROCESS, pid) == nice, (argument, environment)
            assert os.sched_getscheduler(pid) == policy, (argument, environment)
            if mine is not None:
                assert _priority.current_ioprio(pid) == (io or mine), (argument, environment)
    monkeypatch.delenv("SAVEPOINT_WRITER_PRIORITY")
    monkeypatch.setenv("SAVEPOINT_WRITER_NICE", "0")
    with sp.AsyncCheckpointer(writer="process") as c:
        c.save(tmp_path / "nice0", state(1)).wait()
        assert os.getpriority(os.PRIO_PROCESS, c._process.pid) == ours
    with pytest.raises(ValueError, match="writer_priority"):
        sp.AsyncCheckpointer(writer="process", writer_priority="lowest")  # type: ignore[arg-type]
    monkeypatch.setenv("SAVEPOINT_WRITER_PRIORITY", "bogus")
    with pytest.raises(ValueError, match="writer_priority"):
        sp.AsyncCheckpointer(writer="process")
    monkeypatch.delenv("SAVEPOINT_WRITER_PRIORITY")
    with sp.CheckpointManager(tmp_path / "run", async_save=True, writer_priority="idle") as mgr:
        mgr.save(1, state(1)).wait()
        writer = mgr._saver.checkpointer._process  # type: ignore[union-attr]
        assert os.sched_getscheduler(writer.pid) == os.SCHED_IDLE
    with pytest.raises(ValueError, match="writer_priority"):
        sp.CheckpointManager(tmp_path / "run2", async_save=True, writer_priority="high")  # type: ignore[arg-type]


# -- every wait on the writer process is bounded (issue 28, "nothing hangs") -------------------
# The writer process is stopped (SIGSTOP: it never answers, as one stuck on a dead NFS mount
# would not): closing a sharded save's blob session (``_ShardWriter.close``, the settle after the
# commit) gives up after the save's ``timeout``, and a rank's write step stops waiting once the
# other ranks gave up on the phase (``abandoned``); either way the writer process is killed, so
# no late answer can be mistaken for the next save's, and the next save starts a new one.


def stopped_writer() -> tuple[process.ProcessWriter, int]:
    writer = process.ProcessWriter()
    writer.ensure()
    pid = writer.pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    return writer, pid


def test_closing_a_session_the_writer_process_never_settles_is_bounded(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    writer, pid = stopped_writer()
    try:
        shard_writer = process._ShardWriter(writer, str(tmp_path / "ckpt"), None, None)  # type: ignore[arg-type]
        shard_writer.open, shard_writer.timeout = True, 0.5  # a session open in the writer process
        start = time.monotonic()
        with caplog.at_level(logging.WARNING):
            shard_writer.close(committed=True)  # never raises: logged
        elapsed = time.monotonic() - start
        assert 0.4 < elapsed < 3, elapsed
        assert "did not answer within 0.5 s" in caplog.text, caplog.text
        assert gone(pid) and writer.pid is None
        writer.ensure()  # the next save starts a new writer process
        assert writer.pid not in (None, pid)
    finally:
        writer.close()


def test_a_rank_stops_waiting_for_its_writer_process_once_the_others_gave_up(
    tmp_path: Path,
) -> None:
    writer, pid = stopped_writer()
    given_up = sp.DistributedCheckpointError("the others gave up", path=str(tmp_path))
    asked: list[float] = []

    def abandoned() -> sp.DistributedCheckpointError | None:
        asked.append(time.monotonic())
        return given_up if len(asked) >= 2 else None

    try:
        start = time.monotonic()
        with pytest.raises(sp.DistributedCheckpointError) as info:
            writer.receive(str(tmp_path / "ckpt"), None, abandoned=abandoned)
        assert info.value is given_up
        assert time.monotonic() - start < 4  # asked about once a second
        assert gone(pid) and writer.pid is None
    finally:
        writer.close()
