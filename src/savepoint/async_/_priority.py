"""How much the writer process of ``AsyncCheckpointer(writer="process")`` yields to its trainer:
its CPU and I/O priority (``writer_priority=``, or ``SAVEPOINT_WRITER_PRIORITY`` where not given).

- ``"normal"``: the trainer's own priorities;
- ``"low"``: niced (``SAVEPOINT_WRITER_NICE``, default :data:`NICE`) and the lowest best-effort
  I/O level: a loop that keeps every core busy still lets the writer run a share of the time;
- ``"idle"``: ``SCHED_IDLE`` (the writer runs only on a core nothing else wants) and the idle I/O
  class (its requests are served when no other process has any queued, where the kernel's I/O
  scheduler arbitrates: ``mq-deadline`` and ``bfq`` do, ``none`` does not).

A lower priority only matters while something else wants the same core or disk: with the
trainer waiting on a GPU, the writer gets an idle core at once whatever its priority, and a save
becomes durable as fast as at ``"normal"``. While the trainer keeps every core busy it costs the
save its time to durable, not its correctness: the save still commits (a trainer that never
leaves a core idle delays an ``"idle"`` writer most). The choice of the default is measured in
``docs/performance.md`` (issue 27).

Applied by the writer process to itself when it starts, before any thread of it exists (Linux
applies nice, the scheduling policy and the I/O priority per thread; threads made later inherit
them). Best effort: a platform without the call keeps the trainer's priority.
"""

from __future__ import annotations

import contextlib
import ctypes
import difflib
import os
import platform
from typing import Literal

from savepoint.errors import CheckpointArgumentError

__all__ = [
    "DEFAULT",
    "NICE",
    "PRIORITIES",
    "Priority",
    "apply",
    "check",
    "check_writer",
    "current_ioprio",
    "resolve",
]

Priority = Literal["normal", "low", "idle"]
PRIORITIES: tuple[Priority, ...] = ("normal", "low", "idle")
DEFAULT: Priority = "low"
NICE = 10  # how much lower a "low" writer's CPU priority is than its trainer's

_IOPRIO_WHO_PROCESS = 1
_IOPRIO_CLASS_SHIFT = 13
_IOPRIO_CLASS_BE, _IOPRIO_CLASS_IDLE = 2, 3
# ioprio_set's syscall number (it has no libc wrapper): by machine, Linux only.
_IOPRIO_SET = {"x86_64": 251, "aarch64": 30, "arm64": 30, "ppc64le": 273, "s390x": 282}


def check(priority: object) -> Priority:
    """``writer_priority=`` checked: one of :data:`PRIORITIES` (else a
    :class:`CheckpointArgumentError`, a ValueError, naming the nearest)."""
    if priority not in PRIORITIES:
        raise CheckpointArgumentError(
            f"writer_priority must be one of {', '.join(PRIORITIES)}, not {priority!r}"
            + _nearest(priority, PRIORITIES)
        )
    return priority


def check_writer(writer: object) -> None:
    """``writer=`` checked: None, "thread" or "process" (else a :class:`CheckpointArgumentError`,
    a ValueError, naming the nearest: ``writer="proces"``)."""
    if writer is not None and writer not in ("thread", "process"):
        raise CheckpointArgumentError(
            f"writer must be 'thread' or 'process', not {writer!r}"
            + _nearest(writer, ("thread", "process"))
        )


def _nearest(given: object, choices: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(given, choices, n=1) if isinstance(given, str) else []
    return f" (did you mean {close[0]!r}?)" if close else ""


def resolve(priority: Priority | None) -> Priority:
    """The priority to use: the one given, else ``SAVEPOINT_WRITER_PRIORITY``, else
    :data:`DEFAULT` (an unknown value in the environment is refused as one given would be)."""
    if priority is not None:
        return check(priority)
    raw = os.environ.get("SAVEPOINT_WRITER_PRIORITY", "")
    if raw and raw not in PRIORITIES:  # (named: the caller gave no writer_priority=)
        raise CheckpointArgumentError(
            "SAVEPOINT_WRITER_PRIORITY (the writer_priority where none is given) must be one "
            f"of {', '.join(PRIORITIES)}, not {raw!r}" + _nearest(raw, PRIORITIES)
        )
    return check(raw) if raw else DEFAULT


def apply(priority: str) -> None:
    """Lower the calling thread's (and the threads it makes later) CPU and I/O priority as
    ``priority`` says (see the module docstring); ``"normal"`` changes nothing."""
    if priority == "low":
        raw = os.environ.get("SAVEPOINT_WRITER_NICE", "")
        try:
            amount = int(raw) if raw else NICE
        except ValueError:
            amount = NICE
        _nice(amount)
        _ioprio(_IOPRIO_CLASS_BE, 7)
    elif priority == "idle":
        _nice(19)  # where SCHED_IDLE is refused, the lowest ordinary priority
        if hasattr(os, "sched_setscheduler") and hasattr(os, "SCHED_IDLE"):
            with contextlib.suppress(OSError):
                os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        _ioprio(_IOPRIO_CLASS_IDLE, 0)


def _nice(amount: int) -> None:
    if amount > 0 and hasattr(os, "nice"):
        with contextlib.suppress(OSError):
            os.nice(min(amount, 19))


def _ioprio(klass: int, level: int) -> None:
    number = _IOPRIO_SET.get(platform.machine())
    if number is None or platform.system() != "Linux":
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        value = (klass << _IOPRIO_CLASS_SHIFT) | level
        libc.syscall(number, _IOPRIO_WHO_PROCESS, 0, value)


def current_ioprio(pid: int = 0) -> tuple[int, int] | None:
    """(class, level) of ``pid``'s I/O priority (0: this thread), None where unknown: for tests."""
    number = {"x86_64": 252, "aarch64": 31, "arm64": 31}.get(platform.machine())
    if number is None or platform.system() != "Linux":
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    value = int(libc.syscall(number, _IOPRIO_WHO_PROCESS, pid))
    if value < 0:
        return None
    return value >> _IOPRIO_CLASS_SHIFT, value & ((1 << _IOPRIO_CLASS_SHIFT) - 1)
