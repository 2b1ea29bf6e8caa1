"""``savepoint consolidate SRC DST``: a sharded checkpoint as an ordinary one, on one machine."""

from __future__ import annotations

import time

import click

from savepoint.cli._common import command, echo_json, fail_read, local, named, progress, shown
from savepoint.cli._text import size as _size
from savepoint.errors import CheckpointError

__all__ = ["consolidate_cmd"]


@command(
    "consolidate",
    short="Write a sharded checkpoint as an unsharded one.",
    json_help="Print what was written as JSON (see docs/cli.md).",
)
@click.argument("src", type=click.Path(path_type=str))
@click.argument("dst", type=click.Path(path_type=str))
@click.option(
    "--max-file-gib",
    type=click.FloatRange(min=0, min_open=True),
    default=1.0,
    show_default=True,
    help="Split the output into data files of at most this size.",
)
@click.option("--no-verify", is_flag=True, help="Skip checking each shard's checksum.")
def consolidate_cmd(
    src: str, dst: str, max_file_gib: float, no_verify: bool, as_json: bool
) -> None:
    """Write the sharded checkpoint SRC as an unsharded checkpoint DST (one tensor in memory at
    a time). DST is replaced atomically if it is a checkpoint; SRC is never modified. Both may
    be local paths or URLs (memory://, s3://, ...).

    \b
    Example:
      savepoint consolidate sharded/step-100 whole/step-100
    """
    from savepoint.distributed.consolidate import consolidate

    src, dst = local(src, "source"), local(dst, "target")
    start = time.perf_counter()
    try:
        with progress("consolidating") as update:
            info = consolidate(
                src,
                dst,
                verify=not no_verify,
                max_file_bytes=max(1, int(max_file_gib * (1 << 30))),
                progress=update,
            )
    except CheckpointError as exc:
        fail_read(exc, src)
    elapsed = time.perf_counter() - start
    if as_json:
        echo_json(
            {
                "path": named(dst, info.path),
                "source": shown(src),
                "destination": named(dst, info.path),
                "tensor_count": len(info.tensors),
                "total_bytes": info.total_bytes,
                "files": info.files,
                "verified": not no_verify,
                "seconds": round(elapsed, 3),
            },
            format=info.format,
            version=info.format_version,
        )
        return
    click.echo(
        f"ok: {named(dst, info.path)}: {len(info.tensors)} tensors, {_size(info.total_bytes)} in "
        f"{len(info.files)} file(s), written in {elapsed:.2f} s"
    )
