"""Writing any checkpoint savepoint reads in the layout of ``torch.distributed.checkpoint``'s own
``FileSystemWriter`` (``.metadata`` and ``__0_0.distcp``), so that ``dcp.load`` (torchtitan's
resume, ``dcp_to_torch_save``) reads it on any number of ranks:
``savepoint convert CKPT OUT --format dcp``, ``sp.convert(src, dst, format="dcp")``.

The state is flattened exactly as ``dcp.save`` flattens it (``flatten_state_dict``): dicts are
walked (keys turned into strings), a list is walked when it holds a tensor, a dict or such a list
(else it is one value), a tuple is one value; each leaf is named by its path joined with ``.``
(``{"model": {"layers": [{"w": t}]}}`` gives ``model.layers.0.w``), and ``planner_data`` records
each path, as DCP's default planners do. Then:

- every tensor is one chunk (the whole tensor), stored as the ``torch.save`` archive
  ``FileSystemWriter`` writes for it (:mod:`savepoint.formats._torch_write`), streamed from the
  source a block at a time: DCP's planner reads each rank's part out of it. Leaves tied to one
  tensor are written once, their names pointing at the same bytes.
- every plain value (a number, a string, None, a list or tuple of plain values, an empty dict or
  list) is a ``BYTE_IO`` item, as DCP's planner writes it: ``torch.save`` of the value (a pickle of
  plain values only). An empty dict, which DCP's flattening drops, is kept this way, so DCP's
  full-state readers give it back.
- a checkpoint read from DCP (savepoint's import of a ``FileSystemWriter`` directory, or one
  written through ``SavepointWriter``, converted or not: a flat tree with ``metadata["dcp"]``)
  goes back under its own names, with its ``planner_data`` and tensor properties; its ``BYTE_IO``
  values, kept as raw bytes, are written back verbatim (never unpickled).

What DCP's layout cannot hold is listed (a ConversionError, or with ``lossy`` left out): two
leaves whose dotted names collide, a tuple (or plain list) holding tensors (DCP would pickle the
tensors inside one ``torch.save``'d value; savepoint writes no pickled tensors), and metadata
(``.metadata`` has no place for a user's). Writing ``.metadata`` needs torch (it is a pickle of
DCP's own dataclasses, made by torch's classes); the directory is committed atomically.
"""

from __future__ import annotations

import os
import pickle
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from savepoint.codecs import dtypes
from savepoint.errors import IncompatibleCheckpointError
from savepoint.formats import _files, _torch_write
from savepoint.formats._files import LazyTensor

__all__ = [
    "DATA_FILE",
    "writer",
]

DATA_FILE = "__0_0.distcp"
_METADATA = ".metadata"
_VERSION = "1.0.0"  # torch.distributed.checkpoint.filesystem.CURRENT_DCP_VERSION (2.13)


@dataclass
class _Item:
    """One entry of the flattened state: a tensor, raw ``BYTE_IO`` bytes kept from a DCP
    checkpoint, or a plain value's pickle."""

    fqn: str
    path: tuple[str | int, ...]
    tensor: LazyTensor | None = None
    raw: LazyTensor | None = None
    value: bytes | None = None


def _terminal(value: Any) -> bool:
    """DCP's ``traverse_state_dict._is_terminal``: not a dict, and not a list holding a tensor,
    a dict or a list that is not terminal."""
    if isinstance(value, Mapping):
        return False
    if not isinstance(value, list):
        return True
    for entry in value:
        if isinstance(entry, LazyTensor):
            return False
        if isinstance(entry, (Mapping, list)) and not _terminal(entry):
            return False
    return True


def _flatten(tree: Any, cannot: Callable[[str, str], None]) -> list[_Item]:
    from savepoint.formats.convert import has_tensor  # convert imports this module

    items: list[_Item] = []
    names: dict[str, str] = {}

    def leaf(path: tuple[str | int, ...], value: Any) -> None:
        fqn = ".".join(map(str, path))
        where = "/".join(map(str, path))
        if fqn in names:
            cannot(where, f"its DCP name {fqn!r} is also that of {names[fqn]}")
            return
        names[fqn] = where
        if isinstance(value, LazyTensor):
            items.append(_Item(fqn, path, tensor=value))
        elif has_tensor(value):
            cannot(
                where,
                f"a {type(value).__name__} holding tensors: DCP stores it as one torch.save'd "
                "value, and savepoint writes no pickled tensors",
            )
        else:
            items.append(_Item(fqn, path, value=pickle.dumps(value, protocol=2)))

    def walk(path: tuple[str | int, ...], value: Any) -> None:
        if isinstance(value, Mapping) and value:
            for k, v in value.items():
                walk((*path, str(k)), v)
        elif isinstance(value, Mapping) or _terminal(value):
            leaf(path, value)
        else:
            for i, v in enumerate(value):
                walk((*path, i), v)

    if isinstance(tree, Mapping):
        for key, value in tree.items():
            walk((str(key),), value)
    else:
        cannot("<root>", f"a {type(tree).__name__}; a DCP state is a dict")
    return items


