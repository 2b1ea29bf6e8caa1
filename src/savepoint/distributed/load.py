"""Loading a checkpoint on any number of ranks, each reading only what it needs.

Call order (``load(path, into=state, process_group=pg)`` on every rank of ``pg``):

1. **plan** (all ranks): open the checkpoint (every rank reads the manifest itself), match
   ``into`` against it with the same planner as an unsharded load (keys, shapes, dtypes: every
   problem reported before anything is modified), then work out, for each target, the region of
   the tensor it holds (a plain tensor: all of it; a Shard, FlatShard or DTensor: its box or range)
   and which pieces of which shards overlap it (:func:`~savepoint.distributed.plan.plan_reads`).
   The ranks then agree: if planning failed anywhere, every rank raises and no rank has modified
   anything;
   With ``read_once`` (the default) each rank also tells rank 0 which bytes of which shards it
   would read, and rank 0 plans the bytes several ranks need (a replicated tensor, the blocks
   around two ranks' parts) to be read once (:mod:`~savepoint.distributed.readonce`);
2. **read** (all ranks): each rank maps the data files holding its shards and copies exactly the
   overlapping elements into its targets (in place for CPU targets, through a host buffer for
   device tensors), checking each shard it touches against its checksum (by block where the
   shard has block checksums); bytes planned to be read once are read and checked by one rank
   and sent to the others over savepoint's gloo group (:mod:`._fetch`); then Stateful objects
   get ``load_state_dict``. The ranks agree again: a failure anywhere raises on all.

Each step is a phase with the deadline ``timeout`` (``"load: plan"``, ``"load: read"``, and
``"load: read-once round k"`` for each round of read-once chunks): a rank that misses it is
named with the phase in the error every rank raises (:mod:`savepoint.distributed.deadlines`).

Without a process group the same two steps run in one process (a single rank restoring Shard
targets, say), and errors pass through unchanged. Loading without ``into`` returns every tensor
whole on every rank (read once too, unless ``mmap``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Literal, TypeVar

import numpy as np

from savepoint.codecs import boxes, dtypes
from savepoint.codecs import manifest as mf
from savepoint.distributed import _fetch, collectives, plan, readonce, shard
from savepoint.engine import load as load_engine
from savepoint.engine.read import Needs, Reader, RegionCopy, ShardTask
from savepoint.errors import (
    IncompatibleCheckpointError,
    ReplacedWhileReadingError,
    StateMismatchError,
)
from savepoint.state import arrays, restore, tree
from savepoint.storage.paths import PathArg
from savepoint.storage.paths import resolve as resolve_path

__all__ = ["load"]

T = TypeVar("T")

Progress = Callable[[int, int], None]


class _Target:
    """One tensor to fill: ``region`` of tensor ``ref``, into ``dst`` (uint8, the region's bytes)
    which is the target itself or a host buffer copied into it afterwards."""

    __slots__ = ("after", "dst", "ref", "region")

    def __init__(
        self,
        ref: str,
        region: boxes.Region,
        dst: np.ndarray[Any, Any],
        after: Callable[[], None] | None,
    ) -> None:
        self.ref = ref
        self.region = region
        self.dst = dst
        self.after = after


def load(
    path: PathArg,
    *,
    into: Any = None,
    keys: Iterable[str] | str | None = None,
    verify: bool | Literal["first"] = True,
    framework: load_engine.Framework = "auto",
    device: Any = None,
    mmap: bool = False,
    progress: Progress | None = None,
    process_group: Any = None,
    timeout: float | None = None,
    read_once: bool = True,
) -> Any:
    """``sp.load`` with a process group or sharded targets: see the module docstring."""
    location = resolve_path(path, what="checkpoint path")
    target = location.store.url(location.path)
    coord = collectives.coordinator(process_group, timeout)
    sharing = read_once and coord.moves_data and coord.world_size > 1
    held: dict[str, Any] = {}
    swaps: list[shard.Swap] = []

    def plan_local() -> list[readonce.Entry] | None:
        reader = Reader.open(
            location,
            copy_on_write=mmap and into is None,
            needs=_needs(into, keys),
            lazy_indexes=into is not None,
        )
        held["reader"] = reader
        root = load_engine.select(reader.shown, reader.manifest, keys)
        held["root"] = root
        if into is not None:
            planned, new_swaps, specs = shard.swap_targets(into)
            swaps.extend(new_swaps)
            p = restore.plan(root, planned, reader.manifest.tensors)
            if p.problems:
                raise StateMismatchError(p.problems, path=reader.shown)
            held["plan"] = p
            held["targets"] = _targets(reader, p, specs, root, framework, held)
        elif sharing and not mmap:
            held["targets"] = _fresh(reader, root, framework, held)
        if "targets" not in held:
            return None
        held["tasks"] = _tasks(reader, held["targets"], verify)
        if not sharing:
            return None
        entries = _fetch.entries(reader, held["tasks"], verify)
        held["entries"] = entries
        return entries

    def read_local() -> Any:
        reader: Reader = held["reader"]
        root = held["root"]
        if "targets" not in held:
            counter = load_engine.counter(progress, reader.manifest, tree.refs(root))
            return load_engine.load_tree(reader, root, verify, framework, device, mmap, counter)
        _fill(reader, coord, held, verify, progress)
        getter = load_engine.getter(held["made"], device)
        if into is None:
            return tree.build(root, getter)
        return held["plan"].finish(getter)

    def read_and_keep() -> None:
        # The loaded tree stays on this rank; only success or failure travels between ranks.
        held["result"] = read_local()

    try:
        with coord.exclusive():
            held["reads"] = coord.step(
                "loading", target, _still_there(plan_local, held), _plan_reads, phase="load: plan"
            )
            coord.step("loading", target, read_and_keep, phase="load: read")
    finally:
        shard.restore(swaps)
        reader = held.get("reader")
        if reader is not None:
            reader.close()
    return into if into is not None else held["result"]


def _needs(into: Any, keys: Iterable[str] | str | None) -> Needs:
    """The data files ``Reader.open`` pins: every file of the tensors under ``keys``; with
    ``into``, of a version 7 checkpoint (read lazily: :mod:`savepoint.codecs.manifest._v7_lazy`)
    none: ``plan_local`` opens those its reads need once they are planned (through the pinned
    directory; naming them here would plan twice, or read every index)."""
    every = load_engine.files_needed(keys)
    if into is None:
        return every

    def needs(shown: str, manifest: mf.Manifest) -> Iterable[str]:
        if isinstance(manifest.tensors, mf.GridTensors):
            return ()
        return every(shown, manifest)

    return needs


def _still_there(plan: Callable[[], T], held: dict[str, Any]) -> Callable[[], T]:
    """``plan``, where a version 7 checkpoint read lazily reads its index files after it was
    opened: one missing (or other than recorded) because the checkpoint was deleted or replaced
    since is not damage but ReplacedWhileReadingError ("load again"), as for its data files."""

    def run() -> T:
        try:
            return plan()
        except mf.ManifestError as exc:  # (only a lazy index read raises it after the open)
            reader: Reader | None = held.get("reader")
            gone = None if reader is None else reader.generation.left_its_path()
            if reader is None or gone is None:
                raise
            raise ReplacedWhileReadingError(
                f"{reader.shown} was {gone} while it was being read ({exc}); load again",
                path=reader.shown,
            ) from None

    return run


def _plan_reads(found: list[list[readonce.Entry] | None]) -> readonce.Plan | None:
    """Rank 0's read-once plan from every rank's entries; None where a rank has none to give
    (``read_once=False``, or a load without targets): then every rank reads what it needs."""
    if any(entries is None for entries in found):
        return None
    return readonce.plan([entries or [] for entries in found])


def _fill(
    reader: Reader,
    coord: collectives.Coordinator,
    held: dict[str, Any],
    verify: bool | Literal["first"],
    progress: Progress | None,
) -> None:
    """Fill the planned targets (``held``: see :func:`load`), read-once where planned."""
    targets: list[_Target] = held["targets"]
    tasks: list[ShardTask] = held["tasks"]
    counter = None
    if progress is not None:
        counter = load_engine.Counter(progress, sum(t.dst.nbytes for t in targets))
    reader.prepare_files(_files(reader, tasks), check_header=bool(verify))
    mine = held.get("entries", ())
    _fetch.read(reader, coord, held.get("reads"), tasks, mine, verify, counter)
    for t in targets:
        if t.after is not None:
            t.after()


def _files(reader: Reader, tasks: list[ShardTask]) -> set[str]:
    """The data files the tasks read."""
    files = {reader.manifest.tensors[ref].layout()[i].file for ref, i, _ in tasks}
    files.discard("")  # shards stored as blobs (an incremental save's)
    return files


def _targets(
    reader: Reader,
    p: restore.Plan,
    specs: dict[int, shard.Shard | shard.FlatShard],
    root: tree.Node,
    framework: load_engine.Framework,
    held: dict[str, Any],
) -> list[_Target]:
    """Every tensor to fill, with the region of the saved tensor it receives."""
    manifest = reader.manifest
    out: list[_Target] = []
    for ref, target, key in p.inplace:
        spec = specs.get(id(target))
        if spec is None and shard.is_dtensor(target):
            converted = shard.from_dtensor(target, key)
            spec = converted if isinstance(converted, shard.Shard) else None
            target = converted if spec is None else target
        rec = manifest.tensors[ref]
        if spec is None:
            region: boxes.Region = boxes.full(rec.shape)
            local = target
        elif isinstance(spec, shard.Shard):
            region, local = spec.box, spec.local
        else:
            region, local = spec.region, spec.local
        out.append(_target(reader, ref, key, region, local))
    kinds = load_engine.kinds(root)
    made = {ref: reader.allocate(ref, kinds[ref], framework) for ref in p.fresh}
    held["made"] = made
    for ref, obj in made.items():
        view = arrays.byte_view(obj)
        assert view is not None
        out.append(_Target(ref, boxes.full(manifest.tensors[ref].shape), view, None))
    return out


def _fresh(
    reader: Reader, root: tree.Node, framework: load_engine.Framework, held: dict[str, Any]
) -> list[_Target]:
    """Every tensor under ``root``, allocated whole, to fill (a load without ``into``)."""
    made = {
        ref: reader.allocate(ref, kind, framework) for ref, kind in load_engine.kinds(root).items()
    }
    held["made"] = made
    out = []
    for ref, obj in made.items():
        view = arrays.byte_view(obj)
        assert view is not None
        out.append(_Target(ref, boxes.full(reader.manifest.tensors[ref].shape), view, None))
    return out


def _target(reader: Reader, ref: str, key: str, region: boxes.Region, local: Any) -> _Target:
    rec = reader.manifest.tensors[ref]
    d = dtypes.from_name(rec.dtype)
    described = arrays.describe(local)
    expected = boxes.size(region, rec.shape)
    if described is None or described[0] != rec.dtype or int(np.prod(described[1])) != expected:
        raise IncompatibleCheckpointError(
            f"{reader.shown}: {key}: the local part ({described}) does not hold "
            f"{boxes.show(region)} of {rec.dtype}{list(rec.shape)}",
            path=reader.shown,
        )
    view = arrays.byte_view(local)
    if view is not None:
        return _Target(ref, region, view, None)
    host = np.empty(expected * d.itemsize, dtype=np.uint8)

    def copy_back() -> None:
        shaped = host.view(d.numpy).reshape(tuple(described[1]))
        if isinstance(local, np.ndarray):
            if not local.flags.writeable:
                raise IncompatibleCheckpointError(
                    f"{reader.shown}: cannot restore {key!r} into a read-only numpy array",
                    path=reader.shown,
                )
            np.copyto(local, shaped, casting="no")
        else:
            from savepoint.state import torch_tensors

            torch_tensors.copy_into(local, shaped, d)

    return _Target(ref, region, host, copy_back)


def _tasks(
    reader: Reader, targets: list[_Target], verify: bool | Literal["first"]
) -> list[ShardTask]:
    """One task per shard touched, holding every copy out of it; the data files they read
    opened now where ``Reader.open`` opened none (a version 7 checkpoint: see :func:`_needs`)."""
    by_shard: dict[tuple[str, int], list[RegionCopy]] = {}
    for t in targets:
        rec = reader.manifest.tensors[t.ref]
        typed = t.dst.view(dtypes.from_name(rec.dtype).numpy)
        for op in plan.record_reads(rec, t.region):
            dst = typed[op.dst.offset : op.dst.offset + boxes.volume(op.dst.box)]
            dst = dst.reshape(boxes.extents(op.dst.box))
            origin = tuple(start for start, _ in op.dst.box)
            copy = RegionCopy(op.src, op.region, dst, origin)
            by_shard.setdefault((t.ref, op.shard), []).append(copy)
    tasks: list[ShardTask] = [(ref, i, copies) for (ref, i), copies in by_shard.items()]
    if isinstance(reader.manifest.tensors, mf.GridTensors):
        reader.prepare_files(_files(reader, tasks), check_header=bool(verify))
    return tasks
