"""The storage protocol: the one way every layer above puts bytes somewhere and gets them back.

A :class:`Store` is a namespace of blobs (files, objects) and directories (prefixes) addressed by
``/``-separated absolute paths in the store's own namespace (``/tmp/run/step-1`` on the local
filesystem, ``/bucket/run/step-1`` in memory). No layer above ``storage/`` opens, maps or syncs a
checkpoint's files itself: it asks a store, and chooses its strategy from the store's
:class:`Capabilities`. (The foreign formats of ``formats/`` are local files by definition and
do their own file I/O; anonymous memory maps for staging buffers are not files.)

The contract has two parts (``docs/storage.md`` walks a backend author through it):

- **the required core**, what every backend implements: the ten abstract methods of
  :class:`Store` (``open_blob``, ``create_blob``, ``put``, ``remove``, ``stat``, ``list``,
  ``makedirs``, ``mkdir``, ``remove_tree``, ``sync_dir``), a ``scheme`` and its
  ``capabilities``. Everything else has a default built on the core: ``read_small``,
  ``put_making_dir``, ``pin`` (by path, as object stores pin), ``lock`` (a lease object where
  ``put`` is create-only) and the path helpers. A store of the core alone is a manifest-last
  store, as an object store is (``tests/storage/_dictstore.py`` is one, in 200 lines);
- **optional capabilities**, each a small mixin tied to its flag in :data:`CAPABILITIES`, the one
  table that says which methods a flag promises: :class:`Renames` (``atomic_rename``: ``rename``,
  ``replace``, ``exchange``, and a ``pin`` by handle), :class:`HardLinks` (``hard_links``:
  ``link``), :class:`Locks` (``locks``: a ``lock`` that excludes other processes). The other flags
  (``create_only_put``, ``direct_io``, ``zero_copy``, ``durable``) qualify core methods and need
  none. A backend class that fixes its ``capabilities`` in its body is checked when the class is
  created: a flag claimed without its mixin, a mixin without its flag, or a capability's method
  defined outside its mixin is a TypeError there. A backend whose flags are chosen per instance
  (the memory store's object-store mode, the fault injector, an fsspec filesystem) is checked by
  :func:`capability_problems`, which the contract suite (``tests/storage/test_contract.py``) runs
  on every backend; such an instance refuses the methods of a flag it does not claim
  (NotImplementedError; ``exchange`` answers False), as :class:`Store`'s own defaults do.
  Callers check the flag before they call the optional methods (``if
  store.capabilities.atomic_rename: store.rename(...)``), so :class:`Store` keeps those refusing
  defaults and every store can be typed as one ``Store``.

What was taken from peers: DCP's ``StorageWriter``/``StorageReader`` document the order in which
a backend is called, numbered, in the class itself (here: :class:`Store`'s docstring); fsspec's
``AbstractFileSystem`` derives most of its surface from a few primitives (``read_small``,
``put_making_dir``, ``pin`` and ``lock`` are derived here), but leaves its optional methods as
``NotImplementedError`` found at call time, which is what the capability table replaces;
obspec/obstore split the protocol into one small protocol per operation (``Put``, ``Rename``,
``Copy``, ...) that consumers compose, which is the shape of the mixins, kept nominal here
(a mixin, not a structural protocol) so that a flag and its methods are checked together at
class creation; etils' ``epath`` registers backends by scheme, as
:mod:`savepoint.storage.paths` does.

Writing a blob, in this order::

    w = store.create_blob(path, size=n)   # exclusive: the blob must not exist (FileExistsError);
                                          # the parent directory must (FileNotFoundError)
    w.write(view); w.write(view); ...     # sequential; fastest when every view but the last
                                          # starts and ends on ``w.alignment`` bytes
    w.finish()                            # the bytes are durable and whole at ``path``
    # or, on any failure (finish's own included): w.abort()   # nothing remains; never raises

``write`` takes the view synchronously: the caller may reuse the buffer when it returns (the
engine overlaps copying with writing by calling ``write`` from its own writer thread). The last
write may be padded with zeros up to ``alignment`` (or any multiple of it): ``finish`` cuts the
blob back to ``size``; fewer than ``size`` bytes written is a caller's bug that ``finish``
refuses with ValueError. A partly written blob may be visible at ``path`` before ``finish``
(local files) or not (memory, object stores); a second writer of the same path fails, at
``create_blob`` or at the latest at its ``finish``. After ``finish`` or ``abort`` the writer
takes no more calls (ValueError), except ``abort`` (a no-op after ``abort``; after a successful
``finish`` it deletes the blob).

Reading a blob::

    r = store.open_blob(path)             # FileNotFoundError passes through (also for a path
                                          # through a non-directory); refusals are
                                          # CheckpointErrors (a symlink, a FIFO, EACCES)
    r.size                                # bytes, from the open blob (not a second lookup)
    r.read(offset, out)                   # fill ``out`` (a writable contiguous buffer) exactly;
                                          # EOFError when the blob ends first
    r.view(start, end)                    # a zero-copy uint8 array where ``zero_copy``, else None
    r.close()

A reader keeps serving the bytes it opened after ``path`` is replaced or deleted. Committed blobs
are never modified in place, so a reader never sees a mixture.

A checkpoint directory is read through a :class:`Pinned` directory (``store.pin(path)``): names
opened through it resolve inside that very directory even if ``path`` is renamed or replaced
meanwhile (a directory descriptor on local disks, the directory node in memory), so a reader
never mixes two generations of a checkpoint (see :mod:`savepoint.engine.read`). Once the
directory itself is deleted its ``identity()`` is None and names no longer open (blobs already
open stay readable). A store without renames never replaces a directory (a save commits a new
generation beside the old one), so its directories are pinned by path (:class:`PrefixPin`, the
default ``pin``); a :class:`Renames` store must pin by handle.

Directories: ``makedirs``, ``mkdir`` (exclusive), ``list`` (child names, sorted; ``[]`` when
absent), ``stat``, ``remove`` (a blob), ``remove_tree``, ``sync_dir`` (make entries durable).
Where ``capabilities.atomic_rename``: ``rename`` (the destination must not exist), ``replace``
(a blob over a blob) and ``exchange`` (swap two directories in one step; False where the
filesystem cannot). Where ``capabilities.hard_links``: ``link`` shares a committed blob's bytes
under a second name (it may still raise OSError where one filesystem has none: EXDEV, EPERM;
callers copy then). ``put`` writes a small blob in one call: ``exclusive=True`` is a create-only
put (FileExistsError if it exists; atomic against concurrent creators and readers where
``capabilities.create_only_put``); ``exclusive=False`` replaces the blob atomically (readers see
the old bytes or the new ones, never a mixture). A failed ``put`` leaves the previous state.
``put_making_dir`` is ``makedirs`` of the blob's directory, then ``put``: in one step where the
store can (object stores, memory), so that a new directory is never seen empty.

Durability: ``finish`` and ``put`` make a blob's bytes durable; its name, like every new,
renamed or removed entry, is durable once ``sync_dir`` of its directory returns.

Errors: FileNotFoundError where the protocol says it passes through; other OSErrors (ENOSPC, EIO,
EROFS, ...) propagate with their errno for the layer above to word; the read side's refusals are
CheckpointErrors naming the path.
"""

