"""One writer per run directory: the writer lock (runs/lock.py).

Two managers on one directory let one's retention delete the other's just-committed checkpoint.
A writing manager now holds an flock from open to close (or garbage collection, or death); a
second writer, in this process or another, gets RunLockedError naming the holder; readers need
no lock.
"""

from __future__ import annotations

import errno
import gc
import os
import signal
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import savepoint as sp
from _support import one_rank_world
from savepoint.runs import lock as run_lock
from savepoint.runs import opening

from ._util import CHILD_ENV, blank, state

HOLDER = Path(__file__).with_name("_lock_holder_child.py")


def test_second_manager_in_this_process_is_refused(tmp_path: Path) -> None:
    run = tmp_path / "run"
    first = sp.CheckpointManager(run, keep_last=1)
    first.save(1, state(1))
    with pytest.raises(sp.RunLockedError) as info:
        sp.CheckpointManager(run, keep_last=1)
    err = info.value
    assert isinstance(err, sp.CheckpointWriteError) and err.errno == errno.EWOULDBLOCK
    assert err.holder is not None
    assert f"pid {os.getpid()} (this process) on host {socket.gethostname()}" in err.holder
    assert err.holder in str(err) and err.path == str(run)
    first.save(2, state(2))  # the refused manager changed nothing
    assert first.steps() == [2]
    # Readers need no lock.
    assert sp.CheckpointManager(run, read_only=True).restore(blank()) == 2
    sp.load(run / "latest")
    first.close()
    with sp.CheckpointManager(run) as second:  # closing released it
        assert second.steps() == [2]


def test_garbage_collection_releases_the_lock(tmp_path: Path) -> None:
    run = tmp_path / "run"
    m = sp.CheckpointManager(run)
    m.save(1, state(1))
    del m
    gc.collect()
    sp.CheckpointManager(run).close()


def test_a_failed_open_does_not_keep_the_lock(tmp_path: Path) -> None:
    run = tmp_path / "run"
    sp.CheckpointManager(run, variant="a").close()
    with pytest.raises(sp.RunMismatchError) as info:
        sp.CheckpointManager(run, variant="b")
    # ``info`` keeps the failed constructor's frame (and its self) alive: the lock must not be.
    with sp.CheckpointManager(run, variant="a"):
        assert info.value is not None


def test_only_rank_zero_of_a_process_group_takes_the_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every rank constructs a manager on the same directory; rank 0 keeps the books."""
    run = tmp_path / "run"
    with one_rank_world() as dist:
        # Four groups of this one process, each standing for a rank (the first for rank 0).
        groups = [dist.group.WORLD, *(dist.new_group([0]) for _ in range(3))]
        monkeypatch.setattr(opening, "rank", lambda group: groups.index(group))
        leader = sp.CheckpointManager(run, process_group=groups[0])
        others = [sp.CheckpointManager(run, process_group=g) for g in groups[1:]]
        assert leader._opened.writer is not None and all(o._opened.writer is None for o in others)
        for o in others:
            o.close()
        leader.close()


def test_another_process_is_refused_until_the_holder_dies(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with sp.CheckpointManager(run) as m:
        m.save(1, state(1))
    proc = subprocess.Popen(
        [sys.executable, "-W", "error", str(HOLDER), str(run)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=CHILD_ENV,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("locked"), (line, proc.stderr.read() if proc.stderr else "")
        for _ in range(2):  # a refused attempt must not wipe the holder's description
            with pytest.raises(sp.RunLockedError) as info:
                sp.CheckpointManager(run)
            assert info.value.holder is not None
            assert info.value.holder.startswith(f"pid {proc.pid} on host {socket.gethostname()}")
            assert f"pid {proc.pid}" in str(info.value)
        assert run_lock.read_holder(str(run)) == info.value.holder
        # Readers go on reading meanwhile.
        assert sp.CheckpointManager(run, read_only=True).restore(blank()) == 1
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
    # The kernel dropped the dead holder's lock: no stale lock file to clean up by hand.
    with sp.CheckpointManager(run) as m:
        m.save(2, state(2))
    assert run_lock.read_holder(str(run)) is None  # closing cleared the description


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_does_not_keep_the_lock(tmp_path: Path) -> None:
    """A child forked by the writer (a data-loader worker) must not keep the run locked once the
    writer is gone."""
    run = tmp_path / "run"
    m = sp.CheckpointManager(run)
    read_end, write_end = os.pipe()
    ready_read, ready_write = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork() with threads (3.12+)
        pid = os.fork()
    if pid == 0:  # the child (the at-fork hooks have run): live until the parent is done
        os.close(write_end)
        os.write(ready_write, b"r")
        os.read(read_end, 1)
        os._exit(0)
    os.close(read_end)
    os.close(ready_write)
    try:
        assert os.read(ready_read, 1) == b"r"
        m.close()
        with sp.CheckpointManager(run) as again:  # the child is still alive
            again.save(1, state(1))
    finally:
        os.close(write_end)
        os.close(ready_read)
        os.waitpid(pid, 0)
