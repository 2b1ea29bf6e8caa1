"""``CheckpointManager``: a run directory whose checkpoints survive crashes, full disks and retention.

Opening (``CheckpointManager(directory, ...)``): every argument is checked first, before anything
is touched (:class:`savepoint.runs.config.ManagerConfig`). The open itself is
:class:`savepoint.runs.opening.Opening` (its docstring has the steps): a manager that can write the
directory takes the run's writer lock (:mod:`savepoint.runs.lock`; with a ``process_group`` only
rank 0 does, the rank that keeps the books), so a second writer gets RunLockedError naming the
holder. It then removes temporaries of dead processes and repairs what an interrupted writer left:
it finishes deletions the report lists as ``discarding``, lists checkpoints a killed save
committed but did not record (nothing committed is dropped), and makes ``latest/`` and ``best/``
agree with ``report.json`` (republished, or removed when the report names no such checkpoint). A
directory this process cannot write (read-only media, no write permission, or ``read_only=True``)
gives a *read-only* manager: it writes nothing and takes no lock; ``steps``, ``latest_step``,
``best_step`` and ``restore`` work, ``save`` raises CheckpointWriteError. Unreadable run files
are CheckpointPermissionError. A run that lost its ``run.json`` gets it back from the identity
its ``report.json`` records; a damaged ``report.json`` is CorruptCheckpointError saying how to
have it rebuilt. An open that fails writes nothing and holds nothing.

One writer, checked at every save: the writer lock is checked before each save and at
``close()``; a manager in a forked child, or one whose lock file was replaced (another writer may
have written the run since), raises RunLockedError and writes nothing more, not even at
``close()`` (:mod:`savepoint.runs.lock`). Threads may share a manager: ``save``, ``restore`` and
``close`` run one at a time.

Sequence of ``save(step, state, metrics)`` (steps 3-5 are the run's books,
:class:`savepoint.runs.books.Books`, over the checkpoints' metrics, :mod:`savepoint.runs.catalog`;
an open's repair is :func:`savepoint.runs.opening.repair`):

1. the save policy decides whether this step is written (``force=True`` always writes);
2. the checkpoint is written with the commit protocol to ``checkpoints/step-<step>``
   (synchronously, or snapshotted and written in the background with ``async_save=True``). If a
   checkpoint of that step already exists it is first hard-linked aside (copied where the store
   has no hard links), so a failed save can put it back;
3. once committed, the run's books: after a resume, checkpoints newer than this step (the
   abandoned timeline) leave the run (the report names them under ``discarding``);
4. the records logged since the last save (and this save's metrics) are appended to the history
   log (:mod:`savepoint.runs.history`) and the new ``report.json`` is written aside, its fsync
   started (:func:`~savepoint.runs.report.stage_json`); the aliases that change are staged (hard
   links, :class:`~savepoint.runs.aliases.StagedLinks`, or a pointer on object stores: the last
   step that needs free space) and swapped in;
5. ``report.json`` is replaced atomically (a rename, once its fsync is done): it lists the new
   checkpoint. ``save`` returns here: the checkpoint is committed and synced, the report names
   it. On a disk that is one fsync beyond a plain ``sp.save`` (the report's bytes, made while
   the aliases are linked); the
   renames of the report and the aliases are synced in step 6, and a power cut before that
   brings back the previous report and aliases, whole, which the next open repairs as it does
   after a kill;
6. *the background step* (:mod:`savepoint.runs.settle`: on the manager's one worker thread,
   started by its first save; inside the writer thread of an async save): the
   previous aliases are removed, the run directory and the history log are synced, checkpoints
   left under ``discarding`` are deleted; then, if retention would delete anything, the new
   checkpoint is read back and verified (manifest and every checksum: ``verify_before_prune``),
   and only once it verified does retention pick the checkpoints to delete (never the newest,
   the current best, or the checkpoint this run resumed from), ``report.json`` name them under
   ``discarding`` (synced) and the deletion run; object stores' history segments are compacted.
   ``wait()``, ``close()``, the next save and every query (``steps()``, ``latest_step()``,
   ``best_step()``) wait for it; the ``PendingSave`` a synchronous save returns is done when it
   is.

A checkpoint that fails verification is kept and nothing is pruned; the failure is recorded in
``report.json`` (``verify_failures``) and raised, once, as CorruptCheckpointError by the save's
``PendingSave.wait()`` and by the next ``save`` (which then saves nothing: call it again),
``wait()`` or ``close()``. From then on retention does not count that checkpoint (it never takes
a verified one's place under ``keep_last``/``keep_best``, and is deleted once a newer one
verifies) and it is never the best. At interpreter exit a background step still running is
finished, and a failure it found is printed.

Failure semantics. Every error out of the manager (``save``, ``PendingSave.wait()`` and
``exception()`` of an async save, ``wait``, ``close``, ``restore``) is a CheckpointError subclass,
usage errors aside (a bad argument is ValueError, a closed manager RuntimeError);
a failed write is CheckpointWriteError with the failing call's ``errno`` (``errno.ENOSPC`` for a
full disk), never a raw OSError and never the bare base class; a write the store refused says so
in the store's own words, with the store's advice (credentials and bucket policy on an object
store, permissions on a disk: :func:`savepoint.commit.transaction.refused_hint`). A save that
fails in steps 2-5 has *not* happened: the checkpoint is removed again (or the previous checkpoint
of that step put back), ``report.json``, the history log and the aliases are as they were, nothing
was deleted, and the message says so. Only if undoing fails as well does the error say what is
left (the next open repairs it). A failure in step 6 does not undo the save: a deletion that
fails leaves the checkpoint on disk, not part of the run, and is retried by the next save,
``close()`` or open; a failed sync of the books is CheckpointWriteError from the next save,
``wait()`` or ``close()``. A SIGKILL at any point leaves the old run or the new one: a checkpoint
committed in step 2 is kept and listed by the next open, even if its books were never written,
and a history record cut short is ignored (and cut off by the next writing open). A background
save whose commit fails does not count as a save for the save policy (nor does a failed
synchronous one). An exception leaving a ``with CheckpointManager(...)`` block is not replaced by
a failure of the ``close()`` it triggers: that error is attached to it as a note (printed on
Python 3.10).

A save given metrics but none named ``best_metric`` (a misspelt name, say) warns once per
manager (UserWarning): that checkpoint can never be ranked as the best.

Preemption (``preemption=True`` or a list of signals; docs/runs.md, "Preemption"): flag-only
handlers (:mod:`savepoint.runs.preemption`) installed at open from the main thread and removed by
``close()``; ``preempted()`` reads the flag (with a process group: the ranks' agreed answer, one
all-reduce every ``preemption_every`` calls); ``save_on_preemption(step, state)`` works to a grace
budget (``preemption_grace``, 25 s, from the notice): the async save in flight is finished if it
commits in time to leave room for this save, otherwise abandoned (its next write raises, its
transaction removes what it wrote); from then on background steps stop before verification,
retention, deletions and compaction (the next run does them); ``step`` is committed synchronously
and its books synced (steps 2-5, and the syncs of step 6); the result carries ``exit_code``
(128 + the signal). Retention decisions, deletions, restore choices and fallbacks, and preemption
are logged (``logging``, logger ``savepoint.runs.manager``, INFO).

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
import os
import signal
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal

from savepoint import checkpoint
from savepoint.async_.checkpointer import AsyncCheckpointer
from savepoint.async_.pending import PendingSave
from savepoint.commit.transaction import discard
from savepoint.errors import (
    CheckpointError,
    CheckpointWriteError,
    RunLockedError,
)
from savepoint.info import CheckpointInfo
from savepoint.options import SaveOptions
from savepoint.runs import aliases, layout, opening
from savepoint.runs.books import Books, plain, write_error
from savepoint.runs.catalog import Catalog
from savepoint.runs.config import ManagerConfig
from savepoint.runs.config import seconds as _grace
from savepoint.runs.gc import GcReport, collect
from savepoint.runs.incremental import BlobHandles
from savepoint.runs.lock import WriterLock
from savepoint.runs.policies import Mode, RetentionPolicy, SavePolicy
from savepoint.runs.preemption import (
    DEFAULT_GRACE,
    Preemption,
    PreemptionSave,
    max_over_ranks,
)
from savepoint.runs.report import (
    REPORT_FILE,
    Report,
    count_elements,
)
from savepoint.runs.restoring import Restorer, StepSpec
from savepoint.runs.settle import Settle
from savepoint.runs.tiers import Tier, TierCopier
from savepoint.storage.base import Store
from savepoint.storage.paths import Location, PathArg, resolve

__all__ = ["CheckpointManager", "PreemptionSave", "StepSpec", "reader"]

log = logging.getLogger(__name__)

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
    ValueError from this constructor, naming it, before anything is touched (as is every other
    argument: :class:`savepoint.runs.config.ManagerConfig`). ``save_options`` is the result.

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
        # Every argument is checked (runs.config) before anything is touched.
        arguments = dict(locals())
        del arguments["self"], arguments["directory"]
        extra = arguments.pop("save_options")
        self._start(directory, ManagerConfig.of(**arguments, **extra), check_consistent=True)

    def _start(self, directory: PathArg, config: ManagerConfig, *, check_consistent: bool) -> None:
        """The open (runs.opening) of a manager asked for ``config``: see :func:`reader`."""
        self._config = config
        self._run = resolve(directory, what="run directory")
        # Incremental saves: the run's blob store and what its saves share (runs.incremental).
        self._blob_handles = (
            BlobHandles(self._run, policy=config.blob_policy, frozen=config.frozen)
            if config.incremental
            else None
        )
        # The run's checkpoints and their metrics (runs.catalog), and its books (report, history
        # log, lineage, aliases: runs.books).
        self._catalog = Catalog(
            self._run, best_metric=config.best_metric, best_mode=config.best_mode
        )
        self._books = Books(
            self._run, self._catalog, retention=config.retention, aliases=config.aliases
        )
        # Which checkpoint restore() and peek() read, and from where (runs.restoring).
        self._restorer = Restorer(self._run, self._catalog, self._books.steps_now)
        self._lock = threading.RLock()
        # save(), restore() and close() run one at a time (threads sharing a manager): two saves
        # at once would stage into one buffer, or verify a checkpoint the other is replacing.
        self._saving = threading.RLock()
        # The background step of each save (runs.settle: syncs, verification, retention), on
        # one worker thread, and the error it left for the next save, wait() or close().
        self._settle = Settle(
            self._books,
            self._lock,
            retention=config.retention,
            verify_before_prune=config.verify_before_prune,
            collect=_nothing if self._blob_handles is None else self._blob_handles.collect,
            scrub=_nothing if self._blob_handles is None else self._blob_handles.scrub,
        )
        stop_worker = weakref.finalize(self, self._settle.worker.stop)
        stop_worker.atexit = False  # (at exit the worker finishes its step: see _finish_at_exit)
        # Preemption (see save_on_preemption): once a preemption save started
        # (_settle.preempting) the background steps defer verification, retention and deletions
        # to the next run.
        self._preemption_logged = False
        self._noticed_at: float | None = None  # when preempted() first answered True
        self._write_seconds: float | None = None  # how long the last save took to commit
        self._preempt_sync_error: CheckpointError | None = None
        self._closed = False
        self._last_saved: int | None = None
        self._best_warned = False
        self._inflight: int | None = None  # the step an async save is writing
        self._last_async: _AsyncSave | None = None
        self._lock_error_raised = False
        # The open (runs.opening): the lock, run.json and report.json, the tiers, the repair.
        self._opened = opening.Opening(
            self._run, config, self._books, self._settle, check_consistent=check_consistent
        ).open(self)
        self.run = self._opened.run
        self._restorer.tiers = self._opened.tiers
        # Set by save_on_preemption: an async save it gives up on stops at its next write.
        self._abandon = _Abandon(self.save_options.progress)
        self._async = (
            AsyncCheckpointer(**{**self.save_options.changed(), "progress": self._abandon.progress})
            if config.async_save
            else None
        )
        if self._opened.writes_books:
            _LIVE.add(self)

    # -- what was asked for (runs.config) and what the open found (runs.opening) ---------------

    @property
    def directory(self) -> str:
        """The run directory: a plain path on the local disk, else its URL."""
        return self._books.directory

    @property
    def save_options(self) -> SaveOptions:
        return self._config.save_options

    @property
    def retention(self) -> RetentionPolicy:
        """Every retention rule given, as one :class:`~savepoint.runs.policies.AnyOf`."""
        return self._config.retention

    @property
    def save_policy(self) -> SavePolicy:
        return self._config.save_policy

    @property
    def verify_before_prune(self) -> bool:
        return self._config.verify_before_prune

    @property
    def aliases(self) -> bool:
        return self._config.aliases

    @property
    def incremental(self) -> bool:
        return self._config.incremental

    @property
    def preemption_grace(self) -> float:
        return self._config.preemption.grace

    @property
    def read_only(self) -> bool:
        return self._opened.read_only

    @property
    def read_only_reason(self) -> str | None:
        """Why the manager is read-only (None when it writes)."""
        return self._opened.read_only_reason

    # (for the save route and the preemption flow)

    @property
    def _store(self) -> Store:
        return self._run.store

    @property
    def _leader(self) -> bool:
        return self._opened.leader

    @property
    def _writer(self) -> WriterLock | None:
        return self._opened.writer

    @property
    def _tiers(self) -> TierCopier | None:
        return self._opened.tiers

    @property
    def _preemption(self) -> Preemption | None:
        return self._opened.preemption

    def _finish_open_run(self) -> None:
        """Write ``run.json`` again (a writer's): the first save counted the parameters."""
        if self._opened.writes_books:
            opening.write_run(self._run, self.run)

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
        see the module docstring). Threads may share a manager: their saves run one after the
        other."""
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
        preempt: bool = False,
    ) -> PendingSave:
        """``preempt``: save_on_preemption's save (it dealt with the save in flight and the
        background step already): synchronous, its books synced here, no background step."""
        self._check_open()
        if not preempt:
            # The last save's background step first: its verification failure is raised here,
            # before this save starts (nothing is saved by this call then: call it again).
            self._join_background()
            self._raise_verification_error()
            if self._async is not None:
                self._raise_background_error()
            if self._tiers is not None:
                self._tiers.raise_error()
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
        self._books.dirty = True
        self._keep_resume()
        clean = plain(dict(metrics or {}))
        self._warn_unranked(step, clean)
        target = self._checkpoint(step)
        meta = {"savepoint_run": {"step": step, "epoch": epoch, "metrics": clean}}
        # A run given no num_params records the size of its state (report.json, then run.json).
        derived = None
        if self._leader and self.run.num_params is None and self._books.report.num_params is None:
            derived = count_elements(state)
        backup = self._before_commit(step, preempt) if self._leader else None
        previous, self._last_saved = self._last_saved, step
        flight = _AsyncSave(step, previous)
        settled: PendingSave | None = None
        begun = time.monotonic()

        def committed(info: CheckpointInfo) -> None:
            flight.committed = True
            self._write_seconds = time.monotonic() - begun
            flight.background = self._after_commit(
                step,
                clean,
                epoch,
                backup,
                previous,
                derived,
                info,
                settled,
                preempt,
                flight.booked.set,
            )
            if derived is not None and self.run.num_params is None:
                self.run = dataclasses.replace(self.run, num_params=self._books.report.num_params)
                with contextlib.suppress(CheckpointWriteError):  # the next open rewrites it
                    self._finish_open_run()

        if self._async is not None and not preempt:
            blobs = self._blob_handles
            incremental = {} if blobs is None else blobs.async_options()
            try:
                pending = self._async.save(
                    target, state, metadata=meta, on_commit=committed, **incremental
                )
            except BaseException:
                self._books.drop(backup)
                self._last_saved = previous
                raise
            pending._future.add_done_callback(lambda _: flight.booked.set())
            if backup is not None:  # a failed background commit leaves it; committed() uses it
                pending._future.add_done_callback(lambda _: self._books.drop(backup))
            pending.step = step
            flight.pending = pending
            self._last_async = flight
            self._inflight = step
            return pending
        # Done when the background step (verification, retention) is: wait() raises its error.
        settled = PendingSave(self.step_path(step), step)
        try:
            if self._blob_handles is not None:
                info = self._blob_handles.save(target, state, meta, self.save_options)
            else:
                info = checkpoint.save(target, state, metadata=meta, **self.save_options.changed())
        except BaseException:
            self._books.drop(backup)
            self._last_saved = previous
            raise
        committed(info)
        if not flight.background:
            settled.set_result(info)
        return settled

    def _warn_unranked(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Warn (once per manager) when a save gives metrics but none named ``best_metric`` (a
        misspelt name, say): that checkpoint can never be the best, nor be kept by
        ``keep_best``. A save given no metrics at all is a deliberate unranked save: no
        warning."""
        if self._catalog.best_metric is None or not metrics or self._catalog.best_metric in metrics:
            return
        if self._best_warned or not self._leader:
            return
        self._best_warned = True
        given = ", ".join(sorted(metrics)) or "none"
        warnings.warn(
            f"{self.directory}: save({step}) gave no {self._catalog.best_metric!r} in its metrics (it gave "
            f"{given}), so that checkpoint is never ranked as the best (best_metric="
            f"{self._catalog.best_metric!r}); this warning is given once per CheckpointManager",
            stacklevel=4,
        )

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

    def _before_commit(self, step: int, preempt: bool = False) -> str | None:
        """Prepare to (re)use the name of checkpoint ``step``: finish a pending deletion of an
        old checkpoint of that step, and hard-link an existing one aside (returned) so that a
        failed save can put it back. Raises CheckpointWriteError with nothing changed."""

        def exists() -> bool:
            return layout.committed(self._step(step))

        pending = self._catalog.discarding | self._books.discarding_on_disk
        if not exists() and step not in pending and step != self._inflight:
            return None
        # The save in flight (async) or the background step may be verifying, deleting or
        # relinking this step.
        if preempt:
            # (their errors are save_on_preemption's to report, not to raise here)
            flight = self._last_async
            if flight is not None and flight.pending is not None:
                flight.pending.exception()
            self._join_background()
        else:
            self.wait()
        with self._lock:
            try:
                if step in self._catalog.discarding:
                    discard(self._store, self._step(step).path)
                    self._catalog.discarding = self._catalog.discarding - {step}
                    self._catalog.metrics.pop(step, None)
                if step in self._books.discarding_on_disk:
                    # The report must stop naming it for deletion before a new checkpoint takes
                    # its name: an open after a kill would delete the new one otherwise.
                    self._books.fill(self._books.steps_now())
                    self._books.store_report()
                if not exists():
                    return None
                return aliases.copy_aside(self._step(step))
            except OSError as exc:
                raise self._write_error(
                    f"cannot save step {step} to {self.directory}: preparing its directory failed; "
                    "nothing was saved and the run is as before",
                    exc,
                ) from exc

    def log(self, step: int, loss: float | None = None, **metrics: Any) -> None:
        """Record a training step's loss (the report's loss curve) and any other values.

        O(1): the record joins the report in memory and is appended to the run's history log
        (:mod:`savepoint.runs.history`) by the next save or ``close()``."""
        with self._lock:
            self._books.log(step, loss, metrics)

    def _after_commit(
        self,
        step: int,
        metrics: dict[str, Any],
        epoch: int | None,
        backup: str | None,
        previous: int | None,
        num_params: int | None = None,
        info: CheckpointInfo | None = None,
        settled: PendingSave | None = None,
        preempt: bool = False,
        booked: Callable[[], None] | None = None,
    ) -> bool:
        """Steps 3-5 of the module docstring for the committed checkpoint ``step``
        (``num_params``: derived from its state, recorded in the report), then step 6 started
        in the background (its end resolves ``settled``, the handle a synchronous save
        returns). Returns whether a background step was started. ``preempt``: a preemption
        save: the books are synced here and the rest of step 6 is left to the next run.
        ``booked``: called once the report names the checkpoint (an async save)."""
        if not preempt:
            self._join_background()  # an async save's books wait for the last background step
        with self._lock:
            if not self._leader:
                self._catalog.metrics[step] = metrics
                return False
            try:
                swapped = self._books.record(step, metrics, epoch, num_params, backup)
            except CheckpointWriteError:  # undone (runs.books): the save did not happen
                if self._last_saved == step:  # the save policy counts from the last save
                    self._last_saved = previous
                raise
            # Done: the checkpoint is saved and recorded. What follows runs in the background
            # (removing the previous aliases too: unlinks the save need not wait for).
            if preempt:
                # What must survive the exit: the report's and aliases' renames, the history.
                # Verification, retention and deletions wait for the next run.
                self._preempt_sync_error = self._settle.sync_books(swapped)
                return False
            if self._async is None:
                self._settle.start(step, info, settled, swapped)
                return True
        # An async save: this is the background already (its writer thread); the save's
        # PendingSave is done once this is, and raises what it found.
        if booked is not None:
            booked()
        error = self._settle.run(step, swapped)
        if error is not None:
            raise error
        return False

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
        return self._preemption

    def preempted(self, *, local: bool = False) -> bool:
        """Whether to stop for a preemption notice (a signal given to ``preemption=``).

        Without a process group: a memory read, cheap anywhere (data loading, evaluation,
        warm-up). With one (the manager's ``process_group``): the answer every rank agrees on,
        from one all-reduce (MAX over the ranks' flags, on that group) every
        ``preemption_every``-th call, so call it at the same points on every rank (once per
        step, say); once True it stays True without further collectives. Ranks therefore stop at
        the same call even when the signal reached only some of them. ``local=True``: this
        process's own flag, no collective (for code that runs on some ranks only; stop at an
        agreed call all the same)."""
        p = self._preemption
        if p is None:
            raise RuntimeError(
                f"{self!r} was opened without preemption=...: pass preemption=True (SIGTERM, "
                "SIGUSR1) or a list of signals to be told of preemption notices"
            )
        answer = p.requested() if local else p.poll()
        if answer and not self._preemption_logged:
            self._preemption_logged = True
            self._noticed_at = time.monotonic()
            if p.requested():
                log.info(
                    "%s: preemption notice: %s received %.2f s ago; stopping",
                    self.directory,
                    _signal_name(p.signum),
                    p.elapsed(),
                )
            else:
                log.info("%s: preemption notice received by another rank; stopping", self.directory)
        return answer

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
        an earlier verification) are logged and listed in ``errors``."""
        started = time.monotonic()
        self._check_open()
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, not {step!r}")
        budget = self.preemption_grace if grace is None else _grace(grace, "grace")
        p = self._preemption
        notice = p.received_at if p is not None else None
        # The budget runs from this process's signal, else from when preempted() first said so
        # (another rank's signal), else from now.
        base = notice if notice is not None else self._noticed_at
        deadline = (started if base is None else base) + budget
        # From now on, background steps stop before verifying, pruning or deleting.
        self._settle.preempting.set()
        errors: list[str] = []
        deferred: list[str] = []
        in_flight: Literal["none", "finished", "abandoned", "failed"] = "none"
        in_flight_step: int | None = None
        with self._saving:
            self._check_open()
            # Room for this save: twice the last save's time, a second at least (half the budget
            # when no save was timed yet).
            last = self._write_seconds
            reserve = budget / 2 if last is None else min(budget / 2, max(1.0, 2 * last))
            wait_until = deadline - reserve
            in_flight, in_flight_step, flight_error = self._end_in_flight(step, wait_until, reserve)
            if flight_error is not None:
                errors.append(flight_error)
            self._end_background(wait_until, errors, deferred)
            with self._lock:
                have = step in self._books.steps_now() and step not in self._catalog.failed
            signum = None if p is None else p.signum
            # One all-reduce: the ranks' steps (they must agree), the signal, whether any rank
            # lacks the step, whether any rank abandoned the save in flight.
            top, low, agreed, missing, gave_up = max_over_ranks(
                self.save_options.process_group,
                [step, -step, signum or 0, 0 if have else 1, int(in_flight == "abandoned")],
            )
            if top != -low:
                raise ValueError(
                    f"save_on_preemption: the ranks passed different steps (from {-low} to "
                    f"{top}); every rank must save the same step (stop at an agreed "
                    "mgr.preempted())"
                )
            signum = agreed or None
            if gave_up and in_flight == "failed":
                # Abandoned by another rank: a sharded save fails on every rank then.
                in_flight = "abandoned"
                if flight_error is not None:
                    errors.remove(flight_error)
            if missing:
                self._save(step, state, metrics, True, epoch, preempt=True)
                sync_error, self._preempt_sync_error = self._preempt_sync_error, None
                if sync_error is not None:
                    errors.append(str(sync_error))
            else:
                log.info("%s: step %d is committed already: not saved again", self.directory, step)
            committed_at = time.monotonic()
            copied_to = self._copy_on_preemption(step, deadline, errors, deferred)
        deferred.append(
            f"verifying step {step}, retention and deletions (the next run's first save)"
        )
        for error in errors:
            log.warning("%s: during the preemption save: %s", self.directory, error)
        since = None if notice is None else committed_at - notice
        result = PreemptionSave(
            step=step,
            path=self.step_path(step),
            saved=bool(missing),
            seconds=committed_at - started,
            since_notice=since,
            budget=budget,
            within_budget=committed_at <= deadline,
            signum=signum,
            exit_code=0 if signum is None else 128 + signum,
            in_flight=in_flight,
            in_flight_step=in_flight_step,
            deferred=tuple(deferred),
            errors=tuple(errors),
            copied_to=copied_to,
        )
        (log.info if result.within_budget else log.warning)(
            "%s: preemption save: step %d %s in %.2f s (%s; budget %g s%s); exit with %d",
            self.directory,
            step,
            "committed" if missing else "was committed already",
            result.seconds,
            "no signal" if since is None else f"{since:.2f} s after the notice",
            budget,
            "" if result.within_budget else ", EXCEEDED",
            result.exit_code,
        )
        return result

    def _copy_on_preemption(
        self, step: int, deadline: float, errors: list[str], deferred: list[str]
    ) -> tuple[str, ...]:
        """With tiers: copy checkpoint ``step`` to the first tier (due or not) and wait for it
        until ``deadline``; returns the tier's name if the copy committed in time."""
        if self._tiers is None or not self._tiers.tiers:
            return ()
        first = self._tiers.tiers[0]
        self._tiers.submit(step, self._checkpoint(step), [first])
        if not self._tiers.wait(max(0.0, deadline - time.monotonic())):
            deferred.append(f"copying step {step} to tier {first.label!r} (not done in time)")
            return ()
        try:
            self._tiers.raise_error()
        except CheckpointError as exc:
            errors.append(str(exc))
        try:
            copied = layout.committed(self._tiers.location(first, step))
        except CheckpointError as exc:  # not known to be there: not counted as copied
            errors.append(str(exc))
            copied = False
        return (first.label,) if copied else ()

    def _end_in_flight(
        self, step: int, wait_until: float, reserve: float
    ) -> tuple[Literal["none", "finished", "abandoned", "failed"], int | None, str | None]:
        """Finish the async save in flight if it commits by ``wait_until``, else abandon it
        (it stops at its next write; its transaction removes what it wrote). Returns what
        became of it, its step, and its error (consumed: reported by save_on_preemption)."""
        in_flight: Literal["none", "finished", "abandoned", "failed"] = "none"
        flight, step_in_flight, error = self._last_async, None, None
        if flight is not None and flight.pending is not None and not flight.pending.done():
            step_in_flight = flight.step
            if not flight.booked.wait(max(0.0, wait_until - time.monotonic())):
                log.info(
                    "%s: abandoning the save of step %d in flight: it would not commit in time "
                    "to leave %.1f s for step %d",
                    self.directory,
                    flight.step,
                    reserve,
                    step,
                )
                self._abandon.step = flight.step
                flight.booked.wait()  # it stops at its next write (or has just committed)
            # Committed: its background step stops before retention (a verification already
            # reading it back is left to finish: it only reads).
            self._wait_unless_verifying(flight.pending.done, wait_until)
            self._abandon.step = None
            in_flight = "finished"
            if not flight.committed:
                cause = flight.pending.exception()
                gave_up = isinstance(cause, _Abandoned) or isinstance(
                    getattr(cause, "__cause__", None), _Abandoned
                )
                in_flight = "abandoned" if gave_up else "failed"
        if self._async is not None and (
            flight is None or flight.pending is None or flight.pending.done()
        ):
            try:
                self._async._raise_background_error()
            except CheckpointError as exc:
                if in_flight != "abandoned":
                    error = str(exc)
            self._settle_async(wait=False)
        return in_flight, step_in_flight, error

    def _end_background(self, wait_until: float, errors: list[str], deferred: list[str]) -> None:
        """Let the background step of the last save reach its end (it stops before retention);
        past ``wait_until`` leave a verification that is still reading a checkpoint back."""
        busy = self._settle.worker.busy
        if busy():
            self._wait_unless_verifying(lambda: not busy(), wait_until)
        verifying = self._settle.verifying
        if verifying is not None:
            deferred.append(f"verifying step {verifying} (still reading it back)")
        if not busy():
            earlier = self._settle.take_error()
            if earlier is not None:
                errors.append(str(earlier))

    def _wait_unless_verifying(self, done: Callable[[], bool], until: float) -> None:
        """Wait until ``done()``; past ``until`` stop waiting for a background step that is
        reading a checkpoint back (it only reads, then stops before retention)."""
        while not done():
            if time.monotonic() >= until and self._settle.verifying is not None:
                return
            time.sleep(0.005)

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
            self._last_saved = step
        return step

    def _keep_resume(self) -> None:
        with self._lock:
            self._books.keep_resume()

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
        if not self._opened.writes_books:
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
                report = collect(self._run, grace=grace, dry_run=dry_run, lock=False)
                if not dry_run and self._blob_handles is not None:
                    self._blob_handles.before_gc()
                    self._blob_handles.collect()
                return report

    def wait(self) -> None:
        """Block until any background save is committed and the background step of the last
        save (verifying the new checkpoint, then retention's deletions) is done; raise a save's
        error if it failed, or the verification failure it found."""
        try:
            if self._async is not None:
                try:
                    self._async.wait()
                finally:
                    self._settle_async(wait=True)
        finally:
            self._join_background()
        self._raise_verification_error()
        if self._tiers is not None:
            self._tiers.wait()
            self._tiers.raise_error()

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
            if self._async is not None:
                try:
                    self._async.close()
                finally:
                    self._settle_async(wait=True)
        finally:
            self._closed = True
            self._join_background()
            self._settle.worker.stop()
            if self._tiers is not None:
                self._tiers.close()  # the copy-ups finish (their failures are raised below)
            self._forget_resume()
            try:
                self._write_final_report()
            finally:
                self._give_back()

    def _write_final_report(self) -> None:
        """close()'s ``report.json``: what saves, logs and deletions left unwritten (by a
        writer that still holds the run: see _still_writer)."""
        books = self._books
        if not self._opened.writes_books:
            return
        if not (books.dirty or self._catalog.discarding or books.pending):
            return
        if not self._still_writer():
            return
        with self._lock:
            self._finish_discards()
            books.fill(books.steps_now())
            try:
                books.store_report()
            except OSError as exc:
                raise self._write_error(
                    f"cannot write the final {REPORT_FILE} of {self.directory} (the checkpoints "
                    "are intact; the report is rewritten by the next save)",
                    exc,
                ) from exc

    def _give_back(self) -> None:
        """close()'s last step, whatever failed: what the open took is released."""
        self._opened.release_lock()
        if self._books.history is not None:
            with contextlib.suppress(OSError):
                self._books.history.close()
        _LIVE.discard(self)
        if self._preemption is not None and not self._preemption.close():
            log.info(
                "%s: closed outside the main thread: its preemption handlers (flag only) stay "
                "installed",
                self.directory,
            )

    def _still_writer(self) -> bool:
        """For close(): whether this manager may still write the run's books."""
        if self._writer is None:
            return True  # another rank's manager (its books are rank 0's) or none needed
        if os.getpid() != self._opened.pid:
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


