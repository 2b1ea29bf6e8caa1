"""Which data files a load reads, worked out from the manifest alone, before any file is there.

:func:`files_needed` answers for ``sp.load(path, into=..., keys=...)`` on one rank: the files
holding the shards that overlap the regions this rank's targets hold (a plain tensor: all of it;
a ``Shard``, ``FlatShard`` or sharded DTensor: its box or range), found with the same planners
as the load itself (:func:`savepoint.state.restore.plan` over the targets, as
:mod:`savepoint.distributed.load` swaps them, and :func:`savepoint.distributed.plan.plan_reads`
for the overlaps); tensors the load makes fresh, and a load without ``into``, need every file of
the tensors under ``keys``. A restore that must bring the files to the rank first (the peer
tier, :mod:`savepoint.runs.peers`) fetches exactly these, then loads with the ordinary loader.

Nothing is read and nothing is modified (the targets swapped for planning are put back); of a
version 7 manifest read lazily (:mod:`savepoint.codecs.manifest._v7_lazy`) only the records of
the pieces the plan meets are asked for, as in the load itself. A plan with problems (a missing key, a shape that differs) needs every file of the tensors under
``keys``: the load that follows reports the problems.

:func:`direct_ranges` answers, with the same planners, which of those bytes can be received
straight into the targets' memory (a stored shard read whole into one contiguous run of a plain
CPU array or tensor): the peer tier lands them there as they arrive and leaves the rest to the
loader, those targets set aside.
"""

from __future__ import annotations

import collections
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

__all__ = ["Direct", "direct_ranges", "files_needed", "needs_and_direct"]


def files_needed(
    manifest: mf.Manifest, shown: str, *, into: Any = None, keys: Iterable[str] | str | None = None
) -> set[str]:
    """The data files a load of ``keys`` into ``into`` reads on this rank (see the module
    docstring). ``shown``: how messages name the checkpoint."""
    return _needs(manifest, shown, into, keys, None)[0]


def needs_and_direct(manifest: mf.Manifest, shown: str, into: Any) -> tuple[set[str], list[Direct]]:
    """:func:`files_needed` of a load of the whole checkpoint into ``into``, and
    :func:`direct_ranges` of those files (every one of them fetched), from one plan."""
    return _needs(manifest, shown, into, None, True)


def _needs(
    manifest: mf.Manifest,
    shown: str,
    into: Any,
    keys: Iterable[str] | str | None,
    fetched: set[str] | bool | None,
) -> tuple[set[str], list[Direct]]:
    """The files a load reads, and (``fetched`` not None: those files, True: every file it
    reads) the tensors received straight into their targets."""
    load_engine.records_as_dict(manifest)
    root = load_engine.select(shown, manifest, keys)
    if into is None:
        return files_of(manifest, tree.refs(root)), []
    planned, swaps, specs = shard.swap_targets(into)
    try:
        p = restore.plan(root, planned, manifest.tensors)
        if p.problems:
            return files_of(manifest, tree.refs(root)), []
        found = files_of(manifest, p.fresh)
        reads: list[_Read] = []
        for ref, target, key in p.inplace:
            rec = manifest.tensors[ref]
            layout = rec.layout()
            spec = specs.get(id(target))
            region = _region(target, spec, key, rec.shape)
            ops = plan.record_reads(rec, region)
            found.update(layout[op.shard].file for op in ops)
            reads.append((ref, target, rec, layout, spec, ops))
        found.discard("")  # shards stored as blobs
        if fetched is None or fetched is False:
            return found, []
        files = found if fetched is True else fetched
        return found, _direct_reads(manifest, p.fresh, reads, planned, files)
    finally:
        shard.restore(swaps)


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
    target's memory: a C-contiguous CPU array or tensor reached from ``into`` through dicts
    (once), nothing converted, each stored shard read whole into one contiguous run of it, every
    file of theirs fetched, and no other tensor of this load read from those files. Empty when
    the plan has problems (the load reports them). Nothing is read or modified."""
    return _needs(manifest, shown, into, None, fetched)[1]


# One in-place read of a load: ref, the planned target, its record, layout, spec, read ops.
_Read = tuple[str, Any, Any, Any, Any, list[plan.ReadOp]]


def _direct_reads(
    manifest: mf.Manifest, fresh: set[str], reads: list[_Read], planned: Any, fetched: set[str]
) -> list[Direct]:
    """:func:`direct_ranges` of the planned ``reads`` (see there)."""
    homes = _homes(planned)
    counts = collections.Counter(r[0] for r in reads) + collections.Counter(id(r[1]) for r in reads)
    files: dict[str, set[str]] = {ref: files_of(manifest, {ref}) for ref in fresh}
    direct: dict[str, Direct] = {}
    for ref, target, rec, layout, spec, ops in reads:
        files[ref] = {layout[op.shard].file for op in ops}
        home = homes.get(id(target))
        if home is None or not (spec is None or isinstance(spec, shard.Shard)):
            continue
        if counts[ref] > 1 or counts[id(target)] > 1:  # a tied tensor, a target met twice
            continue
        memory = _memory(target if spec is None else spec.local)
        ranges = [_direct(rec, layout[op.shard], op, memory, fetched) for op in ops]
        if memory is not None and ops and all(r is not None for r in ranges):
            direct[ref] = Direct(ref, memory, *home, [r for r in ranges if r is not None])
    # a file another read of this load needs is not received into targets (nor, in turn, the
    # other files of a tensor that loses its place for it)
    shared = {f for ref, names in files.items() if ref not in direct for f in names}
    users: dict[str, list[str]] = {}
    for ref, d in direct.items():
        for name in {r[0] for r in d.ranges}:
            users.setdefault(name, []).append(ref)
    queue = list(shared)
    while queue:
        for ref in users.get(queue.pop(), ()):
            if direct.pop(ref, None) is not None:
                fresh = files[ref] - shared
                shared |= fresh
                queue.extend(fresh)
    return list(direct.values())


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
