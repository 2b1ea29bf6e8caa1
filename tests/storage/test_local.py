"""savepoint.storage.local: the streaming writer (direct and buffered), its fallbacks and error
paths, and the hostile-safe reading helpers."""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import _privileges
from savepoint.codecs import checksum
from savepoint.errors import CheckpointError, CheckpointPermissionError, CorruptCheckpointError
from savepoint.state.arrays import NumpySource
from savepoint.storage import local

BUF = 8192
RNG = np.random.default_rng(1234)


def rand_bytes(n: int) -> np.ndarray:
    return RNG.integers(0, 256, n, dtype=np.uint8)


def tiny_pool() -> local.StagingPool:
    return local.StagingPool(BUF, 2)


def write(
    path: Path,
    header: bytes,
    arrays: list[np.ndarray],
    *,
    direct: bool,
    pool: local.StagingPool | None = None,
) -> tuple[list[str], list[int]]:
    progress: list[int] = []
    digests = local.write_file(
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


def check_file(path: Path, header: bytes, arrays: list[np.ndarray], digests: list[str]) -> None:
    image = expected_image(header, arrays)
    assert path.stat().st_size == len(image)
    assert path.read_bytes() == image
    assert digests == [checksum.digest(np.ascontiguousarray(a).tobytes()) for a in arrays]


# ---------------------------------------------------------------------------------------------
# write_file: sizes around buffer and block boundaries
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
def test_write_file_image_and_checksums(
    tmp_path: Path, sizes: list[int], header_len: int, direct: bool
) -> None:
    header = bytes(rand_bytes(header_len))
    arrays = [rand_bytes(n) for n in sizes]
    path = tmp_path / "data.safetensors"
    digests, progress = write(path, header, arrays, direct=direct)
    check_file(path, header, arrays, digests)
    assert sum(progress) == sum(sizes)  # tensor bytes: the header is not part of the total
    assert all(p > 0 for p in progress)


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
@pytest.mark.parametrize("total", [0, 1, 4095, 4096, 4097, 3 * 4096, BUF * 5 + 1])
def test_write_file_default_pool(tmp_path: Path, total: int, direct: bool) -> None:
    header = b"\x08\x00\x00\x00\x00\x00\x00\x00{}      "
    arrays = [rand_bytes(total)]
    path = tmp_path / "f"
    digests = local.write_file(str(path), header, [NumpySource(arrays[0], "k")], direct=direct)
    check_file(path, header, arrays, digests)


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
def test_write_file_mixed_sources(tmp_path: Path, direct: bool) -> None:
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
def test_write_file_torch_sources(tmp_path: Path, direct: bool) -> None:
    torch = pytest.importorskip("torch")
    from savepoint.state._torch import TorchSource

    ts = [
        torch.arange(5000, dtype=torch.float32).reshape(50, 100)[:, ::2],
        torch.arange(3000, dtype=torch.bfloat16),
        torch.arange(4097, dtype=torch.int8),
    ]
    header = bytes(rand_bytes(8))
    digests = local.write_file(
        str(tmp_path / "f"),
        header,
        [TorchSource(t, "k") for t in ts],
        pool=tiny_pool(),
        direct=direct,
    )
    arrays = [t.contiguous().reshape(-1).view(torch.uint8).numpy() for t in ts]
    check_file(tmp_path / "f", header, arrays, digests)


def test_write_file_is_really_direct_when_asked(
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
# write_file: fallbacks and errors
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
def test_write_error_in_the_writer_thread_is_raised(
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
    # nothing is written after the error, and the writer thread is gone
    assert count["n"] == fail_at
    assert not [t for t in threading.enumerate() if t.ident not in before and t.is_alive()]


def test_zero_byte_write_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_write = os.write

    def fake_write(fd: int, data: Any) -> int:
        return 0 if _writer_thread() else real_write(fd, data)

    monkeypatch.setattr(os, "write", fake_write)
    with pytest.raises(OSError) as info:
        write(tmp_path / "f", b"12345678", [rand_bytes(10)], direct=False)
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
        local.write_file(str(tmp_path / "f"), b"12345678", [Broken()], pool=tiny_pool())  # type: ignore[list-item]
    assert Broken.released
    assert not [t for t in threading.enumerate() if t.ident not in before and t.is_alive()]


# ---------------------------------------------------------------------------------------------
# StagingPool
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("size", "count"), [(0, 2), (4095, 2), (4097, 2), (-4096, 2), (4096, 1)])
def test_staging_pool_validation(size: int, count: int) -> None:
    with pytest.raises(ValueError):
        local.StagingPool(size, count)


def test_staging_pool_reuse() -> None:
    pool = local.StagingPool(BUF, 3)
    with pool.acquire(BUF * 10) as first:
        assert len(first) == 3
        assert all(len(b.array) == BUF for b in first)
        for b in first:
            assert b.array.ctypes.data % 4096 == 0  # page-aligned for O_DIRECT
    with pool.acquire(BUF * 10) as second:
        assert [id(b) for b in second] == [id(b) for b in first]
        with pool.acquire(BUF * 10) as third:  # concurrent user: its own set
            assert {id(b) for b in third}.isdisjoint(id(b) for b in second)
    # small requests get small temporary buffers and leave the pool alone
    with pool.acquire(100) as small:
        assert len(small) == 2
        assert all(len(b.array) == 4096 * 2 for b in small)
        assert not {id(b) for b in small} & {id(b) for b in first}
    with pool.acquire(0) as empty:
        assert all(len(b.array) == 4096 for b in empty)
    pool.clear()
    with pool.acquire(BUF * 10) as after_clear:
        assert not {id(b) for b in after_clear} & {id(b) for b in first}


# ---------------------------------------------------------------------------------------------
# small files, directories
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, 4096, 100_000])
def test_write_small(tmp_path: Path, n: int) -> None:
    data = bytes(rand_bytes(n))
    local.write_small(str(tmp_path / "m"), data)
    assert (tmp_path / "m").read_bytes() == data
    with pytest.raises(FileExistsError):
        local.write_small(str(tmp_path / "m"), b"other")
    assert (tmp_path / "m").read_bytes() == data


