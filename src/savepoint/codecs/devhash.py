"""``mlh64``: a checksum that a GPU computes at memory speed and a CPU computes identically.

XXH3 is a sequential hash: fast on one CPU core, but it cannot be spread over the thousands of
threads of a GPU. ``mlh64`` is a *multilinear* hash over 16-bit units: every unit is multiplied
by a key that depends only on its position and the products are summed, so any slice of the data
can be hashed by any thread, in any order, and the partial sums added. It is exact integer
arithmetic (no floating-point rounding, no reduction-order effects), so the digest of a tensor
hashed on a GPU, by a Triton kernel or by torch operations, is bit-for-bit the digest NumPy
computes from the same bytes on the host.

Definition (what every implementation computes)::

    p      = 2**31 - 1                      (a Mersenne prime)
    u[j]   = bytes 2j, 2j+1 as a little-endian *signed* 16-bit integer
             (an odd last byte b is the unit b)
    W      = 32768 units (64 KiB) per window; window t holds units [t*W, (t+1)*W)
    K[l,r] = splitmix64(0x5AFE9017 + l*W + r) mod 65535 + 1,  l in {0, 1}, r in [0, W)
    s[l,t] = sum_r K[l,r] * u[t*W + r]        (exact: |s| < 2**47)
    S[l]   = sum_t (s[l,t] mod p) * g[l]**(t+1)  mod p,   g = (16807, 48271)
    digest = XXH3-64 of the 24 bytes S[0], S[1], n (uint64, little-endian), as 16 hex digits

The window sums are the part that touches every byte; the fold over windows reads 16 bytes per
64 KiB window and runs on the host. Any change of one unit changes ``s`` by ``K * delta`` with
``0 < K < 2**16`` and ``0 < |delta| < 2**16``, never a multiple of the prime ``p``: every change
confined to one unit is detected, and the two lanes make a random corruption pass with
probability about 2**-62. Like XXH3 it is a checksum against accidents, not a MAC.

Implementations here:

- :func:`window_sums` (NumPy, host bytes): each batch of windows is converted to float64 and
  multiplied by the key matrix with BLAS. Products are below 2**32 and sums below 2**47, so every
  partial sum is an integer float64 holds exactly, whatever the summation order.
- :func:`torch_window_sums` (a CUDA tensor): a Triton kernel when Triton imports, chosen over a
  hand-written CUDA kernel (CuPy) and over torch operations because one kernel reads every byte
  once and keeps the products in registers (torch operations would write the float64 copy of
  each batch to device memory and read it again), and because Triton's interpreter runs the very
  same kernel on the CPU, so the suite checks it against NumPy without a GPU. Without Triton the
  same float64 matrix product runs as torch operations on the device (cuBLAS FP64 is exact here
  for the same reason).

``Hasher`` streams host bytes in any piece sizes (a reader checking a tensor as it copies it).
A digest of this algorithm is written ``"mlh64:<16 hex>"`` in memory (see
:mod:`savepoint.codecs.checksum`); manifests from version 6 record it per tensor.
"""

from __future__ import annotations

import functools
import struct
import threading
from typing import Any

import numpy as np
import xxhash

__all__ = [
    "ALGORITHM",
    "Hasher",
    "P",
    "PREFIX",
    "WINDOW",
    "WINDOW_UNITS",
    "digest",
    "finish",
    "fold",
    "keys",
    "torch_window_sums",
    "window_sums",
]

ALGORITHM = "mlh64"
PREFIX = ALGORITHM + ":"
P = (1 << 31) - 1
WINDOW_UNITS = 32768
WINDOW = 2 * WINDOW_UNITS  # bytes per window
_SEED = 0x5AFE9017
_GENERATORS = (16807, 48271)  # primitive roots of P
_BATCH = 64  # windows converted to float64 at a time on the host (16 MiB of float64)
_MASK64 = (1 << 64) - 1


