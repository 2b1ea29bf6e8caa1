"""Strategy "rename": a fully synced hidden sibling becomes the checkpoint in one atomic step.

Sequence of :func:`publish` (stores with ``atomic_rename``):

1. the caller wrote every blob under ``staging`` (a hidden sibling, see
   :mod:`savepoint.commit.names`), each finished (synced), ``manifest.json`` last;
2. ``staging`` itself is synced, so its entries are durable;
3. if nothing exists at the target: ``rename(staging, target)``. If a checkpoint exists there:
   ``exchange`` swaps the two directories in one atomic step (``renameat2(RENAME_EXCHANGE)`` on
   Linux 3.15+: ext4, xfs, btrfs, tmpfs...). Where the store cannot exchange, the old checkpoint
   is first renamed to ``.<name>.savepoint-old-...`` and the new one renamed into place; a crash
   between those two renames leaves the old checkpoint under that name, and
   :func:`savepoint.commit.transaction.resolve` finds it;
4. the parent directory is synced: the new checkpoint is now durable;
5. the replaced checkpoint (now under a hidden name) is deleted.

A crash at any point therefore leaves the old checkpoint or the new one at the target, never a
mixture, plus at most one hidden directory that the next save to the same target removes
(:func:`clean_stale`, which only touches names of dead processes on this host).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from savepoint.codecs import manifest as mf
from savepoint.commit import names
from savepoint.storage.base import Store


def publish(store: Store, staging: str, target: str, *, synced: bool = False) -> None:
    """Steps 2-5 above. ``target`` must be absent, an empty directory, or a committed checkpoint.

    If a step fails before the parent directory is synced, the renames done so far are undone
    (best effort) so that ``target`` holds the previous checkpoint again and ``staging`` the new
    one, which the caller then removes; the error is re-raised."""
    parent = store.parent(target)
    if not synced:  # ``synced``: the caller synced ``staging`` after its last entry was made
        store.sync_dir(staging)
    if store.stat(target) is None:
        store.rename(staging, target)
        _or_undo(lambda: store.sync_dir(parent), lambda: store.rename(target, staging))
        return
    if store.exchange(staging, target):
        # ``staging`` now holds the previous checkpoint.
        _or_undo(lambda: store.sync_dir(parent), lambda: store.exchange(staging, target))
        _tidy(store, staging)
        return
    replaced = names.hidden(store, target, names.OLD_TAG)
    store.rename(target, replaced)
    _or_undo(lambda: store.sync_dir(parent), lambda: store.rename(replaced, target))
    _or_undo(lambda: store.rename(staging, target), lambda: store.rename(replaced, target))

    def put_back() -> None:
        store.rename(target, staging)
        store.rename(replaced, target)

    _or_undo(lambda: store.sync_dir(parent), put_back)
    _tidy(store, replaced)


def _or_undo(step: Callable[[], object], undo: Callable[[], object]) -> None:
    try:
        step()
    except BaseException:
        with contextlib.suppress(OSError):
            undo()
        raise


def _tidy(store: Store, path: str) -> None:
    # The new checkpoint is committed: failing to delete the old one must not fail the save (a
    # later save's clean_stale removes it once this process is gone).
    with contextlib.suppress(OSError):
        store.remove_tree(path)


def has_manifest(store: Store, directory: str) -> bool:
    """Whether ``directory`` holds a ``manifest.json`` (not a directory of that name). A lookup
    that fails raises the store's OSError: a failed read is not an absent manifest."""
    st = store.stat(store.join(directory, mf.NAME))
    return st is not None and st.kind != "dir"


def clean_stale(store: Store, target: str) -> list[str]:
    """Remove hidden siblings of ``target`` left by dead processes; returns what was removed."""
    return tidy(store, target)[0]


def tidy(store: Store, target: str) -> tuple[list[str], bool]:
    """:func:`clean_stale`, and whether an ``-old-`` sibling was kept (the only copy, while
    ``target`` holds no checkpoint): only then is tidying again after a commit worth a listing."""
    removed: list[str] = []
    kept_old = False
    try:
        committed = has_manifest(store, target)
        found = names.siblings_by_tag(store, target, (names.TMP_TAG, names.OLD_TAG))
    except OSError:  # tidying is best effort; the next save tries again
        return removed, kept_old
    for tag in (names.TMP_TAG, names.OLD_TAG):
        for path, rest in found[tag]:
            # A "-old-" directory is the only copy when a fallback replace died between renames.
            if tag == names.OLD_TAG and not committed:
                kept_old = True
                continue
            if names.dead_here(rest):
                try:
                    store.remove_tree(path)
                except OSError:  # tidying is best effort; the next save tries again
                    continue
                removed.append(path)
    return removed, kept_old


def discard(store: Store, path: str) -> None:
    """Delete ``path`` so that no crash leaves it half-deleted: renamed to a hidden temporary name
    (atomic), the parent synced, then removed; the next sweep of dead processes' temporaries in
    the parent finishes the job if the process dies during the removal."""
    hidden = names.hidden(store, path, names.TMP_TAG)
    try:
        store.rename(path, hidden)
    except FileNotFoundError:
        return
    store.sync_dir(store.parent(path))
    store.remove_tree(hidden)


def old_copy(store: Store, path: str) -> str | None:
    """The newest ``-old-`` sibling of ``path`` holding a manifest: the previous checkpoint a
    fallback replace left when it died (or is) between its two renames."""
    olds = [o for o, _ in names.siblings(store, path, names.OLD_TAG) if has_manifest(store, o)]
    return max(olds, key=lambda o: _mtime(store, o)) if olds else None


def _mtime(store: Store, path: str) -> float:
    # A sibling can vanish between listing and stat (the next save tidied it): rank it last.
    try:
        st = store.stat(path)
    except OSError:
        return -1.0
    return -1.0 if st is None else st.mtime
