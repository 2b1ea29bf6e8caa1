"""``CheckpointManager``: a run directory whose checkpoints survive crashes, full disks and retention.

A manager is the one handle on a training run's directory (docs/runs.md): it saves checkpoints
with the commit protocol and keeps the run's books, prunes by retention, restores, and reacts to
preemption; a read-only one (:func:`reader`, ``read_only=True``) only reads. The class composes
parts that each own one kind of state and say what they promise in their module docstrings; none
holds a reference to the manager (one nobody closed is freed once dropped, its finalizers
releasing the run's lock):

- :mod:`savepoint.runs.config`: every argument, checked before anything is touched;
- :mod:`savepoint.runs.opening`: the open (the writer lock, read-only opens, ``run.json`` and
  ``report.json``, the tiers, the repair of what an interrupted writer left);
- :mod:`savepoint.runs.saving`: the save sequence (steps 1-6), what a failed save undoes, when a
  save counts (:mod:`savepoint.runs.pacing`: the save policy asked);
- :mod:`savepoint.runs.books` (steps 3-5: the report, the history log, the lineage, the aliases)
  over :mod:`savepoint.runs.catalog` (the checkpoints and their metrics);
- :mod:`savepoint.runs.settle`: step 6, the background step (verification, retention,
  deletions) and its one error slot;
- :mod:`savepoint.runs.restoring`: which checkpoint ``restore`` and ``peek`` read, and from where;
- :mod:`savepoint.runs.incremental`: an incremental run's blob store;
- :mod:`savepoint.runs.preempting`: ``preempted()`` and ``save_on_preemption()`` (the handlers:
  :mod:`savepoint.runs.preemption`);
- :mod:`savepoint.runs.lifecycle`: the locks (threads may share a manager), ``close()``,
  ``gc()``, a fork and the interpreter's exit.

What every call may raise, and what a failure leaves: docs/runs.md ("Failures"); the
guarantees and the tests that hold them: docs/reliability.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import signal
import sys
import threading
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

from savepoint.async_.pending import PendingSave
from savepoint.errors import (
    CheckpointError,
    CheckpointWriteError,
)
from savepoint.options import SaveOptions
from savepoint.runs import layout, opening
from savepoint.runs.books import Books
from savepoint.runs.catalog import Catalog
from savepoint.runs.config import ManagerConfig
from savepoint.runs.config import seconds as _grace
from savepoint.runs.gc import GcReport
from savepoint.runs.incremental import BlobHandles
from savepoint.runs.lifecycle import Lifecycle
from savepoint.runs.peers import PeerTier
from savepoint.runs.policies import Mode, RetentionPolicy, SavePolicy
from savepoint.runs.preempting import Preempting
from savepoint.runs.preemption import (
    DEFAULT_GRACE,
    Preemption,
    PreemptionSave,
)
from savepoint.runs.report import (
    Report,
)
from savepoint.runs.restoring import Restorer, StepSpec
from savepoint.runs.saving import Saver, check_step
from savepoint.runs.settle import Settle
from savepoint.runs.tiers import Tier, TierCopier
from savepoint.storage.paths import Location, PathArg, resolve

__all__ = ["CheckpointManager", "PreemptionSave", "StepSpec", "catalog_of", "reader"]

log = logging.getLogger(__name__)


class CheckpointManager:
    """Saves, restores and prunes the checkpoints of one training run in ``directory``.

    ``directory`` is a local path, a URL (``memory://run``) or a
    :class:`~savepoint.storage.paths.Location` (``store.at(path)``): every file of the run is
    read and written through that store, and ``directory`` and messages show it as its URL (a
    plain path on the local disk). On a store without atomic renames (an object store) each
    checkpoint and alias commits manifest-last (:mod:`savepoint.commit.transaction`).

    How checkpoints are written: ``options`` (a :class:`~savepoint.options.SaveOptions`) and/or
    its fields as keywords (``max_file_bytes``, ``writers``, ``direct``, ``progress``,
    ``process_group``, ``timeout``), checked here: an unknown or invalid option is a TypeError or
    ValueError from this constructor, naming it, before anything is touched (as is every other
    argument: :class:`savepoint.runs.config.ManagerConfig`). ``save_options`` is the result.

    Retention (a step is kept if any rule wants it; with no rule, every checkpoint is kept):
    ``keep_last`` newest steps, ``keep_best`` best by ``best_metric`` (``best_mode`` "min" or
    "max", ties to the later step), ``keep_every`` multiples of that step, or any ``retention``
    policy object from :mod:`savepoint.runs.policies`. ``save_every`` (or a ``save_policy``)
    makes ``save`` skip steps (``sp.policies.Continuous``: the next save once the previous one
    is durable, see :meth:`should_save`). ``async_save=True`` writes each checkpoint in the
    background (``save`` returns once the state is staged); ``writer`` and ``writer_priority``
    choose who writes it, as ``AsyncCheckpointer``'s (by default its writer process). ``name``,
    ``variant``, ``config`` and ``num_params`` describe the run in ``run.json``; opening an
    existing run with a different name, variant or ``num_params`` is a RunMismatchError. A
    different ``config`` is a change of the run's config: it warns (UserWarning naming the keys),
    becomes the config of ``run.json`` and ``report.json``, and ``report.json``'s
    ``config_changes`` records each key's old and new value and the latest committed step at that
    open; ``strict_config=True`` refuses it instead (RunMismatchError naming the keys). A read-only
    manager only warns. Without ``num_params`` a new run records the element count of its first
    saved state (:func:`savepoint.runs.report.count_elements`). Without ``best_metric``, an
    existing run keeps ranking by the metric its report names.

    ``read_only``: None (the default) opens read-only exactly when the directory cannot be written
    (read-only media, no permission); True never writes and takes no lock (a reader next to a live
    writer); False requires write access (CheckpointWriteError otherwise). ``read_only`` and
    ``read_only_reason`` say what was chosen. A writing manager holds the run's writer lock until
    ``close()`` (or until it is garbage collected): a second one raises RunLockedError.

    ``preemption``: True (SIGTERM and SIGUSR1) or a list of signals installs flag-only handlers
    (main thread only; removed by ``close()``); :meth:`preempted` says when to stop (agreed by
    every rank of ``process_group``, with an all-reduce every ``preemption_every`` calls) and
    :meth:`save_on_preemption` commits within ``preemption_grace`` seconds of the notice (25 by
    default, for Kubernetes' 30). See docs/runs.md, "Preemption".

    ``incremental=True``: the run's checkpoints share a content-addressed blob store at
    ``<run>/blobs`` (``docs/blobs.md``): a tensor ``blob_policy`` wants (a
    :class:`savepoint.blobs.BlobPolicy`; default: those of 1 MiB or more) is written only where its
    bytes changed since an earlier save; retention then deletes the blobs no remaining checkpoint
    names. With ``async_save=True`` the caller is blocked for the staging copy only; the background
    thread runs the blob store's save session and then retention and the blob collection.
    ``compression``: ``"zstd"`` (or a :class:`savepoint.blobs.Compression`) stores blobs
    zstd-compressed where that saves space (``BlobPolicy.of("zstd")``; needs the zstandard
    package); only with ``incremental=True``, and a ``blob_policy`` naming another compression is a
    ValueError. ``frozen``: key prefixes (``("model/base_model",)``) of tensors that never change
    during the run (a frozen base model): after this manager's first save of them, their bytes are
    not read again but for a random block per chunk, checked against the first save's (a mismatch
    is logged and the tensor saved as any other); their earlier blobs are reused. A change the
    sample misses is not saved: declare only what is truly frozen. Unsharded saves only."""

    def __init__(
        self,
        directory: PathArg,
        *,
        keep_last: int | None = None,
        keep_best: int | None = None,
        best_metric: str | None = None,
        best_mode: Mode = "min",
        keep_every: int | None = None,
        save_every: int | None = None,
        async_save: bool = False,
        writer: Literal["thread", "process"] | None = None,
        writer_priority: Literal["normal", "low", "idle"] | None = None,
        retention: RetentionPolicy | None = None,
        save_policy: SavePolicy | None = None,
        name: str | None = None,
        variant: str | None = None,
        config: Mapping[str, Any] | None = None,
        num_params: int | None = None,
        verify_before_prune: bool = True,
        aliases: bool = True,
        read_only: bool | None = None,
        strict_config: bool = False,
        preemption: bool | Iterable[int | str | signal.Signals] | None = None,
        preemption_grace: float = DEFAULT_GRACE,
        preemption_every: int = 1,
        tiers: Sequence[Tier | PeerTier] | None = None,
        incremental: bool = False,
        blob_policy: Any = None,
        frozen: Iterable[str] | None = None,
        compression: Any = None,
        options: SaveOptions | None = None,
        **save_options: Any,
    ) -> None:
        # Every argument is checked (runs.config) before anything is touched.
        arguments = dict(locals())
        del arguments["self"], arguments["directory"]
        extra = arguments.pop("save_options")
        self._start(directory, ManagerConfig.of(**arguments, **extra), check_consistent=True)

    def _start(self, directory: PathArg, config: ManagerConfig, *, check_consistent: bool) -> None:
        """The open (runs.opening) of a manager asked for ``config``: see :func:`reader`."""
        self._config = config
        self._run = resolve(directory, what="run directory")
        # Incremental saves: the run's blob store and what its saves share (runs.incremental).
        self._blob_handles = (
            BlobHandles(self._run, policy=config.blob_policy, frozen=config.frozen)
            if config.incremental
            else None
        )
        # The run's checkpoints and their metrics (runs.catalog), and its books (report, history
        # log, lineage, aliases: runs.books).
        self._catalog = Catalog(
            self._run, best_metric=config.best_metric, best_mode=config.best_mode
        )
        self._books = Books(
            self._run, self._catalog, retention=config.retention, aliases=config.aliases
        )
        # Which checkpoint restore() and peek() read, and from where (runs.restoring).
        self._restorer = Restorer(self._run, self._catalog, self._books.steps_now)
        lock = threading.RLock()  # the books' and the background step's (runs.lifecycle)
        # The background step of each save (runs.settle: syncs, verification, retention), on
        # one worker thread, and the error it left for the next save, wait() or close().
        self._settle = Settle(
            self._books,
            lock,
            retention=config.retention,
            verify_before_prune=config.verify_before_prune,
            collect=_nothing if self._blob_handles is None else self._blob_handles.collect,
            scrub=_nothing if self._blob_handles is None else self._blob_handles.scrub,
        )
        stop_worker = weakref.finalize(self, self._settle.worker.stop)
        stop_worker.atexit = False  # (at exit the worker finishes its step: runs.lifecycle)
        opener = opening.Opening(
            self._run, config, self._books, self._settle, check_consistent=check_consistent
        )
        # The save route (runs.saving: the save policy's state, the async writer) and the
        # preemption flow over it (runs.preempting: the handlers, installed by the open); once a
        # preemption save started (_settle.preempting) the background steps defer verification,
        # retention and deletions to the next run.
        self._saver = Saver(
            self._books,
            self._settle,
            config.save_options,
            save_policy=config.save_policy,
            leader=opener.leader,
            async_save=config.async_save,
            writer=config.writer,
            writer_priority=config.writer_priority,
            blobs=self._blob_handles,
            host=_SaverHost(self),
        )
        self._preempting = Preempting(self._saver, _grace)
        try:  # the open (runs.opening): the lock, run.json and report.json, the tiers, the repair
            opened = self._opened = opener.open(self)
        except BaseException:
            self._saver.close()  # (its async writer; the open gave back what it took)
            raise
        self.run = opened.run
        self._restorer.opened(opened.tiers, opened.peers, self._books)
        self._saver.opened(opened.read_only, opened.read_only_reason, opened.writer)
        self._preempting.preemption = opened.preemption
        # Its locks, close(), gc(), a fork and the interpreter's exit (runs.lifecycle).
        self._life = Lifecycle(
            self._run,
            opened,
            self._books,
            self._settle,
            self._saver,
            self._blob_handles,
            lock=lock,
        )

    # -- what was asked for (runs.config) and what the open found (runs.opening) ---------------

    @property
    def directory(self) -> str:
        """The run directory: a plain path on the local disk, else its URL."""
        return self._books.directory

    @property
    def save_options(self) -> SaveOptions:
        return self._config.save_options

    @property
    def retention(self) -> RetentionPolicy:
        """Every retention rule given, as one :class:`~savepoint.runs.policies.AnyOf`."""
        return self._config.retention

    @property
    def verify_before_prune(self) -> bool:
        return self._config.verify_before_prune

    @property
    def aliases(self) -> bool:
        return self._config.aliases

    @property
    def incremental(self) -> bool:
        return self._config.incremental

    @property
    def preemption_grace(self) -> float:
        return self._config.preemption.grace

    @property
    def read_only(self) -> bool:
        return self._opened.read_only

    @property
    def read_only_reason(self) -> str | None:
        """Why the manager is read-only (None when it writes)."""
        return self._opened.read_only_reason

    # (for restore's and the preemption flow's tiers)

    @property
    def _tiers(self) -> TierCopier | None:
        return self._opened.tiers

    def _finish_open_run(self) -> None:
        """Write ``run.json`` again (a writer's): the first save counted the parameters."""
        if self._opened.writes_books:
            opening.write_run(self._run, self.run)

    # -- queries -------------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Steps with a committed checkpoint that is part of the run, ascending (once the
        background step of the last save, which may prune, has finished)."""
        self._join_background()
        return self._books.steps_now()

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def best_step(self) -> int | None:
        """The best step by ``best_metric`` among the checkpoints on disk (never one that failed
        verification), or None."""
        return self._catalog.best_among(self.steps())

    @property
    def save_policy(self) -> SavePolicy:
        """Which steps ``save`` writes (``save_every``, or the ``save_policy`` given)."""
        return self._saver.save_policy

    @property
    def report(self) -> Report:
        """The run's report as this manager keeps it (``report.json`` once written)."""
        return self._books.report

    @property
    def restored_from(self) -> str | None:
        """Where the last restore (or peek) read its checkpoint: "run directory", "peer memory"
        (``sp.Tier.peers``) or a tier's name; None before the first."""
        return self._restorer.restored_from

    @property
    def best_metric(self) -> str | None:
        return self._catalog.best_metric

    @property
    def best_mode(self) -> Mode:
        return self._catalog.best_mode

    def step_path(self, step: int) -> str:
        """Checkpoint ``step``'s directory, as ``sp.load`` takes it (a URL off the local disk)."""
        return str(self._step(step))

    def _step(self, step: int) -> Location:
        return layout.step_location(self._run, step)

    def metrics(self, step: int) -> dict[str, Any]:
        return dict(self._catalog.metrics.get(step, {}))

    # -- saving --------------------------------------------------------------------------------

    def save(
        self,
        step: int,
        state: Any,
        metrics: Mapping[str, Any] | None = None,
        *,
        force: bool = False,
        epoch: int | None = None,
    ) -> PendingSave:
        """Save ``state`` as checkpoint ``step`` (unless the save policy skips it).

        Either the save happens completely or, on CheckpointWriteError, not at all. It returns
        once the checkpoint is committed and ``report.json`` names it; verification and
        retention follow in the background (the returned PendingSave is done when they are;
        see :mod:`savepoint.runs.saving`). Threads may share a manager: their saves run one
        after the other."""
        self._life.check_open()
        with self._life.saving:
            return self._saver.save(step, state, metrics, force, epoch)

    def should_save(self, step: int) -> bool:
        """Whether ``save(step)`` would write (the save policy's answer), without saving: ask
        it before building a state that costs something to gather. The next ``save(step)``
        reuses this answer instead of asking the policy again. With a process group and a
        policy whose answer depends on this process's clock (``sp.policies.Continuous``), every
        rank's answer is agreed (one all-reduce: ask at the same steps on every rank), so the
        ranks save the same steps (:mod:`savepoint.runs.pacing`)."""
        self._life.check_open()
        check_step(step)
        with self._life.saving:
            return self._saver.pacing.should_save(step, self._saver.last_saved)

    def log(self, step: int, loss: float | None = None, **metrics: Any) -> None:
        """Record a training step's loss (the report's loss curve) and any other values.

        O(1): the record joins the report in memory and is appended to the run's history log
        (:mod:`savepoint.runs.history`) by the next save or ``close()``."""
        self._saver.log(step, loss, metrics)

    # -- the background step of a save (runs.settle) ------------------------------------------

    def _join_background(self) -> None:
        """Wait for the background step of the last save (not from that step itself)."""
        self._settle.join()

    def _finish_discards(self) -> None:
        self._settle.finish_discards()

    # -- preemption ----------------------------------------------------------------------------

    @property
    def preemption(self) -> Preemption | None:
        """The notice handlers ``preemption=`` installed (None without): ``signum``,
        ``received_at``, ``count``, and ``request()`` for a notice of your own (a spot
        instance's metadata endpoint, say), which :meth:`preempted` then agrees on like a
        signal."""
        return self._preempting.preemption

    def preempted(self, *, local: bool = False) -> bool:
        """Whether to stop for a preemption notice (a signal given to ``preemption=``).

        Without a process group: a memory read, cheap anywhere (data loading, evaluation,
        warm-up). With one (the manager's ``process_group``): the answer every rank agrees on,
        from one all-reduce (MAX over the ranks' flags, on that group) every
        ``preemption_every``-th call, so call it at the same points on every rank (once per
        step, say); once True it stays True without further collectives. Ranks therefore stop at
        the same call even when the signal reached only some of them. ``local=True``: this
        process's own flag, no collective (for code that runs on some ranks only; stop at an
        agreed call all the same). The flow: :mod:`savepoint.runs.preempting`."""
        if self._preempting.preemption is None:
            raise RuntimeError(
                f"{self!r} was opened without preemption=...: pass preemption=True (SIGTERM, "
                "SIGUSR1) or a list of signals to be told of preemption notices"
            )
        return self._preempting.preempted(local)

    def save_on_preemption(
        self,
        step: int,
        state: Any,
        metrics: Mapping[str, Any] | None = None,
        *,
        epoch: int | None = None,
        grace: float | None = None,
    ) -> PreemptionSave:
        """Commit ``state`` as checkpoint ``step`` before the job's machines are taken, and say
        how to exit (:class:`~savepoint.runs.preemption.PreemptionSave`; ``sys.exit(r.exit_code)``).

        The budget is ``grace`` seconds (default: the ``preemption_grace`` the manager was
        opened with, 25), counted from this process's first signal (else from the call of
        :meth:`preempted` that first answered True: another rank's signal; else from now). In
        order: the async save in flight is finished if it commits in time to leave room for
        this save (an estimate from the last save's duration), otherwise abandoned (it stops
        at its next write and its transaction removes what it wrote: nothing of it is committed
        or listed); background verification and retention stop where they are and are left to
        the next run; then ``step`` is committed synchronously with the commit protocol, its
        books synced, nothing deleted. A step already committed (by the save in flight, or an
        earlier save) is not written again. No signal is needed: it saves all the same (exit
        code 0). Signals arriving meanwhile only set the flag again. With a process group every
        rank calls it with the same step (checked: ValueError on every rank otherwise), and all
        ranks return the same answer. A save that cannot be committed (a full disk) raises
        CheckpointWriteError as ``save`` does; failures that do not stop it (the save in flight,
        an earlier verification) are logged and listed in ``errors``. The steps:
        :class:`savepoint.runs.preempting.Preempting`."""
        return self._preempting.save(
            step,
            state,
            metrics,
            epoch,
            grace,
            default_grace=self.preemption_grace,
            saving=self._life.saving,
        )

    # -- restoring -----------------------------------------------------------------------------

    def restore(
        self, into: Any, step: StepSpec = "latest", *, resume: bool = True, **load_options: Any
    ) -> int | None:
        """Restore checkpoint ``step`` ("latest", "best" or a number) into ``into``.

        Returns the step restored. With ``resume`` (the default) the run continues from that step:
        the report forgets history after it (the resumed run logs those steps again), records the
        lineage, and retention protects that checkpoint; ``resume=False`` only loads. Nothing is
        written here (restoring works on read-only media): the next save or ``log()`` records
        the resume, and a ``close()`` with neither in between writes nothing for it (an
        evaluation changes nothing). With "latest", a checkpoint that fails verification is
        skipped (with a warning) for the next older one; None means the run has no checkpoint at
        all. "best" and explicit steps are never substituted: missing or corrupt is an error.

        Next to a live writer (a read-only manager), the checkpoint chosen may be deleted or
        replaced by the writer before it is read: then "latest" and "best" choose again from what
        the run holds now (never a warning, never an error for an intact run), and an explicit
        step that was deleted is CheckpointNotFoundError saying so.
        """
        self._life.check_open()
        with self._life.saving:
            self.wait()
            found = self._restorer.read(step, {**load_options, "into": into})
            if found is None:
                log.info("%s: no checkpoint to restore: a fresh start", self.directory)
                return None
            log.info(
                "%s: restored checkpoint %d (asked for %r)%s",
                self.directory,
                found[0],
                step,
                "; the run resumes from it" if resume else "",
            )
            return self._resumed(found[0]) if resume else found[0]

    def peek(
        self, keys: Iterable[str] | str, step: StepSpec = "latest", **load_options: Any
    ) -> Any:
        """The saved values of ``keys`` (paths as in :func:`savepoint.load`) of checkpoint ``step``,
        as plain values and arrays, without building the model: e.g. the config or the step
        counter a script needs before it can build what it restores into. Chooses the checkpoint
        exactly as :meth:`restore` does (a "latest" that fails verification is skipped with a
        warning for the next older one), writes nothing and resumes nothing. None: the run has no
        checkpoint at all."""
        self._life.check_open()
        with self._life.saving:
            self.wait()
            found = self._restorer.read(step, {**load_options, "keys": keys})
            return None if found is None else found[1]

    def _resumed(self, step: int) -> int:
        """The run continues from ``step``: in memory now; on disk with the next save or
        ``log()``, never by ``close()`` alone (runs.books)."""
        with self._life.lock:
            self._books.resume(step)
            self._saver.last_saved = step
        return step

    # -- lifecycle (runs.lifecycle) ------------------------------------------------------------

    def gc(self, grace: float = 3600.0, dry_run: bool = False) -> GcReport:
        """Remove what failed or interrupted saves left in the run and no reader can be using:
        generations without a manifest and superseded ones, step directories holding nothing
        committed, hidden temporaries of dead processes, open multipart uploads (S3), each only
        once it is older than ``grace`` seconds (:mod:`savepoint.runs.gc`). Runs after any
        background save has finished, holding the writer lock; never removes a committed
        checkpoint, the report, ``run.json`` or an alias. ``dry_run`` removes nothing. A
        read-only manager (or another rank's) raises CheckpointWriteError."""
        return self._life.gc(grace, dry_run)

    def wait(self) -> None:
        """Block until any background save is committed and the background step of the last
        save (verifying the new checkpoint, then retention's deletions) is done; raise a save's
        error if it failed, or the verification failure it found."""
        self._saver.wait()

    def close(self) -> None:
        """Finish pending saves and their background step, write the final report, and release
        the writer lock; then raise what failed (a background save, a verification).

        A manager that no longer holds the lock (runs.lock: a forked child, a lock file taken by
        another writer) writes nothing; the latter is RunLockedError unless a save raised it
        already. A second ``close()`` does nothing."""
        self._life.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object
    ) -> None:
        """Close; an exception leaving the block is not replaced by a failure of that
        ``close()``: the failure is attached to it as a note (printed on Python 3.10)."""
        if exc is None:
            self.close()
            return
        try:
            self.close()
        except CheckpointError as close_error:
            # The body's exception (an interrupted training loop, Ctrl-C) is what the caller must
            # see; the failure to finish a save rides along with it instead of replacing it.
            note = f"while it propagated, closing {self!r} failed: {close_error}"
            if hasattr(exc, "add_note"):
                exc.add_note(note)
            else:  # Python 3.10
                print(f"savepoint: {note}", file=sys.stderr)

    def __repr__(self) -> str:
        mode = ", read_only=True" if self.read_only else ""
        return f"CheckpointManager({self.directory!r}, retention={self.retention!r}{mode})"


