"""savepoint.engine.pipeline: the streaming writer (direct and buffered, on any store), its
fallbacks and error paths, the reusable staging buffers, and file images written in place."""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from savepoint.codecs import checksum
from savepoint.engine import pipeline
from savepoint.state.arrays import NumpySource
from savepoint.storage import local
from savepoint.storage.base import Store
from savepoint.storage.memory import MemoryStore

BUF = 8192
RNG = np.random.default_rng(1234)


def rand_bytes(n: int) -> np.ndarray:
    return RNG.integers(0, 256, n, dtype=np.uint8)


def tiny_pool() -> pipeline.StagingPool:
    return pipeline.StagingPool(BUF, 2)


def write(
    path: Path,
    header: bytes,
    arrays: list[np.ndarray],
    *,
    direct: bool,
    pool: pipeline.StagingPool | None = None,
    store: Store = local.STORE,
) -> tuple[list[checksum.Digest], list[int]]:
    progress: list[int] = []
    digests = pipeline.write_blob(
        store,
        str(path),
        header,
        [NumpySource(a, f"t{i}") for i, a in enumerate(arrays)],
        pool=pool or tiny_pool(),
        direct=direct,
        progress=progress.append,
    )
    return digests, progress


def expected_image(header: bytes, arrays: list[np.ndarray]) -> bytes:
    return header + b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)


def check_file(
    path: Path, header: bytes, arrays: list[np.ndarray], digests: list[checksum.Digest]
) -> None:
    image = expected_image(header, arrays)
    assert path.stat().st_size == len(image)
    assert path.read_bytes() == image
    assert digests == [checksum.of(np.ascontiguousarray(a).tobytes()) for a in arrays]


# ---------------------------------------------------------------------------------------------
# write_blob: sizes around buffer and block boundaries
# ---------------------------------------------------------------------------------------------

SIZE_LISTS = [
    [],
    [0],
    [1],
    [4095],
    [4096],
    [4097],
    [BUF - 8],  # with an 8-byte header: exactly one full buffer
    [BUF - 7],
    [BUF],
    [BUF + 1],
    [2 * BUF],
    [3 * BUF + 5],
    [0, 4095, 1, 0, BUF, BUF + 1, 3],
    [20_000, 20_000, 0],
    [4096] * 6,
]


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
@pytest.mark.parametrize("header_len", [8, 4088, BUF, BUF + 8])
@pytest.mark.parametrize("sizes", SIZE_LISTS, ids=lambda s: "-".join(map(str, s)) or "none")
def test_write_blob_image_and_checksums(
    tmp_path: Path, sizes: list[int], header_len: int, direct: bool
) -> None:
    header = bytes(rand_bytes(header_len))
    arrays = [rand_bytes(n) for n in sizes]
    path = tmp_path / "data.safetensors"
    digests, progress = write(path, header, arrays, direct=direct)
    check_file(path, header, arrays, digests)
    assert sum(progress) == sum(sizes)  # tensor bytes: the header is not part of the total
    assert all(p > 0 for p in progress)


M = checksum.MIN_BLOCK


