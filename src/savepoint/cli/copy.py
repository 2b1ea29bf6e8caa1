"""``savepoint copy SRC DST``: one checkpoint copied to another place (another disk, a RAM disk,
an object store), verified first and committed there like a save (:func:`savepoint.copy`)."""

from __future__ import annotations

import time

import click

from savepoint.cli._common import command, echo_json, fail_read, local, progress, shown
from savepoint.cli._runs import is_run, step_path
from savepoint.cli._text import size as _size
from savepoint.errors import CheckpointError

__all__ = ["copy_cmd"]


@command(
    "copy",
    short="Copy a checkpoint to another place, verified and committed atomically.",
    json_help="Print what was copied as JSON (see docs/cli.md).",
)
@click.argument("src", type=click.Path(path_type=str))
@click.argument("dst", type=click.Path(path_type=str))
@click.option(
    "--step",
    metavar="STEP",
    help="With a run directory: the step to copy (a number, 'latest' or 'best'; default latest).",
)
@click.option(
    "--verify/--no-verify",
    default=True,
    show_default=True,
    help="Check every checksum of SRC before anything is committed at DST.",
)
@click.option(
    "--overwrite/--no-overwrite",
    default=True,
    show_default=True,
    help="Replace a committed checkpoint at DST (never anything else).",
)
@click.option(
    "--materialize",
    is_flag=True,
    help="Write an incremental (blob-backed) SRC as a plain checkpoint that needs no blob store.",
)
def copy_cmd(
    src: str,
    dst: str,
    step: str | None,
    verify: bool,
    overwrite: bool,
    materialize: bool,
    as_json: bool,
) -> None:
    """Copy the savepoint checkpoint SRC to DST: the same manifest and data files, byte for
    byte, committed at DST the way a save commits (a failure leaves DST as it was).

    SRC and DST are local paths or URLs (s3://, gs://, az://, memory://); SRC may be a run
    directory (its latest checkpoint, or --step N|latest|best). An incremental checkpoint
    brings the blobs it names that are missing there to the blob store at the same relative
    place from DST (its run's blobs/, say); --materialize writes it as a plain checkpoint
    instead.

    \b
    Examples:
      savepoint copy /dev/shm/run/checkpoints/step-0000000100 s3://bucket/run/step-100
      savepoint copy runs/demo backup/demo-latest --step best
    """
    from savepoint.blobs import PutStats
    from savepoint.transfer import copy

    src = local(src)
    dst = local(dst, what="destination")
    if is_run(src):
        _, src = step_path(src, step or "latest")
    elif step is not None:
        raise click.UsageError("--step is for run directories; SRC is a checkpoint")
    start = time.perf_counter()
    stats = PutStats()
    try:
        with progress("copying") as update:
            info = copy(
                src,
                dst,
                verify=verify,
                overwrite=overwrite,
                progress=update,
                materialize=materialize,
                stats=stats,
            )
    except CheckpointError as exc:
        fail_read(exc, src)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    elapsed = time.perf_counter() - start
    nbytes = sum(info.files.values())
    if as_json:
        echo_json(
            {
                "source": shown(src),
                "destination": info.path,
                "tensors": len(info.tensors),
                "bytes": nbytes,
                "blobs_copied": stats.blobs_written,
                "blob_bytes": stats.bytes_stored,
                "materialized": materialize,
                "verified": verify,
                "seconds": round(elapsed, 6),
            },
            format=info.format,
            version=info.format_version,
        )
        return
    checked = "verified and " if verify else ""
    blobs = ""
    if stats.blobs_written or stats.blobs_reused:
        blobs = (
            f", {stats.blobs_written} blobs copied ({_size(stats.bytes_stored)}), "
            f"{stats.blobs_reused} already there"
        )
    plain = " as a plain checkpoint" if materialize else ""
    click.echo(
        f"ok: {shown(src)} {checked}copied to {info.path}{plain}: {len(info.tensors)} tensors, "
        f"{_size(nbytes)}{blobs} in {elapsed:.2f} s"
    )
