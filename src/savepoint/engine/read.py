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

The jobs live in the package's private modules, functions over the one small object that owns the
pinned generation (:class:`._pin.Generation`): pin and re-read (:mod:`._pin`: :func:`locate`,
:meth:`Reader.open`, :func:`rereading`), checks (:mod:`._checks`), whole copies (:mod:`._copies`:
:meth:`Reader.transfer`, :meth:`Reader.materialize`, the ranged reads of stores without views),
shard assembly (:mod:`._shards`) and blob reads (:mod:`._blobreads`). :class:`Reader` is their
face: the names the rest of the package imports are here.
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from savepoint.codecs import manifest as mf
from savepoint.codecs import safetensors
from savepoint.engine import _blobreads, _checks, _copies, _shards
from savepoint.engine._checks import SMALL
from savepoint.engine._pin import (
    ATTEMPTS,
    REREADS,
    DataFile,
    Generation,
    Needs,
    locate,
    rereading,
)
from savepoint.engine._shards import RegionCopy, ShardTask
from savepoint.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
)
from savepoint.storage.base import PinnedContext, Store
from savepoint.storage.paths import Location, PathArg
from savepoint.storage.paths import resolve as resolve_path

if TYPE_CHECKING:
    from savepoint.blobs import BlobStore

__all__ = [
    "ATTEMPTS",
    "Needs",
    "REREADS",
    "Reader",
    "RegionCopy",
    "SMALL",
    "ShardTask",
    "blob_digests",
    "files_of",
    "locate",
    "rereading",
]


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


_FILE_OF = operator.attrgetter("file")


