"""Blob identity: the digest that names a blob's content.

``blake3`` (the default): BLAKE3 with a 256-bit output, written as 64 lowercase hex digits. It is a
cryptographic hash: nobody can make two different contents share a name, even on purpose, so a
blob store can be shared by runs, users and the models they download without one content
silently standing in for another. ``xxh3-128``: XXH3 with a 128-bit output (32 hex digits), about
8x faster (see ``docs/blobs.md``) and collision-free for data nobody crafted, but not
cryptographic: with its public default secret, colliding inputs can be constructed, so it is only
offered for stores whose every writer is trusted.

:class:`FastMemo` makes re-hashing unchanged content cheap: it remembers, per process, the digest
of each chunk under a keyed XXH3-128 (a random seed drawn per memo, never written anywhere), so a
chunk seen before costs an XXH3 pass (~20 GiB/s) instead of a BLAKE3 pass (~3 GiB/s here).
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import xxhash

from savepoint.codecs.recipe import ALGORITHMS, is_digest
from savepoint.errors import IncompatibleCheckpointError

__all__ = [
    "ALGORITHMS",
    "DEFAULT",
    "FastMemo",
    "digest_function",
    "hex_length",
    "is_digest",
]

DEFAULT = "blake3"
_B3_THREADS_FROM = 1 << 20


def _blake3(data: Any) -> str:
    import blake3

    # blake3-py holds the GIL while it hashes, so threads of ours do not run it in parallel; its
    # own thread pool does (1.3-2x on the 2-core development machine for 1 MiB and more, see
    # benchmarks/bench_blobs.py).
    if memoryview(data).nbytes >= _B3_THREADS_FROM:
        return blake3.blake3(data, max_threads=blake3.blake3.AUTO).hexdigest()
    return blake3.blake3(data).hexdigest()


def _xxh3_128(data: Any) -> str:
    return f"{xxhash.xxh3_128_intdigest(data):032x}"


def digest_function(algorithm: str) -> Callable[[Any], str]:
    """The function that names a buffer's content under ``algorithm``."""
    if algorithm == "blake3":
        try:
            import blake3  # noqa: F401
        except ImportError:  # pragma: no cover - depends on the environment
            raise IncompatibleCheckpointError(
                "blob digests need the blake3 package: pip install blake3"
            ) from None
        return _blake3
    if algorithm == "xxh3-128":
        return _xxh3_128
    raise IncompatibleCheckpointError(
        f"unknown blob digest algorithm {algorithm!r} (known: {', '.join(ALGORITHMS)})"
    )


def hex_length(algorithm: str) -> int:
    try:
        return ALGORITHMS[algorithm]
    except KeyError:
        raise IncompatibleCheckpointError(
            f"unknown blob digest algorithm {algorithm!r} (known: {', '.join(ALGORITHMS)})"
        ) from None


class FastMemo:
    """Remembers ``keyed XXH3-128 of a chunk -> (its digest, its XXH3-64)`` for the chunks this
    process hashed,
    so unchanged chunks are named at XXH3 speed. Bounded (least recently used entries go first);
    thread-safe. The seed is random per memo, so an outsider cannot aim a collision at it; pass
    ``memo=None`` to the put calls to hash every chunk with the store's algorithm."""

    def __init__(self, capacity: int = 1 << 20) -> None:
        self.capacity = capacity
        self._seed = int.from_bytes(os.urandom(8), "little")
        self._entries: OrderedDict[tuple[int, int], tuple[str, str]] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def key(self, data: Any) -> tuple[int, int]:
        return (xxhash.xxh3_128_intdigest(data, self._seed), memoryview(data).nbytes)

    def get(self, key: tuple[int, int]) -> tuple[str, str] | None:
        with self._lock:
            found = self._entries.get(key)
            if found is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return found

    def add(self, key: tuple[int, int], named: tuple[str, str]) -> None:
        with self._lock:
            self._entries[key] = named
            self._entries.move_to_end(key)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
