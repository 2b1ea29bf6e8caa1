"""The ``savepoint`` command line (also ``python -m savepoint``).

Exit status: 0 success; 1 the checkpoint is missing, incomplete, corrupt or incompatible (the
reason is printed on stderr); 2 a usage error.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import click

from savepoint import checkpoint
from savepoint._version import __version__
from savepoint.errors import CheckpointError


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError  # pragma: no cover


@contextmanager
def _progress(label: str) -> Iterator[Callable[[int, int], None]]:
    """A progress callback; the bar appears only once the operation has run for a second."""
    from tqdm import tqdm

    bar: Any = None
    start = time.monotonic()

    def update(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            if time.monotonic() - start < 1.0 or not sys.stderr.isatty():
                return
            bar = tqdm(total=total, desc=label, unit="B", unit_scale=True, unit_divisor=1024)
        bar.update(done - bar.n)

    try:
        yield update
    finally:
        if bar is not None:
            bar.close()


def _fail(exc: CheckpointError) -> None:
    click.echo(f"error: {exc}", err=True)
    sys.exit(1)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="savepoint")
def main() -> None:
    """Inspect and verify savepoint checkpoints."""


def _table(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(
            cell.ljust(w) if i < len(row) - 1 else cell
            for i, (cell, w) in enumerate(zip(row, widths))
        )
        for row in rows
    )


@main.command("inspect")
@click.argument("path", type=click.Path(path_type=str))
@click.option("--json", "as_json", is_flag=True, help="Print the description as JSON.")
def inspect_cmd(path: str, as_json: bool) -> None:
    """List the tensors, values and metadata of the checkpoint at PATH (reads no tensor data)."""
    try:
        info = checkpoint.inspect(path)
    except CheckpointError as exc:
        _fail(exc)
        return
    if as_json:
        click.echo(json.dumps(info.to_dict(), indent=2, sort_keys=False))
        return
    click.echo(f"checkpoint  {info.path}")
    click.echo(f"written by  {info.writer}, format {info.format_version}, {info.created}")
    click.echo(
        f"data        {_size(info.total_bytes)} in {len(info.tensors)} tensors, "
        f"{len(info.files)} file(s)"
    )
    if info.metadata:
        click.echo(f"metadata    {json.dumps(info.metadata, sort_keys=True)}")
    for key, kind in info.stateful.items():
        click.echo(f"stateful    {key or '<root>'}: {kind}")
    if info.tensors:
        rows: list[tuple[str, ...]] = [("key", "dtype", "shape", "size", "file")]
        for t in info.tensors:
            shape = "(" + ", ".join(map(str, t.shape)) + ("," if len(t.shape) == 1 else "") + ")"
            note = f"{t.file}" + (f" (tied to {t.tied_to})" if t.tied_to else "")
            rows.append((t.key, t.dtype, shape, _size(t.nbytes), note))
        click.echo("")
        click.echo(_table(rows))
    if info.values:
        click.echo("")
        values: list[tuple[str, ...]] = [("key", "value")]
        values += [
            (k, repr(v) if len(repr(v)) <= 60 else repr(v)[:57] + "...")
            for k, v in info.values.items()
        ]
        click.echo(_table(values))


@main.command("verify")
@click.argument("path", type=click.Path(path_type=str))
@click.option("-q", "--quiet", is_flag=True, help="Print nothing when the checkpoint is intact.")
def verify_cmd(path: str, quiet: bool) -> None:
    """Check the structure and every checksum of the checkpoint at PATH.

    Exits 0 when it is intact, 1 (with the reason) otherwise.
    """
    start = time.perf_counter()
    try:
        with _progress("verifying") as progress:
            info = checkpoint.verify(path, progress=progress)
    except CheckpointError as exc:
        _fail(exc)
        return
    if not quiet:
        elapsed = time.perf_counter() - start
        click.echo(
            f"ok: {info.path}: {len(info.tensors)} tensors, {_size(info.total_bytes)} in "
            f"{len(info.files)} file(s) verified in {elapsed:.2f} s"
        )
