"""The CUDA tests' checks, run on the CPU: a mistake in a check fails in every suite run instead
of on the GPU machine (lent for minutes). Not marked ``cuda``; each twin names its CUDA test."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import _gpu
import _runs
import pytest

pytestmark = pytest.mark.torch


def test_roundtrip(ckpt: Path) -> None:
    _gpu.check_roundtrip(ckpt, "cpu")


def test_tied_module(ckpt: Path) -> None:
    _gpu.check_tied_module(ckpt, "cpu")


def test_corrupt_device_load(ckpt: Path, flip_byte: Callable[..., None]) -> None:
    _gpu.check_corrupt_device_load(ckpt, "cpu", flip_byte)


def test_device_paths_every_dtype(
    tmp_path: Path, flip_byte: Callable[..., None], monkeypatch: pytest.MonkeyPatch
) -> None:
    from savepoint.async_ import staging
    from savepoint.engine import device
    from savepoint.state import torch_tensors

    # The switches under which the CPU runs the device paths (tests/engine/test_device_fill.py).
    monkeypatch.setattr(staging, "DEVICE_HASH_CPU", True)
    monkeypatch.setattr(device, "CPU_TARGETS", True)
    monkeypatch.setattr(torch_tensors, "CPU_AS_DEVICE", True)
    monkeypatch.setattr(device, "PIECE", 8 * 65536)  # "multi": 2 pieces + 12345 bytes >= 1 MiB
    _gpu.check_device_paths_every_dtype(tmp_path, "cpu", flip_byte)


def test_save_with_several_writers(ckpt: Path) -> None:
    _gpu.check_save_orders_after_the_current_stream(ckpt, "cpu")


def test_device_load_memory(ckpt: Path) -> None:
    _gpu.check_device_load_memory(ckpt, "cpu", mib=128)


def test_async_captures_state_at_return(tmp_path: Path) -> None:
    _gpu.check_async_captures_state_at_return(tmp_path, "cpu", saves=2, rounds=20, mib=2)


def test_async_survives_freed_tensors(tmp_path: Path) -> None:
    _gpu.check_async_survives_freed_tensors(tmp_path, "cpu", mib=2)


def test_async_process_writer_captures_state_at_return(tmp_path: Path) -> None:
    _gpu.check_async_captures_state_at_return(
        tmp_path, "cpu", saves=2, rounds=20, mib=2, writer="process"
    )


def test_arena_reused(tmp_path: Path) -> None:
    _gpu.check_arena_reused(tmp_path, "cpu", saves=20, mib=1)


@pytest.mark.slow
def test_resume_after_kill(tmp_path: Path) -> None:
    _runs.check_resume_after_kill(tmp_path, "cpu", steps=12, kill_at=7)


@pytest.mark.slow
def test_process_groups(tmp_path: Path) -> None:
    _runs.check_process_groups(tmp_path, "cpu")