from __future__ import annotations

import abc
import errno
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np

from savepoint import errors_map
from savepoint.errors import CheckpointError, CorruptCheckpointError

if TYPE_CHECKING:
    from savepoint.storage.paths import Location

__all__ = [
    "BlobReader",
    "BlobWriter",
    "CAPABILITIES",
    "Capabilities",
    "Capability",
    "HardLinks",
    "Kind",
    "Lock",
    "Locks",
    "Pinned",
    "PinnedContext",
    "PrefixPin",
    "Renames",
    "Stat",
    "Store",
    "ThreadLock",
    "capability_problems",
    "pin_prefix",
    "read_error",
    "walk",
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
    """What is at a path: ``kind``; ``size`` in bytes (meaningful for a ``file``); ``identity``,
    equal for the same directory or blob (device and inode, a node's id; hard links share it);
    ``mtime`` in seconds since the epoch; ``special`` names what an ``other`` is where the
    backend can tell (a local FIFO, socket or device), for messages."""

    kind: Kind
    size: int
    identity: Any
    mtime: float
    special: str = ""  # for kind "other", where the backend can tell: "FIFO", "socket", "device"


class BlobReader(Protocol):
    """An open blob. ``name`` is how messages show it."""

    name: str
    size: int

    def read(self, offset: int, out: Any) -> None:
        """Fill ``out`` (a writable C-contiguous buffer, taken as bytes) with the bytes at
        ``offset``; EOFError when the blob ends first (nothing is promised about ``out`` then),
        ValueError for a negative offset."""
        ...

    def view(self, start: int, end: int) -> np.ndarray[Any, Any] | None:
        """A zero-copy read-only (or, opened ``copy_on_write``, private writable) uint8 array of
        ``[start, end)``, valid until the reader is closed (a copy-on-write view outlives it);
        None where the backend has none (read into a buffer instead). EOFError unless
        ``0 <= start <= end <= size``."""
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
    """A backend: the required core (see the module docstring for each call's promises).

    A subclass sets ``scheme`` and ``capabilities`` and implements the ten abstract methods.
    The layers above call them in these orders (a store of the core alone is a manifest-last
    store; a :class:`Renames` store commits by rename instead, steps 3 to 5 of a save then
    being ``sync_dir``, ``rename`` or ``exchange``, ``sync_dir`` of the parent):

    A save (:class:`savepoint.commit.transaction.Transaction`):

    1. ``stat(target)``, ``list(target)``: what is there (nothing, an empty directory, a
       checkpoint); ``makedirs(target)``, then ``mkdir(staging)``, the attempt's own directory;
    2. per data file: ``create_blob(staging/name, size=n)``, ``write`` ..., ``finish`` (or
       ``abort``); small files: ``put(path, data, exclusive=True)``;
    3. ``sync_dir(staging)``;
    4. ``put(staging/manifest.json, data, exclusive=True)``: the commit point;
    5. ``sync_dir(staging)``; then ``list``, ``remove_tree`` of older generations.
       Failure at any step: ``remove_tree(staging)``.

    A load (:mod:`savepoint.engine.read`):

    1. ``stat(path)``, ``list(path)``: the newest committed generation;
    2. ``pin(generation)``; through it ``read_small("manifest.json", cap=...)``, then
       ``open_blob(name)`` per data file: ``size``, ``read(offset, out)`` or ``view``,
       ``close``; ``close`` the pin.

    Runs and retention: ``lock(run/.writer.lock)`` (by default a lease: ``put`` exclusive,
    ``read_small``, ``remove``), ``put`` (``exclusive=False``) of the run's books, ``list``,
    ``stat``, ``remove_tree`` and ``remove`` of old checkpoints.
    """

    scheme: str  # "file", "memory", ...
    capabilities: Capabilities

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _check_class(cls)

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
        """How messages and reports show ``path`` (a plain path for the local filesystem).

        :func:`savepoint.storage.paths.resolve` of the URL names ``path`` again: ``%``, ``?``
        and ``#`` are percent-escaped, everything else is shown as it is."""
        escaped = path.lstrip("/").replace("%", "%25").replace("?", "%3F").replace("#", "%23")
        return f"{self.scheme}://{escaped}"

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
        (checked before anything is read). FileNotFoundError passes through. By default
        ``open_blob``, ``read``, ``close``."""
        reader = self.open_blob(path)
        try:
            if cap is not None and reader.size > cap:
                shown = self.url(path)
                raise CorruptCheckpointError(
                    f"{shown} is {reader.size} bytes, over the {cap}-byte cap", path=shown
                )
            out = bytearray(reader.size)
            reader.read(0, out)
            return bytes(out)
        finally:
            reader.close()

    @abc.abstractmethod
    def put(self, path: str, data: bytes, *, exclusive: bool = True) -> None:
        """Write a small blob durably in one call (see the module docstring)."""

    def put_making_dir(self, path: str, data: bytes, *, exclusive: bool = True) -> None:
        """:meth:`put`, making the blob's directory (and its missing parents) first where it is
        missing: ``makedirs`` of the parent, then ``put``. A store that can do both in one step
        overrides this so that nobody ever sees the new directory without the blob (an object
        store puts the object alone: it makes its prefix exist; the in-memory store creates both
        under its lock). Where the store cannot (a filesystem through fsspec), a process that dies
        between the two leaves an empty directory."""
        self.makedirs(self.parent(path))
        self.put(path, data, exclusive=exclusive)

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
        """Names in the directory ``path``, sorted; [] when it does not exist."""

    @abc.abstractmethod
    def makedirs(self, path: str) -> None:
        """Create directory ``path`` and its missing parents; an existing directory is fine,
        anything else there is FileExistsError."""

    @abc.abstractmethod
    def mkdir(self, path: str) -> None:
        """Create one directory; FileExistsError if something is there."""

    @abc.abstractmethod
    def remove_tree(self, path: str) -> None:
        """Delete a directory and everything in it (a link: just the link); absent is fine."""

    @abc.abstractmethod
    def sync_dir(self, path: str) -> None:
        """Make the entries of directory ``path`` durable (a no-op where that is implied)."""

    def pin(self, path: str) -> PinnedContext:
        """Pin directory ``path``; FileNotFoundError and NotADirectoryError pass through. By
        default by path (:func:`pin_prefix`: right for a store without renames, whose directories
        are never replaced); a :class:`Renames` store pins by handle."""
        return pin_prefix(self, path, self._is_directory)

    def _is_directory(self, path: str) -> bool:
        st = self.stat(path)
        return st is not None and st.kind == "dir"

    # -- optional: the refusals of a capability not claimed (see CAPABILITIES) -----------------

    def rename(self, src: str, dst: str) -> None:
        """Atomically move ``src`` (a blob or a directory) to ``dst``, which must not exist
        (FileExistsError; ``atomic_rename``). A missing ``src`` is FileNotFoundError; a
        directory moved into itself is OSError(EINVAL)."""
        raise NotImplementedError(f"{self.scheme} storage cannot rename")

    def replace(self, src: str, dst: str) -> None:
        """Atomically move the blob ``src`` over the blob ``dst`` (``atomic_rename``)."""
        raise NotImplementedError(f"{self.scheme} storage cannot rename")

    def exchange(self, a: str, b: str) -> bool:
        """Atomically swap two existing paths (FileNotFoundError if one is missing); False,
        with nothing changed, where this store or filesystem cannot."""
        return False

    def link(self, src: str, dst: str) -> None:
        """A second name for the committed blob ``src`` (``hard_links``)."""
        raise NotImplementedError(f"{self.scheme} storage has no hard links")

    def lock(self, path: str) -> Lock:
        """An exclusive, non-blocking lock named by ``path`` (a run's writer lock). By default,
        where the store can put create-only, a lease object at ``path``
        (:class:`savepoint.storage.lease.LeaseLock`)."""
        if self.capabilities.create_only_put:
            from savepoint.storage.lease import LeaseLock

            return LeaseLock(self, path)
        raise NotImplementedError(f"{self.scheme} storage has no locks")


# -- optional capabilities -------------------------------------------------------------------


class Renames(abc.ABC):
    """``atomic_rename``: directories and blobs renamed atomically, so a save commits by renaming
    a synced staging directory into place. The store pins directories by handle (a renamed or
    replaced path must not change what a pinned reader sees)."""

    @abc.abstractmethod
    def rename(self, src: str, dst: str) -> None:
        """Atomically move ``src`` (a blob or a directory) to ``dst``, which must not exist
        (FileExistsError). A missing ``src`` is FileNotFoundError; a directory moved into
        itself is OSError(EINVAL)."""

    @abc.abstractmethod
    def replace(self, src: str, dst: str) -> None:
        """Atomically move the blob ``src`` over the blob ``dst``."""

    @abc.abstractmethod
    def exchange(self, a: str, b: str) -> bool:
        """Atomically swap two existing paths (FileNotFoundError if one is missing); False,
        with nothing changed, where this filesystem cannot (the caller then renames twice)."""

    @abc.abstractmethod
    def pin(self, path: str) -> PinnedContext:
        """Pin directory ``path`` by handle (see the module docstring)."""


class HardLinks(abc.ABC):
    """``hard_links``: a committed blob's bytes shared under a second name (run aliases that
    cost no space)."""

    @abc.abstractmethod
    def link(self, src: str, dst: str) -> None:
        """A second name ``dst`` (which must not exist) for the committed blob ``src``; OSError
        (EXDEV, EPERM) where this one filesystem has none: callers copy then."""


class Locks(abc.ABC):
    """``locks``: :meth:`Store.lock` excludes other processes, not only this process's threads
    (every store has a ``lock``; this says whose holders it excludes)."""

    @abc.abstractmethod
    def lock(self, path: str) -> Lock:
        """An exclusive, non-blocking lock named by ``path``, excluding other processes."""


@dataclass(frozen=True)
class Capability:
    """One row of :data:`CAPABILITIES`: the flag, its mixin, and the methods the mixin adds.
    ``own``: those methods exist for this capability alone, so a backend defining one without
    the mixin is refused (``lock`` is every store's: a store without ``locks`` has an
    in-process lock or a lease)."""

    flag: str
    mixin: type
    methods: tuple[str, ...]
    own: bool = True


CAPABILITIES: tuple[Capability, ...] = (
    Capability("atomic_rename", Renames, ("rename", "replace", "exchange")),
    Capability("hard_links", HardLinks, ("link",)),
    Capability("locks", Locks, ("lock",), own=False),
)
"""The one place each capability flag is tied to its methods (see the module docstring)."""


def _check_class(cls: type[Store]) -> None:
    """TypeError when backend class ``cls`` defines a capability's method outside its mixin
    or, where its body fixes ``capabilities``, claims a flag without the mixin or has a mixin
    without the flag."""
    fixed = cls.__dict__.get("capabilities")
    for cap in CAPABILITIES:
        has = issubclass(cls, cap.mixin)
        if cap.own and not has:
            for name in cap.methods:
                owner = next(k for k in cls.__mro__ if name in k.__dict__)
                if owner is not Store:
                    raise TypeError(
                        f"{cls.__qualname__} defines {name}() but is not a {cap.mixin.__name__}: "
                        f"derive it from savepoint.storage.base.{cap.mixin.__name__} and claim "
                        f"{cap.flag}, or drop {name}()"
                    )
        if isinstance(fixed, Capabilities) and getattr(fixed, cap.flag) != has:
            raise TypeError(
                f"{cls.__qualname__} says {cap.flag}={getattr(fixed, cap.flag)} but "
                + (f"is not a {cap.mixin.__name__}" if not has else f"is a {cap.mixin.__name__}")
                + f" ({', '.join(cap.methods)}): the flag and the mixin go together"
            )


def capability_problems(store: Store) -> list[str]:
    """What is wrong with ``store``'s capability flags, as sentences (none: nothing): a flag
    claimed by an instance whose class lacks the capability's mixin. (A class that has the
    mixin may still refuse it per instance, as the flag says; the contract suite calls the
    methods to check that they do.)"""
    problems = []
    for cap in CAPABILITIES:
        if getattr(store.capabilities, cap.flag) and not isinstance(store, cap.mixin):
            problems.append(
                f"{type(store).__qualname__} claims {cap.flag} but is not a "
                f"{cap.mixin.__name__} ({', '.join(cap.methods)})"
            )
    return problems


class PinnedContext(Pinned, Protocol):
    """A :class:`Pinned` directory that closes when its ``with`` block ends."""

    def __enter__(self) -> PinnedContext: ...

    def __exit__(self, *exc: object) -> None: ...


class Lock(Protocol):
    """An exclusive lock (``Store.lock``): ``acquire`` never blocks."""

    def acquire(self) -> bool:
        """True if taken; False if another holder has it."""
        ...

    def release(self) -> None: ...


class PrefixPin:
    """The :class:`Pinned` of a store without directory handles (object stores, fsspec
    filesystems): under the manifest-last layout a generation is never rewritten, so its path
    is as stable as a handle would be. ``identity()`` is None once ``alive()`` says the
    directory is gone; names with ``..`` (or none) are FileNotFoundError, never a way out."""

    def __init__(self, store: Store, path: str, identity: Any, alive: Callable[[], bool]) -> None:
        self.path = path
        self._store = store
        self._identity = identity
        self._alive = alive

    def __enter__(self) -> PrefixPin:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _path(self, name: str) -> str:
        parts = [p for p in name.split("/") if p not in ("", ".")]
        if ".." in parts or not parts:
            shown = self._store.url(Store.join(self.path, name))
            raise FileNotFoundError(errno.ENOENT, "No such blob in the directory", shown)
        return Store.join(self.path, *parts)

    def open_blob(self, name: str, *, copy_on_write: bool = False) -> BlobReader:
        return self._store.open_blob(self._path(name))

    def read_small(self, name: str, *, cap: int | None) -> bytes:
        return self._store.read_small(self._path(name), cap=cap)

    def identity(self) -> Any:
        return self._identity if self._alive() else None

    def close(self) -> None:
        pass


def pin_prefix(store: Store, path: str, alive: Callable[[str], bool]) -> PrefixPin:
    """``store.pin(path)`` for a store without directory handles: the directory must exist;
    ``alive(path)`` later says whether it still does."""
    st = store.stat(path)
    if st is None:
        raise FileNotFoundError(errno.ENOENT, "No such directory", store.url(path))
    if st.kind != "dir":
        raise NotADirectoryError(errno.ENOTDIR, "Not a directory", store.url(path))
    where = store.abspath(path)
    return PrefixPin(store, where, st.identity, lambda: alive(where))


class ThreadLock:
    """A :class:`Lock` that excludes the threads of this process only (stores that live in one
    process, or filesystems without locks)."""

    def __init__(self, lock: threading.Lock) -> None:
        self._lock = lock

    def acquire(self) -> bool:
        return self._lock.acquire(blocking=False)

    def release(self) -> None:
        self._lock.release()


def walk(store: Store, path: str) -> Iterator[str]:
    """Every blob path under directory ``path``, depth first (for copies and tests)."""
    for name in sorted(store.list(path)):
        child = store.join(path, name)
        st = store.stat(child)
        if st is not None and st.kind == "dir":
            yield from walk(store, child)
        elif st is not None:
            yield child


def read_error(shown: str, exc: OSError) -> CheckpointError:
    """The error to raise for ``exc``, which a store raised while ``shown`` was read or looked
    at (``stat`` and ``list`` let a refusal pass through, and a store other than the local one
    may say any failure raw): ``exc`` itself when it is a CheckpointError already;
    CheckpointPermissionError for a refusal (EACCES, EPERM, an object store's 403); a
    CheckpointError naming ``shown`` and the cause for any other failure."""
    return errors_map.read_error(exc, shown)
