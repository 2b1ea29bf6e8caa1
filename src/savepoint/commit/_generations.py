"""Strategy "manifest-last": no rename; the manifest's create-only put is the commit point.

Layout: the target is a directory (a prefix, on an object store) holding generations,
``<target>/gen-<time_ns:020d>-<host>-<pid>-<random8>/`` (see :mod:`savepoint.commit.names`). A
save writes its data blobs into a generation of its own, then ``manifest.json`` there with a
create-only put: before that put the generation is no checkpoint ("no manifest, no checkpoint"),
after it it is. Readers take the newest generation holding a manifest
(:func:`savepoint.commit.transaction.resolve`), so a crash at any point leaves the previous
checkpoint or the new one.

After the manifest put:

1. :func:`switch`: if the target holds a checkpoint of its own (``<target>/manifest.json``, the
   rename strategy's flat layout, say copied from a local disk), that manifest is removed: it
   would win over any generation, so removing it is what makes the new generation the checkpoint;
2. :func:`tidy`, best effort: every older generation and every blob or directory of the target
   that is not a generation (the flat checkpoint's data) is deleted. A reader that pinned one of
   them keeps its bytes where the store allows it (memory); an object store's reader retries on
   the new one.
"""

from __future__ import annotations

import contextlib

from savepoint.codecs import manifest as mf
from savepoint.commit import names
from savepoint.commit._rename import has_manifest
from savepoint.storage.base import Store


def newest(store: Store, target: str) -> str | None:
    """The newest generation of ``target`` holding a manifest; None where there is none. A
    listing or lookup that fails raises the store's OSError (a failed read is not "none")."""
    entries = store.list(target)
    for name in sorted((e for e in entries if names.is_generation(e)), reverse=True):
        if has_manifest(store, store.join(target, name)):
            return store.join(target, name)
    return None


def only_generations(store: Store, target: str) -> bool:
    """Whether every entry of ``target`` is a generation (committed or abandoned)."""
    return all(names.is_generation(e) for e in store.list(target))


def switch(store: Store, target: str) -> None:
    """Step 1 above, once the new generation's manifest is in place."""
    store.sync_dir(target)
    if has_manifest(store, target):
        store.remove(store.join(target, mf.NAME))


def tidy(store: Store, staging: str, target: str) -> None:
    """Step 2 above (never raises OSError: what is left, the next commit deletes)."""
    try:
        store.sync_dir(target)
        entries = store.list(target)
    except OSError:
        return
    mine = store.basename(staging)
    for name in entries:
        if name == mine or (names.is_generation(name) and name > mine):
            continue
        path = store.join(target, name)
        with contextlib.suppress(OSError):
            st = store.stat(path)
            if st is not None and st.kind == "dir":
                store.remove_tree(path)
            elif st is not None:
                store.remove(path)


def discard(store: Store, target: str) -> None:
    """Delete the checkpoint at ``target`` so that no crash leaves it half-deleted: every
    manifest goes first (the generations', oldest first, then the target's own, which would
    win over them), then everything else."""
    gens = sorted(e for e in store.list(target) if names.is_generation(e))
    for name in gens:
        with contextlib.suppress(FileNotFoundError):
            store.remove(store.join(target, name, mf.NAME))
    with contextlib.suppress(FileNotFoundError):
        store.remove(store.join(target, mf.NAME))
    store.sync_dir(target)
    store.remove_tree(target)
