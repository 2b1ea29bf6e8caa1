"""``savepoint ls RUN_DIR``: the checkpoints of a run (a local path or a URL), and which retention
rule keeps each."""

from __future__ import annotations

from typing import Any

import click

from savepoint import checkpoint
from savepoint.cli._common import command, echo_json, local, shown
from savepoint.cli._runs import (
    RUN_FORMAT,
    committed_steps,
    load_report,
    metrics_text,
    require_run,
    run_problems,
    run_version,
)
from savepoint.cli._text import size as _size
from savepoint.cli._text import table as _table
from savepoint.errors import CheckpointError

__all__ = ["ls_cmd"]


@command(
    "ls",
    short="List a run's checkpoints and why each is kept.",
    json_help="Print the listing as JSON (see docs/cli.md).",
    progress=False,
)
@click.argument("run_dir", type=click.Path(path_type=str))
def ls_cmd(run_dir: str, as_json: bool) -> None:
    """List the checkpoints of the run at RUN_DIR (a local path or a URL: memory://, s3://, ...):
    steps, sizes, metrics, and why each is kept.

    RUN_DIR is a directory made by sp.CheckpointManager (it holds run.json, report.json and
    checkpoints/). For one checkpoint use `savepoint inspect`; for a sweep of runs,
    `savepoint report SWEEP`.

    \b
    Example:
      savepoint ls runs/demo
    """
    from savepoint.runs import layout, policies

    run_dir = local(run_dir, "run directory")
    require_run(run_dir)
    report = load_report(run_dir)
    on_disk = committed_steps(run_dir)
    problems = run_problems(run_dir, report, on_disk)
    leaving = set(report.discarding) - set(report.checkpoints)
    steps = [s for s in on_disk if s not in leaving]
    entries: list[tuple[int, int | None, dict[str, Any], str]] = []
    for step in steps:
        try:
            info = checkpoint.inspect(layout.step_path(run_dir, step))
        except (CheckpointError, OSError) as exc:
            entries.append((step, None, {}, f"unreadable: {exc}"))
            continue
        meta = info.metadata.get("savepoint_run") or {}
        # An incremental checkpoint's tensors are in the run's shared blob store: its size is
        # theirs (what it restores), not its few data files'.
        blobs = (info.format_version or 0) >= 4
        size = info.total_bytes if blobs else sum(info.files.values())
        entries.append((step, size, dict(meta.get("metrics") or {}), info.created))
    policy = policies.from_spec(report.retention)
    reasons = policies.explain(policy, [policies.Entry(s, m) for s, _, m, _ in entries])
    latest = steps[-1] if steps else None
    best = (report.best or {}).get("step")
    resumed = {item.get("resumed_from") for item in report.lineage}
    rows_json: list[dict[str, Any]] = []
    for step, nbytes, metrics, created in entries:
        tags = []
        if step == latest:
            tags.append("latest")
        if step == best:
            tags.append("best")
        if step in resumed:
            tags.append("resumed-from")
        rows_json.append(
            {
                "step": step,
                "bytes": nbytes,
                "metrics": metrics,
                "created": created,
                "tags": tags,
                "kept_by": reasons.get(step, []),
            }
        )
    if as_json:
        echo_json(
            {
                "path": shown(run_dir),
                "run": shown(run_dir),
                "name": report.name,
                "variant": report.variant,
                "steps_completed": report.steps_completed,
                "checkpoints": rows_json,
                "problems": problems,
            },
            format=RUN_FORMAT,
            version=run_version(run_dir),
        )
        return
    click.echo(
        f"run {report.name}"
        + (f" ({report.variant})" if report.variant else "")
        + f": {len(steps)} checkpoint(s), {report.steps_completed} steps completed"
    )
    for problem in problems:
        click.echo(f"warning: {problem}", err=True)
    if not rows_json:
        return
    rows: list[tuple[str, ...]] = [("step", "size", "metrics", "tags", "kept by")]
    for r in rows_json:
        rows.append(
            (
                str(r["step"]),
                _size(r["bytes"]) if r["bytes"] is not None else "?",
                metrics_text(r["metrics"]) or "-",
                ",".join(r["tags"]) or "-",
                ",".join(r["kept_by"]) or "-",
            )
        )
    click.echo(_table(rows))
