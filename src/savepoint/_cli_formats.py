"""Command-line support for the foreign formats: ``savepoint convert``, and ``inspect`` / ``verify``
of ``.shrew`` files, safetensors files, boostr directories, burn records and training artifacts.

``savepoint.cli`` adds :data:`convert_cmd` to its group and hands a path to :func:`inspect_other`
or :func:`verify_other` when :func:`handles` says it is not a savepoint checkpoint. Exit statuses
follow the main CLI: 0 success, 1 a checkpoint problem (reason on stderr), 2 a usage error.
"""

from __future__ import annotations

import json
import os
import sys
import time

import click

from savepoint._text import size as _size
from savepoint._text import table as _table
from savepoint.conversion import TARGETS, convert
from savepoint.errors import CheckpointError
from savepoint.formats import detect, training_artifact
from savepoint.formats._files import FormatInfo

__all__ = ["convert_cmd", "handles", "inspect_other", "verify_other"]


def _fail(exc: CheckpointError) -> None:
    click.echo(f"error: {exc}", err=True)
    sys.exit(1)


def handles(path: str) -> bool:
    """True when ``path`` holds a checkpoint in a format other than savepoint's own, or is an
    existing non-directory that detection refuses (a FIFO, a device, an unknown file) or a sweep
    of training artifacts: its reason is the one to report, not the native reader's "not a
    checkpoint directory"."""
    try:
        return detect.detect(path) != "savepoint"
    except CheckpointError:
        # A sweep of training artifacts: detection's message (name a variant) is the useful one.
        return (os.path.lexists(path) and not os.path.isdir(path)) or training_artifact.is_sweep(
            path
        )


def _shape(shape: tuple[int, ...]) -> str:
    return "(" + ", ".join(map(str, shape)) + ("," if len(shape) == 1 else "") + ")"


def inspect_other(path: str, as_json: bool) -> None:
    """``savepoint inspect`` for a non-native checkpoint."""
    try:
        info = detect.inspect_any(path)
    except CheckpointError as exc:
        _fail(exc)
        return
    if as_json:
        click.echo(json.dumps(info.to_dict(), indent=2))
        return
    _print(info)


def _print(info: FormatInfo) -> None:
    click.echo(f"checkpoint  {info.path}")
    click.echo(f"format      {info.label}")
    click.echo(
        f"data        {_size(info.total_bytes)} in {len(info.tensors)} tensors, "
        f"{len(info.files)} file(s)"
    )
    if info.metadata:
        click.echo(f"metadata    {json.dumps(info.metadata, sort_keys=True, ensure_ascii=False)}")
    if info.tensors:
        rows: list[tuple[str, ...]] = [("key", "dtype", "shape", "size", "file")]
        rows += [(t.key, t.dtype, _shape(t.shape), _size(t.nbytes), t.file) for t in info.tensors]
        click.echo("")
        click.echo(_table(rows))
    if info.values:
        values: list[tuple[str, ...]] = [("key", "value")]
        for k, v in info.values.items():
            text = repr(v)
            values.append((k, text if len(text) <= 60 else text[:57] + "..."))
        click.echo("")
        click.echo(_table(values))


def verify_other(path: str, quiet: bool) -> None:
    """``savepoint verify`` for a non-native checkpoint."""
    start = time.perf_counter()
    try:
        info = detect.verify_any(path)
    except CheckpointError as exc:
        _fail(exc)
        return
    if not quiet:
        click.echo(
            f"ok: {info.path}: {info.label}, {len(info.tensors)} tensors, "
            f"{_size(info.total_bytes)} in {len(info.files)} file(s) checked in "
            f"{time.perf_counter() - start:.2f} s (the format has no checksums: structure and "
            "sizes were checked and every byte read)"
        )


@click.command("convert")
@click.argument("src", type=click.Path(path_type=str))
@click.argument("dst", type=click.Path(path_type=str))
@click.option(
    "--format",
    "fmt",
    type=click.Choice(TARGETS),
    help="Target format (default: from DST: *.shrew, *.safetensors, *.mpk (burn), an existing "
    "boostr directory, else savepoint's format). 'shrew' picks v2 for a training state.",
)
@click.option(
    "--lossy",
    is_flag=True,
    help="Leave out what the target format cannot hold (listed) instead of failing.",
)
@click.option("--overwrite", is_flag=True, help="Replace DST if it exists.")
def convert_cmd(src: str, dst: str, fmt: str | None, lossy: bool, overwrite: bool) -> None:
    """Convert the checkpoint SRC (savepoint, .shrew, safetensors, boostr, distributed boostr, a
    burn record, a training artifact) into DST, one tensor at a time.

    Fails, writing nothing, when DST's format cannot hold part of SRC (plain values in .shrew,
    say), listing every such part; --lossy leaves them out instead.
    """
    start = time.perf_counter()
    try:
        report = convert(src, dst, format=fmt, lossy=lossy, overwrite=overwrite)
    except CheckpointError as exc:
        _fail(exc)
        return
    click.echo(
        f"converted {report.source} ({report.source_format}) -> {report.destination} "
        f"({report.destination_format}): {report.tensors} tensors, {_size(report.bytes)} in "
        f"{time.perf_counter() - start:.2f} s"
    )
    if report.dropped:
        click.echo(f"left out ({len(report.dropped)}):")
        for item in report.dropped:
            click.echo(f"  - {item}")
