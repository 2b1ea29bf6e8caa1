"""Distributed boostr checkpoints: ``sharding_meta.json``, the layout checks, and consolidation
into one checkpoint for each strategy. Specified in :mod:`savepoint.formats.boostr`."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from savepoint.errors import CorruptCheckpointError, IncompatibleCheckpointError
from savepoint.formats._boostr_single import (
    MODEL,
    OPTIMIZER,
    RANK_DIR,
    SHARDING,
    Bad,
    BoostrCheckpoint,
    BoostrDirectory,
    Framework,
    Rank,
    all_tensors,
    corrupt,
    load,
    read_json,
    require_dir,
    uint,
    write,
)
from savepoint.formats._files import ConcatTensor, LazyTensor, SafetensorsFile
from savepoint.storage import local
from savepoint.storage.paths import local_path


@dataclass(frozen=True)
class ShardingConfig:
    """One rank's entry in ``sharding_meta.json``; ``stage`` is set for ZeroPartitioned only."""

    world_size: int
    rank: int
    owned_params: tuple[str, ...]
    strategy: str
    stage: int | None = None
    split_dims: Mapping[str, int] = field(default_factory=dict)

    @classmethod
    def parse(cls, doc: Any) -> ShardingConfig:
        if not isinstance(doc, dict):
            raise Bad("a shard config is not an object")
        owned = doc.get("owned_params")
        if not isinstance(owned, list) or not all(isinstance(p, str) for p in owned):
            raise Bad("'owned_params' must be a list of strings")
        strategy, stage = _strategy(doc.get("strategy"))
        split = doc.get("split_dims", {})
        if not isinstance(split, dict):
            raise Bad("'split_dims' must map parameter names to dimensions")
        for param in split:
            uint(split, param, None)  # serde's usize: an integer in [0, 2**64)
        return cls(
            world_size=uint(doc, "world_size", None),
            rank=uint(doc, "rank", None),
            owned_params=tuple(owned),
            strategy=strategy,
            stage=stage,
            split_dims=dict(split),
        )


def _strategy(value: Any) -> tuple[str, int | None]:
    if isinstance(value, str) and value in ("Replicated", "TensorParallel"):
        return value, None
    if isinstance(value, dict) and len(value) == 1:
        ((name, body),) = value.items()
        if name in ("Replicated", "TensorParallel") and body is None:
            return name, None
        if name == "ZeroPartitioned" and isinstance(body, dict):
            return name, uint(body, "stage", None, 256)
    raise Bad(
        f'unknown strategy {value!r} (expected "Replicated", {{"ZeroPartitioned": '
        '{"stage": k}} or "TensorParallel")'
    )


@dataclass(frozen=True)
class ShardingMeta:
    version: int
    world_size: int
    shards: tuple[ShardingConfig, ...]


def read_sharding_meta(directory: str | os.PathLike[str]) -> ShardingMeta:
    path = os.path.join(os.fspath(directory), SHARDING)
    doc = read_json(path, "not a distributed checkpoint")
    try:
        shards = doc.get("shards")
        if not isinstance(shards, list):
            raise Bad("'shards' must be a list")
        return ShardingMeta(
            version=uint(doc, "version", None, 1 << 32),
            world_size=uint(doc, "world_size", None),
            shards=tuple(ShardingConfig.parse(s) for s in shards),
        )
    except Bad as exc:
        raise CorruptCheckpointError(f"{path}: {exc}", path=path) from None


def _rank_dirs(directory: str) -> list[int]:
    try:
        names = os.listdir(directory)
    except PermissionError as exc:
        raise local.permission_error(exc, directory) from None
    except OSError as exc:
        raise corrupt(directory, f"cannot list the directory: {exc.strerror or exc}") from None
    return sorted(
        int(m.group(1))
        for e in names
        if (m := RANK_DIR.fullmatch(e)) and os.path.isdir(os.path.join(directory, e))
    )


def _check_layout(directory: str, meta: ShardingMeta) -> None:
    n = meta.world_size
    if n == 0:
        raise corrupt(directory, f"{SHARDING} says world_size 0: there is nothing to read")
    seen: set[int] = set()
    for shard in meta.shards:
        if shard.rank >= n:
            raise corrupt(
                directory,
                f"{SHARDING} has a shard for rank {shard.rank}, out of range for world_size {n}",
            )
        if shard.world_size != n:
            raise corrupt(
                directory,
                f"{SHARDING}: rank {shard.rank}'s config says world_size {shard.world_size}, the "
                f"checkpoint {n}",
            )
        if shard.rank in seen:
            raise corrupt(directory, f"{SHARDING} has two shard configs for rank {shard.rank}")
        seen.add(shard.rank)
    for r in range(n):
        if r not in seen:
            raise corrupt(directory, f"rank {r} is missing: {SHARDING} has no shard config for it")
    ranks = _rank_dirs(directory)
    for r in range(n):
        if r not in ranks:
            raise corrupt(directory, f"rank {r} is missing: no rank_{r}/ directory")
    extra = [r for r in ranks if r >= n]
    if extra:
        raise corrupt(
            directory,
            f"rank_{extra[0]}/ is out of range for world_size {n} (a checkpoint saved with more "
            "ranks? its sharding_meta.json disagrees)",
        )
    strategies = {s.strategy for s in meta.shards}
    if len(strategies) > 1:
        raise corrupt(
            directory, f"the shards use different strategies ({', '.join(sorted(strategies))})"
        )


