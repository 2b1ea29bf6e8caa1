"""CUDA tensors saved and loaded: every dtype, views, tied weights, device loads, memory, streams.

Marked ``cuda``: skipped without a CUDA device (``make gpu-check`` runs them on one). The checks
themselves are in ``_gpu.py``; ``test_twins_on_cpu.py`` runs each on the CPU in every suite run.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import _gpu
import pytest

import savepoint as sp

torch = _gpu.torch

pytestmark = [
    pytest.mark.torch,
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_every_dtype_view_and_tied_tensor_round_trips_on_cuda(ckpt: Path) -> None:
    _gpu.check_roundtrip(ckpt, "cuda")


def test_a_module_with_tied_weights_on_cuda_stays_tied(ckpt: Path) -> None:
    _gpu.check_tied_module(ckpt, "cuda")


def test_a_checkpoint_saved_on_the_host_loads_onto_the_device(ckpt: Path) -> None:
    state = _gpu.zoo("cpu", seed=11)
    sp.save(ckpt, state)
    for device in ("cuda", "cuda:0", torch.device("cuda", 0)):
        loaded = sp.load(ckpt, device=device)
        for key, want in state.items():
            _gpu.assert_same(loaded[key], want, key, "cuda:0")


def test_device_loads_find_a_flipped_byte(ckpt: Path, flip_byte: Callable[..., None]) -> None:
    _gpu.check_corrupt_device_load(ckpt, "cuda", flip_byte)


def test_a_save_inside_a_side_stream_waits_for_that_stream(ckpt: Path) -> None:
    _gpu.check_save_orders_after_the_current_stream(ckpt, "cuda")


def test_device_loads_hold_at_most_one_host_copy(ckpt: Path) -> None:
    _gpu.check_device_load_memory(ckpt, "cuda", mib=512)


def test_device_loads_and_device_checksums_of_every_dtype(
    tmp_path: Path, flip_byte: Callable[..., None]
) -> None:
    _gpu.check_device_paths_every_dtype(tmp_path, "cuda", flip_byte)
