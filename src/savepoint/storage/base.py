"""The storage protocol: the one way every layer above puts bytes somewhere and gets them back.

A :class:`Store` is a namespace of blobs (files, objects) and directories (prefixes) addressed by
``/``-separated absolute paths in the store's own namespace (``/tmp/run/step-1`` on the local
filesystem, ``/bucket/run/step-1`` in memory). Nothing above ``storage/`` calls ``os.open``,
``mmap`` or ``fsync``: it asks a store, and chooses its strategy from the store's
:class:`Capabilities`.

Writing a blob, in this order::

    w = store.create_blob(path, size=n)   # exclusive: the blob must not exist
    w.write(view); w.write(view); ...     # sequential; fastest when every view but the last
                                          # starts and ends on ``w.alignment`` bytes
    w.finish()                            # durable when it returns (fsync on local disks)
    # or, on any failure: w.abort()       # nothing remains at ``path``; never raises

``write`` takes the view synchronously: the caller may reuse the buffer when it returns (the
engine overlaps copying with writing by calling ``write`` from its own writer thread). A final
write may be padded up to ``alignment`` with zeros: ``finish`` cuts the blob back to ``size``.

Reading a blob::

    r = store.open_blob(path)             # FileNotFoundError passes through; refusals are
                                          # CheckpointErrors (a symlink, a FIFO, EACCES)
    r.size                                # bytes, from the open blob (not a second lookup)
    r.read(offset, out)                   # fill ``out`` (a writable uint8 buffer) exactly
    r.view(start, end)                    # a zero-copy uint8 array where the backend has one
    r.close()

A checkpoint directory is read through a :class:`Pinned` directory (``store.pin(path)``): names
opened through it resolve inside that very directory even if ``path`` is renamed, replaced or
deleted meanwhile (a directory descriptor on local disks, the directory node in memory), so a
reader never mixes two generations of a checkpoint (see :mod:`savepoint.engine.read`).

Directories: ``makedirs``, ``mkdir`` (exclusive), ``list`` (child names; ``[]`` when absent),
``stat``, ``remove`` (a blob), ``remove_tree``, ``sync_dir`` (make entries durable). Where
``capabilities.atomic_rename``: ``rename`` (the destination must not exist) and ``exchange``
(swap two directories in one step; False where the filesystem cannot). Where
``capabilities.hard_links``: ``link`` shares a committed blob's bytes under a second name.
``put`` writes a small blob in one call: ``exclusive=True`` is a create-only put (FileExistsError
if it exists), atomic where ``capabilities.create_only_put``; ``exclusive=False`` replaces the blob
atomically (readers see the old bytes or the new ones, never a mixture).

Errors: FileNotFoundError where the protocol says it passes through; other OSErrors (ENOSPC, EIO,
EROFS, ...) propagate with their errno for the layer above to word; the read side's refusals are
CheckpointErrors naming the path.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np

if TYPE_CHECKING:
    from savepoint.storage.paths import Location

__all__ = [
    "BlobReader",
    "BlobWriter",
    "Capabilities",
    "Pinned",
    "Stat",
    "Store",
]

Kind = Literal["file", "dir", "link", "other"]


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do; the layers above pick their strategy from these flags.

    ``atomic_rename``: a directory can be renamed (and exchanged) atomically, so a save commits
    by renaming a synced temporary into place. Without it a save commits manifest-last: data
    under a prefix unique to the attempt, the manifest put last and create-only.
    ``create_only_put``: ``put(exclusive=True)`` is atomic against concurrent creators.
    ``direct_io``: writers bypass the page cache when handed aligned buffers.
    ``hard_links``: ``link`` shares bytes; run aliases (latest, best) cost no space.
    ``zero_copy``: ``BlobReader.view`` returns views of the stored bytes (mmap, memory).
    ``durable``: bytes survive the process (False for the in-memory store).
    ``locks``: ``lock`` excludes other processes, not only other threads of this one.
    """

    atomic_rename: bool
    create_only_put: bool
    direct_io: bool
    hard_links: bool
    zero_copy: bool
    durable: bool
    locks: bool


@dataclass(frozen=True)
class Stat:
    kind: Kind
    size: int
    identity: Any  # equal for the same directory or blob (device and inode, a node's id)
    mtime: float


class BlobReader(Protocol):
    """An open blob. ``name`` is how messages show it."""

    name: str
    size: int

    def read(self, offset: int, out: Any) -> None:
        """Fill ``out`` (a writable uint8 buffer) with the bytes at ``offset``; EOFError when
        the blob ends first."""
        ...

    def view(self, start: int, end: int) -> np.ndarray[Any, Any] | None:
        """A zero-copy read-only (or, opened ``copy_on_write``, private writable) uint8 array of
        ``[start, end)``, valid until the reader is closed (a copy-on-write view outlives it);
        None where the backend has none (read into a buffer instead)."""
        ...

    def close(self) -> None: ...


class BlobWriter(Protocol):
    """A blob being written; see the module docstring for the call order."""

    alignment: int  # 4096 with O_DIRECT, 1 where any buffer is as fast as any other

    def write(self, data: memoryview) -> None: ...

    def finish(self) -> None: ...

    def abort(self) -> None: ...


