"""Content-addressed blobs: the storage of incremental checkpoints (see ``docs/blobs.md``).

A :class:`BlobStore` keeps blobs named by the digest of their content (BLAKE3-256 by default) on
any :class:`~savepoint.storage.base.Store` (local disk, memory, object stores, fsspec), so content
that is already there is never written again. Large tensors are cut into fixed-size chunks
(:meth:`BlobStore.put_chunked`), each a blob, listed by a :class:`Recipe`; blobs may be
zstd-compressed by policy (:class:`Compression`, off by default). Saves run in a
:class:`SaveSession`; :func:`collect` deletes the blobs no kept checkpoint refers to, safely
against saves in flight and crash-safe at every step (see :mod:`savepoint.blobs.gc`).

::

    blobs = BlobStore.open("/runs/a/blobs")
    with blobs.session() as s:
        recipe = s.put_chunked(array, compression=Compression(level=3))
        s.sync(); s.check()
        ...  # commit a manifest holding recipe.to_json()
    data = blobs.read_recipe(recipe)            # uint8 array; verified against the digests
    blobs.collect(lambda: digests_of_kept_checkpoints(), grace=0)
"""

from __future__ import annotations

from savepoint.blobs.digest import FastMemo
from savepoint.blobs.frame import Compression
from savepoint.blobs.gc import BlobGcReport, SaveSession, collect
from savepoint.blobs.policy import RUN_BLOBS, BlobPolicy
from savepoint.blobs.store import (
    DEFAULT_CHUNK,
    BlobInfo,
    BlobStore,
    PutResult,
    PutStats,
    Recipe,
    referenced_by,
)

__all__ = [
    "BlobGcReport",
    "BlobInfo",
    "BlobPolicy",
    "BlobStore",
    "Compression",
    "DEFAULT_CHUNK",
    "FastMemo",
    "PutResult",
    "PutStats",
    "RUN_BLOBS",
    "Recipe",
    "SaveSession",
    "collect",
    "referenced_by",
]
