"""Saving one unsharded checkpoint: plan the files, write them into a transaction, commit.

:func:`save_flat` is the whole synchronous save below the facade: the files are planned
(:mod:`savepoint.engine.plan`), a :class:`~savepoint.commit.transaction.Transaction` is opened on
the target, each file is streamed into its staging directory by the write pipeline
(:mod:`savepoint.engine.pipeline`, up to ``writers`` files at once), and the manifest is committed
last. :func:`save_staged` does the same for a state the async checkpointer has already laid out
as file images (:mod:`savepoint.async_.staging`): checksums from the images on all cores, then
each image written straight from the arena.

:func:`write_files` is the part a sharded save shares: it writes planned files into a staging
directory it does not own and returns their records.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import functools
import json
import logging
import posixpath
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from savepoint._version import __version__
from savepoint.codecs import checksum
from savepoint.codecs import manifest as mf
from savepoint.commit.transaction import Transaction
from savepoint.engine import parallel, pipeline, plan
from savepoint.engine.plan import FileLayout, FilePlan, lay_out
from savepoint.errors import UnsupportedStateError
from savepoint.state import tree
from savepoint.state.arrays import TensorSource
from savepoint.storage.paths import Location

if TYPE_CHECKING:
    from savepoint.async_.staging import Staged
    from savepoint.blobs import BlobPolicy, BlobStore, FastMemo, Recipe, SaveSession
    from savepoint.blobs.patch import PatchTracker

__all__ = [
    "Records",
    "blob_store_path",
    "byte_counter",
    "check_metadata",
    "has_shards",
    "host_bytes",
    "new_manifest",
    "put_source",
    "save_blobs",
    "save_flat",
    "save_staged",
    "write_files",
    "write_staged",
    "writer_version",
]

Records = tuple[dict[str, mf.FileRecord], dict[str, mf.TensorRecord]]
Progress = Callable[[int, int], None]
T = TypeVar("T")
R = TypeVar("R")

_SHARD_TYPES = "savepoint.distributed.shard."

log = logging.getLogger(__name__)


def writer_version() -> str:
    return f"savepoint {__version__}"


def check_metadata(metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    """``metadata`` as the manifest will hold it: a JSON round trip of a mapping with finite
    floats, so it is exactly what a reader will see (UnsupportedStateError otherwise)."""
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise UnsupportedStateError(f"metadata must be a mapping, got {type(metadata).__name__}")
    try:
        return dict(json.loads(json.dumps(dict(metadata), allow_nan=False)))
    except (TypeError, ValueError) as exc:
        raise UnsupportedStateError(
            f"metadata must be JSON-serialisable with finite floats: {exc}"
        ) from None


def has_shards(root: tree.Node) -> bool:
    """Whether a flattened tree holds sharding descriptions (``sp.Shard`` and friends are saved
    through the Stateful protocol, so every flattening path carries them; see distributed.shard)."""
    stack = [root]
    while stack:
        node = stack.pop()
        t = node["t"]
        if t == "stateful":
            if node["type"].startswith(_SHARD_TYPES):
                return True
            stack.append(node["state"])
        elif t == "dict":
            stack.extend(child for _, child in node["items"])
        elif t in ("list", "tuple"):
            stack.extend(node["items"])
    return False


def new_manifest(
    tree_node: tree.Node,
    records: tuple[dict[str, mf.FileRecord], Mapping[str, mf.TensorRecord]],
    metadata: dict[str, Any],
) -> mf.Manifest:
    """The (unsharded) manifest of a checkpoint whose files were written with ``records``."""
    files, tensors = records
    return mf.Manifest(
        tree=tree_node,
        files=files,
        tensors=tensors,
        metadata=metadata,
        writer=writer_version(),
        created=_dt.datetime.now(_dt.timezone.utc).isoformat().replace("+00:00", "Z"),
    )


def byte_counter(total: int, progress: Progress | None) -> Callable[[int], None]:
    """A callback taking the bytes just written, reporting ``progress(done, total)``."""
    done = 0

    def on_bytes(n: int) -> None:
        nonlocal done
        done += n
        if progress is not None:
            progress(min(done, total), total)

    return on_bytes


def _map(fn: Callable[[T], R], items: Sequence[T], threads: int) -> list[R]:
    if threads > 1 and len(items) > 1:
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="savepoint-file") as pool:
            return list(pool.map(fn, items))
    return [fn(x) for x in items]


def write_files(
    location: Location,
    plans: Sequence[FilePlan],
    tensors: Mapping[str, TensorSource],
    *,
    writers: int,
    direct: bool = True,
    progress: Callable[[int], None] | None = None,
    blocked: bool = False,
) -> Records:
    """Write every planned file into the directory ``location`` (each finished: durable) with
    up to ``writers`` at once; return the file records and the tensor records (in the order of
    ``tensors``, the state's order, not the file layout's). ``blocked``: large tensors get block
    checksums (a sharded checkpoint's shards; see :mod:`savepoint.codecs.checksum`)."""
    store = location.store

    def write_one(fp: FilePlan) -> tuple[mf.FileRecord, dict[str, mf.TensorRecord]]:
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


def save_flat(
    location: Location,
    flat: tree.Flat,
    metadata: dict[str, Any],
    *,
    max_file_bytes: int,
    writers: int,
    direct: bool = True,
    progress: Progress | None = None,
    release: bool = False,
) -> tuple[str, mf.Manifest]:
    """Save a flattened state (checked metadata) as an unsharded checkpoint at ``location``;
    return the directory committed and its manifest.

    The files are laid out compactly (:func:`savepoint.engine.plan.lay_out`), their records kept
    as columns (:class:`savepoint.codecs.manifest.TensorTable`) and the manifest built once, in
    place (:func:`savepoint.codecs.manifest.dump`): a save of a million small tensors holds no
    Python object per tensor beyond the state's tree. ``release``: the caller owns ``flat`` and
    will not use its tensors again, so each source is dropped from ``flat.tensors`` as soon as
    it is copied (for a million small tensors the sources are about 150 MB), and a tree of more
    than ``plan.STREAM_ENTRIES`` tensors is kept compressed while the manifest is built (``flat.tree``
    is then left empty; the manifest returned reads it back when asked: ``Manifest.root``)."""
    started = time.perf_counter()
    tensors = flat.tensors
    total = sum(s.nbytes for s in tensors.values())
    on_bytes = byte_counter(total, progress)

    names = list(tensors)
    layouts = lay_out(names, tensors, max_file_bytes)
    table = mf.TensorTable(names)
    # The data files' fsyncs run on threads of their own while the manifest is built and
    # written; the commit waits for them before it publishes (see pipeline.write_file).
    finishing: list[Callable[[], None]] = []
    with Transaction(location.store, location.path) as tx, _waiting(finishing):
        store = tx.store
        take = tensors.pop if release else tensors.__getitem__

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
                store.join(tx.staging, layout.name),
                header(),
                base,
                sources(),
                layout.size,
                direct=direct,
                progress=on_bytes if progress is not None else None,
                finishing=finishing,
            )
            column = table.digests
            for row, digest in zip(layout.order, digests):
                column[row] = digest
            log.debug("wrote %s: %d tensors, %d bytes", layout.name, len(digests), layout.size)
            return mf.FileRecord(layout.size, base, checksum.hexdigest(hasher))

        for layout in layouts:
            table.code(2, layout.name)
        records = _map(write_one, list(enumerate(layouts)), writers)
        if release:
            tensors.clear()  # emptied by now; this frees its table too
        files = {layout.name: record for layout, record in zip(layouts, records)}
        del layouts
        if not release or len(names) <= plan.STREAM_ENTRIES:
            manifest = new_manifest(flat.tree, (files, table), metadata)
            raw = mf.dump(manifest)
            size = len(raw)
            directory = tx.commit(raw, durable=finishing)
            del raw
        else:
            # A big tree as text, compressed (a million-tensor tree is 190 MB of dicts and 6 MB
            # of compressed text), then the dicts dropped before the manifest is built; the
            # manifest returned keeps the text (see Manifest.root), ``flat.tree`` stays empty.
            packed = [(zlib.compress(p, 1), level) for p, level in mf.tree_pieces(flat.tree)]
            length = 0

            def unpack() -> Iterator[tuple[bytes, int]]:
                nonlocal length
                packed.reverse()
                while packed:
                    piece, level = packed.pop()
                    text = zlib.decompress(piece)
                    length += len(text)
                    yield text, level

            flat.tree = {}
            manifest = new_manifest({}, (files, table), metadata)
            raw = mf.dump(manifest, unpack())
            size = len(raw)
            directory = tx.commit(raw, durable=finishing)
            end = size - mf.TRAILER_BYTES
            squeeze = zlib.compressobj(1)
            manifest.tree_packed = squeeze.compress(memoryview(raw)[end - length : end])
            manifest.tree_packed += squeeze.flush()
            del raw
    took = time.perf_counter() - started
    log.info(
        "saved %s: %d tensors, %d bytes (manifest %d) in %.3f s, %.1f MiB/s",
        location.store.url(directory),
        len(names),
        total,
        size,
        took,
        total / took / 2**20 if took > 0 else 0.0,
    )
    return directory, manifest