def test_fsync_dir(tmp_path: Path) -> None:
    local.fsync_dir(str(tmp_path))


# ---------------------------------------------------------------------------------------------
# reading
# ---------------------------------------------------------------------------------------------


def test_open_read_regular_file(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"0123456789")
    fd = local.open_read(str(tmp_path / "f"))
    try:
        assert local.read_exact(fd, 2, 5) == b"23456"
        assert local.read_exact(fd, 0, 0) == b""
        assert local.read_exact(fd, 10, 0) == b""
        with pytest.raises(EOFError, match="wanted 5 bytes at 8"):
            local.read_exact(fd, 8, 5)
        with pytest.raises(EOFError):
            local.read_exact(fd, 100, 1)
    finally:
        os.close(fd)


@pytest.mark.parametrize("dangling", [False, True], ids=["to-file", "dangling"])
def test_open_read_refuses_symlinks(tmp_path: Path, dangling: bool) -> None:
    real = tmp_path / "real"
    if not dangling:
        real.write_bytes(b"secret")
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(local.SymlinkError) as info:
        local.open_read(str(link))
    # A CheckpointError the caller may let escape, with what callers used to read off OSError.
    assert isinstance(info.value, CorruptCheckpointError)
    assert not isinstance(info.value, OSError)
    assert info.value.errno == errno.ELOOP
    assert info.value.filename == str(link)
    assert info.value.strerror == "is a symlink"
    assert info.value.path == str(link)
    assert str(info.value) == f"{link} is a symlink; refusing to follow it"


def test_open_read_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        local.open_read(str(tmp_path / "missing"))
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(FileNotFoundError):  # a path through a non-directory is missing too
        local.open_read(str(tmp_path / "file" / "inner"))


def test_open_read_refuses_directories_fifos_and_sockets_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    sock_path = tmp_path / "sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(sock_path))
    outcome: dict[str, Any] = {}

    def attempt() -> None:
        for name, p in (("dir", tmp_path), ("fifo", fifo), ("socket", sock_path)):
            try:
                fd = local.open_read(str(p))
            except Exception as exc:
                outcome[name] = exc
            else:  # pragma: no cover - the failure case
                os.close(fd)
                outcome[name] = "opened"

    try:
        t = threading.Thread(target=attempt, daemon=True)
        t.start()
        t.join(10)
    finally:
        sock.close()
    assert not t.is_alive(), "open_read blocked on a FIFO"
    for name, p in (("dir", tmp_path), ("fifo", fifo), ("socket", sock_path)):
        exc = outcome.get(name)
        # Before: NotRegularFileError was a bare OSError, which escaped public entry points.
        assert isinstance(exc, local.NotRegularFileError), f"{name}: {exc!r}"
        assert isinstance(exc, CorruptCheckpointError) and not isinstance(exc, OSError)
        assert "is not a regular file" in str(exc) and str(p) in str(exc)
        assert exc.strerror == "is not a regular file" and exc.filename == str(p)


