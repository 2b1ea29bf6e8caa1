"""A manager's life after its open: its two locks, ``close()``, ``gc()``, a fork, the exit.

:class:`Lifecycle` is what a :class:`~savepoint.runs.manager.CheckpointManager` shares between
its calls: ``lock`` (its books and background step: the :class:`~savepoint.runs.settle.Settle`
and the :class:`~savepoint.runs.saving.Saver` take the same one), ``saving`` (``save``,
``restore`` and ``close`` run one at a time: two saves at once would stage into one buffer, or
verify a checkpoint the other is replacing), whether it is closed, and what the open took
(:class:`~savepoint.runs.opening.Opened`). Like every part it holds no reference to its manager:
a manager nobody closed is freed once dropped (its finalizers release the run's lock and stop
its worker thread).

``close()``, in order, whatever fails along the way: the async save in flight is finished (its
AsyncCheckpointer closed), the background step of the last save joined and its worker stopped,
the tiers' copy-ups and the peer-memory replications finished; then ``report.json`` is written if a save, a ``log()`` or a
deletion left it unwritten (only by a manager that still holds the run: a forked child's copy
writes nothing, and a lock file another writer took is RunLockedError unless a save raised it
already), and what the open took is given back (the writer lock, the history log, the
preemption handlers: outside the main thread they stay installed, logged). Then the error of a
background save, the verification failure the last background step found and a tier's failed
copy are raised; an error of the close itself carries a background step's failure as a note.

``gc()`` (:mod:`savepoint.runs.gc`) runs after any background save has finished, under both
locks, with the writer lock checked; on an incremental run it also collects the blob store.

A forked child has none of its parent's threads: a background step running at the fork is the
parent's, and it may have held the locks, which would never be released in the child. The
child's copies get fresh locks and no background step; they cannot write the run anyway (the
writer lock is checked at every save: RunLockedError). At interpreter exit the background steps
of the writers still open are finished (they may be deleting) and what failed is printed:
there is nobody left to raise it to.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import logging
import os
import sys
import threading
import weakref
from typing import Any

from savepoint.errors import CheckpointWriteError
from savepoint.runs.books import Books, write_error
from savepoint.runs.gc import GcReport, collect
from savepoint.runs.incremental import BlobHandles
from savepoint.runs.opening import Opened
from savepoint.runs.report import REPORT_FILE
from savepoint.runs.saving import Saver
from savepoint.runs.settle import Settle
from savepoint.storage.paths import Location

__all__ = ["Lifecycle"]

# (the manager's logger)
log = logging.getLogger("savepoint.runs.manager")

# The writers whose background step (verification, retention) may still run or failed
# unreported: finished (and a failure printed) at interpreter exit.
_LIVE: weakref.WeakSet[Lifecycle] = weakref.WeakSet()


class Lifecycle:
    """The locks and the end of one manager of the run at ``run``, opened as ``opened``, over
    its parts (see the module docstring); ``lock`` is the one its ``settle`` was given."""

    def __init__(
        self,
        run: Location,
        opened: Opened,
        books: Books,
        settle: Settle,
        saver: Saver,
        blobs: BlobHandles | None,
        *,
        lock: Any,
    ) -> None:
        self.run, self.opened, self.books, self.settle = run, opened, books, settle
        self.saver, self.blobs = saver, blobs
        self.lock = lock
        self.saving = threading.RLock()
        self.closed = False
        if opened.writes_books:
            _LIVE.add(self)

    def check_open(self) -> None:
        if self.closed:
            raise RuntimeError(
                f"the CheckpointManager for {self.books.directory} is closed; open a new one to "
                "save or restore"
            )

    # -- gc() ----------------------------------------------------------------------------------

    def gc(self, grace: float, dry_run: bool) -> GcReport:
        """The manager's ``gc()``."""
        self.check_open()
        opened = self.opened
        if not opened.writes_books:
            why = (
                opened.read_only_reason
                if opened.read_only
                else "only rank 0 writes the run's files"
            )
            raise CheckpointWriteError(
                f"cannot collect garbage in {self.books.directory}: this manager does not write "
                f"the run ({why}); nothing was removed",
                path=self.books.directory,
                errno=errno.EROFS,
            )
        with self.saving:
            self.saver.wait()
            with self.lock:
                if not dry_run:
                    self.saver.check_writer()
                report = collect(self.run, grace=grace, dry_run=dry_run, lock=False)
                if not dry_run and self.blobs is not None:
                    self.blobs.before_gc()
                    self.blobs.collect()
                return report

    # -- close() -------------------------------------------------------------------------------

    def close(self) -> None:
        """The manager's ``close()`` (see the module docstring)."""
        with self.saving:
            if self.closed:
                return
            try:
                self._close()
            except BaseException as exc:
                also = self.settle.take_error()
                if also is not None and hasattr(exc, "add_note"):
                    exc.add_note(f"and the background step of a save failed: {also}")
                raise
            error = self.settle.take_error()  # what the last background step reported
            if error is not None:
                raise error
            if self.opened.tiers is not None:
                self.opened.tiers.raise_error()
            if self.opened.peers is not None:
                self.opened.peers.raise_error()

    def _close(self) -> None:
        try:
            self.saver.close()
        finally:
            self.closed = True
            self.settle.join()
            self.settle.worker.stop()
            if self.opened.tiers is not None:
                self.opened.tiers.close()  # the copy-ups finish (their failures are raised after)
            if self.opened.peers is not None:
                self.opened.peers.close()  # the replications finish (raised after, too)
            with self.lock:
                self.books.forget_resume()
            try:
                self._write_final_report()
            finally:
                self._give_back()

    def _write_final_report(self) -> None:
        """close()'s ``report.json``: what saves, logs and deletions left unwritten (by a
        writer that still holds the run: see _still_writer)."""
        books = self.books
        if not self.opened.writes_books:
            return
        if not (books.dirty or books.catalog.discarding or books.pending):
            return
        if not self._still_writer():
            return
        with self.lock:
            self.settle.finish_discards()
            books.fill(books.steps_now())
            try:
                books.store_report()
            except OSError as exc:
                raise write_error(
                    self.run.store,
                    f"cannot write the final {REPORT_FILE} of {books.directory} (the checkpoints "
                    "are intact; the report is rewritten by the next save)",
                    exc,
                ) from exc

    def _give_back(self) -> None:
        """close()'s last step, whatever failed: what the open took is released."""
        self.opened.release_lock()
        if self.books.history is not None:
            with contextlib.suppress(OSError):
                self.books.history.close()
        _LIVE.discard(self)
        preemption = self.opened.preemption
        if preemption is not None and not preemption.close():
            log.info(
                "%s: closed outside the main thread: its preemption handlers (flag only) stay "
                "installed",
                self.books.directory,
            )

    def _still_writer(self) -> bool:
        """For close(): whether this manager may still write the run's books."""
        if self.opened.writer is None:
            return True  # another rank's manager (its books are rank 0's) or none needed
        if os.getpid() != self.opened.pid:
            return False  # a forked child: the books are the parent's
        if self.saver.lock_error_raised:
            return False
        self.saver.check_writer()
        return True


def _forget_in_child() -> None:
    """A forked child's copies: fresh locks, no background step (see the module docstring)."""
    for life in list(_LIVE):
        life.lock = threading.RLock()
        life.saving = threading.RLock()
        life.settle.forget_in_child(life.lock)  # (its worker forgets its own step)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


@atexit.register
def _finish_at_exit() -> None:
    """At interpreter exit, let background steps finish and print what failed."""
    for life in list(_LIVE):
        if life.opened.pid != os.getpid():
            continue  # a forked child's copy: the books are the parent's
        try:
            life.saver.wait()  # (the manager's wait())
        except BaseException as exc:
            print(f"savepoint: {exc}", file=sys.stderr)
