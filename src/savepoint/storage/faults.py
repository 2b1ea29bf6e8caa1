"""A store that fails on purpose: deterministic faults for the tests of every layer above.

:class:`FaultyStore` wraps any store (``FaultyStore(LocalStore())``, ``FaultyStore(MemoryStore())``)
and implements :class:`~savepoint.storage.base.Store` by passing every call on to it, after
recording the call in :attr:`FaultyStore.calls`. Disarmed it is indistinguishable from the store
it wraps (the contract suite runs against it). Armed, it fails chosen calls::

    store = FaultyStore(MemoryStore())
    store.fail("write", nth=3)                       # the 3rd write from now: OSError(ENOSPC)
    store.fail("finish", code=errno.EIO)             # the next fsync of a blob fails with EIO
    store.fail("sync_dir", path="*/parent", code=errno.EIO)
    store.space(10_000)                              # a disk with 10,000 bytes left
    stall = store.stall("write")                     # the next write blocks ...
    stall.reached.wait(); ...; stall.release()       # ... until released (or its timeout)
    store.crash("rename")                            # the process "dies" at the next rename
    store.crash_after(5)                             # ... or right after the 5th change
    store.hook("open_blob", lambda call: ...)        # run a callback at a chosen call
    sp.save(store.at("/run/ckpt"), state)            # every savepoint path argument takes it

A fault names one call kind or several (:data:`KINDS`), optionally a ``path`` pattern
(:func:`fnmatch.fnmatchcase` against the call's path or its destination: ``"*/manifest.json"``),
and which matching calls it hits: the ``nth`` one counted from when it was armed, and ``times``
in a row from there (None: every one from then on). ``after=False`` (the default) fails the call
before it reaches the inner store, so it has no effect; ``after=True`` lets it take effect first
(the bytes were written, then the fsync failed). The :class:`Fault` handle counts ``fired``.

A crash models a process that dies: it raises :class:`SimulatedCrash`, a ``BaseException`` (so
``except Exception`` handlers do not swallow it) and freezes the store: every later call, through
the store or any reader, writer or pinned directory it handed out, raises SimulatedCrash as well,
so no cleanup that a dead process could not run reaches the inner store. A test then inspects
``store.inner`` as the next process would find it. Exhaustively: run an operation once to learn
its changes (:meth:`FaultyStore.mutations`), then for each ``k`` run it again on a fresh store
with ``crash_after(k)``.

Each :class:`Call` records a kind and a path: for store calls (``put``, ``rename`` ...) the path
argument, the second path as ``dest``; for ``write``, ``finish`` and ``abort`` of a writer and
``read`` and ``view`` of a reader, the blob's path; for ``open_blob`` and ``read_small`` through a
pinned directory, the path joined. ``nbytes`` is what a ``write`` or ``put`` was handed, or
what a ``read`` asked for (with its ``offset``), so a test can count the bytes a load reads.
``views=False`` makes every reader's ``view`` answer None (recorded, never passed on), as an
object store's: the engine then reads everything through ``read``, and every byte read is
counted.
``close`` and ``Pinned.identity`` are not recorded and never fail (closing a descriptor changes
nothing on disk).
"""

from __future__ import annotations

import errno
import fnmatch
import os
import threading
from collections.abc import Callable, Iterable
from typing import Any, Literal, NamedTuple, TypeVar

import numpy as np

from savepoint.storage.base import (
    BlobReader,
    BlobWriter,
    Capabilities,
    HardLinks,
    Lock,
    Locks,
    PinnedContext,
    Renames,
    Stat,
    Store,
)

__all__ = [
    "Call",
    "Fault",
    "FaultyStore",
    "KINDS",
    "MUTATIONS",
    "SimulatedCrash",
    "Stall",
]

#: Every call kind a fault can name.
KINDS = frozenset(
    {
        "abort",
        "create_blob",
        "exchange",
        "finish",
        "link",
        "list",
        "lock",
        "makedirs",
        "mkdir",
        "open_blob",
        "pin",
        "put",
        "read",
        "read_small",
        "remove",
        "remove_tree",
        "rename",
        "replace",
        "stat",
        "sync_dir",
        "view",
        "write",
    }
)

