"""Run-directory helpers shared by ``verify``, ``ls``, ``diff`` and ``report``: each either returns
what the command needs or prints why it cannot and exits 1."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, NoReturn

import click

from savepoint.cli._common import fail, location
from savepoint.errors import CheckpointError

if TYPE_CHECKING:
    from savepoint.runs.report import Report


def cannot_look(path: str, exc: OSError) -> NoReturn:
    """Exit 1 because the store holding ``path`` could not be asked what is there (a bucket
    that does not exist, a network failure, a permission)."""
    click.echo(f"error: cannot look at {path}: {exc.strerror or exc}", err=True)
    sys.exit(1)


def is_run(path: str) -> bool:
    """Whether ``path`` (a local path or a URL) is a run directory (``runs.layout.is_run``)."""
    from savepoint.runs import layout

    try:
        return layout.is_run(path)
    except OSError as exc:
        cannot_look(path, exc)


def lost_run_file(path: str) -> bool:
    """Whether ``path`` is a run that lost only its run.json (``runs.layout.lost_run_file``)."""
    from savepoint.runs import layout

    try:
        return layout.lost_run_file(path)
    except OSError as exc:
        cannot_look(path, exc)


def require_run(path: str) -> None:
    """Exit 1 unless ``path`` (a local path or a URL) is a run directory (one that only lost
    run.json is told how to fix)."""
    if not is_run(path):
        hint = (
            "; it has a report.json: opening it with a CheckpointManager rebuilds run.json"
            if lost_run_file(path)
            else ""
        )
        click.echo(f"error: {path} is not a savepoint run directory (no run.json){hint}", err=True)
        sys.exit(1)


def load_report(path: str) -> Report:
    """The run's report.json; exit 1 when it is unreadable or not written yet."""
    from savepoint.runs.report import load_report

    try:
        report = load_report(path)
        if report is not None:
            return report
    except CheckpointError as exc:
        fail(exc)
    click.echo(f"error: {path} has no report.json yet", err=True)
    sys.exit(1)


def committed_steps(run_dir: str) -> list[int]:
    """The steps with a committed checkpoint in ``run_dir``, ascending."""
    from savepoint.runs import layout

    try:
        return layout.committed_steps(run_dir)
    except CheckpointError as exc:
        fail(exc)


def run_problems(run_dir: str, report: Report, steps: list[int]) -> list[str]:
    """The view's consistency check (runs.view.run_problems), as ``ls`` and ``report`` print it."""
    from savepoint.runs.report import RUN_FILE, RunInfo, read_json
    from savepoint.runs.view import run_problems

    where = location(run_dir).join(RUN_FILE)
    try:
        doc = read_json(where)
        run = RunInfo.from_json(doc, str(where))
    except CheckpointError as exc:
        fail(exc)
    return run_problems(run_dir, run, report, steps)


def metrics_text(values: dict[str, Any]) -> str:
    """Metrics as ``name=value`` pairs sorted by name, floats to six significant digits."""
    return " ".join(
        f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}" for k, v in sorted(values.items())
    )
