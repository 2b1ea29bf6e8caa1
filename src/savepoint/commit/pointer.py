"""An alias that names a committed checkpoint instead of holding a copy of it.

On stores with hard links a run's ``latest/`` and ``best/`` are checkpoints whose blobs are links
to one step's blobs (no space, readable by anything). Object stores have no links, and a copy
would cost a second upload of the whole state at every save, so there an alias is a directory
holding one small blob, ``savepoint-alias.json``::

    {"savepoint_alias": 1, "target": "checkpoints/step-0000000100"}

``target`` is relative to the directory that holds the alias (the run directory), ``/``-separated,
without ``.``, ``..`` or empty components, so a pointer can never lead outside its run. It is
written with one overwriting ``put`` (atomic on object stores: a reader sees the old pointer or
the new one) after the checkpoint it names is committed, and
:func:`savepoint.commit.transaction.resolve` follows it (one level: a pointer to a pointer is not
followed), so ``sp.load("s3://b/run/latest")`` loads that step. A missing, unreadable or malformed
pointer reads as no checkpoint.
"""

from __future__ import annotations

import json

from savepoint.storage.base import Store

__all__ = ["CAP", "NAME", "VERSION", "encode", "target", "write"]

NAME = "savepoint-alias.json"
VERSION = 1
CAP = 64 << 10  # a pointer is a few dozen bytes; anything bigger is not one


def encode(relative: str) -> bytes:
    """The pointer blob naming ``relative`` (checked as :func:`target` will read it)."""
    _components(relative)
    return json.dumps({"savepoint_alias": VERSION, "target": relative}).encode()


def write(store: Store, alias: str, checkpoint: str) -> None:
    """Make ``alias`` (a directory beside ``checkpoint``'s ancestors) point at ``checkpoint``:
    one overwriting put. ``checkpoint`` must lie under the alias's parent directory."""
    base = store.parent(store.abspath(alias)).rstrip("/") + "/"
    checkpoint = store.abspath(checkpoint)
    if not checkpoint.startswith(base):
        raise ValueError(f"{checkpoint} is not under {base}: an alias points inside its run")
    data = encode(checkpoint[len(base) :])
    store.makedirs(alias)
    store.put(store.join(alias, NAME), data, exclusive=False)


def target(store: Store, alias: str) -> str | None:
    """The path ``alias`` points at, or None where it holds no readable, well-formed pointer
    (never raises OSError or a decoding error)."""
    try:
        data = store.read_small(store.join(alias, NAME), cap=CAP)
    except Exception:  # absent, not a blob, over the cap, unreadable: no pointer
        return None
    try:
        doc = json.loads(data)
        if not isinstance(doc, dict) or doc.get("savepoint_alias") != VERSION:
            return None
        relative = doc.get("target")
        if not isinstance(relative, str):
            return None
        parts = _components(relative)
    except ValueError:
        return None
    return store.join(store.parent(store.abspath(alias)), *parts)


def _components(relative: str) -> list[str]:
    parts = relative.split("/")
    if not relative or any(p in ("", ".", "..") or "\\" in p or "\0" in p for p in parts):
        raise ValueError(f"not a relative path inside the run: {relative!r}")
    return parts
