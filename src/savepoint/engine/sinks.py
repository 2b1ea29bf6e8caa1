"""Sinks: where the writer's bytes go, taken from their source as their plan lays them out.

The writer (:func:`savepoint.engine.save.write`) is configured by its sinks. Each is built in
the writer's first step (the plan: from descriptions alone, before any file is created), then
its :meth:`Sink.write` writes into the staging directory of the save's transaction (step 2) and
returns what the manifest records (:class:`Written`); :meth:`Sink.seal` makes what it wrote
outside that directory durable and checked before the commit, :meth:`Sink.committed` runs after.

| sink | plan | byte source | where the bytes go |
|---|---|---|---|
| :class:`LayoutFiles` | :func:`~savepoint.engine.plan.lay_out` (no object per tensor) | live tensors (each dropped once copied, with ``release``) | data files (:func:`~savepoint.engine.pipeline.write_file`), their fsyncs on the finishing pool |
| :class:`PlannedFiles` | :func:`~savepoint.engine.plan.plan_files` | live tensors, or a sharded save's pieces | data files (:func:`write_files`), each finished; block checksums for shards |
| :class:`ImageFiles` | the staging arena's (:mod:`savepoint.async_.staging`) | the arena's file images | data files written straight from the images (:func:`write_staged`) |
| :class:`BlobTensors` | the blob policy's choice | live tensors, or views of the arena | the blob store, through a save session (chunks, patches) |

:func:`write_files` is also the data-file writer of a sharded rank's pieces, of ``sp.copy``'s
``materialize=True`` and of DCP's ``StorageWriter``; all of them build their manifest and commit
through :mod:`savepoint.engine.save` (``new_manifest``, ``commit``).
"""

from __future__ import annotations

import functools
import logging
import posixpath
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import numpy as np

from savepoint.codecs import checksum
from savepoint.codecs import manifest as mf
from savepoint.engine import parallel, pipeline
from savepoint.engine.plan import FileLayout, FilePlan, lay_out
from savepoint.errors import UnsupportedStateError
from savepoint.state.arrays import TensorSource
from savepoint.storage.paths import Location

if TYPE_CHECKING:
    from savepoint.async_.staging import Staged
    from savepoint.blobs import BlobPolicy, BlobStore, FastMemo, Recipe, SaveSession
    from savepoint.blobs.patch import PatchTracker

__all__ = [
    "BLOB_SEGMENT",
    "BlobTensors",
    "ImageFiles",
    "LayoutFiles",
    "PlannedFiles",
    "Records",
    "Sink",
    "Written",
    "blob_store_path",
    "host_bytes",
    "put_source",
    "write_files",
    "write_staged",
]

Records = tuple[dict[str, mf.FileRecord], dict[str, mf.TensorRecord]]
Progress = Callable[[int, int], None]
Durable = list[Callable[[], None]]
T = TypeVar("T")
R = TypeVar("R")

log = logging.getLogger(__name__)


@dataclass
class Written:
    """What a sink wrote, as the manifest records it: the data files, the tensors (in the
    sink's order), the format version they need, and the blob store they name (its path
    relative to the checkpoint and its digest), if any."""

    files: dict[str, mf.FileRecord]
    tensors: Mapping[str, mf.TensorRecord]
    version: int = mf.UNSHARDED
    blobs: tuple[str, str] | None = None


class Sink(Protocol):
    """One configuration of the writer's step 2 (see the module docstring)."""

    def write(self, staging: Location, durable: Durable) -> Written:
        """Write into the directory ``staging``; append to ``durable`` each function that waits
        for a file's fsync still running (the commit calls them before it publishes)."""

    def seal(self) -> None:
        """Before the commit: what was written elsewhere made durable and checked."""

    def committed(self) -> None:
        """After the commit."""


def _map(fn: Callable[[T], R], items: Sequence[T], threads: int) -> list[R]:
    if threads > 1 and len(items) > 1:
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="savepoint-file") as pool:
            return list(pool.map(fn, items))
    return [fn(x) for x in items]


class _Files:
    """A data-file sink: nothing to seal, nothing to do once committed."""

    def seal(self) -> None:
        pass

    def committed(self) -> None:
        pass


