"""``latest/`` and ``best/``: copies of (or pointers to) checkpoints that must agree with
``report.json``.

An alias is an ordinary checkpoint directory whose files are hard links to one step's files
(copies where a filesystem refuses a link: :func:`link_tree`). On stores without hard links
(object stores) it is instead a pointer naming the step (:mod:`savepoint.commit.pointer`), put in
one overwriting put after the step is committed: a copy there would upload the whole state a
second time at every save. Readers resolve either form the same way
(:func:`savepoint.commit.transaction.resolve`). It *agrees* with the report when
it is absent, or when it holds exactly the checkpoint the report names (``latest_step``,
``best.step``): the same ``manifest.json`` (the same blob, or the same bytes where the store had no
hard links), and the manifest holds every tensor's checksum, so the same manifest means the same
checkpoint.

The manager changes an alias only through a commit transaction
(:class:`savepoint.commit.transaction.Transaction`): :func:`stage` begins one and fills its
staging directory (the only step that needs free space), :meth:`Staged.publish` commits it (one
atomic exchange, or the manifest-last commit on object stores), and :func:`remove` discards an
alias, so a reader of ``run/best`` sees the old checkpoint or the new one, never a mixture.
:func:`copy_aside` and :func:`put_back` use the same copies to keep a checkpoint that a new save of
its step replaces until that save is complete. :func:`disagreements` and :func:`run_problems` are
what ``savepoint ls`` and ``savepoint verify RUN`` report.
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Iterable, Mapping

from savepoint import checkpoint
from savepoint.codecs import manifest as mf
from savepoint.commit import names, pointer
from savepoint.commit.transaction import Transaction, check_target, discard
from savepoint.commit.transaction import resolve as resolve_commit
from savepoint.errors import CheckpointError
from savepoint.runs import layout
from savepoint.runs.report import Report
from savepoint.storage.base import BlobReader, Store
from savepoint.storage.paths import Location, PathArg, resolve

__all__ = [
    "NAMES",
    "Staged",
    "StagedLinks",
    "StagedPointer",
    "Staging",
    "abort",
    "by_pointer",
    "copy_aside",
    "disagreements",
    "holds",
    "link_tree",
    "path_of",
    "publish",
    "put_back",
    "recorded_step",
    "remove",
    "run_problems",
    "stage",
    "stage_changed",
    "swap",
    "targets",
]

NAMES = (layout.LATEST, layout.BEST)
_COPY_CHUNK = 64 << 20
# What a link raises where a filesystem (or this pair of paths) has no hard links, or a file has
# too many: then a copy is made instead. Anything else (a full disk, a quota, an I/O error) is
# raised: a copy would need more of what just ran out.
_NO_HARD_LINKS = frozenset(
    getattr(errno, name)
    for name in ("EPERM", "EXDEV", "EMLINK", "ENOTSUP", "EOPNOTSUPP", "ENOSYS", "EACCES")
    if hasattr(errno, name)
)


def _run(directory: PathArg) -> Location:
    return resolve(directory, what="run directory")


def path_of(directory: PathArg, alias: str) -> Location:
    return _run(directory).join(alias)


def targets(report: Report) -> dict[str, int | None]:
    """The step each alias must hold according to ``report`` (None: the alias must be absent)."""
    best = (report.best or {}).get("step")
    return {
        layout.LATEST: report.latest_step,
        layout.BEST: best if isinstance(best, int) and not isinstance(best, bool) else None,
    }


def holds(directory: PathArg, alias: str, step: int) -> bool:
    """Whether ``alias`` is a copy of checkpoint ``step`` (False if either is missing)."""
    run = _run(directory)
    store = run.store
    mine, theirs = (
        _manifest(store, path_of(run, alias).path),
        _manifest(store, layout.step_location(run, step).path),
    )
    if mine is None or theirs is None:
        return False
    try:
        a, b = store.stat(mine), store.stat(theirs)
    except OSError:
        return False
    if a is None or b is None or a.kind != "file" or b.kind != "file":
        return False  # never open a FIFO (it would block) or a device
    if a.identity == b.identity:
        return True
    return a.size == b.size and _same_bytes(store, mine, theirs, a.size)


def _manifest(store: Store, path: str) -> str | None:
    where = resolve_commit(store, path, strict=False)
    return None if where is None else store.join(where, mf.NAME)


def _same_bytes(store: Store, a: str, b: str, size: int) -> bool:
    try:
        first = store.open_blob(a)
        try:
            second = store.open_blob(b)
            try:
                return _equal(first, second, size)
            finally:
                second.close()
        finally:
            first.close()
    except (OSError, EOFError, CheckpointError):
        return False


def _equal(first: BlobReader, second: BlobReader, size: int) -> bool:
    x, y = _buffer(size), _buffer(size)
    for pos in range(0, size, len(x)):
        n = min(len(x), size - pos)
        first.read(pos, x[:n])
        second.read(pos, y[:n])
        if x[:n] != y[:n]:
            return False
    return True


def _buffer(size: int) -> memoryview:
    return memoryview(bytearray(max(1, min(size, _COPY_CHUNK))))


def recorded_step(directory: PathArg, alias: str) -> int | None:
    """The step an alias's checkpoint says it was saved as (its manifest metadata), or None."""
    with contextlib.suppress(CheckpointError, OSError):
        meta = checkpoint.inspect(layout.checkpoint_arg(path_of(directory, alias))).metadata
        run_meta = meta.get("savepoint_run")
        step = run_meta.get("step") if isinstance(run_meta, dict) else None
        if isinstance(step, int) and not isinstance(step, bool):
            return step
    return None


