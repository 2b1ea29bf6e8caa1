"""Regenerate the golden ``.shrew`` files in this directory, built byte by byte from the format's
specification (the header comments of the seed's ``checkpoint.rs``), never with savepoint's
writer: the tests check that savepoint reads exactly :func:`expected` from each file and writes
each file back byte for byte.

Usage, from the repository root::

    .venv/bin/python tests/golden/shrew/make_shrew_golden.py

Every integer is little-endian; ``key`` is a u32 byte length and UTF-8 bytes; tensor data is the
values' little-endian bytes in C order. bfloat16 values are written as the upper 16 bits of their
float32 bits (every value below is exactly representable, so no rounding is involved). Optimizer
scalars and buffers are written sorted by key, the deterministic order savepoint's writer uses
(the seed's own order is that of a Rust HashMap).

Files:

- ``v1_dtypes.shrew``: one tensor per dtype tag 0-6, with extreme values (I64 -2**63, 2**53 + 1,
  2**63 - 1; U32 2**32 - 1; F64 -0.0 and a subnormal; F16 -65504);
- ``v1_empty.shrew``: no tensors;
- ``v1_edge.shrew``: an empty tensor (shape (0, 3), no data), a 0-d tensor, and UTF-8 keys
  (CJK, an accent, an emoji, a ``/`` like the seed's "graph/param");
- ``v2_adam.shrew``: the seed's own test checkpoint (Adam optimizer section, 6 losses);
- ``v2_no_optimizer.shrew``: no optimizer section (the seed's second test);
- ``v2_minimal.shrew``: an empty model, an optimizer with no scalars or buffers, best_loss
  +inf (the seed's default), an empty loss history, the largest u64 epoch.
"""

from __future__ import annotations

import math
import os
import struct
from typing import Any

import ml_dtypes
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))

F32, F64, U8, U32, I64, F16, BF16 = range(7)
_PACK = {F32: "f", F64: "d", U8: "B", U32: "I", I64: "q", F16: "e"}
_NUMPY: dict[int, Any] = {
    F32: np.float32,
    F64: np.float64,
    U8: np.uint8,
    U32: np.uint32,
    I64: np.int64,
    F16: np.float16,
    BF16: ml_dtypes.bfloat16,
}


def u8(v: int) -> bytes:
    return struct.pack("<B", v)


def u32(v: int) -> bytes:
    return struct.pack("<I", v)


def u64(v: int) -> bytes:
    return struct.pack("<Q", v)


def f64(v: float) -> bytes:
    return struct.pack("<d", v)


def key(s: str) -> bytes:
    raw = s.encode("utf-8")
    return u32(len(raw)) + raw


def values_bytes(tag: int, values: list[Any]) -> bytes:
    if tag == BF16:
        out = b""
        for v in values:
            (bits,) = struct.unpack("<I", struct.pack("<f", v))
            assert bits & 0xFFFF == 0, f"{v} is not exactly a bfloat16"
            out += struct.pack("<H", bits >> 16)
        return out
    return b"".join(struct.pack("<" + _PACK[tag], v) for v in values)


def tensor(name: str, tag: int, dims: list[int], values: list[Any]) -> bytes:
    data = values_bytes(tag, values)
    return key(name) + u8(tag) + u32(len(dims)) + b"".join(map(u32, dims)) + u64(len(data)) + data


# (name, dtype tag, dims, values in C order)
TensorSpec = tuple[str, int, list[int], list[Any]]

V1: dict[str, list[TensorSpec]] = {
    "v1_dtypes": [
        ("f32", F32, [2, 2], [1.0, -2.5, 3.25, 0.0]),
        ("f64", F64, [3], [math.pi, -0.0, 5e-324]),
        ("u8", U8, [3], [0, 128, 255]),
        ("u32", U32, [2], [0, 2**32 - 1]),
        ("i64", I64, [3], [-(2**63), 2**53 + 1, 2**63 - 1]),
        ("f16", F16, [2], [0.5, -65504.0]),
        ("bf16", BF16, [2], [1.0, -3.140625]),
    ],
    "v1_empty": [],
    "v1_edge": [
        ("empty", F32, [0, 3], []),
        ("scalar", F64, [], [2.5]),
        ("层/权重", F32, [2], [1.5, -1.5]),
        ("café", U8, [1], [7]),
        ("🙂", I64, [1, 1], [-1]),
        ("Forward/w1", F64, [1, 2], [0.1, 0.2]),
    ],
}

