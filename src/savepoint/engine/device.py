"""Loads onto a GPU: each tensor read through a ring of pinned buffers, copied to the device on a
side stream while the next piece is read, and checked where that is cheapest.

A tensor stored whole in a data file, loaded into (or, with ``device=``, allocated on) a CUDA
tensor, never exists whole in host memory: :func:`fill` reads it :data:`PIECE` bytes at a time
into one of :data:`BUFFERS` pinned buffers (spread over the read pool), queues a non-blocking
host-to-device copy of that buffer on a side stream and moves on to the next piece, waiting
only when it comes back to a buffer whose copy has not finished. So the disk (or page cache)
and the host-to-device link work at the same time, and the host holds at most
``BUFFERS x PIECE`` bytes of the state.

Checks: a tensor saved with an ``mlh64`` checksum (hashed on its GPU when it was staged, see
:mod:`savepoint.codecs.devhash`) is hashed again on the device, piece by piece, right after each
piece lands (window sums on the side stream; one small copy back at the end): the host does no
hashing at all. A tensor saved with XXH3 is hashed from the pinned buffer on the host, which
overlaps with the copy of the same piece. A mismatch raises CorruptCheckpointError naming the
tensor; the target then holds unchecked bytes, as with any failed ``sp.load(into=...)``.

The current stream waits for the side stream before :func:`fill` returns, so kernels queued
after the load see the loaded values.

On the CPU (tests set :data:`CPU_TARGETS`), the same loop runs with plain buffers and
synchronous copies, so the suite exercises the piece arithmetic and both kinds of checks.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from savepoint.codecs import checksum, devhash
from savepoint.engine import parallel

if TYPE_CHECKING:
    from savepoint.engine.read import Reader

__all__ = ["BUFFERS", "CPU_TARGETS", "PIECE", "eligible", "fill", "stats"]

log = logging.getLogger(__name__)

PIECE = 16 << 20  # a multiple of devhash.WINDOW: window sums of consecutive pieces add up
BUFFERS = 4
_READ_SPLIT = 4 << 20  # a piece is read by the pool in parts of this size
# Tests only: treat contiguous CPU torch tensors as device targets (plain buffers, no streams).
CPU_TARGETS = False

assert PIECE % devhash.WINDOW == 0

# What the last fill did (the GPU check reports it): tensors, bytes, pieces, how they were checked.
stats: dict[str, int] = {}


def eligible(record: Any, target: Any) -> bool:
    """Whether ``target`` (a tensor the load fills) for ``record`` takes the device path: a
    contiguous torch tensor on a CUDA device (or on the CPU, under :data:`CPU_TARGETS`), and a
    record stored whole in a data file, checked whole (not a shard, a blob recipe, or a tensor
    with block checksums)."""
    if record.recipe is not None or len(record.shards) > 1 or record.block or not record.nbytes:
        return False
    if record.dtype == "BOOL":
        return False  # its bytes are checked for values other than 0 and 1 on the host
    torch = sys.modules.get("torch")  # never imported here: a target of torch's means it is
    if torch is None or not isinstance(target, torch.Tensor) or not target.is_contiguous():
        return False
    if target.is_conj() or target.is_neg() or target.nbytes != record.nbytes:
        return False
    kind = target.device.type
    return kind == "cuda" or (CPU_TARGETS and kind == "cpu")


def fill(
    reader: Reader,
    items: Sequence[tuple[str, Any]],
    *,
    verify: bool,
    progress: Callable[[int], None] | None = None,
) -> None:
    """Read each ``(ref, target)`` (targets :func:`eligible` for their records) into its target,
    checked with ``verify`` (see the module docstring)."""
    by_device: dict[Any, list[tuple[str, Any]]] = {}
    for ref, target in items:
        by_device.setdefault(target.device, []).append((ref, target))
    for group in by_device.values():  # one ring and one side stream per device
        _fill_device(reader, group, verify=verify, progress=progress)


def _fill_device(
    reader: Reader,
    items: Sequence[tuple[str, Any]],
    *,
    verify: bool,
    progress: Callable[[int], None] | None,
) -> None:
    """:func:`fill` of targets that are all on one device."""
    import torch

    cuda = items[0][1].device.type == "cuda"
    device = items[0][1].device
    ring = _Ring(torch, device, cuda)
    checks: list[tuple[str, Any, str, int]] = []  # (ref, device window sums, expected, bytes)
    done = {"tensors": 0, "bytes": 0, "pieces": 0, "device_checked": 0, "host_checked": 0}
    try:
        for ref, target in items:
            rec = reader.manifest.tensors[ref]
            opened = reader.open_file(rec.file, check_header=verify)
            dst = target.detach().reshape(-1).view(torch.uint8)
            on_device = verify and checksum.is_tagged(rec.xxh3)
            hasher = checksum.Hasher(expect=rec.xxh3) if verify and not on_device else None
            sums: list[Any] = []
            for pos in range(0, rec.nbytes, PIECE):
                n = min(PIECE, rec.nbytes - pos)
                buf = ring.next()
                host = buf[:n].numpy()
                _read(reader, opened, rec.start + pos, host)
                if hasher is not None:
                    hasher.update(host)
                with ring.on_side():
                    dst[pos : pos + n].copy_(buf[:n], non_blocking=cuda)
                    if on_device:
                        sums.append(devhash.torch_window_sums(dst[pos : pos + n]))
                ring.used(buf)
                done["pieces"] += 1
                if progress is not None:
                    progress(n)
            if hasher is not None and hasher.result().xxh3 != rec.xxh3:
                raise reader._corrupt(f"checksum mismatch in tensor {ref!r}", key=ref)
            if on_device:
                checks.append((ref, sums, rec.xxh3, rec.nbytes))
            done["tensors"] += 1
            done["bytes"] += rec.nbytes
            done["device_checked" if on_device else "host_checked"] += int(verify)
        ring.finish()
        for ref, sums, expected, nbytes in checks:
            host_sums = torch.cat(sums).cpu().numpy()
            if devhash.finish(devhash.fold(host_sums), nbytes) != expected:
                raise reader._corrupt(f"checksum mismatch in tensor {ref!r}", key=ref)
    finally:
        ring.finish()
        stats.clear()
        stats.update(done)
    log.debug("device fill: %s", done)


def _read(reader: Reader, opened: Any, start: int, out: np.ndarray[Any, Any]) -> None:
    """Bytes ``[start, start + len(out))`` of a data file into ``out``, in parts on the pool."""
    parts = range(0, len(out), _READ_SPLIT)

    def read_part(pos: int) -> None:
        piece = out[pos : pos + _READ_SPLIT]
        if opened.array is not None:
            np.copyto(piece, opened.array[start + pos : start + pos + len(piece)])
            return
        try:
            opened.blob.read(start + pos, piece)
        except EOFError:
            raise reader._corrupt("a data file shrank while being read") from None

    if len(parts) == 1:
        read_part(0)
    else:
        parallel.run_all(read_part, parts)


class _Ring:
    """:data:`BUFFERS` host buffers (pinned on CUDA) used in turn, each reused only once the
    copy that last read it has finished; and the side stream those copies run on."""

    def __init__(self, torch: Any, device: Any, cuda: bool) -> None:
        self._torch = torch
        self._cuda = cuda
        self._buffers = [
            torch.empty(PIECE, dtype=torch.uint8, pin_memory=cuda) for _ in range(BUFFERS)
        ]
        self._events: list[Any] = [None] * BUFFERS
        self._turn = 0
        self._stream: Any = None
        if cuda:
            self._current = torch.cuda.current_stream(device)
            self._stream = torch.cuda.Stream(device)
            # The targets may still be in use by kernels queued before the load.
            self._stream.wait_stream(self._current)
        self._finished = False

    def next(self) -> Any:
        i = self._turn % BUFFERS
        if self._events[i] is not None:
            self._events[i].synchronize()
            self._events[i] = None
        return self._buffers[i]

    def on_side(self) -> Any:
        if self._stream is None:
            import contextlib

            return contextlib.nullcontext()
        return self._torch.cuda.stream(self._stream)

    def used(self, buf: Any) -> None:
        i = self._turn % BUFFERS
        if self._cuda:
            event = self._torch.cuda.Event()
            event.record(self._stream)
            self._events[i] = event
        self._turn += 1

    def finish(self) -> None:
        if self._finished:
            return
        self._finished = True
        if self._stream is not None:
            self._stream.synchronize()
            self._current.wait_stream(self._stream)
