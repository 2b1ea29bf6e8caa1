"""The route of a managed save: :class:`Saver`, the save sequence of a
:class:`~savepoint.runs.manager.CheckpointManager`.

Sequence of ``save(step, state, metrics)`` (steps 3-5 are the run's books,
:class:`savepoint.runs.books.Books`, over the checkpoints' metrics, :mod:`savepoint.runs.catalog`;
step 6 is :mod:`savepoint.runs.settle`):

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

With a peer-memory tier (:mod:`savepoint.runs.peers`), every rank hands each committed
checkpoint to it as soon as the commit is known (before step 3: a save whose books then fail
is committed all the same, and every rank must replicate the same steps), and the next save,
``wait()`` and ``close()`` raise what its last replication left, as they do a tier's copy-up.

The steps of :meth:`Saver.save`, each a method: check (the last save's background errors, the
step, read-only, :meth:`Saver._check`), decide (the save policy, :meth:`Saver._decide`), prepare
(the writer lock, the metrics, the backup of step 2, :meth:`Saver._prepare`), write
(:meth:`Saver._write_sync` or :meth:`Saver._write_async`), book (steps 3-5 and the start of 6,
:meth:`Saver._book`). A save that fails before its commit, or whose books fail, does not count
as a save for the save policy (``Saver.last_saved`` goes back to the save before it), nor does a
background save whose commit fails (:meth:`Saver.settle_async`). A save given metrics but none
named ``best_metric`` (a misspelt name, say) warns once per manager (UserWarning): that
checkpoint can never be ranked as the best.

The Saver holds no reference to its manager (a manager nobody closed is freed once dropped: its
finalizer releases the run's lock): what it asks of it goes through a :class:`Host` holding a
weak reference, and an async save in flight keeps the manager alive (``Host.keep``) until it is
done, so the run's lock is never released under it. The lock it takes is the manager's
(``Settle.lock``: the fork hook of :mod:`savepoint.runs.lifecycle` replaces it there).
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from savepoint import checkpoint
from savepoint.async_.checkpointer import AsyncCheckpointer, Writer, WriterPriority
from savepoint.async_.pending import PendingSave
from savepoint.commit.transaction import discard
from savepoint.errors import (
    CheckpointArgumentError,
    CheckpointError,
    CheckpointWriteError,
    RunLockedError,
)
from savepoint.info import CheckpointInfo
from savepoint.options import SaveOptions
from savepoint.runs import aliases, layout
from savepoint.runs.books import Books, append_pending, plain, write_error
from savepoint.runs.lock import WriterLock
from savepoint.runs.pacing import Pacing
from savepoint.runs.policies import SavePolicy
from savepoint.runs.report import count_elements
from savepoint.runs.settle import Settle, verify_here
from savepoint.storage.paths import Location

__all__ = ["BlobSaving", "Host", "Saver", "abandoned", "check_step", "unranked_warning"]


class Host(Protocol):
    """What a :class:`Saver` asks of its manager (an implementation holds it weakly)."""

    def check_open(self) -> None:
        """Raise RuntimeError if the manager is closed."""

    def num_params(self) -> int | None:
        """The run's ``num_params`` as its identity (``run.json``) has it; None: not known."""

    def adopt_num_params(self) -> None:
        """A save recorded the element count of its state in the report: the run takes it
        (``run.json`` rewritten, best effort: the next open rewrites it)."""

    def keep(self) -> object:
        """The object an async save in flight keeps alive until it is done (the manager)."""


class BlobSaving(Protocol):
    """The incremental route of a save (the run's blob store): ``runs.incremental.BlobHandles``."""

    def save(
        self, target: str | Location, state: Any, meta: dict[str, Any], save_options: SaveOptions
    ) -> CheckpointInfo:
        """A synchronous incremental save of ``target``."""

    def async_options(self, shared: bool = True) -> dict[str, Any]:
        """The keywords an async save passes (``blobs``, ``blob_policy``, ``memo``, ...)."""


