"""Single files for inference snapshots (the seed's ``save_json`` / ``save_msgpack`` and loads).

Contract:

- paths are local paths or URLs (``memory://``): the bytes go through the path's store;
- writing is atomic and durable (``Store.put(exclusive=False)``; on local disks a hidden temporary
  sibling, fsynced and renamed over the target, then the parent directory fsynced). A reader sees the old file or the new one,
  never a torn one; a failed write leaves the old file as it was and no temporary behind. Any
  failure is a CheckpointWriteError with the failing call's ``errno`` (``errno.ENOSPC`` for a
  full disk). The parent directory must exist (as for the seed's ``File::create``); a symlink
  at the target is replaced by the file, not written through;
- reading goes through ``Store.read_small`` on the resolved path (a user may name a symlink;
  on local disks :func:`savepoint.storage.local.open_read`): a FIFO, socket, device or directory is refused without blocking
  (CorruptCheckpointError), a missing file is CheckpointNotFoundError, an unreadable one
  CheckpointPermissionError, a read error CheckpointError. No OSError escapes.
"""

from __future__ import annotations

from savepoint import errors_map
from savepoint.errors import CheckpointError, CheckpointNotFoundError
from savepoint.storage.paths import PathArg, resolve

PathLike = PathArg


def write(path: PathLike, data: bytes, what: str) -> None:
    """Replace the file at ``path`` by ``data`` atomically (see the module docstring)."""
    loc = resolve(path, what=what)
    target = loc.store.url(loc.path)
    try:
        loc.store.put(loc.path, data, exclusive=False)
    except CheckpointError:
        raise
    except OSError as exc:
        raise errors_map.write_error(
            exc,
            target,
            f"writing the {what} {target} failed",
            where="",
            tail="; the file there holds its old content or the new one, never a torn file, and "
            "no temporary file remains",
            scheme=loc.store.scheme,
            cause=False,
        ) from None


def read(path: PathLike, what: str) -> bytes:
    """The whole content of the regular file at ``path`` (see the module docstring)."""
    loc = resolve(path, what=what)
    shown = str(path) if loc.is_local else loc.store.url(loc.path)
    try:
        return loc.store.read_small(loc.store.realpath(loc.path), cap=None)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"no {what} at {shown}", path=shown) from None
