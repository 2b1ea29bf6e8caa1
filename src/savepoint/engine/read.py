"""Reading one committed checkpoint from any store: pin, check, transfer with fused checksums.

Every check that can be made from the manifest happens before any data file is opened (the
manifest is parsed whole by :mod:`savepoint.codecs.manifest`). A data file's size must equal the
recorded size and its header must hash to the recorded value before any of its data is viewed.

Concurrent replaces: pin, and retry only before pinning. A save over an existing checkpoint swaps
a new directory into place and then deletes the previous generation's files (or, manifest-last,
commits a newer generation and deletes the older ones), so a reader can hold a directory whose
files are being deleted. :meth:`Reader.open` therefore pins one generation: it pins the directory
(``store.pin``), then through it opens the manifest and every data file the caller will need
(``needs``), and keeps them open. An open blob stays readable after its name is deleted (and a
copy-on-write view of it outlives the reader: ``mmap=True`` arrays stay valid after their files
are deleted), so once ``open`` returns nothing a writer does can take the load's bytes away or mix
two generations. If the generation vanishes before it is pinned (the directory, the manifest or a
needed data file missing) and the path now resolves to another directory (or to none), ``open``
starts again from the path, up to :data:`ATTEMPTS` times; a file missing while the path still
resolves to the very directory that was pinned is a damaged checkpoint (CorruptCheckpointError,
IncompleteCheckpointError for the manifest). Loads never retry after they have modified anything:
every retry happens inside ``open``.

Bytes are read through ``BlobReader.view`` where the store has zero-copy views (mmap on local
disks, the stored bytes in memory): a warm 1 GiB copy out of the page cache took 0.067 s against
0.16 s for ``preadv`` on the development machine. A store without views (``view`` returns None)
is read into buffers instead: a tensor's whole byte range is read once, then checked and copied
like a view.

Small tensors (up to :data:`SMALL`) are checked and copied many to a task, each hashed in one
call; a load without ``into`` makes each straight from its checked bytes
(:meth:`Reader.materialize`), so a state of 100,000 tensors costs microseconds a tensor.

Sharded checkpoints (manifest versions 2 and 3) store some tensors as several shards.
:meth:`Reader.transfer` assembles such a tensor whole from its shards (that is how a load without
a process group, and ``verify``, read them); :meth:`Reader.read_shards` copies chosen regions of
chosen shards into arbitrary targets (the resharding loads of :mod:`savepoint.distributed`). Both
check checksums fused with the copy: a version 3 shard with block checksums is read and checked
only over the blocks holding the bytes a task needs; any other shard is checked whole.
"""

from __future__ import annotations

import functools
import operator
import posixpath
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import xxhash

from savepoint.codecs import boxes, checksum, dtypes, safetensors
from savepoint.codecs import manifest as mf
from savepoint.commit import names
from savepoint.commit.transaction import resolve
from savepoint.engine import parallel
from savepoint.errors import (
    CheckpointError,
    CheckpointMemoryError,
    CheckpointNotFoundError,
    CheckpointPermissionError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    IncompleteCheckpointError,
    ReplacedWhileReadingError,
)
from savepoint.state import arrays
from savepoint.storage import local
from savepoint.storage.base import BlobReader, PinnedContext, Store
from savepoint.storage.paths import Location, PathArg
from savepoint.storage.paths import resolve as resolve_path

if TYPE_CHECKING:
    from savepoint.blobs import BlobStore

T = TypeVar("T")
_Small = TypeVar("_Small", bound=tuple[Any, ...])

__all__ = [
    "ATTEMPTS",
    "Needs",
    "REREADS",
    "Reader",
    "RegionCopy",
    "ShardTask",
    "blob_digests",
    "files_of",
    "locate",
    "rereading",
]

PIECE = 1 << 20  # hash-then-copy granularity: stays in cache (L2 on most machines) between the two
# Tensors up to this size (savepoint never block-hashes them: see
# savepoint.codecs.checksum.block_size) are checked and copied in tight loops, many per task.
SMALL = 2 * checksum.MIN_BLOCK
# Stores without zero-copy views (object stores): tensors are read with ranged reads straight into
# their destination; small neighbours are read together, one read per group of at most
# GROUP_BYTES whose gaps are at most GAP_BYTES (a GET costs about as much as reading that much).
GROUP_BYTES = 16 << 20
GAP_BYTES = 256 << 10
ATTEMPTS = 20  # generations a reader tries to pin before giving up (each try takes microseconds)
# Whole reads started again when a store without kept bytes (an object store) lost the generation
# being read to a writer's replace (ReplacedWhileReadingError): each is a full read, so few.
REREADS = 5
REPLACE_WAIT = 2.0  # seconds to wait for a live fallback replace to put its new checkpoint in place

# Which data files a caller will read, given the pinned directory (as messages show it) and its
# manifest.
Needs = Callable[[str, mf.Manifest], Iterable[str]]


def locate(store: Store, path: str) -> str:
    """The directory holding the committed checkpoint for ``path``, or a clear error.

    A fallback replace (two renames) leaves ``path`` missing for a moment, and a replace can
    land between the looks :func:`resolve` takes; an answer of "nothing there" or "no manifest"
    is given only when a second look agrees."""
    shown = store.url(path)
    for attempt in range(ATTEMPTS):
        found = _resolve(store, path)
        if found is not None:
            return found
        try:
            st = store.stat(path)
            if st is not None and st.kind == "link":
                st = store.stat(store.realpath(path))
            replacing = st is None and bool(names.siblings(store, path, names.OLD_TAG))
        except PermissionError as exc:
            raise local.permission_error(exc, shown) from None
        except OSError as exc:
            raise CheckpointError(
                f"cannot look at {shown}: {exc.strerror or exc}", path=shown
            ) from exc
        if st is None:
            if not replacing or attempt == ATTEMPTS - 1:
                raise CheckpointNotFoundError(f"no checkpoint at {shown}", path=shown) from None
            time.sleep(0.001)  # a replace is between its renames: look again
            continue
        if st.kind != "dir":
            kind = "a regular file" if st.kind == "file" else _special_kind(store, path)
            raise IncompleteCheckpointError(
                f"{shown} is {kind}, not a savepoint checkpoint directory (files of other "
                "formats, .safetensors, .pt, .shrew, burn .mpk, are read from local paths by "
                "sp.load, sp.convert and `savepoint inspect`)",
                path=shown,
            )
        try:
            there = store.stat(store.join(path, mf.NAME))
        except PermissionError as exc:
            # A directory we may not search hides its manifest: say so, not "no manifest".
            raise local.permission_error(exc, shown) from None
        except OSError as exc:  # a failed look is not "no manifest"
            raise CheckpointError(
                f"cannot look at {shown}: {exc.strerror or exc}", path=shown
            ) from exc
        if there is None:
            break
        # The manifest is there now: a replace landed while resolve looked. Look again.
    raise IncompleteCheckpointError(
        f"{shown} has no {mf.NAME}: the save that created it did not commit (or it is not a "
        "savepoint checkpoint); use an earlier checkpoint",
        path=shown,
    )


