"""Copy one committed checkpoint to another place, on any store, committed there like a save.

``sp.copy("/dev/shm/run/step-100", "s3://bucket/run/step-100")`` reads the source's manifest and
data files from one pinned generation (a concurrent replace of the source cannot mix two
checkpoints into the copy), checks every checksum of the source first (``verify=True``, the
default: a copy never spreads damage to another tier), streams each data file into the
destination's staging area through page-aligned buffers (O_DIRECT on local disks, multipart
uploads on object stores) and commits with the source's manifest, byte for byte, through the
same :class:`~savepoint.commit.transaction.Transaction` a save uses: a crash or an error at any
point leaves the destination's previous checkpoint (or nothing) and no half copy. The copy is the
same checkpoint: same manifest, same files, same checksums.

**Incremental checkpoints** (manifest version 4: tensors in a blob store, ``docs/blobs.md``) name
their blob store relative to themselves (``"../blobs"``, say). By default the copy brings the
blobs along to the blob store at that same relative position from the destination (created if
missing, with the source's digest; one there with another digest is refused before anything is
written), copying only the blobs missing there: the store is content-addressed, so a blob found
at its name is already the right one. Blobs are copied as they are stored (a compressed blob
stays compressed), each checked on the way against its header, its XXH3-64 and (``verify=True``)
its name, and made durable before the manifest (unchanged) commits, all inside a
:class:`~savepoint.blobs.SaveSession` of the destination store, so a collection running there
cannot delete a blob the copy reuses. ``materialize=True`` instead writes a plain checkpoint
(version 1, every tensor in data files, bit-exact) that needs no blob store. A blob missing or
damaged at the source is a CorruptCheckpointError naming the tensor; nothing is committed then.

The destination may be replaced if it holds a committed savepoint checkpoint (like ``sp.save``);
``overwrite=False`` refuses then. Copying a checkpoint onto itself is refused. ``progress``:
``progress(done, total)`` in bytes, over the verification and the copy together. ``stats``: a
:class:`~savepoint.blobs.PutStats` that receives the totals of the blobs copied and reused.
"""

from __future__ import annotations

import concurrent.futures
import logging
import mmap
import posixpath
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from savepoint.codecs import dtypes
from savepoint.codecs import manifest as mf
from savepoint.commit.transaction import Transaction, check_target
from savepoint.engine import collector, plan
from savepoint.engine import load as load_engine
from savepoint.engine import save as save_engine
from savepoint.engine.describe import describe
from savepoint.engine.read import Reader
from savepoint.engine.sinks import Written, write_files
from savepoint.errors import (
    CheckpointError,
    CheckpointWriteError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    UnsupportedStateError,
)
from savepoint.info import CheckpointInfo
from savepoint.options import DEFAULT_MAX_FILE_BYTES, Progress, check_load
from savepoint.storage.base import BlobReader, BlobWriter, Store
from savepoint.storage.paths import Location, PathArg
from savepoint.storage.paths import resolve as resolve_path

if TYPE_CHECKING:
    from savepoint.blobs import BlobStore, PutStats, Recipe, SaveSession

__all__ = ["copy"]

log = logging.getLogger(__name__)

CHUNK = 16 << 20  # bytes per read and write; a multiple of every store's alignment
BLOB_WORKERS = 4  # blobs copied at once (object stores: a request each, latency-bound)
REFRESH_EVERY = 10.0  # seconds between checks of the copy's session record while blobs copy


