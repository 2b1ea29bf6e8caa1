"""A backend of the required core alone, in a dict: the example of ``docs/storage.md``.

:class:`DictStore` implements the ten abstract methods of :class:`savepoint.storage.base.Store`
and nothing else: ``pin`` (by path), ``read_small``, ``put_making_dir`` and ``lock`` (a lease
object, since ``put(exclusive=True)`` is create-only here) are the protocol's defaults. It claims
no optional capability, so a save commits to it manifest-last, as to an object store. The
contract suite runs on it (``dict`` and ``faulty-dict`` in ``_backends``).
"""

from __future__ import annotations

import errno
import itertools
import threading
import time
from typing import Any

import numpy as np

from savepoint.errors import NotRegularFileError
from savepoint.storage.base import Capabilities, Stat, Store

_ids = itertools.count(1)


class _Entry:
    """A blob (``data``) or a directory (``data`` None)."""

    def __init__(self, data: bytes | None) -> None:
        self.data = data
        self.id = next(_ids)
        self.mtime = time.time()


def _missing(path: str) -> FileNotFoundError:
    return FileNotFoundError(errno.ENOENT, "No such file or directory", path)


class _Reader:
    def __init__(self, name: str, data: bytes) -> None:
        self.name, self.size, self._data = name, len(data), data

    def read(self, offset: int, out: Any) -> None:
        dst = memoryview(out).cast("B")
        if offset < 0:
            raise ValueError(f"negative offset {offset} into {self.name}")
        if offset + len(dst) > self.size:
            raise EOFError(f"wanted {len(dst)} bytes at {offset} of {self.name} ({self.size})")
        dst[:] = self._data[offset : offset + len(dst)]

    def view(self, start: int, end: int) -> np.ndarray[Any, Any] | None:
        return None  # zero_copy=False: callers read into their buffers

    def close(self) -> None:
        pass


class _Writer:
    alignment = 1

    def __init__(self, store: DictStore, path: str, size: int | None) -> None:
        self._store, self._path, self._size = store, path, size
        self._parts: list[bytes] = []
        self._state = "open"

    def write(self, data: memoryview) -> None:
        if self._state != "open":
            raise ValueError(f"write after the writer of {self._path} was {self._state}")
        self._parts.append(bytes(data))

    def finish(self) -> None:
        if self._state != "open":
            raise ValueError(f"finish after the writer of {self._path} was {self._state}")
        data = b"".join(self._parts)
        if self._size is not None:
            if len(data) < self._size:
                raise ValueError(f"{self._path}: {len(data)} bytes written of the {self._size}")
            data = data[: self._size]
        self._store.put(self._path, data, exclusive=True)  # a second writer fails here
        self._state = "finished"

    def abort(self) -> None:
        if self._state == "finished":
            self._store.remove(self._path)
        self._parts, self._state = [], "aborted"


class DictStore(Store):
    """Blobs and directories as entries of one dict, keyed by absolute path."""

    scheme = "dict"
    capabilities = Capabilities(
        atomic_rename=False,
        create_only_put=True,
        direct_io=False,
        hard_links=False,
        zero_copy=False,
        durable=False,
        locks=False,
    )

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {"/": _Entry(None)}
        self._lock = threading.Lock()

    def _parent(self, path: str) -> None:
        """FileNotFoundError unless ``path``'s parent is a directory (call under the lock)."""
        parent = self._entries.get(self.parent(path))
        if parent is None or parent.data is not None:
            raise _missing(path)

    # -- the required core ---------------------------------------------------------------------

    def open_blob(self, path: str, *, copy_on_write: bool = False) -> _Reader:
        p = self.abspath(path)
        entry = self._entries.get(p)
        if entry is None:
            raise _missing(p)
        if entry.data is None:
            raise NotRegularFileError(p, self.url(p))
        return _Reader(self.url(p), entry.data)

    def create_blob(self, path: str, *, size: int | None = None, direct: bool = True) -> _Writer:
        p = self.abspath(path)
        with self._lock:
            self._parent(p)
            if p in self._entries:
                raise FileExistsError(errno.EEXIST, "File exists", p)
        return _Writer(self, p, size)

    def put(self, path: str, data: bytes, *, exclusive: bool = True) -> None:
        p = self.abspath(path)
        with self._lock:
            self._parent(p)
            entry = self._entries.get(p)
            if entry is not None and entry.data is None:
                raise IsADirectoryError(errno.EISDIR, "Is a directory", p)
            if entry is not None and exclusive:
                raise FileExistsError(errno.EEXIST, "File exists", p)
            self._entries[p] = _Entry(bytes(data))

    def remove(self, path: str) -> None:
        p = self.abspath(path)
        with self._lock:
            entry = self._entries.get(p)
            if entry is None:
                raise _missing(p)
            if entry.data is None:
                raise IsADirectoryError(errno.EISDIR, "Is a directory", p)
            del self._entries[p]

    def stat(self, path: str) -> Stat | None:
        entry = self._entries.get(self.abspath(path))
        if entry is None:
            return None
        kind = "dir" if entry.data is None else "file"
        return Stat(kind, len(entry.data or b""), entry.id, entry.mtime)

    def list(self, path: str) -> list[str]:
        prefix = self.abspath(path).rstrip("/") + "/"
        with self._lock:
            keys = list(self._entries)
        return sorted(
            k[len(prefix) :]
            for k in keys
            if k.startswith(prefix) and k != prefix and "/" not in k[len(prefix) :]
        )

    def makedirs(self, path: str) -> None:
        parts = [p for p in self.abspath(path).split("/") if p]
        with self._lock:
            for n in range(1, len(parts) + 1):
                p = "/" + "/".join(parts[:n])
                entry = self._entries.setdefault(p, _Entry(None))
                if entry.data is not None:
                    raise FileExistsError(errno.EEXIST, "File exists", p)

    def mkdir(self, path: str) -> None:
        p = self.abspath(path)
        with self._lock:
            self._parent(p)
            if p in self._entries:
                raise FileExistsError(errno.EEXIST, "File exists", p)
            self._entries[p] = _Entry(None)

    def remove_tree(self, path: str) -> None:
        p = self.abspath(path)
        with self._lock:
            for key in [k for k in self._entries if k == p or k.startswith(p.rstrip("/") + "/")]:
                if key != "/":
                    del self._entries[key]

    def sync_dir(self, path: str) -> None:
        entry = self._entries.get(self.abspath(path))
        if entry is None:
            raise _missing(path)
        if entry.data is not None:
            raise NotADirectoryError(errno.ENOTDIR, "Not a directory", path)
