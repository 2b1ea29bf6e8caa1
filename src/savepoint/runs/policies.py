"""Which checkpoints to write, and which to keep: small policy objects that compose.

Retention policies look at the committed checkpoints of a run (step, metrics) and return the
steps they want kept; a checkpoint survives if any policy in force wants it (``AnyOf``). They are
pure functions of their input, so they are tested with tables of "steps in, steps kept". The
manager adds its own protections on top (the newest verified checkpoint, the current best, the one
the run resumed from), so no policy can delete those.

Save policies decide, per step, whether ``CheckpointManager.save`` writes at all. A save policy
may also watch the saves it allowed (:class:`SaveObserver`: ``started``, ``durable``, ``failed``):
:class:`Continuous` starts the next save once the previous one is done.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

__all__ = [
    "AnyOf",
    "Continuous",
    "Entry",
    "KeepAll",
    "KeepBest",
    "KeepEvery",
    "KeepLatest",
    "Mode",
    "RetentionPolicy",
    "SaveAlways",
    "SaveAnyOf",
    "SaveEvery",
    "SaveEverySeconds",
    "SaveObserver",
    "SavePolicy",
    "best_entries",
    "explain",
    "from_spec",
    "metric_value",
    "to_spec",
]

Mode = Literal["min", "max"]


def _check_count(what: str, n: object, minimum: int) -> None:
    """``n`` is an int (not a bool) of at least ``minimum``: TypeError or ValueError otherwise."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"{what} needs an int n >= {minimum}, not {type(n).__name__} ({n!r})")
    if n < minimum:
        raise ValueError(f"{what} needs n >= {minimum}, not {n}")


@dataclass(frozen=True)
class Entry:
    """A committed checkpoint as policies see it."""

    step: int
    metrics: Mapping[str, Any] = field(default_factory=dict)


class RetentionPolicy(Protocol):
    def keep(self, entries: Sequence[Entry]) -> set[int]:
        """The steps this policy wants kept, out of ``entries`` (any order)."""


@dataclass(frozen=True)
class KeepLatest:
    """The ``n`` highest steps."""

    n: int

    def __post_init__(self) -> None:
        _check_count("KeepLatest(n)", self.n, 0)

    def keep(self, entries: Sequence[Entry]) -> set[int]:
        return set(sorted(e.step for e in entries)[::-1][: self.n])


def metric_value(entry: Entry, metric: str) -> float | None:
    """The entry's value for ``metric`` as a float, or None when absent or not a finite number."""
    value = entry.metrics.get(metric)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def best_entries(entries: Sequence[Entry], metric: str, mode: Mode) -> list[Entry]:
    """Entries that report ``metric``, best first; ties go to the later step."""
    if mode not in ("min", "max"):
        raise ValueError(f"mode must be 'min' or 'max', not {mode!r}")
    scored = [(v, e) for e in entries if (v := metric_value(e, metric)) is not None]
    sign = 1.0 if mode == "min" else -1.0
    scored.sort(key=lambda ve: (sign * ve[0], -ve[1].step))
    return [e for _, e in scored]


@dataclass(frozen=True)
class KeepBest:
    """The ``n`` best by ``metric`` (``mode`` "min" or "max"); ties keep the later step.
    Entries without a finite value for the metric are never chosen by this policy."""

    n: int
    metric: str
    mode: Mode = "min"

    def __post_init__(self) -> None:
        _check_count("KeepBest(n)", self.n, 0)
        if self.mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', not {self.mode!r}")

    def keep(self, entries: Sequence[Entry]) -> set[int]:
        return {e.step for e in best_entries(entries, self.metric, self.mode)[: self.n]}


@dataclass(frozen=True)
class KeepEvery:
    """Every step that is a multiple of ``n`` (milestones kept for good)."""

    n: int

    def __post_init__(self) -> None:
        _check_count("KeepEvery(n)", self.n, 1)

    def keep(self, entries: Sequence[Entry]) -> set[int]:
        return {e.step for e in entries if e.step % self.n == 0}


@dataclass(frozen=True)
class KeepAll:
    def keep(self, entries: Sequence[Entry]) -> set[int]:
        return {e.step for e in entries}


class AnyOf:
    """Keeps a step if any of its policies keeps it."""

    def __init__(self, *policies: RetentionPolicy) -> None:
        self.policies = policies

    def keep(self, entries: Sequence[Entry]) -> set[int]:
        kept: set[int] = set()
        for p in self.policies:
            kept |= p.keep(entries)
        return kept

    def __repr__(self) -> str:
        return f"AnyOf({', '.join(map(repr, self.policies))})"


