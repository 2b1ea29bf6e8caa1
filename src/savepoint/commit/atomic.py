"""Turning a fully written temporary directory into a checkpoint, atomically.

Sequence for ``commit(path)`` (local filesystems):

1. the caller writes every file under ``staging`` (a hidden sibling,
   ``.<name>.savepoint-tmp-<host>-<pid>-<random>``), fsyncs each file, writes ``manifest.json``
   last and fsyncs it;
2. ``staging`` itself is fsynced, so its entries are durable;
3. if nothing exists at ``path``: ``rename(staging, path)``. If a checkpoint exists there:
   ``renameat2(RENAME_EXCHANGE)`` swaps the two directories in one atomic step (Linux 3.15+, on
   ext4, xfs, btrfs, tmpfs...). Where exchange is not available the old checkpoint is first renamed
   to ``.<name>.savepoint-old-...`` and the new one renamed into place; a crash between those two
   renames leaves the old checkpoint under that name, and :func:`resolve` finds it;
4. the parent directory is fsynced: the new checkpoint is now durable;
5. the replaced checkpoint (now under the hidden name) is deleted.

A crash at any point therefore leaves the old checkpoint or the new one at ``path``, never a
mixture, plus at most one hidden directory that the next save to the same path removes
(:func:`clean_stale`, which only touches names of dead processes on this host).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
import shutil
import socket
import uuid
from collections.abc import Callable

from savepoint.codecs import manifest as manifest_format
from savepoint.storage.local import fsync_dir, write_small

TMP_TAG = ".savepoint-tmp-"
OLD_TAG = ".savepoint-old-"
_HOST = "".join(c if c.isalnum() else "_" for c in socket.gethostname())[:32] or "host"

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_renameat2: Callable[..., int] | None = None
try:
    _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    _renameat2 = _libc.renameat2
    _renameat2.argtypes = [
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_uint,
    ]
    _renameat2.restype = ctypes.c_int
except (OSError, AttributeError):  # pragma: no cover - non-glibc platforms
    _renameat2 = None


def _hidden(path: str, tag: str) -> str:
    parent, name = os.path.split(os.path.abspath(path))
    return os.path.join(parent, f".{name}{tag}{_HOST}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def staging_path(path: str) -> str:
    return _hidden(path, TMP_TAG)


def exchange(a: str, b: str) -> bool:
    """Atomically swap two paths; False when this platform or filesystem cannot."""
    if _renameat2 is None:
        return False
    rc = _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), b)


def commit(staging: str, path: str) -> None:
    """Steps 2-5 above. ``path`` must be absent, an empty directory, or a committed checkpoint.

    If a step fails before the parent directory is synced, the renames done so far are undone
    (best effort) so that ``path`` holds the previous checkpoint again and ``staging`` the new
    one, which the caller then removes; the error is re-raised.
    """
    parent = os.path.dirname(os.path.abspath(path))
    fsync_dir(staging)
    if not os.path.lexists(path):
        os.rename(staging, path)
        _or_undo(lambda: fsync_dir(parent), lambda: os.rename(path, staging))
        return
    if exchange(staging, path):
        # ``staging`` now holds the previous checkpoint.
        _or_undo(lambda: fsync_dir(parent), lambda: exchange(staging, path))
        remove_tree(staging)
        return
    replaced = _hidden(path, OLD_TAG)
    os.rename(path, replaced)
    _or_undo(lambda: fsync_dir(parent), lambda: os.rename(replaced, path))
    _or_undo(lambda: os.rename(staging, path), lambda: os.rename(replaced, path))

    def put_back() -> None:
        os.rename(path, staging)
        os.rename(replaced, path)

    _or_undo(lambda: fsync_dir(parent), put_back)
    remove_tree(replaced)


def _or_undo(step: Callable[[], object], undo: Callable[[], object]) -> None:
    try:
        step()
    except BaseException:
        with contextlib.suppress(OSError):
            undo()
        raise


def remove_tree(path: str) -> None:
    """Remove a directory tree, or just the link when ``path`` is a symlink (never its target)."""
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)  # a symlink, or a file (an interrupted replace_file)


def _siblings(path: str, tag: str) -> list[tuple[str, str]]:
    """(hidden path, the part after the tag) for each hidden sibling of ``path`` with ``tag``."""
    parent, name = os.path.split(os.path.abspath(path))
    prefix = f".{name}{tag}"
    try:
        entries = os.listdir(parent)
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        # No parent, or one this process may not list: no sibling it could use either. Callers
        # that must tell "unreadable" from "absent" stat the path itself.
        return []
    return [(os.path.join(parent, e), e[len(prefix) :]) for e in entries if e.startswith(prefix)]


def _dead_here(rest: str) -> bool:
    """True if ``<host>-<pid>-<random>`` names a process of this host that no longer runs."""
    parts = rest.split("-")
    if len(parts) != 3 or parts[0] != _HOST or not parts[1].isdigit():
        return False
    pid = int(parts[1])
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError):
        return False
    return False


def clean_stale(path: str) -> list[str]:
    """Remove hidden siblings of ``path`` left by dead processes; returns what was removed."""
    removed = []
    has_checkpoint = os.path.isfile(os.path.join(path, manifest_format.NAME))
    for tag in (TMP_TAG, OLD_TAG):
        for hidden, rest in _siblings(path, tag):
            # A "-old-" directory is the only copy when a fallback replace died between renames.
            if tag == OLD_TAG and not has_checkpoint:
                continue
            if _dead_here(rest):
                try:
                    remove_tree(hidden)
                except OSError:  # tidying is best effort; the next save tries again
                    continue
                removed.append(hidden)
    return removed


def clean_stale_in(parent: str) -> list[str]:
    """Remove every hidden savepoint temporary in ``parent`` left by a dead process of this host
    (interrupted saves, prunes and alias updates); returns what was removed."""
    removed: list[str] = []
    try:
        entries = os.listdir(parent)
    except FileNotFoundError:
        return removed
    for entry in entries:
        if not entry.startswith(".") or TMP_TAG not in entry:
            continue
        if _dead_here(entry.rsplit(TMP_TAG, 1)[1]):
            hidden = os.path.join(parent, entry)
            try:
                remove_tree(hidden)
            except OSError:
                continue
            removed.append(hidden)
    return removed


def discard(path: str) -> None:
    """Delete a committed checkpoint so that no crash can leave it half-deleted: first renamed to
    a hidden temporary name (atomic), then removed; :func:`clean_stale_in` finishes the job if the
    process dies during the removal."""
    hidden = _hidden(path, TMP_TAG)
    try:
        os.rename(path, hidden)
    except FileNotFoundError:
        return
    fsync_dir(os.path.dirname(os.path.abspath(path)))
    remove_tree(hidden)


def resolve(path: str) -> str | None:
    """Where the committed checkpoint for ``path`` is: ``path`` itself, or the old checkpoint a
    fallback replace left under a hidden name when it died between its two renames."""
    if os.path.isfile(os.path.join(path, manifest_format.NAME)):
        return path
    if os.path.lexists(path):
        return None
    olds = [
        o
        for o, _ in _siblings(path, OLD_TAG)
        if os.path.isfile(os.path.join(o, manifest_format.NAME))
    ]
    return max(olds, key=_mtime) if olds else None


def _mtime(path: str) -> float:
    # A sibling can vanish between listing and stat (the next save tidied it): rank it last.
    try:
        return os.path.getmtime(path)
    except OSError:
        return -1.0


def replace_file(path: str, data: bytes) -> None:
    """Write a small file atomically: a hidden temporary sibling, fsync, rename over ``path``,
    fsync of the parent. Readers see the old content or the new one, never a torn file."""
    parent = os.path.dirname(os.path.abspath(path))
    tmp = _hidden(path, TMP_TAG)
    try:
        write_small(tmp, data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(parent)


# What os.link raises where a filesystem (or this pair of paths) has no hard links, or a file
# has too many: then a copy is made instead. Anything else (a full disk, a quota, an I/O error)
# is raised: a copy would need more of what just ran out.
_NO_HARD_LINKS = frozenset(
    getattr(errno, name)
    for name in ("EPERM", "EXDEV", "EMLINK", "ENOTSUP", "EOPNOTSUPP", "ENOSYS", "EACCES")
    if hasattr(errno, name)
)


def link_tree(source: str, staging: str) -> None:
    """Fill ``staging`` with hard links to the files of the checkpoint ``source`` (copies where
    the filesystem has no hard links). Committed files are never modified in place, so a linked
    copy costs no space and stays valid after ``source`` is deleted. Other errors (ENOSPC: no
    inode or directory block left for the link) are raised; ``staging`` is the caller's to
    remove."""
    os.mkdir(staging)
    for name in os.listdir(source):
        src, dst = os.path.join(source, name), os.path.join(staging, name)
        try:
            os.link(src, dst, follow_symlinks=False)
        except OSError as exc:
            if exc.errno not in _NO_HARD_LINKS:
                raise
            shutil.copyfile(src, dst, follow_symlinks=False)
            fd = os.open(dst, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
