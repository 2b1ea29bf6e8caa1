"""One garbage collection of a run or a checkpoint (:class:`Sweep`): the rules of
:mod:`savepoint.runs.gc` (its docstring says what is garbage and what is never removed) applied
to each thing found, what was removed, kept and aborted recorded for the report."""

from __future__ import annotations

import contextlib
import logging
import math
import re
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from savepoint.codecs import manifest as mf
from savepoint.commit import names, pointer
from savepoint.commit.transaction import resolve as resolve_commit
from savepoint.errors import CheckpointError
from savepoint.runs import history, layout
from savepoint.runs._gc_report import AbortedUpload, GcReport, Removed, Skipped
from savepoint.runs.report import load_report
from savepoint.storage.base import Store, walk
from savepoint.storage.paths import Location

__all__ = ["TAGS", "Sweep", "age_text", "generation_time"]

log = logging.getLogger("savepoint.runs.gc")  # the collection's one logger

_STEP_DIR = re.compile(r"step-(\d{10,})")
TAGS = (names.TMP_TAG, names.OLD_TAG)


def generation_time(name: str) -> float:
    """When a generation was started (seconds since the epoch), from its name."""
    stamp = name[len(names.GEN_PREFIX) : len(names.GEN_PREFIX) + 20]
    return int(stamp) / 1e9


def age_text(seconds: float) -> str:
    if seconds == math.inf:
        return "of unknown age"
    if seconds < 120:
        return f"{max(seconds, 0):.0f} s old"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min old"
    return f"{seconds / 3600:.1f} h old"


