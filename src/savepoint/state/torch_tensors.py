"""torch adapter. Imported only when the state already holds torch tensors or torch output is asked for.

Save side: ``TorchSource`` exposes a CPU tensor's bytes as a zero-copy numpy uint8 view (every
dtype, bfloat16 and float8 included, by viewing the storage as uint8). A tensor on another device
is copied to host one staging chunk at a time, so a GPU state never needs a whole host copy.
Load side: ``byte_view`` gives the writable bytes of a CPU tensor so reads land in it directly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from savepoint.codecs import dtypes
from savepoint.codecs.dtypes import DType
from savepoint.errors import UnsupportedStateError

__all__ = [
    "TorchSource",
    "byte_view",
    "copy_into",
    "empty",
    "from_numpy",
    "stage_to_pinned",
    "to_device",
]


def _plain(t: torch.Tensor, key: str) -> torch.Tensor:
    if t.is_sparse or t.layout != torch.strided:
        raise UnsupportedStateError(
            f"{key or '<root>'}: {t.layout} tensors cannot be stored; call .to_dense() first",
            key=key,
        )
    if t.is_quantized:
        raise UnsupportedStateError(
            f"{key or '<root>'}: quantized tensors cannot be stored; dequantize them first", key=key
        )
    if t.device.type == "meta":
        raise UnsupportedStateError(
            f"{key or '<root>'}: meta tensors have no data to save", key=key
        )
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t


class TorchSource:
    __slots__ = ("_flat", "_tensor", "device_type", "dtype", "kind", "nbytes", "shape")

    def __init__(self, tensor: torch.Tensor, key: str) -> None:
        t = _plain(tensor, key)
        self.dtype: DType = dtypes.from_torch(t.dtype, key)
        self._tensor = t
        self._flat: Any = None
        self.shape = tuple(int(s) for s in t.shape)
        self.nbytes = t.numel() * t.element_size()
        self.kind = "torch"
        self.device_type = t.device.type

    def identity(self) -> tuple[Any, ...] | None:
        t = self._tensor
        if self.nbytes == 0:
            return None
        return (
            "torch",
            str(t.device),
            t.untyped_storage().data_ptr(),
            t.storage_offset(),
            tuple(t.shape),
            t.stride(),
            t.dtype,
        )

    def _bytes(self) -> Any:
        if self._flat is None:
            t = self._tensor.contiguous().reshape(-1).view(torch.uint8)
            self._flat = t.numpy() if t.device.type == "cpu" else t
        return self._flat

    def copy_to(self, dst: np.ndarray[Any, Any], start: int) -> None:
        flat = self._bytes()
        if isinstance(flat, np.ndarray):
            np.copyto(dst, flat[start : start + dst.size], casting="no")
        else:
            # Device tensor: a blocking device-to-host copy of just this chunk.
            torch.from_numpy(dst).copy_(flat[start : start + dst.size])

    def release(self) -> None:
        self._flat = None


def stage_to_pinned(jobs: list[tuple[Any, torch.Tensor]]) -> Callable[[], None]:
    """Start non-blocking device-to-host copies of CUDA sources into pinned destinations.

    Ordering (see savepoint.async_.staging): the side stream waits for the current stream, the
    copies run on the side stream, the current stream then waits for the side stream, and each
    source tensor is recorded on the side stream. Returns a function that blocks until the
    copies have landed (the background writer calls it)."""
    by_device: dict[Any, list[tuple[Any, torch.Tensor]]] = {}
    for source, dst in jobs:
        by_device.setdefault(source._tensor.device, []).append((source, dst))
    events = []
    for device, items in by_device.items():
        with torch.cuda.device(device):
            current = torch.cuda.current_stream(device)
            side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
            side.wait_stream(current)
            with torch.cuda.stream(side):
                for source, dst in items:
                    src = source._tensor.contiguous().reshape(-1).view(torch.uint8)
                    dst.copy_(src, non_blocking=True)  # dst: a slice of the pinned arena
                    src.record_stream(side)
                    source._tensor.record_stream(side)
            current.wait_stream(side)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(side)
            events.append(event)

    def wait() -> None:
        for event in events:
            event.synchronize()

    return wait


def byte_view(target: Any) -> np.ndarray[Any, Any] | None:
    if not isinstance(target, torch.Tensor):
        return None
    t = target.detach()
    if t.device.type != "cpu" or not t.is_contiguous() or t.layout != torch.strided:
        return None
    if t.is_conj() or t.is_neg():
        return None
    return t.reshape(-1).view(torch.uint8).numpy()


def empty(d: DType, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.empty(shape, dtype=dtypes.torch_dtype(d))


def from_numpy(array: np.ndarray[Any, Any], d: DType) -> torch.Tensor:
    """A torch tensor sharing ``array``'s memory, for any stored dtype (bfloat16, float8 included)."""
    flat = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    if not flat.flags.writeable:  # torch wants writable memory (frombuffer would warn)
        flat = flat.copy()
    t = torch.from_numpy(flat)
    return t.view(dtypes.torch_dtype(d)).reshape(array.shape)


def copy_into(target: torch.Tensor, host: np.ndarray[Any, Any], d: DType) -> None:
    """Copy host data into a target that cannot be filled directly (device, non-contiguous)."""
    with torch.no_grad():
        target.copy_(from_numpy(host, d))


def to_device(t: torch.Tensor, device: Any) -> torch.Tensor:
    return t.to(device)