@contextlib.contextmanager
def _waiting(finishing: list[Callable[[], None]]) -> Iterator[None]:
    """Wait for every deferred finish before leaving (a save that fails before its commit
    leaves no fsync thread behind)."""
    try:
        yield
    finally:
        for wait in finishing:
            with contextlib.suppress(BaseException):
                wait()


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


def save_staged(
    location: Location,
    staged: Staged,
    metadata: dict[str, Any],
    *,
    direct: bool = True,
    writers: int = 1,
    progress: Progress | None = None,
) -> tuple[str, mf.Manifest]:
    """Commit a staged state (the background half of an async save) at ``location``; return
    the directory committed and its manifest."""
    with Transaction(location.store, location.path) as tx:
        records = write_staged(
            Location(location.store, tx.staging),
            staged,
            direct=direct,
            writers=writers,
            progress=progress,
        )
        manifest = new_manifest(staged.tree, records, metadata)
        if any(checksum.is_tagged(r.xxh3) for r in records[1].values()):
            manifest.format_version = mf.DEVICE_CHECKS  # mlh64 checksums (version 6)
        directory = tx.commit(mf.dumps(manifest))
    return directory, manifest


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


def save_blobs(
    location: Location,
    flat: tree.Flat,
    metadata: dict[str, Any],
    *,
    session: SaveSession,
    policy: BlobPolicy,
    memo: FastMemo | None = None,
    tracker: PatchTracker | None = None,
    frozen: Callable[[str], bool] | None = None,
    max_file_bytes: int,
    writers: int,
    direct: bool = True,
    progress: Progress | None = None,
) -> tuple[str, mf.Manifest]:
    """An incremental save (a version 4 checkpoint, 5 when a tensor is patched): the tensors
    ``policy.wants`` go to the blob store of ``session`` (unchanged chunks are not written
    again; with ``tracker`` and ``policy.patches``, a tensor in host memory whose last save the
    tracker saw is written as a patch of its changed rows, see :mod:`savepoint.blobs.patch`),
    the others into data files as usual; the blobs are made durable and the session checked (no
    collection deleted what it reuses) before the manifest is committed, and the tracker told
    after. ``frozen(name)``: the caller says that tensor did not change since the tracker's
    last save of it (its bytes are then only sampled: :func:`savepoint.blobs.patch.put_tensor`).
    The caller closes the session."""
    started = time.perf_counter()
    tensors = flat.tensors
    store_path = blob_store_path(location, session.blobs)
    names = list(tensors)
    in_blobs = [n for n in names if policy.wants(tensors[n].nbytes)]
    blob_set = set(in_blobs)
    rest = {n: tensors[n] for n in names if n not in blob_set}
    total = sum(s.nbytes for s in tensors.values())
    on_bytes = byte_counter(total, progress)

    before = session.stats.bytes_written
    patching = policy.patches and memo is not None and tracker is not None
    pending: dict[str, Any] = {}
    with Transaction(location.store, location.path) as tx:
        recipes: dict[str, mf.TensorRecord] = {}
        if in_blobs:
            put = _blob_putter(
                session, policy, memo, tracker if patching else None, on_bytes, frozen
            )
            for name, (recipe, entry) in put(tensors, in_blobs).items():
                source = tensors[name]
                if entry is not None:
                    pending[name] = entry
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
        files: dict[str, mf.FileRecord] = {}
        records: dict[str, mf.TensorRecord] = {}
        if rest:
            plans = plan.plan_files(rest, max_file_bytes)
            files, records = write_files(
                Location(tx.store, tx.staging),
                plans,
                rest,
                writers=writers,
                direct=direct,
                progress=on_bytes if progress is not None else None,
            )
        ordered = {n: recipes[n] if n in blob_set else records[n] for n in names}
        manifest = new_manifest(flat.tree, (files, ordered), metadata)
        patched = any(r.recipe.patches for r in recipes.values())
        manifest.format_version = mf.PATCHES if patched else mf.BLOBS
        manifest.blob_store = store_path
        manifest.blob_digest = session.blobs.algorithm
        raw = mf.dumps(manifest)
        session.sync()
        session.check()
        directory = tx.commit(raw)
    if tracker is not None and patching:
        tracker.commit(session.blobs.url(), pending)
    took = time.perf_counter() - started
    log.info(
        "saved %s incrementally: %d tensors (%d in blobs), %d bytes, %d blob bytes written, "
        "in %.3f s",
        location.store.url(directory),
        len(names),
        len(in_blobs),
        total,
        session.stats.bytes_written - before,
        took,
    )
    return directory, manifest
