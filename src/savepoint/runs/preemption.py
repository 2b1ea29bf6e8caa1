"""Preemption notices: signal handlers that only set a flag, a cheap poll, and (with a process
group) one answer for every rank.

Schedulers warn before they take a job's machines: Kubernetes sends SIGTERM and waits
``terminationGracePeriodSeconds`` (30 s by default), spot instances give about two minutes,
SLURM sends the signal ``--signal`` names (often SIGUSR1) a configurable time before the end.
:class:`Preemption` installs handlers for those signals (SIGTERM and SIGUSR1 by default) that do
nothing but record the notice: no I/O, no locks, nothing that could deadlock inside a handler.
A handler that was installed before (a Python callable) is still called after the flag is set;
the default action of the signal (terminating the process) is not, since stopping cleanly is the
point. :meth:`Preemption.close` puts the previous handlers back.

:meth:`Preemption.requested` is a memory read: poll it anywhere (data loading, evaluation,
warm-up). :meth:`Preemption.poll` is what a distributed loop calls at the same points on every
rank: with a process group it runs one all-reduce (MAX of the ranks' flags, on the group given;
gloo and NCCL both work) every ``every`` calls and returns the agreed answer, so the ranks stop at
the same step even when the signal reached them at different moments, and one rank never leaves
alone. Like any collective, every rank must make the same number of ``poll`` calls.

In a process forked after the handlers were installed (a data-loader worker, say) a notice is
not this job's: the handler puts the previous disposition back and lets the signal act as it
would have (a worker told to stop by its parent stops).

:class:`PreemptionSave` is what ``CheckpointManager.save_on_preemption`` returns (see
``docs/runs.md``, "Preemption"): the step committed, where, how long it took against the grace
budget, and ``exit_code``, the status to leave with (``128 + signal``, as a shell reports a
process the signal ended: 143 for SIGTERM).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
from collections.abc import Iterable, Sequence
from types import FrameType
from typing import Any, Literal

__all__ = [
    "DEFAULT_GRACE",
    "DEFAULT_SIGNALS",
    "Preemption",
    "PreemptionSave",
    "max_over_ranks",
    "signals_of",
]

# Seconds save_on_preemption aims to commit within, counted from the notice: Kubernetes' default
# terminationGracePeriodSeconds (30 s) less a margin for the exit itself.
DEFAULT_GRACE = 25.0

DEFAULT_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGUSR1)


def signals_of(spec: bool | Iterable[int | str | signal.Signals]) -> tuple[signal.Signals, ...]:
    """The signals a ``preemption=`` argument names: True for the defaults, or signals given as
    numbers, names (``"SIGTERM"``, ``"USR1"``) or ``signal.Signals``."""
    if spec is True:
        return DEFAULT_SIGNALS
    if spec is False or isinstance(spec, (str, bytes, int)):
        raise TypeError(
            "preemption must be True or a list of signals (numbers, names such as 'SIGTERM', "
            f"or signal.Signals), not {spec!r}"
        )
    found: list[signal.Signals] = []
    for item in spec:
        try:
            if isinstance(item, str):
                name = item.upper()
                sig = signal.Signals[name if name.startswith("SIG") else "SIG" + name]
            else:
                sig = signal.Signals(item)
        except (KeyError, ValueError):
            raise ValueError(f"preemption: {item!r} is not a signal") from None
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            raise ValueError(f"preemption: {sig.name} cannot be caught")
        if sig not in found:
            found.append(sig)
    if not found:
        raise ValueError("preemption: no signal given")
    return tuple(found)


def max_over_ranks(process_group: Any, values: Sequence[int]) -> list[int]:
    """The element-wise maximum of ``values`` over the ranks of ``process_group`` (True: the
    default group): one all-reduce on that group, which every rank must call (a CUDA tensor for
    NCCL, a CPU one otherwise); ``values`` as they are without a process group."""
    if process_group is None:
        return list(values)
    import torch
    import torch.distributed as dist

    group = None if process_group is True else process_group
    device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    t = torch.tensor(list(values), dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return [int(v) for v in t.tolist()]


class Preemption:
    """Flag-setting handlers for ``signals`` (see the module docstring). ``process_group``:
    :meth:`poll` agrees across its ranks, with an all-reduce every ``every`` polls."""

    def __init__(
        self,
        signals: Iterable[int | str | signal.Signals] | bool = True,
        *,
        process_group: Any = None,
        every: int = 1,
    ) -> None:
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ValueError(f"every must be a positive integer, got {every!r}")
        self.signals = signals_of(signals)
        self.process_group = process_group
        self.every = every
        self.signum: int | None = None  # the first signal received
        self.received_at: float | None = None  # time.monotonic() of the first signal
        self.count = 0  # signals received (a second one during a save changes nothing)
        self._pid = os.getpid()
        self._flag = False
        self._agreed = False
        self._polls = 0
        self._previous: dict[signal.Signals, Any] = {}
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                "preemption handlers can only be installed from the main thread (Python runs "
                "signal handlers there): create the CheckpointManager in the main thread"
            )
        try:
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        except BaseException:
            self.close()
            raise

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        previous = self._previous.get(signal.Signals(signum))
        if os.getpid() != self._pid:
            # A forked child (a data-loader worker): the notice is not ours to keep. The
            # previous disposition acts, as if these handlers had never been installed.
            if callable(previous):
                previous(signum, frame)
                return
            signal.signal(signum, signal.SIG_DFL if previous is None else previous)
            os.kill(os.getpid(), signum)
            return
        self.count += 1
        if not self._flag:
            self.signum = signum
            self.received_at = time.monotonic()
            self._flag = True
        if callable(previous):
            previous(signum, frame)

    def requested(self) -> bool:
        """Whether a notice reached *this* process (no communication)."""
        return self._flag

    def request(self) -> None:
        """Act as if a notice had arrived (tests; a job's own reasons to stop)."""
        if not self._flag:
            self.received_at = time.monotonic()
            self._flag = True

    def poll(self) -> bool:
        """Whether to stop: this process's flag, or with a process group the ranks' agreed
        answer (sticky once True; an all-reduce every ``every`` calls, on every rank)."""
        if self.process_group is None:
            return self._flag
        if self._agreed:
            return True
        self._polls += 1
        if self._polls % self.every:
            return False
        (agreed,) = max_over_ranks(self.process_group, [1 if self._flag else 0])
        self._agreed = bool(agreed)
        return self._agreed

    def elapsed(self) -> float:
        """Seconds since the first notice (0 without one)."""
        return 0.0 if self.received_at is None else time.monotonic() - self.received_at

    def close(self) -> bool:
        """Put back the handlers that were there before (idempotent). Only the main thread can:
        from another thread the flag-only handlers stay installed (harmless) and this returns
        False. A handler someone installed over ours is left alone (it may chain to ours)."""
        if not self._previous:
            return True
        if threading.current_thread() is not threading.main_thread():
            return False
        previous, self._previous = self._previous, {}
        for sig, handler in previous.items():
            if handler is not None and signal.getsignal(sig) == self._handle:
                signal.signal(sig, handler)
        return True

    def __enter__(self) -> Preemption:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclasses.dataclass(frozen=True)
class PreemptionSave:
    """What ``CheckpointManager.save_on_preemption`` did; leave with ``sys.exit(r.exit_code)``.

    ``step``, ``path``: the checkpoint the run resumes from (committed and synced, named by
    ``report.json``). ``saved``: False when that step was committed already (by the save in
    flight, or an earlier save) and nothing new was written. ``seconds``: the time spent in
    ``save_on_preemption``; ``since_notice``: from the notice to the commit (None: no signal
    reached any rank); ``budget``: the grace budget in seconds, counted from the notice (from the
    call without one); ``within_budget``: whether the commit came within it. ``signum``: the
    signal received (agreed over the ranks: the highest number any rank got), None without one.
    ``exit_code``: ``128 + signum`` (143 for SIGTERM, 138 for SIGUSR1), the status a shell reports
    for a process the signal ended, so schedulers treat the exit as the preemption it is (see
    docs/runs.md for Kubernetes' podFailurePolicy and SLURM's requeue); 0 without a signal.
    ``in_flight``: what happened to the async save that was writing ("none", "finished",
    "abandoned": stopped before its commit and not part of the run, "failed": it failed on its
    own), and ``in_flight_step`` its step. ``deferred``: what was left for the next run (retention,
    verification, deletions). ``errors``: failures that did not stop the save (a background save
    that failed, a verification failure found earlier, a sync of the books), also logged.
    ``copied_to``: with tiers, the tier the step was copied to within the budget (the first
    tier: the run directory may be a RAM disk that does not outlive the machine), else empty."""

    step: int
    path: str
    saved: bool
    seconds: float
    since_notice: float | None
    budget: float
    within_budget: bool
    signum: int | None
    exit_code: int
    in_flight: Literal["none", "finished", "abandoned", "failed"] = "none"
    in_flight_step: int | None = None
    deferred: tuple[str, ...] = ()
    errors: tuple[str, ...] = ()
    copied_to: tuple[str, ...] = ()

    @property
    def signal_name(self) -> str | None:
        """``"SIGTERM"``..., None without a signal."""
        if self.signum is None:
            return None
        try:
            return signal.Signals(self.signum).name
        except ValueError:
            return str(self.signum)
