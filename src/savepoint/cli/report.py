"""``savepoint report PATH``: a run's summary, or a sweep of runs ranked by their best metric,
optionally plotted to an image."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import click

from savepoint.cli._common import (
    command,
    echo_json,
    fail,
    local,
    local_file,
    location,
    shown,
    sweep_runs,
)
from savepoint.cli._runs import (
    cannot_look,
    committed_steps,
    is_run,
    load_report,
    lost_run_file,
    metrics_text,
    run_problems,
)
from savepoint.cli._text import table as _table
from savepoint.errors import IncompatibleCheckpointError

if TYPE_CHECKING:
    from savepoint.runs.report import Report
    from savepoint.storage.paths import Location

__all__ = ["report_cmd"]


@command(
    "report",
    short="Summarise a run or rank a sweep; plot the curves.",
    json_help="Print the report (or the sweep's ranking) as JSON (see docs/cli.md).",
    progress=False,
)
@click.argument("path", type=click.Path(path_type=str))
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(path_type=str, dir_okay=False),
    help="Write the curves to this image (.png, .pdf, .svg, ...; needs matplotlib).",
)
@click.option(
    "--log-y/--linear-y",
    "log_y",
    default=None,
    help="Loss panels on a log y axis (--log-y) or every axis linear (--linear-y). Default: a "
    "loss panel is logarithmic when its values span 10x or more; accuracy and other metrics "
    "stay linear.",
)
def report_cmd(path: str, plot_path: str | None, log_y: bool | None, as_json: bool) -> None:
    """Summarise a run (RUN_DIR) or a sweep (a directory of runs), optionally plotting the curves.

    The plot shows the training loss and every validation loss (metrics named *loss*) on one
    panel and each other metric on its own; the best checkpoint is a star on its metric's
    panel; dotted lines mark the steps the run resumed from; one legend serves every panel.
    Loss panels whose values span an order of magnitude or more are drawn on a log axis.

    PATH may be a local path or a URL (memory://, s3://, ...); the plot is a local file.

    \b
    Examples:
      savepoint report runs/demo
      savepoint report runs/demo --plot demo.png --linear-y
      savepoint report runs/              # a sweep: its runs ranked by their best metric
    """
    path, plot_path = local(path), (local_file(plot_path, "plot path") if plot_path else None)
    if plot_path is not None:
        _check_plot(plot_path)
    where = location(path)
    run = is_run(path)
    names = [] if run else _sweep_runs(path, where)
    reports: list[Report]
    if run:
        reports = [load_report(path)]
        _show_run(path, reports[0], as_json, plot_path)
    elif names:
        reports = [load_report(str(where.join(n))) for n in names]
        _show_sweep(path, where, reports, as_json, plot_path)
    else:
        _not_a_run(path)
    if plot_path:
        _plot(reports, plot_path, where, log_y, as_json)


def _check_plot(plot_path: str) -> None:
    """Exit 1 (matplotlib missing) or 2 (a folder that does not exist, an extension matplotlib
    does not write) before any work when the plot cannot be written."""
    from savepoint.runs.plot import check_output

    problem = check_output(plot_path)
    if problem is None:
        return
    if "matplotlib:" in problem:
        fail(problem, path=plot_path)
    raise click.BadParameter(problem, param_hint="'--plot'")


def _plot(
    reports: list[Report], plot_path: str, where: Location, log_y: bool | None, as_json: bool
) -> None:
    from savepoint.runs.plot import plot_reports

    title = reports[0].name if len(reports) == 1 else f"sweep: {where.store.basename(where.path)}"
    try:
        written = plot_reports(reports, plot_path, title, log_y=log_y)
    except ImportError as exc:
        fail(str(exc), path=plot_path)
    except (OSError, ValueError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        fail(f"cannot write the plot {plot_path}: {reason}", path=plot_path)
    click.echo(f"plot written to {written}", err=as_json)


def _show_run(path: str, r: Report, as_json: bool, plot_path: str | None) -> None:
    problems = run_problems(path, r, committed_steps(path))
    for problem in problems:
        click.echo(f"warning: {problem}", err=True)
    if as_json:
        doc: dict[str, Any] = {"path": shown(path), **r.to_json(), "problems": problems}
        if plot_path:
            doc["plot"] = plot_path
        echo_json(doc, format="savepoint-report", version=doc.get("version"))
        return
    click.echo(f"run          {r.name}" + (f" ({r.variant})" if r.variant else ""))
    click.echo(
        f"steps        {r.steps_completed}" + (f", epoch {r.epoch}" if r.epoch is not None else "")
    )
    click.echo(f"wall time    {r.wall_time_s:.1f} s")
    if r.loss_history:
        first, last = r.loss_history[0], r.loss_history[-1]
        click.echo(
            f"loss         {first[1]:.6g} (step {first[0]}) -> {last[1]:.6g} (step {last[0]})"
        )
    if r.best:
        click.echo(
            f"best         step {r.best['step']}: {metrics_text(r.best.get('metrics') or {})}"
        )
    click.echo(f"checkpoints  {', '.join(map(str, r.checkpoints)) or 'none'}")
    if r.save_intervals:
        click.echo(f"saving       {_intervals_text(r.save_intervals)}")
    for item in r.lineage:
        click.echo(f"resumed      from step {item.get('resumed_from')} at {item.get('at')}")


def _intervals_text(doc: dict[str, Any]) -> str:
    """report.json's ``save_intervals`` (a continuous save policy's achieved intervals) as one
    line: the count, the policy's bounds, the median, p90 and max interval and time to durable
    (a value that is not a number is left out: the file may be from another writer)."""

    def num(key: str) -> float | None:
        value = doc.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        return None

    bounds = [
        f"{k} {num(f'{k}_interval_s'):g} s"
        for k in ("min", "target")
        if num(f"{k}_interval_s") is not None
    ]
    parts = [f"{doc.get('saves', '?')} saves ({doc.get('policy', '?')}: {', '.join(bounds)})"]
    for name, what in (("interval", "interval"), ("durable", "durable after")):
        stats = [(num(f"{name}_{q}_s"), q) for q in ("median", "p90", "max")]
        if all(v is not None for v, _ in stats):
            parts.append(f"{what} " + ", ".join(f"{v:.3g} s {q}" for v, q in stats))
    if num("behind_target") is not None:
        parts.append(f"{doc['behind_target']} intervals behind the target")
    return "; ".join(parts)


def _show_sweep(
    path: str, where: Location, reports: list[Report], as_json: bool, plot_path: str | None
) -> None:
    from savepoint.runs.sweep import Sweep

    metric = next((r.best.get("metric") for r in reports if r.best), None)
    mode: Literal["min", "max"] = (
        "max" if any((r.best or {}).get("mode") == "max" for r in reports) else "min"
    )
    rows_data = Sweep(where, metric=metric, mode=mode).compare()
    if as_json:
        doc: dict[str, Any] = {
            "path": shown(path),
            "metric": metric,
            "mode": mode,
            "runs": rows_data,
        }
        if plot_path:
            doc["plot"] = plot_path
        echo_json(doc, format="savepoint-comparison", version=1)
        return
    click.echo(f"sweep {where}: {len(rows_data)} runs ranked by {metric} ({mode})")
    rows: list[tuple[str, ...]] = [
        ("rank", "run", "best", "best step", "final loss", "steps", "wall s")
    ]
    for row in rows_data:
        rows.append(
            (
                str(row["rank"]),
                row["name"],
                "-" if row["best_metric"] is None else f"{row['best_metric']:.6g}",
                str(row["best_step"]) if row["best_step"] is not None else "-",
                "-" if row["final_loss"] is None else f"{row['final_loss']:.6g}",
                str(row["steps"]),
                f"{row['wall_time_s']:.1f}",
            )
        )
    click.echo(_table(rows))


def _not_a_run(path: str) -> None:
    if lost_run_file(path):
        hint = " (its run.json is missing: opening it with a CheckpointManager rebuilds it)"
    else:
        where = location(path)
        try:
            is_checkpoint = where.store.stat(where.join("manifest.json").path) is not None
        except OSError:
            is_checkpoint = False
        if is_checkpoint:
            hint = (
                f": it is a checkpoint (`savepoint inspect {path}` describes it; a report "
                "belongs to the run directory that holds it)"
            )
        else:
            parent = path.rstrip("/").rpartition("/")[0]
            inside = bool(parent) and is_run(parent)
            hint = (
                f": it is inside the run {parent} (`savepoint report {parent}`)" if inside else ""
            )
    fail(
        IncompatibleCheckpointError(
            f"{path} is neither a run directory nor a sweep of runs{hint}", path=path
        )
    )


def _sweep_runs(path: str, where: Location) -> list[str]:
    """The names of the runs in the sweep directory at ``where`` (empty: not a sweep)."""
    try:
        return sweep_runs(where)
    except OSError as exc:
        cannot_look(path, exc)
