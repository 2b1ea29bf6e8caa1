"""Which checkpoint of a run ``restore`` and ``peek`` read, and from where (:class:`Restorer`).

Restoring writes nothing: it reads checkpoints only, so it works on read-only media (the
bookkeeping of a resume, lineage and the history after the step resumed from, is the books'
and written by the next save or ``log()``, never by ``close()`` alone:
:mod:`savepoint.runs.books`). The choice rules:

- ``"latest"`` tries the newest checkpoint first; one that fails verification is skipped with a
  warning and the next older one is tried. None: the run has no checkpoint at all (a fresh
  start, the only case that returns None). Checkpoints exist but none is intact:
  CorruptCheckpointError rather than start over.
- After a resume, a tier's (or peer memory's) copy of a step of the abandoned timeline is never
  ``"latest"``: a copy newer than the run directory's newest checkpoint, of a step between one
  the run resumed from and the step it had reached then (its lineage), is ignored
  (:func:`abandoned`); the copy-ups delete them, but until they have run (and if one fails)
  they are still there. (An explicit step still reads them.)
- ``"best"`` and an explicit step are never substituted: missing or corrupt is an error.
- "latest" and "best" are resolved from the checkpoints and their metrics
  (:class:`~savepoint.runs.catalog.Catalog`), never through the alias directories.
- With storage tiers (:mod:`savepoint.runs.tiers`) each step is read from the run directory
  first, then from each tier holding a copy, fastest first; :attr:`Restorer.restored_from`
  names where the last restore read its checkpoint (:data:`RUN_DIRECTORY` or a tier's name).
- With a peer-memory tier (:mod:`savepoint.runs.peers`) every ``read`` first surveys it (every
  rank at once) and a step complete there is read from it before any other source
  (``"peer memory"``); a failure there (a copy that does not verify, a rank that does not
  answer) is agreed by every rank, which go on with the next source together.
- A sharded load (``process_group=``) that its own checks refused on every rank that failed is a
  copy that failed verification, as an unsharded load's CorruptCheckpointError
  (:func:`_checked`): the next source or step, on every rank alike.
- Next to a live writer (a read-only manager, the view of :func:`savepoint.open_run`), a
  checkpoint the writer deletes or replaces while it is being read is never taken for a corrupt
  one: "latest" and "best" choose again (the catalog rereads the report's ``discarding`` and the
  metrics of checkpoints saved after it opened), an explicit step deleted meanwhile is
  CheckpointNotFoundError saying so.

Choices and fallbacks are logged (logger ``savepoint.runs.manager``, INFO).
"""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Callable
from typing import Any, Literal, Protocol

from savepoint import checkpoint
from savepoint.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    DistributedCheckpointError,
    IncompleteCheckpointError,
    MissingCheckpointError,
)
from savepoint.runs import layout
from savepoint.runs.catalog import Catalog
from savepoint.runs.peers import PEER_MEMORY, PeerMemory
from savepoint.runs.report import Report
from savepoint.runs.tiers import Tier, TierCopier
from savepoint.storage.paths import Location

__all__ = ["RUN_DIRECTORY", "Restorer", "StepSpec", "abandoned"]

log = logging.getLogger("savepoint.runs.manager")

StepSpec = int | Literal["latest", "best"]
_RESTORE_TRIES = 20
RUN_DIRECTORY = "run directory"  # restored_from for a checkpoint read from the run itself
# Where a step can be read: (its name, a load function taking load()'s keyword arguments).
Source = tuple[str, Callable[[dict[str, Any]], Any]]
Copies = dict[int, list[tuple[Tier, Location]]]
# A warning's stacklevel from the choice methods: the caller of restore()/peek()/RunView.load.
_CALLER = 5


class _Books(Protocol):
    """What a restore reads of the run's books (:class:`savepoint.runs.books.Books`)."""

    report: Report


class _Moved(Exception):
    """The checkpoint being restored was deleted or replaced by the run's writer meanwhile."""


