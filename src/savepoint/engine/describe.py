"""A native checkpoint described from its manifest alone (:class:`savepoint.info.CheckpointInfo`).

Used by ``sp.inspect`` / ``sp.verify`` and by every save path to describe what it committed
(single-process, async, sharded), so that all of them return the same description.

The per-key part (``tensors``, ``values``, ``stateful``) is deferred until first read
(:meth:`CheckpointInfo.deferred`): a save returns a description that most callers drop, and for a
state of 100,000 tensors building it took longer than writing the data.
"""

from __future__ import annotations

import functools
from typing import Any

from savepoint.codecs import manifest as mf
from savepoint.engine import collector
from savepoint.info import CheckpointInfo, Described, TensorInfo
from savepoint.state import tree

__all__ = ["describe"]


def describe(path: str, manifest: mf.Manifest) -> CheckpointInfo:
    """The description of the checkpoint at ``path`` (as messages show it) with ``manifest``."""
    return CheckpointInfo.deferred(
        functools.partial(_contents, manifest),
        path=path,
        format_version=manifest.format_version,
        writer=manifest.writer,
        created=manifest.created,
        metadata=manifest.metadata,
        files={name: f.size for name, f in manifest.files.items()},
        world_size=manifest.world_size,
    )


def _contents(manifest: mf.Manifest) -> Described:
    """Tensors, plain values and Stateful objects by flat key."""
    with collector.paused():
        return _describe_leaves(manifest)


def _describe_leaves(manifest: mf.Manifest) -> Described:
    tensors = []
    values: dict[str, Any] = {}
    used: set[str] = set()
    seen_refs: set[str] = set()
    records = manifest.tensors
    make = TensorInfo.make
    for key, node in tree.keyed_leaves(manifest.tree):
        # {0: a, "0": b} share a path; keep both apart, as tensor names do (see state.tree).
        unique = key
        if unique in used:
            n = 2
            while unique in used:
                unique, n = f"{key}~{n}", n + 1
        used.add(unique)
        if node["t"] == "tensor":
            ref = node["ref"]
            rec = records[ref]
            tied = ref if ref in seen_refs else None
            seen_refs.add(ref)
            pieces = len(rec.shards) or 1  # len(rec.layout()), without making one
            if pieces == 1:
                tensors.append(
                    make(unique, rec.dtype, rec.shape, rec.end - rec.start, rec.file, ref, tied)
                )
            else:
                tensors.append(
                    make(
                        unique,
                        rec.dtype,
                        rec.shape,
                        rec.nbytes,
                        f"{pieces} shards",
                        ref,
                        tied,
                        pieces,
                    )
                )
        else:
            values[unique] = tree.plain_value(node)
    return tuple(tensors), values, _stateful(manifest.tree)


def _stateful(root: tree.Node) -> dict[str, str]:
    """Stateful objects by flat key, with the type name each was saved from (iteratively: the
    tree may be as deep as the manifest allows)."""
    found: dict[str, str] = {}
    stack: list[tuple[tree.Node, str, bool]] = [(root, "", True)]
    while stack:
        node, key, is_root = stack.pop()
        t = node["t"]
        if t == "stateful":
            found[key] = node["type"]
            stack.append((node["state"], key, is_root))
        elif t == "dict":
            stack.extend(
                (child, tree.child_key(key, is_root, k), False)
                for k, child in reversed(node["items"])
                if child["t"] in _CONTAINERS
            )
        elif t in ("list", "tuple"):
            items = node["items"]
            stack.extend(
                (items[i], tree.child_key(key, is_root, i), False)
                for i in range(len(items) - 1, -1, -1)
                if items[i]["t"] in _CONTAINERS
            )
    return found


_CONTAINERS = frozenset(("dict", "list", "tuple", "stateful"))
