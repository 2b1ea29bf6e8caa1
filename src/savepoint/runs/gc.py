"""Garbage collection: what failed or interrupted saves left in a run, removed once no reader
can be using it.

A save that is killed (or fails where its own cleanup cannot run) leaves no damage, only
leftovers that no reader looks at (:mod:`savepoint.commit`); the next save to the same path
tidies most of them. :func:`collect` removes the rest, on any store, and
:meth:`savepoint.CheckpointManager.gc` does the same while holding the run's writer lock:

- **generations without a manifest** (manifest-last commits, object stores): an attempt that
  never reached its commit point, older than ``grace`` seconds (the time is in the generation's
  name, :func:`savepoint.commit.names.generation`, taken from the writer's clock);
- **superseded generations**: older committed generations of a checkpoint whose newest
  committed generation replaced them (a crash between the manifest put and the tidy), and the
  files of a flat checkpoint a generation replaced, older than ``grace``;
- **history segments covered by a compacted one** (object stores: a compaction cut short
  between putting the merged segment and deleting its parts, :mod:`savepoint.runs.history`),
  older than ``grace``;
- **step directories holding nothing committed** (``checkpoints/step-N`` whose save died before
  its first commit), when nothing in them is younger than ``grace``; one that ``report.json``
  lists is never removed (it is reported, for inspection);
- **hidden temporaries** of the rename strategy (``.<name>.savepoint-tmp-<host>-<pid>-...`` and
  ``-old-``): those of dead processes of this host at once (the rule of
  :func:`savepoint.commit._rename.clean_stale`: a live process's are never touched), those of
  other hosts once nothing in them changed for ``grace`` seconds; an ``-old-`` copy is removed
  only while its target holds a committed checkpoint (else it is the only copy, which readers
  load);
- **open multipart uploads** (S3) under the run's prefix, initiated more than ``grace`` seconds
  ago and, for an upload into a generation, of an attempt started more than ``grace`` seconds ago
  (:mod:`savepoint.storage.uploads`; without boto3 the report says they were not checked).

Never removed: a committed checkpoint (the newest committed generation of every checkpoint, and
every checkpoint ``report.json`` lists or names as latest or best, or that an alias points at,
or whose deletion is pending), ``run.json``, ``report.json``, the history log (``history.jsonl``
and every segment no other covers), the writer lock, the aliases, and anything younger than
``grace``. Each removal is a whole directory (or blob) that no reader
resolves to, so a reader never sees a checkpoint change; a committed generation loses its
manifest first, so a removal cut short leaves nothing that reads as a checkpoint.

:func:`collect` also takes a single checkpoint path (``sp.save``'s target): then its generations
and its hidden siblings are collected. Collecting a run takes the run's writer lock (a lease
object on object stores; RunLockedError while a manager writes the run: call that manager's
``gc``). ``grace`` is what keeps the attempt of a writer outside the lock safe (an ``sp.save``
to the same path, a store with no lock at all): it must be longer than any save takes (the
default is one hour). ``dry_run`` removes nothing, takes no lock, and reports what would be
removed.

The parts: this module is the entry (:func:`collect`: what the path is, the writer lock) and
re-exports the report's records (:mod:`savepoint.runs._gc_report`); one collection's walk and its
rules for each thing found are :class:`savepoint.runs._sweep.Sweep`, the open multipart uploads
:mod:`savepoint.runs._gc_uploads`. The blob store's own collection (blobs no kept checkpoint
names) is :mod:`savepoint.blobs.gc`, which ``CheckpointManager.gc`` runs after this one.
"""

from __future__ import annotations

import logging
import math

from savepoint import errors_map
from savepoint.commit import names
from savepoint.commit.transaction import resolve as resolve_commit
from savepoint.errors import (
    CheckpointError,
    CheckpointNotFoundError,
)
from savepoint.runs._gc_report import AbortedUpload, GcReport, Removed, Skipped
from savepoint.runs._gc_uploads import abort_uploads
from savepoint.runs._sweep import TAGS, Sweep
from savepoint.runs.lock import WriterLock
from savepoint.runs.report import REPORT_FILE, RUN_FILE
from savepoint.storage.paths import Location, PathArg, resolve

