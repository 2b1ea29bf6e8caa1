"""The preemption flow of a :class:`~savepoint.runs.manager.CheckpointManager`: ``preempted()`` and
``save_on_preemption()`` (docs/runs.md, "Preemption"), driving the manager's
:class:`~savepoint.runs.saving.Saver`.

Preemption (``preemption=True`` or a list of signals): flag-only handlers
(:mod:`savepoint.runs.preemption`) installed at open from the main thread and removed by
``close()``; ``preempted()`` reads the flag (with a process group: the ranks' agreed answer, one
all-reduce every ``preemption_every`` calls); ``save_on_preemption(step, state)`` works to a grace
budget (``preemption_grace``, 25 s, from the notice): the async save in flight is finished if it
commits in time to leave room for this save, otherwise abandoned (its next write raises, its
transaction removes what it wrote); from then on background steps stop before verification,
retention, deletions and compaction (the next run does them); ``step`` is committed synchronously
and its books synced (steps 2-5 of :mod:`savepoint.runs.saving`, and the syncs of step 6); the
result carries ``exit_code`` (128 + the signal). Preemption is logged (``logging``, logger
``savepoint.runs.manager``, INFO).

The steps of :meth:`Preempting.save`, each a method: the budget (:meth:`Preempting._begin`),
room for this save (the save in flight and the background step, :meth:`Preempting._make_room`),
the ranks' agreement (:meth:`Preempting._agree`), the commit (:meth:`Preempting._commit`, then
its replication into peer memory, when the run has that tier, and the copy to the first tier),
the answer (:meth:`Preempting._result`).
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import time
from collections.abc import Callable, Mapping
from typing import Any, Literal

from savepoint.errors import CheckpointError
from savepoint.runs import layout
from savepoint.runs.peers import PEER_MEMORY
from savepoint.runs.preemption import Preemption, PreemptionSave, max_over_ranks
from savepoint.runs.saving import Saver, abandoned, check_step

__all__ = ["Preempting"]

# (the manager's logger: preemption is documented under that name)
log = logging.getLogger("savepoint.runs.manager")

InFlight = Literal["none", "finished", "abandoned", "failed"]


class Preempting:
    """The preemption flow over a manager's ``saver`` (see the module docstring). ``check_grace``
    validates a ``grace=`` argument (seconds). ``preemption``: the notice handlers, set by the
    open (None: none installed; ``save_on_preemption`` works all the same)."""

    def __init__(self, saver: Saver, check_grace: Callable[[Any, str], float]) -> None:
        self.saver = saver
        self.check_grace = check_grace
        self.preemption: Preemption | None = None
        self._logged = False  # the notice was logged
        self._noticed_at: float | None = None  # when preempted() first answered True

    def preempted(self, local: bool) -> bool:
        """The manager's ``preempted()`` (its handlers are installed: ``preemption``)."""
        p = self.preemption
        assert p is not None  # (the manager raises otherwise)
        answer = p.requested() if local else p.poll()
        if answer and not self._logged:
            self._logged = True
            self._noticed_at = time.monotonic()
            directory = self.saver.books.directory
            if p.requested():
                log.info(
                    "%s: preemption notice: %s received %.2f s ago; stopping",
                    directory,
                    _signal_name(p.signum),
                    p.elapsed(),
                )
            else:
                log.info("%s: preemption notice received by another rank; stopping", directory)
        return answer

    def save(
        self,
        step: int,
        state: Any,
        metrics: Mapping[str, Any] | None,
        epoch: int | None,
        grace: float | None,
        *,
        default_grace: float,
        saving: Any,
    ) -> PreemptionSave:
        """The manager's ``save_on_preemption``: ``default_grace`` is its ``preemption_grace``,
        ``saving`` its save lock (taken here once the background steps were told to stop)."""
        attempt = self._begin(step, grace, default_grace)
        with saving:
            self.saver.host.check_open()
            flight_error = self._make_room(attempt)
            self._agree(attempt, flight_error)
            self._commit(attempt, state, metrics, epoch)
            attempt.committed_at = time.monotonic()
            attempt.copied_to = self._copy_on_preemption(
                step, attempt.deadline, attempt.errors, attempt.deferred
            )
        return self._result(attempt)

    def _begin(self, step: int, grace: float | None, default_grace: float) -> _Attempt:
        """The budget and its deadline; from now on, background steps stop before verifying,
        pruning or deleting."""
        started = time.monotonic()
        self.saver.host.check_open()
        check_step(step)
        budget = default_grace if grace is None else self.check_grace(grace, "grace")
        p = self.preemption
        notice = p.received_at if p is not None else None
        # The budget runs from this process's signal, else from when preempted() first said so
        # (another rank's signal), else from now.
        base = notice if notice is not None else self._noticed_at
        deadline = (started if base is None else base) + budget
        self.saver.settle.preempting.set()
        return _Attempt(step, started, budget, notice, deadline)

    def _make_room(self, a: _Attempt) -> str | None:
        """Finish or abandon the save in flight, let the background step stop; returns the
        save in flight's error (also in ``a.errors``)."""
        # Room for this save: twice the last save's time, a second at least (half the budget
        # when no save was timed yet).
        last = self.saver.write_seconds
        reserve = a.budget / 2 if last is None else min(a.budget / 2, max(1.0, 2 * last))
        wait_until = a.deadline - reserve
        a.in_flight, a.in_flight_step, flight_error = self._end_in_flight(
            a.step, wait_until, reserve
        )
        if flight_error is not None:
            a.errors.append(flight_error)
        self._end_background(wait_until, a.errors, a.deferred)
        return flight_error

    def _agree(self, a: _Attempt, flight_error: str | None) -> None:
        """One all-reduce: the ranks' steps (they must agree), the signal, whether any rank
        lacks the step, whether any rank abandoned the save in flight."""
        saver = self.saver
        with saver.lock:
            have = a.step in saver.books.steps_now() and a.step not in saver.catalog.failed
        p = self.preemption
        signum = None if p is None else p.signum
        top, low, agreed, a.missing, gave_up = max_over_ranks(
            saver.options.process_group,
            [a.step, -a.step, signum or 0, 0 if have else 1, int(a.in_flight == "abandoned")],
        )
        if top != -low:
            raise ValueError(
                f"save_on_preemption: the ranks passed different steps (from {-low} to "
                f"{top}); every rank must save the same step (stop at an agreed "
                "mgr.preempted())"
            )
        a.signum = agreed or None
        if gave_up and a.in_flight == "failed":
            # Abandoned by another rank: a sharded save fails on every rank then.
            a.in_flight = "abandoned"
            if flight_error is not None:
                a.errors.remove(flight_error)

    def _commit(
        self, a: _Attempt, state: Any, metrics: Mapping[str, Any] | None, epoch: int | None
    ) -> None:
        """Commit ``a.step`` synchronously and sync its books, unless every rank has it."""
        if a.missing:
            # (stacklevel: the manager's caller, for the unranked-metrics warning)
            sync_error = self.saver.save_now(a.step, state, metrics, epoch, stacklevel=5)
            if sync_error is not None:
                a.errors.append(str(sync_error))
        else:
            log.info(
                "%s: step %d is committed already: not saved again",
                self.saver.books.directory,
                a.step,
            )

    def _result(self, a: _Attempt) -> PreemptionSave:
        """What was done, logged."""
        directory = self.saver.books.directory
        a.deferred.append(
            f"verifying step {a.step}, retention and deletions (the next run's first save)"
        )
        for error in a.errors:
            log.warning("%s: during the preemption save: %s", directory, error)
        since = None if a.notice is None else a.committed_at - a.notice
        result = PreemptionSave(
            step=a.step,
            path=self.saver.path(a.step),
            saved=bool(a.missing),
            seconds=a.committed_at - a.started,
            since_notice=since,
            budget=a.budget,
            within_budget=a.committed_at <= a.deadline,
            signum=a.signum,
            exit_code=0 if a.signum is None else 128 + a.signum,
            in_flight=a.in_flight,
            in_flight_step=a.in_flight_step,
            deferred=tuple(a.deferred),
            errors=tuple(a.errors),
            copied_to=a.copied_to,
        )
        (log.info if result.within_budget else log.warning)(
            "%s: preemption save: step %d %s in %.2f s (%s; budget %g s%s); exit with %d",
            directory,
            a.step,
            "committed" if a.missing else "was committed already",
            result.seconds,
            "no signal" if since is None else f"{since:.2f} s after the notice",
            a.budget,
            "" if result.within_budget else ", EXCEEDED",
            result.exit_code,
        )
        return result

    def _copy_on_preemption(
        self, step: int, deadline: float, errors: list[str], deferred: list[str]
    ) -> tuple[str, ...]:
        """With a peer-memory tier: wait until ``deadline`` for the replication of ``step``
        (submitted at its commit) first. With tiers: copy checkpoint ``step`` to the first tier
        (due or not) and wait for it until ``deadline``. Returns the tiers the step reached in
        time."""
        peers = self._replicated(step, deadline, errors, deferred)
        tiers = self.saver.settle.tiers
        if tiers is None or not tiers.tiers:
            return peers
        first = tiers.tiers[0]
        tiers.submit(step, layout.checkpoint_arg(self.saver.catalog.step_location(step)), [first])
        if not tiers.wait(max(0.0, deadline - time.monotonic())):
            deferred.append(f"copying step {step} to tier {first.label!r} (not done in time)")
            return ()
        try:
            tiers.raise_error()
        except CheckpointError as exc:
            errors.append(str(exc))
        try:
            copied = layout.committed(tiers.location(first, step))
        except CheckpointError as exc:  # not known to be there: not counted as copied
            errors.append(str(exc))
            copied = False
        return peers + ((first.label,) if copied else ())

    def _replicated(
        self, step: int, deadline: float, errors: list[str], deferred: list[str]
    ) -> tuple[str, ...]:
        """(``"peer memory"``,) once the replication of ``step`` is complete (waited for until
        ``deadline``), else () with what happened in ``errors`` or ``deferred``."""
        peers = self.saver.settle.peers
        if peers is None:
            return ()
        if not peers.wait(max(0.0, deadline - time.monotonic())):
            deferred.append(f"replicating step {step} into peer memory (not done in time)")
            return ()
        try:
            peers.raise_error()
        except CheckpointError as exc:
            errors.append(str(exc))
        last = peers.last
        return (PEER_MEMORY,) if last is not None and last.step == step and last.complete else ()

    def _end_in_flight(
        self, step: int, wait_until: float, reserve: float
    ) -> tuple[InFlight, int | None, str | None]:
        """Finish the async save in flight if it commits by ``wait_until``, else abandon it
        (it stops at its next write; its transaction removes what it wrote). Returns what
        became of it, its step, and its error (consumed: reported by save_on_preemption)."""
        saver = self.saver
        in_flight: InFlight = "none"
        flight, step_in_flight, error = saver.last_async, None, None
        if flight is not None and flight.pending is not None and not flight.pending.done():
            step_in_flight = flight.step
            if not flight.booked.wait(max(0.0, wait_until - time.monotonic())):
                log.info(
                    "%s: abandoning the save of step %d in flight: it would not commit in time "
                    "to leave %.1f s for step %d",
                    saver.books.directory,
                    flight.step,
                    reserve,
                    step,
                )
                saver.abandon.step = flight.step
                flight.booked.wait()  # it stops at its next write (or has just committed)
            # Committed: its background step stops before retention (a verification already
            # reading it back is left to finish: it only reads).
            self._wait_unless_verifying(flight.pending.done, wait_until)
            saver.abandon.step = None
            in_flight = "finished"
            if not flight.committed:
                gave_up = abandoned(flight.pending.exception())
                in_flight = "abandoned" if gave_up else "failed"
        if saver.checkpointer is not None and (
            flight is None or flight.pending is None or flight.pending.done()
        ):
            failure = saver.take_background_error()
            if failure is not None and in_flight != "abandoned":
                error = str(failure)
        return in_flight, step_in_flight, error

    def _end_background(self, wait_until: float, errors: list[str], deferred: list[str]) -> None:
        """Let the background step of the last save reach its end (it stops before retention);
        past ``wait_until`` leave a verification that is still reading a checkpoint back."""
        settle = self.saver.settle
        busy = settle.worker.busy
        if busy():
            self._wait_unless_verifying(lambda: not busy(), wait_until)
        verifying = settle.verifying
        if verifying is not None:
            deferred.append(f"verifying step {verifying} (still reading it back)")
        if not busy():
            earlier = settle.take_error()
            if earlier is not None:
                errors.append(str(earlier))

    def _wait_unless_verifying(self, done: Callable[[], bool], until: float) -> None:
        """Wait until ``done()``; past ``until`` stop waiting for a background step that is
        reading a checkpoint back (it only reads, then stops before retention)."""
        while not done():
            if time.monotonic() >= until and self.saver.settle.verifying is not None:
                return
            time.sleep(0.005)


@dataclasses.dataclass
class _Attempt:
    """One save_on_preemption on its way (the steps of :meth:`Preempting.save` fill it in)."""

    step: int
    started: float
    budget: float
    notice: float | None  # when this process's signal came (None: none)
    deadline: float
    errors: list[str] = dataclasses.field(default_factory=list)
    deferred: list[str] = dataclasses.field(default_factory=list)
    in_flight: InFlight = "none"
    in_flight_step: int | None = None
    signum: int | None = None
    missing: int = 0  # whether any rank lacks the step (the all-reduce's answer)
    committed_at: float = 0.0
    copied_to: tuple[str, ...] = ()


def _signal_name(signum: int | None) -> str:
    if signum is None:
        return "a notice"
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
