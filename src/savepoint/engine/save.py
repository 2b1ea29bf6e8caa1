"""The one writer of savepoint's format: a save in four named steps, on one screen.

:func:`write` is every unsharded save below the facade, in the shape of DCP's
``state_dict_saver`` (plan, write, manifest, commit):

1. **plan**: the caller builds the save's sinks (:mod:`savepoint.engine.sinks`) from
   descriptions alone, before any file is created: which tensor goes into which file at which
   offset (:mod:`savepoint.engine.plan`), which go to the blob store;
2. **write**: a :class:`~savepoint.commit.transaction.Transaction` is opened on the target and
   each sink writes its bytes, taken from its source (live tensors, a staged arena), into the
   staging directory or the blob store;
3. **manifest**: one builder (:func:`new_manifest`) from what the sinks wrote;
4. **commit**: :func:`commit`, the one commit point of the format (a sharded save's rank 0
   calls it too): the manifest encoded, what the sinks wrote elsewhere sealed, then
   ``Transaction.commit`` (manifest last, the data files' fsyncs waited for, published).

The configurations:

| call | plan | byte source | sinks |
|---|---|---|---|
| :func:`save_flat` (``sp.save``) | ``lay_out`` | live tensors | ``LayoutFiles`` |
| :func:`save_staged` (``AsyncCheckpointer``) | the arena's | file images | ``ImageFiles`` |
| :func:`save_blobs` (``blobs=``) | the blob policy, ``plan_files`` | live tensors or the arena | ``BlobTensors`` + ``PlannedFiles`` |
| ``distributed/save.py`` (``process_group=``) | merged across ranks | each rank's pieces | per rank: ``put_pieces`` + ``write_pieces``; rank 0: :func:`new_manifest`, :func:`commit` |
| ``integrations/dcp.py`` (DCP's ``StorageWriter``) | DCP's planner | each rank's chunks | per rank: ``write_files``; the coordinator: :func:`new_manifest`, :func:`commit` |
| ``transfer.py`` (``sp.copy``) | the source's manifest | the source's data files and blobs | streamed files; :func:`commit` of the source's manifest bytes (``encoded=``), the blob session sealed; ``materialize=True``: :func:`new_manifest` with the source's ``created`` |

No other module builds a ``Manifest`` to commit. Two kinds of ``Transaction.commit`` stay
outside :func:`commit`, because they write nothing of savepoint's format:

- the run aliases (``runs/aliases.py``: ``latest/``, ``best/``, and ``put_back``, which
  republishes a checkpoint a failed save of its step set aside) publish the files of a
  checkpoint that :func:`commit` already committed: hard links to them (copies where the store
  has none or a link is refused), its ``manifest.json`` among them. Under the rename strategy
  the manifest is linked into the staging directory with the rest and the commit carries no
  bytes at all (``tx.commit(None)``); only under the manifest-last strategy (stores without
  rename) are the step's manifest bytes read back and committed unchanged. :func:`commit`
  would have nothing to do there: no manifest to encode or check (the bytes are the step's,
  checked when it committed), no sink to seal, no data file's fsync to wait for (the linked
  files are durable), and handing it a ``Manifest`` would cost a parse of the step's whole
  tensor table at every alias update of every managed save. (On stores without hard links an
  alias is a pointer object, ``commit/pointer.py``, put in one overwriting put: no
  transaction.)
- other systems' formats that are directories (``formats/_boostr_write.py``,
  ``formats/_files.py:atomic_directory`` for boostr and training artifacts) commit with
  ``tx.commit(None)``: they have no ``manifest.json``.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import logging
import time
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from savepoint._version import __version__
from savepoint.codecs import manifest as mf
from savepoint.commit.transaction import Transaction
from savepoint.engine import plan
from savepoint.engine.sinks import (
    BlobTensors,
    ImageFiles,
    LayoutFiles,
    PlannedFiles,
    Sink,
    Written,
)
from savepoint.errors import UnsupportedStateError
from savepoint.state import tree
from savepoint.storage.paths import Location

if TYPE_CHECKING:
    from savepoint.async_.staging import Staged
    from savepoint.blobs import BlobPolicy, FastMemo, SaveSession
    from savepoint.blobs.patch import PatchTracker

__all__ = [
    "Seal",
    "byte_counter",
    "check_metadata",
    "commit",
    "has_shards",
    "new_manifest",
    "save_blobs",
    "save_flat",
    "save_staged",
    "write",
    "writer_version",
]

Progress = Callable[[int, int], None]

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


def byte_counter(total: int, progress: Progress | None) -> Callable[[int], None]:
    """A callback taking the bytes just written, reporting ``progress(done, total)``."""
    done = 0

    def on_bytes(n: int) -> None:
        nonlocal done
        done += n
        if progress is not None:
            progress(min(done, total), total)

    return on_bytes


# ---------------------------------------------------------------------------------------------
# the writer
# ---------------------------------------------------------------------------------------------


def write(
    location: Location,
    state: tree.Node | tree.Flat,
    metadata: dict[str, Any],
    sinks: Sequence[Sink],
    *,
    order: Sequence[str] | None = None,
) -> tuple[str, mf.Manifest, int]:
    """Steps 2 to 4 of a save whose plan is ``sinks`` (step 1, see the module docstring);
    return the directory committed, its manifest and the manifest's size in bytes. ``state``:
    the state's tree, or the flattened state itself where the save owns it and its tree is to
    be kept compressed while the manifest is built (see :class:`_Tree`). ``order``: the state's
    tensor order, where several sinks' records are merged."""
    text = _Tree(state)
    del state  # (a streamed tree is dropped in step 3: nothing here may keep it)
    durable: list[Callable[[], None]] = []  # the data files' fsyncs, on the finishing pool
    with Transaction(location.store, location.path) as tx, _waiting(durable):
        staging = Location(tx.store, tx.staging)
        written = [sink.write(staging, durable) for sink in sinks]  # 2. write
        manifest = new_manifest(text.open(), written, metadata, order=order)  # 3. manifest
        directory, size = commit(tx, manifest, durable=durable, seal=sinks, text=text)  # 4.
    for sink in sinks:
        sink.committed()
    return directory, manifest, size


