"""Writing a Hugging Face model directory (``export(hf=True)``): the shards, the index and an
optional ``config.json``, staged in a hidden sibling directory and committed in one rename.

The layout rules (names, shard assignment, the index's bytes) are
:mod:`savepoint.formats.huggingface`'s; which tensors go in, under which names, and the
``__metadata__`` are :mod:`savepoint.formats.export`'s. This module only writes.

Memory: each shard is streamed by the write pipeline from the sources (mapped files, read and
checked as they are copied) through two staging buffers of at most half the largest tensor
(at least 1 MiB, at most 32 MiB each), made for this export and dropped after it; a source that
is not one range of a file (a tensor a sharded save stored in pieces) is assembled whole when it
is copied. Extra memory: at most twice the largest tensor, plus 2 MiB.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from savepoint.codecs import bounded_json
from savepoint.engine.pipeline import BLOCK, StagingPool
from savepoint.errors import (
    CheckpointNotFoundError,
    CheckpointWriteError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
)
from savepoint.formats import _files, huggingface
from savepoint.formats._targets import check_replaceable
from savepoint.state.arrays import TensorSource
from savepoint.storage import local
from savepoint.storage.paths import Location

__all__ = ["CONFIG", "check_target", "config_bytes", "staging_pool", "write_directory"]

CONFIG = "config.json"
_MAX_CONFIG_BYTES = 16 << 20
_MIN_BUFFER = 1 << 20
_MAX_BUFFER = 32 << 20


def staging_pool(largest: int) -> StagingPool:
    """Two staging buffers of half the largest tensor, within [1 MiB, 32 MiB], 4 KiB-aligned,
    the same two for every shard (no smaller set for a small shard: one set alive at a time)."""
    half = -(-(largest // 2) // BLOCK) * BLOCK
    return StagingPool(min(_MAX_BUFFER, max(_MIN_BUFFER, half)), 2, sized=False)


def check_target(source: Location, target: str, overwrite: bool) -> None:
    """What may be at ``target``: nothing, or with ``overwrite`` an empty directory or a
    Hugging Face model directory (it is replaced whole), never the source or a directory that
    holds it or lies inside it."""
    real = os.path.realpath(target)
    if source.is_local:
        src = os.path.realpath(source.path)
        if src == real or _under(src, real) or _under(real, src):
            raise CheckpointWriteError(
                f"{target} is the source, holds it or lies inside it; export into another "
                "directory",
                path=target,
            )
    if not os.path.lexists(target):
        return
    if not overwrite:
        raise CheckpointWriteError(
            f"{target} already exists; pass overwrite=True (savepoint export --overwrite) to "
            "replace it",
            path=target,
        )
    check_replaceable(target)
    if not os.path.isdir(target):
        raise CheckpointWriteError(
            f"{target} is a file; export --hf writes a directory: name a directory", path=target
        )
    if os.listdir(target) and not huggingface.is_repository(target):
        raise CheckpointWriteError(
            f"{target} is a directory holding neither {huggingface.SINGLE} nor "
            f"{huggingface.INDEX}; refusing to replace it (it is replaced whole): choose "
            "another directory",
            path=target,
        )


def _under(path: str, directory: str) -> bool:
    return path.startswith(directory.rstrip(os.sep) + os.sep)


def config_bytes(config: Any, metadata: Mapping[str, Any]) -> tuple[bytes | None, str]:
    """``config.json``'s bytes and where they come from: ``config`` as a path (the file, checked
    to be a JSON object, copied byte for byte) or a mapping (written as ``save_pretrained``
    writes one); without it, the model config a ``SavepointTrainer`` checkpoint records
    (``metadata["transformers"]["config"]``), if any; else nothing."""
    if config is None:
        recorded = metadata.get("transformers")
        found = recorded.get("config") if isinstance(recorded, Mapping) else None
        if not isinstance(found, Mapping):
            return None, ""
        return _dumped(found), "metadata['transformers']['config']"
    if isinstance(config, Mapping):
        return _dumped(config), "config="
    if not isinstance(config, (str, os.PathLike)):
        raise TypeError(f"config must be a path or a mapping, not {type(config).__name__}")
    path = os.path.abspath(os.fspath(config))
    try:
        raw = local.read_small(os.path.realpath(path), cap=_MAX_CONFIG_BYTES)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"no config file at {path}", path=path) from None
    if type(bounded_json.loads(raw, CorruptCheckpointError, path)) is not dict:
        raise IncompatibleCheckpointError(
            f"{path} is not a JSON object, as a model's config.json is", path=path
        )
    return raw, path


def _dumped(config: Mapping[str, Any]) -> bytes:
    try:
        text = json.dumps(dict(config), indent=2, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"config cannot be written as JSON: {exc}") from None
    return (text + "\n").encode("utf-8")


def write_directory(
    target: str,
    items: Sequence[tuple[str, TensorSource]],
    metadata: Mapping[str, str],
    *,
    max_shard_size: int,
    config: bytes | None,
) -> tuple[str, ...]:
    """Write ``items`` (name, source) as the Hugging Face model directory ``target``, shards of
    at most ``max_shard_size`` bytes (a larger tensor alone), each with ``metadata`` as its
    ``__metadata__``, the index when there are several, and ``config``. Atomic: on any error
    nothing is left and what was at ``target`` is untouched. Returns the files written."""
    shards = huggingface.plan_shards([s.nbytes for _, s in items], max_shard_size)
    names = huggingface.shard_names(len(shards))
    pool = staging_pool(max((s.nbytes for _, s in items), default=0))
    written = list(names)
    syncs: list[Callable[[], None]] = []  # one shard's fsync runs while the next is written
    try:
        with _files.atomic_directory(target, what="Hugging Face model directory") as staging:
            try:
                for name, shard in zip(names, shards):
                    part = [items[i] for i in shard]
                    path = os.path.join(staging, name)
                    _files.write_safetensors(
                        path, part, metadata, pool=pool, finishing=syncs, align=True
                    )
            except BaseException:
                with contextlib.suppress(BaseException):
                    _wait_all(syncs)  # before the staging directory goes
                raise
            _wait_all(syncs)  # every shard durable before anything names it
            if len(shards) > 1:
                weight_map = {items[i][0]: n for n, shard in zip(names, shards) for i in shard}
                total = sum(s.nbytes for _, s in items)
                elements = sum(_elements(s) for _, s in items)
                index = huggingface.index_bytes(weight_map, total, elements)
                _write_small(os.path.join(staging, huggingface.INDEX), index)
                written.append(huggingface.INDEX)
            if config is not None:
                _write_small(os.path.join(staging, CONFIG), config)
                written.append(CONFIG)
    finally:
        pool.clear()  # the buffers are this export's: none outlives it
    return tuple(written)


def _wait_all(waits: list[Callable[[], None]]) -> None:
    """Wait for every deferred fsync; raise the first failure (after waiting for the rest)."""
    first: BaseException | None = None
    for wait in waits:
        try:
            wait()
        except BaseException as exc:
            first = first or exc
    if first is not None:
        raise first


def _elements(source: TensorSource) -> int:
    count = 1
    for d in source.shape:
        count *= d
    return count


def _write_small(path: str, data: bytes) -> None:
    with open(path, "xb") as f:
        f.write(data)
        _files.fsync_file(f)
