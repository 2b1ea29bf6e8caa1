"""Opening a run directory: what a writing open repairs of what an interrupted writer left.

:func:`repair` is the last step of a writing :class:`~savepoint.runs.manager.CheckpointManager`
open (the manager's module docstring, "Opening"): the history log's torn last line and the
segments a compaction left behind are mended, deletions the report lists as ``discarding`` are
finished, checkpoints a killed save committed but did not record are listed (nothing committed
is dropped), and ``latest/`` and ``best/`` are made to agree with ``report.json`` (republished,
or removed when the report names no such checkpoint).
"""

from __future__ import annotations

from collections.abc import Callable

from savepoint.runs.books import Books, write_error
from savepoint.runs.report import REPORT_FILE

__all__ = ["repair"]


def repair(books: Books, stop: Callable[[], bool]) -> None:
    """Finish what an interrupted writer left in the run ``books`` keeps (see the module
    docstring); ``stop()``: deletions wait for the next open (a preemption save started)."""
    assert books.history is not None
    try:
        books.history.repair()  # a torn last line, segments a compaction left behind
    except OSError as exc:
        raise write_error(
            books.store, f"cannot repair the history log of {books.directory}", exc
        ) from exc
    books.finish_discards(stop)
    r, metrics = books.report, books.catalog.metrics
    live = books.steps_now()
    for step in (s for s in live if s not in r.checkpoints):
        # committed by a save that was killed before its books
        if metrics.get(step):
            r.metric_history.setdefault(step, {}).update(metrics[step])
            books.pending.append({"step": step, "metrics": metrics[step]})
        r.steps_completed = max(r.steps_completed, step)
    before = (r.checkpoints, r.latest_step, r.best, r.discarding)
    books.fill(live)
    if (r.checkpoints, r.latest_step, r.best, r.discarding) != before:
        try:
            books.store_report()
        except OSError as exc:
            raise write_error(
                books.store, f"cannot repair {REPORT_FILE} of {books.directory}", exc
            ) from exc
    books.repair_aliases()
