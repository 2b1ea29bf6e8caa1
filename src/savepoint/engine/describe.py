"""A native checkpoint described from its manifest alone (:class:`savepoint.info.CheckpointInfo`).

Used by ``sp.inspect`` / ``sp.verify`` and by every save path to describe what it committed
(single-process, async, sharded), so that all of them return the same description.
"""

from __future__ import annotations

from typing import Any

from savepoint.codecs import manifest as mf
from savepoint.info import CheckpointInfo, TensorInfo
from savepoint.state import tree

__all__ = ["describe"]


def describe(path: str, manifest: mf.Manifest) -> CheckpointInfo:
    """The description of the checkpoint at ``path`` (as messages show it) with ``manifest``."""
    tensors = []
    values: dict[str, Any] = {}
    used: set[str] = set()
    seen_refs: set[str] = set()
    for leaf_path, node in tree.leaves(manifest.tree):
        # {0: a, "0": b} share a path; keep both apart, as tensor names do (see state.tree).
        key = unique = tree.join(leaf_path)
        n = 2
        while unique in used:
            unique, n = f"{key}~{n}", n + 1
        used.add(unique)
        if node["t"] == "tensor":
            ref = node["ref"]
            rec = manifest.tensors[ref]
            tied = ref if ref in seen_refs else None
            seen_refs.add(ref)
            pieces = len(rec.layout())
            file = rec.file if pieces == 1 else f"{pieces} shards"
            tensors.append(
                TensorInfo(unique, rec.dtype, rec.shape, rec.nbytes, file, ref, tied, pieces)
            )
        else:
            values[unique] = tree.plain_value(node)
    return CheckpointInfo(
        path=path,
        format_version=manifest.format_version,
        writer=manifest.writer,
        created=manifest.created,
        metadata=manifest.metadata,
        tensors=tuple(tensors),
        values=values,
        files={name: f.size for name, f in manifest.files.items()},
        stateful=_stateful(manifest.tree),
        world_size=manifest.world_size,
    )


def _stateful(root: tree.Node) -> dict[str, str]:
    """Stateful objects by flat key, with the type name each was saved from (iteratively: the
    tree may be as deep as the manifest allows)."""
    found: dict[str, str] = {}
    stack: list[tuple[tree.Node, tuple[tree.Key, ...]]] = [(root, ())]
    while stack:
        node, path = stack.pop()
        t = node["t"]
        if t == "stateful":
            found[tree.join(path)] = node["type"]
            stack.append((node["state"], path))
        elif t == "dict":
            stack.extend((child, (*path, k)) for k, child in reversed(node["items"]))
        elif t in ("list", "tuple"):
            stack.extend(
                (child, (*path, i)) for i, child in reversed(list(enumerate(node["items"])))
            )
    return found
