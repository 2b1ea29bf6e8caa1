"""savepoint.blobs.frame: the blob header, hostile headers, and the zstd codec."""

from __future__ import annotations

import numpy as np
import pytest

from savepoint.blobs import frame
from savepoint.blobs.frame import HEADER, Compression
from savepoint.errors import CorruptCheckpointError, IncompatibleCheckpointError


def test_header_round_trip() -> None:
    head = frame.pack_header(frame.ZSTD, 4, 1000, 600)
    assert len(head) == HEADER
    parsed = frame.parse_header(head, shown="x", blob_size=HEADER + 600, expect_size=1000)
    assert parsed == frame.Header(frame.ZSTD, 4, 1000, 600)


@pytest.mark.parametrize("offset", range(HEADER))
def test_every_flipped_header_byte_is_refused(offset: int) -> None:
    head = bytearray(frame.pack_header(frame.RAW, 0, 10, 10))
    head[offset] ^= 0x40
    with pytest.raises((CorruptCheckpointError, IncompatibleCheckpointError)):
        frame.parse_header(head, shown="x", blob_size=HEADER + 10)


def test_sizes_are_checked_against_the_blob_and_the_caller() -> None:
    head = frame.pack_header(frame.RAW, 0, 10, 10)
    with pytest.raises(CorruptCheckpointError, match="truncated or overwritten"):
        frame.parse_header(head, shown="x", blob_size=HEADER + 9)
    with pytest.raises(CorruptCheckpointError, match="were expected"):
        frame.parse_header(head, shown="x", expect_size=11)
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        frame.parse_header(head[:20], shown="x")
    with pytest.raises(CorruptCheckpointError, match="two sizes"):
        frame.parse_header(frame.pack_header(frame.RAW, 0, 10, 9), shown="x")


def test_a_newer_version_is_incompatible_not_corrupt() -> None:
    import struct

    import xxhash

    head = struct.pack("<4sBBBBQQ", b"SPBL", 2, 0, 0, 0, 1, 1)
    head += struct.pack("<Q", xxhash.xxh3_64_intdigest(head))
    with pytest.raises(IncompatibleCheckpointError, match="Upgrade"):
        frame.parse_header(head, shown="x")


def _round_trip(data: np.ndarray, policy: Compression | None) -> tuple[int, int]:
    view = memoryview(data.reshape(-1).view(np.uint8))
    codec, shuffle, payload = frame.encode(view, policy, data.dtype.itemsize)
    out = np.empty(len(view), np.uint8)
    if codec == frame.RAW:
        assert payload is view  # no copy
        out[:] = np.frombuffer(payload, np.uint8)
    else:
        frame.decode(frame.Header(codec, shuffle, len(view), len(payload)), payload, out, shown="x")
    assert out.tobytes() == view.tobytes()
    return codec, len(payload)


@pytest.mark.parametrize("dtype", ["float32", "float16", "float64", "int8"])
@pytest.mark.parametrize("shuffle", [False, True])
def test_compressed_round_trip(dtype: str, shuffle: bool) -> None:
    data = (np.random.default_rng(0).standard_normal(100_003) * 0.01).astype(dtype)
    _round_trip(data, Compression(shuffle=shuffle, min_saving=0.0, probe=False))


def test_zeros_compress_and_random_bytes_stay_raw() -> None:
    codec, stored = _round_trip(np.zeros(1 << 20, np.float32), Compression())
    assert codec == frame.ZSTD and stored < 1000
    noise = np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8)
    assert _round_trip(noise, Compression())[0] == frame.RAW  # the probe gives up at once
    assert _round_trip(noise, Compression(probe=False))[0] == frame.RAW  # too little saved


def test_min_saving_decides() -> None:
    data = np.random.default_rng(1).standard_normal(1 << 18).astype(np.float32)
    assert _round_trip(data, Compression(min_saving=0.0, probe=False))[0] == frame.ZSTD
    assert _round_trip(data, Compression(min_saving=0.9, probe=False))[0] == frame.RAW


def test_policy_is_checked() -> None:
    with pytest.raises(ValueError, match="unknown compression"):
        Compression(codec="lz4")
    with pytest.raises(ValueError, match="level"):
        Compression(level=0)
    with pytest.raises(ValueError, match="min_saving"):
        Compression(min_saving=1.0)


def test_garbage_payload_is_corrupt() -> None:
    out = np.empty(100, np.uint8)
    with pytest.raises(CorruptCheckpointError, match="decompress"):
        frame.decode(frame.Header(frame.ZSTD, 0, 100, 10), b"0123456789", out, shown="x")
    import zstandard

    short = zstandard.ZstdCompressor().compress(b"a" * 50)
    with pytest.raises(CorruptCheckpointError):
        frame.decode(frame.Header(frame.ZSTD, 0, 100, len(short)), short, out, shown="x")
