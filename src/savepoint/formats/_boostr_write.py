"""Writing distributed boostr checkpoints (``rank_{r}/`` + ``sharding_meta.json``), and the host
snapshots behind background boostr saves. The layout is specified in
:mod:`savepoint.formats.boostr`; :func:`save_distributed` is the public entry point.

Commit protocol (both forms): every ``rank_{r}/`` is written, each file fsynced, into one hidden
staging directory of a :class:`~savepoint.commit.transaction.Transaction` (the one every native
save commits through, rename strategy); only then does rank 0 write ``sharding_meta.json``, open
the staging directory with the reader's own checks (:func:`open_distributed`: what was written
consolidates) and commit the transaction. A crash or an error at any point leaves the previous
checkpoint at the path (or nothing) and never a ``sharding_meta.json`` next to incomplete ranks.
With a process group the two steps run through :mod:`savepoint.distributed.collectives`, so a
failure on any rank raises one DistributedCheckpointError on every rank and rank 0 removes the
staging directory.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal

import numpy as np

from savepoint.codecs import serde_text
from savepoint.commit.transaction import Transaction, write_error
from savepoint.errors import CheckpointError, CorruptCheckpointError
from savepoint.formats import _files
from savepoint.formats._boostr_distributed import ShardingConfig, ShardingMeta, open_distributed
from savepoint.formats._boostr_single import (
    CHECKPOINT_VERSION,
    MODEL,
    OPTIMIZER,
    SHARDING,
    STATE,
    BoostrCheckpoint,
    TrainingState,
    check_replaceable,
    tensor_sources,
)
from savepoint.formats._files import LazyTensor
from savepoint.state.arrays import HostCopy, TensorSource
from savepoint.storage import local
from savepoint.storage.local import STORE as LOCAL
from savepoint.storage.paths import local_path

Strategy = Literal["Replicated", "ZeroPartitioned", "TensorParallel"]
STRATEGIES = ("Replicated", "ZeroPartitioned", "TensorParallel")
# Who writes one rank's rank_{r}/ of a distributed save: (staging directory, rank, the
# training_state.json document); see prepare_distributed.
RankWriter = Callable[[str, int, bytes], None]


# ---------------------------------------------------------------------------------------------
# host snapshots
# ---------------------------------------------------------------------------------------------


class HostTensor(LazyTensor):
    """A private host copy of a tensor's bytes, taken when constructed: later changes to the
    original (in-place training updates, a GPU tensor being overwritten) do not reach it. The
    copy is :class:`savepoint.state.arrays.HostCopy`, as in sharded saves; this makes it a LazyTensor,
    which the boostr writers take as is."""

    def __init__(self, source: TensorSource) -> None:
        super().__init__(source.dtype, source.shape, kind=source.kind)
        self._copy = HostCopy(source)

    def copy_to(self, dst: np.ndarray[Any, Any], start: int) -> None:
        self._copy.copy_to(dst, start)


def snapshot(
    tensors: Mapping[str, Any] | Iterable[tuple[str, Any]], what: str
) -> list[tuple[str, LazyTensor]]:
    """``tensors`` checked (names, types) and copied to host memory owned by the result."""
    return [(name, HostTensor(source)) for name, source in tensor_sources(tensors, what)]


# ---------------------------------------------------------------------------------------------
# one rank
# ---------------------------------------------------------------------------------------------


class _Rank:
    """One rank's checkpoint, checked but not yet written."""

    def __init__(self, rank: int, shard: Any) -> None:
        if not isinstance(shard, BoostrCheckpoint):
            raise TypeError(
                f"rank {rank}: expected a boostr.BoostrCheckpoint(model, optimizer, state), got "
                f"{type(shard).__name__}"
            )
        self.rank = rank
        self.model = tensor_sources(shard.model, "model")
        self.optimizer = (
            tensor_sources(shard.optimizer, "optimizer") if shard.optimizer is not None else []
        )
        state = shard.state if shard.state is not None else TrainingState()
        self.document = state.to_json()
        self.step, self.epoch = state.step, state.epoch

    def summary(self) -> dict[str, Any]:
        """Plain data rank 0 needs to build the sharding configs (travels between ranks)."""

        def describe(items: list[tuple[str, TensorSource]]) -> dict[str, Any]:
            return {n: (s.dtype.name, tuple(s.shape)) for n, s in items}

        return {
            "model": describe(self.model),
            "optimizer": describe(self.optimizer),
            "step": self.step,
            "epoch": self.epoch,
        }

    def write(self, staging: str) -> None:
        """Write ``rank_{r}/`` into ``staging`` (:func:`write_rank`)."""
        write_rank(staging, self.rank, self.model, self.optimizer, self.document)


