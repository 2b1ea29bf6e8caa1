"""Plan caching: a sharded save whose plan did not change reuses the previous global plan.

A training job saves the same state shape over and over: the same keys, shapes and placements
on every rank, so every rank's local plan and rank 0's global plan are the same each time (only
the path differs: ``step-100``, ``step-200``). Planning is what grows with tensors x ranks, so
from the second save on:

- each rank describes its state (it needs the sources of its pieces; the description itself is
  reused when the flattened tree, dtypes and shapes are equal: :mod:`.describe`), compares its local
  plan with the one it sent last time (path aside: :func:`unchanged`) and, if equal, sends only
  a marker naming the previous plan's id instead of the plan;
- rank 0, if every rank sent the marker of the plan it holds (:class:`RootMemo`), skips the
  merge, begins the save's transaction and answers every rank with the staging path alone; each
  rank writes the pieces the previous plan gave it (:class:`RankMemo`);
- a rank whose plan changed sends it whole; rank 0 merges the plans it received with the ones
  it kept for the others and answers with a new plan (a new id) as for a first save;
- a marker naming a plan rank 0 does not hold (its memo is from another save, after a failure
  between the ranks) makes rank 0 answer ``RESEND``, and every rank sends its plan whole in a
  second step.

So a repeated save's planning and coordination is one step of small messages (and the write
step's). The memos are per process, keyed by the process group (its global ranks) and this
rank, one plan per group (the last); rank 0's holds every rank's last plan. A save without a process group is not cached.
"""

from __future__ import annotations

import dataclasses
import threading
import uuid
from dataclasses import dataclass
from typing import Any

from savepoint.distributed import layout, plan

__all__ = [
    "RESEND",
    "RankMemo",
    "RootMemo",
    "blank",
    "forget",
    "key",
    "new_id",
    "rank_memo",
    "root_memo",
    "touch",
    "unchanged",
]

RESEND = "resend"  # rank 0's answer when a marker names a plan it does not hold


@dataclass(frozen=True)
class RankMemo:
    """What a rank keeps of its last save's plan: its local plan (path blanked), its blob
    place, the pieces it was given, and the global plan's id."""

    local: plan.LocalPlan
    place: Any
    items: tuple[plan.Item, ...]
    plan_id: str


@dataclass(frozen=True)
class RootMemo:
    """What rank 0 keeps: every rank's last local plan and place, the global plan, its id."""

    plans: list[tuple[plan.LocalPlan, Any]]
    global_plan: plan.GlobalPlan
    place: Any
    plan_id: str


_ranks: dict[Any, RankMemo] = {}
_roots: dict[Any, RootMemo] = {}
_lock = threading.Lock()


def key(coord: Any) -> Any:
    """The memo key of ``coord``'s group and rank (None: no caching). Saves with one key run
    one at a time: a key is a channel of :mod:`.collectives` (world, ranks, timeout), whose lock
    :meth:`~.collectives.TorchCoordinator.exclusive` holds for a whole save. A save without a
    process group (one process) is not cached: two may run at once, and it plans alone."""
    own = getattr(coord, "memo_key", None)
    if own is not None:
        return own
    ranks = getattr(coord, "_ranks", None)
    if ranks is None:  # LocalCoordinator
        return None
    import torch.distributed as dist

    return ("torch", id(dist.group.WORLD), ranks, coord.timeout, coord.rank)


def blank(local: plan.LocalPlan) -> plan.LocalPlan:
    return dataclasses.replace(local, path="")


def unchanged(memo: RankMemo | None, local: plan.LocalPlan, place: Any) -> bool:
    """Whether ``local`` is the plan ``memo`` kept (path aside), plain values' types included
    (``{"step": 1}`` then ``{"step": True}`` is a change: the manifest holds rank 0's tree)."""
    return (
        memo is not None
        and memo.place == place
        and memo.local == blank(local)
        and layout.same_tree(memo.local.tree, local.tree)
    )


def rank_memo(k: Any, memo: RankMemo | None = None, *, store: bool = False) -> RankMemo | None:
    if k is None:
        return None
    with _lock:
        if store:
            if memo is None:
                _ranks.pop(k, None)
            else:
                _ranks[k] = memo
        return _ranks.get(k)


def root_memo(k: Any, memo: RootMemo | None = None, *, store: bool = False) -> RootMemo | None:
    if k is None:
        return None
    with _lock:
        if store:
            if memo is None:
                _roots.pop(k, None)
            else:
                _roots[k] = memo
        return _roots.get(k)


def forget(k: Any) -> None:
    with _lock:
        _ranks.pop(k, None)
        _roots.pop(k, None)
        _used.pop(k, None)


# The memo keys of real process groups (:func:`key`'s "torch" keys) by last use, oldest first.
# What is kept per key (here, in .save and .describe: a few tens of MB at 50,000 tensors) is
# dropped once the key is stale: a key of a default group since destroyed (a re-initialised
# world: its groups are gone), or beyond the KEYS_KEPT most recently used. Dropping is always
# safe: a rank or rank 0 without its memo describes and plans again, as after a restart (the
# protocol's REGRID and RESEND answers). Other keys (a simulated world's) are their owner's to
# forget.
_used: dict[Any, None] = {}
KEYS_KEPT = 16


def touch(k: Any) -> list[Any]:
    """Record a save with key ``k``; the keys now stale, for the caller to forget everywhere."""
    if type(k) is not tuple or k[:1] != ("torch",):
        return []
    with _lock:
        _used.pop(k, None)
        _used[k] = None
        stale = [old for old in _used if old[1] != k[1]]  # another world's: it is gone
        keep = [old for old in _used if old[1] == k[1]]
        stale += keep[: max(0, len(keep) - KEYS_KEPT)]
        for old in stale:
            _used.pop(old, None)
    return stale


def new_id() -> str:
    return uuid.uuid4().hex
