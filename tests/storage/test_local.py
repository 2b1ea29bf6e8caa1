"""savepoint.storage.local: small files, directory syncs and the hostile-safe reading helpers (the
streaming writer is tested with the engine, tests/engine/test_pipeline.py)."""

from __future__ import annotations

import errno
import os
import socket
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import _privileges
from savepoint.errors import CheckpointError, CheckpointPermissionError, CorruptCheckpointError
from savepoint.storage import local

RNG = np.random.default_rng(1234)


def rand_bytes(n: int) -> np.ndarray:
    return RNG.integers(0, 256, n, dtype=np.uint8)


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