class Reader:
    """Views the data files a load needs, once each, and hands out verified tensor bytes.

    It keeps one :class:`._pin.Generation` (the pinned directory, its manifest, the files opened
    of it) and hands each job to the module that does it."""

    __slots__ = ("copy_on_write", "generation", "manifest", "path", "shown", "source", "store")

    def __init__(self, generation: Generation) -> None:
        self.generation = generation  # owned: closed with the reader
        self.store: Store = generation.store
        self.path: str = generation.path  # where the checkpoint was found
        self.shown: str = generation.shown  # how messages name the checkpoint
        self.source: str = generation.source  # the path the caller asked for
        self.manifest: mf.Manifest = generation.manifest
        self.copy_on_write: bool = generation.copy_on_write

    @classmethod
    def open(
        cls,
        path: PathArg,
        *,
        copy_on_write: bool = False,
        needs: Needs | None = None,
        columns: bool = True,
        lazy_indexes: bool = False,
    ) -> Reader:
        """Open and pin one generation of the committed checkpoint at ``path`` (a local path,
        a URL or a Location).

        Its directory, its manifest and the data files ``needs(shown, manifest)`` names (by
        default every data file) are opened before this returns, so a concurrent replace or
        delete of ``path`` can neither take them away nor mix two checkpoints into one load (see
        the module docstring). ``needs`` may raise (a missing key, say); nothing stays open then.
        A needed file missing from a generation that is still in place is left unopened: reading
        it raises CorruptCheckpointError. ``columns``: see :func:`savepoint.codecs.manifest.parse`
        (a load passes False). ``lazy_indexes``: a version 7 manifest's index files are read when
        a record needs them (:mod:`savepoint.codecs.manifest._v7_lazy`: a resharding load reads
        those of the ranks whose pieces it reads), not all at open.
        """
        where = path if isinstance(path, Location) else resolve_path(path, what="checkpoint path")
        return cls(Generation.open(where, copy_on_write, needs, columns, lazy_indexes))

    @property
    def pinned(self) -> PinnedContext | None:
        """The pinned directory (None once closed)."""
        return self.generation.pinned

    @property
    def _files(self) -> dict[str, DataFile]:
        return self.generation.files

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.generation.close()

    def _corrupt(self, message: str, key: str | None = None) -> CorruptCheckpointError:
        return self.generation.corrupt(message, key)

    def open_file(self, name: str, *, check_header: bool = True) -> DataFile:
        """Data file ``name``, its size and header checked against the manifest (once)."""
        return self.generation.open_file(name, check_header=check_header)

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

    def file_range(self, ref: str) -> tuple[int, int] | None:
        """``(fd, offset)`` of tensor ``ref``'s bytes where they are one range of a local data
        file (the descriptor is this reader's: valid until it closes), else None."""
        rec = self.manifest.tensors[ref]
        if self.is_split(ref):
            return None
        fileno = getattr(self.open_file(rec.file).blob, "fileno", None)
        return None if fileno is None else (fileno(), rec.start)

    def prepare(self, refs: Iterable[str], *, check_header: bool = True) -> None:
        """Open, size-check and header-check every file holding ``refs``, before any allocation:
        a manifest that claims more data than the files hold fails here, not in ``np.empty``."""
        self.prepare_files(files_of(self.manifest, refs), check_header=check_header)

    def prepare_files(self, names: Iterable[str], *, check_header: bool = True) -> None:
        for name in sorted(names):
            self.generation.open_file(name, check_header=check_header)

    def is_split(self, ref: str) -> bool:
        """Whether ``ref`` is not one range of a data file (shards, or blobs)."""
        rec = self.manifest.tensors[ref]
        return rec.is_split or rec.recipe is not None

    def blob_store(self) -> BlobStore:
        """The blob store of a version 4 checkpoint (opened once; never created)."""
        return _blobreads.open_blob_store(self.generation)

    def blob_failure(
        self, exc: CorruptCheckpointError, ref: str, where: str = ""
    ) -> CheckpointError:
        """The error for a blob read of tensor ``ref`` that failed with ``exc``: see
        :func:`._blobreads.blob_failure` (a blob collected from a checkpoint deleted or replaced
        since it was pinned is not damage)."""
        return _blobreads.blob_failure(self.generation, exc, ref, where)

    def transfer(
        self,
        jobs: Sequence[tuple[str, np.ndarray[Any, Any] | None]],
        *,
        verify: bool = True,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        """Copy each ``(ref, dst)`` tensor into ``dst`` (uint8, exact length; None: check only),
        hashed as it is copied with ``verify``: see :func:`._copies.transfer`."""
        _copies.transfer(self.generation, jobs, verify=verify, progress=progress)

    def check_small(
        self,
        records: Iterable[tuple[str, mf.TensorRecord]] | mf.TensorTable,
        progress: Callable[[int], None] | None = None,
    ) -> list[str]:
        """Check the small tensors among ``(ref, record)`` (or a table) in one tight loop on this
        thread and return the refs of the others, for :meth:`transfer`: see
        :func:`._checks.check_small`."""
        return _checks.check_small(self.generation, records, progress)

    def materialize(
        self,
        found: dict[str, str],
        framework: str,
        *,
        verify: bool = True,
        progress: Callable[[int], None] | None = None,
    ) -> dict[str, Any]:
        """New arrays or tensors, made straight from their checked bytes, for the small tensors
        among ``found`` (ref -> kind) stored whole in files with a zero-copy view: see
        :func:`._copies.materialize`. Their files must be prepared (:meth:`prepare`)."""
        return _copies.materialize(
            self.generation, found, framework, verify=verify, progress=progress
        )

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
        work = _shards.shard_work(
            self.generation,
            tasks,
            verify=verify,
            progress=progress,
            lock=threading.Lock(),
            check_only=check_only,
        )
        _copies.run_work(work)

    def needed_span(self, ref: str, copies: Sequence[RegionCopy]) -> tuple[int, int]:
        """The byte range of a shard of ``ref`` that ``copies`` read (``(0, 0)``: none)."""
        return _shards.needed_span(self.generation, ref, copies)

    def checked_span(self, ref: str, index: int, span: tuple[int, int]) -> tuple[int, int]:
        """The byte range a verified read of ``span`` of shard ``index`` of ``ref`` reads and
        checks: the blocks holding it, or the whole shard where it has no block checksums."""
        return _shards.blocks_around(self.manifest.tensors[ref].layout()[index], span)

    def fill_jobs(
        self, targets: Iterable[tuple[str, Any]]
    ) -> tuple[list[tuple[str, np.ndarray[Any, Any] | None]], list[Callable[[], None]]]:
        """Jobs that read straight into each target, plus copies to run afterwards for targets
        that cannot be filled directly (device tensors, non-contiguous or read-only views)."""
        return _copies.fill_jobs(self.generation, targets)

    def allocate(self, ref: str, kind: str, framework: str, *, share_memory: bool = False) -> Any:
        """A new array or tensor shaped for ``ref``: empty, or (``share_memory``) a view of the
        file's bytes (copy-on-write: the reader was opened with ``copy_on_write``)."""
        return _copies.allocate(self.generation, ref, kind, framework, share_memory=share_memory)
