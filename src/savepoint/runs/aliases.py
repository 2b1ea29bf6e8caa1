"""``latest/`` and ``best/``: copies of checkpoints that must agree with ``report.json``.

An alias is an ordinary checkpoint directory whose files are hard links to one step's files
(:func:`savepoint.commit.atomic.link_tree`). It *agrees* with the report when it is absent, or
when it holds exactly the checkpoint the report names (``latest_step``, ``best.step``): the same
``manifest.json`` (the same inode, or the same bytes where the filesystem had no hard links), and
the manifest holds every tensor's checksum, so the same manifest means the same checkpoint.

The manager changes an alias only by :func:`stage` (link the files under a hidden temporary name:
the only step that needs free space) and :func:`commit` (one atomic exchange), or :func:`remove`
(atomic rename away, then delete), so a reader of ``run/best`` sees the old checkpoint or the new
one, never a mixture. :func:`disagreements` and :func:`run_problems` are what ``savepoint ls``
and ``savepoint verify RUN`` report.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterable

from savepoint import checkpoint
from savepoint.codecs import manifest as mf
from savepoint.commit import atomic
from savepoint.errors import CheckpointError
from savepoint.runs import layout
from savepoint.runs.report import Report

NAMES = (layout.LATEST, layout.BEST)


def path_of(directory: str, alias: str) -> str:
    return os.path.join(directory, alias)


def targets(report: Report) -> dict[str, int | None]:
    """The step each alias must hold according to ``report`` (None: the alias must be absent)."""
    best = (report.best or {}).get("step")
    return {
        layout.LATEST: report.latest_step,
        layout.BEST: best if isinstance(best, int) and not isinstance(best, bool) else None,
    }


def holds(directory: str, alias: str, step: int) -> bool:
    """Whether ``alias`` is a copy of checkpoint ``step`` (False if either is missing)."""
    mine = os.path.join(path_of(directory, alias), mf.NAME)
    theirs = os.path.join(layout.step_path(directory, step), mf.NAME)
    try:
        a, b = os.stat(mine), os.stat(theirs)
    except OSError:
        return False
    if not (stat.S_ISREG(a.st_mode) and stat.S_ISREG(b.st_mode)):
        return False  # never open a FIFO (it would block) or a device
    if (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino):
        return True
    if a.st_size != b.st_size:
        return False
    try:
        with open(mine, "rb") as fa, open(theirs, "rb") as fb:
            while True:
                x, y = fa.read(1 << 20), fb.read(1 << 20)
                if x != y:
                    return False
                if not x:
                    return True
    except OSError:
        return False


def recorded_step(directory: str, alias: str) -> int | None:
    """The step an alias's checkpoint says it was saved as (its manifest metadata), or None."""
    with contextlib.suppress(CheckpointError, OSError):
        meta = checkpoint.inspect(path_of(directory, alias)).metadata.get("savepoint_run")
        step = meta.get("step") if isinstance(meta, dict) else None
        if isinstance(step, int) and not isinstance(step, bool):
            return step
    return None


def stage(directory: str, alias: str, step: int) -> str:
    """Hard-link checkpoint ``step`` under a hidden temporary name next to ``alias``; returns it.
    Nothing visible changes; on failure nothing is left behind."""
    staging = atomic.staging_path(path_of(directory, alias))
    try:
        atomic.link_tree(layout.step_path(directory, step), staging)
    except BaseException:
        with contextlib.suppress(OSError):
            atomic.remove_tree(staging)
        raise
    return staging


def commit(directory: str, alias: str, staging: str) -> None:
    """Make a staged copy the alias, atomically (see :func:`savepoint.commit.atomic.commit`)."""
    try:
        atomic.commit(staging, path_of(directory, alias))
    except BaseException:
        with contextlib.suppress(OSError):
            atomic.remove_tree(staging)
        raise


def publish(directory: str, alias: str, step: int) -> None:
    commit(directory, alias, stage(directory, alias, step))


def remove(directory: str, alias: str) -> None:
    """Remove an alias: renamed away first (atomic), then deleted."""
    atomic.discard(path_of(directory, alias))


def _steps(steps: Iterable[int]) -> str:
    items = sorted(steps)
    return ("step " if len(items) == 1 else "steps ") + ", ".join(map(str, items))


def disagreements(directory: str, report: Report) -> list[str]:
    """How ``latest/`` and ``best/`` disagree with ``report`` (empty when they agree)."""
    problems = []
    for alias, step in targets(report).items():
        if not os.path.lexists(path_of(directory, alias)):
            continue  # aliases are optional (aliases=False); a missing one misleads nobody
        if step is not None and holds(directory, alias, step):
            continue
        held = recorded_step(directory, alias)
        what = f"a copy of step {held}" if held is not None else "not a copy of any step"
        if step is None:
            problems.append(
                f"{alias}/ is {what}, but report.json has no {alias} checkpoint: it should not exist"
            )
        elif not os.path.isdir(layout.step_path(directory, step)):
            problems.append(
                f"{alias}/ is {what}, and report.json's {alias} checkpoint (step {step}) is not "
                "on disk"
            )
        else:
            problems.append(f"{alias}/ is {what}, but report.json says step {step}")
    return problems


def run_problems(directory: str, report: Report, steps: list[int]) -> list[str]:
    """Every disagreement between ``report``, the committed ``steps`` and the aliases.

    Opening the run with a (writable) ``CheckpointManager`` repairs each of them: it finishes
    deletions, lists checkpoints an interrupted save committed, and republishes the aliases."""
    problems = disagreements(directory, report)
    pending = set(report.discarding) - set(report.checkpoints)
    on_disk = set(steps) - pending
    listed = set(report.checkpoints)
    if on_disk - listed:
        problems.append(
            f"{_steps(on_disk - listed)} committed but not listed in report.json (a save "
            "interrupted after its commit)"
        )
    if listed - on_disk:
        problems.append(f"report.json lists {_steps(listed - on_disk)}, not on disk")
    if pending & set(steps):
        problems.append(
            f"{_steps(pending & set(steps))} left to delete by an interrupted save (retention "
            "or an abandoned timeline); readers ignore them"
        )
    newest = max(on_disk) if on_disk else None
    if report.latest_step != newest and not (on_disk - listed or listed - on_disk):
        problems.append(
            f"report.json says the latest step is {report.latest_step}, the newest checkpoint "
            f"is {newest}"
        )
    return problems
