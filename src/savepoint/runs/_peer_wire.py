"""The peer tier's wire between the ranks of a manager's process group.

Two channels, both savepoint's own, never the training's:

- **documents** (:meth:`Wire.gather`): small JSON documents (what a rank holds, what it needs,
  what it committed) through the job's rendezvous store (the default store of
  ``torch.distributed``, under a prefix of savepoint's), never pickled. Every rank sets its
  document; rank 0 waits for all of them and publishes the list, which every rank reads: one
  write and one read per rank, whatever the world size. A rank counts as not answering once its
  heartbeat (a counter each rank in a session bumps every fraction of ``timeout`` from a thread
  of its own) has not moved for ``timeout`` seconds and its document is still missing: a rank
  that is busy copying is waited for, a dead or frozen one is named. Rank 0 not answering is
  named by the others the same way.
- **bytes** (:meth:`Wire.transfer`): point-to-point ``send``/``recv`` of uint8 tensors on a
  gloo process group made for the tier (``ProcessGroupGloo`` over a prefix of the same store,
  as :mod:`savepoint.distributed.collectives` makes its own), in chunks of at least
  :data:`CHUNK` bytes, a few in flight per file, each file followed by the XXH3-64 the sender
  computed over the bytes it sent (not computed where the receiver knows what to expect: a
  restore checks each file against its copy's marker). Sends run on a thread of their own and receives on the
  caller's, each side in one order every rank derives from the same documents, so no two ranks
  wait on each other. A gloo operation that fails (a peer died: at once; a peer that stops
  answering: after ``timeout``) fails that transfer and names the peer; the group is then not
  trusted any more: every rank drops it once the failure is agreed (:meth:`Wire.reset`) and the
  next session makes a fresh one.

Without a process group (one process) there is nobody to talk to: :meth:`Wire.gather` returns
this rank's document and no bytes travel.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import json
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, Protocol

import numpy as np

from savepoint.codecs import bounded_json, checksum
from savepoint.errors import CorruptCheckpointError

__all__ = ["CHUNK", "Gathered", "Incoming", "Outgoing", "Sink", "Source", "Wire", "chunk_size"]

CHUNK = 16 << 20  # bytes per send at least (files over 4095 chunks get larger ones)
_CHUNKS = 4095  # chunk tags per file (the 4096th is its trailer: the sender's digest)
_WINDOW = 4  # chunks of one file in flight per side
_POLL = 0.02  # seconds between looks at a sending thread that may have stalled

_wires: dict[tuple[int, tuple[int, ...]], int] = {}
_wires_lock = threading.Lock()


@dataclasses.dataclass
class Gathered:
    """Every rank's document of one :meth:`Wire.gather` (None for a rank that did not answer),
    and the ranks that did not answer within the deadline."""

    values: list[Any]
    missing: list[int]


class Source(Protocol):
    """An open file to send: ``chunk(start, end)`` is a uint8 array of those bytes, valid until
    ``close()``."""

    def chunk(self, start: int, end: int) -> np.ndarray[Any, Any]: ...

    def close(self) -> None: ...


@dataclasses.dataclass
class Outgoing:
    """A file of ``size`` bytes this rank sends to ``dsts``, read from ``open()``;
    ``on_chunk`` sees each chunk in order (this rank's own copy, written meanwhile)."""

    message: int
    dsts: list[int]
    size: int
    name: str
    open: Callable[[], Source]
    on_chunk: Callable[[np.ndarray[Any, Any]], None] | None = None
    digest: str | None = None  # what was sent (set by the transfer)
    hashed: bool = True  # False: the receivers know the digest already (no trailer to check)


class Sink(Protocol):
    """Where a received file's bytes go, chunk by chunk in order."""

    def write(self, chunk: np.ndarray[Any, Any]) -> None: ...

    def close(self) -> None: ...


@dataclasses.dataclass
class Incoming:
    """A file this rank receives from ``src``: ``size`` bytes written to ``into()`` (None:
    received and dropped), checked against the sender's digest and ``expect`` (when known).
    ``digest`` and ``error`` tell how it went."""

    message: int
    src: int
    size: int
    name: str
    into: Callable[[], Sink] | None
    expect: str | None = None
    digest: str | None = None
    error: str | None = None
    corrupt: bool = False  # the bytes arrived but do not match what was expected
    lost: bool = False  # the bytes did not arrive (the sender died, stalled or failed)


def _pool(largest: int) -> list[Any]:
    """The receive buffers of one transfer: :data:`_WINDOW` chunks (as small as the largest
    file allows)."""
    import torch

    n = min(chunk_size(largest), largest)
    return [torch.empty(n, dtype=torch.uint8) for _ in range(_WINDOW if n else 1)]


def chunk_size(size: int) -> int:
    """The chunk size both ends use for a file of ``size`` bytes."""
    return max(CHUNK, -(-size // _CHUNKS))


def _tag(message: int, chunk: int) -> int:
    return (message << 12) | chunk


def _tensor(array: np.ndarray[Any, Any]) -> Any:
    import torch

    with warnings.catch_warnings():  # a read-only mapping is only read by a send
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)


class Wire:
    """The ranks of ``process_group`` as the peer tier talks to them (see the module docstring).
    ``timeout``: seconds a rank that shows no sign of life is waited for. ``nodes`` (set by the
    tier once known): each rank's node, for messages."""

    def __init__(self, process_group: Any, timeout: float) -> None:
        self.timeout = timeout
        self.nodes: list[str] = []
        self.rank, self.world = 0, 1
        self.prefix = ""
        self._store: Any = None
        self._group: Any = None
        self._generation = 0
        self._sessions = 0
        self._session = ""
        self._last_all: str | None = None
        self._beating = threading.Event()
        self._beat_thread: threading.Thread | None = None
        if process_group is None:
            return
        import torch.distributed as dist

        ranks = tuple(dist.get_process_group_ranks(process_group))
        self.rank, self.world = ranks.index(dist.get_rank()), len(ranks)
        key = (id(dist.group.WORLD), ranks)
        with _wires_lock:  # every rank opens its managers in the same order
            n = _wires.get(key, 0)
            _wires[key] = n + 1
        digest = hashlib.sha1(",".join(map(str, ranks)).encode()).hexdigest()[:16]
        self.prefix = f"savepoint-peers/{digest}/{n}/"

    def who(self, rank: int) -> str:
        """``rank 3 (node b)``."""
        node = self.nodes[rank] if rank < len(self.nodes) else "?"
        return f"rank {rank} (node {node})"

    # -- sessions and documents ------------------------------------------------------------

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        """One exchange between the ranks (a replication, a survey, a fetch): every rank opens
        the same sessions in the same order; while one is open this rank's heartbeat runs."""
        self._sessions += 1
        self._session = f"s{self._sessions}"
        if self.world > 1:
            self._beating.set()
            if self._beat_thread is None:
                self._beat_thread = threading.Thread(
                    target=self._beat, name="savepoint-peers-beat", daemon=True
                )
                self._beat_thread.start()
        try:
            yield
        finally:
            if self.world > 1:
                self._acknowledge()
            self._beating.clear()

    def _acknowledge(self) -> None:
        """The end of a session: rank 0 (which may host the store) waits, at most ``timeout``,
        until every rank read the session's last document."""
        kv, key = self._kv(), f"{self._session}/read"
        with contextlib.suppress(Exception):  # (a store gone: nothing to wait for)
            if self.rank != 0:
                if kv.add(key, 1) == self.world - 1:
                    kv.set(f"{key}/all", "1")
                return
            kv.wait([f"{key}/all"], timedelta(seconds=self.timeout))
        with contextlib.suppress(Exception):
            kv.delete_key(key)
            kv.delete_key(f"{key}/all")

    def _beat(self) -> None:
        count = 0
        interval = max(0.05, min(1.0, self.timeout / 5))
        while True:
            self._beating.wait()
            count += 1
            with contextlib.suppress(Exception):  # the store gone: the gathers say so
                self._kv().set(f"beat/{self.rank}", str(count))
            time.sleep(interval)

    def _kv(self) -> Any:
        if self._store is None:
            from torch.distributed import PrefixStore  # type: ignore[attr-defined]
            from torch.distributed.distributed_c10d import _get_default_store

            self._store = PrefixStore(self.prefix, _get_default_store())
        return self._store

    def gather(self, phase: str, value: Any) -> Gathered:
        """Every rank's ``value`` (JSON), in rank order, on every rank."""
        if self.world == 1:
            return Gathered([value], [])
        kv, key = self._kv(), f"{self._session}/{phase}"
        kv.set(f"{key}/{self.rank}", json.dumps(value))
        if self.rank == 0:
            keys = [f"{key}/{r}" for r in range(self.world)]
            missing = self._wait(dict(enumerate(keys)))
            values = [None if r in missing else self._load(kv.get(k)) for r, k in enumerate(keys)]
            with contextlib.suppress(Exception):
                for k in keys:
                    kv.delete_key(k)
                if self._last_all is not None:  # every rank read it before setting this one
                    kv.delete_key(self._last_all)
            self._last_all = f"{key}/all"
            kv.set(self._last_all, json.dumps({"values": values, "missing": missing}))
        elif self._wait({0: f"{key}/all"}):
            return Gathered([value if r == self.rank else None for r in range(self.world)], [0])
        doc = self._load(kv.get(f"{key}/all"))
        return Gathered(list(doc["values"]), list(doc["missing"]))

    def _load(self, raw: Any) -> Any:
        data = raw if isinstance(raw, bytes) else str(raw).encode()
        return bounded_json.loads(data, CorruptCheckpointError, "a peer tier document")

    def _wait(self, keys: dict[int, str]) -> list[int]:
        """Wait until every key is set, or each rank still missing has shown no heartbeat for
        ``timeout`` seconds: those ranks, ascending."""
        kv = self._kv()
        pending = dict(keys)
        beats = self._beats(pending)
        while True:
            # (blocks in the store until the keys are set: a timeout is the exception, and
            # torch logs one then, so the wait is as long as a rank may stay silent)
            with contextlib.suppress(Exception):
                kv.wait(list(pending.values()), timedelta(seconds=self.timeout))
                return []
            pending = {r: k for r, k in pending.items() if not _has(kv, k)}
            if not pending:
                return []
            now = self._beats(pending)
            if all(now[r] == beats[r] for r in pending):
                return sorted(pending)  # silent for ``timeout``: not answering
            beats = now

    def _beats(self, ranks: dict[int, str]) -> dict[int, str | None]:
        """Each rank's heartbeat counter as the store has it now (None: none yet)."""
        kv, found = self._kv(), {}
        for r in ranks:
            key = f"beat/{r}"
            found[r] = kv.get(key).decode() if _has(kv, key) else None
        return found

    # -- bytes ---------------------------------------------------------------------------------

    def group(self) -> Any:
        """The gloo group of this generation (made on first use, every rank at once)."""
        if self._group is None:
            import torch.distributed as dist
            from torch.distributed import PrefixStore  # type: ignore[attr-defined]

            store = PrefixStore(f"g{self._generation}/", self._kv())
            self._group = dist.ProcessGroupGloo(
                store, self.rank, self.world, timedelta(seconds=self.timeout)
            )
        return self._group

    def reset(self) -> None:
        """Drop the group after a failed transfer (every rank, once the failure is agreed)."""
        self._group = None
        self._generation += 1

    def transfer(self, outgoing: list[Outgoing], incoming: list[Incoming]) -> list[str]:
        """Send ``outgoing`` and receive ``incoming`` (both in message order); returns what
        failed on this rank's sending side (each naming the peer), the receptions' outcomes in
        ``incoming``. A peer that failed one reception is not waited for again."""
        group = None  # (alone: only this rank's own copies, nothing sent)
        if self.world > 1:
            try:  # every rank calls transfer at the same point: the group is made together
                group = self.group()
            except Exception as exc:
                problem = f"could not set up the peer tier's gloo group: {_short(exc)}"
                for item in incoming:
                    item.lost, item.error = True, problem
                return [problem]
        errors: list[str] = []
        progress = [time.monotonic()]
        sender = threading.Thread(
            target=self._send_all,
            args=(group, sorted(outgoing, key=lambda o: o.message), errors, progress),
            name="savepoint-peers-send",
            daemon=True,
        )
        sender.start()
        failed: dict[int, str] = {}
        pool = _pool(max((i.size for i in incoming), default=0))
        for item in sorted(incoming, key=lambda i: i.message):
            if item.src in failed:
                item.lost, item.error = True, f"not received: {failed[item.src]}"
                continue
            self._receive(group, item, pool)
            if item.lost:
                failed[item.src] = item.error or "it failed"
            progress[0] = time.monotonic()
        while sender.is_alive():
            sender.join(_POLL * 10)
            if sender.is_alive() and time.monotonic() - progress[0] > self.timeout:
                errors.append(
                    f"{self.who(self.rank)} did not finish sending within {self.timeout:g} s "
                    "(a send stalled)"
                )
                break
        return errors

    def _send_all(
        self, group: Any, outgoing: list[Outgoing], errors: list[str], progress: list[float]
    ) -> None:
        for item in outgoing:
            try:
                self._send(group, item, progress)
            except Exception as exc:
                errors.append(
                    f"sending {item.name} to {', '.join(self.who(d) for d in item.dsts)} "
                    f"failed: {_short(exc)}"
                )
                return  # the group is not trusted any more

    def _send(self, group: Any, item: Outgoing, progress: list[float]) -> None:
        hasher = checksum.new()
        works: collections.deque[tuple[Any, Any]] = collections.deque()
        n = chunk_size(item.size)
        source = item.open()
        try:
            for i, start in enumerate(range(0, item.size, n)):
                chunk = source.chunk(start, min(item.size, start + n))
                tensor = _tensor(chunk) if item.dsts else None
                for dst in item.dsts:  # (posted first: gloo sends while this thread hashes)
                    works.append((group.send([tensor], dst, _tag(item.message, i)), tensor))
                if item.hashed:
                    hasher.update(chunk)
                if item.on_chunk is not None:
                    item.on_chunk(chunk)
                while len(works) > _WINDOW * len(item.dsts):
                    works.popleft()[0].wait()
                    progress[0] = time.monotonic()
            digest = checksum.hexdigest(hasher) if item.hashed else "0" * 16
            trailer = np.frombuffer(bytearray(bytes.fromhex(digest)), np.uint8)
            for dst in item.dsts:
                sent = _tensor(trailer)
                works.append((group.send([sent], dst, _tag(item.message, _CHUNKS)), sent))
            while works:
                works.popleft()[0].wait()
                progress[0] = time.monotonic()
            item.digest = digest
        finally:
            for work, _ in works:  # (a failure: nothing may still read the source's memory)
                with contextlib.suppress(Exception):
                    work.wait()
            works.clear()
            source.close()

    def _receive(self, group: Any, item: Incoming, pool: list[Any]) -> None:
        """Receive ``item`` chunk by chunk into the reused buffers of ``pool`` (a few in
        flight), each hashed and written to its file in order: no file is mapped, no page of
        it touched twice."""
        import torch

        sink: Sink | None = None
        if item.into is not None:
            try:
                sink = item.into()
            except OSError as exc:  # no room: received all the same (the sender sends it)
                item.error = f"cannot store {item.name}: {exc.strerror or exc}"
        n = chunk_size(item.size)
        hasher = checksum.new()
        trailer = torch.zeros(8, dtype=torch.uint8)
        pending: collections.deque[tuple[Any, Any]] = collections.deque()

        def land() -> None:
            work, chunk = pending.popleft()
            work.wait()
            data = chunk.numpy()
            hasher.update(data)
            if sink is not None:
                sink.write(data)

        try:
            for i, start in enumerate(range(0, item.size, n)):
                chunk = pool[i % len(pool)][: min(n, item.size - start)]
                pending.append((group.recv([chunk], item.src, _tag(item.message, i)), chunk))
                if len(pending) == len(pool):
                    land()
            while pending:
                land()
            group.recv([trailer], item.src, _tag(item.message, _CHUNKS)).wait()
        except Exception as exc:
            item.lost = True
            item.error = (
                f"{self.who(item.src)} did not send {item.name} within {self.timeout:g} s "
                f"({_short(exc)})"
            )
            return
        finally:
            if sink is not None:
                sink.close()
        if sink is None:
            return  # dropped (its error says why)
        sent = trailer.numpy().tobytes().hex()
        got = item.digest = checksum.hexdigest(hasher)
        if got != (sent if item.expect is None else item.expect):
            item.corrupt = True
            known = f"sent {sent}" if item.expect is None else f"its marker has {item.expect}"
            item.error = (
                f"{item.name} from {self.who(item.src)} does not match its checksum (received "
                f"{got}, {known})"
            )


def _has(kv: Any, key: str) -> bool:
    try:
        return bool(kv.check([key]))
    except Exception:  # the store gone: nothing there any more
        return False


def _short(exc: BaseException) -> str:
    """gloo's message without its source location and boilerplate advice."""
    text = (str(exc).splitlines() or [repr(exc)])[0]
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    return text.split(" This is typically caused", 1)[0].rstrip(". ")