def link_tree(store: Store, source: str, staging: str, *, manifest: bool = True) -> str:
    """Fill the existing directory ``staging`` with hard links to the files of the checkpoint at
    ``source`` (in either commit layout), ``manifest.json`` last (or not at all: ``manifest``
    False); copies where the store has no hard links (or a link fails with one of
    :data:`_NO_HARD_LINKS`). Returns the path of the source's manifest. Committed files are
    never modified in place, so a linked copy costs no space and stays valid after ``source`` is
    deleted. Other errors (ENOSPC: no inode or directory block left for the link) are raised;
    ``staging`` is the caller's to remove."""
    found = resolve_commit(store, source, strict=False)
    if found is None:
        raise FileNotFoundError(errno.ENOENT, "no committed checkpoint", store.url(source))
    entries = [name for name in sorted(store.list(found)) if name != mf.NAME]
    for name in [*entries, mf.NAME] if manifest else entries:
        src, dst = store.join(found, name), store.join(staging, name)
        if store.capabilities.hard_links:
            try:
                store.link(src, dst)
                continue
            except OSError as exc:
                if exc.errno not in _NO_HARD_LINKS:
                    raise
        _copy_blob(store, src, dst)
    return store.join(found, mf.NAME)


def _copy_blob(store: Store, src: str, dst: str) -> None:
    reader = store.open_blob(src)
    try:
        writer = store.create_blob(dst, size=reader.size, direct=False)
        try:
            chunk = _buffer(reader.size)
            for pos in range(0, reader.size, len(chunk)):
                part = chunk[: min(len(chunk), reader.size - pos)]
                reader.read(pos, part)
                writer.write(part)
            writer.finish()
        except BaseException:
            writer.abort()
            raise
    finally:
        reader.close()


class Staged:
    """An alias being replaced: a transaction whose staging holds links to one checkpoint;
    nothing visible changes until :meth:`publish`. (With the manifest-last strategy the manifest
    is the commit point, so it is put by :meth:`publish`, not staged.)"""

    restores = False  # undo() does not put the previous alias back: the caller republishes it

    def __init__(self, store: Store, target: str, source: str, what: str) -> None:
        self._tx = Transaction(store, target, what=what).begin()
        self._manifest: bytes | None = None
        try:
            linked = self._tx.strategy == "rename"
            manifest = link_tree(store, source, self._tx.staging, manifest=linked)
            if not linked:
                self._manifest = store.read_small(manifest, cap=None)
        except BaseException:
            self._tx.abort()
            raise

    def publish(self, *, sync: bool = True) -> None:
        """Make the staged copy the alias, atomically (and durably: ``sync`` is implied)."""
        self._tx.commit(self._manifest)

    def finish(self) -> None:
        """Nothing left to do (the transaction removed the previous alias)."""

    def undo(self) -> None:
        """Nothing to put back: the caller republishes the previous alias."""

    def abort(self) -> None:
        """Remove the staged copy (never raises)."""
        self._tx.abort()


