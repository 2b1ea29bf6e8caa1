"""Any filesystem fsspec knows (hdfs://, sftp://, ftp://, abfs://, webdav://, ...), through fsspec.

Install with ``pip install 'savepoint[fsspec]'`` plus the package of the filesystem's fsspec
implementation (``paramiko`` for sftp, ``adlfs`` for abfs, ``pyarrow`` for hdfs, ``webdav4`` for
webdav, ...). ``import savepoint`` never imports fsspec; this module does, when a URL of such a
scheme is first resolved (:mod:`savepoint.storage.paths`) or a store is made by hand:
``FsspecStore(fs).at("/run")`` wraps any ``fsspec.AbstractFileSystem``, and
``FsspecStore.from_url(url, **storage_options)`` goes through ``fsspec.core.url_to_fs``.
``s3://``, ``gs://`` and ``az://`` stay on obstore (:mod:`savepoint.storage.objectstore`),
``memory://`` and local paths on savepoint's own backends; ``fsspec+<protocol>://...`` names
fsspec's filesystem of any protocol explicitly (``fsspec+gs://bucket/run`` through gcsfs).

Namespace: the store's paths are ``/``-rooted (``ftp://host/data/run`` is the path ``/data/run``
of the store for that host; ``abfs://container/run`` is ``/container/run``); the filesystem's own
path is its root marker followed by the path.

Directories: where the filesystem has real directories (local, sftp, ftp, hdfs, fsspec's memory
filesystem) ``mkdir`` makes one; where it has none (object stores: a "directory" exists while
something lies under its prefix) ``mkdir`` also puts an empty marker object,
``<dir>/.savepoint-dir``, as :mod:`savepoint.storage.objectstore` does, so that an empty
directory exists; ``list`` never shows the marker, and ``remove_tree`` deletes it last.

Capabilities, decided per filesystem:

- ``atomic_rename``: False for every filesystem, fsspec's local one included. fsspec's ``mv`` is a
  copy and a delete on object stores and not atomic on most remote filesystems, and even where it
  is a ``rename(2)`` fsspec has no directory handle to pin a generation with. Saves therefore
  commit manifest-last (data under a generation prefix unique to the attempt, the manifest last,
  :mod:`savepoint.commit`); a local path keeps using :class:`~savepoint.storage.local.LocalStore`
  (directory descriptors, renameat2, O_DIRECT, mmap, flock), which fsspec cannot offer.
- ``create_only_put``: True only for fsspec's LocalFileSystem, where ``put(exclusive=True)``
  writes a synced temporary and hard-links it into place (``link(2)`` fails with EEXIST: atomic
  against concurrent creators and readers). Everywhere else False: an exclusive ``put`` checks
  that nothing is there, then writes (through ``pipe_file(mode="create")``, which is atomic where
  the implementation makes it so, and a plain write where it does not). Two writers racing on one
  checkpoint path could then both believe they committed; a single writer is safe, since the
  manifest is still written last (no manifest, no checkpoint). A :class:`WeakCreateWarning`
  (a UserWarning) says so once per filesystem, at its first write.
- ``hard_links``, ``zero_copy``, ``direct_io``, ``locks``: False (run aliases are pointer objects;
  reads copy into the caller's buffer; ``lock`` is an in-process lock, so a run's writer lock
  excludes a second writer in this process only, as on the in-memory store).
- ``durable``: True, except for fsspec's in-memory filesystem. On the local filesystem ``finish``
  and ``put`` fsync the file and ``sync_dir`` the directory; elsewhere a closed file is as
  durable as the filesystem makes it, and ``sync_dir`` only checks the directory exists.

Writing: ``create_blob`` refuses an existing path (FileExistsError), then opens the file
(``"xb"`` where the implementation takes it, which is O_EXCL on the local filesystem; else
``"wb"``). The check and the open are two steps, so on a filesystem without ``"xb"`` a second
writer that creates the path between them is not refused at ``create_blob``; where the file only
appears when it is closed (object stores), ``finish`` checks again before closing. Data blobs
always go to a generation prefix unique to the attempt, so the commit does not depend on this.
``abort`` discards the upload (or closes the file) and deletes what this writer created.
``put(exclusive=False)`` replaces atomically on the local filesystem (a synced temporary and
``os.replace``) and on object stores (one PUT); on file-like remote filesystems (ftp, sftp, hdfs)
fsspec writes in place, so a reader racing such a replace may see a partial blob (savepoint
replaces only small documents this way: a run's pointer aliases, ``run.json``).

Reading: ``open_blob`` opens the file once; a blob of at most ``prefetch`` bytes (1 MiB), and any
blob of the in-memory filesystem, is read whole at once and served from memory, so it stays
readable after it is replaced or deleted; a larger one is read through its open handle (one
handle per reader, reads serialised), which keeps the bytes it opened on the local filesystem
and on sftp; on object stores a larger blob replaced while open may be read from its new version
(savepoint never replaces a committed data blob: every save writes a new generation).

Errors: FileNotFoundError, FileExistsError and other OSErrors of the implementation pass
through; any other exception of the implementation (ftplib's, paramiko's, an HTTP client's)
becomes an OSError (EIO) naming the path and the cause; an operation the filesystem does not
implement is OSError(EROFS).
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import uuid
import warnings
import weakref
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import fsspec
import numpy as np
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem
from fsspec.spec import AbstractBufferedFile, AbstractFileSystem

from savepoint.errors import CorruptCheckpointError, NotRegularFileError
from savepoint.storage.base import (
    Capabilities,
    PrefixPin,
    Stat,
    Store,
    ThreadLock,
    pin_prefix,
    read_error,
)

if TYPE_CHECKING:
    from savepoint.storage.paths import Location

__all__ = ["FsspecStore", "MARKER", "OWN_SCHEMES", "WeakCreateWarning", "shared"]

MiB = 1024 * 1024
MARKER = ".savepoint-dir"  # the object that makes an empty directory exist (no real directories)
# Protocols savepoint serves with a backend of its own: fsspec's filesystems of these protocols
# are named ``fsspec+<protocol>://`` so that their URLs never resolve to savepoint's backend.
OWN_SCHEMES = frozenset({"file", "local", "memory", "s3", "s3a", "gs", "gcs", "az"})

T = TypeVar("T")


class WeakCreateWarning(UserWarning):
    """A filesystem without an atomic create-only write is used for saving (see the module
    docstring): filter it (``warnings.filterwarnings("ignore", category=WeakCreateWarning)``)
    where one writer per checkpoint path is assured."""


# The filesystems already warned about (weakly: a filesystem object may go away).
_WARNED: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
_WARNED_IDS: set[int] = set()  # for filesystems that take no weak reference
_WARN_LOCK = threading.Lock()


def _protocol_of(fs: AbstractFileSystem) -> str:
    proto = fs.protocol
    return str(proto if isinstance(proto, str) else proto[0])


class FsspecStore(Store):
    """A :class:`Store` over an ``fsspec.AbstractFileSystem`` (see the module docstring).

    ``fs``: the filesystem, or None with ``protocol`` (and ``storage_options``): the filesystem
    ``fsspec.filesystem(protocol, **storage_options)`` is made at first use, so that making the
    store connects nowhere. ``url_base``: how :meth:`url` starts (``"ftp://host/"``; by default
    ``"<scheme>://"``). ``prefetch``: blobs up to this size are read whole when opened.
    """

    def __init__(
        self,
        fs: AbstractFileSystem | None = None,
        *,
        protocol: str | None = None,
        storage_options: Mapping[str, Any] | None = None,
        url_base: str | None = None,
        prefetch: int = 1 * MiB,
    ) -> None:
        if fs is None and protocol is None:
            raise ValueError("FsspecStore takes a filesystem, or the protocol to make one")
        if fs is not None and not isinstance(fs, AbstractFileSystem):
            raise TypeError(f"FsspecStore takes an fsspec filesystem, not {type(fs).__name__}")
        self._fs = fs
        self._options = dict(storage_options or {})
        cls = type(fs) if fs is not None else fsspec.get_filesystem_class(protocol)
        self.protocol = _protocol_of(fs) if fs is not None else str(protocol)
        self.scheme = f"fsspec+{self.protocol}" if self.protocol in OWN_SCHEMES else self.protocol
        self._local = issubclass(cls, LocalFileSystem)
        self._in_memory = issubclass(cls, MemoryFileSystem)
        self._root_marker = str(getattr(cls, "root_marker", ""))
        self.capabilities = Capabilities(
            atomic_rename=False,
            create_only_put=self._local,
            direct_io=False,
            hard_links=False,
            zero_copy=False,
            durable=not self._in_memory,
            locks=False,
        )
        self._url_base = url_base
        self.prefetch = max(0, prefetch)
        self._lock = threading.Lock()

    @classmethod
    def from_url(cls, url: str, **storage_options: Any) -> Location:
        """The :class:`~savepoint.storage.paths.Location` that ``url`` names, through
        ``fsspec.core.url_to_fs(url, **storage_options)`` (the filesystem is made now)."""
        fs, fs_path = fsspec.core.url_to_fs(url, **storage_options)
        store = cls(fs)
        return store.at("/" + str(fs_path).strip("/"))

    # -- internals -----------------------------------------------------------------------------

    @property
    def fs(self) -> AbstractFileSystem:
        """The filesystem (made now if the store was made from a protocol)."""
        if self._fs is None:
            with self._lock:
                if self._fs is None:
                    try:
                        self._fs = self._call(
                            "connecting to", "/", fsspec.filesystem, self.protocol, **self._options
                        )
                    except OSError as exc:
                        shown = self.url("/")
                        raise OSError(
                            exc.errno or errno.EIO, f"connecting to {shown} failed: {exc}", shown
                        ) from exc
        return self._fs

    def url(self, path: str) -> str:
        if self._url_base is None:
            return super().url(path)
        escaped = path.lstrip("/").replace("%", "%25").replace("?", "%3F").replace("#", "%23")
        return self._url_base + escaped

    def _p(self, path: str) -> str:
        """The filesystem's own path for ``path``."""
        rest = self.abspath(path).lstrip("/")
        return self._root_marker + rest if rest else (self._root_marker or "")

    def _call(self, what: str, path: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)``, with the implementation's own exceptions made OSErrors."""
        try:
            return fn(*args, **kwargs)
        except OSError:
            raise
        except NotImplementedError as exc:
            shown = self.url(path)
            raise OSError(
                errno.EROFS, f"{what} {shown}: the {self.protocol} filesystem cannot", shown
            ) from exc
        except Exception as exc:
            shown = self.url(path)
            cause = str(exc).strip().splitlines()[0][:400] if str(exc).strip() else ""
            raise OSError(
                errno.EIO, f"{what} {shown} failed: {type(exc).__name__}: {cause}", shown
            ) from exc

    def _fresh(self, fs_path: str) -> None:
        """Forget what the filesystem cached about ``fs_path`` (listing caches of remote
        filesystems): another process may have changed it."""
        with contextlib.suppress(Exception):
            self.fs.invalidate_cache(fs_path)

    def _info(self, path: str) -> dict[str, Any] | None:
        """The filesystem's info of ``path``; None when nothing is there (also for a path
        through a blob)."""
        p = self._p(path)
        fs = self.fs
        self._fresh(p)
        try:
            return dict(self._call("stat of", path, fs.info, p))
        except (FileNotFoundError, NotADirectoryError):
            return None

    def _is_dir(self, path: str) -> bool:
        if self.abspath(path) == "/":
            return True
        info = self._info(path)
        return info is not None and info.get("type") == "directory"

    def _need_parent(self, path: str) -> None:
        if not self._is_dir(self.parent(self.abspath(path))):
            raise FileNotFoundError(errno.ENOENT, "No such directory", self.url(path))

    def _warn_once(self) -> None:
        """The WeakCreateWarning, once per filesystem, where ``create_only_put`` is False."""
        if self.capabilities.create_only_put:
            return
        fs = self.fs
        with _WARN_LOCK:
            try:
                if _WARNED.get(fs):
                    return
                _WARNED[fs] = True
            except TypeError:  # not weakly referenceable
                if id(fs) in _WARNED_IDS:
                    return
                _WARNED_IDS.add(id(fs))
        warnings.warn(
            f"savepoint: the {self.protocol} filesystem (through fsspec) has no atomic "
            "create-only write, so a checkpoint's manifest is written after checking that none "
            "is there: two writers racing on one checkpoint path could both believe they "
            "committed. A single writer per path is safe (the manifest is still written last: "
            "no manifest, no checkpoint).",
            WeakCreateWarning,
            stacklevel=3,
        )

    def _read_whole(self, path: str, cap: int | None) -> bytes:
        """Every byte of the blob at ``path`` (at most ``cap``: CorruptCheckpointError past
        it, before reading where the size is known)."""
        shown = self.url(path)
        info = self._info(path)
        if info is None:
            raise FileNotFoundError(errno.ENOENT, "No such file", shown)
        if info.get("type") != "file":
            raise NotRegularFileError(path, shown)
        if cap is not None and int(info.get("size") or 0) > cap:
            raise CorruptCheckpointError(
                f"{shown} is {info.get('size')} bytes, over the {cap}-byte cap", path=shown
            )
        f = self._open_read(path)
        try:
            data = self._slurp(path, f, cap)
        finally:
            with contextlib.suppress(Exception):
                f.close()
        if cap is not None and len(data) > cap:
            raise CorruptCheckpointError(
                f"{shown} is over the {cap}-byte cap", path=shown
            )  # it grew since its size was looked up
        return data

    def _open_read(self, path: str) -> Any:
        fs = self.fs
        try:
            return self._call("open of", path, fs.open, self._p(path), "rb")
        except (IsADirectoryError, PermissionError) as exc:
            if isinstance(exc, IsADirectoryError):
                raise NotRegularFileError(path, self.url(path)) from None
            raise read_error(self.url(path), exc) from None  # refusals are CheckpointErrors
        except NotADirectoryError:
            raise FileNotFoundError(errno.ENOENT, "No such file", self.url(path)) from None

    def _slurp(self, path: str, f: Any, cap: int | None) -> bytes:
        getvalue = getattr(f, "getvalue", None)
        if callable(getvalue):  # an in-memory file (shared by every reader: no seek and read)
            return bytes(getvalue())
        return bytes(self._call("read of", path, f.read, -1 if cap is None else cap + 1))

    # -- blobs ---------------------------------------------------------------------------------

    def open_blob(self, path: str, *, copy_on_write: bool = False) -> _Reader:
        shown = self.url(path)
        info = self._info(path)
        if info is None:
            raise FileNotFoundError(errno.ENOENT, "No such file", shown)
        if info.get("type") != "file":
            raise NotRegularFileError(path, shown)
        f = self._open_read(path)
        try:
            if callable(getattr(f, "getvalue", None)) or self._in_memory:
                data = self._slurp(path, f, None)
                return _Reader(self, path, shown, len(data), data, None)
            size = int(self._call("seek in", path, f.seek, 0, 2))
            if size <= self.prefetch:
                self._call("seek in", path, f.seek, 0)
                data = self._slurp(path, f, None)
                if len(data) != size:
                    raise CorruptCheckpointError(
                        f"{shown} changed while it was opened (size {size}, read {len(data)})",
                        path=shown,
                    )
                return _Reader(self, path, shown, size, data, None)
        except BaseException:
            with contextlib.suppress(Exception):
                f.close()
            raise
        return _Reader(self, path, shown, size, None, f)

    def read_small(self, path: str, *, cap: int | None) -> bytes:
        return self._read_whole(path, cap)

    def create_blob(self, path: str, *, size: int | None = None, direct: bool = True) -> _Writer:
        shown = self.url(path)
        if self.abspath(path) == "/":
            raise IsADirectoryError(errno.EISDIR, "Is a directory", shown)
        self._warn_once()
        self._need_parent(path)
        info = self._info(path)
        if info is not None:
            if info.get("type") == "directory":
                raise IsADirectoryError(errno.EISDIR, "Is a directory", shown)
            raise FileExistsError(errno.EEXIST, "File exists", shown)
        fs, p = self.fs, self._p(path)

        def open_new() -> Any:
            try:
                return fs.open(p, "xb")  # O_EXCL on the local filesystem
            except (ValueError, NotImplementedError):
                return fs.open(p, "wb")  # no "xb" in this implementation: checked above

        try:
            f = self._call("create of", path, open_new)
        except FileExistsError:
            raise FileExistsError(errno.EEXIST, "File exists", shown) from None
        # Where the file is there before it is closed (local, memory, sftp), it is this
        # writer's; where it appears at close (object stores), finish checks again.
        visible = self._info(path) is not None
        return _Writer(self, path, p, f, size, visible)

    def put(self, path: str, data: bytes, *, exclusive: bool = True) -> None:
        shown = self.url(path)
        if self.abspath(path) == "/":
            raise IsADirectoryError(errno.EISDIR, "Is a directory", shown)
        self._warn_once()
        self._need_parent(path)
        info = self._info(path)
        if info is not None and info.get("type") == "directory":
            raise IsADirectoryError(errno.EISDIR, "Is a directory", shown)
        data = bytes(data)
        if self._local:
            self._put_local(path, data, exclusive=exclusive)
            return
        fs, p = self.fs, self._p(path)
        if not exclusive:
            self._call("write of", path, fs.pipe_file, p, data)
            return
        if info is not None:
            raise FileExistsError(errno.EEXIST, "File exists", shown)
        try:
            self._call("write of", path, fs.pipe_file, p, data, mode="create")
        except FileExistsError:
            raise FileExistsError(errno.EEXIST, "File exists", shown) from None
        except OSError as exc:
            if not isinstance(exc.__cause__, TypeError):
                raise
            self._call("write of", path, fs.pipe_file, p, data)  # no mode= in this version

    def _put_local(self, path: str, data: bytes, *, exclusive: bool) -> None:
        """A synced temporary beside ``path``, then linked (create-only) or renamed into place."""
        p = self._p(path)
        tmp = os.path.join(
            os.path.dirname(p), f".{os.path.basename(p)}.{uuid.uuid4().hex[:12]}.tmp"
        )
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)
            if exclusive:
                os.link(tmp, p)  # EEXIST: FileExistsError, atomic against every creator
            else:
                os.replace(tmp, p)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        self._sync_local(os.path.dirname(p))

    def _sync_local(self, directory: str) -> None:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def remove(self, path: str) -> None:
        info = self._info(path)
        if info is None:
            raise FileNotFoundError(errno.ENOENT, "No such file", self.url(path))
        if info.get("type") == "directory":
            raise IsADirectoryError(errno.EISDIR, "Is a directory", self.url(path))
        self._call("delete of", path, self.fs.rm_file, self._p(path))

    # -- directories ---------------------------------------------------------------------------

    def stat(self, path: str) -> Stat | None:
        p = self._p(path)
        if self.abspath(path) == "/":
            return Stat("dir", 0, ("dir", self.protocol, p), 0.0)
        info = self._info(path)
        if info is None:
            return None
        kind = info.get("type")
        mtime = _mtime(info)
        if info.get("islink"):
            return Stat("link", int(info.get("size") or 0), ("link", p), mtime)
        if kind == "directory":
            return Stat("dir", 0, ("dir", self.protocol, p), mtime)
        if kind == "file":
            version = tuple(
                str(info[k])
                for k in ("ino", "ETag", "etag", "generation", "VersionId", "version_id")
                if info.get(k) is not None
            )
            identity = ("file", p, int(info.get("size") or 0), mtime, version)
            return Stat("file", int(info.get("size") or 0), identity, mtime)
        return Stat("other", int(info.get("size") or 0), ("other", p), mtime, str(kind or ""))

    def list(self, path: str) -> list[str]:
        p = self._p(path)
        fs = self.fs
        self._fresh(p)
        try:
            entries = self._call("listing of", path, fs.ls, p, detail=True)
        except (FileNotFoundError, NotADirectoryError):
            return []
        names: set[str] = set()
        mine = p.rstrip("/")
        for entry in entries:
            name = str(entry["name"] if isinstance(entry, dict) else entry).rstrip("/")
            if name == mine or not name:  # the path itself: a blob, not a directory
                continue
            names.add(name.rsplit("/", 1)[-1])
        names.discard(MARKER)
        return sorted(names)

    def _mkdir_one(self, path: str) -> None:
        """Make directory ``path`` (its parent exists, nothing is at it)."""
        fs, p = self.fs, self._p(path)
        try:
            self._call("mkdir of", path, fs.mkdir, p, create_parents=False)
        except FileExistsError:
            if self._is_dir(path):
                raise FileExistsError(errno.EEXIST, "File exists", self.url(path)) from None
            raise
        except OSError as exc:
            if exc.errno != errno.EROFS:  # EROFS here: no mkdir at all (the marker below)
                raise
        if not self._is_dir(path):  # no real directories: a marker makes it exist
            marker = self._p(self.join(self.abspath(path), MARKER))
            self._call("mkdir of", path, fs.pipe_file, marker, b"")

    def makedirs(self, path: str) -> None:
        self._warn_once()
        missing: list[str] = []
        current = self.abspath(path)
        while current != "/":
            info = self._info(current)
            if info is not None:
                if info.get("type") != "directory":
                    raise FileExistsError(
                        errno.EEXIST, "File exists (not a directory)", self.url(current)
                    )
                break
            missing.append(current)
            current = self.parent(current)
        for directory in reversed(missing):
            try:
                self._mkdir_one(directory)
            except FileExistsError:
                if not self._is_dir(directory):
                    raise

    def mkdir(self, path: str) -> None:
        shown = self.url(path)
        if self.abspath(path) == "/":
            raise FileExistsError(errno.EEXIST, "File exists", shown)
        self._warn_once()
        self._need_parent(path)
        if self._info(path) is not None:
            raise FileExistsError(errno.EEXIST, "File exists", shown)
        self._mkdir_one(path)

    def remove_tree(self, path: str) -> None:
        info = self._info(path)
        if info is None:
            return
        fs, p = self.fs, self._p(path)
        if info.get("type") != "directory" or info.get("islink"):
            with contextlib.suppress(FileNotFoundError):
                self._call("delete of", path, fs.rm_file, p)
            return
        if not self._local:
            files = [str(f) for f in self._call("listing of", path, fs.find, p)]
            markers = [f for f in files if f.rstrip("/").endswith("/" + MARKER)]
            if markers:
                # The markers last: the directory exists until everything in it is gone.
                for batch in ([f for f in files if f not in markers], markers):
                    if batch:
                        with contextlib.suppress(FileNotFoundError):
                            self._call("delete of", path, fs.rm, batch)
        with contextlib.suppress(FileNotFoundError):
            self._call("delete of", path, fs.rm, p, recursive=True)
        self._fresh(p)

    def sync_dir(self, path: str) -> None:
        """fsync on the local filesystem; elsewhere only a check that the directory exists."""
        info = None if self.abspath(path) == "/" else self._info(path)
        if self.abspath(path) != "/" and (info is None or info.get("type") != "directory"):
            if info is not None:
                raise NotADirectoryError(errno.ENOTDIR, "Not a directory", self.url(path))
            raise FileNotFoundError(errno.ENOENT, "No such directory", self.url(path))
        if self._local:
            self._sync_local(self._p(path))

    def lock(self, path: str) -> ThreadLock:
        """An in-process lock (``locks`` is False: fsspec has no lock another process would
        see), so that two writers of one run in this process exclude each other."""
        fs = self.fs
        key = self._p(path)
        with _LOCKS_LOCK:
            try:
                table = _LOCKS.setdefault(fs, {})
            except TypeError:  # not weakly referenceable
                table = _LOCKS_BY_ID.setdefault(id(fs), {})
            lock = table.setdefault(key, threading.Lock())
        return ThreadLock(lock)

    def pin(self, path: str) -> PrefixPin:
        return pin_prefix(self, path, self._is_dir)


