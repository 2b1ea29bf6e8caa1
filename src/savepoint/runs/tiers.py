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

Layout: a tier holds ``checkpoints/step-<step>/`` as a run directory does, ``tier.json`` naming
the run it belongs to, and ``.writer.lock``, the lock of the one manager that copies up to it. No
report and no aliases: a tier is a shelf of committed checkpoints. A tier of an incremental run
(``CheckpointManager(..., incremental=True)``) also has ``blobs/``, its own blob store, laid out as
the run directory's is (the manifests name it ``../../blobs``).

Ownership: a tier belongs to exactly one run. ``tier.json`` records the run's name, variant and
``id`` (the ``run_id`` made with the run and kept in its ``run.json`` and ``report.json``: random,
so two runs never share it, whatever their names)::

    {"format": "savepoint-tier", "version": 2,
     "run": {"name": "run-7", "variant": null, "id": "9f0c...e1"}}

A writing manager takes the tier's writer lock (``store.lock(<tier>/.writer.lock)``: ``flock`` on a
disk, a lease object on an object store, as a run directory's, :mod:`savepoint.runs.lock`) before
it reads or writes ``tier.json``, and holds it until ``close()``. A second run is refused with
RunMismatchError: while another manager holds the tier's lock (two jobs started from one config;
a restarted job whose old process still runs), and when ``tier.json`` names another run (another
id, name or variant). Nothing of the other run is touched. Read-only managers (and the ranks
other than 0 of a sharded run) take no lock; they check ``tier.json`` the same way.

Two exceptions, both taken under the lock:

- a run directory created by this very open (no ``run.json``, no ``report.json``, no checkpoint:
  a job restarted on a new machine whose run directory, on a RAM disk, died with the old one)
  continues the run its tiers belong to: it takes that run's id (written to its ``run.json``),
  so that ``restore()`` can read the tiers. (To start a new run, give it its own tiers.) So does
  a run directory made before run ids (its ``run.json`` has none), whose name and variant are
  all that can be compared, as before.
- a ``tier.json`` of version 1 (savepoint before run ids: name and variant only) is adopted by the
  first run of that name and variant whose writer opens it: its id is written there. Until then a
  run with the same name and variant could have written it too, so this is the best that can be
  known about such a tier: each run should have had its own.

A failed read of ``tier.json`` (a failed request, an I/O error) is never taken as "no
``tier.json``": the open fails (CheckpointError) and nothing is written.

Copy-up (:class:`TierCopier`): one background thread per manager copies a committed checkpoint to
each tier it is due on with :func:`savepoint.copy` (every checksum of the source checked first,
committed on the tier through the save's Transaction: a kill leaves the tier's previous
checkpoints and a temporary the next copy tidies). Then, if the tier holds more than ``keep``
checkpoints, the new copy is read back and verified there and only then are the oldest deleted
(never the step the run resumed from). After a resume from step ``k``, the copy-up of a step
``s`` also deletes the tier's steps after ``max(s, k)`` (once the new copy is verified there):
they belong to the timeline the run abandoned, as the run directory deletes its own when the new
timeline commits its first checkpoint. A failed copy-up is kept and raised once, as
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
step by step (see :mod:`savepoint.runs.restoring`). A tier that cannot be listed fails the restore
(CheckpointError naming it) rather than being skipped: its checkpoints are not "none".
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from savepoint import errors_map
from savepoint.codecs import bounded_json
from savepoint.commit.transaction import discard
from savepoint.errors import (
    CheckpointError,
    CheckpointWriteError,
    CorruptCheckpointError,
    RunLockedError,
    RunMismatchError,
)
from savepoint.runs import layout
from savepoint.runs.lock import WriterLock
from savepoint.storage.paths import Location
from savepoint.storage.paths import resolve as resolve_path

if TYPE_CHECKING:
    from savepoint.blobs import BlobStore
    from savepoint.runs.peers import PeerTier

__all__ = ["TIER_FILE", "Tier", "TierCopier"]

