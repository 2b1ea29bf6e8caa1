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

The sequence of ``save(step, state, metrics)``, steps 1-6 (the save policy, the commit, the
books, the background step), what a verification failure does, and the warning for metrics
that name no ``best_metric``: :mod:`savepoint.runs.saving`, whose
:class:`~savepoint.runs.saving.Saver` runs them (steps 3-5 are
:class:`savepoint.runs.books.Books`, step 6 :mod:`savepoint.runs.settle`; an open's repair is
:func:`savepoint.runs.opening.repair`).

Failure semantics. Every error out of the manager (``save``, ``PendingSave.wait()`` and
``exception()`` of an async save, ``wait``, ``close``, ``restore``) is a CheckpointError subclass,
usage errors aside (a bad argument is ValueError, a closed manager RuntimeError);
a failed write is CheckpointWriteError with the failing call's ``errno`` (``errno.ENOSPC`` for a
full disk), never a raw OSError and never the bare base class; a write the store refused says so
in the store's own words, with the store's advice (credentials and bucket policy on an object
store, permissions on a disk: :func:`savepoint.commit.transaction.refused_hint`). A save that
fails in steps 2-5 (of the save sequence) has *not* happened: the checkpoint is removed again
(or the previous checkpoint of that step put back), ``report.json``, the history log and the
aliases are as they were, nothing was deleted, and the message says so. Only if undoing fails
as well does the error say what is left (the next open repairs it). A failure in step 6 does not
undo the save: a deletion that fails leaves the checkpoint on disk, not part of the run, and is
retried by the next save, ``close()`` or open; a failed sync of the books is
CheckpointWriteError from the next save, ``wait()`` or ``close()``. A SIGKILL at any point leaves
the old run or the new one: a checkpoint committed in step 2 is kept and listed by the next open,
even if its books were never written, and a history record cut short is ignored (and cut off by
the next writing open). A background save whose commit fails does not count as a save for the
save policy (nor does a failed synchronous one). An exception leaving a
``with CheckpointManager(...)`` block is not replaced by a failure of the ``close()`` it
triggers: that error is attached to it as a note (printed on Python 3.10).

Preemption (``preemption=True`` or a list of signals; docs/runs.md, "Preemption"): the flow of
``preempted()`` and ``save_on_preemption()`` is :mod:`savepoint.runs.preempting`. Retention
decisions, deletions, restore choices and fallbacks, and preemption are logged (``logging``,
logger ``savepoint.runs.manager``, INFO).

``restore(into, step="latest")`` and ``peek`` write nothing (they work on read-only media); which
checkpoint they read, its fallbacks ("latest" falls back to an older intact step, "best" and
explicit steps are never substituted), tiers as sources and a checkpoint a live writer deletes
or replaces meanwhile: :mod:`savepoint.runs.restoring`. The resume's bookkeeping (lineage,
history truncated after the step resumed from) is written by the next save or by ``close()``.
Incremental runs' blob store (saves into it, collection, scrubbing):
:mod:`savepoint.runs.incremental`.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import errno
import logging
import math
import os
import signal
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, ClassVar

from savepoint import errors_map
from savepoint.async_.pending import PendingSave
from savepoint.errors import (
    CheckpointError,
    CheckpointWriteError,
    IncompatibleCheckpointError,
    RunMismatchError,
)
from savepoint.options import SaveOptions
from savepoint.runs import history, layout, opening, policies
from savepoint.runs.books import Books, plain, write_error
from savepoint.runs.catalog import Catalog
from savepoint.runs.gc import GcReport, collect
from savepoint.runs.incremental import BlobHandles
from savepoint.runs.lock import WriterLock
from savepoint.runs.policies import Mode, RetentionPolicy, SavePolicy
from savepoint.runs.preempting import Preempting
from savepoint.runs.preemption import (
    DEFAULT_GRACE,
    Preemption,
    PreemptionSave,
    signals_of,
)
from savepoint.runs.report import (
    REPORT_FILE,
    RUN_FILE,
    Report,
    RunInfo,
    check_consistent,
    config_diff,
    lagging_run,
    new_run_id,
    now_iso,
    read_history,
    read_json,
    read_report,
    write_json,
)
from savepoint.runs.restoring import Restorer, StepSpec
from savepoint.runs.saving import Saver, check_step
from savepoint.runs.settle import Settle
from savepoint.runs.tiers import Tier, TierCopier
from savepoint.storage.paths import Location, PathArg, resolve

