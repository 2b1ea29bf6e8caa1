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

The class is composed of one mixin per job over the state they share
(:class:`savepoint.blobs._base.BlobBase`: the store, the digest function, the directories to
sync, and a blob opened with its header checked): the puts (:mod:`savepoint.blobs._puts`), the
reads of a blob and of a recipe (:mod:`savepoint.blobs._reads`), and here the store's
configuration, its listing and deletion, its save sessions and collections. Mixins rather than
a composer over parts: callers hold one object (``blobs.read``, ``blobs.put_chunked``,
``blobs.session``), the parts call each other once per chunk on the hot path (a put checks the
header of a blob already at its name), and callers patch a method of ``BlobStore`` (``read``,
``copy_stored``) expecting the store's own calls to see it; forwarding methods would add a call
per chunk and hide those patches.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from savepoint import errors_map
from savepoint.blobs import digest as _digest
from savepoint.blobs._base import CONFIG as CONFIG
from savepoint.blobs._base import DATA as DATA
from savepoint.blobs._base import DEFAULT_CHUNK as DEFAULT_CHUNK
from savepoint.blobs._base import FORMAT as FORMAT
from savepoint.blobs._base import GC as GC
from savepoint.blobs._base import MIN_CHUNK as MIN_CHUNK
from savepoint.blobs._base import SESSIONS as SESSIONS
from savepoint.blobs._base import TMP as TMP
from savepoint.blobs._base import VERSION as VERSION
from savepoint.blobs._base import BlobInfo as BlobInfo
from savepoint.blobs._base import MissingBlobError as MissingBlobError
from savepoint.blobs._base import PutResult as PutResult
from savepoint.blobs._base import PutStats as PutStats
from savepoint.blobs._base import whole_when_visible
from savepoint.blobs._puts import Puts
from savepoint.blobs._reads import RecipeReads
from savepoint.codecs import bounded_json
from savepoint.codecs.recipe import MAX_CHUNK as MAX_CHUNK
from savepoint.codecs.recipe import Recipe as Recipe
from savepoint.errors import (
    CheckpointError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
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

_CONFIG_CAP = 64 << 10


class BlobStore(Puts, RecipeReads):
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
        self._dirty = set()
        self._lock = threading.Lock()
        self._whole_when_visible = whole_when_visible(store)

    @classmethod
    def open(cls, where: PathArg | Location, **kwargs: Any) -> BlobStore:
        """The blob store at a path or URL (``/runs/a/blobs``, ``s3://bucket/run/blobs``)."""
        from savepoint.storage.paths import resolve

        location = resolve(where, what="blob store")
        return cls(location.store, location.path, **kwargs)

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
                raise errors_map.write_error(
                    exc,
                    self.url(),
                    f"cannot create the blob store {self.url()}",
                    scheme=self.store.scheme,
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


def referenced_by(recipes: Iterable[Recipe]) -> set[str]:
    """Every digest the given recipes name."""
    out: set[str] = set()
    for recipe in recipes:
        out.update(recipe.names())
    return out