# ---------------------------------------------------------------------------------------------
# data files
# ---------------------------------------------------------------------------------------------


class LayoutFiles(_Files):
    """The data files of an unsharded save, laid out compactly (:func:`lay_out`) from live
    tensors, their records kept as columns (:class:`~savepoint.codecs.manifest.TensorTable`):
    a million small tensors cost no Python object each here. ``release``: the caller owns
    ``tensors`` and will not use them again: each source is dropped as soon as it is copied,
    and the mapping is left empty. ``progress(n)`` is told of tensor bytes as they are written."""

    def __init__(
        self,
        tensors: dict[str, TensorSource],
        max_file_bytes: int,
        *,
        writers: int,
        direct: bool,
        progress: Callable[[int], None] | None,
        release: bool,
    ) -> None:
        self.tensors = tensors
        self.names = list(tensors)
        self.layouts = lay_out(self.names, tensors, max_file_bytes)
        self.writers = writers
        self.direct = direct
        self.progress = progress
        self.release = release

    def write(self, staging: Location, durable: Durable) -> Written:
        names, tensors, layouts = self.names, self.tensors, self.layouts
        table = mf.TensorTable(names)
        store = staging.store
        take = tensors.pop if self.release else tensors.__getitem__

        def write_one(job: tuple[int, FileLayout]) -> mf.FileRecord:
            code, layout = job  # files are numbered in order below: code == index
            base = layout.header_size
            starts, order = layout.starts, layout.order
            shape_codes = [table.code(1, shape) for shape in layout.shapes]
            shape_of = layout.shape_of
            dtype_codes: dict[Any, int] = {}
            set_row = table.set_row
            hasher = checksum.new()

            def header() -> Iterator[bytes]:
                for piece in layout.header_pieces(names, tensors):
                    hasher.update(piece)
                    yield piece

            def sources() -> Iterator[TensorSource]:
                for j, row in enumerate(order):
                    source = take(names[row])
                    d = dtype_codes.get(source.dtype)
                    if d is None:
                        d = dtype_codes[source.dtype] = table.code(0, source.dtype.name)
                    set_row(
                        row,
                        d,
                        shape_codes[shape_of[j]],
                        code,
                        base + starts[j],
                        base + starts[j + 1],
                    )
                    yield source

            digests = pipeline.write_file(
                store,
                store.join(staging.path, layout.name),
                header(),
                base,
                sources(),
                layout.size,
                direct=self.direct,
                progress=self.progress,
                finishing=durable,
            )
            column = table.digests
            for row, digest in zip(layout.order, digests):
                column[row] = digest
            log.debug("wrote %s: %d tensors, %d bytes", layout.name, len(digests), layout.size)
            return mf.FileRecord(layout.size, base, checksum.hexdigest(hasher))

        for layout in layouts:
            table.code(2, layout.name)
        records = _map(write_one, list(enumerate(layouts)), self.writers)
        if self.release:
            tensors.clear()  # emptied by now; this frees its table too
        files = {layout.name: record for layout, record in zip(layouts, records)}
        self.layouts = []  # (20 MB at a million tensors)
        return Written(files, table)


class PlannedFiles(_Files):
    """Planned data files (:func:`savepoint.engine.plan.plan_files`) from live tensors, each
    finished (durable) when written (see :func:`write_files`)."""

    def __init__(
        self,
        plans: Sequence[FilePlan],
        tensors: Mapping[str, TensorSource],
        *,
        writers: int,
        direct: bool,
        progress: Callable[[int], None] | None,
        blocked: bool = False,
    ) -> None:
        self.plans = plans
        self.tensors = tensors
        self.writers = writers
        self.direct = direct
        self.progress = progress
        self.blocked = blocked

    def write(self, staging: Location, durable: Durable) -> Written:
        files, tensors = write_files(
            staging,
            self.plans,
            self.tensors,
            writers=self.writers,
            direct=self.direct,
            progress=self.progress,
            blocked=self.blocked,
        )
        return Written(files, tensors)


