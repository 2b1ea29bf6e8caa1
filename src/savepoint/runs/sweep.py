"""Sweeps: several runs of one experiment (a variant or config each), compared and ranked.

``Sweep(directory)`` holds one run directory per variant (``directory/<name>/``, each managed by
a CheckpointManager) and writes ``directory/comparison.json``::

    {"format": "savepoint-comparison", "version": 1, "metric": "val_loss", "mode": "min",
     "runs": [{"rank": 1, "name": "wide", "variant": "wide", "best_metric": 0.31,
               "best_step": 400, "final_loss": 0.29, "steps": 500, "wall_time_s": 41.2,
               "num_params": 1234}, ...]}

Runs are ranked by their best value of the metric (runs without one come last, by name). A run's
best is taken among the steps that have a checkpoint (those its report lists and that are on
disk): ``best_step`` is always a checkpoint one can load.
"""

from __future__ import annotations

import os
from typing import Any

from savepoint.errors import CheckpointNotFoundError
from savepoint.runs import layout
from savepoint.runs.manager import CheckpointManager
from savepoint.runs.policies import Entry, Mode, metric_value
from savepoint.runs.report import (
    REPORT_FILE,
    RUN_FILE,
    Report,
    RunInfo,
    load_report,
    read_json,
    write_json,
)
from savepoint.storage.paths import PathArg, resolve

__all__ = ["COMPARISON_FILE", "Sweep"]

COMPARISON_FILE = "comparison.json"


class Sweep:
    """The runs of one experiment under ``directory`` (a local path or a URL such as
    ``memory://sweep``), compared by ``metric`` (``mode`` "min" or "max")."""

    def __init__(
        self, directory: PathArg, *, metric: str | None = None, mode: Mode = "min"
    ) -> None:
        if mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', not {mode!r}")
        self._root = resolve(directory, what="sweep directory")
        self.directory = str(self._root)
        self.metric = metric
        self.mode: Mode = mode
        self._root.store.makedirs(self._root.path)

    def run(self, name: str, **manager_options: Any) -> CheckpointManager:
        """The CheckpointManager of run ``name`` (created on first use); ``variant`` defaults to
        the name and ``best_metric``/``best_mode`` to the sweep's."""
        separators = ("/", os.sep, os.altsep)
        if not name or name.startswith(".") or any(sep and sep in name for sep in separators):
            raise ValueError(f"run name {name!r} must be a plain directory name")
        manager_options.setdefault("variant", name)
        manager_options.setdefault("name", name)
        if self.metric is not None:
            manager_options.setdefault("best_metric", self.metric)
            manager_options.setdefault("best_mode", self.mode)
        return CheckpointManager(self._root.join(name), **manager_options)

    def runs(self) -> list[str]:
        """Names of the runs in the sweep (subdirectories with a run.json), sorted."""
        store = self._root.store
        return sorted(e for e in store.list(self._root.path) if layout.is_run(self._root.join(e)))

    def compare(self) -> list[dict[str, Any]]:
        """Rank the runs, write ``comparison.json``, and return its rows."""
        rows = [self._row(name) for name in self.runs()]
        sign = 1.0 if self.mode == "min" else -1.0
        rows.sort(
            key=lambda r: (r["best_metric"] is None, sign * (r["best_metric"] or 0.0), r["name"])
        )
        for i, row in enumerate(rows, start=1):
            row["rank"] = i
        doc = {
            "format": "savepoint-comparison",
            "version": 1,
            "metric": self.metric,
            "mode": self.mode,
            "runs": rows,
        }
        write_json(self._root.join(COMPARISON_FILE), doc)
        return rows

    def _row(self, name: str) -> dict[str, Any]:
        where = self._root.join(name)
        directory = str(where)
        run = RunInfo.from_json(read_json(where.join(RUN_FILE)), directory)
        report = load_report(where)  # report.json and the history log
        if report is None:
            raise CheckpointNotFoundError(f"{directory} has no {REPORT_FILE} yet", path=directory)
        metric = self.metric or (report.best or {}).get("metric")
        saved = set(report.checkpoints) & set(layout.committed_steps(where))
        best_value, best_step = _best(report, metric, self.mode, saved)
        return {
            "rank": 0,
            "name": name,
            "variant": run.variant,
            "best_metric": best_value,
            "best_step": best_step,
            "final_loss": report.loss_history[-1][1] if report.loss_history else None,
            "steps": report.steps_completed,
            "wall_time_s": report.wall_time_s,
            "num_params": run.num_params,
        }


def _best(
    report: Report, metric: str | None, mode: Mode, saved: set[int]
) -> tuple[float | None, int | None]:
    if metric is None:
        return None, None
    best: tuple[float, int] | None = None
    for step, values in sorted(report.metric_history.items()):
        if step not in saved:
            continue  # logged, but never saved (or pruned): not a checkpoint one can load
        v = metric_value(Entry(step, values), metric)
        if v is None:
            continue
        better = best is None or (v <= best[0] if mode == "min" else v >= best[0])
        if better:
            best = (float(v), step)
    return (best[0], best[1]) if best else (None, None)