def _mtime(info: Mapping[str, Any]) -> float:
    for key in ("mtime", "LastModified", "last_modified", "modified", "updated", "created"):
        value = info.get(key)
        if value is None:
            continue
        if hasattr(value, "timestamp"):
            return float(value.timestamp())
        with contextlib.suppress(TypeError, ValueError):
            return float(value)
    return 0.0


class _Reader:
    """An open blob: its bytes in memory (small blobs, the in-memory filesystem), or an open
    handle read under a lock."""

    def __init__(
        self, store: FsspecStore, path: str, name: str, size: int, data: bytes | None, f: Any
    ) -> None:
        self.name = name
        self.size = size
        self._store = store
        self._path = path
        self._data = data
        self._f = f
        self._lock = threading.Lock()

    def read(self, offset: int, out: Any) -> None:
        dst = memoryview(out).cast("B")
        n = len(dst)
        if offset < 0:
            raise ValueError(f"negative offset {offset} into {self.name}")
        if offset + n > self.size:
            raise EOFError(f"wanted {n} bytes at {offset} of {self.name}, it has {self.size}")
        if not n:
            return
        if self._data is not None:
            dst[:] = memoryview(self._data)[offset : offset + n]
            return
        with self._lock:
            f = self._f
            if f is None:
                raise ValueError(f"read of {self.name} after it was closed")
            self._store._call("seek in", self._path, f.seek, offset)
            got = 0
            while got < n:
                chunk = self._store._call("read of", self._path, f.read, n - got)
                if not chunk:
                    raise CorruptCheckpointError(
                        f"{self.name} ended at {offset + got} bytes, under the {self.size} it "
                        "had when it was opened (it was changed); load again",
                        path=self.name,
                    )
                dst[got : got + len(chunk)] = chunk
                got += len(chunk)

    def view(self, start: int, end: int) -> np.ndarray[Any, Any] | None:
        if not 0 <= start <= end <= self.size:
            raise EOFError(f"wanted bytes [{start}, {end}) of {self.name}, it has {self.size}")
        return None

    def close(self) -> None:
        with self._lock:
            f, self._f = self._f, None
        if f is not None:
            with contextlib.suppress(Exception):
                f.close()