class Restorer:
    """Reads a checkpoint of the run at ``run`` chosen by the rules of the module docstring.

    ``catalog``: the run's checkpoints and their metrics; ``steps()``: the checkpoints that are
    part of the run now, ascending. ``tiers`` (set once the run is open): the tiers holding
    copies, or None. Holds no lock and writes nothing; the caller runs one read at a time."""

    def __init__(self, run: Location, catalog: Catalog, steps: Callable[[], list[int]]) -> None:
        self.run, self.directory = run, str(run)
        self.catalog = catalog
        self.steps = steps
        self.tiers: TierCopier | None = None
        self.peers: PeerMemory | None = None  # the peer-memory tier (runs.peers)
        self.peer_steps: set[int] = set()  # complete in peer memory (surveyed once per read)
        self.restored_from: str | None = None  # where the last read came from
        self.books: _Books | None = None  # (report.lineage: the run's resumes)

    def opened(
        self, tiers: TierCopier | None, peers: PeerMemory | None, books: _Books | None = None
    ) -> None:
        """The run's storage tiers and peer-memory tier, as its open found them; ``books``: the
        run's books, whose report's lineage (its resumes) tells the abandoned timelines."""
        self.tiers, self.peers, self.books = tiers, peers, books

    def read(self, step: StepSpec, load_options: dict[str, Any]) -> tuple[int, Any] | None:
        """Load checkpoint ``step`` with ``load_options``: (the step loaded, what
        :func:`savepoint.load` returned), or None when the run has no checkpoint at all."""
        if not (isinstance(step, int) and not isinstance(step, bool)) and step not in (
            "latest",
            "best",
        ):
            raise ValueError(f"step must be 'latest', 'best' or an int, not {step!r}")
        # Every rank at once, before anything else: which steps peer memory holds whole.
        self.peer_steps = self.peers.survey() if self.peers is not None else set()
        for _ in range(_RESTORE_TRIES):
            self.catalog.refresh()
            try:
                return self.once(step, load_options)
            except _Moved:
                continue
        raise CheckpointNotFoundError(
            f"{self.directory}: each checkpoint chosen to restore ({step!r}) was deleted or "
            f"replaced by the run's writer before it could be read ({_RESTORE_TRIES} tries); try "
            "again, or restore a step retention keeps",
            path=self.directory,
        )

    def once(self, step: StepSpec, load_options: dict[str, Any]) -> tuple[int, Any] | None:
        """One attempt of :meth:`read` on one listing of the run (and of its tiers' copies);
        raises _Moved when the checkpoint chosen was deleted or replaced while it was read."""
        steps = self.steps()
        copies = self.tiers.candidates() if self.tiers is not None else {}
        for held in self.peer_steps:
            copies.setdefault(held, [])
        if step == "latest":
            return self.latest(steps, copies, load_options)
        if step == "best":
            return self.best(steps, copies, load_options)
        assert isinstance(step, int)
        return self.explicit(step, steps, copies, load_options)

    def latest(
        self, steps: list[int], copies: Copies, load_options: dict[str, Any]
    ) -> tuple[int, Any] | None:
        """The newest step that loads, from any of its sources; one that fails verification is
        skipped with a warning for another copy or an older step."""
        gone = abandoned(steps, copies, self.books.report.lineage if self.books else [])
        if gone:
            log.info(
                "%s: the copies of steps %s belong to the timeline abandoned by a resume: not "
                "restored as the latest",
                self.directory,
                sorted(gone),
            )
            copies = {s: c for s, c in copies.items() if s not in gone}
        every = sorted(set(steps) | set(copies))
        if not every:
            return None
        failures = []
        for candidate in reversed(every):
            for source, load in self.sources(candidate, steps, copies):
                try:
                    loaded = _checked(load, load_options)
                except (CorruptCheckpointError, IncompleteCheckpointError) as exc:
                    where = "" if not copies else f" ({source})"
                    failures.append(f"step {candidate}{where}: {exc}")
                    log.info(
                        "%s: checkpoint %d (%s) failed verification, trying another copy or "
                        "an older one: %s",
                        self.directory,
                        candidate,
                        source,
                        exc,
                    )
                    other = "an older one" if not copies else "another copy or an older one"
                    what = (
                        "could not be restored" if source == PEER_MEMORY else "failed verification"
                    )
                    warnings.warn(
                        f"checkpoint {candidate} of {self.directory}{where} {what}, trying "
                        f"{other}: {exc}",
                        stacklevel=_CALLER,
                    )
                    continue
                return self.restored(candidate, source, loaded)
        raise CorruptCheckpointError(
            f"{self.directory}: no intact checkpoint among {len(every)}: " + "; ".join(failures),
            path=self.directory,
        )

    def best(
        self, steps: list[int], copies: Copies, load_options: dict[str, Any]
    ) -> tuple[int, Any]:
        """The best step by the run's metric, never substituted: missing or corrupt raises."""
        best = self.catalog.best_among(steps)
        if best is None:
            metric = self.catalog.best_metric
            raise MissingCheckpointError(
                f"{self.directory}: no best checkpoint (best_metric={metric!r}): no checkpoint "
                "has a finite value for that metric"
                if metric is not None
                else f"{self.directory}: no best checkpoint: the run ranks no metric; open it "
                "with best_metric=... to choose one",
                path=self.directory,
            )
        return self.first_intact(best, steps, copies, load_options)

    def explicit(
        self, step: int, steps: list[int], copies: Copies, load_options: dict[str, Any]
    ) -> tuple[int, Any]:
        """Checkpoint ``step``, never substituted; deleted while read: CheckpointNotFoundError
        (replaced by a new save of that step: _Moved, the new one is read)."""
        where = str(layout.step_location(self.run, step))
        if step not in steps and step not in copies:
            held = f"it has {steps}"
            if any(copies.values()):
                held += f"; its tiers have {sorted(s for s, c in copies.items() if c)}"
            if self.peer_steps:
                held += f"; peer memory has {sorted(self.peer_steps)}"
            raise CheckpointNotFoundError(
                f"{self.directory} has no checkpoint for step {step} ({held})", path=where
            )
        try:
            return self.first_intact(step, steps, copies, load_options)
        except _Moved:
            if self.catalog.manifest_id(step) is not None:
                raise  # replaced by a new save of that step: read the new one
            raise CheckpointNotFoundError(
                f"checkpoint {step} of {self.directory} was deleted while it was being restored "
                "(the run's writer pruned it); choose a step the run still has",
                path=where,
            ) from None

    def sources(self, step: int, steps: list[int], copies: Copies) -> list[Source]:
        """Where checkpoint ``step`` can be read, in the order to try: peer memory (when the
        step is complete there), the run directory, then the tiers holding a copy (fastest
        first); each as (its name, a load function)."""
        found: list[Source] = []
        if step in self.peer_steps and self.peers is not None:
            found.append((PEER_MEMORY, functools.partial(self.peers.load, step)))
        if step in steps or step not in copies:
            # (not listed and no copy: read it all the same; a live writer's deletion then
            # shows as _Moved, and a restore chooses again)
            found.append((RUN_DIRECTORY, functools.partial(self.load, step)))
        for tier, where in copies.get(step, ()):
            found.append((tier.label, functools.partial(_load_copy, layout.checkpoint_arg(where))))
        return found

    def first_intact(
        self, step: int, steps: list[int], copies: Copies, load_options: dict[str, Any]
    ) -> tuple[int, Any]:
        """Checkpoint ``step`` from the first of its copies that loads (never another step)."""
        sources = self.sources(step, steps, copies)
        for i, (source, load) in enumerate(sources):
            try:
                return self.restored(step, source, _checked(load, load_options))
            except (CorruptCheckpointError, IncompleteCheckpointError) as exc:
                if i == len(sources) - 1:
                    raise
                log.warning(
                    "%s: checkpoint %d (%s) failed verification, trying its copy on %s: %s",
                    self.directory,
                    step,
                    source,
                    sources[i + 1][0],
                    exc,
                )
        raise AssertionError("unreachable: a step always has a source")

    def restored(self, step: int, source: str, loaded: Any) -> tuple[int, Any]:
        self.restored_from = source
        if self.tiers is not None or self.peers is not None:
            log.info("%s: step %d read from %s", self.directory, step, source)
        return step, loaded

    def load(self, step: int, load_options: dict[str, Any]) -> Any:
        """Load checkpoint ``step`` from the run directory; _Moved if it was deleted or replaced
        meanwhile (a failure that must not be taken for corruption)."""
        before = self.catalog.manifest_id(step)
        where = layout.checkpoint_arg(layout.step_location(self.run, step))
        try:
            return checkpoint.load(where, **load_options)
        except (CheckpointNotFoundError, CorruptCheckpointError, IncompleteCheckpointError):
            if before is None or self.catalog.manifest_id(step) != before:
                raise _Moved from None
            raise


