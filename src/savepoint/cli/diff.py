"""``savepoint diff A B`` / ``savepoint diff RUN STEP STEP``: how two checkpoints differ.

Exit status 0 when they are identical, 1 when they differ or one cannot be read.
"""

from __future__ import annotations

import sys

import click

from savepoint.cli._common import echo_json, fail_read, local, named
from savepoint.cli._runs import load_report, require_run
from savepoint.cli._text import table as _table
from savepoint.errors import CheckpointError

__all__ = ["diff_cmd"]


@click.command("diff")
@click.argument("a", type=click.Path(path_type=str))
@click.argument("b", type=str)
@click.argument("c", type=str, required=False)
@click.option("--json", "as_json", is_flag=True, help="Print the comparison as JSON.")
@click.option("--all", "show_all", is_flag=True, help="List identical tensors too.")
def diff_cmd(a: str, b: str, c: str | None, as_json: bool, show_all: bool) -> None:
    """Compare two checkpoints: `diff CKPT_A CKPT_B`, or two steps of a run: `diff RUN STEP STEP`
    (a step may be a number, 'latest' or 'best'). Checkpoints and runs may be local paths or URLs
    (memory://, s3://, ...). Exit status 0 when identical, 1 otherwise."""
    from savepoint.formats.diff import diff

    a, b = local(a, "checkpoint path"), (b if c is not None else local(b, "checkpoint path"))
    if c is not None:
        a, b = _resolve_step(a, b), _resolve_step(a, c)
    try:
        report = diff(a, b)
    except CheckpointError as exc:
        fail_read(exc, a, b)
    report.a, report.b = named(a, report.a), named(b, report.b)
    if as_json:
        echo_json(report.to_dict(), default=str)
        sys.exit(0 if report.identical else 1)
    click.echo(f"a: {report.a}\nb: {report.b}")
    for key in report.removed:
        click.echo(f"- {key}")
    for key in report.added:
        click.echo(f"+ {key}")
    for key, x, y in report.changed:
        click.echo(f"~ {key}: {x} -> {y}")
    for key, x, y in report.values:
        click.echo(f"~ {key}: {x!r} -> {y!r}")
    shown = [t for t in report.tensors if show_all or not t.equal]
    if shown:
        rows: list[tuple[str, ...]] = [("tensor", "dtype", "shape", "max abs diff", "rel L2 diff")]
        for t in shown:
            rows.append((t.key, t.dtype, str(list(t.shape)), f"{t.max_abs:.4g}", f"{t.rel_l2:.4g}"))
        click.echo(_table(rows))
    same = sum(t.equal for t in report.tensors)
    click.echo(
        f"{len(report.tensors)} tensors compared, {same} identical; {len(report.added)} added, "
        f"{len(report.removed)} removed, {len(report.changed)} changed type/shape, "
        f"{len(report.values)} values differ"
    )
    sys.exit(0 if report.identical else 1)


def _resolve_step(run_dir: str, spec: str) -> str:
    """The checkpoint path of step ``spec`` (a number, 'latest' or 'best') in the run ``run_dir``."""
    from savepoint.runs import layout

    require_run(run_dir)
    if spec in ("latest", "best"):
        report = load_report(run_dir)
        step = report.latest_step if spec == "latest" else (report.best or {}).get("step")
        if step is None:
            click.echo(f"error: {run_dir} has no {spec} checkpoint", err=True)
            sys.exit(1)
    else:
        try:
            step = int(spec)
        except ValueError:
            raise click.BadParameter(f"{spec!r} is not a step number, 'latest' or 'best'") from None
    return layout.step_path(run_dir, int(step))