@dataclass
class Sweep:
    """One collection: what it found, removed and kept."""

    where: Location
    grace: float
    dry_run: bool
    now: float = field(default_factory=time.time)
    removed: list[Removed] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    failures: list[Skipped] = field(default_factory=list)
    aborted: list[AbortedUpload] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    uploads_checked: bool = False

    @property
    def store(self) -> Store:
        return self.where.store

    def url(self, path: str) -> str:
        return self.store.url(path)

    def report(self) -> GcReport:
        return GcReport(
            directory=str(self.where),
            grace=self.grace,
            dry_run=self.dry_run,
            removed=tuple(self.removed),
            aborted_uploads=tuple(self.aborted),
            skipped=tuple(self.skipped),
            failures=tuple(self.failures),
            uploads_checked=self.uploads_checked,
            notes=tuple(self.notes),
        )

    # -- looking -------------------------------------------------------------------------------

    def pointer(self, path: str) -> str | bool | None:
        """Where the alias pointer at ``path`` points (None: no pointer, or a damaged one);
        True where it cannot be read (recorded as a failure: nothing it may name is removed)."""
        try:
            return pointer.target(self.store, path)
        except (OSError, CheckpointError) as exc:
            self.failures.append(Skipped(self.url(path), f"cannot be looked at: {exc}"))
            return True

    def committed(self, path: str) -> bool | None:
        """Whether ``path`` holds a committed checkpoint; None where that cannot be looked at
        (recorded as a failure: then nothing there is removed)."""
        try:
            return resolve_commit(self.store, path, strict=False) is not None
        except CheckpointError as exc:
            self.failures.append(Skipped(self.url(path), f"cannot be looked at: {exc}"))
            return None

    # -- removing ------------------------------------------------------------------------------

    def skip(self, path: str, reason: str) -> None:
        log.debug("gc: keeping %s: %s", self.url(path), reason)
        self.skipped.append(Skipped(self.url(path), reason))

    def remove(self, path: str, reason: str, *, manifest_first: bool = False) -> bool:
        """Remove the directory or blob at ``path`` (unless a dry run); False if it failed."""
        store = self.store
        try:
            st = store.stat(path)
        except OSError as exc:
            self.failures.append(Skipped(self.url(path), f"{reason}; cannot be looked at: {exc}"))
            return False
        if st is None:
            return True  # gone meanwhile (a writer's own tidy)
        size = self._size(path, st.kind == "dir", st.size)
        if not self.dry_run:
            try:
                if st.kind == "dir":
                    if manifest_first:
                        # A removal cut short must not leave a committed generation without its
                        # data: the manifest goes first.
                        with contextlib.suppress(FileNotFoundError):
                            store.remove(store.join(path, mf.NAME))
                    store.remove_tree(path)
                else:
                    store.remove(path)
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.info("gc: cannot remove %s (%s): %s", self.url(path), reason, exc)
                self.failures.append(
                    Skipped(self.url(path), f"{reason}; removing it failed: {exc.strerror or exc}")
                )
                return False
        log.info(
            "gc: %s %s (%s bytes): %s",
            "would remove" if self.dry_run else "removed",
            self.url(path),
            "?" if size is None else size,
            reason,
        )
        self.removed.append(Removed(self.url(path), reason, size))
        return True

    def _size(self, path: str, is_dir: bool, size: int) -> int | None:
        if not is_dir:
            return size
        total = 0
        try:
            for blob in walk(self.store, path):
                st = self.store.stat(blob)
                total += st.size if st is not None and st.kind == "file" else 0
        except OSError:
            return None
        return total

    def _newest_change(self, path: str) -> float:
        """The newest modification time of ``path`` and everything in it (0: unknown)."""
        store = self.store
        newest = 0.0
        with contextlib.suppress(OSError):
            st = store.stat(path)
            if st is not None:
                newest = st.mtime
                if st.kind == "dir":
                    for blob in walk(store, path):
                        found = store.stat(blob)
                        if found is not None:
                            newest = max(newest, found.mtime)
        return newest

    def _age(self, path: str) -> float:
        changed = self._newest_change(path)
        return math.inf if changed <= 0 else self.now - changed

    # -- a run ---------------------------------------------------------------------------------

    def run(self) -> None:
        store, run = self.store, self.where.path
        report = load_report(self.where, history=False)
        listed: set[int] = set()
        pending: set[int] = set()
        if report is not None:
            listed |= set(report.checkpoints)
            if report.latest_step is not None:
                listed.add(report.latest_step)
            best = (report.best or {}).get("step")
            if isinstance(best, int) and not isinstance(best, bool):
                listed.add(best)
            pending = set(report.discarding) - set(report.checkpoints)
        checkpoints = store.join(run, layout.CHECKPOINTS)
        targets = {a: self.pointer(store.join(run, a)) for a in (layout.LATEST, layout.BEST)}
        # An alias whose pointer cannot be read may name any step: every step counts as named.
        unknown = any(t is True for t in targets.values())
        for target in targets.values():
            if isinstance(target, str) and store.parent(target) == checkpoints:
                m = _STEP_DIR.fullmatch(store.basename(target))
                if m:
                    listed.add(int(m.group(1)))
        for entry in _list(store, checkpoints):
            path = store.join(checkpoints, entry)
            if _hidden_tag(entry) is not None:
                self.hidden(checkpoints, entry)
                continue
            m = _STEP_DIR.fullmatch(entry)
            if m is None:
                continue  # not savepoint's: never touched
            step = int(m.group(1))
            if step in pending and self.committed(path) is not False:
                self.skip(
                    path,
                    "pending deletion (report.json's discarding): the run's writer deletes it at "
                    "its next open or save",
                )
            self.checkpoint(path, listed=unknown or step in listed)
        self.history_segments(store.join(run, history.SEGMENTS_DIR))
        for entry in _list(store, run):
            if _hidden_tag(entry) is not None:
                self.hidden(run, entry)
            elif entry in (layout.LATEST, layout.BEST):
                alias = store.join(run, entry)
                if targets[entry] is None:
                    # A linked copy (a checkpoint of its own): its superseded generations only.
                    self.checkpoint(alias, listed=True)

    def history_segments(self, directory: str) -> None:
        """History segments that a longer one covers (a compaction cut short between putting
        the merged segment and deleting its parts): no reader reads them."""
        try:
            _live, covered = history.segments(self.store, directory)
        except (OSError, CheckpointError) as exc:
            self.failures.append(Skipped(self.url(directory), f"cannot be looked at: {exc}"))
            return
        for seg in covered:
            path = self.store.join(directory, seg.name)
            age = self._age(path)
            reason = f"history segment covered by a compacted one, {age_text(age)}"
            if age < self.grace:
                self.skip(path, f"{reason}: younger than the grace period ({self.grace:g} s)")
            else:
                self.remove(path, reason)

    # -- one checkpoint ------------------------------------------------------------------------

    def checkpoint(self, path: str, *, listed: bool) -> None:
        """Collect the generations of the checkpoint at ``path``; remove ``path`` itself when it
        holds nothing committed and nothing young (unless ``listed``)."""
        store = self.store
        if self.pointer(path) is not None:
            return  # an alias pointer (or one that cannot be read): the run's bookkeeping
        try:
            st = store.stat(path)
            if st is None or st.kind != "dir":
                return
            entries = store.list(path)
            own = _has_manifest(store, path)
            gens = sorted(e for e in entries if names.is_generation(e))
            committed = [g for g in gens if _has_manifest(store, store.join(path, g))]
        except OSError as exc:
            self.failures.append(Skipped(self.url(path), f"cannot be looked at: {exc}"))
            return
        others = [e for e in entries if not names.is_generation(e)]
        newest = committed[-1] if committed and not own else None
        if newest is None and not own:
            # Nothing committed here: a save (or several) that died before its commit.
            if listed:
                self.skip(
                    path,
                    "holds no committed checkpoint, yet the run names it (report.json or an "
                    "alias): left as it is, for inspection",
                )
                return
            ages = [self.now - generation_time(g) for g in gens]
            ages += [self._age(store.join(path, e)) for e in others]
            youngest = min(ages) if ages else self._age_dir(path)
            what = "generations that never committed" if gens else "no generation"
            reason = f"holds no committed checkpoint ({what}), {age_text(youngest)}"
            if youngest >= self.grace:
                # Looked up again, as readers do.
                if self.committed(path) is False:
                    self.remove(path, reason)
                return
            if not gens:
                self.skip(path, f"{reason}: younger than the grace period ({self.grace:g} s)")
                return
        for gen in gens:
            if gen == newest:
                continue
            gpath = store.join(path, gen)
            age = self.now - generation_time(gen)
            if gen in committed:
                by = "the checkpoint's own manifest" if own else f"the newer generation {newest}"
                reason = f"committed generation superseded by {by}"
            else:
                reason = "generation without a manifest (a save that never committed)"
            reason = f"{reason}, {age_text(age)}"
            if age < self.grace:
                self.skip(gpath, f"{reason}: younger than the grace period ({self.grace:g} s)")
                continue
            self.remove(gpath, reason, manifest_first=gen in committed)
        if newest is not None:
            # Files of a flat checkpoint the newest generation replaced (a crash before the tidy).
            for entry in sorted(others):
                epath = store.join(path, entry)
                age = self._age(epath)
                reason = f"left over from the checkpoint {newest} replaced, {age_text(age)}"
                if age < self.grace:
                    self.skip(epath, f"{reason}: younger than the grace period")
                else:
                    self.remove(epath, reason)

    def _age_dir(self, path: str) -> float:
        """An (otherwise empty) directory's age; on an object store, its marker object's."""
        store = self.store
        with contextlib.suppress(OSError):
            st = store.stat(path)
            if st is not None and st.mtime > 0:
                return self.now - st.mtime
            marker = _marker_name(store)
            if marker is not None:
                found = store.stat(store.join(path, marker))
                if found is not None and found.mtime > 0:
                    return self.now - found.mtime
        return math.inf

    # -- hidden temporaries (the rename strategy) -------------------------------------------

    def siblings(self, target: str) -> None:
        """The hidden temporaries beside the checkpoint ``target``."""
        parent = self.store.parent(target)
        prefix = f".{self.store.basename(target)}."
        for entry in _list(self.store, parent):
            if entry.startswith(prefix) and _hidden_tag(entry) is not None:
                self.hidden(parent, entry)

    def hidden(self, parent: str, entry: str) -> None:
        """A hidden temporary ``parent/entry`` (see the module docstring for the rules)."""
        store = self.store
        found = _hidden_tag(entry)
        assert found is not None
        tag, target_name, rest = found
        path = store.join(parent, entry)
        target = store.join(parent, target_name)
        what = "replaced checkpoint" if tag == names.OLD_TAG else "temporary"
        if tag == names.OLD_TAG:
            try:
                replaced = _has_manifest(store, target)
            except OSError as exc:
                self.failures.append(Skipped(self.url(path), f"cannot be looked at: {exc}"))
                return
        if tag == names.OLD_TAG and not replaced:
            self.skip(
                path,
                f"the previous checkpoint of {self.url(target)}, left by a replace interrupted "
                "between its two renames: the only copy, which readers load (the next save there "
                "removes it)",
            )
            return
        parts = rest.split("-")
        host = parts[0] if len(parts) == 3 else ""
        pid = parts[1] if len(parts) == 3 else "?"
        if names.dead_here(rest):
            self.remove(path, f"hidden {what} of process {pid}, no longer running on this host")
            return
        if host == names.HOST:
            self.skip(path, f"hidden {what} of process {pid} of this host, still running")
            return
        age = self._age(path)
        source = f"host {host}" if host else "an unknown process"
        reason = f"hidden {what} of {source}, unchanged for {age_text(age).replace(' old', '')}"
        if age < self.grace:
            self.skip(path, f"{reason}: within the grace period ({self.grace:g} s)")
            return
        self.remove(path, reason)


def _hidden_tag(entry: str) -> tuple[str, str, str] | None:
    """(tag, the target's name, what follows the tag) of a hidden temporary's name."""
    if not entry.startswith("."):
        return None
    for tag in TAGS:
        at = entry.rfind(tag)
        if at > 1:
            return tag, entry[1:at], entry[at + len(tag) :]
    return None


def _has_manifest(store: Store, directory: str) -> bool:
    """Whether ``directory`` holds a manifest; a lookup that fails raises its OSError (a failed
    read is not "uncommitted": that would remove a committed generation)."""
    st = store.stat(store.join(directory, mf.NAME))
    return st is not None and st.kind != "dir"


def _list(store: Store, path: str) -> list[str]:
    try:
        return store.list(path)
    except OSError:
        return []


def _marker_name(store: Store) -> str | None:
    """The name of the object that makes an empty directory exist, on an object store."""
    module = _objectstore(store)
    marker = getattr(module, "MARKER", None)
    return marker if isinstance(marker, str) and marker else None


def _objectstore(store: Store) -> Any:
    """The object-store module when ``store`` is one of its stores (then it is imported)."""
    module = sys.modules.get("savepoint.storage.objectstore")
    return module if module is not None and isinstance(store, module.ObjectStore) else None
