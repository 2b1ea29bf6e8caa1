"""A world of N ranks in one process: the real sharded-save protocol, collectives recorded.

Nobody can rent 8,192 GPUs to test a checkpointing library, but what breaks at that scale in a
sharded save is planning and bookkeeping, which one process can run for every rank:
:func:`simulate_save` runs the real save of :mod:`savepoint.distributed.save` (each rank's
``describe`` and local plan, rank 0's :func:`~savepoint.distributed.plan.merge`, the staging
transaction, the manifest built by the writer's one builder and its commit) once per simulated
rank, each rank on a thread of its own, through :class:`SimCoordinator`: a
:class:`~savepoint.distributed.collectives.TorchCoordinator` (its step protocol, failures
included, unchanged) whose object collectives are replaced by an in-process exchange that
records what the real gloo path would send (:mod:`savepoint.distributed.traffic`: the payloads
pickled by the same serializer, padded and length-prefixed as ``collectives`` does).

The ranks run one at a time, in rank order, each until its next collective (a round robin of
threads: rank 0 combines alone while the others wait), so each rank's share is timed without
the others'. The pieces are not written (:class:`SimWriter` returns the records a writer would,
with placeholder checksums), unless ``writer="real"`` (small states: the tests compare the
manifest with a real run's, byte for byte).

The states (:func:`model_state`) are those of real models, as shard descriptions whose local
parts are zero-byte numpy views (nothing allocated): dense transformer layers under FSDP
(``Shard(0)`` over every rank) or FSDP x TP (a 2-d mesh), MoE experts stacked and spread over
the ranks, and Adam's ``exp_avg``/``exp_avg_sq`` beside each parameter. A DTensor's box comes
from :func:`savepoint.distributed.shard.dtensor_box`, the function reading real DTensors uses,
driven by a mesh that only knows its coordinates.
"""

from __future__ import annotations

import gc
import math
import pickle
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from savepoint.codecs import checksum, dtypes
from savepoint.codecs import manifest as mf
from savepoint.distributed import collectives, layout, plan, plancache, save, shard
from savepoint.distributed.pieces import Records, file_name
from savepoint.distributed.traffic import Traffic
from savepoint.info import CheckpointInfo
from savepoint.options import SaveOptions
from savepoint.state import tree
from savepoint.state.arrays import TensorSource
from savepoint.storage.paths import Location
from savepoint.storage.paths import resolve as resolve_path

__all__ = [
    "Placement",
    "SimCoordinator",
    "SimResult",
    "SimWriter",
    "World",
    "model_state",
    "simulate_save",
]


# ---------------------------------------------------------------------------------------------
# the world: ranks on threads, one at a time, collectives through slots
# ---------------------------------------------------------------------------------------------


class _Diverged(RuntimeError):
    """The simulated ranks did not run the same collectives (a bug in the protocol)."""


class World:
    """N simulated ranks: :meth:`run` calls ``fn(coordinator)`` for each, on threads that take
    turns in rank order, switching at each collective."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.traffic = Traffic(size)
        self._turn = [threading.Event() for _ in range(size)]
        self._done = threading.Event()
        self._finished = [False] * size
        self._ops: dict[int, dict[str, Any]] = {}  # collective number -> its slots

    def run(self, fn: Callable[[SimCoordinator], Any]) -> list[Any]:
        """Every rank's result (or the exception it raised), by rank."""
        coords = [SimCoordinator(self, r) for r in range(self.size)]
        results: list[Any] = [None] * self.size

        def body(r: int) -> None:
            self._turn[r].wait()
            try:
                results[r] = fn(coords[r])
            except BaseException as exc:
                results[r] = exc
            self._finished[r] = True
            self._pass(r)

        old = threading.stack_size(1 << 20)
        try:
            threads = [
                threading.Thread(target=body, args=(r,), daemon=True) for r in range(self.size)
            ]
            for t in threads:
                t.start()
        finally:
            threading.stack_size(old)
        self._turn[0].set()
        self._done.wait()
        for t in threads:
            t.join()
        self.coordinators = coords
        return results

    def _pass(self, r: int) -> None:
        """Hand the turn to the next rank that has not finished (or end the run)."""
        for step in range(1, self.size + 1):
            nxt = (r + step) % self.size
            if not self._finished[nxt]:
                self._turn[nxt].set()
                return
        self._done.set()

    def _yield(self, r: int) -> None:
        if any(self._finished):
            raise _Diverged(f"rank {r} joined a collective another rank never reached")
        self._turn[r].clear()
        self._pass(r)
        self._turn[r].wait()

    def meet(
        self, r: int, number: int, deposit: Callable[[dict[str, Any]], None]
    ) -> dict[str, Any]:
        """Rank ``r`` at collective ``number``: ``deposit`` into its slots, wait for every
        rank to have deposited, return the slots (freed once every rank has read them)."""
        slots = self._ops.setdefault(number, {"read": 0})
        deposit(slots)
        self._yield(r)
        slots["read"] += 1
        if slots["read"] == self.size:
            del self._ops[number]
        return slots


