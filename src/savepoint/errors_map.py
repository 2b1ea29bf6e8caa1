"""One table from OS and object-store failures to savepoint's errors, and one home for each hint.

httpx's ``map_exceptions`` shape: a failure the OS or a store raised (an :class:`OSError`, whose
``errno`` says what went wrong) becomes savepoint's error here and nowhere else:

- :data:`ERRNOS`: errno -> (the hint a failed write names, the class a failed read raises);
  a failed write is always a :class:`CheckpointWriteError` carrying the failing call's errno.
- :data:`OBJECT_STORE`: an object store's failure kind -> the OSError the Store contract
  raises for it (a refusal is a PermissionError with EACCES, as the local disk's).
- :data:`HINTS`: every user-facing hint, once.
- :func:`write_error`, :func:`read_error`, :func:`permission_error` and the context manager
  :func:`mapped` build the errors; modules never build one from an OSError by hand
  (``tests/test_errors_map.py`` scans for it).

This module imports only :mod:`savepoint.errors`, so every layer may use it.
"""

from __future__ import annotations

import contextlib
import errno as _errno
import os
from collections.abc import Iterator
from typing import Literal, NamedTuple

from savepoint.errors import CheckpointError, CheckpointPermissionError, CheckpointWriteError

__all__ = [
    "ERRNOS",
    "Entry",
    "HINTS",
    "OBJECT_STORE",
    "mapped",
    "permission_error",
    "read_error",
    "reason",
    "store_error",
    "write_error",
    "write_hint",
]

HINTS: dict[str, str] = {
    "disk_full": "free disk space and save again",
    "quota": "free quota and save again",
    "read_only": "the filesystem is read-only",
    "refused_local": "check the permissions of the parent directory",
    "refused_remote": (
        "the store refused the request: check the credentials and the bucket's access policy"
    ),
    "unreadable_local": "make it readable by this user (or read it as one who may) and try again",
    "unreadable_remote": (
        "make it readable by this user (on an object store: check the credentials and the "
        "bucket's policy) and try again"
    ),
    "cause": "see the cause below",
}


class Entry(NamedTuple):
    """How one errno maps: ``hint`` (a key of :data:`HINTS`; "refused" picks the local or the
    remote refusal by the store) for a failed write, ``read`` the class a failed read raises."""

    hint: str
    read: type[CheckpointError]


ERRNOS: dict[int, Entry] = {
    _errno.ENOSPC: Entry("disk_full", CheckpointError),
    _errno.EDQUOT: Entry("quota", CheckpointError),
    _errno.EROFS: Entry("read_only", CheckpointError),
    _errno.EACCES: Entry("refused", CheckpointPermissionError),
    _errno.EPERM: Entry("refused", CheckpointPermissionError),
}

# An object store's failure kind -> the OSError (class, errno) the Store contract raises for it.
OBJECT_STORE: dict[str, tuple[type[OSError], int]] = {
    "missing": (FileNotFoundError, _errno.ENOENT),  # 404 NoSuchKey / NoSuchBucket
    "exists": (FileExistsError, _errno.EEXIST),  # 412 a conditional put lost
    "refused": (PermissionError, _errno.EACCES),  # 401 / 403 AccessDenied
    "failed": (OSError, _errno.EIO),  # anything else, after the retries
}


def store_error(
    kind: str, message: str, shown: str, *, side: Literal["read", "write"] | None = None
) -> OSError | CheckpointError:
    """The error for an object store's failure of ``kind`` (a key of :data:`OBJECT_STORE`) on
    ``shown``, ``message`` saying it all (the request, the attempts, the cause): the OSError the
    Store contract raises; a failed write (``side="write"``) a CheckpointWriteError with that
    errno, which the layers above pass on as it is; a failed read of bytes a CheckpointError
    (a refused one :func:`read_error`'s CheckpointPermissionError), as the local store's."""
    cls, code = OBJECT_STORE[kind]
    raw = cls(code, message, shown)
    if side == "write":
        return CheckpointWriteError(message, path=shown, errno=code)
    if side == "read":
        return read_error(raw, shown) if kind == "refused" else CheckpointError(message, path=shown)
    return raw


def _entry(exc: BaseException) -> Entry | None:
    code = getattr(exc, "errno", None)
    if isinstance(code, int) and code in ERRNOS:
        return ERRNOS[code]
    if isinstance(exc, PermissionError):  # a store's refusal without an errno
        return ERRNOS[_errno.EACCES]
    return None


