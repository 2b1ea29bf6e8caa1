"""Versions 2 and 3: sharded tensors, and block checksums.

A sharded save's tensor entry is ``{"dtype", "shape", "shards"}``; each shard holds a ``box`` or
a ``flat`` range of the tensor (:mod:`savepoint.codecs.boxes`) at a byte range of a data file,
from version 3 perhaps with per-block checksums (:func:`_blocks`), and from version 4 perhaps as
a blob recipe instead (:func:`savepoint.codecs.manifest._v4_blobs.recipe_of`). The shards of a
tensor must tile it exactly.
"""

from __future__ import annotations

from typing import Any

from savepoint.codecs import boxes, checksum
from savepoint.codecs.manifest._checks import (
    MAX_OFFSET,
    MIN_BLOCK,
    byte_range,
    dtype_and_shape,
    is_digest,
    natural,
    require,
    show,
)
from savepoint.codecs.manifest._records import (
    BLOBS,
    BLOCKED,
    FileRecord,
    ShardRecord,
    TensorRecord,
    whole,
)
from savepoint.codecs.manifest._v4_blobs import recipe_of

KEYS = frozenset(("dtype", "shape", "shards"))  # a sharded tensor entry's members
_BOX_SHARD = frozenset(("file", "offsets", "xxh3", "box"))
_FLAT_SHARD = frozenset(("file", "offsets", "xxh3", "flat"))
_SHARD_KINDS = (_BOX_SHARD, _FLAT_SHARD)
_BLOCKED_KINDS = _SHARD_KINDS + tuple(k | {"blocks"} for k in _SHARD_KINDS)
_BLOB_SHARD_KINDS = (frozenset(("xxh3", "blobs", "box")), frozenset(("xxh3", "blobs", "flat")))
_BLOCKS = frozenset(("size", "xxh3"))


def sharded_tensor(
    name: str, t: Any, files: dict[str, FileRecord], version: int, algorithm: str | None = None
) -> TensorRecord:
    require(
        type(t) is dict and t.keys() == KEYS,
        f"tensor {name!r}: entry must have dtype, shape, shards",
    )
    shape, itemsize = dtype_and_shape(name, t)
    raw_shards = t["shards"]
    require(
        type(raw_shards) is list and len(raw_shards) > 0,
        f"tensor {name!r}: shards must be a non-empty list",
    )
    shards = [
        shard_record(
            f"tensor {name!r} shard {i}", sh, t["dtype"], shape, itemsize, files, version, algorithm
        )
        for i, sh in enumerate(raw_shards)
    ]
    problem = boxes.check_cover([s.region for s in shards], shape)
    require(problem is None, f"tensor {name!r}: shards do not tile shape {list(shape)}: {problem}")
    return whole(t["dtype"], shape, tuple(shards))


def shard_record(
    what: str,
    sh: Any,
    dtype: str,
    shape: tuple[int, ...],
    itemsize: int,
    files: dict[str, FileRecord],
    version: int,
    algorithm: str | None = None,
) -> ShardRecord:
    """One checked shard object (``what`` names it in messages) of a tensor of ``shape``."""
    if version >= BLOBS and type(sh) is dict and "blobs" in sh:
        require(
            sh.keys() in _BLOB_SHARD_KINDS,
            f"{what}: a blob shard must have xxh3, blobs and one of box, flat",
        )
        start, end = 0, -1  # from its recipe, once its region is checked
    else:
        kinds = _BLOCKED_KINDS if version >= BLOCKED else _SHARD_KINDS
        require(
            type(sh) is dict and sh.keys() in kinds,
            f"{what}: entry must have file, offsets, xxh3 and one of box, flat"
            + (" (and may have blocks)" if version >= BLOCKED else "")
            + (" (or xxh3, blobs and one of box, flat)" if version >= BLOBS else ""),
        )
        start, end = byte_range(what, sh, files)
        require(is_digest(sh["xxh3"]), f"{what}: bad checksum")
    region: boxes.Region
    if "flat" in sh:
        require(_pair(sh["flat"]), f"{what}: flat must be [start, stop] with start <= stop")
        region = boxes.Flat(*sh["flat"])
    else:
        box = sh["box"]
        require(
            type(box) is list and len(box) == len(shape) and all(map(_pair, box)),
            f"{what}: box must hold one [start, stop] (start <= stop) per dimension of "
            f"{list(shape)}",
        )
        region = tuple((a, b) for a, b in box)
    require(
        boxes.inside(region, shape),
        f"{what}: {boxes.show(region)} lies outside shape {list(shape)}",
    )
    expected = boxes.size(region, shape) * itemsize
    if end < 0:
        recipe, digest = recipe_of(
            what, sh, expected, f"{boxes.show(region)} of {dtype}", algorithm, version
        )
        return ShardRecord("", 0, expected, sh["xxh3"], region, digest.block, digest.blocks, recipe)
    require(
        end - start == expected,
        f"{what}: {end - start} bytes recorded, {boxes.show(region)} of {dtype} needs {expected}",
    )
    block = 0
    digests: tuple[str, ...] = ()
    if "blocks" in sh:
        block, digests = _blocks(what, sh["blocks"], end - start, sh["xxh3"])
    return ShardRecord(sh["file"], start, end, sh["xxh3"], region, block, digests)


def _pair(x: Any) -> bool:
    return type(x) is list and len(x) == 2 and all(map(natural, x)) and x[0] <= x[1]


def _blocks(what: str, raw: Any, nbytes: int, xxh3: str) -> tuple[int, tuple[str, ...]]:
    """The checked ``blocks`` member of a shard of ``nbytes`` bytes whose ``xxh3`` is given."""
    require(
        type(raw) is dict and raw.keys() == _BLOCKS,
        f"{what}: blocks must be an object with size and xxh3",
    )
    size, digests = raw["size"], raw["xxh3"]
    require(
        type(size) is int and MIN_BLOCK <= size < MAX_OFFSET and size & (size - 1) == 0,
        f"{what}: block size must be a power of two of at least 1 KiB, got {show(size)}",
    )
    count = -(-nbytes // size)
    require(
        count >= 2 and type(digests) is list and len(digests) == count,
        f"{what}: {nbytes} bytes in blocks of {size} need {count} block checksums (at least 2)",
    )
    require(all(map(is_digest, digests)), f"{what}: bad block checksum")
    require(checksum.combine(digests) == xxh3, f"{what}: block checksums disagree with its xxh3")
    return size, tuple(digests)
