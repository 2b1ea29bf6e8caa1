"""A fault-injecting HTTP reverse proxy on loopback, in front of the moto S3 server.

Tests point an :class:`~savepoint.storage.objectstore.ObjectStore` at :attr:`FaultProxy.endpoint`
and program faults per request with :meth:`FaultProxy.fail`: a rule matches the HTTP method and a
regular expression searched in the request target (path and query, ``/bucket/key?partNumber=2``),
and fires on the ``nth`` matching request and the ``times - 1`` after it (``times=None``: on every
one from the ``nth`` on), optionally only for ``seconds`` after it was armed. What a rule does:

``"503"``, ``"500"``, ``"404-upload"``, ``"403"``
    answer that status with S3's XML error body (``SlowDown``, ``InternalError``,
    ``NoSuchUpload``: what S3 answers a second completion of a multipart upload, ``AccessDenied``:
    what a bucket policy denying the request answers); the request is read but never forwarded.
``"reset-request"``
    read half of the request body, then reset the connection (``SO_LINGER`` 0: an RST, not a FIN);
    nothing is forwarded.
``"reset-response"``
    forward the request (it takes effect), send the response head and half of its body, reset.
``"lose"``
    forward the request (it takes effect), then reset without answering: "the request succeeded,
    the client saw an error".
``"stall"``
    hold the request for ``seconds_stalled`` before forwarding it (the client has usually timed
    out and gone by then; the forwarded request still takes effect, as a late one would).
``"ignore-precondition"``
    strip ``If-None-Match`` and ``If-Match`` before forwarding (a server without conditional
    writes).

``then``, if given, is called (with the rule) when the rule fires, before the action: a test uses
it to let "another writer" act at that very moment. Each rule counts every request it matches;
when several fire on one request, the first armed acts. :attr:`FaultProxy.log` records every request
as ``(method, target, action or "")``.

One thread per client connection; requests on a connection are served in turn (HTTP/1.1
keep-alive), bodies with ``Content-Length`` or ``Transfer-Encoding: chunked`` (forwarded with a
``Content-Length``), ``Expect: 100-continue`` answered. Each request is forwarded on a fresh
connection to the server (``http.client``), whose response is read whole and sent back with a
``Content-Length``. Standard library only.
"""

from __future__ import annotations

import contextlib
import http.client
import re
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import BinaryIO

import pytest

from ._s3server import Server

ACTIONS = (
    "503",
    "500",
    "404-upload",
    "403",
    "reset-request",
    "reset-response",
    "lose",
    "stall",
    "ignore-precondition",
)
_HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
    "expect",
}
_ERRORS = {
    "503": ("Service Unavailable", "SlowDown", "Please reduce your request rate."),
    "500": ("Internal Server Error", "InternalError", "We encountered an internal error."),
    "404-upload": ("Not Found", "NoSuchUpload", "The specified upload does not exist."),
    "403": ("Forbidden", "AccessDenied", "Access Denied"),
}


@dataclass
class Rule:
    method: str
    pattern: re.Pattern[str]
    action: str
    nth: int = 1
    times: int | None = 1
    seconds: float | None = None
    seconds_stalled: float = 0.0
    then: Callable[[Rule], object] | None = None
    armed_at: float = field(default_factory=time.monotonic)
    seen: int = 0  # matching requests so far
    fired: int = 0  # requests this rule acted on

    def take(self, method: str, target: str) -> bool:
        """Count a request; whether the rule acts on it (call under the proxy's lock)."""
        if method != self.method or not self.pattern.search(target):
            return False
        self.seen += 1
        if self.seen < self.nth:
            return False
        if self.times is not None and self.seen >= self.nth + self.times:
            return False
        if self.seconds is not None and time.monotonic() - self.armed_at > self.seconds:
            return False
        self.fired += 1
        return True


class _Reset(Exception):
    """The connection is to be reset (the action has been carried out)."""