def write_rank(
    staging: str,
    rank: int,
    model: Sequence[tuple[str, Any]],
    optimizer: Sequence[tuple[str, Any]],
    document: bytes,
) -> None:
    """One rank's ``rank_{r}/`` written into the staging directory of a distributed save:
    ``model.safetensors``, ``optimizer.safetensors`` (for a non-empty ``optimizer``) and
    ``training_state.json`` (``document``, ``TrainingState.to_json()``), every file and both
    directories fsynced. ``model`` and ``optimizer``: (name, source) pairs, as
    ``tensor_sources`` gives them. Run by the rank (:func:`save_distributed`), or by the writer process of
    ``AsyncCheckpointer(writer="process")`` from its staging arena."""
    directory = os.path.join(staging, f"rank_{rank}")
    os.mkdir(directory)
    _files.write_safetensors(os.path.join(directory, MODEL), model)
    if optimizer:  # the seed writes optimizer.safetensors only for a non-empty state
        _files.write_safetensors(os.path.join(directory, OPTIMIZER), optimizer)
    local.write_small(os.path.join(directory, STATE), document)
    local.fsync_dir(directory)
    local.fsync_dir(staging)


# ---------------------------------------------------------------------------------------------
# the sharding configs
# ---------------------------------------------------------------------------------------------


def _check_strategy(
    strategy: str, stage: int | None, split_dims: Mapping[str, int] | None
) -> tuple[int | None, dict[str, int]]:
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, not {strategy!r}")
    if strategy == "ZeroPartitioned":
        if type(stage) is not int or not 0 <= stage < 256:
            raise ValueError("ZeroPartitioned needs stage= (the ZeRO stage, an integer 0-255)")
    elif stage is not None:
        raise ValueError(f"stage= is for ZeroPartitioned only, not {strategy}")
    split = dict(split_dims or {})
    for name, dim in split.items():
        if not isinstance(name, str) or type(dim) is not int or dim < 0:
            raise ValueError(f"split_dims must map parameter names to dimensions, got {name!r}")
    if strategy == "TensorParallel" and not split:
        raise ValueError(
            "TensorParallel needs split_dims= (which parameter is split along which dimension): "
            "consolidation concatenates the ranks' slices along it"
        )
    if strategy != "TensorParallel" and split:
        raise ValueError(f"split_dims= is for TensorParallel only, not {strategy}")
    return stage, split


def _owned_list(value: Any, what: str) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, Iterable):
        raise ValueError(f"{what} must be a list of parameter names")
    names = tuple(value)
    if not all(isinstance(n, str) for n in names):
        raise ValueError(f"{what} must be a list of parameter names")
    return names


def _default_owners(summaries: list[dict[str, Any]]) -> list[tuple[str, ...]]:
    """ZeroPartitioned without ``owned_params``: a parameter belongs to the lowest rank holding
    optimizer state for it (``<param>`` or ``<param>.<suffix>``), else to the lowest rank holding
    it. Every parameter gets exactly one owner, which holds it (what consolidation requires)."""
    owners: dict[str, int] = {}
    params = {p for s in summaries for p in s["model"]}
    for r, s in enumerate(summaries):
        for name in s["optimizer"]:
            cut = len(name)
            while cut > 0:
                param = name[:cut]
                if param in params and param in s["model"]:
                    owners.setdefault(param, r)
                    break
                cut = name.rfind(".", 0, cut)
    for r, s in enumerate(summaries):
        for param in s["model"]:
            owners.setdefault(param, r)
    out: list[list[str]] = [[] for _ in summaries]
    for r, s in enumerate(summaries):
        out[r] = [p for p in s["model"] if owners[p] == r]
    return [tuple(o) for o in out]


