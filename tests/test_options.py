"""Argument checks that run before anything is read (savepoint.options)."""

from __future__ import annotations

import pytest

import savepoint as sp
from savepoint.options import check_device, check_load


def test_a_cuda_device_on_a_machine_without_one_is_a_clear_error() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(sp.UnsupportedDeviceError, match=r"device='cuda'.*device=None") as info:
        check_device("cuda")
    assert isinstance(info.value, sp.CheckpointError) and isinstance(info.value, ValueError)
    with pytest.raises(sp.UnsupportedDeviceError):
        check_load(device=torch.device("cuda", 1))


def test_devices_that_are_no_devices_and_ones_that_are() -> None:
    pytest.importorskip("torch")
    with pytest.raises(ValueError, match="not a torch device"):
        check_device("gpu0")
    check_device("cpu")
    check_device("meta")
    assert check_load(device="cpu", keys="a") == "a"


def test_load_refuses_a_missing_cuda_device_before_reading(tmp_path: object) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(sp.UnsupportedDeviceError, match=r"no CUDA support|no CUDA device"):
        sp.load("memory://nothing-here/ckpt", device="cuda")  # refused before the path is read


def test_grid_is_a_bool_and_a_peer_tier_keeps_it() -> None:
    from savepoint.runs.config import ManagerConfig

    with pytest.raises(TypeError, match="grid"):
        sp.SaveOptions(grid="no")  # type: ignore[arg-type]
    assert sp.SaveOptions().grid and not sp.SaveOptions(grid=False).grid
    plain = ManagerConfig.of(keep_last=1)
    peers = ManagerConfig.of(keep_last=1, tiers=[sp.Tier.peers()])  # (it carries version 7)
    off = ManagerConfig.of(keep_last=1, tiers=[sp.Tier.peers()], grid=False)
    assert plain.save_options.grid and peers.save_options.grid and not off.save_options.grid
