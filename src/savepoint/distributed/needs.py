"""Which data files a load reads, worked out from the manifest alone, before any file is there.

:func:`files_needed` answers for ``sp.load(path, into=..., keys=...)`` on one rank: the files
holding the shards that overlap the regions this rank's targets hold (a plain tensor: all of it;
a ``Shard``, ``FlatShard`` or sharded DTensor: its box or range), found with the same planners
as the load itself (:func:`savepoint.state.restore.plan` over the targets, as
:mod:`savepoint.distributed.load` swaps them, and :func:`savepoint.distributed.plan.plan_reads`
for the overlaps); tensors the load makes fresh, and a load without ``into``, need every file of
the tensors under ``keys``. A restore that must bring the files to the rank first (the peer
tier, :mod:`savepoint.runs.peers`) fetches exactly these, then loads with the ordinary loader.

Nothing is read and nothing is modified (the targets swapped for planning are put back). A plan
with problems (a missing key, a shape that differs) needs every file of the tensors under
``keys``: the load that follows reports the problems.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from savepoint.codecs import boxes
from savepoint.codecs import manifest as mf
from savepoint.distributed import plan, shard
from savepoint.engine import load as load_engine
from savepoint.engine.read import files_of
from savepoint.state import restore, tree

__all__ = ["files_needed"]


def files_needed(
    manifest: mf.Manifest, shown: str, *, into: Any = None, keys: Iterable[str] | str | None = None
) -> set[str]:
    """The data files a load of ``keys`` into ``into`` reads on this rank (see the module
    docstring). ``shown``: how messages name the checkpoint."""
    load_engine.records_as_dict(manifest)
    root = load_engine.select(shown, manifest, keys)
    everything = files_of(manifest, tree.refs(root))
    if into is None:
        return everything
    planned, swaps, specs = shard.swap_targets(into)
    try:
        p = restore.plan(root, planned, manifest.tensors)
        if p.problems:
            return everything
        found = files_of(manifest, p.fresh)
        for ref, target, key in p.inplace:
            rec = manifest.tensors[ref]
            layout = rec.layout()
            region = _region(target, specs.get(id(target)), key, rec.shape)
            for op in plan.plan_reads(rec.shape, [s.region for s in layout], region):
                found.add(layout[op.shard].file)
    finally:
        shard.restore(swaps)
    found.discard("")  # shards stored as blobs
    return found


def _region(
    target: Any, spec: shard.Shard | shard.FlatShard | None, key: str, shape: tuple[int, ...]
) -> boxes.Region:
    """The region of the saved tensor that ``target`` receives (as the load works it out)."""
    if spec is None and shard.is_dtensor(target):
        converted = shard.from_dtensor(target, key)
        spec = converted if isinstance(converted, shard.Shard) else None
    if isinstance(spec, shard.Shard):
        return spec.box
    if isinstance(spec, shard.FlatShard):
        return spec.region
    return boxes.full(shape)