def copy(
    src: PathArg,
    dst: PathArg,
    *,
    verify: bool = True,
    overwrite: bool = True,
    direct: bool = True,
    progress: Progress | None = None,
    materialize: bool = False,
    stats: PutStats | None = None,
) -> CheckpointInfo:
    """Copy the committed checkpoint at ``src`` to ``dst`` (paths or URLs, any stores); return
    the description of the copy. ``materialize``: write an incremental checkpoint as a plain one
    (no blob store needed to read it; a plain source is copied as usual). See the module
    docstring."""
    check_load(progress=progress, what="copy")
    if not isinstance(materialize, bool):
        raise TypeError(f"materialize must be a bool, not {materialize!r}")
    source = resolve_path(src, what="checkpoint path")
    target = resolve_path(dst, what="checkpoint path")
    started = time.perf_counter()
    with collector.paused(), Reader.open(source) as reader:
        if _same_place(source.store, source.path, target.store, target.path):
            raise ValueError(f"cannot copy {reader.shown} onto itself")
        manifest = reader.manifest
        store = target.store
        mode = "plain" if not manifest.has_blobs else "materialize" if materialize else "blobs"
        check = _target_check(overwrite)
        if mode == "materialize" and manifest.world_size is not None:
            # A sharded incremental checkpoint: its shards assembled into whole tensors, as a
            # plain unsharded checkpoint (what consolidate writes).
            from savepoint.distributed.consolidate import consolidate

            check(store, target.path)
            return consolidate(source, target, verify=verify, progress=progress)
        dest: BlobStore | None = None
        if mode == "blobs":
            check(store, target.path)  # refused before any blob is written
            dest = _open_blobs(store, _destination_blobs(reader, target), reader, target, False)
        jobs = _blob_jobs(manifest) if mode == "blobs" else []
        blob_tensors = (
            [r for r, rec in manifest.tensors.items() if rec.recipe is not None]
            if mode == "materialize"
            else []
        )
        later = sum(record.size for record in manifest.files.values())
        later += sum(size for _, _, size, _ in jobs)
        later += sum(manifest.tensors[r].nbytes for r in blob_tensors)
        meter = _Meter(progress, later)
        if verify:
            load_engine.verify(reader, meter.verifying, blobs=mode == "plain")
        assert reader.pinned is not None
        copied = 0
        totals = _new_stats() if mode == "blobs" and stats is None else stats
        if mode == "blobs":
            assert totals is not None
            raw = reader.pinned.read_small(mf.NAME, cap=mf.MAX_MANIFEST_BYTES)
            if dest is None:  # created only now that the source checked out
                dest = _open_blobs(store, _destination_blobs(reader, target), reader, target, True)
            assert dest is not None
            with dest.session() as session:
                _copy_blobs(reader, session, jobs, verify, totals, meter)
                session.sync()
                with Transaction(store, target.path, check=check) as tx:
                    copied = _copy_files(reader, tx, direct, meter, session.check)
                    path, _ = save_engine.commit(tx, manifest, encoded=raw, seal=[_Seal(session)])
            written = manifest
        elif mode == "materialize":
            with Transaction(store, target.path, check=check) as tx:
                copied = _copy_files(reader, tx, direct, meter)
                written = _materialize(reader, tx, blob_tensors, verify, direct, meter)
                copied += sum(manifest.tensors[r].nbytes for r in blob_tensors)
                path, _ = save_engine.commit(tx, written)
        else:
            raw = reader.pinned.read_small(mf.NAME, cap=mf.MAX_MANIFEST_BYTES)
            with Transaction(store, target.path, check=check) as tx:
                copied = _copy_files(reader, tx, direct, meter)
                path, _ = save_engine.commit(tx, manifest, encoded=raw)
            written = manifest
        shown = store.url(path)
        info = describe(shown, written)
    seconds = time.perf_counter() - started
    log.info(
        "copied %s to %s%s: %d files, %d bytes%s in %.3f s (%s)",
        reader.shown,
        shown,
        " as a plain checkpoint" if mode == "materialize" else "",
        len(written.files),
        copied,
        (
            f", {totals.blobs_written} blobs copied ({totals.bytes_stored} bytes), "
            f"{totals.blobs_reused} already there"
            if mode == "blobs" and totals is not None
            else ""
        ),
        seconds,
        "source verified" if verify else "not verified",
    )
    return info


def _new_stats() -> PutStats:
    from savepoint.blobs import PutStats

    return PutStats()


class _Seal:
    """The copy's blob session as what the commit seals: checked (its record is still there,
    so no collection deleted a blob the copy reuses) just before the manifest commits."""

    def __init__(self, session: SaveSession) -> None:
        self.session = session

    def seal(self) -> None:
        self.session.check()


class _Meter:
    """``progress(done, total)`` over the verification (its own total, told by the verify) and
    the ``later`` bytes of the copy; thread-safe."""

    def __init__(self, progress: Progress | None, later: int) -> None:
        self.progress = progress
        self.later = later
        self.checked = 0
        self.done = 0
        self.lock = threading.Lock()

    def verifying(self, done: int, total: int) -> None:
        self.checked = total
        if self.progress is not None:
            self.progress(done, total + self.later)

    def add(self, n: int) -> None:
        if self.progress is None:
            return
        with self.lock:
            self.done += n
            self.progress(
                min(self.checked + self.done, self.checked + self.later), self.checked + self.later
            )