class _Weak:
    """A part's view of its manager, holding no reference to it: a manager nobody closed is
    freed once dropped (its finalizer releases the run's lock), not at the next cyclic
    collection."""

    def __init__(self, manager: CheckpointManager) -> None:
        self._manager = weakref.ref(manager)

    def _get(self) -> CheckpointManager:
        manager = self._manager()
        assert manager is not None, "a save of a manager that is gone"
        return manager


class _SaverHost(_Weak):
    """The manager as its Saver asks for it (:class:`savepoint.runs.saving.Host`)."""

    def check_open(self) -> None:
        self._get()._life.check_open()

    def num_params(self) -> int | None:
        return self._get().run.num_params

    def adopt_num_params(self) -> None:
        manager = self._get()
        if manager.run.num_params is None:
            manager.run = dataclasses.replace(
                manager.run, num_params=manager._books.report.num_params
            )
            with contextlib.suppress(CheckpointWriteError):  # the next open rewrites it
                manager._finish_open_run()

    def keep(self) -> object:
        return self._manager()


def _nothing(*_: object) -> None:
    """The background step's blob callbacks of a run that is not incremental."""


def reader(directory: PathArg, *, check_consistent: bool = True) -> CheckpointManager:
    """A read-only manager of the run at ``directory`` (``read_only=True``: no lock, writes
    nothing). ``check_consistent=False`` also opens a run whose ``report.json`` disagrees with
    its ``run.json`` or its checkpoints, as it is (``sp.open_run``'s view lists the problems)."""
    manager = CheckpointManager.__new__(CheckpointManager)
    manager._start(directory, ManagerConfig.of(read_only=True), check_consistent=check_consistent)
    return manager


def catalog_of(manager: CheckpointManager) -> Catalog:
    """The catalog of the run a manager keeps (its checkpoints and their metrics, read at the
    open): ``sp.open_run``'s view reads through its reader's instead of reading every
    checkpoint's metrics a second time."""
    return manager._catalog
