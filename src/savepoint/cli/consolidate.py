"""``savepoint consolidate SRC DST``: a sharded checkpoint as an ordinary one, on one machine."""

from __future__ import annotations

import time

import click

from savepoint.cli._common import fail_read, local, named, progress
from savepoint.cli._text import size as _size
from savepoint.errors import CheckpointError

__all__ = ["consolidate_cmd"]


@click.command("consolidate")
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
def consolidate_cmd(src: str, dst: str, max_file_gib: float, no_verify: bool) -> None:
    """Write the sharded checkpoint SRC as an unsharded checkpoint DST (one tensor in memory at
    a time). DST is replaced atomically if it is a checkpoint; SRC is never modified. Both may
    be local paths or URLs (memory://, s3://, ...)."""
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
    click.echo(
        f"ok: {named(dst, info.path)}: {len(info.tensors)} tensors, {_size(info.total_bytes)} in "
        f"{len(info.files)} file(s), written in {time.perf_counter() - start:.2f} s"
    )
