"""Loads onto a device through pinned pieces (savepoint.engine.device), run on the CPU.

Under ``CPU_TARGETS`` / ``CPU_AS_DEVICE`` the device path takes CPU torch tensors with plain
buffers and synchronous copies: the piece arithmetic, the ring, both kinds of checks (XXH3 on
the host, mlh64 "on the device") and the hooks in ``sp.load`` run here exactly as on a GPU,
where tests/cuda repeats them on CUDA tensors."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import savepoint as sp
from savepoint.async_ import staging
from savepoint.codecs import manifest as mf
from savepoint.engine import device
from savepoint.errors import CorruptCheckpointError

torch = pytest.importorskip("torch")


@pytest.fixture
def on_device(monkeypatch: pytest.MonkeyPatch) -> None:
    from savepoint.state import torch_tensors

    monkeypatch.setattr(device, "CPU_TARGETS", True)
    monkeypatch.setattr(torch_tensors, "CPU_AS_DEVICE", True)
    monkeypatch.setattr(device, "PIECE", 2 * 65536)  # several pieces per tensor, ring reuse
    monkeypatch.setattr(device, "_READ_SPLIT", 40000)  # parts on the pool, unaligned


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    return {
        "big": torch.randn(700, 333, generator=g),  # 932,400 bytes: 8 pieces, a partial one
        "half": torch.randn(70001, generator=g).to(torch.bfloat16),
        "odd": torch.arange(300001, dtype=torch.uint8),
        "small": torch.arange(5.0),
        "mask": torch.tensor([True, False]),
    }


def _save(path: Path, mlh64: bool, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    state = _state()
    monkeypatch.setattr(staging, "DEVICE_HASH_CPU", mlh64)
    monkeypatch.setattr(staging, "DEVICE_HASH_MIN", 4096)
    with sp.AsyncCheckpointer() as ac:
        ac.save(path, state)
    return state


@pytest.mark.parametrize("mlh64", [False, True], ids=["xxh3", "mlh64"])
def test_device_loads_take_the_piece_path_and_are_exact(
    tmp_path: Path, mlh64: bool, on_device: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = _save(tmp_path / "ck", mlh64, monkeypatch)
    assert sp.inspect(tmp_path / "ck").format_version == (6 if mlh64 else 1)
    out = sp.load(tmp_path / "ck", device="cpu")
    for k, v in state.items():
        assert torch.equal(out[k], v), k
    assert device.stats["tensors"] == 3 and device.stats["pieces"] >= 8 + 2 + 3
    key = "device_checked" if mlh64 else "host_checked"
    assert device.stats[key] == 3
    into = {k: torch.zeros_like(v) for k, v in state.items()}
    sp.load(tmp_path / "ck", into=into)
    for k, v in state.items():
        assert torch.equal(into[k], v), k
    assert device.stats["tensors"] == 4  # "small" too (a fresh load makes it from host bytes)


@pytest.mark.parametrize("mlh64", [False, True], ids=["xxh3", "mlh64"])
@pytest.mark.parametrize("where", [0, 131071, 131072, 932399])
def test_a_damaged_piece_is_found_by_the_device_path(
    tmp_path: Path, mlh64: bool, where: int, on_device: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    _save(tmp_path / "ck", mlh64, monkeypatch)
    m = mf.parse((tmp_path / "ck" / mf.NAME).read_bytes(), columns=False)
    rec = m.tensors["big"]
    path = tmp_path / "ck" / rec.file
    data = bytearray(path.read_bytes())
    data[rec.start + where] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="'big'"):
        sp.load(tmp_path / "ck", device="cpu")
    with pytest.raises(CorruptCheckpointError, match="'big'"):
        sp.load(tmp_path / "ck", into={"big": torch.zeros(700, 333)}, keys="big")
    out = sp.load(tmp_path / "ck", device="cpu", verify=False)
    assert not torch.equal(out["big"], _state()["big"])


def test_device_loads_from_a_store_without_a_file_view(
    on_device: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = _save("memory://device-fill/ck", True, monkeypatch)  # type: ignore[arg-type]
    out = sp.load("memory://device-fill/ck", device="cpu")
    for k, v in state.items():
        assert torch.equal(out[k], v), k
    assert device.stats["device_checked"] == 3


def test_verify_first_and_targets_that_do_not_qualify_keep_the_host_path(
    tmp_path: Path, on_device: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = _save(tmp_path / "ck", True, monkeypatch)
    device.stats.clear()
    into = {"big": torch.zeros(333, 700).t()}  # not contiguous
    sp.load(tmp_path / "ck", into=into, keys="big")
    assert torch.equal(into["big"], state["big"]) and not device.stats.get("tensors")
    into = {"big": torch.zeros(700, 333)}
    sp.load(tmp_path / "ck", into=into, keys="big", verify="first")
    assert torch.equal(into["big"], state["big"]) and not device.stats.get("tensors")


def test_without_the_test_switch_cpu_loads_never_take_the_device_path(tmp_path: Path) -> None:
    sp.save(tmp_path / "ck", _state())
    device.stats.clear()
    sp.load(tmp_path / "ck", device="cpu")
    sp.load(tmp_path / "ck", into={"big": torch.zeros(700, 333)}, keys="big")
    assert not device.stats.get("tensors")


def test_a_copy_of_the_v6_golden_loads_on_the_device_path(tmp_path: Path, on_device: None) -> None:
    golden = Path(__file__).resolve().parent.parent / "golden" / "v6" / "ck"
    shutil.copytree(golden, tmp_path / "ck")
    into = {"odd": torch.zeros(70001, dtype=torch.uint8), "model": {"w": torch.zeros(128, 160)}}
    sp.load(tmp_path / "ck", into=into, keys=["odd", "model/w"])
    assert into["odd"].numpy().tobytes() == np.arange(70001, dtype=np.uint8).tobytes()
    assert device.stats["device_checked"] == 2