#: The kinds that change what is stored (or make it durable): the points a crash can fall between.
MUTATIONS = frozenset(
    {
        "abort",
        "create_blob",
        "exchange",
        "finish",
        "link",
        "makedirs",
        "mkdir",
        "put",
        "remove",
        "remove_tree",
        "rename",
        "replace",
        "sync_dir",
        "write",
    }
)

_T = TypeVar("_T")


class SimulatedCrash(BaseException):
    """The process "died" here (see the module docstring). A BaseException, as KeyboardInterrupt
    is: cleanup written ``except Exception`` does not run, as it would not after a real crash."""


class Call(NamedTuple):
    """One recorded call: its kind, its path, the second path of a two-path call, the bytes
    handed to a ``write`` or ``put`` or asked for by a ``read``, and a ``read``'s offset."""

    kind: str
    path: str
    dest: str | None = None
    nbytes: int | None = None
    offset: int | None = None


class Fault:
    """An armed fault (returned by :meth:`FaultyStore.fail` and friends); ``fired`` counts the
    calls it hit."""

    def __init__(
        self,
        mode: Literal["fail", "crash", "stall", "space", "hook"],
        kinds: Iterable[str],
        *,
        nth: int = 1,
        times: int | None = 1,
        path: str | None = None,
        after: bool = False,
        code: int = errno.ENOSPC,
    ) -> None:
        self.kinds = frozenset(kinds)
        unknown = self.kinds - KINDS
        if unknown:
            raise ValueError(f"unknown call kinds {sorted(unknown)}; known: {sorted(KINDS)}")
        if nth < 1 or (times is not None and times < 1):
            raise ValueError(f"nth ({nth}) and times ({times}) count from 1")
        self.mode = mode
        self.nth = nth
        self.times = times
        self.path = path
        self.after = after
        self.code = code
        self.seen = 0
        self.fired = 0

    def __repr__(self) -> str:
        return (
            f"Fault({self.mode}, {sorted(self.kinds)}, nth={self.nth}, times={self.times}, "
            f"path={self.path!r}, fired={self.fired})"
        )

    def _matches(self, call: Call) -> bool:
        if call.kind not in self.kinds:
            return False
        if self.path is None:
            return True
        return fnmatch.fnmatchcase(call.path, self.path) or (
            call.dest is not None and fnmatch.fnmatchcase(call.dest, self.path)
        )

    def _hit(self, call: Call) -> bool:
        """Count ``call``; True if this fault fires on it."""
        if not self._matches(call):
            return False
        self.seen += 1
        if self.seen < self.nth or (self.times is not None and self.fired >= self.times):
            return False
        self.fired += 1
        return True

    def _error(self, call: Call) -> OSError:
        return OSError(self.code, f"{os.strerror(self.code)} (injected)", call.path)


_F = TypeVar("_F", bound=Fault)


class Stall(Fault):
    """A stalled call: it blocks until :meth:`release` (or ``timeout`` seconds, then it goes on:
    a slow disk, not a failed one). ``reached`` is set once a call is blocked."""

    def __init__(
        self, kinds: Iterable[str], *, nth: int, times: int | None, path: str | None, timeout: float
    ) -> None:
        super().__init__("stall", kinds, nth=nth, times=times, path=path)
        self.timeout = timeout
        self.reached = threading.Event()
        self.timed_out = False
        self._released = threading.Event()

    def release(self) -> None:
        """Let every call blocked here (and any later one it hits) go on."""
        self._released.set()

    def _block(self) -> None:
        self.reached.set()
        if not self._released.wait(self.timeout):
            self.timed_out = True


class _Hook(Fault):
    """Runs ``action(call)`` at the calls it hits (before or ``after`` they take effect)."""

    def __init__(
        self,
        kinds: Iterable[str],
        action: Callable[[Call], object],
        *,
        nth: int,
        times: int | None,
        path: str | None,
        after: bool,
    ) -> None:
        super().__init__("hook", kinds, nth=nth, times=times, path=path, after=after)
        self.action = action


class _Space(Fault):
    """A disk with ``left`` bytes free for the writes and puts it matches."""

    def __init__(self, left: int, path: str | None) -> None:
        super().__init__("space", {"write", "put"}, times=None, path=path)
        self.left = left