def _resolve(store: Store, path: str) -> str | None:
    """:func:`resolve`, waiting out a live fallback replace between its two renames."""
    deadline = None
    while True:
        found = resolve(store, path)
        if found is None or names.OLD_TAG not in store.basename(found):
            return found  # the checkpoint itself, a generation of it, or what its alias names
        # ``path`` is missing and a fallback replace (two renames, where the filesystem cannot
        # exchange) left the previous checkpoint under a hidden name: either that replace is
        # between its renames right now, or it died there. A live one finishes in moments.
        rest = store.basename(found).split(names.OLD_TAG, 1)[-1]
        deadline = deadline or time.monotonic() + REPLACE_WAIT
        if names.dead_here(rest) or time.monotonic() > deadline:
            import warnings

            warnings.warn(
                f"{store.url(path)} is missing but an interrupted replace left its previous "
                f"checkpoint at {store.url(found)}; loading that one (the next save to "
                f"{store.url(path)} tidies up)",
                stacklevel=6,
            )
            return found
        time.sleep(0.001)


def _parse_manifest(shown: str, raw: bytes, columns: bool = True) -> mf.Manifest:
    try:
        return mf.parse(raw, columns=columns)
    except mf.ManifestVersionError as exc:
        raise IncompatibleCheckpointError(f"{shown}: {exc}", path=shown) from None
    except mf.ManifestError as exc:
        raise CorruptCheckpointError(f"{shown}/{mf.NAME}: {exc}", path=shown) from None


def blob_digests(locations: Iterable[Location]) -> set[str]:
    """Every blob the committed checkpoints at ``locations`` name (tensors', shards' and
    patches'): what a collection must keep. A location holding no committed checkpoint is
    skipped; a manifest that cannot be read raises (a collection then deletes nothing)."""
    found: set[str] = set()
    for where in locations:
        try:
            reader = Reader.open(where, needs=lambda shown, manifest: ())
        except (CheckpointNotFoundError, IncompleteCheckpointError):
            continue  # nothing committed there (deleted since a listing, say)
        with reader:
            for recipe in mf.recipes(reader.manifest):
                found.update(recipe.names())
    return found


def files_of(manifest: mf.Manifest, refs: Iterable[str]) -> set[str]:
    """The data files holding every shard of the tensors ``refs``."""
    records = manifest.tensors
    if not manifest.sharded:  # every tensor stored whole: one file each (or blobs: "")
        named = set(map(_FILE_OF, map(records.__getitem__, refs)))
        named.discard("")
        return named
    found: set[str] = set()
    for r in refs:
        rec = records[r]
        if rec.shards:
            found.update(s.file for s in rec.shards)
        else:
            found.add(rec.file)
    found.discard("")  # shards stored as blobs (version 4)
    return found


class _Replaced(Exception):
    """The generation being opened was replaced or deleted before it was pinned: start again."""


def _same_generation(store: Store, path: str, pinned: PinnedContext) -> bool:
    """Whether ``path`` still resolves to the pinned directory."""
    try:
        mine = pinned.identity()
        now = resolve(store, path)
        if mine is None or now is None:
            return False  # removed (or nothing there any more: a fresh locate says what)
        there = store.stat(now)
    except OSError:
        return False
    return there is not None and there.identity == mine


class _File:
    """An open, checked data file: a whole-file view where the store has one, else reads."""

    __slots__ = ("array", "blob")

    def __init__(self, blob: BlobReader, array: np.ndarray[Any, Any] | None) -> None:
        self.blob = blob
        self.array = array

    def slice(self, start: int, end: int) -> np.ndarray[Any, Any]:
        if self.array is not None:
            return self.array[start:end]
        out = np.empty(end - start, dtype=np.uint8)
        self.blob.read(start, out)
        return out


@dataclass(frozen=True)
class RegionCopy:
    """Copy ``region`` (global coordinates) of a tensor out of one of its shards into ``dst``.

    ``src`` is the piece of the shard's buffer that holds ``region``; ``dst`` is a typed array
    holding the box of the tensor that starts at ``dst_origin`` (global coordinates).
    """

    src: boxes.Piece
    region: boxes.Box
    dst: np.ndarray[Any, Any]
    dst_origin: tuple[int, ...]


ShardTask = tuple[str, int, Sequence[RegionCopy]]  # (tensor ref, shard index, copies)


def _view(array: np.ndarray[Any, Any], index: tuple[slice, ...]) -> np.ndarray[Any, Any]:
    # ``a[()]`` of a 0-d array is a scalar, not a view; ``a[...]`` is a view.
    return array[index] if index else array[...]


