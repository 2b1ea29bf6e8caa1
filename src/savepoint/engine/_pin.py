"""Pin and re-read: the one generation of a checkpoint a reader holds (see :mod:`.read`).

:class:`Generation` owns everything a reader keeps open: the pinned directory, its parsed
manifest, the data files opened by :meth:`Generation.open` and those checked since
(:meth:`Generation.open_file`), and the blob store of a version 4 checkpoint once opened
(:mod:`._blobreads`). The read jobs (:mod:`._checks`, :mod:`._copies`, :mod:`._shards`,
:mod:`._blobreads`) are functions over it.

:meth:`Generation.open` pins, retrying only before pinning (up to :data:`ATTEMPTS` times) when
the generation vanished before it was pinned; :func:`rereading` starts a whole read again (up to
:data:`REREADS` times) when a store that keeps no bytes for open readers lost the generation
being read to a writer's replace. :func:`locate` finds the committed directory of a path.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from savepoint.codecs import checksum, safetensors
from savepoint.codecs import manifest as mf
from savepoint.commit import names
from savepoint.commit.transaction import resolve
from savepoint.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    IncompleteCheckpointError,
    ReplacedWhileReadingError,
)
from savepoint.storage import local
from savepoint.storage.base import BlobReader, PinnedContext, Store
from savepoint.storage.paths import Location

if TYPE_CHECKING:
    from savepoint.blobs import BlobStore

T = TypeVar("T")

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
                stacklevel=7,  # through locate, Generation._open_once/open, Reader.open
            )
            return found
        time.sleep(0.001)


def _parse_manifest(
    shown: str,
    raw: bytes,
    columns: bool = True,
    read_index: mf.ReadIndex | None = None,
    lazy: bool = False,
) -> mf.Manifest:
    try:
        manifest = mf.parse(raw, columns=columns, read_index=read_index, lazy=lazy)
        if isinstance(manifest.tensors, mf.GridTensors):
            manifest.tensors.where = shown  # how the errors of its later index reads name it
        return manifest
    except mf.ManifestVersionError as exc:
        raise IncompatibleCheckpointError(f"{shown}: {exc}", path=shown) from None
    except mf.ManifestError as exc:
        raise CorruptCheckpointError(f"{shown}/{mf.NAME}: {exc}", path=shown) from None


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


class DataFile:
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


class Generation:
    """One pinned generation of a committed checkpoint and what a reader has opened of it."""

    __slots__ = (
        "blob_store",
        "blobs",
        "copy_on_write",
        "files",
        "manifest",
        "path",
        "pinned",
        "shown",
        "source",
        "store",
    )

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
        self.pinned = pinned  # owned: closed with the generation
        self.copy_on_write = copy_on_write
        self.blobs = dict(blobs or {})  # owned: data files opened by ``open``, not yet checked
        self.files: dict[str, DataFile] = {}  # owned: data files checked by ``open_file``
        self.blob_store: BlobStore | None = None  # a version 4 checkpoint's, once opened

    @classmethod
    def open(
        cls,
        where: Location,
        copy_on_write: bool,
        needs: Needs | None,
        columns: bool,
        lazy: bool = False,
    ) -> Generation:
        """Open and pin one generation of the committed checkpoint at ``where``: see
        :meth:`savepoint.engine.read.Reader.open`."""
        for attempt in range(ATTEMPTS):
            try:
                return cls._open_once(where.store, where.path, copy_on_write, needs, columns, lazy)
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
        cls,
        store: Store,
        path: str,
        copy_on_write: bool,
        needs: Needs | None,
        columns: bool,
        lazy: bool = False,
    ) -> Generation:
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

            # A version 7 manifest's rank indexes, from the same pinned generation (``lazy``:
            # when a record needs them, while the generation is open).
            def read_index(name: str, size: int) -> bytes:
                return pinned.read_small(name, cap=size)

            manifest = _parse_manifest(shown, raw, columns, read_index, lazy)
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

    def close(self) -> None:
        for f in self.files.values():
            f.blob.close()
        self.files.clear()
        for blob in self.blobs.values():
            blob.close()
        self.blobs.clear()
        if self.pinned is not None:
            self.pinned.close()
            self.pinned = None

    def corrupt(self, message: str, key: str | None = None) -> CorruptCheckpointError:
        """A CorruptCheckpointError naming this checkpoint (and ``key``, the tensor)."""
        return CorruptCheckpointError(f"{self.shown}: {message}", path=self.shown, key=key)

    def open_blob(self, name: str) -> BlobReader:
        """Data file ``name``, unchecked: the one ``open`` opened (handed over once), else now."""
        blob = self.blobs.pop(name, None)
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
            raise self.corrupt(f"data file {name} is missing") from None

    def open_file(self, name: str, *, check_header: bool = True, view: bool = True) -> DataFile:
        """Data file ``name``, its size and header checked against the manifest (once).
        ``view=False``: no whole-file view is made (no mapping, no read-ahead into the page
        cache); its bytes are read with ``blob.read`` (a direct verify streams it itself)."""
        opened = self.files.get(name)
        if opened is not None:
            return opened
        record = self.manifest.files[name]
        blob = self.open_blob(name)
        try:
            size = blob.size
            if size != record.size:
                raise self.corrupt(
                    f"data file {name} is {size} bytes, {record.size} were committed (truncated "
                    "or overwritten)"
                )
            head = np.empty(record.header_size, dtype=np.uint8)
            try:
                blob.read(0, head)
            except EOFError:
                raise self.corrupt(f"data file {name} shrank while being read") from None
            raw = head.tobytes()
            try:
                n = safetensors.header_length(raw, size)
            except safetensors.HeaderError as exc:
                raise self.corrupt(f"data file {name}: {exc}") from None
            if n + 8 != record.header_size:
                raise self.corrupt(f"data file {name}: header length field is damaged")
            if check_header and checksum.digest(raw) != record.header_xxh3:
                raise self.corrupt(f"data file {name}: header checksum mismatch")
            opened = DataFile(blob, blob.view(0, size) if view else None)
        except BaseException:
            blob.close()
            raise
        self.files[name] = opened
        return opened

    def left_its_path(self) -> str | None:
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