def _describe(e: Any) -> str:
    return f"{e.dtype} {list(e.shape)}"


def _same_everywhere(
    directory: str, name: str, files: list[SafetensorsFile | None], chosen: int
) -> None:
    f = files[chosen]
    assert f is not None
    want = f.entry(name)
    for r, other in enumerate(files):
        if other is not None and name in other:
            e = other.entry(name)
            if (e.dtype, e.shape) != (want.dtype, want.shape):
                raise corrupt(
                    directory,
                    f"the shards do not fit together: {name!r} is {_describe(want)} in rank "
                    f"{chosen} and {_describe(e)} in rank {r}",
                )


def _owner(name: str, owners: Mapping[str, int], prefixes: bool) -> int | None:
    if name in owners:
        return owners[name]
    if prefixes:
        cut = name.rfind(".")
        while cut > 0:
            if name[:cut] in owners:
                return owners[name[:cut]]
            cut = name.rfind(".", 0, cut)
    return None


def _zero(
    directory: str, meta: ShardingMeta, ranks: list[Rank]
) -> tuple[dict[str, LazyTensor], dict[str, LazyTensor] | None, dict[str, str]]:
    owners: dict[str, int] = {}
    for shard in meta.shards:
        for p in shard.owned_params:
            if p in owners and owners[p] != shard.rank:
                raise corrupt(
                    directory,
                    f"the shards do not fit together: {p!r} is owned by ranks {owners[p]} and "
                    f"{shard.rank}",
                )
            owners[p] = shard.rank
    for p, r in owners.items():
        if p not in ranks[r].model:
            raise corrupt(directory, f"rank {r} owns {p!r} but its {MODEL} lacks it")
    sources: dict[str, str] = {}

    def merge(kind: str, files: list[SafetensorsFile | None]) -> dict[str, LazyTensor]:
        holders: dict[str, list[int]] = {}
        for r, f in enumerate(files):
            for name in f.names() if f is not None else ():
                holders.setdefault(name, []).append(r)
        out: dict[str, LazyTensor] = {}
        for name, held in holders.items():
            owner = _owner(name, owners, prefixes=kind == "optimizer")
            chosen = owner if owner is not None and owner in held else held[0]
            _same_everywhere(directory, name, files, chosen)
            f = files[chosen]
            assert f is not None
            out[name] = f.tensor(name)
            sources[f"{kind}/{name}"] = f"rank_{chosen}/{os.path.basename(f.path)}"
        return out

    model = merge("model", [r.model for r in ranks])
    optimizers = [r.optimizer for r in ranks]
    optimizer = merge("optimizer", optimizers) if any(optimizers) else None
    return model, optimizer, sources


def _tensor_parallel(
    directory: str, meta: ShardingMeta, ranks: list[Rank]
) -> tuple[dict[str, LazyTensor], dict[str, LazyTensor] | None, dict[str, str]]:
    by_rank = {s.rank: s for s in meta.shards}
    split = dict(by_rank[0].split_dims)
    if not split:
        raise corrupt(
            directory,
            "TensorParallel consolidation needs split_dims (which parameter is split along which "
            f"dimension) in rank 0's config in {SHARDING}, and it has none",
        )
    for r, shard in sorted(by_rank.items()):
        if shard.split_dims and dict(shard.split_dims) != split:
            raise corrupt(directory, f"rank {r}'s split_dims disagree with rank 0's in {SHARDING}")
    n = len(ranks)
    every = "rank_0.." + f"{n - 1}" if n > 1 else "rank_0"
    sources: dict[str, str] = {}

    def concat(
        kind: str, name: str, dim: int, files: list[SafetensorsFile | None], file: str
    ) -> LazyTensor:
        parts = []
        first = None
        for r, f in enumerate(files):
            if f is None or name not in f:
                raise corrupt(
                    directory,
                    f"split {kind} tensor {name!r} is missing from rank {r} (every rank holds a "
                    "slice of it)",
                )
            e = f.entry(name)
            if first is None:
                first = e
                if dim >= len(e.shape):
                    raise corrupt(
                        directory,
                        f"split_dims says {name!r} is split along dimension {dim}, but it has "
                        f"{len(e.shape)} dimension(s)",
                    )
            elif (
                e.dtype != first.dtype
                or len(e.shape) != len(first.shape)
                or any(a != b for i, (a, b) in enumerate(zip(e.shape, first.shape)) if i != dim)
            ):
                raise corrupt(
                    directory,
                    f"the shards of {name!r} do not fit together along dimension {dim}: "
                    f"{_describe(first)} in rank 0, {_describe(e)} in rank {r}",
                )
            parts.append(f.tensor(name))
        sources[f"{kind}/{name}"] = f"{every}/{file}"
        return ConcatTensor(parts, dim)

    models: list[SafetensorsFile | None] = [r.model for r in ranks]
    rank0 = ranks[0].model
    missing = [p for p in split if p not in rank0]
    if missing:
        raise corrupt(directory, f"split parameter {missing[0]!r} is missing from rank 0 ({MODEL})")
    model: dict[str, LazyTensor] = {}
    for name in rank0.names():
        if name in split:
            model[name] = concat("model", name, split[name], models, MODEL)
        else:
            _same_everywhere(directory, name, models, 0)
            model[name] = rank0.tensor(name)
    for r, rank in enumerate(ranks[1:], start=1):
        stray = [n for n in rank.model.names() if n not in rank0]
        if stray:
            raise corrupt(
                directory,
                f"the shards do not fit together: rank {r} holds {stray[0]!r}, which rank 0 lacks",
            )
    opt0 = ranks[0].optimizer
    if opt0 is None:
        if any(r.optimizer is not None for r in ranks):
            raise corrupt(directory, f"rank 0 has no {OPTIMIZER} but other ranks do")
        return model, None, sources
    optimizers: list[SafetensorsFile | None] = [r.optimizer for r in ranks]
    optimizer: dict[str, LazyTensor] = {}
    for name in opt0.names():
        dim = split.get(name)
        if dim is None:
            cut = name.rfind(".")
            while cut > 0 and dim is None:
                param = name[:cut]
                if param in split and opt0.entry(name).shape == rank0.entry(param).shape:
                    dim = split[param]
                cut = name.rfind(".", 0, cut)
        optimizer[name] = (
            opt0.tensor(name)
            if dim is None
            else concat("optimizer", name, dim, optimizers, OPTIMIZER)
        )
    return model, optimizer, sources


