"""What an export or a conversion may replace on the local disk: the checks made before anything
is written (shared by :mod:`savepoint.formats.convert`, :mod:`savepoint.formats.export` and the
writers of directories of other formats)."""

from __future__ import annotations

import os
import stat

from savepoint.errors import CheckpointWriteError
from savepoint.storage.paths import Location

__all__ = ["check_local_target", "check_replaceable"]


def check_local_target(
    source: Location,
    target_path: str,
    overwrite: bool,
    *,
    verb: str = "convert",
    directories: bool = True,
) -> None:
    """What may be at a local ``target_path``: nothing, or with ``overwrite`` a file or (with
    ``directories``) a directory other than the source itself. ``verb`` names the command in
    messages."""
    if not os.path.lexists(target_path):
        return
    if source.is_local and os.path.realpath(target_path) == os.path.realpath(source.path):
        raise CheckpointWriteError(
            f"{target_path} is the source itself; {verb} into another path", path=target_path
        )
    if not overwrite:
        raise CheckpointWriteError(
            f"{target_path} already exists; pass overwrite=True (savepoint {verb} "
            "--overwrite) to replace it",
            path=target_path,
        )
    if not directories and os.path.isdir(target_path):
        raise CheckpointWriteError(
            f"{target_path} is a directory; {verb} writes one .safetensors file: name the file",
            path=target_path,
        )
    check_replaceable(target_path)


def check_replaceable(path: str) -> None:
    """Refuse to overwrite what is not a checkpoint: a FIFO, a socket, a device (or a link to
    one). Only a regular file or a directory is replaced, each by its own kind, by the writer."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return  # a dangling link: replacing the link loses nothing
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise CheckpointWriteError(
            f"{path} is not a regular file or directory (a FIFO, socket or device); refusing to "
            "replace it",
            path=path,
        )
