"""Saving one unsharded checkpoint: plan the files, write them into a transaction, commit.

:func:`save_flat` is the whole synchronous save below the facade: the files are planned
(:mod:`savepoint.engine.plan`), a :class:`~savepoint.commit.transaction.Transaction` is opened on
the target, each file is streamed into its staging directory by the write pipeline
(:mod:`savepoint.engine.pipeline`, up to ``writers`` files at once), and the manifest is committed
last. :func:`save_staged` does the same for a state the async checkpointer has already laid out
as file images (:mod:`savepoint.async_.staging`): checksums from the images on all cores, then
each image written straight from the arena.

:func:`write_files` is the part a sharded save shares: it writes planned files into a staging
directory it does not own and returns their records.
"""

from __future__ import annotations

import datetime as _dt
import functools
import json
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from savepoint._version import __version__
from savepoint.codecs import checksum
from savepoint.codecs import manifest as mf
from savepoint.commit.transaction import Transaction
from savepoint.engine import parallel, pipeline
from savepoint.engine.plan import FilePlan, plan_files
from savepoint.errors import UnsupportedStateError
from savepoint.state import tree
from savepoint.state.arrays import TensorSource
from savepoint.storage.paths import Location

if TYPE_CHECKING:
    from savepoint.async_.staging import Staged

__all__ = [
    "Records",
    "check_metadata",
    "has_shards",
    "new_manifest",
    "save_flat",
    "save_staged",
    "write_files",
    "write_staged",
    "writer_version",
]

Records = tuple[dict[str, mf.FileRecord], dict[str, mf.TensorRecord]]
Progress = Callable[[int, int], None]
T = TypeVar("T")
R = TypeVar("R")

_SHARD_TYPES = "savepoint.distributed.shard."


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


def new_manifest(tree_node: tree.Node, records: Records, metadata: dict[str, Any]) -> mf.Manifest:
    """The (unsharded) manifest of a checkpoint whose files were written with ``records``."""
    files, tensors = records
    return mf.Manifest(
        tree=tree_node,
        files=files,
        tensors=tensors,
        metadata=metadata,
        writer=writer_version(),
        created=_dt.datetime.now(_dt.timezone.utc).isoformat().replace("+00:00", "Z"),
    )


def _map(fn: Callable[[T], R], items: Sequence[T], threads: int) -> list[R]:
    if threads > 1 and len(items) > 1:
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="savepoint-file") as pool:
            return list(pool.map(fn, items))
    return [fn(x) for x in items]


def write_files(
    location: Location,
    plans: Sequence[FilePlan],
    tensors: Mapping[str, TensorSource],
    *,
    writers: int,
    direct: bool = True,
    progress: Callable[[int], None] | None = None,
    blocked: bool = False,
) -> Records:
    """Write every planned file into the directory ``location`` (each finished: durable) with
    up to ``writers`` at once; return the file records and the tensor records (in the order of
    ``tensors``, the state's order, not the file layout's). ``blocked``: large tensors get block
    checksums (a sharded checkpoint's shards; see :mod:`savepoint.codecs.checksum`)."""
    store = location.store

    def write_one(fp: FilePlan) -> tuple[mf.FileRecord, dict[str, mf.TensorRecord]]:
        digests = pipeline.write_blob(
            store,
            store.join(location.path, fp.name),
            fp.header,
            [tensors[e.name] for e in fp.entries],
            direct=direct,
            progress=progress,
            blocked=blocked,
        )
        record = mf.FileRecord(fp.size, len(fp.header), checksum.digest(fp.header))
        plain = mf.TensorRecord.plain
        return record, {
            e.name: plain(e.dtype, e.shape, fp.name, e.start, e.end, d.xxh3)
            if not d.block
            else mf.TensorRecord(
                e.dtype, e.shape, fp.name, e.start, e.end, d.xxh3, (), d.block, d.blocks
            )
            for e, d in zip(fp.entries, digests)
        }

    files: dict[str, mf.FileRecord] = {}
    records: dict[str, mf.TensorRecord] = {}
    for fp, (record, recs) in zip(plans, _map(write_one, plans, writers)):
        files[fp.name] = record
        if records:
            records.update(recs)
        else:
            records = recs
    if list(records) == list(tensors):
        return files, records  # already in the state's order (one file of one dtype, say)
    return files, {name: records[name] for name in tensors}


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

    ``release``: the caller owns ``flat`` and will not use its tensors again, so they are
    dropped (``flat.tensors`` emptied) once written, before the manifest is made: for a state
    of a million small tensors their sources are about 190 MB."""
    total = sum(s.nbytes for s in flat.tensors.values())
    done = 0

    def on_bytes(n: int) -> None:
        nonlocal done
        done += n
        if progress is not None:
            progress(min(done, total), total)

    plans = plan_files(flat.tensors, max_file_bytes)
    with Transaction(location.store, location.path) as tx:
        records = write_files(
            Location(location.store, tx.staging),
            plans,
            flat.tensors,
            writers=writers,
            direct=direct,
            progress=on_bytes if progress is not None else None,
        )
        del plans  # the entries of a million tensors are 180 MB: gone before the manifest
        if release:
            flat.tensors.clear()
        manifest = new_manifest(flat.tree, records, metadata)
        directory = tx.commit(mf.dumps(manifest))
    return directory, manifest


def write_staged(
    location: Location,
    staged: Staged,
    *,
    direct: bool = True,
    writers: int = 1,
    progress: Progress | None = None,
) -> Records:
    """Write a staged state's file images (see savepoint.async_.staging) into the directory
    ``location``: checksums first, from the images, on all cores; then each image straight from
    the arena, up to ``writers`` files at once. ``progress(done, total)`` counts tensor bytes
    (not headers) as they are handed to the store."""
    store = location.store
    total = sum(f.size - len(f.header) for f in staged.files)
    done = 0
    lock = threading.Lock()

    def on_range(header: int, start: int, stop: int) -> None:
        nonlocal done
        n = max(0, stop - max(start, header))
        if progress is not None and n:
            with lock:
                done += n
                progress(min(done, total), total)

    staged.wait()
    jobs = [(f, e) for f in staged.files for e in f.entries]
    digests = parallel.run_all(
        lambda job: checksum.digest(job[0].image[job[1].start : job[1].end]), jobs
    )
    by_name = {e.name: (f, e, d) for (f, e), d in zip(jobs, digests)}

    def write_one(f: Any) -> None:
        pipeline.write_image(
            store,
            store.join(location.path, f.name),
            f.image,
            f.size,
            direct=direct,
            progress=functools.partial(on_range, len(f.header)) if progress else None,
        )

    _map(write_one, staged.files, writers)
    files = {
        f.name: mf.FileRecord(f.size, len(f.header), checksum.digest(f.header))
        for f in staged.files
    }
    tensors = {
        name: mf.TensorRecord(e.dtype, e.shape, f.name, e.start, e.end, d)
        for name in staged.order
        for f, e, d in [by_name[name]]
    }
    return files, tensors


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
    with Transaction(location.store, location.path) as tx:
        records = write_staged(
            Location(location.store, tx.staging),
            staged,
            direct=direct,
            writers=writers,
            progress=progress,
        )
        manifest = new_manifest(staged.tree, records, metadata)
        directory = tx.commit(mf.dumps(manifest))
    return directory, manifest
