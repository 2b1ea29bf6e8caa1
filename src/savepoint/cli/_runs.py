"""Run-directory helpers shared by ``verify``, ``ls``, ``diff``, ``export``, ``gc`` and
``report``: each either returns what the command needs or prints why it cannot and exits 1."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NoReturn

import click

from savepoint.cli._common import fail, location, sweep_runs
from savepoint.errors import CheckpointError, IncompatibleCheckpointError

if TYPE_CHECKING:
    from savepoint.runs.report import Report

RUN_FORMAT = "savepoint-run"  # run.json's format name, as --json names a run


def cannot_look(path: str, exc: OSError) -> NoReturn:
    """Exit 1 because the store holding ``path`` could not be asked what is there (a bucket
    that does not exist, a network failure, a permission)."""
    fail(f"cannot look at {path}: {exc.strerror or exc}", path=path)


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
    """Exit 1 unless ``path`` (a local path or a URL) is a run directory: one that only lost
    run.json is told how to fix it, a checkpoint or a sweep what to run instead."""
    if is_run(path):
        return
    if lost_run_file(path):
        hint = "; it has a report.json: opening it with a CheckpointManager rebuilds run.json"
    else:
        hint = _what_else(path)
    fail(
        IncompatibleCheckpointError(
            f"{path} is not a savepoint run directory (no run.json){hint}", path=path
        )
    )


def _what_else(path: str) -> str:
    """What ``path`` is instead of a run, as a hint (empty when nothing better is known)."""
    from savepoint.runs import layout

    try:
        where = location(path)
        if where.store.stat(where.join("manifest.json").path) is not None:
            return (
                f": it is a checkpoint (`savepoint inspect {path}` describes it, "
                f"`savepoint verify {path}` checks it)"
            )
        runs = sweep_runs(where)
        if runs:
            return (
                f": it is a sweep of {len(runs)} run(s) (`savepoint report {path}` ranks them; "
                f"`savepoint ls {path.rstrip('/')}/{runs[0]}` lists one run's checkpoints)"
            )
        parent = path.rstrip("/").rpartition("/")[0]
        if parent and layout.is_run(parent):
            return f": it is inside the run {parent} (`savepoint ls {parent}`)"
    except (OSError, CheckpointError):
        pass
    return ""


def run_version(path: str) -> int | None:
    """The version of the run's run.json (None when it cannot be read)."""
    from savepoint.runs.report import RUN_FILE, read_json

    try:
        doc = read_json(location(path).join(RUN_FILE))
    except (CheckpointError, OSError):
        return None
    version = doc.get("version") if isinstance(doc, dict) else None
    return version if isinstance(version, int) else None


def load_report(path: str) -> Report:
    """The run's report.json; exit 1 when it is unreadable or not written yet."""
    from savepoint.runs.report import load_report

    try:
        report = load_report(path)
        if report is not None:
            return report
    except CheckpointError as exc:
        fail(exc)
    fail(f"{path} has no report.json yet", path=path)


def committed_steps(run_dir: str) -> list[int]:
    """The steps with a committed checkpoint in ``run_dir``, ascending."""
    from savepoint.runs import layout

    try:
        return layout.committed_steps(run_dir)
    except CheckpointError as exc:
        fail(exc)


def step_path(run_dir: str, spec: str) -> tuple[int, str]:
    """The step ``spec`` (a number, 'latest' or 'best') of the run ``run_dir`` and its
    checkpoint's path; exit 1 when the run has no such checkpoint, 2 when ``spec`` is none of
    those."""
    from savepoint.runs import layout

    require_run(run_dir)
    if spec in ("latest", "best"):
        report = load_report(run_dir)
        step = report.latest_step if spec == "latest" else (report.best or {}).get("step")
        if step is None:
            fail(f"{run_dir} has no {spec} checkpoint", path=run_dir)
    else:
        try:
            step = int(spec)
        except ValueError:
            raise click.BadParameter(f"{spec!r} is not a step number, 'latest' or 'best'") from None
    return int(step), layout.step_path(run_dir, int(step))


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
