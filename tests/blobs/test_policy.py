"""savepoint.blobs.policy: the per-tensor decision and the user-facing arguments."""

from __future__ import annotations

import pytest

from savepoint.blobs import BlobPolicy, Compression


def test_defaults() -> None:
    policy = BlobPolicy()
    assert policy.compression is None and policy.chunk_size == 4 << 20
    assert policy.wants(1 << 20) and not policy.wants((1 << 20) - 1)
    assert not BlobPolicy(min_blob_bytes=0).wants(0)


def test_of() -> None:
    assert BlobPolicy.of("zstd").compression == Compression()
    assert BlobPolicy.of("zstd", level=5).compression == Compression(level=5)
    custom = Compression(level=2, shuffle=False)
    assert BlobPolicy.of(custom, chunk_size=1 << 20).compression is custom
    with pytest.raises(ValueError, match="unknown compression"):
        BlobPolicy.of("lz4")
    with pytest.raises(ValueError, match="level"):
        BlobPolicy.of(None, level=3)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"chunk_size": 100},
        {"chunk_size": 3 << 20},
        {"min_blob_bytes": -1},
        {"workers": 0},
        {"compression": "zstd"},
    ],
)
def test_checked(kwargs: dict) -> None:
    with pytest.raises((ValueError, TypeError)):
        BlobPolicy(**kwargs)
