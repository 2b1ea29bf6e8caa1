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

:func:`direct_ranges` answers, with the same planners, which of those bytes can be received
straight into the targets' memory (a stored shard read whole into one contiguous run of a plain
CPU array or tensor): the peer tier lands them there as they arrive and leaves the rest to the
loader, those targets set aside.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterable
from typing import Any

import numpy as np

from savepoint.codecs import boxes, dtypes
from savepoint.codecs import manifest as mf
from savepoint.distributed import plan, shard
from savepoint.engine import load as load_engine
from savepoint.engine.read import files_of
from savepoint.state import restore, tree

__all__ = ["Direct", "direct_ranges", "files_needed"]


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


@dataclasses.dataclass
class Direct:
    """A tensor whose stored bytes land straight in its target's memory: ``memory`` (a flat
    uint8 view of it), which ``parent[key]`` (a dict of ``into``) holds, and ``ranges``: (file,
    start, end, offset) for each stored shard, bytes ``[start, end)`` of ``file`` going to
    ``memory[offset : offset + end - start]``."""

    ref: str
    memory: Any
    parent: dict[Any, Any]
    key: Any
    ranges: list[tuple[str, int, int, int]]


def direct_ranges(manifest: mf.Manifest, shown: str, into: Any, fetched: set[str]) -> list[Direct]:
    """For a load of the whole checkpoint into ``into`` that brings the files ``fetched`` over
    a wire first, the tensors whose every stored byte can be received straight into their
    target's memory: a C-contiguous CPU array or tensor reached from ``into`` through dicts,
    nothing converted, each stored shard read whole into one contiguous run of it, every file
    of theirs fetched, and no other tensor of this load read from those files. Empty when the
    plan has problems (the load reports them). Nothing is read or modified."""
    load_engine.records_as_dict(manifest)
    root = load_engine.select(shown, manifest, None)
    planned, swaps, specs = shard.swap_targets(into)
    try:
        p = restore.plan(root, planned, manifest.tensors)
        if p.problems:
            return []
        homes = _homes(planned)
        reads: dict[str, set[str]] = {ref: files_of(manifest, {ref}) for ref in p.fresh}
        direct: dict[str, Direct] = {}
        seen = [ref for ref, _, _ in p.inplace] + [str(id(t)) for _, t, _ in p.inplace]
        tied = {x for x in seen if seen.count(x) > 1}  # a tied tensor, a target met twice
        for ref, target, key in p.inplace:
            rec = manifest.tensors[ref]
            layout = rec.layout()
            spec = specs.get(id(target))
            region = _region(target, spec, key, rec.shape)
            ops = plan.plan_reads(rec.shape, [s.region for s in layout], region)
            reads[ref] = {layout[op.shard].file for op in ops}
            home = homes.get(id(target))
            if home is None or not (spec is None or isinstance(spec, shard.Shard)):
                continue
            if ref in tied or str(id(target)) in tied:
                continue
            memory = _memory(target if spec is None else spec.local)
            ranges = [_direct(rec, layout[op.shard], op, memory, fetched) for op in ops]
            if memory is not None and ops and all(r is not None for r in ranges):
                direct[ref] = Direct(ref, memory, *home, [r for r in ranges if r is not None])
        while True:  # a file another read of this load needs is not received into targets
            shared = {f for ref, files in reads.items() if ref not in direct for f in files}
            gone = [ref for ref, d in direct.items() if any(r[0] in shared for r in d.ranges)]
            if not gone:
                return list(direct.values())
            for ref in gone:
                del direct[ref]
    finally:
        shard.restore(swaps)


def _homes(planned: Any) -> dict[int, tuple[dict[Any, Any], Any]]:
    """id(target) -> (the dict holding it, its key), for the leaves reached through dicts
    (a leaf met twice has no home: taking it out of one dict would leave it in the other)."""
    out: dict[int, tuple[dict[Any, Any], Any]] = {}
    twice: set[int] = set()
    stack = [planned]
    while stack:
        obj = stack.pop()
        if isinstance(obj, dict):
            for key, value in obj.items():
                stack.append(value)
                if id(value) in out:
                    twice.add(id(value))
                out[id(value)] = (obj, key)
    return {i: home for i, home in out.items() if i not in twice}


def _memory(target: Any) -> Any:
    """A writable flat uint8 view of ``target``'s memory (a C-contiguous CPU numpy array or
    torch tensor, on a little-endian machine), else None."""
    if sys.byteorder != "little":
        return None
    if isinstance(target, np.ndarray):
        if target.flags.c_contiguous and target.flags.writeable and target.size:
            return target.reshape(-1).view(np.uint8)
        return None
    torch = sys.modules.get("torch")
    if torch is None or type(target) not in (torch.Tensor, torch.nn.Parameter):
        return None
    if target.device.type != "cpu" or not target.is_contiguous() or target.numel() == 0:
        return None
    if target.is_quantized or target.is_sparse or target.is_conj() or target.is_neg():
        return None
    return target.detach().reshape(-1).view(torch.uint8).numpy()


def _direct(
    rec: Any, stored: Any, op: plan.ReadOp, memory: Any, fetched: set[str]
) -> tuple[str, int, int, int] | None:
    """(file, start, end, byte offset in the target) when ``op`` reads the whole stored shard
    into one contiguous run of the target, raw; else None."""
    if memory is None or stored.recipe is not None or stored.file not in fetched:
        return None
    if isinstance(stored.region, boxes.Flat) or isinstance(op.region, boxes.Flat):
        return None
    count = boxes.volume(op.region)
    itemsize = dtypes.from_name(rec.dtype).itemsize
    if count != boxes.volume(stored.region) or stored.end - stored.start != count * itemsize:
        return None
    common, extents = boxes.extents(op.region), boxes.extents(op.dst.box)
    inner = [i for i, (c, e) in enumerate(zip(common, extents)) if c != e]
    if inner and any(c != 1 for c in common[: inner[-1]]):
        return None  # not one contiguous run of the target's buffer
    offset = 0
    for (start, _), (lo, hi) in zip(op.region, op.dst.box):
        offset = offset * (hi - lo) + (start - lo)
    offset = (offset + op.dst.offset) * itemsize
    if offset + count * itemsize > memory.size:
        return None
    return stored.file, stored.start, stored.end, offset
