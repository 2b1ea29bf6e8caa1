"""What an incremental save does with each tensor: :class:`BlobPolicy`.

The engine's one decision per tensor is :meth:`BlobPolicy.wants`: tensors of at least
``min_blob_bytes`` go to the blob store as fixed-size chunks (``chunk_size``), optionally
compressed; smaller ones stay in the checkpoint's own data files, where they cost no object of
their own (a blob costs an fsync and a rename locally, a PUT on object stores: about as much as
writing 1-2 MiB, measured in ``docs/blobs.md``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from savepoint.blobs.frame import Compression
from savepoint.blobs.store import DEFAULT_CHUNK, MAX_CHUNK, MIN_CHUNK
from savepoint.codecs.recipe import MAX_PATCHES

__all__ = ["BlobPolicy", "DEFAULT_MIN_BLOB_BYTES", "RUN_BLOBS"]

DEFAULT_MIN_BLOB_BYTES = 1 << 20
RUN_BLOBS = "blobs"  # a run's blob store: <run directory>/blobs


@dataclass(frozen=True)
class BlobPolicy:
    """How incremental saves store tensors. ``compression``: None (the default), or a
    :class:`Compression`. ``workers``: threads hashing, compressing and writing the chunks of one
    tensor. ``memo``: name unchanged chunks by a keyed XXH3-128 pass instead of BLAKE3 (see
    :class:`savepoint.blobs.FastMemo`).

    ``patches``: write only the changed rows of a tensor whose previous save this process
    made, as a patch on its previous recipe (:mod:`savepoint.blobs.patch`), while the chain
    holds fewer than ``max_patches`` patches adding up to at most ``patch_budget`` times the
    tensor's bytes (a restore then reads at most ``1 + patch_budget`` times the tensor);
    otherwise the tensor is written as chunks again. Needs ``memo``."""

    chunk_size: int = DEFAULT_CHUNK
    min_blob_bytes: int = DEFAULT_MIN_BLOB_BYTES
    compression: Compression | None = None
    workers: int = 2
    memo: bool = True
    patches: bool = True
    max_patches: int = 64
    patch_budget: float = 0.5

    def __post_init__(self) -> None:
        size = self.chunk_size
        if not MIN_CHUNK <= size <= MAX_CHUNK or size & (size - 1):
            # a power of two: a recipe's checks are then manifest block checksums
            raise ValueError(
                f"chunk_size must be a power of two between {MIN_CHUNK} and {MAX_CHUNK} bytes, "
                f"not {size}"
            )
        if self.min_blob_bytes < 0:
            raise ValueError(f"min_blob_bytes must be >= 0, not {self.min_blob_bytes}")
        if self.workers < 1:
            raise ValueError(f"workers must be at least 1, not {self.workers}")
        if not 1 <= self.max_patches <= MAX_PATCHES:
            raise ValueError(
                f"max_patches must be between 1 and {MAX_PATCHES}, not {self.max_patches}"
            )
        if not 0.0 < self.patch_budget <= 4.0:
            raise ValueError(f"patch_budget must be in (0, 4], not {self.patch_budget}")
        if self.compression is not None and not isinstance(self.compression, Compression):
            raise TypeError("compression must be a savepoint.blobs.Compression or None")

    @classmethod
    def of(
        cls, compression: str | Compression | None = None, level: int | None = None, **kw: Any
    ) -> BlobPolicy:
        """The policy of user-facing arguments: ``compression="zstd"`` (with ``level``), a
        :class:`Compression`, or None; the other fields by name."""
        policy: Compression | None
        if isinstance(compression, str):
            policy = Compression(codec=compression, level=1 if level is None else level)
        elif level is not None:
            raise ValueError("level is given with compression='zstd'")
        else:
            policy = compression
        return cls(compression=policy, **kw)

    def wants(self, nbytes: int) -> bool:
        """Whether a tensor of ``nbytes`` goes to the blob store."""
        return nbytes >= self.min_blob_bytes and nbytes > 0
