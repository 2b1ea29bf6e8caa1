"""Opening a run directory: the open of a :class:`~savepoint.runs.manager.CheckpointManager`.

:class:`Opening` is one open, in order:

1. the directory: a writer (rank 0 of a process group, or the only process) creates it and takes
   the run's writer lock (:mod:`savepoint.runs.lock`), then removes the temporaries of dead
   processes; other ranks only create ``checkpoints/``. A directory this process cannot write
   (read-only media, no permission: ``read_only=None``) or ``read_only=True`` gives a read-only
   open, with the reason (the manager writes nothing and takes no lock: its queries and
   ``restore`` work, ``save`` is CheckpointWriteError); ``read_only=False`` there is
   CheckpointWriteError;
2. the run: ``run.json`` (or, when it was lost, the identity ``report.json`` records; a new run
   takes the one asked for) compared with the name, variant, config and ``num_params`` asked
   for: a different name, variant or ``num_params`` is RunMismatchError, a different config a
   config change (refused by ``strict_config=True``); ``report.json`` read, checked against
   ``run.json`` and the committed checkpoints (``check_consistent``: the read-only view of
   :mod:`savepoint.runs.view` opens inconsistent runs too), or a fresh one when there is none;
3. the tiers (:class:`~savepoint.runs.tiers.TierCopier`; a new run directory may continue the
   run its tiers belong to, and takes its id), and the peer-memory tier
   (:class:`~savepoint.runs.peers.PeerMemory`: nothing is exchanged with the other ranks until
   the first save or restore);
4. only then, writes: ``run.json`` when it is new or lagged behind, the config change (a
   writer records it in ``report.json`` and ``run.json``; a read-only open only warns), and the
   repair of what an interrupted writer left (:func:`repair`);
5. the preemption handlers (:class:`~savepoint.runs.preemption.Preemption`).

The result is one :class:`Opened` record. An open that fails writes nothing (its writes are
step 4's) and gives back what it took: the handlers, the tiers' locks, the writer lock, the
history log. A store that refused to be looked at (no such bucket, a refused credential) is a
savepoint error naming the run, the OSError as its cause; unreadable run files are
CheckpointPermissionError, and a damaged ``report.json`` is CorruptCheckpointError saying how to
have it rebuilt.

:func:`repair` (step 4): the history log's torn last line and the segments a compaction left
behind are mended, deletions the report lists as ``discarding`` are finished, checkpoints a
killed save committed but did not record are listed (nothing committed is dropped), and
``latest/`` and ``best/`` are made to agree with ``report.json`` (republished, or removed when
the report names no such checkpoint).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import warnings
import weakref
from collections.abc import Callable
from typing import Any

from savepoint import errors_map
from savepoint.errors import CheckpointError, CheckpointWriteError, RunMismatchError
from savepoint.runs import history, layout
from savepoint.runs.books import Books, plain, write_error
from savepoint.runs.config import ManagerConfig
from savepoint.runs.lock import WriterLock
from savepoint.runs.peers import PeerMemory
from savepoint.runs.preemption import Preemption
from savepoint.runs.report import (
    REPORT_FILE,
    RUN_FILE,
    Report,
    RunInfo,
    check_consistent,
    config_diff,
    lagging_run,
    new_run_id,
    now_iso,
    read_history,
    read_json,
    read_report,
    write_json,
)
from savepoint.runs.settle import Settle
from savepoint.runs.tiers import TierCopier
from savepoint.storage.paths import Location

__all__ = ["Opened", "Opening", "not_writable", "open_error", "rank", "repair", "write_run"]

_READ_ONLY_ERRNOS = (errno.EROFS, errno.EACCES, errno.EPERM)


@dataclasses.dataclass
class Opened:
    """What an open found and took; the manager keeps it until ``close()``."""

    leader: bool  # rank 0 of the process group (or no group): keeps the run's books
    read_only: bool
    read_only_reason: str | None
    writer: WriterLock | None  # the run's writer lock (a writing leader's only)
    release: Callable[[], object] | None  # releases it (a finalizer of the manager)
    run: RunInfo  # as opened (the manager's ``run`` follows the saves)
    tiers: TierCopier | None
    preemption: Preemption | None
    peers: PeerMemory | None = None  # the peer-memory tier (runs.peers)
    pid: int = dataclasses.field(default_factory=os.getpid)  # the process that opened

    @property
    def writes_books(self) -> bool:
        return self.leader and not self.read_only

    def release_lock(self) -> None:
        if self.release is not None:
            self.release()


class Opening:
    """One open of the run at ``run`` for a manager (``owner``: its finalizers release the
    locks of a manager never closed) asked for ``config``, whose run state ``books`` (and its
    catalog) and background step ``settle`` it fills in. ``check_consistent``: a ``report.json``
    that disagrees with ``run.json`` or the checkpoints is RunMismatchError (False: opened as it
    is). See the module docstring."""

    def __init__(
        self,
        run: Location,
        config: ManagerConfig,
        books: Books,
        settle: Settle,
        *,
        check_consistent: bool = True,
    ) -> None:
        self.location, self.store, self.directory = run, run.store, str(run)
        self.config, self.books, self.settle = config, books, settle
        self.check_consistent = check_consistent
        self.leader = rank(config.save_options.process_group) == 0
        self.read_only = False
        self.reason: str | None = None
        self.writer: WriterLock | None = None
        self.release: Callable[[], object] | None = None
        self.tiers: TierCopier | None = None
        self.peers: PeerMemory | None = None
        self.preemption: Preemption | None = None
        # Whether the run's id is made by this open (a new run directory, or a run made before
        # run ids): then it takes the id of the run its tiers belong to (runs.tiers).
        self.created = False
        self.legacy_id = False
        self.changes: list[dict[str, Any]] = []  # the config change found (see _record_change)
        self.new_config: dict[str, Any] | None = None

    @property
    def writes_books(self) -> bool:
        return self.leader and not self.read_only

    def open(self, owner: object) -> Opened:
        """Open the run (see the module docstring); on failure, give back what was taken."""
        try:
            run = self._open(owner)
        except BaseException as exc:
            if self.preemption is not None:
                self.preemption.close()
            if self.tiers is not None:
                self.tiers.close()
            if self.release is not None:
                self.release()
            if self.books.history is not None:
                with contextlib.suppress(OSError):
                    self.books.history.close()
            if isinstance(exc, OSError) and not isinstance(exc, CheckpointError):
                # The store refused to be looked at (no such bucket, a refused credential, an
                # unreachable endpoint): a savepoint error naming the run, the cause below.
                raise open_error(self.directory, exc) from exc
            raise
        return Opened(
            self.leader,
            self.read_only,
            self.reason,
            self.writer,
            self.release,
            run,
            self.tiers,
            self.preemption,
            self.peers,
        )

    def _open(self, owner: object) -> RunInfo:
        books = self.books
        self.read_only, self.writer = self._directory()
        books.catalog.read_only = self.read_only
        if self.writer is not None:
            # Garbage collection releases the lock of a manager never closed (the finalizer
            # holds the lock object, not the manager). Not at interpreter exit: background
            # saves are finished then (async_.checkpointer), still under the lock, which
            # the kernel drops when the process ends.
            release = weakref.finalize(owner, self.writer.release)
            release.atexit = False
            self.release = release
        run, new_run_file, report = self._run()
        if self.writes_books:
            books.history = history.writer(self.location)
        listed = report.checkpoints if report is not None else ()
        on_disk = layout.committed_steps(self.location, expected=listed)
        books.report = self._report(run, report, on_disk)
        lagging = lagging_run(run, books.report)
        if lagging is not None:  # a writer was stopped between report.json and run.json
            run, new_run_file = lagging, True
        if self.config.tiers:
            run, new_tiers_id = self._tiers(owner, run, fresh=not on_disk)
            new_run_file = new_run_file or new_tiers_id
        if self.config.peers is not None:  # (with the run's id, as the tiers left it)
            group = self.config.save_options.process_group
            self.peers = PeerMemory(self.config.peers, group, run.run_id or run.name)
            self.settle.peers = self.peers
        if new_run_file:
            # Only now: an open that fails (a mismatch, a damaged report) writes nothing.
            self._write_run(run)
        books.wall_before = books.report.wall_time_s
        books.discarding_on_disk = frozenset(books.report.discarding)
        books.catalog.opened(books.report, on_disk)
        if self.changes:
            run = self._record_change(run)
        if self.writes_books:
            with self.settle.lock:
                repair(books, self.settle.preempting.is_set)
        policy = self.config.preemption
        if policy.signals is not None:
            self.preemption = Preemption(
                policy.signals,
                process_group=self.config.save_options.process_group,
                every=policy.every,
            )
        return run

    def _directory(self) -> tuple[bool, WriterLock | None]:
        """Create the directory and take the writer lock: (read-only?, the lock if taken)."""
        read_only = self.config.read_only
        if read_only:
            self.reason = "opened with read_only=True"
            return True, None
        store, checkpoints = self.store, self.location.join(layout.CHECKPOINTS)
        found = store.stat(checkpoints.path)
        if found is not None and not layout.is_dir(checkpoints):
            raise CheckpointWriteError(
                f"{checkpoints} is not a directory, but a run keeps its checkpoints there: move it "
                "out of the way and open the run again",
                path=str(checkpoints),
                errno=errno.ENOTDIR,
            )
        if not self.leader:
            # Other ranks write only their part of each checkpoint, never the run's books.
            with contextlib.suppress(OSError):
                store.makedirs(checkpoints.path)
            return False, None
        exists = layout.is_dir(self.location)
        if exists and self.location.is_local:
            problem = not_writable(self.location.path, checkpoints.path)
            if problem is not None and read_only is None:
                self.reason = problem[1]
                return True, None
            if problem is not None:
                raise CheckpointWriteError(
                    f"cannot open {self.directory} for writing (read_only=False): {problem[1]}",
                    path=self.directory,
                    errno=problem[0],
                )
        try:
            store.makedirs(checkpoints.path)
            writer = WriterLock.acquire(self.location)
        except CheckpointError:
            raise
        except OSError as exc:
            if read_only is None and exists and exc.errno in _READ_ONLY_ERRNOS:
                self.reason = f"{os.strerror(exc.errno or 0)} ({exc.filename})"
                return True, None
            raise write_error(
                store, f"cannot open the run directory {self.directory}", exc
            ) from exc
        with contextlib.suppress(OSError, CheckpointError):  # tidying is best effort
            layout.clean_stale_in(store, checkpoints.path)
            layout.clean_stale_in(store, self.location.path)
        return False, writer

    def _run(self) -> tuple[RunInfo, bool, Report | None]:
        """What the run is, whether ``run.json`` must be written (once the whole open has
        succeeded), and ``report.json`` as read (None: the run has none yet). A run that lost
        its ``run.json`` (its report remains) gets back the identity its report records; a new
        run gets the one asked for."""
        asked = self.config
        where = self.location.join(RUN_FILE)
        doc = read_json(where)
        # The run's id: made with the run by its writer (other ranks and read-only managers of
        # a run without one do not know it: None).
        wanted = RunInfo(
            name=asked.name or self.store.basename(self.location.path),
            variant=asked.variant,
            config=plain(dict(asked.config or {})),
            num_params=asked.num_params,
            run_id=new_run_id() if self.writes_books else None,
        )
        stale = doc is None
        if doc is not None:
            run, source = RunInfo.from_json(doc, str(where)), RUN_FILE
            # Compare with what the run really is: a writer stopped between report.json and
            # run.json left run.json behind (report.lagging_run); the caller's config is checked
            # against the caught-up one, and run.json is rewritten once the open succeeds.
            report, self.books.version = read_report(self.location)
            caught_up = lagging_run(run, report) if report is not None else None
            if caught_up is not None:
                run, stale = caught_up, True
        else:
            report, self.books.version = read_report(self.location)
            if report is None:
                self.created = True  # (no run.json, no report.json: with no checkpoint, new)
                return wanted, True, None
            source = REPORT_FILE
            run = RunInfo(
                name=report.name,
                variant=report.variant,
                config=report.config,
                num_params=report.num_params,
                run_id=report.run_id,
            )
        if run.run_id is None:
            # A run made before run ids: the report's, else a new one from its writer, recorded
            # in the next report.json it writes (not by the open: opening and restoring change
            # nothing), and in run.json if the open writes it anyway.
            known = report.run_id if report is not None else None
            run = dataclasses.replace(run, run_id=known or wanted.run_id)
            self.legacy_id = known is None  # (made now: its tiers' run id may replace it)
        self._compare(run, wanted, source)
        return run, stale, report

    def _compare(self, run: RunInfo, wanted: RunInfo, source: str) -> None:
        """RunMismatchError unless the run is the one asked for; a config change is noted."""
        asked, problems = self.config, []
        if asked.name is not None and asked.name != run.name:
            problems.append(f"name {asked.name!r} ({source} has {run.name!r})")
        if asked.variant is not None and asked.variant != run.variant:
            problems.append(f"variant {asked.variant!r} ({source} has {run.variant!r})")
        if asked.config is not None and wanted.config != run.config:
            changes = config_diff(run.config, wanted.config)
            if asked.strict_config:
                keys = ", ".join(c["key"] for c in changes)
                problems.append(f"a different config (keys: {keys}; strict_config=True)")
            else:
                self.changes, self.new_config = changes, wanted.config
        if asked.num_params is not None and asked.num_params != run.num_params:
            problems.append(f"num_params {asked.num_params} ({source} has {run.num_params})")
        if problems:
            raise RunMismatchError(
                f"{self.directory} is an existing run, opened with {'; '.join(problems)}; use "
                "another directory for a different run",
                path=self.directory,
            )

    def _report(self, run: RunInfo, report: Report | None, on_disk: list[int]) -> Report:
        if report is not None and report.run_id is None and self.writes_books:
            report.run_id = run.run_id  # (written with the next report)
        if report is None:
            self.books.dirty = True  # close() writes the first report.json
            fresh = Report.for_run(run)
            # A log without a report: a first save killed before its report, or a report moved
            # aside to be rebuilt; its history is the run's.
            read_history(self.location, fresh)
            return fresh
        if self.check_consistent:
            check_consistent(self.directory, run, report, on_disk)
        return report

    def _tiers(self, owner: object, run: RunInfo, *, fresh: bool) -> tuple[RunInfo, bool]:
        """Open the tiers: (the run, with the id they name; whether run.json must say so)."""
        books = self.books
        # Every rank reads the tiers (restore); rank 0 alone copies up, as it keeps the books,
        # and holds each tier's writer lock. Before run.json is written: a new run directory
        # may continue the run its tiers belong to (runs.tiers).
        tiers = self.tiers = TierCopier(
            self.config.tiers,
            {"name": run.name, "variant": run.variant, "id": run.run_id},
            inherit=self.writes_books and ((self.created and fresh) or self.legacy_id),
            protected=lambda: () if books.resumed_from is None else (books.resumed_from,),
            writable=self.writes_books,
        )
        self.settle.tiers = tiers
        release_tiers = weakref.finalize(owner, tiers.release_locks)
        release_tiers.atexit = False  # (as the run's lock: see _open)
        if tiers.run_id != run.run_id or (self.legacy_id and self.writes_books):
            # The id the tiers now name (theirs, or one made now) goes to run.json.
            books.report.run_id = tiers.run_id
            return dataclasses.replace(run, run_id=tiers.run_id), True
        return run, False

    def _write_run(self, run: RunInfo) -> None:
        """Write the ``run.json`` that :meth:`_run` decided on (the books' writer only)."""
        if self.writes_books:
            write_run(self.location, run)

    def _record_change(self, run: RunInfo) -> RunInfo:
        """Warn about the config change found; a writer records it (report.json first, then
        run.json: a run.json left behind by a kill in between is brought up to date by the next
        open, see report.lagging_run). The run, with its new config if recorded."""
        assert self.new_config is not None
        # Against the run's config as the report records it (run.json may have lagged behind).
        self.changes = config_diff(run.config, self.new_config)
        if not self.changes:
            return run
        keys = ", ".join(c["key"] for c in self.changes)
        steps = self.books.steps_now()
        step = steps[-1] if steps else None
        # (the warnings point at the caller of CheckpointManager(...): six frames up)
        if not self.writes_books:
            warnings.warn(
                f"{self.directory} was opened with a config that differs from its run.json in "
                f"{keys}; this read-only manager records nothing",
                stacklevel=6,
            )
            return run
        self.books.report.config = self.new_config
        self.books.report.config_changes.append(
            {"step": step, "at": now_iso(), "changes": self.changes}
        )
        run = dataclasses.replace(run, config=self.new_config)
        try:
            self.books.store_report()
        except OSError as exc:
            raise write_error(
                self.store, f"cannot record the config change in {REPORT_FILE}", exc
            ) from exc
        self._write_run(run)
        warnings.warn(
            f"{self.directory}: the run's config changed at step {step} ({keys}); recorded in "
            f"{REPORT_FILE} under config_changes (strict_config=True refuses config changes)",
            stacklevel=6,
        )
        return run


def repair(books: Books, stop: Callable[[], bool]) -> None:
    """Finish what an interrupted writer left in the run ``books`` keeps (see the module
    docstring); ``stop()``: deletions wait for the next open (a preemption save started)."""
    assert books.history is not None
    try:
        books.history.repair()  # a torn last line, segments a compaction left behind
    except OSError as exc:
        raise write_error(
            books.store, f"cannot repair the history log of {books.directory}", exc
        ) from exc
    books.finish_discards(stop)
    r, metrics = books.report, books.catalog.metrics
    live = books.steps_now()
    for step in (s for s in live if s not in r.checkpoints):
        # committed by a save that was killed before its books
        if metrics.get(step):
            r.metric_history.setdefault(step, {}).update(metrics[step])
            books.pending.append({"step": step, "metrics": metrics[step]})
        r.steps_completed = max(r.steps_completed, step)
    before = (r.checkpoints, r.latest_step, r.best, r.discarding)
    books.fill(live)
    if (r.checkpoints, r.latest_step, r.best, r.discarding) != before:
        try:
            books.store_report()
        except OSError as exc:
            raise write_error(
                books.store, f"cannot repair {REPORT_FILE} of {books.directory}", exc
            ) from exc
    books.repair_aliases()


def write_run(location: Location, run: RunInfo) -> None:
    """Write ``run.json`` of the run at ``location`` (CheckpointWriteError if that fails)."""
    where = location.join(RUN_FILE)
    try:
        write_json(where, run.to_json())
    except OSError as exc:
        raise write_error(location.store, f"cannot create {where}", exc) from exc


def not_writable(*paths: str) -> tuple[int, str] | None:
    """(errno, why) this process cannot create files in ``paths`` (the existing ones), or None."""
    effective = os.access in os.supports_effective_ids
    for path in paths:
        if os.path.isdir(path) and not os.access(path, os.W_OK | os.X_OK, effective_ids=effective):
            try:
                read_only_fs = bool(os.statvfs(path).f_flag & os.ST_RDONLY)
            except OSError:
                read_only_fs = False
            if read_only_fs:
                return errno.EROFS, f"{path} is on a read-only filesystem"
            return errno.EACCES, f"{path} is not writable by this user"
    return None


def open_error(directory: str, exc: OSError) -> CheckpointError:
    """The error for a run whose store could not be looked at while opening it."""
    return errors_map.read_error(
        exc, directory, head=f"cannot open the run {directory}", what="the run"
    )


def rank(process_group: Any) -> int:
    """This process's rank in ``process_group`` (0 without one)."""
    if process_group is None:
        return 0
    import torch.distributed as dist

    return int(dist.get_rank(group=process_group))
