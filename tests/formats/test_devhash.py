"""``mlh64`` (savepoint.codecs.devhash): every implementation computes the definition.

The NumPy implementation is checked against a plain-Python transcription of the module
docstring's definition; the torch-operations one (what a GPU without Triton runs) and the Triton
kernel (under Triton's interpreter, on the CPU) against NumPy; the streaming hasher against the
one-shot digest. A known-answer digest pins the definition itself: a CUDA implementation that
drifts from it fails tests/cuda/test_devhash_cuda.py against these same numbers."""

from __future__ import annotations

import importlib.util
import os
import struct
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from savepoint.codecs import checksum, devhash

SIZES = [0, 1, 2, 3, 4095, 65535, 65536, 65537, 3 * 65536 + 7]


def _spec(data: bytes) -> str:
    """The module docstring's definition, in plain Python (slow; small inputs only)."""
    p, w = devhash.P, devhash.WINDOW_UNITS
    padded = data + b"\0" * (len(data) & 1)
    units = struct.unpack(f"<{len(padded) // 2}h", padded)
    k = devhash.keys()
    lanes = [0, 0]
    for lane, g in enumerate((16807, 48271)):
        for t in range(0, -(-len(units) // w)):
            s = sum(int(k[lane, r]) * units[t * w + r] for r in range(min(w, len(units) - t * w)))
            lanes[lane] = (lanes[lane] + (s % p) * pow(g, t + 1, p)) % p
    value = xxhash.xxh3_64_intdigest(struct.pack("<QQQ", lanes[0], lanes[1], len(data)))
    return f"mlh64:{value:016x}"


def _bytes(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed + n).integers(0, 256, n, dtype=np.uint8)


def test_the_keys_are_the_definitions() -> None:
    k = devhash.keys()
    assert k.shape == (2, devhash.WINDOW_UNITS) and k.min() >= 1 and k.max() <= 65535
    # splitmix64(0x5AFE9017), by hand, mod 65535, plus one
    z = (0x5AFE9017 + 0x9E3779B97F4A7C15) & (2**64 - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    assert int(k[0, 0]) == (z ^ (z >> 31)) % 65535 + 1


@pytest.mark.parametrize("n", [0, 1, 2, 3, 100, 65536 + 3])
def test_numpy_computes_the_definition(n: int) -> None:
    data = _bytes(n).tobytes()
    assert devhash.digest(data) == _spec(data)


def test_a_known_answer() -> None:
    """Pinned: any change to the definition (keys, windows, fold, finish) changes this."""
    data = bytes(range(256)) * 1000 + b"\x07"
    assert devhash.digest(data) == "mlh64:" + KNOWN
    assert devhash.digest(b"") == "mlh64:" + EMPTY


KNOWN = "7c828065cbd863f4"  # bytes(range(256)) * 1000 + b"\x07" (two windows and an odd byte)
EMPTY = "743df94ee4c78a2a"


@pytest.mark.parametrize("n", SIZES)
def test_the_stream_hasher_matches_for_any_pieces(n: int) -> None:
    data = _bytes(n)
    rng = np.random.default_rng(n)
    h = devhash.Hasher()
    pos = 0
    while pos < n:
        step = int(rng.integers(1, 70000))
        h.update(data[pos : pos + step])
        pos += step
    assert h.hexdigest() == devhash.digest(data)
    c = checksum.Hasher(expect=devhash.digest(data))
    c.update(data)
    assert c.result().xxh3 == devhash.digest(data)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("start", [0, 1])
def test_torch_operations_match_numpy(n: int, start: int) -> None:
    torch = pytest.importorskip("torch")
    data = _bytes(n + start)
    got = devhash.torch_window_sums(torch.from_numpy(data)[start:], use_triton=False)
    assert got.dtype == torch.int64
    assert np.array_equal(got.numpy(), devhash.window_sums(data[start:]))


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(2, 3 * 65536),
    where=st.floats(0, 1, exclude_max=True),
    delta=st.integers(1, 255),
)
def test_any_change_of_one_unit_is_found(n: int, where: float, delta: int) -> None:
    data = _bytes(n)
    changed = data.copy()
    i = int(where * n)
    changed[i] = (int(changed[i]) + delta) % 256
    assert devhash.digest(changed) != devhash.digest(data)
    assert checksum.matches(data, devhash.digest(data))
    assert not checksum.matches(changed, devhash.digest(data))


def test_swapped_windows_and_lengths_are_found() -> None:
    data = _bytes(4 * 65536)
    swapped = np.concatenate([data[65536:131072], data[:65536], data[131072:]])
    assert devhash.digest(swapped) != devhash.digest(data)
    assert devhash.digest(np.zeros(10, np.uint8)) != devhash.digest(np.zeros(12, np.uint8))


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_the_triton_kernel_matches_numpy_under_the_interpreter() -> None:
    """The kernel a GPU runs, run by Triton's interpreter on the CPU (a child process: the
    interpreter is chosen when triton is imported)."""
    code = textwrap.dedent(
        """
        import numpy as np, torch
        from savepoint.codecs import devhash
        for n in (1, 2, 3, 65536, 65537, 2 * 65536 + 5):
            for start in (0, 1):
                data = np.random.default_rng(n).integers(0, 256, n + start, dtype=np.uint8)
                got = devhash.torch_window_sums(torch.from_numpy(data)[start:], use_triton=True)
                assert np.array_equal(got.numpy(), devhash.window_sums(data[start:])), (n, start)
        print("triton ok")
        """
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "triton ok" in out.stdout