class FaultProxy:
    """The proxy; :meth:`start` it, program it with :meth:`fail`, :meth:`stop` it."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.removeprefix("http://").rstrip("/").split(":")
        self.upstream = (host, int(port))
        self.rules: list[Rule] = []
        self.log: list[tuple[str, str, str]] = []
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._clients: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._stopped = False

    # -- programming ---------------------------------------------------------------------------

    def fail(
        self,
        method: str,
        pattern: str,
        action: str,
        *,
        nth: int = 1,
        times: int | None = 1,
        seconds: float | None = None,
        stall: float = 0.0,
        then: Callable[[Rule], object] | None = None,
    ) -> Rule:
        """Arm a rule (see the module docstring); returns it (``fired`` counts its hits)."""
        assert action in ACTIONS, action
        rule = Rule(method, re.compile(pattern), action, nth, times, seconds, stall, then)
        with self._lock:
            self.rules.append(rule)
        return rule

    def clear(self) -> None:
        """Disarm every rule."""
        with self._lock:
            self.rules.clear()

    def requests(self, method: str, pattern: str) -> list[tuple[str, str, str]]:
        """The logged requests of ``method`` whose target matches ``pattern``."""
        with self._lock:
            return [e for e in self.log if e[0] == method and re.search(pattern, e[1])]

    # -- life ----------------------------------------------------------------------------------

    def start(self) -> FaultProxy:
        thread = threading.Thread(target=self._accept, name="faultproxy-accept", daemon=True)
        thread.start()
        self._threads.append(thread)
        return self

    def stop(self) -> None:
        self._stopped = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread
        self._listener.close()
        with self._lock:
            clients = list(self._clients)
        for sock in clients:
            _linger0(sock)
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes its thread, which closes it
        for thread in self._threads:
            thread.join(2)

    def _accept(self) -> None:
        while not self._stopped:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self._clients.add(sock)
            thread = threading.Thread(
                target=self._serve, args=(sock,), name="faultproxy-conn", daemon=True
            )
            thread.start()
            self._threads.append(thread)

    # -- one connection ------------------------------------------------------------------------

    def _serve(self, sock: socket.socket) -> None:
        rfile = sock.makefile("rb")
        try:
            while not self._stopped and self._one(sock, rfile):
                pass
        except _Reset:
            _linger0(sock)
        except OSError:
            pass  # the client went away (a timeout on its side, say)
        finally:
            rfile.close()  # the socket's file descriptor closes with its last reference
            with self._lock:
                self._clients.discard(sock)
            sock.close()

    def _one(self, sock: socket.socket, rfile: BinaryIO) -> bool:
        """Serve one request; False when the connection is to be closed."""
        line = rfile.readline(65537)
        if not line:
            return False
        method, target, _version = line.decode("latin-1").split(" ", 2)
        headers: list[tuple[str, str]] = []
        while True:
            raw = rfile.readline(65537)
            if raw in (b"\r\n", b"\n", b""):
                break
            name, _, value = raw.decode("latin-1").partition(":")
            headers.append((name.strip(), value.strip()))
        lower = {name.lower(): value for name, value in headers}

        with self._lock:
            # Every rule counts every request it matches; the first that fires acts.
            firing = [r for r in self.rules if r.take(method, target)]
            rule = firing[0] if firing else None
            self.log.append((method, target, rule.action if rule else ""))
        if rule is not None and rule.then is not None:
            rule.then(rule)
        action = rule.action if rule is not None else ""

        if lower.get("expect", "").lower() == "100-continue":
            sock.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
        if action == "reset-request":
            length = int(lower.get("content-length", "0") or 0)
            rfile.read(length // 2)
            raise _Reset
        body = _read_body(rfile, lower)
        keep_alive = lower.get("connection", "").lower() != "close"

        if action in _ERRORS:
            reason, code, message = _ERRORS[action]
            xml = (
                '<?xml version="1.0" encoding="UTF-8"?>\n'
                f"<Error><Code>{code}</Code><Message>{message}</Message>"
                f"<Resource>{target}</Resource><RequestId>faultproxy</RequestId></Error>"
            ).encode()
            head = [("Content-Type", "application/xml")]
            _send(sock, f"{action[:3]} {reason}", head, xml, keep_alive)
            return keep_alive
        if action == "stall":
            time.sleep(rule.seconds_stalled if rule is not None else 0.0)
        if action == "ignore-precondition":
            headers = [(n, v) for n, v in headers if n.lower() not in ("if-none-match", "if-match")]

        status, upstream_headers, payload = self._forward(method, target, headers, body)
        if action == "lose":
            raise _Reset
        if action == "reset-response":
            _send(sock, status, upstream_headers, payload, keep_alive, cut=len(payload) // 2)
            raise _Reset
        _send(sock, status, upstream_headers, payload, keep_alive)
        return keep_alive

    def _forward(
        self, method: str, target: str, headers: list[tuple[str, str]], body: bytes
    ) -> tuple[str, list[tuple[str, str]], bytes]:
        conn = http.client.HTTPConnection(*self.upstream, timeout=60)
        try:
            conn.putrequest(method, target, skip_host=True, skip_accept_encoding=True)
            for name, value in headers:
                if name.lower() not in _HOP_BY_HOP and name.lower() != "content-length":
                    conn.putheader(name, value)
            if body or method in ("PUT", "POST"):
                conn.putheader("Content-Length", str(len(body)))
            conn.endheaders(body)
            response = conn.getresponse()
            payload = b"" if method == "HEAD" else response.read()
            kept = [
                (n, v)
                for n, v in response.getheaders()
                if n.lower() not in _HOP_BY_HOP and n.lower() != "content-length"
            ]
            if method == "HEAD":
                length = response.getheader("Content-Length")
                if length is not None:
                    kept.append(("Content-Length", length))
            return f"{response.status} {response.reason}", kept, payload
        finally:
            conn.close()


def _read_body(rfile: BinaryIO, lower: dict[str, str]) -> bytes:
    if "chunked" in lower.get("transfer-encoding", "").lower():
        parts = []
        while True:
            size = int(rfile.readline(1024).split(b";")[0].strip(), 16)
            if size == 0:
                while rfile.readline(65537) not in (b"\r\n", b"\n", b""):
                    pass  # trailers
                return b"".join(parts)
            parts.append(rfile.read(size))
            rfile.readline(3)
    return rfile.read(int(lower.get("content-length", "0") or 0))


def _send(
    sock: socket.socket,
    status: str,
    headers: list[tuple[str, str]],
    body: bytes,
    keep_alive: bool,
    *,
    cut: int | None = None,
) -> None:
    lines = [f"HTTP/1.1 {status}"]
    lines += [f"{name}: {value}" for name, value in headers]
    if not any(n.lower() == "content-length" for n, _ in headers):
        lines.append(f"Content-Length: {len(body)}")
    lines.append("Connection: keep-alive" if keep_alive else "Connection: close")
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    sock.sendall(head + (body if cut is None else body[:cut]))


def _linger0(sock: socket.socket) -> None:
    """Make closing ``sock`` abrupt: with SO_LINGER 0, close sends an RST instead of a FIN."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


@pytest.fixture
def fault_proxy(s3: Server) -> Iterator[FaultProxy]:
    """A fault proxy in front of the session's moto server, stopped after the test."""
    proxy = FaultProxy(s3.endpoint).start()
    try:
        yield proxy
    finally:
        proxy.stop()
