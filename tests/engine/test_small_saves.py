"""Small saves: the data files' fsyncs run beside the manifest's, and nothing is published
before they are done (issue 25 item 19: a 1-10 MB save cost 2.2x a framework's save + fsync)."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import savepoint as sp
from savepoint.errors import CheckpointWriteError


def _fd_path(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return "?"


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
def test_data_files_are_durable_before_the_rename_and_fsynced_beside_the_manifest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[tuple[str, str, str]] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        path = _fd_path(fd)
        events.append(("start", path, threading.current_thread().name))
        real_fsync(fd)
        events.append(("end", path, threading.current_thread().name))

    monkeypatch.setattr(os, "fsync", fsync)
    state = {"a": np.arange(100_000, dtype=np.float32), "b": np.ones(7)}
    sp.save(tmp_path / "ck", state)
    data = [e for e in events if "data-00000" in e[1]]
    assert data[0][2].startswith("savepoint-finish")  # on the finishing pool
    data_end = events.index(data[-1])
    # It ends before the staging directory is renamed into place: the parent's fsync, which
    # follows the rename, starts after it.
    parent_sync = max(i for i, e in enumerate(events) if e[0] == "start" and e[1] == str(tmp_path))
    assert data_end < parent_sync
    out = sp.load(tmp_path / "ck")
    assert np.array_equal(out["a"], state["a"])


def test_a_failed_data_fsync_publishes_nothing_and_keeps_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = {"a": np.zeros(10)}
    sp.save(tmp_path / "ck", old)
    real_fsync = os.fsync

    def fsync(fd: int) -> Any:
        if threading.current_thread().name.startswith("savepoint-finish"):
            raise OSError(errno.EIO, "Input/output error")
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(CheckpointWriteError):
        sp.save(tmp_path / "ck", {"a": np.ones(10)})
    monkeypatch.undo()
    assert np.array_equal(sp.load(tmp_path / "ck")["a"], old["a"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # no staging left behind
