"""The blob store on a real S3-protocol server (moto on loopback, tests/storage/_s3server.py):
blobs are create-only objects, multipart ones included; dedupe, ranges, sessions and collection."""

from __future__ import annotations

import numpy as np
import pytest

from storage import _s3server

pytestmark = pytest.mark.skipif(not _s3server.AVAILABLE, reason=_s3server.SKIP_REASON)

MiB = 1 << 20


def test_blobs_on_s3(s3_bucket: str) -> None:
    from savepoint.blobs import BlobStore, Compression, PutStats, collect
    from savepoint.storage.objectstore import MIN_PART_SIZE, ObjectStore

    store = ObjectStore("s3", part_size=MIN_PART_SIZE)
    blobs = BlobStore(store, f"/{s3_bucket}/run/blobs")
    assert BlobStore.open(f"s3://{s3_bucket}/run/blobs").algorithm == "blake3"
    data = (np.random.default_rng(0).standard_normal(3 * MiB) * 0.01).astype(np.float32)  # 12 MiB
    with blobs.session() as s:
        big = s.put_chunked(data, chunk_size=8 * MiB)  # one multipart blob, one small one
        small = s.put_chunked(data[:1000], chunk_size=4096, compression=Compression())
        s.sync()
        s.check()
    assert blobs.read_recipe(big).tobytes() == data.tobytes()
    raw = data.view(np.uint8)
    got = blobs.read_recipe(big, start=8 * MiB - 10, end=8 * MiB + 10)
    assert got.tobytes() == raw[8 * MiB - 10 : 8 * MiB + 10].tobytes()
    assert blobs.read_recipe(small).tobytes() == data[:1000].tobytes()

    stats = PutStats()
    assert blobs.put_chunked(data, chunk_size=8 * MiB, stats=stats) == big
    assert stats.blobs_written == 0 and stats.blobs_reused == 2

    report = collect(blobs, lambda: set(big.digests), grace=0)
    assert not report.deferred and set(report.deleted) == set(small.digests)
    assert set(blobs.list()) == set(big.digests)
    blobs.verify_recipe(big)