def explain(policy: RetentionPolicy, entries: Sequence[Entry]) -> dict[int, list[str]]:
    """For each step, the names of the policies that keep it (``savepoint ls`` shows these)."""
    parts = policy.policies if isinstance(policy, AnyOf) else (policy,)
    reasons: dict[int, list[str]] = {e.step: [] for e in entries}
    for p in parts:
        for step in p.keep(entries):
            reasons[step].append(_label(p))
    return reasons


def to_spec(policy: RetentionPolicy) -> list[dict[str, Any]]:
    """A JSON description of a policy (stored in report.json so ``savepoint ls`` can explain)."""
    parts = policy.policies if isinstance(policy, AnyOf) else (policy,)
    spec: list[dict[str, Any]] = []
    for p in parts:
        if isinstance(p, KeepLatest):
            spec.append({"policy": "keep_last", "n": p.n})
        elif isinstance(p, KeepBest):
            spec.append({"policy": "keep_best", "n": p.n, "metric": p.metric, "mode": p.mode})
        elif isinstance(p, KeepEvery):
            spec.append({"policy": "keep_every", "n": p.n})
        elif isinstance(p, KeepAll):
            spec.append({"policy": "keep_all"})
        else:
            spec.append({"policy": "custom", "repr": repr(p)})
    return spec


def from_spec(spec: Any) -> AnyOf:
    """The policy :func:`to_spec` described; parts it cannot rebuild (custom ones) are left out."""
    parts: list[RetentionPolicy] = []
    for item in spec if isinstance(spec, list) else []:
        kind = item.get("policy") if isinstance(item, dict) else None
        try:
            if kind == "keep_last":
                parts.append(KeepLatest(int(item["n"])))
            elif kind == "keep_best":
                parts.append(KeepBest(int(item["n"]), str(item["metric"]), item.get("mode", "min")))
            elif kind == "keep_every":
                parts.append(KeepEvery(int(item["n"])))
            elif kind == "keep_all":
                parts.append(KeepAll())
        except (KeyError, TypeError, ValueError):
            continue
    return AnyOf(*parts)


def _label(p: Any) -> str:
    if isinstance(p, KeepLatest):
        return f"last-{p.n}"
    if isinstance(p, KeepBest):
        return f"best-{p.n}-{p.metric}"
    if isinstance(p, KeepEvery):
        return f"every-{p.n}"
    return type(p).__name__


class SavePolicy(Protocol):
    def should_save(self, step: int, last_saved: int | None) -> bool:
        """Whether ``save(step)`` writes; ``last_saved`` is the previous saved step or None."""


@dataclass(frozen=True)
class SaveEvery:
    """Save when the step is a multiple of ``n``."""

    n: int

    def __post_init__(self) -> None:
        _check_count("SaveEvery(n)", self.n, 1)

    def should_save(self, step: int, last_saved: int | None) -> bool:
        return step % self.n == 0


class SaveEverySeconds:
    """Save when at least ``seconds`` have passed since the last save (or none happened yet)."""

    def __init__(self, seconds: float, clock: Any = time.monotonic) -> None:
        if seconds <= 0:
            raise ValueError("SaveEverySeconds needs a positive interval")
        self.seconds = seconds
        self.clock = clock
        self._last: float | None = None

    def should_save(self, step: int, last_saved: int | None) -> bool:
        now = self.clock()
        if self._last is None or last_saved is None or now - self._last >= self.seconds:
            self._last = now
            return True
        return False


class SaveAnyOf:
    """Save if any of its policies says so."""

    def __init__(self, *policies: SavePolicy) -> None:
        self.policies = policies

    def should_save(self, step: int, last_saved: int | None) -> bool:
        # Every policy sees every step (time-based ones keep their own clocks).
        answers = [p.should_save(step, last_saved) for p in self.policies]
        return any(answers)

    # Observers among its policies (Continuous) see every save, whichever policy asked for it.
    def started(self, step: int) -> None:
        _tell(self.policies, "started", step)

    def durable(self, step: int) -> None:
        _tell(self.policies, "durable", step)

    def failed(self, step: int) -> None:
        _tell(self.policies, "failed", step)


def _tell(policies: Sequence[Any], event: str, step: int) -> None:
    for p in policies:
        hook = getattr(p, event, None)
        if callable(hook):
            hook(step)


class SaveAlways:
    def should_save(self, step: int, last_saved: int | None) -> bool:
        return True


