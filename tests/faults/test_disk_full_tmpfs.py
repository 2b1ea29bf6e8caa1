"""A real full disk: every write operation swept through every amount of free space on a tmpfs.

Operations: ``sp.save`` over a checkpoint (one data file, several, several written by three
threads) and to a new path; ``CheckpointManager.save`` (sync and ``async_save=True``, with
``keep_last`` so retention runs and ``best_metric`` so ``best/`` moves) and a first save into a
new run directory; ``AsyncCheckpointer.save``; a directory-backed ``SnapshotHistory`` (``push``
and ``take``); ``InferenceSnapshot.save``; ``sp.convert`` to ``.shrew`` v1 and v2, a
safetensors file and a boostr directory.

For each, on an empty tmpfs, the sweep first measures what the operation needs: statvfs before
and after an unhindered run, then the least free space with which it succeeds (bisection). Then
it runs the operation with every amount of free space from 0 to past that need, one page at a
time, and again with every number of free inodes (tmpfs charges one per file, directory and hard
link), so that each phase runs out once: data files, manifest, staging directory, report.json,
run.json, aliases. Every outcome must be one of

- success, and the result loads back exactly and verifies; or
- ``CheckpointWriteError`` with ``errno == ENOSPC`` (never a raw OSError, never another type),
  the previously committed data intact and loadable exactly, no temporary litter (nothing named
  ``*.savepoint-tmp-*`` or ``*.savepoint-old-*``), every page and inode it took given back, and
  the same operation succeeding once the space is freed.

Each sweep must also have failed in each of the scenario's phases (matched on the traceback of
the root cause), so a refactoring that moves a phase out of reach is noticed.

Mounting needs root; otherwise this file is re-run inside a new user + mount namespace
(``test_sweeps_in_a_user_namespace``); where neither works it skips, and the injection tests in
``test_disk_full.py`` remain. ``SAVEPOINT_TORTURE=1`` (``make torture``) sweeps states four
times bigger (more pages inside every file) and more variants.
"""

from __future__ import annotations

import errno
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import _torture
import savepoint as sp
from savepoint.formats import boostr, shrew
from savepoint.formats._files import SafetensorsFile
from savepoint.inference import InferenceSnapshot, SnapshotHistory
from savepoint.runs import layout
from savepoint.storage.local import LocalStore

from . import _tmpfs
from ._tmpfs import BLOCKS, INODES, Scenario, Sweep
from ._util import assert_same

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="tmpfs and user namespaces are Linux only"
)

TORTURE = _torture.ENABLED
TMPFS_BYTES = (64 if TORTURE else 8) << 20
TMPFS_INODES = 256  # plenty for every scenario; each sweep point refills the rest with fillers
IN_NAMESPACE = os.environ.get(_tmpfs.NAMESPACE_ENV) == "1"
# SAVEPOINT_TMPFS_USERNS=1 sends the sweeps through the user-namespace path even as root.
FORCE_NAMESPACE = os.environ.get("SAVEPOINT_TMPFS_USERNS") == "1" and not IN_NAMESPACE

# Failure sites (see _tmpfs.failure_site) of each phase.
DATA = r"write_all$"
DATA_OPEN = r"_open_for_write$"
# A conversion's or export's file made by the kernel-copy writer (formats/_kernel_copy.py: a
# source in the page cache, as a tmpfs one always is) is opened there instead.
COPY_OPEN = rf"{DATA_OPEN}|_kernel_copy\.write$"
STAGING_DIR = r"^transaction\.begin>local\.mkdir$"
# The manifest goes straight into the staging directory on a local disk (a blob), or through
# put; the report is staged aside (a blob) by a save, or put by write_json (never run.json).
MANIFEST = r"transaction\._write_staged_manifest>(local\.put>local\.write_small|local\.write>local\.write_all|local\.create_blob>.*_open_for_write)$"
REPORT = (
    r"(?<!write_run)>report\.(write_json>.*write_small|stage_json>.*(write_all|_open_for_write))$"
)
ALIAS = r"link_tree"
SAVE_PHASES = {
    BLOCKS: {"data files": DATA, "manifest": MANIFEST},
    INODES: {"staging directory": STAGING_DIR, "data files": DATA_OPEN, "manifest": MANIFEST},
}


