"""Save, load, verify and inspect one checkpoint: the public facade.

This module validates arguments, resolves every path argument to a store
(:func:`savepoint.storage.paths.resolve`: a local path, ``file://``, ``memory://`` or a
``Location``) and dispatches: unsharded saves and loads to the engine
(:mod:`savepoint.engine.save`, :mod:`savepoint.engine.load`), sharded ones to
:mod:`savepoint.distributed`. It describes checkpoints with :class:`CheckpointInfo`.

``save`` blocks until the checkpoint is committed: every data file and the manifest are durable
inside a staging directory, which is then published in one atomic step (on local disks a rename
or exchange and a synced parent; on stores without rename the manifest's create-only put, see
:mod:`savepoint.commit.transaction`). A crash at any moment leaves the previous checkpoint or the
new one, never a mixture. ``load`` trusts nothing it reads: the manifest is checked whole before
any data file is opened, and every tensor it returns has passed its checksum (unless
``verify=False``).

Readers never write, so they work on read-only media, and they may run while another process
saves over the same path: ``load``, ``verify`` and ``inspect`` pin one generation (its directory,
manifest and the data files they read are opened up front) and return exactly that checkpoint,
retrying on the new one if theirs vanished before it was pinned (see :mod:`savepoint.engine.read`).
A file they may not read raises CheckpointPermissionError naming it.

With ``process_group=...`` (or a state holding ``Shard``, ``FlatShard``, ``Partitioned`` or
DTensor leaves) ``save`` and ``load`` hand over to :mod:`savepoint.distributed`: sharded
checkpoints written by every rank at once and loadable on any number of ranks. That package sits
above this module and is imported only then, so unsharded saves and loads never touch it (nor torch).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from savepoint._arguments import check_path, guarded
from savepoint.engine import collector
from savepoint.engine import load as load_engine
from savepoint.engine import save as save_engine
from savepoint.engine.describe import describe
from savepoint.engine.read import Reader, rereading
from savepoint.errors import (
    CheckpointArgumentError,
    CheckpointError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    IncompleteCheckpointError,
    UnsupportedStateError,
)
from savepoint.info import CheckpointInfo, TensorInfo
from savepoint.options import (
    DEFAULT_MAX_FILE_BYTES,
    DEFAULT_WRITERS,
    Progress,
    SaveOptions,
    check_load,
)
from savepoint.state import tree
from savepoint.storage.paths import Location, PathArg
from savepoint.storage.paths import resolve as resolve_path

__all__ = [
    "CheckpointInfo",
    "DEFAULT_MAX_FILE_BYTES",
    "DEFAULT_WRITERS",
    "Framework",
    "PathLike",
    "Progress",
    "SaveOptions",
    "TensorInfo",
    "describe",
    "inspect",
    "load",
    "save",
    "save_flat",
    "save_incremental",
    "save_with",
    "verify",
]

PathLike = PathArg
_MEMO_LOCK = threading.Lock()
Framework = load_engine.Framework


# ---------------------------------------------------------------------------------------------
# save
# ---------------------------------------------------------------------------------------------


@guarded
def save(
    path: PathLike,
    state: Any,
    *,
    metadata: Mapping[str, Any] | None = None,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    writers: int = DEFAULT_WRITERS,
    direct: bool = True,
    progress: Progress | None = None,
    process_group: Any = None,
    timeout: float | None = None,
    blobs: Any = None,
    blob_policy: Any = None,
    frozen: Any = None,
) -> CheckpointInfo:
    """Save ``state`` to the directory ``path``, atomically and durably; return what was written.

    ``path`` is a local path, a ``file://`` or ``memory://`` URL, or a ``Location``
    (``store.at(path)``); other URL schemes are refused with UnsupportedStorageError before
    anything is created.

    ``state`` is a nested tree of dicts (str or int keys), lists and tuples whose leaves are numpy
    arrays or scalars, torch tensors (any device; copied to host a chunk at a time), jax arrays
    and pytrees (docs/jax.md), None, bool, int, float, str, bytes, and Stateful objects (anything
    with ``state_dict()`` and ``load_state_dict()``: modules, optimizers...), whose
    ``state_dict()`` is saved. A ``torch.compile``, DDP or DataParallel wrapper saves the keys of
    the model it wraps; a dataclass instance is saved as a plain dict of its fields (the class is
    not recorded). Tensors that are the same view of the same memory (tied weights) are stored once.

    ``metadata`` is a JSON-serialisable mapping stored verbatim in the manifest. Data is split into
    safetensors files of at most ``max_file_bytes`` (a bigger tensor gets a file of its own), which
    ``writers`` threads write concurrently; ``direct=False`` asks for buffered writes (plus fsync)
    even where O_DIRECT works. ``progress(done, total)`` is called as bytes are written.

    If ``path`` already holds a checkpoint it is replaced atomically. A directory at ``path`` that
    is neither empty nor a checkpoint is never touched: that is an error. On any failure (disk full,
    fsync error, an unsupported leaf) nothing at ``path`` changes and no temporary files remain.

    ``process_group`` (a ``torch.distributed`` group; call ``save`` on every rank of it): a sharded
    save. Each rank writes what it holds (a plain tensor is replicated: one rank writes it;
    ``sp.Shard``, ``sp.FlatShard``, ``sp.Partitioned`` and DTensor leaves describe parts), rank 0
    commits one manifest after every rank has finished its files; a failure anywhere raises
    DistributedCheckpointError on every rank naming it, after ``timeout`` seconds (each phase's
    deadline) at most for a rank that stopped answering. See ``docs/distributed.md``.

    ``blobs`` (a :class:`savepoint.blobs.BlobStore`, or its path or URL, on the same store as
    ``path`` and at most two levels above it): an incremental save (a version 4 checkpoint). The
    tensors ``blob_policy`` (a :class:`savepoint.blobs.BlobPolicy`; default: those of 1 MiB or
    more) wants are stored there as content-addressed chunks, written only when no earlier save
    wrote the same bytes; the others go into data files. See ``docs/blobs.md``. With
    ``process_group`` (or a state holding sharding descriptions) every rank puts the pieces it
    writes into that store, which must then be one all ranks see (a shared filesystem or an
    object store), named alike on every rank; see ``docs/distributed.md``. ``frozen`` (with
    ``blobs``, unsharded): key prefixes of tensors the caller says did not change since this
    process's last save of them into that store: their bytes are only sampled (see
    ``CheckpointManager(frozen=)``).

    A path named like a single file of another format (``*.safetensors``, ``*.pt``, ``*.pth``,
    ``*.bin``, ``*.shrew``, ``*.mpk``) is refused with CheckpointArgumentError naming that
    format's writer, unless it already holds a savepoint checkpoint (see docs/training-state.md,
    "Files of other formats"); so are ``sp.save(state, path)`` (torch.save's order) and
    torch.save's keywords.
    """
    check_path("sp.save", path, state)
    _refuse_file_name(path)
    if blobs is not None:
        return save_incremental(
            path,
            state,
            metadata,
            blobs,
            blob_policy,
            max_file_bytes,
            writers,
            direct,
            progress,
            process_group=process_group,
            timeout=timeout,
            frozen=frozen,
        )
    if blob_policy is not None or frozen is not None:
        raise ValueError("blob_policy and frozen are given without blobs=")
    options = SaveOptions(
        max_file_bytes=max_file_bytes,
        writers=writers,
        direct=direct,
        progress=progress,
        process_group=process_group,
        timeout=timeout,
    )
    return save_with(path, state, metadata, options, checked=True)


def save_with(
    path: PathLike,
    state: Any,
    metadata: Mapping[str, Any] | None,
    options: SaveOptions,
    *,
    checked: bool = False,
) -> CheckpointInfo:
    """``sp.save`` with its options as one :class:`SaveOptions` (the manager's: its fields
    ``sp.save`` takes no keyword for, ``grid``, included); ``checked``: the path was."""
    if not checked:
        check_path("sp.save", path, state)
        _refuse_file_name(path)
    location = resolve_path(path, what="checkpoint path")
    return _write(location, options, metadata, state=state, release=True)


def save_incremental(
    path: PathLike,
    state: Any,
    metadata: Mapping[str, Any] | None,
    blobs: Any,
    policy: Any,
    max_file_bytes: int,
    writers: int,
    direct: bool,
    progress: Progress | None,
    memo: Any = None,
    tracker: Any = None,
    *,
    process_group: Any = None,
    timeout: float | None = None,
    frozen: Any = None,
) -> CheckpointInfo:
    """``save(path, state, blobs=..., blob_policy=...)`` (an incremental save; the arguments
    positional), with ``memo``: the :class:`savepoint.blobs.FastMemo` to name unchanged chunks
    by (default: this process's, when the policy asks for one), and ``tracker``: the
    :class:`savepoint.blobs.patch.PatchTracker` that finds changed rows (default: this
    process's, when the policy asks for patches). ``CheckpointManager(..., incremental=True)``
    passes its own. With ``process_group``, or a state holding sharding descriptions, a sharded
    incremental save (:mod:`savepoint.distributed.save`). ``frozen``: key prefixes of tensors
    that did not change since this tracker's last save of them (their bytes are only sampled;
    see ``CheckpointManager(frozen=)``); unsharded saves only."""
    from savepoint.blobs import BlobPolicy, BlobStore

    store = blobs if isinstance(blobs, BlobStore) else BlobStore.open(blobs)
    policy = BlobPolicy() if policy is None else policy
    if not isinstance(policy, BlobPolicy):
        raise TypeError("blob_policy must be a savepoint.blobs.BlobPolicy")
    if memo is None and policy.memo:
        memo = _memo(store.algorithm)
    if tracker is None and policy.patches:
        tracker = _tracker()
    options = SaveOptions(  # checks them
        max_file_bytes=max_file_bytes,
        writers=writers,
        direct=direct,
        progress=progress,
        process_group=process_group,
        timeout=timeout,
    )
    location = resolve_path(path, what="checkpoint path")
    return _write(
        location,
        options,
        metadata,
        state=state,
        release=False,
        blobs=_Blobs(store, policy, memo, tracker),
        frozen=frozen,
    )


class _Blobs(NamedTuple):
    """What makes a save incremental: the blob store, its policy, the memo and the tracker."""

    store: Any
    policy: Any
    memo: Any
    tracker: Any


def _write(
    location: Location,
    options: SaveOptions,
    metadata: Any,
    *,
    state: Any = None,
    flat: tree.Flat | None = None,
    release: bool,
    blobs: _Blobs | None = None,
    frozen: Any = None,
) -> CheckpointInfo:
    """Every save of savepoint's format, routed: the one place that decides whether it is
    sharded (a process group, or a flattened state holding sharding descriptions: then
    :mod:`savepoint.distributed.save` writes it) or not (the engine's writer,
    :mod:`savepoint.engine.save`). ``flat``: the state already flattened and ``metadata``
    already checked (``save_flat``); otherwise ``state`` is flattened here. ``release``: see
    :func:`savepoint.engine.save.save_flat`. ``blobs``: an incremental save; ``frozen`` its key
    prefixes of unchanged tensors (unsharded only)."""
    grouped = options.process_group is not None
    if grouped and frozen is not None:
        raise UnsupportedStateError("frozen= is not supported for sharded saves")
    if grouped and flat is None:
        from savepoint.distributed import save as distributed_save

        return distributed_save.save(location, state, metadata, options, _sharded(blobs))
    with collector.paused():
        meta = metadata
        if flat is None:
            meta = save_engine.check_metadata(metadata)
            flat = tree.flatten(state)
        if grouped or save_engine.has_shards(flat.tree):
            from savepoint.distributed import save as distributed_save

            if frozen is not None:
                raise UnsupportedStateError("frozen= is not supported for sharded saves")
            return distributed_save.save_flat(location, flat, meta, options, _sharded(blobs))
        if blobs is None:
            directory, manifest = save_engine.save_flat(
                location,
                flat,
                meta,
                max_file_bytes=options.max_file_bytes,
                writers=options.writers,
                direct=options.direct,
                progress=options.progress,
                release=release,
            )
        else:
            with blobs.store.session() as session:
                directory, manifest = save_engine.save_blobs(
                    location,
                    flat,
                    meta,
                    session=session,
                    policy=blobs.policy,
                    memo=blobs.memo,
                    tracker=blobs.tracker,
                    frozen=None if frozen is None else _frozen_keys(frozen),
                    max_file_bytes=options.max_file_bytes,
                    writers=options.writers,
                    direct=options.direct,
                    progress=options.progress,
                )
        return describe(location.store.url(directory), manifest)


def _sharded(blobs: _Blobs | None) -> Any:
    """``blobs`` as a sharded save takes them (None: not incremental)."""
    if blobs is None:
        return None
    from savepoint.distributed import save as distributed_save

    return distributed_save.Incremental(blobs.store, blobs.policy, blobs.memo, blobs.tracker)


# Single-file formats sp.save would otherwise make a directory named like: what writes them.
_FILE_WRITERS = {
    ".safetensors": (
        "a safetensors file",
        "safetensors.torch.save_file(model.state_dict(), path) (the safetensors package), or "
        "save a checkpoint and export its weights: sp.save('ckpt', state); sp.export('ckpt', "
        "'{name}') (savepoint export)",
    ),
    ".pt": ("a torch.save file", "torch.save(state, path)"),
    ".pth": ("a torch.save file", "torch.save(state, path)"),
    ".bin": ("a torch.save file", "torch.save(state, path)"),
    ".shrew": (
        "a .shrew file",
        "savepoint.formats.shrew.save_tensors(path, tensors) (or save_training)",
    ),
    ".mpk": ("a burn record", "savepoint.formats.burn.save_record(path, tensors)"),
}


def _refuse_file_name(path: PathLike) -> None:
    """Refuse a target named like a single file of another format (``model.safetensors``):
    ``sp.save`` writes a checkpoint directory, which would carry that name. A path that holds a
    savepoint checkpoint already is taken as it is (one saved there by an earlier version)."""
    text = path.path if isinstance(path, Location) else os.fspath(path)
    suffix = os.path.splitext(text.rstrip("/"))[1].lower()
    known = _FILE_WRITERS.get(suffix)
    if known is None:
        return  # (the common case costs a string operation)
    from savepoint.commit.transaction import resolve as resolve_commit

    location = resolve_path(path, what="checkpoint path")
    store = location.store
    name = store.basename(location.path)
    if resolve_commit(store, location.path, strict=False) is not None:
        return
    what, writer = known
    raise CheckpointArgumentError(
        f"sp.save writes a savepoint checkpoint, which is a directory, and {location} names "
        f"{what}: refusing to make a directory of that name. To write {what}, use "
        f"{writer.format(name=name)}; to save a checkpoint, give a directory name without the "
        f"{suffix} suffix (sp.save('{name[: -len(suffix)] or 'ckpt'}', state)). sp.load reads "
        f"{what} as it is",
        path=str(location),
    )


_TRACKERS: list[Any] = []  # the PatchTracker of this process's sp.save(..., blobs=...) calls
_MEMOS: dict[str, Any] = {}  # digest algorithm -> the FastMemo of this process's sp.save calls
_MEMO_ENTRIES = 1 << 16  # 256 GiB of 4 MiB chunks named, about 15 MB of memo


def _frozen_keys(prefixes: Any) -> Any:
    from savepoint.blobs.patch import frozen_keys

    return frozen_keys(prefixes)


def _tracker() -> Any:
    """The process's :class:`savepoint.blobs.patch.PatchTracker` for ``sp.save(..., blobs=)``."""
    from savepoint.blobs.patch import PatchTracker

    with _MEMO_LOCK:
        if not _TRACKERS:
            _TRACKERS.append(PatchTracker())
        return _TRACKERS[0]


def _memo(algorithm: str) -> Any:
    """The process's :class:`savepoint.blobs.FastMemo` for stores of ``algorithm``: a second
    ``sp.save(..., blobs=...)`` of unchanged tensors names their chunks at XXH3 speed."""
    from savepoint.blobs import FastMemo

    with _MEMO_LOCK:
        memo = _MEMOS.get(algorithm)
        if memo is None:
            memo = _MEMOS[algorithm] = FastMemo(_MEMO_ENTRIES)
        return memo


def save_flat(
    path: PathLike,
    flat: tree.Flat,
    metadata: dict[str, Any],
    options: SaveOptions | None = None,
) -> CheckpointInfo:
    """``save`` for a state already flattened (``metadata`` already checked: see
    :func:`savepoint.engine.save.check_metadata`), written as ``options`` say (default: the
    defaults).

    With ``options.process_group``, or when the state holds sharding descriptions (``sp.Shard``
    saved by a single process), this is a sharded save
    (:func:`savepoint.distributed.save.save_flat`)."""
    location = resolve_path(path, what="checkpoint path")
    return _write(location, options or SaveOptions(), metadata, flat=flat, release=False)


# ---------------------------------------------------------------------------------------------
# load
# ---------------------------------------------------------------------------------------------


@guarded
def load(
    path: PathLike,
    *,
    into: Any = None,
    keys: Iterable[str] | str | None = None,
    verify: load_engine.Verify = True,
    framework: Framework = "auto",
    device: Any = None,
    mmap: bool = False,
    progress: Progress | None = None,
    process_group: Any = None,
    timeout: float | None = None,
    read_once: bool = True,
) -> Any:
    """Load a checkpoint: return the saved tree, or restore it into ``into`` in place.

    ``path`` takes what ``save`` takes (a local path, a ``file://`` or ``memory://`` URL, a
    ``Location``).

    Without ``into`` the tree comes back as saved: dicts, lists, tuples, plain values, and arrays:
    numpy by default, torch tensors where a torch tensor was saved (``framework`` forces one or the
    other; ``device`` moves torch tensors there). Stateful objects come back as their state dicts.
    Tied tensors come back tied. ``mmap=True`` returns arrays backed by a private copy-on-write
    mapping of the files instead of copies (no memory used until written to).

    With ``into`` (a dict/list tree, a Stateful, or a tree holding Stateful objects) every tensor is
    read straight into the existing array, tensor or parameter; plain values are assigned into
    their containers; Stateful objects get ``load_state_dict`` with the saved tree, innermost
    first. ``into`` may cover part of the checkpoint; only that part is read. Every missing key and
    every shape or dtype mismatch is reported in one StateMismatchError before anything is
    modified. Returns ``into``. Wrapped models (compile, DDP) load in either form, dataclass
    targets take their saved fields, and Python scalars and 0-d tensors stand in for each other
    when the conversion is exact: see docs/training-state.md, "State from real training scripts".
    A pytree holding ``jax.Array`` (or ``jax.ShapeDtypeStruct``) leaves cannot be filled in place:
    the restored pytree is returned, of ``into``'s own types, each array placed with its target's
    sharding (any mesh), and a dict or list root has its entries replaced too (docs/jax.md).

    ``keys`` selects paths (``"model"``, ``"model/layer.weight"``: components joined by ``/``, with
    ``~`` written ``~0`` and ``/`` written ``~1``); only their bytes are read.

    With ``verify=True`` (the default) sizes and headers are checked before any data is copied,
    and each tensor's checksum while it is copied (about 5% over a bare copy). A mismatch raises
    CorruptCheckpointError naming the tensor; with ``into`` the target may then be partly
    overwritten, so restore another checkpoint. ``verify="first"`` checks every checksum before
    modifying anything, at the price of one more pass over the data (about 35% of a warm load);
    ``verify=False`` checks sizes and structure only.

    A sharded checkpoint (saved with ``process_group``) loads on any number of ranks; without
    ``into`` its tensors come back whole. With ``process_group`` (call ``load`` on every rank) or
    Shard / FlatShard / Partitioned / DTensor targets, each rank reads only the bytes it needs
    (bytes several ranks need are read once and sent over the group unless ``read_once=False``);
    a failure on any rank raises DistributedCheckpointError on all. See ``docs/distributed.md``.

    ``path`` may also be a local file or directory of another format savepoint reads (a
    ``.safetensors`` or PyTorch ``.pt``/``.pth``/``.bin``/``.ckpt`` file, read with
    ``torch.load(weights_only=True)`` only; ``.shrew``, burn ``.mpk``, boostr, training
    artifacts, Hugging Face model directories, DCP, DeepSpeed and Orbax directories): its tree
    comes back, or into ``into`` (see :mod:`savepoint.formats.load`). A run directory, a sweep
    or any other directory raises IncompleteCheckpointError saying what it is and what to call.
    """
    check_path("sp.load", path)
    keys = check_load(
        keys=keys,
        verify=verify,
        framework=framework,
        mmap=mmap,
        progress=progress,
        process_group=process_group,
        timeout=timeout,
        device=device,
        read_once=read_once,
    )
    location = resolve_path(path, what="checkpoint path")
    options: dict[str, Any] = {"into": into, "keys": keys, "verify": verify, "mmap": mmap}
    options.update(framework=framework, device=device, progress=progress)
    if into is not None and _holds_jax(into):
        return _load_jax(location, options, process_group, timeout)
    return _load(location, options, process_group, timeout, read_once=read_once)


def _load(
    location: Location,
    options: dict[str, Any],
    process_group: Any,
    timeout: float | None,
    *,
    read_once: bool = True,
) -> Any:
    """``sp.load`` once its arguments are checked: sharded, unsharded, or another format."""
    into = options["into"]
    if process_group is not None or (into is not None and _has_shard_targets(into)):
        from savepoint.distributed import load as distributed_load

        return distributed_load.load(
            location, process_group=process_group, timeout=timeout, read_once=read_once, **options
        )
    try:
        # A generation replaced under the read (object stores) is read again from the new one.
        with collector.paused():
            return rereading(lambda: load_engine.load(location, **options))
    except (IncompleteCheckpointError, CorruptCheckpointError) as exc:
        found = _other(location, exc)
        if found is None:
            raise
    if found.kind == "format" and not found.remote:
        from savepoint.formats.load import load_any

        with collector.paused():
            return load_any(location.path, found.format, **options)
    raise _not_a_checkpoint(found, "sp.load")


def _holds_jax(into: Any) -> bool:
    """Whether ``into`` is a pytree holding ``jax.Array`` leaves (never imports jax: such a
    leaf can only exist once jax is imported)."""
    if "jax" not in sys.modules:
        return False
    from savepoint.state import jax_restore

    return jax_restore.holds_jax(into)


def _load_jax(
    location: Location, options: dict[str, Any], process_group: Any, timeout: float | None
) -> Any:
    """``sp.load(into=pytree)`` of a JAX pytree: restored into host arrays, then placed with
    the target leaves' shardings and rebuilt (see :mod:`savepoint.state.jax_restore`)."""
    from savepoint.state import jax_restore

    if process_group is not None:
        raise UnsupportedStateError(
            "sp.load(into=<a pytree of jax arrays>) takes no process_group: jax arrays are "
            "restored by one process, onto the devices their shardings name (multi-process "
            "jax.distributed restores are not supported)"
        )
    unpacked = jax_restore.unpack(options["into"])
    _load(location, {**options, "into": unpacked.plain}, None, timeout)
    return unpacked.finish(str(location))


def _other(location: Location, exc: CheckpointError) -> Any:
    """What is at ``location`` (a :class:`savepoint.pathkind.Found`) when the reader failed with
    ``exc`` about it and it is no savepoint checkpoint, nor one whose save did not commit: a
    file or directory of another format, a run directory... None: ``exc`` is the answer."""
    if exc.path != str(location):
        return None
    from savepoint import pathkind

    found = pathkind.classify(location)
    if found is None or found.kind == "uncommitted":
        return None
    if isinstance(exc, CorruptCheckpointError) and found.kind != "format":
        return None  # a damaged checkpoint is damaged, whatever else its directory holds
    if found.error is not None and not isinstance(found.error, IncompatibleCheckpointError):
        return None  # a FIFO, a device, an unreadable file: the reader says which
    return found


def _not_a_checkpoint(found: Any, call: str) -> IncompleteCheckpointError:
    from savepoint import pathkind

    return IncompleteCheckpointError(pathkind.library_message(found, call), path=found.path)


def _has_shard_targets(into: Any) -> bool:
    """Whether ``into`` holds sharded targets outside Stateful objects (cheap: no torch import,
    nothing but a walk of plain containers)."""
    from savepoint.distributed import shard

    return shard.has_targets(into)


# ---------------------------------------------------------------------------------------------
# verify / inspect
# ---------------------------------------------------------------------------------------------


@guarded
def inspect(path: PathLike) -> CheckpointInfo:
    """Keys, dtypes, shapes, sizes, plain values and metadata, from the manifest alone.

    ``path`` may also be a local file or directory of another format savepoint reads (as
    ``savepoint inspect``: :func:`savepoint.formats.detect.inspect_any`); a run directory, a
    sweep or any other directory raises IncompleteCheckpointError saying what it is and what to
    call instead."""
    check_path("sp.inspect", path)
    location = resolve_path(path, what="checkpoint path")
    try:
        with collector.paused(), Reader.open(location, needs=lambda shown, manifest: ()) as reader:
            return describe(reader.shown, reader.manifest)
    except (IncompleteCheckpointError, CorruptCheckpointError) as exc:
        found = _other(location, exc)
        if found is None:
            raise
    if found.kind == "format" and not found.remote:
        from savepoint.formats import detect

        return detect.inspect_any(location.path)
    raise _not_a_checkpoint(found, "sp.inspect")


@guarded
def verify(
    path: PathLike, *, progress: Progress | None = None, direct: bool = False
) -> CheckpointInfo:
    """Check the manifest, every data file's header against it, and every tensor's checksum.

    ``direct=True`` reads the data files of a local checkpoint past the page cache (``O_DIRECT``
    where the filesystem takes it), each once, in order, through one reused buffer: it checks
    the bytes on the disk rather than a cached copy, costs the caller little more CPU than the
    hash, and leaves the page cache as it was (a checkpoint just written with ``O_DIRECT`` is
    not in it anyway; a cached one verifies faster without it). A ``CheckpointManager`` reads
    its new checkpoint back this way before pruning. Elsewhere it reads as without it.

    Raises a CheckpointError subclass describing the first problem; returns the checkpoint's
    description when everything is intact. A local file or directory of another format is
    checked as far as its format allows (``savepoint verify``:
    :func:`savepoint.formats.detect.verify_any`; those formats have no checksums); a run
    directory and the others ``sp.load`` names raise IncompleteCheckpointError saying what to
    call (a whole run is checked by ``savepoint verify RUN``).
    """
    check_path("sp.verify", path)
    check_load(progress=progress, what="verify")
    location = resolve_path(path, what="checkpoint path")

    def once() -> CheckpointInfo:
        with Reader.open(location) as reader:
            load_engine.verify(reader, progress, direct=direct)
            return describe(reader.shown, reader.manifest)

    try:
        with collector.paused():
            return rereading(once)  # a generation replaced under the read (object stores): again
    except (IncompleteCheckpointError, CorruptCheckpointError) as exc:
        found = _other(location, exc)
        if found is None:
            raise
    if found.kind == "format" and not found.remote:
        from savepoint.formats import detect

        return detect.verify_any(location.path, progress=progress)
    raise _not_a_checkpoint(found, "sp.verify")