class StagedPointer:
    """An alias being replaced on a store without hard links: a pointer to the step
    (:mod:`savepoint.commit.pointer`), put by :meth:`publish` in one overwriting put; nothing
    is written before that, so :meth:`abort` has nothing to undo. The pointer object it
    replaces is read first (a read that fails fails the staging), so that :meth:`undo` puts it
    back exactly, with no read that could fail then."""

    restores = True

    def __init__(self, store: Store, target: str, source: str) -> None:
        if resolve_commit(store, source, strict=False) is None:
            raise FileNotFoundError(errno.ENOENT, "no committed checkpoint", store.url(source))
        self._store, self._target, self._source = store, target, source
        self._name = store.join(target, pointer.NAME)
        try:
            self._previous: bytes | None = store.read_small(self._name, cap=pointer.CAP)
        except (FileNotFoundError, NotADirectoryError):
            self._previous = None

    def publish(self, *, sync: bool = True) -> None:
        pointer.write(self._store, self._target, self._source)

    def finish(self) -> None:
        pass

    def undo(self) -> None:
        """Put the previous pointer object back (or none, where there was none). Raises
        OSError."""
        store = self._store
        if self._previous is not None:
            store.put_making_dir(self._name, self._previous, exclusive=False)
            return
        with contextlib.suppress(FileNotFoundError):
            store.remove(self._name)
        if not store.list(self._target):  # (a store that keeps an empty directory)
            store.remove_tree(self._target)

    def abort(self) -> None:
        pass


class StagedLinks:
    """An alias being replaced on a store that renames (a local disk, memory): a hidden sibling
    of the alias filled with hard links to the step's files (``manifest.json`` last).
    :meth:`publish` renames it into place, or exchanges it with the alias in one atomic step.

    Fewer syncs than a commit transaction (which syncs the staging directory, then the parent,
    once per alias): none here but one sync of the run directory, after the swap. With
    ``sync=False`` not even that: the manager replaces ``report.json`` right after, and the
    background step of its save syncs the run directory once for the report and both aliases;
    until the report is written, :meth:`undo` swaps the previous alias back exactly as it was
    (it is kept under the staging name until :meth:`finish`), with no new file needed.

    Why the staging directory needs no sync of its own: an alias holds only links to files that
    are already committed and synced; the links are made before the swap and the run directory
    is synced after it, and journaling filesystems (ext4, XFS, btrfs, ZFS) make metadata durable
    in the order it was changed, so that sync persists the links too. A filesystem that did not
    could, after a power cut, show an alias missing some of its links: ``sp.load`` then refuses
    it (a missing file, or no manifest: never other data), and the next writing open rebuilds
    it from the report. Where the store cannot exchange, the commit transaction's two-rename
    replace (:class:`Staged`) is used."""

    restores = True

    def __init__(self, store: Store, target: str, source: str, what: str) -> None:
        check_target(store, target, what)
        self._store, self._target, self._source, self._what = store, target, source, what
        self._staging = names.hidden(store, target, names.TMP_TAG)
        self._moved: str | None = None  # "renamed" or "exchanged", until finish() or undo()
        store.mkdir(self._staging)
        try:
            link_tree(store, source, self._staging)
        except BaseException:
            self.abort()
            raise

    def publish(self, *, sync: bool = True) -> None:
        """Make the staged copy the alias, atomically; ``sync``: durably too, and done."""
        store, staging, target = self._store, self._staging, self._target
        try:
            if store.stat(target) is None:
                store.rename(staging, target)
                self._moved = "renamed"
            elif store.exchange(staging, target):
                self._moved = "exchanged"  # the previous alias is now at the staging name
        except BaseException:
            self.abort()  # nothing moved: the staged copy goes
            raise
        if self._moved is None:  # no exchange on this filesystem
            self.abort()
            self.restores = False  # (the two-rename replace: the caller republishes)
            Staged(store, target, self._source, self._what).publish()
            return
        if sync:
            store.sync_dir(store.parent(target))
            self.finish()

    def finish(self) -> None:
        """Remove the previous alias (best effort: a dead process's is removed at the next
        open)."""
        if self._moved == "exchanged":
            with contextlib.suppress(OSError):
                self._store.remove_tree(self._staging)
        self._moved = None

    def undo(self) -> None:
        """Put the previous alias back (or none, where there was none). Raises OSError."""
        store, staging, target = self._store, self._staging, self._target
        if self._moved == "exchanged":
            store.exchange(staging, target)
        elif self._moved == "renamed":
            store.rename(target, staging)
        self._moved = None
        self.abort()

    def abort(self) -> None:
        """Remove the staged copy (never raises)."""
        with contextlib.suppress(OSError):
            self._store.remove_tree(self._staging)


Staging = Staged | StagedPointer | StagedLinks


def by_pointer(store: Store) -> bool:
    """Whether aliases on ``store`` are pointers (no hard links: a copy would upload the whole
    state again) rather than linked copies."""
    return not store.capabilities.hard_links