class FaultyStore(Renames, HardLinks, Locks, Store):
    """``inner`` with faults injected on demand (see the module docstring).

    ``exchange=False`` makes ``exchange`` answer False (nothing swapped), as on a filesystem
    without ``renameat2``, so the two-rename replace runs on any machine. ``views=False``: no
    reader has zero-copy views (see the module docstring).
    """

    def __init__(self, inner: Store, *, exchange: bool = True, views: bool = True) -> None:
        self.inner = inner
        self.views = views
        self.scheme = inner.scheme
        self.capabilities: Capabilities = inner.capabilities
        self.calls: list[Call] = []
        self._exchange = exchange
        self._faults: list[Fault] = []
        self._crashed: Call | None = None
        self._lock = threading.Lock()

    # -- arming --------------------------------------------------------------------------------

    def fail(
        self,
        kind: str | Iterable[str],
        *,
        nth: int = 1,
        times: int | None = 1,
        code: int = errno.ENOSPC,
        path: str | None = None,
        after: bool = False,
    ) -> Fault:
        """Make the ``nth`` matching call (and ``times - 1`` more) raise ``OSError(code)``."""
        return self._arm(
            Fault("fail", _kinds(kind), nth=nth, times=times, path=path, after=after, code=code)
        )

    def crash(
        self,
        kind: str | Iterable[str],
        *,
        nth: int = 1,
        path: str | None = None,
        after: bool = False,
    ) -> Fault:
        """Crash at the ``nth`` matching call: before it takes effect, or ``after``."""
        return self._arm(Fault("crash", _kinds(kind), nth=nth, path=path, after=after))

    def crash_after(self, n: int, *, kinds: Iterable[str] = MUTATIONS) -> Fault:
        """Crash right after the ``n``-th call of ``kinds`` from now took effect; ``n=0``:
        before the first one."""
        if n < 0:
            raise ValueError(f"n counts calls, from 0: {n}")
        return self.crash(kinds, nth=max(n, 1), after=n > 0)

    def stall(
        self,
        kind: str | Iterable[str],
        *,
        nth: int = 1,
        times: int | None = 1,
        path: str | None = None,
        timeout: float = 30.0,
    ) -> Stall:
        """Block the ``nth`` matching call until the returned handle is released."""
        stall = Stall(_kinds(kind), nth=nth, times=times, path=path, timeout=timeout)
        self._arm(stall)
        return stall

    def hook(
        self,
        kind: str | Iterable[str],
        action: Callable[[Call], object],
        *,
        nth: int = 1,
        times: int | None = 1,
        path: str | None = None,
        after: bool = False,
    ) -> Fault:
        """Run ``action(call)`` at the ``nth`` matching call (and ``times - 1`` more), before it
        takes effect or ``after``: a phase marker, a concurrent writer that strikes at the
        worst moment, a real ``SIGKILL``. What ``action`` raises, the call raises."""
        return self._arm(_Hook(_kinds(kind), action, nth=nth, times=times, path=path, after=after))

    def space(self, left: int, *, path: str | None = None) -> Fault:
        """Leave ``left`` bytes of room for writes and puts (matching ``path``): the write that
        crosses the limit writes what fits and raises ENOSPC, as a full disk does; a put that
        does not fit raises ENOSPC with no effect; every later one raises ENOSPC."""
        return self._arm(_Space(left, path))

    def disarm(self) -> None:
        """Remove every armed fault (a crash that happened stays: the store remains frozen)."""
        with self._lock:
            self._faults.clear()

    def _arm(self, fault: _F) -> _F:
        with self._lock:
            self._faults.append(fault)
        return fault

    @property
    def crashed(self) -> Call | None:
        """The call at which the simulated crash happened; None while alive."""
        return self._crashed

    def mutations(self) -> list[Call]:
        """The recorded calls that changed the store (kinds in :data:`MUTATIONS`)."""
        with self._lock:
            return [c for c in self.calls if c.kind in MUTATIONS]

    # -- the one path every call takes ---------------------------------------------------------

    def _alive(self) -> None:
        if self._crashed is not None:
            raise SimulatedCrash(f"the process crashed at {self._crashed}; nothing runs after")

    def _call(
        self,
        kind: str,
        path: str,
        action: Callable[[], _T],
        dest: str | None = None,
        nbytes: int | None = None,
        offset: int | None = None,
    ) -> _T:
        call = Call(kind, path, dest, nbytes, offset)
        with self._lock:
            self._alive()
            self.calls.append(call)
            hits = [f for f in self._faults if not isinstance(f, _Space) and f._hit(call)]
        for stall in hits:
            if isinstance(stall, Stall):
                stall._block()
        with self._lock:
            self._alive()
        for fault in hits:
            if not fault.after:
                self._fire(fault, call)
        try:
            result = action()
        except BaseException:
            for fault in hits:
                if fault.after:
                    self._fire(fault, call)
            raise
        for fault in hits:
            if fault.after:
                self._fire(fault, call)
        return result

    def _fire(self, fault: Fault, call: Call) -> None:
        """Make ``fault`` happen at ``call``: raise (a failure, a crash) or run its hook."""
        if isinstance(fault, _Hook):
            fault.action(call)
        elif fault.mode == "crash":
            with self._lock:
                self._crashed = call
            raise SimulatedCrash(f"simulated crash at {call}")
        elif fault.mode == "fail":
            raise fault._error(call)

    def _spend(self, call: Call, size: int, *, partial: bool) -> int:
        """How many of ``size`` bytes fit under the space faults that match ``call`` (with
        ``partial=False``: all of them or none), taken from their room."""
        with self._lock:
            spaces = [f for f in self._faults if isinstance(f, _Space) and f._matches(call)]
            fit = min([size, *(f.left for f in spaces)])
            if fit < size and not partial:
                fit = 0
            for fault in spaces:
                fault.left -= fit
                if fit < size:
                    fault.fired += 1
        return fit

    def _no_space(self, path: str) -> OSError:
        return OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (injected)", path)

    # -- paths: the inner store's ----------------------------------------------------------------

    def abspath(self, path: str) -> str:
        return self.inner.abspath(path)

    def realpath(self, path: str) -> str:
        return self.inner.realpath(path)

    def url(self, path: str) -> str:
        return self.inner.url(path)

    def join(self, path: str, *names: str) -> str:  # type: ignore[override]
        return self.inner.join(path, *names)

    def parent(self, path: str) -> str:  # type: ignore[override]
        return self.inner.parent(path)

    def basename(self, path: str) -> str:  # type: ignore[override]
        return self.inner.basename(path)

    # -- blobs ---------------------------------------------------------------------------------

    def open_blob(self, path: str, *, copy_on_write: bool = False) -> BlobReader:
        reader = self._call(
            "open_blob", path, lambda: self.inner.open_blob(path, copy_on_write=copy_on_write)
        )
        return _Reader(self, reader, path)

    def create_blob(self, path: str, *, size: int | None = None, direct: bool = True) -> BlobWriter:
        writer = self._call(
            "create_blob", path, lambda: self.inner.create_blob(path, size=size, direct=direct)
        )
        return _Writer(self, writer, path)

    def read_small(self, path: str, *, cap: int | None) -> bytes:
        return self._call("read_small", path, lambda: self.inner.read_small(path, cap=cap))

    def put(self, path: str, data: bytes, *, exclusive: bool = True) -> None:
        def put() -> None:
            if self._spend(Call("put", path), len(data), partial=False) < len(data):
                raise self._no_space(path)
            self.inner.put(path, data, exclusive=exclusive)

        self._call("put", path, put, nbytes=len(data))

    def put_making_dir(self, path: str, data: bytes, *, exclusive: bool = True) -> None:
        """One call, as the inner store makes it (one step where it can): recorded as a put."""

        def put() -> None:
            if self._spend(Call("put", path), len(data), partial=False) < len(data):
                raise self._no_space(path)
            self.inner.put_making_dir(path, data, exclusive=exclusive)

        self._call("put", path, put, nbytes=len(data))

    def remove(self, path: str) -> None:
        self._call("remove", path, lambda: self.inner.remove(path))

    # -- directories ---------------------------------------------------------------------------

    def stat(self, path: str) -> Stat | None:
        return self._call("stat", path, lambda: self.inner.stat(path))

    def list(self, path: str) -> list[str]:
        return self._call("list", path, lambda: self.inner.list(path))

    def makedirs(self, path: str) -> None:
        self._call("makedirs", path, lambda: self.inner.makedirs(path))

    def mkdir(self, path: str) -> None:
        self._call("mkdir", path, lambda: self.inner.mkdir(path))

    def remove_tree(self, path: str) -> None:
        self._call("remove_tree", path, lambda: self.inner.remove_tree(path))

    def sync_dir(self, path: str) -> None:
        self._call("sync_dir", path, lambda: self.inner.sync_dir(path))

    def pin(self, path: str) -> _Pinned:
        return _Pinned(self, self._call("pin", path, lambda: self.inner.pin(path)), path)

    # -- by capability -------------------------------------------------------------------------

    def rename(self, src: str, dst: str) -> None:
        self._call("rename", src, lambda: self.inner.rename(src, dst), dst)

    def replace(self, src: str, dst: str) -> None:
        self._call("replace", src, lambda: self.inner.replace(src, dst), dst)

    def exchange(self, a: str, b: str) -> bool:
        return self._call("exchange", a, lambda: self._exchange and self.inner.exchange(a, b), b)

    def link(self, src: str, dst: str) -> None:
        self._call("link", src, lambda: self.inner.link(src, dst), dst)

    def lock(self, path: str) -> Lock:
        return _Lock(self, self._call("lock", path, lambda: self.inner.lock(path)))


