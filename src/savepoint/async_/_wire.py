"""What the trainer and its writer process say to each other: length-prefixed JSON on a Unix socket.

Each message is an 8-byte big-endian length and that many bytes of JSON (a mapping with an ``op``);
a file descriptor (the shared staging arena, when it is new) travels with a message as
``SCM_RIGHTS`` ancillary data. No pickle: the writer process reads only JSON it can check, and the
trainer rebuilds errors from a type name it looks up among savepoint's own error classes.

Errors cross as ``{"type", "message", "path", "errno"}``: the trainer raises the CheckpointError
subclass of that name (a CheckpointWriteError for any name savepoint does not define).
"""

from __future__ import annotations

import json
import os
import socket
import struct
import traceback
from typing import Any

from savepoint import errors, errors_map

__all__ = [
    "WriterProcessTraceback",
    "error_fields",
    "error_from",
    "receive",
    "receive_message",
    "reported",
    "send",
]

_HEAD = struct.Struct("!Q")
MAX_MESSAGE = 1 << 32  # a layout of millions of tensors is tens of MiB; refuse nonsense lengths


def send(sock: socket.socket, message: dict[str, Any], fds: list[int] | None = None) -> None:
    """Send one message (and ``fds`` with its first bytes)."""
    body = json.dumps(message, separators=(",", ":"), allow_nan=False).encode()
    head = _HEAD.pack(len(body))
    if fds:
        sent = socket.send_fds(sock, [head], fds)
        if sent < len(head):
            sock.sendall(head[sent:])
    else:
        sock.sendall(head)
    sock.sendall(body)


def receive(sock: socket.socket) -> tuple[dict[str, Any] | None, list[int]]:
    """The next message and the descriptors that came with it; ``(None, [])`` at end of stream
    (the other side closed or died)."""
    head, fds, _, _ = socket.recv_fds(sock, _HEAD.size, 4)
    if not head:
        return None, fds
    head += _exactly(sock, _HEAD.size - len(head))
    (length,) = _HEAD.unpack(head)
    if length > MAX_MESSAGE:
        raise ValueError(f"a message of {length} bytes from the other end of the writer socket")
    body = _exactly(sock, length)
    message = json.loads(body)
    if not isinstance(message, dict) or not isinstance(message.get("op"), str):
        raise ValueError("a message without an op from the other end of the writer socket")
    return message, fds


def receive_message(sock: socket.socket) -> dict[str, Any] | None:
    """The next message, or None at end of stream or when the other end broke the protocol
    (it died mid-message, say); descriptors that came with it are closed (for a side that
    expects none)."""
    try:
        message, fds = receive(sock)
    except (OSError, EOFError, ValueError):
        return None
    for fd in fds:
        os.close(fd)
    return message


def _exactly(sock: socket.socket, n: int) -> bytes:
    parts = []
    while n:
        part = sock.recv(min(n, 1 << 20))
        if not part:
            raise EOFError("the writer socket closed in the middle of a message")
        parts.append(part)
        n -= len(part)
    return b"".join(parts)


class WriterProcessTraceback(Exception):
    """The ``__cause__`` of an error raised in the writer process: its traceback there, as text
    (the exception objects themselves stay in that process; nothing is unpickled)."""


_TRACEBACK_CHARS = 16_384  # the end of a longer traceback is kept


def error_fields(exc: errors.CheckpointError) -> dict[str, Any]:
    """A CheckpointError as a message's fields, with the traceback of it and its causes."""
    number = getattr(exc, "errno", None)
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return {
        "type": type(exc).__name__,
        "message": exc.message,
        "path": exc.path,
        "errno": number if isinstance(number, int) else None,
        "traceback": text[-_TRACEBACK_CHARS:],
    }


def error_from(fields: dict[str, Any]) -> errors.CheckpointError:
    """The error :func:`error_fields` described: the savepoint error class of that name, else a
    CheckpointWriteError whose message names the type."""
    name, message = str(fields.get("type")), str(fields.get("message"))
    path = fields.get("path") if isinstance(fields.get("path"), str) else None
    number = fields.get("errno") if isinstance(fields.get("errno"), int) else None
    cls = getattr(errors, name, None) if name in errors.__all__ else None
    if not (isinstance(cls, type) and issubclass(cls, errors.CheckpointError)):
        cls, message = errors.CheckpointWriteError, f"{name}: {message}"
    try:
        error = cls(message, path=path)
    except TypeError:  # a class whose constructor takes more: its message and path only
        error = cls.__new__(cls)
        Exception.__init__(error, message)
        error.message, error.path = message, path
    if isinstance(error, OSError):
        error.errno = number
    remote = fields.get("traceback")
    if isinstance(remote, str) and remote:
        error.__cause__ = WriterProcessTraceback(
            "in the savepoint writer process:\n" + remote[-_TRACEBACK_CHARS:]
        )
    return error


def reported(exc: BaseException, target: str) -> errors.CheckpointError:
    """What a background failure is reported as, by ``PendingSave.wait()`` and by the next
    ``save()``, ``wait()`` or ``close()`` alike: a CheckpointError as it is; an OSError (a full
    disk while ``on_commit`` writes its bookkeeping, say) as a CheckpointWriteError with its
    ``errno``; anything else as a CheckpointError. The original is the ``__cause__``."""
    if isinstance(exc, errors.CheckpointError):
        return exc
    error: errors.CheckpointError
    if isinstance(exc, OSError):
        where = exc.filename if isinstance(exc.filename, str) and exc.filename else target
        error = errors_map.write_error(
            exc, target, f"the background save to {target} failed", where=where
        )
    else:
        error = errors.CheckpointError(
            f"a background save failed: {exc!r}", path=getattr(exc, "filename", None)
        )
    error.__cause__ = exc
    return error
