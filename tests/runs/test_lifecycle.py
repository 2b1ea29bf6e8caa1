"""A manager's lifecycle part alone (issue 26, ``runs/lifecycle.py``): one lock shared with the
background step, ``close()`` giving back what the open took, the interpreter-exit hook."""

from __future__ import annotations

import errno
import uuid
import weakref

import numpy as np
import pytest

import savepoint as sp
from savepoint.runs import lifecycle


def _url() -> str:
    return f"memory://lifecycle/{uuid.uuid4().hex}"


def test_close_gives_back_what_the_open_took(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lifecycle, "_LIVE", weakref.WeakSet())
    url = _url()
    m = sp.CheckpointManager(url, keep_last=1)
    life = m._life
    # One lock for the books, the background step and the save route.
    assert life.settle.lock is life.lock and life.saver.lock is life.lock
    assert set(lifecycle._LIVE) == {life}  # a writer: finished at exit
    reader = sp.CheckpointManager(url, read_only=True)
    assert reader._life not in lifecycle._LIVE  # a reader has nothing to finish
    m.save(1, {"w": np.zeros(4, np.float32)})
    m.close()
    assert life.closed and not lifecycle._LIVE
    m.close()  # a second close() does nothing
    with pytest.raises(RuntimeError, match="is closed; open a new one"):
        m.save(2, {"w": np.ones(4, np.float32)})
    with pytest.raises(RuntimeError, match="is closed"):
        m.gc()
    again = sp.CheckpointManager(url)  # the writer lock was released
    assert again.steps() == [1]
    again.close()
    reader.close()


def test_gc_of_a_reader_removes_nothing() -> None:
    url = _url()
    sp.CheckpointManager(url).close()
    with sp.CheckpointManager(url, read_only=True) as reader:
        with pytest.raises(sp.CheckpointWriteError, match="nothing was removed") as caught:
            reader.gc(grace=0)
    assert caught.value.errno == errno.EROFS


def test_at_exit_a_background_failure_is_printed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Nobody is left to raise it to: the exit hook waits for the writer and prints it."""
    monkeypatch.setattr(lifecycle, "_LIVE", weakref.WeakSet())
    m = sp.CheckpointManager(_url())
    m.save(1, {"w": np.zeros(4, np.float32)})
    m._settle.keep(sp.CorruptCheckpointError("checkpoint 1 did not verify (a test)"))
    lifecycle._finish_at_exit()
    assert "savepoint: checkpoint 1 did not verify (a test)" in capsys.readouterr().err
    m.close()  # (the error was reported once, at exit)
