"""torch adapter. Imported only when the state already holds torch tensors or torch output is asked for.

Save side: ``TorchSource`` exposes a CPU tensor's bytes as a zero-copy numpy uint8 view (every
dtype, bfloat16 and float8 included, by viewing the storage as uint8). A tensor on another device
is copied to host one staging chunk at a time, so a GPU state never needs a whole host copy.
Load side: ``byte_view`` gives the writable bytes of a CPU tensor so reads land in it directly.
"""

from __future__ import annotations

import ctypes
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
    "cuda_device",
    "empty",
    "from_address",
    "from_numpy",
    "stage_to_pinned",
    "to_device",
]


def _refuse(t: torch.Tensor, key: str) -> None:
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


def _plain(t: torch.Tensor, key: str) -> torch.Tensor:
    # One cheap test for the common case (each torch attribute costs a fraction of a
    # microsecond, which a state of a million tensors pays a million times).
    if t.is_quantized or t.is_meta or t.layout is not _STRIDED:
        _refuse(t, key)
    if t.requires_grad or type(t) is not torch.Tensor:
        t = t.detach()
    if t.dtype in _COMPLEX and t.is_conj():  # only complex tensors carry a conjugate bit
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t


_STRIDED = torch.strided
_COMPLEX = frozenset(
    getattr(torch, name)
    for name in ("complex32", "complex64", "complex128")
    if hasattr(torch, name)
)
_DTYPES: dict[Any, DType] = {}  # torch dtype -> DType, filled as dtypes are met


class TorchSource:
    """A tensor's bytes for a writer (see :class:`savepoint.state.arrays.TensorSource`).

    Built once per tensor of the state, so construction does the least it can and the object is
    small (a state of a million tensors holds a million of these while it is saved): four slots,
    with ``shape`` and ``device_type`` read from the tensor when asked for (``kind`` is the
    class's). The contiguous byte view a copy needs is made on the first :meth:`copy_to`, and a
    small CPU tensor is copied by the write pipeline straight from :meth:`pointer` without one."""

    __slots__ = ("_flat", "_stream", "_tensor", "dtype", "nbytes")

    kind = "torch"

    def __init__(self, tensor: torch.Tensor, key: str) -> None:
        t = _plain(tensor, key)
        d = _DTYPES.get(t.dtype)
        if d is None:
            d = _DTYPES[t.dtype] = dtypes.from_torch(t.dtype, key)
        self.dtype: DType = d
        self._tensor = t
        self._flat: Any = None
        self.nbytes: int = t.nbytes
        # A CUDA tensor is copied (maybe on a pool thread, whose current stream is the default
        # one) on the stream that was current where the save was called: the copy then sees
        # every kernel the caller queued on it before the save, side streams included.
        self._stream: Any = None if t.is_cpu or t.device.type != "cuda" else _current_stream(t)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._tensor.shape)

    @property
    def device_type(self) -> str:
        t = self._tensor
        return "cpu" if t.is_cpu else str(t.device.type)

    def identity(self) -> tuple[Any, ...] | None:
        t = self._tensor
        if self.nbytes == 0:
            return None
        # The address of the first element stands for (storage, offset): with the dtype, shape
        # and strides, equal identities are the same view of the same memory.
        return ("torch", t.device, t.data_ptr(), t.shape, t.stride(), t.dtype)

    def pointer(self) -> int | None:
        """The host address of the tensor's bytes, when they are contiguous in host memory (the
        write pipeline copies small tensors from there, with no view object), else None."""
        t = self._tensor
        if not t.is_cpu or not t.is_contiguous():
            return None
        return int(t.data_ptr())

    def _bytes(self) -> Any:
        if self._flat is None:
            t = self._tensor.contiguous().reshape(-1).view(torch.uint8)
            self._flat = t.numpy() if t.device.type == "cpu" else t
        return self._flat

    def copy_to(self, dst: np.ndarray[Any, Any], start: int) -> None:
        if self._stream is not None:
            # CUDA tensor: the contiguous copy (if any) and a blocking device-to-host copy of
            # just this chunk, both on the caller's stream (see __init__).
            with torch.cuda.stream(self._stream):
                flat = self._bytes()
                torch.from_numpy(dst).copy_(flat[start : start + dst.size])
            return
        flat = self._bytes()
        if isinstance(flat, np.ndarray):
            np.copyto(dst, flat[start : start + dst.size], casting="no")
        else:
            # Another device: a blocking device-to-host copy of just this chunk.
            torch.from_numpy(dst).copy_(flat[start : start + dst.size])

    def release(self) -> None:
        self._flat = None