def _from_dcp(tree: Any, dcp: Any) -> list[_Item] | None:
    """The items of a flat tree read from DCP (``metadata["dcp"]`` of version 1), under their
    own names; None when the tree is not such a one."""
    if not (isinstance(dcp, Mapping) and dcp.get("version") == 1 and isinstance(tree, Mapping)):
        return None
    if not all(isinstance(k, str) and isinstance(v, LazyTensor) for k, v in tree.items()):
        return None
    opaque = set(dcp.get("bytes") or ())
    paths = dcp.get("planner_data")
    paths = paths if isinstance(paths, Mapping) else {}
    items = []
    for fqn, t in tree.items():
        path = paths.get(fqn)
        ok = isinstance(path, list) and path and all(isinstance(p, (str, int)) for p in path)
        where: tuple[str | int, ...] = tuple(path) if ok and path else tuple(fqn.split("."))
        raw = fqn in opaque and t.dtype.name == "U8" and len(t.shape) == 1
        items.append(_Item(fqn, where, tensor=None if raw else t, raw=t if raw else None))
    return items


def _torch() -> Any:
    try:
        import torch
        import torch.distributed.checkpoint
    except ImportError:
        raise IncompatibleCheckpointError(
            "writing a DCP checkpoint needs torch (its .metadata is a pickle of DCP's own "
            "classes): pip install 'savepoint[torch]'"
        ) from None
    return torch


def writer(source: Any, dst: str, plan: Any) -> Callable[[], tuple[int, int]]:
    """What ``convert`` calls for the target ``"dcp"``: ``source`` is its source (``tree``,
    ``metadata``), ``plan.cannot(where, why)`` collects what DCP's layout cannot hold; the
    returned function writes the directory at ``dst`` and returns (tensors, bytes)."""
    metadata = dict(source.metadata)
    dcp = metadata.pop("dcp", None)
    items = _from_dcp(source.tree, dcp)
    properties: dict[str, Any] = {}
    if items is not None:
        found = dcp.get("properties")
        properties = dict(found) if isinstance(found, Mapping) else {}
    else:
        items = _flatten(source.tree, plan.cannot)
        if dcp is not None:
            metadata["dcp"] = dcp
    for key in metadata:
        plan.cannot(f"metadata/{key}", "DCP's .metadata has no place for a checkpoint's metadata")
    torch = _torch()

    def write() -> tuple[int, int]:
        with _files.atomic_directory(dst, what="DCP checkpoint") as staging:
            stored = _write_data(os.path.join(staging, DATA_FILE), items)
            _write_metadata(torch, os.path.join(staging, _METADATA), items, stored, properties, dst)
        tensors = {id(i.tensor or i.raw): i.tensor or i.raw for i in items if i.value is None}
        return len(tensors), sum(t.nbytes for t in tensors.values() if t is not None)

    return write


def _write_data(path: str, items: list[_Item]) -> dict[str, tuple[int, int]]:
    """Every item into the one data file, values first (as DCP orders them); each item's
    (offset, length), tied tensors sharing one."""
    stored: dict[str, tuple[int, int]] = {}
    written: dict[int, tuple[int, int]] = {}
    with open(path, "wb") as f:
        for item in sorted(items, key=lambda i: i.tensor is not None):
            start = f.tell()
            if item.value is not None:
                _torch_write.write_bytes_archive(f, item.value)
            elif item.raw is not None:
                for piece in _files.chunks(item.raw):
                    f.write(piece)
            else:
                assert item.tensor is not None
                if id(item.tensor) in written:
                    stored[item.fqn] = written[id(item.tensor)]
                    continue
                t = item.tensor
                _torch_write.write_tensor_archive(f, t.dtype, t.shape, _files.chunks(t))
                written[id(t)] = (start, f.tell() - start)
            stored[item.fqn] = (start, f.tell() - start)
        _files.fsync_file(f)
    return stored


def _write_metadata(
    torch: Any,
    path: str,
    items: list[_Item],
    stored: dict[str, tuple[int, int]],
    properties: Mapping[str, Any],
    dst: str,
) -> None:
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    state: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    for item in items:
        offset, length = stored[item.fqn]
        info = _StorageInfo(DATA_FILE, offset, length)
        if item.tensor is None:
            state[item.fqn] = BytesStorageMetadata()
            storage[MetadataIndex(item.fqn)] = info
            continue
        t = item.tensor
        p = properties.get(item.fqn)
        p = p if isinstance(p, Mapping) else {}
        size = torch.Size(t.shape)
        origin = torch.Size([0] * len(t.shape))
        state[item.fqn] = TensorStorageMetadata(
            TensorProperties(
                dtype=dtypes.torch_dtype(t.dtype),
                requires_grad=bool(p.get("requires_grad", False)),
                pin_memory=bool(p.get("pin_memory", False)),
            ),
            size,
            [ChunkStorageMetadata(offsets=origin, sizes=size)],
        )
        storage[MetadataIndex(item.fqn, origin, 0)] = info
    meta = Metadata(
        state_dict_metadata=state,
        planner_data={i.fqn: i.path for i in items},
        storage_data=storage,
        storage_meta=StorageMeta(checkpoint_id=dst, save_id=str(uuid.uuid4())),
        version=_VERSION,
    )
    with open(path, "wb") as f:
        pickle.dump(meta, f)
        _files.fsync_file(f)