def _remote(scheme: str) -> bool:
    return scheme.removeprefix("fsspec+") not in ("file", "local")


def write_hint(exc: BaseException, *, scheme: str = "file", cause: bool = True) -> str:
    """What to do about ``exc``, met while writing on a store of ``scheme``: the full disk's,
    the quota's, the read-only filesystem's, the refusal's (permissions on the local disk,
    credentials and access policy on any other store); else "see the cause below" when the
    cause is chained (``cause``), else nothing."""
    entry = _entry(exc)
    if entry is None:
        return HINTS["cause"] if cause else ""
    if entry.hint == "refused":
        return HINTS["refused_remote" if _remote(scheme) else "refused_local"]
    return HINTS[entry.hint]


def reason(exc: BaseException) -> str:
    """What went wrong, in the failing call's own words (an object store's message names the
    request and its cause; a local error is its strerror)."""
    if isinstance(exc, OSError) and not isinstance(exc, CheckpointError):
        return exc.strerror or (os.strerror(exc.errno) if exc.errno else str(exc))
    return str(exc) or type(exc).__name__


def write_error(
    exc: OSError,
    path: str | None,
    head: str,
    *,
    tail: str = "",
    where: str | None = None,
    scheme: str = "file",
    cause: bool = True,
) -> CheckpointWriteError:
    """The CheckpointWriteError for ``exc``, met while writing ``path``: the message is
    ``"{head}: {reason} ({where}){tail}; {hint}"``, ``where`` defaulting to the file ``exc``
    names ("" for none), the hint from :func:`write_hint`; its ``errno`` is ``exc``'s."""
    if where is None:
        where = exc.filename if isinstance(exc.filename, str) else ""
    message = f"{head}: {reason(exc)}" + (f" ({where})" if where else "") + tail
    hint = write_hint(exc, scheme=scheme, cause=cause)
    return CheckpointWriteError(message + (f"; {hint}" if hint else ""), path=path, errno=exc.errno)


def permission_error(
    exc: OSError,
    shown: str,
    *,
    what: str = "the checkpoint itself",
    head: str | None = None,
    scheme: str | None = None,
) -> CheckpointPermissionError:
    """The CheckpointPermissionError for a refused read of ``shown`` (EACCES, EPERM, an object
    store's 403): ``"{head}: permission denied ({reason}); {what} may be intact: {hint}"``,
    ``head`` defaulting to ``shown``, the hint how to make it readable on its store."""
    if scheme is None:
        scheme = shown.partition("://")[0] if "://" in shown else "file"
    hint = HINTS["unreadable_remote" if _remote(scheme) else "unreadable_local"]
    # The refusal's own words (an object store's names the request), never a nested message.
    cause = exc.strerror or os.strerror(exc.errno or _errno.EACCES)
    return CheckpointPermissionError(
        f"{head or shown}: permission denied ({cause}); {what} may be intact: {hint}",
        path=shown,
        errno=exc.errno or _errno.EACCES,
    )


def read_error(
    exc: OSError,
    shown: str,
    *,
    what: str = "the checkpoint itself",
    head: str | None = None,
    tail: str = "",
) -> CheckpointError:
    """The error for ``exc``, met while ``shown`` was read or looked at: ``exc`` itself when it
    is a CheckpointError already; :func:`permission_error` for a refusal; else the class
    :data:`ERRNOS` names (CheckpointError) saying ``head`` (default "cannot read {shown}") and
    the cause, then ``tail``."""
    if isinstance(exc, CheckpointError):
        return exc
    entry = _entry(exc)
    if entry is not None and issubclass(entry.read, CheckpointPermissionError):
        return permission_error(exc, shown, what=what, head=head)
    cls = entry.read if entry is not None else CheckpointError
    return cls(f"{head or f'cannot read {shown}'}: {reason(exc)}{tail}", path=shown)


@contextlib.contextmanager
def mapped(
    path: str | None,
    head: str,
    *,
    tail: str = "",
    scheme: str = "file",
    read: bool = False,
) -> Iterator[None]:
    """Run the block; an OSError escaping it (not a CheckpointError, which passes as it is)
    becomes :func:`write_error` (or :func:`read_error` when ``read``), its cause chained."""
    try:
        yield
    except CheckpointError:
        raise
    except OSError as exc:
        if read:
            raise read_error(exc, path or "", head=head) from exc
        raise write_error(exc, path, head, tail=tail, scheme=scheme) from exc
