"""Shared helpers for the fault-injection tests (not collected: the name does not start with test_)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import Iterator
from typing import Any

from _compare import same
from savepoint.codecs import checksum
from savepoint.codecs import manifest as mf

MANIFEST = mf.NAME


# ---------------------------------------------------------------------------------------------
# forging manifests exactly as savepoint.codecs.manifest.dumps lays them out
# ---------------------------------------------------------------------------------------------


def seal(head: bytes) -> bytes:
    """Append the self-checksum trailer to ``head`` (everything up to the last member), as dumps does."""
    return head + f',\n "manifest_xxh3": "{checksum.digest(head)}"\n}}\n'.encode("ascii")


def head_from_members(members: list[tuple[str, str]]) -> bytes:
    """The head of a manifest whose top-level members are ``(key, raw JSON text)`` pairs, in order.

    Raw text lets a test write what ``json.dumps`` never would (duplicate keys, deep nesting).
    """
    return ("{\n" + ",\n".join(f" {json.dumps(k)}: {v}" for k, v in members)).encode("ascii")


def compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=True)


def doc_members(doc: dict[str, Any]) -> list[tuple[str, str]]:
    return [(k, compact(v)) for k, v in doc.items()]


def forge(doc: dict[str, Any]) -> bytes:
    """A manifest holding ``doc`` (without its manifest_xxh3) whose checksum is valid."""
    return seal(head_from_members(doc_members(doc)))


def read_doc(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """The manifest of ``directory`` as a plain dict, in file order, without manifest_xxh3."""
    with open(os.path.join(directory, MANIFEST), "rb") as f:
        doc = json.loads(f.read())
    del doc["manifest_xxh3"]
    return doc


def write_manifest(directory: str | os.PathLike[str], raw: bytes) -> None:
    with open(os.path.join(directory, MANIFEST), "wb") as f:
        f.write(raw)


# ---------------------------------------------------------------------------------------------
# comparing loaded state exactly
# ---------------------------------------------------------------------------------------------


def assert_same(got: Any, want: Any, where: str = "<root>") -> None:
    """Exact equality of two state trees: same containers, same keys, arrays equal bit for bit."""
    same(got, want, where)


# ---------------------------------------------------------------------------------------------
# guarding against hangs
# ---------------------------------------------------------------------------------------------


class Hang(Exception):
    """Raised in the main thread when an operation overruns its deadline."""


@contextlib.contextmanager
def deadline(seconds: float, what: str) -> Iterator[None]:
    """Raise Hang if the block runs longer than ``seconds`` (SIGALRM also interrupts blocking
    system calls such as open() on a FIFO, because the handler raises)."""

    def on_alarm(signum: int, frame: Any) -> None:
        raise Hang(f"{what} did not finish within {seconds} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def hidden_siblings(directory: str | os.PathLike[str], name: str) -> list[str]:
    return sorted(e for e in os.listdir(directory) if e.startswith(f".{name}."))
