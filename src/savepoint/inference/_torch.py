"""torch side of snapshots. Imported only when a snapshot meets a torch tensor or is asked for one.

A snapshot keeps a torch tensor as a torch tensor, on the device it was captured on, so taking and
restoring GPU state never leaves the device; encoders read it through :func:`host`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from savepoint.codecs import dtypes
from savepoint.codecs.dtypes import DType
from savepoint.errors import UnsupportedStateError


def check(t: torch.Tensor, where: str) -> tuple[DType, tuple[int, ...]]:
    if t.layout != torch.strided:
        raise UnsupportedStateError(
            f"{where}: {t.layout} tensors cannot be snapshotted; call .to_dense() first", key=where
        )
    if t.is_quantized:
        raise UnsupportedStateError(
            f"{where}: quantized tensors cannot be snapshotted; dequantize them first", key=where
        )
    if t.device.type == "meta":
        raise UnsupportedStateError(f"{where}: a meta tensor has no data to snapshot", key=where)
    return dtypes.from_torch(t.dtype, where), tuple(int(s) for s in t.shape)


def _plain(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t


def capture(t: torch.Tensor, reuse: Any) -> torch.Tensor:
    """A copy of ``t`` on its device: into ``reuse`` when it matches (dtype, shape, device)."""
    src = _plain(t)
    with torch.no_grad():
        if (
            isinstance(reuse, torch.Tensor)
            and reuse.dtype == src.dtype
            and reuse.shape == src.shape
            and reuse.device == src.device
            and reuse.is_contiguous()
        ):
            reuse.copy_(src)
            return reuse
        out = torch.empty(src.shape, dtype=src.dtype, device=src.device)
        out.copy_(src)
        return out


def host(t: torch.Tensor, d: DType) -> np.ndarray[Any, Any]:
    """A numpy array holding ``t``'s values: a view for a contiguous CPU tensor, else a copy."""
    src = _plain(t)
    if src.device.type != "cpu":
        src = src.cpu()
    src = src.contiguous()
    shape = tuple(int(s) for s in src.shape)
    if src.numel() == 0:
        return np.empty(shape, dtype=d.numpy)
    raw: np.ndarray[Any, Any] = src.reshape(-1).view(torch.uint8).numpy()
    return raw.view(d.numpy).reshape(shape)


def from_host(array: np.ndarray[Any, Any], d: DType) -> torch.Tensor:
    """A CPU tensor with ``array``'s values, sharing its memory when it is writable."""
    torch_dtype = getattr(torch, d.torch_name)
    if array.size == 0:
        return torch.empty(array.shape, dtype=torch_dtype)
    flat = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    if not flat.flags.writeable:
        flat = flat.copy()  # torch has no read-only tensors and warns about read-only buffers
    return torch.from_numpy(flat).view(torch_dtype).reshape(array.shape)


def check_target(target: Any, d: DType, shape: tuple[int, ...]) -> str | None:
    """Why ``target`` cannot receive an array of ``d`` and ``shape``, or None if it can."""
    if not isinstance(target, torch.Tensor):
        return f"expected a torch tensor, got {type(target).__name__}"
    try:
        got = dtypes.from_torch(target.dtype, "").name
    except UnsupportedStateError:
        got = str(target.dtype)
    if got != d.name or tuple(target.shape) != shape:
        return f"{d.name} {list(shape)} in the snapshot, {got} {list(target.shape)} in the target"
    return None


def copy_into(target: torch.Tensor, src: Any, d: DType) -> None:
    """Copy a snapshot array (numpy or torch) into ``target`` in place."""
    with torch.no_grad():
        if isinstance(src, torch.Tensor):
            target.copy_(src)
            return
        if src.size == 0:
            return
        if (
            target.device.type == "cpu"
            and target.is_contiguous()
            and not target.is_conj()
            and not target.is_neg()
        ):
            # Straight into the target's memory: no temporary, no read-only buffer for torch.
            view = target.detach().reshape(-1).view(torch.uint8).numpy()
            np.copyto(view, np.ascontiguousarray(src).reshape(-1).view(np.uint8))
            return
        target.copy_(from_host(src, d))
