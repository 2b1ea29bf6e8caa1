"""Staging: the copy of a state that training can no longer change, laid out as the files to write.

``StagingArena.stage(flat)`` plans the data files (same split as a synchronous save), then copies
every tensor into one host buffer at the very position it will have in its file, header included,
each file starting on a 4 KiB boundary. The background writer
(:func:`savepoint.engine.save.save_staged`) then computes the checksums from the images and writes
each image straight from the arena through the store's blob writer (with ``O_DIRECT`` on local
disks: no second copy). What blocks the caller is only the copy into the arena, spread over all
cores.

The arena is allocated once, the size of the state, and reused by every later save (touched at
allocation: first-touch page faults cost more than the copy itself on the development machine);
when a state outgrows it, it is replaced by one with 25% headroom; it is never shrunk. There is
one arena per AsyncCheckpointer and one save in flight, so async saving holds exactly one staging
copy.

CUDA tensors are staged into pinned host memory with non-blocking copies on a side stream. The
side stream first waits for the current stream, so the copies see every kernel queued before
``save()``; the current stream then waits for the side stream, so kernels queued after ``save()``
(the next training step) cannot overwrite a tensor before it is copied, and the tensors are
marked as used by the side stream so the caching allocator cannot recycle them early. ``save()``
returns without waiting for the copies; the writer waits on a CUDA event before touching the bytes.

Host checksums: host tensors are hashed (XXH3) while they are copied, each 256 KiB piece right
after it lands in the arena, while it is still in cache: the background writer (thread or
process) then has nothing left to hash for them. On the development machine hashing a piece
just copied costs about half the CPU time of hashing it back from memory later (0.036 s against
0.065 s of one core per GiB), and the writer's CPU time per GiB drops by that much more (XXH3
was two thirds of the writer process's CPU). A tensor is copied and hashed in order by one
thread, so the largest tensors are copied in parallel pieces instead (and hashed by the writer)
where copying them whole would leave a core idle: whole tensors are kept only while list
scheduling them, largest first, keeps the busiest thread within 10% of an even share.
``stage(hash_host=False)`` (incremental saves: the blob store hashes with its own digest) copies only.

Device checksums: a CUDA tensor of at least :data:`DEVICE_HASH_MIN` bytes is also hashed on its
device, on the same side stream, right after its copy is queued (``mlh64``, see
:mod:`savepoint.codecs.devhash`); the window sums of all of them come back to pinned memory in
one copy with the staged bytes, and the writer folds them into digests instead of hashing those
bytes on the host. The manifest then records ``mlh64`` for those tensors (version 6).
"""

from __future__ import annotations

import mmap
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from savepoint.codecs import checksum, safetensors
from savepoint.codecs.dtypes import DType
from savepoint.engine import parallel
from savepoint.engine.plan import plan_files
from savepoint.state.arrays import NumpySource, TensorSource
from savepoint.state.tree import Flat, Node

__all__ = ["ArenaSource", "Staged", "StagedFile", "StagingArena", "on_cuda", "staged_sources"]

BLOCK = 4096
_PIECE = 16 << 20
# CUDA tensors this large are hashed on their device while staged; smaller ones cost more in
# kernel launches than XXH3 costs on the host.
DEVICE_HASH_MIN = 1 << 20
# Tests only: hash host tensors of DEVICE_HASH_MIN bytes or more with mlh64 too, so the CPU
# suite runs the device-checksum path through the writer, the manifest and every reader.
DEVICE_HASH_CPU = False
# Host tensors hashed while they are staged (see the module docstring); False leaves all the
# hashing to the writer (benchmarks/bench_writers.py --compare-hashing measures both in one run).
# HASH_WHILE_STAGING for the thread writer's saves, HASH_WHILE_STAGING_FOR_PROCESS for the
# writer process's. Both hash while staging: leaving the hashing to the writer process makes
# save() block for a plain copy (1.02-1.08x a memcpy of 1 GiB against 1.42-1.45x), but in the
# same runs the loop lost as much or more time per save overall (0.23 s against 0.23 s, 0.22 s
# against 0.15 s: the writer reads the arena back to hash it, twice the CPU a GiB), so the
# default is the smaller loss (docs/performance.md, "Third pass").
HASH_WHILE_STAGING = True
HASH_WHILE_STAGING_FOR_PROCESS = True
_HASH_PIECE = 256 << 10  # bytes copied then hashed at a time (in cache: the L2 holds several)
_BALANCE = 1.1  # the busiest thread's share of the copy against an even share