class Pinned(Protocol):
    """One directory, pinned: names resolve inside it whatever happens to its path later."""

    path: str

    def open_blob(self, name: str, *, copy_on_write: bool = False) -> BlobReader: ...

    def read_small(self, name: str, *, cap: int | None) -> bytes: ...

    def identity(self) -> Any:
        """The directory's identity (compare with ``Store.stat(path).identity``); None once it
        has been deleted."""
        ...

    def close(self) -> None: ...


class Store(abc.ABC):
    """A backend. Subclasses implement every abstract method; see the module docstring."""

    scheme: str  # "file", "memory", ...
    capabilities: Capabilities

    # -- paths ---------------------------------------------------------------------------------

    @staticmethod
    def join(path: str, *names: str) -> str:
        return "/".join([path.rstrip("/") or "", *names]) if names else path

    @staticmethod
    def parent(path: str) -> str:
        head = path.rstrip("/").rsplit("/", 1)[0]
        return head or "/"

    @staticmethod
    def basename(path: str) -> str:
        return path.rstrip("/").rsplit("/", 1)[-1]

    def abspath(self, path: str) -> str:
        """``path`` made absolute (relative paths are relative to the working directory on the
        local filesystem and to ``/`` elsewhere) and normalised."""
        import posixpath

        return posixpath.normpath("/" + path.lstrip("/"))

    def realpath(self, path: str) -> str:
        """``path`` with symlinks resolved (the identity where the backend has none)."""
        return path

    def url(self, path: str) -> str:
        """How messages and reports show ``path`` (a plain path for the local filesystem)."""
        return f"{self.scheme}://{path.lstrip('/')}"

    def at(self, path: str) -> Location:
        """``path`` in this store, as an argument any savepoint function takes."""
        from savepoint.storage.paths import Location

        return Location(self, self.abspath(path))

    # -- blobs ---------------------------------------------------------------------------------

    @abc.abstractmethod
    def open_blob(self, path: str, *, copy_on_write: bool = False) -> BlobReader: ...

    @abc.abstractmethod
    def create_blob(self, path: str, *, size: int | None = None, direct: bool = True) -> BlobWriter:
        """A writer for a new blob of ``size`` bytes (None: unknown); ``direct=False`` asks for
        buffered writes even where O_DIRECT is possible."""

    def read_small(self, path: str, *, cap: int | None) -> bytes:
        """The whole blob at ``path``; CorruptCheckpointError when it is over ``cap`` bytes
        (checked before anything is read). FileNotFoundError passes through."""
        with self.pin(self.parent(path)) as pinned:
            return pinned.read_small(self.basename(path), cap=cap)

    @abc.abstractmethod
    def put(self, path: str, data: bytes, *, exclusive: bool = True) -> None:
        """Write a small blob durably in one call (see the module docstring)."""

    @abc.abstractmethod
    def remove(self, path: str) -> None:
        """Delete a blob (or a link); FileNotFoundError passes through."""

    # -- directories ---------------------------------------------------------------------------

    @abc.abstractmethod
    def stat(self, path: str) -> Stat | None:
        """What is at ``path`` (a symlink is reported as ``link``, not followed); None if
        nothing is. PermissionError passes through."""

    @abc.abstractmethod
    def list(self, path: str) -> list[str]:
        """Names in the directory ``path``; [] when it does not exist."""

    @abc.abstractmethod
    def makedirs(self, path: str) -> None: ...

    @abc.abstractmethod
    def mkdir(self, path: str) -> None:
        """Create one directory; FileExistsError if something is there."""

    @abc.abstractmethod
    def remove_tree(self, path: str) -> None:
        """Delete a directory and everything in it (a link: just the link); absent is fine."""

    @abc.abstractmethod
    def sync_dir(self, path: str) -> None:
        """Make the entries of directory ``path`` durable (a no-op where that is implied)."""

    @abc.abstractmethod
    def pin(self, path: str) -> PinnedContext:
        """Pin directory ``path``; FileNotFoundError and NotADirectoryError pass through."""

    # -- optional: by capability ---------------------------------------------------------------

    def rename(self, src: str, dst: str) -> None:
        """Atomically move ``src`` to ``dst``, which must not exist (``atomic_rename``)."""
        raise NotImplementedError(f"{self.scheme} storage cannot rename")

    def replace(self, src: str, dst: str) -> None:
        """Atomically move the blob ``src`` over the blob ``dst`` (``atomic_rename``)."""
        raise NotImplementedError(f"{self.scheme} storage cannot rename")

    def exchange(self, a: str, b: str) -> bool:
        """Atomically swap two existing paths; False where this store cannot."""
        return False

    def link(self, src: str, dst: str) -> None:
        """A second name for the committed blob ``src`` (``hard_links``)."""
        raise NotImplementedError(f"{self.scheme} storage has no hard links")

    def lock(self, path: str) -> Lock:
        """An exclusive, non-blocking lock named by ``path`` (a run's writer lock)."""
        raise NotImplementedError(f"{self.scheme} storage has no locks")


class PinnedContext(Pinned, Protocol):
    def __enter__(self) -> PinnedContext: ...

    def __exit__(self, *exc: object) -> None: ...


class Lock(Protocol):
    def acquire(self) -> bool:
        """True if taken; False if another holder has it."""
        ...

    def release(self) -> None: ...


def walk(store: Store, path: str) -> Iterator[str]:
    """Every blob path under directory ``path``, depth first (for copies and tests)."""
    for name in sorted(store.list(path)):
        child = store.join(path, name)
        st = store.stat(child)
        if st is not None and st.kind == "dir":
            yield from walk(store, child)
        elif st is not None:
            yield child
