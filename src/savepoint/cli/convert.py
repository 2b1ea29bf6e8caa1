"""``savepoint convert SRC DST``: a checkpoint in another format, one tensor at a time.

The formats and the rules for what each can hold live in :mod:`savepoint.formats.convert`; this module
only parses the options and prints the outcome.
"""

from __future__ import annotations

import time

import click

from savepoint.cli._common import command, echo_json, fail_read, local, location, progress
from savepoint.cli._text import size as _size
from savepoint.errors import CheckpointError
from savepoint.formats import burn
from savepoint.formats.convert import TARGETS, ConversionReport, convert

__all__ = ["convert_cmd"]

# The formats a target's file name selects (convert's default, as --format says).
_BY_NAME = ((".shrew", "shrew"), (".safetensors", "safetensors"), ("." + burn.EXTENSION, "burn"))


@command(
    "convert",
    short="Convert a checkpoint between formats (savepoint, .shrew, safetensors, boostr, burn, .pt).",
    json_help="Print what was written as JSON (see docs/cli.md).",
)
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
def convert_cmd(
    src: str, dst: str, fmt: str | None, lossy: bool, overwrite: bool, as_json: bool
) -> None:
    """Convert the checkpoint SRC (savepoint, .shrew, safetensors, boostr, distributed boostr, a
    burn record, a training artifact, or a PyTorch .pt/.pth/.bin state dict) into DST, one
    tensor at a time.

    Fails, writing nothing, when DST's format cannot hold part of SRC (plain values in .shrew,
    say), listing every such part; --lossy leaves them out instead. To hand a model's weights
    to Hugging Face tools, `savepoint export` is simpler: it never needs --lossy.

    PyTorch files are read with torch.load(weights_only=True) only (never a full unpickle): a
    file holding more than tensors and plain containers is refused with the reason.

    SRC and DST may be local paths or URLs (memory://, s3://, ...) where they hold savepoint's
    own format; the other formats are local files.

    \b
    Examples:
      savepoint convert model.shrew ckpt/
      savepoint convert pytorch_model.bin ckpt/
      savepoint convert ckpt/ weights.safetensors --lossy
    """
    src, dst = local(src, "source"), local(dst, "target")
    if fmt is None and not location(dst).is_local:
        # As on local paths, the name says the format: a *.safetensors URL is refused (those
        # files are local only) rather than made a savepoint checkpoint of that name.
        fmt = next((f for suffix, f in _BY_NAME if dst.lower().endswith(suffix)), None)
    start = time.perf_counter()
    try:
        with progress("converting") as update:
            report = convert(
                src, dst, format=fmt, lossy=lossy, overwrite=overwrite, progress=update
            )
    except CheckpointError as exc:
        fail_read(exc, src, any_format=True)
    elapsed = time.perf_counter() - start
    if as_json:
        fmt_out, version = _written(report)
        echo_json(
            {
                "path": report.destination,
                "source": {
                    "path": report.source,
                    "format": report.source_kind,
                    "version": report.source_version,
                },
                "destination": report.destination,
                "tensors": report.tensors,
                "bytes": report.bytes,
                "dropped": list(report.dropped),
                "seconds": round(elapsed, 3),
            },
            format=fmt_out,
            version=version,
        )
        return
    click.echo(
        f"converted {report.source} ({report.source_format}) -> {report.destination} "
        f"({report.destination_format}): {report.tensors} tensors, {_size(report.bytes)} in "
        f"{elapsed:.2f} s"
    )
    if report.dropped:
        click.echo(f"left out ({len(report.dropped)}):")
        for item in report.dropped:
            click.echo(f"  - {item}")


def _written(report: ConversionReport) -> tuple[str, int | None]:
    """The format written and its version (``shrew-v2`` is format ``shrew``, version 2)."""
    target = report.destination_format
    if target.startswith("shrew-v"):
        return "shrew", int(target.rpartition("v")[2])
    if target == "savepoint":
        from savepoint import checkpoint

        try:
            return "savepoint", checkpoint.inspect(report.destination).format_version
        except CheckpointError:
            return "savepoint", None
    return target, None