def build_meta(
    target: str,
    summaries: list[dict[str, Any]],
    strategy: str,
    stage: int | None,
    split: dict[str, int],
    owned: list[tuple[str, ...] | None],
) -> ShardingMeta:
    """The ``sharding_meta.json`` for these ranks, after the checks only the writer can make
    (the reader's own checks run on the written files before the commit)."""
    world = len(summaries)
    if strategy == "Replicated":
        for r, s in enumerate(summaries[1:], start=1):
            for kind in ("model", "optimizer"):
                if s[kind] != summaries[0][kind]:
                    differ = sorted(set(s[kind].items()) ^ set(summaries[0][kind].items()))
                    raise CheckpointError(
                        f"{target}: Replicated ranks must hold the same tensors, but rank {r}'s "
                        f"{kind} differs from rank 0's at {differ[0][0]!r} (consolidation reads "
                        "rank 0 alone, so the difference would be lost)",
                        path=target,
                    )
    defaults = _default_owners(summaries) if strategy == "ZeroPartitioned" else None
    shards = []
    for r, s in enumerate(summaries):
        mine = owned[r]
        if mine is None:
            mine = defaults[r] if defaults is not None else tuple(s["model"])
        shards.append(
            ShardingConfig(
                world_size=world,
                rank=r,
                owned_params=mine,
                strategy=strategy,
                stage=stage,
                split_dims=dict(split),
            )
        )
    return ShardingMeta(version=CHECKPOINT_VERSION, world_size=world, shards=tuple(shards))


def meta_json(meta: ShardingMeta) -> bytes:
    """``sharding_meta.json`` as the seed's serde writes it (externally tagged strategy enum)."""

    def config(c: ShardingConfig) -> dict[str, Any]:
        strategy: Any = (
            {"ZeroPartitioned": {"stage": c.stage}}
            if c.strategy == "ZeroPartitioned"
            else c.strategy
        )
        return {
            "world_size": c.world_size,
            "rank": c.rank,
            "owned_params": list(c.owned_params),
            "strategy": strategy,
            "split_dims": dict(c.split_dims),
        }

    doc = {
        "version": meta.version,
        "world_size": meta.world_size,
        "shards": [config(c) for c in meta.shards],
    }
    return serde_text.dumps(doc, indent=2).encode("utf-8")


# ---------------------------------------------------------------------------------------------
# staging and commit (rank 0)
# ---------------------------------------------------------------------------------------------


def begin(target: str) -> Transaction:
    """Check ``target`` may be replaced and open the transaction (its staging directory next to
    the target); OSErrors are CheckpointWriteErrors."""
    return Transaction(
        LOCAL, target, what="boostr checkpoint", check=lambda store, t: check_replaceable(t)
    ).begin()


def finish(tx: Transaction, meta: ShardingMeta) -> None:
    """Write ``sharding_meta.json`` last, check the result consolidates, commit atomically; on
    any failure the transaction is aborted (the previous checkpoint stays)."""
    target, staging = tx.target, tx.staging
    try:
        local.write_small(os.path.join(staging, SHARDING), meta_json(meta))
        with open_distributed(staging):
            pass
    except CorruptCheckpointError as exc:
        tx.abort()
        raise CheckpointError(
            str(exc).replace(staging, target)
            + " (nothing was written: the previous checkpoint is intact)",
            path=target,
        ) from None
    except OSError as exc:
        tx.abort()
        raise write_error(LOCAL, target, exc, tx.what) from None
    tx.commit(None)


# ---------------------------------------------------------------------------------------------
# the entry point
# ---------------------------------------------------------------------------------------------


