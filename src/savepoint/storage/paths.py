"""Path arguments: a local path, a URL, or a :class:`Location` (a store and a path in it).

Every public entry point that takes a path passes it through :func:`resolve` (or, for formats
that exist only as local files, :func:`local_path`) first. Without it,
``sp.save("s3://bucket/run")`` would quietly write ``./s3:/bucket/run`` on the local disk.

- a plain path, ``pathlib.Path`` or ``file:///abs/path``: the local filesystem;
- ``memory://name/...``: the process's in-memory store (:func:`savepoint.storage.memory.shared`);
- ``s3://bucket/key`` (also ``s3a://``), ``gs://bucket/key`` (also ``gcs://``) and
  ``az://container/key``: the path ``/bucket/key`` in the process's object store of that scheme
  (:func:`savepoint.storage.objectstore.shared`, configured from the environment) when obstore is
  installed (the ``s3``, ``gcs`` and ``azure`` extras); without it they are refused with
  :class:`~savepoint.errors.UnsupportedStorageError` naming the extra to install, before
  anything is created (obstore is imported only then: ``import savepoint`` never imports it);
- any other scheme fsspec knows (``hdfs://``, ``sftp://``, ``ftp://``, ``abfs://``,
  ``webdav://``, ...), and ``fsspec+<protocol>://`` for fsspec's filesystem of any protocol
  (``fsspec+gs://bucket/run`` through gcsfs): the path in the process's
  :class:`~savepoint.storage.fsspecstore.FsspecStore` for that protocol and the URL's host, port
  and user (:func:`savepoint.storage.fsspecstore.shared`; fsspec adds its configuration from the
  environment when the filesystem is made, at first use: resolving connects nowhere), when fsspec
  (the ``fsspec`` extra) and the implementation's package are installed; otherwise refused with
  :class:`~savepoint.errors.UnsupportedStorageError` naming what to install (``savepoint[fsspec]``,
  or the package fsspec names: ``paramiko`` for sftp, ``adlfs`` for abfs, ...). fsspec's wrappers
  and archives (``simplecache``, ``dir``, ``zip``, ...) and ``http(s)://`` (read-only, with no
  directories) are refused: wrap a filesystem by hand and pass ``FsspecStore(fs).at(path)``;
- other schemes: refused the same way;
- a :class:`Location` (``store.at(path)``): any store object, such as the fault-injecting one of
  the tests or an object store configured by hand.
"""

from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Union
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
# The extras that carry the backends of object stores (abfs:// goes through fsspec and adlfs;
# az:// is the same storage through obstore).
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
        scheme = "" if match is None else match.group(1).lower()
        if scheme == "memory" or scheme.startswith("memory+"):
            from savepoint.storage import memory

            rest = text[match.end() :] if match is not None else ""
            if "?" in rest or "#" in rest:
                raise UnsupportedStorageError(
                    f"{what} {text!r}: a memory:// URL takes no query or fragment (write a name's "
                    "'?' as %3F and '#' as %23)",
                    path=text,
                    scheme="memory",
                )
            store = memory.shared() if scheme == "memory" else _numbered(scheme, text, what)
            return Location(store, store.abspath(unquote(rest)))
        if scheme in _OBJECT_SCHEMES and _has_obstore():
            return _object_store(text, scheme, text[len(scheme) + 3 :], what)
        protocol = _fsspec_protocol(scheme)
        if protocol is not None and _has_fsspec() and _fsspec_knows(protocol):
            return _fsspec_location(text, scheme, protocol, what)
    from savepoint.storage import local

    return Location(local.STORE, os.path.abspath(local_path(path, what=what)))


def _numbered(scheme: str, text: str, what: str) -> Store:
    """The in-memory store a ``memory+<number>://`` URL names (see ``MemoryStore.url``)."""
    from savepoint.storage import memory

    number = scheme.partition("+")[2]
    store = memory.by_number(int(number)) if number.isdigit() else None
    if store is None:
        raise UnsupportedStorageError(
            f"{what} {text!r} names an in-memory store made by hand that no longer exists (it "
            "lives as long as its MemoryStore object; memory:// URLs name the process's shared "
            "store)",
            path=text,
            scheme=scheme,
        )
    return store


