"""``savepoint report PATH``: a run's summary, or a sweep of runs ranked by their best metric,
optionally plotted to a PNG."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Literal

import click

from savepoint.cli._common import echo_json, local, local_file, location
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

if TYPE_CHECKING:
    from savepoint.storage.paths import Location

__all__ = ["report_cmd"]


@click.command("report")
@click.argument("path", type=click.Path(path_type=str))
@click.option(
    "--plot", "plot_path", type=click.Path(path_type=str), help="Write a PNG of the curves."
)
@click.option("--json", "as_json", is_flag=True, help="Print the report (or comparison) as JSON.")
def report_cmd(path: str, plot_path: str | None, as_json: bool) -> None:
    """Summarise a run (RUN_DIR) or a sweep (a directory of runs), optionally plotting the curves.

    PATH may be a local path or a URL (memory://, s3://, ...); the plot is a local file."""
    from savepoint.runs.sweep import Sweep

    path, plot_path = local(path), (local_file(plot_path, "plot path") if plot_path else None)
    where = location(path)
    run = is_run(path)
    names = [] if run else _sweep_runs(path, where)
    if run:
        reports = [load_report(path)]
        r = reports[0]
        for problem in run_problems(path, r, committed_steps(path)):
            click.echo(f"warning: {problem}", err=True)
        if as_json:
            echo_json(r.to_json())
        else:
            click.echo(f"run          {r.name}" + (f" ({r.variant})" if r.variant else ""))
            click.echo(
                f"steps        {r.steps_completed}"
                + (f", epoch {r.epoch}" if r.epoch is not None else "")
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
            for item in r.lineage:
                click.echo(f"resumed      from step {item.get('resumed_from')} at {item.get('at')}")
    elif names:
        reports = [load_report(str(where.join(n))) for n in names]
        metric = next((r.best.get("metric") for r in reports if r.best), None)
        mode: Literal["min", "max"] = (
            "max" if any((r.best or {}).get("mode") == "max" for r in reports) else "min"
        )
        rows_data = Sweep(where, metric=metric, mode=mode).compare()
        if as_json:
            echo_json(rows_data)
        else:
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
    else:
        hint = (
            " (its run.json is missing: opening it with a CheckpointManager rebuilds it)"
            if lost_run_file(path)
            else ""
        )
        click.echo(f"error: {path} is neither a run directory nor a sweep of runs{hint}", err=True)
        sys.exit(1)
    if plot_path:
        from savepoint.runs.plot import plot_reports

        title = (
            reports[0].name if len(reports) == 1 else f"sweep: {where.store.basename(where.path)}"
        )
        written = plot_reports(reports, plot_path, title)
        click.echo(f"plot written to {written}", err=as_json)


def _sweep_runs(path: str, where: Location) -> list[str]:
    """The names of the runs in the sweep directory at ``where`` (empty: not a sweep)."""
    from savepoint.runs import layout
    from savepoint.runs.sweep import Sweep

    try:
        return Sweep(where).runs() if layout.is_dir(where) else []
    except OSError as exc:
        cannot_look(path, exc)
