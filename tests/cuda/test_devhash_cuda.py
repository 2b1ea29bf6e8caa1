"""Device checksums and device loads on a real GPU (skipped without CUDA).

The CPU suite proves the definition (tests/formats/test_devhash.py) and the load path under test
switches (tests/engine/test_device_fill.py); these run the same things on CUDA tensors: the
Triton kernel compiled for the device, the torch-operations fallback on cuBLAS, staging that
hashes on the side stream, and loads that check on the device."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

import savepoint as sp
from savepoint.codecs import devhash
from savepoint.engine import device
from savepoint.errors import CorruptCheckpointError

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SIZES = [1, 2, 3, 65535, 65536, 65537, (3 << 20) + 11]


@pytest.mark.parametrize("use_triton", [True, False], ids=["triton", "torch-ops"])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("start", [0, 1])
def test_device_window_sums_are_numpys(use_triton: bool, n: int, start: int) -> None:
    if use_triton and devhash._triton() is None:
        pytest.skip("triton does not import here")
    data = np.random.default_rng(n).integers(0, 256, n + start, dtype=np.uint8)
    flat = torch.from_numpy(data).cuda()[start:]
    got = devhash.torch_window_sums(flat, use_triton=use_triton).cpu().numpy()
    assert np.array_equal(got, devhash.window_sums(data[start:]))


def test_the_known_answer_on_the_device() -> None:
    data = bytes(range(256)) * 1000 + b"\x07"
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8).cuda()
    sums = devhash.torch_window_sums(flat).cpu().numpy()
    assert devhash.finish(devhash.fold(sums), len(data)) == "mlh64:7c828065cbd863f4"


def test_device_checksum_throughput() -> None:
    """At least 200 GB/s (issue 24's target) on an H200-class GPU; the figure is printed for
    the GPU check's report."""
    flat = torch.randint(0, 256, (2 << 30,), dtype=torch.uint8, device="cuda")
    devhash.torch_window_sums(flat)  # compile and warm up
    torch.cuda.synchronize()
    best = 0.0
    for _ in range(5):
        t0 = time.perf_counter()
        devhash.torch_window_sums(flat)
        torch.cuda.synchronize()
        best = max(best, flat.numel() / (time.perf_counter() - t0) / 1e9)
    print(f"device checksum throughput: {best:.0f} GB/s")
    assert best >= 200


def test_async_saves_hash_cuda_tensors_on_the_device_and_loads_check_there(
    tmp_path: Path,
) -> None:
    state = {
        "w": torch.randn(2048, 1024, device="cuda").to(torch.bfloat16),  # 4 MiB: mlh64
        "b": torch.randn(64, device="cuda"),  # small: XXH3 on the host
    }
    with sp.AsyncCheckpointer() as ac:
        ac.save(tmp_path / "ck", state)
    doc = json.loads((tmp_path / "ck" / "manifest.json").read_bytes())
    assert doc["format_version"] == 6
    assert "mlh64" in doc["tensors"]["w"] and "xxh3" in doc["tensors"]["b"]
    out = sp.load(tmp_path / "ck", device="cuda")
    assert out["w"].is_cuda and torch.equal(out["w"], state["w"])
    assert device.stats["device_checked"] == 1
    into = {k: torch.zeros_like(v) for k, v in state.items()}
    sp.load(tmp_path / "ck", into=into)
    assert torch.equal(into["w"], state["w"]) and torch.equal(into["b"], state["b"])
    # A flipped byte is found by the device check.
    rec = doc["tensors"]["w"]
    path = tmp_path / "ck" / rec["file"]
    data = bytearray(path.read_bytes())
    data[rec["offsets"][0] + 123457] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="'w'"):
        sp.load(tmp_path / "ck", device="cuda")
    with pytest.raises(CorruptCheckpointError, match="'w'"):
        sp.verify(tmp_path / "ck")
