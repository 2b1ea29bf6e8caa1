"""Where things live in a run directory.

::

    run/
      run.json                 what the run is (name, variant, config, parameter count)
      report.json              what it did (history, best, lineage), rewritten after every save
      checkpoints/
        step-0000000100/       one savepoint checkpoint per saved step (10-digit, zero padded)
        step-0000000200/
      latest/                  the newest checkpoint, as hard links (a loadable checkpoint)
      best/                    the best checkpoint by the run's metric, as hard links
      .writer.lock             flock'ed by the one CheckpointManager writing the run (runs.lock)

``latest`` and ``best`` are ordinary checkpoint directories whose files are hard links to the
step's files (copies where the filesystem has no hard links): ``sp.load("run/best")`` works on any
filesystem, without symlinks, and keeps working after retention deletes the step directory.
They always hold the checkpoints ``report.json`` names as latest and best (or are absent): a
manager that opens the run repairs any disagreement an interrupted save left (see
:mod:`savepoint.runs.aliases`).
"""

from __future__ import annotations

import errno
import os
import re

from savepoint.codecs import manifest as mf
from savepoint.errors import CheckpointPermissionError, CorruptCheckpointError

CHECKPOINTS = "checkpoints"
LATEST = "latest"
BEST = "best"
_STEP_DIR = re.compile(r"step-(\d{10,})")


def step_name(step: int) -> str:
    if step < 0:
        raise ValueError(f"steps are non-negative integers, not {step}")
    return f"step-{step:010d}"


def step_path(directory: str, step: int) -> str:
    return os.path.join(directory, CHECKPOINTS, step_name(step))


def committed_steps(directory: str) -> list[int]:
    """Steps with a committed checkpoint (a manifest), ascending. Hidden temporaries are ignored.

    An unlistable ``checkpoints/`` is CheckpointPermissionError (EACCES/EPERM) or
    CorruptCheckpointError (not a directory, or any other failure); a missing one has no steps."""
    root = os.path.join(directory, CHECKPOINTS)
    try:
        entries = os.listdir(root)
    except FileNotFoundError:
        return []
    except PermissionError as exc:
        raise CheckpointPermissionError(
            f"{root}: permission denied; make it readable by this user and try again",
            path=root,
            errno=exc.errno,
        ) from None
    except OSError as exc:
        hint = (
            ": the run keeps its checkpoints in that directory; move what is there out of the way"
            if exc.errno == errno.ENOTDIR
            else ""
        )
        raise CorruptCheckpointError(
            f"cannot list {root}: {exc.strerror or exc}{hint}", path=root
        ) from None
    steps = []
    for entry in entries:
        m = _STEP_DIR.fullmatch(entry)
        if m and os.path.isfile(os.path.join(root, entry, mf.NAME)):
            steps.append(int(m.group(1)))
    return sorted(steps)


def is_run(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, "run.json"))


def lost_run_file(directory: str) -> bool:
    """A run directory whose ``run.json`` is gone but whose ``report.json`` (which records the
    same identity) is still there: a manager that opens it rebuilds ``run.json``."""
    return not os.path.lexists(os.path.join(directory, "run.json")) and os.path.isfile(
        os.path.join(directory, "report.json")
    )
