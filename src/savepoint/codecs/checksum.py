"""Checksums: XXH3-64 (``xxhash``), written as 16 lowercase hex digits; per tensor, or per block.

XXH3 hashes at about 28 GiB/s on one core of the development machine (crc32c through
``google-crc32c`` needs a bytes copy of its input, zlib.crc32 runs near 1 GiB/s), and it releases
the GIL, so checking a warm 1 GiB load costs about 0.035 s.

Blocks (sharded checkpoints, manifest version 3): a record larger than :data:`MIN_BLOCK` x 2 is
hashed in blocks of :func:`block_size` bytes (a power of two, at least :data:`MIN_BLOCK`, at most
:data:`MAX_BLOCKS` blocks per record), so a load that needs part of a shard reads and checks only
the blocks holding that part. Such a record's ``xxh3`` is :func:`combine` of its block digests
(XXH3-64 of their 8-byte big-endian values, in order): the bytes are hashed once, by block.

Other algorithms (manifest version 6): a digest string is either 16 hex digits (XXH3-64) or
``"<algorithm>:<16 hex>"``; the one other algorithm is ``mlh64``
(:mod:`savepoint.codecs.devhash`), which a GPU computes while it stages a tensor. A reader
checks each tensor with the algorithm its digest names: :func:`matches` and
``Hasher(expect=...)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import xxhash

__all__ = [
    "ALGORITHM",
    "Digest",
    "Hasher",
    "MAX_BLOCKS",
    "MIN_BLOCK",
    "block_size",
    "combine",
    "digest",
    "hexdigest",
    "is_digest",
    "is_tagged",
    "matches",
    "new",
    "of",
]

ALGORITHM = "xxh3-64"
# 64 KiB blocks up to 64 MiB records, then blocks grow so no record has more than 1,024. A
# verified read of a contiguous range of L bytes reads at most two partial blocks beyond it, so
# at most 1 + 2 * block / L times its bytes: at most 1.05x for L >= 2.5 MiB, or for a range of
# at least 1/12 of a record over 64 MiB (its blocks are under 1/512 of it). The digests cost
# about 19 manifest bytes per block: at most 0.03% of the data, 19 KB per record. (Writers
# before this rule capped records at 256 blocks; readers take any count.)
MIN_BLOCK = 64 << 10
MAX_BLOCKS = 1024


def new() -> Any:
    return xxhash.xxh3_64()


def digest(data: Any) -> str:
    return f"{xxhash.xxh3_64_intdigest(data):016x}"


def hexdigest(hasher: Any) -> str:
    return f"{hasher.intdigest():016x}"


def is_tagged(expected: str) -> bool:
    """Whether a digest string names another algorithm than XXH3-64 (``mlh64:...``)."""
    return ":" in expected


def matches(data: Any, expected: str) -> bool:
    """Whether ``data`` has the digest ``expected``, in the algorithm that digest names."""
    if is_tagged(expected):
        from savepoint.codecs import devhash

        return devhash.digest(data) == expected
    return digest(data) == expected


def is_digest(value: Any) -> bool:
    return (
        isinstance(value, str) and len(value) == 16 and all(c in "0123456789abcdef" for c in value)
    )


def block_size(nbytes: int) -> int:
    """The block size a writer uses for a record of ``nbytes`` (0: hashed whole)."""
    if nbytes <= 2 * MIN_BLOCK:
        return 0
    size = MIN_BLOCK
    while size * MAX_BLOCKS < nbytes:
        size *= 2
    return size


def combine(blocks: tuple[str, ...] | list[str]) -> str:
    """The record digest of a blocked record: XXH3-64 of its block digests' 8-byte values."""
    return digest(b"".join(int(b, 16).to_bytes(8, "big") for b in blocks))


@dataclass(frozen=True)
class Digest:
    """A record's checksum: ``xxh3``, and (``block`` > 0) the digest of each block."""

    xxh3: str
    block: int = 0
    blocks: tuple[str, ...] = ()


class Hasher:
    """Hashes a stream of bytes (``update`` in order) whole, or (``block`` > 0) block by block;
    :meth:`result` gives the :class:`Digest`. ``first`` is the index of the stream's first block
    (a reader checking part of a record starts on a block boundary)."""

    def __init__(self, block: int = 0, first: int = 0, expect: str = "") -> None:
        self.block = block
        self.first = first
        self._other: Any = None
        if not block and expect and is_tagged(expect):
            from savepoint.codecs import devhash

            self._other = devhash.Hasher()
        self._hasher = new()
        self._fill = 0
        self._blocks: list[str] = []

    def update(self, data: Any) -> None:
        if self._other is not None:
            self._other.update(data)
            return
        if not self.block:
            self._hasher.update(data)
            return
        pos, n = 0, len(data)
        while pos < n:
            take = min(self.block - self._fill, n - pos)
            self._hasher.update(data[pos : pos + take])
            self._fill += take
            pos += take
            if self._fill == self.block:
                self._blocks.append(hexdigest(self._hasher))
                self._hasher.reset()
                self._fill = 0

    def done(self) -> tuple[str, ...]:
        """The digests of the blocks completed so far (a blocked stream)."""
        return tuple(self._blocks)

    def result(self) -> Digest:
        if self._other is not None:
            return Digest(self._other.hexdigest())
        if not self.block:
            return Digest(hexdigest(self._hasher))
        blocks = tuple(self._blocks) + ((hexdigest(self._hasher),) if self._fill else ())
        return Digest(combine(blocks), self.block, blocks)


def of(data: Any, block: int = 0) -> Digest:
    """The :class:`Digest` of ``data`` (one call, no streaming)."""
    if not block:
        return Digest(digest(data))
    n = len(data)
    blocks = tuple(digest(data[pos : pos + block]) for pos in range(0, n, block))
    return Digest(combine(blocks), block, blocks)