@pytest.mark.parametrize(
    "sizes", [[2 * M], [2 * M + 1], [3 * M - 1, 7], [256 * M + 4097], [1, 5 * M, 3 * M]]
)
def test_write_blob_block_checksums(sizes: list[int]) -> None:
    """``blocked``: a source over two minimum blocks gets one digest per block, whatever the
    staging buffers' size, and its xxh3 combines them (what a sharded save records)."""
    store = MemoryStore()
    store.makedirs("/d")
    arrays = [rand_bytes(n) for n in sizes]
    digests = pipeline.write_blob(
        store,
        "/d/f",
        b"h" * 8,
        [NumpySource(a, f"t{i}") for i, a in enumerate(arrays)],
        pool=tiny_pool(),
        blocked=True,
    )
    for a, d in zip(arrays, digests):
        block = checksum.block_size(len(a))
        assert d == checksum.of(a.tobytes(), block)
        if block:
            assert len(d.blocks) == -(-len(a) // block) <= checksum.MAX_BLOCKS
            assert d.blocks[0] == checksum.digest(a[:block].tobytes())
            assert d.xxh3 == checksum.combine(d.blocks) != checksum.digest(a.tobytes())
        else:
            assert d.blocks == () and d.xxh3 == checksum.digest(a.tobytes())
    most = checksum.MAX_BLOCKS
    assert most == 1024
    assert [checksum.block_size(n) for n in (2 * M, 2 * M + 1, most * M, most * M + 1)] == [
        0,
        M,
        M,
        2 * M,
    ]


@pytest.mark.parametrize("sizes", [[], [1], [BUF - 8], [3 * BUF + 5], [0, 4095, 1, BUF + 1]])
def test_write_blob_into_memory(sizes: list[int]) -> None:
    store = MemoryStore()
    store.makedirs("/d")
    header = bytes(rand_bytes(8))
    arrays = [rand_bytes(n) for n in sizes]
    digests, progress = write(Path("/d/f"), header, arrays, direct=True, store=store)
    assert store.read_small("/d/f", cap=None) == expected_image(header, arrays)
    assert digests == [checksum.of(a.tobytes()) for a in arrays]
    assert sum(progress) == sum(sizes)


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
@pytest.mark.parametrize("total", [0, 1, 4095, 4096, 4097, 3 * 4096, BUF * 5 + 1])
def test_write_blob_default_pool(tmp_path: Path, total: int, direct: bool) -> None:
    header = b"\x08\x00\x00\x00\x00\x00\x00\x00{}      "
    arrays = [rand_bytes(total)]
    path = tmp_path / "f"
    digests = pipeline.write_blob(
        local.STORE, str(path), header, [NumpySource(arrays[0], "k")], direct=direct
    )
    check_file(path, header, arrays, digests)


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
def test_write_blob_mixed_sources(tmp_path: Path, direct: bool) -> None:
    base = np.arange(3000, dtype=np.float64).reshape(60, 50)
    arrays = [
        base[:, ::3],  # non-contiguous
        base.T,  # transposed
        np.arange(5000, dtype=">i4"),  # big-endian: stored little-endian
        np.zeros((0, 7), dtype=np.float32),  # empty
        np.array(3.5, dtype=np.float16),  # 0-d
        (np.arange(4099) % 2).astype(bool),
    ]
    header = bytes(rand_bytes(24))
    digests, _ = write(tmp_path / "f", header, arrays, direct=direct)
    little = [
        a.astype(a.dtype.newbyteorder("<")) if a.dtype.byteorder == ">" else a for a in arrays
    ]
    check_file(tmp_path / "f", header, little, digests)


@pytest.mark.torch
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
def test_write_blob_torch_sources(tmp_path: Path, direct: bool) -> None:
    torch = pytest.importorskip("torch")
    from savepoint.state.torch_tensors import TorchSource

    ts = [
        torch.arange(5000, dtype=torch.float32).reshape(50, 100)[:, ::2],
        torch.arange(3000, dtype=torch.bfloat16),
        torch.arange(4097, dtype=torch.int8),
    ]
    header = bytes(rand_bytes(8))
    digests = pipeline.write_blob(
        local.STORE,
        str(tmp_path / "f"),
        header,
        [TorchSource(t, "k") for t in ts],
        pool=tiny_pool(),
        direct=direct,
    )
    arrays = [t.contiguous().reshape(-1).view(torch.uint8).numpy() for t in ts]
    check_file(tmp_path / "f", header, arrays, digests)


def test_write_blob_is_really_direct_when_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    flags_seen: list[int] = []
    real_open = os.open

    def spy(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        flags_seen.append(flags)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", spy)
    header = bytes(rand_bytes(8))
    write(tmp_path / "d", header, [rand_bytes(100)], direct=True)
    assert flags_seen and flags_seen[0] & os.O_DIRECT  # ext4/xfs accept O_DIRECT
    flags_seen.clear()
    write(tmp_path / "b", header, [rand_bytes(100)], direct=False)
    assert flags_seen and not flags_seen[0] & os.O_DIRECT


# ---------------------------------------------------------------------------------------------
# write_blob: fallbacks and errors
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sizes", [[1], [4097], [3 * BUF + 5]], ids=str)
def test_o_direct_refused_at_open_falls_back_to_buffered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sizes: list[int]
) -> None:
    calls: list[int] = []
    real_open = os.open

    def fake_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        calls.append(flags)
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "O_DIRECT not supported here", path)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", fake_open)
    header = bytes(rand_bytes(8))
    arrays = [rand_bytes(n) for n in sizes]
    path = tmp_path / "f"
    digests, _ = write(path, header, arrays, direct=True)
    monkeypatch.undo()
    assert len(calls) == 2
    assert calls[0] & os.O_DIRECT
    assert not calls[1] & os.O_DIRECT
    check_file(path, header, arrays, digests)


