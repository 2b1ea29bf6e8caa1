"""The in-memory store: ``memory://`` URLs, and the reference backend of the contract tests.

It behaves like a POSIX filesystem in every way the layers above rely on: directories are nodes,
a rename moves a node atomically, a pinned directory keeps its node (so a reader holds its
generation while a writer replaces the path), a deleted blob stays readable through a reader
that opened it, and committed blobs are immutable ``bytes``. One lock serialises every change.

``MemoryStore(atomic_rename=False)`` behaves like an object store instead: no rename, no
exchange, no hard links, so every save commits manifest-last (see :mod:`savepoint.commit`); the
contract and commit tests run both ways.

All ``memory://`` URLs of a process share one store (:func:`shared`); ``memory://a/b`` is the
path ``/a/b`` in it. Its contents last as long as the process.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import threading
import time
import weakref
from typing import Any

import numpy as np

from savepoint.errors import CorruptCheckpointError, NotRegularFileError
from savepoint.storage.base import (
    BlobReader,
    Capabilities,
    HardLinks,
    Renames,
    Stat,
    Store,
    ThreadLock,
)

__all__ = ["MemoryStore", "by_number", "shared"]

_ids = itertools.count(1)
_numbers = itertools.count(1)
# Stores made by hand, by number, while they live: their memory+<number>:// URLs resolve to them.
_LIVE: weakref.WeakValueDictionary[int, MemoryStore] = weakref.WeakValueDictionary()


class _Blob:
    __slots__ = ("data", "id", "mtime")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.id = next(_ids)
        self.mtime = time.time()


class _Dir:
    __slots__ = ("alive", "entries", "id", "mtime")

    def __init__(self) -> None:
        self.entries: dict[str, _Dir | _Blob] = {}
        self.id = next(_ids)
        self.mtime = time.time()
        self.alive = True


def _missing(path: str) -> FileNotFoundError:
    return FileNotFoundError(errno.ENOENT, "No such file or directory", path)


class _Reader:
    def __init__(self, name: str, data: bytes, copy_on_write: bool) -> None:
        self.name = name
        self.size = len(data)
        self._data = data
        self._copy = copy_on_write

    def read(self, offset: int, out: Any) -> None:
        dst = memoryview(out).cast("B")
        n = len(dst)
        if offset < 0:
            raise ValueError(f"negative offset {offset} into {self.name}")
        if offset + n > self.size:
            raise EOFError(f"wanted {n} bytes at {offset} of {self.name}, it has {self.size}")
        if n:
            np.frombuffer(dst, dtype=np.uint8)[:] = np.frombuffer(
                self._data, dtype=np.uint8, count=n, offset=offset
            )

    def view(self, start: int, end: int) -> np.ndarray[Any, Any] | None:
        if not 0 <= start <= end <= self.size:
            raise EOFError(f"wanted bytes [{start}, {end}) of {self.name}, it has {self.size}")
        array = np.frombuffer(self._data, dtype=np.uint8)[start:end]
        return array.copy() if self._copy else array

    def close(self) -> None:
        pass


class _Writer:
    """Collects the writes; ``finish`` publishes them as one immutable blob (create-only)."""

    alignment = 1

    def __init__(self, store: MemoryStore, path: str, size: int | None) -> None:
        self._store = store
        self._path = path
        self._size = size
        self._parts: list[bytes] = []
        self._written = 0
        self._state = "open"  # "open", "finished", "aborted"

    def _need_open(self, what: str) -> None:
        if self._state != "open":
            raise ValueError(f"{what} after the writer of {self._path} was {self._state}")

    def write(self, data: memoryview) -> None:
        self._need_open("write")
        self._store._charge(self._written + len(data))
        self._parts.append(bytes(data))
        self._written += len(data)

    def finish(self) -> None:
        self._need_open("finish")
        if self._size is not None and self._written < self._size:
            raise ValueError(
                f"{self._path}: {self._written} bytes written of the {self._size} announced"
            )
        data = b"".join(self._parts)
        if self._size is not None:
            data = data[: self._size]
        self._store._publish(self._path, data, exclusive=True)
        self._parts = []
        self._state = "finished"

    def abort(self) -> None:
        self._parts = []
        if self._state == "finished":
            with contextlib.suppress(OSError):
                self._store.remove(self._path)
        self._state = "aborted"


class _Pinned:
    def __init__(self, store: MemoryStore, path: str, node: _Dir) -> None:
        self.path = path
        self._store = store
        self._node = node

    def __enter__(self) -> _Pinned:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _blob(self, name: str) -> _Blob:
        """The blob ``name`` (a path relative to the pinned directory, which it cannot leave:
        ``..`` resolves to nothing) names."""
        node: _Dir | _Blob | None = self._node
        with self._store._lock:
            for part in name.split("/"):
                if part in ("", "."):
                    continue
                node = node.entries.get(part) if isinstance(node, _Dir) and part != ".." else None
        shown = Store.join(self.path, name)
        if node is None:
            raise _missing(shown)
        if not isinstance(node, _Blob):
            raise NotRegularFileError(shown, self._store.url(shown))
        return node

    def open_blob(self, name: str, *, copy_on_write: bool = False) -> _Reader:
        return _Reader(
            self._store.url(Store.join(self.path, name)), self._blob(name).data, copy_on_write
        )

    def read_small(self, name: str, *, cap: int | None) -> bytes:
        data = self._blob(name).data
        if cap is not None and len(data) > cap:
            shown = self._store.url(Store.join(self.path, name))
            raise CorruptCheckpointError(
                f"{shown} is {len(data)} bytes, over the {cap}-byte cap", path=shown
            )
        return data

    def identity(self) -> Any:
        return self._node.id if self._node.alive else None

    def close(self) -> None:
        pass


class MemoryStore(Renames, HardLinks, Store):
    """Blobs and directories in this process's memory (see the module docstring).

    ``capacity`` (bytes, None: unlimited) makes writes past it fail with ENOSPC, as a full disk
    does."""

    scheme = "memory"

    def __init__(self, *, atomic_rename: bool = True, capacity: int | None = None) -> None:
        self.capabilities = Capabilities(
            atomic_rename=atomic_rename,
            create_only_put=True,
            direct_io=False,
            hard_links=atomic_rename,
            zero_copy=True,
            durable=False,
            locks=False,
        )
        self.capacity = capacity
        self.number = next(_numbers)
        _LIVE[self.number] = self
        self._root = _Dir()
        self._lock = threading.RLock()
        self._locks: dict[str, threading.Lock] = {}

    def url(self, path: str) -> str:
        """``memory://...`` for the shared store; ``memory+<number>://...`` for one made by hand,
        which :func:`savepoint.storage.paths.resolve` finds again while the store lives (a plain
        ``memory://`` URL would name the shared store, another one)."""
        shown = super().url(path)
        if self is _SHARED:
            return shown
        return f"memory+{self.number}" + shown[len(self.scheme) :]

    # -- internals -----------------------------------------------------------------------------

    def _walk(self, path: str) -> tuple[_Dir, str] | None:
        """(the parent directory node, the last name) of ``path``; None if a parent is absent."""
        parts = [p for p in self.abspath(path).split("/") if p]
        node: _Dir | _Blob = self._root
        for part in parts[:-1]:
            if not isinstance(node, _Dir) or part not in node.entries:
                return None
            node = node.entries[part]
        if not isinstance(node, _Dir):
            return None
        return node, (parts[-1] if parts else "")

    def _get(self, path: str) -> _Dir | _Blob | None:
        if self.abspath(path) == "/":
            return self._root
        found = self._walk(path)
        return None if found is None else found[0].entries.get(found[1])

    def _used(self) -> int:
        """Bytes held by the blobs reachable from the root (a hard-linked blob counts once)."""
        seen: set[int] = set()
        total, stack = 0, [self._root]
        while stack:
            for child in stack.pop().entries.values():
                if isinstance(child, _Dir):
                    stack.append(child)
                elif child.id not in seen:
                    seen.add(child.id)
                    total += len(child.data)
        return total

    def _charge(self, pending: int) -> None:
        """ENOSPC if a blob of ``pending`` bytes would not fit (checked at every write, as a
        full disk fails the write that crosses it)."""
        if self.capacity is not None:
            with self._lock:
                if self._used() + pending > self.capacity:
                    raise OSError(errno.ENOSPC, "No space left on device (memory store capacity)")

    def _publish(self, path: str, data: bytes, *, exclusive: bool) -> None:
        with self._lock:
            found = self._walk(path)
            if found is None:
                raise _missing(path)
            parent, name = found
            existing = parent.entries.get(name)
            if existing is not None and (exclusive or isinstance(existing, _Dir)):
                raise FileExistsError(errno.EEXIST, "File exists", path)
            if self.capacity is not None:
                freed = len(existing.data) if isinstance(existing, _Blob) else 0
                if self._used() - freed + len(data) > self.capacity:
                    raise OSError(errno.ENOSPC, "No space left on device (memory store capacity)")
            parent.entries[name] = _Blob(data)

    # -- blobs ---------------------------------------------------------------------------------

    def _parent_pin(self, path: str) -> _Pinned:
        """The pinned parent of blob ``path``; FileNotFoundError also when a parent is a blob,
        as ``open(2)`` says of a path through a non-directory."""
        try:
            return self.pin(self.parent(path))
        except NotADirectoryError:
            raise _missing(path) from None

    def open_blob(self, path: str, *, copy_on_write: bool = False) -> BlobReader:
        with self._parent_pin(path) as pinned:
            return pinned.open_blob(self.basename(path), copy_on_write=copy_on_write)

    def read_small(self, path: str, *, cap: int | None) -> bytes:
        with self._parent_pin(path) as pinned:
            return pinned.read_small(self.basename(path), cap=cap)

    def create_blob(self, path: str, *, size: int | None = None, direct: bool = True) -> _Writer:
        with self._lock:
            found = self._walk(path)
            if found is None:
                raise _missing(path)
            if found[1] in found[0].entries:
                raise FileExistsError(errno.EEXIST, "File exists", path)
        return _Writer(self, self.abspath(path), size)

    def put(self, path: str, data: bytes, *, exclusive: bool = True) -> None:
        self._publish(path, bytes(data), exclusive=exclusive)

    def put_making_dir(self, path: str, data: bytes, *, exclusive: bool = True) -> None:
        """The directories and the blob under the store's lock: one step (a failed put leaves
        no directory it made)."""
        with self._lock:
            made = None
            directory = self.parent(self.abspath(path))
            while self._get(directory) is None and directory != "/":
                made, directory = directory, self.parent(directory)
            self.makedirs(self.parent(path))
            try:
                self.put(path, data, exclusive=exclusive)
            except BaseException:
                if made is not None:
                    self.remove_tree(made)
                raise

    def remove(self, path: str) -> None:
        with self._lock:
            found = self._walk(path)
            node = None if found is None else found[0].entries.get(found[1])
            if node is None or found is None:
                raise _missing(path)
            if isinstance(node, _Dir):
                raise IsADirectoryError(errno.EISDIR, "Is a directory", path)
            del found[0].entries[found[1]]

    # -- directories ---------------------------------------------------------------------------

    def stat(self, path: str) -> Stat | None:
        with self._lock:
            node = self._get(path)
        if node is None:
            return None
        if isinstance(node, _Dir):
            return Stat("dir", 0, node.id, node.mtime)
        return Stat("file", len(node.data), node.id, node.mtime)

    def list(self, path: str) -> list[str]:
        with self._lock:
            node = self._get(path)
            return sorted(node.entries) if isinstance(node, _Dir) else []

    def makedirs(self, path: str) -> None:
        with self._lock:
            node = self._root
            for part in [p for p in self.abspath(path).split("/") if p]:
                child = node.entries.get(part)
                if child is None:
                    child = node.entries[part] = _Dir()
                elif not isinstance(child, _Dir):
                    raise FileExistsError(errno.EEXIST, "File exists (not a directory)", path)
                node = child

    def mkdir(self, path: str) -> None:
        with self._lock:
            found = self._walk(path)
            if found is None:
                raise _missing(path)
            if found[1] in found[0].entries:
                raise FileExistsError(errno.EEXIST, "File exists", path)
            found[0].entries[found[1]] = _Dir()

    def remove_tree(self, path: str) -> None:
        with self._lock:
            found = self._walk(path)
            node = None if found is None else found[0].entries.pop(found[1], None)
        # As on a disk, a directory pinned by a reader empties: names no longer open through it
        # (blobs already open keep their bytes).
        stack = [node] if isinstance(node, _Dir) else []
        while stack:
            d = stack.pop()
            d.alive = False
            stack.extend(c for c in d.entries.values() if isinstance(c, _Dir))
            d.entries = {}

    def sync_dir(self, path: str) -> None:
        """Nothing to make durable; a missing directory is still the caller's error."""
        with self._lock:
            node = self._get(path)
        if not isinstance(node, _Dir):
            raise (
                _missing(path)
                if node is None
                else NotADirectoryError(errno.ENOTDIR, "Not a directory", path)
            )

    def pin(self, path: str) -> _Pinned:
        with self._lock:
            node = self._get(path)
        if node is None:
            raise _missing(path)
        if not isinstance(node, _Dir):
            raise NotADirectoryError(errno.ENOTDIR, "Not a directory", path)
        return _Pinned(self, self.abspath(path), node)

    # -- by capability -------------------------------------------------------------------------

    def _need_rename(self) -> None:
        if not self.capabilities.atomic_rename:
            raise NotImplementedError("this memory store behaves as an object store: no rename")

    def _not_inside(self, src: str, dst: str) -> None:
        """EINVAL, as rename(2) says, when directory ``src`` would move into its own subtree."""
        a, b = self.abspath(src), self.abspath(dst)
        if a != b and (b + "/").startswith(a.rstrip("/") + "/"):
            raise OSError(errno.EINVAL, "Invalid argument (a directory into itself)", dst)

    def rename(self, src: str, dst: str) -> None:
        self._need_rename()
        with self._lock:
            a, b = self._walk(src), self._walk(dst)
            if a is None or a[1] not in a[0].entries:
                raise _missing(src)
            if b is None:
                raise _missing(dst)
            if b[1] in b[0].entries:
                raise FileExistsError(errno.EEXIST, "File exists", dst)
            self._not_inside(src, dst)
            b[0].entries[b[1]] = a[0].entries.pop(a[1])

    def replace(self, src: str, dst: str) -> None:
        self._need_rename()
        with self._lock:
            a, b = self._walk(src), self._walk(dst)
            if a is None or a[1] not in a[0].entries:
                raise _missing(src)
            if b is None:
                raise _missing(dst)
            if isinstance(b[0].entries.get(b[1]), _Dir):
                raise IsADirectoryError(errno.EISDIR, "Is a directory", dst)
            self._not_inside(src, dst)
            b[0].entries[b[1]] = a[0].entries.pop(a[1])

    def exchange(self, a: str, b: str) -> bool:
        if not self.capabilities.atomic_rename:
            return False
        with self._lock:
            x, y = self._walk(a), self._walk(b)
            if x is None or y is None or x[1] not in x[0].entries or y[1] not in y[0].entries:
                raise _missing(a if x is None or x[1] not in x[0].entries else b)
            self._not_inside(a, b)
            self._not_inside(b, a)
            x[0].entries[x[1]], y[0].entries[y[1]] = y[0].entries[y[1]], x[0].entries[x[1]]
        return True

    def link(self, src: str, dst: str) -> None:
        if not self.capabilities.hard_links:
            raise NotImplementedError("this memory store has no hard links")
        with self._lock:
            node = self._get(src)
            if not isinstance(node, _Blob):
                raise (
                    _missing(src)
                    if node is None
                    else IsADirectoryError(errno.EISDIR, "Is a directory", src)
                )
            found = self._walk(dst)
            if found is None:
                raise _missing(dst)
            if found[1] in found[0].entries:
                raise FileExistsError(errno.EEXIST, "File exists", dst)
            found[0].entries[found[1]] = node

    def lock(self, path: str) -> ThreadLock:
        with self._lock:
            lock = self._locks.setdefault(self.abspath(path), threading.Lock())
        return ThreadLock(lock)


_SHARED: MemoryStore | None = None
_SHARED_LOCK = threading.Lock()


def shared() -> MemoryStore:
    """The store behind every ``memory://`` URL of this process."""
    global _SHARED
    with _SHARED_LOCK:
        if _SHARED is None:
            _SHARED = MemoryStore()
        return _SHARED


def by_number(number: int) -> MemoryStore | None:
    """The live store made by hand with this ``number`` (its ``memory+<number>://`` URLs), or
    None once it is gone."""
    return _LIVE.get(number)