def write_files(
    location: Location,
    plans: Sequence[FilePlan],
    tensors: Mapping[str, TensorSource],
    *,
    writers: int,
    direct: bool = True,
    progress: Callable[[int], None] | None = None,
    blocked: bool = False,
    watch: Callable[[str], AbstractContextManager[Any]] | None = None,
) -> Records:
    """Write every planned file into the directory ``location`` (each finished: durable) with
    up to ``writers`` at once; return the file records and the tensor records (in the order of
    ``tensors``, the state's order, not the file layout's). ``blocked``: large tensors get block
    checksums (a sharded checkpoint's shards; see :mod:`savepoint.codecs.checksum`). ``watch``:
    entered with each file's name while that file is written (what a late rank was doing)."""
    store = location.store

    def write_one(fp: FilePlan) -> tuple[mf.FileRecord, dict[str, mf.TensorRecord]]:
        with watch(fp.name) if watch is not None else nullcontext():
            digests = pipeline.write_blob(
                store,
                store.join(location.path, fp.name),
                fp.header,
                [tensors[e.name] for e in fp.entries],
                direct=direct,
                progress=progress,
                blocked=blocked,
            )
        record = mf.FileRecord(fp.size, len(fp.header), checksum.digest(fp.header))
        plain = mf.TensorRecord.plain
        return record, {
            e.name: plain(e.dtype, e.shape, fp.name, e.start, e.end, d.xxh3)
            if not d.block
            else mf.TensorRecord(
                e.dtype, e.shape, fp.name, e.start, e.end, d.xxh3, (), d.block, d.blocks
            )
            for e, d in zip(fp.entries, digests)
        }

    files: dict[str, mf.FileRecord] = {}
    records: dict[str, mf.TensorRecord] = {}
    for fp, (record, recs) in zip(plans, _map(write_one, plans, writers)):
        files[fp.name] = record
        if records:
            records.update(recs)
        else:
            records = recs
    if list(records) == list(tensors):
        return files, records  # already in the state's order (one file of one dtype, say)
    return files, {name: records[name] for name in tensors}


class ImageFiles(_Files):
    """The file images of a state the async checkpointer staged (its plan made when it was
    staged), written straight from the arena (see :func:`write_staged`)."""

    def __init__(
        self, staged: Staged, *, writers: int, direct: bool, progress: Progress | None
    ) -> None:
        self.staged = staged
        self.writers = writers
        self.direct = direct
        self.progress = progress

    def write(self, staging: Location, durable: Durable) -> Written:
        files, tensors = write_staged(
            staging, self.staged, direct=self.direct, writers=self.writers, progress=self.progress
        )
        tagged = any(checksum.is_tagged(r.xxh3) for r in tensors.values())
        # mlh64 checksums computed on the device need version 6
        return Written(files, tensors, mf.DEVICE_CHECKS if tagged else mf.UNSHARDED)


def write_staged(
    location: Location,
    staged: Staged,
    *,
    direct: bool = True,
    writers: int = 1,
    progress: Progress | None = None,
) -> Records:
    """Write a staged state's file images (see savepoint.async_.staging) into the directory
    ``location``: checksums first, from the images, on all cores; then each image straight from
    the arena, up to ``writers`` files at once. ``progress(done, total)`` counts tensor bytes
    (not headers) as they are handed to the store."""
    store = location.store
    total = sum(f.size - len(f.header) for f in staged.files)
    done = 0
    lock = threading.Lock()

    def on_range(header: int, start: int, stop: int) -> None:
        nonlocal done
        n = max(0, stop - max(start, header))
        if progress is not None and n:
            with lock:
                done += n
                progress(min(done, total), total)

    staged.wait()
    checks = staged.checks()  # hashed on the device while staged (mlh64)
    jobs = [(f, e) for f in staged.files for e in f.entries]
    digests = parallel.run_all(
        lambda job: (
            checks.get(job[1].name) or checksum.digest(job[0].image[job[1].start : job[1].end])
        ),
        jobs,
    )
    by_name = {e.name: (f, e, d) for (f, e), d in zip(jobs, digests)}

    def write_one(f: Any) -> None:
        pipeline.write_image(
            store,
            store.join(location.path, f.name),
            f.image,
            f.size,
            direct=direct,
            progress=functools.partial(on_range, len(f.header)) if progress else None,
        )

    _map(write_one, staged.files, writers)
    files = {
        f.name: mf.FileRecord(f.size, len(f.header), checksum.digest(f.header))
        for f in staged.files
    }
    tensors = {
        name: mf.TensorRecord(e.dtype, e.shape, f.name, e.start, e.end, d)
        for name in staged.order
        for f, e, d in [by_name[name]]
    }
    return files, tensors


