"""A lock for stores that have no locks but a create-only put (object stores): a lease object.

``LeaseLock(store, path)`` is the lock at ``path``: a small JSON object naming its holder,

    {"pid": 123, "host": "node7", "since": "2026-11-26T12:00:00Z", "expires": 1790000000.0,
     "token": "3f2a..."}

``acquire`` is a create-only put of that object (``If-None-Match: *`` on S3), so of two
contenders exactly one wins. The holder keeps the lease alive: a daemon thread rewrites it with a
later ``expires`` every ``ttl / 3`` seconds, and :meth:`check` (a run's writer calls it before
every save) renews it too and says when it was lost. A lease whose ``expires`` has passed, or
whose holder is a process of this host that no longer runs, is stale: a contender deletes it and
tries its create-only put again (only one of several contenders can win that put). A holder whose
object was taken over (its token is gone) has lost the lock for good.

A lease that cannot be read (a failed request: a 503 after the retries, a reset) is never taken as
absent or stale: ``acquire`` raises the store's error instead of deleting or overwriting a lease
it could not read, and a holder whose renewal fails keeps the lock while its last record stays
valid for a whole heartbeat more (``ttl / 3``: no contender may take it before it expires), then
stops as if it had lost it.

What this cannot promise: a holder stalled for longer than ``ttl`` (a process stopped with SIGSTOP,
a machine that lost the network) loses its lease to a new writer and learns so only at its next
:meth:`check`, before its next save, which it then refuses. Choose ``ttl`` longer than any stall
you expect (default 60 s). Clocks of different machines are compared through ``expires``: keep them
in sync to within a fraction of ``ttl`` (NTP does).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any

from savepoint.codecs import bounded_json
from savepoint.errors import CheckpointError, CorruptCheckpointError

if TYPE_CHECKING:
    from savepoint.storage.base import Store

__all__ = ["DEFAULT_TTL", "LeaseLock", "pid_gone"]

DEFAULT_TTL = 60.0
_CAP = 4096


class LeaseLock:
    """An exclusive, non-blocking lock held as a lease object (see the module docstring)."""

    describes_itself = True  # the object names its holder: nothing else may be put at its path

    def __init__(self, store: Store, path: str, *, ttl: float = DEFAULT_TTL) -> None:
        if not ttl > 0:
            raise ValueError(f"a lease needs a positive ttl, not {ttl}")
        self.store = store
        self.path = path
        self.ttl = ttl
        self._token: str | None = None
        self._expires = 0.0  # the ``expires`` of the last record this holder put
        self._since = ""
        self._lost: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._mutex = threading.Lock()

    # -- the Lock protocol ---------------------------------------------------------------------

    def acquire(self) -> bool:
        """True if taken; False while another holder's lease is alive."""
        if self._token is not None:
            return False  # this object holds it already: a second acquire is another contender
        token = uuid.uuid4().hex
        self._since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        for _ in range(3):
            record = self._record(token)
            try:
                self.store.put(self.path, record, exclusive=True)
            except FileExistsError:
                if not self._clear_stale():
                    return False
                continue
            self._token, self._lost = token, None
            self._expires = json.loads(record)["expires"]
            self._start_heartbeat()
            return True
        return False

    def release(self) -> None:
        """Stop renewing and delete the lease if it is still ours; idempotent."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)
        with self._mutex:
            token, self._token = self._token, None
        if token is None:
            return
        with contextlib.suppress(OSError, CheckpointError):  # unreadable: it expires by itself
            if self._holder_token() == token:
                self.store.remove(self.path)

    # -- holding -------------------------------------------------------------------------------

    def check(self) -> str | None:
        """Renew the lease; None while it is held, else why it was lost (for good)."""
        with self._mutex:
            if self._lost is None and self._token is not None:
                self._lost = self._renew(self._token)
            return self._lost

    def _renew(self, token: str) -> str | None:
        record = self._record(token)
        try:
            current = self._holder_token()
            if current != token:
                return (
                    f"its lease {self.store.url(self.path)} was taken over by another writer "
                    "(this one did not renew it in time)"
                    if current is not None
                    else f"its lease {self.store.url(self.path)} was deleted"
                )
            self.store.put(self.path, record, exclusive=False)
        except (OSError, CheckpointError) as exc:
            # A failed read or put is not a lost lease: while the last record put stays valid
            # for a whole heartbeat more, no contender may take it, and the next renewal tries
            # again. Past that, this holder cannot know, and stops.
            if time.time() + self.ttl / 3 < self._expires:
                return None
            return f"its lease {self.store.url(self.path)} could not be renewed ({exc})"
        self._expires = json.loads(record)["expires"]
        return None

    def _start_heartbeat(self) -> None:
        self._stop = threading.Event()

        def beat(stop: threading.Event) -> None:
            while not stop.wait(self.ttl / 3):
                with self._mutex:
                    if self._token is None or self._lost is not None:
                        return
                    self._lost = self._renew(self._token)

        self._thread = threading.Thread(
            target=beat, args=(self._stop,), name="savepoint-lease", daemon=True
        )
        self._thread.start()

    # -- the object ----------------------------------------------------------------------------

    def _record(self, token: str) -> bytes:
        doc = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": self._since,
            "expires": time.time() + self.ttl,
            "token": token,
        }
        return (json.dumps(doc) + "\n").encode("utf-8")

    def _read(self) -> dict[str, Any] | None:
        # A read that fails (a failed request, an I/O error, a refusal) raises: it is neither
        # "no lease" (a contender would put its own over a live one's) nor a stale lease (it
        # would be deleted), and a holder that cannot read its lease has not lost it.
        try:
            raw = self.store.read_small(self.path, cap=_CAP)
        except FileNotFoundError:
            return None
        except CorruptCheckpointError:
            return {}  # over the cap, not a blob: no lease of ours; treated as stale below
        try:
            doc = bounded_json.loads(raw, CorruptCheckpointError, self.store.url(self.path))
        except CorruptCheckpointError:  # not JSON, nested too deep: no lease of ours
            return {}
        return doc if isinstance(doc, dict) else {}

    def _holder_token(self) -> str | None:
        doc = self._read()
        token = None if doc is None else doc.get("token")
        return token if isinstance(token, str) else None

    def _clear_stale(self) -> bool:
        """Delete the lease at the path if it is stale; True if the path is free to try again."""
        doc = self._read()
        if doc is None:
            return True  # released meanwhile
        expires = doc.get("expires")
        expired = not isinstance(expires, (int, float)) or expires < time.time()
        if not (expired or _dead_here(doc)):
            return False
        # Object stores have no conditional delete: look again right before deleting, so that
        # a lease another contender has just taken is not deleted (a narrow race remains; its
        # loser learns at its next renewal that the lease is no longer its own).
        if self._read() != doc:
            return True
        with contextlib.suppress(FileNotFoundError):
            self.store.remove(self.path)
        return True


def _dead_here(doc: dict[str, Any]) -> bool:
    """Whether the lease's holder is a process of this host that no longer runs."""
    pid = doc.get("pid")
    return doc.get("host") == socket.gethostname() and isinstance(pid, int) and pid_gone(pid)


def pid_gone(pid: int) -> bool:
    """True if no process ``pid`` runs on this host (never for this process itself)."""
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError):
        return False
    return False
