"""Deadlines of a sharded save or load: what a rank that misses one was doing, and the one
error every rank raises for it.

Every phase of a sharded save or load (``"save: plan"``, ``"save: write"``, ``"save: commit"``,
``"load: plan"``, ``"load: read"``, ``"load: read-once round k"``) ends at a numbered point where
the ranks meet (:mod:`savepoint.distributed.collectives`): after each rank's local part of a step,
after rank 0's combining (merging the plans, the commit), and at each data collective that
opens a read-once round. Each rank records in the default store the last point it reached
(:class:`Board`). A rank waits at a point at most ``timeout`` seconds (the gloo group's timeout);
a rank that has not reached it by then missed the phase's deadline. The first rank to give up
writes a :class:`Verdict` (create-only: the first one written stands) naming the ranks that had
not reached the point, the phase, the object (the checkpoint) and what each of those ranks was
doing where it said (the data file it was writing); after a timeout they are named at once,
after a collective broke because a rank died a slower live rank gets a few seconds to record the
point first. Every other rank raises the error of that verdict, one message on every rank, and
a late rank reads the verdict when it reaches the point and raises it at once instead of
entering the collective (it would wait another ``timeout`` there). The store lives in the
process of rank 0 of the world, which may exit as soon as it raised: a rank giving up leaves
only once the others giving up on the point with it have the verdict, and a store that is gone
does not erase the ranks it already showed behind.

What a rank is doing is noted in memory (:func:`working_on`, around each data file written) and
published to the store only by a :class:`Watch` timer, once a phase has run for half its deadline
(then every quarter deadline, if it changed): a save whose phases end in time never writes a
note. :func:`abandoned` lets a rank that waits on someone else's work (the writer process of
``AsyncCheckpointer(writer="process")``) stop waiting once the others gave up, and rank 0 make
no commit the others no longer wait for.
"""

from __future__ import annotations

import heapq
import json
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from savepoint.errors import DistributedCheckpointError

__all__ = [
    "Board",
    "Verdict",
    "Watch",
    "abandoned",
    "give_up",
    "ranks_text",
    "watch",
    "working_on",
]


