"""Shared fixtures: a checkpoint path, and a way to damage one stored tensor's bytes."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest

# Torch and OpenBLAS start a thread per core for each operation. The suite's tensors are tiny and
# it runs on small shared machines (2 cores in CI), where those threads only contend (the demo's
# training took 2.3 x the CPU time with two): one thread, in this process and in every child it
# starts. An explicit OMP_NUM_THREADS wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    """Where a test saves its checkpoint (the parent exists, the path itself does not)."""
    return tmp_path / "ckpt"


def _flip(path: Path, ref: str, offset: int = 0) -> None:
    with open(path / "manifest.json", encoding="utf-8") as f:
        record = json.load(f)["tensors"][ref]
    start, end = record["offsets"]
    assert start + offset < end, f"tensor {ref!r} has no byte {offset} to flip"
    with open(path / record["file"], "r+b") as f:
        f.seek(start + offset)
        byte = f.read(1)
        f.seek(start + offset)
        f.write(bytes([byte[0] ^ 0xFF]))
        f.flush()
        os.fsync(f.fileno())


@pytest.fixture
def flip_byte() -> Callable[..., None]:
    """``flip_byte(checkpoint_dir, ref, offset=0)`` inverts one data byte of the tensor ``ref``."""
    return _flip


# The moto S3 server of the object-store tests (session-scoped) and a fresh bucket per test.
from storage._s3server import s3, s3_bucket  # noqa: E402, F401