def new_manifest(
    tree_node: tree.Node,
    written: Sequence[Written],
    metadata: dict[str, Any],
    *,
    order: Sequence[str] | None = None,
    world_size: int | None = None,
    created: str | None = None,
) -> mf.Manifest:
    """The one manifest builder: the manifest naming what the sinks ``written`` wrote (their
    records merged in ``order`` where there are several), at the newest format version any of
    them needs; ``world_size``: the ranks of a sharded save; ``created``: the creation time
    where it is not now (a copy keeps its source's)."""
    if len(written) == 1:
        files, tensors = written[0].files, written[0].tensors
    else:
        files = {}
        merged: dict[str, mf.TensorRecord] = {}
        for part in written:
            files.update(part.files)
            merged.update(part.tensors)
        tensors = merged if order is None else {name: merged[name] for name in order}
    manifest = mf.Manifest(
        tree=tree_node,
        files=files,
        tensors=tensors,
        metadata=metadata,
        writer=writer_version(),
        created=created if created is not None else _now(),
        format_version=max(part.version for part in written),
        world_size=world_size,
    )
    for part in written:
        if part.blobs is not None:
            manifest.blob_store, manifest.blob_digest = part.blobs
    return manifest


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat().replace("+00:00", "Z")


class Seal(Protocol):
    """What :func:`commit` seals before it publishes (every :class:`Sink` is one)."""

    def seal(self) -> None: ...


def commit(
    tx: Transaction,
    manifest: mf.Manifest,
    *,
    durable: Sequence[Callable[[], None]] = (),
    seal: Sequence[Seal] = (),
    text: _Tree | None = None,
    encoded: bytes | None = None,
) -> tuple[str, int]:
    """Step 4, the one commit point of savepoint's format: ``manifest`` encoded (UnsupportedStateError
    when readers would refuse it, before anything is sealed), what the sinks ``seal`` wrote
    outside the staging directory made durable and checked, then ``tx`` committed (the
    manifest written last, the fsyncs ``durable`` waited for, published). Returns the directory
    committed and the manifest's size. ``encoded``: the manifest's bytes, already encoded and
    committed unchanged (``sp.copy`` commits its source's, byte for byte)."""
    raw = mf.dump(manifest, None if text is None else text.pieces()) if encoded is None else encoded
    for sink in seal:
        sink.seal()
    directory = tx.commit(raw, durable=durable) if durable else tx.commit(raw)
    if text is not None and isinstance(raw, bytearray):
        text.keep(manifest, raw)
    return directory, len(raw)