# ---------------------------------------------------------------------------------------------
# states
# ---------------------------------------------------------------------------------------------

ROWS = 64 if TORTURE else 16


def make_state(seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {
        "model": {f"w{i}": rng.standard_normal((ROWS, 64)).astype(np.float32) for i in range(5)},
        "emb": rng.standard_normal((ROWS * 4, 8)).astype(ml_dtypes.bfloat16),
        "step": np.int64(seed),
        "tag": f"state-{seed}",
        "misc": [1, 2.5, None, b"bytes"],
    }


OLD = make_state(1)
NEW = make_state(2)
MAX_FILE_BYTES = ROWS * 64 * 4 * 2  # two of the model's tensors per data file


def flat_state(seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {f"t{i}": rng.standard_normal((ROWS, 48)).astype(np.float32) for i in range(4)}


def boostr_state(seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    model = {
        f"layer{i}.weight": rng.standard_normal((ROWS, 32)).astype(np.float32) for i in range(3)
    }
    return {
        "model": model,
        "optimizer": {f"{k}.m": v * 0.5 for k, v in model.items()},
        "step": seed,
        "epoch": 1,
        "learning_rate": 0.001,
    }


def shrew_state(seed: int) -> dict[str, Any]:
    """What .shrew v2 holds: a model, an OptimizerState and the training fields."""
    rng = np.random.default_rng(seed)
    model = {
        f"layer{i}.weight": rng.standard_normal((ROWS, 32)).astype(np.float32) for i in range(3)
    }
    buffers = {f"m.{i}": rng.standard_normal(ROWS * 8) for i in range(2)}
    return {
        "model": model,
        "optimizer": sp.OptimizerState("Adam", {"lr": 0.001}, buffers),
        "epoch": 1,
        "global_step": seed,
        "best_loss": 0.5,
        "loss_history": [1.0, 0.75, 0.5],
    }


def snapshot(i: int) -> InferenceSnapshot:
    rng = np.random.default_rng(i)
    return InferenceSnapshot(
        states=[rng.standard_normal((ROWS, 32)).astype(np.float32) for _ in range(2)],
        history=[np.full((8,), i, np.float32) for _ in range(3)],
        step_count=i,
        config={"layers": 2},
        metadata={"timestamp": i, "description": f"snap {i}"},
    )


# ---------------------------------------------------------------------------------------------
# operations
# ---------------------------------------------------------------------------------------------


def expect_write_error(err: BaseException | None, what: str) -> None:
    """A PendingSave's error is None or the CheckpointWriteError(ENOSPC) the caller got."""
    if err is not None and not (
        isinstance(err, sp.CheckpointWriteError) and err.errno == errno.ENOSPC
    ):
        raise AssertionError(f"{what} is {err!r}")


class SaveOver(Scenario):
    """``sp.save`` over a committed checkpoint."""

    def __init__(self, name: str, **options: Any) -> None:
        self.name = name
        self.options = options
        self.phases = SAVE_PHASES

    def path(self, work: Path) -> Path:
        return work / "ckpt"

    def prepare(self, work: Path) -> None:
        sp.save(self.path(work), OLD, metadata={"tag": "old"}, **self.options)

    def act(self, work: Path) -> None:
        sp.save(self.path(work), NEW, metadata={"tag": "new"}, **self.options)

    def check_done(self, work: Path) -> None:
        assert os.listdir(work) == ["ckpt"], os.listdir(work)
        assert_same(sp.load(self.path(work)), NEW)
        assert sp.verify(self.path(work)).metadata == {"tag": "new"}

    def check_intact(self, work: Path) -> None:
        assert os.listdir(work) == ["ckpt"], os.listdir(work)
        assert_same(sp.load(self.path(work)), OLD)
        assert sp.verify(self.path(work)).metadata == {"tag": "old"}


class SaveOverTwoRenames(SaveOver):
    """As SaveOver where the filesystem cannot exchange two directories atomically: the
    replace falls back to two renames (the local store's ``exchange`` answers False)."""

    def act(self, work: Path) -> None:
        mp = pytest.MonkeyPatch()
        mp.setattr(LocalStore, "exchange", lambda self, a, b: False)
        try:
            super().act(work)
        finally:
            mp.undo()


class SaveNew(SaveOver):
    """``sp.save`` to a path where nothing is yet."""

    def prepare(self, work: Path) -> None:
        pass

    def check_intact(self, work: Path) -> None:
        assert os.listdir(work) == [], os.listdir(work)
        with pytest.raises(sp.CheckpointNotFoundError):
            sp.load(self.path(work))


class AsyncSave(SaveOver):
    """``AsyncCheckpointer.save`` over a checkpoint: the error comes from ``wait()``, and the
    ``PendingSave`` reports the same error."""

    def __init__(self, name: str, direct: bool) -> None:
        super().__init__(name, max_file_bytes=MAX_FILE_BYTES)
        self.direct = direct

    def act(self, work: Path) -> None:
        with sp.AsyncCheckpointer(
            writer="thread", max_file_bytes=MAX_FILE_BYTES, direct=self.direct
        ) as ckpt:
            pending = ckpt.save(self.path(work), NEW, metadata={"tag": "new"})
            try:
                ckpt.wait()
            finally:
                expect_write_error(pending.exception(), "PendingSave.exception()")


STEPS = {1: (make_state(11), 3.0), 2: (make_state(12), 2.0), 3: (make_state(13), 1.0)}


class ManagedSave(Scenario):
    """``CheckpointManager.save`` of step 3 after steps 1 and 2, with ``keep_last=2`` (step 1 is
    pruned) and ``best_metric`` (``best/`` and ``latest/`` move to step 3)."""

    step = 3
    before: tuple[int, ...] = (1, 2)  # committed by prepare
    after: tuple[int, ...] = (2, 3)  # the run's steps after a successful save

    def __init__(self, name: str, async_save: bool) -> None:
        self.name = name
        self.async_save = async_save
        self.mgr: sp.CheckpointManager | None = None
        self.phases = {
            BLOCKS: {"data files": DATA, "manifest": MANIFEST, "report.json": REPORT},
            INODES: {**SAVE_PHASES[INODES], "report.json": REPORT, "aliases": ALIAS},
        }

    def run(self, work: Path) -> Path:
        return work / "run"

    def open(self, work: Path) -> sp.CheckpointManager:
        return sp.CheckpointManager(
            self.run(work),
            keep_last=2,
            best_metric="loss",
            keep_best=1,
            async_save=self.async_save,
            writer="thread" if self.async_save else None,  # (faults injected in this process)
            max_file_bytes=MAX_FILE_BYTES,
        )

    def prepare(self, work: Path) -> None:
        self.mgr = self.open(work)
        for step in self.before:
            state, loss = STEPS[step]
            self.mgr.save(step, state, {"loss": loss}).wait()

    def act(self, work: Path) -> None:
        if self.mgr is None:
            self.mgr = self.open(work)
        state, loss = STEPS[self.step]
        pending = self.mgr.save(self.step, state, {"loss": loss})
        if self.async_save:
            try:
                self.mgr.wait()
            finally:
                expect_write_error(pending.exception(), "PendingSave.exception()")
        else:
            pending.wait()

    def check_run(self, work: Path, steps: list[int]) -> None:
        """The manager, the step directories, the aliases and report.json all say ``steps``."""
        assert self.mgr is not None
        assert self.mgr.steps() == steps, self.mgr.steps()
        latest = steps[-1] if steps else None
        best = min(steps, key=lambda s: STEPS[s][1]) if steps else None
        assert self.mgr.latest_step() == latest
        assert self.mgr.best_step() == best
        for step in steps:
            assert_same(sp.load(self.mgr.step_path(step)), STEPS[step][0])
        report_path = self.run(work) / "report.json"
        if steps or report_path.exists():  # a run that never saved has no report yet
            report = json.loads(report_path.read_text())
            assert report["checkpoints"] == steps[::-1], report["checkpoints"]
        if latest is not None and best is not None:
            assert_same(sp.load(self.run(work) / "latest"), STEPS[latest][0])
            assert_same(sp.load(self.run(work) / "best"), STEPS[best][0])

    def check_done(self, work: Path) -> None:
        self.check_run(work, list(self.after))

    def check_intact(self, work: Path) -> None:
        # Whatever was committed before is still there and exact (retention may have pruned
        # step 1 before a failure after the commit: it is not needed once step 3 exists).
        steps = layout.committed_steps(str(self.run(work)))
        assert set(self.before[-1:]) <= set(steps) <= {*self.before, self.step}, steps
        for step in steps:
            assert_same(sp.load(layout.step_path(str(self.run(work)), step)), STEPS[step][0])

    def post_commit(self, work: Path) -> bool:
        return self.step in layout.committed_steps(str(self.run(work)))

    def semantic_problems(self, work: Path, failed: bool) -> list[str]:
        """After a failed save its step is not listed, and report.json and the aliases say the
        run is where it was (issue 11, item 2: either the save failed and the step is not
        listed, or it succeeded). With the disk still full, closing the manager succeeds or
        raises CheckpointWriteError(ENOSPC), and a manager reopened on the run agrees."""
        if not failed or not (self.run(work) / "run.json").exists():
            return []  # no run was created: nothing to reopen
        problems = []
        try:
            self.close()
        except sp.CheckpointWriteError as exc:
            if exc.errno != errno.ENOSPC:
                problems.append(f"close() on a full disk raised {exc!r}")
        except Exception as exc:
            problems.append(f"close() on a full disk raised {exc!r}")
        try:
            self.mgr = self.open(work)
        except Exception as exc:
            return [*problems, f"reopening the run on a full disk raised {exc!r}"]
        want = [s for s in self.before if s in layout.committed_steps(str(self.run(work)))]
        try:
            self.check_run(work, want)
        except (AssertionError, sp.CheckpointError) as exc:
            problems.append(f"after the failure the run is not at {want}: {exc!r}"[:500])
        return problems

    def recover(self, work: Path) -> None:
        self.act(work)
        self.check_done(work)
        self.close()  # a fresh manager on the same directory agrees
        self.mgr = self.open(work)
        self.check_run(work, list(self.after))

    def close(self) -> None:
        if self.mgr is not None:
            mgr, self.mgr = self.mgr, None
            mgr.close()


class ManagedFirstSave(ManagedSave):
    """A CheckpointManager opened on a new directory (run.json, checkpoints/) and its first save
    (report.json, latest/ and best/ created)."""

    step = 1
    before = ()
    after = (1,)
    keeps_nothing = False  # a failed first save may leave the new run (run.json, the lock)

    def __init__(self, name: str) -> None:
        super().__init__(name, async_save=False)
        self.phases = {
            BLOCKS: {
                "run.json": r"write_run>.*write_small$",
                "data files": DATA,
                "manifest": MANIFEST,
                "report.json": REPORT,
            },
            INODES: {
                "run directory": r"^(manager|opening)\.\w+(>local\.makedirs)?$",  # its own makedirs
                "run.json": r"write_run>",
                **SAVE_PHASES[INODES],
                "report.json": REPORT,
                "aliases": ALIAS,
            },
        }

    def prepare(self, work: Path) -> None:
        pass


class History(Scenario):
    """A directory-backed ``SnapshotHistory(max_snapshots=2)`` holding two snapshots gets a
    third (``push``, or ``take`` reusing the evicted snapshot's buffers): it is committed, then
    the oldest is deleted."""

    def __init__(self, name: str, take: bool) -> None:
        self.name = name
        self.take = take
        self.hist: SnapshotHistory | None = None
        self.phases = SAVE_PHASES

    def add(self, i: int) -> None:
        assert self.hist is not None
        s = snapshot(i)
        if self.take:
            self.hist.take(
                states=s.states,
                history=s.history,
                step_count=s.step_count,
                config=s.config,
                metadata=s.metadata,
            )
        else:
            self.hist.push(s)

    def prepare(self, work: Path) -> None:
        self.hist = SnapshotHistory(2, directory=work / "hist")
        self.add(1)
        self.add(2)

    def act(self, work: Path) -> None:
        self.add(3)

    def _check(self, work: Path, want: list[int]) -> None:
        assert self.hist is not None
        assert [self.hist.get(i) for i in range(len(self.hist))] == [snapshot(i) for i in want]
        reopened = SnapshotHistory(2, directory=work / "hist")
        assert [reopened.get(i) for i in range(len(reopened))] == [snapshot(i) for i in want]
        assert len(os.listdir(work / "hist")) == len(want), os.listdir(work / "hist")

    def check_done(self, work: Path) -> None:
        self._check(work, [3, 2])

    def check_intact(self, work: Path) -> None:
        self._check(work, [2, 1])

    def close(self) -> None:
        self.hist = None


class HistoryFirst(History):
    """A ``SnapshotHistory`` opened on a new directory, and its first snapshot."""

    keeps_nothing = False  # a failed first push may leave the new, empty directory

    def __init__(self, name: str) -> None:
        super().__init__(name, take=False)
        self.phases = {
            BLOCKS: SAVE_PHASES[BLOCKS],
            INODES: {"its directory": r"^history\.\w+(>local\.makedirs)?$", **SAVE_PHASES[INODES]},
        }

    def prepare(self, work: Path) -> None:
        pass

    def act(self, work: Path) -> None:
        if self.hist is None:
            self.hist = SnapshotHistory(2, directory=work / "hist")
        self.add(1)

    def check_done(self, work: Path) -> None:
        self._check(work, [1])

    def check_intact(self, work: Path) -> None:
        if self.hist is None:  # the directory could not be made
            assert not (work / "hist").exists()
        else:
            self._check(work, [])


class SnapshotSave(SaveOver):
    """``InferenceSnapshot.save`` over an earlier snapshot."""

    def __init__(self, name: str) -> None:
        super().__init__(name)

    def prepare(self, work: Path) -> None:
        snapshot(1).save(self.path(work))

    def act(self, work: Path) -> None:
        snapshot(2).save(self.path(work))

    def check_done(self, work: Path) -> None:
        assert os.listdir(work) == ["ckpt"], os.listdir(work)
        assert InferenceSnapshot.load(self.path(work)) == snapshot(2)

    def check_intact(self, work: Path) -> None:
        assert os.listdir(work) == ["ckpt"], os.listdir(work)
        assert InferenceSnapshot.load(self.path(work)) == snapshot(1)


class Convert(Scenario):
    """``sp.convert(source, target, overwrite=True)`` over an earlier conversion. The sources live
    off the tmpfs; results must equal, byte for byte, conversions made on an ordinary disk."""

    def __init__(
        self,
        name: str,
        target: str,
        fmt: str | None,
        state: Callable[[int], Any],
        phases: dict[str, dict[str, str]],
    ) -> None:
        self.name = name
        self.target = target
        self.fmt = fmt
        self.state = state
        self.phases = phases
        self.sources: dict[int, Path] = {}
        self.reference: dict[int, dict[str, bytes]] = {}

    def setup(self, scratch: Path) -> None:
        for seed in (1, 2):
            src = scratch / f"{self.name}-source-{seed}"
            sp.save(src, self.state(seed))
            self.sources[seed] = src
            ref = scratch / f"{self.name}-reference-{seed}" / self.target
            sp.convert(src, ref, format=self.fmt)
            self.reference[seed] = _contents(ref)

    def convert(self, work: Path, seed: int) -> None:
        assert self.sources, "setup() first"
        sp.convert(self.sources[seed], work / self.target, format=self.fmt, overwrite=True)

    def prepare(self, work: Path) -> None:
        self.convert(work, 1)

    def act(self, work: Path) -> None:
        self.convert(work, 2)

    def _check(self, work: Path, seed: int) -> None:
        assert os.listdir(work) == [self.target], os.listdir(work)
        assert _contents(work / self.target) == self.reference[seed]
        target = str(work / self.target)
        if self.target.endswith(".shrew"):
            shrew.verify(target)
        elif self.target.endswith(".safetensors"):
            with SafetensorsFile(target) as f:
                for name in f.names():
                    f.tensor(name).load()
        else:
            boostr.verify(target)

    def check_done(self, work: Path) -> None:
        self._check(work, 2)

    def check_intact(self, work: Path) -> None:
        self._check(work, 1)


def _contents(path: Path) -> dict[str, bytes]:
    if path.is_file():
        return {"": path.read_bytes()}
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


SHREW_PHASES = {
    # The file goes through a buffered writer: its bytes reach the disk while tensors are
    # written, and the last of them when it is flushed for the fsync.
    BLOCKS: {"the file's bytes": r"_shrew_write\.|_files\.fsync_file$"},
    INODES: {"the file": r"shrew\._write$"},
}
BOOSTR_PHASES = {
    BLOCKS: {
        "safetensors files": DATA,
        "training_state.json": r"_boostr_single\.write>local\.write_small$",
    },
    INODES: {
        "staging directory": STAGING_DIR,
        "safetensors files": COPY_OPEN,
        "training_state.json": r"_boostr_single\.write>local\.write_small$",
    },
}


def scenarios() -> list[Scenario]:
    out: list[Scenario] = [
        SaveOver("save-over-one-file"),
        SaveOver("save-over-several-files", max_file_bytes=MAX_FILE_BYTES),
        SaveOver("save-over-three-writers", max_file_bytes=MAX_FILE_BYTES, writers=3),
        SaveNew("save-new", max_file_bytes=MAX_FILE_BYTES),
        AsyncSave("async-checkpointer", direct=True),
        ManagedSave("manager-sync", async_save=False),
        ManagedSave("manager-async", async_save=True),
        ManagedFirstSave("manager-new-run"),
        History("history-push", take=False),
        History("history-take", take=True),
        HistoryFirst("history-new-directory"),
        SnapshotSave("snapshot-save"),
        Convert("convert-shrew-v1", "model.shrew", None, flat_state, SHREW_PHASES),
        Convert("convert-shrew-v2", "train.shrew", None, shrew_state, SHREW_PHASES),
        Convert(
            "convert-safetensors",
            "model.safetensors",
            None,
            flat_state,
            {BLOCKS: {"data": DATA}, INODES: {"the file": COPY_OPEN}},
        ),
        Convert("convert-boostr", "boostr-ckpt", "boostr", boostr_state, BOOSTR_PHASES),
    ]
    if TORTURE:
        out += [
            SaveOverTwoRenames("save-over-two-renames", max_file_bytes=MAX_FILE_BYTES),
            AsyncSave("async-checkpointer-buffered", direct=False),
        ]
    return out


SCENARIOS = {s.name: s for s in scenarios()}

# ---------------------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------------------

_RESULTS: dict[tuple[str, str], Sweep] = {}


def sweep(root: Path, scratch: Path, name: str, resource: str) -> Sweep:
    """The sweep of one scenario over one resource (run once; two tests read it)."""
    key = (name, resource)
    if key not in _RESULTS:
        sc = SCENARIOS[name]
        if isinstance(sc, Convert) and not sc.sources:
            sc.setup(scratch)
        inodes = TMPFS_INODES if resource == INODES else None
        with _tmpfs.mounted(root, TMPFS_BYTES, inodes) as fs:
            _RESULTS[key] = _tmpfs.Sweeper(fs, sc, resource).sweep()
    return _RESULTS[key]


def _mount_skip_reason() -> str | None:
    if FORCE_NAMESPACE:
        return "SAVEPOINT_TMPFS_USERNS=1: test_sweeps_in_a_user_namespace runs these"
    problem = _tmpfs.mount_problem()
    if problem is None:
        return None
    if IN_NAMESPACE:
        return f"even in a user namespace: {problem}"
    return f"{problem}; test_sweeps_in_a_user_namespace runs these in a user namespace"


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tmpfs-sources")


@pytest.fixture
def mountpoint(tmp_path: Path) -> Path:
    reason = _mount_skip_reason()
    if reason is not None:
        pytest.skip(reason)
    return tmp_path / "mnt"


SWEEPS = [
    pytest.param(name, resource, id=f"{name}-{resource}")
    for name in SCENARIOS
    for resource in (BLOCKS, INODES)
]


@pytest.mark.parametrize(("name", "resource"), SWEEPS)
def test_full_disk_sweep(scratch: Path, mountpoint: Path, name: str, resource: str) -> None:
    result = sweep(mountpoint, scratch, name, resource)
    problems = result.problems()
    assert not problems, f"{result.describe()}\n" + "\n".join(problems)
    assert result.points[0].failed, "the operation succeeded without any free space"
    assert not result.points[-1].failed, "the sweep never reached enough free space"
    missing = result.missing_phases(SCENARIOS[name].phases[resource])
    assert not missing, f"{result.describe()}\nnever failed in: {missing}"


MANAGED = [
    pytest.param(name, resource, id=f"{name}-{resource}")
    for name, sc in SCENARIOS.items()
    if isinstance(sc, ManagedSave)
    for resource in (BLOCKS, INODES)
]


@pytest.mark.parametrize(("name", "resource"), MANAGED)
def test_managed_save_that_failed_is_not_listed(
    scratch: Path, mountpoint: Path, name: str, resource: str
) -> None:
    """A managed save that ran out of space after committing its checkpoint (writing
    report.json, linking the aliases) raised CheckpointWriteError(ENOSPC), its step is not
    listed, report.json and latest/ and best/ agree with the steps on disk, and the manager
    closes (or says the disk is full) and reopens on the full disk."""
    result = sweep(mountpoint, scratch, name, resource)
    # The manager's bookkeeping after a commit runs in the run's books (runs.books.Books.record).
    after_commit = [p.free for p in result.points if p.failed and "books.record" in p.site]
    assert after_commit, f"{result.describe()}\nno point failed after the commit"
    semantic = result.semantic()
    assert not semantic, f"{result.describe()}\n" + "\n".join(semantic)


def test_sweeps_in_a_user_namespace(tmp_path: Path) -> None:
    """Where this process cannot mount a tmpfs (not root), the sweeps above run in a pytest
    process in a new user + mount namespace, where it can. Where this process can mount, a
    small part of them still runs there, so the fallback itself stays tested."""
    if IN_NAMESPACE:
        pytest.skip("already in the user namespace")
    problem = _tmpfs.namespace_problem()
    if problem is not None:
        pytest.skip(f"{problem}; test_disk_full.py injects full disks instead")
    everything = FORCE_NAMESPACE or _tmpfs.mount_problem() is not None
    argv = [
        sys.executable,
        "-m",
        "pytest",
        str(Path(__file__).resolve()),
        "-q",
        "-p",
        "no:cacheprovider",
        f"--basetemp={tmp_path / 'inner'}",
        "-k",
        "not user_namespace" if everything else "save-new-blocks",
    ]
    done = _tmpfs.run_in_user_namespace(argv, timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-12000:]
    summary = done.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary, output[-12000:]
