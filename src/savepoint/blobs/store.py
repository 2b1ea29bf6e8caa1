"""A content-addressed blob store on any :class:`~savepoint.storage.base.Store`.

Layout under the store's root (a directory or an object-store prefix)::

    <root>/store.json                      {"format": "savepoint-blobs", "version": 1,
                                            "digest": "blake3"}  (create-only, never changed)
    <root>/data/<d[:2]>/<d>                one blob: 32-byte header + payload (see frame)
    <root>/data/<d[:2]>/<d>.tmp-<random>   a blob being written (stores with atomic rename only)
    <root>/sessions/<id>.json              a save in flight (see savepoint.blobs.gc)
    <root>/gc/<id>.json                    a collection in flight

A blob's name is the digest of its content, so one that exists is never written again, and
writers of the same content cannot disagree: the first to publish wins, the others find it there
(a create-only rename on local disks, a create-only object on object stores) and discard theirs.
A blob appears whole or not at all: on stores with atomic rename it is written under a temporary
name, fsynced, then renamed into place; on object stores the object becomes visible only when its
upload completes. No listing ever needs more than names: a blob's name is its identity, its codec
and sizes are in its header, its age in the store's own ``mtime``.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from savepoint.blobs import digest as _digest
from savepoint.blobs import frame
from savepoint.blobs.frame import HEADER, Compression
from savepoint.codecs import bounded_json
from savepoint.codecs import checksum as _checksum
from savepoint.codecs.recipe import MAX_CHUNK, Patch, Recipe
from savepoint.errors import (
    CheckpointError,
    CheckpointMemoryError,
    CheckpointWriteError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    ReplacedWhileReadingError,
)
from savepoint.storage.base import read_error

if TYPE_CHECKING:
    from savepoint.blobs.gc import BlobGcReport, SaveSession
    from savepoint.storage.base import Store
    from savepoint.storage.paths import Location, PathArg

__all__ = [
    "BlobInfo",
    "BlobStore",
    "DEFAULT_CHUNK",
    "FORMAT",
    "MAX_CHUNK",
    "MissingBlobError",
    "PutResult",
    "PutStats",
    "Recipe",
    "referenced_by",
]

FORMAT = "savepoint-blobs"
VERSION = 1
CONFIG = "store.json"
DATA = "data"
SESSIONS = "sessions"
GC = "gc"
TMP = ".tmp-"
DEFAULT_CHUNK = 4 << 20  # see docs/blobs.md, "Chunk size"
MIN_CHUNK = 4 << 10
_CONFIG_CAP = 64 << 10


class MissingBlobError(CorruptCheckpointError):
    """A blob is not in the store (``digest`` names it): deleted, or never written. Still a
    CorruptCheckpointError, as for any damaged checkpoint; a reader tells a checkpoint whose
    blobs a collection took *after a writer deleted it* (not damage) from one that lost a blob
    while it still exists (see :meth:`savepoint.engine.read.Reader.blob_failure`)."""

    def __init__(self, message: str, *, path: str, digest: str) -> None:
        super().__init__(message, path=path)
        self.digest = digest


def _empty(n: int, what: str, shown: str) -> np.ndarray[Any, Any]:
    """``np.empty(n, uint8)``, or CheckpointMemoryError saying what it was for."""
    try:
        return np.empty(n, np.uint8)
    except MemoryError:
        raise CheckpointMemoryError(
            f"{shown}: cannot allocate {n} bytes for {what}; free memory and read again",
            path=shown,
        ) from None


def _bytes_view(data: Any) -> tuple[memoryview, int]:
    """``data`` as a flat byte view (no copy for contiguous buffers) and its item size."""
    if isinstance(data, np.ndarray):
        if not data.flags.c_contiguous:
            data = np.ascontiguousarray(data)
        return memoryview(data.reshape(-1).view(np.uint8)), data.dtype.itemsize
    view = memoryview(data)
    if not view.c_contiguous:
        raise ValueError("blob content must be a C-contiguous buffer")
    itemsize = view.itemsize
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view, itemsize


def _out_array(out: Any, n: int) -> np.ndarray[Any, Any]:
    arr = np.frombuffer(out, dtype=np.uint8) if not isinstance(out, np.ndarray) else out
    arr = arr.reshape(-1)
    if arr.dtype != np.uint8:
        arr = arr.view(np.uint8)
    if arr.size != n:
        raise ValueError(f"out holds {arr.size} bytes; {n} are needed")
    if not arr.flags.writeable:
        raise ValueError("out is read-only")
    return arr


@dataclass(frozen=True)
class PutResult:
    """One ``put``: the blob's ``digest``, its content ``size``, whether this call ``written``
    it (False: it was there already), and the bytes it ``stored`` (header included; 0 when not
    written)."""

    digest: str
    size: int
    written: bool
    stored: int


@dataclass
class PutStats:
    """Totals over several puts (thread-safe ``add``): what incremental saves report."""

    blobs_written: int = 0
    blobs_reused: int = 0
    bytes_in: int = 0  # content bytes handed to put
    bytes_written: int = 0  # content bytes of the blobs written
    bytes_stored: int = 0  # bytes those blobs take in the store
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, result: PutResult) -> None:
        with self._lock:
            self.bytes_in += result.size
            if result.written:
                self.blobs_written += 1
                self.bytes_written += result.size
                self.bytes_stored += result.stored
            else:
                self.blobs_reused += 1


@dataclass(frozen=True)
class BlobInfo:
    digest: str
    codec: str  # "raw" or "zstd"
    size: int  # content bytes
    stored: int  # bytes in the store, header included
    mtime: float


class BlobStore:
    """Content-addressed blobs under ``root`` of ``store`` (see the module docstring).

    ``algorithm``: the digest of a new store (``"blake3"``, the default, or ``"xxh3-128"``); an
    existing store keeps its own, and asking for another is IncompatibleCheckpointError.
    ``create=False``: FileNotFoundError-like CheckpointError when there is no store there."""

    def __init__(
        self, store: Store, root: str, *, algorithm: str | None = None, create: bool = True
    ) -> None:
        self.store = store
        self.root = store.abspath(root)
        self.data_root = store.join(self.root, DATA)
        self.algorithm = self._open_config(algorithm, create)
        self._hash = _digest.digest_function(self.algorithm)
        self._hex = _digest.hex_length(self.algorithm)
        self._dirty: set[str] = set()
        self._lock = threading.Lock()
        self._whole_when_visible = _whole_when_visible(store)

    @classmethod
    def open(cls, where: PathArg | Location, **kwargs: Any) -> BlobStore:
        """The blob store at a path or URL (``/runs/a/blobs``, ``s3://bucket/run/blobs``)."""
        from savepoint.storage.paths import resolve

        location = resolve(where, what="blob store")
        return cls(location.store, location.path, **kwargs)

    def url(self, path: str | None = None) -> str:
        return self.store.url(self.root if path is None else path)

    # -- configuration -------------------------------------------------------------------------

    def _read_config(self) -> dict[str, Any] | None:
        path = self.store.join(self.root, CONFIG)
        try:
            raw = self.store.read_small(path, cap=_CONFIG_CAP)
        except FileNotFoundError:
            return None
        except OSError as exc:  # a refused or failed read on a store that says it raw
            raise read_error(self.url(path), exc) from None
        try:
            config = bounded_json.loads(raw, CorruptCheckpointError, self.url(path))
        except CorruptCheckpointError:
            config = None
        if (
            not isinstance(config, dict)
            or config.get("format") != FORMAT
            or type(config.get("version")) is not int
        ):
            raise CorruptCheckpointError(
                f"{self.url(path)} is not a savepoint blob store configuration", path=self.url(path)
            )
        if config["version"] > VERSION:
            raise IncompatibleCheckpointError(
                f"blob store {self.url()} has version {config['version']}; this savepoint reads "
                f"version {VERSION}. Upgrade savepoint.",
                path=self.url(),
            )
        if config.get("digest") not in _digest.ALGORITHMS:
            raise CorruptCheckpointError(
                f"blob store {self.url()} names an unknown digest {config.get('digest')!r}",
                path=self.url(),
            )
        return config

    def _open_config(self, algorithm: str | None, create: bool) -> str:
        if algorithm is not None:
            _digest.hex_length(algorithm)  # unknown: IncompatibleCheckpointError
        config = self._read_config()
        if config is None:
            if not create:
                raise CorruptCheckpointError(
                    f"no blob store at {self.url()} (no {CONFIG})", path=self.url()
                )
            chosen = algorithm or _digest.DEFAULT
            body = json.dumps({"format": FORMAT, "version": VERSION, "digest": chosen}) + "\n"
            try:
                for sub in (DATA, SESSIONS, GC):
                    self.store.makedirs(self.store.join(self.root, sub))
                self.store.sync_dir(self.root)
                self.store.put(self.store.join(self.root, CONFIG), body.encode(), exclusive=True)
                self.store.sync_dir(self.root)
            except FileExistsError:
                pass  # another writer created it first: use theirs
            except OSError as exc:
                if isinstance(exc, CheckpointError):
                    raise
                raise CheckpointWriteError(
                    f"cannot create the blob store {self.url()}: {exc}",
                    path=self.url(),
                    errno=exc.errno,
                ) from exc
            config = self._read_config()
            assert config is not None
        found: str = config["digest"]
        if algorithm is not None and algorithm != found:
            raise IncompatibleCheckpointError(
                f"blob store {self.url()} names its blobs by {found}, not {algorithm}",
                path=self.url(),
            )
        return found

    # -- names -----------------------------------------------------------------------------------

    def digest(self, data: Any) -> str:
        """The name ``data`` (any contiguous buffer) would have in this store."""
        return self._hash(_bytes_view(data)[0])

    def _check(self, digest: str) -> None:
        if not _digest.is_digest(self.algorithm, digest):
            raise CorruptCheckpointError(
                f"{digest!r} is not a {self.algorithm} blob digest", path=self.url()
            )

    def path(self, digest: str) -> str:
        """Where blob ``digest`` lives in the store."""
        self._check(digest)
        return self.store.join(self.data_root, digest[:2], digest)

    def exists(self, digest: str) -> bool:
        path = self.path(digest)
        try:
            st = self.store.stat(path)
        except PermissionError as exc:  # a refusal (an object store's 403) is no "missing"
            raise read_error(self.url(path), exc) from None
        return st is not None and st.kind == "file"

    def _present(self, path: str, size: int) -> bool:
        """Whether a whole blob of ``size`` content bytes is at ``path``. A visible blob is whole
        (see the module docstring), but where the store cannot promise that (no rename, no
        create-only put: some fsspec filesystems) a size that is not the raw one is checked
        against the header; a damaged blob there is replaced."""
        st = self.store.stat(path)
        if st is None:
            return False
        if st.kind != "file":
            raise CorruptCheckpointError(
                f"{self.url(path)} is not a blob file", path=self.url(path)
            )
        if st.size == HEADER + size or (self._whole_when_visible and st.size >= HEADER):
            return True
        try:
            with self._reader(path) as reader:
                self._header(reader, path, size)
            return True
        except CorruptCheckpointError:
            pass
        # Damaged (truncated by a crash on a store that shows partial writes, or bit rot):
        # write it again over the bad one.
        try:
            self.store.remove(path)
        except FileNotFoundError:
            pass
        return False

    # -- writing ---------------------------------------------------------------------------------

    def put(
        self,
        data: Any,
        *,
        compression: Compression | None = None,
        itemsize: int | None = None,
        digest: str | None = None,
        stats: PutStats | None = None,
    ) -> PutResult:
        """Store ``data`` (bytes, a buffer, a contiguous numpy array: read in place) under its
        digest, unless a blob of that name is there already. ``digest``: the caller's own
        computation of it (trusted). ``itemsize``: the element size, for the byte shuffle of
        compressed blobs (numpy arrays bring their own). Durable once :meth:`sync` returns."""
        view, own_itemsize = _bytes_view(data)
        d = digest if digest is not None else self._hash(view)
        result = self._put_view(view, d, compression, itemsize or own_itemsize)
        if stats is not None:
            stats.add(result)
        return result

    def _put_view(
        self, view: memoryview, d: str, compression: Compression | None, itemsize: int
    ) -> PutResult:
        path = self.path(d)
        n = len(view)
        try:
            if self._present(path, n):
                return PutResult(d, n, False, 0)
            codec, shuffle, payload = frame.encode(view, compression, itemsize)
            header = frame.pack_header(codec, shuffle, n, len(payload))
            stored = HEADER + len(payload)
            written = self._publish(path, header, payload, stored)
        except OSError as exc:
            if isinstance(exc, CheckpointError):
                raise
            raise CheckpointWriteError(
                f"cannot write blob {self.url(path)}: {exc}", path=self.url(path), errno=exc.errno
            ) from exc
        return PutResult(d, n, written, stored if written else 0)

    def _create(self, path: str, size: int) -> Any:
        parent = self.store.parent(path)
        try:
            return self.store.create_blob(path, size=size, direct=False)
        except FileNotFoundError:
            self.store.makedirs(parent)
            with self._lock:
                self._dirty.add(self.data_root)
            return self.store.create_blob(path, size=size, direct=False)

    def _publish(self, path: str, header: bytes, payload: Any, stored: int) -> bool:
        """Write the blob; False when another writer published it first."""
        atomic = self.store.capabilities.atomic_rename
        target = f"{path}{TMP}{os.urandom(6).hex()}" if atomic else path
        try:
            writer = self._create(target, stored)
        except FileExistsError:
            return False
        try:
            writer.write(memoryview(header))
            if len(payload):
                writer.write(memoryview(payload))
            writer.finish()
        except FileExistsError:
            writer.abort()
            return False
        except BaseException:
            writer.abort()
            raise
        if atomic:
            try:
                self.store.rename(target, path)
            except FileExistsError:
                self.store.remove(target)
                return False
            except BaseException:
                try:
                    self.store.remove(target)
                except OSError:
                    pass
                raise
        with self._lock:
            self._dirty.add(self.store.parent(path))
        return True

    def sync(self) -> None:
        """Make the names of the blobs written so far durable (one directory sync per fan-out
        directory touched; a no-op on object stores). Call before committing anything that
        refers to them."""
        with self._lock:
            dirty, self._dirty = self._dirty, set()
        try:
            # Fan-out directories first, then data/ (which names new fan-out directories).
            for path in sorted(dirty, key=lambda p: p == self.data_root):
                self.store.sync_dir(path)
        except OSError as exc:
            with self._lock:
                self._dirty |= dirty
            if isinstance(exc, CheckpointError):
                raise
            raise CheckpointWriteError(
                f"cannot make the blobs of {self.url()} durable: {exc}",
                path=self.url(),
                errno=exc.errno,
            ) from exc

    def put_chunked(
        self,
        data: Any,
        *,
        chunk_size: int = DEFAULT_CHUNK,
        compression: Compression | None = None,
        itemsize: int | None = None,
        workers: int = 1,
        memo: _digest.FastMemo | None = None,
        stats: PutStats | None = None,
        on_put: Callable[[PutResult], None] | None = None,
        keys: Sequence[tuple[int, int]] | None = None,
    ) -> Recipe:
        """Store ``data`` as fixed-size chunks of ``chunk_size`` bytes (the last one shorter),
        each a blob; the :class:`Recipe` lists them. Unchanged chunks of an earlier save are not
        written again. ``workers`` > 1 hashes, compresses and writes chunks on that many threads
        (the digests, zstd and the stores release the GIL). ``memo``: skip hashing chunks this
        process has named before (see :class:`savepoint.blobs.digest.FastMemo`); ``keys``: the
        memo's key of each chunk, when the caller computed them already (a patch tracker)."""
        if not MIN_CHUNK <= chunk_size <= MAX_CHUNK:
            raise ValueError(f"chunk_size must be between {MIN_CHUNK} and {MAX_CHUNK} bytes")
        view, own_itemsize = _bytes_view(data)
        size = itemsize or own_itemsize
        n = len(view)
        starts = range(0, n, chunk_size)

        def one(start: int) -> tuple[str, str]:
            part = view[start : start + chunk_size]
            named: tuple[str, str] | None = None
            key = None
            if memo is not None:
                key = keys[start // chunk_size] if keys is not None else memo.key(part)
                named = memo.get(key)
            if named is None:
                named = (self._hash(part), _checksum.digest(part))
                if memo is not None and key is not None:
                    memo.add(key, named)
            result = self._put_view(part, named[0], compression, size)
            if stats is not None:
                stats.add(result)
            if on_put is not None:
                on_put(result)
            return named

        if workers > 1 and len(starts) > 1:
            with concurrent.futures.ThreadPoolExecutor(min(workers, len(starts))) as pool:
                named = list(pool.map(one, starts))
        else:
            named = [one(s) for s in starts]
        digests = tuple(d for d, _ in named)
        return Recipe(self.algorithm, n, chunk_size, digests, tuple(c for _, c in named))

    # -- reading ---------------------------------------------------------------------------------

    def _missing(self, path: str) -> MissingBlobError:
        return MissingBlobError(
            f"blob {self.url(path)} is missing (deleted while still referenced, or never "
            "written); the checkpoint that names it cannot be restored from this store",
            path=self.url(path),
            digest=self.store.basename(path),
        )

    def _reader(self, path: str) -> _Open:
        try:
            return _Open(self.store.open_blob(path))
        except FileNotFoundError:
            raise self._missing(path) from None

    def _header(self, reader: Any, path: str, expect: int | None) -> frame.Header:
        buf = bytearray(HEADER)
        try:
            reader.read(0, buf)
        except ReplacedWhileReadingError:  # deleted since it was opened (object stores)
            raise self._missing(path) from None
        except EOFError:
            raise CorruptCheckpointError(
                f"blob {self.url(path)} is truncated ({reader.size} bytes)", path=self.url(path)
            ) from None
        header = frame.parse_header(
            buf, shown=self.url(path), blob_size=reader.size, expect_size=expect
        )
        if header.codec != frame.RAW and header.raw_size > MAX_CHUNK and expect is None:
            raise CorruptCheckpointError(
                f"blob {self.url(path)} claims {header.raw_size} bytes of content",
                path=self.url(path),
            )
        return header

    def _read_payload(
        self, reader: Any, path: str, header: frame.Header, out: np.ndarray[Any, Any] | None = None
    ) -> np.ndarray[Any, Any]:
        """The whole content of an open blob, decoded (into ``out`` when given): a compressed
        one straight into it, after its zstd frame's claimed content size was found to be the
        header's (:func:`frame.decode`), so nothing is allocated for a claim the caller did not
        account for. Memory: the content, plus the payload of a compressed blob (at most
        :func:`frame.compress_bound` of the content)."""
        shown = self.url(path)
        if header.codec == frame.RAW:
            if out is None:
                out = _empty(header.raw_size, "a blob's content", shown)
            self._read_at(reader, path, HEADER, out)
            return out
        payload = _empty(header.stored_size, "a compressed blob", shown)
        self._read_at(reader, path, HEADER, payload)
        frame.check_frame(header, payload, shown=shown)
        if out is None:
            out = _empty(header.raw_size, "a blob's content", shown)
        frame.decode(header, payload, out, shown=shown)
        return out

    def _read_at(self, reader: Any, path: str, offset: int, out: np.ndarray[Any, Any]) -> None:
        if out.size == 0:
            return
        try:
            reader.read(offset, out)
        except ReplacedWhileReadingError:  # deleted since it was opened (object stores)
            raise self._missing(path) from None
        except EOFError:
            raise CorruptCheckpointError(
                f"blob {self.url(path)} is truncated", path=self.url(path)
            ) from None

    def _verify_content(
        self, digest: str, content: Any, path: str, check: str | None = None
    ) -> None:
        """Compare ``content`` with its name, or (``check`` given) with its XXH3-64."""
        if check is not None:
            if _checksum.digest(content) != check:
                raise CorruptCheckpointError(
                    f"blob {self.url(path)} does not match its checksum (corrupt)",
                    path=self.url(path),
                )
            return
        if self._hash(content) != digest:
            raise CorruptCheckpointError(
                f"blob {self.url(path)} does not match its digest (corrupt)", path=self.url(path)
            )

    def read(
        self,
        digest: str,
        *,
        size: int | None = None,
        out: Any = None,
        verify: bool = True,
        check: str | None = None,
    ) -> np.ndarray[Any, Any]:
        """The content of blob ``digest`` as a uint8 array (into ``out`` when given). ``size``:
        the content size the caller expects (a recipe's), checked before anything is allocated.
        ``verify``: hash the content and compare with the name, or (``check``: the content's
        XXH3-64 from a recipe) with that, at XXH3 speed."""
        path = self.path(digest)
        with self._reader(path) as reader:
            header = self._header(reader, path, size)
            if out is not None:
                target = self._read_payload(reader, path, header, _out_array(out, header.raw_size))
            else:
                target = self._read_payload(reader, path, header)
        if verify:
            self._verify_content(digest, target, path, check)
        return target

    def read_range(
        self,
        digest: str,
        start: int,
        end: int,
        *,
        size: int | None = None,
        out: Any = None,
        verify: bool = False,
        check: str | None = None,
    ) -> np.ndarray[Any, Any]:
        """Content bytes ``[start, end)`` of blob ``digest``: read in place from a raw blob,
        decoded whole from a compressed one. ``verify`` reads (and checks, as :meth:`read`
        does) the whole blob."""
        path = self.path(digest)
        with self._reader(path) as reader:
            header = self._header(reader, path, size)
            if not 0 <= start <= end <= header.raw_size:
                raise ValueError(
                    f"range [{start}, {end}) outside blob {digest} of {header.raw_size} bytes"
                )
            target = (
                _empty(end - start, "a blob's range", self.url(path))
                if out is None
                else _out_array(out, end - start)
            )
            if header.codec == frame.RAW and not verify:
                self._read_at(reader, path, HEADER + start, target)
                return target
            whole = self._read_payload(reader, path, header)
        if verify:
            self._verify_content(digest, whole, path, check)
        target[:] = whole[start:end]
        return target

    def read_recipe(
        self,
        recipe: Recipe,
        *,
        out: Any = None,
        start: int = 0,
        end: int | None = None,
        verify: bool = True,
        full: bool = False,
        workers: int = 1,
    ) -> np.ndarray[Any, Any]:
        """Bytes ``[start, end)`` (all by default) of the content a :class:`Recipe` describes,
        into ``out`` when given; only the chunks holding them are read. ``verify`` checks every
        chunk read (whole chunks are read then) against the recipe's XXH3-64 checks, or, where
        it has none or ``full``, against its digest (BLAKE3: 5-8x slower). A patched recipe's
        base is read, each patch applied (read whole, checked against its own XXH3-64 or, with
        ``full``, its name), and with ``verify`` the result checked against ``checks``."""
        if recipe.algorithm != self.algorithm:
            raise IncompatibleCheckpointError(
                f"a {recipe.algorithm} recipe cannot name blobs of the {self.algorithm} store "
                f"{self.url()}",
                path=self.url(),
            )
        end = recipe.size if end is None else end
        if not 0 <= start <= end <= recipe.size:
            raise ValueError(f"range [{start}, {end}) outside {recipe.size} bytes")
        target = (
            _empty(end - start, "a tensor's blobs", self.url())
            if out is None
            else _out_array(out, end - start)
        )
        if recipe.patches:
            return self._read_patched(recipe, target, start, end, verify, full, workers)
        checks: Sequence[str | None] = (
            recipe.checks if recipe.checks and not full else [None] * len(recipe.digests)
        )
        jobs = [
            (d, s, e, c)
            for (d, s, e), c in zip(recipe.spans(), checks)
            if e > start and s < end  # overlaps
        ]

        def one(job: tuple[str, int, int, str | None]) -> None:
            d, s, e, c = job
            lo, hi = max(s, start), min(e, end)
            dst = target[lo - start : hi - start]
            if lo == s and hi == e:
                self.read(d, size=e - s, out=dst, verify=verify, check=c)
            else:
                self.read_range(d, lo - s, hi - s, size=e - s, out=dst, verify=verify, check=c)

        if workers > 1 and len(jobs) > 1:
            with concurrent.futures.ThreadPoolExecutor(min(workers, len(jobs))) as pool:
                list(pool.map(one, jobs))
        else:
            for job in jobs:
                one(job)
        return target

    def _read_patched(
        self,
        recipe: Recipe,
        target: np.ndarray[Any, Any],
        start: int,
        end: int,
        verify: bool,
        full: bool,
        workers: int,
    ) -> np.ndarray[Any, Any]:
        """:meth:`read_recipe` of a patched recipe into ``target`` (bytes ``[start, end)``):
        checked, the whole chunks holding the range (:meth:`_patched_checked`); unchecked, the
        base's bytes of the range. Either way the patches are then read and applied one at a
        time (:meth:`_apply_patches`), so the memory a read holds is ``target`` (plus, for a
        range that does not start and end on chunk boundaries, the chunks holding it) and one
        patch, however many patches the recipe names."""
        if verify:
            chunk = recipe.chunk
            lo = start // chunk * chunk
            hi = min(-(-end // chunk) * chunk, recipe.size)
            work = target
            if (lo, hi) != (start, end):
                work = _empty(hi - lo, "the chunks of a patched tensor", self.url())
            self._patched_checked(recipe, work, lo // chunk, -(-hi // chunk), full, workers)
        else:
            lo, hi, work = start, end, target
            base = recipe.base()
            self.read_recipe(base, out=work, start=lo, end=hi, verify=False, workers=workers)
            self._apply_patches(recipe, work, lo, hi, verify=full, full=full)
        if work is not target:
            target[:] = work[start - lo : end - lo]
        return target

    def _patched_checked(
        self,
        recipe: Recipe,
        work: np.ndarray[Any, Any],
        first: int,
        last: int,
        full: bool,
        workers: int = 1,
    ) -> None:
        """Chunks ``[first, last)`` of a patched recipe's content into ``work`` (exactly those
        chunks' bytes), checked: each base chunk against its XXH3-64 (and, with ``full``, its
        name), then each patch read, checked and applied in turn, then each chunk of the result
        against the recipe's checks."""
        chunk = recipe.chunk
        lo, hi = first * chunk, min(last * chunk, recipe.size)
        base = recipe.base()
        self.read_recipe(base, out=work, start=lo, end=hi, verify=True, full=full, workers=workers)
        if full:  # checked against the names above; the XXH3-64 too, as verify_recipe does
            for i in range(first, last):
                s = i * chunk - lo
                part = work[s : min(s + chunk, hi - lo)]
                self._verify_content(
                    base.digests[i], part, self.path(base.digests[i]), base.checks[i]
                )
        self._apply_patches(recipe, work, lo, hi, verify=True, full=full)
        for i in range(first, last):
            s = i * chunk - lo
            part = work[s : min(s + chunk, hi - lo)]
            if _checksum.digest(part) != recipe.checks[i]:
                raise CorruptCheckpointError(
                    f"blobs of {self.url()}: chunk {i} of a patched tensor does not match its "
                    "checksum once its patches are applied (corrupt)",
                    path=self.url(),
                )

    def _apply_patches(
        self,
        recipe: Recipe,
        work: np.ndarray[Any, Any],
        lo: int,
        hi: int,
        *,
        verify: bool,
        full: bool,
    ) -> None:
        """Apply every patch of ``recipe``, in order, to ``work`` (content bytes ``[lo, hi)``):
        each read whole (checked, with ``verify``, against its XXH3-64 and, with ``full``, its
        name), applied, and dropped before the next is read. A patch naming the blob the one
        before it named is not read again."""
        from savepoint.blobs.patch import apply_patch

        held: np.ndarray[Any, Any] | None = None
        held_as: tuple[str, int, str] | None = None  # (blob, size, check) of ``held``
        for p in recipe.patches:
            size = p.content_size(recipe.size)
            if held_as is None or held_as[:2] != (p.blob, size):
                held = held_as = None  # the previous content goes before the next is read
                held = self._patch_content(recipe, p, verify=verify, full=full)
                held_as = (p.blob, size, p.check)
            elif verify and held_as[2] != p.check:
                self._verify_content(p.blob, held, self.path(p.blob), p.check)
            assert held is not None
            apply_patch(held, p, recipe.size, work, lo, hi, shown=self.url(self.path(p.blob)))

    def _patch_content(
        self, recipe: Recipe, p: Patch, *, verify: bool, full: bool
    ) -> np.ndarray[Any, Any]:
        """A patch's content: checked (``verify``) against its XXH3-64, and (``full``) its
        name."""
        size = p.content_size(recipe.size)
        if not verify:
            return self.read(p.blob, size=size, verify=full)
        content = self.read(p.blob, size=size, verify=True, check=p.check)
        if full:
            self._verify_content(p.blob, content, self.path(p.blob))
        return content

    def verify(self, digest: str, *, size: int | None = None) -> None:
        """Read blob ``digest`` whole and check it against its name; CorruptCheckpointError
        (missing, truncated, damaged header, wrong content) otherwise."""
        self.read(digest, size=size, verify=True)

    def verify_recipe(self, recipe: Recipe) -> None:
        """Every blob of ``recipe`` against its digest, and its XXH3-64 check where it has one;
        a patched recipe's result against its checks too."""
        if recipe.patches:
            self._verify_patched(recipe)
            return
        checks: Sequence[str | None] = recipe.checks or [None] * len(recipe.digests)
        for (d, s, e), c in zip(recipe.spans(), checks):
            content = self.read(d, size=e - s, verify=True)
            if c is not None:
                self._verify_content(d, content, self.path(d), c)

    def _verify_patched(self, recipe: Recipe) -> None:
        """:meth:`verify_recipe` of a patched recipe: each patch and each base chunk against
        its name and its XXH3-64, and each chunk of the result against ``checks``; one read of
        every blob. In memory: the patches and one chunk, where the patches' contents add up to
        at most the tensor (:meth:`patches_in_memory`: every chain a writer makes); otherwise
        the whole tensor and one patch (the patches applied one at a time)."""
        if not self.patches_in_memory(recipe):
            work = _empty(recipe.size, "a patched tensor", self.url())
            self._patched_checked(recipe, work, 0, len(recipe.digests), full=True)
            return
        patches = self.patch_contents(recipe, full=True)
        buf = _empty(min(recipe.chunk, recipe.size), "a chunk", self.url())
        for i in range(len(recipe.digests)):
            self.read_chunk(recipe, i, patches=patches, full=True, out=buf)

    @staticmethod
    def patches_in_memory(recipe: Recipe) -> bool:
        """Whether the contents of ``recipe``'s patches add up to at most its content size, so
        that holding them all (:meth:`patch_contents`, for :meth:`read_chunk`) stays within the
        tensor's own size. A writer's chains always do (``BlobPolicy.patch_budget``, at most
        1); a forged recipe naming a big patch 1,024 times does not, and its readers apply the
        patches one at a time instead."""
        return recipe.patch_bytes() <= recipe.size

    def patch_contents(self, recipe: Recipe, *, full: bool = False) -> list[np.ndarray[Any, Any]]:
        """The content of every patch of ``recipe``, in order, each checked against its XXH3-64
        and, with ``full``, its name (for :meth:`read_chunk`). A blob named by several patches
        is read once. Holds them all: callers check :meth:`patches_in_memory` first."""
        out = []
        seen: dict[tuple[str, int], tuple[str, np.ndarray[Any, Any]]] = {}
        for p in recipe.patches:
            key = (p.blob, p.content_size(recipe.size))
            found = seen.get(key)
            if found is None:
                found = seen[key] = (
                    p.check,
                    self._patch_content(recipe, p, verify=True, full=full),
                )
            elif found[0] != p.check:
                self._verify_content(p.blob, found[1], self.path(p.blob), p.check)
            out.append(found[1])
        return out

    def read_chunk(
        self,
        recipe: Recipe,
        index: int,
        *,
        patches: Sequence[np.ndarray[Any, Any]] | None = None,
        full: bool = False,
        out: np.ndarray[Any, Any] | None = None,
    ) -> np.ndarray[Any, Any]:
        """Chunk ``index`` of the content ``recipe`` describes, checked: its blob against its
        XXH3-64 (and, with ``full``, its name); for a patched recipe, the base chunk so, the
        patches applied (``patches``: :meth:`patch_contents`; when None, each read and applied
        in turn) and the result against the chunk's check. Into ``out`` (at least a chunk) when
        given."""
        from savepoint.blobs.patch import apply_patch

        d, s = recipe.digests[index], index * recipe.chunk
        e = min(s + recipe.chunk, recipe.size)
        part = (
            _empty(e - s, "a chunk", self.url()) if out is None else _out_array(out[: e - s], e - s)
        )
        if recipe.patches and patches is None:
            self._patched_checked(recipe, part, index, index + 1, full)
            return part
        checks = recipe.base_checks if recipe.patches else recipe.checks
        check = checks[index] if checks else None
        self.read(d, size=e - s, out=part, verify=True, check=check)
        if full and check is not None:
            self._verify_content(d, part, self.path(d))
        if not recipe.patches:
            return part
        assert patches is not None
        for p, content in zip(recipe.patches, patches):
            apply_patch(content, p, recipe.size, part, s, e, shown=self.url(self.path(p.blob)))
        if _checksum.digest(part) != recipe.checks[index]:
            raise CorruptCheckpointError(
                f"blobs of {self.url()}: chunk {index} of a patched tensor does not match its "
                "checksum once its patches are applied (corrupt)",
                path=self.url(),
            )
        return part

    def info(self, digest: str) -> BlobInfo:
        path = self.path(digest)
        st = self.store.stat(path)
        with self._reader(path) as reader:
            header = self._header(reader, path, None)
        codec = "raw" if header.codec == frame.RAW else "zstd"
        return BlobInfo(
            digest, codec, header.raw_size, HEADER + header.stored_size, st.mtime if st else 0.0
        )

    # -- listing and deleting --------------------------------------------------------------------

    def _fanouts(self) -> list[str]:
        return [
            name
            for name in self.store.list(self.data_root)
            if len(name) == 2 and all(c in "0123456789abcdef" for c in name)
        ]

    def entries(self) -> Iterator[tuple[str, str]]:
        """``(name, path)`` of every entry under ``data/``: blobs, and leftover temporaries
        (names with ``.tmp-``)."""
        for fan in self._fanouts():
            folder = self.store.join(self.data_root, fan)
            for name in self.store.list(folder):
                yield name, self.store.join(folder, name)

    def list(self) -> Iterator[str]:
        """The digest of every blob in the store (names only: one listing per fan-out
        directory, no per-blob request)."""
        for name, _path in self.entries():
            if _digest.is_digest(self.algorithm, name):
                yield name

    def delete(self, digest: str) -> bool:
        """Remove blob ``digest``; False if it was not there. Only :mod:`savepoint.blobs.gc`
        should call this on a store that saves are using (see its protocol)."""
        path = self.path(digest)
        try:
            self.store.remove(path)
        except FileNotFoundError:
            return False
        with self._lock:
            self._dirty.add(self.store.parent(path))
        return True

    def scrub(self, digests: Iterable[str]) -> Sequence[str]:
        """Read each blob of ``digests`` and check it against its name; delete those that are
        damaged (content, size or header wrong), so the next save that has their content
        writes them again instead of naming a damaged blob (a save trusts a blob found at its
        name). Missing ones are skipped. Returns the digests deleted. For the run's writer,
        after a checkpoint failed to verify: a damaged blob is useless to every checkpoint."""
        removed: Sequence[str] = ()
        for d in dict.fromkeys(digests):
            try:
                self.read(d, verify=True)
            except CorruptCheckpointError:
                if self.exists(d) and self.delete(d):
                    removed = (*removed, d)
        if removed:
            self.sync()
        return removed

    def copy_from(
        self,
        source: BlobStore,
        digests: Iterable[str],
        *,
        compression: Compression | None = None,
        stats: PutStats | None = None,
    ) -> PutStats:
        """Copy the blobs ``digests`` of ``source`` that this store lacks (a tier's copy-up, a
        run branched into a store of its own), each read and verified, then put (re-encoded by
        ``compression``). Call within a session of this store when saves or collections may run
        here."""
        stats = stats if stats is not None else PutStats()
        for d in dict.fromkeys(digests):
            if self.exists(d):
                stats.add(PutResult(d, 0, False, 0))
                continue
            content = source.read(d, verify=True)
            self.put(content, digest=d, compression=compression, stats=stats)
        return stats

    def copy_stored(
        self,
        source: BlobStore,
        digest: str,
        *,
        size: int | None = None,
        check: str | None = None,
        full: bool = True,
    ) -> PutResult:
        """Copy blob ``digest`` of ``source`` here as it is stored there (header and payload: a
        compressed blob stays compressed), unless this store has it already. It is checked on
        the way, before anything is written: its header (``size``: the content size a recipe
        expects), its content against ``check`` (its XXH3-64, from a recipe) and, with ``full``,
        against its name; CorruptCheckpointError otherwise. Call within a session of this store
        when saves or collections may run here (:func:`savepoint.copy` does)."""
        if source.algorithm != self.algorithm:
            raise IncompatibleCheckpointError(
                f"cannot copy {source.algorithm} blobs of {source.url()} into the "
                f"{self.algorithm} store {self.url()}",
                path=self.url(),
            )
        path = self.path(digest)
        src_path = source.path(digest)
        try:
            if size is not None and self._present(path, size):
                return PutResult(digest, size, False, 0)
            with source._reader(src_path) as reader:
                header = source._header(reader, src_path, size)
                stored = _empty(HEADER + header.stored_size, "a blob", source.url(src_path))
                source._read_at(reader, src_path, 0, stored)
            shown = source.url(src_path)
            header = frame.parse_header(
                stored[:HEADER].tobytes(), shown=shown, blob_size=len(stored), expect_size=size
            )
            if size is None and self._present(path, header.raw_size):
                return PutResult(digest, header.raw_size, False, 0)
            if header.codec == frame.RAW:
                content = stored[HEADER:]
            else:
                frame.check_frame(header, stored[HEADER:], shown=shown)
                content = _empty(header.raw_size, "a blob's content", shown)
                frame.decode(header, stored[HEADER:], content, shown=shown)
            if check is not None:
                source._verify_content(digest, content, src_path, check)
            if full or check is None:
                source._verify_content(digest, content, src_path)
            del content
            written = self._publish(path, stored[:HEADER].tobytes(), stored[HEADER:], len(stored))
        except OSError as exc:
            if isinstance(exc, CheckpointError):
                raise
            raise CheckpointWriteError(
                f"cannot copy blob {source.url(src_path)} to {self.url(path)}: {exc}",
                path=self.url(path),
                errno=exc.errno,
            ) from exc
        return PutResult(digest, header.raw_size, written, len(stored) if written else 0)

    # -- saves and collection ----------------------------------------------------------------------

    def session(self, **kwargs: Any) -> SaveSession:
        """A :class:`~savepoint.blobs.gc.SaveSession`, begun (use it as a context manager)."""
        from savepoint.blobs.gc import SaveSession

        return SaveSession(self, **kwargs).begin()

    def collect(
        self, referenced: Callable[[], Iterable[str]] | Iterable[str], **kwargs: Any
    ) -> BlobGcReport:
        """:func:`savepoint.blobs.gc.collect` on this store."""
        from savepoint.blobs.gc import collect

        return collect(self, referenced, **kwargs)


def _whole_when_visible(store: Store) -> bool:
    """Whether a blob found at its name is whole on ``store``: where blobs are renamed into
    place (atomic rename) or published at ``finish`` (memory, object stores). Not on fsspec
    filesystems, where a writer may show a partial file. (The storage protocol has no flag for
    this yet: ``Capabilities.atomic_create`` would be it.)"""
    inner: Any = store
    while hasattr(inner, "inner"):  # savepoint.storage.faults.FaultyStore and similar wrappers
        inner = inner.inner
    return not type(inner).__module__.endswith("fsspecstore")


class _Open:
    """A blob reader as a context manager."""

    def __init__(self, reader: Any) -> None:
        self.reader = reader

    def __enter__(self) -> Any:
        return self.reader

    def __exit__(self, *exc: object) -> None:
        self.reader.close()


def referenced_by(recipes: Iterable[Recipe]) -> set[str]:
    """Every digest the given recipes name."""
    out: set[str] = set()
    for recipe in recipes:
        out.update(recipe.names())
    return out
