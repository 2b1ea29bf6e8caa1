"""``savepoint inspect PATH``: what a checkpoint holds, from its headers alone (no tensor data).

savepoint's own checkpoints are described by :func:`savepoint.checkpoint.inspect`; every other
format it reads (.shrew, safetensors, boostr, burn, training artifacts) by
:func:`savepoint.formats.detect.inspect_any`.
"""

from __future__ import annotations

import dataclasses

import click

from savepoint import checkpoint
from savepoint.cli._common import command, echo_json, fail_read, is_foreign, local, named
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
    """The human-readable description: ``str(info)``, which ``print(sp.inspect(path))`` shows
    too (savepoint's own format says who wrote it and which objects were Stateful; other formats
    name their format)."""
    click.echo(str(info))
