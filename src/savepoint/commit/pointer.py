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
followed), so ``sp.load("s3://b/run/latest")`` loads that step.

A directory without a pointer object is no alias. One whose pointer object is damaged (not a
pointer, a bad target, a target holding no committed checkpoint) is reported as such by
:func:`read` (:class:`Damaged`, saying what is wrong) and by ``resolve`` (CorruptCheckpointError);
:func:`target` reads it as no pointer, for the bookkeeping that only asks where an alias points.

A pointer that cannot be read (a failed request, an I/O error, a refusal) is never taken as "no
pointer": :func:`read` and :func:`target` raise the store's error. A run's writer that took a
failed read of ``latest/``'s pointer as "no pointer" could record a wrong step, or a collection
keep too little; it must publish the alias or fail.
"""

from __future__ import annotations

import json

from savepoint.codecs import bounded_json
from savepoint.errors import CorruptCheckpointError
from savepoint.storage.base import Store

__all__ = ["CAP", "Damaged", "NAME", "VERSION", "encode", "read", "target", "write"]

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
    # The directory with the pointer, in one put where the store can (an object store): a
    # makedirs first would leave, if the process died before the put, an alias directory
    # holding nothing, which sp.load calls an uncommitted checkpoint, not a missing alias.
    store.put_making_dir(store.join(alias, NAME), data, exclusive=False)


class Damaged(ValueError):
    """An alias holds a pointer object that is not a well-formed pointer; the message names the
    object and says what is wrong with it."""


def read(store: Store, alias: str) -> str | None:
    """The path ``alias`` points at; None where ``alias`` holds no pointer object (nothing named
    :data:`NAME` there); :class:`Damaged` where it holds one that is no pointer (over :data:`CAP`,
    not a blob, not JSON, not a pointer of this version, a target that is not a relative path
    inside the run). A pointer that cannot be read raises what the store raised (an OSError, a
    CheckpointError): a failed read is not an absent pointer."""
    name = store.join(alias, NAME)
    shown = store.url(name)
    try:
        data = store.read_small(name, cap=CAP)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except IsADirectoryError:
        raise Damaged(f"{shown} is a directory, not a pointer blob") from None
    except CorruptCheckpointError as exc:  # over the cap, a FIFO, a link: the store says which
        raise Damaged(str(exc)) from None
    doc = bounded_json.loads(data, Damaged, shown)
    if not isinstance(doc, dict) or "savepoint_alias" not in doc:
        raise Damaged(f'{shown} is JSON but not an alias pointer (no "savepoint_alias" member)')
    if doc["savepoint_alias"] != VERSION:
        raise Damaged(
            f"{shown} is an alias pointer of version {_brief(doc['savepoint_alias'])}; this "
            f"savepoint reads version {VERSION}"
        )
    relative = doc.get("target")
    if not isinstance(relative, str):
        raise Damaged(f'{shown} has no target path ("target" is {_brief(relative)})')
    try:
        parts = _components(relative)
    except ValueError:
        raise Damaged(
            f"{shown} has a bad target, {_brief(relative)}: not a relative path inside the run"
        ) from None
    return store.join(store.parent(store.abspath(alias)), *parts)


def _brief(value: object) -> str:
    """``repr(value)``, cut short: a hostile pointer may hold 64 KiB."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def target(store: Store, alias: str) -> str | None:
    """The path ``alias`` points at, or None where it holds no pointer or a damaged one (never
    a decoding error). A pointer that cannot be read raises, as in :func:`read`."""
    try:
        return read(store, alias)
    except Damaged:
        return None


def _components(relative: str) -> list[str]:
    parts = relative.split("/")
    if not relative or any(p in ("", ".", "..") or "\\" in p or "\0" in p for p in parts):
        raise ValueError(f"not a relative path inside the run: {relative!r}")
    return parts