class Saver:
    """The save route of one manager (see the module docstring): the run ``books``, the
    background step ``settle``, the save ``options``, the ``save_policy``; ``leader``: this rank
    keeps the run's books; ``async_save``: saves are written by an AsyncCheckpointer owned here;
    ``blobs``: the incremental route (None: plain saves). The open tells it whether it may write
    and the writer lock (:meth:`opened`). Its caller holds the manager's save lock."""

    def __init__(
        self,
        books: Books,
        settle: Settle,
        options: SaveOptions,
        *,
        save_policy: SavePolicy,
        leader: bool,
        async_save: bool,
        blobs: BlobSaving | None,
        host: Host,
        writer: Writer | None = None,
        writer_priority: WriterPriority | None = None,
    ) -> None:
        self.books, self.catalog, self.settle = books, books.catalog, settle
        self.options, self.leader = options, leader
        self.pacing = Pacing(save_policy, options.process_group)  # the save policy, asked
        self.blobs, self.host = blobs, host
        self.read_only = False
        self.read_only_reason: str | None = None
        self.writer: WriterLock | None = None
        self.lock_error_raised = False  # the writer lock was lost and RunLockedError raised
        self.last_saved: int | None = None  # the save policy's last save
        self.write_seconds: float | None = None  # how long the last save took to commit
        self.last_async: _AsyncSave | None = None
        self._inflight: int | None = None  # the step an async save is writing
        self._best_warned = False
        # Set by save_on_preemption (runs.preempting): an async save it gives up on stops at
        # its next write.
        self.abandon = _Abandon(options.progress)
        self.checkpointer = (
            _checkpointer(options, self.abandon, writer, writer_priority) if async_save else None
        )

    @property
    def lock(self) -> Any:
        """The manager's lock (the books' and the background step's)."""
        return self.settle.lock

    def opened(self, read_only: bool, reason: str | None, writer: WriterLock | None) -> None:
        """What the open found: whether this manager writes nothing (and why), its writer lock."""
        self.read_only, self.read_only_reason, self.writer = read_only, reason, writer

    def path(self, step: int) -> str:
        """Checkpoint ``step``'s directory, as the manager's ``step_path``."""
        return str(self.catalog.step_location(step))

    # -- the save ------------------------------------------------------------------------------

    def save(
        self,
        step: int,
        state: Any,
        metrics: Mapping[str, Any] | None,
        force: bool,
        epoch: int | None,
    ) -> PendingSave:
        """The manager's ``save`` (its save lock held): see the module docstring."""
        self._check(step, preempt=False)
        if not self._decide(step, force):
            return PendingSave.finished(None, step, skipped=True)
        job = self._prepare(step, state, metrics, epoch, preempt=False, stacklevel=4)
        if self.checkpointer is not None:
            return self._write_async(job, state)
        return self._write_sync(job, state)

    def save_now(
        self,
        step: int,
        state: Any,
        metrics: Mapping[str, Any] | None,
        epoch: int | None,
        stacklevel: int,
    ) -> CheckpointError | None:
        """save_on_preemption's save (it dealt with the save in flight and the background step
        already): forced, synchronous, its books synced here, no background step. Returns the
        error of that sync (the checkpoint is committed and recorded all the same).
        ``stacklevel``: the frame a warning points at (the manager's caller), counting this one
        as 1."""
        self._check(step, preempt=True)
        job = self._prepare(step, state, metrics, epoch, preempt=True, stacklevel=stacklevel + 1)
        self._write_sync(job, state)
        return job.sync_error

    def _check(self, step: int, preempt: bool) -> None:
        """Raise what the last save left (its background step's or background save's error:
        nothing is saved by this call then), a bad ``step``, a read-only run."""
        self.host.check_open()
        if not preempt:
            # The last save's background step first: its verification failure is raised here,
            # before this save starts (nothing is saved by this call then: call it again).
            self.settle.join()
            self._raise_verification_error()
            if self.checkpointer is not None:
                self._raise_background_error()
            for copies in (self.settle.tiers, self.settle.peers):  # (what their last copy left)
                if copies is not None:
                    copies.raise_error()
        check_step(step)
        if self.read_only:
            raise _read_only(self.books.directory, step, self.read_only_reason)

    def _decide(self, step: int, force: bool) -> bool:
        """Whether ``step`` is written (step 1: :class:`~savepoint.runs.pacing.Pacing`)."""
        return self.pacing.decide(step, self.last_saved, force)

    def _prepare(
        self,
        step: int,
        state: Any,
        metrics: Mapping[str, Any] | None,
        epoch: int | None,
        preempt: bool,
        stacklevel: int,
    ) -> _Job:
        """Check the writer lock, note the resume, the metadata, the backup of an existing
        checkpoint of ``step`` (step 2); from here the save policy counts ``step`` as saved
        (put back if the save fails). ``stacklevel``: as :meth:`save_now`'s, from here."""
        self.check_writer()
        self.books.dirty = True
        with self.lock:
            self.books.keep_resume()
        clean = plain(dict(metrics or {}))
        self._warn_unranked(step, clean, stacklevel + 1)
        target = layout.checkpoint_arg(self.catalog.step_location(step))
        meta = {"savepoint_run": {"step": step, "epoch": epoch, "metrics": clean}}
        # A run given no num_params records the size of its state (report.json, then run.json).
        derived = None
        if self.leader and self.host.num_params() is None and self.books.report.num_params is None:
            derived = count_elements(state)
        backup = self._before_commit(step, preempt) if self.leader else None
        previous, self.last_saved = self.last_saved, step
        self.pacing.started(step)
        return _Job(
            step, epoch, clean, preempt, target, meta, derived, backup, _AsyncSave(step, previous)
        )

    def _write_async(self, job: _Job, state: Any) -> PendingSave:
        """Stage ``state`` and hand the write to the AsyncCheckpointer: its commit calls
        :meth:`_book` from its writer thread."""
        assert self.checkpointer is not None
        # The background thread runs the blob store's save session, then (committed: retention
        # and the blob collection) after it is closed (a writer process keeps its own memo).
        job.in_process = self.checkpointer.writes_in_process(job.target)
        shared = not job.in_process
        incremental = self.blobs.async_options(shared) if self.blobs is not None else {}
        if job.in_process and self.leader:
            with self.lock:  # it commits even if this process dies now: the history goes now
                append_pending(self.books)
        job.keep = self.host.keep()  # (the manager stays alive until the save is done)
        flight, backup = job.flight, job.backup
        try:
            pending = self.checkpointer.save(
                job.target,
                state,
                metadata=job.meta,
                on_commit=functools.partial(self._book, job),
                **incremental,
            )
        except BaseException:
            self.books.drop(backup)
            self.last_saved = flight.previous
            self.pacing.failed(job.step)
            raise
        pending._future.add_done_callback(lambda _: flight.booked.set())
        _watch(pending, flight, self.pacing, self.books)
        if backup is not None:  # a failed background commit leaves it; _book uses it
            pending._future.add_done_callback(lambda _: self.books.drop(backup))
        pending.step = job.step
        flight.pending = pending
        self.last_async = flight
        self._inflight = job.step
        return pending

    def _write_sync(self, job: _Job, state: Any) -> PendingSave:
        """Write and commit ``state`` here, then book it; the PendingSave returned is done when
        the background step (verification, retention) is: wait() raises its error."""
        job.settled = settled = PendingSave(self.path(job.step), job.step)
        _watch(settled, job.flight, self.pacing, self.books)
        try:
            if self.blobs is not None:
                info = self.blobs.save(job.target, state, job.meta, self.options)
            else:
                info = checkpoint.save_with(job.target, state, job.meta, self.options)
        except BaseException:
            self.books.drop(job.backup)
            self.last_saved = job.flight.previous
            self.pacing.failed(job.step)
            raise
        self._book(job, info)
        if not job.flight.background:
            settled.set_result(info)
        return settled

    def _book(self, job: _Job, info: CheckpointInfo) -> None:
        """The checkpoint is committed: steps 3-6, and the run's num_params if derived."""
        flight = job.flight
        flight.committed = True
        self.write_seconds = time.monotonic() - job.begun
        if self.settle.peers is not None:  # every rank, every committed save, before its books
            self.settle.peers.submit(job.step, job.target)
        flight.background = self._after_commit(job, info)
        if job.derived is not None:
            self.host.adopt_num_params()

    def _before_commit(self, step: int, preempt: bool) -> str | None:
        """Prepare to (re)use the name of checkpoint ``step``: finish a pending deletion of an
        old checkpoint of that step, and hard-link an existing one aside (returned) so that a
        failed save can put it back. Raises CheckpointWriteError with nothing changed."""
        where = self.catalog.step_location(step)

        def exists() -> bool:
            return layout.committed(where)

        pending = self.catalog.discarding | self.books.discarding_on_disk
        if not exists() and step not in pending and step != self._inflight:
            return None
        # The save in flight (async) or the background step may be verifying, deleting or
        # relinking this step.
        if preempt:
            # (their errors are save_on_preemption's to report, not to raise here)
            flight = self.last_async
            if flight is not None and flight.pending is not None:
                flight.pending.exception()
            self.settle.join()
        else:
            self.wait()
        with self.lock:
            try:
                if step in self.catalog.discarding:
                    discard(self.books.store, where.path)
                    self.catalog.discarding = self.catalog.discarding - {step}
                    self.catalog.metrics.pop(step, None)
                if step in self.books.discarding_on_disk:
                    # The report must stop naming it for deletion before a new checkpoint takes
                    # its name: an open after a kill would delete the new one otherwise.
                    self.books.fill(self.books.steps_now())
                    self.books.store_report()
                if not exists():
                    return None
                return aliases.copy_aside(where)
            except OSError as exc:
                raise write_error(
                    self.books.store,
                    f"cannot save step {step} to {self.books.directory}: preparing its directory "
                    "failed; nothing was saved and the run is as before",
                    exc,
                ) from exc

    def _after_commit(self, job: _Job, info: CheckpointInfo) -> bool:
        """Steps 3-5 of the module docstring for the committed checkpoint ``job.step``
        (``job.derived``: the element count of its state, recorded in the report), then step 6
        started in the background (its end resolves ``job.settled``, the handle a synchronous
        save returns). Returns whether a background step was started. A preemption save: the
        books are synced here (the sync's error in ``job.sync_error``) and the rest of step 6
        is left to the next run. An async save: ``booked`` is set once the report names it."""
        step = job.step
        if not job.preempt:
            self.settle.join()  # an async save's books wait for the last background step
        with self.lock:
            if not self.leader:
                self.catalog.metrics[step] = job.metrics
                return False
            try:
                swapped = self.books.record(step, job.metrics, job.epoch, job.derived, job.backup)
            except CheckpointWriteError:  # undone (runs.books): the save did not happen
                if self.last_saved == step:  # the save policy counts from the last save
                    self.last_saved = job.flight.previous
                raise
            # Done: the checkpoint is saved and recorded. What follows runs in the background
            # (removing the previous aliases too: unlinks the save need not wait for).
            if job.preempt:
                # What must survive the exit: the report's and aliases' renames, the history.
                # Verification, retention and deletions wait for the next run.
                job.sync_error = self.settle.sync_books(swapped)
                return False
            if self.checkpointer is None:
                self.settle.start(step, info, job.settled, swapped)
                return True
        # An async save: this is the background already (its writer thread); the save's
        # PendingSave is done once this is, and raises what it found.
        job.flight.booked.set()
        error = self.settle.run(step, swapped, _verifier(self.checkpointer, job))
        if error is not None:
            raise error
        return False

    # -- what the last save left ------------------------------------------------------------------

    def wait(self) -> None:
        """The manager's ``wait()``: block until any background save is committed and the
        background step of the last save is done; raise a save's error if it failed, or the
        verification failure it found; then the tiers' copies."""
        try:
            if self.checkpointer is not None:
                try:
                    self.checkpointer.wait()
                finally:
                    self.settle_async(wait=True)
        finally:
            self.settle.join()
        self._raise_verification_error()
        for copies in (self.settle.tiers, self.settle.peers):
            if copies is not None:
                copies.wait()
                copies.raise_error()

    def close(self) -> None:
        """Finish the background save in flight and close the AsyncCheckpointer (raising what
        failed, after the save policy forgot a save whose commit failed)."""
        if self.checkpointer is not None:
            try:
                self.checkpointer.close()
            finally:
                self.settle_async(wait=True)

    def take_background_error(self) -> CheckpointError | None:
        """The error of a background save that failed (once; None if none), the save policy
        settled (not waiting for a save still in flight). Async saves only."""
        assert self.checkpointer is not None
        error = None
        try:
            self.checkpointer._raise_background_error()
        except CheckpointError as exc:
            error = exc
        self.settle_async(wait=False)
        return error

    def _raise_background_error(self) -> None:
        """Raise the error of a background save that failed (once), after forgetting it as the
        save policy's last save."""
        assert self.checkpointer is not None
        raised = True
        try:
            self.checkpointer._raise_background_error()
            raised = False
        finally:
            self.settle_async(wait=raised)

    def settle_async(self, *, wait: bool) -> None:
        """Once the last background save is done: if its commit failed (so it never reached
        ``_after_commit``, which undoes its own failures), the save policy counts from the save
        before it again. ``wait``: it is known to be finishing (its error was just raised)."""
        flight = self.last_async
        if flight is None or flight.pending is None:
            return
        if not wait and not flight.pending.done():
            return
        failed = flight.pending.exception() is not None
        with self.lock:
            if failed and not flight.committed and self.last_saved == flight.step:
                self.last_saved = flight.previous
            if self.last_async is flight:
                self.last_async = None

    def _raise_verification_error(self) -> None:
        """Raise (once) what the last background step reported."""
        error = self.settle.take_error()
        if error is not None:
            raise error

    def check_writer(self) -> None:
        """Raise unless this manager still holds the run's writer lock (runs.lock: a forked
        child, or a lock file deleted and taken by another writer)."""
        if self.writer is None:
            return
        try:
            self.writer.check()
        except RunLockedError:
            self.lock_error_raised = True
            raise

    def _warn_unranked(self, step: int, metrics: Mapping[str, Any], stacklevel: int) -> None:
        """Warn (once per manager) when a save gives metrics but none named ``best_metric``
        (:func:`unranked_warning`)."""
        if self._best_warned or not self.leader:
            return
        message = unranked_warning(self.books.directory, step, metrics, self.catalog.best_metric)
        if message is not None:
            self._best_warned = True
            warnings.warn(message, stacklevel=stacklevel)

    @property
    def save_policy(self) -> SavePolicy:
        return self.pacing.policy

    def log(self, step: int, loss: float | None, metrics: dict[str, Any]) -> None:
        """The manager's ``log()``: the record joins the report in memory (the history log gets
        it with the next save or ``close()``)."""
        with self.lock:
            self.books.log(step, loss, metrics)