class _Tree:
    """The manifest's tree member. Where the save owns a state of more than
    ``plan.STREAM_ENTRIES`` tensors (given as its Flat) the tree is made text, compressed (a
    million-tensor tree is 190 MB of dicts and 6 MB of compressed text), and the dicts dropped
    (``Flat.tree`` left empty) before the manifest is built; the manifest returned keeps the
    text (see ``Manifest.root``)."""

    def __init__(self, state: tree.Node | tree.Flat) -> None:
        self.state = state
        self.packed: list[tuple[bytes, int]] | None = None
        self.length = 0

    def open(self) -> tree.Node:
        """The tree to build the manifest with (empty where it is kept as text)."""
        flat = self.state
        if not isinstance(flat, tree.Flat):
            return flat
        self.packed = [(zlib.compress(p, 1), level) for p, level in mf.tree_pieces(flat.tree)]
        flat.tree = {}
        return {}

    def pieces(self) -> Iterator[tuple[bytes, int]] | None:
        """The tree's text for :func:`savepoint.codecs.manifest.dump` (None: from the manifest)."""
        return None if self.packed is None else self._unpack(self.packed)

    def _unpack(self, packed: list[tuple[bytes, int]]) -> Iterator[tuple[bytes, int]]:
        packed.reverse()
        while packed:
            piece, level = packed.pop()
            text = zlib.decompress(piece)
            self.length += len(text)
            yield text, level

    def keep(self, manifest: mf.Manifest, raw: bytearray) -> None:
        """The tree's text, from the manifest written, kept compressed by ``manifest``."""
        if self.packed is None:
            return
        end = len(raw) - mf.TRAILER_BYTES
        squeeze = zlib.compressobj(1)
        manifest.tree_packed = squeeze.compress(memoryview(raw)[end - self.length : end])
        manifest.tree_packed += squeeze.flush()


@contextlib.contextmanager
def _waiting(durable: list[Callable[[], None]]) -> Iterator[None]:
    """Wait for every deferred finish before leaving (a save that fails before its commit
    leaves no fsync thread behind)."""
    try:
        yield
    finally:
        for wait in durable:
            with contextlib.suppress(BaseException):
                wait()


# ---------------------------------------------------------------------------------------------
# the configurations
# ---------------------------------------------------------------------------------------------


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

    The files are laid out compactly (:class:`~savepoint.engine.sinks.LayoutFiles`), their
    records kept as columns and the manifest built once, in place
    (:func:`savepoint.codecs.manifest.dump`): a save of a million small tensors holds no Python
    object per tensor beyond the state's tree. ``release``: the caller owns ``flat`` and will
    not use its tensors again, so each source is dropped from ``flat.tensors`` as soon as it is
    copied (for a million small tensors the sources are about 150 MB), and a tree of more than
    ``plan.STREAM_ENTRIES`` tensors is kept compressed while the manifest is built
    (``flat.tree`` is then left empty; the manifest returned reads it back when asked:
    ``Manifest.root``)."""
    started = time.perf_counter()
    tensors = flat.tensors
    count = len(tensors)
    total = sum(s.nbytes for s in tensors.values())
    on_bytes = byte_counter(total, progress)
    files = LayoutFiles(
        tensors,
        max_file_bytes,
        writers=writers,
        direct=direct,
        progress=on_bytes if progress is not None else None,
        release=release,
    )
    state = flat if release and count > plan.STREAM_ENTRIES else flat.tree
    directory, manifest, size = write(location, state, metadata, [files])
    took = time.perf_counter() - started
    log.info(
        "saved %s: %d tensors, %d bytes (manifest %d) in %.3f s, %.1f MiB/s",
        location.store.url(directory),
        count,
        total,
        size,
        took,
        total / took / 2**20 if took > 0 else 0.0,
    )
    return directory, manifest


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
    images = ImageFiles(staged, writers=writers, direct=direct, progress=progress)
    directory, manifest, _ = write(location, staged.tree, metadata, [images])
    return directory, manifest


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
    names = list(tensors)
    in_blobs = [n for n in names if policy.wants(tensors[n].nbytes)]
    blob_set = set(in_blobs)
    rest = {n: tensors[n] for n in names if n not in blob_set}
    total = sum(s.nbytes for s in tensors.values())
    on_bytes = byte_counter(total, progress)
    patching = policy.patches and memo is not None and tracker is not None
    sinks: list[Sink] = [
        BlobTensors(
            location,
            tensors,
            in_blobs,
            session=session,
            policy=policy,
            memo=memo,
            tracker=tracker if patching else None,
            frozen=frozen,
            on_bytes=on_bytes,
        )
    ]
    if rest:
        sinks.append(
            PlannedFiles(
                plan.plan_files(rest, max_file_bytes),
                rest,
                writers=writers,
                direct=direct,
                progress=on_bytes if progress is not None else None,
            )
        )
    before = session.stats.bytes_written
    directory, manifest, _ = write(location, flat.tree, metadata, sinks, order=names)
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