__all__ = ["CheckpointManager", "PreemptionSave", "StepSpec"]

log = logging.getLogger(__name__)

_READ_ONLY_ERRNOS = (errno.EROFS, errno.EACCES, errno.EPERM)
# Managers whose background step (verification, retention) may still run or failed unreported:
# finished (and a failure printed) at interpreter exit.
_LIVE: weakref.WeakSet[CheckpointManager] = weakref.WeakSet()


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

    ``preemption``: True (SIGTERM and SIGUSR1) or a list of signals installs flag-only handlers
    (main thread only; removed by ``close()``); :meth:`preempted` says when to stop (agreed by
    every rank of ``process_group``, with an all-reduce every ``preemption_every`` calls) and
    :meth:`save_on_preemption` commits within ``preemption_grace`` seconds of the notice (25 by
    default, for Kubernetes' 30). See docs/runs.md, "Preemption".

    ``incremental=True``: the run's checkpoints share a content-addressed blob store at
    ``<run>/blobs`` (``docs/blobs.md``): a tensor ``blob_policy`` wants (a
    :class:`savepoint.blobs.BlobPolicy`; default: those of 1 MiB or more) is written only where
    its bytes changed since an earlier save; retention then deletes the blobs no remaining
    checkpoint names. With ``async_save=True`` the caller is blocked for the staging copy only;
    the background thread runs the blob store's save session and then retention and the blob
    collection. ``compression``: ``"zstd"`` (or a :class:`savepoint.blobs.Compression`) stores
    blobs zstd-compressed where that saves space (``BlobPolicy.of("zstd")``; needs the
    zstandard package); only with ``incremental=True``, and a ``blob_policy`` naming another
    compression is a ValueError. ``frozen``: key prefixes (``("model/base_model",)``) of
    tensors that never change during the run (a frozen base model): after this manager's first
    save of them, their bytes are not read again but for a random block per chunk, checked
    against the first save's (a mismatch is logged and the tensor saved as any other); their
    earlier blobs are reused. A change the sample misses is not saved: declare only what is
    truly frozen. Unsharded saves only.
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
        preemption: bool | Iterable[int | str | signal.Signals] | None = None,
        preemption_grace: float = DEFAULT_GRACE,
        preemption_every: int = 1,
        tiers: Sequence[Tier] | None = None,
        incremental: bool = False,
        blob_policy: Any = None,
        frozen: Iterable[str] | None = None,
        compression: Any = None,
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
            "incremental": incremental,
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
        if frozen is not None:
            from savepoint.blobs.patch import frozen_keys

            if not incremental:
                raise ValueError("frozen is given without incremental=True")
            if self.save_options.process_group is not None:
                raise ValueError("frozen is not supported with a process group (sharded saves)")
            if not isinstance(frozen, str) and hasattr(frozen, "__iter__"):
                frozen = tuple(frozen)  # (a generator, say: read once)
            frozen_keys(frozen)  # checks them
        if blob_policy is not None:
            from savepoint.blobs import BlobPolicy

            if not incremental:
                raise ValueError("blob_policy is given without incremental=True")
            if not isinstance(blob_policy, BlobPolicy):
                raise TypeError("blob_policy must be a savepoint.blobs.BlobPolicy")
        if compression is not None:
            if not incremental:
                raise ValueError(
                    "compression is given without incremental=True (only the blobs of "
                    "incremental saves are compressed)"
                )
            blob_policy = _compressed(blob_policy, compression)
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
        signals = None if preemption is None or preemption is False else signals_of(preemption)
        tier_list = _tiers(tiers)
        self.preemption_grace = _grace(preemption_grace, "preemption_grace")
        if (
            not isinstance(preemption_every, int)
            or isinstance(preemption_every, bool)
            or preemption_every < 1
        ):
            raise ValueError(
                f"preemption_every must be a positive integer, not {preemption_every!r}"
            )
        if signals is not None and threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                "preemption=: signal handlers can only be installed from the main thread (Python "
                "runs them there): create the CheckpointManager in the main thread, or leave "
                "preemption off and call save_on_preemption() when your own handler says so"
            )
        self._run = resolve(directory, what="run directory")
        self._store = self._run.store
        # Incremental saves: the run's blob store and what its saves share (runs.incremental).
        self.incremental = incremental
        self._blob_handles = (
            BlobHandles(self._run, policy=blob_policy, frozen=frozen) if incremental else None
        )
        self.directory = str(self._run)
        if retention is not None:
            rules.append(retention)
        self.retention: RetentionPolicy = (
            policies.AnyOf(*rules) if rules else policies.AnyOf(policies.KeepAll())
        )
        # The run's checkpoints and their metrics (runs.catalog), and its books (report, history
        # log, lineage, aliases: runs.books).
        self._catalog = Catalog(self._run, best_metric=best_metric, best_mode=best_mode)
        self._books = Books(self._run, self._catalog, retention=self.retention, aliases=aliases)
        # Which checkpoint restore() and peek() read, and from where (runs.restoring).
        self._restorer = Restorer(self._run, self._catalog, self._books.steps_now)
        if save_policy is None:
            save_policy = every if every is not None else policies.SaveAlways()
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
        # The background step of each save (runs.settle: syncs, verification, retention), on
        # one worker thread, and the error it left for the next save, wait() or close().
        self._settle = Settle(
            self._books,
            self._lock,
            retention=self.retention,
            verify_before_prune=verify_before_prune,
            collect=_nothing if self._blob_handles is None else self._blob_handles.collect,
            scrub=_nothing if self._blob_handles is None else self._blob_handles.scrub,
        )
        stop_worker = weakref.finalize(self, self._settle.worker.stop)
        stop_worker.atexit = False  # (at exit the worker finishes its step: see _finish_at_exit)
        # The save route (runs.saving: the save policy's state, the async writer) and the
        # preemption flow over it (runs.preempting: the handlers, installed once the open
        # succeeded); once a preemption save started (_settle.preempting) the background steps
        # defer verification, retention and deletions to the next run.
        self._saver = Saver(
            self._books,
            self._settle,
            self.save_options,
            save_policy=save_policy,
            leader=self._leader,
            async_save=async_save,
            blobs=self._blob_handles,
            host=_SaverHost(self),
        )
        self._preempting = Preempting(self._saver, _grace)
        # Slower tiers that committed checkpoints are copied up to (runs.tiers).
        self._tiers: TierCopier | None = None
        self._closed = False
        self._pid = os.getpid()
        self._release: Callable[[], object] | None = None
        self.read_only_reason: str | None = None
        self._strict_config = strict_config
        self._config_changes: list[dict[str, Any]] = []
        self._new_config: dict[str, Any] | None = None
        # Whether the run's id is made by this open (a new run directory, or a run made before
        # run ids): then it takes the id of the run its tiers belong to (runs.tiers).
        self._created = False
        self._legacy_id = False
        try:
            self.read_only, self._writer = self._open_directory(read_only)
            self._catalog.read_only = self.read_only
            self._saver.opened(self.read_only, self.read_only_reason, self._writer)
            if self._writer is not None:
                # Garbage collection releases the lock of a manager never closed (the finalizer
                # holds the lock object, not the manager). Not at interpreter exit: background
                # saves are finished then (async_.checkpointer), still under the lock, which
                # the kernel drops when the process ends.
                release = weakref.finalize(self, self._writer.release)
                release.atexit = False
                self._release = release
            self.run, new_run_file, report = self._open_run(name, variant, config, num_params)
            if self._writes_books():
                self._books.history = history.writer(self._run)
            listed = report.checkpoints if report is not None else ()
            on_disk = layout.committed_steps(self._run, expected=listed)
            self._books.report = self._open_report(report, on_disk)
            lagging = lagging_run(self.run, self._books.report)
            if lagging is not None:  # a writer was stopped between report.json and run.json
                self.run, new_run_file = lagging, True
            if tier_list:
                # Every rank reads the tiers (restore); rank 0 alone copies up, as it keeps the
                # books, and holds each tier's writer lock. Before run.json is written: a new
                # run directory may continue the run its tiers belong to (runs.tiers).
                self._tiers = TierCopier(
                    tier_list,
                    {"name": self.run.name, "variant": self.run.variant, "id": self.run.run_id},
                    inherit=self._writes_books()
                    and ((self._created and not on_disk) or self._legacy_id),
                    protected=lambda: (
                        () if self._books.resumed_from is None else (self._books.resumed_from,)
                    ),
                    writable=self._writes_books(),
                )
                self._settle.tiers = self._restorer.tiers = self._tiers
                release_tiers = weakref.finalize(self, self._tiers.release_locks)
                release_tiers.atexit = False  # (as the run's lock: see above)
                if self._tiers.run_id != self.run.run_id or (
                    self._legacy_id and self._writes_books()
                ):
                    # The id the tiers now name (theirs, or one made now) goes to run.json.
                    self.run = dataclasses.replace(self.run, run_id=self._tiers.run_id)
                    self._books.report.run_id = self.run.run_id
                    new_run_file = True
            if new_run_file:
                # Only now: an open that fails (a mismatch, a damaged report) writes nothing.
                self._finish_open_run()
            self._books.wall_before = self._books.report.wall_time_s
            self._books.discarding_on_disk = frozenset(self._books.report.discarding)
            self._catalog.opened(self._books.report, on_disk)
            if self._config_changes:
                self._record_config_change()
            if self._writes_books():
                self._repair()
                _LIVE.add(self)
            if signals is not None:
                self._preempting.preemption = Preemption(
                    signals, process_group=self.save_options.process_group, every=preemption_every
                )
        except BaseException as exc:
            if self._preempting.preemption is not None:
                self._preempting.preemption.close()
            if self._tiers is not None:
                self._tiers.close()
            self._release_lock()
            if self._books.history is not None:
                with contextlib.suppress(OSError):
                    self._books.history.close()
            self._saver.close()
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
            raise self._write_error(f"cannot open the run directory {self.directory}", exc) from exc
        with contextlib.suppress(OSError, CheckpointError):  # tidying is best effort
            layout.clean_stale_in(store, checkpoints.path)
            layout.clean_stale_in(store, self._run.path)
        return False, writer

    def _writes_books(self) -> bool:
        return self._leader and not self.read_only

    def _release_lock(self) -> None:
        if self._release is not None:
            self._release()

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
        # The run's id: made with the run by its writer (other ranks and read-only managers of
        # a run without one do not know it: None).
        wanted = RunInfo(
            name=name or self._store.basename(self._run.path),
            variant=variant,
            config=plain(dict(config or {})),
            num_params=num_params,
            run_id=new_run_id() if self._writes_books() else None,
        )
        stale = doc is None
        if doc is not None:
            run, source = RunInfo.from_json(doc, path), RUN_FILE
            # Compare with what the run really is: a writer stopped between report.json and
            # run.json left run.json behind (report.lagging_run); the caller's config is checked
            # against the caught-up one, and run.json is rewritten once the open succeeds.
            report, self._books.version = read_report(self._run)
            caught_up = lagging_run(run, report) if report is not None else None
            if caught_up is not None:
                run, stale = caught_up, True
        else:
            report, self._books.version = read_report(self._run)
            if report is None:
                self._created = True  # (no run.json, no report.json: with no checkpoint, new)
                return wanted, True, None
            source = REPORT_FILE
            run = RunInfo(
                name=report.name,
                variant=report.variant,
                config=report.config,
                num_params=report.num_params,
                run_id=report.run_id,
            )
        if run.run_id is None:
            # A run made before run ids: the report's, else a new one from its writer, recorded
            # in the next report.json it writes (not by the open: opening and restoring change
            # nothing), and in run.json if the open writes it anyway.
            known = report.run_id if report is not None else None
            run = dataclasses.replace(run, run_id=known or wanted.run_id)
            self._legacy_id = known is None  # (made now: its tiers' run id may replace it)
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
            raise self._write_error(f"cannot create {where}", exc) from exc

    def _open_report(self, report: Report | None, on_disk: list[int]) -> Report:
        if report is not None and report.run_id is None and self._writes_books():
            report.run_id = self.run.run_id  # (written with the next report)
        if report is None:
            self._books.dirty = True  # close() writes the first report.json
            fresh = Report.for_run(self.run)
            # A log without a report: a first save killed before its report, or a report moved
            # aside to be rebuilt; its history is the run's.
            read_history(self._run, fresh)
            return fresh
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
        self._books.report.config = self._new_config
        self._books.report.config_changes.append(
            {"step": step, "at": now_iso(), "changes": self._config_changes}
        )
        self.run = dataclasses.replace(self.run, config=self._new_config)
        try:
            self._books.store_report()
        except OSError as exc:
            raise self._write_error(
                f"cannot record the config change in {REPORT_FILE}", exc
            ) from exc
        self._finish_open_run()
        warnings.warn(
            f"{self.directory}: the run's config changed at step {step} ({keys}); recorded in "
            f"{REPORT_FILE} under config_changes (strict_config=True refuses config changes)",
            stacklevel=3,
        )

    def _repair(self) -> None:
        """Finish what an interrupted writer left (see the module docstring), then make the
        aliases agree with the report."""
        with self._lock:
            opening.repair(self._books, self._settle.preempting.is_set)

    # -- queries -------------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Steps with a committed checkpoint that is part of the run, ascending (once the
        background step of the last save, which may prune, has finished)."""
        self._join_background()
        return self._books.steps_now()

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def best_step(self) -> int | None:
        """The best step by ``best_metric`` among the checkpoints on disk (never one that failed
        verification), or None."""
        return self._catalog.best_among(self.steps())

    @property
    def save_policy(self) -> SavePolicy:
        """Which steps ``save`` writes (``save_every``, or the ``save_policy`` given)."""
        return self._saver.save_policy

    @property
    def report(self) -> Report:
        """The run's report as this manager keeps it (``report.json`` once written)."""
        return self._books.report

    @property
    def restored_from(self) -> str | None:
        """Where the last restore (or peek) read its checkpoint: "run directory" or a tier's
        name; None before the first."""
        return self._restorer.restored_from

    @property
    def best_metric(self) -> str | None:
        return self._catalog.best_metric

    @property
    def best_mode(self) -> Mode:
        return self._catalog.best_mode

    def step_path(self, step: int) -> str:
        """Checkpoint ``step``'s directory, as ``sp.load`` takes it (a URL off the local disk)."""
        return str(self._step(step))

    def _step(self, step: int) -> Location:
        return layout.step_location(self._run, step)

    def _checkpoint(self, step: int) -> str | Location:
        """Checkpoint ``step`` as the path argument of ``savepoint.checkpoint``'s functions."""
        return layout.checkpoint_arg(self._step(step))

    def metrics(self, step: int) -> dict[str, Any]:
        return dict(self._catalog.metrics.get(step, {}))

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

        Either the save happens completely or, on CheckpointWriteError, not at all. It returns
        once the checkpoint is committed and ``report.json`` names it; verification and
        retention follow in the background (the returned PendingSave is done when they are;
        see :mod:`savepoint.runs.saving`). Threads may share a manager: their saves run one
        after the other."""
        self._check_open()
        with self._saving:
            return self._saver.save(step, state, metrics, force, epoch)

    def should_save(self, step: int) -> bool:
        """Whether ``save(step)`` would write (the save policy's answer), without saving: ask
        it before building a state that costs something to gather. The next ``save(step)``
        reuses this answer instead of asking the policy again. With a process group and a
        policy whose answer depends on this process's clock (``sp.policies.Continuous``), every
        rank's answer is agreed (one all-reduce: ask at the same steps on every rank), so the
        ranks save the same steps (:mod:`savepoint.runs.pacing`)."""
        self._check_open()
        check_step(step)
        with self._saving:
            return self._saver.pacing.should_save(step, self._saver.last_saved)

    def log(self, step: int, loss: float | None = None, **metrics: Any) -> None:
        """Record a training step's loss (the report's loss curve) and any other values.

        O(1): the record joins the report in memory and is appended to the run's history log
        (:mod:`savepoint.runs.history`) by the next save or ``close()``."""
        self._saver.log(step, loss, metrics)

    # -- the background step of a save (runs.settle) ------------------------------------------

    def _join_background(self) -> None:
        """Wait for the background step of the last save (not from that step itself)."""
        self._settle.join()

    def _raise_verification_error(self) -> None:
        """Raise (once) what the last background step reported."""
        error = self._settle.take_error()
        if error is not None:
            raise error

    def _write_error(self, what: str, exc: OSError) -> CheckpointWriteError:
        return write_error(self._store, what, exc)

    def _finish_discards(self) -> None:
        self._settle.finish_discards()

    # -- preemption ----------------------------------------------------------------------------

    @property
    def preemption(self) -> Preemption | None:
        """The notice handlers ``preemption=`` installed (None without): ``signum``,
        ``received_at``, ``count``, and ``request()`` for a notice of your own (a spot
        instance's metadata endpoint, say), which :meth:`preempted` then agrees on like a
        signal."""
        return self._preempting.preemption

    def preempted(self, *, local: bool = False) -> bool:
        """Whether to stop for a preemption notice (a signal given to ``preemption=``).

        Without a process group: a memory read, cheap anywhere (data loading, evaluation,
        warm-up). With one (the manager's ``process_group``): the answer every rank agrees on,
        from one all-reduce (MAX over the ranks' flags, on that group) every
        ``preemption_every``-th call, so call it at the same points on every rank (once per
        step, say); once True it stays True without further collectives. Ranks therefore stop at
        the same call even when the signal reached only some of them. ``local=True``: this
        process's own flag, no collective (for code that runs on some ranks only; stop at an
        agreed call all the same). The flow: :mod:`savepoint.runs.preempting`."""
        if self._preempting.preemption is None:
            raise RuntimeError(
                f"{self!r} was opened without preemption=...: pass preemption=True (SIGTERM, "
                "SIGUSR1) or a list of signals to be told of preemption notices"
            )
        return self._preempting.preempted(local)

    def save_on_preemption(
        self,
        step: int,
        state: Any,
        metrics: Mapping[str, Any] | None = None,
        *,
        epoch: int | None = None,
        grace: float | None = None,
    ) -> PreemptionSave:
        """Commit ``state`` as checkpoint ``step`` before the job's machines are taken, and say
        how to exit (:class:`~savepoint.runs.preemption.PreemptionSave`; ``sys.exit(r.exit_code)``).

        The budget is ``grace`` seconds (default: the ``preemption_grace`` the manager was
        opened with, 25), counted from this process's first signal (else from the call of
        :meth:`preempted` that first answered True: another rank's signal; else from now). In
        order: the async save in flight is finished if it commits in time to leave room for
        this save (an estimate from the last save's duration), otherwise abandoned (it stops
        at its next write and its transaction removes what it wrote: nothing of it is committed
        or listed); background verification and retention stop where they are and are left to
        the next run; then ``step`` is committed synchronously with the commit protocol, its
        books synced, nothing deleted. A step already committed (by the save in flight, or an
        earlier save) is not written again. No signal is needed: it saves all the same (exit
        code 0). Signals arriving meanwhile only set the flag again. With a process group every
        rank calls it with the same step (checked: ValueError on every rank otherwise), and all
        ranks return the same answer. A save that cannot be committed (a full disk) raises
        CheckpointWriteError as ``save`` does; failures that do not stop it (the save in flight,
        an earlier verification) are logged and listed in ``errors``. The steps:
        :class:`savepoint.runs.preempting.Preempting`."""
        return self._preempting.save(
            step,
            state,
            metrics,
            epoch,
            grace,
            default_grace=self.preemption_grace,
            saving=self._saving,
        )

    # -- restoring -----------------------------------------------------------------------------

    def restore(
        self, into: Any, step: StepSpec = "latest", *, resume: bool = True, **load_options: Any
    ) -> int | None:
        """Restore checkpoint ``step`` ("latest", "best" or a number) into ``into``.

        Returns the step restored. With ``resume`` (the default) the run continues from that step:
        the report forgets history after it (the resumed run logs those steps again), records the
        lineage, and retention protects that checkpoint; ``resume=False`` only loads. Nothing is
        written here (restoring works on read-only media): the next save or ``log()`` records
        the resume, and a ``close()`` with neither in between writes nothing for it (an
        evaluation changes nothing). With "latest", a checkpoint that fails verification is
        skipped (with a warning) for the next older one; None means the run has no checkpoint at
        all. "best" and explicit steps are never substituted: missing or corrupt is an error.

        Next to a live writer (a read-only manager), the checkpoint chosen may be deleted or
        replaced by the writer before it is read: then "latest" and "best" choose again from what
        the run holds now (never a warning, never an error for an intact run), and an explicit
        step that was deleted is CheckpointNotFoundError saying so.
        """
        self._check_open()
        with self._saving:
            self.wait()
            found = self._restorer.read(step, {**load_options, "into": into})
            if found is None:
                log.info("%s: no checkpoint to restore: a fresh start", self.directory)
                return None
            log.info(
                "%s: restored checkpoint %d (asked for %r)%s",
                self.directory,
                found[0],
                step,
                "; the run resumes from it" if resume else "",
            )
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
            found = self._restorer.read(step, {**load_options, "keys": keys})
            return None if found is None else found[1]

    def _resumed(self, step: int) -> int:
        """The run continues from ``step``: in memory now; on disk with the next save or
        ``log()``, never by ``close()`` alone (runs.books)."""
        with self._lock:
            self._books.resume(step)
            self._saver.last_saved = step
        return step

    def _forget_resume(self) -> None:
        with self._lock:
            self._books.forget_resume()

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
                    self._saver.check_writer()
                report = collect(self._run, grace=grace, dry_run=dry_run, lock=False)
                if not dry_run and self._blob_handles is not None:
                    self._blob_handles.before_gc()
                    self._blob_handles.collect()
                return report

    def wait(self) -> None:
        """Block until any background save is committed and the background step of the last
        save (verifying the new checkpoint, then retention's deletions) is done; raise a save's
        error if it failed, or the verification failure it found."""
        self._saver.wait()

    def close(self) -> None:
        """Finish pending saves and their background step, write the final report, and release
        the writer lock; then raise what failed (a background save, a verification).

        A manager that no longer holds the lock (runs.lock: a forked child, a lock file taken by
        another writer) writes nothing; the latter is RunLockedError unless a save raised it
        already. A second ``close()`` does nothing."""
        with self._saving:
            if self._closed:
                return
            try:
                self._close()
            except BaseException as exc:
                also = self._settle.take_error()
                if also is not None and hasattr(exc, "add_note"):
                    exc.add_note(f"and the background step of a save failed: {also}")
                raise
            self._raise_verification_error()
            if self._tiers is not None:
                self._tiers.raise_error()

    def _close(self) -> None:
        try:
            self._saver.close()
        finally:
            self._closed = True
            self._join_background()
            self._settle.worker.stop()
            if self._tiers is not None:
                self._tiers.close()  # the copy-ups finish (their failures are raised below)
            self._forget_resume()
            try:
                if (
                    self._writes_books()
                    and (self._books.dirty or self._catalog.discarding or self._books.pending)
                    and self._still_writer()
                ):
                    with self._lock:
                        self._finish_discards()
                        self._books.fill(self._books.steps_now())
                        try:
                            self._books.store_report()
                        except OSError as exc:
                            raise self._write_error(
                                f"cannot write the final {REPORT_FILE} of {self.directory} "
                                "(the checkpoints are intact; the report is rewritten by the "
                                "next save)",
                                exc,
                            ) from exc
            finally:
                self._release_lock()
                if self._books.history is not None:
                    with contextlib.suppress(OSError):
                        self._books.history.close()
                _LIVE.discard(self)
                preemption = self._preempting.preemption
                if preemption is not None and not preemption.close():
                    log.info(
                        "%s: closed outside the main thread: its preemption handlers (flag "
                        "only) stay installed",
                        self.directory,
                    )

    def _still_writer(self) -> bool:
        """For close(): whether this manager may still write the run's books."""
        if self._writer is None:
            return True  # another rank's manager (its books are rank 0's) or none needed
        if os.getpid() != self._pid:
            return False  # a forked child: the books are the parent's
        if self._saver.lock_error_raised:
            return False
        self._saver.check_writer()
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


class _Weak:
    """A part's view of its manager, holding no reference to it: a manager nobody closed is
    freed once dropped (its finalizer releases the run's lock), not at the next cyclic
    collection."""

    def __init__(self, manager: CheckpointManager) -> None:
        self._manager = weakref.ref(manager)

    def _get(self) -> CheckpointManager:
        manager = self._manager()
        assert manager is not None, "a save of a manager that is gone"
        return manager


class _SaverHost(_Weak):
    """The manager as its Saver asks for it (:class:`savepoint.runs.saving.Host`)."""

    def check_open(self) -> None:
        self._get()._check_open()

    def num_params(self) -> int | None:
        return self._get().run.num_params

    def adopt_num_params(self) -> None:
        manager = self._get()
        if manager.run.num_params is None:
            manager.run = dataclasses.replace(
                manager.run, num_params=manager._books.report.num_params
            )
            with contextlib.suppress(CheckpointWriteError):  # the next open rewrites it
                manager._finish_open_run()

    def keep(self) -> object:
        return self._manager()


def _nothing(*_: object) -> None:
    """The background step's blob callbacks of a run that is not incremental."""


def _forget_in_child() -> None:
    """A forked child has none of its parent's threads: a background step running at the fork
    is the parent's (it may have held a manager's locks, which would never be released in the
    child). The child's copies get fresh locks and no background step; they cannot write the
    run anyway (the writer lock is checked at every save: RunLockedError)."""
    for manager in list(_LIVE):
        manager._lock = threading.RLock()
        manager._saving = threading.RLock()
        manager._settle.forget_in_child(manager._lock)  # (its worker forgets its own step)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


@atexit.register
def _finish_at_exit() -> None:
    """At interpreter exit, let background steps finish (they may be deleting), and print what
    failed: there is nobody left to raise it to."""
    for manager in list(_LIVE):
        if manager._pid != os.getpid():
            continue  # a forked child's copy: the books are the parent's
        try:
            manager.wait()
        except BaseException as exc:
            print(f"savepoint: {exc}", file=sys.stderr)


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
    return errors_map.read_error(
        exc, directory, head=f"cannot open the run {directory}", what="the run"
    )


def _policy(argument: str, make: Callable[..., Any], n: Any, *more: Any) -> Any:
    """``make(n, *more)``, its TypeError or ValueError naming the manager's ``argument`` (the
    policy checks ``n``: an int, at least its minimum)."""
    try:
        return make(n, *more)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{argument}={n!r}: {exc}") from None


def _grace(value: Any, name: str) -> float:
    """A grace budget in seconds: a positive finite number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, not {type(value).__name__}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive number of seconds, not {value!r}")
    return float(value)


def _compressed(policy: Any, compression: Any) -> Any:
    """The blob policy of ``CheckpointManager(..., compression=)``: ``"zstd"`` or a
    :class:`savepoint.blobs.Compression`, merged into ``policy`` (a BlobPolicy or None); a policy
    that names another compression is a ValueError."""
    import importlib.util

    from savepoint.blobs import BlobPolicy, Compression

    if isinstance(compression, str):
        if compression != "zstd":
            raise ValueError(
                f"compression must be None, 'zstd' or a savepoint.blobs.Compression, not "
                f"{compression!r} (for another zstd level: compression=Compression(level=3))"
            )
        chosen = BlobPolicy.of(compression).compression
    elif isinstance(compression, Compression):
        chosen = compression
    else:
        raise TypeError(
            "compression must be None, 'zstd' or a savepoint.blobs.Compression, not "
            f"{type(compression).__name__} ({compression!r})"
        )
    if importlib.util.find_spec("zstandard") is None:
        raise IncompatibleCheckpointError(
            "compression='zstd' needs the zstandard package: pip install zstandard "
            "(or pip install 'savepoint[zstd]')"
        )
    if policy is None:
        return BlobPolicy(compression=chosen)
    if policy.compression is None:
        return dataclasses.replace(policy, compression=chosen)
    if policy.compression != chosen:
        raise ValueError(
            f"compression={compression!r} conflicts with blob_policy's compression "
            f"({policy.compression!r}): give one of them"
        )
    return policy


def _tiers(value: Any) -> list[Tier]:
    """The ``tiers=`` argument: None or a sequence of :class:`~savepoint.runs.tiers.Tier`."""
    if value is None:
        return []
    if isinstance(value, (str, bytes, Tier)) or not isinstance(value, Sequence):
        raise TypeError(f"tiers must be a list of sp.Tier, not {value!r}")
    for tier in value:
        if not isinstance(tier, Tier):
            raise TypeError(f"tiers must be a list of sp.Tier, not one holding {tier!r}")
    return list(value)


def _rank(process_group: Any) -> int:
    if process_group is None:
        return 0
    import torch.distributed as dist

    return int(dist.get_rank(group=process_group))