# The schemes of the object-store backend (savepoint.storage.objectstore).
_OBJECT_SCHEMES = frozenset({"s3", "s3a", "gs", "gcs", "az"})


def _has_obstore() -> bool:
    return importlib.util.find_spec("obstore") is not None


def _object_store(text: str, scheme: str, rest: str, what: str) -> Location:
    """The Location of an object-store URL: ``s3://bucket/key`` is ``/bucket/key``."""
    from savepoint.storage import objectstore

    if "?" in rest or "#" in rest:
        raise UnsupportedStorageError(
            f"{what} {text!r}: a {scheme}:// URL takes no query or fragment (write a name's '?' "
            "as %3F and '#' as %23)",
            path=text,
            scheme=scheme,
        )
    store = objectstore.shared(scheme)
    path = store.abspath(unquote(rest))
    if path == "/" or rest.startswith("/"):  # s3:///x names no bucket (not the bucket "x")
        raise UnsupportedStorageError(
            f"{what} {text!r}: the URL names no bucket (as in {scheme}://bucket/run)",
            path=text,
            scheme=scheme,
        )
    return Location(store, path)


# Schemes savepoint serves itself: fsspec's filesystems of these are named fsspec+<protocol>://.
_OWN_SCHEMES = frozenset({"file", "local", "asynclocal", "memory", *_OBJECT_SCHEMES})
# fsspec protocols that are no checkpoint store of their own: wrappers of another filesystem,
# archives, inline data, and HTTP (read-only, no directories, paths that are whole URLs).
_FSSPEC_REFUSED = frozenset(
    {
        "async_wrapper",
        "asyncwrapper",
        "blockcache",
        "cached",
        "dask",
        "data",
        "dir",
        "filecache",
        "generic",
        "http",
        "https",
        "libarchive",
        "reference",
        "simplecache",
        "tar",
        "zip",
    }
)


def _has_fsspec() -> bool:
    return importlib.util.find_spec("fsspec") is not None


def _fsspec_protocol(scheme: str) -> str | None:
    """The fsspec protocol a URL of ``scheme`` would be read through (None: not fsspec's)."""
    if scheme.startswith("fsspec+"):
        return scheme.partition("+")[2] or None
    if not scheme or scheme in _OWN_SCHEMES:
        return None
    return scheme


def _fsspec_knows(protocol: str) -> bool:
    from fsspec.registry import known_implementations, registry

    return protocol in known_implementations or protocol in registry


def _fsspec_location(text: str, scheme: str, protocol: str, what: str) -> Location:
    """The Location of a URL read through fsspec (see the module docstring)."""
    import fsspec

    tail = (
        " For now pass a local path, or mount the filesystem and pass a path inside the mount; "
        "memory:// URLs work everywhere."
    )
    if protocol in _FSSPEC_REFUSED:
        reason = (
            "fsspec's HTTP filesystem is read-only and has no directories"
            if protocol in ("http", "https")
            else f"fsspec's {protocol}:// is a wrapper of another filesystem (or an archive), "
            "not a store of its own"
        )
        raise UnsupportedStorageError(
            f"{what} {text!r}: savepoint has no backend for {scheme}:// URLs: {reason}. Make the "
            "filesystem yourself and pass FsspecStore(fs).at(path) "
            "(savepoint.storage.fsspecstore)." + tail,
            path=text,
            scheme=scheme,
        )
    try:
        cls = fsspec.get_filesystem_class(protocol)
    except ImportError as exc:
        missing = getattr(exc.__cause__, "name", None)
        package = f" (the module {missing!r} is missing)" if missing else ""
        extra = _EXTRAS.get(scheme)
        hint = (
            f"; or use az://container/... with the `savepoint[{extra}]` extra"
            if extra == "azure"
            else ""
        )
        raise UnsupportedStorageError(
            f"{what} {text!r}: savepoint reads {scheme}:// URLs through fsspec, whose "
            f"implementation of {protocol}:// cannot be imported here{package}: {exc}. Install "
            f"that package{hint}." + tail,
            path=text,
            scheme=scheme,
        ) from None
    rest = text[len(scheme) + 3 :]
    if "?" in rest or "#" in rest:
        raise UnsupportedStorageError(
            f"{what} {text!r}: a {scheme}:// URL takes no query or fragment (write a name's '?' "
            "as %3F and '#' as %23)",
            path=text,
            scheme=scheme,
        )
    from savepoint.storage import fsspecstore

    url = f"{protocol}://{rest}"
    try:
        options = dict(cls._get_kwargs_from_urls(url))
        stripped = str(cls._strip_protocol(url)).strip("/")
    except Exception as exc:
        raise UnsupportedStorageError(
            f"{what} {text!r}: fsspec's {protocol} filesystem cannot read this URL: {exc}",
            path=text,
            scheme=scheme,
        ) from None
    base = _url_base(scheme, rest, stripped, cls)
    store = fsspecstore.shared(protocol, options, base)
    return Location(store, store.abspath(unquote(stripped)))


