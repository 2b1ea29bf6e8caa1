"""``savepoint inspect PATH``: what a checkpoint holds, from its headers alone (no tensor data).

savepoint's own checkpoints are described by :func:`savepoint.checkpoint.inspect`; every other
format it reads (.shrew, safetensors, boostr, burn, training artifacts) by
:func:`savepoint.formats.detect.inspect_any`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

import click

from savepoint import checkpoint
from savepoint.cli._common import command, echo_json, fail_read, is_foreign, local, named
from savepoint.cli._text import size as _size
from savepoint.cli._text import table as _table
from savepoint.errors import CheckpointError
from savepoint.formats import detect
from savepoint.info import CheckpointInfo

__all__ = ["inspect_cmd"]


@command(
    "inspect",
    short="Describe what a checkpoint holds (any format savepoint reads).",
    json_help="Print the description as JSON (see docs/cli.md).",
    progress=False,
)
@click.argument("path", type=click.Path(path_type=str))
def inspect_cmd(path: str, as_json: bool) -> None:
    """List the tensors, values and metadata of the checkpoint at PATH (reads no tensor data).

    PATH may be a savepoint checkpoint, a .shrew file, a .safetensors file, a boostr directory
    (single or distributed), a burn record (.mpk), a seed-001 training-artifact directory or a
    PyTorch file (.pt, .pth, .bin: read with torch.load(weights_only=True)). A savepoint
    checkpoint may also be a URL (memory://, s3://, ...); the other formats are local files.

    A run directory is not a checkpoint: inspect RUN/latest, RUN/best or
    RUN/checkpoints/step-N (`savepoint ls RUN` lists them).

    \b
    Examples:
      savepoint inspect runs/demo/latest
      savepoint inspect model.safetensors --json
    """
    path = local(path)
    try:
        info = detect.inspect_any(path) if is_foreign(path) else checkpoint.inspect(path)
    except CheckpointError as exc:
        fail_read(exc, path, any_format=True)
    info = dataclasses.replace(info, path=named(path, info.path))
    if as_json:
        echo_json(info.to_dict(), format=info.format, version=info.format_version)
    else:
        _show(info)


def _show(info: CheckpointInfo) -> None:
    """The human-readable description: savepoint's own format says who wrote it and which
    objects were Stateful; other formats name their format."""
    native = info.format == "savepoint"
    click.echo(f"checkpoint  {info.path}")
    if native:
        click.echo(f"written by  {info.writer}, format {info.format_version}, {info.created}")
    else:
        click.echo(f"format      {info.label}")
    click.echo(
        f"data        {_size(info.total_bytes)} in {len(info.tensors)} tensors, "
        f"{len(info.files)} file(s)"
    )
    if info.metadata:
        click.echo(f"metadata    {json.dumps(info.metadata, sort_keys=True, ensure_ascii=False)}")
    for key, kind in info.stateful.items():
        click.echo(f"stateful    {key or '<root>'}: {kind}")
    if info.tensors:
        rows: list[tuple[str, ...]] = [("key", "dtype", "shape", "size", "file")]
        for t in info.tensors:
            where = t.file
            blobs = info.format == "savepoint" and info.format_version == 4
            if not where and t.shards == 1 and blobs and t.nbytes:
                where = "(blob store)"  # an incremental checkpoint's tensor
            note = where + (f" (tied to {t.tied_to})" if t.tied_to else "")
            rows.append((t.key, t.dtype, _shape(t.shape), _size(t.nbytes), note))
        click.echo("")
        click.echo(_table(rows))
    if info.values:
        click.echo("")
        click.echo(_table(_value_rows(info.values)))


def _shape(shape: tuple[int, ...]) -> str:
    """A shape as Python writes a tuple: ``()``, ``(3,)``, ``(2, 3)``."""
    return "(" + ", ".join(map(str, shape)) + ("," if len(shape) == 1 else "") + ")"


def _value_rows(values: Mapping[str, Any]) -> list[tuple[str, ...]]:
    """The plain values as a key/value table, each repr cut to 60 characters."""
    rows: list[tuple[str, ...]] = [("key", "value")]
    for key, value in values.items():
        text = repr(value)
        rows.append((key, text if len(text) <= 60 else text[:57] + "..."))
    return rows
