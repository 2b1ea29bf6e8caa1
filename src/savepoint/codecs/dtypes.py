"""The dtypes savepoint stores, by their safetensors name, with their numpy and torch equivalents.

numpy has no bfloat16 or float8; ``ml_dtypes`` provides them, so every dtype below round-trips
through numpy without conversion. torch dtypes are named by attribute (``"float32"``) and resolved
only when torch is already imported, so this module never imports torch.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from savepoint.errors import UnsupportedStateError

__all__ = [
    "BY_NAME",
    "DType",
    "from_name",
    "from_numpy",
    "from_torch",
    "torch_dtype",
]


@dataclass(frozen=True)
class DType:
    name: str  # safetensors name, as written in headers and manifests
    numpy: np.dtype[Any]
    torch_name: str  # attribute of the torch module

    @property
    def itemsize(self) -> int:
        return int(self.numpy.itemsize)


_TABLE = [
    DType("BOOL", np.dtype(np.bool_), "bool"),
    DType("U8", np.dtype(np.uint8), "uint8"),
    DType("I8", np.dtype(np.int8), "int8"),
    DType("U16", np.dtype(np.uint16), "uint16"),
    DType("I16", np.dtype(np.int16), "int16"),
    DType("U32", np.dtype(np.uint32), "uint32"),
    DType("I32", np.dtype(np.int32), "int32"),
    DType("U64", np.dtype(np.uint64), "uint64"),
    DType("I64", np.dtype(np.int64), "int64"),
    DType("F16", np.dtype(np.float16), "float16"),
    DType("BF16", np.dtype(ml_dtypes.bfloat16), "bfloat16"),
    DType("F32", np.dtype(np.float32), "float32"),
    DType("F64", np.dtype(np.float64), "float64"),
    DType("C64", np.dtype(np.complex64), "complex64"),
    DType("F8_E4M3", np.dtype(ml_dtypes.float8_e4m3fn), "float8_e4m3fn"),
    DType("F8_E5M2", np.dtype(ml_dtypes.float8_e5m2), "float8_e5m2"),
    DType("F8_E4M3FNUZ", np.dtype(ml_dtypes.float8_e4m3fnuz), "float8_e4m3fnuz"),
    DType("F8_E5M2FNUZ", np.dtype(ml_dtypes.float8_e5m2fnuz), "float8_e5m2fnuz"),
]

BY_NAME: dict[str, DType] = {d.name: d for d in _TABLE}
_BY_NUMPY: dict[np.dtype[Any], DType] = {d.numpy: d for d in _TABLE}
_BY_TORCH_NAME: dict[str, DType] = {d.torch_name: d for d in _TABLE}


def from_name(name: str) -> DType:
    try:
        return BY_NAME[name]
    except KeyError:
        raise KeyError(f"unknown dtype {name!r}") from None


def from_numpy(dtype: np.dtype[Any], key: str) -> DType:
    found = _BY_NUMPY.get(dtype.newbyteorder("=") if dtype.byteorder == "<" else dtype)
    if found is None:
        raise UnsupportedStateError(
            f"{key or '<root>'}: numpy dtype {dtype} cannot be stored (safetensors holds "
            f"{', '.join(sorted(BY_NAME))}); convert it first",
            key=key,
        )
    return found


def from_torch(dtype: Any, key: str) -> DType:
    name = str(dtype).removeprefix("torch.")
    found = _BY_TORCH_NAME.get(name)
    if found is None:
        raise UnsupportedStateError(
            f"{key or '<root>'}: torch dtype {dtype} cannot be stored (safetensors holds "
            f"{', '.join(sorted(BY_NAME))}); convert it first",
            key=key,
        )
    return found


def torch_dtype(d: DType) -> Any:
    torch = sys.modules.get("torch")
    if torch is None:  # pragma: no cover - callers only ask when torch output was requested
        import torch
    return getattr(torch, d.torch_name)
