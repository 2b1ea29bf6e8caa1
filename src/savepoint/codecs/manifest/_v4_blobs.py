"""Versions 4 and 5: tensors and shards in a blob store, and patched recipes.

An incremental save keeps tensors in a content-addressed blob store (:mod:`savepoint.blobs`)
named by the manifest's ``blob_store`` (:func:`check_blob_store`) and ``blob_digest``
(:func:`blob_members`). A tensor entry (:func:`blob_record`) or a shard (see
:mod:`savepoint.codecs.manifest._v2_sharded`) then names a :class:`savepoint.codecs.recipe.Recipe`
instead of a file range; :func:`recipe_of` checks it completely, and from version 5 it may carry
patches.
"""

from __future__ import annotations

import math
import re
from typing import Any

from savepoint.codecs import checksum
from savepoint.codecs import recipe as _recipe
from savepoint.codecs.manifest._checks import MIN_BLOCK, dtype_and_shape, is_digest, require, show
from savepoint.codecs.manifest._records import PATCHES, ManifestError, TensorRecord
from savepoint.errors import CorruptCheckpointError

KEYS = frozenset(("dtype", "shape", "xxh3", "blobs"))  # a blob tensor entry's members
MAX_UP = 2  # how many leading ``..`` a version 4 blob_store may have
_STORE_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,199}")


def check_blob_store(value: Any) -> str:
    """A version 4 ``blob_store``, checked: relative, plain names after at most two leading
    ``..`` (a manifest naming a store anywhere else, absolute, a URL, ``a/../..``, is hostile)."""
    require(
        type(value) is str and 0 < len(value) <= 1024,
        f"blob_store must be a relative path, got {show(value)}",
    )
    parts = value.split("/")
    up = 0
    while up < len(parts) and parts[up] == "..":
        up += 1
    rest = parts[up:]
    require(
        up <= MAX_UP
        and bool(rest)
        and all(_STORE_PART.fullmatch(p) and p not in (".", "..") for p in rest),
        f"blob_store {show(value)} is not a relative path of plain names after at most "
        f"{MAX_UP} '..' (a store outside the run)",
    )
    return str(value)


def blob_members(doc: dict[str, Any]) -> tuple[str, str]:
    store = check_blob_store(doc.get("blob_store"))
    algorithm = doc.get("blob_digest")
    require(
        algorithm in _recipe.ALGORITHMS,
        f"blob_digest must be one of {sorted(_recipe.ALGORITHMS)}, got {show(algorithm)}",
    )
    return store, str(algorithm)


def blob_record(name: str, t: dict[str, Any], algorithm: str | None, version: int) -> TensorRecord:
    """One tensor entry naming a blob recipe (it has a ``blobs`` member), checked."""
    require(
        t.keys() == KEYS,
        f"tensor {name!r}: a blob entry must have dtype, shape, xxh3, blobs",
    )
    shape, itemsize = dtype_and_shape(name, t)
    expected = math.prod(shape) * itemsize
    recipe, digest = recipe_of(
        f"tensor {name!r}", t, expected, f"shape {list(shape)} of {t['dtype']}", algorithm, version
    )
    return TensorRecord(
        t["dtype"], shape, "", 0, expected, t["xxh3"], (), digest.block, digest.blocks, recipe
    )


def recipe_of(
    what: str,
    entry: dict[str, Any],
    expected: int,
    holding: str,
    algorithm: str | None,
    version: int,
) -> tuple[Any, checksum.Digest]:
    """The checked recipe of a version 4 entry (a tensor's or a shard's) whose bytes are
    ``expected`` (``holding`` says what they are), and its checksum."""
    try:
        recipe = _recipe.Recipe.from_json(entry["blobs"])
    except CorruptCheckpointError as exc:
        raise ManifestError(f"{what}: {exc}") from None
    require(
        not recipe.patches or version >= PATCHES,
        f"{what}: a patched blob recipe in a version {version} manifest (patches came with "
        f"version {PATCHES})",
    )
    require(
        recipe.size == expected,
        f"{what}: its blobs hold {recipe.size} bytes, {holding} needs {expected}",
    )
    require(
        recipe.algorithm == algorithm,
        f"{what}: {recipe.algorithm} blobs in a {show(algorithm)} blob store",
    )
    require(
        recipe.chunk & (recipe.chunk - 1) == 0 and recipe.chunk >= MIN_BLOCK,
        f"{what}: blob chunk {recipe.chunk} is not a power of two of at least 1 KiB",
    )
    digest = recipe.checksum() if recipe.size else checksum.Digest(checksum.digest(b""))
    require(
        digest is not None and is_digest(entry["xxh3"]) and digest.xxh3 == entry["xxh3"],
        f"{what}: its xxh3 does not match its blobs' checks",
    )
    assert digest is not None
    return recipe, digest