def test_open_read_through_a_directory_descriptor_names_the_file(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo")
    dir_fd = local.open_dir(str(tmp_path))
    assert dir_fd is not None
    try:
        with pytest.raises(local.NotRegularFileError) as info:
            local.open_read("fifo", dir_fd=dir_fd)
        assert info.value.path == str(tmp_path / "fifo")  # not just "fifo"
        with pytest.raises(local.NotRegularFileError) as info:
            local.open_read("fifo", dir_fd=dir_fd, shown="the fifo")
        assert info.value.path == "the fifo"
    finally:
        os.close(dir_fd)


def _permission_outcomes(file: str, directory: str) -> dict[str, Any]:
    """What open_read and open_dir raise on unreadable things (run unprivileged)."""
    out: dict[str, Any] = {}
    for name, call in (
        ("open_read", lambda: local.open_read(file)),
        ("open_dir", lambda: local.open_dir(directory)),
    ):
        try:
            os.close(call())  # type: ignore[arg-type]
        except CheckpointPermissionError as exc:
            out[name] = {
                "permission": isinstance(exc, PermissionError),
                "errno": exc.errno,
                "path": exc.path,
                "message": str(exc),
            }
        except Exception as exc:
            out[name] = repr(exc)
        else:
            out[name] = "opened"
    return out


def test_open_read_and_open_dir_map_permission_errors() -> None:
    # Before: a raw PermissionError from both.
    with _privileges.workspace() as root:
        file, directory = root / "f", root / "d"
        file.write_bytes(b"data")
        directory.mkdir()
        with _privileges.unreadable(file), _privileges.unreadable(directory):
            got = _privileges.call_unprivileged(_permission_outcomes, str(file), str(directory))
    assert got.ok, str(got)
    for name, path in (("open_read", file), ("open_dir", directory)):
        outcome = got.value[name]
        assert isinstance(outcome, dict), f"{name}: {outcome}"
        assert outcome["permission"] and outcome["errno"] == errno.EACCES
        assert outcome["path"] == str(path)
        assert "permission denied" in outcome["message"].lower()


def test_open_read_other_failures_are_checkpoint_errors(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="cannot open") as info:
        local.open_read(str(tmp_path / ("x" * 300)))  # ENAMETOOLONG
    assert type(info.value) is CheckpointError
    assert isinstance(info.value.__cause__, OSError)


def test_mapped_file_slices(tmp_path: Path) -> None:
    data = bytes(rand_bytes(10_000))
    (tmp_path / "f").write_bytes(data)
    fd = local.open_read(str(tmp_path / "f"))
    try:
        m = local.MappedFile(fd, len(data))
    finally:
        os.close(fd)  # the mapping outlives the descriptor
    for start, end in [
        (0, 0),
        (0, 1),
        (8, 4096),
        (4095, 4097),
        (9_999, 10_000),
        (0, 10_000),
        (5, 5),
    ]:
        s = m.slice(start, end)
        assert s.dtype == np.uint8
        assert s.tobytes() == data[start:end]
    s = m.slice(100, 200)
    assert not s.flags.writeable
    with pytest.raises(ValueError):
        s[0] = 1
    m.close()
    assert s.tobytes() == data[100:200]  # a live slice keeps the mapping usable


def test_mapped_file_copy_on_write(tmp_path: Path) -> None:
    data = bytes(rand_bytes(5000))
    (tmp_path / "f").write_bytes(data)
    fd = local.open_read(str(tmp_path / "f"))
    try:
        m = local.MappedFile(fd, len(data), copy_on_write=True)
    finally:
        os.close(fd)
    s = m.slice(10, 20)
    s[:] = 0  # private: allowed, and the file is untouched
    assert m.slice(10, 20).tobytes() == b"\x00" * 10
    m.close()
    assert (tmp_path / "f").read_bytes() == data
    assert s.tobytes() == b"\x00" * 10