def save_distributed(
    path: str | os.PathLike[str],
    shards: Sequence[BoostrCheckpoint] | BoostrCheckpoint,
    *,
    strategy: Strategy = "Replicated",
    stage: int | None = None,
    split_dims: Mapping[str, int] | None = None,
    owned_params: Sequence[Sequence[str] | None] | Sequence[str] | None = None,
    process_group: Any = None,
    timeout: float | None = None,
) -> ShardingMeta:
    """Write a distributed boostr checkpoint (the seed's ``save_distributed_checkpoint`` for every
    rank), atomically; returns what ``sharding_meta.json`` says.

    Without ``process_group``, ``shards`` lists every rank's :class:`BoostrCheckpoint` (rank ``r``
    is ``shards[r]``) and this process writes them all. With ``process_group`` (every rank of the
    group calls this), ``shards`` is this rank's checkpoint: each rank writes its own ``rank_{r}/``
    (``r``: its rank in the group) and rank 0 writes ``sharding_meta.json`` once every rank has
    fsynced; a failure anywhere raises DistributedCheckpointError on every rank (``timeout``
    seconds for a rank that stops answering) and commits nothing.

    What each rank holds, by ``strategy``: ``"Replicated"``, a full copy (every rank the same
    tensors); ``"ZeroPartitioned"`` (``stage=`` required), any subsets whose union is the state,
    each parameter owned by one rank (``owned_params``, per rank without a process group or this
    rank's list with one; by default the lowest rank holding optimizer state for it, else the
    lowest holding it); ``"TensorParallel"`` (``split_dims=`` required), for each parameter in
    ``split_dims`` the rank's slice along that dimension, in rank order, and full copies of the
    rest. Before committing, the written files are checked with the reader's consolidation rules;
    shards that would not consolidate raise CheckpointError and commit nothing.

    Tensor arguments are streamed from the given arrays (numpy, torch, lazy tensors of an opened
    checkpoint): do not modify them until this returns (AsyncCheckpointer copies them first).
    """
    target = os.path.abspath(local_path(path, what="boostr checkpoint"))
    stage, split = _check_strategy(strategy, stage, split_dims)
    if process_group is not None:
        return _save_group(
            target, shards, strategy, stage, split, owned_params, process_group, timeout
        )
    if isinstance(shards, BoostrCheckpoint) or not isinstance(shards, Sequence):
        raise TypeError(
            "without process_group, shards must list every rank's BoostrCheckpoint (rank r is "
            "shards[r])"
        )
    if not shards:
        raise ValueError("shards is empty: a distributed checkpoint has at least one rank")
    if owned_params is None:
        owned: list[tuple[str, ...] | None] = [None] * len(shards)
    else:
        if isinstance(owned_params, str) or len(owned_params) != len(shards):
            raise ValueError("owned_params must hold one list of parameter names per rank")
        owned = [
            None if o is None else _owned_list(o, f"owned_params[{r}]")
            for r, o in enumerate(owned_params)
        ]
    ranks = [_Rank(r, s) for r, s in enumerate(shards)]
    meta = build_meta(target, [r.summary() for r in ranks], strategy, stage, split, owned)
    tx = begin(target)
    try:
        for rank in ranks:
            rank.write(tx.staging)
    except BaseException as exc:
        tx.abort()
        if isinstance(exc, OSError) and not isinstance(exc, CheckpointError):
            raise write_error(LOCAL, target, exc, tx.what) from exc
        raise
    finish(tx, meta)
    return meta


