"""Path arguments: a local path, a URL, or a :class:`Location` (a store and a path in it).

Every public entry point that takes a path passes it through :func:`resolve` (or, for formats
that exist only as local files, :func:`local_path`) first. Without it,
``sp.save("s3://bucket/run")`` would quietly write ``./s3:/bucket/run`` on the local disk.

- a plain path, ``pathlib.Path`` or ``file:///abs/path``: the local filesystem;
- ``memory://name/...``: the process's in-memory store (:func:`savepoint.storage.memory.shared`);
- ``s3://``, ``gs://``, ``az://`` and other schemes: refused with
  :class:`~savepoint.errors.UnsupportedStorageError` naming the extra that will carry their
  backend, before anything is created;
- a :class:`Location` (``store.at(path)``): any store object, such as the fault-injecting one of
  the tests or an object store configured by hand.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Union
from urllib.parse import unquote, urlsplit

from savepoint.errors import UnsupportedStorageError

if TYPE_CHECKING:
    from savepoint.storage.base import Store

__all__ = ["Location", "PathArg", "local_path", "resolve"]


@dataclass(frozen=True)
class Location:
    """A path inside a particular store; accepted wherever savepoint takes a path."""

    store: Store
    path: str

    def __str__(self) -> str:
        return self.store.url(self.path)

    def join(self, *names: str) -> Location:
        return Location(self.store, self.store.join(self.path, *names))

    @property
    def is_local(self) -> bool:
        """True for the local filesystem itself; a store wrapping it (the fault-injecting one
        of the tests) is not local: what it is handed must go through its calls."""
        from savepoint.storage.local import LocalStore

        return isinstance(self.store, LocalStore)


PathArg = Union[str, "os.PathLike[str]", Location]

# RFC 3986 scheme followed by "://". A relative path with a colon later ("runs/a:b") or a first
# component such as "a:b" without "//" does not match and stays a local path.
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
# The extras that will carry the backends of schemes savepoint does not handle yet (issue 15).
_EXTRAS = {
    "s3": "s3",
    "s3a": "s3",
    "gs": "gcs",
    "gcs": "gcs",
    "az": "azure",
    "abfs": "azure",
    "abfss": "azure",
    "azure": "azure",
}


def resolve(path: PathArg, *, what: str = "path") -> Location:
    """The store and the absolute path in it that ``path`` names (see the module docstring)."""
    if isinstance(path, Location):
        return Location(path.store, path.store.abspath(path.path))
    text = os.fspath(path)
    if isinstance(text, str):
        match = _URL.match(text)
        if match is not None and match.group(1).lower() == "memory":
            from savepoint.storage import memory

            rest = text[match.end() :]
            if "?" in rest or "#" in rest:
                raise UnsupportedStorageError(
                    f"{what} {text!r}: a memory:// URL takes no query or fragment (write a name's "
                    "'?' as %3F and '#' as %23)",
                    path=text,
                    scheme="memory",
                )
            store = memory.shared()
            return Location(store, store.abspath(unquote(rest)))
    from savepoint.storage import local

    return Location(local.STORE, os.path.abspath(local_path(path, what=what)))


def local_path(path: PathArg, *, what: str = "path") -> str:
    """Return ``path`` as a local filesystem path string (unchanged when it is not a URL).

    ``file:///abs/path`` (or ``file://localhost/abs/path``) becomes ``/abs/path``, percent-escapes
    decoded. Any other ``scheme://...`` raises UnsupportedStorageError (also ValueError) naming the
    scheme; ``what`` names the argument in the message ("checkpoint path", "run directory", ...).
    A ``pathlib.Path`` built from a URL has already collapsed ``//`` to ``/`` and is a local path.
    """
    if isinstance(path, Location):
        if path.is_local:
            return path.path
        raise UnsupportedStorageError(
            f"{what} {path}: this reads and writes local files only; copy it to a local path",
            path=str(path),
            scheme=path.store.scheme,
        )
    text = os.fspath(path)
    if not isinstance(text, str):
        raise TypeError(f"{what} must be a str or os.PathLike[str], not {type(text).__name__}")
    match = _URL.match(text)
    if match is None:
        return text
    scheme = match.group(1).lower()
    if scheme == "file":
        parts = urlsplit(text)
        if parts.netloc in ("", "localhost") and not parts.query and not parts.fragment:
            local = unquote(parts.path)
            if local.startswith("/"):
                return local
        raise UnsupportedStorageError(
            f"{what} {text!r}: a file:// URL must name an absolute path on this machine, "
            f"as in file:///abs/path (no host other than localhost, no query or fragment)",
            path=text,
            scheme=scheme,
        )
    if scheme == "memory":
        raise UnsupportedStorageError(
            f"{what} {text!r}: this reads and writes local files only (memory:// holds savepoint "
            "checkpoints, runs and snapshot histories); pass a local path",
            path=text,
            scheme=scheme,
        )
    extra = _EXTRAS.get(scheme)
    needs = (
        f"its backend will come with the `savepoint[{extra}]` extra (pip install "
        f"'savepoint[{extra}]'), which this version does not have yet"
        if extra
        else "other schemes will be read through fsspec with the `savepoint[fsspec]` extra, "
        "which this version does not have yet"
    )
    raise UnsupportedStorageError(
        f"{what} {text!r}: savepoint has no backend for {scheme}:// URLs here; {needs}. For now "
        "pass a local path, or mount the bucket (s3fs, gcsfuse, blobfuse2, ...) and pass a path "
        "inside the mount; memory:// URLs work everywhere.",
        path=text,
        scheme=scheme,
    )