def _kinds(kind: str | Iterable[str]) -> frozenset[str]:
    return frozenset({kind} if isinstance(kind, str) else kind)


class _Reader:
    def __init__(self, store: FaultyStore, inner: BlobReader, path: str) -> None:
        self.name = inner.name
        self.size = inner.size
        self._store = store
        self._inner = inner
        self._path = path

    def read(self, offset: int, out: Any) -> None:
        nbytes = memoryview(out).nbytes
        self._store._call(
            "read", self._path, lambda: self._inner.read(offset, out), nbytes=nbytes, offset=offset
        )

    def view(self, start: int, end: int) -> np.ndarray[Any, Any] | None:
        if not self._store.views:
            return self._store._call("view", self._path, lambda: None)
        return self._store._call("view", self._path, lambda: self._inner.view(start, end))

    def close(self) -> None:
        self._inner.close()


class _Writer:
    def __init__(self, store: FaultyStore, inner: BlobWriter, path: str) -> None:
        self.alignment = inner.alignment
        self._store = store
        self._inner = inner
        self._path = path

    def write(self, data: memoryview) -> None:
        def write() -> None:
            fit = self._store._spend(Call("write", self._path), len(data), partial=True)
            if fit < len(data):
                if fit:
                    self._inner.write(data[:fit])
                raise self._store._no_space(self._path)
            self._inner.write(data)

        self._store._call("write", self._path, write, nbytes=len(data))

    def finish(self) -> None:
        self._store._call("finish", self._path, self._inner.finish)

    def abort(self) -> None:
        self._store._call("abort", self._path, self._inner.abort)


class _Pinned:
    def __init__(self, store: FaultyStore, inner: PinnedContext, path: str) -> None:
        self.path = path
        self._store = store
        self._inner = inner

    def __enter__(self) -> _Pinned:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def open_blob(self, name: str, *, copy_on_write: bool = False) -> BlobReader:
        path = self._store.join(self.path, name)
        reader = self._store._call(
            "open_blob", path, lambda: self._inner.open_blob(name, copy_on_write=copy_on_write)
        )
        return _Reader(self._store, reader, path)

    def read_small(self, name: str, *, cap: int | None) -> bytes:
        path = self._store.join(self.path, name)
        data: bytes = self._store._call(
            "read_small", path, lambda: self._inner.read_small(name, cap=cap)
        )
        return data

    def identity(self) -> Any:
        with self._store._lock:
            self._store._alive()
        return self._inner.identity()

    def close(self) -> None:
        self._inner.close()


class _Lock:
    def __init__(self, store: FaultyStore, inner: Lock) -> None:
        self._store = store
        self._inner = inner

    def acquire(self) -> bool:
        with self._store._lock:
            self._store._alive()
        return self._inner.acquire()

    def release(self) -> None:
        with self._store._lock:
            self._store._alive()
        self._inner.release()
