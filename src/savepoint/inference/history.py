"""SnapshotHistory: a bounded ring of inference snapshots, newest first, for rollback.

The seed's ``CheckpointManager``, in Python: ``push`` adds a snapshot as the newest and, when the
ring already holds ``max_snapshots``, drops the oldest; ``latest()`` is the newest (index 0);
``get(i)`` counts from the newest (negative ``i`` from the oldest, as in Python); ``rollback()``
removes the newest and returns it; ``len()`` and ``clear()``. Lookups of what is not there give
None, as the seed's Options do. ``max_snapshots`` must be at least 1 (the seed's manager, given
0, still keeps one).

Buffer reuse. ``push(snapshot)`` stores the snapshot object itself: snapshots are copies already
and are never modified, so pushing copies nothing. ``take(states=..., ...)`` captures the live
state and pushes it in one step, and once the ring is full it copies into the buffers of the
snapshot it evicts (``np.copyto`` / ``Tensor.copy_``) instead of allocating. It must allocate
when:

- the ring is not full yet (nothing is evicted), or was just reopened from a directory;
- an array's dtype, shape or device differs from the evicted snapshot's array at that position;
- the evicted snapshot has been handed out: by ``latest()``, ``get()``, ``rollback()``, or because
  it came in through ``push`` (the caller holds it). A history never writes into a snapshot
  anyone else can see.

A failed ``take`` (an unsupported array, a bad config) changes nothing; a failure while copying
(a device error) may cost the oldest snapshot, which the ``take`` was evicting anyway.

Directory-backed (``directory=...``). Each pushed snapshot is first committed as a savepoint
checkpoint named ``snapshot-<seq>`` (``seq`` a zero-padded sequence number, one more than the
largest in the directory) with :meth:`InferenceSnapshot.save` (atomic, fsynced), then added to the
ring; the snapshots beyond the bound are then deleted with ``commit.transaction.discard`` (renamed
away in one step, then removed; manifests first on an object store). ``rollback`` loads the
newest, deletes its directory the same way, and returns it; ``clear`` deletes them all, oldest
first. Opening a history on a directory that already holds snapshots rebuilds the ring from their
sequence numbers (newest first; they are loaded lazily, when asked for), prunes those beyond
``max_snapshots``, and removes temporaries of interrupted saves by dead processes. A crash at any point leaves committed
snapshots only, so a restarted process can roll back. Every write failure is a
CheckpointWriteError carrying the failing call's ``errno`` (``errno.ENOSPC`` for a full disk);
a ``push`` or ``take`` whose save fails leaves the history as it was. One process writes a
directory at a time; a history is not thread-safe. The directory may be a local path or a URL
(``memory://h``) or a :class:`~savepoint.storage.paths.Location`: everything goes through its
store.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from savepoint import errors_map
from savepoint.commit.transaction import discard
from savepoint.commit.transaction import resolve as resolve_commit
from savepoint.inference.snapshot import InferenceSnapshot, SnapshotMetadata
from savepoint.runs.layout import checkpoint_arg, clean_stale_in
from savepoint.storage.paths import Location, PathArg, resolve

__all__ = ["PREFIX", "SnapshotHistory"]

PREFIX = "snapshot-"
_NAME = re.compile(r"snapshot-([0-9]{1,30})")


@dataclass
class _Entry:
    seq: int  # the directory's sequence number (in memory: a counter)
    snapshot: InferenceSnapshot | None  # None: on disk, not loaded
    private: bool  # filled by take() and never handed out: its buffers may be reused


class SnapshotHistory:
    """A bounded ring of snapshots, newest first; optionally backed by a directory."""

    def __init__(self, max_snapshots: int, directory: PathArg | None = None) -> None:
        if isinstance(max_snapshots, bool) or not isinstance(max_snapshots, int):
            raise TypeError(f"max_snapshots must be an int, got {type(max_snapshots).__name__}")
        if max_snapshots < 1:
            raise ValueError(f"max_snapshots must be at least 1, got {max_snapshots}")
        self._max = max_snapshots
        self._entries: deque[_Entry] = deque()
        self._next_seq = 0
        self._loc = None if directory is None else resolve(directory, what="snapshot directory")
        self._dir = None if self._loc is None else str(self._loc)
        if self._loc is not None:
            self._open(self._loc)

    # -- properties --------------------------------------------------------------------------

    @property
    def max_snapshots(self) -> int:
        return self._max

    @property
    def directory(self) -> str | None:
        return self._dir

    def path(self, index: int = 0) -> str | None:
        """The directory holding snapshot ``index`` (0 = newest; a URL off the local disk), or
        None in memory / if absent."""
        entry = self._entry(index)
        return str(self._where(entry.seq)) if entry is not None and self._loc is not None else None

    def __len__(self) -> int:
        return len(self._entries)

    def is_empty(self) -> bool:
        """The seed's ``is_empty``: whether no snapshot is held (``len(history) == 0``)."""
        return not self._entries

    def __repr__(self) -> str:
        where = f", directory={self._dir!r}" if self._dir is not None else ""
        return f"SnapshotHistory({len(self)}/{self._max}{where})"

    # -- adding ------------------------------------------------------------------------------

    def push(self, snapshot: InferenceSnapshot) -> None:
        """Add ``snapshot`` as the newest (no copy), dropping the oldest beyond the bound."""
        if not isinstance(snapshot, InferenceSnapshot):
            raise TypeError(f"expected an InferenceSnapshot, got {type(snapshot).__name__}")
        self._add(snapshot, private=False)

    def take(
        self,
        *,
        states: Iterable[Any],
        history: Iterable[Any] = (),
        step_count: int = 0,
        config: Mapping[str, Any] | None = None,
        metadata: SnapshotMetadata | Mapping[str, Any] | None = None,
    ) -> None:
        """Capture a snapshot of the live state (arguments as for InferenceSnapshot) and push
        it, reusing the evicted snapshot's buffers when it can (see the module docstring)."""
        prepared = InferenceSnapshot._prepare(states, history, step_count, config, metadata)
        donor = None
        if len(self._entries) >= self._max:
            oldest = self._entries[-1]
            if oldest.private and oldest.snapshot is not None:
                donor, oldest.snapshot, oldest.private = oldest.snapshot, None, False
                if self._loc is None:
                    # Leaving anyway; on disk it stays until the new snapshot is committed.
                    self._entries.pop()
        self._add(InferenceSnapshot._build(prepared, donor), private=True)

    def _add(self, snapshot: InferenceSnapshot, *, private: bool) -> None:
        seq = self._next_seq
        if self._loc is not None:
            snapshot.save(self._arg(seq))
        self._next_seq = seq + 1
        self._entries.appendleft(_Entry(seq, snapshot, private))
        self._prune()

    def _prune(self) -> None:
        while len(self._entries) > self._max:
            oldest = self._entries[-1]
            if self._loc is not None:
                self._discard(oldest.seq)
            self._entries.pop()

    # -- reading -----------------------------------------------------------------------------

    def _entry(self, index: int) -> _Entry | None:
        if isinstance(index, bool) or not isinstance(index, int):
            raise TypeError(f"index must be an int, got {type(index).__name__}")
        if not -len(self._entries) <= index < len(self._entries):
            return None
        return self._entries[index]

    def _snapshot(self, entry: _Entry) -> InferenceSnapshot:
        if entry.snapshot is None:
            entry.snapshot = InferenceSnapshot.load(self._arg(entry.seq))
        entry.private = False  # handed out: never written into again
        return entry.snapshot

    def get(self, index: int) -> InferenceSnapshot | None:
        """Snapshot ``index`` (0 = newest; negative counts from the oldest), or None."""
        entry = self._entry(index)
        return self._snapshot(entry) if entry is not None else None

    def latest(self) -> InferenceSnapshot | None:
        """The newest snapshot, or None when empty."""
        return self.get(0)

    def rollback(self) -> InferenceSnapshot | None:
        """Remove the newest snapshot and return it (None when empty). On a directory, it is
        loaded first and its checkpoint then deleted atomically; if loading fails (a damaged
        checkpoint) the error is raised and nothing is removed."""
        if not self._entries:
            return None
        entry = self._entries[0]
        snapshot = self._snapshot(entry)
        if self._loc is not None:
            self._discard(entry.seq)
        self._entries.popleft()
        return snapshot

    def clear(self) -> None:
        """Remove every snapshot (on a directory: delete them, oldest first)."""
        while self._entries:
            if self._loc is not None:
                self._discard(self._entries[-1].seq)
            self._entries.pop()

    # -- directory ---------------------------------------------------------------------------

    def _where(self, seq: int) -> Location:
        assert self._loc is not None
        return self._loc.join(f"{PREFIX}{seq:012d}")

    def _arg(self, seq: int) -> str | Location:
        """Snapshot ``seq`` as the path argument of InferenceSnapshot.save/load."""
        return checkpoint_arg(self._where(seq))

    def _discard(self, seq: int) -> None:
        where = self._where(seq)
        try:
            discard(where.store, where.path)
        except OSError as exc:
            raise errors_map.write_error(
                exc,
                str(where),
                f"deleting snapshot {where} failed",
                tail="; the history is unchanged",
                scheme=where.store.scheme,
            ) from exc

    def _open(self, directory: Location) -> None:
        store = directory.store
        try:
            store.makedirs(directory.path)
            clean_stale_in(store, directory.path)
            names = store.list(directory.path)
        except OSError as exc:
            raise errors_map.write_error(
                exc,
                str(directory),
                f"cannot open the snapshot directory {directory}",
                scheme=store.scheme,
            ) from exc
        seqs = []
        committed = []
        for name in names:
            match = _NAME.fullmatch(name)
            if match is None:
                continue
            seq = int(match.group(1))
            seqs.append(seq)
            canonical = name == f"{PREFIX}{seq:012d}"
            if canonical and resolve_commit(store, directory.join(name).path) is not None:
                committed.append(seq)
        # Past any name in the directory, committed or not, so a new snapshot never collides.
        self._next_seq = max(seqs, default=-1) + 1
        for seq in sorted(committed, reverse=True):
            self._entries.append(_Entry(seq, None, False))
        self._prune()
