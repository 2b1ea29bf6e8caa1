"""sp.copy: one committed checkpoint copied to another place (any store), committed there like a
save, the same checkpoint byte for byte; damage is not spread and a failed copy leaves the
destination as it was."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import savepoint as sp
import savepoint.transfer
from _compare import same


def state(seed: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {
        "w": rng.standard_normal((256, 64)).astype(np.float32),
        "b": rng.standard_normal(64).astype(np.float16),
        "step": seed,
        "nested": {"ids": np.arange(1000, dtype=np.int64), "name": "x"},
    }


def files(path: Path) -> dict[str, bytes]:
    return {
        os.path.relpath(os.path.join(root, f), path): Path(root, f).read_bytes()
        for root, _, names in os.walk(path)
        for f in names
    }


def test_a_local_copy_is_the_same_checkpoint_byte_for_byte(tmp_path: Path) -> None:
    sp.save(tmp_path / "a", state(), max_file_bytes=64 << 10)  # several data files
    info = sp.copy(tmp_path / "a", tmp_path / "b")
    assert info.path.endswith("b")
    assert files(tmp_path / "a") == files(tmp_path / "b")
    assert len(files(tmp_path / "b")) > 2
    same(sp.load(tmp_path / "b"), state())
    sp.verify(tmp_path / "b")


@pytest.mark.parametrize("direction", ["to", "from"])
def test_copies_between_local_disk_and_memory(tmp_path: Path, direction: str) -> None:
    url = f"memory://transfer-{direction}/ckpt"
    if direction == "to":
        sp.save(tmp_path / "a", state(1))
        sp.copy(tmp_path / "a", url)
        same(sp.load(url), state(1))
    else:
        sp.save(url, state(2))
        sp.copy(url, tmp_path / "b")
        same(sp.load(tmp_path / "b"), state(2))
        sp.verify(tmp_path / "b")


def test_copies_to_and_from_an_s3_bucket(tmp_path: Path, s3_bucket: str) -> None:
    sp.save(tmp_path / "a", state(3), max_file_bytes=64 << 10)
    url = f"s3://{s3_bucket}/run/step-3"
    sp.copy(tmp_path / "a", url)
    sp.verify(url)
    same(sp.load(url), state(3))
    sp.copy(url, tmp_path / "back")
    assert files(tmp_path / "a") == files(tmp_path / "back")


def test_a_damaged_source_is_not_copied(tmp_path: Path, flip_byte: Callable[..., None]) -> None:
    sp.save(tmp_path / "a", state())
    flip_byte(tmp_path / "a", "w", 100)
    with pytest.raises(sp.CorruptCheckpointError, match="w"):
        sp.copy(tmp_path / "a", tmp_path / "b")
    assert not (tmp_path / "b").exists()
    assert os.listdir(tmp_path) == ["a"]  # no staging left behind
    sp.copy(tmp_path / "a", tmp_path / "c", verify=False)  # asked for: copied as it is
    with pytest.raises(sp.CorruptCheckpointError):
        sp.verify(tmp_path / "c")


def test_a_failed_copy_leaves_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sp.save(tmp_path / "a", state(5), max_file_bytes=64 << 10)
    sp.save(tmp_path / "b", state(6))
    calls = []

    def failing(*args: Any) -> None:
        calls.append(1)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real(*args)

    real = savepoint.transfer._stream
    monkeypatch.setattr(savepoint.transfer, "_stream", failing)
    with pytest.raises(sp.CheckpointWriteError, match="No space left"):
        sp.copy(tmp_path / "a", tmp_path / "b")
    same(sp.load(tmp_path / "b"), state(6))
    assert sorted(os.listdir(tmp_path)) == ["a", "b"]


def test_what_a_copy_may_replace(tmp_path: Path) -> None:
    sp.save(tmp_path / "a", state(7))
    sp.save(tmp_path / "b", state(8))
    with pytest.raises(sp.CheckpointWriteError, match="overwrite=False"):
        sp.copy(tmp_path / "a", tmp_path / "b", overwrite=False)
    same(sp.load(tmp_path / "b"), state(8))
    sp.copy(tmp_path / "a", tmp_path / "b")  # a committed checkpoint is replaced, like save
    same(sp.load(tmp_path / "b"), state(7))
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "notes.txt").write_text("mine")
    with pytest.raises(sp.CheckpointError):
        sp.copy(tmp_path / "a", tmp_path / "c")
    assert (tmp_path / "c" / "notes.txt").read_text() == "mine"
    with pytest.raises(ValueError, match="onto itself"):
        sp.copy(tmp_path / "a", tmp_path / "a")
    with pytest.raises(sp.CheckpointNotFoundError):
        sp.copy(tmp_path / "missing", tmp_path / "d")