def test_other_open_errors_are_not_swallowed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fake_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        raise OSError(errno.EACCES, "denied", path)

    monkeypatch.setattr(os, "open", fake_open)
    with pytest.raises(PermissionError):
        write(tmp_path / "f", b"12345678", [rand_bytes(10)], direct=True)


def test_existing_file_is_not_overwritten(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"keep me")
    with pytest.raises(FileExistsError):
        write(path, b"12345678", [rand_bytes(10)], direct=True)
    assert path.read_bytes() == b"keep me"


def _writer_thread() -> bool:
    return threading.current_thread().name == "savepoint-writer"


def test_einval_on_a_direct_write_switches_to_buffered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_write = os.write
    state = {"failed": 0, "direct_after": None}

    def fake_write(fd: int, data: Any) -> int:
        if _writer_thread():
            is_direct = bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)
            if state["failed"] == 0 and is_direct:
                state["failed"] = 1
                raise OSError(errno.EINVAL, "direct write refused")
            if state["failed"]:
                state["direct_after"] = is_direct
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", fake_write)
    header = bytes(rand_bytes(8))
    arrays = [rand_bytes(3 * BUF + 17), rand_bytes(5)]
    path = tmp_path / "f"
    digests, _ = write(path, header, arrays, direct=True)
    monkeypatch.undo()
    assert state == {"failed": 1, "direct_after": False}
    check_file(path, header, arrays, digests)


@pytest.mark.parametrize("fail_at", [1, 2, 4])
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
def test_write_error_in_the_writer_thread_is_raised_and_the_blob_aborted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fail_at: int, direct: bool
) -> None:
    real_write = os.write
    count = {"n": 0}

    def fake_write(fd: int, data: Any) -> int:
        if _writer_thread():
            count["n"] += 1
            if count["n"] == fail_at:
                raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", fake_write)
    before = {t.ident for t in threading.enumerate()}
    with pytest.raises(OSError) as info:
        write(tmp_path / "f", bytes(rand_bytes(8)), [rand_bytes(6 * BUF)], direct=direct)
    assert info.value.errno == errno.ENOSPC
    # nothing is written after the error, the writer thread is gone, and so is the blob
    assert count["n"] == fail_at
    assert not [t for t in threading.enumerate() if t.ident not in before and t.is_alive()]
    assert not (tmp_path / "f").exists()


def test_zero_byte_write_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_write = os.write

    def fake_write(fd: int, data: Any) -> int:
        return 0 if _writer_thread() else real_write(fd, data)

    monkeypatch.setattr(os, "write", fake_write)
    with pytest.raises(OSError) as info:
        write(tmp_path / "f", b"12345678", [rand_bytes(2 * BUF + 10)], direct=False)
    assert info.value.errno == errno.EIO


def test_a_file_that_fits_one_buffer_is_written_without_a_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing to overlap: no writer thread is started (a small save paid 0.1-3 ms for one),
    and a zero-byte write on the caller's thread is the same error."""
    real_write = os.write
    threads: list[str] = []

    def fake_write(fd: int, data: Any) -> int:
        threads.append(threading.current_thread().name)
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", fake_write)
    header = bytes(rand_bytes(8))
    arrays = [rand_bytes(1000), rand_bytes(17)]
    digests, _ = write(tmp_path / "f", header, arrays, direct=False)
    assert threads and "savepoint-writer" not in threads
    check_file(tmp_path / "f", header, arrays, digests)
    monkeypatch.setattr(os, "write", lambda fd, data: 0)
    with pytest.raises(OSError) as info:
        write(tmp_path / "g", header, arrays, direct=False)
    assert info.value.errno == errno.EIO


