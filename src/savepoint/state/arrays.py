"""Tensor leaves: what a writer needs to stream a tensor's bytes, and how loads fill targets.

A ``TensorSource`` is the save side: dtype, shape, and ``copy_to(dst, start)`` which writes the
tensor's raw little-endian bytes ``[start, start + len(dst))`` into a uint8 buffer. numpy sources
live here; torch sources live in :mod:`savepoint.state.torch_tensors` and are only built when the state
holds torch tensors (so torch is never imported by savepoint itself), jax sources in
:mod:`savepoint.state.jax_arrays`, only when it holds ``jax.Array`` leaves.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Protocol

import numpy as np

from savepoint.codecs import dtypes
from savepoint.codecs.dtypes import DType

__all__ = [
    "HostCopy",
    "NumpySource",
    "TensorSource",
    "byte_view",
    "describe",
    "is_jax_array",
    "is_torch_tensor",
    "make_source",
]

if sys.byteorder != "little":  # pragma: no cover - no big-endian CI machine
    raise ImportError("savepoint writes little-endian data and supports little-endian hosts only")


class TensorSource(Protocol):
    dtype: DType
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def kind(self) -> str:
        """ "numpy", "numpy_scalar" or "torch": what the loader gives back by default (a
        ``jax.Array``'s is "numpy")."""

    def identity(self) -> tuple[Any, ...] | None:
        """Memory identity: equal for two leaves that are the same view of the same memory."""

    def copy_to(self, dst: np.ndarray[Any, Any], start: int) -> None:
        """Copy bytes ``[start, start + dst.size)`` of the tensor's contiguous image into ``dst``."""

    def release(self) -> None:
        """Drop any temporary made for copying (a contiguous copy, a device transfer)."""


class NumpySource:
    __slots__ = ("_array", "_flat", "dtype", "kind", "nbytes", "shape")

    def __init__(self, array: np.ndarray[Any, Any], key: str, *, scalar: bool = False) -> None:
        if array.dtype.byteorder == ">":
            array = array.astype(array.dtype.newbyteorder("<"))
        self.dtype = dtypes.from_numpy(array.dtype, key)
        self._array = array
        self._flat: np.ndarray[Any, Any] | None = None
        self.shape = tuple(int(s) for s in array.shape)
        self.nbytes = int(array.nbytes)
        self.kind = "numpy_scalar" if scalar else "numpy"

    def identity(self) -> tuple[Any, ...] | None:
        if self.nbytes == 0:
            return None
        a = self._array
        return ("numpy", a.__array_interface__["data"][0], a.shape, a.strides, a.dtype.str)

    def _bytes(self) -> np.ndarray[Any, Any]:
        if self._flat is None:
            # A non-contiguous array is copied once here and dropped by release().
            self._flat = np.ascontiguousarray(self._array).reshape(-1).view(np.uint8)
        return self._flat

    def copy_to(self, dst: np.ndarray[Any, Any], start: int) -> None:
        np.copyto(dst, self._bytes()[start : start + dst.size], casting="no")

    def release(self) -> None:
        self._flat = None


def is_torch_tensor(obj: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def is_jax_array(obj: Any) -> bool:
    """Whether ``obj`` is a ``jax.Array`` (never imports jax: one can only exist once it is)."""
    jax = sys.modules.get("jax")
    cls = getattr(jax, "Array", None) if jax is not None else None
    return cls is not None and isinstance(obj, cls)


def make_source(leaf: Any, key: str) -> TensorSource | None:
    """The source for an array-like leaf, or None if the leaf is not a tensor."""
    if isinstance(leaf, np.ndarray):
        if leaf.dtype.hasobject:
            from savepoint.errors import UnsupportedStateError

            raise UnsupportedStateError(
                f"{key or '<root>'}: numpy arrays of Python objects cannot be stored without "
                "pickle; convert them to a numeric dtype or to plain lists",
                key=key,
            )
        return NumpySource(leaf, key)
    if isinstance(leaf, np.generic) and not isinstance(leaf, (np.str_, np.bytes_, np.object_)):
        return NumpySource(np.asarray(leaf), key, scalar=True)
    if is_torch_tensor(leaf):
        source: TensorSource = _torch_source()(leaf, key)
        return source
    if is_jax_array(leaf):
        jax_source: TensorSource = _jax_source()(leaf, key)
        return jax_source
    return None


@functools.cache
def _torch_source() -> Any:
    """``torch_tensors.TorchSource``, imported once (an import statement per leaf cost a
    100,000-tensor save 0.07 s)."""
    from savepoint.state import torch_tensors

    return torch_tensors.TorchSource


@functools.cache
def _jax_source() -> Any:
    """``jax_arrays.JaxSource``, imported once (as :func:`_torch_source`)."""
    from savepoint.state import jax_arrays

    return jax_arrays.JaxSource


def byte_view(target: Any) -> np.ndarray[Any, Any] | None:
    """A writable uint8 view of a host, contiguous numpy array or torch tensor, or None."""
    if isinstance(target, np.ndarray):
        if target.flags.c_contiguous and target.flags.writeable:
            return target.reshape(-1).view(np.uint8)
        return None
    if not is_torch_tensor(target):
        return None
    from savepoint.state import torch_tensors

    return torch_tensors.byte_view(target)


def describe(target: Any) -> tuple[str, tuple[int, ...]] | None:
    """(dtype name, shape) of an array or tensor target, or None if it is not one."""
    if isinstance(target, np.ndarray):
        try:
            return dtypes.from_numpy(target.dtype, "").name, tuple(target.shape)
        except Exception:
            return f"numpy {target.dtype}", tuple(target.shape)
    if is_torch_tensor(target):
        dtype = target.dtype
        name = _TORCH_NAMES.get(dtype)
        if name is None:
            try:
                name = _TORCH_NAMES[dtype] = dtypes.from_torch(dtype, "").name
            except Exception:
                return f"torch {dtype}", tuple(target.shape)
        return name, tuple(target.shape)
    return None


_TORCH_NAMES: dict[Any, str] = {}  # torch dtype -> stored dtype name, as met (restores ask often)


class HostCopy:
    """A host copy of a tensor's bytes, taken when constructed, standing in for the tensor when
    the write happens later (background and sharded saves): later changes to the original do not
    reach it. Copied in 16 MiB pieces, so a GPU source is staged a piece at a time."""

    __slots__ = ("_data", "dtype", "kind", "nbytes", "shape")

    def __init__(self, source: TensorSource) -> None:
        self.dtype = source.dtype
        self.shape = source.shape
        self.nbytes = source.nbytes
        self.kind = source.kind
        self._data = np.empty(source.nbytes, dtype=np.uint8)
        try:
            for pos in range(0, source.nbytes, _PIECE):
                source.copy_to(self._data[pos : pos + _PIECE], pos)
        finally:
            source.release()

    def identity(self) -> tuple[Any, ...] | None:
        return None

    def copy_to(self, dst: np.ndarray[Any, Any], start: int) -> None:
        np.copyto(dst, self._data[start : start + dst.size])

    def host_view(self) -> np.ndarray[Any, Any]:
        """The copy's bytes (a flat uint8 array, read in place by incremental saves)."""
        return self._data

    def release(self) -> None:
        pass


_PIECE = 16 << 20
