"""``sp.verify(path, direct=True)`` (engine/_direct.py): every data file streamed once past the
page cache through one reused buffer, each tensor hashed as its bytes go by. Damage anywhere is
found (a tensor inside one read, one spanning reads, an empty one, a BOOL one, either manifest
form), the files are never mapped, and a filesystem that refuses O_DIRECT is read buffered."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import savepoint as sp
from savepoint.engine import _direct
from savepoint.engine import load as load_engine
from savepoint.engine.read import Reader
from savepoint.storage import _local_read


def _state() -> dict[str, Any]:
    rng = np.random.default_rng(7)
    return {
        "big": rng.standard_normal(70_000).astype(np.float32),  # spans several 64 KiB reads
        "small": rng.standard_normal(300).astype(np.float32),
        "empty": np.zeros(0, dtype=np.float32),
        "mask": rng.random(5000) > 0.5,
        "tail": rng.standard_normal(40_000).astype(np.float64),
    }


@pytest.fixture
def ckpt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(_direct, "CHUNK", 64 << 10)  # many reads, tensors across their ends
    monkeypatch.setattr(_direct, "_BUFFER", [])
    path = tmp_path / "ckpt"
    sp.save(path, _state(), max_file_bytes=200_000)  # several data files
    assert len(list(path.glob("*.safetensors"))) > 1
    return path


def _flip(path: Path, tensor: str) -> None:
    with Reader.open(path) as reader:
        rec = reader.manifest.tensors[tensor]
        file, at = path / rec.file, rec.start + (rec.end - rec.start) * 2 // 3
    data = bytearray(file.read_bytes())
    data[at] ^= 0x10
    file.write_bytes(bytes(data))


@pytest.mark.parametrize("columns", [True, False], ids=["table", "records"])
def test_intact_checkpoint_verifies_without_mapping_its_files(
    ckpt: Path, columns: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_map(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a direct verify mapped a data file")

    monkeypatch.setattr(_local_read, "MappedFile", no_map)
    seen: list[int] = []
    with Reader.open(ckpt, columns=columns) as reader:
        load_engine.verify(reader, lambda done, total: seen.append(done), direct=True)
    assert seen[-1] == sum(a.nbytes for a in _state().values())
    sp.verify(ckpt, direct=True)


@pytest.mark.parametrize("tensor", ["big", "small", "tail"])
@pytest.mark.parametrize("columns", [True, False], ids=["table", "records"])
def test_a_flipped_bit_is_found_naming_the_tensor(ckpt: Path, tensor: str, columns: bool) -> None:
    _flip(ckpt, tensor)
    with Reader.open(ckpt, columns=columns) as reader:
        with pytest.raises(
            sp.CorruptCheckpointError, match=f"checksum mismatch in tensor '{tensor}'"
        ):
            load_engine.verify(reader, None, direct=True)


def test_a_filesystem_refusing_o_direct_is_read_buffered(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_direct, "_O_DIRECT", 0)
    sp.verify(ckpt, direct=True)
    _flip(ckpt, "big")
    with pytest.raises(sp.CorruptCheckpointError, match="'big'"):
        sp.verify(ckpt, direct=True)


def test_o_direct_refused_at_the_read_falls_back(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno
    import os

    real = os.preadv
    direct: set[int] = set()
    opened = _direct._open

    def tracking(fd: int) -> int | None:
        got = opened(fd)
        if got is not None:
            direct.add(got)
        return got

    def refusing(fd: int, buffers: Any, offset: int) -> int:
        if fd in direct:
            raise OSError(errno.EINVAL, "refused")
        return real(fd, buffers, offset)

    monkeypatch.setattr(_direct, "_open", tracking)
    monkeypatch.setattr(os, "preadv", refusing)
    _flip(ckpt, "tail")
    with pytest.raises(sp.CorruptCheckpointError, match="'tail'"):
        sp.verify(ckpt, direct=True)
    if not direct:
        pytest.skip("this filesystem refuses O_DIRECT at the open: the fallback above ran")
