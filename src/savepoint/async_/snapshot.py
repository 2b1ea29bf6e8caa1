"""Snapshots: a flattened state whose tensors are host copies that training can no longer change.

``snapshot(flat)`` copies every tensor's bytes into host memory owned by the snapshot, so the
original tensors may be modified as soon as it returns; the writer then streams from the copies.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from savepoint.state.arrays import TensorSource
from savepoint.state.dtypes import DType
from savepoint.state.tree import Flat

_PIECE = 16 << 20


class SnapshotSource:
    """A host copy of a tensor's bytes, standing in for the original source when writing."""

    __slots__ = ("_data", "dtype", "kind", "nbytes", "shape")

    def __init__(self, source: TensorSource, data: np.ndarray[Any, Any]) -> None:
        self.dtype: DType = source.dtype
        self.shape = source.shape
        self.nbytes = source.nbytes
        self.kind = source.kind
        self._data = data

    def identity(self) -> tuple[Any, ...] | None:
        return None

    def copy_to(self, dst: np.ndarray[Any, Any], start: int) -> None:
        np.copyto(dst, self._data[start : start + dst.size])

    def release(self) -> None:
        pass


def snapshot(flat: Flat) -> Flat:
    """A copy of ``flat`` whose tensors no longer share memory with the caller's state."""
    copies: dict[str, TensorSource] = {}
    for name, source in flat.tensors.items():
        data = np.empty(source.nbytes, dtype=np.uint8)
        try:
            for pos in range(0, source.nbytes, _PIECE):
                source.copy_to(data[pos : pos + _PIECE], pos)
        finally:
            source.release()
        copies[name] = SnapshotSource(source, data)
    return Flat(tree=flat.tree, tensors=copies)