def _url_base(scheme: str, rest: str, stripped: str, cls: Any) -> str:
    """How the URLs of an fsspec store start: the URL's path is the store's path; what comes
    before it (a host, a user) names the store."""
    body = rest.strip("/")
    if stripped and body.endswith(stripped):
        head = body[: len(body) - len(stripped)]
    elif not stripped:
        head = body
    else:
        head = ""
    head = head.strip("/")
    if "@" in head.split("/", 1)[0] and ":" in head.split("@", 1)[0]:
        # user:password@host: the password stays out of messages (the options keep it).
        user, _, host = head.partition("@")
        head = user.split(":", 1)[0] + "@" + host
    # fsspec's local filesystem: its URLs keep the path absolute (fsspec+file:///tmp/run, not
    # fsspec+file://tmp/run, which names a relative path).
    from fsspec.implementations.local import LocalFileSystem

    absolute = not head and issubclass(cls, LocalFileSystem)
    return f"{scheme}://{head}/" if head or absolute else f"{scheme}://"


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
    protocol = _fsspec_protocol(scheme)
    by_fsspec = (
        protocol is not None
        and protocol not in _FSSPEC_REFUSED
        and _has_fsspec()
        and _fsspec_knows(protocol)
    )
    if (scheme in _OBJECT_SCHEMES and _has_obstore()) or by_fsspec:
        raise UnsupportedStorageError(
            f"{what} {text!r}: this reads and writes local files only ({scheme}:// holds "
            "savepoint checkpoints, runs and snapshot histories); pass a local path",
            path=text,
            scheme=scheme,
        )
    if protocol is not None and _has_fsspec() and _fsspec_knows(protocol):
        _fsspec_location(text, scheme, protocol, what)  # raises, saying why
    if scheme in _OBJECT_SCHEMES:
        needs = (
            f"its backend comes with the `savepoint[{extra}]` extra (pip install "
            f"'savepoint[{extra}]'), which this installation does not have"
        )
    elif not _has_fsspec():
        needs = (
            "other schemes are read through fsspec with the `savepoint[fsspec]` extra (pip "
            "install 'savepoint[fsspec]'), which this installation does not have"
        )
    else:
        needs = "fsspec, which savepoint reads other schemes through, knows no such filesystem"
    if extra and scheme not in _OBJECT_SCHEMES:
        needs += f" (or use az://container/... with the `savepoint[{extra}]` extra)"
    raise UnsupportedStorageError(
        f"{what} {text!r}: savepoint has no backend for {scheme}:// URLs here; {needs}. For now "
        "pass a local path, or mount the bucket (s3fs, gcsfs, blobfuse2, ...) and pass a path "
        "inside the mount; memory:// URLs work everywhere.",
        path=text,
        scheme=scheme,
    )
