"""What every part of the blob store shares: the names of its layout, the records its puts
return, and a blob opened and its header checked.

:class:`savepoint.blobs.store.BlobStore` is composed of one class per job, each a mixin over
:class:`BlobBase` (which declares the state they share, set by ``BlobStore.__init__``): the puts
(:mod:`savepoint.blobs._puts`), the reads of one blob and of a recipe's chunks and patches
(:mod:`savepoint.blobs._reads`), and in ``store.py`` itself the configuration, listing, deletion,
save sessions and collections. See ``store.py``'s docstring for the layout and why mixins.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from savepoint.blobs import digest as _digest
from savepoint.blobs import frame
from savepoint.blobs.frame import HEADER
from savepoint.codecs import checksum as _checksum
from savepoint.codecs.recipe import MAX_CHUNK
from savepoint.errors import (
    CheckpointMemoryError,
    CorruptCheckpointError,
    ReplacedWhileReadingError,
)
from savepoint.storage.base import read_error

if TYPE_CHECKING:
    from savepoint.storage.base import Store

__all__ = [
    "BlobBase",
    "BlobInfo",
    "CONFIG",
    "DATA",
    "DEFAULT_CHUNK",
    "FORMAT",
    "GC",
    "MIN_CHUNK",
    "MissingBlobError",
    "Opened",
    "PutResult",
    "PutStats",
    "SESSIONS",
    "TMP",
    "VERSION",
    "bytes_view",
    "empty",
    "out_array",
    "whole_when_visible",
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


class MissingBlobError(CorruptCheckpointError):
    """A blob is not in the store (``digest`` names it): deleted, or never written. Still a
    CorruptCheckpointError, as for any damaged checkpoint; a reader tells a checkpoint whose
    blobs a collection took *after a writer deleted it* (not damage) from one that lost a blob
    while it still exists (see :meth:`savepoint.engine.read.Reader.blob_failure`)."""

    def __init__(self, message: str, *, path: str, digest: str) -> None:
        super().__init__(message, path=path)
        self.digest = digest


def empty(n: int, what: str, shown: str) -> np.ndarray[Any, Any]:
    """``np.empty(n, uint8)``, or CheckpointMemoryError saying what it was for."""
    try:
        return np.empty(n, np.uint8)
    except MemoryError:
        raise CheckpointMemoryError(
            f"{shown}: cannot allocate {n} bytes for {what}; free memory and read again",
            path=shown,
        ) from None


def bytes_view(data: Any) -> tuple[memoryview, int]:
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


def out_array(out: Any, n: int) -> np.ndarray[Any, Any]:
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


def whole_when_visible(store: Store) -> bool:
    """Whether a blob found at its name is whole on ``store``: where blobs are renamed into
    place (atomic rename) or published at ``finish`` (memory, object stores). Not on fsspec
    filesystems, where a writer may show a partial file. (The storage protocol has no flag for
    this yet: ``Capabilities.atomic_create`` would be it.)"""
    inner: Any = store
    while hasattr(inner, "inner"):  # savepoint.storage.faults.FaultyStore and similar wrappers
        inner = inner.inner
    return not type(inner).__module__.endswith("fsspecstore")


class Opened:
    """A blob reader as a context manager."""

    def __init__(self, reader: Any) -> None:
        self.reader = reader

    def __enter__(self) -> Any:
        return self.reader

    def __exit__(self, *exc: object) -> None:
        self.reader.close()


class BlobBase:
    """The state every part of a :class:`~savepoint.blobs.store.BlobStore` shares (set by its
    ``__init__``), its names, and a blob opened with its header checked."""

    store: Store
    root: str
    data_root: str
    algorithm: str
    _hash: Callable[[Any], str]
    _hex: int
    _dirty: set[str]  # directories to sync before the blobs written are durable
    _lock: threading.Lock  # guards ``_dirty``
    _whole_when_visible: bool

    def url(self, path: str | None = None) -> str:
        return self.store.url(self.root if path is None else path)

    # -- names -----------------------------------------------------------------------------------

    def digest(self, data: Any) -> str:
        """The name ``data`` (any contiguous buffer) would have in this store."""
        return self._hash(bytes_view(data)[0])

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
        (see :mod:`savepoint.blobs.store`), but where the store cannot promise that (no rename, no
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

    # -- opening a blob --------------------------------------------------------------------------

    def _missing(self, path: str) -> MissingBlobError:
        return MissingBlobError(
            f"blob {self.url(path)} is missing (deleted while still referenced, or never "
            "written); the checkpoint that names it cannot be restored from this store",
            path=self.url(path),
            digest=self.store.basename(path),
        )

    def _reader(self, path: str) -> Opened:
        try:
            return Opened(self.store.open_blob(path))
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