__all__ = ["AbortedUpload", "GcReport", "Removed", "Skipped", "collect"]

log = logging.getLogger(__name__)


def collect(
    directory: PathArg, *, grace: float = 3600.0, dry_run: bool = False, lock: bool = True
) -> GcReport:
    """Remove what failed or interrupted saves left in the run (or checkpoint) at ``directory``
    and no reader can be using (see the module docstring); returns what was done.

    ``grace``: seconds; nothing younger is removed. ``dry_run``: remove nothing, report what
    would be removed. ``lock``: take the run's writer lock where the store has one (False: the
    caller holds it, as ``CheckpointManager.gc`` does). Raises CheckpointNotFoundError when
    ``directory`` is neither a run nor a checkpoint, RunLockedError when a manager writes the run,
    CheckpointWriteError when the lock cannot be taken; a leftover that cannot be removed is
    listed in ``failures``, not raised."""
    if isinstance(grace, bool) or not isinstance(grace, (int, float)):
        raise TypeError(f"grace must be a number of seconds, not {type(grace).__name__}")
    if not math.isfinite(grace) or grace < 0:
        raise ValueError(f"grace must be a non-negative number of seconds, not {grace!r}")
    for flag, value in (("dry_run", dry_run), ("lock", lock)):
        if not isinstance(value, bool):
            raise TypeError(f"{flag} must be a bool, not {type(value).__name__} ({value!r})")
    where = resolve(directory, what="run directory")
    run = _is_run(where)
    if not run and not _is_checkpoint(where):
        raise CheckpointNotFoundError(
            f"{where} is neither a savepoint run directory (no run.json or report.json) nor a "
            "checkpoint: nothing to collect",
            path=str(where),
        )
    sweep = Sweep(where, float(grace), dry_run)
    writer = None
    if run and lock and not dry_run:
        writer = _take_lock(where)
        if writer is None:
            sweep.notes.append(
                f"{where.store.scheme}:// storage has no locks: only the grace period keeps a "
                "live writer's attempt safe"
            )
    log.info(
        "gc: collecting %s (grace %g s%s)", where, float(grace), ", dry run" if dry_run else ""
    )
    try:
        if run:
            sweep.run()
        else:
            sweep.checkpoint(where.path, listed=False)
            sweep.siblings(where.path)
        abort_uploads(sweep)
    finally:
        if writer is not None:
            writer.release()
    return sweep.report()


def _is_run(where: Location) -> bool:
    """Whether a run's files are at ``where``; a store that cannot be looked at (no such
    bucket, a refused credential) is that error, not "no run"."""
    store = where.store
    try:
        return any(
            (st := store.stat(store.join(where.path, name))) is not None and st.kind == "file"
            for name in (RUN_FILE, REPORT_FILE)
        )
    except OSError as exc:
        raise errors_map.read_error(exc, str(where), head=f"cannot look at {where}") from exc


def _is_checkpoint(where: Location) -> bool:
    """A committed checkpoint, a directory of generations, or an absent path with hidden
    siblings (a first save that died). A lookup that fails is CheckpointError, not "no"."""
    store = where.store
    try:
        if resolve_commit(store, where.path, strict=False) is not None:
            return True
        st = store.stat(where.path)
        if st is not None:
            entries = store.list(where.path) if st.kind == "dir" else []
            return bool(entries) and all(names.is_generation(e) for e in entries)
        return any(names.siblings(store, where.path, tag) for tag in TAGS)
    except OSError as exc:
        raise errors_map.read_error(
            exc, str(where), head=f"cannot look at {where}", tail="; nothing was removed"
        ) from exc


def _take_lock(run: Location) -> WriterLock | None:
    """The run's writer lock, or None where the store has none."""
    try:
        return WriterLock.acquire(run)
    except NotImplementedError:
        return None
    except CheckpointError:
        raise
    except OSError as exc:
        raise errors_map.write_error(
            exc,
            str(run),
            f"cannot collect garbage in {run}: its writer lock cannot be taken",
            tail="; nothing was removed",
            scheme=run.store.scheme,
        ) from exc
