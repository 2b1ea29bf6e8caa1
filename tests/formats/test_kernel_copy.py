"""The kernel-copy writer of safetensors files (savepoint.formats._kernel_copy): a Hugging Face
export of a local checkpoint copies the bytes with copy_file_range, checks what was written,
falls back to sendfile and then to the staging pipeline, and fails cleanly."""

from __future__ import annotations

import errno
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import savepoint as sp
from savepoint.formats import _files, _kernel_copy
from savepoint.formats.export import export

KiB = 1024


def model() -> dict[str, np.ndarray[Any, Any]]:
    rng = np.random.default_rng(3)
    return {
        "embed": rng.standard_normal(40 * KiB).astype(np.float32),  # 160 KiB
        "a": rng.standard_normal(3000).astype(np.float32),
        "b": rng.standard_normal(777).astype(np.float16),
        "c": np.arange(20 * KiB, dtype=np.int64),
    }


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    sp.save(tmp_path / "ckpt", {"model": model()})
    for p in (tmp_path / "ckpt").iterdir():  # in the page cache (the save wrote O_DIRECT):
        if p.is_file():  # the kernel copies only a cached source (_kernel_copy.cached)
            p.read_bytes()
    return tmp_path / "ckpt"


def _data_start(path: Path) -> int:
    with open(path, "rb") as f:
        return 8 + int(struct.unpack("<Q", f.read(8))[0])


def _same(out: Path) -> None:
    loaded = sp.load(out)
    want = model()
    assert sorted(loaded) == sorted(want)
    assert all(np.array_equal(loaded[k], v) and loaded[k].dtype == v.dtype for k, v in want.items())


def test_runs_join_ranges_that_lie_back_to_back_in_one_file(ckpt: Path) -> None:
    class Src:
        def __init__(self, fd: int, offset: int, nbytes: int) -> None:
            self.file, self.nbytes = (fd, offset), nbytes

        def check(self, view: Any) -> None:
            pass

    sources: list[Any] = [Src(3, 100, 8), Src(3, 108, 0), Src(3, 108, 16), Src(4, 124, 4)]
    sources.append(Src(3, 500, 4))
    assert _kernel_copy.runs(sources) == [(3, 100, 24), (4, 124, 4), (3, 500, 4)]
    assert _kernel_copy.runs([*sources, object()]) is None  # one source in no file: none


def test_a_shard_is_copied_by_the_kernel_page_aligned_with_its_source(
    ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[int, int]] = []
    real = os.copy_file_range

    def spy(src: int, dst: int, count: int, offset: int, position: int) -> int:
        calls.append((offset % 4096, position % 4096))
        return real(src, dst, count, offset, position)

    monkeypatch.setattr(os, "copy_file_range", spy)
    export(ckpt, tmp_path / "hf", hf=True)
    assert calls and all(src == dst for src, dst in calls)  # whole pages for the kernel
    shard = tmp_path / "hf" / "model.safetensors"
    st = pytest.importorskip("safetensors.numpy")
    read = st.load_file(str(shard))  # the padded header is one other readers take
    assert all(np.array_equal(read[k], v) for k, v in model().items())
    _same(tmp_path / "hf")
    # A single-file export keeps the usual 8-byte padding (its bytes are any writer's).
    one = tmp_path / "one.safetensors"
    export(ckpt, one)
    header = one.read_bytes()[8 : _data_start(one)]
    assert len(header) - len(header.rstrip(b" ")) < 8


@pytest.mark.parametrize("refused", ["copy_file_range", "both"])
def test_a_refused_kernel_copy_falls_back(
    ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refused: str
) -> None:
    def no(*args: Any) -> int:
        raise OSError(errno.EXDEV, "cross-device")

    sent: list[int] = []
    real_sendfile = os.sendfile

    def sendfile(*args: Any) -> int:
        if refused == "both":
            raise OSError(errno.EINVAL, "not here")
        sent.append(real_sendfile(*args))
        return sent[-1]

    monkeypatch.setattr(os, "copy_file_range", no)
    monkeypatch.setattr(os, "sendfile", sendfile)
    piped: list[str] = []
    real_write_blob = _files.pipeline.write_blob

    def write_blob(store: Any, path: str, *args: Any, **kwargs: Any) -> Any:
        piped.append(path)
        return real_write_blob(store, path, *args, **kwargs)

    monkeypatch.setattr(_files.pipeline, "write_blob", write_blob)
    export(ckpt, tmp_path / "hf", hf=True, max_shard_size=100 * KiB)
    if refused == "both":
        assert piped and not sent  # the staging pipeline wrote every shard
    else:
        assert sent and not piped
    _same(tmp_path / "hf")


def test_what_is_checked_is_the_written_file(
    ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copy that lands wrong (here: one byte changed after the kernel wrote it) is caught by
    the checks of the new file, and nothing is left behind."""
    real = os.copy_file_range

    def damaging(src: int, dst: int, count: int, offset: int, position: int) -> int:
        n = real(src, dst, count, offset, position)
        os.pwrite(dst, b"\xff", position + n // 2)
        return n

    monkeypatch.setattr(os, "copy_file_range", damaging)
    with pytest.raises(sp.CorruptCheckpointError, match="checksum mismatch"):
        export(ckpt, tmp_path / "hf", hf=True, max_shard_size=100 * KiB)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_a_source_that_ends_early_is_corrupt(
    ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "copy_file_range", lambda *args: 0)
    with pytest.raises(sp.CorruptCheckpointError, match="ended while"):
        export(ckpt, tmp_path / "hf", hf=True)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_a_failed_deferred_fsync_fails_the_export(
    ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fsync(fd: int) -> None:
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(sp.CheckpointWriteError):
        export(ckpt, tmp_path / "hf", hf=True, max_shard_size=100 * KiB)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_the_probe_tells_a_cached_source_from_an_evicted_one(tmp_path: Path) -> None:
    if not hasattr(os, "RWF_NOWAIT"):
        pytest.skip("no RWF_NOWAIT probe on this platform")
    path = tmp_path / "data"
    path.write_bytes(os.urandom(4 << 20))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        span = [(fd, 1 << 20, 3 << 20)]  # past the readahead of a first read
        assert _kernel_copy.cached(span)  # just written through the page cache
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        if _kernel_copy.cached(span):
            pytest.skip("this filesystem keeps the pages (tmpfs) or ignores RWF_NOWAIT")
    finally:
        os.close(fd)


def test_a_source_not_in_the_page_cache_goes_through_the_pipeline(
    ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernel's copy reads a cold source in one synchronous stream (2x a raw copy's time
    at 4 GiB here): an evicted checkpoint is exported by the pipeline's direct reads instead."""
    probed: list[int] = []

    def cold(ranges: Any) -> bool:
        probed.append(len(ranges))
        return False

    copied: list[int] = []
    real = os.copy_file_range

    def spy(*args: Any) -> int:
        copied.append(real(*args))
        return copied[-1]

    monkeypatch.setattr(_kernel_copy, "cached", cold)
    monkeypatch.setattr(os, "copy_file_range", spy)
    export(ckpt, tmp_path / "hf", hf=True)
    assert probed and not copied  # asked, then the pipeline wrote the shard
    _same(tmp_path / "hf")