class Reader:
    """Views the data files a load needs, once each, and hands out verified tensor bytes."""

    def __init__(
        self,
        store: Store,
        path: str,
        manifest: mf.Manifest,
        *,
        pinned: PinnedContext | None = None,
        copy_on_write: bool = False,
        blobs: dict[str, BlobReader] | None = None,
        source: str | None = None,
    ) -> None:
        self.store = store
        self.path = path
        self.shown = store.url(path)  # how messages name the checkpoint
        self.source = source or path  # the path the caller asked for (``path`` is where it was)
        self.manifest = manifest
        self.pinned = pinned  # owned: closed with the reader
        self.copy_on_write = copy_on_write
        self._blobs = dict(blobs or {})  # owned: data files opened by ``open``
        self._files: dict[str, _File] = {}
        self._blob_store: BlobStore | None = None

    @classmethod
    def open(
        cls,
        path: PathArg,
        *,
        copy_on_write: bool = False,
        needs: Needs | None = None,
        columns: bool = True,
    ) -> Reader:
        """Open and pin one generation of the committed checkpoint at ``path`` (a local path,
        a URL or a Location).

        Its directory, its manifest and the data files ``needs(shown, manifest)`` names (by
        default every data file) are opened before this returns, so a concurrent replace or
        delete of ``path`` can neither take them away nor mix two checkpoints into one load (see
        the module docstring). ``needs`` may raise (a missing key, say); nothing stays open then.
        A needed file missing from a generation that is still in place is left unopened: reading
        it raises CorruptCheckpointError. ``columns``: see :func:`savepoint.codecs.manifest.parse`
        (a load passes False).
        """
        where = path if isinstance(path, Location) else resolve_path(path, what="checkpoint path")
        for attempt in range(ATTEMPTS):
            try:
                return cls._open_once(where.store, where.path, copy_on_write, needs, columns)
            except _Replaced:
                time.sleep(min(0.0005 * attempt, 0.01))  # let the writer finish its swap
        shown = where.store.url(where.path)
        raise CheckpointError(
            f"{shown} was replaced {ATTEMPTS} times while it was being opened (another process "
            "is saving to it continuously); each checkpoint it held was intact: load again",
            path=shown,
        )

    @classmethod
    def _open_once(
        cls, store: Store, path: str, copy_on_write: bool, needs: Needs | None, columns: bool
    ) -> Reader:
        directory = locate(store, path)
        shown = store.url(directory)
        try:
            pinned = store.pin(directory)
        except (FileNotFoundError, NotADirectoryError):
            raise _Replaced from None  # renamed away or deleted since locate saw it
        except PermissionError as exc:  # a pin looks (stat) and may be refused
            raise local.permission_error(exc, shown) from None
        blobs: dict[str, BlobReader] = {}
        try:
            try:
                raw = pinned.read_small(mf.NAME, cap=mf.MAX_MANIFEST_BYTES)
            except FileNotFoundError:
                if not _same_generation(store, path, pinned):
                    raise _Replaced from None
                raise IncompleteCheckpointError(f"{shown} has no {mf.NAME}", path=shown) from None
            manifest = _parse_manifest(shown, raw, columns)
            wanted = manifest.files if needs is None else needs(shown, manifest)
            for name in sorted(set(wanted)):
                try:
                    blobs[name] = pinned.open_blob(name, copy_on_write=copy_on_write)
                except FileNotFoundError:
                    if not _same_generation(store, path, pinned):
                        raise _Replaced from None
                    # Missing from a stable generation: damage, reported by the load that reads
                    # it (``needs`` may name more files than a partial ``into`` reads).
        except BaseException:
            for blob in blobs.values():
                blob.close()
            pinned.close()
            raise
        return cls(
            store,
            directory,
            manifest,
            pinned=pinned,
            copy_on_write=copy_on_write,
            blobs=blobs,
            source=path,
        )

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for f in self._files.values():
            f.blob.close()
        self._files.clear()
        for blob in self._blobs.values():
            blob.close()
        self._blobs.clear()
        if self.pinned is not None:
            self.pinned.close()
            self.pinned = None

    def _corrupt(self, message: str, key: str | None = None) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{self.shown}: {message}", path=self.shown, key=key)

    def _open_blob(self, name: str) -> BlobReader:
        blob = self._blobs.pop(name, None)
        if blob is not None:
            return blob
        # Not opened by ``open`` (a caller that named fewer files than it reads): open now. The
        # generation may be gone by now; that is not damage, so do not call it corrupt.
        try:
            if self.pinned is None:
                raise FileNotFoundError(name)
            return self.pinned.open_blob(name, copy_on_write=self.copy_on_write)
        except FileNotFoundError:
            if self.pinned is not None and not _same_generation(
                self.store, self.source, self.pinned
            ):
                raise ReplacedWhileReadingError(
                    f"{self.shown} was replaced or deleted while it was being read (data "
                    f"file {name} was not opened in time); load again",
                    path=self.shown,
                ) from None
            raise self._corrupt(f"data file {name} is missing") from None

    def open_file(self, name: str, *, check_header: bool = True) -> _File:
        """Data file ``name``, its size and header checked against the manifest (once)."""
        opened = self._files.get(name)
        if opened is not None:
            return opened
        record = self.manifest.files[name]
        blob = self._open_blob(name)
        try:
            size = blob.size
            if size != record.size:
                raise self._corrupt(
                    f"data file {name} is {size} bytes, {record.size} were committed (truncated "
                    "or overwritten)"
                )
            head = np.empty(record.header_size, dtype=np.uint8)
            try:
                blob.read(0, head)
            except EOFError:
                raise self._corrupt(f"data file {name} shrank while being read") from None
            raw = head.tobytes()
            try:
                n = safetensors.header_length(raw, size)
            except safetensors.HeaderError as exc:
                raise self._corrupt(f"data file {name}: {exc}") from None
            if n + 8 != record.header_size:
                raise self._corrupt(f"data file {name}: header length field is damaged")
            if check_header and checksum.digest(raw) != record.header_xxh3:
                raise self._corrupt(f"data file {name}: header checksum mismatch")
            opened = _File(blob, blob.view(0, size))
        except BaseException:
            blob.close()
            raise
        self._files[name] = opened
        return opened

    def header_bytes(self, name: str) -> bytes:
        """Data file ``name``'s header, its 8-byte length prefix included (size-checked)."""
        return bytes(self.open_file(name).slice(0, self.manifest.files[name].header_size))

    def header_entries(self, name: str) -> list[safetensors.Entry]:
        record = self.manifest.files[name]
        raw = bytes(self.open_file(name).slice(8, record.header_size))
        try:
            entries, _ = safetensors.parse_header(raw, record.size)
        except safetensors.HeaderError as exc:
            raise self._corrupt(f"data file {name}: {exc}") from None
        return entries

    def raw(self, ref: str, *, check_header: bool = True) -> np.ndarray[Any, Any]:
        rec = self.manifest.tensors[ref]
        return self.open_file(rec.file, check_header=check_header).slice(rec.start, rec.end)

    def prepare(self, refs: Iterable[str], *, check_header: bool = True) -> None:
        """Open, size-check and header-check every file holding ``refs``, before any allocation:
        a manifest that claims more data than the files hold fails here, not in ``np.empty``."""
        self.prepare_files(files_of(self.manifest, refs), check_header=check_header)

    def prepare_files(self, names: Iterable[str], *, check_header: bool = True) -> None:
        for name in sorted(names):
            self.open_file(name, check_header=check_header)

    def is_split(self, ref: str) -> bool:
        """Whether ``ref`` is not one range of a data file (shards, or blobs)."""
        rec = self.manifest.tensors[ref]
        return rec.is_split or rec.recipe is not None

    def blob_store(self) -> BlobStore:
        """The blob store of a version 4 checkpoint (opened once; never created)."""
        if self._blob_store is None:
            from savepoint.blobs import BlobStore

            rel = self.manifest.blob_store
            assert rel is not None
            # A run's alias (``<run>/latest``, a linked copy of ``<run>/checkpoints/step-N``)
            # holds the manifest of a directory one level deeper: where the store is not at
            # ``rel``, it is looked for one ``..`` closer (never further out than ``rel``).
            tries = [rel] + ([rel[3:]] if rel.startswith("../") else [])
            # ``rel`` is relative to the checkpoint's path; on a store without rename the
            # manifest is in a generation directory under it (commit._generations).
            base = self.path
            if names.is_generation(self.store.basename(base)):
                base = self.store.parent(base)
            # Where both open (a store of other checkpoints next to the run, say), the one
            # holding a blob this checkpoint names is its own.
            probe = next((r.digests[0] for r in mf.recipes(self.manifest) if r.digests), None)
            first: CheckpointError | None = None
            for candidate in tries:
                root = posixpath.normpath(posixpath.join(base, candidate))
                try:
                    opened = BlobStore(
                        self.store, root, algorithm=self.manifest.blob_digest, create=False
                    )
                except CheckpointError as exc:
                    # A refusal says more than the other candidate's "no store here".
                    refused = isinstance(exc, CheckpointPermissionError)
                    first = exc if refused else first or exc
                    continue
                self._blob_store = self._blob_store or opened
                if probe is None or opened.exists(probe):
                    self._blob_store = opened
                    break
            if self._blob_store is None and isinstance(first, CheckpointPermissionError):
                raise first  # may not be read: not damage
            if self._blob_store is None:
                if self._left_its_path() == "deleted":  # the run deleted with its store, say
                    raise CheckpointNotFoundError(
                        f"{self.shown} was deleted while it was being read (its blob store "
                        "with it); it was intact when the read began. Load a checkpoint that "
                        "is still there",
                        path=self.shown,
                    )
                root = posixpath.normpath(posixpath.join(base, rel))
                raise CorruptCheckpointError(
                    f"{self.shown}: its blob store {self.store.url(root)} cannot be opened: "
                    f"{first}",
                    path=self.shown,
                ) from None
        return self._blob_store

    def blob_failure(
        self, exc: CorruptCheckpointError, ref: str, where: str = ""
    ) -> CheckpointError:
        """The error for a blob read of tensor ``ref`` (``where``: which part of it) that failed
        with ``exc``. The reader pins the checkpoint's directory, not its blobs (they may be
        thousands, shared with every other checkpoint of the run), so a writer can delete the
        checkpoint being read and then collect its blobs (a run's retention does, manifest
        first). A missing blob is therefore damage only while the checkpoint is still at its
        path: deleted since it was opened, it is CheckpointNotFoundError saying so; replaced by
        another checkpoint, ReplacedWhileReadingError (``sp.load`` and ``sp.verify`` read the new
        one). Anything else is CorruptCheckpointError naming the tensor."""
        from savepoint.blobs.store import MissingBlobError

        if isinstance(exc, MissingBlobError):
            gone = self._left_its_path()
            if gone == "deleted":
                return CheckpointNotFoundError(
                    f"{self.shown} was deleted while it was being read (by a run's retention, "
                    f"say), and blob {exc.digest} of tensor {ref!r} with it; it was intact when "
                    "the read began. Load a checkpoint that is still there",
                    path=self.shown,
                )
            if gone == "replaced":
                return ReplacedWhileReadingError(
                    f"{self.shown} was replaced while it was being read, and blob {exc.digest} "
                    f"of tensor {ref!r} of the checkpoint being read was collected; load again",
                    path=self.shown,
                )
        return self._corrupt(f"tensor {ref!r}{where}: {exc}", key=ref)

    def _left_its_path(self) -> str | None:
        """Whether the checkpoint this reader pinned has left the path it was opened by:
        "deleted" (nothing committed there now), "replaced" (another checkpoint there now), or
        None (it is still there, or that cannot be told)."""
        try:
            now = resolve(self.store, self.source, strict=False)
            if now is None:
                return "deleted"
            if self.pinned is None:
                return None
            mine = self.pinned.identity()
            there = self.store.stat(now)
        except (OSError, CheckpointError):
            return None
        if there is not None and mine is not None and there.identity == mine:
            return None
        return "replaced"

    def _read_blobs(
        self,
        ref: str,
        dst: np.ndarray[Any, Any] | None,
        verify: bool,
        progress: Callable[[int], None] | None,
        lock: threading.Lock,
    ) -> None:
        """A tensor stored as blobs: read into ``dst`` (checked against the recipe's checks
        with ``verify``), or with no ``dst`` every blob checked against its digest."""
        rec = self.manifest.tensors[ref]
        recipe = rec.recipe
        blobs = self.blob_store()
        try:
            if dst is None:
                blobs.verify_recipe(recipe)
                if rec.dtype == "BOOL":
                    dst = blobs.read_recipe(recipe, verify=False)
            else:
                blobs.read_recipe(recipe, out=dst, verify=verify)
        except CorruptCheckpointError as exc:
            raise self.blob_failure(exc, ref) from None
        if dst is not None and rec.dtype == "BOOL":
            self._check_bool(ref, dst)
        if progress is not None:
            with lock:
                progress(rec.nbytes)

    def transfer(
        self,
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
        records = self.manifest.tensors
        files = self._files
        for ref, dst in jobs:
            rec = records[ref]
            if rec.recipe is not None:
                work.append(
                    (
                        rec.nbytes,
                        functools.partial(self._read_blobs, ref, dst, verify, progress, lock),
                    )
                )
                continue
            if len(rec.shards) > 1:
                split.extend(self._assemble(ref, dst))
                continue
            opened = files.get(rec.file) or self.open_file(rec.file, check_header=verify)
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
                    functools.partial(self._copy_whole, ref, src, dst, verify, progress, lock),
                )
            )
        for size, bundle in _runs(small):
            work.append((size, functools.partial(self._copy_small, bundle, verify, progress, lock)))
        work += self._ranged_work(ranged, verify=verify, progress=progress, lock=lock)
        work += self._shard_work(split, verify=verify, progress=progress, lock=lock)
        self._run(work)

    def check_small(
        self,
        records: Iterable[tuple[str, mf.TensorRecord]] | mf.TensorTable,
        progress: Callable[[int], None] | None = None,
    ) -> list[str]:
        """Check the checksums of the small tensors among ``(ref, record)`` stored whole in
        files with a zero-copy view (opened and checked already, or now) in one tight loop on
        this thread; return the refs of the others, for :meth:`transfer`. A mismatch raises
        CorruptCheckpointError naming the tensor.

        For a verify of 100,000 small tensors this is 0.5 us a tensor, where a transfer job
        each costs about 2 (work items, runs, a numpy slice and a hex formatting per tensor);
        the hashing holds the GIL for buffers this small anyway."""
        if isinstance(records, mf.TensorTable):
            return self._check_small_table(records, progress)
        hexdigest = _HEXDIGEST
        views: dict[str, memoryview | None] = {}
        rest: list[str] = []
        checked = 0
        for ref, rec in records:
            start, end = rec.start, rec.end
            if (
                rec.shards[1:]
                or rec.block
                or end - start > SMALL
                or rec.dtype == "BOOL"
                or rec.recipe is not None
            ):
                rest.append(ref)
                continue
            file = rec.file
            if file in views:
                view = views[file]
            else:
                opened = self._files.get(file) or self.open_file(file)
                view = views[file] = None if opened.array is None else opened.array.data
            if view is None:
                rest.append(ref)
                continue
            if hexdigest(view[start:end]) != rec.xxh3 and not checksum.matches(
                view[start:end], rec.xxh3
            ):
                raise self._corrupt(f"checksum mismatch in tensor {ref!r}", key=ref)
            checked += end - start
        if progress is not None and checked:
            progress(checked)
        return rest

    def _check_small_table(
        self, table: mf.TensorTable, progress: Callable[[int], None] | None
    ) -> list[str]:
        """:meth:`check_small` of every tensor of a table, from its columns (no records)."""
        intdigest = _INTDIGEST
        views: list[memoryview | None] = []
        for name in table.files:
            opened = self._files.get(name) or self.open_file(name)
            views.append(None if opened.array is None else opened.array.data)
        boolean = table.dtypes.index("BOOL") if "BOOL" in table.dtypes else -1
        names, starts, ends, digests = table.names, table.starts, table.ends, table.digests
        file_of, dtype_of = table.file_of, table.dtype_of
        rest: list[str] = []
        checked = 0
        for i, start in enumerate(starts):
            end = ends[i]
            view = views[file_of[i]]
            if end - start > SMALL or view is None or dtype_of[i] == boolean:
                rest.append(names[i])
                continue
            if intdigest(view[start:end]) != digests[i]:
                ref = names[i]
                raise self._corrupt(f"checksum mismatch in tensor {ref!r}", key=ref)
            checked += end - start
        if progress is not None and checked:
            progress(checked)
        return rest

    def _copy_small(
        self,
        items: Sequence[tuple[str, mf.TensorRecord, np.ndarray[Any, Any], Any]],
        verify: bool,
        progress: Callable[[int], None] | None,
        lock: threading.Lock,
    ) -> None:
        """:meth:`_copy_whole` for small tensors (``(ref, record, file view, dst)``), in one
        loop: each hashed in one call, then copied. No hasher, view or task per tensor: a
        100,000-tensor verify spent 20 us a tensor on those."""
        digest = checksum.digest
        for ref, rec, array, dst in items:
            src = array[rec.start : rec.end]
            if verify and digest(src) != rec.xxh3 and not checksum.matches(src, rec.xxh3):
                raise self._corrupt(f"checksum mismatch in tensor {ref!r}", key=ref)
            if rec.dtype == "BOOL" and (verify or dst is not None):
                self._check_bool(ref, src)
            if dst is not None:
                np.copyto(dst, src)
            if progress is not None:
                with lock:
                    progress(len(src))

    def materialize(
        self,
        found: dict[str, str],
        framework: str,
        *,
        verify: bool = True,
        progress: Callable[[int], None] | None = None,
    ) -> dict[str, Any]:
        """New arrays or tensors, made straight from their checked bytes, for the small tensors
        among ``found`` (ref -> kind) stored whole in files with a zero-copy view; returned by
        ref, chosen as :meth:`allocate` chooses. The other refs are left to :meth:`allocate` and
        :meth:`transfer`. Their files must be prepared (:meth:`prepare`).

        One copy per tensor and no empty allocation, byte view or task to fill later: for a
        100,000-tensor load that took 2.5 s, this takes about 0.3 s. With ``verify`` each is
        hashed before it is made; a mismatch raises CorruptCheckpointError naming the tensor."""
        records = self.manifest.tensors
        files = self._files
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
                    raise self._corrupt(f"checksum mismatch in tensor {ref!r}", key=ref)
                d = by_name[rec.dtype]
                if d.name == "BOOL":
                    self._check_bool(ref, src)
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

    def _ranged_work(
        self,
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
            rec = self.manifest.tensors[ref]
            by_file.setdefault(rec.file, []).append((rec.start, rec.end, ref, dst))
        for name, items in by_file.items():
            blob = self._files[name].blob
            items.sort(key=lambda item: item[0])
            group: list[tuple[int, int, str, np.ndarray[Any, Any] | None]] = []
            for item in [*items, None]:
                if group and (
                    item is None
                    or item[0] - group[-1][1] > GAP_BYTES
                    or item[1] - group[0][0] > GROUP_BYTES
                ):
                    start, end = group[0][0], group[-1][1]
                    if len(group) == 1:
                        fn = functools.partial(
                            self._read_whole, name, blob, group[0], verify, progress, lock
                        )
                    else:
                        fn = functools.partial(
                            self._read_group, name, blob, group, verify, progress, lock
                        )
                    work.append((end - start, fn))
                    group = []
                if item is not None:
                    group.append(item)
        return work

    def _read_range(
        self, name: str, blob: BlobReader, start: int, out: np.ndarray[Any, Any]
    ) -> None:
        try:
            blob.read(start, out)
        except EOFError:
            raise self._corrupt(f"data file {name} shrank while being read") from None

    def _read_whole(
        self,
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
            self._read_range(name, blob, start, dst)
            self._check_read(ref, [dst], verify, progress, lock)
            return
        scratch = np.empty(min(GROUP_BYTES, end - start), dtype=np.uint8)

        def pieces() -> Iterator[np.ndarray[Any, Any]]:
            for pos in range(start, end, len(scratch)):
                piece = scratch[: min(len(scratch), end - pos)]
                self._read_range(name, blob, pos, piece)
                yield piece

        self._check_read(ref, pieces(), verify, progress, lock)

    def _read_group(
        self,
        name: str,
        blob: BlobReader,
        group: Sequence[tuple[int, int, str, np.ndarray[Any, Any] | None]],
        verify: bool,
        progress: Callable[[int], None] | None,
        lock: threading.Lock,
    ) -> None:
        """Neighbouring small tensors: one read of their span, then each copied and checked."""
        base = group[0][0]
        span = np.empty(group[-1][1] - base, dtype=np.uint8)
        self._read_range(name, blob, base, span)
        for start, end, ref, dst in group:
            self._copy_whole(ref, span[start - base : end - base], dst, verify, progress, lock)

    def _check_read(
        self,
        ref: str,
        pieces: Iterable[np.ndarray[Any, Any]],
        verify: bool,
        progress: Callable[[int], None] | None,
        lock: threading.Lock,
    ) -> None:
        """Hash (``verify``), BOOL-check and count bytes already in place, piece by piece."""
        rec = self.manifest.tensors[ref]
        hasher = checksum.Hasher(rec.block, expect=rec.xxh3) if verify else None
        boolean = rec.dtype == "BOOL"
        for data in pieces:
            for pos in range(0, len(data), PIECE):
                piece = data[pos : pos + PIECE]
                if hasher is not None:
                    hasher.update(piece)
                if boolean:
                    self._check_bool(ref, piece)
                if progress is not None:
                    with lock:
                        progress(len(piece))
        if hasher is not None:
            self._check_digest(ref, rec.layout()[0], hasher, "")

    def _copy_whole(
        self,
        ref: str,
        src: np.ndarray[Any, Any],
        dst: np.ndarray[Any, Any] | None,
        verify: bool,
        progress: Callable[[int], None] | None,
        lock: threading.Lock,
    ) -> None:
        rec = self.manifest.tensors[ref]
        hasher = checksum.Hasher(rec.block, expect=rec.xxh3) if verify else None
        boolean = rec.dtype == "BOOL"
        for pos in range(0, len(src), PIECE):
            piece = src[pos : pos + PIECE]
            if hasher is not None:
                hasher.update(piece)
            if boolean and (hasher is not None or dst is not None):
                self._check_bool(ref, piece)
            if dst is not None:
                np.copyto(dst[pos : pos + PIECE], piece)
            if progress is not None:
                with lock:
                    progress(len(piece))
        if hasher is not None:
            self._check_digest(ref, rec.layout()[0], hasher, "")

    def _check_digest(
        self, ref: str, shard: mf.ShardRecord, hasher: checksum.Hasher, where: str
    ) -> None:
        """Compare what ``hasher`` saw (the whole shard, or blocks from ``hasher.first`` on) with
        the manifest; a mismatch is a CorruptCheckpointError naming the tensor, ``where`` (the
        shard, for split tensors) and the first bad block."""
        got = hasher.result()
        if not shard.block:
            if got.xxh3 != shard.xxh3:
                raise self._corrupt(f"checksum mismatch in tensor {ref!r}{where}", key=ref)
            return
        expected = shard.blocks[hasher.first : hasher.first + len(got.blocks)]
        for i, (a, b) in enumerate(zip(got.blocks, expected)):
            if a != b:
                first = (hasher.first + i) * shard.block
                last = min(first + shard.block, shard.nbytes)
                raise self._corrupt(
                    f"checksum mismatch in tensor {ref!r}{where}: block {hasher.first + i + 1} "
                    f"of {len(shard.blocks)} (bytes {first}..{last} of it)",
                    key=ref,
                )

    def _check_bool(self, ref: str, data: np.ndarray[Any, Any]) -> None:
        """Refuse a BOOL tensor holding a byte other than 0 or 1: numpy and torch would keep the
        odd byte, and the tensor would then differ from its own round trip. The checksum cannot
        catch it (a crafted file can carry a matching one). About 0.08 s per GiB, BOOL tensors only."""
        # max() reduces with SIMD and no temporary: about 3x cheaper than np.any(data > 1).
        if data.size and int(data.view(np.uint8).max()) > 1:
            raise self._corrupt(
                f"tensor {ref!r} is BOOL but holds bytes other than 0 and 1", key=ref
            )

    @staticmethod
    def _run(work: list[tuple[int, Callable[[], None]]]) -> None:
        def run(bundle: list[tuple[int, Callable[[], None]]]) -> None:
            for _, fn in bundle:
                fn()

        parallel.run_all(run, parallel.bundles(work, lambda item: item[0]))

    def _assemble(self, ref: str, dst: np.ndarray[Any, Any] | None) -> list[ShardTask]:
        """Tasks that copy every shard of a split tensor into its place in ``dst`` (bytes)."""
        rec = self.manifest.tensors[ref]
        if dst is None:
            return [(ref, i, ()) for i in range(len(rec.shards))]
        typed = dst.view(dtypes.from_name(rec.dtype).numpy).reshape(rec.shape)
        origin = (0,) * len(rec.shape)
        return [
            (
                ref,
                i,
                [RegionCopy(p, p.box, typed, origin) for p in boxes.pieces(s.region, rec.shape)],
            )
            for i, s in enumerate(rec.shards)
        ]

    def read_shards(
        self,
        tasks: Sequence[ShardTask],
        *,
        verify: bool = True,
        progress: Callable[[int], None] | None = None,
        check_only: bool = False,
    ) -> None:
        """Run ``(ref, shard index, copies)`` tasks on the thread pool: each shard touched is
        viewed once and, with ``verify``, checked (a task without copies only checks it;
        ``check_only`` checks what the copies would read, the blocks holding it, and copies
        nothing: ``verify="first"``).

        The hash runs ahead of the copies in buffer order, a piece at a time, so a copy reads
        memory the hash has just brought into cache. The granularity of verification is the
        block where the shard has block checksums (manifest version 3: a rank that needs part of
        a shard reads and hashes only the blocks holding that part) and the shard otherwise
        (with ``verify=False`` only the bytes needed are read).
        """
        self._run(
            self._shard_work(
                tasks,
                verify=verify,
                progress=progress,
                lock=threading.Lock(),
                check_only=check_only,
            )
        )

    def _shard_work(
        self,
        tasks: Sequence[ShardTask],
        *,
        verify: bool,
        progress: Callable[[int], None] | None,
        lock: threading.Lock,
        check_only: bool = False,
    ) -> list[tuple[int, Callable[[], None]]]:
        work: list[tuple[int, Callable[[], None]]] = []
        for ref, index, copies in tasks:
            shard = self.manifest.tensors[ref].layout()[index]
            if shard.recipe is not None and not copies and not check_only:
                # A verify pass over a shard stored as blobs: every blob against its name.
                self.blob_store()
                fn = functools.partial(self._verify_blob_shard, ref, shard, progress, lock)
                work.append((shard.nbytes, fn))
                continue
            opened = None
            if shard.recipe is None:
                opened = self.open_file(shard.file, check_header=verify)
            else:
                self.blob_store()  # opened here, once, not by the tasks at once
            # The bytes a task reads: those its copies need, widened (``verify``) to the blocks
            # holding them, or to the whole shard where it has no block checksums; a check-only
            # task (no copies) reads the whole shard.
            span = (0, shard.nbytes)
            if copies:
                span = self._needed(ref, copies)
                if verify:
                    span = _blocks_around(shard, span)
            # Without a view the shard is read when its task runs (not all shards up front), and
            # only ``span`` of it; a shard stored as blobs reads only the chunks holding ``span``
            # (its blocks are its chunks).
            raw: Callable[[], np.ndarray[Any, Any]]
            if opened is None:
                raw = functools.partial(self._read_blob_part, ref, shard, span)
            elif opened.array is None and span != (0, shard.nbytes):
                raw = functools.partial(self._read_part, opened, shard.start, shard.end, span)
            else:
                raw = functools.partial(opened.slice, shard.start, shard.end)
            fn = functools.partial(
                self._copy_shard,
                ref,
                index,
                raw,
                () if check_only else copies,
                span if verify or check_only else None,
                progress,
                lock,
            )
            work.append((shard.end - shard.start, fn))
        return work

    def _needed(self, ref: str, copies: Sequence[RegionCopy]) -> tuple[int, int]:
        """The byte range of a shard's buffer that ``copies`` read."""
        item = dtypes.from_name(self.manifest.tensors[ref].dtype).numpy.itemsize
        spans = [boxes.span(c.region, c.src) for c in copies if boxes.volume(c.region)]
        if not spans:
            return 0, 0
        return min(lo for lo, _ in spans) * item, max(hi for _, hi in spans) * item

    def _read_part(
        self, opened: _File, start: int, end: int, needed: tuple[int, int]
    ) -> np.ndarray[Any, Any]:
        """A shard's buffer with only ``needed`` (a byte range of it) read; the rest is never
        looked at (unverified copies touch only what they need)."""
        buf = np.empty(end - start, dtype=np.uint8)
        lo, hi = needed
        if hi > lo:
            try:
                opened.blob.read(start + lo, buf[lo:hi])
            except EOFError:
                raise self._corrupt(f"a data file shrank while being read ({start + hi})") from None
        return buf

    def _read_blob_part(
        self, ref: str, shard: mf.ShardRecord, needed: tuple[int, int]
    ) -> np.ndarray[Any, Any]:
        """:meth:`_read_part` of a shard stored as blobs: ``needed`` read out of its recipe
        (unchecked here: the caller hashes what it reads against the recipe's checks)."""
        buf = np.empty(shard.nbytes, dtype=np.uint8)
        lo, hi = needed
        if hi > lo:
            try:
                self.blob_store().read_recipe(
                    shard.recipe, out=buf[lo:hi], start=lo, end=hi, verify=False
                )
            except CorruptCheckpointError as exc:
                raise self.blob_failure(
                    exc, ref, f" ({boxes.show(shard.region)} in blobs)"
                ) from None
        return buf

    def _verify_blob_shard(
        self,
        ref: str,
        shard: mf.ShardRecord,
        progress: Callable[[int], None] | None,
        lock: threading.Lock,
    ) -> None:
        """Every blob of a shard stored as blobs against its digest and its recipe's check."""
        where = f" ({boxes.show(shard.region)} in blobs)"
        try:
            self.blob_store().verify_recipe(shard.recipe)
            if self.manifest.tensors[ref].dtype == "BOOL":
                content = self.blob_store().read_recipe(shard.recipe, verify=False)
        except CorruptCheckpointError as exc:
            raise self.blob_failure(exc, ref, where) from None
        if self.manifest.tensors[ref].dtype == "BOOL":
            self._check_bool(ref, content)
        if progress is not None:
            with lock:
                progress(shard.nbytes)

    def _copy_shard(
        self,
        ref: str,
        index: int,
        load: Callable[[], np.ndarray[Any, Any]],
        copies: Sequence[RegionCopy],
        check: tuple[int, int] | None,
        progress: Callable[[int], None] | None,
        lock: threading.Lock,
    ) -> None:
        """Copy the regions ``copies`` need out of a shard's bytes; with ``check`` (a byte range
        of the shard, whole blocks or the whole shard) hash that range first, a piece ahead of
        the copies that read it, and compare it with the manifest."""
        raw = load()
        rec = self.manifest.tensors[ref]
        numpy_dtype = dtypes.from_name(rec.dtype).numpy
        item = numpy_dtype.itemsize
        typed = raw.view(numpy_dtype)
        steps: list[tuple[int, np.ndarray[Any, Any], np.ndarray[Any, Any]]] = []
        for c in copies:
            src = typed[c.src.offset : c.src.offset + boxes.volume(c.src.box)]
            src = src.reshape(boxes.extents(c.src.box))
            for sub in boxes.split(c.region, c.src, PIECE // item):
                _, hi = boxes.span(sub, c.src)
                into = tuple(slice(a - o, b - o) for (a, b), o in zip(sub, c.dst_origin))
                steps.append(
                    (hi * item, _view(src, boxes.relative(sub, c.src)), _view(c.dst, into))
                )
        steps.sort(key=lambda step: step[0])
        shard = rec.layout()[index]
        hasher = None
        begin = hashed = stop = 0
        if check is not None and (check[1] > check[0] or not shard.nbytes):
            begin, stop = check
            hashed = begin
            hasher = checksum.Hasher(
                shard.block, hashed // shard.block if shard.block else 0, shard.xxh3
            )
        boolean = rec.dtype == "BOOL"
        for end, source, target in steps:
            while hasher is not None and hashed < end:
                n = min(PIECE, end - hashed)
                hasher.update(raw[hashed : hashed + n])
                if boolean:
                    self._check_bool(ref, raw[hashed : hashed + n])
                hashed += n
            if boolean and hasher is None:
                self._check_bool(ref, source)
            np.copyto(target, source, casting="no")
            if progress is not None:
                with lock:
                    progress(target.nbytes)
        if hasher is None:
            return
        for pos in range(hashed, stop, PIECE):
            piece = raw[pos : min(pos + PIECE, stop)]
            hasher.update(piece)
            if boolean:
                self._check_bool(ref, piece)
        if not copies and progress is not None:
            with lock:
                progress(stop - begin)  # a check-only pass counts the bytes it hashed
        where = ""
        if rec.is_split:
            where = (
                f" (shard {index + 1} of {len(rec.layout())}, {boxes.show(shard.region)} in "
                f"{shard.file or 'blobs'})"
            )
        self._check_digest(ref, shard, hasher, where)

    def fill_jobs(
        self, targets: Iterable[tuple[str, Any]]
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
            rec = self.manifest.tensors[ref]
            d = dtypes.from_name(rec.dtype)
            host = np.empty(rec.nbytes, dtype=np.uint8)
            jobs.append((ref, host))
            after.append(functools.partial(self._copy_into, ref, target, host, d))
        return jobs, after

    def _copy_into(
        self, ref: str, target: Any, host: np.ndarray[Any, Any], d: dtypes.DType
    ) -> None:
        shaped = host.view(d.numpy).reshape(self.manifest.tensors[ref].shape)
        if isinstance(target, np.ndarray):
            if not target.flags.writeable:
                raise IncompatibleCheckpointError(
                    f"{self.shown}: cannot restore {ref!r} into a read-only numpy array",
                    path=self.shown,
                )
            np.copyto(target, shaped, casting="no")
        else:
            from savepoint.state import torch_tensors

            torch_tensors.copy_into(target, shaped, d)

    def allocate(self, ref: str, kind: str, framework: str, *, share_memory: bool = False) -> Any:
        """A new array or tensor shaped for ``ref``: empty, or (``share_memory``) a view of the
        file's bytes (copy-on-write: the reader was opened with ``copy_on_write``)."""
        rec = self.manifest.tensors[ref]
        d = dtypes.from_name(rec.dtype)
        want_torch = framework == "torch" or (
            framework == "auto" and kind == "torch" and _torch_available()
        )
        if share_memory and not rec.is_split and rec.recipe is None:
            array = self.raw(ref).view(d.numpy).reshape(rec.shape)
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
                f"{self.shown}: cannot allocate {rec.nbytes} bytes for tensor {ref!r} "
                f"({rec.dtype} {list(rec.shape)}), the size its manifest records: {exc}",
                path=self.shown,
            ) from None


_FILE_OF = operator.attrgetter("file")
_HEXDIGEST = xxhash.xxh3_64_hexdigest
_INTDIGEST = xxhash.xxh3_64_intdigest


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


def _blocks_around(shard: mf.ShardRecord, span: tuple[int, int]) -> tuple[int, int]:
    """The byte range a verified read of ``span`` (of ``shard``) reads and checks: the blocks
    holding it, or the whole shard where it has no block checksums (nothing for an empty span)."""
    lo, hi = span
    if hi <= lo:
        return 0, 0
    if not shard.block:
        return 0, shard.nbytes
    b = shard.block
    return lo // b * b, min(-(-hi // b) * b, shard.nbytes)


def _torch_available() -> bool:
    if sys.modules.get("torch") is not None:
        return True
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def _special_kind(store: Store, path: str) -> str:
    """What a non-directory, non-regular file is, where the store can say (local files)."""
    try:
        st = store.stat(store.realpath(path))
    except OSError:
        return "not a directory"
    if st is None or not st.special:
        return "not a directory"
    return f"a {st.special}"


def rereading(read: Callable[[], T]) -> T:
    """``read()``, started again (up to :data:`REREADS` times) when the checkpoint it was
    reading was replaced or deleted under it on a store that keeps no bytes for open readers;
    each attempt pins the generation then at the path afresh."""
    for attempt in range(REREADS):
        try:
            return read()
        except ReplacedWhileReadingError:
            if attempt == REREADS - 1:
                raise
    raise AssertionError("unreachable")  # pragma: no cover
