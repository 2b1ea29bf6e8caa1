"""``savepoint gc RUN``: remove what failed or interrupted saves left in a run (or checkpoint)."""

from __future__ import annotations

import sys

import click

from savepoint.cli._common import command, echo_error_json, echo_json, fail
from savepoint.cli._runs import RUN_FORMAT, run_version
from savepoint.cli._text import size as _size
from savepoint.errors import CheckpointError

__all__ = ["gc_cmd"]


@command(
    "gc",
    short="Remove what failed or interrupted saves left in a run.",
    json_help="Print the report as JSON (see docs/cli.md).",
    progress=False,
)
@click.argument("run", type=str)
@click.option(
    "--grace",
    type=click.FloatRange(min=0),
    default=3600.0,
    show_default=True,
    help="Keep anything younger than this many seconds (a save that may still be running).",
)
@click.option("--dry-run", is_flag=True, help="Remove nothing; print what would be removed.")
def gc_cmd(run: str, grace: float, dry_run: bool, as_json: bool) -> None:
    """Remove the leftovers of failed or interrupted saves from RUN (a run directory or a
    checkpoint; a local path or an s3://, gs://, az:// or memory:// URL): generations that never
    committed and superseded ones, step directories holding nothing committed, hidden temporaries
    of dead processes, and open multipart uploads on S3. Committed checkpoints, report.json,
    run.json and the aliases are never touched, nor anything younger than --grace seconds.

    \b
    Examples:
      savepoint gc runs/demo --dry-run
      savepoint gc s3://bucket/runs/demo --grace 600
    """
    from savepoint.runs import layout
    from savepoint.runs.gc import collect

    try:
        report = collect(run, grace=grace, dry_run=dry_run)
        is_run = layout.is_run(run)
    except CheckpointError as exc:
        fail(exc)
    except OSError as exc:
        fail(f"cannot look at {run}: {exc.strerror or exc}", path=run)
    fmt, version = (RUN_FORMAT, run_version(run)) if is_run else ("savepoint", None)
    if as_json and report.failures:
        echo_error_json(
            "GcFailures",
            f"{len(report.failures)} item(s) could not be removed; the run is intact, run gc again",
            report.directory,
            format=fmt,
            version=version,
            details=report.to_dict(),
        )
    elif as_json:
        echo_json({"path": report.directory, **report.to_dict()}, format=fmt, version=version)
    else:
        verb = "would remove" if dry_run else "removed"
        for item in report.removed:
            size = "" if item.bytes is None else f" ({_size(item.bytes)})"
            click.echo(f"{verb} {item.path}{size}: {item.reason}")
        for upload in report.aborted_uploads:
            click.echo(
                f"{'would abort' if dry_run else 'aborted'} open upload {upload.path} "
                f"(upload id {upload.upload_id}, initiated {upload.initiated})"
            )
        for skipped in report.skipped:
            click.echo(f"kept {skipped.path}: {skipped.reason}")
        for failure in report.failures:
            click.echo(f"failed {failure.path}: {failure.reason}", err=True)
        for note in report.notes:
            click.echo(f"note: {note}")
        click.echo(
            f"{'dry run: ' if dry_run else ''}{report.directory}: {verb} {len(report.removed)} "
            f"item(s), {_size(report.bytes_freed)}; {len(report.aborted_uploads)} open upload(s) "
            f"{'to abort' if dry_run else 'aborted'}; {len(report.skipped)} kept"
        )
    if report.failures:
        click.echo(
            f"error: {len(report.failures)} item(s) could not be removed (see above); the run "
            "is intact, run gc again",
            err=True,
        )
        sys.exit(1)
