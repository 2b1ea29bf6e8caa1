"""Storage tiers of a run: copies of its checkpoints on slower, safer places, made in the background.

A run's own directory is its fastest tier: every save commits there (on local NVMe, or on a RAM
disk such as ``/dev/shm``), and ``save`` returns (or, async, the snapshot is taken) as soon as it
has. Each further :class:`Tier` (another disk, an object store) is slower and outlives more
failures; it receives a copy of the checkpoints saved at least ``every`` steps after the last one
it received, and keeps the ``keep`` newest of them::

    mgr = sp.CheckpointManager(
        "/dev/shm/run-7",                                      # RAM: every save, the newest 2
        keep_last=2,
        tiers=[
            sp.Tier("/scratch/run-7", every=500, keep=3),      # local disk
            sp.Tier("s3://bucket/run-7", every=2000),          # object store: all of them
        ],
    )

Layout: a tier holds ``checkpoints/step-<step>/`` as a run directory does, and ``tier.json``
naming the run it belongs to (a tier of another run is refused with RunMismatchError rather than
mixed in). No report and no aliases: a tier is a shelf of committed checkpoints. A tier of an
incremental run (``CheckpointManager(..., incremental=True)``) also has ``blobs/``, its own blob
store, laid out as the run directory's is (the manifests name it ``../../blobs``).

Copy-up (:class:`TierCopier`): one background thread per manager copies a committed checkpoint to
each tier it is due on with :func:`savepoint.copy` (every checksum of the source checked first,
committed on the tier through the save's Transaction: a kill leaves the tier's previous
checkpoints and a temporary the next copy tidies). Then, if the tier holds more than ``keep``
checkpoints, the new copy is read back and verified there and only then are the oldest deleted
(never the step the run resumed from). A failed copy-up is kept and raised once, as
CheckpointWriteError naming the tier, the step and the cause, by the manager's next ``save``,
``wait()`` or ``close()`` (like any background failure); the copy of the next due step is tried
as usual. The run directory's retention never deletes a checkpoint whose copy-up has not finished.

Incremental checkpoints: :func:`savepoint.copy` brings along only the blobs the tier's store does
not have yet (an unchanged frozen base is copied up once), checked on the way, in a session of
the tier's store. Retention on the tier deletes step directories and then collects the tier's
blob store by reference counting (the digests every checkpoint still on the tier names), as the
manager collects its run's store.

Restore: :meth:`TierCopier.candidates` lists, for each step, where it can be read, fastest tier
first; the manager's ``restore()`` tries them newest step first and falls back tier by tier, then
step by step (see :mod:`savepoint.runs.manager`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from savepoint.codecs import bounded_json
from savepoint.commit.transaction import discard
from savepoint.errors import CheckpointError, CheckpointWriteError, RunMismatchError
from savepoint.runs import layout
from savepoint.storage.paths import Location
from savepoint.storage.paths import resolve as resolve_path

if TYPE_CHECKING:
    from savepoint.blobs import BlobStore

__all__ = ["TIER_FILE", "Tier", "TierCopier"]

log = logging.getLogger(__name__)

TIER_FILE = "tier.json"


@dataclasses.dataclass(frozen=True)
class Tier:
    """A place that keeps copies of a run's checkpoints (see the module docstring).

    ``url``: a directory or URL (``s3://bucket/run``, ``/mnt/scratch/run``); ``every``: copy a
    saved step here when it is at least this many steps after the last step copied (1: every
    save); ``keep``: how many of the newest copies stay (None: all); ``name``: how messages and
    ``restore`` name the tier (default: its URL)."""

    url: str
    every: int = 1
    keep: int | None = None
    name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.url, (str, os.PathLike)):
            raise TypeError(f"Tier url must be a path or URL string, not {self.url!r}")
        object.__setattr__(self, "url", os.fspath(self.url))
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"Tier every must be a positive int, not {self.every!r}")
        if self.keep is not None and (
            isinstance(self.keep, bool) or not isinstance(self.keep, int) or self.keep < 1
        ):
            raise ValueError(f"Tier keep must be a positive int or None, not {self.keep!r}")
        if self.name is not None and not isinstance(self.name, str):
            raise TypeError(f"Tier name must be a str, not {self.name!r}")

    @property
    def label(self) -> str:
        return self.name or self.url


class TierCopier:
    """Background copy-up of a run's checkpoints to its tiers (see the module docstring).

    ``run_id``: what ``tier.json`` records and checks (the run's name and creation time);
    ``protected()``: steps a tier must never delete (the step the run resumed from)."""

    def __init__(
        self,
        tiers: Sequence[Tier],
        run_id: dict[str, Any],
        *,
        protected: Callable[[], Iterable[int]] = tuple,
        writable: bool = True,
    ) -> None:
        labels = [t.label for t in tiers]
        if len(set(labels)) != len(labels):
            raise ValueError(f"tiers need distinct names (or URLs): {labels}")
        self.tiers = list(tiers)
        self.run_id = dict(run_id)
        self._protected = protected
        self._where = {t.label: resolve_path(t.url, what=f"tier {t.label!r}") for t in tiers}
        self._lock = threading.Lock()
        self._pending: dict[int, int] = {}  # step -> copy-ups not finished
        self._cleared: set[str] = set()  # tiers whose dead records were looked for
        self._last: dict[str, int | None] = {}
        self._errors: list[CheckpointError] = []
        self._futures: list[Future[None]] = []
        self._executor: ThreadPoolExecutor | None = None
        for tier in self.tiers:
            if writable:
                self._claim(tier)
            steps = self._steps(tier)
            self._last[tier.label] = steps[-1] if steps else None

    # -- where ---------------------------------------------------------------------------------

    def location(self, tier: Tier, step: int) -> Location:
        return layout.step_location(self._where[tier.label], step)

    def _steps(self, tier: Tier) -> list[int]:
        where = self._where[tier.label]
        if where.store.stat(where.join(layout.CHECKPOINTS).path) is None:
            return []
        return layout.committed_steps(where)

    def _claim(self, tier: Tier) -> None:
        """Make the tier's directory and check (or write) its ``tier.json``."""
        where = self._where[tier.label]
        store = where.store
        path = where.join(TIER_FILE).path
        doc = {"format": "savepoint-tier", "version": 1, "run": self.run_id}
        try:
            store.makedirs(where.join(layout.CHECKPOINTS).path)
            if store.stat(path) is None:
                try:
                    store.put(path, json.dumps(doc, sort_keys=True).encode(), exclusive=True)
                except FileExistsError:
                    pass  # another writer claimed it a moment ago: checked below
            raw = store.read_small(path, cap=1 << 16)
        except CheckpointError:
            raise
        except OSError as exc:
            raise CheckpointWriteError(
                f"tier {tier.label!r} ({where}): cannot prepare it: {exc.strerror or exc}",
                path=str(where),
                errno=exc.errno,
            ) from exc
        try:
            found = bounded_json.loads(raw, bounded_json.StrictJSONError, str(where))["run"]
        except (ValueError, KeyError, TypeError):
            found = None
        if found != self.run_id:
            raise RunMismatchError(
                f"tier {tier.label!r} ({where}) holds checkpoints of another run ({found}, this "
                f"is {self.run_id}); give each run its own tier directory",
                path=str(where),
            )

    # -- copy-up -------------------------------------------------------------------------------

    def due(self, step: int) -> list[Tier]:
        """The tiers a checkpoint of ``step`` is to be copied to."""
        with self._lock:
            return [
                t
                for t in self.tiers
                if (last := self._last[t.label]) is None or step - last >= t.every or step < last
            ]

    def submit(
        self, step: int, source: str | Location, tiers: Sequence[Tier] | None = None
    ) -> list[Tier]:
        """Copy the committed checkpoint ``source`` of ``step`` to the tiers it is due on (or to
        ``tiers``, due or not), in the background; returns those tiers."""
        due = self.due(step) if tiers is None else list(tiers)
        if not due:
            return []
        with self._lock:
            for t in due:
                self._last[t.label] = step
            self._pending[step] = self._pending.get(step, 0) + 1
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="savepoint-tiers")
            future = self._executor.submit(self._copy_up, step, source, due)
            self._futures = [f for f in self._futures if not f.done()] + [future]
        return due

    def pending_steps(self) -> set[int]:
        """Steps whose copy-up has not finished: the run directory must keep them."""
        with self._lock:
            return set(self._pending)

    def _copy_up(self, step: int, source: str | Location, due: list[Tier]) -> None:
        from savepoint.blobs import PutStats
        from savepoint.transfer import copy

        try:
            for tier in due:
                target = self.location(tier, step)
                started = time.perf_counter()
                try:
                    stats = PutStats()
                    copy(source, target, verify=True, stats=stats)
                    log.info(
                        "step %d copied to tier %r (%s) in %.3f s%s",
                        step,
                        tier.label,
                        target,
                        time.perf_counter() - started,
                        f"; {stats.blobs_written} blobs copied ({stats.bytes_stored} bytes), "
                        f"{stats.blobs_reused} already there"
                        if stats.blobs_written or stats.blobs_reused
                        else "",
                    )
                    self._prune(tier, step)
                except BaseException as exc:  # kept, and raised by the manager
                    self._fail(tier, step, exc)
        finally:
            with self._lock:
                left = self._pending.get(step, 1) - 1
                if left:
                    self._pending[step] = left
                else:
                    self._pending.pop(step, None)

    def _prune(self, tier: Tier, newest: int) -> None:
        if tier.keep is None:
            return
        steps = self._steps(tier)
        if len(steps) <= tier.keep:
            return
        from savepoint import checkpoint

        # Nothing goes before the new copy has been read back and verified on the tier.
        checkpoint.verify(layout.checkpoint_arg(self.location(tier, newest)))
        protected = set(self._protected()) | {newest}
        extra = len(steps) - tier.keep
        deleted = 0
        for step in steps:
            if extra <= 0:
                break
            if step in protected:
                continue
            where = self.location(tier, step)
            discard(where.store, where.path)
            log.info("tier %r: deleted step %d (keep=%d)", tier.label, step, tier.keep)
            extra -= 1
            deleted += 1
        if deleted:
            self._collect(tier)

    # -- blobs ---------------------------------------------------------------------------------

    def blob_store(self, tier: Tier) -> BlobStore | None:
        """The tier's blob store, ``<tier>/blobs`` (where the incremental checkpoints copied
        there keep their blobs), or None when there is none."""
        from savepoint.blobs import RUN_BLOBS, BlobStore
        from savepoint.blobs.store import CONFIG

        where = self._where[tier.label].join(RUN_BLOBS)
        if where.store.stat(where.join(CONFIG).path) is None:
            return None
        return BlobStore(where.store, where.path, create=False)

    def referenced_blobs(self, tier: Tier) -> set[str]:
        """The blob digests every committed checkpoint on the tier names. A manifest that
        cannot be read raises: a collection then deletes nothing."""
        from savepoint.engine.read import blob_digests

        return blob_digests(self.location(tier, step) for step in self._steps(tier))

    def _collect(self, tier: Tier) -> None:
        """Delete the tier's blobs that no checkpoint kept there names (after retention deleted
        checkpoints), as the manager collects its run's store: reference counting under the
        blob store's protocol (a copy-up in flight holds it back). A failure is logged and
        left for the next collection."""
        from savepoint.blobs.gc import clear_dead_records

        try:
            blobs = self.blob_store(tier)
            if blobs is None:
                return
            if tier.label not in self._cleared:  # a copy-up of ours killed before, say
                self._cleared.add(tier.label)
                clear_dead_records(blobs)
            report = blobs.collect(lambda: self.referenced_blobs(tier), grace=0)
        except (CheckpointError, OSError) as exc:
            log.warning("tier %r: cannot collect unused blobs yet: %s", tier.label, exc)
            return
        if report.deleted:
            log.info(
                "tier %r: deleted %d unused blobs (%d bytes)",
                tier.label,
                len(report.deleted),
                report.bytes_freed,
            )

    def _fail(self, tier: Tier, step: int, exc: BaseException) -> None:
        cause = f"{type(exc).__name__}: {exc}" if not isinstance(exc, CheckpointError) else exc
        error = CheckpointWriteError(
            f"copying step {step} to tier {tier.label!r} ({self._where[tier.label]}) failed: "
            f"{cause}; the run directory still has the checkpoint, and the next step due is "
            "copied as usual",
            path=str(self.location(tier, step)),
            errno=getattr(exc, "errno", None),
        )
        error.__cause__ = exc
        log.warning("%s", error)
        with self._lock:
            self._errors.append(error)

    def raise_error(self) -> None:
        """Raise (once) the first copy-up failure not yet reported."""
        with self._lock:
            if not self._errors:
                return
            error, self._errors = self._errors[0], []
        raise error

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for every copy-up submitted so far (at most ``timeout`` seconds): whether they
        are all done."""
        from concurrent.futures import wait as wait_for

        with self._lock:
            futures = list(self._futures)
        return not wait_for(futures, timeout=timeout).not_done

    def close(self) -> None:
        self.wait()
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)

    # -- restore -------------------------------------------------------------------------------

    def candidates(self) -> dict[int, list[tuple[Tier, Location]]]:
        """Every committed checkpoint on the tiers: step -> [(tier, location)], tiers in the
        order given (fastest first). An unreachable tier is skipped with a log record."""
        found: dict[int, list[tuple[Tier, Location]]] = {}
        for tier in self.tiers:
            try:
                steps = self._steps(tier)
            except (CheckpointError, OSError) as exc:
                log.warning("tier %r cannot be listed, skipped: %s", tier.label, exc)
                continue
            for step in steps:
                found.setdefault(step, []).append((tier, self.location(tier, step)))
        return found
