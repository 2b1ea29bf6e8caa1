"""The names a commit gives to what is not (or no longer) a checkpoint, and who may tidy them.

Rename strategy (stores with ``atomic_rename``): a save stages under a hidden sibling of its target,
``.<name>.savepoint-tmp-<host>-<pid>-<random8>``; a fallback replace (no atomic exchange) parks the
previous checkpoint under ``.<name>.savepoint-old-<host>-<pid>-<random8>`` between its two renames.

Manifest-last strategy (object stores): an attempt writes under
``<target>/gen-<time_ns:020d>-<host>-<pid>-<random8>``; the zero-padded creation time makes the
newest generation sort last.

``<host>`` is this machine's hostname reduced to ``[A-Za-z0-9_]`` (at most 32 characters), so a
hidden name splits on ``-`` into host, pid and random part. Only names of *this* host whose pid no
longer runs are ever tidied by another process (:func:`dead_here`): a live writer's staging is
never touched, and neither is another machine's on a shared filesystem.
"""

from __future__ import annotations

import os
import socket
import time
import uuid

from savepoint.storage.base import Store
from savepoint.storage.lease import pid_gone

__all__ = [
    "GEN_PREFIX",
    "HOST",
    "OLD_TAG",
    "TMP_TAG",
    "dead_here",
    "generation",
    "hidden",
    "is_generation",
    "siblings",
    "siblings_by_tag",
]

TMP_TAG = ".savepoint-tmp-"
OLD_TAG = ".savepoint-old-"
GEN_PREFIX = "gen-"
HOST = "".join(c if c.isalnum() else "_" for c in socket.gethostname())[:32] or "host"


def _owner() -> str:
    return f"{HOST}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def hidden(store: Store, path: str, tag: str) -> str:
    """A fresh hidden sibling of ``path`` carrying ``tag`` (:data:`TMP_TAG` or :data:`OLD_TAG`)."""
    return store.join(store.parent(path), f".{store.basename(path)}{tag}{_owner()}")


def generation() -> str:
    """A fresh generation name: ``gen-<time_ns:020d>-<host>-<pid>-<random8>``."""
    return f"{GEN_PREFIX}{time.time_ns():020d}-{_owner()}"


def is_generation(name: str) -> bool:
    """Whether ``name`` is a generation directory's name (see :func:`generation`)."""
    stamp = name[len(GEN_PREFIX) : len(GEN_PREFIX) + 20]
    return name.startswith(GEN_PREFIX) and len(stamp) == 20 and stamp.isdigit()


def siblings(store: Store, path: str, tag: str) -> list[tuple[str, str]]:
    """(hidden path, the part after the tag) for each hidden sibling of ``path`` with ``tag``.

    A parent that is missing or may not be listed (EACCES) has no sibling anyone could use:
    ``[]``. Any other failure to list it (an I/O error, a failed request) raises the store's
    OSError: a failed read is not an absence."""
    return siblings_by_tag(store, path, (tag,))[tag]


def siblings_by_tag(
    store: Store, path: str, tags: tuple[str, ...]
) -> dict[str, list[tuple[str, str]]]:
    """:func:`siblings` for several tags from one listing of the parent (a parent holding
    thousands of checkpoints costs a listing each)."""
    base = f".{store.basename(path)}"
    parent = store.parent(path)
    out: dict[str, list[tuple[str, str]]] = {tag: [] for tag in tags}
    try:
        entries = store.list(parent)
    except PermissionError:
        return out
    for e in entries:
        if not e.startswith(base):
            continue
        for tag in tags:
            prefix = base + tag
            if e.startswith(prefix):
                out[tag].append((store.join(parent, e), e[len(prefix) :]))
    return out


def dead_here(rest: str) -> bool:
    """True if ``<host>-<pid>-<random>`` names a process of this host that no longer runs."""
    parts = rest.split("-")
    if len(parts) != 3 or parts[0] != HOST or not parts[1].isdigit():
        return False
    return pid_gone(int(parts[1]))