def stage(directory: PathArg, alias: str, step: int) -> Staging:
    """Begin replacing ``alias`` by checkpoint ``step``: a linked copy (:class:`StagedLinks` where
    the store renames, :class:`Staged` elsewhere), or on stores without hard links a pointer
    (:class:`StagedPointer`); on failure nothing is left behind."""
    run = _run(directory)
    source = layout.step_location(run, step).path
    target = path_of(run, alias).path
    if by_pointer(run.store):
        return StagedPointer(run.store, target, source)
    if run.store.capabilities.atomic_rename:
        return StagedLinks(run.store, target, source, f"{alias}/ alias")
    return Staged(run.store, target, source, f"{alias}/ alias")


def stage_changed(run: Location, report: Report, enabled: bool) -> dict[str, Staging]:
    """Stage each alias that must change to agree with ``report`` (none when aliases are off,
    ``enabled`` False); the caller publishes them (:func:`swap`) or aborts them (:func:`abort`)."""
    staged: dict[str, Staging] = {}
    if not enabled:
        return staged
    try:
        for alias, step in targets(report).items():
            if step is not None and not holds(run, alias, step):
                staged[alias] = stage(run, alias, step)
    except BaseException:
        abort(staged)
        raise
    return staged


def swap(
    run: Location,
    report: Report,
    enabled: bool,
    staged: dict[str, Staging],
    *,
    swapped: list[Staging],
    removed: list[bool],
) -> None:
    """Publish the aliases :func:`stage_changed` staged, unsynced, and remove those ``report``
    no longer names. Each one published (or being published: a publish that failed may have
    taken effect) is added to ``swapped``: the caller finishes it (or undoes it) once the report
    is (or is not) written; ``removed[0]`` is set when an alias is removed."""
    for alias, step in targets(report).items():
        if alias in staged:
            published = staged.pop(alias)
            swapped.append(published)
            published.publish(sync=False)
        elif run.store.stat(path_of(run, alias).path) is not None and (
            # (with aliases on, stage_changed found an unstaged one holding its step)
            step is None or (not enabled and not holds(run, alias, step))
        ):
            # The report names no such checkpoint (a best pruned with an abandoned timeline),
            # or aliases are off: a stale alias must not outlive the report.
            removed[0] = True
            remove(run, alias)


def abort(staged: Mapping[str, Staging]) -> None:
    """Abandon staged aliases without letting cleanup hide an error."""
    for alias in staged.values():
        alias.abort()


def publish(directory: PathArg, alias: str, step: int) -> None:
    stage(directory, alias, step).publish()


def remove(directory: PathArg, alias: str) -> None:
    """Remove an alias so that no crash leaves it half-deleted (``transaction.discard``)."""
    where = path_of(directory, alias)
    discard(where.store, where.path)


def copy_aside(checkpoint_dir: Location) -> str:
    """A hidden copy (hard links where the store has them) of the committed checkpoint at
    ``checkpoint_dir``, beside it; returns its path. Nothing visible changes; on failure
    nothing is left behind. A copy a dead process left is tidied like any other temporary."""
    store = checkpoint_dir.store
    copy = names.hidden(store, checkpoint_dir.path, names.TMP_TAG)
    store.mkdir(copy)
    try:
        link_tree(store, checkpoint_dir.path, copy)
    except BaseException:
        with contextlib.suppress(OSError):
            store.remove_tree(copy)
        raise
    return copy


def put_back(store: Store, copy: str, target: str) -> None:
    """Make the copy made by :func:`copy_aside` the checkpoint at ``target`` again, atomically,
    and remove the copy."""
    Staged(store, target, copy, "checkpoint").publish()
    with contextlib.suppress(OSError):
        store.remove_tree(copy)


def _steps(steps: Iterable[int]) -> str:
    items = sorted(steps)
    return ("step " if len(items) == 1 else "steps ") + ", ".join(map(str, items))


def disagreements(directory: PathArg, report: Report) -> list[str]:
    """How ``latest/`` and ``best/`` disagree with ``report`` (empty when they agree)."""
    run = _run(directory)
    problems = []
    for alias, step in targets(report).items():
        if run.store.stat(path_of(run, alias).path) is None:
            continue  # aliases are optional (aliases=False); a missing one misleads nobody
        if step is not None and holds(run, alias, step):
            continue
        held = recorded_step(run, alias)
        what = f"a copy of step {held}" if held is not None else "not a copy of any step"
        if step is None:
            problems.append(
                f"{alias}/ is {what}, but report.json has no {alias} checkpoint: it should not exist"
            )
        elif not layout.is_dir(layout.step_location(run, step)):
            problems.append(
                f"{alias}/ is {what}, and report.json's {alias} checkpoint (step {step}) is not "
                "on disk"
            )
        else:
            problems.append(f"{alias}/ is {what}, but report.json says step {step}")
    return problems


def run_problems(directory: PathArg, report: Report, steps: list[int]) -> list[str]:
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
