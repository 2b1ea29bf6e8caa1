"""``savepoint convert SRC DST``: a checkpoint in another format, one tensor at a time.

The formats and the rules for what each can hold live in :mod:`savepoint.formats.convert`; this module
only parses the options and prints the outcome.
"""

from __future__ import annotations

import time

import click

from savepoint.cli._common import fail
from savepoint.cli._text import size as _size
from savepoint.errors import CheckpointError
from savepoint.formats.convert import TARGETS, convert

__all__ = ["convert_cmd"]


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
        fail(exc)
    click.echo(
        f"converted {report.source} ({report.source_format}) -> {report.destination} "
        f"({report.destination_format}): {report.tensors} tensors, {_size(report.bytes)} in "
        f"{time.perf_counter() - start:.2f} s"
    )
    if report.dropped:
        click.echo(f"left out ({len(report.dropped)}):")
        for item in report.dropped:
            click.echo(f"  - {item}")