def _current_stream(t: torch.Tensor) -> Any:
    return torch.cuda.current_stream(t.device)


def stage_to_pinned(
    jobs: list[tuple[str, Any, torch.Tensor]], *, hash_min: int | None = None
) -> tuple[Callable[[], None], Callable[[], dict[str, str]]]:
    """Start non-blocking device-to-host copies of CUDA sources (``(name, source, pinned
    destination)``) into pinned destinations, and hash each source of at least ``hash_min``
    bytes on its device (``mlh64``; None: none).

    Ordering (see savepoint.async_.staging): the side stream waits for the current stream, the
    copies and the hashing kernels run on the side stream, the window sums are copied to pinned
    memory on it too, the current stream then waits for the side stream, and each source tensor
    is recorded on the side stream. Returns a function that blocks until the copies have landed
    (the background writer calls it), and one that then gives the digests by name."""
    from savepoint.codecs import devhash

    by_device: dict[Any, list[tuple[str, Any, torch.Tensor]]] = {}
    for name, source, dst in jobs:
        by_device.setdefault(source._tensor.device, []).append((name, source, dst))
    events = []
    hashed: list[tuple[list[tuple[str, int, int]], torch.Tensor]] = []
    for device, items in by_device.items():
        with torch.cuda.device(device):
            current = torch.cuda.current_stream(device)
            side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
            side.wait_stream(current)
            with torch.cuda.stream(side):
                sums: list[torch.Tensor] = []
                spans: list[tuple[str, int, int]] = []
                for name, source, dst in items:
                    src = source._tensor.contiguous().reshape(-1).view(torch.uint8)
                    dst.copy_(src, non_blocking=True)  # dst: a slice of the pinned arena
                    if hash_min is not None and src.numel() >= hash_min:
                        part = devhash.torch_window_sums(src)
                        spans.append((name, src.numel(), part.shape[0]))
                        sums.append(part)
                    src.record_stream(side)
                    source._tensor.record_stream(side)
                if sums:
                    joined = torch.cat(sums)
                    host = torch.empty(joined.shape, dtype=torch.int64, pin_memory=True)
                    host.copy_(joined, non_blocking=True)
                    joined.record_stream(side)
                    hashed.append((spans, host))
            current.wait_stream(side)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(side)
            events.append(event)

    def wait() -> None:
        for event in events:
            event.synchronize()

    def digests() -> dict[str, str]:
        out: dict[str, str] = {}
        for spans, host in hashed:
            all_sums = host.numpy()
            row = 0
            for name, nbytes, windows in spans:
                out[name] = devhash.finish(devhash.fold(all_sums[row : row + windows]), nbytes)
                row += windows
        return out

    return wait, digests


def byte_view(target: Any) -> np.ndarray[Any, Any] | None:
    if not isinstance(target, torch.Tensor):
        return None
    t = target.detach()
    if t.device.type != "cpu" or not t.is_contiguous() or t.layout != torch.strided:
        return None
    if t.is_conj() or t.is_neg():
        return None
    return t.reshape(-1).view(torch.uint8).numpy()


def empty(d: DType, shape: tuple[int, ...], device: Any = None) -> torch.Tensor:
    return torch.empty(shape, dtype=dtypes.torch_dtype(d), device=device)


# Tests only: treat "cpu" as a device loads allocate on directly (savepoint.engine.device).
CPU_AS_DEVICE = False


def cuda_device(device: Any) -> torch.device | None:
    """``device`` (a ``device=`` argument) as a torch device when it is a CUDA device a load can
    allocate on directly, else None."""
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError):
        return None
    if d.type == "cuda" and torch.cuda.is_available():
        return d
    if CPU_AS_DEVICE and d.type == "cpu":
        return d
    return None


def from_address(address: int, nbytes: int, d: DType, shape: tuple[int, ...]) -> torch.Tensor:
    """A new CPU tensor of dtype ``d`` and ``shape`` holding a copy of the ``nbytes`` bytes at
    host ``address`` (exactly its data): allocated by torch as :func:`empty` is, filled by one
    ``memmove`` (no byte view of the new tensor is made: for a small tensor that view costs more
    than the copy). The caller keeps the bytes alive and checked."""
    dtype = _TORCH_DTYPES.get(d.name)
    if dtype is None:
        dtype = _TORCH_DTYPES[d.name] = dtypes.torch_dtype(d)
    t = torch.empty(shape, dtype=dtype)
    if nbytes:
        ctypes.memmove(t.data_ptr(), address, nbytes)
    return t


_TORCH_DTYPES: dict[str, torch.dtype] = {}


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
