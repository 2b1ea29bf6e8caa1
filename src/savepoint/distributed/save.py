"""Sharded save: every rank writes what it holds, rank 0 commits one manifest last.

Call order (``save(path, state, process_group=pg)`` on every rank of ``pg``):

1. **plan** (all ranks): flatten the state, describe each tensor piece as plain data
   (:class:`~savepoint.distributed.plan.LocalPlan`); rank 0 gathers every plan, merges them
   (:func:`~savepoint.distributed.plan.merge`: trees agree, pieces tile their tensors, each piece
   gets one writer), checks the target path, creates the staging directory next to it and sends
   each rank its list of pieces and the staging path;
2. **write** (all ranks): each rank writes its pieces as ``data-r<rank>-<i>.safetensors`` files
   into the shared staging directory (through the same sink as an unsharded save's planned
   files, :func:`savepoint.engine.sinks.write_files`, each file finished: durable) and syncs the
   directory; rank 0 gathers every rank's file and shard records, builds the manifest with the
   writer's one builder (:func:`savepoint.engine.save.new_manifest`) and commits it through the
   writer's one commit point (:func:`savepoint.engine.save.commit`: the manifest last, then the
   rename, or on stores without rename the manifest's create-only put); every rank gets the
   committed manifest back.

A rank's write in step 2 is :func:`write_rank`, a function of plain data (the staging directory,
the pieces the plan gave the rank, their sources; its parts, :func:`write_pieces` and
:func:`put_pieces`, live in :mod:`savepoint.distributed.pieces`). Who runs it is a
:class:`RankWriter`: this thread (:class:`LocalWriter`, the default), or the writer process of
``AsyncCheckpointer(writer="process")``, which runs it from its shared staging arena while the
collectives stay in the trainer's background thread (the writer process is not in the group).

This is the writer of :mod:`savepoint.engine.save` spread over the ranks, in the steps of DCP's
``state_dict_saver``: local plan, global plan (step 1), write data, finish (step 2). Its bytes go
through the code of the writer's sinks (:mod:`savepoint.engine.sinks`): data files through
``write_files`` (the ``PlannedFiles`` sink's writer), blobs through ``put_source``,
``host_bytes`` and ``BLOB_SEGMENT`` and :func:`savepoint.blobs.patch.put_tensor` (the
``BlobTensors`` sink's), its manifest through ``new_manifest`` and its commit through
``commit``. What is not :func:`savepoint.engine.save.write` with sinks, and why: ``write`` opens
its own transaction and runs every sink, the manifest and the commit in one process, whereas
here the transaction is rank 0's, every rank writes into its staging directory, and a gather
lies between a rank's write (and its seal: its session synced and checked, by that rank, which
alone holds it) and rank 0's manifest; and a rank's records are shard records (a region each,
several per tensor), not a sink's one record per tensor (``Written``).

A failure anywhere, in either step, raises one DistributedCheckpointError on every rank naming
the failing ranks; rank 0 aborts the transaction (the staging directory is removed); the previous
checkpoint at ``path`` is untouched. The phases ``"save: plan"``, ``"save: write"`` and ``"save:
commit"`` (rank 0's part of step 2) each have the deadline ``timeout``: a rank that misses it
is named with the phase (:mod:`savepoint.distributed.deadlines`), and rank 0 makes no commit
once the others gave up waiting for it. No manifest exists until every rank has finished its files
(two-phase commit). The store must be shared by all ranks (one filesystem, a network filesystem
across nodes, or an object store; ``memory://`` serves the ranks of one process only).

**Incremental** (``save(..., blobs=..., process_group=pg)``, :class:`Incremental`): the blob
store must be one all ranks see, at the same place relative to the checkpoint (step 1 checks
that every rank names it alike). In step 2 every rank opens a
:class:`~savepoint.blobs.SaveSession` on it, puts the pieces it writes that the policy wants as
chunked blobs (an unchanged chunk is named by the process's memo and not written again), writes
the others into data files as above, then ``sync()`` s and ``check()`` s its session before
sending its records (recipes included) to rank 0, which commits a version 4 manifest naming
them. Each rank keeps its session open until the commit's answer reaches it, then closes it, and
a third step waits for every rank to have closed its session: when ``save`` returns on rank 0,
no session of this save is open, so a collection rank 0 runs next (the manager's retention) is
not deferred by it, and none could have run while any rank's session was open (the session
protocol of :mod:`savepoint.blobs.gc` defers it). On a failure each rank closes its session;
the blobs it wrote are garbage for the next collection.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from savepoint.codecs import manifest as mf
from savepoint.commit.transaction import Transaction
from savepoint.distributed import (
    collectives,
    deadlines,
    layout,
    manifests,
    plan,
    plancache,
    shard,
)
from savepoint.distributed.describe import describe, describe_layout
from savepoint.distributed.describe import forget as describe_forget
from savepoint.distributed.pieces import (
    Indexed,
    Records,
    file_name,
    put_pieces,
    seal_index,
    write_pieces,
)
from savepoint.engine import save as save_engine
from savepoint.engine import sinks
from savepoint.engine.describe import describe as describe_checkpoint
from savepoint.errors import DistributedCheckpointError
from savepoint.info import CheckpointInfo
from savepoint.options import Progress, SaveOptions
from savepoint.state import tree
from savepoint.state.arrays import TensorSource
from savepoint.storage.paths import Location, PathArg
from savepoint.storage.paths import resolve as resolve_path

if TYPE_CHECKING:
    from savepoint.blobs import BlobPolicy, BlobStore, FastMemo, SaveSession
    from savepoint.blobs.patch import PatchTracker

__all__ = [
    "Incremental",
    "LocalWriter",
    "RankSession",
    "RankWriter",
    "Records",
    "SaveRun",
    "describe",
    "describe_layout",
    "file_name",
    "flatten",
    "forget",
    "put_pieces",
    "save",
    "save_flat",
    "write_pieces",
    "write_rank",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Incremental:
    """What makes a sharded save incremental (on this rank): the shared blob store, the policy
    choosing the pieces that go there, and the memo naming unchanged chunks (this process's)."""

    blobs: BlobStore
    policy: BlobPolicy
    memo: FastMemo | None = None
    tracker: PatchTracker | None = None  # finds changed rows (savepoint.blobs.patch)


def save(
    path: PathArg,
    state: Any,
    metadata: Mapping[str, Any] | None,
    options: SaveOptions,
    incremental: Incremental | None = None,
) -> CheckpointInfo:
    """``sp.save(path, state, process_group=...)`` (with ``incremental``: ``blobs=...`` too):
    see the module docstring."""

    def flat_state() -> tuple[tree.Flat, dict[str, Any]]:
        meta = save_engine.check_metadata(metadata)
        return flatten(state), meta

    return _save(path, flat_state, options, incremental)


def flatten(state: Any) -> tree.Flat:
    """``state`` flattened for a sharded save (DTensors read as Shards), its tensors not copied."""
    return tree.flatten(shard.from_dtensors(state))


def save_flat(
    path: PathArg,
    flat: tree.Flat,
    metadata: dict[str, Any],
    options: SaveOptions,
    incremental: Incremental | None = None,
    writer: RankWriter | None = None,
) -> CheckpointInfo:
    """A sharded save of a state flattened (and snapshotted) earlier: the background writer of
    ``AsyncCheckpointer`` calls this with its process group, and ``checkpoint.save_flat`` of a
    state holding Shard descriptions lands here. Without a process group
    (``options.process_group`` None) this is a one-rank sharded save (a state holding Shard
    descriptions saved by a single process): its pieces must cover every tensor. ``writer``:
    who writes this rank's pieces in step 2 (default: this thread, :class:`LocalWriter`)."""
    return _save(path, lambda: (flat, metadata), options, incremental, writer)


def _save(
    path: PathArg,
    flatten: Callable[[], tuple[tree.Flat, dict[str, Any]]],
    options: SaveOptions,
    incremental: Incremental | None,
    writer: RankWriter | None = None,
) -> CheckpointInfo:
    location = resolve_path(path, what="checkpoint path")
    coord = collectives.coordinator(options.process_group, options.timeout)
    run = _Save(location, coord, flatten, incremental, writer or LocalWriter(incremental))
    with coord.exclusive():
        return run.run(options)


# A regular rank's pieces and their bytes, by memo key, while its description is the one kept
# (describe.describe_layout returned the same grid object): a repeated save skips the rule.
_NBYTES = operator.attrgetter("nbytes")
_owned: dict[Any, tuple[Any, tuple[plan.Item, ...], int]] = {}
# Rank 0: the global plan a regular layout implies, per memo key while the layout is the one
# kept by describe (the same object): a repeated save does not rebuild its tensor table.
_implied: dict[Any, tuple[layout.Layout, plan.GlobalPlan]] = {}
# A rank: the description (describe's grid object) rank 0 last accepted for a regular save, per
# memo key. While describe hands back that same object, the rank sends a marker naming its
# layout (GRID + digest) instead of its Compact: rank 0 holding that layout's plan, checked with
# these ranks, answers OWN at once (the repeated save's coordination: one small message a rank).
_accepted: dict[Any, Any] = {}
GRID = "grid:"
REGRID = "regrid"  # rank 0's answer when it holds no plan for a marker: Compacts, please


def forget(memo_key: Any) -> None:
    """Drop what this module and :mod:`.describe` keep for ``memo_key`` (the group is gone)."""
    _owned.pop(memo_key, None)
    _implied.pop(memo_key, None)
    _accepted.pop(memo_key, None)
    describe_forget(memo_key)
    plancache.forget(memo_key)


# Where a rank's blob store is, as the manifest would name it (relative to the checkpoint), and
# its digest; None for a save that is not incremental.
BlobPlace = tuple[str, str] | None
# What a rank sends rank 0 in step 1: its plan and place, or (unchanged) None, None and the id
# of the plan it had last; and its path. Rank 0's answer: the staging path, the rank's pieces
# (None: those of the plan it had last) and the plan's id; or plancache.RESEND.
# A rank with a regular state (savepoint.distributed.layout) sends a Compact instead of its plan,
# and rank 0 answers OWN: the pieces the layout's rule gives the rank.
Sent = tuple[plan.LocalPlan | layout.Compact | None, BlobPlace, str | None, str]
Answer = tuple[str, tuple[plan.Item, ...] | str | None, str]
OWN = "own"


class RankWriter(Protocol):
    """Who writes this rank's pieces in step 2: this process (:class:`LocalWriter`) or the writer
    process of ``AsyncCheckpointer(writer="process")``; either runs :func:`write_rank`."""

    def write(
        self,
        location: Location,
        staging: str,
        rank: int,
        items: tuple[plan.Item, ...],
        sources: dict[str, TensorSource],
        options: SaveOptions,
    ) -> Records:
        """Write ``items`` into ``staging`` (and the blob store, for an incremental save);
        return this rank's records."""

    def close(self, committed: bool) -> None:
        """After the commit (``committed``) or a failure: end what ``write`` left open (an
        incremental save's session, its patch tracker told of the commit). Never raises."""


class LocalWriter:
    """Step 2 on this rank, in this process (the rank's thread): :func:`write_rank`."""

    def __init__(self, incremental: Incremental | None) -> None:
        self.incremental = incremental
        self.blobs: RankSession | None = None  # while an incremental save runs

    def write(
        self,
        location: Location,
        staging: str,
        rank: int,
        items: tuple[plan.Item, ...],
        sources: dict[str, TensorSource],
        options: SaveOptions,
    ) -> Records:
        inc = self.incremental
        if inc is not None:
            tracker = inc.tracker if inc.policy.patches else None
            self.blobs = RankSession(inc.blobs.session(), inc.policy, inc.memo, tracker)
        return write_rank(
            location,
            staging,
            rank,
            items,
            sources,
            max_file_bytes=options.max_file_bytes,
            writers=options.writers,
            direct=options.direct,
            progress=options.progress,
            blobs=self.blobs,
        )

    def close(self, committed: bool) -> None:
        blobs, self.blobs = self.blobs, None
        if blobs is not None:
            blobs.close(committed)


class _Save:
    """One sharded save on this rank: the two steps of the module docstring."""

    def __init__(
        self,
        location: Location,
        coord: collectives.Coordinator,
        flatten: Callable[[], tuple[tree.Flat, dict[str, Any]]],
        incremental: Incremental | None,
        writer: RankWriter,
    ) -> None:
        self.location = location
        self.shown = location.store.url(location.path)
        self.coord = coord
        self.flatten = flatten
        self.incremental = incremental
        self.writer = writer
        self.blob_place: BlobPlace = None  # rank 0: what the manifest names
        self.sources: dict[str, TensorSource] = {}
        self.metadata: dict[str, Any] = {}
        self.plan: plan.GlobalPlan | None = None  # rank 0
        self.tx: Transaction | None = None  # rank 0, until committed or aborted
        self.local: tuple[plan.LocalPlan, BlobPlace] | None = None  # this rank's plan
        self.resend = False  # rank 0 asked for every plan whole
        self.marked = False  # this rank sent a marker for its regular layout (GRID)
        self.described: Any = None  # describe's grid object (None: not regular)
        self.memo_key = plancache.key(coord)
        for stale in plancache.touch(self.memo_key):
            forget(stale)
        # A regular state: its layout, this rank's coordinate, the pieces the layout gives it.
        self.regular: tuple[layout.Layout, tuple[int, ...], tuple[plan.Item, ...]] | None = None
        self.own_bytes = 0  # what this rank writes of a regular state
        self.compact = False  # this save was planned from the layout: manifest version 7
        self.write_index = True  # False: the world simulator's SimWriter (nothing written)
        self.grid = True  # options.grid: a regular state may be planned from its layout

    def run(self, options: SaveOptions) -> CheckpointInfo:
        self.grid = options.grid
        answer = self.plan_step()
        if answer == REGRID:  # rank 0 holds no plan for a marker: regular ranks send Compacts
            self.marked = False
            answer = self.plan_step()
        if answer == plancache.RESEND:  # a rank's memo is not rank 0's: every plan, whole
            self.resend = True
            answer = self.plan_step()
        staging, items = self.take(answer)

        def write_local() -> Records | Indexed:
            rank = self.coord.rank
            got = self.writer.write(self.location, staging, rank, items, self.sources, options)
            if self.compact:  # a regular save: the records go into this rank's index file
                store = self.location.store
                return seal_index(store, staging, rank, got, write=self.write_index)
            return got

        # Every rank gets the committed manifest (in memory, from rank 0) to describe it.
        try:
            directory, manifest = self.coord.step(
                "saving",
                self.shown,
                write_local,
                self.commit,
                cleanup=self.abort,
                phase="save: write",
                combine_phase="save: commit",
            )
        except BaseException:
            self.writer.close(committed=False)
            raise
        if self.incremental is not None:
            self.close_sessions()
        return describe_checkpoint(self.location.store.url(directory), manifest)

    def plan_step(self) -> Any:
        return self.coord.step(
            "saving",
            self.shown,
            self.plan_local,
            self.plan_global,
            each=True,
            cleanup=self.abort,
            phase="save: plan",
        )

    def plan_local(self) -> Sent:
        """This rank's plan, or (unchanged since its last save: :mod:`.plancache`) a marker."""
        if self.local is None:
            flat, self.metadata = self.flatten()
            local_plan, self.sources, grid = describe_layout(flat, self.shown, self.memo_key)
            place: BlobPlace = None
            if self.incremental is not None:
                blobs = self.incremental.blobs
                place = (sinks.blob_store_path(self.location, blobs), blobs.algorithm)
            elif grid is not None and self.grid:
                self.regular, self.own_bytes = self.own(grid, local_plan)
                self.described = grid
                # The same description rank 0 accepted last time: a marker is enough.
                self.marked = _accepted.get(self.memo_key) is grid
            self.local = (local_plan, place)
        local_plan, place = self.local
        if self.regular is not None and not self.resend:
            lay, coord, _ = self.regular
            if self.marked:
                return None, place, GRID + lay.digest, local_plan.path
            return layout.Compact(lay.digest, coord, self.own_bytes), place, None, local_plan.path
        memo = plancache.rank_memo(self.memo_key)
        if memo is not None and not self.resend and plancache.unchanged(memo, local_plan, place):
            return None, None, memo.plan_id, local_plan.path
        return local_plan, place, None, local_plan.path

    def own(self, grid: tuple[layout.Layout, tuple[int, ...]], local_plan: plan.LocalPlan) -> Any:
        """((layout, coordinate, the pieces the layout's rule gives this rank), their bytes);
        kept per memo key while the description is the one kept (``grid`` the same object)."""
        lay, coord = grid
        kept = _owned.get(self.memo_key)
        if kept is not None and kept[0] is grid:
            return (lay, coord, kept[1]), kept[2]
        _owned.pop(self.memo_key, None)
        positions = layout.written(lay, coord)
        items, sources = local_plan.items, self.sources
        # describe_layout adds a piece and its source together, in the layout's order, and
        # skips only empty pieces: with none skipped, position i is items[i] (in C, 2 ms at
        # 50,000 pieces; the keys compared as the sources', 20 times cheaper than items').
        if len(items) == len(lay.keys) and list(sources) == lay.keys:
            own = tuple(map(items.__getitem__, positions))
            nbytes = sum(map(_NBYTES, map(list(sources.values()).__getitem__, positions)))
        else:  # pieces skipped: picked by key (the sources' keys are the items', in order)
            keys = {lay.keys[i] for i in positions}
            mine = list(map(keys.__contains__, sources))
            if len(mine) != len(items):  # (never from describe_layout)
                mine = [item.key in keys for item in items]
            own = tuple(itertools.compress(items, mine))
            nbytes = sum(sources[item.key].nbytes for item in own)
        if self.memo_key is not None:
            _owned[self.memo_key] = (grid, own, nbytes)
        return (lay, coord, own), nbytes

    def take(self, answer: Answer) -> tuple[str, tuple[plan.Item, ...]]:
        """The staging path and this rank's pieces from rank 0's answer (None: the pieces the
        previous plan gave it), remembered for the next save."""
        staging, items, plan_id = answer
        local_plan, place = self.local or (None, None)
        if isinstance(items, str):  # OWN
            assert self.regular is not None
            self.compact = True
            if self.memo_key is not None:
                _accepted[self.memo_key] = self.described
            return staging, self.regular[2]
        if items is None:
            memo = plancache.rank_memo(self.memo_key)
            assert memo is not None and memo.plan_id == plan_id
            return staging, memo.items
        assert local_plan is not None
        kept = plancache.RankMemo(plancache.blank(local_plan), place, items, plan_id)
        plancache.rank_memo(self.memo_key, kept, store=True)
        return staging, items

    def plan_global(self, sent: list[Sent]) -> list[Any]:
        """Rank 0: the global plan (reused when every rank's is unchanged), each rank's answer."""
        k, world = self.memo_key, len(sent)
        if any(
            isinstance(s[0], layout.Compact) or (isinstance(s[2], str) and s[2].startswith(GRID))
            for s in sent
        ):
            return self.plan_regular(sent)
        memo = plancache.root_memo(k)
        if (
            memo is not None
            and len(memo.plans) == world
            and all(s[0] is None and s[2] == memo.plan_id for s in sent)
            and len({s[3] for s in sent}) == 1
        ):  # every rank's plan unchanged: the previous global plan, no merge
            self.blob_place, self.plan = memo.place, memo.global_plan
            self.tx = Transaction(self.location.store, self.location.path).begin()
            return [(self.tx.staging, None, memo.plan_id)] * world
        plans: list[tuple[plan.LocalPlan, BlobPlace]] = []
        for r, (local_plan, place, plan_id, path) in enumerate(sent):
            if local_plan is None:
                if memo is None or memo.plan_id != plan_id or len(memo.plans) != world:
                    plancache.root_memo(k, None, store=True)
                    return [plancache.RESEND] * world
                old, place = memo.plans[r]
                local_plan = dataclasses.replace(old, path=path)
            assert isinstance(local_plan, plan.LocalPlan)  # Compacts went to plan_regular
            plans.append((local_plan, place))
        answers = self.merge(plans)
        plan_id = plancache.new_id()
        assert self.plan is not None
        kept = [(plancache.blank(p), place) for p, place in plans]
        plancache.root_memo(
            k, plancache.RootMemo(kept, self.plan, self.blob_place, plan_id), store=True
        )
        return [(staging, items, plan_id) for staging, items in answers]

    def plan_regular(self, sent: list[Sent]) -> list[Any]:
        """Rank 0, every rank regular: the plan the layout implies, in O(tensors + ranks); any
        disagreement (or a rank not regular): every plan whole (plancache.RESEND), for merge."""
        if self.regular is None or len({(s[1], s[3]) for s in sent}) != 1:
            return [plancache.RESEND] * len(sent)
        lay = self.regular[0]
        kept = _implied.get(self.memo_key)
        if kept is None or kept[0] is not lay:
            kept = None
        marker = GRID + lay.digest
        if kept is not None and all(s[0] is None and s[2] == marker for s in sent):
            pass  # every rank's description is the one checked with these ranks last time
        elif any(s[0] is None and isinstance(s[2], str) and s[2].startswith(GRID) for s in sent):
            return [REGRID] * len(sent)  # a marker rank 0 cannot vouch for: every Compact
        else:
            compact = [s[0] for s in sent if isinstance(s[0], layout.Compact)]
            if len(compact) != len(sent) or layout.check(compact, lay):
                return [plancache.RESEND] * len(sent)
        self.blob_place = sent[0][1]
        if kept is not None:
            self.plan = kept[1]
        else:
            self.plan = plan.GlobalPlan(lay.tree, lay.tensors(), ())
            if self.memo_key is not None:
                _implied[self.memo_key] = (lay, self.plan)
        self.tx = Transaction(self.location.store, self.location.path).begin()
        return [(self.tx.staging, OWN, lay.digest)] * len(sent)

    def merge(
        self, plans: list[tuple[plan.LocalPlan, BlobPlace]]
    ) -> list[tuple[str, tuple[plan.Item, ...]]]:
        places = [place for _, place in plans]
        if len(set(places)) > 1:
            ranks = [r for r, place in enumerate(places) if place != places[0]]
            raise plan.PlanError(
                [
                    (
                        "",
                        "the ranks were given different blob stores (every rank must name the "
                        "same shared store, at the same place relative to the checkpoint): "
                        + "; ".join(f"rank {r}: {place}" for r, place in enumerate(places)),
                    )
                ],
                ranks,
            )
        self.blob_place = places[0]
        self.plan = plan.merge([local_plan for local_plan, _ in plans])
        self.tx = Transaction(self.location.store, self.location.path).begin()
        return [(self.tx.staging, items) for items in self.plan.writes]

    def commit(self, results: list[Any]) -> tuple[str, mf.Manifest]:
        assert self.plan is not None and self.tx is not None
        if self.compact:
            assert self.regular is not None
            manifest = manifests.grid_manifest(self.plan, self.regular[0], results, self.metadata)
        else:
            manifest = manifests.manifest(
                self.plan, results, self.metadata, self.coord.world_size, self.blob_place
            )
        late = deadlines.abandoned()  # the others gave up waiting for this commit: make none
        if late is not None:
            raise late
        directory, _ = save_engine.commit(self.tx, manifest)
        self.tx = None  # committed: nothing to clean up any more
        return directory, manifest

    def close_sessions(self) -> None:
        """Step 3 of an incremental save, after the commit: every rank closes its session, and
        returns once all have (so rank 0 may collect at once). The checkpoint is committed: a
        rank lost now is logged, not raised (the next collective operation reports it)."""
        try:
            self.coord.step(
                "saving",
                self.shown,
                lambda: self.writer.close(committed=True),
                phase="save: close sessions",
            )
        except DistributedCheckpointError as exc:
            log.warning(
                "%s: committed, but not every rank confirmed it closed: %s", self.shown, exc
            )

    def abort(self) -> None:
        if self.tx is not None:
            self.tx.abort()
            self.tx = None


SaveRun = _Save  # one rank's save, driven by the world simulator (savepoint.distributed.simulate)


# ---------------------------------------------------------------------------------------------
# step 2: writing this rank's pieces, and the manifest
# ---------------------------------------------------------------------------------------------


@dataclass
class RankSession:
    """The blob side of an incremental save on one rank: its open save session, the policy, the
    memo naming unchanged chunks, the patch tracker (None: no row patches) and the tracker's
    entries for the pieces put, told to the tracker once the checkpoint is committed."""

    session: SaveSession
    policy: BlobPolicy
    memo: FastMemo | None = None
    tracker: PatchTracker | None = None
    pending: dict[str, Any] = field(default_factory=dict)

    def close(self, committed: bool) -> None:
        """End the session (after the commit, or after a failure); a record that cannot be
        removed is logged, not raised: it only defers collections until it is stale."""
        try:
            if committed and self.tracker is not None:
                self.tracker.commit(self.session.blobs.url(), self.pending)
        finally:
            try:
                self.session.close()
            except OSError as exc:
                log.warning(
                    "cannot remove the save's session record %s (%s); blob collections wait "
                    "until it is stale",
                    self.session.path,
                    exc,
                )


def write_rank(
    target: PathArg,
    staging: str,
    rank: int,
    items: tuple[plan.Item, ...],
    sources: dict[str, TensorSource],
    *,
    max_file_bytes: int,
    writers: int,
    direct: bool,
    progress: Progress | None,
    blobs: RankSession | None = None,
) -> Records:
    """This rank's part of step 2, a function of plain data (the staging directory, the pieces
    this rank was assigned, their sources): the pieces into data files (:func:`write_pieces`);
    with ``blobs`` (an incremental save) those the policy wants into the blob store first
    (:func:`put_pieces`, through the session, kept open until the commit), and the session
    synced and checked before the records go to rank 0. Runs in the rank's process, or in the
    writer process of ``AsyncCheckpointer(writer="process")`` from its staging arena."""
    if blobs is None:
        return write_pieces(
            target,
            staging,
            rank,
            items,
            sources,
            max_file_bytes=max_file_bytes,
            writers=writers,
            direct=direct,
            progress=progress,
        )
    policy, session = blobs.policy, blobs.session
    in_blobs = tuple(item for item in items if policy.wants(item.nbytes))
    in_files = tuple(item for item in items if not policy.wants(item.nbytes))
    total = sum(item.nbytes for item in items)
    blob_bytes = sum(item.nbytes for item in in_blobs)
    on_bytes = save_engine.byte_counter(total, progress)
    before = session.stats.bytes_written
    shards = put_pieces(
        session,
        in_blobs,
        sources,
        policy,
        blobs.memo,
        on_bytes if progress is not None else None,
        tracker=blobs.tracker,
        pending=blobs.pending,
    )
    files, file_shards = write_pieces(
        target,
        staging,
        rank,
        in_files,
        sources,
        max_file_bytes=max_file_bytes,
        writers=writers,
        direct=direct,
        progress=(lambda done, _: progress(blob_bytes + done, total))
        if progress is not None
        else None,
    )
    session.sync()
    session.check()
    log.info(
        "%s: rank %d put %d pieces (%d bytes) as blobs, %d blob bytes written",
        target,
        rank,
        len(in_blobs),
        blob_bytes,
        session.stats.bytes_written - before,
    )
    return files, shards + file_shards