# ---------------------------------------------------------------------------------------------
# the blob store
# ---------------------------------------------------------------------------------------------

BLOB_SEGMENT = 64 << 20  # bytes of a tensor copied out and put at a time by an incremental save


def blob_store_path(location: Location, blobs: BlobStore) -> str:
    """The ``blob_store`` a version 4 manifest at ``location`` records for ``blobs``: its path
    relative to the checkpoint's directory, on the same store, at most two ``..`` up
    (UnsupportedStateError otherwise: readers refuse any other)."""
    shown = location.store.url(location.path)
    if location.store.url("/") != blobs.store.url("/"):
        raise UnsupportedStateError(
            f"the blob store {blobs.url()} is not on the same store as the checkpoint {shown}"
        )
    rel = posixpath.relpath(blobs.root, location.path)
    try:
        return mf.check_blob_store(rel)
    except mf.ManifestError:
        raise UnsupportedStateError(
            f"the blob store {blobs.url()} must be inside the directory holding {shown}, or at "
            f"most {mf.MAX_UP} levels above it (readers refuse blob stores further away), "
            f"not {rel!r}"
        ) from None


class BlobTensors:
    """The tensors of an incremental save that go to the blob store of ``session`` (see
    :func:`savepoint.engine.save.save_blobs`): put as chunks (unchanged chunks not written
    again) or, with ``tracker``, as patches of their changed rows. ``seal`` syncs and checks
    the session (no collection deleted what it reuses); ``committed`` tells the tracker."""

    def __init__(
        self,
        location: Location,
        tensors: Mapping[str, TensorSource],
        names: list[str],
        *,
        session: SaveSession,
        policy: BlobPolicy,
        memo: FastMemo | None,
        tracker: PatchTracker | None,
        frozen: Callable[[str], bool] | None,
        on_bytes: Callable[[int], None],
    ) -> None:
        self.place = (blob_store_path(location, session.blobs), session.blobs.algorithm)
        self.tensors = tensors
        self.names = names
        self.session = session
        self.tracker = tracker
        self.pending: dict[str, Any] = {}
        self.put = _blob_putter(session, policy, memo, tracker, on_bytes, frozen)

    def write(self, staging: Location, durable: Durable) -> Written:
        recipes: dict[str, mf.TensorRecord] = {}
        if self.names:
            for name, (recipe, entry) in self.put(self.tensors, self.names).items():
                source = self.tensors[name]
                if entry is not None:
                    self.pending[name] = entry
                digest = recipe.checksum()
                assert digest is not None
                recipes[name] = mf.TensorRecord(
                    source.dtype.name,
                    source.shape,
                    "",
                    0,
                    source.nbytes,
                    digest.xxh3,
                    (),
                    digest.block,
                    digest.blocks,
                    recipe,
                )
        patched = any(r.recipe.patches for r in recipes.values())
        return Written({}, recipes, mf.PATCHES if patched else mf.BLOBS, self.place)

    def seal(self) -> None:
        self.session.sync()
        self.session.check()

    def committed(self) -> None:
        if self.tracker is not None:
            self.tracker.commit(self.session.blobs.url(), self.pending)


def host_bytes(source: TensorSource) -> np.ndarray[Any, Any] | None:
    """A source's bytes as a flat uint8 view of host memory, where that costs no copy (a
    C-contiguous numpy array, a contiguous CPU torch tensor); None otherwise."""
    from savepoint.state.arrays import NumpySource

    if isinstance(source, NumpySource):
        return source._bytes() if source._array.flags.c_contiguous else None
    host_view = getattr(source, "host_view", None)
    if host_view is not None:  # a HostCopy (background and sharded saves)
        view: np.ndarray[Any, Any] = host_view()
        return view
    pointer = getattr(source, "pointer", None)
    if pointer is not None and pointer() is not None:
        view = source._bytes()  # type: ignore[attr-defined]
        return view if isinstance(view, np.ndarray) else None
    return None


