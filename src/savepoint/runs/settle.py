"""The background step of a managed save (step 6 of the manager's save sequence): settle.

:class:`Settle` runs it for a :class:`~savepoint.runs.manager.CheckpointManager`: the aliases a
save replaced are removed, the run directory and the history log are synced, checkpoints left
under ``discarding`` are deleted; then, if retention would delete anything, the new checkpoint
is read back and verified (``verify_before_prune``), and only once it verified does retention
pick the checkpoints to delete (never the newest, the current best, the checkpoint the run
resumed from, or one a tier copy or a peer-memory replication is reading), ``report.json``
name them under ``discarding`` (synced) and the deletion run; object stores' history segments are compacted. Once a
preemption save started (``preempting``), all but the syncs wait for the next run.

A synchronous save's step runs on the manager's one long-lived :class:`Worker` thread (started
at the first save, stopped by ``close()``: no thread is started per save); an async save runs it
in its own writer thread (:meth:`Settle.run`). What it fails with is kept in one error slot,
raised once by the next save, ``wait()`` or ``close()`` (:meth:`Settle.take_error`). A forked
child has none of its parent's threads: its workers forget the step running at the fork.
Retention's decisions and the deletions are logged (logger ``savepoint.runs.manager``, INFO).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

from savepoint import checkpoint, errors_map
from savepoint.async_.pending import PendingSave
from savepoint.errors import CheckpointError, CorruptCheckpointError
from savepoint.info import CheckpointInfo
from savepoint.runs import aliases, layout, policies
from savepoint.runs.books import Books, write_error
from savepoint.runs.peers import PeerMemory
from savepoint.runs.policies import Entry, RetentionPolicy
from savepoint.runs.tiers import TierCopier
from savepoint.storage.paths import Location

__all__ = ["Settle", "Worker", "verify_here"]

# (the manager's logger: its retention decisions are documented under that name)
log = logging.getLogger("savepoint.runs.manager")


class Worker:
    """One long-lived daemon thread that runs jobs one at a time, started by the first
    :meth:`submit`. It holds a job only while it runs it (never its owner: a manager nobody
    closed can still be garbage collected; its finalizer calls :meth:`stop`)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._forget()
        _WORKERS.add(self)

    def _forget(self) -> None:
        self._cond = threading.Condition()
        self._job: Callable[[], None] | None = None
        self._busy = False  # a job submitted and not finished
        self._stopped = False
        self._thread: threading.Thread | None = None

    def submit(self, job: Callable[[], None]) -> None:
        """Run ``job`` on the worker (the last job has finished: :meth:`join`)."""
        with self._cond:
            assert not self._busy, "one job at a time"
            self._job, self._busy, self._stopped = job, True, False
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while self._job is None and not self._stopped:
                    self._cond.wait()
                job, self._job = self._job, None
                if job is None:  # stopped: a later submit starts another thread
                    self._thread = None
                    return
            try:
                job()
            finally:
                del job
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def busy(self) -> bool:
        """Whether a job submitted has not finished."""
        return self._busy

    def join(self) -> None:
        """Wait until no job is running (at once from the worker's own thread)."""
        if threading.current_thread() is self._thread:
            return
        with self._cond:
            while self._busy:
                self._cond.wait()

    def stop(self) -> None:
        """End the thread once its job (if any) is done; a later :meth:`submit` starts one."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()


_WORKERS: weakref.WeakSet[Worker] = weakref.WeakSet()


def _forget_in_child() -> None:
    for worker in list(_WORKERS):
        worker._forget()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


class Settle:
    """Step 6 for the run ``books`` keeps (see the module docstring). ``lock`` is the manager's
    (the books are shared with the caller's thread: the fork hook of runs.lifecycle replaces both);
    ``collect`` deletes the blobs no checkpoint names (after retention deleted some),
    ``scrub(step)`` the damaged blobs a checkpoint that did not verify names."""

    def __init__(
        self,
        books: Books,
        lock: Any,
        *,
        retention: RetentionPolicy,
        verify_before_prune: bool,
        collect: Callable[[], None],
        scrub: Callable[[int], None],
    ) -> None:
        self.books, self.lock = books, lock
        self.retention, self.verify_before_prune = retention, verify_before_prune
        self.collect, self.scrub = collect, scrub
        self.tiers: TierCopier | None = None  # (set once the open made them)
        self.peers: PeerMemory | None = None  # the peer-memory tier (runs.peers)
        self.preempting = threading.Event()  # set by a preemption save: see the module docstring
        self.verifying: int | None = None  # the step being read back
        self.worker = Worker("savepoint-books")
        self._error: BaseException | None = None  # the one error slot
        self._error_lock = threading.Lock()

    # -- the worker and the error slot -----------------------------------------------------------

    def start(
        self,
        step: int,
        info: CheckpointInfo | None,
        settled: PendingSave | None,
        swapped: list[aliases.Staging],
    ) -> None:
        """Step 6 for checkpoint ``step`` on the worker: the caller's save returns now (the last
        step has finished). Its end resolves ``settled``; its error goes to the slot."""

        def job() -> None:
            error: BaseException | None = None
            try:
                error = self.run(step, swapped)
            except Exception as exc:  # a thread has nobody to raise to: the next call raises it
                error = exc if isinstance(exc, CheckpointError) else _failure(exc)
            except BaseException as exc:  # (a simulated crash, an interpreter shutting down)
                error = exc
            finally:
                if error is not None:
                    self.keep(error)
                if settled is not None and not settled.done():
                    if error is None:
                        settled.set_result(info)
                    else:
                        settled.set_exception(error)

        self.worker.submit(job)

    def join(self) -> None:
        """Wait for the step running (not from the worker itself)."""
        self.worker.join()

    def keep(self, error: BaseException) -> None:
        """Keep ``error`` for the next call to raise (the first one kept wins)."""
        with self._error_lock:
            if self._error is None:
                self._error = error

    def take_error(self) -> BaseException | None:
        """The error kept (once: the slot is emptied)."""
        with self._error_lock:
            error, self._error = self._error, None
        return error

    def forget_in_child(self, lock: Any) -> None:
        """A forked child's copy: the manager's new ``lock``, an empty slot."""
        self.lock, self._error_lock, self._error = lock, threading.Lock(), None

    # -- the step ----------------------------------------------------------------------------------

    def run(
        self,
        step: int,
        swapped: list[aliases.Staging],
        verify: Callable[[str | Location], None] | None = None,
    ) -> CheckpointError | None:
        """Remove the aliases ``swapped`` replaced, make the books durable, delete what left the
        run, verify checkpoint ``step`` (with ``verify(path)``: an async save's writer process
        reads it back; by default here) and apply retention, compact the history. Returns the
        error to report (a failed verification, a failed sync); tidying that fails is retried
        later. Once a preemption save started, all but the syncs wait for the next run."""
        error = self.sync_books(swapped)
        if error is not None or self.preempting.is_set():
            return error
        books, catalog = self.books, self.books.catalog
        if self.tiers is not None:
            self.tiers.submit(step, layout.checkpoint_arg(catalog.step_location(step)))
        with self.lock:
            self.finish_discards()  # an abandoned timeline, deletions an earlier save left
            doomed = self.doomed(step, books.steps_now())
        if not doomed:
            self.compact()
            return None
        if self.verify_before_prune and step not in books.verified:
            if self.preempting.is_set():
                return None
            self.verifying = step  # (a preemption save does not wait for this)
            try:
                (verify or verify_here)(layout.checkpoint_arg(catalog.step_location(step)))
            except (CheckpointError, OSError) as exc:
                return self.verification_failed(step, exc)
            finally:
                self.verifying = None
            books.verified.add(step)
        with self.lock:
            if self.preempting.is_set():
                return None  # retention decides in the next run
            self._retain(step)
        self.compact()
        return None

    def _retain(self, step: int) -> None:
        """Retention, once checkpoint ``step`` verified: the report names the checkpoints it
        deletes as leaving before they are deleted (a crash in between leaves them for the next
        open to delete). The caller holds the lock."""
        books, catalog = self.books, self.books.catalog
        live = books.steps_now()
        doomed = self.doomed(step, live)
        if not doomed:
            return
        log.info(
            "%s: retention deletes checkpoints %s: not kept by %s (kept: %s; the newest, "
            "step %d, verified)",
            books.directory,
            sorted(doomed),
            policies.to_spec(self.retention),
            [s for s in live if s not in doomed],
            step,
        )
        discarding = catalog.discarding | doomed
        books.fill([s for s in live if s not in doomed], discarding)
        try:
            books.store_report()
        except OSError:
            books.fill(live)  # nothing deleted; the next save decides again
        else:
            catalog.discarding = discarding
            self.finish_discards()
            self.collect()

    def sync_books(self, swapped: list[aliases.Staging]) -> CheckpointError | None:
        """The first part of step 6: remove the aliases ``swapped`` replaced, then make the
        report's and the aliases' renames and the history log durable. Returns the error."""
        for alias in swapped:
            alias.finish()
        books = self.books
        try:
            # The report's and the aliases' renames (and a new history.jsonl's name), then the
            # records appended to the history log.
            books.store.sync_dir(books.run.path)
            if books.history is not None:
                books.history.sync()
        except OSError as exc:
            return write_error(
                books.store,
                f"cannot make the books of {books.directory} durable (the checkpoints are "
                "intact; report.json, latest/, best/ and the loss and metric history logged "
                "since the previous save may be brought back to their previous state by a "
                "power cut, which the next open repairs)",
                exc,
            )
        return None

    def compact(self) -> None:
        history = self.books.history
        if history is not None and not self.preempting.is_set():
            with contextlib.suppress(OSError, CheckpointError):  # the next save compacts
                history.compact()

    def finish_discards(self) -> None:
        """Delete the checkpoints that left the run (none once a preemption save started: the
        next open deletes them)."""
        self.books.finish_discards(self.preempting.is_set)

    def doomed(self, newest: int, live: list[int]) -> set[int]:
        """The steps retention deletes from ``live`` once ``newest`` is verified. Checkpoints
        that failed verification are not counted (they never take a good one's place); the
        newest, the best and the one resumed from are always kept."""
        books, catalog = self.books, self.books.catalog
        entries = [Entry(s, catalog.metrics.get(s, {})) for s in live if s not in catalog.failed]
        keep = self.retention.keep(entries)
        keep |= {s for s in (newest, catalog.best_among(live), books.resumed_from) if s is not None}
        if self.tiers is not None:
            keep |= self.tiers.pending_steps()  # a copy-up is reading it
        if self.peers is not None:
            keep |= self.peers.pending_steps()  # a replication is reading it
        return {s for s in live if s not in keep}

    def verification_failed(self, step: int, exc: BaseException) -> CheckpointError:
        """Record that checkpoint ``step`` did not verify (report.verify_failures); from now on
        retention does not count it and it is never the best. Returns the error to raise."""
        books = self.books
        err = CorruptCheckpointError(
            f"checkpoint {step} of {books.directory} did not verify when read back after saving "
            f"({exc}); it is saved but nothing was pruned, and retention will not count it (nor "
            "choose it as best): it is recorded in report.json under verify_failures and "
            "deleted once a newer checkpoint verifies",
            path=str(books.catalog.step_location(step)),
        )
        err.__cause__ = exc
        log.warning(
            "%s: checkpoint %d did not verify when read back: %s", books.directory, step, exc
        )
        if isinstance(exc, CorruptCheckpointError):
            self.scrub(step)
        with self.lock:
            books.record_failure(step, exc)
        return err


def verify_here(path: str | Location) -> None:
    """The read-back before pruning, in this process: past the page cache (the bytes on the
    disk, at about the cost of the hash; a mapped read-back cost the trainer about 0.4 s of CPU
    per GiB in page faults on the development machine)."""
    checkpoint.verify(path, direct=True)


def _failure(exc: BaseException) -> CheckpointError:
    """A background step's unexpected failure, as the error the next call raises."""
    if isinstance(exc, OSError):
        error: CheckpointError = errors_map.write_error(
            exc,
            exc.filename if isinstance(exc.filename, str) else None,
            "the background step of a save failed",
        )
    else:
        error = CheckpointError(f"the background step of a save failed: {exc!r}")
    error.__cause__ = exc
    return error
