"""``sp.open_run(directory)``: a read-only view of a run directory.

The view writes nothing, ever: no lock, no repair, no report rewrite, no temporary; it works on
read-only media and next to a live writer. It opens the run as a read-only
:class:`CheckpointManager` that also opens runs whose files disagree (so that
:meth:`RunView.problems` can list what is wrong), and reads through the run's parts, as the manager
does: the checkpoints and their metrics (:class:`~savepoint.runs.catalog.Catalog`, reread from
the run as a live writer changes it) and the choice of restore
(:class:`~savepoint.runs.restoring.Restorer`): "latest" and "best" are resolved from the
checkpoints and their metrics, a "latest" that fails verification is skipped with a warning for
the next older one, and a checkpoint the writer deletes or replaces while it is read is chosen
again, never taken for a corrupt one.

The consistency check (:func:`run_problems`) is the one ``savepoint ls``, ``savepoint report``
and ``savepoint verify RUN`` print: ``run.json`` against ``report.json`` (variant, config,
parameter count), the report's best checkpoint, the committed checkpoints against the report's
list, and the ``latest/`` and ``best/`` aliases against the report. Next to a live writer it is a
snapshot: a save in progress may show a disagreement that its next step resolves.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

from savepoint.errors import CheckpointNotFoundError, MissingCheckpointError, RunMismatchError
from savepoint.runs import aliases, layout
from savepoint.runs.manager import CheckpointManager, catalog_of, reader
from savepoint.runs.report import Report, RunInfo, identity_problems, load_report, missing_best
from savepoint.runs.restoring import Restorer, StepSpec
from savepoint.storage.base import read_error
from savepoint.storage.paths import PathArg, resolve

__all__ = ["RunView", "open_run", "run_problems"]


def run_problems(
    directory: PathArg, run: RunInfo, report: Report | None, steps: list[int]
) -> list[str]:
    """Every disagreement between ``run.json`` (``run``), ``report.json`` (``report``; None when
    the run has none yet), the committed checkpoints (``steps``) and the aliases; empty when the
    run is consistent. A writable CheckpointManager repairs all but the identity mismatches."""
    if report is None:
        return []
    problems = identity_problems(run, report)
    missing = missing_best(str(resolve(directory, what="run directory")), report, steps)
    if missing is not None:
        problems.append(missing)
    return problems + aliases.run_problems(directory, report, steps)


class RunView:
    """A read-only view of the run at ``directory`` (see the module docstring).

    ``info`` is what ``run.json`` says (rebuilt from ``report.json`` when run.json is lost),
    ``report`` the current ``report.json`` (None before the first one is written), ``steps()``
    the checkpoints that are part of the run, ``metrics(step)`` the metrics saved with one."""

    def __init__(self, directory: PathArg) -> None:
        self._run = resolve(directory, what="run directory")
        self.directory = str(self._run)
        try:
            found = layout.is_run(self._run) or layout.lost_run_file(self._run)
        except OSError as exc:  # may not look (an object store's 403): not "no run here"
            raise read_error(self.directory, exc) from None
        if not found:
            raise CheckpointNotFoundError(
                f"{self.directory} is not a savepoint run directory (no run.json or report.json)",
                path=self.directory,
            )
        # A read-only manager that opens inconsistent runs too (the view lists their problems).
        self._manager: CheckpointManager = reader(self._run, check_consistent=False)
        # The reader's catalog (read-only: reread as the writer changes the run; the metrics
        # the open read are not read again) and the view's own restorer; the steps the report
        # listed at open are looked up even where a listing lacks them.
        self._catalog = catalog_of(self._manager)
        listed = list(self._manager.report.checkpoints)
        self._restorer = Restorer(
            self._run, self._catalog, functools.partial(self._catalog.steps, listed)
        )

    @property
    def info(self) -> RunInfo:
        return self._manager.run

    @property
    def report(self) -> Report | None:
        """``report.json`` as it is now, with the loss and metric history of the run's history
        log (reread at each access: a live writer rewrites and appends to them)."""
        return load_report(self._run)

    def steps(self) -> list[int]:
        """Steps with a committed checkpoint that is part of the run, ascending."""
        self._catalog.refresh()
        return self._restorer.steps()

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def best_step(self) -> int | None:
        """The best step by the metric the run ranks by (its report's), or None."""
        return self._catalog.best_among(self.steps())

    def metrics(self, step: int) -> dict[str, Any]:
        """The metrics saved with checkpoint ``step`` (empty if none, or no such checkpoint)."""
        return dict(self._catalog.metrics_of(step))

    def checkpoint_path(self, step: StepSpec = "latest") -> str:
        """The directory of checkpoint ``step`` ("latest", "best" or a number); loadable with
        ``sp.load``. CheckpointNotFoundError when the run has no such checkpoint."""
        steps = self.steps()  # one listing for the choice, the check and the message
        number: object = step
        if step == "latest":
            number = steps[-1] if steps else None
        elif step == "best":
            number = self._catalog.best_among(steps)
            if number is None:
                raise MissingCheckpointError(
                    f"{self.directory} has no best checkpoint (no metric ranks its checkpoints)",
                    path=self.directory,
                )
        if not isinstance(number, int) or number not in steps:
            raise CheckpointNotFoundError(
                f"{self.directory} has no checkpoint for step {step!r} (it has {steps})",
                path=self.directory,
            )
        return self._manager.step_path(number)

    def load(
        self,
        step: StepSpec = "latest",
        *,
        into: Any = None,
        keys: Iterable[str] | str | None = None,
        **load_options: Any,
    ) -> Any:
        """Load checkpoint ``step`` as :func:`savepoint.load` does (the saved tree, or ``into``
        restored in place; ``keys`` selects paths), choosing it as ``CheckpointManager.restore``
        does. CheckpointNotFoundError when the run has no checkpoint."""
        found = self._restorer.read(step, {**load_options, "into": into, "keys": keys})
        if found is None:
            raise CheckpointNotFoundError(
                f"{self.directory} has no checkpoint yet", path=self.directory
            )
        return found[1]

    def peek(
        self, keys: Iterable[str] | str, step: StepSpec = "latest", **load_options: Any
    ) -> Any:
        """As ``CheckpointManager.peek``: the values of ``keys``, None when there is no
        checkpoint."""
        found = self._restorer.read(step, {**load_options, "keys": keys})
        return None if found is None else found[1]

    def problems(self) -> list[str]:
        """Every disagreement between run.json, report.json, the checkpoints and the aliases
        (:func:`run_problems`); empty when the run is consistent."""
        return run_problems(self._run, self.info, self.report, layout.committed_steps(self._run))

    def check(self) -> None:
        """Raise RunMismatchError listing :meth:`problems`, if there are any."""
        problems = self.problems()
        if problems:
            raise RunMismatchError(
                f"{self.directory}: the run is inconsistent: {'; '.join(problems)}",
                path=self.directory,
            )

    def close(self) -> None:
        """Nothing to release (the view holds no lock and no file); for ``with`` blocks."""
        self._manager.close()

    def __enter__(self) -> RunView:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"open_run({self.directory!r})"


def open_run(directory: PathArg) -> RunView:
    """A read-only view of the run at ``directory``: its info, report, steps and metrics, its
    checkpoints on demand, and its consistency checks. Writes nothing (see :class:`RunView`)."""
    return RunView(directory)
