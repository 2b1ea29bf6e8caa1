"""Step 2 of a sharded save on one rank, as plain data: the rank's pieces written into the save's
staging directory (:func:`write_pieces`) or put into the blob store (:func:`put_pieces`), and
the records of what was written, to be gathered by rank 0.

Nothing here talks to the other ranks: these functions take the staging directory, the pieces
this rank was assigned (:class:`~savepoint.distributed.plan.Item`) and their sources, and return
the records. :mod:`savepoint.distributed.save` runs them in the caller's process (the rank's
own thread); ``AsyncCheckpointer(writer="process")`` runs them in its writer process, from the
shared staging arena, and the pieces and records cross the process boundary as JSON
(:func:`items_json`, :func:`records_json` and their inverses: plain lists and mappings, no
pickle).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from savepoint.codecs import boxes, checksum
from savepoint.codecs import manifest as mf
from savepoint.commit.transaction import write_error
from savepoint.distributed import plan
from savepoint.distributed.deadlines import working_on
from savepoint.engine import save as save_engine
from savepoint.engine import sinks
from savepoint.engine.plan import FilePlan, plan_files
from savepoint.errors import CheckpointError
from savepoint.options import Progress
from savepoint.state.arrays import NumpySource, TensorSource
from savepoint.storage.paths import Location, PathArg
from savepoint.storage.paths import resolve as resolve_path

if TYPE_CHECKING:
    from savepoint.blobs import BlobPolicy, FastMemo, SaveSession
    from savepoint.blobs.patch import PatchTracker

__all__ = [
    "Indexed",
    "Records",
    "file_name",
    "items_from_json",
    "items_json",
    "put_pieces",
    "records_from_json",
    "records_json",
    "seal_index",
    "write_pieces",
]

# A rank's records: its data files, and the shard record of each piece it wrote (by tensor key).
Records = tuple[dict[str, mf.FileRecord], list[tuple[str, mf.ShardRecord]]]
# What a rank of a regular save sends instead (manifest version 7): its data files, and the name
# and record of its index file, which holds its shard records.
Indexed = tuple[dict[str, mf.FileRecord], str, mf.IndexRecord]


def seal_index(
    store: Any, staging: str, rank: int, records: Records, *, write: bool = True
) -> Indexed:
    """A regular save's step 2, after the rank's pieces are written: its shard records into its
    index file (``index-r<rank>.json`` in the staging directory, put create-only and synced; not
    written when ``write`` is False, the world simulator's), and what rank 0 needs of it."""
    files, shards = records
    data = mf.index_bytes(shards)
    name = mf.index_name(rank)
    if write:
        path = store.join(staging, name)
        try:
            store.put(path, data)
            store.sync_dir(staging)
        except OSError as exc:
            if isinstance(exc, CheckpointError):
                raise
            raise write_error(store, path, exc) from exc
    return files, name, mf.IndexRecord(len(data), checksum.digest(data))


def file_name(rank: int, index: int) -> str:
    return f"data-r{rank:05d}-{index:05d}.safetensors"


def write_pieces(
    target: PathArg,
    staging: str,
    rank: int,
    items: tuple[plan.Item, ...],
    sources: dict[str, TensorSource],
    *,
    max_file_bytes: int,
    writers: int,
    direct: bool = True,
    progress: Progress | None = None,
) -> Records:
    """Write ``items`` into the staging directory ``staging`` of a save to ``target`` as this
    rank's data files (planned as an unsharded save plans its files, named
    ``data-r<rank>-<i>``); return their records."""
    if not items:
        return {}, []
    where = resolve_path(target, what="checkpoint path")
    names: dict[str, plan.Item] = {}
    for item in items:
        name = base = mf.shard_name(item.key, item.region, item.shape)
        n = 2
        while name in names or name == "__metadata__":
            name, n = f"{base}~{n}", n + 1
        names[name] = item
    on_bytes = save_engine.byte_counter(sum(item.nbytes for item in items), progress)

    tensors = {name: _as_recorded(sources[item.key], item) for name, item in names.items()}
    plans: list[FilePlan] = plan_files(tensors, max_file_bytes, lambda i: file_name(rank, i))
    try:
        files, records = sinks.write_files(
            Location(where.store, staging),
            plans,
            tensors,
            writers=writers,
            direct=direct,
            progress=on_bytes if progress is not None else None,
            blocked=True,
            watch=lambda name: working_on(f"writing {name}"),
        )
        where.store.sync_dir(staging)
    except OSError as exc:
        if isinstance(exc, CheckpointError):
            raise
        raise write_error(where.store, where.path, exc) from exc
    shards = [
        (
            item.key,
            mf.ShardRecord(
                rec.file, rec.start, rec.end, rec.xxh3, item.region, rec.block, rec.blocks
            ),
        )
        for name, item in names.items()
        for rec in [records[name]]
    ]
    return files, shards


def _as_recorded(source: TensorSource, item: plan.Item) -> TensorSource:
    """``source``, or for a tensor without elements written whole (its region the whole
    tensor) from a part of another shape (``[0, 0) x [3, 6)`` of ``[0, 6]``): an empty source
    of the tensor's shape, so the data file's header says what the shard record does."""
    if source.nbytes or source.shape == item.shape:
        return source
    empty = NumpySource(np.empty(item.shape, np.uint8), item.key)
    empty.dtype, empty.kind = source.dtype, source.kind
    return empty


def put_pieces(
    session: SaveSession,
    items: tuple[plan.Item, ...],
    sources: dict[str, TensorSource],
    policy: BlobPolicy,
    memo: FastMemo | None,
    progress: Callable[[int], None] | None = None,
    *,
    tracker: PatchTracker | None = None,
    pending: dict[str, Any] | None = None,
) -> list[tuple[str, mf.ShardRecord]]:
    """Put each piece of ``items`` into the blob store of ``session`` as chunked blobs (chunks
    already stored are not written again); return the shard record of each, naming its recipe.
    ``progress(n)`` gets the bytes of each piece put. With ``tracker``, a piece in host memory
    whose last save the tracker saw is written as a patch of its changed rows
    (:func:`savepoint.blobs.patch.put_tensor`), and its entry goes to ``pending`` (for
    ``tracker.commit`` once the checkpoint is committed)."""
    from savepoint.blobs.patch import put_tensor

    if not items:
        return []
    biggest = max(item.nbytes for item in items)
    chunk = policy.chunk_size
    scratch = np.empty(min(biggest, max(chunk, sinks.BLOB_SEGMENT // chunk * chunk)), np.uint8)
    out: list[tuple[str, mf.ShardRecord]] = []
    for item in items:
        source = sources[item.key]
        host = sinks.host_bytes(source) if tracker is not None and memo else None
        if host is not None:
            assert tracker is not None and memo is not None and pending is not None
            name = f"{item.key}@{item.region}"
            shape, itemsize = tuple(source.shape), source.dtype.itemsize
            recipe, pending[name] = put_tensor(
                session, host, name, shape, itemsize, policy, memo, tracker
            )
            source.release()
        else:
            recipe = sinks.put_source(session, source, policy, memo, scratch)
        digest = recipe.checksum()
        assert digest is not None and recipe.size == item.nbytes
        record = mf.ShardRecord(
            "", 0, item.nbytes, digest.xxh3, item.region, digest.block, digest.blocks, recipe
        )
        out.append((item.key, record))
        if progress is not None:
            progress(item.nbytes)
    return out


# ---------------------------------------------------------------------------------------------
# the pieces and the records as JSON (to and from the writer process)
# ---------------------------------------------------------------------------------------------


def _region_json(region: boxes.Region) -> Any:
    if isinstance(region, boxes.Flat):
        return {"flat": [region.start, region.stop]}
    return [[a, b] for a, b in region]


def _region(obj: Any) -> boxes.Region:
    if isinstance(obj, dict):
        start, stop = obj["flat"]
        return boxes.Flat(int(start), int(stop))
    return tuple((int(a), int(b)) for a, b in obj)


def items_json(items: tuple[plan.Item, ...]) -> list[list[Any]]:
    """``items`` as JSON values (one list each), for :func:`items_from_json`."""
    return [[i.key, i.dtype, list(i.shape), _region_json(i.region)] for i in items]


def items_from_json(obj: list[list[Any]]) -> tuple[plan.Item, ...]:
    return tuple(
        plan.Item(str(key), str(dtype), tuple(int(n) for n in shape), _region(region))
        for key, dtype, shape, region in obj
    )


def records_json(records: Records) -> dict[str, Any]:
    """A rank's records as JSON values, for :func:`records_from_json`."""
    files, shards = records
    return {
        "files": {name: [r.size, r.header_size, r.header_xxh3] for name, r in files.items()},
        "shards": [
            [
                key,
                s.file,
                s.start,
                s.end,
                s.xxh3,
                _region_json(s.region),
                s.block,
                list(s.blocks),
                None if s.recipe is None else s.recipe.to_json(),
            ]
            for key, s in shards
        ],
    }


def records_from_json(obj: dict[str, Any]) -> Records:
    from savepoint.codecs.recipe import Recipe

    files = {
        str(name): mf.FileRecord(int(size), int(header), str(digest))
        for name, (size, header, digest) in obj["files"].items()
    }
    shards = [
        (
            str(key),
            mf.ShardRecord(
                str(file),
                int(start),
                int(end),
                str(xxh3),
                _region(region),
                int(block),
                tuple(str(b) for b in blocks),
                None if recipe is None else Recipe.from_json(recipe),
            ),
        )
        for key, file, start, end, xxh3, region, block, blocks, recipe in obj["shards"]
    ]
    return files, shards
