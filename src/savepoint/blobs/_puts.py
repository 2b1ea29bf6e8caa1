"""The blob store's puts: a blob written under its name unless it is there already, chunked
content, blobs copied from another store, and the directory syncs that make them durable (a mixin
of :class:`savepoint.blobs.store.BlobStore`; see ``store.py``'s docstring)."""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from savepoint import errors_map
from savepoint.blobs import digest as _digest
from savepoint.blobs import frame
from savepoint.blobs._base import (
    DEFAULT_CHUNK,
    MIN_CHUNK,
    TMP,
    BlobBase,
    PutResult,
    PutStats,
    bytes_view,
    empty,
)
from savepoint.blobs.frame import HEADER, Compression
from savepoint.codecs import checksum as _checksum
from savepoint.codecs.recipe import MAX_CHUNK, Recipe
from savepoint.errors import CheckpointError, IncompatibleCheckpointError

if TYPE_CHECKING:
    from savepoint.blobs.store import BlobStore

__all__ = ["Puts"]


class Puts(BlobBase):
    """Writing blobs (see :class:`savepoint.blobs.store.BlobStore`)."""

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
        view, own_itemsize = bytes_view(data)
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
            raise errors_map.write_error(
                exc, self.url(path), f"cannot write blob {self.url(path)}", scheme=self.store.scheme
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
            raise errors_map.write_error(
                exc,
                self.url(),
                f"cannot make the blobs of {self.url()} durable",
                scheme=self.store.scheme,
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
        view, own_itemsize = bytes_view(data)
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
                stored = empty(HEADER + header.stored_size, "a blob", source.url(src_path))
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
                content = empty(header.raw_size, "a blob's content", shown)
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
            raise errors_map.write_error(
                exc,
                self.url(path),
                f"cannot copy blob {source.url(src_path)} to {self.url(path)}",
                scheme=self.store.scheme,
            ) from exc
        return PutResult(digest, header.raw_size, written, len(stored) if written else 0)