class SimCoordinator(collectives.TorchCoordinator):
    """One simulated rank: the real step protocol, collectives through its :class:`World`."""

    def __init__(self, world: World, rank: int) -> None:  # no process group
        self.world = world
        self.rank = rank
        self.world_size = world.size
        self.timeout = collectives.DEFAULT_TIMEOUT
        self._ranks = tuple(range(world.size))
        self._channel = None
        self._collectives = 0
        self._phase = ""
        self.memo_key = ("sim", id(world), rank)  # plan caching (plancache.key)
        self.saves: list[dict[str, dict[str, float]]] = []  # per save: phase -> part -> s
        self.times: dict[str, dict[str, float]] = {}  # the current save's

    def new_save(self) -> None:
        self.times = {}
        self.saves.append(self.times)

    moves_data = False  # read-once loads are not simulated

    # -- timing -------------------------------------------------------------------------------

    def _time(self, part: str, fn: Callable[[], Any]) -> Any:
        t0 = time.perf_counter()
        try:
            return fn()
        finally:
            parts = self.times.setdefault(self._phase, {})
            parts[part] = parts.get(part, 0.0) + time.perf_counter() - t0

    def step(
        self,
        what: str,
        path: str,
        local: Callable[[], Any],
        combine: Callable[[list[Any]], Any] | None = None,
        *,
        each: bool = False,
        cleanup: Callable[[], None] | None = None,
        phase: str | None = None,
        combine_phase: str | None = None,
    ) -> Any:
        self._phase = phase or what
        timed_combine = None
        if combine is not None:
            c = combine

            def timed_combine(values: list[Any]) -> Any:
                return self._time("combine", lambda: c(values))

        return super().step(
            what,
            path,
            lambda: self._time("local", local),
            timed_combine,
            each=each,
            cleanup=cleanup,
            phase=phase,
            combine_phase=combine_phase,
        )

    # -- the object collectives (payloads as collectives._gather etc. send them) --------------

    def _encode(self, obj: Any) -> bytes:
        data: bytes = self._time("encode", lambda: collectives.encoded(obj))
        return data

    def _decode(self, data: bytes) -> Any:
        # In-memory, between the simulated ranks of this process (as collectives._decode).
        return self._time("decode", lambda: pickle.loads(data))

    def _meet(self, deposit: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        self._collectives += 1
        return self.world.meet(self.rank, self._collectives, deposit)

    def _gather_objects(self, obj: Any) -> list[Any] | None:
        if self.world_size == 1:
            return [obj]
        data = self._encode(obj)
        rank = self.rank

        def deposit(slots: dict[str, Any]) -> None:
            slots.setdefault("data", [b""] * self.world_size)[rank] = data

        slots = self._meet(deposit)
        if rank != 0:
            return None
        payloads = slots["data"]
        self.world.traffic.gather([len(p) for p in payloads])
        return [self._decode(p) for p in payloads]

    def _broadcast_object(self, obj: Any) -> Any:
        if self.world_size == 1:
            return obj
        data = self._encode(obj) if self.rank == 0 else b""

        def deposit(slots: dict[str, Any]) -> None:
            if self.rank == 0:
                slots["root"] = data
                self.world.traffic.broadcast(len(data))

        slots = self._meet(deposit)
        # Every rank decodes the same bytes: decoded once, the time counted on every rank (N
        # copies of a committed manifest would not fit in this process's memory).
        if "decoded" not in slots:
            t0 = time.perf_counter()
            slots["decoded"] = self._decode(slots["root"])
            slots["took"] = time.perf_counter() - t0
        else:
            parts = self.times.setdefault(self._phase, {})
            parts["decode"] = parts.get("decode", 0.0) + slots["took"]
        return slots["decoded"]

    def _scatter_objects(self, objs: Sequence[Any] | None) -> Any:
        if self.world_size == 1:
            assert objs is not None
            return objs[0]
        encoded: list[bytes] = []
        if objs is not None and self.rank == 0:  # as collectives._scatter: a repeat encoded once
            once: dict[int, bytes] = {}
            for o in objs:
                if id(o) not in once:
                    once[id(o)] = self._encode(o)
                encoded.append(once[id(o)])

        def deposit(slots: dict[str, Any]) -> None:
            if self.rank == 0:
                slots["root"] = encoded
                self.world.traffic.scatter([len(e) for e in encoded])

        return self._decode(self._meet(deposit)["root"][self.rank])

    def all_flags(self, flag: int, *, phase: str | None = None) -> list[int]:
        if self.world_size == 1:
            return [flag]
        rank = self.rank

        def deposit(slots: dict[str, Any]) -> None:
            slots.setdefault("flags", [0] * self.world_size)[rank] = int(flag)
            if rank == 0:
                self.world.traffic.sizes()

        return list(self._meet(deposit)["flags"])


# ---------------------------------------------------------------------------------------------
# the writer that writes nothing
# ---------------------------------------------------------------------------------------------


PLACEHOLDER = "0" * 16  # a digest's length; never checked (nothing is read back)


class SimWriter:
    """A :class:`~savepoint.distributed.save.RankWriter` returning the records a rank's writer
    would (one data file, the pieces back to back after a header, block digests as many as the
    writer makes) without writing anything."""

    def write(
        self,
        location: Location,
        staging: str,
        rank: int,
        items: tuple[plan.Item, ...],
        sources: dict[str, TensorSource],
        options: SaveOptions,
    ) -> Records:
        if not items:
            return {}, []
        name = file_name(rank, 0)
        header = 64 + sum(len(i.key) + 96 for i in items)
        offset = header
        shards = []
        for item in items:
            n = item.nbytes
            block = checksum.block_size(n)
            blocks = (PLACEHOLDER,) * (-(-n // block)) if block else ()
            record = mf.ShardRecord(
                name, offset, offset + n, PLACEHOLDER, item.region, block, blocks
            )
            shards.append((item.key, record))
            offset += n
        return {name: mf.FileRecord(offset, header, PLACEHOLDER)}, shards

    def close(self, committed: bool) -> None:
        pass


# ---------------------------------------------------------------------------------------------
# a save of N ranks
# ---------------------------------------------------------------------------------------------


@dataclass
class SimResult:
    world: int
    results: list[Any]  # per rank: its last save's CheckpointInfo, or the exception it raised
    traffic: Traffic  # every save's
    times: list[list[dict[str, dict[str, float]]]]  # per rank, per save: phase -> part -> s
    manifests: list[mf.Manifest] = field(default_factory=list)  # rank 0's, per save
    marks: list[int] = field(default_factory=list)  # traffic.mark() at each save's start

    @property
    def manifest(self) -> mf.Manifest | None:
        return self.manifests[-1] if self.manifests else None

    def save_traffic(self, save: int = -1) -> Traffic:
        """The gloo operations of one save (default: the last)."""
        save %= len(self.marks)
        end = self.marks[save + 1] if save + 1 < len(self.marks) else None
        t = self.traffic.since(self.marks[save])
        if end is not None:
            t = Traffic(self.world, [ops[: end - self.marks[save]] for ops in t.ops])
        return t

    def share(self, rank: int, phase: str, parts: Sequence[str], save: int = -1) -> float:
        got = self.times[rank][save].get(phase, {})
        return sum(got.get(p, 0.0) for p in parts)

    def rank0_plan_s(self, save: int = -1) -> float:
        """Rank 0's global planning: the gathered plans decoded, merged, answers encoded."""
        return self.share(0, "save: plan", ("decode", "combine", "encode"), save)

    def per_rank_plan_s(self, save: int = -1) -> list[float]:
        """Each rank's local planning (rank 0's too): its plan described and encoded, its
        answer decoded (rank 0's decoding of the others' plans is not in its figure)."""
        out = []
        for r in range(self.world):
            t = self.share(r, "save: plan", ("local", "encode", "decode"), save)
            if r == 0:  # rank 0 decoded everyone's plans and encoded every answer
                t = self.share(0, "save: plan", ("local",), save)
            out.append(t)
        return out

    def critical_plan_s(self, save: int = -1) -> float:
        """Step 1's critical path (collectives free): the slowest rank's plan described and
        sent, rank 0's combining, the slowest rank's answer decoded."""
        sent = max(
            self.share(r, "save: plan", ("local", "encode"), save) for r in range(self.world)
        )
        if self.world == 1:
            return sent + self.share(0, "save: plan", ("combine",), save)
        answer = max(self.share(r, "save: plan", ("decode",), save) for r in range(1, self.world))
        return sent + self.rank0_plan_s(save) + answer


def simulate_save(
    world: int,
    state: Callable[[int, int], Any],
    path: str,
    *,
    writer: str = "sim",
    options: SaveOptions | None = None,
    metadata: dict[str, Any] | None = None,
    paths: Sequence[str] = (),
) -> SimResult:
    """The sharded save of ``state(rank, world)`` to ``path`` by ``world`` simulated ranks,
    then to each of ``paths`` (repeated saves: the plan cache at work). ``writer``: ``"sim"``
    (nothing written, :class:`SimWriter`) or ``"real"`` (the pieces written, as ``sp.save``
    would)."""
    options = options or SaveOptions()
    sim = World(world)
    manifests: list[mf.Manifest] = []
    marks: list[int] = []

    def one(coord: SimCoordinator, where: str) -> CheckpointInfo:
        location = resolve_path(where, what="checkpoint path")
        coord.new_save()
        if coord.rank == 0:
            marks.append(sim.traffic.mark())

        def flat() -> tuple[tree.Flat, dict[str, Any]]:
            return save.flatten(state(coord.rank, world)), dict(metadata or {})

        rank_writer: save.RankWriter = SimWriter() if writer == "sim" else save.LocalWriter(None)
        run = save.SaveRun(location, coord, flat, None, rank_writer)
        run.write_index = writer != "sim"
        if coord.rank == 0:
            commit = run.commit

            def keep(results: list[Records]) -> tuple[str, mf.Manifest]:
                directory, manifest = commit(results)
                manifests.append(manifest)
                return directory, manifest

            run.commit = keep  # type: ignore[method-assign]
        return run.run(options)

    def saves(coord: SimCoordinator) -> CheckpointInfo | None:
        info = one(coord, path)
        for where in paths:
            info = one(coord, where)
        # Rank 0's description, and every rank's that is small: N descriptions of a big
        # checkpoint would not fit in this process's memory.
        return info if coord.rank == 0 or world <= 64 else None

    was = gc.isenabled()
    gc.disable()
    try:
        results = sim.run(saves)
    finally:
        if was:
            gc.enable()
        for c in sim.coordinators:
            plancache.forget(c.memo_key)
            save.forget(c.memo_key)
    return SimResult(
        world, results, sim.traffic, [c.saves for c in sim.coordinators], manifests, marks
    )


# ---------------------------------------------------------------------------------------------
# states of real models, described without their data
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Placement:
    """A DTensor placement as :func:`shard.dtensor_box` reads it: ``Shard(dim)`` or
    ``Replicate()`` (``dim`` None)."""

    dim: int | None = None

    def is_shard(self) -> bool:
        return self.dim is not None


class _Mesh:
    """A device mesh as :func:`shard.dtensor_box` reads it: its shape and this rank's
    coordinate (rank-major, as ``init_device_mesh``)."""

    def __init__(self, shape: tuple[int, ...], rank: int) -> None:
        self.shape = shape
        coordinate = []
        for n in reversed(shape):
            coordinate.append(rank % n)
            rank //= n
        self.coordinate = list(reversed(coordinate))

    def get_coordinate(self) -> list[int]:
        return self.coordinate

    def size(self, i: int) -> int:
        return self.shape[i]


def _local(shape: Sequence[int], dtype: str, fill: float | None) -> np.ndarray[Any, Any]:
    dt = dtypes.from_name(dtype).numpy
    if fill is None:  # a zero-byte view: the description of a piece, no data
        return np.broadcast_to(np.zeros((), dtype=dt), tuple(shape))
    n = math.prod(shape)
    return (np.arange(n, dtype=np.float64) * 1e-3 + fill).astype(dt).reshape(tuple(shape))


def _dtensor(
    shape: tuple[int, ...],
    mesh: _Mesh,
    placements: Sequence[Placement],
    dtype: str,
    fill: float | None,
    regular: bool = True,
) -> Any:
    """What :func:`shard.from_dtensor` makes of a DTensor with these placements (``regular``
    False: a Shard given by its offsets alone, as a state not from DTensors)."""
    if not any(p.is_shard() for p in placements):
        return _local(shape, dtype, fill)
    box = shard.dtensor_box(shape, mesh, placements)
    assert box is not None
    local = _local([b - a for a, b in box], dtype, fill)
    # As shard.from_dtensor reads a DTensor: the box and the grid it follows from.
    dims = tuple(p.dim if p.is_shard() else None for p in placements)
    grid = layout.Grid(mesh.shape, tuple(mesh.coordinate), dims) if regular else None
    return shard.Shard(local, shape, tuple(a for a, _ in box), grid=grid)


def model_state(
    rank: int,
    world: int,
    tensors: int,
    *,
    tp: int = 1,
    hidden: int = 7168,
    experts: int = 256,
    expert_ffn: int = 2048,
    dtype: str = "F32",
    data: bool = False,
    regular: bool = True,
) -> dict[str, Any]:
    """Rank ``rank``'s state of a mixture-of-experts transformer shaped like DeepSeek-V3 (61
    layers of 256 experts make about 47,000 parameters... here as many layers as make about
    ``tensors`` tensors: parameters and Adam's ``exp_avg``/``exp_avg_sq``, and a ``step``).
    Each layer: attention (``q``, ``kv``, ``o``), two norms, a router and ``experts`` experts
    (``w1``, ``w2``, ``w3``: one module per expert, as Hugging Face models hold them). FSDP
    shards every tensor ``Shard(0)`` over the data-parallel ranks; with ``tp`` > 1 a
    ``(world / tp, tp)`` mesh also splits attention ``Shard(0)`` (``q``, ``kv``) and ``Shard(1)``
    (``o``) over its second dimension and the experts over it by ``Shard(0)`` (expert parallel
    within the group), norms and router replicated over it. ``data``: real local parts (small
    ``hidden`` only), else zero-byte views. ``regular``: the Shards carry their grid (as
    DTensors are read), so the save is planned compactly (:mod:`.layout`); False: by offsets
    alone, planned piece by piece (:func:`.plan.merge`)."""
    if world % tp:
        raise ValueError(f"tp={tp} does not divide world={world}")
    mesh = _Mesh((world // tp, tp), rank)
    fsdp = Placement(0)
    col = (fsdp, Placement(0) if tp > 1 else Placement())
    row = (fsdp, Placement(1) if tp > 1 else Placement())
    rep = (fsdp, Placement())
    params: list[tuple[str, tuple[int, ...], tuple[Placement, Placement]]] = []
    wanted = max(1, (tensors - 1) // 3)
    layer = 0
    while len(params) < wanted:
        p = f"layers.{layer}."
        params += [
            (p + "attn.q", (hidden, hidden), col),
            (p + "attn.kv", (hidden // 4, hidden), col),
            (p + "attn.o", (hidden, hidden), row),
            (p + "norm1", (hidden,), rep),
            (p + "norm2", (hidden,), rep),
            (p + "moe.router", (experts, hidden), rep),
        ]
        for e in range(experts):
            q = f"{p}moe.experts.{e}."
            params += [
                (q + "w1", (expert_ffn, hidden), col),
                (q + "w2", (hidden, expert_ffn), row),
                (q + "w3", (expert_ffn, hidden), col),
            ]
        layer += 1
    params = params[:wanted]
    model: dict[str, Any] = {}
    optim: dict[str, Any] = {}
    for i, (name, shape, placements) in enumerate(params):
        fill = (i + 1.0) if data else None
        model[name] = _dtensor(shape, mesh, placements, dtype, fill, regular)
        avg, sq = (None, None) if fill is None else (-fill, 0.5)
        optim[name] = {
            "exp_avg": _dtensor(shape, mesh, placements, dtype, avg, regular),
            "exp_avg_sq": _dtensor(shape, mesh, placements, dtype, sq, regular),
        }
    return {"model": model, "optim": {"state": optim, "step": 1000}}
