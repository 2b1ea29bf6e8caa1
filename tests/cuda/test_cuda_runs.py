"""CUDA training runs in subprocesses: exact resume after SIGKILL, an NCCL group beside gloo.

Marked ``cuda``: skipped without a CUDA device. ``test_twins_on_cpu.py`` runs the same scripts
on the CPU (backend gloo).
"""

from __future__ import annotations

from pathlib import Path

import _gpu
import _runs
import pytest

torch = _gpu.torch

pytestmark = [
    pytest.mark.torch,
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_a_cuda_run_with_dropout_resumes_exactly_after_sigkill(tmp_path: Path) -> None:
    _runs.check_resume_after_kill(tmp_path, "cuda", steps=24, kill_at=13)


@pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_nccl_available()),
    reason="this torch has no NCCL",
)
def test_a_one_gpu_nccl_group_beside_gloo(tmp_path: Path) -> None:
    _runs.check_process_groups(tmp_path, "cuda")
