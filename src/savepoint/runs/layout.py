"""Where things live in a run directory.

::

    run/
      run.json                 what the run is (name, variant, config, parameter count)
      report.json              what it is now (checkpoints, best, lineage), replaced at each save
      history.jsonl            what it did step by step (loss, metrics), appended to
                               (on object stores: history/<first>-<last>.jsonl segments;
                               :mod:`savepoint.runs.history`)
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

import contextlib
import errno
import os
import re
from collections.abc import Iterable

from savepoint.commit import names
from savepoint.commit.transaction import resolve as resolve_commit
from savepoint.errors import CheckpointPermissionError, CorruptCheckpointError
from savepoint.storage import local
from savepoint.storage.base import Store
from savepoint.storage.paths import Location, PathArg, resolve

__all__ = [
    "BEST",
    "CHECKPOINTS",
    "LATEST",
    "checkpoint_arg",
    "clean_stale_in",
    "committed",
    "committed_steps",
    "is_dir",
    "is_run",
    "lost_run_file",
    "step_location",
    "step_name",
    "step_path",
]

CHECKPOINTS = "checkpoints"
LATEST = "latest"
BEST = "best"
_STEP_DIR = re.compile(r"step-(\d{10,})")


def step_name(step: int) -> str:
    if step < 0:
        raise ValueError(f"steps are non-negative integers, not {step}")
    return f"step-{step:010d}"


def step_location(run: Location, step: int) -> Location:
    return run.join(CHECKPOINTS, step_name(step))


def step_path(directory: PathArg, step: int) -> str:
    """Checkpoint ``step`` of the run at ``directory``, as messages and ``sp.load`` name it (a
    plain path on the local disk, a URL elsewhere)."""
    return str(step_location(resolve(directory, what="run directory"), step))


def checkpoint_arg(where: Location) -> str | Location:
    """``where`` as the path argument of ``sp.save``/``load``/...: a plain path on the local
    filesystem store (what callers and their hooks have always been given), the Location itself
    on any other store (so a store given by hand, a fault-injecting one say, is the one used)."""
    return where.path if where.store is local.STORE else where


def committed(where: Location) -> bool:
    """Whether ``where`` holds a committed checkpoint (its manifest, in either commit layout).
    A lookup that fails raises CheckpointError (``transaction.resolve``): never False for a
    checkpoint that could not be looked at."""
    return resolve_commit(where.store, where.path, strict=False) is not None


def committed_steps(directory: PathArg, expected: Iterable[int] = ()) -> list[int]:
    """Steps with a committed checkpoint (a manifest), ascending. Hidden temporaries are ignored.

    ``expected`` (the steps ``report.json`` lists) are not taken on the listing's word: one the
    listing lacks is looked up directly (its own prefix, its manifest), so an empty or partial
    listing (a paginated listing cut short, an eventually consistent store) never makes a
    committed checkpoint look gone.

    An unlistable ``checkpoints/`` is CheckpointPermissionError (EACCES/EPERM) or
    CorruptCheckpointError (not a directory, or any other failure); a missing one has no steps.
    A step directory whose commit cannot be looked at (a failed request, an I/O error) raises
    CheckpointError naming it: a step is never left out because a read failed (the run's
    writer would record, alias and prune by that partial view, and a blob collection would
    delete the blobs of the checkpoint left out)."""
    run = resolve(directory, what="run directory")
    root = run.join(CHECKPOINTS)
    store = root.store
    try:
        # Followed if it is a symlink (checkpoints kept on another disk).
        found = store.stat(store.realpath(root.path))
        entries = store.list(root.path) if found is None or found.kind == "dir" else None
    except PermissionError as exc:
        raise CheckpointPermissionError(
            f"{root}: permission denied; make it readable by this user and try again",
            path=str(root),
            errno=exc.errno,
        ) from None
    except OSError as exc:
        raise CorruptCheckpointError(
            f"cannot list {root}: {exc.strerror or exc}", path=str(root)
        ) from None
    if entries is None:
        raise CorruptCheckpointError(
            f"cannot list {root}: {os.strerror(errno.ENOTDIR)}: the run keeps its checkpoints in "
            "that directory; move what is there out of the way",
            path=str(root),
        )
    steps = []
    for entry in entries:
        m = _STEP_DIR.fullmatch(entry)
        if m and committed(root.join(entry)):
            steps.append(int(m.group(1)))
    listed = set(steps)
    steps += [s for s in set(expected) - listed if committed(step_location(run, s))]
    return sorted(steps)


def is_run(directory: PathArg) -> bool:
    return _is_file(resolve(directory, what="run directory").join("run.json"))


def lost_run_file(directory: PathArg) -> bool:
    """A run directory whose ``run.json`` is gone but whose ``report.json`` (which records the
    same identity) is still there: a manager that opens it rebuilds ``run.json``."""
    run = resolve(directory, what="run directory")
    return run.store.stat(run.join("run.json").path) is None and _is_file(run.join("report.json"))


def is_dir(where: Location) -> bool:
    """Whether a directory is at ``where``, following a symlink (as ``os.path.isdir``)."""
    return _kind(where) == "dir"


def _is_file(where: Location) -> bool:
    """Whether a regular file is at ``where``, following a symlink (as ``os.path.isfile``)."""
    return _kind(where) == "file"


def _kind(where: Location) -> str | None:
    store = where.store
    try:
        found = store.stat(store.realpath(where.path))
    except OSError:
        return None
    return None if found is None else found.kind


def clean_stale_in(store: Store, parent: str) -> None:
    """Remove every hidden savepoint temporary in the directory ``parent`` that a dead process of
    this host left (an interrupted save, deletion, alias update or backup: the names of
    :mod:`savepoint.commit.names`); best effort. A live process's temporaries, and another
    host's on a shared filesystem, are never touched."""
    tag = names.TMP_TAG
    for entry in store.list(parent):
        if entry.startswith(".") and tag in entry and names.dead_here(entry.rsplit(tag, 1)[1]):
            with contextlib.suppress(OSError):  # tidying is best effort; the next open retries
                store.remove_tree(store.join(parent, entry))
