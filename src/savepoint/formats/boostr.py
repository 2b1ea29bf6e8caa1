"""boostr checkpoint directories (the seed's async/distributed trainer), read and written.

Single checkpoint, a directory::

    model.safetensors       the model's tensors (any safetensors dtype), no __metadata__
    optimizer.safetensors   optional: the optimizer's tensors ("layers.0.weight.m", ...)
    training_state.json     {"version": 2, "step": u64, "epoch": u64, "learning_rate": f64,
                             "metadata": {str: str}}

``training_state.json`` follows the seed's serde rules: ``step`` is required; ``epoch``,
``learning_rate`` and ``metadata`` default to 0, 0.0 and {} when absent; an absent ``version``
means 1 (checkpoints from before the field existed). Unknown members are ignored, as serde does;
duplicate members, NaN/Infinity, nulls and wrong types are errors. Numbers are read as serde_json
reads them: ``step``/``epoch`` are u64 (a float such as ``5.0``, and ``-0``, which serde_json reads
as the float -0.0, are refused); ``learning_rate`` takes any JSON number as the nearest f64, and
one out of its range (``1e400``, or an integer of 400 digits) is refused by name. Both JSON files
are read through ``storage.local.open_read`` (a FIFO is refused without blocking; an unreadable
file is CheckpointPermissionError) and the bounded JSON reader (``savepoint.codecs.bounded_json``). The writer always writes
version 2 (the seed's current version), pretty-printed with two-space indents as
``serde_json::to_string_pretty`` does, refuses non-finite learning rates (serde would write
``null``, which no reader accepts), and writes ``optimizer.safetensors`` only for a non-empty
optimizer state, as the seed does. Directories are written atomically: a hidden staging sibling,
fsynced, renamed into place.

Distributed checkpoint, a directory::

    sharding_meta.json      {"version": 2, "world_size": N, "shards": [config, ...]}
    rank_0/ ... rank_{N-1}/ each a single checkpoint as above

    config = {"world_size": N, "rank": r, "owned_params": [name, ...], "strategy": S,
              "split_dims": {name: dim}}          # split_dims may be absent (empty)
    S      = "Replicated" | {"ZeroPartitioned": {"stage": k}} | "TensorParallel"
             (serde's externally tagged enum; {"Replicated": null} is accepted too)

Consolidation into one checkpoint (:func:`open_distributed`, :func:`consolidate`) checks the
layout first: one config per rank ``0..N-1`` (a config for a rank ``>= N``, or a ``rank_{k}``
directory with ``k >= N``, is "out of range"; a rank without a config or without its directory is
"missing"), every config with the same ``world_size`` and strategy, every rank at the same step
and epoch. Then, by strategy:

- Replicated: rank 0's model and optimizer.
- ZeroPartitioned: the union over ranks. A tensor owned by a rank (listed in its
  ``owned_params``; optimizer tensors belong to the parameter whose name plus ``"."`` prefixes
  theirs) comes from its owner, which must hold it; other tensors from the lowest rank holding
  them. A parameter owned by two ranks, or copies of one tensor whose dtype or shape differ
  between ranks, are errors. (The seed's rank 0 writes placeholder configs with empty
  ``owned_params`` for the other ranks; with this rule such checkpoints consolidate as the seed
  does, by union.)
- TensorParallel: every parameter in rank 0's ``split_dims`` (required, and other ranks'
  non-empty ``split_dims`` must agree) is concatenated over the ranks in rank order along its
  dimension; every rank must hold it with the same dtype, the same number of dimensions and the
  same size in every other dimension. Optimizer tensors named like a split parameter (or like
  ``<param>.<suffix>`` with the parameter's shard shape) are concatenated the same way. Other
  tensors come from rank 0, and a rank holding a model tensor that rank 0 lacks is an error.
  (The seed silently keeps rank 0's slice, or drops the tensor, where shards are missing.)

Writing: :func:`save_distributed` (specified in ``savepoint.formats._boostr_write``) from a list
of per-rank checkpoints or from a process group; ``sharding_meta.json`` is written last, into a
staging directory that is committed atomically once every rank has fsynced its ``rank_{r}/``.
:func:`prepare_distributed` splits the process-group form into a check-and-copy half and a write
half, for ``AsyncCheckpointer.save_distributed`` (the seed's async per-rank writer).

Every error is a CorruptCheckpointError naming the directory and what to fix. Tensors are read
lazily from the mapped files; a concatenated tensor is the only thing ever held in memory.
"""

from __future__ import annotations

import os

from savepoint.formats._boostr_distributed import (
    ShardingConfig,
    ShardingMeta,
    consolidate,
    load_consolidated,
    load_distributed,
    open_distributed,
    read_sharding_meta,
)
from savepoint.formats._boostr_single import (
    CHECKPOINT_VERSION,
    MODEL,
    OPTIMIZER,
    SHARDING,
    STATE,
    BoostrCheckpoint,
    BoostrDirectory,
    TrainingState,
    load,
    open_checkpoint,
    read_training_state,
    save,
    tensor_sources,
    write,
)
from savepoint.formats._boostr_write import (
    RankWriter,
    Strategy,
    prepare_distributed,
    save_distributed,
    snapshot,
    write_rank,
)
from savepoint.formats._progress import Progress, Tally
from savepoint.info import CheckpointInfo
from savepoint.storage.paths import local_path

__all__ = [
    "BoostrCheckpoint",
    "BoostrDirectory",
    "CHECKPOINT_VERSION",
    "MODEL",
    "OPTIMIZER",
    "RankWriter",
    "SHARDING",
    "STATE",
    "ShardingConfig",
    "ShardingMeta",
    "Strategy",
    "TrainingState",
    "consolidate",
    "inspect",
    "is_distributed",
    "load",
    "load_consolidated",
    "load_distributed",
    "open_any",
    "open_checkpoint",
    "open_distributed",
    "prepare_distributed",
    "read_sharding_meta",
    "read_training_state",
    "save",
    "save_distributed",
    "snapshot",
    "tensor_sources",
    "verify",
    "write",
    "write_rank",
]


def is_distributed(path: str | os.PathLike[str]) -> bool:
    return os.path.isfile(os.path.join(os.fspath(path), SHARDING))


def open_any(path: str | os.PathLike[str]) -> BoostrDirectory:
    path = local_path(path, what="boostr checkpoint")
    return open_distributed(path) if is_distributed(path) else open_checkpoint(path)


def inspect(path: str | os.PathLike[str]) -> CheckpointInfo:
    with open_any(path) as d:
        return d.info()


def verify(path: str | os.PathLike[str], *, progress: Progress | None = None) -> CheckpointInfo:
    """Check every document and safetensors header, the consolidation plan, and read every byte
    of tensor data once (the format has no checksums); ``progress(done, total)`` is called in
    bytes as it reads."""
    with open_any(path) as d:
        tally = Tally(progress, sum(e.end - e.start for f in d.files for e in f.entries))
        for f in d.files:
            for e in f.entries:
                tally.drain(f.tensor(e.name))
        return d.info()
