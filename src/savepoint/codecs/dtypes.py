"""The dtypes savepoint stores, by their safetensors name, with their numpy and torch equivalents.

numpy has no bfloat16 or float8; ``ml_dtypes`` provides them, so every dtype below round-trips
through numpy without conversion. ``ml_dtypes`` costs more to import than the rest of savepoint's
save path together (its extension module, 1.2-1.5 s on a quiet machine), so it is imported only
when one of those dtypes' numpy form is asked for (``DType.numpy`` of BF16 or F8_*, or
``from_numpy`` of a dtype that is not numpy's own: ml_dtypes is then already imported by whoever
made the array). A dtype's name, itemsize and kind never need it. torch dtypes are named by
attribute (``"float32"``) and resolved only when torch is already imported, so this module never
imports torch.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

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
    torch_name: str  # attribute of the torch module; for ml_dtypes' types, theirs too
    itemsize: int
    kind: str  # "b", "u", "i", "f", "c" by meaning (numpy says "V" for ml_dtypes' bfloat16)
    plain: np.dtype[Any] | None = field(default=None, repr=False)  # None: an ml_dtypes type

    @cached_property
    def numpy(self) -> np.dtype[Any]:
        """The numpy dtype (importing ``ml_dtypes`` for bfloat16 and float8, the first time)."""
        if self.plain is not None:
            return self.plain
        found: np.dtype[Any] = np.dtype(getattr(_ml_dtypes(), self.torch_name))
        return found


def _plain(name: str, dtype: Any, torch_name: str) -> DType:
    d = np.dtype(dtype)
    return DType(name, torch_name, d.itemsize, d.kind, d)


_TABLE = [
    _plain("BOOL", np.bool_, "bool"),
    _plain("U8", np.uint8, "uint8"),
    _plain("I8", np.int8, "int8"),
    _plain("U16", np.uint16, "uint16"),
    _plain("I16", np.int16, "int16"),
    _plain("U32", np.uint32, "uint32"),
    _plain("I32", np.int32, "int32"),
    _plain("U64", np.uint64, "uint64"),
    _plain("I64", np.int64, "int64"),
    _plain("F16", np.float16, "float16"),
    DType("BF16", "bfloat16", 2, "f"),
    _plain("F32", np.float32, "float32"),
    _plain("F64", np.float64, "float64"),
    _plain("C64", np.complex64, "complex64"),
    DType("F8_E4M3", "float8_e4m3fn", 1, "f"),
    DType("F8_E5M2", "float8_e5m2", 1, "f"),
    DType("F8_E4M3FNUZ", "float8_e4m3fnuz", 1, "f"),
    DType("F8_E5M2FNUZ", "float8_e5m2fnuz", 1, "f"),
]

BY_NAME: dict[str, DType] = {d.name: d for d in _TABLE}
# numpy's own dtypes at once; ml_dtypes' added by _by_numpy() once ml_dtypes is imported.
_BY_NUMPY: dict[np.dtype[Any], DType] = {d.plain: d for d in _TABLE if d.plain is not None}
_BY_TORCH_NAME: dict[str, DType] = {d.torch_name: d for d in _TABLE}
_LOCK = threading.Lock()


def _ml_dtypes() -> Any:
    import ml_dtypes

    return ml_dtypes


def _by_numpy(dtype: np.dtype[Any]) -> DType | None:
    found = _BY_NUMPY.get(dtype)
    if found is None and "ml_dtypes" in sys.modules and len(_BY_NUMPY) < len(_TABLE):
        # A dtype numpy does not define can only be one of ml_dtypes' if ml_dtypes is imported.
        with _LOCK:
            for d in _TABLE:
                _BY_NUMPY.setdefault(d.numpy, d)
        found = _BY_NUMPY.get(dtype)
    return found


def from_name(name: str) -> DType:
    try:
        return BY_NAME[name]
    except KeyError:
        raise KeyError(f"unknown dtype {name!r}") from None


def from_numpy(dtype: np.dtype[Any], key: str) -> DType:
    found = _by_numpy(dtype.newbyteorder("=") if dtype.byteorder == "<" else dtype)
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