# model, optimizer (type, scalars, buffers) or None, epoch, global_step, best_loss, loss history
V2: dict[str, dict[str, Any]] = {
    "v2_adam": {
        "model": [
            ("layer1/weight", F32, [2, 2], [1.0, 2.0, 3.0, 4.0]),
            ("layer1/bias", F32, [2], [0.1, 0.2]),
        ],
        "optimizer": (
            "Adam",
            {"t": 100.0, "lr": 0.001, "beta1": 0.9},
            {"m.0": [0.01, 0.02, 0.03, 0.04], "v.0": [0.001, 0.002, 0.003, 0.004]},
        ),
        "epoch": 10,
        "global_step": 5000,
        "best_loss": 0.032,
        "loss_history": [1.5, 0.8, 0.4, 0.1, 0.05, 0.032],
    },
    "v2_no_optimizer": {
        "model": [("w", F64, [2], [1.0, 2.0])],
        "optimizer": None,
        "epoch": 5,
        "global_step": 250,
        "best_loss": 0.1,
        "loss_history": [0.5, 0.3, 0.1],
    },
    "v2_minimal": {
        "model": [],
        "optimizer": ("SGD", {}, {}),
        "epoch": 2**64 - 1,
        "global_step": 0,
        "best_loss": math.inf,
        "loss_history": [],
    },
}


def v1_bytes(tensors: list[TensorSpec]) -> bytes:
    return b"SHRW" + u32(1) + u32(len(tensors)) + b"".join(tensor(*t) for t in tensors)


def v2_bytes(spec: dict[str, Any]) -> bytes:
    out = b"SHRW" + u32(2)
    out += u8(0x01) + u32(len(spec["model"])) + b"".join(tensor(*t) for t in spec["model"])
    if spec["optimizer"] is not None:
        kind, scalars, buffers = spec["optimizer"]
        out += u8(0x02) + key(kind)
        out += u32(len(scalars)) + b"".join(key(k) + f64(scalars[k]) for k in sorted(scalars))
        out += u32(len(buffers))
        for k in sorted(buffers):
            out += key(k) + u64(len(buffers[k])) + b"".join(map(f64, buffers[k]))
    out += u8(0x03) + u64(spec["epoch"]) + u64(spec["global_step"]) + f64(spec["best_loss"])
    out += u32(len(spec["loss_history"])) + b"".join(map(f64, spec["loss_history"]))
    return out + u8(0xFF)


def files() -> dict[str, bytes]:
    """File name -> exact file content."""
    out = {f"{name}.shrew": v1_bytes(t) for name, t in V1.items()}
    out.update({f"{name}.shrew": v2_bytes(spec) for name, spec in V2.items()})
    return out


def array(spec: TensorSpec) -> np.ndarray:
    _, tag, dims, values = spec
    return np.array(values, dtype=_NUMPY[tag]).reshape(dims)


def expected(name: str) -> Any:
    """What reading ``name`` must give: for v1 {key: array}; for v2 a dict of the
    TrainingCheckpoint fields, the optimizer as (type, scalars, buffers as float64 arrays)."""
    stem = name.removesuffix(".shrew")
    if stem in V1:
        return {t[0]: array(t) for t in V1[stem]}
    spec = V2[stem]
    optimizer = spec["optimizer"]
    if optimizer is not None:
        kind, scalars, buffers = optimizer
        optimizer = (kind, dict(scalars), {k: np.array(v, np.float64) for k, v in buffers.items()})
    return {
        "model_params": {t[0]: array(t) for t in spec["model"]},
        "optimizer_state": optimizer,
        "epoch": spec["epoch"],
        "global_step": spec["global_step"],
        "best_loss": spec["best_loss"],
        "loss_history": list(spec["loss_history"]),
    }


def main() -> None:
    for name, data in files().items():
        with open(os.path.join(HERE, name), "wb") as f:
            f.write(data)
        print(f"{name}: {len(data)} bytes")


if __name__ == "__main__":
    main()
