"""Async saves of CUDA state: the state at save() return, freed tensors, one pinned arena.

Marked ``cuda``: skipped without a CUDA device. The checks are in ``_gpu.py`` and run on the CPU
too (``test_twins_on_cpu.py``).
"""

from __future__ import annotations

from pathlib import Path

import _gpu
import pytest

torch = _gpu.torch

pytestmark = [
    pytest.mark.torch,
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_thousands_of_updates_right_after_save_never_reach_the_checkpoint(tmp_path: Path) -> None:
    _gpu.check_async_captures_state_at_return(tmp_path, "cuda", saves=4, rounds=1000, mib=64)


def test_tensors_freed_right_after_save_are_still_saved(tmp_path: Path) -> None:
    _gpu.check_async_survives_freed_tensors(tmp_path, "cuda", mib=64)


def test_one_pinned_arena_for_a_hundred_saves(tmp_path: Path) -> None:
    _gpu.check_arena_reused(tmp_path, "cuda", saves=100, mib=4)


def test_the_writer_process_stages_cuda_state_at_return(tmp_path: Path) -> None:
    # The shared arena, registered with cudaHostRegister: copies as for the thread writer.
    _gpu.check_async_captures_state_at_return(
        tmp_path, "cuda", saves=3, rounds=500, mib=64, writer="process"
    )


def test_the_writer_process_saves_tensors_freed_right_after_save(tmp_path: Path) -> None:
    _gpu.check_async_survives_freed_tensors(tmp_path, "cuda", mib=64, writer="process")
