"""A full disk and failing fsyncs while saving over an existing checkpoint.

Expected every time: CheckpointWriteError (also an OSError) with a clear message and ``.errno``,
the previous checkpoint intact and loadable exactly, and nothing else left in the parent
directory. Failures are injected through a FaultyStore around the local disk (a disk with N
bytes of room left, an fsync failing with EIO at a chosen file or directory, mkdir failing with
ENOSPC, a filesystem that cannot exchange); where this container lets us mount a small tmpfs, the
real thing too (and test_disk_full_tmpfs.py sweeps every write operation there).
"""

from __future__ import annotations

import errno
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import savepoint as sp
from savepoint.commit import names
from savepoint.storage.faults import Fault, FaultyStore
from savepoint.storage.local import LocalStore

from . import _tmpfs
from ._util import assert_same, deadline, read_doc

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="Linux filesystem semantics (and tmpfs)"
)

NAME = "ckpt"
SAVE_DEADLINE_S = 60.0
MAX_FILE_BYTES = 256 << 10


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


def save(path: Any, state: dict[str, Any], **kwargs: Any) -> sp.CheckpointInfo:
    kwargs.setdefault("max_file_bytes", MAX_FILE_BYTES)
    return sp.save(path, state, metadata={"tag": state["tag"]}, **kwargs)


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
# injected ENOSPC: a FaultyStore around the local disk with a few bytes of room left
# ---------------------------------------------------------------------------------------------


def faulty(**options: Any) -> FaultyStore:
    return FaultyStore(LocalStore(), **options)


def write_plan(tmp_path: Path, writers: int) -> tuple[list[tuple[str, int]], int]:
    """What a successful save of NEW over OLD writes: the (file, bytes) sequence and data total."""
    probe = tmp_path / "probe" / NAME
    probe.parent.mkdir()
    save(probe, OLD)
    store = faulty()
    save(store.at(str(probe)), NEW, writers=writers)
    shutil.rmtree(probe.parent)
    log = [(os.path.basename(c.path), c.nbytes or 0) for c in store.calls if c.kind in SPENDS]
    data = sum(n for name, n in log if name != "manifest.json")
    assert log[-1][0] == "manifest.json", log
    return log, data


SPENDS = ("write", "put")  # the calls that take disk space (FaultyStore.space counts them)

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
def test_enospc_from_write(tmp_path: Path, path: Path, case: str, writers: int) -> None:
    log, data = write_plan(tmp_path, writers)
    assert len({name for name, _ in log}) >= 4, log  # several data files plus the manifest
    save(path, OLD)
    store = faulty()
    space = store.space(BUDGETS[case](log, data))
    with pytest.raises(sp.CheckpointWriteError) as exc_info, deadline(SAVE_DEADLINE_S, "save"):
        save(store.at(str(path)), NEW, writers=writers)
    assert space.fired >= 1
    assert_failed_cleanly(exc_info, path, OLD, errno.ENOSPC)
    # Once space is back, the same save works.
    save(path, NEW, writers=writers)
    assert_same(sp.load(path), NEW)
    assert sorted(os.listdir(path.parent)) == [NAME]


def test_enospc_on_a_first_save_leaves_nothing(path: Path) -> None:
    store = faulty()
    store.space(10_000)
    with pytest.raises(sp.CheckpointWriteError) as exc_info, deadline(SAVE_DEADLINE_S, "save"):
        save(store.at(str(path)), NEW)
    assert_failed_cleanly(exc_info, path, None, errno.ENOSPC)


def test_enospc_creating_the_staging_directory(path: Path) -> None:
    save(path, OLD)
    store = faulty()
    fault = store.fail("mkdir", path=f"*{names.TMP_TAG}*")
    with pytest.raises(sp.CheckpointWriteError) as exc_info, deadline(SAVE_DEADLINE_S, "save"):
        save(store.at(str(path)), NEW)
    assert fault.fired == 1
    assert_failed_cleanly(exc_info, path, OLD, errno.ENOSPC)


# ---------------------------------------------------------------------------------------------
# injected fsync failures: the call that ends with an fsync fails once it has written
# ---------------------------------------------------------------------------------------------

# case -> (call kind, path pattern, which matching call, errno). A blob's ``finish`` (the
# manifest is one on a local disk) and ``sync_dir`` each end with an fsync.
FSYNC_CASES: dict[str, tuple[str, str, int, int]] = {
    "first-data-file": ("finish", "*/data-*", 1, errno.EIO),
    "third-data-file": ("finish", "*/data-*", 3, errno.EIO),
    "manifest": ("finish", "*/manifest.json", 1, errno.EIO),
    "staging-directory": ("sync_dir", f"*/*{names.TMP_TAG}*", 1, errno.EIO),
    "parent-directory": ("sync_dir", "*/parent", 1, errno.EIO),
    "data-file-enospc": ("finish", "*/data-*", 2, errno.ENOSPC),
}


def failing_fsync(case: str, **options: Any) -> tuple[FaultyStore, Fault]:
    kind, pattern, nth, code = FSYNC_CASES[case]
    store = faulty(**options)
    return store, store.fail(kind, path=pattern, nth=nth, code=code, after=True)


@pytest.mark.parametrize("replace", ["exchange", "two-renames"])
@pytest.mark.parametrize("case", list(FSYNC_CASES))
def test_fsync_failure(path: Path, case: str, replace: str) -> None:
    save(path, OLD)
    store, fault = failing_fsync(case, exchange=replace == "exchange")
    with pytest.raises(sp.CheckpointWriteError) as exc_info, deadline(SAVE_DEADLINE_S, "save"):
        save(store.at(str(path)), NEW)
    assert fault.fired == 1
    assert_failed_cleanly(exc_info, path, OLD, FSYNC_CASES[case][3])


@pytest.mark.parametrize(
    "case", ["first-data-file", "manifest", "staging-directory", "parent-directory"]
)
def test_fsync_failure_on_a_first_save_leaves_nothing(path: Path, case: str) -> None:
    store, fault = failing_fsync(case)
    with pytest.raises(sp.CheckpointWriteError) as exc_info, deadline(SAVE_DEADLINE_S, "save"):
        save(store.at(str(path)), NEW)
    assert fault.fired == 1
    assert_failed_cleanly(exc_info, path, None, FSYNC_CASES[case][3])


def test_fsync_failure_after_the_parent_was_synced_once(path: Path) -> None:
    # Two-rename replace: the parent is synced between the renames and again after the second.
    save(path, OLD)
    store = faulty(exchange=False)
    fault = store.fail("sync_dir", path="*/parent", nth=2, code=errno.EIO, after=True)
    with pytest.raises(sp.CheckpointWriteError) as exc_info, deadline(SAVE_DEADLINE_S, "save"):
        save(store.at(str(path)), NEW)
    assert fault.fired == 1
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


def test_enospc_opening_a_snapshot_history_directory(tmp_path: Path) -> None:
    store = faulty()
    store.fail({"mkdir", "makedirs"}, times=None)
    with pytest.raises(sp.CheckpointWriteError) as exc_info:
        sp.SnapshotHistory(2, directory=store.at(str(tmp_path / "history")))
    assert exc_info.value.errno == errno.ENOSPC, exc_info.value
    assert "free disk space" in str(exc_info.value)
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