class _Writer:
    """A blob being written through an open fsspec file; ``finish`` closes (commits) it."""

    alignment = 1

    def __init__(
        self, store: FsspecStore, path: str, fs_path: str, f: Any, size: int | None, visible: bool
    ) -> None:
        self._store = store
        self._path = path
        self._fs_path = fs_path
        self._f = f
        self._size = size
        self._visible = visible  # the file exists before it is closed: it is this writer's
        self._written = 0
        self._state = "open"  # "open", "finished", "aborted"
        self._lock = threading.Lock()

    @property
    def _shown(self) -> str:
        return self._store.url(self._path)

    def _need_open(self, what: str) -> None:
        if self._state != "open":
            raise ValueError(f"{what} after the writer of {self._shown} was {self._state}")

    def write(self, data: memoryview) -> None:
        with self._lock:
            self._need_open("write")
            src = memoryview(data).cast("B")
            if self._size is not None:
                src = src[: max(0, self._size - self._written)]  # padding past the size is cut
            if len(src):
                self._store._call("write of", self._path, self._f.write, src)
                self._written += len(src)

    def finish(self) -> None:
        with self._lock:
            self._need_open("finish")
            if self._size is not None and self._written < self._size:
                raise ValueError(
                    f"{self._shown}: {self._written} bytes written of the {self._size} announced"
                )
            store, f = self._store, self._f
            if not self._visible and store._info(self._path) is not None:
                raise FileExistsError(errno.EEXIST, "File exists", self._shown)
            if store._local:
                store._call("flush of", self._path, f.flush)
                store._call("fsync of", self._path, lambda: os.fsync(f.fileno()))
            store._call("close of", self._path, f.close)
            self._state = "finished"

    def abort(self) -> None:
        with self._lock:
            state, self._state = self._state, "aborted"
            if state == "aborted":
                return
            store, f = self._store, self._f
            if state == "open":
                _discard(f)
            if state == "finished" or self._visible:
                with contextlib.suppress(Exception):
                    store.fs.rm_file(self._fs_path)
                store._fresh(self._fs_path)


