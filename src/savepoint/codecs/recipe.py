"""A blob recipe: a tensor's bytes as a list of content-addressed blobs (see
:mod:`savepoint.blobs`), as version 4 manifests record it. In the codecs layer so that the
manifest parser checks recipes (hostile input) without importing the blob store; the store
re-exports :class:`Recipe` (``savepoint.blobs.Recipe``)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from savepoint.codecs import checksum as _checksum
from savepoint.errors import CorruptCheckpointError

__all__ = ["ALGORITHMS", "MAX_CHUNK", "Recipe", "is_digest"]

ALGORITHMS: dict[str, int] = {"blake3": 64, "xxh3-128": 32}  # name -> hex digits
MAX_CHUNK = 1 << 30  # also the largest content a compressed blob may claim
_HEX = {n: re.compile(f"[0-9a-f]{{{n}}}") for n in set(ALGORITHMS.values())}


def is_digest(algorithm: str, value: object) -> bool:
    """Whether ``value`` is a well-formed digest of ``algorithm`` (hostile input: names only)."""
    n = ALGORITHMS.get(algorithm)
    return n is not None and isinstance(value, str) and _HEX[n].fullmatch(value) is not None


@dataclass(frozen=True)
class Recipe:
    """A tensor's bytes as a list of blobs: content ``[i * chunk, min((i + 1) * chunk, size))``
    is the blob ``digests[i]``. A recipe of one chunk is a whole-tensor blob.

    ``checks``: the XXH3-64 of each chunk's content (savepoint's checksum, 16 hex digits), so
    that loads check what they read at XXH3 speed instead of re-computing BLAKE3; empty where a
    writer recorded none. They are block checksums in the sense of
    :mod:`savepoint.codecs.checksum` (blocks of ``chunk`` bytes): :meth:`checksum` gives the
    tensor's manifest checksum.

    In a manifest it is the JSON object of :meth:`to_json` (``{"digest": "blake3", "size": 123,
    "chunk": 4194304, "blobs": ["<hex>", ...], "xxh3": ["<16 hex>", ...]}``); :meth:`from_json`
    checks one completely (hostile input)."""

    algorithm: str
    size: int
    chunk: int
    digests: tuple[str, ...]
    checks: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        count = -(-self.size // self.chunk) if self.chunk > 0 else -1
        if self.size < 0 or not 0 < self.chunk <= MAX_CHUNK or count != len(self.digests):
            raise CorruptCheckpointError(
                f"blob recipe: {len(self.digests)} blob(s) of {self.chunk} bytes cannot hold "
                f"{self.size} bytes"
            )
        for d in self.digests:
            if not is_digest(self.algorithm, d):
                raise CorruptCheckpointError(f"blob recipe: {d!r} is not a {self.algorithm} digest")
        if self.checks and (
            len(self.checks) != len(self.digests)
            or not all(_checksum.is_digest(c) for c in self.checks)
        ):
            raise CorruptCheckpointError("blob recipe: its xxh3 checks do not match its blobs")

    def spans(self) -> Iterator[tuple[str, int, int]]:
        """``(digest, start, end)`` of every chunk, in order."""
        for i, d in enumerate(self.digests):
            yield d, i * self.chunk, min((i + 1) * self.chunk, self.size)

    def checksum(self) -> _checksum.Digest | None:
        """The content's checksum as a manifest records it (None without ``checks``): one chunk,
        its XXH3-64; several, :func:`savepoint.codecs.checksum.combine` of theirs, with the chunk
        as the block size."""
        if not self.checks:
            return None
        if len(self.checks) == 1:
            return _checksum.Digest(self.checks[0])
        return _checksum.Digest(_checksum.combine(self.checks), self.chunk, self.checks)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "digest": self.algorithm,
            "size": self.size,
            "chunk": self.chunk,
            "blobs": list(self.digests),
        }
        if self.checks:
            out["xxh3"] = list(self.checks)
        return out

    @classmethod
    def from_json(cls, obj: Any) -> Recipe:
        if (
            not isinstance(obj, dict)
            or not {"digest", "size", "chunk", "blobs"} <= set(obj) <= _RECIPE_KEYS
            or obj["digest"] not in ALGORITHMS
            or not all(type(obj[k]) is int for k in ("size", "chunk"))
            or not isinstance(obj["blobs"], list)
            or not isinstance(obj.get("xxh3", []), list)
        ):
            raise CorruptCheckpointError(f"malformed blob recipe: {str(obj)[:200]}")
        checks = tuple(obj.get("xxh3", ()))
        return cls(obj["digest"], obj["size"], obj["chunk"], tuple(obj["blobs"]), checks)


_RECIPE_KEYS = {"digest", "size", "chunk", "blobs", "xxh3"}
