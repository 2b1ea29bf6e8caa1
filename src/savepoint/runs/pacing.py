"""When a managed save happens: :class:`Pacing`, the save policy of a
:class:`~savepoint.runs.manager.CheckpointManager` as its save route asks it.

Per step the route asks :meth:`Pacing.decide` (``CheckpointManager.save``; ``force=True`` always
writes), or the caller asks first with ``CheckpointManager.should_save(step)``, whose answer the
following ``save(step)`` reuses instead of asking the policy again. A policy that watches its
saves (:class:`savepoint.runs.policies.SaveObserver`: :class:`~savepoint.runs.policies.Continuous`)
is told of each save that starts, becomes durable (committed) or fails, and its
``achieved()`` figures go into ``report.json`` as ``save_intervals`` with each save's books.

With a process group, a policy whose answer depends on this process's clock and saves
(``agreed = True``: :class:`~savepoint.runs.policies.Continuous`) is agreed on: every rank asks
its own policy and the step is saved only if every rank said yes (one all-reduce of one integer
per question, which every rank must therefore ask at the same steps: call ``save`` or
``should_save`` at every step on every rank). Policies that decide by the step alone
(``SaveEvery``, ``SaveAlways``) need no agreement. ``SaveEverySeconds`` is not agreed (its clock
moves at the question): with a process group prefer ``Continuous(target_interval=...)``.
"""

from __future__ import annotations

from typing import Any

from savepoint.runs.policies import SaveAnyOf, SavePolicy
from savepoint.runs.preemption import max_over_ranks

__all__ = ["Pacing", "achieved", "agreed"]


def agreed(policy: Any) -> bool:
    """Whether ``policy``'s answer must be agreed by the ranks (see the module docstring)."""
    if isinstance(policy, SaveAnyOf):
        return any(agreed(p) for p in policy.policies)
    return bool(getattr(policy, "agreed", False))


def achieved(policy: Any) -> dict[str, Any] | None:
    """What a policy that watches its saves achieved (its ``achieved()``; within ``SaveAnyOf``,
    the first part's that has one), or None."""
    parts = policy.policies if isinstance(policy, SaveAnyOf) else (policy,)
    for part in parts:
        report = getattr(part, "achieved", None)
        if callable(report):
            got: dict[str, Any] = report()
            return got
    return None


class Pacing:
    """The save ``policy`` of one manager, agreed over ``process_group`` where it must be."""

    def __init__(self, policy: SavePolicy, process_group: Any = None) -> None:
        self.policy = policy
        self._group = process_group if agreed(policy) else None
        self._asked: tuple[int, bool] | None = None  # should_save's answer, for save(step)

    def should_save(self, step: int, last_saved: int | None) -> bool:
        """Whether ``save(step)`` would write; the next ``save(step)`` reuses this answer."""
        answer = self._ask(step, last_saved)
        self._asked = (step, answer)
        return answer

    def decide(self, step: int, last_saved: int | None, force: bool) -> bool:
        """Whether ``save(step)`` writes (step 1 of a managed save)."""
        asked, self._asked = self._asked, None
        if asked is not None and asked[0] == step:
            return force or asked[1]
        if force and self._group is None:
            return True
        answer = self._ask(step, last_saved)  # (with a group every rank asks, forced or not)
        return force or answer

    def _ask(self, step: int, last_saved: int | None) -> bool:
        answer = bool(self.policy.should_save(step, last_saved))
        if self._group is not None:
            answer = max_over_ranks(self._group, [0 if answer else 1])[0] == 0
        return answer

    def started(self, step: int) -> None:
        _tell(self.policy, "started", step)

    def durable(self, step: int) -> None:
        _tell(self.policy, "durable", step)

    def failed(self, step: int) -> None:
        _tell(self.policy, "failed", step)

    def achieved(self) -> dict[str, Any] | None:
        return achieved(self.policy)


def _tell(policy: Any, event: str, step: int) -> None:
    hook = getattr(policy, event, None)
    if callable(hook):
        hook(step)
