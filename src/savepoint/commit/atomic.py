"""The rename strategy for plain local paths, for what is not a directory transaction.

Directory saves of every format commit through :class:`savepoint.commit.transaction.Transaction`.
What remains here serves single files of the foreign formats (``.shrew``, burn records, a
converted safetensors file: a hidden temporary sibling, :func:`staging_path` and
:func:`clean_stale`, then one ``os.replace``), small files replaced whole (:func:`replace_file`),
and lookups by local path (:func:`resolve`); :func:`commit` publishes a staging directory by path
(the tests drive the rename strategy's crash cases through it).

Every function here is the rename strategy (:mod:`savepoint.commit._rename`) applied to the local
filesystem store; see that module for the sequence and its crash guarantees, and
:mod:`savepoint.commit.names` for the hidden names.
"""

from __future__ import annotations

import os

from savepoint.commit import _rename, names, transaction
from savepoint.storage import local

__all__ = [
    "OLD_TAG",
    "TMP_TAG",
    "clean_stale",
    "commit",
    "remove_tree",
    "replace_file",
    "resolve",
    "staging_path",
]

TMP_TAG = names.TMP_TAG
OLD_TAG = names.OLD_TAG


def staging_path(path: str) -> str:
    """A fresh hidden staging sibling of ``path`` (made absolute)."""
    return names.hidden(local.STORE, os.path.abspath(path), TMP_TAG)


def commit(staging: str, path: str) -> None:
    """Publish the fully written ``staging`` directory at ``path`` (absent, an empty directory,
    or a committed checkpoint); on failure ``path`` holds the previous checkpoint again."""
    _rename.publish(local.STORE, os.path.abspath(staging), os.path.abspath(path))


def remove_tree(path: str) -> None:
    """Remove a directory tree, or just the link when ``path`` is a symlink (never its target)."""
    local.STORE.remove_tree(path)


def clean_stale(path: str) -> list[str]:
    """Remove hidden siblings of ``path`` left by dead processes; returns what was removed."""
    return _rename.clean_stale(local.STORE, os.path.abspath(path))


def resolve(path: str) -> str | None:
    """Where the committed checkpoint for ``path`` is (see ``transaction.resolve``)."""
    return transaction.resolve(local.STORE, path)


def replace_file(path: str, data: bytes) -> None:
    """Write a small file atomically: readers see the old content or the new one, never a torn
    file (a synced hidden temporary renamed over ``path``, then the parent synced)."""
    local.STORE.put(os.path.abspath(path), data, exclusive=False)
