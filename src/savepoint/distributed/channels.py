"""savepoint's own gloo groups (:class:`Channel`), one per set of ranks and timeout, kept per
process and reused by every sharded save and load over those ranks
(:mod:`savepoint.distributed.collectives` runs its collectives on them).

Each channel's keys live under a prefix of the job's default store: the ranks' digest, the
channel's number, and (:func:`store_scope`) torchrun's attempt, as torchrun keeps its store
across elastic restarts. Channels of a destroyed default group are dropped with it.
"""

from __future__ import annotations

import hashlib
import os
import threading
from datetime import timedelta
from typing import Any

from savepoint.distributed.deadlines import Board

__all__ = ["Channel", "channel", "forget", "store_scope"]


class Channel:
    """savepoint's gloo group over one set of ranks (created on first use), plus its board in
    the default store (:class:`.deadlines.Board`): the last point each rank reached, so when a
    collective fails the survivors can name the ranks that never reached it, and the verdicts."""

    def __init__(self, prefix: str, timeout: float) -> None:
        self.prefix = prefix
        self.timeout = timeout
        self.lock = threading.RLock()  # one save or load at a time per process (sync, async)
        self.steps = 0
        self._group: Any = None
        self._store: Any = None
        self.board = Board(self._default_store)  # points reached, verdicts, notes

    def _default_store(self) -> Any:
        if self._store is None:
            from torch.distributed import PrefixStore  # type: ignore[attr-defined]
            from torch.distributed.distributed_c10d import _get_default_store

            self._store = PrefixStore(self.prefix, _get_default_store())
        return self._store

    def group(self, rank: int, size: int) -> Any:
        if self._group is None:
            import torch.distributed as dist

            self._group = dist.ProcessGroupGloo(
                self._default_store(), rank, size, timedelta(seconds=self.timeout)
            )
        return self._group

    def next_step(self) -> int:
        self.steps += 1
        return self.steps


_channels: dict[tuple[int, tuple[int, ...], float], Channel] = {}
_created: dict[tuple[int, tuple[int, ...]], int] = {}
_channels_lock = threading.Lock()


_world: Any = None  # the default group the channels belong to (held: its id stays unique)


def store_scope() -> str:
    """The launch in savepoint's key prefixes in the job's default store. torchrun keeps its
    store across elastic restarts (torch 2.13), so keys a killed attempt left (gloo addresses,
    the peer tier's documents) would be read as this attempt's; under torchrun the attempt is in
    every prefix. Other launchers make a store per job: the scope is empty."""
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if restart is None:
        return ""
    return f"attempt-{os.environ.get('TORCHELASTIC_RUN_ID', '')}-{restart}/"


def _world_id() -> int:
    import torch.distributed as dist

    return id(dist.group.WORLD)


def channel(ranks: tuple[int, ...], timeout: float) -> Channel:
    """The channel over ``ranks`` (global) for ``timeout``, one per process and reused.

    Every member creates its channels for a given rank set in the same order (every member calls
    the same saves and loads), so the n-th one has the same store prefix on each. When the
    default group is another than the channels' (destroyed, the world initialised again), they
    are dropped with their gloo groups and the counts start again: the old one's peers are gone.
    The group is held meanwhile, so a new one cannot take its address (keys hold its id).
    """
    import torch.distributed as dist

    global _world
    world = dist.group.WORLD
    key = (id(world), ranks, timeout)
    with _channels_lock:
        if world is not _world:
            _channels.clear()
            _created.clear()
            _world = world
        channel = _channels.get(key)
        if channel is None:
            n = _created.get(key[:2], 0)
            _created[key[:2]] = n + 1
            digest = hashlib.sha1(",".join(map(str, ranks)).encode()).hexdigest()[:16]
            channel = Channel(f"savepoint/{store_scope()}{digest}/{n}/", timeout)
            _channels[key] = channel
        return channel


def forget(ranks: tuple[int, ...], timeout: float) -> None:
    """Drop a channel whose collective failed: it cannot be trusted to be in step any more."""
    with _channels_lock:
        _channels.pop((_world_id(), ranks, timeout), None)
