"""Single files for inference snapshots (the seed's ``save_json`` / ``save_msgpack`` and loads).

Contract:

- writing is atomic and durable: the bytes go to a hidden temporary sibling, which is fsynced
  and renamed over the target, then the parent directory is fsynced
  (:func:`savepoint.commit.atomic.replace_file`). A reader sees the old file or the new one,
  never a torn one; a failed write leaves the old file as it was and no temporary behind. Any
  failure is a CheckpointWriteError with the failing call's ``errno`` (``errno.ENOSPC`` for a
  full disk). The parent directory must exist (as for the seed's ``File::create``); a symlink
  at the target is replaced by the file, not written through;
- reading goes through :func:`savepoint.storage.local.open_read` on the resolved path (a user
  may name a symlink): a FIFO, socket, device or directory is refused without blocking
  (CorruptCheckpointError), a missing file is CheckpointNotFoundError, an unreadable one
  CheckpointPermissionError, a read error CheckpointError. No OSError escapes.
"""

from __future__ import annotations

import errno
import os

from savepoint.commit import atomic
from savepoint.errors import CheckpointError, CheckpointNotFoundError, CheckpointWriteError
from savepoint.storage import local
from savepoint.storage.paths import local_path

PathLike = str | os.PathLike[str]


def write(path: PathLike, data: bytes, what: str) -> None:
    """Replace the file at ``path`` by ``data`` atomically (see the module docstring)."""
    target = os.path.abspath(local_path(path, what=what))
    try:
        atomic.replace_file(target, data)
    except CheckpointError:
        raise
    except OSError as exc:
        reason = os.strerror(exc.errno) if exc.errno else str(exc)
        hint = "; free disk space and try again" if exc.errno == errno.ENOSPC else ""
        raise CheckpointWriteError(
            f"writing the {what} {target} failed: {reason}{hint}; the file there holds its old "
            "content or the new one, never a torn file, and no temporary file remains",
            path=target,
            errno=exc.errno,
        ) from None


def read(path: PathLike, what: str) -> bytes:
    """The whole content of the regular file at ``path`` (see the module docstring)."""
    shown = local_path(path, what=what)
    try:
        return local.read_small(os.path.realpath(shown), cap=None, shown=shown)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"no {what} at {shown}", path=shown) from None