log = logging.getLogger(__name__)

TIER_FILE = "tier.json"
TIER_VERSION = 2  # 1: the run named by name and variant only (before run ids)
_TIER_CAP = 1 << 16


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

    @staticmethod
    def peers(
        replicas: int = 1,
        node: str | None = None,
        memory_dir: str | None = None,
        budget: int | None = None,
        timeout: float = 60.0,
    ) -> PeerTier:
        """The peer-memory tier (:mod:`savepoint.runs.peers`, docs/peers.md): each rank keeps
        its part of every checkpoint in its node's memory and sends it to ``replicas`` ranks on
        other nodes; ``restore()`` reads it first."""
        from savepoint.runs.peers import PeerTier

        return PeerTier(replicas, node, memory_dir, budget, timeout)


class TierCopier:
    """Background copy-up of a run's checkpoints to its tiers (see the module docstring).

    ``run``: what ``tier.json`` records and checks of the run (its name and variant), with its
    ``run_id`` under ``"id"`` (None or absent: not known here, as on the ranks other than 0 of a
    sharded run before rank 0 wrote ``run.json``; then name and variant are checked alone).
    ``inherit``: the run's id was made by this open (a new run directory, or a run made before
    run ids): it may continue the run its tiers belong to, and :attr:`run_id` is then that run's
    id, for the caller to record.
    ``protected()``: the step the run resumed from, if it did: never deleted (and the steps
    after it and after a new copy belong to the abandoned timeline: :func:`_doomed`).
    ``writable``: take each tier's writer lock and claim it (else check ``tier.json`` only).
    Call :meth:`close` to release the locks."""

    def __init__(
        self,
        tiers: Sequence[Tier],
        run: dict[str, Any],
        *,
        inherit: bool = False,
        protected: Callable[[], Iterable[int]] = tuple,
        writable: bool = True,
    ) -> None:
        labels = [t.label for t in tiers]
        if len(set(labels)) != len(labels):
            raise ValueError(f"tiers need distinct names (or URLs): {labels}")
        self.tiers = list(tiers)
        self.run = {k: v for k, v in run.items() if k != "id"}
        self.run_id: str | None = run.get("id")
        self._inherit = inherit
        self._locks: dict[str, WriterLock] = {}
        self._protected = protected
        self._where = {t.label: resolve_path(t.url, what=f"tier {t.label!r}") for t in tiers}
        self._lock = threading.Lock()
        self._pending: dict[int, int] = {}  # step -> copy-ups not finished
        self._cleared: set[str] = set()  # tiers whose dead records were looked for
        self._last: dict[str, int | None] = {}
        self._errors: list[CheckpointError] = []
        self._futures: list[Future[None]] = []
        self._executor: ThreadPoolExecutor | None = None
        try:
            if writable:
                self._claim()
            else:
                for tier in self.tiers:
                    self._check(tier)
            for tier in self.tiers:
                steps = self._steps(tier)
                self._last[tier.label] = steps[-1] if steps else None
        except BaseException:
            self.release_locks()
            raise

    # -- where ---------------------------------------------------------------------------------

    def location(self, tier: Tier, step: int) -> Location:
        return layout.step_location(self._where[tier.label], step)

    def _steps(self, tier: Tier) -> list[int]:
        where = self._where[tier.label]
        if where.store.stat(where.join(layout.CHECKPOINTS).path) is None:
            return []
        return layout.committed_steps(where)

    def _claim(self) -> None:
        """Make each tier's directory and take its writer lock; then check (or write) every
        ``tier.json`` (see "Ownership" in the module docstring)."""
        found: dict[str, dict[str, Any] | None] = {}
        for tier in self.tiers:
            where = self._where[tier.label]
            try:
                where.store.makedirs(where.join(layout.CHECKPOINTS).path)
                self._take_lock(tier)
            except CheckpointError:
                raise
            except OSError as exc:
                raise self._prepare_error(tier, exc) from exc
            found[tier.label] = self._read(tier)
        if self._inherit:
            # A run directory made by this open continues the run its tiers belong to.
            ids = {f.get("id") for f in found.values() if f is not None and self._same_name(f)}
            ids.discard(None)
            if len(ids) == 1:
                (theirs,) = ids
                if theirs != self.run_id:
                    log.info(
                        "the tiers belong to run %s of the same name: this new run directory "
                        "continues it (takes its run id)",
                        theirs,
                    )
                    self.run_id = theirs
        for tier in self.tiers:
            run = found[tier.label]
            if run is not None:
                self._compare(tier, run)
            if run is None or "id" not in run:
                # A new tier, or one of version 1 (name and variant only): claimed for this run.
                try:
                    self._write(tier, exclusive=run is None)
                except CheckpointError:
                    raise
                except OSError as exc:
                    raise self._prepare_error(tier, exc) from exc

    def _prepare_error(self, tier: Tier, exc: OSError) -> CheckpointWriteError:
        where = self._where[tier.label]
        return errors_map.write_error(
            exc,
            str(where),
            f"tier {tier.label!r} ({where}): cannot prepare it",
            scheme=where.store.scheme,
        )

    def _take_lock(self, tier: Tier) -> None:
        """Take the tier's writer lock (RunMismatchError while another manager holds it)."""
        where = self._where[tier.label]
        try:
            lock = WriterLock.acquire(where)
        except NotImplementedError:  # a store without locks: tier.json alone decides
            log.info("tier %r (%s): the store has no locks", tier.label, where)
            return
        except RunLockedError as exc:
            raise RunMismatchError(
                f"tier {tier.label!r} ({where}) is being written by another run's manager "
                f"({exc.holder or 'holder unknown'}); a tier belongs to one run: give each run "
                "its own tier directory (or close the other manager first)",
                path=str(where),
            ) from None
        self._locks[tier.label] = lock

    def _check(self, tier: Tier) -> None:
        """A reader's check: the tier, if it has a ``tier.json``, belongs to this run."""
        found = self._read(tier)
        if found is not None:
            self._compare(tier, found)

    def _read(self, tier: Tier) -> dict[str, Any] | None:
        """``tier.json``'s ``run`` member; None where there is no ``tier.json``. A failed read
        raises (never "absent"); a damaged one is CorruptCheckpointError."""
        where = self._where[tier.label]
        path = where.join(TIER_FILE)
        try:
            raw = where.store.read_small(path.path, cap=_TIER_CAP)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except CheckpointError:
            raise
        except OSError as exc:
            raise CheckpointError(
                f"tier {tier.label!r}: cannot read {path} ({exc.strerror or exc}); nothing was "
                "written: try again once the store answers",
                path=str(path),
            ) from exc
        doc = bounded_json.loads(raw, CorruptCheckpointError, str(path))
        run = doc.get("run") if isinstance(doc, dict) else None
        if not (isinstance(doc, dict) and doc.get("format") == "savepoint-tier") or not (
            isinstance(run, dict) and isinstance(run.get("id", ""), str)
        ):
            raise CorruptCheckpointError(
                f"{path} is not a savepoint tier.json; it is not this run's tier: give the run "
                "another tier directory (or, if the tier is this run's, move the file aside)",
                path=str(path),
            )
        return run

    def _same_name(self, found: dict[str, Any]) -> bool:
        return {k: v for k, v in found.items() if k != "id"} == self.run

    def _compare(self, tier: Tier, found: dict[str, Any]) -> None:
        theirs = found.get("id")
        if self._same_name(found) and (
            theirs is None or self.run_id is None or theirs == self.run_id
        ):
            return
        where = self._where[tier.label]
        ours = {**self.run, "id": self.run_id} if self.run_id is not None else self.run
        raise RunMismatchError(
            f"tier {tier.label!r} ({where}) holds checkpoints of another run ({found}, this "
            f"is {ours}); give each run its own tier directory",
            path=str(where),
        )

    def _write(self, tier: Tier, *, exclusive: bool) -> None:
        """Write ``tier.json`` naming this run (under the tier's lock)."""
        where = self._where[tier.label]
        path = where.join(TIER_FILE).path
        run = {**self.run, "id": self.run_id} if self.run_id is not None else self.run
        doc = {"format": "savepoint-tier", "version": TIER_VERSION, "run": run}
        data = json.dumps(doc, sort_keys=True).encode()
        try:
            where.store.put(path, data, exclusive=exclusive)
        except FileExistsError:  # another writer claimed it a moment ago (a store without locks)
            found = self._read(tier)
            if found is None:
                raise
            self._compare(tier, found)

    def check_lock(self, tier: Tier) -> None:
        """Raise unless this manager still holds the tier's writer lock (a lease renewed)."""
        lock = self._locks.get(tier.label)
        if lock is not None:
            lock.check()

    def release_locks(self) -> None:
        """Release every tier's writer lock (idempotent)."""
        locks, self._locks = self._locks, {}
        for lock in locks.values():
            with contextlib.suppress(OSError, CheckpointError):
                lock.release()

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
                    self.check_lock(tier)  # still this run's tier (a lease lost is not)
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
        """Retention on ``tier`` once ``newest`` is copied there (:func:`_doomed`)."""
        doomed = _doomed(self._steps(tier), newest, tier.keep, set(self._protected()))
        if not doomed:
            return
        from savepoint import checkpoint

        # Nothing goes before the new copy has been read back and verified on the tier.
        checkpoint.verify(layout.checkpoint_arg(self.location(tier, newest)))
        for step, why in doomed:
            where = self.location(tier, step)
            discard(where.store, where.path)
            log.info("tier %r: deleted step %d (%s)", tier.label, step, why)
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
        """Wait for the copy-ups, then release the tiers' writer locks."""
        try:
            self.wait()
            with self._lock:
                executor, self._executor = self._executor, None
            if executor is not None:
                executor.shutdown(wait=True)
        finally:
            self.release_locks()

    # -- restore -------------------------------------------------------------------------------

    def candidates(self) -> dict[int, list[tuple[Tier, Location]]]:
        """Every committed checkpoint on the tiers: step -> [(tier, location)], tiers in the
        order given (fastest first). A tier that cannot be listed raises CheckpointError naming
        it: skipped, its checkpoints would read as none, and a restore would start over (or
        from an older step) with the newest copies out of sight."""
        found: dict[int, list[tuple[Tier, Location]]] = {}
        for tier in self.tiers:
            try:
                steps = self._steps(tier)
            except (CheckpointError, OSError) as exc:
                where = self._where[tier.label]
                raise CheckpointError(
                    f"tier {tier.label!r} ({where}) cannot be listed ({exc}); a restore without "
                    "it could miss its newest checkpoints: try again once it answers, or open "
                    "the manager without that tier",
                    path=str(where),
                ) from exc
            for step in steps:
                found.setdefault(step, []).append((tier, self.location(tier, step)))
        return found


def _doomed(
    steps: list[int], newest: int, keep: int | None, protected: set[int]
) -> list[tuple[int, str]]:
    """The steps a tier deletes once ``newest`` is copied there, each with why. After a resume
    (``protected`` holds the step resumed from, never deleted): those after ``max(newest,
    resumed)``, which belong to the timeline the run abandoned (the run directory's rule,
    :meth:`savepoint.runs.books.Books.record`; left there, "latest" could take one). Then, past
    ``keep`` (None: no limit), the oldest of the others, never a protected one or ``newest``."""
    horizon = max([newest, *protected]) if protected else None
    doomed = [(s, "abandoned timeline") for s in steps if horizon is not None and s > horizon]
    rest = [s for s in steps if horizon is None or s <= horizon]
    extra = len(rest) - keep if keep is not None else 0
    for step in rest:
        if extra <= 0:
            break
        if step not in protected and step != newest:
            doomed.append((step, f"keep={keep}"))
            extra -= 1
    return doomed
