"""``savepoint diff A B`` / ``savepoint diff RUN STEP STEP``: how two checkpoints differ.

What the manifests show (keys added or removed, dtype or shape changes, plain values) is printed
at once; then each tensor's row as it is computed. Tensors whose stored checksums match are equal
without being read (see :mod:`savepoint.formats.diff`, which also reads the other formats).
``--json`` prints one object at the end.

Exit status 0 when they are identical, 1 when they differ or one cannot be read.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import click

from savepoint.cli._common import command, echo_json, fail_read, local, named, progress
from savepoint.cli._runs import step_path
from savepoint.errors import CheckpointError
from savepoint.formats.diff import Comparison, DiffReport, compare

__all__ = ["diff_cmd"]

_HEADER = ("tensor", "dtype", "shape", "max abs diff", "rel L2 diff")


@command(
    "diff",
    short="Show how two checkpoints (or two steps of a run) differ.",
    json_help="Print the comparison as one JSON object when it ends (see docs/cli.md).",
)
@click.argument("a", type=click.Path(path_type=str))
@click.argument("b", type=str)
@click.argument("c", type=str, required=False)
@click.option("--all", "show_all", is_flag=True, help="List identical tensors too.")
@click.option(
    "--read-all",
    is_flag=True,
    help="Read and compare every tensor, even those whose stored checksums already match "
    "(each is then verified as it is read).",
)
def diff_cmd(a: str, b: str, c: str | None, show_all: bool, read_all: bool, as_json: bool) -> None:
    """Compare two checkpoints: `diff CKPT_A CKPT_B`, or two steps of a run: `diff RUN STEP STEP`
    (a step may be a number, 'latest' or 'best'). Checkpoints and runs may be local paths or URLs
    (memory://, s3://, ...); either checkpoint may also be a local file or directory of another
    format savepoint reads (a .safetensors file, a Hugging Face model directory, .shrew, ...,
    whose tensors are always read: they have no checksums). Exit status 0 when identical, 1
    otherwise.

    Differences are printed as they are found: first what the manifests show (- removed,
    + added, ~ changed type, shape or value), then each differing tensor's largest absolute
    and relative L2 difference. Tensors with equal stored checksums are not read.

    \b
    Examples:
      savepoint diff runs/demo 8 latest
      savepoint diff ckpt/a ckpt/b --json
    """
    a, b = local(a, "checkpoint path"), (b if c is not None else local(b, "checkpoint path"))
    if c is not None:
        a, b = step_path(a, b)[1], step_path(a, c)[1]
    try:
        with compare(a, b, read_all=read_all) as comparison, progress("comparing") as bar:
            report = comparison.report
            report.a, report.b = named(a, report.a), named(b, report.b)
            if not as_json:
                _head(report, bar.echo)
            widths = _widths(comparison)
            header_shown = False
            for row in comparison.tensors(bar):
                if as_json or not (show_all or not row.equal):
                    continue
                if not header_shown:
                    bar.echo(_row(_HEADER, widths))
                    header_shown = True
                cells = (
                    row.key,
                    row.dtype,
                    str(list(row.shape)),
                    f"{row.max_abs:.4g}",
                    f"{row.rel_l2:.4g}",
                )
                bar.echo(_row(cells, widths))
    except CheckpointError as exc:
        fail_read(exc, a, b, any_format=True)
    if as_json:
        echo_json(report.to_dict(), format=report.a_format, version=report.a_version, default=str)
        sys.exit(0 if report.identical else 1)
    same = sum(t.equal for t in report.tensors)
    by_checksum = sum(t.by_checksum for t in report.tensors)
    click.echo(
        f"{len(report.tensors)} tensors compared, {same} identical"
        + (f" ({by_checksum} by stored checksum, not read)" if by_checksum else "")
        + f"; {len(report.added)} added, {len(report.removed)} removed, "
        f"{len(report.changed)} changed type/shape, {len(report.values)} values differ"
    )
    sys.exit(0 if report.identical else 1)


def _head(report: DiffReport, echo: Callable[[str], None]) -> None:
    echo(f"a: {report.a}\nb: {report.b}")
    for key in report.removed:
        echo(f"- {key}")
    for key in report.added:
        echo(f"+ {key}")
    for key, x, y in report.changed:
        echo(f"~ {key}: {x} -> {y}")
    for key, x, y in report.values:
        echo(f"~ {key}: {x!r} -> {y!r}")


def _widths(comparison: Comparison) -> list[int]:
    """Column widths for every row the comparison can produce, known before any is computed
    (so rows line up as they stream); the number columns are as wide as their headers."""
    planned = comparison.planned()
    return [
        max([len(_HEADER[0]), *(len(k) for k, _, _ in planned)]),
        max([len(_HEADER[1]), *(len(d) for _, d, _ in planned)]),
        max([len(_HEADER[2]), *(len(str(list(s))) for _, _, s in planned)]),
        max(len(_HEADER[3]), 10),
    ]


def _row(cells: tuple[str, ...], widths: list[int]) -> str:
    return "  ".join([*(cell.ljust(w) for cell, w in zip(cells[:-1], widths)), cells[-1]])
