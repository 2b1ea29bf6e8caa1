"""The run's books: ``report.json``, the history log, the metrics of each checkpoint, the lineage
and the ``latest/`` and ``best/`` aliases, as one object with no threads and no lock.

:class:`Books` owns that state for a :class:`~savepoint.runs.manager.CheckpointManager` (which
holds its lock around every call: a background step and the caller's thread share the books) and
for the read-only view of :func:`savepoint.open_run`; it works on any store (``memory://`` in the
tests). It writes what the manager's save sequence (:mod:`savepoint.runs.saving`) calls steps
3-5, :meth:`Books.record`: after a resume, checkpoints newer than the step saved leave the run
(the report names them under ``discarding``); the records logged since the last save are
appended to the history log and the new ``report.json`` is written aside, its fsync started;
the aliases that change are staged and swapped in; then ``report.json`` is renamed into place.
A failure anywhere in there is undone (:meth:`Books.undo`): the new checkpoint goes (or the one
it replaced comes back), the report, the history log and the aliases are as they were, and the
CheckpointWriteError says so (or, if undoing fails as well, what is left: the next open repairs
it, :meth:`Books.repair`).

The steps that left the run (``discarding``, and what ``report.json`` on disk lists as such) are
replaced, never mutated: a background step updates them while the caller's thread reads them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any, Literal

from savepoint import errors_map
from savepoint.commit.transaction import discard
from savepoint.errors import (
    CheckpointError,
    CheckpointWriteError,
)
from savepoint.runs import aliases, history, layout, policies
from savepoint.runs.catalog import Catalog
from savepoint.runs.policies import RetentionPolicy
from savepoint.runs.report import (
    REPORT_FILE,
    REPORT_VERSION,
    Report,
    StagedJson,
    now_iso,
    plain_value,
    stage_json,
    write_json,
)
from savepoint.storage.base import Store
from savepoint.storage.paths import Location

__all__ = ["Books", "StagedReport", "append_pending", "plain", "write_error"]

# (the manager's logger: its retention decisions and deletions are documented under that name)
log = logging.getLogger("savepoint.runs.manager")

# A record not yet appended to the history log: a dict, or a log() call as (step, loss, metrics).
Record = dict[str, Any] | tuple[int, float | None, dict[str, Any] | None]


class Books:
    """The books of the run at ``run`` (see the module docstring); the caller serializes calls.
    ``catalog`` holds its checkpoints' metrics, ``retention`` is recorded in the report,
    ``aliases``: whether ``latest/`` and ``best/`` are kept. The manager's open fills in
    ``report``, ``version`` (of ``report.json`` on disk; 1: the history inline) and ``history``
    (the log's writer, writers only)."""

    def __init__(
        self, run: Location, catalog: Catalog, *, retention: RetentionPolicy, aliases: bool
    ) -> None:
        self.run, self.store, self.directory = run, run.store, str(run)
        self.catalog, self.retention, self.aliases = catalog, retention, aliases
        self.report = Report(name=self.store.basename(run.path))  # (the open reads the real one)
        self.version: int | None = None
        self.history: history.HistoryWriter | None = None
        self.pending: list[Record] = []  # records not yet appended to the history log
        self.verified: set[int] = set()  # steps verified since they were saved
        # What report.json on disk lists as discarding (a step there must not be reused before
        # the report stops listing it). Replaced, never mutated (see the module docstring).
        self.discarding_on_disk: frozenset[int] = frozenset()
        self.resumed_from: int | None = None
        # A resume no save or log() has followed yet: the report before it, and the history
        # records it adds. close() then puts the report back and writes nothing for it (an
        # evaluation script that restores changes nothing); the next save or log() keeps it.
        self.unresumed: Report | None = None
        self.resume_marks: list[Record] = []
        # Whether close() has anything to write: a save, a log, or a report to create (a resume
        # alone is not; opening and restoring leave report.json byte for byte as it was).
        self.dirty = False
        self.started, self.wall_before = time.monotonic(), 0.0

    def steps_now(self) -> list[int]:
        """The committed checkpoints that are part of the run, ascending."""
        return self.catalog.steps(self.report.checkpoints)

    # -- the report and the history log ----------------------------------------------------------

    def fill(self, live: list[int], discarding: frozenset[int] | None = None) -> None:
        """The report lists ``live`` (and ``discarding``: default, the pending deletions)."""
        r = self.report
        r.wall_time_s = self.wall_before + (time.monotonic() - self.started)
        r.checkpoints = sorted(live, reverse=True)
        r.retention = policies.to_spec(self.retention)
        r.latest_step = r.checkpoints[0] if r.checkpoints else None
        best = self.catalog.best_among(live)
        r.best = (
            None
            if best is None
            else {
                "metric": self.catalog.best_metric,
                "mode": self.catalog.best_mode,
                "step": best,
                "metrics": self.catalog.metrics.get(best, {}),
            }
        )
        pending = self.catalog.discarding if discarding is None else discarding
        r.discarding = sorted(pending - set(live))

    def store_report(self, *, durable: bool = True) -> None:
        """Append the records logged since the last report to the history log, then replace
        report.json with ``self.report`` (atomic). Both or neither: if the report cannot be
        written the append is taken back (the records stay pending). ``durable=False``: the run
        directory is left unsynced (the background step of the save syncs it). Raises
        OSError."""
        flushed = self._flush_history()
        try:
            write_json(self.run.join(REPORT_FILE), self.report.to_file_json(), sync_dir=durable)
        except BaseException:
            self._unflush(flushed)
            raise
        self._stored(flushed)

    def stage_report(self) -> StagedReport:
        """:meth:`store_report` with ``durable=False`` in two steps: the history records are
        appended and the report written aside now (its fsync started), and the returned
        handle's ``publish()`` puts it in place (or ``abort()`` takes both back). Raises
        OSError, nothing written."""
        flushed = self._flush_history()
        try:
            staged = stage_json(self.run.join(REPORT_FILE), self.report.to_file_json())
        except BaseException:
            self._unflush(flushed)
            raise
        return StagedReport(self, staged, flushed)

    def _stored(self, flushed: _Flushed | None) -> None:
        """What a written report changes: the report version, what it lists as discarding."""
        if flushed is not None and flushed.rewrote:
            self.version = REPORT_VERSION
        self.discarding_on_disk = frozenset(self.report.discarding)

    def _unflush(self, flushed: _Flushed | None) -> None:
        """Take back a history append whose report was not written (the records stay pending)."""
        if flushed is not None and not flushed.rewrote:
            assert self.history is not None
            with contextlib.suppress(OSError):
                self.history.rollback(flushed.mark)
            self.pending = flushed.records + self.pending

    def _flush_history(self) -> _Flushed | None:
        """Write the pending records to the history log (all of the history, the first time
        after a version 1 report, whose history was inline). Raises OSError, nothing written."""
        if self.history is None:
            return None
        if self.version == 1:
            r = self.report
            self.history.rewrite(
                history.encode(history.records_of(r.loss_history, r.metric_history))
            )
            self.pending = []
            return _Flushed(None, [], rewrote=True)
        if not self.pending:
            return None
        records = self.pending
        mark = self.history.append(history.encode(records))
        self.pending = []
        return _Flushed(mark, records)

    def log(self, step: int, loss: float | None, metrics: dict[str, Any]) -> None:
        """A training step's loss and values: in the report now, in the history log with the
        next report written."""
        self.dirty = True
        self.keep_resume()
        step = int(step)
        value = None if loss is None else float(loss)
        values = plain(metrics) if metrics else None
        if value is not None:
            self.report.loss_history.append((step, value))
        if values:
            self.report.metric_history.setdefault(step, {}).update(values)
        if value is not None or values:
            self.pending.append((step, value, values))
        self.report.steps_completed = max(self.report.steps_completed, step)

    # -- resuming --------------------------------------------------------------------------------

    def resume(self, step: int) -> None:
        """The run continues from ``step``: in memory now; on disk with the next save or
        ``log()`` (:meth:`keep_resume`), never by ``close()`` alone."""
        if self.unresumed is None:
            self.unresumed = dataclasses.replace(self.report, lineage=list(self.report.lineage))
        self.resumed_from = step
        self.report.truncate_after(step)
        self.resume_marks.append({"resumed_from": step})
        self.report.lineage.append(
            {
                "resumed_from": step,
                "at": now_iso(),
                "steps_completed_before": self.report.steps_completed,
            }
        )
        self.report.steps_completed = step

    def keep_resume(self) -> None:
        """The run writes again after a resume: its records join the history log, ahead of
        what follows, and close() keeps the resumed report."""
        self.pending.extend(self.resume_marks)
        self.resume_marks = []
        self.unresumed = None

    def forget_resume(self) -> None:
        """close() after a resume nothing followed: the report as it was before it."""
        if self.unresumed is not None:
            self.report, self.unresumed = self.unresumed, None
            self.resume_marks = []

    # -- a save's books (steps 3-5), and their undo ----------------------------------------------

    def record(
        self,
        step: int,
        metrics: dict[str, Any],
        epoch: int | None,
        num_params: int | None,
        backup: str | None,
    ) -> list[aliases.Staging]:
        """Steps 3-5 of the manager's save sequence for the committed checkpoint ``step``
        (``num_params``: derived from its state; ``backup``: the checkpoint of that step it
        replaced, linked aside). Returns the aliases swapped in, their previous versions still
        to be removed (``finish()``, step 6). A failure is undone: CheckpointWriteError."""
        saved = self._snapshot(step)
        self._enter(step, metrics, epoch, num_params)
        staged: dict[str, aliases.Staging] = {}
        swapped: list[aliases.Staging] = []
        removed = [False]  # whether an alias the report no longer names was removed
        phase = "updating the run's books"
        try:
            discarding = self._leave_abandoned(step)
            # The report is written aside first, its fsync running while the aliases are
            # linked; then the aliases are swapped in, then the report, none of their renames
            # synced: the background step syncs the run directory once for all three (a power
            # cut before it brings back the previous report and aliases, whole: the next open
            # lists this checkpoint again), and the save returns one sync earlier.
            phase = f"writing {REPORT_FILE}"
            report_staged = self.stage_report()
            try:
                phase = "linking latest/ and best/"
                staged = aliases.stage_changed(self.run, self.report, self.aliases)
                phase = "updating latest/ and best/"
                aliases.swap(
                    self.run, self.report, self.aliases, staged, swapped=swapped, removed=removed
                )
                phase = f"writing {REPORT_FILE}"
                report_staged.publish()
            except BaseException:
                report_staged.abort()
                raise
        except (OSError, CheckpointError) as exc:
            # Each alias swapped (or being swapped) is put back as it was, where its kind can
            # (a linked copy, a pointer) with no read that could fail; the others, and any
            # whose undo failed, are republished from the previous report by undo().
            touched = removed[0]
            for alias in reversed(swapped):
                try:
                    alias.undo()
                except (OSError, CheckpointError):
                    touched = True
                else:
                    touched = touched or not alias.restores
            aliases.abort(staged)
            raise self.undo(step, backup, saved, phase, exc, touched) from exc
        # Done: the checkpoint is saved and recorded.
        self.drop(backup)
        self.catalog.discarding = discarding
        return swapped

    def _snapshot(self, step: int) -> _Saved:
        """What an undo restores: fill() assigns fresh lists, so a shallow copy of the report
        keeps the old ones; only this step's metric history is updated in place."""
        before = self.report.metric_history.get(step)
        return _Saved(
            dataclasses.replace(self.report),
            None if before is None else dict(before),
            dict(self.catalog.metrics),
            list(self.pending),
            self.catalog.failed,
        )

    def _enter(
        self, step: int, metrics: dict[str, Any], epoch: int | None, num_params: int | None
    ) -> None:
        """The committed checkpoint ``step`` in memory: its metrics, the run's progress."""
        self.catalog.metrics[step] = metrics
        self.verified.discard(step)
        r = self.report
        if step in self.catalog.failed:  # a new checkpoint of a step that failed: a fresh start
            self.catalog.failed = self.catalog.failed - {step}
            r.verify_failures = [f for f in r.verify_failures if f.get("step") != step]
        if metrics:
            r.metric_history.setdefault(step, {}).update(metrics)
            self.pending.append({"step": step, "metrics": metrics})
        r.steps_completed = max(r.steps_completed, step)
        if epoch is not None:
            r.epoch = epoch
        if num_params is not None and r.num_params is None:
            r.num_params = num_params

    def _leave_abandoned(self, step: int) -> frozenset[int]:
        """The report lists the run with ``step``; returns the steps that left it. After a
        resume, checkpoints past this step belong to the abandoned timeline (a rollback, or
        newer checkpoints that failed verification): now that the new timeline has a committed
        checkpoint they go, or a restart would undo the resume. (The checkpoint resumed from is
        never one of them.)"""
        # The step just committed counts even if a listing does not show it yet.
        on_disk = layout.committed_steps(self.run, expected=[*self.report.checkpoints, step])
        abandoned: set[int] = set()
        if self.resumed_from is not None:
            horizon = max(step, self.resumed_from)
            abandoned = {s for s in on_disk if s > horizon}
            if abandoned:
                log.info(
                    "%s: checkpoints %s leave the run: they are newer than step %d, "
                    "resumed from, and belong to the abandoned timeline",
                    self.directory,
                    sorted(abandoned),
                    self.resumed_from,
                )
        live = [s for s in on_disk if s not in abandoned and s not in self.catalog.discarding]
        # Retention decides in the background, once this checkpoint is verified.
        discarding = frozenset((self.catalog.discarding | abandoned) - set(live))
        self.fill(live, discarding)
        return discarding

    def undo(
        self,
        step: int,
        backup: str | None,
        saved: _Saved,
        phase: str,
        exc: BaseException,
        aliases_touched: bool = True,
    ) -> CheckpointWriteError:
        """Roll a failed save back: the new checkpoint goes (or the previous one of that step
        comes back), the report, the history log and the aliases are restored (the report is
        the last thing a save writes, so a failed save never wrote it: the records it would
        have appended to the log were taken back with it; ``aliases_touched``: the aliases
        may have changed, so they are republished). Returns the error."""
        problems = []
        where = self.catalog.step_location(step)
        try:
            if backup is not None:
                aliases.put_back(self.store, backup, where.path)
            else:
                discard(self.store, where.path)
        except OSError as undo_exc:
            problems.append(
                f"checkpoint {step} could not be removed again ({undo_exc.strerror or undo_exc}): "
                "it is committed but not in report.json"
            )
        self.report, self.catalog.metrics, self.catalog.failed = (
            saved.report,
            saved.metrics,
            saved.failed,
        )
        if saved.history is None:
            self.report.metric_history.pop(step, None)
        else:
            self.report.metric_history[step] = saved.history
        self.verified.discard(step)
        # The records logged before this save are written again by the next report; this
        # save's own (its metrics) are gone with it.
        self.pending = saved.pending
        try:
            if aliases_touched:
                self.repair_aliases(unknown="republish")
        except (CheckpointError, OSError) as undo_exc:
            problems.append(str(undo_exc))
        return _undo_error(self.store, self.directory, step, str(where), phase, exc, problems)

    def drop(self, path: str | None) -> None:
        """Remove a temporary (a backup) without letting cleanup hide an error."""
        if path is not None:
            with contextlib.suppress(OSError):
                self.store.remove_tree(path)

    # -- the aliases ---------------------------------------------------------------------------

    def repair_aliases(self, unknown: Literal["raise", "republish"] = "raise") -> None:
        """Make each alias hold the checkpoint the report names: republish it, or remove it when
        the report names none (or republishing fails: a missing alias misleads nobody). An
        alias that cannot be looked at (a failed read is not "it holds it") raises, or with
        ``unknown="republish"`` (undoing a save that changed it) is republished."""
        for alias, step in aliases.targets(self.report).items():
            path = aliases.path_of(self.run, alias)
            try:
                if step is not None and aliases.holds(self.run, alias, step):
                    continue
            except CheckpointError as exc:
                if unknown == "raise":
                    raise
                log.info("%s: %s cannot be looked at (%s): republished", self.directory, path, exc)
            if self.store.stat(path.path) is None and (step is None or not self.aliases):
                continue
            if step is not None and self.aliases:
                try:
                    aliases.publish(self.run, alias, step)
                    continue
                except (OSError, CheckpointError):
                    pass
            try:
                aliases.remove(self.run, alias)
            except OSError as exc:
                raise write_error(
                    self.store, f"{path} disagrees with {REPORT_FILE} and cannot be removed", exc
                ) from exc

    # -- what left the run, what did not verify, what a killed writer left -----------------------

    def finish_discards(self, stop: Callable[[], bool]) -> None:
        """Delete the checkpoints that left the run; one that cannot be deleted stays pending.
        Once ``stop()`` says so (a preemption save started), none is: the next open deletes
        them (report.json lists them under ``discarding``)."""
        remaining: set[int] = set()
        for step in sorted(self.catalog.discarding):
            if stop():
                remaining.add(step)
                continue
            try:
                discard(self.store, self.catalog.step_location(step).path)
            except OSError as exc:
                log.info("%s: cannot delete checkpoint %d yet: %s", self.directory, step, exc)
                remaining.add(step)
                continue
            log.info("%s: deleted checkpoint %d (it left the run)", self.directory, step)
            self.catalog.metrics.pop(step, None)
            self.verified.discard(step)
        self.catalog.discarding = frozenset(remaining)

    def record_failure(self, step: int, exc: BaseException) -> None:
        """Checkpoint ``step`` did not verify: report.verify_failures names it; from now on
        retention does not count it and it is never the best (best/ leaves it)."""
        self.catalog.failed = self.catalog.failed | {step}
        self.report.verify_failures = [
            *self.report.verify_failures,
            {"step": step, "at": now_iso(), "error": str(exc)},
        ]
        with contextlib.suppress(OSError, CheckpointError):  # the next save writes them
            self.fill(self.steps_now())
            self.store_report()
            self.repair_aliases()


class StagedReport:
    """A report :meth:`Books.stage_report` wrote aside, with its history append."""

    def __init__(self, books: Books, staged: StagedJson, flushed: _Flushed | None) -> None:
        self._books, self._flushed = books, flushed
        self._staged: StagedJson | None = staged

    def publish(self) -> None:
        """Put the report in place (raises OSError: then call :meth:`abort`)."""
        assert self._staged is not None, "published once"
        self._staged.publish()
        self._books._stored(self._flushed)
        self._staged = None

    def abort(self) -> None:
        """Take back the report and its history append (never raises; nothing once published)."""
        if self._staged is None:
            return
        self._staged.abort()
        self._books._unflush(self._flushed)


@dataclasses.dataclass
class _Saved:
    """The books before a save, for its undo."""

    report: Report
    history: dict[str, Any] | None
    metrics: dict[int, dict[str, Any]]
    pending: list[Record]
    failed: frozenset[int]


@dataclasses.dataclass
class _Flushed:
    """What a report write appended to the history log: ``mark`` to roll back to, the
    ``records`` appended; ``rewrote``: the whole history was written (a version 1 report's)."""

    mark: history.Mark | None
    records: list[Record]
    rewrote: bool = False


def append_pending(books: Books) -> bool:
    """Append the records ``books`` gathered so far to the history log now, ahead of the report
    (an async save handed to the writer process: that save commits even if this process is
    killed before its books, and the history up to it must then be on disk; an open that finds
    the checkpoint unbooked adopts it, :func:`savepoint.runs.opening.repair`). Not synced here
    (the save's background step syncs the log). A report of version 1 (its history inline,
    moved to the log with the next report) appends nothing. Returns whether anything was
    appended; an OSError leaves the records pending (they go with the report)."""
    if books.history is None or books.version == 1 or not books.pending:
        return False
    try:
        books._flush_history()
    except OSError:
        return False
    return True


def plain(values: Mapping[str, Any]) -> dict[str, Any]:
    """Metrics and configs as the JSON values a reader gets back: numpy and torch scalars become
    Python numbers, tuples lists, and non-finite floats the strings "nan", "inf", "-inf" (not
    numbers, so retention and ranking never pick them, and the files stay standard JSON)."""
    return {str(k): plain_value(v) for k, v in values.items()}


def write_error(store: Store, what: str, exc: OSError) -> CheckpointWriteError:
    """The CheckpointWriteError for ``what`` failing with ``exc`` on ``store``."""
    where = _shown(store, exc.filename)
    return errors_map.write_error(exc, where, what, where=where or "", scheme=store.scheme)


def _undo_error(
    store: Store,
    directory: str,
    step: int,
    where: str,
    phase: str,
    exc: BaseException,
    problems: list[str],
) -> CheckpointWriteError:
    """The error of a save that failed while ``phase`` and was undone (or not: ``problems``)."""
    head = f"saving step {step} to {directory} failed while {phase}: {_reason(store, exc)}"
    if problems:
        message = (
            f"{head}; undoing it failed too: {'; '.join(problems)}. Opening the run again "
            "with a CheckpointManager repairs report.json and the aliases"
        )
    else:
        message = (
            f"{head}. The save was undone and the run is as before: step {step} is not "
            "saved, report.json, latest/, best/ and every other checkpoint are unchanged; "
            f"{errors_map.write_hint(exc, scheme=store.scheme)}"
        )
    return CheckpointWriteError(message, path=where, errno=getattr(exc, "errno", None))


def _reason(store: Store, exc: BaseException) -> str:
    """What went wrong, in the store's own words (an object store's message names the request
    and its cause; a local error is its strerror), and where."""
    if not isinstance(exc, OSError) or isinstance(exc, CheckpointError):
        return str(exc)
    reason = exc.strerror or (os.strerror(exc.errno) if exc.errno else str(exc))
    where = _shown(store, exc.filename)
    return f"{reason} ({where})" if where else reason


def _shown(store: Store, filename: Any) -> str | None:
    """A path an OSError names, as the user names it (a URL off the local disk)."""
    if isinstance(filename, str) and filename.startswith("/") and store.scheme != "file":
        return store.url(filename)
    return filename if isinstance(filename, str) else None