def prepare_distributed(
    path: str | os.PathLike[str],
    model: Mapping[str, Any],
    optimizer: Mapping[str, Any] | None = None,
    state: TrainingState | None = None,
    *,
    strategy: Strategy = "Replicated",
    stage: int | None = None,
    split_dims: Mapping[str, int] | None = None,
    owned_params: Sequence[str] | None = None,
    process_group: Any,
    timeout: float | None = None,
    copy: bool = True,
    rank_writer: RankWriter | None = None,
) -> Callable[[], ShardingMeta]:
    """The two halves of ``save_distributed(path, BoostrCheckpoint(model, optimizer, state),
    process_group=...)`` for one rank, split for a background save (the seed's
    ``AsyncCheckpointer::save_distributed``): this call checks every argument (the strategy, the
    tensors' names and types, ``state``, ``owned_params``, the group) and copies this rank's
    tensors into host memory owned by the result, so the caller may change them as soon as it
    returns; the returned function, called once on every rank of the group (in any thread),
    writes ``rank_{r}/`` and commits exactly as :func:`save_distributed` does, returning the
    ``ShardingMeta``.

    ``copy=False``: ``model`` and ``optimizer`` are a private copy already (the caller's
    staging arena), not copied again. ``rank_writer(staging, rank, document)``: who writes this
    rank's ``rank_{r}/`` (default: :func:`write_rank`, in the calling thread); the
    ``AsyncCheckpointer``'s writer process writes it from the arena, while the collectives stay
    in the caller's thread."""
    from savepoint.options import check_process_group

    target = os.path.abspath(local_path(path, what="boostr checkpoint"))
    stage, split = _check_strategy(strategy, stage, split_dims)
    check_process_group(process_group)
    mine = None if owned_params is None else _owned_list(owned_params, "owned_params")
    given = state if state is not None else TrainingState()
    if not isinstance(given, TrainingState):
        raise TypeError(f"state must be a boostr.TrainingState, not {type(given).__name__}")
    given.to_json()  # refuse what cannot be written now, in the caller
    take = snapshot if copy else _checked
    frozen = BoostrCheckpoint(
        dict(take(model, "model")),
        None if optimizer is None else dict(take(optimizer, "optimizer")),
        dataclasses.replace(given, metadata=dict(given.metadata)),
    )

    def write() -> ShardingMeta:
        return _save_group(
            target, frozen, strategy, stage, split, mine, process_group, timeout, rank_writer
        )

    return write


def _checked(tensors: Mapping[str, Any], what: str) -> list[tuple[str, Any]]:
    """``tensors`` checked as :func:`snapshot` checks them, and not copied."""
    tensor_sources(tensors, what)
    return list(tensors.items())


def _save_group(
    target: str,
    shard: Any,
    strategy: str,
    stage: int | None,
    split: dict[str, int],
    owned_params: Any,
    process_group: Any,
    timeout: float | None,
    rank_writer: RankWriter | None = None,
) -> ShardingMeta:
    """The process-group form of :func:`save_distributed`, in two collective steps: (1) every
    rank checks its checkpoint and sends rank 0 a summary; rank 0 builds the configs, checks the
    target and creates the staging directory; (2) every rank writes and fsyncs its ``rank_{r}/``;
    rank 0, once every rank reported success, writes ``sharding_meta.json`` and commits."""
    from savepoint.distributed import collectives

    coord = collectives.coordinator(process_group, timeout)
    mine = None if owned_params is None else _owned_list(owned_params, "owned_params")
    held: dict[str, Any] = {}  # this rank's _Rank; on rank 0 also the meta and the staging path

    def prepare() -> tuple[dict[str, Any], tuple[str, ...] | None]:
        held["rank"] = _Rank(coord.rank, shard)
        return held["rank"].summary(), mine

    def plan(results: list[tuple[dict[str, Any], tuple[str, ...] | None]]) -> str:
        held["meta"] = build_meta(
            target, [s for s, _ in results], strategy, stage, split, [o for _, o in results]
        )
        held["tx"] = begin(target)
        return str(held["tx"].staging)

    def write(staging: str) -> None:
        try:
            if rank_writer is None:
                held["rank"].write(staging)
            else:
                rank_writer(staging, coord.rank, held["rank"].document)
        except OSError as exc:
            if isinstance(exc, CheckpointError):
                raise
            raise _files.write_error(target, exc) from exc

    def commit(_: list[None]) -> ShardingMeta:
        finish(held.pop("tx"), held["meta"])
        meta: ShardingMeta = held["meta"]
        return meta

    def cleanup() -> None:
        tx = held.pop("tx", None)
        if tx is not None:
            tx.abort()

    with coord.exclusive():
        staging = coord.step("saving", target, prepare, plan, cleanup=cleanup, phase="save: plan")
        meta: ShardingMeta = coord.step(
            "saving",
            target,
            lambda: write(staging),
            commit,
            cleanup=cleanup,
            phase="save: write",
            combine_phase="save: commit",
        )
        return meta