def _splitmix64(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        out: np.ndarray[Any, Any] = z ^ (z >> np.uint64(31))
        return out


@functools.cache
def keys() -> np.ndarray[Any, Any]:
    """The key matrix ``K``, shape (2, W), int64 values in [1, 65535]."""
    index = np.arange(2 * WINDOW_UNITS, dtype=np.uint64) + np.uint64(_SEED)
    k = (_splitmix64(index) % np.uint64(65535)).astype(np.int64) + 1
    out: np.ndarray[Any, Any] = k.reshape(2, WINDOW_UNITS)
    out.flags.writeable = False
    return out


@functools.cache
def _float_keys() -> np.ndarray[Any, Any]:
    """``K`` transposed, as float64 (W, 2): the right operand of the window products."""
    out = np.ascontiguousarray(keys().T.astype(np.float64))
    out.flags.writeable = False
    return out


class _Powers:
    """``g[l] ** e mod P`` for arrays of exponents: two tables (low 11 bits, high bits) grown
    as needed, so a fold over a million windows is a few vector operations."""

    LOW = 2048

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._low = np.array(
            [[pow(g, i, P) for i in range(self.LOW)] for g in _GENERATORS], dtype=np.int64
        )
        self._high = np.ones((2, 1), dtype=np.int64)

    def __call__(self, exponents: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        """(len(exponents), 2): column ``l`` holds ``g[l] ** e mod P``."""
        high = exponents // self.LOW
        need = int(high.max()) + 1 if len(high) else 1
        with self._lock:
            if self._high.shape[1] < need:
                grown = max(need, 2 * self._high.shape[1])
                step = [pow(g, self.LOW, P) for g in _GENERATORS]
                rows = []
                for lane, g_step in enumerate(step):
                    row = [int(self._high[lane, 0])]
                    for _ in range(1, grown):
                        row.append(row[-1] * g_step % P)
                    rows.append(row)
                self._high = np.array(rows, dtype=np.int64)
            table_high = self._high
        low = exponents % self.LOW
        out: np.ndarray[Any, Any] = (table_high[:, high] * self._low[:, low] % P).T
        return out


_powers = _Powers()


def window_sums(data: Any) -> np.ndarray[Any, Any]:
    """``s`` of host bytes (a uint8 array or any buffer): int64, shape (windows, 2)."""
    a = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data
    a = a.reshape(-1)
    if a.dtype != np.uint8:
        a = a.view(np.uint8)
    n = len(a)
    windows = -(-n // WINDOW)
    out = np.empty((windows, 2), dtype=np.int64)
    full = n // WINDOW
    k = _float_keys()
    if full:
        units = a[: full * WINDOW].view("<i2").reshape(full, WINDOW_UNITS)
        for start in range(0, full, _BATCH):
            stop = min(start + _BATCH, full)
            product = units[start:stop].astype(np.float64) @ k
            out[start:stop] = product.astype(np.int64)
    if full < windows:
        tail = np.zeros(WINDOW, dtype=np.uint8)
        tail[: n - full * WINDOW] = a[full * WINDOW :]
        out[full] = (tail.view("<i2").astype(np.float64) @ k).astype(np.int64)
    return out


def fold(sums: np.ndarray[Any, Any], first: int = 0) -> tuple[int, int]:
    """The lanes' ``S`` contribution of windows ``first, first + 1, ...`` with window sums
    ``sums`` (int64, (windows, 2)); contributions of consecutive pieces add modulo P."""
    if not len(sums):
        return 0, 0
    m = np.asarray(sums, dtype=np.int64) % P
    exponents = np.arange(first + 1, first + 1 + len(m), dtype=np.int64)
    terms = m * _powers(exponents) % P
    total = terms.sum(axis=0) % P
    return int(total[0]), int(total[1])


def finish(lanes: tuple[int, int], nbytes: int) -> str:
    """The digest, in its tagged form ``mlh64:<16 hex>``."""
    value = xxhash.xxh3_64_intdigest(struct.pack("<QQQ", lanes[0], lanes[1], nbytes & _MASK64))
    return f"{PREFIX}{value:016x}"


def digest(data: Any) -> str:
    """The ``mlh64`` digest of host bytes (any buffer), tagged: ``mlh64:<16 hex>``."""
    a = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data
    a = a.reshape(-1).view(np.uint8)
    return finish(fold(window_sums(a)), len(a))


class Hasher:
    """``mlh64`` over a stream of host bytes fed in order, in pieces of any size (what a reader
    checking a tensor while it copies it needs). :meth:`hexdigest` gives the tagged digest."""

    def __init__(self) -> None:
        self._pending = np.zeros(WINDOW, dtype=np.uint8)
        self._fill = 0
        self._windows = 0
        self._lanes = (0, 0)
        self._nbytes = 0

    def _add(self, sums: np.ndarray[Any, Any]) -> None:
        a, b = fold(sums, self._windows)
        self._lanes = ((self._lanes[0] + a) % P, (self._lanes[1] + b) % P)
        self._windows += len(sums)

    def update(self, data: Any) -> None:
        a = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data
        a = a.reshape(-1).view(np.uint8)
        self._nbytes += len(a)
        pos = 0
        if self._fill:
            take = min(WINDOW - self._fill, len(a))
            self._pending[self._fill : self._fill + take] = a[:take]
            self._fill += take
            pos = take
            if self._fill < WINDOW:
                return
            self._add(window_sums(self._pending))
            self._fill = 0
        full = (len(a) - pos) // WINDOW * WINDOW
        if full:
            self._add(window_sums(a[pos : pos + full]))
            pos += full
        rest = len(a) - pos
        if rest:
            self._pending[:rest] = a[pos:]
            self._fill = rest

    def hexdigest(self) -> str:
        lanes = self._lanes
        if self._fill:
            a, b = fold(window_sums(self._pending[: self._fill]), self._windows)
            lanes = ((lanes[0] + a) % P, (lanes[1] + b) % P)
        return finish(lanes, self._nbytes)


# -- torch (device) implementations ----------------------------------------------------------


def torch_window_sums(flat: Any, *, use_triton: bool | None = None) -> Any:
    """``s`` of a 1-D uint8 torch tensor's bytes, computed where the tensor lives: an int64
    tensor of shape (windows, 2) on the same device (queued on the current stream, not waited
    for). A CPU tensor goes through :func:`window_sums`. ``use_triton``: None picks the Triton
    kernel when Triton imports and the tensor is on a CUDA device; True insists (the tests run
    it under Triton's interpreter on the CPU); False uses torch operations."""
    import torch

    n = int(flat.numel())
    windows = -(-n // WINDOW)
    if use_triton is None:
        if flat.device.type == "cpu":
            return torch.from_numpy(window_sums(flat.numpy()))
        use_triton = flat.device.type == "cuda" and _triton() is not None
    if windows == 0:
        return torch.empty((0, 2), dtype=torch.int64, device=flat.device)
    even = n - (n & 1)
    units = flat[:even].view(torch.int16) if even and flat.storage_offset() % 2 == 0 else None
    if even and units is None:
        units = flat[:even].clone().view(torch.int16)  # an odd start address: realign once
    k = _keys_on(flat.device)[0]
    if use_triton:
        out = _triton_sums(units, even // 2, windows, k)
    else:
        out = _torch_sums(units, even // 2, windows, flat.device)
    if n & 1:  # an odd last byte is the unit (0, b): add its products
        last = flat[n - 1 :].to(torch.int64)
        r = (n // 2) % WINDOW_UNITS
        out[windows - 1] += last * k[:, r]
    return out


def _torch_sums(units: Any, count: int, windows: int, device: Any) -> Any:
    import torch

    out = torch.zeros((windows, 2), dtype=torch.int64, device=device)
    if units is None or count == 0:
        return out
    k = _keys_on(device)[1]
    full = count // WINDOW_UNITS
    view = units[: full * WINDOW_UNITS].view(full, WINDOW_UNITS)
    for start in range(0, full, 4 * _BATCH):
        stop = min(start + 4 * _BATCH, full)
        out[start:stop] = (view[start:stop].to(torch.float64) @ k).to(torch.int64)
    if full * WINDOW_UNITS < count:
        tail = torch.zeros(WINDOW_UNITS, dtype=torch.float64, device=device)
        tail[: count - full * WINDOW_UNITS] = units[full * WINDOW_UNITS :].to(torch.float64)
        out[full] = (tail @ k).to(torch.int64)
    return out


_DEVICE_KEYS: dict[Any, tuple[Any, Any, Any]] = {}


def _keys_on(device: Any) -> tuple[Any, Any, Any]:
    """``K`` on ``device``, copied once: as int64 (the odd byte's products), float64 transposed
    (the torch-operations product) and int32 (the Triton kernel's)."""
    import torch

    cached = _DEVICE_KEYS.get(device)
    if cached is None:
        cached = _DEVICE_KEYS[device] = (
            torch.from_numpy(keys().copy()).to(device),
            torch.from_numpy(_float_keys().copy()).to(device),
            torch.from_numpy(keys().astype(np.int32)).to(device),
        )
    return cached


@functools.cache
def _triton() -> Any:
    try:
        import triton
        import triton.language as tl
    except Exception:  # not installed, or broken (no driver): torch operations instead
        return None

    @triton.jit  # type: ignore[untyped-decorator]
    def window_sums_kernel(  # type: ignore[no-untyped-def]
        units_ptr,
        keys_ptr,
        out_ptr,
        count,
        WINDOW_UNITS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        base = t * WINDOW_UNITS
        acc0 = tl.zeros([BLOCK], dtype=tl.int64)
        acc1 = tl.zeros([BLOCK], dtype=tl.int64)
        for start in range(0, WINDOW_UNITS, BLOCK):
            r = start + tl.arange(0, BLOCK)
            index = base + r
            u = tl.load(units_ptr + index, mask=index < count, other=0).to(tl.int32)
            k0 = tl.load(keys_ptr + r).to(tl.int32)
            k1 = tl.load(keys_ptr + WINDOW_UNITS + r).to(tl.int32)
            # |u * k| < 2**31: the products fit int32; the sums need int64.
            acc0 += (u * k0).to(tl.int64)
            acc1 += (u * k1).to(tl.int64)
        tl.store(out_ptr + 2 * t, tl.sum(acc0, axis=0))
        tl.store(out_ptr + 2 * t + 1, tl.sum(acc1, axis=0))

    return window_sums_kernel


def _triton_sums(units: Any, count: int, windows: int, k: Any) -> Any:
    import torch

    kernel = _triton()
    if kernel is None:
        raise RuntimeError("Triton is not available")
    out = torch.zeros((windows, 2), dtype=torch.int64, device=k.device)
    if units is None or count == 0:
        return out
    keys32 = _keys_on(k.device)[2]
    kernel[(windows,)](units, keys32, out, count, WINDOW_UNITS=WINDOW_UNITS, BLOCK=2048)
    return out