@dataclass
class StagedFile:
    name: str
    header: bytes
    entries: list[safetensors.Entry]  # file order, absolute offsets within the file
    image: np.ndarray[Any, Any]  # the file's bytes, starting 4 KiB-aligned, capacity rounded up
    size: int


@dataclass
class Staged:
    tree: Node
    files: list[StagedFile]
    order: list[str]  # tensor names in state order (the manifest's order)
    wait: Callable[[], None] = field(default=lambda: _nothing())  # blocks until copies land
    # Digests computed while staging, by tensor name (XXH3 of host tensors; mlh64, tagged, of
    # tensors hashed on their device); call after ``wait``.
    checks: Callable[[], dict[str, str]] = field(default=lambda: {})

    @property
    def nbytes(self) -> int:
        return sum(f.size for f in self.files)


def _round(n: int) -> int:
    return -(-n // BLOCK) * BLOCK


class StagingArena:
    """One reusable host buffer for staged states (pinned when a state holds CUDA tensors)."""

    def __init__(self) -> None:
        self._array: np.ndarray[Any, Any] | None = None
        self._keep: Any = None  # the object owning the memory (mmap or pinned tensor)
        self.pinned = False

    @property
    def capacity(self) -> int:
        return 0 if self._array is None else len(self._array)

    def _reserve(self, needed: int, pinned: bool) -> np.ndarray[Any, Any]:
        if self._array is not None and len(self._array) >= needed and self.pinned == pinned:
            return self._array
        # The first arena is the state's size; one that must grow gets 25% headroom, so a state
        # that keeps growing a little does not reallocate (and touch) it at every save.
        grow = 1.25 if self._array is not None and self.pinned == pinned else 1.0
        self._array = self._keep = None
        size = -(-int(needed * grow) // (2 << 20)) * (2 << 20)
        if pinned:
            t = self._pinned_map(size)
            t.fill_(0)
            self._keep, self._array = t, t.numpy()
        else:
            m = self._host_map(size)
            a = np.frombuffer(m, dtype=np.uint8)
            parallel.run_all(lambda i: a[i : i + _PIECE].fill(0), range(0, size, _PIECE))
            self._keep, self._array = m, a
        self.pinned = pinned
        return self._array

    def _pinned_map(self, size: int) -> Any:
        """Pinned host memory of ``size`` bytes, as a torch uint8 tensor (the caching host
        allocator's here; the shared memory registered with CUDA in
        :class:`savepoint.async_.process.SharedArena`)."""
        import torch

        return torch.empty(size, dtype=torch.uint8, pin_memory=True)

    def _host_map(self, size: int) -> mmap.mmap:
        """The host memory of an arena of ``size`` bytes (anonymous here; shared with the writer
        process in :class:`savepoint.async_.process.SharedArena`)."""
        return mmap.mmap(-1, size)

    def release(self) -> None:
        self._array = self._keep = None

    def stage(
        self,
        flat: Flat,
        max_file_bytes: int,
        *,
        hash_on_device: bool = True,
        hash_host: bool = True,
    ) -> Staged:
        """Copy ``flat``'s tensors into the arena, laid out as the files they will be written to
        (``hash_host``: host tensors hashed as they are copied, see the module docstring).
        ``hash_on_device=False``: no CUDA tensor is hashed on its device (``Staged.checks`` is
        empty; for a writer that hashes the bytes it writes on the host, as a sharded save's)."""
        layouts = []
        total = 0
        for fp in plan_files(flat.tensors, max_file_bytes):
            layouts.append((fp.name, fp.header, list(fp.entries), total, fp.size))
            total += _round(fp.size)
        cuda = [s for s in flat.tensors.values() if on_cuda(s)]
        arena = self._reserve(max(total, BLOCK), pinned=bool(cuda))
        files = []
        host_jobs: list[tuple[str, TensorSource, np.ndarray[Any, Any]]] = []
        device_jobs: list[tuple[str, TensorSource, np.ndarray[Any, Any]]] = []
        host_checked: list[tuple[str, np.ndarray[Any, Any]]] = []
        for name, header, entries, base, size in layouts:
            image = arena[base : base + _round(size)]
            image[: len(header)] = np.frombuffer(header, dtype=np.uint8)
            for e in entries:
                source = flat.tensors[e.name]
                dst = image[e.start : e.end]
                if on_cuda(source):
                    device_jobs.append((e.name, source, dst))
                else:
                    host_jobs.append((e.name, source, dst))
                    if hash_on_device and DEVICE_HASH_CPU and len(dst) >= DEVICE_HASH_MIN:
                        host_checked.append((e.name, dst))
            files.append(StagedFile(name, header, entries, image, size))
        wait: Callable[[], None] = _nothing
        device_checks: Callable[[], dict[str, str]] = dict
        if device_jobs:
            from savepoint.state import torch_tensors

            base = arena.__array_interface__["data"][0]
            pinned = self._keep  # the pinned torch tensor behind ``arena``
            wait, device_checks = torch_tensors.stage_to_pinned(
                [
                    (name, s, pinned[(o := d.__array_interface__["data"][0] - base) : o + len(d)])
                    for name, s, d in device_jobs
                ],
                hash_min=DEVICE_HASH_MIN if hash_on_device else None,
            )
        for _, source, dst in host_jobs:
            source.copy_to(dst[:0], 0)  # make any contiguous copy once, before the threads
        units = _units(host_jobs, parallel.workers(), hash_host and HASH_WHILE_STAGING)
        host_digests = dict(d for done in parallel.run_all(_copy_unit, units) for d in done)
        for _, source, _ in host_jobs:
            source.release()

        def checks() -> dict[str, str]:
            from savepoint.codecs import devhash

            out = dict(host_digests)
            out.update(device_checks())
            out.update((name, devhash.digest(dst)) for name, dst in host_checked)
            return out

        return Staged(flat.tree, files, list(flat.tensors), wait, checks)

    def snapshot(self, flat: Flat, max_file_bytes: int) -> tuple[Staged, Flat]:
        """``flat`` staged (:meth:`stage`, in parallel, into this reused arena; no device
        checksums), and the staged state as a :class:`Flat` over the arena's bytes
        (:func:`staged_sources`): the snapshot of a sharded save, whose write step plans its
        own files from those sources (the thread writer's, and the writer process's, which
        finds each piece by its place in the shared arena). Training may change ``flat``'s
        tensors once this returns; the arena must not be staged into again before the save is
        done, and a CUDA state's bytes are there once ``Staged.wait()`` returns."""
        kinds = {name: (s.dtype, s.shape, s.kind) for name, s in flat.tensors.items()}
        staged = self.stage(flat, max_file_bytes, hash_on_device=False, hash_host=False)
        return staged, staged_sources(staged, kinds)


def _nothing() -> None:
    pass


def on_cuda(source: TensorSource) -> bool:
    return source.kind == "torch" and getattr(source, "device_type", "cpu") != "cpu"


# A unit of the pool's copy work: tensors copied whole and hashed, ``(name, source, dst)``, and
# pieces of tensors copied only, ``(None, source, piece of dst, start)``.
_Job = tuple[str, TensorSource, np.ndarray[Any, Any]]
_Task = tuple[str | None, TensorSource, np.ndarray[Any, Any], int]


def _units(jobs: list[_Job], workers: int, hashed: bool) -> list[list[_Task]]:
    """Copy work in ~16 MiB units, small tensors bundled. With ``hashed`` tensors are whole
    (copied and hashed in order by one thread) except the largest ones that list scheduling
    cannot balance (see the module docstring), cut into 16 MiB pieces as all are without."""
    jobs = sorted((j for j in jobs if len(j[2])), key=lambda j: len(j[2]), reverse=True)
    big = [len(dst) for _, _, dst in jobs if len(dst) > _PIECE]
    cut = len(jobs)  # the first ``cut`` jobs (the largest) are cut into pieces
    if hashed:
        small = sum(len(dst) for _, _, dst in jobs) - sum(big)
        cut = 0
        while cut < len(big) and not _balanced(big[cut:], big[:cut], small, workers):
            cut += 1
    tasks: list[_Task] = []
    for i, (name, source, dst) in enumerate(jobs):
        if i >= cut:
            tasks.append((name, source, dst, 0))
        else:
            tasks.extend((None, source, dst[p : p + _PIECE], p) for p in range(0, len(dst), _PIECE))
    return parallel.bundles(tasks, lambda t: len(t[2]))


def _balanced(whole: list[int], cut: list[int], small: int, workers: int) -> bool:
    """Whether list scheduling, largest first, of the big tensors ``whole``, of 16 MiB pieces
    of those ``cut`` and of ``small`` bytes of small tensors (bundled into units of that size)
    keeps the busiest of ``workers`` within :data:`_BALANCE` of an even share, or within one
    unit of it (a small state)."""
    sizes = whole + [min(_PIECE, n - p) for n in cut for p in range(0, n, _PIECE)]
    sizes += [_PIECE] * (small // _PIECE) + [small % _PIECE]
    sizes.sort(reverse=True)
    loads = [0] * workers
    for n in sizes:
        loads[loads.index(min(loads))] += n
    even = sum(sizes) / workers
    return max(loads) <= max(even * _BALANCE, even + _PIECE)


def _copy_unit(unit: list[_Task]) -> list[tuple[str, str]]:
    """Copy a unit's tensors and pieces; the digests of the tensors copied whole."""
    digests = []
    for name, source, dst, pos in unit:
        if name is None:
            source.copy_to(dst, pos)
            continue
        hasher = checksum.new()
        for p in range(0, len(dst), _HASH_PIECE):
            piece = dst[p : p + _HASH_PIECE]
            source.copy_to(piece, p)
            hasher.update(piece)
        digests.append((name, checksum.hexdigest(hasher)))
    return digests


class ArenaSource(NumpySource):
    """A staged tensor: its bytes in the staging arena (a uint8 view), with the dtype, shape and
    kind of the tensor it was copied from."""

    __slots__ = ()

    @property
    def view(self) -> np.ndarray[Any, Any]:
        """The staged bytes: a flat uint8 view of the arena."""
        return self._array

    def __init__(
        self, data: np.ndarray[Any, Any], dtype: DType, shape: tuple[int, ...], kind: str
    ) -> None:
        super().__init__(data, "")
        self.dtype = dtype
        self.shape = shape
        self.kind = kind


def staged_sources(staged: Staged, kinds: dict[str, tuple[DType, tuple[int, ...], str]]) -> Flat:
    """The staged state as a :class:`~savepoint.state.tree.Flat` whose sources are the arena's
    bytes (``kinds``: each tensor's dtype, shape and kind as it was staged): what an incremental
    save puts into the blob store, from the thread writer or the writer process alike."""
    sources: dict[str, TensorSource] = {}
    for f in staged.files:
        for e in f.entries:
            sources[e.name] = ArenaSource(f.image[e.start : e.end], *kinds[e.name])
    return Flat(staged.tree, {name: sources[name] for name in staged.order})