def test_short_writes_are_continued(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_write = os.write

    def fake_write(fd: int, data: Any) -> int:
        if _writer_thread():
            return real_write(fd, bytes(memoryview(data)[:1000]))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", fake_write)
    header = bytes(rand_bytes(8))
    arrays = [rand_bytes(2 * BUF + 3)]
    digests, _ = write(tmp_path / "f", header, arrays, direct=False)
    monkeypatch.undo()
    check_file(tmp_path / "f", header, arrays, digests)


def test_error_in_a_source_is_raised_and_the_writer_stops(tmp_path: Path) -> None:
    class Broken:
        dtype = NumpySource(np.zeros(1, np.uint8), "x").dtype
        shape = (5 * BUF,)
        nbytes = 5 * BUF
        kind = "numpy"
        released = False

        def identity(self) -> None:
            return None

        def copy_to(self, dst: np.ndarray, start: int) -> None:
            if start >= 2 * BUF:
                raise RuntimeError("device lost")
            dst[:] = 1

        def release(self) -> None:
            Broken.released = True

    before = {t.ident for t in threading.enumerate()}
    with pytest.raises(RuntimeError, match="device lost"):
        pipeline.write_blob(
            local.STORE,
            str(tmp_path / "f"),
            b"12345678",
            [Broken()],  # type: ignore[list-item]
            pool=tiny_pool(),
        )
    assert Broken.released
    assert not [t for t in threading.enumerate() if t.ident not in before and t.is_alive()]
    assert not (tmp_path / "f").exists()


# ---------------------------------------------------------------------------------------------
# write_image
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 4097, 3 * BUF + 5])
@pytest.mark.parametrize("chunk", [4096, 1 << 20])
def test_write_image(tmp_path: Path, size: int, direct: bool, chunk: int) -> None:
    rounded = -(-size // 4096) * 4096
    image = np.frombuffer(mmap.mmap(-1, max(rounded, 4096)), dtype=np.uint8)
    image[:size] = rand_bytes(size)
    for store, path in ((local.STORE, str(tmp_path / "f")), (MemoryStore(), "/f")):
        pipeline.write_image(store, path, image, size, direct=direct, chunk=chunk)
        assert store.read_small(path, cap=None) == image[:size].tobytes()


# ---------------------------------------------------------------------------------------------
# StagingPool
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("size", "count"), [(0, 2), (4095, 2), (4097, 2), (-4096, 2), (4096, 1)])
def test_staging_pool_validation(size: int, count: int) -> None:
    with pytest.raises(ValueError):
        pipeline.StagingPool(size, count)


def test_staging_pool_reuse() -> None:
    pool = pipeline.StagingPool(BUF, 3)
    with pool.acquire(BUF * 10) as first:
        assert len(first) == 3
        assert all(len(b.array) == BUF for b in first)
        for b in first:
            assert b.array.ctypes.data % 4096 == 0  # page-aligned for O_DIRECT
    with pool.acquire(BUF * 10) as second:
        assert [id(b) for b in second] == [id(b) for b in first]
        with pool.acquire(BUF * 10) as third:  # concurrent user: its own set
            assert {id(b) for b in third}.isdisjoint(id(b) for b in second)
    # small requests get a set of two buffers of their size class (a power of two, at least
    # 64 KiB, at most the pool's), kept for the next small save of that class
    with pool.acquire(100) as small:
        assert len(small) == 2
        assert all(len(b.array) == min(64 << 10, BUF) for b in small)
        assert not {id(b) for b in small} & {id(b) for b in first}
    with pool.acquire(0) as again:
        assert [id(b) for b in again] == [id(b) for b in small]
    big = pipeline.StagingPool(32 << 20, 2)
    with big.acquire(3 << 20) as a:
        assert all(len(b.array) == 4 << 20 for b in a)
    with big.acquire(3 << 20) as b:
        assert [id(x) for x in b] == [id(x) for x in a]
    with big.acquire(5 << 20), big.acquire(9 << 20):
        pass
    assert sorted(big._small) == [8 << 20, 16 << 20]  # the two largest classes are kept
    pool.clear()
    with pool.acquire(BUF * 10) as after_clear:
        assert not {id(b) for b in after_clear} & {id(b) for b in first}
