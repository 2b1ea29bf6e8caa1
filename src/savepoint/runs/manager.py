"""``CheckpointManager``: a run directory whose checkpoints survive crashes, full disks and retention.

Opening (``CheckpointManager(directory, ...)``): a manager that can write the directory takes the
run's writer lock (:mod:`savepoint.runs.lock`; with a ``process_group`` only rank 0 does, the rank
that keeps the books), so a second writer gets RunLockedError naming the holder. It then removes
temporaries of dead processes and repairs what an interrupted writer left: it finishes deletions
the report lists as ``discarding``, lists checkpoints a killed save committed but did not record
(nothing committed is dropped), and makes ``latest/`` and ``best/`` agree with ``report.json``
(republished, or removed when the report names no such checkpoint). A directory this process
cannot write (read-only media, no write permission, or ``read_only=True``) gives a *read-only*
manager: it writes nothing and takes no lock; ``steps``, ``latest_step``, ``best_step`` and
``restore`` work, ``save`` raises CheckpointWriteError. Unreadable run files are
CheckpointPermissionError. A run that lost its ``run.json`` gets it back from the identity its
``report.json`` records; a damaged ``report.json`` is CorruptCheckpointError saying how to have it
rebuilt. An open that fails writes nothing.

One writer, checked at every save: the writer lock is checked before each save and at
``close()``; a manager in a forked child, or one whose lock file was replaced (another writer may
have written the run since), raises RunLockedError and writes nothing more, not even at
``close()`` (:mod:`savepoint.runs.lock`). Threads may share a manager: ``save``, ``restore`` and
``close`` run one at a time.

Sequence of ``save(step, state, metrics)``:

1. the save policy decides whether this step is written (``force=True`` always writes);
2. the checkpoint is written with the commit protocol to ``checkpoints/step-<step>``
   (synchronously, or snapshotted and written in the background with ``async_save=True``). If a
   checkpoint of that step already exists it is first hard-linked aside (copied where the store
   has no hard links), so a failed save can put it back;
3. once committed, the run's books: after a resume, checkpoints newer than this step (the
   abandoned timeline) leave the run; retention picks the checkpoints to delete, after reading the
   new one back and verifying it (manifest and every checksum; if that fails nothing is deleted
   and, once the save is otherwise complete, CorruptCheckpointError is raised). Retention never
   deletes the newest checkpoint, the current best, or the checkpoint this run resumed from;
4. the aliases that change are staged (a commit transaction each, its staging filled with hard
   links: the last step that needs free space), then ``report.json`` is replaced atomically: it
   lists the new checkpoint, no longer lists the ones being deleted, and names them under
   ``discarding``;
5. the staged aliases are committed (an alias the report no longer names is removed);
6. the checkpoints under ``discarding`` are deleted, and the report is rewritten without them.

Failure semantics. Every error out of the manager (``save``, ``PendingSave.wait()`` and
``exception()`` of an async save, ``wait``, ``close``, ``restore``) is a CheckpointError subclass,
usage errors aside (a bad argument is ValueError, a closed manager RuntimeError);
a failed write is CheckpointWriteError with the failing call's ``errno`` (``errno.ENOSPC`` for a
full disk), never a raw OSError and never the bare base class. A save that fails in steps 2-5 has
*not* happened: the checkpoint is removed again (or the previous checkpoint of that step put
back), ``report.json`` and the aliases are as they were, nothing was deleted, and the message says
so. Only if undoing fails as well does the error say what is left (the next open repairs it). A
failure in step 6 does not fail the save: the checkpoints stay on disk, are not part of the run
(not in ``steps()`` or the report), and the deletion is retried by the next save, ``close()`` or
open. A SIGKILL at any point leaves the old run or the new one: a checkpoint committed in step 2 is
kept and listed by the next open, even if its books were never written. A background save whose
commit fails does not count as a save for the save policy (nor does a failed synchronous one). An
exception leaving a ``with CheckpointManager(...)`` block is not replaced by a failure of the
``close()`` it triggers: that error is attached to it as a note (printed on Python 3.10).

``restore(into, step="latest")`` writes nothing: it reads checkpoints only, so it works on
read-only media. Its bookkeeping (lineage, history truncated after the step resumed from) is
written by the next save or by ``close()``. It tries the newest checkpoint first; one that fails
verification is skipped with a warning and the next older one is tried. It returns the step
restored, or None when the run has no checkpoint at all (a fresh start: the only case that returns
None). If checkpoints exist but none is intact, it raises CorruptCheckpointError rather than start
over. "latest" and "best" are resolved from the checkpoints and their metrics, never through the
alias directories. Next to a live writer (``read_only=True``), a checkpoint the writer deletes or
replaces while it is being read is never taken for a corrupt one: "latest" and "best" choose again
(a read-only manager rereads the report's ``discarding`` and reads the metrics of checkpoints saved
after it opened), an explicit step deleted meanwhile is CheckpointNotFoundError saying so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar, Literal

from savepoint import checkpoint
from savepoint.async_.checkpointer import AsyncCheckpointer
from savepoint.async_.pending import PendingSave
from savepoint.codecs import manifest as mf
from savepoint.commit.transaction import discard
from savepoint.commit.transaction import resolve as resolve_commit
from savepoint.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointPermissionError,
    CheckpointWriteError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    MissingCheckpointError,
    RunLockedError,
    RunMismatchError,
)
from savepoint.info import CheckpointInfo
from savepoint.options import SaveOptions
from savepoint.runs import aliases, layout, policies
from savepoint.runs.gc import GcReport, collect
from savepoint.runs.lock import WriterLock
from savepoint.runs.policies import Entry, Mode, RetentionPolicy, SavePolicy
from savepoint.runs.report import (
    REPORT_FILE,
    RUN_FILE,
    Report,
    RunInfo,
    check_consistent,
    config_diff,
    count_elements,
    lagging_run,
    load_report,
    now_iso,
    plain_value,
    read_json,
    write_json,
)
from savepoint.storage.paths import Location, PathArg, resolve

__all__ = ["CheckpointManager", "StepSpec"]

StepSpec = int | Literal["latest", "best"]
_RESTORE_TRIES = 20
_READ_ONLY_ERRNOS = (errno.EROFS, errno.EACCES, errno.EPERM)
_HINTS = {
    errno.ENOSPC: "free disk space and save again",
    errno.EDQUOT: "free quota and save again",
    errno.EROFS: "the filesystem is read-only",
    errno.EACCES: "check the permissions of the run directory",
}


class CheckpointManager:
    """Saves, restores and prunes the checkpoints of one training run in ``directory``.

    ``directory`` is a local path, a URL (``memory://run``) or a
    :class:`~savepoint.storage.paths.Location` (``store.at(path)``): every file of the run is
    read and written through that store, and ``directory`` and messages show it as its URL (a
    plain path on the local disk). On a store without atomic renames (an object store) each
    checkpoint and alias commits manifest-last (:mod:`savepoint.commit.transaction`).

    How checkpoints are written: ``options`` (a :class:`~savepoint.options.SaveOptions`) and/or
    its fields as keywords (``max_file_bytes``, ``writers``, ``direct``, ``progress``,
    ``process_group``, ``timeout``), checked here: an unknown or invalid option is a TypeError or
    ValueError from this constructor, naming it, before anything is touched. ``save_options`` is
    the result.

    Retention (a step is kept if any rule wants it; with no rule, every checkpoint is kept):
    ``keep_last`` newest steps, ``keep_best`` best by ``best_metric`` (``best_mode`` "min" or
    "max", ties to the later step), ``keep_every`` multiples of that step, or any ``retention``
    policy object from :mod:`savepoint.runs.policies`. ``save_every`` (or a ``save_policy``)
    makes ``save`` skip steps. ``name``, ``variant``, ``config`` and ``num_params`` describe the
    run in ``run.json``; opening an existing run with a different name, variant or ``num_params``
    is a RunMismatchError. A different ``config`` is a change of the run's config: it warns
    (UserWarning naming the keys), becomes the config of ``run.json`` and ``report.json``, and
    ``report.json``'s ``config_changes`` records each key's old and new value and the latest
    committed step at that open; ``strict_config=True`` refuses it instead (RunMismatchError naming
    the keys). A read-only manager only warns. Without ``num_params`` a new run records the element
    count of its first saved state (:func:`savepoint.runs.report.count_elements`).
    Without ``best_metric``, an existing run keeps ranking by the metric its report names.

    ``read_only``: None (the default) opens read-only exactly when the directory cannot be written
    (read-only media, no permission); True never writes and takes no lock (a reader next to a live
    writer); False requires write access (CheckpointWriteError otherwise). ``read_only`` and
    ``read_only_reason`` say what was chosen. A writing manager holds the run's writer lock until
    ``close()`` (or until it is garbage collected): a second one raises RunLockedError.
    """

    # The read-only view (savepoint.runs.view) opens inconsistent runs too, to list their problems.
    _check_on_open: ClassVar[bool] = True

    def __init__(
        self,
        directory: PathArg,
        *,
        keep_last: int | None = None,
        keep_best: int | None = None,
        best_metric: str | None = None,
        best_mode: Mode = "min",
        keep_every: int | None = None,
        save_every: int | None = None,
        async_save: bool = False,
        retention: RetentionPolicy | None = None,
        save_policy: SavePolicy | None = None,
        name: str | None = None,
        variant: str | None = None,
        config: Mapping[str, Any] | None = None,
        num_params: int | None = None,
        verify_before_prune: bool = True,
        aliases: bool = True,
        read_only: bool | None = None,
        strict_config: bool = False,
        options: SaveOptions | None = None,
        **save_options: Any,
    ) -> None:
        # Every argument is checked before anything is touched; every save option here, not at
        # the first save (savepoint.options).
        self.save_options = SaveOptions.of(save_options, base=options)
        flags = {
            "async_save": async_save,
            "verify_before_prune": verify_before_prune,
            "aliases": aliases,
            "strict_config": strict_config,
        }
        for flag, value in flags.items():
            if not isinstance(value, bool):
                raise TypeError(f"{flag} must be a bool, not {type(value).__name__} ({value!r})")
        if read_only is not None and not isinstance(read_only, bool):
            raise TypeError(
                f"read_only must be None, True or False, not {type(read_only).__name__} "
                f"({read_only!r})"
            )
        if keep_best is not None and best_metric is None:
            raise ValueError("keep_best needs best_metric (the metric to rank checkpoints by)")
        if best_mode not in ("min", "max"):
            raise ValueError(f"best_mode must be 'min' or 'max', not {best_mode!r}")
        rules: list[RetentionPolicy] = []
        if keep_last is not None:
            rules.append(_policy("keep_last", policies.KeepLatest, keep_last))
        if keep_best is not None and best_metric is not None:
            rules.append(_policy("keep_best", policies.KeepBest, keep_best, best_metric, best_mode))
        if keep_every is not None:
            rules.append(_policy("keep_every", policies.KeepEvery, keep_every))
        every: SavePolicy | None = None
        if save_every is not None:
            every = _policy("save_every", policies.SaveEvery, save_every)
        self._run = resolve(directory, what="run directory")
        self._store = self._run.store
        self.directory = str(self._run)
        self.best_metric = best_metric
        self.best_mode: Mode = best_mode
        if retention is not None:
            rules.append(retention)
        self.retention: RetentionPolicy = (
            policies.AnyOf(*rules) if rules else policies.AnyOf(policies.KeepAll())
        )
        if save_policy is None:
            save_policy = every if every is not None else policies.SaveAlways()
        self.save_policy = save_policy
        self.verify_before_prune = verify_before_prune
        self.aliases = aliases
        # With a process group every rank saves its part; the run's bookkeeping (report, aliases,
        # retention, the writer lock) is done by rank 0 alone, so no two processes rewrite the
        # same files.
        self._leader = _rank(self.save_options.process_group) == 0
        self._lock = threading.RLock()
        # save(), restore() and close() run one at a time (threads sharing a manager): two saves
        # at once would stage into one buffer, or verify a checkpoint the other is replacing.
        self._saving = threading.RLock()
        self._async = AsyncCheckpointer(**self.save_options.changed()) if async_save else None
        self._closed = False
        self._pid = os.getpid()
        self._started = time.monotonic()
        self._resumed_from: int | None = None
        self._verified: set[int] = set()
        self._last_saved: int | None = None
        # Steps no longer part of the run whose deletion is pending, and what report.json on disk
        # lists as such (a step there must not be reused before the report stops listing it).
        # (Both are replaced, never mutated: the background thread of an async save updates
        # them while the caller's thread reads them.)
        self._discarding: frozenset[int] = frozenset()
        self._discarding_on_disk: frozenset[int] = frozenset()
        # On object stores retention's deletions run here, behind the save that decided them.
        self._deleter: threading.Thread | None = None
        self._inflight: int | None = None  # the step an async save is writing
        self._last_async: _AsyncSave | None = None
        self._lock_error_raised = False
        self._release: Callable[[], object] | None = None
        self.read_only_reason: str | None = None
        # Whether close() has anything to write: a save, a log, a resume, or a report to create.
        # (Opening and restoring without resuming leave report.json byte for byte as it was.)
        self._dirty = False
        self._strict_config = strict_config
        self._config_changes: list[dict[str, Any]] = []
        self._new_config: dict[str, Any] | None = None
        try:
            self.read_only, self._writer = self._open_directory(read_only)
            if self._writer is not None:
                # Garbage collection releases the lock of a manager never closed (the finalizer
                # holds the lock object, not the manager). Not at interpreter exit: background
                # saves are finished then (async_.checkpointer), still under the lock, which
                # the kernel drops when the process ends.
                release = weakref.finalize(self, self._writer.release)
                release.atexit = False
                self._release = release
            self.run, new_run_file, report = self._open_run(name, variant, config, num_params)
            listed = report.checkpoints if report is not None else ()
            on_disk = layout.committed_steps(self._run, expected=listed)
            self.report = self._open_report(report, on_disk)
            lagging = lagging_run(self.run, self.report)
            if lagging is not None:  # a writer was stopped between report.json and run.json
                self.run, new_run_file = lagging, True
            if new_run_file:
                # Only now: an open that fails (a mismatch, a damaged report) writes nothing.
                self._finish_open_run()
            if self.best_metric is None and self.report.best:
                metric, mode = self.report.best.get("metric"), self.report.best.get("mode")
                if isinstance(metric, str) and mode in ("min", "max"):
                    self.best_metric, self.best_mode = metric, mode
            self._wall_before = self.report.wall_time_s
            pending = set(self.report.discarding) - set(self.report.checkpoints)
            self._discarding_on_disk = frozenset(self.report.discarding)
            self._discarding = frozenset(pending & set(on_disk))
            self._metrics: dict[int, dict[str, Any]] = {}
            self._metrics_seen: dict[int, Any] = {}  # manifest identities (read-only managers)
            for step in (s for s in on_disk if s not in self._discarding):
                if self.read_only:
                    self._metrics_seen[step] = self._manifest_id(step)
                self._metrics[step] = self._read_metrics(step)
            if self._config_changes:
                self._record_config_change()
            if self._writes_books():
                self._repair()
        except BaseException as exc:
            self._release_lock()
            if self._async is not None:
                self._async.close()
            if isinstance(exc, OSError) and not isinstance(exc, CheckpointError):
                # The store refused to be looked at (no such bucket, a refused credential, an
                # unreachable endpoint): a savepoint error naming the run, the cause below.
                raise _open_error(self.directory, exc) from exc
            raise

    # -- opening -----------------------------------------------------------------------------

    def _open_directory(self, read_only: bool | None) -> tuple[bool, WriterLock | None]:
        """Create the directory and take the writer lock: (read-only?, the lock if taken)."""
        if read_only:
            self.read_only_reason = "opened with read_only=True"
            return True, None
        store, checkpoints = self._store, self._run.join(layout.CHECKPOINTS)
        found = store.stat(checkpoints.path)
        if found is not None and not layout.is_dir(checkpoints):
            raise CheckpointWriteError(
                f"{checkpoints} is not a directory, but a run keeps its checkpoints there: move it "
                "out of the way and open the run again",
                path=str(checkpoints),
                errno=errno.ENOTDIR,
            )
        if not self._leader:
            # Other ranks write only their part of each checkpoint, never the run's books.
            with contextlib.suppress(OSError):
                store.makedirs(checkpoints.path)
            return False, None
        exists = layout.is_dir(self._run)
        if exists and self._run.is_local:
            problem = _not_writable(self._run.path, checkpoints.path)
            if problem is not None and read_only is None:
                self.read_only_reason = problem[1]
                return True, None
            if problem is not None:
                raise CheckpointWriteError(
                    f"cannot open {self.directory} for writing (read_only=False): {problem[1]}",
                    path=self.directory,
                    errno=problem[0],
                )
        try:
            store.makedirs(checkpoints.path)
            writer = WriterLock.acquire(self._run)
        except CheckpointError:
            raise
        except OSError as exc:
            if read_only is None and exists and exc.errno in _READ_ONLY_ERRNOS:
                self.read_only_reason = f"{os.strerror(exc.errno or 0)} ({exc.filename})"
                return True, None
            raise _write_error(f"cannot open the run directory {self.directory}", exc) from exc
        with contextlib.suppress(OSError, CheckpointError):  # tidying is best effort
            layout.clean_stale_in(store, checkpoints.path)
            layout.clean_stale_in(store, self._run.path)
        return False, writer

    def _writes_books(self) -> bool:
        return self._leader and not self.read_only

    def _release_lock(self) -> None:
        if self._release is not None:
            self._release()

    def _drop(self, path: str | None) -> None:
        """Remove a temporary (a backup) without letting cleanup hide an error."""
        if path is not None:
            with contextlib.suppress(OSError):
                self._store.remove_tree(path)

    def _open_run(
        self,
        name: str | None,
        variant: str | None,
        config: Mapping[str, Any] | None,
        num_params: int | None,
    ) -> tuple[RunInfo, bool, Report | None]:
        """What the run is, whether ``run.json`` must be written (the caller writes it once
        the whole open has succeeded), and ``report.json`` as read (None: the run has none yet).
        A run that lost its ``run.json`` (its report remains) gets back the identity its report
        records; a new run gets the one given here."""
        where = self._run.join(RUN_FILE)
        path = str(where)
        doc = read_json(where)
        wanted = RunInfo(
            name=name or self._store.basename(self._run.path),
            variant=variant,
            config=_plain(dict(config or {})),
            num_params=num_params,
        )
        stale = doc is None
        if doc is not None:
            run, source = RunInfo.from_json(doc, path), RUN_FILE
            # Compare with what the run really is: a writer stopped between report.json and
            # run.json left run.json behind (report.lagging_run); the caller's config is checked
            # against the caught-up one, and run.json is rewritten once the open succeeds.
            report = load_report(self._run)
            caught_up = lagging_run(run, report) if report is not None else None
            if caught_up is not None:
                run, stale = caught_up, True
        else:
            report = load_report(self._run)
            if report is None:
                return wanted, True, None
            source = REPORT_FILE
            run = RunInfo(
                name=report.name,
                variant=report.variant,
                config=report.config,
                num_params=report.num_params,
            )
        problems = []
        if name is not None and name != run.name:
            problems.append(f"name {name!r} ({source} has {run.name!r})")
        if variant is not None and variant != run.variant:
            problems.append(f"variant {variant!r} ({source} has {run.variant!r})")
        if config is not None and wanted.config != run.config:
            changes = config_diff(run.config, wanted.config)
            if self._strict_config:
                keys = ", ".join(c["key"] for c in changes)
                problems.append(f"a different config (keys: {keys}; strict_config=True)")
            else:
                self._config_changes, self._new_config = changes, wanted.config
        if num_params is not None and num_params != run.num_params:
            problems.append(f"num_params {num_params} ({source} has {run.num_params})")
        if problems:
            raise RunMismatchError(
                f"{self.directory} is an existing run, opened with {'; '.join(problems)}; use "
                "another directory for a different run",
                path=self.directory,
            )
        return run, stale, report

    def _finish_open_run(self) -> None:
        """Write the ``run.json`` that :meth:`_open_run` decided on (the books' writer only)."""
        if not self._writes_books():
            return
        where = self._run.join(RUN_FILE)
        try:
            write_json(where, self.run.to_json())
        except OSError as exc:
            raise _write_error(f"cannot create {where}", exc) from exc

    def _open_report(self, report: Report | None, on_disk: list[int]) -> Report:
        if report is None:
            self._dirty = True  # close() writes the first report.json
            return Report.for_run(self.run)
        if self._check_on_open:
            check_consistent(self.directory, self.run, report, on_disk)
        return report

    def _record_config_change(self) -> None:
        """Warn about the config change found at open; a writer records it (report.json first,
        then run.json: a run.json left behind by a kill in between is brought up to date by the
        next open, see report.lagging_run)."""
        assert self._new_config is not None
        # Against the run's config as the report records it (run.json may have lagged behind).
        self._config_changes = config_diff(self.run.config, self._new_config)
        if not self._config_changes:
            return
        keys = ", ".join(c["key"] for c in self._config_changes)
        step = self.latest_step()
        if not self._writes_books():
            warnings.warn(
                f"{self.directory} was opened with a config that differs from its run.json in "
                f"{keys}; this read-only manager records nothing",
                stacklevel=3,
            )
            return
        self.report.config = self._new_config
        self.report.config_changes.append(
            {"step": step, "at": now_iso(), "changes": self._config_changes}
        )
        self.run = dataclasses.replace(self.run, config=self._new_config)
        try:
            self._store_report()
        except OSError as exc:
            raise _write_error(f"cannot record the config change in {REPORT_FILE}", exc) from exc
        self._finish_open_run()
        warnings.warn(
            f"{self.directory}: the run's config changed at step {step} ({keys}); recorded in "
            f"{REPORT_FILE} under config_changes (strict_config=True refuses config changes)",
            stacklevel=3,
        )

    def _read_metrics(self, step: int) -> dict[str, Any]:
        try:
            meta = checkpoint.inspect(self._checkpoint(step)).metadata
        except (CheckpointError, OSError):
            return {}
        run_meta = meta.get("savepoint_run")
        return dict(run_meta.get("metrics") or {}) if isinstance(run_meta, dict) else {}

    def _repair(self) -> None:
        """Finish what an interrupted writer left (see the module docstring), then make the
        aliases agree with the report."""
        with self._lock:
            self._finish_discards()
            r = self.report
            live = self.steps()
            unlisted = [s for s in live if s not in r.checkpoints]
            for step in unlisted:  # committed by a save that was killed before its books
                if self._metrics.get(step):
                    r.metric_history.setdefault(step, {}).update(self._metrics[step])
                r.steps_completed = max(r.steps_completed, step)
            before = (r.checkpoints, r.latest_step, r.best, r.discarding)
            self._fill_report(live)
            if (r.checkpoints, r.latest_step, r.best, r.discarding) != before:
                try:
                    self._store_report()
                except OSError as exc:
                    raise _write_error(
                        f"cannot repair {REPORT_FILE} of {self.directory}", exc
                    ) from exc
            self._repair_aliases()

    def _repair_aliases(self) -> None:
        """Make each alias hold the checkpoint the report names: republish it, or remove it when
        the report names none (or republishing fails: a missing alias misleads nobody)."""
        for alias, step in aliases.targets(self.report).items():
            path = aliases.path_of(self._run, alias)
            if step is not None and aliases.holds(self._run, alias, step):
                continue
            if self._store.stat(path.path) is None and (step is None or not self.aliases):
                continue
            if step is not None and self.aliases:
                try:
                    aliases.publish(self._run, alias, step)
                    continue
                except OSError:
                    pass
            try:
                aliases.remove(self._run, alias)
            except OSError as exc:
                raise _write_error(
                    f"{path} disagrees with {REPORT_FILE} and cannot be removed", exc
                ) from exc

    # -- queries -------------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Steps with a committed checkpoint that is part of the run, ascending."""
        return [
            s
            for s in layout.committed_steps(self._run, expected=self.report.checkpoints)
            if s not in self._discarding
        ]

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def best_step(self) -> int | None:
        """The best step by ``best_metric`` among the checkpoints on disk, or None."""
        return self._best_among(self.steps())

    def _best_among(self, steps: list[int]) -> int | None:
        if self.best_metric is None:
            return None
        entries = [Entry(s, self._metrics_of(s)) for s in steps]
        best = policies.best_entries(entries, self.best_metric, self.best_mode)
        return best[0].step if best else None

    def step_path(self, step: int) -> str:
        """Checkpoint ``step``'s directory, as ``sp.load`` takes it (a URL off the local disk)."""
        return str(self._step(step))

    def _step(self, step: int) -> Location:
        return layout.step_location(self._run, step)

    def _checkpoint(self, step: int) -> str | Location:
        """Checkpoint ``step`` as the path argument of ``savepoint.checkpoint``'s functions."""
        return layout.checkpoint_arg(self._step(step))

    def metrics(self, step: int) -> dict[str, Any]:
        return dict(self._metrics.get(step, {}))

    def _metrics_of(self, step: int) -> dict[str, Any]:
        """A checkpoint's metrics; read from its manifest the first time for a checkpoint this
        manager did not save (a read-only manager next to a live writer sees new ones)."""
        known = self._metrics.get(step)
        if self.read_only:
            # The writer may have saved this step again since: the manifest's identity says so.
            seen = self._manifest_id(step)
            if known is None or self._metrics_seen.get(step) != seen:
                known = self._metrics[step] = self._read_metrics(step)
                self._metrics_seen[step] = seen
            return known
        if known is None:
            known = self._metrics[step] = self._read_metrics(step)
        return known

    # -- saving --------------------------------------------------------------------------------

    def save(
        self,
        step: int,
        state: Any,
        metrics: Mapping[str, Any] | None = None,
        *,
        force: bool = False,
        epoch: int | None = None,
    ) -> PendingSave:
        """Save ``state`` as checkpoint ``step`` (unless the save policy skips it).

        Either the save happens completely or, on CheckpointWriteError, not at all (see the
        module docstring for the one exception, a failed verification before pruning). Threads
        may share a manager: their saves run one after the other."""
        self._check_open()
        with self._saving:
            return self._save(step, state, metrics, force, epoch)

    def _save(
        self,
        step: int,
        state: Any,
        metrics: Mapping[str, Any] | None,
        force: bool,
        epoch: int | None,
    ) -> PendingSave:
        self._check_open()
        if self._async is not None:
            self._raise_background_error()
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, not {step!r}")
        if self.read_only:
            raise CheckpointWriteError(
                f"cannot save step {step}: the run directory {self.directory} is read-only for "
                f"this manager ({self.read_only_reason}); nothing was written. Restoring works; "
                "to save, open the run where it can be written",
                path=self.directory,
                errno=errno.EROFS,
            )
        if not force and not self.save_policy.should_save(step, self._last_saved):
            return PendingSave.finished(None, step, skipped=True)
        self._check_writer()
        self._dirty = True
        clean = _plain(dict(metrics or {}))
        target = self._checkpoint(step)
        meta = {"savepoint_run": {"step": step, "epoch": epoch, "metrics": clean}}
        # A run given no num_params records the size of its state (report.json, then run.json).
        derived = None
        if self._leader and self.run.num_params is None and self.report.num_params is None:
            derived = count_elements(state)
        backup = self._before_commit(step) if self._leader else None
        previous, self._last_saved = self._last_saved, step
        flight = _AsyncSave(step, previous)

        def committed(info: CheckpointInfo) -> None:
            flight.committed = True
            self._after_commit(step, clean, epoch, backup, previous, derived)
            if derived is not None and self.run.num_params is None:
                self.run = dataclasses.replace(self.run, num_params=self.report.num_params)
                with contextlib.suppress(CheckpointWriteError):  # the next open rewrites it
                    self._finish_open_run()

        if self._async is not None:
            try:
                pending = self._async.save(target, state, metadata=meta, on_commit=committed)
            except BaseException:
                self._drop(backup)
                self._last_saved = previous
                raise
            if backup is not None:  # a failed background commit leaves it; committed() uses it
                pending._future.add_done_callback(lambda _: self._drop(backup))
            pending.step = step
            flight.pending = pending
            self._last_async = flight
            self._inflight = step
            return pending
        try:
            info = checkpoint.save(target, state, metadata=meta, **self.save_options.changed())
        except BaseException:
            self._drop(backup)
            self._last_saved = previous
            raise
        committed(info)
        return PendingSave.finished(self.step_path(step), step, info)

    def _raise_background_error(self) -> None:
        """Raise the error of a background save that failed (once), after forgetting it as the
        save policy's last save."""
        assert self._async is not None
        raised = True
        try:
            self._async._raise_background_error()
            raised = False
        finally:
            self._settle_async(wait=raised)

    def _settle_async(self, *, wait: bool) -> None:
        """Once the last background save is done: if its commit failed (so it never reached
        ``_after_commit``, which undoes its own failures), the save policy counts from the save
        before it again. ``wait``: it is known to be finishing (its error was just raised)."""
        flight = self._last_async
        if flight is None or flight.pending is None:
            return
        if not wait and not flight.pending.done():
            return
        failed = flight.pending.exception() is not None
        with self._lock:
            if failed and not flight.committed and self._last_saved == flight.step:
                self._last_saved = flight.previous
            if self._last_async is flight:
                self._last_async = None

    def _check_writer(self) -> None:
        """Raise unless this manager still holds the run's writer lock (runs.lock: a forked
        child, or a lock file deleted and taken by another writer)."""
        if self._writer is None:
            return
        try:
            self._writer.check()
        except RunLockedError:
            self._lock_error_raised = True
            raise

    def _before_commit(self, step: int) -> str | None:
        """Prepare to (re)use the name of checkpoint ``step``: finish a pending deletion of an
        old checkpoint of that step, and hard-link an existing one aside (returned) so that a
        failed save can put it back. Raises CheckpointWriteError with nothing changed."""

        def exists() -> bool:
            return layout.committed(self._step(step))

        pending = self._discarding | self._discarding_on_disk
        if not exists() and step not in pending and step != self._inflight:
            return None
        if self._async is not None:
            self.wait()  # the save in flight may be writing, deleting or relinking this step
        with self._lock:
            try:
                if step in self._discarding:
                    discard(self._store, self._step(step).path)
                    self._discarding = self._discarding - {step}
                    self._metrics.pop(step, None)
                if step in self._discarding_on_disk:
                    # The report must stop naming it for deletion before a new checkpoint takes
                    # its name: an open after a kill would delete the new one otherwise.
                    self._fill_report(self.steps())
                    self._store_report()
                if not exists():
                    return None
                return aliases.copy_aside(self._step(step))
            except OSError as exc:
                raise _write_error(
                    f"cannot save step {step} to {self.directory}: preparing its directory failed; "
                    "nothing was saved and the run is as before",
                    exc,
                ) from exc

    def log(self, step: int, loss: float | None = None, **metrics: Any) -> None:
        """Record a training step's loss (the report's loss curve) and any other values."""
        with self._lock:
            self._dirty = True
            if loss is not None:
                self.report.loss_history.append((int(step), float(loss)))
            if metrics:
                self.report.metric_history.setdefault(int(step), {}).update(_plain(metrics))
            self.report.steps_completed = max(self.report.steps_completed, int(step))

    def _after_commit(
        self,
        step: int,
        metrics: dict[str, Any],
        epoch: int | None,
        backup: str | None,
        previous: int | None,
        num_params: int | None = None,
    ) -> None:
        """Steps 3-6 of the module docstring, for the committed checkpoint ``step``
        (``num_params``: derived from its state, recorded in the report)."""
        with self._lock:
            if not self._leader:
                self._metrics[step] = metrics
                return
            # What an undo restores: _fill_report assigns fresh lists, so a shallow copy of the
            # report keeps the old ones; only this step's metric history is updated in place.
            history = self.report.metric_history.get(step)
            saved = _Saved(
                dataclasses.replace(self.report),
                None if history is None else dict(history),
                dict(self._metrics),
                previous,
            )
            self._metrics[step] = metrics
            self._verified.discard(step)
            r = self.report
            if metrics:
                r.metric_history.setdefault(step, {}).update(metrics)
            r.steps_completed = max(r.steps_completed, step)
            if epoch is not None:
                r.epoch = epoch
            if num_params is not None and r.num_params is None:
                r.num_params = num_params
            staged: dict[str, aliases.Staging] = {}
            phase = "updating the run's books"
            try:
                # The step just committed counts even if a listing does not show it yet.
                on_disk = layout.committed_steps(
                    self._run, expected=[*self.report.checkpoints, step]
                )
                abandoned: set[int] = set()
                if self._resumed_from is not None:
                    # After a resume, checkpoints past this step belong to the abandoned timeline
                    # (a rollback, or newer checkpoints that failed verification): now that the
                    # new timeline has a committed checkpoint they go, or a restart would undo the
                    # resume. (The checkpoint resumed from is never one of them.)
                    horizon = max(step, self._resumed_from)
                    abandoned = {s for s in on_disk if s > horizon}
                live = [s for s in on_disk if s not in abandoned and s not in self._discarding]
                doomed, verify_error = self._doomed(step, live)
                keep = [s for s in live if s not in doomed]
                discarding = frozenset((self._discarding | abandoned | doomed) - set(keep))
                self._fill_report(keep, discarding)
                phase = "linking latest/ and best/"
                staged = self._stage_aliases()
                phase = f"writing {REPORT_FILE}"
                self._store_report()
            except (OSError, CheckpointError) as exc:
                _abort(staged)
                raise self._undo(step, backup, saved, phase, exc, report_written=False) from exc
            try:
                self._swap_aliases(staged)
            except (OSError, CheckpointError) as exc:
                _abort(staged)
                raise self._undo(
                    step, backup, saved, "updating latest/ and best/", exc, report_written=True
                ) from exc
            # Done: the checkpoint is saved. Deleting is tidying, retried until it succeeds.
            self._drop(backup)
            self._discarding = discarding
            if self._store.capabilities.atomic_rename or not self._discarding:
                self._tidy(keep)
            else:
                # Object stores: deleting a checkpoint is a listing and batched deletes over
                # the network; the report already names the steps as leaving (a crash now is
                # repaired at the next open), so the save returns and they go in the background.
                self._deleter = threading.Thread(
                    target=self._tidy_in_background, name="savepoint-retention", daemon=True
                )
                self._deleter.start()
            if verify_error is not None:
                raise verify_error

    def _tidy(self, keep: list[int]) -> None:
        """Delete what is leaving the run and record it in the report (caller holds the lock)."""
        self._finish_discards()
        if self._discarding != self._discarding_on_disk:
            self._fill_report(keep)  # = steps(): the rest on disk is still in _discarding
            with contextlib.suppress(OSError):  # the next save writes it again
                self._store_report()

    def _tidy_in_background(self) -> None:
        with self._lock:
            try:
                self._tidy(self.steps())
            except BaseException:
                # Tidying only: report.json names what is left, and the next save, close or
                # open deletes it. (A thread has nobody to raise to.)
                return

    def _wait_for_deletions(self) -> None:
        """Let retention's background deletions finish (before the next save's bookkeeping,
        and at close)."""
        deleter = self._deleter
        if deleter is not None and deleter is not threading.current_thread():
            deleter.join()

    def _doomed(self, newest: int, live: list[int]) -> tuple[set[int], CheckpointError | None]:
        """The steps retention deletes, or none (and the error) if ``newest`` fails to verify."""
        entries = [Entry(s, self._metrics.get(s, {})) for s in live]
        keep = self.retention.keep(entries)
        keep |= {s for s in (newest, self._best_among(live), self._resumed_from) if s is not None}
        doomed = {s for s in live if s not in keep}
        if doomed and self.verify_before_prune and newest not in self._verified:
            try:
                checkpoint.verify(self._checkpoint(newest))
            except (CheckpointError, OSError) as exc:
                err = CorruptCheckpointError(
                    f"checkpoint {newest} did not verify after saving ({exc}); it is saved but "
                    "nothing was pruned",
                    path=self.step_path(newest),
                )
                err.__cause__ = exc
                return set(), err
            self._verified.add(newest)
        return doomed, None

    def _stage_aliases(self) -> dict[str, aliases.Staging]:
        staged: dict[str, aliases.Staging] = {}
        if not self.aliases:
            return staged
        try:
            for alias, step in aliases.targets(self.report).items():
                if step is not None and not aliases.holds(self._run, alias, step):
                    staged[alias] = aliases.stage(self._run, alias, step)
        except BaseException:
            _abort(staged)
            raise
        return staged

    def _swap_aliases(self, staged: dict[str, aliases.Staging]) -> None:
        for alias, step in aliases.targets(self.report).items():
            if alias in staged:
                staged.pop(alias).publish()
            elif self._store.stat(aliases.path_of(self._run, alias).path) is not None and (
                # (with aliases on, _stage_aliases found an unstaged one holding its step)
                step is None or (not self.aliases and not aliases.holds(self._run, alias, step))
            ):
                # The report names no such checkpoint (a best pruned with an abandoned
                # timeline), or aliases are off: a stale alias must not outlive the report.
                aliases.remove(self._run, alias)

    def _undo(
        self,
        step: int,
        backup: str | None,
        saved: _Saved,
        phase: str,
        exc: BaseException,
        *,
        report_written: bool,
    ) -> CheckpointWriteError:
        """Roll a failed save back: the new checkpoint goes (or the previous one of that step
        comes back), the report and aliases are restored. Returns the error to raise."""
        problems = []
        try:
            if backup is not None:
                aliases.put_back(self._store, backup, self._step(step).path)
            else:
                discard(self._store, self._step(step).path)
        except OSError as undo_exc:
            problems.append(
                f"checkpoint {step} could not be removed again ({undo_exc.strerror or undo_exc}): "
                "it is committed but not in report.json"
            )
        self.report, self._metrics = saved.report, saved.metrics
        if self._last_saved == step:  # the save policy counts from the last save that happened
            self._last_saved = saved.last_saved
        if saved.history is None:
            self.report.metric_history.pop(step, None)
        else:
            self.report.metric_history[step] = saved.history
        self._verified.discard(step)
        if report_written:
            try:
                self._store_report()
            except OSError as undo_exc:
                problems.append(
                    f"{REPORT_FILE} could not be restored ({undo_exc.strerror or undo_exc})"
                )
        try:
            self._repair_aliases()
        except CheckpointError as undo_exc:
            problems.append(str(undo_exc))
        code = getattr(exc, "errno", None)
        reason = os.strerror(code) if code else str(exc)
        where = getattr(exc, "filename", None)
        head = f"saving step {step} to {self.directory} failed while {phase}: {reason}" + (
            f" ({where})" if where else ""
        )
        if problems:
            message = (
                f"{head}; undoing it failed too: {'; '.join(problems)}. Opening the run again "
                "with a CheckpointManager repairs report.json and the aliases"
            )
        else:
            hint = _HINTS.get(code or 0, "see the cause below")
            message = (
                f"{head}. The save was undone and the run is as before: step {step} is not "
                "saved, report.json, latest/, best/ and every other checkpoint are unchanged; "
                f"{hint}"
            )
        return CheckpointWriteError(message, path=self.step_path(step), errno=code)

    def _finish_discards(self) -> None:
        """Delete the checkpoints that left the run; one that cannot be deleted stays pending."""
        remaining: set[int] = set()
        for step in sorted(self._discarding):
            try:
                discard(self._store, self._step(step).path)
            except OSError:
                remaining.add(step)
                continue
            self._metrics.pop(step, None)
            self._verified.discard(step)
        self._discarding = frozenset(remaining)

    def _fill_report(self, live: list[int], discarding: frozenset[int] | None = None) -> None:
        r = self.report
        r.wall_time_s = self._wall_before + (time.monotonic() - self._started)
        r.checkpoints = sorted(live, reverse=True)
        r.retention = policies.to_spec(self.retention)
        r.latest_step = r.checkpoints[0] if r.checkpoints else None
        best = self._best_among(live)
        r.best = (
            None
            if best is None
            else {
                "metric": self.best_metric,
                "mode": self.best_mode,
                "step": best,
                "metrics": self._metrics.get(best, {}),
            }
        )
        pending = self._discarding if discarding is None else discarding
        r.discarding = sorted(pending - set(live))

    def _store_report(self) -> None:
        """Replace report.json with ``self.report`` (atomic); raises OSError."""
        write_json(self._run.join(REPORT_FILE), self.report.to_json())
        self._discarding_on_disk = frozenset(self.report.discarding)

    # -- restoring -----------------------------------------------------------------------------

    def restore(
        self, into: Any, step: StepSpec = "latest", *, resume: bool = True, **load_options: Any
    ) -> int | None:
        """Restore checkpoint ``step`` ("latest", "best" or a number) into ``into``.

        Returns the step restored. With ``resume`` (the default) the run continues from that step:
        the report forgets history after it (the resumed run logs those steps again), records the
        lineage, and retention protects that checkpoint; ``resume=False`` only loads. Nothing is
        written here (restoring works on read-only media): the next save or ``close()`` writes
        the report. With "latest", a checkpoint that fails verification is skipped (with a
        warning) for the next older one; None means the run has no checkpoint at all. "best" and
        explicit steps are never substituted: missing or corrupt is an error.

        Next to a live writer (a read-only manager), the checkpoint chosen may be deleted or
        replaced by the writer before it is read: then "latest" and "best" choose again from what
        the run holds now (never a warning, never an error for an intact run), and an explicit
        step that was deleted is CheckpointNotFoundError saying so.
        """
        self._check_open()
        with self._saving:
            self.wait()
            found = self._read(step, {**load_options, "into": into})
            if found is None:
                return None
            return self._resumed(found[0]) if resume else found[0]

    def peek(
        self, keys: Iterable[str] | str, step: StepSpec = "latest", **load_options: Any
    ) -> Any:
        """The saved values of ``keys`` (paths as in :func:`savepoint.load`) of checkpoint ``step``,
        as plain values and arrays, without building the model: e.g. the config or the step
        counter a script needs before it can build what it restores into. Chooses the checkpoint
        exactly as :meth:`restore` does (a "latest" that fails verification is skipped with a
        warning for the next older one), writes nothing and resumes nothing. None: the run has no
        checkpoint at all."""
        self._check_open()
        with self._saving:
            self.wait()
            found = self._read(step, {**load_options, "keys": keys})
            return None if found is None else found[1]

    def _read(self, step: StepSpec, load_options: dict[str, Any]) -> tuple[int, Any] | None:
        """Load checkpoint ``step`` with ``load_options``: (the step loaded, what
        :func:`savepoint.load` returned), or None when the run has no checkpoint at all."""
        if not (isinstance(step, int) and not isinstance(step, bool)) and step not in (
            "latest",
            "best",
        ):
            raise ValueError(f"step must be 'latest', 'best' or an int, not {step!r}")
        for _ in range(_RESTORE_TRIES):
            self._refresh_view()
            try:
                return self._restore_once(step, load_options)
            except _Moved:
                continue
        raise CheckpointNotFoundError(
            f"{self.directory}: each checkpoint chosen to restore ({step!r}) was deleted or "
            f"replaced by the run's writer before it could be read ({_RESTORE_TRIES} tries); try "
            "again, or restore a step retention keeps",
            path=self.directory,
        )

    def _restore_once(self, step: StepSpec, load_options: dict[str, Any]) -> tuple[int, Any] | None:
        """One attempt of :meth:`_read`; raises _Moved when the checkpoint chosen was deleted
        or replaced while it was being read."""
        steps = self.steps()
        if step == "latest":
            if not steps:
                return None
            failures = []
            for candidate in reversed(steps):
                try:
                    loaded = self._load(candidate, load_options)
                except (CorruptCheckpointError, IncompleteCheckpointError) as exc:
                    failures.append(f"step {candidate}: {exc}")
                    warnings.warn(
                        f"checkpoint {candidate} of {self.directory} failed verification, trying "
                        f"an older one: {exc}",
                        stacklevel=4,
                    )
                    continue
                return candidate, loaded
            raise CorruptCheckpointError(
                f"{self.directory}: no intact checkpoint among {len(steps)}: "
                + "; ".join(failures),
                path=self.directory,
            )
        if step == "best":
            best = self.best_step()
            if best is None:
                raise MissingCheckpointError(
                    f"{self.directory}: no best checkpoint (best_metric={self.best_metric!r}): "
                    "no checkpoint has a finite value for that metric"
                    if self.best_metric is not None
                    else f"{self.directory}: no best checkpoint: the run ranks no metric; open it "
                    "with best_metric=... to choose one",
                    path=self.directory,
                )
            return best, self._load(best, load_options)
        assert isinstance(step, int)
        if step not in steps:
            raise CheckpointNotFoundError(
                f"{self.directory} has no checkpoint for step {step} (it has {steps})",
                path=self.step_path(step),
            )
        try:
            loaded = self._load(step, load_options)
        except _Moved:
            if self._manifest_id(step) is not None:
                raise  # replaced by a new save of that step: read the new one
            raise CheckpointNotFoundError(
                f"checkpoint {step} of {self.directory} was deleted while it was being restored "
                "(the run's writer pruned it); choose a step the run still has",
                path=self.step_path(step),
            ) from None
        return step, loaded

    def _load(self, step: int, load_options: dict[str, Any]) -> Any:
        """Load checkpoint ``step``; _Moved if it was deleted or replaced meanwhile (a failure
        that must not be taken for corruption)."""
        before = self._manifest_id(step)
        try:
            return checkpoint.load(self._checkpoint(step), **load_options)
        except (CheckpointNotFoundError, CorruptCheckpointError, IncompleteCheckpointError):
            if before is None or self._manifest_id(step) != before:
                raise _Moved from None
            raise

    def _manifest_id(self, step: int) -> Any:
        """The identity of checkpoint ``step``'s manifest (None: no checkpoint): it changes when
        the writer saves the step again."""
        store = self._store
        try:
            where = resolve_commit(store, self._step(step).path, strict=False)
            found = None if where is None else store.stat(store.join(where, mf.NAME))
        except OSError:
            return None
        return None if found is None else found.identity

    def _refresh_view(self) -> None:
        """A read-only manager rereads which steps the writer is deleting (and, if it has none,
        the metric the run ranks by): a live writer may have changed both since it opened."""
        if not self.read_only:
            return
        try:
            report = load_report(self._run)
        except CheckpointError:
            return  # restoring needs only the checkpoints: keep the view from opening
        if report is None:
            return
        self._discarding = frozenset(set(report.discarding) - set(report.checkpoints))
        best = report.best or {}
        metric, mode = best.get("metric"), best.get("mode", "min")
        if self.best_metric is None and isinstance(metric, str) and mode in ("min", "max"):
            self.best_metric, self.best_mode = metric, mode

    def _resumed(self, step: int) -> int:
        with self._lock:
            self._dirty = True
            self._resumed_from = step
            self._last_saved = step
            self.report.truncate_after(step)
            self.report.lineage.append(
                {
                    "resumed_from": step,
                    "at": now_iso(),
                    "steps_completed_before": self.report.steps_completed,
                }
            )
            self.report.steps_completed = step
        return step

    # -- lifecycle -----------------------------------------------------------------------------

    def gc(self, grace: float = 3600.0, dry_run: bool = False) -> GcReport:
        """Remove what failed or interrupted saves left in the run and no reader can be using:
        generations without a manifest and superseded ones, step directories holding nothing
        committed, hidden temporaries of dead processes, open multipart uploads (S3), each only
        once it is older than ``grace`` seconds (:mod:`savepoint.runs.gc`). Runs after any
        background save has finished, holding the writer lock; never removes a committed
        checkpoint, the report, ``run.json`` or an alias. ``dry_run`` removes nothing. A
        read-only manager (or another rank's) raises CheckpointWriteError."""
        self._check_open()
        if not self._writes_books():
            why = self.read_only_reason if self.read_only else "only rank 0 writes the run's files"
            raise CheckpointWriteError(
                f"cannot collect garbage in {self.directory}: this manager does not write the run "
                f"({why}); nothing was removed",
                path=self.directory,
                errno=errno.EROFS,
            )
        with self._saving:
            self.wait()
            with self._lock:
                if not dry_run:
                    self._check_writer()
                return collect(self._run, grace=grace, dry_run=dry_run, lock=False)

    def wait(self) -> None:
        """Block until any background save is committed, and until the deletions retention
        started in the background (object stores) are done; raise a save's error if it
        failed."""
        try:
            if self._async is not None:
                try:
                    self._async.wait()
                finally:
                    self._settle_async(wait=True)
        finally:
            self._wait_for_deletions()

    def close(self) -> None:
        """Finish pending saves, write the final report, and release the writer lock.

        A manager that no longer holds the lock (runs.lock: a forked child, a lock file taken by
        another writer) writes nothing; the latter is RunLockedError unless a save raised it
        already. A second ``close()`` does nothing."""
        with self._saving:
            if self._closed:
                return
            try:
                if self._async is not None:
                    try:
                        self._async.close()
                    finally:
                        self._settle_async(wait=True)
            finally:
                self._closed = True
                self._wait_for_deletions()
                try:
                    if (
                        self._writes_books()
                        and (self._dirty or self._discarding)
                        and self._still_writer()
                    ):
                        with self._lock:
                            self._finish_discards()
                            self._fill_report(self.steps())
                            try:
                                self._store_report()
                            except OSError as exc:
                                raise _write_error(
                                    f"cannot write the final {REPORT_FILE} of {self.directory} "
                                    "(the checkpoints are intact; the report is rewritten by the "
                                    "next save)",
                                    exc,
                                ) from exc
                finally:
                    self._release_lock()

    def _still_writer(self) -> bool:
        """For close(): whether this manager may still write the run's books."""
        if self._writer is None:
            return True  # another rank's manager (its books are rank 0's) or none needed
        if os.getpid() != self._pid:
            return False  # a forked child: the books are the parent's
        if self._lock_error_raised:
            return False
        self._check_writer()
        return True

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(
                f"the CheckpointManager for {self.directory} is closed; open a new one to save or "
                "restore"
            )

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object
    ) -> None:
        if exc is None:
            self.close()
            return
        try:
            self.close()
        except CheckpointError as close_error:
            # The body's exception (an interrupted training loop, Ctrl-C) is what the caller must
            # see; the failure to finish a save rides along with it instead of replacing it.
            note = f"while it propagated, closing {self!r} failed: {close_error}"
            if hasattr(exc, "add_note"):
                exc.add_note(note)
            else:  # Python 3.10
                print(f"savepoint: {note}", file=sys.stderr)

    def __repr__(self) -> str:
        mode = ", read_only=True" if self.read_only else ""
        return f"CheckpointManager({self.directory!r}, retention={self.retention!r}{mode})"


class _Moved(Exception):
    """The checkpoint being restored was deleted or replaced by the run's writer meanwhile."""


@dataclasses.dataclass
class _AsyncSave:
    """A background save, for the save policy: the step and the last save before it."""

    step: int
    previous: int | None
    pending: PendingSave | None = None
    committed: bool = False  # its checkpoint was committed (_after_commit ran)


@dataclasses.dataclass
class _Saved:
    report: Report
    history: dict[str, Any] | None
    metrics: dict[int, dict[str, Any]]
    last_saved: int | None


def _not_writable(*paths: str) -> tuple[int, str] | None:
    """(errno, why) this process cannot create files in ``paths`` (the existing ones), or None."""
    effective = os.access in os.supports_effective_ids
    for path in paths:
        if os.path.isdir(path) and not os.access(path, os.W_OK | os.X_OK, effective_ids=effective):
            try:
                read_only_fs = bool(os.statvfs(path).f_flag & os.ST_RDONLY)
            except OSError:
                read_only_fs = False
            if read_only_fs:
                return errno.EROFS, f"{path} is on a read-only filesystem"
            return errno.EACCES, f"{path} is not writable by this user"
    return None


def _open_error(directory: str, exc: OSError) -> CheckpointError:
    """The error for a run whose store could not be looked at while opening it."""
    reason = exc.strerror or (os.strerror(exc.errno) if exc.errno else str(exc))
    if isinstance(exc, PermissionError):
        return CheckpointPermissionError(
            f"cannot open the run {directory}: {reason}; check the credentials or permissions "
            "for it",
            path=directory,
            errno=exc.errno,
        )
    return CheckpointError(f"cannot open the run {directory}: {reason}", path=directory)


def _write_error(what: str, exc: OSError) -> CheckpointWriteError:
    reason = os.strerror(exc.errno) if exc.errno else str(exc)
    where = f" ({exc.filename})" if exc.filename else ""
    hint = _HINTS.get(exc.errno or 0, "see the cause below")
    return CheckpointWriteError(
        f"{what}: {reason}{where}; {hint}", path=exc.filename, errno=exc.errno
    )


def _abort(staged: Mapping[str, aliases.Staging]) -> None:
    """Abandon staged aliases without letting cleanup hide an error."""
    for alias in staged.values():
        alias.abort()


def _policy(argument: str, make: Callable[..., Any], n: Any, *more: Any) -> Any:
    """``make(n, *more)``, its TypeError or ValueError naming the manager's ``argument`` (the
    policy checks ``n``: an int, at least its minimum)."""
    try:
        return make(n, *more)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{argument}={n!r}: {exc}") from None


def _rank(process_group: Any) -> int:
    if process_group is None:
        return 0
    import torch.distributed as dist

    return int(dist.get_rank(group=process_group))


def _plain(values: Mapping[str, Any]) -> dict[str, Any]:
    """Metrics and configs as the JSON values a reader gets back: numpy and torch scalars become
    Python numbers, tuples lists, and non-finite floats the strings "nan", "inf", "-inf" (not
    numbers, so retention and ranking never pick them, and the files stay standard JSON)."""
    return {str(k): plain_value(v) for k, v in values.items()}