def abandoned(steps: list[int], copies: Copies, lineage: list[dict[str, Any]]) -> set[int]:
    """The steps of ``copies`` (those held by tiers or peer memory) that belong to a timeline the
    run abandoned: newer than its newest checkpoint in ``steps`` (the run directory's, which
    never deletes its newest: a copy of a later step of the current timeline cannot exist), and
    after a step it resumed from, at or before the step it had reached then (``lineage``:
    ``report.lineage``). With no checkpoint in the run directory (a new one, on a new machine)
    nothing is known to be abandoned."""
    if not steps or not lineage:
        return set()
    newest = max(steps)
    spans = []
    for entry in lineage:
        start, end = entry.get("resumed_from"), entry.get("steps_completed_before")
        if isinstance(start, int) and isinstance(end, int):
            spans.append((start, end))
    return {s for s in copies if s > newest and any(a < s <= b for a, b in spans)}


def _checked(load: Callable[[dict[str, Any]], Any], options: dict[str, Any]) -> Any:
    """``load(options)``; a sharded load that failed (DistributedCheckpointError, the same on
    every rank) because every failing rank's own checks refused what it read (checksums,
    records: CorruptCheckpointError or IncompleteCheckpointError there) is raised as a
    CorruptCheckpointError: that copy failed verification, and every rank goes on with the next
    source or step together, as an unsharded load's would. A rank that stalled, targets that
    do not match: raised as they are (the next source would fail the same way)."""
    try:
        return load(options)
    except DistributedCheckpointError as exc:
        refused: set[str] = set()
        kinds: list[type[CheckpointError]] = [CorruptCheckpointError, IncompleteCheckpointError]
        while kinds:
            kind = kinds.pop()
            refused.add(kind.__name__)
            kinds.extend(kind.__subclasses__())
        found = {message.split(":", 1)[0] for message in exc.errors.values()}
        if exc.stalled or not found or not found <= refused:
            raise
        raise CorruptCheckpointError(str(exc), path=exc.path) from exc


def _load_copy(where: str | Location, options: dict[str, Any]) -> Any:
    return checkpoint.load(where, **options)
