"""Which checkpoints to write, and which to keep: small policy objects that compose.

Retention policies look at the committed checkpoints of a run (step, metrics) and return the
steps they want kept; a checkpoint survives if any policy in force wants it (``AnyOf``). They are
pure functions of their input, so they are tested with tables of "steps in, steps kept". The
manager adds its own protections on top (the newest verified checkpoint, the current best, the one
the run resumed from), so no policy can delete those.

Save policies decide, per step, whether ``CheckpointManager.save`` writes at all.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

__all__ = [
    "AnyOf",
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


class SaveAlways:
    def should_save(self, step: int, last_saved: int | None) -> bool:
        return True
