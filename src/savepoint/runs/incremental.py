"""The blob store of an incremental run (``CheckpointManager(..., incremental=True)``).

:class:`BlobHandles` holds what every incremental save of one manager shares: the run's blob store
at ``<run>/blobs`` (``docs/blobs.md``; opened at its first use, which removes the records dead
processes of this host left there), the blob policy, one digest memo and patch tracker, and the
key prefixes declared frozen. It saves a checkpoint into the store (synchronously, or hands an
async save the same keywords), deletes the blobs no committed checkpoint names once retention
deleted checkpoints, and deletes the damaged blobs a checkpoint that failed verification names
(dedupe would otherwise name them in every later save). Collection and scrubbing are best
effort: a failure is logged (logger ``savepoint.runs.manager``) and left for the next one.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from savepoint import checkpoint
from savepoint.errors import CheckpointError
from savepoint.info import CheckpointInfo
from savepoint.options import SaveOptions
from savepoint.runs import layout
from savepoint.storage.paths import Location

__all__ = ["BlobHandles"]

log = logging.getLogger("savepoint.runs.manager")


class BlobHandles:
    """The blob store of the run at ``run`` and what its saves share (see the module docstring).

    ``policy``: a :class:`savepoint.blobs.BlobPolicy` (None: the default); ``frozen``: key
    prefixes of tensors that never change during the run (None: none)."""

    def __init__(self, run: Location, *, policy: Any = None, frozen: Iterable[str] | None) -> None:
        from savepoint.blobs import FastMemo
        from savepoint.blobs.patch import PatchTracker

        self.run, self.directory = run, str(run)
        self.policy = policy
        self.frozen = frozen
        self.memo = FastMemo()
        self.tracker = PatchTracker()
        self._store: Any = None  # the BlobStore, once opened

    def store(self) -> Any:
        """The run's blob store, ``<run>/blobs`` (created at the first incremental save). The
        first use removes what dead processes of this host left in flight there."""
        if self._store is None:
            from savepoint.blobs import RUN_BLOBS, BlobStore

            store = self.run.store
            blobs = BlobStore(store, store.join(self.run.path, RUN_BLOBS))
            self._clear_dead_records(blobs)
            self._store = blobs
        return self._store

    def save(
        self, target: str | Location, state: Any, meta: dict[str, Any], options: SaveOptions
    ) -> CheckpointInfo:
        """An incremental save of checkpoint ``target`` into the run's blob store."""
        return checkpoint.save_incremental(
            target,
            state,
            meta,
            self.store(),
            self.policy,
            options.max_file_bytes,
            options.writers,
            options.direct,
            options.progress,
            memo=self.memo,
            tracker=self.tracker,
            frozen=self.frozen,
            # Sharded: every rank puts its pieces; when this returns on rank 0 every rank has
            # closed its session, so the collection after retention (rank 0's) is not deferred.
            process_group=options.process_group,
            timeout=options.timeout,
        )

    def async_options(self, shared: bool = True) -> dict[str, Any]:
        """The keywords of an async save into the store (``AsyncCheckpointer.save``): its
        background thread runs the store's save session, then (committed) retention and the
        collection, after the session is closed. ``shared=False``: without this manager's memo
        and tracker (a writer process keeps its own)."""
        options = {"blobs": self.store(), "blob_policy": self.policy, "frozen": self.frozen}
        if shared:
            options.update(memo=self.memo, tracker=self.tracker)
        return options

    def before_gc(self) -> None:
        """For ``gc()``, before the blob collection: remove the records dead processes of this
        host left (a store opened now does so as it opens)."""
        if self._store is None:
            self.store()
        else:
            self._clear_dead_records(self._store)

    def referenced(self) -> set[str]:
        """The blob digests every committed checkpoint of the run names: each step directory
        (pending deletions included, until they are gone) and the aliases that are copies.
        A manifest that cannot be read raises: the collection then deletes nothing."""
        from savepoint.engine.read import blob_digests

        store, run = self.run.store, self.run.path
        steps = [layout.step_location(self.run, s) for s in layout.committed_steps(self.run)]
        aliases = [Location(store, store.join(run, a)) for a in (layout.LATEST, layout.BEST)]
        return blob_digests(steps + aliases)

    def collect(self) -> None:
        """Delete the run's blobs no committed checkpoint names (after retention deleted
        checkpoints; nothing before the store is opened). A failure is logged and left for the
        next collection."""
        if self._store is None:
            return
        try:
            report = self._store.collect(self.referenced, grace=0)
        except (CheckpointError, OSError) as exc:
            log.warning("%s: cannot collect unused blobs yet: %s", self.directory, exc)
            return
        if report.deleted:
            log.info(
                "%s: deleted %d unused blobs (%d bytes)",
                self.directory,
                len(report.deleted),
                report.bytes_freed,
            )

    def scrub(self, step: int) -> None:
        """Delete the damaged blobs checkpoint ``step`` names (it did not verify): dedupe would
        otherwise name them in every later save; the next save writes them again from the
        state it is given. Best effort: a failure is logged."""
        from savepoint.engine.read import blob_digests

        try:
            removed = self.store().scrub(blob_digests([layout.step_location(self.run, step)]))
        except (CheckpointError, OSError) as exc:
            log.warning(
                "%s: cannot check the blobs of checkpoint %d: %s", self.directory, step, exc
            )
            return
        if removed:
            log.warning(
                "%s: removed %d damaged blob(s) named by checkpoint %d (%s); the next save "
                "writes their content again",
                self.directory,
                len(removed),
                step,
                ", ".join(d[:12] for d in removed),
            )

    def _clear_dead_records(self, blobs: Any) -> None:
        """Remove the blob store records dead processes of this host left
        (:func:`savepoint.blobs.gc.clear_dead_records`), before the first save and at gc()."""
        from savepoint.blobs.gc import clear_dead_records

        try:
            removed = clear_dead_records(blobs)
        except OSError as exc:  # (CheckpointError included) the timeouts deal with them
            log.warning("%s: cannot look for dead saves' blob records: %s", self.directory, exc)
            return
        if removed:
            log.info(
                "%s: removed %d blob store records of dead processes of this host",
                self.directory,
                removed,
            )
