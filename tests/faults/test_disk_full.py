"""A full disk and failing fsyncs while saving over an existing checkpoint.

Expected every time: CheckpointWriteError (also an OSError) with a clear message and ``.errno``,
the previous checkpoint intact and loadable exactly, and nothing else left in the parent
directory. Failures are injected (os.write raising ENOSPC after N bytes, os.fsync raising EIO at
a chosen file or directory, os.mkdir raising ENOSPC); where this container lets us mount a small
tmpfs, the real thing too (and test_disk_full_tmpfs.py sweeps every write operation there).
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import savepoint as sp
from savepoint.commit import atomic

from . import _tmpfs
from ._util import assert_same, deadline, read_doc

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="identifies files through /proc/self/fd"
)

NAME = "ckpt"
SAVE_DEADLINE_S = 60.0
MAX_FILE_BYTES = 256 << 10
_O_DIRECT = getattr(os, "O_DIRECT", 0)


def make_state(seed: int, scale: int = 1) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {
        "model": {
            f"w{i}": rng.standard_normal((128 * scale, 256)).astype(np.float32) for i in range(4)
        },
        "emb": rng.standard_normal((500, 32)).astype(ml_dtypes.bfloat16),
        "step": np.int64(seed),
        "tag": f"state-{seed}",
        "misc": [1, 2.5, None, b"bytes"],
    }


OLD = make_state(1)
NEW = make_state(2)


def save(path: Path, state: dict[str, Any], **kwargs: Any) -> sp.CheckpointInfo:
    kwargs.setdefault("max_file_bytes", MAX_FILE_BYTES)
    return sp.save(path, state, metadata={"tag": state["tag"]}, **kwargs)


def fd_target(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


def assert_failed_cleanly(
    exc_info: pytest.ExceptionInfo[sp.CheckpointWriteError],
    path: Path,
    previous: dict[str, Any] | None,
    code: int,
) -> None:
    err = exc_info.value
    assert isinstance(err, OSError) and isinstance(err, sp.CheckpointError)
    assert err.errno == code, f"errno {err.errno}, expected {errno.errorcode[code]}: {err}"
    message = str(err)
    assert os.strerror(code) in message and str(path) in message, message
    if code == errno.ENOSPC:
        assert "free disk space" in message, message
    # Nothing but the previous checkpoint (or nothing at all) remains next to it.
    left = sorted(os.listdir(path.parent))
    if previous is None:
        assert left == [], f"a failed first save left {left}"
        with pytest.raises(sp.CheckpointNotFoundError):
            sp.load(path)
        return
    assert left == [NAME], f"a failed save left temporary files behind: {left}"
    assert_same(sp.load(path), previous)
    info = sp.verify(path)
    assert info.metadata == {"tag": previous["tag"]}


@pytest.fixture
def path(tmp_path: Path) -> Path:
    parent = tmp_path / "parent"
    parent.mkdir()
    return parent / NAME


# ---------------------------------------------------------------------------------------------
# injected ENOSPC from os.write
# ---------------------------------------------------------------------------------------------


class WriteBudget:
    """os.write that lets ``budget`` bytes reach files under ``root``, then fails with ENOSPC.

    Like the kernel, it first returns a short count (block-aligned for O_DIRECT descriptors)
    for the write that crosses the limit, then raises on the next one. With budget None it only
    records (target, length) of each write.
    """

    def __init__(self, root: Path, budget: int | None) -> None:
        self.root = str(root)
        self.budget = budget
        self.written = 0
        self.log: list[tuple[str, int]] = []
        self.lock = threading.Lock()
        self.real = os.write

    def __call__(self, fd: int, data: Any) -> int:
        target = fd_target(fd)
        if not target.startswith(self.root):
            return self.real(fd, data)
        view = memoryview(data)
        with self.lock:
            n = len(view)
            if self.budget is not None:
                left = self.budget - self.written
                if left <= 0:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                if n > left:
                    direct = bool(_O_DIRECT and fcntl.fcntl(fd, fcntl.F_GETFL) & _O_DIRECT)
                    n = left - left % 4096 if direct else left
                    if n == 0:
                        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            done = self.real(fd, view[:n])
            self.written += done
            self.log.append((os.path.basename(target), done))
            return done


def write_plan(tmp_path: Path, writers: int) -> tuple[list[tuple[str, int]], int]:
    """What a successful save of NEW over OLD writes: the (file, bytes) sequence and data total."""
    probe = tmp_path / "probe" / NAME
    probe.parent.mkdir()
    save(probe, OLD)
    recorder = WriteBudget(tmp_path / "probe", None)
    mp = pytest.MonkeyPatch()
    mp.setattr(os, "write", recorder)
    try:
        save(probe, NEW, writers=writers)
    finally:
        mp.undo()
    shutil.rmtree(probe.parent)
    data = sum(n for name, n in recorder.log if name != "manifest.json")
    assert recorder.log[-1][0] == "manifest.json", recorder.log
    return recorder.log, data


BUDGETS: dict[str, Callable[[list[tuple[str, int]], int], int]] = {
    "first-write": lambda log, data: 0,
    "mid-first-data-file": lambda log, data: log[0][1] // 2,
    "third-data-file": lambda log, data: (
        sum(n for name, n in log if name in sorted({f for f, _ in log})[:2]) + 4096
    ),
    "last-data-block": lambda log, data: data - 1,
    "manifest-first-byte": lambda log, data: data,
    "mid-manifest": lambda log, data: data + log[-1][1] // 2,
}


@pytest.mark.parametrize("writers", [1, 3])
@pytest.mark.parametrize("case", list(BUDGETS))
def test_enospc_from_write(
    tmp_path: Path, path: Path, monkeypatch: pytest.MonkeyPatch, case: str, writers: int
) -> None:
    log, data = write_plan(tmp_path, writers)
    assert len({name for name, _ in log}) >= 4, log  # several data files plus the manifest
    save(path, OLD)
    budget = WriteBudget(path.parent, BUDGETS[case](log, data))
    monkeypatch.setattr(os, "write", budget)
    with pytest.raises(sp.CheckpointWriteError) as exc_info, deadline(SAVE_DEADLINE_S, "save"):
        save(path, NEW, writers=writers)
    monkeypatch.undo()
    assert budget.written <= (budget.budget or 0)
    assert_failed_cleanly(exc_info, path, OLD, errno.ENOSPC)
    # Once space is back, the same save works.
    save(path, NEW, writers=writers)
    assert_same(sp.load(path), NEW)
    assert sorted(os.listdir(path.parent)) == [NAME]


def test_enospc_on_a_first_save_leaves_nothing(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "write", WriteBudget(path.parent, 10_000))
    with pytest.raises(sp.CheckpointWriteError) as exc_info, deadline(SAVE_DEADLINE_S, "save"):
        save(path, NEW)
    monkeypatch.undo()
    assert_failed_cleanly(exc_info, path, None, errno.ENOSPC)


def test_enospc_creating_the_staging_directory(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    save(path, OLD)
    real_mkdir = os.mkdir

    def full_mkdir(p: Any, *args: Any, **kwargs: Any) -> None:
        if atomic.TMP_TAG in os.fspath(p):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fspath(p))
        real_mkdir(p, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", full_mkdir)
    with pytest.raises(sp.CheckpointWriteError) as exc_info, deadline(SAVE_DEADLINE_S, "save"):
        save(path, NEW)
    monkeypatch.undo()
    assert_failed_cleanly(exc_info, path, OLD, errno.ENOSPC)


# ---------------------------------------------------------------------------------------------
# injected fsync failures
# ---------------------------------------------------------------------------------------------


class FailingFsync:
    """os.fsync that fails with ``code`` the ``nth`` time a target matching ``which`` is synced."""

    def __init__(self, which: Callable[[str], bool], nth: int, code: int) -> None:
        self.which, self.nth, self.code = which, nth, code
        self.seen = 0
        self.fired = False
        self.real = os.fsync

    def __call__(self, fd: int) -> None:
        target = fd_target(fd)
        if not self.fired and self.which(target):
            self.seen += 1
            if self.seen == self.nth:
                self.fired = True
                raise OSError(self.code, os.strerror(self.code))
        self.real(fd)


def _is_data(t: str) -> bool:
    return os.path.basename(t).startswith("data-")


def _is_manifest(t: str) -> bool:
    return os.path.basename(t) == "manifest.json"


def _is_staging(t: str) -> bool:
    return atomic.TMP_TAG in os.path.basename(t)


def _is_parent(t: str) -> bool:
    return os.path.basename(t) == "parent"


FSYNC_CASES: dict[str, tuple[Callable[[str], bool], int, int]] = {
    "first-data-file": (_is_data, 1, errno.EIO),
    "third-data-file": (_is_data, 3, errno.EIO),
    "manifest": (_is_manifest, 1, errno.EIO),
    "staging-directory": (_is_staging, 1, errno.EIO),
    "parent-directory": (_is_parent, 1, errno.EIO),
    "data-file-enospc": (_is_data, 2, errno.ENOSPC),
}


@pytest.mark.parametrize("replace", ["exchange", "two-renames"])
@pytest.mark.parametrize("case", list(FSYNC_CASES))
def test_fsync_failure(
    path: Path, monkeypatch: pytest.MonkeyPatch, case: str, replace: str
) -> None:
    save(path, OLD)
    if replace == "two-renames":
        monkeypatch.setattr(atomic, "exchange", lambda a, b: False)
    which, nth, code = FSYNC_CASES[case]
    failing = FailingFsync(which, nth, code)
    monkeypatch.setattr(os, "fsync", failing)
    with pytest.raises(sp.CheckpointWriteError) as exc_info, deadline(SAVE_DEADLINE_S, "save"):
        save(path, NEW)
    monkeypatch.undo()
    assert failing.fired
    assert_failed_cleanly(exc_info, path, OLD, code)


@pytest.mark.parametrize(
    "case", ["first-data-file", "manifest", "staging-directory", "parent-directory"]
)
def test_fsync_failure_on_a_first_save_leaves_nothing(
    path: Path, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    which, nth, code = FSYNC_CASES[case]
    failing = FailingFsync(which, nth, code)
    monkeypatch.setattr(os, "fsync", failing)
    with pytest.raises(sp.CheckpointWriteError) as exc_info, deadline(SAVE_DEADLINE_S, "save"):
        save(path, NEW)
    monkeypatch.undo()
    assert failing.fired
    assert_failed_cleanly(exc_info, path, None, code)


def test_fsync_failure_after_the_parent_was_synced_once(
    path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two-rename replace: the parent is synced between the renames and again after the second.
    save(path, OLD)
    monkeypatch.setattr(atomic, "exchange", lambda a, b: False)
    failing = FailingFsync(_is_parent, 2, errno.EIO)
    monkeypatch.setattr(os, "fsync", failing)
    with pytest.raises(sp.CheckpointWriteError) as exc_info, deadline(SAVE_DEADLINE_S, "save"):
        save(path, NEW)
    monkeypatch.undo()
    assert failing.fired
    assert_failed_cleanly(exc_info, path, OLD, errno.EIO)


# ---------------------------------------------------------------------------------------------
# a real full filesystem: a small tmpfs (test_disk_full_tmpfs.py sweeps every operation)
# ---------------------------------------------------------------------------------------------

TMPFS_BYTES = 8 << 20


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[_tmpfs.Tmpfs]:
    problem = _tmpfs.mount_problem()
    if problem is not None:
        pytest.skip(f"{problem}; the injected failures above stand in for it")
    with _tmpfs.mounted(tmp_path / "mnt", TMPFS_BYTES) as fs:
        yield fs


def test_real_enospc_on_tmpfs_during_data(tmpfs: _tmpfs.Tmpfs) -> None:
    path = tmpfs.root / "parent" / NAME
    path.parent.mkdir()
    save(path, OLD)  # ~0.6 MiB
    big = make_state(3, scale=20)  # ~10.5 MiB: cannot fit in 8 MiB
    with pytest.raises(sp.CheckpointWriteError) as exc_info, deadline(SAVE_DEADLINE_S, "save"):
        save(path, big)
    assert_failed_cleanly(exc_info, path, OLD, errno.ENOSPC)
    # The failed save gave its space back: a save that fits still works.
    save(path, NEW)
    assert_same(sp.load(path), NEW)
    assert sorted(os.listdir(path.parent)) == [NAME]


def pages(n: int) -> int:
    return -(-n // _tmpfs.PAGE)


@pytest.mark.parametrize(
    "short_by_pages", [0, 1], ids=["room-for-data-not-manifest", "one-page-short"]
)
def test_real_enospc_on_tmpfs_at_the_edge(
    tmp_path: Path, tmpfs: _tmpfs.Tmpfs, short_by_pages: int
) -> None:
    # Learn the page footprint of NEW's data files from a save on the ordinary disk.
    probe = tmp_path / "probe" / NAME
    save(probe, NEW)
    data_pages = sum(pages(f["size"]) for f in read_doc(probe)["files"].values())
    path = tmpfs.root / "parent" / NAME
    path.parent.mkdir()
    save(path, OLD)
    # Fill the filesystem so that exactly the data (less ``short_by_pages`` pages) still fits.
    want_free = (data_pages - short_by_pages) * _tmpfs.PAGE
    tmpfs.set_free(want_free)
    with pytest.raises(sp.CheckpointWriteError) as exc_info, deadline(SAVE_DEADLINE_S, "save"):
        save(path, NEW)
    assert_failed_cleanly(exc_info, path, OLD, errno.ENOSPC)
    assert tmpfs.free_bytes() == want_free  # everything the failed save wrote was given back


# ---------------------------------------------------------------------------------------------
# injected ENOSPC elsewhere: where no tmpfs can be mounted, these stand in for the sweeps
# ---------------------------------------------------------------------------------------------


def test_enospc_opening_a_snapshot_history_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_mkdir = os.mkdir

    def full_mkdir(p: Any, *args: Any, **kwargs: Any) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fspath(p))

    monkeypatch.setattr(os, "mkdir", full_mkdir)
    with pytest.raises(sp.CheckpointWriteError) as exc_info:
        sp.SnapshotHistory(2, directory=tmp_path / "history")
    assert exc_info.value.errno == errno.ENOSPC, exc_info.value
    assert "free disk space" in str(exc_info.value)
    monkeypatch.setattr(os, "mkdir", real_mkdir)
    assert os.listdir(tmp_path) == []
    history = sp.SnapshotHistory(2, directory=tmp_path / "history")
    assert len(history) == 0


def test_enospc_in_an_async_save_callback_is_a_write_error(
    path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A full disk while on_commit writes its own files (the manager's report.json): the handle
    # and the checkpointer both report CheckpointWriteError(ENOSPC), never a raw OSError.
    def full(info: sp.CheckpointInfo) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path.parent / "report.json"))

    with sp.AsyncCheckpointer() as ckpt:
        pending = ckpt.save(path, NEW, on_commit=full)
        with pytest.raises(sp.CheckpointWriteError) as exc_info:
            pending.wait(SAVE_DEADLINE_S)
        assert exc_info.value.errno == errno.ENOSPC
        with pytest.raises(sp.CheckpointWriteError) as again:
            ckpt.wait()
        assert again.value is exc_info.value
