"""Whole copies: tensors stored whole in a data file, copied (or made) from a pinned generation.

:func:`transfer` is the read of a load and of ``verify``: it spreads the tensors over the thread
pool, largest first, small ones (up to :data:`._checks.SMALL`) in bundles, each hashed as it is
copied, a piece at a time, so the check reads memory the copy has just brought into cache; it
hands split tensors to :mod:`._shards` and tensors stored as blobs to :mod:`._blobreads`.
Without a zero-copy view (object stores) a tensor is read with ranged reads straight into its
destination, small neighbours of a file together (:func:`ranged_work`). :func:`materialize` makes
small tensors straight from their checked bytes, :func:`allocate` and :func:`fill_jobs` the
targets of the others. See :mod:`.read`.
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import numpy as np

from savepoint.codecs import checksum, dtypes
from savepoint.codecs import manifest as mf
from savepoint.engine import parallel
from savepoint.engine._blobreads import read_blobs
from savepoint.engine._checks import PIECE, SMALL, check_bool, check_digest, check_read
from savepoint.engine._pin import Generation
from savepoint.engine._shards import ShardTask, assemble, shard_work
from savepoint.errors import CheckpointMemoryError, IncompatibleCheckpointError
from savepoint.state import arrays
from savepoint.storage.base import BlobReader

_Small = TypeVar("_Small", bound=tuple[Any, ...])

# Stores without zero-copy views (object stores): tensors are read with ranged reads straight into
# their destination; small neighbours are read together, one read per group of at most
# GROUP_BYTES whose gaps are at most GAP_BYTES (a GET costs about as much as reading that much).
GROUP_BYTES = 16 << 20
GAP_BYTES = 256 << 10


def transfer(
    gen: Generation,
    jobs: Sequence[tuple[str, np.ndarray[Any, Any] | None]],
    *,
    verify: bool = True,
    progress: Callable[[int], None] | None = None,
) -> None:
    """Copy each ``(ref, dst)`` tensor into ``dst`` (uint8, exact length; None: check only).

    With ``verify`` each tensor is hashed as it is copied, piece by piece, so the check reads
    memory that the copy has just brought into cache (about 15% over a bare copy). Tensors are
    spread over the thread pool, largest first, small ones in bundles. A mismatch raises
    CorruptCheckpointError naming the tensor; other tensors may already have been copied.
    A tensor split over shards is assembled from them, each shard checked the same way.
    """
    # Files are opened (and their sizes and headers checked) here, in order, before any copy.
    work: list[tuple[int, Callable[[], None]]] = []
    split: list[ShardTask] = []
    ranged: list[tuple[str, np.ndarray[Any, Any] | None]] = []
    lock = threading.Lock()
    small: list[tuple[str, mf.TensorRecord, np.ndarray[Any, Any], Any]] = []
    records = gen.manifest.tensors
    files = gen.files
    for ref, dst in jobs:
        rec = records[ref]
        if rec.recipe is not None:
            work.append(
                (
                    rec.nbytes,
                    functools.partial(read_blobs, gen, ref, dst, verify, progress, lock),
                )
            )
            continue
        if len(rec.shards) > 1:
            split.extend(assemble(gen, ref, dst))
            continue
        opened = files.get(rec.file) or gen.open_file(rec.file, check_header=verify)
        if opened.array is None:
            ranged.append((ref, dst))  # read in the pool, straight into dst
            continue
        if rec.end - rec.start <= SMALL and not rec.block:
            small.append((ref, rec, opened.array, dst))
            continue
        src = opened.array[rec.start : rec.end]
        work.append(
            (
                len(src),
                functools.partial(_copy_whole, gen, ref, src, dst, verify, progress, lock),
            )
        )
    for size, bundle in _runs(small):
        work.append((size, functools.partial(_copy_small, gen, bundle, verify, progress, lock)))
    work += ranged_work(gen, ranged, verify=verify, progress=progress, lock=lock)
    work += shard_work(gen, split, verify=verify, progress=progress, lock=lock)
    run_work(work)


def _copy_small(
    gen: Generation,
    items: Sequence[tuple[str, mf.TensorRecord, np.ndarray[Any, Any], Any]],
    verify: bool,
    progress: Callable[[int], None] | None,
    lock: threading.Lock,
) -> None:
    """:func:`_copy_whole` for small tensors (``(ref, record, file view, dst)``), in one
    loop: each hashed in one call, then copied. No hasher, view or task per tensor: a
    100,000-tensor verify spent 20 us a tensor on those."""
    digest = checksum.digest
    for ref, rec, array, dst in items:
        src = array[rec.start : rec.end]
        if verify and digest(src) != rec.xxh3 and not checksum.matches(src, rec.xxh3):
            raise gen.corrupt(f"checksum mismatch in tensor {ref!r}", key=ref)
        if rec.dtype == "BOOL" and (verify or dst is not None):
            check_bool(gen, ref, src)
        if dst is not None:
            np.copyto(dst, src)
        if progress is not None:
            with lock:
                progress(len(src))


def materialize(
    gen: Generation,
    found: dict[str, str],
    framework: str,
    *,
    verify: bool = True,
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """New arrays or tensors, made straight from their checked bytes, for the small tensors
    among ``found`` (ref -> kind) stored whole in files with a zero-copy view; returned by
    ref, chosen as :func:`allocate` chooses. The other refs are left to :func:`allocate` and
    :func:`transfer`. Their files must be prepared (``Reader.prepare``).

    One copy per tensor and no empty allocation, byte view or task to fill later: for a
    100,000-tensor load that took 2.5 s, this takes about 0.3 s. With ``verify`` each is
    hashed before it is made; a mismatch raises CorruptCheckpointError naming the tensor."""
    records = gen.manifest.tensors
    files = gen.files
    torch_ok: bool | None = None
    items: list[tuple[str, mf.TensorRecord, np.ndarray[Any, Any], bool]] = []
    for ref, kind in found.items():
        rec = records[ref]
        if (
            len(rec.shards) > 1
            or rec.block
            or rec.end - rec.start > SMALL
            or rec.recipe is not None
        ):
            continue
        opened = files.get(rec.file)
        if opened is None or opened.array is None:
            continue
        want_torch = framework == "torch"
        if framework == "auto" and kind == "torch":
            if torch_ok is None:
                torch_ok = _torch_available()
            want_torch = torch_ok
        items.append((ref, rec, opened.array, want_torch))
    if not items:
        return {}
    lock = threading.Lock()
    make_torch = None
    if any(item[3] for item in items):
        from savepoint.state import torch_tensors

        make_torch = torch_tensors.from_address

    addresses: dict[int, int] = {}  # id of a file's view -> its address

    def make(bundle: list[tuple[str, mf.TensorRecord, np.ndarray[Any, Any], bool]]) -> Any:
        digest = checksum.digest
        by_name = dtypes.BY_NAME
        made = []
        for ref, rec, array, want_torch in bundle:
            src = array[rec.start : rec.end]
            if verify and digest(src) != rec.xxh3 and not checksum.matches(src, rec.xxh3):
                raise gen.corrupt(f"checksum mismatch in tensor {ref!r}", key=ref)
            d = by_name[rec.dtype]
            if d.name == "BOOL":
                check_bool(gen, ref, src)
            if want_torch:
                assert make_torch is not None
                base = addresses.get(id(array))
                if base is None:
                    base = addresses[id(array)] = array.__array_interface__["data"][0]
                made.append((ref, make_torch(base + rec.start, len(src), d, rec.shape)))
            else:
                made.append((ref, src.view(d.numpy).reshape(rec.shape).copy()))
            if progress is not None:
                with lock:
                    progress(len(src))
        return made

    out: dict[str, Any] = {}
    for made in parallel.run_all(make, [bundle for _, bundle in _runs(items)]):
        out.update(made)
    return out


def _copy_whole(
    gen: Generation,
    ref: str,
    src: np.ndarray[Any, Any],
    dst: np.ndarray[Any, Any] | None,
    verify: bool,
    progress: Callable[[int], None] | None,
    lock: threading.Lock,
) -> None:
    rec = gen.manifest.tensors[ref]
    hasher = checksum.Hasher(rec.block, expect=rec.xxh3) if verify else None
    boolean = rec.dtype == "BOOL"
    for pos in range(0, len(src), PIECE):
        piece = src[pos : pos + PIECE]
        if hasher is not None:
            hasher.update(piece)
        if boolean and (hasher is not None or dst is not None):
            check_bool(gen, ref, piece)
        if dst is not None:
            np.copyto(dst[pos : pos + PIECE], piece)
        if progress is not None:
            with lock:
                progress(len(piece))
    if hasher is not None:
        check_digest(gen, ref, rec.layout()[0], hasher, "")


def ranged_work(
    gen: Generation,
    jobs: Sequence[tuple[str, np.ndarray[Any, Any] | None]],
    *,
    verify: bool,
    progress: Callable[[int], None] | None,
    lock: threading.Lock,
) -> list[tuple[int, Callable[[], None]]]:
    """Work items for tensors of files without a zero-copy view: a big tensor is read into
    its destination by one ranged read (the store may split it into parallel requests);
    small neighbours in a file are read by one request for their whole span, then copied."""
    work: list[tuple[int, Callable[[], None]]] = []
    by_file: dict[str, list[tuple[int, int, str, np.ndarray[Any, Any] | None]]] = {}
    for ref, dst in jobs:
        rec = gen.manifest.tensors[ref]
        by_file.setdefault(rec.file, []).append((rec.start, rec.end, ref, dst))
    for name, items in by_file.items():
        blob = gen.files[name].blob
        # By start, then end: an empty tensor at a neighbour's start comes before it (its
        # end is not the group's end).
        items.sort(key=lambda item: (item[0], item[1]))
        group: list[tuple[int, int, str, np.ndarray[Any, Any] | None]] = []
        for item in [*items, None]:
            if group and (
                item is None
                or item[0] - group[-1][1] > GAP_BYTES
                or item[1] - group[0][0] > GROUP_BYTES
            ):
                start, end = group[0][0], max(entry[1] for entry in group)
                if len(group) == 1:
                    fn = functools.partial(
                        _read_whole, gen, name, blob, group[0], verify, progress, lock
                    )
                else:
                    fn = functools.partial(
                        _read_group, gen, name, blob, group, verify, progress, lock
                    )
                work.append((end - start, fn))
                group = []
            if item is not None:
                group.append(item)
    return work


def _read_range(
    gen: Generation, name: str, blob: BlobReader, start: int, out: np.ndarray[Any, Any]
) -> None:
    try:
        blob.read(start, out)
    except EOFError:
        raise gen.corrupt(f"data file {name} shrank while being read") from None


def _read_whole(
    gen: Generation,
    name: str,
    blob: BlobReader,
    item: tuple[int, int, str, np.ndarray[Any, Any] | None],
    verify: bool,
    progress: Callable[[int], None] | None,
    lock: threading.Lock,
) -> None:
    """One tensor: read into its destination and checked there, or (no destination: a
    verify pass) read and checked a piece at a time through a bounded buffer."""
    start, end, ref, dst = item
    if dst is not None:
        _read_range(gen, name, blob, start, dst)
        check_read(gen, ref, [dst], verify, progress, lock)
        return
    scratch = np.empty(min(GROUP_BYTES, end - start), dtype=np.uint8)

    def pieces() -> Iterator[np.ndarray[Any, Any]]:
        for pos in range(start, end, len(scratch)):
            piece = scratch[: min(len(scratch), end - pos)]
            _read_range(gen, name, blob, pos, piece)
            yield piece

    check_read(gen, ref, pieces(), verify, progress, lock)


def _read_group(
    gen: Generation,
    name: str,
    blob: BlobReader,
    group: Sequence[tuple[int, int, str, np.ndarray[Any, Any] | None]],
    verify: bool,
    progress: Callable[[int], None] | None,
    lock: threading.Lock,
) -> None:
    """Neighbouring small tensors: one read of their span, then each copied and checked."""
    base = group[0][0]
    span = np.empty(max(entry[1] for entry in group) - base, dtype=np.uint8)
    _read_range(gen, name, blob, base, span)
    for start, end, ref, dst in group:
        _copy_whole(gen, ref, span[start - base : end - base], dst, verify, progress, lock)


def fill_jobs(
    gen: Generation, targets: Iterable[tuple[str, Any]]
) -> tuple[list[tuple[str, np.ndarray[Any, Any] | None]], list[Callable[[], None]]]:
    """Jobs that read straight into each target, plus copies to run afterwards for targets
    that cannot be filled directly (device tensors, non-contiguous or read-only views)."""
    jobs: list[tuple[str, np.ndarray[Any, Any] | None]] = []
    after: list[Callable[[], None]] = []
    for ref, target in targets:
        view = arrays.byte_view(target)
        if view is not None:
            jobs.append((ref, view))
            continue
        rec = gen.manifest.tensors[ref]
        d = dtypes.from_name(rec.dtype)
        host = np.empty(rec.nbytes, dtype=np.uint8)
        jobs.append((ref, host))
        after.append(functools.partial(_copy_into, gen, ref, target, host, d))
    return jobs, after


def _copy_into(
    gen: Generation, ref: str, target: Any, host: np.ndarray[Any, Any], d: dtypes.DType
) -> None:
    shaped = host.view(d.numpy).reshape(gen.manifest.tensors[ref].shape)
    if isinstance(target, np.ndarray):
        if not target.flags.writeable:
            raise IncompatibleCheckpointError(
                f"{gen.shown}: cannot restore {ref!r} into a read-only numpy array",
                path=gen.shown,
            )
        np.copyto(target, shaped, casting="no")
    else:
        from savepoint.state import torch_tensors

        torch_tensors.copy_into(target, shaped, d)


def allocate(
    gen: Generation, ref: str, kind: str, framework: str, *, share_memory: bool = False
) -> Any:
    """A new array or tensor shaped for ``ref``: empty, or (``share_memory``) a view of the
    file's bytes (copy-on-write: the reader was opened with ``copy_on_write``)."""
    rec = gen.manifest.tensors[ref]
    d = dtypes.from_name(rec.dtype)
    want_torch = framework == "torch" or (
        framework == "auto" and kind == "torch" and _torch_available()
    )
    if share_memory and not rec.is_split and rec.recipe is None:
        array = gen.open_file(rec.file).slice(rec.start, rec.end).view(d.numpy).reshape(rec.shape)
        if want_torch:
            from savepoint.state import torch_tensors

            return torch_tensors.from_numpy(array, d)
        return array
    try:
        if want_torch:
            from savepoint.state import torch_tensors

            return torch_tensors.empty(d, rec.shape)
        return np.empty(rec.shape, dtype=d.numpy)
    except (MemoryError, RuntimeError) as exc:
        if isinstance(exc, RuntimeError) and "alloc" not in str(exc):
            raise  # torch reports a failed allocation as a RuntimeError
        raise CheckpointMemoryError(
            f"{gen.shown}: cannot allocate {rec.nbytes} bytes for tensor {ref!r} "
            f"({rec.dtype} {list(rec.shape)}), the size its manifest records: {exc}",
            path=gen.shown,
        ) from None


def _runs(items: list[_Small]) -> list[tuple[int, list[_Small]]]:
    """Small-tensor work items (``item[1]`` a record of at most ``SMALL`` bytes) cut, in their
    order, into runs of about ``parallel.SPLIT`` bytes: a task per run, not per tensor. Returns
    (bytes, run) pairs."""
    out: list[tuple[int, list[_Small]]] = []
    start = filled = 0
    for i, item in enumerate(items):
        rec = item[1]
        filled += rec.end - rec.start
        if filled >= parallel.SPLIT:
            out.append((filled, items[start : i + 1]))
            start, filled = i + 1, 0
    if start < len(items):
        out.append((filled, items[start:]))
    return out


def _torch_available() -> bool:
    if sys.modules.get("torch") is not None:
        return True
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def run_work(work: list[tuple[int, Callable[[], None]]]) -> None:
    """Run ``(bytes, job)`` work on the thread pool, in bundles of about ``parallel.SPLIT``."""

    def run(bundle: list[tuple[int, Callable[[], None]]]) -> None:
        for _, fn in bundle:
            fn()

    parallel.run_all(run, parallel.bundles(work, lambda item: item[0]))