def _discard(f: Any) -> None:
    """Throw away an unfinished file without committing it (never raises)."""
    with contextlib.suppress(Exception):
        f.discard()  # an object store's upload: aborted
    if isinstance(f, AbstractBufferedFile):
        with contextlib.suppress(Exception):
            f.closed = True  # closing would upload what is buffered
        return
    with contextlib.suppress(Exception):
        f.close()


_LOCKS: weakref.WeakKeyDictionary[Any, dict[str, threading.Lock]] = weakref.WeakKeyDictionary()
_LOCKS_BY_ID: dict[int, dict[str, threading.Lock]] = {}
_LOCKS_LOCK = threading.Lock()


_SHARED: dict[tuple[str, str, str], FsspecStore] = {}
_SHARED_LOCK = threading.Lock()


def shared(protocol: str, storage_options: Mapping[str, Any], url_base: str) -> FsspecStore:
    """The store behind every URL of ``protocol`` with these options (host, port, user: what the
    URL says; fsspec adds its configuration from the environment, ``FSSPEC_<PROTOCOL>_<KEY>``,
    when it makes the filesystem) in this process. Nothing is connected until the store is used."""
    key = (protocol, url_base, repr(sorted(storage_options.items())))
    with _SHARED_LOCK:
        store = _SHARED.get(key)
        if store is None:
            store = _SHARED[key] = FsspecStore(
                protocol=protocol, storage_options=storage_options, url_base=url_base
            )
        return store