def _target_check(overwrite: bool) -> Callable[[Store, str], None]:
    def check(store: Store, path: str) -> None:
        if not overwrite and store.stat(path) is not None:
            shown = store.url(path)
            raise CheckpointWriteError(
                f"{shown} exists and overwrite=False: nothing was copied", path=shown
            )
        check_target(store, path)

    return check


def _copy_files(
    reader: Reader,
    tx: Transaction,
    direct: bool,
    meter: _Meter,
    between: Callable[[], None] | None = None,
) -> int:
    """Stream every data file of the source into the transaction's staging directory; the
    bytes copied. ``between``: called after each file (the blob session's refresh)."""
    store = tx.store
    copied = 0
    buffer = mmap.mmap(-1, CHUNK)
    try:
        for name, record in reader.manifest.files.items():
            blob = reader.open_file(name, check_header=False).blob
            writer = store.create_blob(
                store.join(tx.staging, name), size=record.size, direct=direct
            )
            try:
                _stream(blob, writer, record.size, buffer)
                meter.add(record.size)
                writer.finish()
            except BaseException:
                writer.abort()
                raise
            copied += record.size
            if between is not None:
                between()
        # A version 7 checkpoint's rank index files (its pieces' records) travel with its
        # manifest, byte for byte (the manifest records their sizes and checksums).
        for name, index in sorted((reader.manifest.indices or {}).items()):
            assert reader.pinned is not None
            data = reader.pinned.read_small(name, cap=index.size)
            store.put(store.join(tx.staging, name), data)
            meter.add(len(data))
            copied += len(data)
    finally:
        buffer.close()
    return copied