def ranks_text(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


@dataclass
class Verdict:
    """Why a phase failed, as the first rank to give up saw it (JSON in the default store)."""

    phase: str
    obj: str  # the checkpoint (or staging directory) the phase works on
    timeout: float
    by: int  # the rank that wrote the verdict
    world: int
    report: str  # what savepoint's process group reported on rank ``by``
    timed_out: bool = False  # the deadline passed (else a collective broke: a rank died)
    stalled: dict[int, str] = field(default_factory=dict)  # rank -> what it was doing ("")
    errors: dict[int, str] = field(default_factory=dict)  # ranks' own errors known to ``by``

    @classmethod
    def of(
        cls, phase: str, obj: str, timeout: float, by: int, world: int, exc: BaseException
    ) -> Verdict:
        """Rank ``by``'s verdict before it names anyone: its collective failed with ``exc``."""
        text = str(exc)
        timed_out = any(w in text.lower() for w in ("timed out", "timeout"))
        return cls(phase, obj, timeout, by, world, text, timed_out)

    def to_json(self) -> str:
        fields = dict(vars(self))
        fields["stalled"] = {str(r): v for r, v in self.stalled.items()}
        fields["errors"] = {str(r): v for r, v in self.errors.items()}
        return json.dumps(fields, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> Verdict:
        fields = json.loads(text)
        fields["stalled"] = {int(r): v for r, v in fields["stalled"].items()}
        fields["errors"] = {int(r): v for r, v in fields["errors"].items()}
        return cls(**fields)

    def part(self, rank: int) -> str:
        """What ``rank``, one of the stalled, did not do."""
        doing = self.stalled.get(rank, "")
        note = f" ({doing})" if doing else ""
        how = f" within {self.timeout:g} s" if self.timed_out else " (died, or stuck)"
        return f"did not finish its part of '{self.phase}' of {self.obj}{note}{how}"

    def error(
        self, what: str, path: str, own: Mapping[int, str] | None = None
    ) -> DistributedCheckpointError:
        """The error every rank raises (``own``: this rank's own failure, added to ``errors``)."""
        stalled = sorted(self.stalled)
        if stalled:
            notes = {r: d for r, d in self.stalled.items() if d}
            if len(stalled) == 1:
                doing = f" ({notes[stalled[0]]})" if notes else ""
            else:
                doing = "; ".join(f"rank {r}: {d}" for r, d in sorted(notes.items()))
                doing = f" ({doing})" if doing else ""
            how = f" within {self.timeout:g} s" if self.timed_out else " (died, or stuck)"
            pronoun = "its" if len(stalled) == 1 else "their"
            who = (
                f"{ranks_text(stalled)} did not finish {pronoun} part of '{self.phase}' of "
                f"{self.obj}{doing}{how}"
            )
        else:
            who = f"a rank died or stopped answering in '{self.phase}' of {self.obj}"
        failed = "".join(
            f"; rank {r} failed: {e}" for r, e in sorted(self.errors.items()) if r not in stalled
        )
        errors = {**self.errors, **(own or {}), **{r: self.part(r) for r in stalled}}
        return DistributedCheckpointError(
            f"{what} {path} failed: {who}{failed}; savepoint's process group reported on rank "
            f"{self.by} of {self.world}: {self.report} (a rank that does not finish a phase "
            f"within {self.timeout:g} s of the others, the timeout= argument, counts as failed)",
            path=path,
            errors=errors,  # empty when no rank could be named
            phase=self.phase,
            stalled={r: self.phase for r in stalled},
        )


# -- the board: points reached, verdicts, notes ------------------------------------------------


class Board:
    """One channel's records in the default store (under its prefix): the last point each rank
    reached (``progress/<rank>``), the verdict on a point (``verdict/<point>``), how many ranks
    gave up on a point and how many have its verdict (counters ``joined/<point>``,
    ``read/<point>``) and what a late rank is doing (``doing/<rank>``). Best effort: the store lives on rank 0 of the world, which
    may be gone; then nothing is named, and nothing here raises but :meth:`note`."""

    def __init__(self, store: Callable[[], Any]) -> None:
        self.store = store

    def done(self, rank: int, point: int) -> None:
        try:
            self.store().set(f"progress/{rank}", str(point))
        except Exception:  # only used to word an error; never fail a step over it
            pass

    def behind(self, point: int, ranks: Sequence[int]) -> list[int]:
        """Those of ``ranks`` that have not recorded reaching ``point`` ([] if unknown)."""
        return self.known_behind(point, ranks) or []

    def known_behind(self, point: int, ranks: Sequence[int]) -> list[int] | None:
        """As :meth:`behind`, or None when the store could not be read (not: nobody behind)."""
        try:
            store = self.store()
            keys = [f"progress/{r}" for r in ranks]
            if keys and store.check(keys):
                return [r for r, v in zip(ranks, store.multi_get(keys)) if int(v) < point]
            return [
                r
                for r, key in zip(ranks, keys)
                if not store.check([key]) or int(store.get(key)) < point
            ]
        except Exception:
            return None

    def verdict(self, point: int) -> Verdict | None:
        """The verdict a rank wrote on ``point``, if one did."""
        try:
            store = self.store()
            key = f"verdict/{point}"
            return Verdict.from_json(store.get(key)) if store.check([key]) else None
        except Exception:
            return None

    def publish(self, point: int, verdict: Verdict) -> Verdict:
        """Write ``verdict`` on ``point`` unless a rank wrote one first; the one that stands."""
        try:
            stored = self.store().compare_set(f"verdict/{point}", "", verdict.to_json())
            return Verdict.from_json(stored)
        except Exception:
            return verdict

    def count(self, key: str, n: int = 1) -> int | None:
        """Add ``n`` to the counter ``key`` (0: read it); its value, or None if unknown. Counts
        the ranks giving up on a point (``joined/<point>``) and those that have its verdict
        (``read/<point>``)."""
        try:
            return int(self.store().add(key, n))
        except Exception:
            return None

    def note(self, rank: int, text: str) -> None:
        self.store().set(f"doing/{rank}", text)

    def doing(self, rank: int) -> str:
        try:
            store = self.store()
            key = f"doing/{rank}"
            return bytes(store.get(key)).decode() if store.check([key]) else ""
        except Exception:
            return ""


def give_up(
    board: Board, point: int, mine: Verdict, waited_for: Sequence[int], grace: float
) -> Verdict:
    """The verdict on ``point``, whose collective failed on rank ``mine.by``: the one another
    rank wrote, or ``mine`` naming those of ``waited_for`` that have not reached the point (and
    what each is doing), written for the others. After a timeout (``mine.timed_out``) the ranks
    behind are named at once: they missed the deadline. After a broken collective (a rank died)
    a slower live rank gets ``grace`` seconds to record the point before it is named.

    The store lives in one rank's process (rank 0 of the world), which may exit as soon as it
    has raised: a read that fails does not erase what an earlier one told (the last answer
    stands, retried until the grace ends), and a rank leaves only once every rank that gave up
    on the point with it has the verdict (at most ``grace`` more), so none of them is left to
    word the error alone, naming nobody."""
    start = time.monotonic()
    board.count(f"joined/{point}")
    behind: list[int] = []  # the last answer the store gave
    while True:
        found = board.verdict(point)
        if found is not None:
            break
        known = board.known_behind(point, waited_for)
        if known is not None:
            behind = [r for r in known if r != mine.by]
        if (behind and mine.timed_out) or time.monotonic() - start >= grace:
            mine.timed_out = mine.timed_out and bool(behind)
            mine.stalled = {r: board.doing(r) for r in behind}
            found = board.publish(point, mine)
            break
        time.sleep(0.05)
    _linger(board, point, grace)
    return found


def _linger(board: Board, point: int, grace: float) -> None:
    """Count this rank as having the verdict on ``point``, then wait (at most ``grace``) until
    every rank that gave up on it has it too: this one may host the store they read it from."""
    if board.count(f"read/{point}") is None:
        return
    until = time.monotonic() + grace
    while time.monotonic() < until:
        joined, read = board.count(f"joined/{point}", 0), board.count(f"read/{point}", 0)
        if joined is None or read is None or read >= joined:
            return
        time.sleep(0.02)


# -- what this process is doing ---------------------------------------------------------------

_watches: list[Watch] = []  # the phases being watched in this process, innermost last
_watches_lock = threading.Lock()


@contextmanager
def working_on(what: str) -> Iterator[None]:
    """Note, for the phase being watched, that this process is doing ``what`` ("writing
    data-r00003-00000.safetensors") until the block ends; nothing outside a watched phase.
    Costs a lock, no I/O."""
    with _watches_lock:
        watch = _watches[-1] if _watches else None
    if watch is None:
        yield
        return
    watch.add(what)
    try:
        yield
    finally:
        watch.remove(what)


def abandoned() -> DistributedCheckpointError | None:
    """The error of the phase being watched if the other ranks have given up on it (a verdict
    was written for the point they wait at), else None. Asks the store only once the phase has
    run for half its deadline; cheap before."""
    with _watches_lock:
        watch = _watches[-1] if _watches else None
    return None if watch is None else watch.abandoned()


def watch(
    board: Board, rank: int, point: Callable[[], int], what: str, path: str, timeout: float
) -> Watch:
    """The :class:`Watch` of ``rank``'s part of a phase of ``what`` ``path`` with deadline
    ``timeout``: it publishes to ``board``; the others wait for it at ``point()``."""

    def check() -> DistributedCheckpointError | None:
        verdict = board.verdict(point())
        return None if verdict is None else verdict.error(what, path)

    return Watch(lambda text: board.note(rank, text), check, timeout / 2, max(timeout / 4, 0.5))


class Watch:
    """One rank's part of one phase, watched: after ``after`` seconds (half the deadline), and
    then every ``every`` seconds while it runs, ``publish`` gets what the rank is doing (the
    files noted by :func:`working_on`, as text) if that changed; ``publish("")`` clears it at the
    end if anything was published. ``check`` returns the error of the phase once the other
    ranks have given up on it (for :func:`abandoned`). One thread of the process times every
    watch (:class:`_Watchdog`): entering and leaving a watch costs a lock, no thread."""

    def __init__(
        self,
        publish: Callable[[str], None],
        check: Callable[[], DistributedCheckpointError | None],
        after: float,
        every: float,
    ) -> None:
        self.publish = publish
        self.check = check
        self.after = after
        self.every = every
        self.start = time.monotonic()
        self.doing: dict[str, int] = {}
        self.lock = threading.Lock()  # guards doing
        self.publishing = threading.Lock()  # guards stopped and shown: no note after the end
        self.stopped = False
        self.shown = ""  # what was published last

    def add(self, what: str) -> None:
        with self.lock:
            self.doing[what] = self.doing.get(what, 0) + 1

    def remove(self, what: str) -> None:
        with self.lock:
            n = self.doing.pop(what, 0) - 1
            if n > 0:
                self.doing[what] = n

    def text(self) -> str:
        with self.lock:
            names = sorted(self.doing)
        return ", ".join(names)

    def abandoned(self) -> DistributedCheckpointError | None:
        if time.monotonic() - self.start < self.after:
            return None
        return self.check()

    def __enter__(self) -> Watch:
        _watchdog.add(self.start + self.after, self)
        with _watches_lock:
            _watches.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        with _watches_lock:
            if self in _watches:
                _watches.remove(self)
        with self.publishing:
            self.stopped = True
            if self.shown:
                self._publish("")

    def fire(self) -> None:
        """Its time came (on the watchdog's thread): publish what changed, and come again."""
        text = self.text()
        with self.publishing:
            if self.stopped:
                return
            if text != self.shown:
                self._publish(text)
        _watchdog.add(time.monotonic() + self.every, self)

    def _publish(self, text: str) -> None:
        try:
            self.publish(text)
            self.shown = text
        except Exception:  # only used to word an error; never fail a phase over it
            pass


class _Watchdog:
    """The one thread that times every :class:`Watch` of the process (started on first use):
    a heap of (when, watch); a watch that ended is dropped when its time comes."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.due: list[tuple[float, int, Watch]] = []
        self.count = 0
        self.thread: threading.Thread | None = None

    def add(self, when: float, watch: Watch) -> None:
        with self.cond:
            if watch.stopped:
                return
            if len(self.due) > 256:  # many ended watches not yet due (a long deadline)
                self.due = [d for d in self.due if not d[2].stopped]
                heapq.heapify(self.due)
            self.count += 1
            heapq.heappush(self.due, (when, self.count, watch))
            if self.thread is None:
                self.thread = threading.Thread(
                    target=self.run, name="savepoint-deadlines", daemon=True
                )
                self.thread.start()
            elif self.due[0][2] is watch:
                self.cond.notify()

    def run(self) -> None:
        while True:
            with self.cond:
                while True:
                    while self.due and self.due[0][2].stopped:
                        heapq.heappop(self.due)
                    now = time.monotonic()
                    if self.due and self.due[0][0] <= now:
                        watch = heapq.heappop(self.due)[2]
                        break
                    self.cond.wait(self.due[0][0] - now if self.due else None)
            watch.fire()


_watchdog = _Watchdog()


def _reset_after_fork() -> None:
    global _watchdog, _watches_lock
    _watchdog = _Watchdog()  # the parent's thread does not exist in the child
    _watches_lock = threading.Lock()
    _watches.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)
