"""A sharded checkpoint rewritten as an ordinary (unsharded, version 1) one.

``consolidate(src, dst)`` streams: the writer asks for one tensor at a time; that tensor is
assembled from its shards (each shard checked against its checksum as it is read) into a buffer
of its own size, written, and dropped before the next one. Peak memory is the largest tensor plus
the writer's staging buffers. The result has the same tree, values and metadata, one tensor per
entry in ordinary data files, and is committed atomically like any save.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from savepoint import _reader, checkpoint
from savepoint.codecs import dtypes
from savepoint.state import tree
from savepoint.state.arrays import TensorSource
from savepoint.storage.paths import local_path


class _AssembledSource:
    """A TensorSource that assembles its tensor from the source checkpoint when first read."""

    __slots__ = ("_data", "_reader", "_verify", "dtype", "kind", "nbytes", "ref", "shape")

    def __init__(self, reader: _reader.Reader, ref: str, kind: str, verify: bool) -> None:
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
    src: checkpoint.PathLike,
    dst: checkpoint.PathLike,
    *,
    verify: bool = True,
    max_file_bytes: int = checkpoint.DEFAULT_MAX_FILE_BYTES,
    progress: checkpoint.Progress | None = None,
) -> checkpoint.CheckpointInfo:
    """Write the checkpoint at ``src`` (sharded or not) to ``dst`` as an unsharded checkpoint."""
    dst = local_path(dst, what="target")
    with _reader.Reader.open(os.path.abspath(local_path(src, what="source"))) as reader:
        manifest = reader.manifest
        kinds = checkpoint._kinds(manifest.tree)
        reader.prepare(manifest.tensors, check_header=verify)
        sources: dict[str, TensorSource] = {
            ref: _AssembledSource(reader, ref, kinds.get(ref, "numpy"), verify)
            for ref in tree.refs(manifest.tree)
        }
        # Manifest order, as a save of the consolidated state would write them.
        ordered = {ref: sources[ref] for ref in manifest.tensors if ref in sources}
        flat = tree.Flat(tree=manifest.tree, tensors=ordered)
        return checkpoint.save_flat(
            dst,
            flat,
            dict(manifest.metadata),
            max_file_bytes=max_file_bytes,
            writers=1,
            progress=progress,
        )