class SaveObserver(Protocol):
    """What a save policy may also implement to watch the saves it allowed; the manager calls
    each method once per save, in this order: ``started`` when the save begins (after the policy
    said yes, or a forced save), then ``durable`` once the save is done: committed, and the
    manager's background step after it (verification before retention, deletions) finished, so
    a save started then does not wait for it (called from the thread that finished it), or
    ``failed`` if it never commits."""

    def started(self, step: int) -> None: ...

    def durable(self, step: int) -> None: ...

    def failed(self, step: int) -> None: ...


def _seconds(what: str, value: object, *, allow_none: bool = False) -> float | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"{what} must be a number of seconds, not {type(value).__name__} ({value!r})"
        )
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{what} must be a finite number of seconds >= 0, not {value!r}")
    return float(value)


class Continuous:
    """Checkpoint as often as the storage allows: the next save starts as soon as the previous
    one is done (committed, and a manager's background step over), but never sooner than ``min_interval`` seconds after the previous
    save started, and, with ``target_interval``, not sooner than that either (the cadence aimed
    at; a storage too slow for it makes the interval the save's own time to durable instead).

    Use it as ``CheckpointManager(save_policy=sp.policies.Continuous(...), async_save=True)`` and
    call ``mgr.save(step, state)`` every step (a skipped step costs one clock read), or ask
    ``mgr.should_save(step)`` first when building the state to save costs something. With a
    process group the manager asks every rank and saves only when all agree (one all-reduce per
    question), so every rank saves the same steps and no rank's interval is below its minimum.

    :meth:`achieved` says what the run got: the intervals between save starts and the times to
    durable (median, 90th percentile, max, over the last 1,024 saves); the manager writes it to
    ``report.json`` as ``save_intervals``. ``clock``: seconds, monotonic (tests pass a fake).
    """

    _WINDOW = 1024
    agreed = True  # with a process group the ranks agree on its answer (runs.pacing)

    def __init__(
        self,
        min_interval: float = 0.0,
        target_interval: float | None = None,
        *,
        clock: Any = time.monotonic,
    ) -> None:
        minimum = _seconds("Continuous(min_interval)", min_interval)
        assert minimum is not None
        target = _seconds("Continuous(target_interval)", target_interval, allow_none=True)
        if target == 0:  # every interval would count as behind it
            raise ValueError(
                "Continuous(target_interval=0): a target must be above 0 seconds (None: no "
                "target; min_interval=0 saves as often as the storage allows)"
            )
        if target is not None and target < minimum:
            raise ValueError(
                f"Continuous(target_interval={target_interval!r}) is below min_interval="
                f"{min_interval!r}: the target cannot be reached without breaking the minimum"
            )
        self.min_interval = minimum
        self.target_interval = target
        self.clock = clock
        self._started_at: float | None = None  # when the last save started
        self._in_flight: int | None = None  # the step being saved, until durable or failed
        self._intervals: deque[float] = deque(maxlen=self._WINDOW)
        self._durations: deque[float] = deque(maxlen=self._WINDOW)
        self._saves = 0
        self._behind = 0  # intervals longer than the target (the storage could not keep up)

    def should_save(self, step: int, last_saved: int | None) -> bool:
        if self._in_flight is not None:
            return False
        if self._started_at is None:
            return True
        wait = self.min_interval if self.target_interval is None else self.target_interval
        return bool(self.clock() - self._started_at >= wait)

    def started(self, step: int) -> None:
        now = self.clock()
        if self._started_at is not None:
            interval = now - self._started_at
            self._intervals.append(interval)
            if self.target_interval is not None and interval > self.target_interval * 1.05:
                self._behind += 1
        self._started_at = now
        self._in_flight = step
        self._saves += 1

    def durable(self, step: int) -> None:
        if self._started_at is not None:
            self._durations.append(self.clock() - self._started_at)
        if self._in_flight == step:
            self._in_flight = None

    def failed(self, step: int) -> None:
        if self._in_flight == step:
            self._in_flight = None

    def achieved(self) -> dict[str, Any]:
        """The intervals the run achieved (seconds), for ``report.json``'s ``save_intervals``."""
        out: dict[str, Any] = {
            "policy": "continuous",
            "min_interval_s": self.min_interval,
            "target_interval_s": self.target_interval,
            "saves": self._saves,
        }
        for name, values in (("interval", self._intervals), ("durable", self._durations)):
            if values:
                ordered = sorted(values)
                out[f"{name}_median_s"] = round(statistics.median(ordered), 6)
                out[f"{name}_p90_s"] = round(
                    ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))], 6
                )
                out[f"{name}_max_s"] = round(ordered[-1], 6)
        if self.target_interval is not None:
            out["behind_target"] = self._behind
        return out

    def __repr__(self) -> str:
        return f"Continuous(min_interval={self.min_interval!r}, target_interval={self.target_interval!r})"
