"""The run's checkpoints as its books know them: which are part of the run, the metrics each was
saved with, which failed verification, and the best by the run's metric.

:class:`Catalog` is the read side of the books (:mod:`savepoint.runs.books`), with no threads
and no lock: a writing manager keeps it up to date as it saves, verifies and deletes; a reader
(a read-only manager, the view of :func:`savepoint.open_run`) rereads from the run what a live
writer may have changed since it opened (:meth:`Catalog.refresh`, and the metrics of a
checkpoint saved again, told by its manifest's identity).

The steps that left the run (``discarding``) are replaced, never mutated: a background step
updates them while the caller's thread reads them.
"""

from __future__ import annotations

from typing import Any

from savepoint import checkpoint
from savepoint.codecs import manifest as mf
from savepoint.commit.transaction import resolve as resolve_commit
from savepoint.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    IncompleteCheckpointError,
)
from savepoint.runs import layout, policies
from savepoint.runs.policies import Entry, Mode
from savepoint.runs.report import Report, load_report
from savepoint.storage.paths import Location

__all__ = ["Catalog", "failed_steps"]


class Catalog:
    """The checkpoints of the run at ``run`` (see the module docstring); ``best_metric`` and
    ``best_mode`` rank them (None: the run ranks none); ``read_only``: next to a live writer."""

    def __init__(
        self, run: Location, *, best_metric: str | None, best_mode: Mode, read_only: bool = False
    ) -> None:
        self.run, self.directory = run, str(run)
        self.best_metric, self.best_mode = best_metric, best_mode
        self.read_only = read_only
        self.metrics: dict[int, dict[str, Any]] = {}
        self.metrics_seen: dict[int, Any] = {}  # manifest identities (read-only catalogs)
        # Steps whose checkpoint did not verify (report.verify_failures): never counted by
        # retention, never the best.
        self.failed: frozenset[int] = frozenset()
        # Steps no longer part of the run whose deletion is pending (replaced, never mutated).
        self.discarding: frozenset[int] = frozenset()

    def opened(self, report: Report, on_disk: list[int]) -> None:
        """What the run's report and its committed checkpoints say at open: the metric it ranks
        by (unless one was given), the failed steps, the pending deletions, each checkpoint's
        metrics."""
        if self.best_metric is None and report.best:
            metric, mode = report.best.get("metric"), report.best.get("mode")
            if isinstance(metric, str) and mode in ("min", "max"):
                self.best_metric, self.best_mode = metric, mode
        self.failed = failed_steps(report)
        pending = set(report.discarding) - set(report.checkpoints)
        self.discarding = frozenset(pending & set(on_disk))
        for step in (s for s in on_disk if s not in self.discarding):
            if self.read_only:
                self.metrics_seen[step] = self.manifest_id(step)
            self.metrics[step] = self.read_metrics(step)

    def step_location(self, step: int) -> Location:
        return layout.step_location(self.run, step)

    def steps(self, expected: list[int]) -> list[int]:
        """The committed checkpoints that are part of the run, ascending (``expected``: the
        steps the report lists, which a listing must show)."""
        return [
            s
            for s in layout.committed_steps(self.run, expected=expected)
            if s not in self.discarding
        ]

    def best_among(self, steps: list[int]) -> int | None:
        """The best of ``steps``; never one that failed verification."""
        if self.best_metric is None:
            return None
        entries = [Entry(s, self.metrics_of(s)) for s in steps if s not in self.failed]
        best = policies.best_entries(entries, self.best_metric, self.best_mode)
        return best[0].step if best else None

    def metrics_of(self, step: int) -> dict[str, Any]:
        """A checkpoint's metrics; read from its manifest the first time for a checkpoint not
        recorded here (a read-only catalog next to a live writer sees new ones)."""
        known = self.metrics.get(step)
        if self.read_only:
            # The writer may have saved this step again since: the manifest's identity says so.
            seen = self.manifest_id(step)
            if known is None or self.metrics_seen.get(step) != seen:
                known = self.metrics[step] = self.read_metrics(step)
                self.metrics_seen[step] = seen
            return known
        if known is None:
            known = self.metrics[step] = self.read_metrics(step)
        return known

    def read_metrics(self, step: int) -> dict[str, Any]:
        """The metrics checkpoint ``step`` was saved with; {} for a checkpoint that is damaged
        or gone (restore skips it). A manifest that cannot be read (a failed request, an I/O
        error, a refusal) raises: metrics taken as absent would move the best checkpoint, and
        retention by the best metric could delete the real best."""
        where = self.step_location(step)
        try:
            meta = checkpoint.inspect(layout.checkpoint_arg(where)).metadata
        except (
            CorruptCheckpointError,
            IncompleteCheckpointError,
            IncompatibleCheckpointError,
            CheckpointNotFoundError,
        ):
            return {}
        except CheckpointError:
            raise
        except OSError as exc:
            raise CheckpointError(
                f"cannot read the metrics of checkpoint {step} of {self.directory}: "
                f"{exc.strerror or exc}; nothing was changed: try again once the store answers",
                path=str(where),
            ) from exc
        run_meta = meta.get("savepoint_run")
        return dict(run_meta.get("metrics") or {}) if isinstance(run_meta, dict) else {}

    def manifest_id(self, step: int) -> Any:
        """The identity of checkpoint ``step``'s manifest (None: no checkpoint): it changes when
        the writer saves the step again."""
        store = self.run.store
        try:
            where = resolve_commit(store, self.step_location(step).path, strict=False)
            found = None if where is None else store.stat(store.join(where, mf.NAME))
        except (OSError, CheckpointError):
            return None  # (unknown: its metrics are read again, which says what is wrong)
        return None if found is None else found.identity

    def refresh(self) -> None:
        """A read-only catalog rereads which steps the writer is deleting (and, if it ranks
        none, the metric the run ranks by): a live writer may have changed both since it
        opened."""
        if not self.read_only:
            return
        try:
            report = load_report(self.run, history=False)
        except CheckpointError:
            return  # restoring needs only the checkpoints: keep the view from opening
        if report is None:
            return
        self.discarding = frozenset(set(report.discarding) - set(report.checkpoints))
        self.failed = failed_steps(report)
        best = report.best or {}
        metric, mode = best.get("metric"), best.get("mode", "min")
        if self.best_metric is None and isinstance(metric, str) and mode in ("min", "max"):
            self.best_metric, self.best_mode = metric, mode


def failed_steps(report: Report) -> frozenset[int]:
    """The steps ``report.verify_failures`` names (checkpoints that did not verify)."""
    steps = (f.get("step") for f in report.verify_failures if isinstance(f, dict))
    return frozenset(s for s in steps if isinstance(s, int) and not isinstance(s, bool))