def _verifier(
    checkpointer: AsyncCheckpointer | None, job: _Job
) -> Callable[[str | Location], None] | None:
    """How an async save's checkpoint is read back before pruning: by the writer process that
    wrote it (at its priority: the trainer pays nothing for the read and the hash), here where
    the thread wrote it or the writer process cannot answer (it died: that is no verdict on the
    checkpoint)."""
    if checkpointer is None or not job.in_process:
        return None

    def verify(path: str | Location) -> None:
        try:
            checkpointer.verify_in_process(path)
        except CheckpointWriteError:
            verify_here(path)

    return verify


def _checkpointer(
    options: SaveOptions, abandon: _Abandon, writer: Writer | None, priority: WriterPriority | None
) -> AsyncCheckpointer:
    """The AsyncCheckpointer of a manager's async saves (``abandon`` stops its save in flight).

    ``writer=None`` is ``AsyncCheckpointer()``'s default: the writer process, with the thread
    writer for each save it refuses. A save handed to the writer process commits even if this
    process is killed right after ``save()`` returned; the history ``log()`` gathered up to it is
    appended to the history log as it is handed over (:func:`~savepoint.runs.books.append_pending`), and the
    next open adopts the unbooked checkpoint (its metrics from its manifest)."""
    return AsyncCheckpointer(
        options=options,
        progress=abandon.progress,
        writer=writer,
        writer_priority=priority,
    )


