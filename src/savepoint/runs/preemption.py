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
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterable
from types import FrameType
from typing import Any

__all__ = ["DEFAULT_SIGNALS", "Preemption", "signals_of"]

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
        if not self._flag:
            self.signum = signum
            self.received_at = time.monotonic()
            self._flag = True
        previous = self._previous.get(signal.Signals(signum))
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
        import torch
        import torch.distributed as dist

        group = None if self.process_group is True else self.process_group
        backend = dist.get_backend(group)
        device = "cuda" if backend == "nccl" else "cpu"
        flag = torch.tensor([1 if self._flag else 0], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        self._agreed = bool(flag.item())
        return self._agreed

    def elapsed(self) -> float:
        """Seconds since the first notice (0 without one)."""
        return 0.0 if self.received_at is None else time.monotonic() - self.received_at

    def close(self) -> None:
        """Put back the handlers that were there before (idempotent; main thread)."""
        previous, self._previous = self._previous, {}
        for sig, handler in previous.items():
            if handler is not None:
                signal.signal(sig, handler)

    def __enter__(self) -> Preemption:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