def _blob_putter(
    session: SaveSession,
    policy: BlobPolicy,
    memo: FastMemo | None,
    tracker: PatchTracker | None,
    on_bytes: Callable[[int], None],
    frozen: Callable[[str], bool] | None = None,
) -> Callable[[Mapping[str, TensorSource], list[str]], dict[str, tuple[Recipe, Any]]]:
    """What puts an incremental save's blob tensors: ``put(tensors, names)`` gives each name's
    recipe and the patch tracker's entry for it (None when not tracked). Tensors in host memory
    are put ``policy.workers`` at a time (hashing holds the GIL, but fsyncs and writes do not,
    and most tensors of a save that changed little are a hash and a stat), patched when
    ``tracker`` is given; the others one at a time, a segment at a time through one buffer."""
    from savepoint.blobs.patch import put_tensor

    lock = threading.Lock()

    def counted(n: int) -> None:
        with lock:
            on_bytes(n)

    def direct(item: tuple[str, TensorSource, np.ndarray[Any, Any]]) -> tuple[Recipe, Any]:
        name, source, host = item
        if tracker is None:
            recipe = _put_host(session, source, host, policy, memo)
            counted(source.nbytes)
            return recipe, None
        assert memo is not None
        shape, itemsize = tuple(source.shape), source.dtype.itemsize
        still = frozen is not None and frozen(name)
        recipe, entry = put_tensor(
            session, host, name, shape, itemsize, policy, memo, tracker, frozen=still
        )
        source.release()
        counted(source.nbytes)
        return recipe, entry

    def put(tensors: Mapping[str, TensorSource], names: list[str]) -> dict[str, tuple[Recipe, Any]]:
        hosts = {n: host_bytes(tensors[n]) for n in names}
        items = [(n, tensors[n], h) for n, h in hosts.items() if h is not None]
        done = dict(zip((n for n, _, _ in items), _map(direct, items, policy.workers)))
        others = [n for n, h in hosts.items() if h is None]
        if others:
            biggest = max(tensors[n].nbytes for n in others)
            segment = max(policy.chunk_size, BLOB_SEGMENT // policy.chunk_size * policy.chunk_size)
            scratch = np.empty(min(biggest, segment), np.uint8)
            for n in others:
                done[n] = (put_source(session, tensors[n], policy, memo, scratch), None)
                counted(tensors[n].nbytes)
        return {n: done[n] for n in names}

    return put


def _put_host(
    session: SaveSession,
    source: TensorSource,
    host: np.ndarray[Any, Any],
    policy: BlobPolicy,
    memo: FastMemo | None,
) -> Recipe:
    """A tensor in host memory (``host``: its bytes) into the blob store as chunks."""
    recipe = session.put_chunked(
        host,
        chunk_size=policy.chunk_size,
        compression=policy.compression,
        itemsize=source.dtype.itemsize,
        workers=policy.workers,
        memo=memo,
    )
    source.release()
    return recipe


def put_source(
    session: SaveSession,
    source: TensorSource,
    policy: BlobPolicy,
    memo: FastMemo | None,
    scratch: np.ndarray[Any, Any],
) -> Recipe:
    """One tensor's bytes into the blob store: straight from its memory where it is contiguous
    on the host, otherwise a segment (a whole number of chunks) at a time through ``scratch``;
    its recipe."""
    from savepoint.blobs.store import Recipe

    n = source.nbytes
    algorithm = session.blobs.algorithm
    direct = host_bytes(source)
    if direct is not None:
        return _put_host(session, source, direct, policy, memo)
    digests: list[str] = []
    checks: list[str] = []
    for start in range(0, n, len(scratch)):
        part = scratch[: min(len(scratch), n - start)]
        source.copy_to(part, start)
        recipe = session.put_chunked(
            part,
            chunk_size=policy.chunk_size,
            compression=policy.compression,
            itemsize=source.dtype.itemsize,
            workers=policy.workers,
            memo=memo,
        )
        digests.extend(recipe.digests)
        checks.extend(recipe.checks)
    source.release()
    return Recipe(algorithm, n, policy.chunk_size, tuple(digests), tuple(checks))