def unranked_warning(
    directory: str, step: int, metrics: Mapping[str, Any], best: str | None
) -> str | None:
    """The warning for a save that gives metrics but none named ``best_metric`` (a misspelt
    name, say): that checkpoint can never be the best, nor be kept by ``keep_best``. None when
    there is nothing to warn about (a save given no metrics at all is a deliberate unranked
    save)."""
    if best is None or not metrics or best in metrics:
        return None
    given = ", ".join(sorted(metrics)) or "none"
    return (
        f"{directory}: save({step}) gave no {best!r} in its metrics (it gave {given}), so that "
        f"checkpoint is never ranked as the best (best_metric={best!r}); this warning is given "
        "once per CheckpointManager"
    )


def _watch(pending: PendingSave, flight: _AsyncSave, pacing: Pacing, books: Books) -> None:
    """Tell the save policy once the save is done (committed and its background step over: the
    next save would wait for it otherwise; ``Continuous`` starts the next one then), or failed;
    the report keeps the policy's figures."""

    def done(_: object) -> None:
        if flight.committed:
            pacing.durable(flight.step)
            books.report.save_intervals = pacing.achieved()
        else:
            pacing.failed(flight.step)

    pending._future.add_done_callback(done)


def check_step(step: Any) -> None:
    """A step is a non-negative int (else a CheckpointArgumentError: a ValueError and TypeError)."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointArgumentError(f"step must be a non-negative int, not {step!r}")


def _read_only(directory: str, step: int, reason: str | None) -> CheckpointWriteError:
    return CheckpointWriteError(
        f"cannot save step {step}: the run directory {directory} is read-only for this manager "
        f"({reason}); nothing was written. Restoring works; to save, open the run where it can "
        "be written",
        path=directory,
        errno=errno.EROFS,
    )


def abandoned(error: BaseException | None) -> bool:
    """Whether ``error`` (an async save's) is the stop of a save save_on_preemption abandoned."""
    return isinstance(error, _Abandoned) or isinstance(
        getattr(error, "__cause__", None), _Abandoned
    )


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


@dataclasses.dataclass
class _Job:
    """One save on its way (the steps of :meth:`Saver.save` hand it on)."""

    step: int
    epoch: int | None
    metrics: dict[str, Any]  # as recorded: plain JSON values
    preempt: bool
    target: str | Location
    meta: dict[str, Any]
    derived: int | None  # the element count of the state, when the run records it
    backup: str | None  # the checkpoint of that step it replaces, linked aside
    flight: _AsyncSave
    begun: float = dataclasses.field(default_factory=time.monotonic)
    settled: PendingSave | None = None  # what a synchronous save returns
    sync_error: CheckpointError | None = None  # a preemption save's books' sync
    keep: object = None  # what an async save keeps alive (Host.keep)
    in_process: bool = False  # an async save the writer process writes


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