@dataclasses.dataclass
class _AsyncSave:
    """A background save, for the save policy: the step and the last save before it."""

    step: int
    previous: int | None
    pending: PendingSave | None = None
    committed: bool = False  # its checkpoint was committed (_after_commit ran)
    background: bool = False  # _after_commit started a background step
    # Set once the report names it (before its background step), or once it failed.
    booked: threading.Event = dataclasses.field(default_factory=threading.Event)


class _Abandoned(CheckpointError):
    """An async save that save_on_preemption gave up on: stopped before its commit."""


class _Abandon:
    """The progress hook of a manager's async saves: the user's ``progress``, and a stop for
    the save ``step`` once save_on_preemption abandons it (raised at its next write, before its
    commit: the transaction removes what it wrote). Holds no reference to the manager."""

    def __init__(self, progress: Callable[[int, int], Any] | None) -> None:
        self.user = progress
        self.step: int | None = None

    def progress(self, done: int, total: int) -> None:
        step = self.step
        if step is not None:
            raise _Abandoned(
                f"the save of step {step} was abandoned: a preemption notice left no time to "
                "finish it; nothing of it was committed"
            )
        if self.user is not None:
            self.user(done, total)


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
        if manager._opened.pid != os.getpid():
            continue  # a forked child's copy: the books are the parent's
        try:
            manager.wait()
        except BaseException as exc:
            print(f"savepoint: {exc}", file=sys.stderr)


def _signal_name(signum: int | None) -> str:
    if signum is None:
        return "a notice"
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def reader(directory: PathArg, *, check_consistent: bool = True) -> CheckpointManager:
    """A read-only manager of the run at ``directory`` (``read_only=True``: no lock, writes
    nothing). ``check_consistent=False`` also opens a run whose ``report.json`` disagrees with
    its ``run.json`` or its checkpoints, as it is (``sp.open_run``'s view lists the problems)."""
    manager = CheckpointManager.__new__(CheckpointManager)
    manager._start(directory, ManagerConfig.of(read_only=True), check_consistent=check_consistent)
    return manager
