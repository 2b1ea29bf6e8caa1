"""Save, load, verify and inspect one checkpoint directory.

``save`` blocks until the checkpoint is durable: every data file and the manifest are fsynced
inside a hidden staging directory, which is then renamed (or atomically exchanged) into place and
the parent directory fsynced. A crash at any moment leaves the previous checkpoint or the new one,
never a mixture. ``load`` trusts nothing on disk: the manifest is checked whole before any data
file is opened, and every tensor it returns has passed its checksum (unless ``verify=False``).

Readers never write, so they work on read-only media, and they may run while another process
saves over the same path: ``load``, ``verify`` and ``inspect`` pin one generation (its directory,
manifest and the data files they read are opened up front) and return exactly that checkpoint,
retrying on the new one if theirs vanished before it was pinned (see :mod:`savepoint._reader`).
A file they may not read raises CheckpointPermissionError naming it.

With ``process_group=...`` (or a state holding ``Shard``, ``FlatShard``, ``Partitioned`` or
DTensor leaves) ``save`` and ``load`` hand over to :mod:`savepoint.distributed`: sharded
checkpoints written by every rank at once and loadable on any number of ranks. That package sits
above this module and is imported only then, so unsharded saves and loads never touch it (nor torch).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import errno
import json
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from savepoint import _reader, _writer
from savepoint.codecs import manifest as mf
from savepoint.commit import atomic
from savepoint.errors import (
    CheckpointError,
    CheckpointWriteError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    StateMismatchError,
    UnsupportedStateError,
)
from savepoint.formats._files import jsonable
from savepoint.state import arrays, restore, tree
from savepoint.storage import local
from savepoint.storage.paths import local_path

PathLike = str | os.PathLike[str]
Framework = Literal["auto", "numpy", "torch"]
Progress = Callable[[int, int], None]

DEFAULT_MAX_FILE_BYTES = 1 << 30
DEFAULT_WRITERS = 1


# ---------------------------------------------------------------------------------------------
# save
# ---------------------------------------------------------------------------------------------


def save(
    path: PathLike,
    state: Any,
    *,
    metadata: Mapping[str, Any] | None = None,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    writers: int = DEFAULT_WRITERS,
    progress: Progress | None = None,
    process_group: Any = None,
    timeout: float | None = None,
) -> CheckpointInfo:
    """Save ``state`` to the directory ``path``, atomically and durably; return what was written.

    ``state`` is a nested tree of dicts (str or int keys), lists and tuples whose leaves are numpy
    arrays or scalars, torch tensors (any device; copied to host a chunk at a time), None, bool,
    int, float, str, bytes, and Stateful objects (anything with ``state_dict()`` and
    ``load_state_dict()``: modules, optimizers, schedulers...), whose ``state_dict()`` is saved.
    A ``torch.compile``, DDP or DataParallel wrapper saves the keys of the model it wraps; a
    dataclass instance is saved as a plain dict of its fields (the class is not recorded).
    Tensors that are the same view of the same memory (tied weights) are stored once.

    ``metadata`` is a JSON-serialisable mapping stored verbatim in the manifest. Data is split into
    safetensors files of at most ``max_file_bytes`` (a bigger tensor gets a file of its own), which
    ``writers`` threads write concurrently. ``progress(done, total)`` is called as bytes are written.

    If ``path`` already holds a checkpoint it is replaced atomically. A directory at ``path`` that
    is neither empty nor a checkpoint is never touched: that is an error. On any failure (disk full,
    fsync error, an unsupported leaf) nothing at ``path`` changes and no temporary files remain.

    ``process_group`` (a ``torch.distributed`` group; call ``save`` on every rank of it): a sharded
    save. Each rank writes what it holds (a plain tensor is replicated: one rank writes it;
    ``sp.Shard``, ``sp.FlatShard``, ``sp.Partitioned`` and DTensor leaves describe parts), rank 0
    commits one manifest after every rank has fsynced; a failure anywhere raises
    DistributedCheckpointError on every rank, after ``timeout`` seconds at most for a rank that
    stopped answering. See ``docs/distributed.md``.
    """
    path = local_path(path, what="checkpoint path")
    if process_group is not None:
        from savepoint.distributed import save as distributed_save

        return distributed_save.save(
            path,
            state,
            metadata,
            process_group=process_group,
            timeout=timeout,
            max_file_bytes=max_file_bytes,
            writers=writers,
            progress=progress,
        )
    meta = _check_metadata(metadata)
    flat = tree.flatten(state)
    return save_flat(
        path, flat, meta, max_file_bytes=max_file_bytes, writers=writers, progress=progress
    )


def save_flat(
    path: PathLike,
    flat: tree.Flat,
    metadata: dict[str, Any],
    *,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    writers: int = DEFAULT_WRITERS,
    progress: Progress | None = None,
    process_group: Any = None,
    timeout: float | None = None,
) -> CheckpointInfo:
    """``save`` for a state already flattened (and checked metadata).

    With ``process_group``, or when the state holds sharding descriptions (``sp.Shard`` saved by
    a single process), this is a sharded save (:func:`savepoint.distributed.save.save_flat`)."""
    if process_group is not None or _has_shards(flat.tree):
        from savepoint.distributed import save as distributed_save

        return distributed_save.save_flat(
            path,
            flat,
            metadata,
            process_group=process_group,
            timeout=timeout,
            max_file_bytes=max_file_bytes,
            writers=writers,
            progress=progress,
        )
    if max_file_bytes <= 0 or writers < 1:
        raise ValueError("max_file_bytes must be positive and writers at least 1")
    total = sum(s.nbytes for s in flat.tensors.values())
    done = 0

    def on_bytes(n: int) -> None:
        nonlocal done
        done += n
        if progress is not None:
            progress(min(done, total), total)

    def write(staging: str) -> tuple[dict[str, mf.FileRecord], dict[str, mf.TensorRecord]]:
        return _writer.write_files(
            staging,
            flat,
            max_file_bytes=max_file_bytes,
            writers=writers,
            progress=on_bytes if progress is not None else None,
        )

    return commit_checkpoint(path, flat.tree, metadata, write)


def commit_checkpoint(
    path: PathLike,
    tree_node: tree.Node,
    metadata: dict[str, Any],
    write: Callable[[str], tuple[dict[str, mf.FileRecord], dict[str, mf.TensorRecord]]],
) -> CheckpointInfo:
    """The commit protocol around ``write(staging_dir)``, which writes and fsyncs the data files
    and returns their records: staging directory, manifest last, atomic commit, cleanup on any
    failure (OSErrors become CheckpointWriteError). Every save path goes through here."""
    target = os.path.abspath(os.fspath(path))
    if os.path.islink(target):
        # A symlinked checkpoint path (to another disk, say): replace what it points to.
        target = os.path.realpath(target)
    staging = atomic.staging_path(target)
    try:
        _check_target(target)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        atomic.clean_stale(target)
        os.mkdir(staging)
        files, tensors = write(staging)
        manifest = mf.Manifest(
            tree=tree_node,
            files=files,
            tensors=tensors,
            metadata=metadata,
            writer=_writer.writer_version(),
            created=_dt.datetime.now(_dt.timezone.utc).isoformat().replace("+00:00", "Z"),
        )
        local.write_small(os.path.join(staging, mf.NAME), mf.dumps(manifest))
        atomic.commit(staging, target)
        # A replace that died between its two renames left "-old-" behind; it is stale now.
        atomic.clean_stale(target)
    except BaseException as exc:
        with contextlib.suppress(OSError):  # cleanup must never hide the error itself
            atomic.remove_tree(staging)
        if isinstance(exc, OSError) and not isinstance(exc, CheckpointError):
            raise _write_error(target, exc) from exc
        raise
    return _info(target, manifest)


def _has_shards(root: tree.Node) -> bool:
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


_SHARD_TYPES = "savepoint.distributed.shard."


def _check_metadata(metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise UnsupportedStateError(f"metadata must be a mapping, got {type(metadata).__name__}")
    try:
        # Round-trip so the manifest holds exactly what a reader will see.
        return dict(json.loads(json.dumps(dict(metadata), allow_nan=False)))
    except (TypeError, ValueError) as exc:
        raise UnsupportedStateError(
            f"metadata must be JSON-serialisable with finite floats: {exc}"
        ) from None


def _check_target(target: str) -> None:
    if not os.path.lexists(target):
        return
    if not os.path.isdir(target):
        raise CheckpointWriteError(
            f"{target} exists and is not a directory; refusing to replace it", path=target
        )
    if not os.path.isfile(os.path.join(target, mf.NAME)) and os.listdir(target):
        raise CheckpointWriteError(
            f"{target} is a non-empty directory that is not a savepoint checkpoint; refusing to "
            "replace it (choose another path or remove it)",
            path=target,
        )


def _write_error(target: str, exc: OSError) -> CheckpointWriteError:
    reason = os.strerror(exc.errno) if exc.errno else str(exc)
    hint = {
        errno.ENOSPC: "free disk space and save again",
        errno.EDQUOT: "free quota and save again",
        errno.EACCES: "check the permissions of the parent directory",
        errno.EROFS: "the filesystem is read-only",
    }.get(exc.errno or 0, "see the cause below")
    err = CheckpointWriteError(
        f"saving {target} failed: {reason} ({exc.filename or target}); any previous checkpoint "
        f"there is intact and no temporary files remain; {hint}",
        path=target,
        errno=exc.errno,
    )
    return err


# ---------------------------------------------------------------------------------------------
# load
# ---------------------------------------------------------------------------------------------


def load(
    path: PathLike,
    *,
    into: Any = None,
    keys: Iterable[str] | str | None = None,
    verify: bool | Literal["first"] = True,
    framework: Framework = "auto",
    device: Any = None,
    mmap: bool = False,
    progress: Progress | None = None,
    process_group: Any = None,
    timeout: float | None = None,
) -> Any:
    """Load a checkpoint: return the saved tree, or restore it into ``into`` in place.

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

    ``keys`` selects paths (``"model"``, ``"model/layer.weight"``: components joined by ``/``, with
    ``~`` written ``~0`` and ``/`` written ``~1``); only their bytes are read.

    With ``verify=True`` (the default) sizes and headers are checked before any data is copied,
    and each tensor's checksum while it is copied (about 5% over a bare copy). A mismatch raises
    CorruptCheckpointError naming the tensor; with ``into`` the target may then be partly
    overwritten, so restore another checkpoint. ``verify="first"`` checks every checksum before
    modifying anything, at the price of one more pass over the data (about 35% of a warm load);
    ``verify=False`` checks sizes and structure only.

    A sharded checkpoint (saved with ``process_group``) loads on any number of ranks. Without
    ``into`` its tensors come back whole. With ``process_group`` (call ``load`` on every rank) or
    with ``sp.Shard`` / ``sp.FlatShard`` / ``sp.Partitioned`` / DTensor targets in ``into``, each
    rank reads only the byte ranges of the shards that overlap the parts it holds; a failure on
    any rank raises DistributedCheckpointError on all of them. See ``docs/distributed.md``.
    """
    path = local_path(path, what="checkpoint path")
    if verify not in (True, False, "first"):
        raise ValueError(f"verify must be True, False or 'first', not {verify!r}")
    if framework not in ("auto", "numpy", "torch"):
        raise ValueError(f"framework must be 'auto', 'numpy' or 'torch', not {framework!r}")
    if keys is not None and not isinstance(keys, str):
        keys = list(keys)  # read twice: to pin the files it needs, then to load
    if process_group is not None or (into is not None and _has_shard_targets(into)):
        from savepoint.distributed import load as distributed_load

        return distributed_load.load(
            path,
            into=into,
            keys=keys,
            verify=verify,
            framework=framework,
            device=device,
            mmap=mmap,
            progress=progress,
            process_group=process_group,
            timeout=timeout,
        )
    reader = _reader.Reader.open(
        os.path.abspath(os.fspath(path)),
        copy_on_write=mmap and into is None,
        needs=files_needed(keys),
    )
    try:
        directory, manifest = reader.path, reader.manifest
        root = _select(directory, manifest, keys)
        counter = _counter(progress, manifest, tree.refs(root) if into is None else None)
        if into is None:
            return _load_tree(reader, root, verify, framework, device, mmap, counter)
        p = restore.plan(root, into, manifest.tensors)
        if p.problems:
            raise StateMismatchError(p.problems, path=directory)
        if counter is not None:
            counter.total = sum(manifest.tensors[r].nbytes for r in p.refs)
        jobs, after = reader.fill_jobs((ref, target) for ref, target, _ in p.inplace)
        reader.prepare(p.refs, check_header=bool(verify))
        kinds = _kinds(root)
        made = {ref: reader.allocate(ref, kinds[ref], framework) for ref in p.fresh}
        jobs += [(ref, arrays.byte_view(obj)) for ref, obj in made.items()]
        if verify == "first":
            reader.transfer([(ref, None) for ref, _ in jobs])
        reader.transfer(jobs, verify=verify is True, progress=counter)
        for step in after:
            step()
        return p.finish(_getter(made, device))
    finally:
        reader.close()


def files_needed(keys: Iterable[str] | str | None) -> _reader.Needs:
    """What a load of ``keys`` reads: the data files of every tensor under them, which
    ``Reader.open`` pins before the load starts (an ``into`` covering less reads a subset).
    A key that is not in the checkpoint raises IncompatibleCheckpointError from here."""

    def needs(directory: str, manifest: mf.Manifest) -> set[str]:
        return _reader.files_of(manifest, tree.refs(_select(directory, manifest, keys)))

    return needs


def _has_shard_targets(into: Any) -> bool:
    """Whether ``into`` holds sharded targets outside Stateful objects (cheap: no torch import,
    nothing but a walk of plain containers)."""
    from savepoint.distributed import shard

    return shard.has_targets(into)


class _Counter:
    def __init__(self, progress: Progress, total: int) -> None:
        self.progress = progress
        self.total = total
        self.done = 0

    def __call__(self, n: int) -> None:
        self.done += n
        self.progress(min(self.done, self.total), self.total)


def _counter(
    progress: Progress | None, manifest: mf.Manifest, refs: set[str] | None
) -> _Counter | None:
    if progress is None:
        return None
    return _Counter(progress, sum(manifest.tensors[r].nbytes for r in refs or ()))


def _kinds(root: tree.Node) -> dict[str, str]:
    """The kind (numpy, numpy_scalar, torch) of each tensor ref, from its first leaf."""
    kinds: dict[str, str] = {}
    for _, node in tree.leaves(root):
        if node["t"] == "tensor":
            kinds.setdefault(node["ref"], node["kind"])
    return kinds


def _getter(made: dict[str, Any], device: Any) -> Callable[[str, str], Any]:
    """The tensor supplier for tree.build: each ref once, so tied leaves stay tied."""
    cache: dict[tuple[str, str], Any] = {}

    def get(ref: str, kind: str) -> Any:
        key = (ref, kind)
        if key not in cache:
            obj = made[ref]
            if device is not None and arrays.is_torch_tensor(obj):
                from savepoint.state import _torch

                obj = _torch.to_device(obj, device)
            cache[key] = obj[()] if kind == "numpy_scalar" and isinstance(obj, np.ndarray) else obj
        return cache[key]

    return get


def _select(directory: str, manifest: mf.Manifest, keys: Iterable[str] | str | None) -> tree.Node:
    if keys is None:
        return manifest.tree
    wanted = [keys] if isinstance(keys, str) else list(keys)
    missing = [k for k in wanted if tree.select(manifest.tree, [k]) is None]
    if missing:
        raise IncompatibleCheckpointError(
            f"{directory}: no such key(s) in the checkpoint: {', '.join(map(repr, missing))}; "
            "`savepoint inspect` lists the keys",
            path=directory,
        )
    selected = tree.select(manifest.tree, wanted)
    assert selected is not None
    return selected


def _load_tree(
    reader: _reader.Reader,
    root: tree.Node,
    verify: bool | Literal["first"],
    framework: Framework,
    device: Any,
    share: bool,
    counter: _Counter | None,
) -> Any:
    kinds = _kinds(root)
    reader.prepare(kinds, check_header=bool(verify))
    made = {
        ref: reader.allocate(ref, kind, framework, share_memory=share)
        for ref, kind in kinds.items()
    }
    jobs = [
        (ref, None if share and not reader.is_split(ref) else arrays.byte_view(obj))
        for ref, obj in made.items()
    ]
    # A fresh tree is only handed over once complete, so "first" needs no separate pass here.
    reader.transfer(jobs, verify=bool(verify), progress=counter)
    return tree.build(root, _getter(made, device))


# ---------------------------------------------------------------------------------------------
# verify / inspect
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorInfo:
    key: str  # path in the state tree (components joined by "/")
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    file: str
    ref: str  # name in the data file; tied leaves share one
    tied_to: str | None = None  # the ref of an earlier leaf this one shares storage with
    shards: int = 1  # pieces it is stored in (sharded checkpoints); ``file`` is then "N shards"


@dataclass(frozen=True)
class CheckpointInfo:
    path: str
    format_version: int
    writer: str
    created: str
    metadata: dict[str, Any]
    tensors: tuple[TensorInfo, ...]
    values: dict[str, Any]
    files: dict[str, int]
    stateful: dict[str, str] = field(default_factory=dict)
    world_size: int | None = None  # ranks that saved a sharded checkpoint; None when unsharded

    @property
    def total_bytes(self) -> int:
        """Bytes of tensor data, each stored tensor counted once."""
        return sum({t.ref: t.nbytes for t in self.tensors}.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "format_version": self.format_version,
            "writer": self.writer,
            "created": self.created,
            "metadata": self.metadata,
            "total_bytes": self.total_bytes,
            "files": self.files,
            "tensors": [
                {
                    "key": t.key,
                    "dtype": t.dtype,
                    "shape": list(t.shape),
                    "nbytes": t.nbytes,
                    "file": t.file,
                    **({"tied_to": t.tied_to} if t.tied_to else {}),
                    **({"shards": t.shards} if t.shards > 1 else {}),
                }
                for t in self.tensors
            ],
            "values": {k: jsonable(v) for k, v in self.values.items()},
            "stateful": self.stateful,
            **({"world_size": self.world_size} if self.world_size is not None else {}),
        }


def _info(directory: str, manifest: mf.Manifest) -> CheckpointInfo:
    tensors = []
    values: dict[str, Any] = {}
    used: set[str] = set()
    seen_refs: set[str] = set()
    for path, node in tree.leaves(manifest.tree):
        # {0: a, "0": b} share a path; keep both apart, as tensor names do (see state.tree).
        key = unique = tree.join(path)
        n = 2
        while unique in used:
            unique, n = f"{key}~{n}", n + 1
        used.add(unique)
        if node["t"] == "tensor":
            ref = node["ref"]
            rec = manifest.tensors[ref]
            tied = ref if ref in seen_refs else None
            seen_refs.add(ref)
            n = len(rec.layout())
            file = rec.file if n == 1 else f"{n} shards"
            tensors.append(TensorInfo(unique, rec.dtype, rec.shape, rec.nbytes, file, ref, tied, n))
        else:
            values[unique] = tree.plain_value(node)
    stateful: dict[str, str] = {}

    def find_stateful(node: tree.Node, path: tuple[tree.Key, ...]) -> None:
        t = node["t"]
        if t == "stateful":
            stateful[tree.join(path)] = node["type"]
            find_stateful(node["state"], path)
        elif t == "dict":
            for k, child in node["items"]:
                find_stateful(child, (*path, k))
        elif t in ("list", "tuple"):
            for i, child in enumerate(node["items"]):
                find_stateful(child, (*path, i))

    find_stateful(manifest.tree, ())
    return CheckpointInfo(
        path=directory,
        format_version=manifest.format_version,
        writer=manifest.writer,
        created=manifest.created,
        metadata=manifest.metadata,
        tensors=tuple(tensors),
        values=values,
        files={name: f.size for name, f in manifest.files.items()},
        stateful=stateful,
        world_size=manifest.world_size,
    )


def inspect(path: PathLike) -> CheckpointInfo:
    """Keys, dtypes, shapes, sizes, plain values and metadata, from the manifest alone."""
    path = local_path(path, what="checkpoint path")
    with _reader.Reader.open(os.path.abspath(path), needs=lambda d, m: ()) as reader:
        return _info(reader.path, reader.manifest)


def verify(path: PathLike, *, progress: Progress | None = None) -> CheckpointInfo:
    """Check the manifest, every data file's header against it, and every tensor's checksum.

    Raises a CheckpointError subclass describing the first problem; returns the checkpoint's
    description when everything is intact.
    """
    path = local_path(path, what="checkpoint path")
    with _reader.Reader.open(os.path.abspath(path)) as reader:
        directory, manifest = reader.path, reader.manifest
        counter = _counter(progress, manifest, set(manifest.tensors))
        expected_sharded = _expected_entries(manifest) if manifest.sharded else {}
        for name in manifest.files:
            if manifest.sharded:
                # Shards are matched by position, dtype and shape; their names are informative.
                expected: Any = sorted(expected_sharded.get(name, []))
                found: Any = sorted(
                    (e.start, e.end, e.dtype, e.shape) for e in reader.header_entries(name)
                )
            else:
                expected = {
                    ref: (rec.dtype, rec.shape, rec.start, rec.end)
                    for ref, rec in manifest.tensors.items()
                    if rec.file == name
                }
                found = {
                    e.name: (e.dtype, e.shape, e.start, e.end) for e in reader.header_entries(name)
                }
            if found != expected:
                raise CorruptCheckpointError(
                    f"{directory}: data file {name} does not hold what the manifest records",
                    path=directory,
                )
        reader.transfer([(ref, None) for ref in manifest.tensors], progress=counter)
    return _info(directory, manifest)


def _expected_entries(
    manifest: mf.Manifest,
) -> dict[str, list[tuple[int, int, str, tuple[int, ...]]]]:
    """(start, end, dtype, stored shape) of every shard, by data file."""
    out: dict[str, list[tuple[int, int, str, tuple[int, ...]]]] = {}
    for rec in manifest.tensors.values():
        for shard in rec.layout():
            out.setdefault(shard.file, []).append(
                (shard.start, shard.end, rec.dtype, mf.shard_shape(shard.region))
            )
    return out
