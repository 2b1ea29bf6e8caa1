"""Sharded checkpoints across ``torch.distributed`` ranks, loadable on any number of ranks.

``sp.save(path, state, process_group=pg)`` on every rank writes one checkpoint: each rank writes
the pieces it holds, once (replicated tensors by one rank), and rank 0 commits the manifest after
every rank has finished (synced) its files. ``sp.load(path, into=state, process_group=pg)`` on any number of ranks
reads, on each rank, only the byte ranges that overlap what that rank holds. How a rank says what
it holds: :mod:`savepoint.distributed.shard` (``Shard``, ``FlatShard``, ``Partitioned``, DTensor).
With ``blobs=`` too (an incremental save) every rank puts its large pieces into one shared blob
store through its own save session, and the manifest names their recipes
(:mod:`savepoint.distributed.save`, ``docs/blobs.md``).

Modules: ``shard`` (descriptions), ``plan`` (plain-data save and load plans, no I/O),
``collectives`` (steps that fail on every rank at once), ``save`` and ``load`` (orchestration),
``consolidate`` (a sharded checkpoint to an unsharded one, one tensor in memory at a time). Bytes
go through the engine (:mod:`savepoint.engine`) and every save commits through one
:class:`~savepoint.commit.transaction.Transaction`. Only ``collectives`` imports torch, and only
when a process group is passed.
"""

from savepoint.distributed.shard import FlatShard, Partitioned, Shard, from_dtensors

__all__ = ["FlatShard", "Partitioned", "Shard", "from_dtensors"]