def open_distributed(path: str | os.PathLike[str]) -> BoostrDirectory:
    """Open a distributed boostr checkpoint as one consolidated checkpoint (lazy tensors)."""
    directory = os.path.abspath(local_path(path, what="boostr checkpoint"))
    require_dir(directory)
    meta = read_sharding_meta(directory)
    _check_layout(directory, meta)
    ranks: list[Rank] = []
    try:
        for r in range(meta.world_size):
            ranks.append(Rank(os.path.join(directory, f"rank_{r}")))
        state = ranks[0].state
        for r, rank in enumerate(ranks):
            if (rank.state.step, rank.state.epoch) != (state.step, state.epoch):
                raise corrupt(
                    directory,
                    f"the shards do not fit together: rank 0 is at step {state.step} epoch "
                    f"{state.epoch}, rank {r} at step {rank.state.step} epoch {rank.state.epoch}",
                )
        strategy = meta.shards[0].strategy
        if strategy == "Replicated":
            model = all_tensors(ranks[0].model)
            assert model is not None
            optimizer = all_tensors(ranks[0].optimizer)
            sources = {f"model/{k}": f"rank_0/{MODEL}" for k in model}
            sources.update({f"optimizer/{k}": f"rank_0/{OPTIMIZER}" for k in optimizer or {}})
        elif strategy == "ZeroPartitioned":
            model, optimizer, sources = _zero(directory, meta, ranks)
        else:
            model, optimizer, sources = _tensor_parallel(directory, meta, ranks)
    except BaseException:
        for rank in ranks:
            rank.close()
        raise
    files = [f for rank in ranks for f in rank.files]
    return BoostrDirectory(directory, model, optimizer, state, files, meta=meta, sources=sources)


def load_consolidated(
    path: str | os.PathLike[str], *, framework: Framework = "numpy"
) -> BoostrCheckpoint:
    """A distributed checkpoint consolidated into memory."""
    with open_distributed(path) as d:
        return d.load(framework)


def load_distributed(
    path: str | os.PathLike[str], rank: int, *, framework: Framework = "numpy"
) -> BoostrCheckpoint:
    """One rank's shard, as the seed's ``load_distributed_checkpoint``: the metadata must exist
    and ``rank`` be below its world size."""
    directory = os.path.abspath(local_path(path, what="boostr checkpoint"))
    require_dir(directory)
    meta = read_sharding_meta(directory)
    if not 0 <= rank < meta.world_size:
        raise IncompatibleCheckpointError(
            f"{directory}: rank {rank} is out of range for a checkpoint with world_size "
            f"{meta.world_size}; consolidate it (savepoint convert) to load it on another number "
            "of ranks",
            path=directory,
        )
    rank_dir = os.path.join(directory, f"rank_{rank}")
    if not os.path.isdir(rank_dir):
        raise corrupt(directory, f"rank {rank} is missing: no rank_{rank}/ directory")
    return load(rank_dir, framework=framework)


def consolidate(sharded_dir: str | os.PathLike[str], output_dir: str | os.PathLike[str]) -> None:
    """The seed's ``consolidate_checkpoint``: write the consolidated single checkpoint, one
    tensor at a time."""
    output_dir = local_path(output_dir, what="consolidation target")
    with open_distributed(sharded_dir) as d:
        write(output_dir, d.model, d.optimizer, d.state)
