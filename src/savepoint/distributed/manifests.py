"""The manifest rank 0 commits for a sharded save, from what every rank wrote.

:func:`grid_manifest`: version 7, a regular save (the tensor table with each tensor's grid, every
rank's data files and index file; the pieces are in the indexes). :func:`manifest`: the per-piece
versions (3; 4 or 5 when the pieces went to a blob store). Both go through the writer's one
builder, ``engine/save.py:new_manifest``.
"""

from __future__ import annotations

import math
from typing import Any

from savepoint.codecs import dtypes
from savepoint.codecs import manifest as mf
from savepoint.distributed import layout, plan
from savepoint.distributed.pieces import Indexed, Records
from savepoint.engine import save as save_engine
from savepoint.engine import sinks

__all__ = ["grid_manifest", "manifest"]


def grid_manifest(
    global_plan: plan.GlobalPlan,
    lay: layout.Layout,
    results: list[Indexed],
    metadata: dict[str, Any],
) -> mf.Manifest:
    """Manifest version 7 of a regular save: the tensor table (each tensor's grid), every
    rank's data files and index file; no piece listed (they are in the indexes)."""
    files: dict[str, mf.FileRecord] = {}
    indices: dict[str, mf.IndexRecord] = {}
    for rank_files, name, index in results:
        files.update(rank_files)
        indices[name] = index
    tensors = {}
    for key, (dtype, shape) in global_plan.tensors.items():
        nbytes = math.prod(shape) * dtypes.from_name(dtype).itemsize
        tensors[key] = mf.TensorRecord(dtype, shape, "", 0, nbytes, "")
    written = sinks.Written(dict(sorted(files.items())), tensors, mf.GRID)
    manifest = save_engine.new_manifest(
        global_plan.tree, [written], metadata, world_size=len(results)
    )
    manifest.mesh = lay.mesh
    manifest.indices = indices
    manifest.grids = dict(zip(lay.keys, lay.dims))
    return manifest


def manifest(
    global_plan: plan.GlobalPlan,
    results: list[Records],
    metadata: dict[str, Any],
    world: int,
    blob_place: tuple[str, str] | None = None,
) -> mf.Manifest:
    """The manifest of what every rank wrote, from the writer's one builder: the files in name
    order, each tensor's shards in region order; version 3 (block checksums), 4 or 5 when the
    pieces went to the blob store ``blob_place`` (5: a patched one)."""
    files: dict[str, mf.FileRecord] = {}
    shards: dict[str, list[mf.ShardRecord]] = {}
    for rank_files, rank_shards in results:
        files.update(rank_files)
        for key, record in rank_shards:
            shards.setdefault(key, []).append(record)
    tensors = {
        key: mf.whole(
            dtype, shape, tuple(sorted(shards[key], key=lambda s: plan.region_order(s.region)))
        )
        for key, (dtype, shape) in global_plan.tensors.items()
    }
    version = mf.BLOCKED
    if blob_place is not None:
        patched = any(
            s.recipe is not None and s.recipe.patches for pieces in shards.values() for s in pieces
        )
        version = mf.PATCHES if patched else mf.BLOBS
    # What the reader's parser checks holds by construction: merge() checked that the pieces of
    # every tensor tile it, the writer recorded each piece's byte range and checksum (the tests
    # parse every manifest written; parsing here too would cost ~10 ms per 1000 shards).
    written = sinks.Written(dict(sorted(files.items())), tensors, version, blob_place)
    return save_engine.new_manifest(global_plan.tree, [written], metadata, world_size=world)
