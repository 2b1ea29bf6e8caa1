"""A sharded checkpoint rewritten as an ordinary (unsharded, version 1) one.

``consolidate(src, dst)`` streams: the writer asks for one tensor at a time; that tensor is
assembled from its shards (each shard checked against its checksum as it is read) into a buffer
of its own size, written, and dropped before the next one. Peak memory is the largest tensor plus
the writer's staging buffers. The result has the same tree, values and metadata, one tensor per
entry in ordinary data files, and is committed atomically like any save.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from savepoint.codecs import dtypes
from savepoint.engine import load as load_engine
from savepoint.engine import save as save_engine
from savepoint.engine.describe import describe
from savepoint.engine.read import Reader
from savepoint.info import CheckpointInfo
from savepoint.options import DEFAULT_MAX_FILE_BYTES, Progress
from savepoint.state import tree
from savepoint.state.arrays import TensorSource
from savepoint.storage.paths import PathArg
from savepoint.storage.paths import resolve as resolve_path

__all__ = ["consolidate"]


class _AssembledSource:
    """A TensorSource that assembles its tensor from the source checkpoint when first read."""

    __slots__ = ("_data", "_reader", "_verify", "dtype", "kind", "nbytes", "ref", "shape")

    def __init__(self, reader: Reader, ref: str, kind: str, verify: bool) -> None:
        rec = reader.manifest.tensors[ref]
        self._reader = reader
        self._verify = verify
        self._data: np.ndarray[Any, Any] | None = None
        self.ref = ref
        self.dtype = dtypes.from_name(rec.dtype)
        self.shape = rec.shape
        self.nbytes = rec.nbytes
        self.kind = kind

    def identity(self) -> tuple[Any, ...] | None:
        return None

    def copy_to(self, dst: np.ndarray[Any, Any], start: int) -> None:
        if self._data is None:
            data = np.empty(self.nbytes, dtype=np.uint8)
            self._reader.transfer([(self.ref, data)], verify=self._verify)
            self._data = data
        np.copyto(dst, self._data[start : start + dst.size])

    def release(self) -> None:
        self._data = None


def consolidate(
    src: PathArg,
    dst: PathArg,
    *,
    verify: bool = True,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    progress: Progress | None = None,
) -> CheckpointInfo:
    """Write the checkpoint at ``src`` (sharded or not) to ``dst`` as an unsharded checkpoint."""
    target = resolve_path(dst, what="target")
    with Reader.open(resolve_path(src, what="source")) as reader:
        manifest = reader.manifest
        kinds = load_engine.kinds(manifest.tree)
        reader.prepare(manifest.tensors, check_header=verify)
        sources: dict[str, TensorSource] = {
            ref: _AssembledSource(reader, ref, kinds.get(ref, "numpy"), verify)
            for ref in tree.refs(manifest.tree)
        }
        # Manifest order, as a save of the consolidated state would write them.
        ordered = {ref: sources[ref] for ref in manifest.tensors if ref in sources}
        flat = tree.Flat(tree=manifest.tree, tensors=ordered)
        directory, written = save_engine.save_flat(
            target,
            flat,
            dict(manifest.metadata),
            max_file_bytes=max_file_bytes,
            writers=1,
            progress=progress,
        )
        return describe(target.store.url(directory), written)