def _stream(blob: BlobReader, writer: BlobWriter, size: int, buffer: mmap.mmap) -> None:
    view = memoryview(buffer)
    align = max(1, getattr(writer, "alignment", 1))
    offset = 0
    try:
        while offset < size:
            n = min(CHUNK, size - offset)
            part: Any = view[:n]
            try:
                blob.read(offset, part)
            except EOFError:
                raise CheckpointError(
                    f"a data file shrank while being copied (at byte {offset} of {size})"
                ) from None
            padded = -(-n // align) * align  # the last write padded; finish() cuts it off
            if padded != n:
                view[n:padded] = bytes(padded - n)
            writer.write(view[:padded])
            offset += n
    finally:
        view.release()


# -- blobs -----------------------------------------------------------------------------------------


def _destination_blobs(reader: Reader, target: Location) -> str:
    """Where the copy's blob store is: the manifest's ``blob_store`` from the destination. One
    that would be a top-level directory of the store (another bucket, on an object store) is
    refused before anything is written."""
    rel = reader.manifest.blob_store
    assert rel is not None
    root = posixpath.normpath(posixpath.join(target.store.abspath(target.path), rel))
    if len([part for part in root.split("/") if part not in ("", ".", "..")]) < 2:
        shown = target.store.url(target.path)
        raise UnsupportedStateError(
            f"cannot copy {reader.shown} to {shown}: its manifest names its blob store {rel!r} "
            f"from there, which would be {target.store.url(root)}, at the top of the store (on "
            "an object store, another bucket); nothing was copied. Copy it one level deeper, "
            "or with materialize=True"
        )
    return root


def _open_blobs(
    store: Store, root: str, reader: Reader, target: Location, create: bool
) -> BlobStore | None:
    """The destination's blob store: the one there (None if there is none and not ``create``),
    or a new one with the source's digest. One that names blobs by another digest is refused
    (IncompatibleCheckpointError), untouched."""
    from savepoint.blobs import BlobStore
    from savepoint.blobs.store import CONFIG

    algorithm = reader.manifest.blob_digest
    try:
        if store.stat(store.join(root, CONFIG)) is not None:
            return BlobStore(store, root, algorithm=algorithm, create=False)
        return BlobStore(store, root, algorithm=algorithm) if create else None
    except IncompatibleCheckpointError as exc:
        shown = store.url(target.path)
        raise IncompatibleCheckpointError(
            f"cannot copy {reader.shown} to {shown}: the blob store its manifest names there, "
            f"{store.url(root)}, is not one for its {algorithm} blobs ({exc}); nothing was "
            "copied. Copy it elsewhere, or with materialize=True",
            path=shown,
        ) from None


def _source_blobs(reader: Reader) -> BlobStore:
    return reader.blob_store()  # CorruptCheckpointError naming the checkpoint when missing


def _blob_jobs(manifest: mf.Manifest) -> list[tuple[str, str, int, str | None]]:
    """``(tensor, digest, content size, XXH3-64 or None)`` of every blob the manifest names,
    each once, with the first tensor naming it (what an error reports)."""
    seen: set[str] = set()
    jobs: list[tuple[str, str, int, str | None]] = []
    for ref, rec in manifest.tensors.items():
        pieces = [s.recipe for s in rec.shards] if len(rec.shards) > 1 else [rec.recipe]
        for recipe in pieces:
            if recipe is not None:
                _recipe_jobs(ref, recipe, seen, jobs)
    return jobs


def _recipe_jobs(
    ref: str, recipe: Recipe, seen: set[str], jobs: list[tuple[str, str, int, str | None]]
) -> None:
    """Add the blobs of one recipe (tensor ``ref``'s, or one of its shards') to ``jobs``."""
    base = recipe.base()  # a patched recipe: its chunks, then its patches
    checks: Any = base.checks or [None] * len(base.digests)
    blobs = [(d, e - s, c) for (d, s, e), c in zip(base.spans(), checks)]
    blobs += [(p.blob, p.content_size(recipe.size), p.check) for p in recipe.patches]
    for digest, size, check in blobs:
        if digest not in seen:
            seen.add(digest)
            jobs.append((ref, digest, size, check))


def _copy_blobs(
    reader: Reader,
    session: SaveSession,
    jobs: list[tuple[str, str, int, str | None]],
    verify: bool,
    totals: PutStats,
    meter: _Meter,
) -> None:
    """Copy the blobs of ``jobs`` the session's store lacks from the source's store, as stored,
    each checked on the way (its name too with ``verify``); the first failure is raised, as a
    CorruptCheckpointError naming the tensor where the source is at fault."""
    if not jobs:
        return
    source = _source_blobs(reader)
    dest = session.blobs
    failed = threading.Event()
    lock = threading.Lock()
    refreshed = [time.monotonic()]

    def one(job: tuple[str, str, int, str | None]) -> None:
        if failed.is_set():
            return
        ref, digest, size, check = job
        try:
            result = dest.copy_stored(source, digest, size=size, check=check, full=verify)
        except CorruptCheckpointError as exc:
            failed.set()
            raise CorruptCheckpointError(
                f"{reader.shown}: tensor {ref!r}: {exc}; nothing was committed at the destination",
                path=reader.shown,
                key=ref,
            ) from None
        except BaseException:
            failed.set()
            raise
        session.reuse((digest,))
        totals.add(result)
        meter.add(size)
        now = time.monotonic()
        with lock:
            due = now - refreshed[0] >= REFRESH_EVERY
            if due:
                refreshed[0] = now
        if due:
            session.check()  # keeps the session's record young on a long copy

    if len(jobs) > 1:
        with concurrent.futures.ThreadPoolExecutor(
            min(BLOB_WORKERS, len(jobs)), thread_name_prefix="savepoint-copy"
        ) as pool:
            futures = [pool.submit(one, job) for job in jobs]
            for future in futures:
                future.result()
    else:
        one(jobs[0])


# -- materialize -----------------------------------------------------------------------------------


class _RecipeSource:
    """A tensor stored as blobs, as a :class:`~savepoint.state.arrays.TensorSource` for the
    write pipeline: each chunk read once (the last one kept for the next piece), checked
    against its XXH3-64 and, with ``full``, its name."""

    kind = "numpy"

    def __init__(
        self, reader: Reader, ref: str, rec: mf.TensorRecord, blobs: BlobStore, full: bool
    ) -> None:
        self.reader = reader
        self.ref = ref
        self.recipe: Recipe = rec.recipe
        self.dtype = dtypes.BY_NAME[rec.dtype]
        self.nbytes = rec.nbytes
        self._shape = rec.shape
        self.blobs = blobs
        self.full = full
        self._index = -1
        self._chunk: np.ndarray[Any, Any] | None = None
        self._patches: list[np.ndarray[Any, Any]] | None = None
        self._whole: np.ndarray[Any, Any] | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    def identity(self) -> tuple[Any, ...] | None:
        return None

    def _checked(self, read: Callable[[], np.ndarray[Any, Any]]) -> np.ndarray[Any, Any]:
        """``read()``, a damaged blob reported as the tensor's."""
        try:
            return read()
        except CorruptCheckpointError as exc:
            shown = self.reader.shown
            raise CorruptCheckpointError(
                f"{shown}: tensor {self.ref!r}: {exc}; nothing was committed at the destination",
                path=shown,
                key=self.ref,
            ) from None

    def _chunk_content(self, index: int) -> np.ndarray[Any, Any]:
        if self.recipe.patches and self._patches is None:
            self._patches = self.blobs.patch_contents(self.recipe, full=self.full)
        return self.blobs.read_chunk(self.recipe, index, patches=self._patches, full=self.full)

    def _load(self, index: int) -> np.ndarray[Any, Any]:
        if index != self._index or self._chunk is None:
            content = self._checked(lambda: self._chunk_content(index))
            self._index, self._chunk = index, content
        return self._chunk

    def copy_to(self, dst: np.ndarray[Any, Any], start: int) -> None:
        chunk = self.recipe.chunk
        pos, end = start, start + dst.size
        if self.recipe.patches and not self.blobs.patches_in_memory(self.recipe):
            # A (forged) chain whose patches add up to more than the tensor: the tensor is read
            # once, whole, its patches applied one at a time (memory: the tensor and one patch).
            if self._whole is None:
                self._whole = self._checked(
                    lambda: self.blobs.read_recipe(self.recipe, verify=True, full=self.full)
                )
            dst[:] = self._whole[start : start + dst.size]
            return
        while pos < end:
            index = pos // chunk
            content = self._load(index)
            lo = pos - index * chunk
            n = min(len(content) - lo, end - pos)
            dst[pos - start : pos - start + n] = content[lo : lo + n]
            pos += n

    def release(self) -> None:
        self._index, self._chunk, self._patches, self._whole = -1, None, None, None


def _fresh_names(taken: Mapping[str, Any]) -> Callable[[int], str]:
    """Data file names ``data-NNNNN.safetensors`` after the source's own (none reused)."""
    used = set(taken)
    names: dict[int, str] = {}
    following = [len(used)]

    def name(index: int) -> str:
        if index not in names:
            while plan.data_file_name(following[0]) in used:
                following[0] += 1
            names[index] = plan.data_file_name(following[0])
            used.add(names[index])
        return names[index]

    return name


def _materialize(
    reader: Reader,
    tx: Transaction,
    refs: list[str],
    verify: bool,
    direct: bool,
    meter: _Meter,
) -> mf.Manifest:
    """Write the tensors ``refs`` (stored as blobs) into new data files of the transaction's
    staging directory; the plain (version 1) manifest of the copy."""
    manifest = reader.manifest
    files = dict(manifest.files)
    records: dict[str, mf.TensorRecord] = {}
    if refs:
        blobs = _source_blobs(reader)
        sources: dict[str, Any] = {
            r: _RecipeSource(reader, r, manifest.tensors[r], blobs, verify) for r in refs
        }
        plans = plan.plan_files(sources, DEFAULT_MAX_FILE_BYTES, name=_fresh_names(files))
        new_files, records = write_files(
            Location(tx.store, tx.staging),
            plans,
            sources,
            writers=1,
            direct=direct,
            progress=meter.add,
        )
        files.update(new_files)
        for r in refs:  # bit-exact: the bytes written are those the recipe's checks vouch for
            expected = manifest.tensors[r].recipe.checksum()
            if expected is not None and expected.block == 0 and records[r].xxh3 != expected.xxh3:
                raise CorruptCheckpointError(
                    f"{reader.shown}: tensor {r!r} changed while being copied", key=r
                )
    tensors = {r: records.get(r, rec) for r, rec in manifest.tensors.items()}
    written = Written(files, tensors, mf.UNSHARDED)
    return save_engine.new_manifest(
        manifest.root(), [written], manifest.metadata, created=manifest.created
    )


def _same_place(a: Store, a_path: str, b: Store, b_path: str) -> bool:
    return a.url(a.abspath(a_path)).rstrip("/") == b.url(b.abspath(b_path)).rstrip("/")
