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

__all__ = ["ALGORITHMS", "MAX_CHUNK", "MAX_PATCHES", "Patch", "Recipe", "is_digest"]

ALGORITHMS: dict[str, int] = {"blake3": 64, "xxh3-128": 32}  # name -> hex digits
MAX_CHUNK = 1 << 30  # also the largest content a compressed blob may claim
MAX_PATCHES = 1024  # the longest chain of patches a reader accepts
_HEX = {n: re.compile(f"[0-9a-f]{{{n}}}") for n in set(ALGORITHMS.values())}


def is_digest(algorithm: str, value: object) -> bool:
    """Whether ``value`` is a well-formed digest of ``algorithm`` (hostile input: names only)."""
    n = ALGORITHMS.get(algorithm)
    return n is not None and isinstance(value, str) and _HEX[n].fullmatch(value) is not None


@dataclass(frozen=True)
class Patch:
    """Blocks of a tensor's content that changed since the recipe's base, as one blob.

    The blob's content is ``count`` block numbers (little-endian ``uint32``, or ``uint64`` when
    the tensor has more than 2**32 blocks of ``block`` bytes), strictly increasing, followed by
    the ``count`` blocks, each ``block`` bytes (the tensor's last block, when shorter, padded
    with zeros). ``check``: the XXH3-64 of that content. Block ``i`` covers content bytes
    ``[i * block, min((i + 1) * block, size))``."""

    blob: str
    block: int
    count: int
    check: str

    def index_itemsize(self, size: int) -> int:
        """Bytes per block number in the blob, for a tensor of ``size`` bytes."""
        return 4 if -(-size // self.block) <= 1 << 32 else 8

    def content_size(self, size: int) -> int:
        """The patch blob's content size, for a tensor of ``size`` bytes."""
        return self.count * (self.index_itemsize(size) + self.block)

    def to_json(self) -> dict[str, Any]:
        return {"blob": self.blob, "block": self.block, "count": self.count, "xxh3": self.check}


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
    checks one completely (hostile input).

    A *patched* recipe (manifest version 5) adds ``patches``: the chunks are then a base, and
    the content is the base with each :class:`Patch` applied in order (the changed rows of an
    embedding, written as one small blob instead of every chunk they touch). ``base_checks``
    are the XXH3-64 of the base chunks; ``checks`` stay those of the content's chunks (what the
    manifest's checksum is made of), so a load checks the base, each patch, and the result.
    JSON: ``"base_xxh3": [...]`` and ``"patches": [{"blob", "block", "count", "xxh3"}, ...]``.
    :meth:`names` lists every blob a recipe needs (base and patches): reference counting must
    use it, not ``digests``."""

    algorithm: str
    size: int
    chunk: int
    digests: tuple[str, ...]
    checks: tuple[str, ...] = ()
    patches: tuple[Patch, ...] = ()
    base_checks: tuple[str, ...] = ()

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
        if not self.patches:
            if self.base_checks:
                raise CorruptCheckpointError("blob recipe: base checks without patches")
            return
        if len(self.patches) > MAX_PATCHES:
            raise CorruptCheckpointError(
                f"blob recipe: {len(self.patches)} patches (at most {MAX_PATCHES} are read)"
            )
        if not self.checks or len(self.base_checks) != len(self.digests):
            raise CorruptCheckpointError("blob recipe: a patched recipe needs every xxh3 check")
        if not all(_checksum.is_digest(c) for c in self.base_checks):
            raise CorruptCheckpointError("blob recipe: malformed base checks")
        for p in self.patches:
            blocks = -(-self.size // p.block) if 0 < p.block <= MAX_CHUNK else 0
            if (
                not is_digest(self.algorithm, p.blob)
                or not 0 < p.count <= blocks
                or not _checksum.is_digest(p.check)
                or p.content_size(self.size) > MAX_CHUNK
            ):
                raise CorruptCheckpointError(
                    f"blob recipe: malformed patch {p.to_json()!r} of a {self.size}-byte tensor"
                )

    def names(self) -> tuple[str, ...]:
        """Every blob this recipe needs: its chunks, then its patches."""
        if not self.patches:
            return self.digests
        return self.digests + tuple(p.blob for p in self.patches)

    def patch_bytes(self) -> int:
        """The content bytes of all its patches (what reading every patch reads)."""
        return sum(p.content_size(self.size) for p in self.patches)

    def base(self) -> Recipe:
        """The recipe of the base alone (itself when it has no patches)."""
        if not self.patches:
            return self
        return Recipe(self.algorithm, self.size, self.chunk, self.digests, self.base_checks)

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
        if self.patches:
            out["base_xxh3"] = list(self.base_checks)
            out["patches"] = [p.to_json() for p in self.patches]
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
            or ("patches" in obj) != ("base_xxh3" in obj)
            or not isinstance(obj.get("patches", []), list)
            or not isinstance(obj.get("base_xxh3", []), list)
        ):
            raise CorruptCheckpointError(f"malformed blob recipe: {str(obj)[:200]}")
        checks = tuple(obj.get("xxh3", ()))
        patches = tuple(_patch(p) for p in obj.get("patches", ()))
        if "patches" in obj and not patches:
            raise CorruptCheckpointError("blob recipe: an empty list of patches")
        return cls(
            obj["digest"],
            obj["size"],
            obj["chunk"],
            tuple(obj["blobs"]),
            checks,
            patches,
            tuple(obj.get("base_xxh3", ())),
        )


def _patch(obj: Any) -> Patch:
    if (
        not isinstance(obj, dict)
        or set(obj) != _PATCH_KEYS
        or not all(type(obj[k]) is int for k in ("block", "count"))
        or not isinstance(obj["blob"], str)
        or not isinstance(obj["xxh3"], str)
    ):
        raise CorruptCheckpointError(f"malformed blob patch: {str(obj)[:200]}")
    return Patch(obj["blob"], obj["block"], obj["count"], obj["xxh3"])


_RECIPE_KEYS = {"digest", "size", "chunk", "blobs", "xxh3", "patches", "base_xxh3"}
_PATCH_KEYS = {"blob", "block", "count", "xxh3"}
