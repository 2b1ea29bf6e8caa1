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
- **bytes** (:meth:`Wire.transfer`): plain TCP connections, one from each sender to each of its
  receivers per transfer (every rank listens on a socket of the tier's, its address published
  in the store; ``$SAVEPOINT_PEER_ADDR`` overrides the address, which is otherwise the one this
  host uses towards the store's host). A connection opens with a hello (the sender's rank and
  the transfer's token: a late connection of an earlier transfer is closed unread); each file is
  a header (its message number and size: anything else is a protocol error), its bytes, and the
  XXH3-64 the sender computed over the bytes it sent (not computed where the receiver knows what
  to expect: a restore checks each file against its copy's marker). The sender hashes each
  piece of 1 MiB while it is in cache, then sends it from the same memory (``sendfile`` cost
  more CPU on loopback than ``sendall`` from a populated mapping); the receiver reads each piece
  straight into one reused buffer, hashes it there and writes it to its file: no bytes object
  is made, no file mapped, no piece copied in user space (a sink with ``place``, a restore's
  targets, has the pieces it names received straight into its own memory instead). Sends run on a thread of their own
  and receives on the caller's, each side in one order every rank derives from the same
  documents (message order), so no two ranks wait on each other. A connection that fails (a
  peer died: at once; a peer that stops answering: after ``timeout``) fails that transfer and
  names the peer; every rank then drops its listener once the failure is agreed
  (:meth:`Wire.reset`) and the next transfer opens fresh ones.

Without a process group (one process) there is nobody to talk to: :meth:`Wire.gather` returns
this rank's document and no bytes travel.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, Protocol

import numpy as np

from savepoint.codecs import bounded_json, checksum
from savepoint.distributed import channels
from savepoint.errors import CorruptCheckpointError
from savepoint.runs._peer_check import Check

log = logging.getLogger("savepoint.runs.peers")

__all__ = ["ADDR_ENV", "Gathered", "Incoming", "Outgoing", "Sink", "Source", "Wire"]

ADDR_ENV = "SAVEPOINT_PEER_ADDR"  # the address other ranks reach this one at (else worked out)
_PIECE = 1 << 20  # bytes hashed and sent at a time (in cache between the two)
_BUFFER = 1 << 20  # a receiver's buffer: each piece is hashed and written from it
_POLL = 0.02  # seconds between looks at a sending thread that may have stalled
_MAGIC = b"SPpw"
_HELLO = struct.Struct("<4sQ16s")  # magic, the sender's rank, the transfer's token
_HEADER = struct.Struct("<QQQ")  # a file's message number, size, flags (its digest follows)
_CHECKED = 1  # flag: the receiver checks the file against its manifest and acknowledges it
_ACK = struct.Struct("<?8s")  # a checked file's acknowledgement: vouched for, the digest

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
    # True: the receivers check the file against its manifest (Incoming.check) and send back
    # the XXH3-64 they computed, which becomes ``digest``: the sender does not read it to hash
    # it (if no receiver vouches for it, the sender hashes it after all)
    checked: bool = False


class Sink(Protocol):
    """Where a received file's bytes go, chunk by chunk in order. A sink may also have
    ``place(at, n) -> (memoryview | None, n)``: where the bytes from offset ``at`` land (at most
    ``n`` of them, and how many): a view of the destination's own memory, received into straight
    (``write`` does not see them), or None for the reused buffer and ``write``."""

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
    # For a file its sender marks checked: what to check it against as it arrives (None: it
    # cannot be checked here, and is not kept)
    check: Callable[[], Check | None] | None = None
    lost: bool = False  # the bytes did not arrive (the sender died, stalled or failed)
    # Whatever the sender says: what this receiver checks the file against as it arrives, in
    # place of ``expect`` (a restore's file received straight into targets, whose checkpoint's
    # checksums cover every byte: stronger than the copy's marker, which only says the copy is
    # what its node kept, and one hash of each byte instead of two)
    verify: Check | None = None


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
        self._generation = 0
        self._sessions = 0
        self._session = ""
        self._transfers = 0
        self._listener: socket.socket | None = None
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
        self.prefix = f"savepoint-peers/{channels.store_scope()}{digest}/{n}/"

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

    def _listen(self) -> socket.socket:
        """This rank's listening socket of this generation (made on first use, its address
        published in the store as ``addr/<generation>/<rank>``)."""
        if self._listener is None:
            host = _advertised_host()
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            listener = socket.create_server((host, 0), family=family, backlog=max(16, self.world))
            port = listener.getsockname()[1]
            self._kv().set(f"addr/{self._generation}/{self.rank}", json.dumps([host, port]))
            self._listener = listener
        return self._listener

    def _address(self, rank: int) -> tuple[str, int]:
        key = f"addr/{self._generation}/{rank}"
        kv = self._kv()
        kv.wait([key], timedelta(seconds=self.timeout))
        host, port = self._load(kv.get(key))
        if not (isinstance(host, str) and isinstance(port, int)):
            raise CorruptCheckpointError(f"a bad address for {self.who(rank)}: {host!r}:{port!r}")
        return host, port

    def reset(self) -> None:
        """Drop the connections' listener after a failed transfer (every rank, once the failure
        is agreed): the next transfer makes a fresh one, and nothing of the failed one is read."""
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.close()
        self._listener = None
        self._generation += 1

    def close(self) -> None:
        """Close the listening socket (the manager's end)."""
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.close()
            self._listener = None

    def transfer(self, outgoing: list[Outgoing], incoming: list[Incoming]) -> list[str]:
        """Send ``outgoing`` and receive ``incoming`` (both in message order); returns what
        failed on this rank's sending side (each naming the peer), the receptions' outcomes in
        ``incoming``. A peer that failed one reception is not waited for again."""
        self._transfers += 1
        token = hashlib.sha1(
            f"{self.prefix}{self._generation}/{self._session}/{self._transfers}".encode()
        ).digest()[:16]
        listener = None  # (alone: only this rank's own copies, nothing sent)
        if self.world > 1:
            try:  # every rank calls transfer at the same point
                listener = self._listen()
            except Exception as exc:
                problem = f"could not open the peer tier's socket: {_short(exc)}"
                for item in incoming:
                    item.lost, item.error = True, problem
                return [problem]
        errors: list[str] = []
        progress = [time.monotonic()]
        sender = threading.Thread(
            target=self._send_all,
            args=(token, sorted(outgoing, key=lambda o: o.message), errors, progress),
            name="savepoint-peers-send",
            daemon=True,
        )
        sender.start()
        inbox = _Inbox(listener, token, self.timeout)
        failed: dict[int, str] = {}
        buffer = memoryview(bytearray(_BUFFER)) if incoming else memoryview(b"")
        try:
            for item in sorted(incoming, key=lambda i: i.message):
                if item.src in failed:
                    item.lost, item.error = True, f"not received: {failed[item.src]}"
                    continue
                self._receive(inbox, item, buffer, progress)
                if item.lost:
                    failed[item.src] = item.error or "it failed"
                    inbox.drop(item.src)
                progress[0] = time.monotonic()
        finally:
            inbox.close()
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
        self, token: bytes, outgoing: list[Outgoing], errors: list[str], progress: list[float]
    ) -> None:
        conns: dict[int, socket.socket] = {}
        item: Outgoing | None = None
        try:
            for dst in dict.fromkeys(d for o in outgoing for d in o.dsts):
                item = next(o for o in outgoing if dst in o.dsts)
                conn = socket.create_connection(self._address(dst), timeout=self.timeout)
                conns[dst] = conn
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                conn.sendall(_HELLO.pack(_MAGIC, self.rank, token))
            for item in outgoing:
                self._send([conns[d] for d in item.dsts], item, progress)
            item = None
            self._acknowledged(conns, outgoing)
        except Exception as exc:
            if item is None:
                errors.append(f"{self.who(self.rank)} could not hash what it sent: {exc}")
                return
            assert item is not None
            errors.append(
                f"sending {item.name} to {', '.join(self.who(d) for d in item.dsts)} "
                f"failed: {_short(exc)}"
            )
        finally:
            for conn in conns.values():
                with contextlib.suppress(OSError):
                    conn.close()

    def _acknowledged(self, conns: dict[int, socket.socket], outgoing: list[Outgoing]) -> None:
        """The digests of the checked files, as their receivers vouch for them (read once
        everything is sent: each receiver sent each one as its file arrived, in order); a file
        no receiver vouched for, or that two describe differently, is hashed here after all."""
        vouched: dict[int, set[str | None]] = {}
        for dst, conn in conns.items():
            mine = [o for o in outgoing if o.checked and dst in o.dsts]
            try:
                for item in mine:
                    ok, raw = _ACK.unpack(_exactly(conn, _ACK.size))
                    vouched.setdefault(item.message, set()).add(raw.hex() if ok else None)
            except OSError:  # (the receiver failed: it says so)
                pass
        for item in outgoing:
            if not item.checked:
                continue
            good = vouched.get(item.message, set()) - {None}
            if len(good) == 1:  # (each receiver checked every byte against the manifest)
                item.digest = good.pop()
                continue
            source, hasher = item.open(), checksum.new()
            try:
                for start in range(0, item.size, _PIECE):
                    hasher.update(source.chunk(start, min(item.size, start + _PIECE)))
            finally:
                source.close()
            item.digest = checksum.hexdigest(hasher)

    def _send(self, conns: list[socket.socket], item: Outgoing, progress: list[float]) -> None:
        """One file: a header, the bytes (each piece hashed, while in cache, before it is sent,
        unless the receivers check it: no copy is made in user space), the sender's digest."""
        hasher = checksum.new()
        hashed = item.hashed and not item.checked
        flags = _CHECKED if item.checked else 0
        for conn in conns:
            conn.sendall(_HEADER.pack(item.message, item.size, flags))
        source = item.open()
        try:
            for start in range(0, item.size, _PIECE):
                chunk = source.chunk(start, min(item.size, start + _PIECE))
                if hashed:
                    hasher.update(chunk)
                view = chunk.data.cast("B")
                for conn in conns:
                    conn.sendall(view)
                if item.on_chunk is not None:
                    item.on_chunk(chunk)
                progress[0] = time.monotonic()
            digest = checksum.hexdigest(hasher) if hashed else "0" * 16
            for conn in conns:
                conn.sendall(bytes.fromhex(digest))
            if not item.checked:
                item.digest = digest
        finally:
            source.close()

    def _receive(
        self, inbox: _Inbox, item: Incoming, buffer: memoryview, progress: list[float]
    ) -> None:
        """Receive ``item`` piece by piece into ``buffer`` (reused), each piece hashed while in
        cache and written to its file in order: no file is mapped, no page of it touched
        twice."""
        sink: Sink | None = None
        if item.into is not None:
            try:
                sink = item.into()
            except OSError as exc:  # no room: received all the same (the sender sends it)
                item.error = f"cannot store {item.name}: {exc.strerror or exc}"
        hasher = checksum.new()
        check: Check | None = item.verify  # (or the sender's, below)
        try:
            conn = inbox.get(item.src)
            message, size, flags = _HEADER.unpack(_exactly(conn, _HEADER.size))
            if (message, size) != (item.message, item.size):
                raise _ProtocolError(
                    f"sent message {message} of {size} bytes where message "
                    f"{item.message} of {item.size} bytes was due"
                )
            checked = bool(flags & _CHECKED)
            if checked and item.check is not None:
                try:
                    check = item.check()
                except Exception as exc:  # (its manifest did not arrive whole: not kept)
                    log.warning("peer memory: %s cannot be checked: %s", item.name, exc)
            at = 0
            place = getattr(sink, "place", None)
            while at < item.size:
                n = min(item.size - at, len(buffer))
                into, n = place(at, n) if place is not None else (None, n)
                piece = _exactly(conn, n, buffer[:n] if into is None else into)
                if item.verify is None:  # (else its checksums cover every byte: one hash)
                    hasher.update(piece)
                if check is not None:
                    check.update(at, piece)
                if sink is not None and into is None:
                    sink.write(np.frombuffer(piece, np.uint8))
                at += n
                progress[0] = time.monotonic()
            trailer = bytes(_exactly(conn, 8))
            if checked:
                problem = "it could not be checked here" if check is None else check.problem()
                got = checksum.hexdigest(hasher)
                conn.sendall(_ACK.pack(problem is None, bytes.fromhex(got)))
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
        if checked:
            item.digest = got
            if problem is not None:
                item.corrupt = check is not None
                item.error = (
                    f"{item.name} from {self.who(item.src)} does not match its manifest's "
                    f"checksums: {problem}"
                )
            return
        if item.verify is not None:  # every byte checked against the checkpoint's checksums
            return _verified(item, self.who(item.src))
        sent = trailer.hex()
        got = item.digest = checksum.hexdigest(hasher)
        if got != (sent if item.expect is None else item.expect):
            item.corrupt = True
            known = f"sent {sent}" if item.expect is None else f"its marker has {item.expect}"
            item.error = (
                f"{item.name} from {self.who(item.src)} does not match its checksum (received "
                f"{got}, {known})"
            )


def _verified(item: Incoming, who: str) -> None:
    """The end of a receive checked by ``item.verify``: corrupt when a range did not match."""
    assert item.verify is not None
    problem = item.verify.problem()
    item.digest = item.expect if problem is None else None
    if problem is not None:
        item.corrupt = True
        item.error = f"{item.name} from {who} does not match its checkpoint's checksums: {problem}"


class _ProtocolError(OSError):
    """A peer sent something other than what the transfer's plan has it send."""


class _Inbox:
    """The connections of one transfer's senders to this rank, accepted as they are needed:
    each opens with a hello (``_HELLO``: the sender's rank and the transfer's token); one of
    another transfer (a late sender of a failed one) is closed unread."""

    def __init__(self, listener: socket.socket | None, token: bytes, timeout: float) -> None:
        self.listener, self.token, self.timeout = listener, token, timeout
        self.conns: dict[int, socket.socket] = {}

    def get(self, src: int) -> socket.socket:
        deadline = time.monotonic() + self.timeout
        while src not in self.conns:
            left = deadline - time.monotonic()
            if self.listener is None or left <= 0:
                raise TimeoutError("no connection")
            self.listener.settimeout(left)
            conn, _ = self.listener.accept()
            try:
                conn.settimeout(self.timeout)
                magic, rank, token = _HELLO.unpack(_exactly(conn, _HELLO.size))
            except Exception:
                conn.close()
                continue
            if magic != _MAGIC or token != self.token or rank in self.conns:
                conn.close()
                continue
            self.conns[rank] = conn
        return self.conns[src]

    def drop(self, src: int) -> None:
        conn = self.conns.pop(src, None)
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.close()

    def close(self) -> None:
        for src in list(self.conns):
            self.drop(src)


def _exactly(conn: socket.socket, n: int, into: memoryview | None = None) -> memoryview:
    """``n`` bytes from ``conn`` (into ``into`` when given); OSError if the stream ends first."""
    view = into if into is not None else memoryview(bytearray(n))
    got = 0
    while got < n:
        k = conn.recv_into(view[got:n], n - got)
        if not k:
            raise _ProtocolError(f"the connection closed after {got} of {n} bytes")
        got += k
    return view[:n]


def _advertised_host() -> str:
    """The address other ranks reach this one at: ``$SAVEPOINT_PEER_ADDR``, else the address
    this host uses towards the rendezvous store's host (127.0.0.1 when that is this host)."""
    env = os.environ.get(ADDR_ENV)
    if env:
        return env
    host = _store_host()
    if host is None:
        host = os.environ.get("MASTER_ADDR")
    if not host or host in ("localhost", "::1") or host.startswith("127."):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))  # (no packet is sent: it picks the route's address)
            return str(probe.getsockname()[0])
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def _store_host() -> str | None:
    from torch.distributed.distributed_c10d import _get_default_store

    with contextlib.suppress(Exception):
        store: Any = _get_default_store()
        for _ in range(8):
            host = getattr(store, "host", None)
            if isinstance(host, str):
                return host
            store = getattr(store, "underlying_store", None)
            if store is None:
                break
    return None


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
