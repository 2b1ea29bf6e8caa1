"""Checkpoints of the other formats savepoint reads, opened for :mod:`savepoint.formats.diff` as
its readers of savepoint checkpoints are: a tree (the one ``convert`` reads, flattened as
``sp.save`` would store it), a record per tensor (dtype, shape, size; no stored checksum, so no
pair is ever equal "by checksum") and ``transfer`` copying tensors into buffers, a block at a
time, as they are compared.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from savepoint.codecs import manifest as mf
from savepoint.formats import convert
from savepoint.formats._files import copy_into
from savepoint.state import tree

__all__ = [
    "SourceReader",
    "open_reader",
]


@dataclass
class _Manifest:
    format_version: int | None
    tree: tree.Node
    tensors: dict[str, mf.TensorRecord]


class SourceReader:
    """The part of :class:`savepoint.engine.read.Reader` a comparison uses, over a lazy tree."""

    def __init__(self, shown: str, version: int | None, flat: tree.Flat) -> None:
        self.shown = shown
        self._tensors: dict[str, Any] = flat.tensors
        records = {
            ref: mf.TensorRecord.plain(t.dtype.name, t.shape, "", 0, t.nbytes, "")
            for ref, t in flat.tensors.items()
        }
        self.manifest = _Manifest(version, flat.tree, records)

    def transfer(
        self,
        jobs: Sequence[tuple[str, np.ndarray[Any, Any] | None]],
        *,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        for ref, dst in jobs:
            assert dst is not None
            copy_into(self._tensors[ref], dst, progress)


@contextlib.contextmanager
def open_reader(path: str, kind: str) -> Iterator[SourceReader]:
    """The local checkpoint of format ``kind`` (as ``detect`` names it) at ``path``."""
    with convert.open_source(path, kind) as source:
        yield SourceReader(path, source.version, convert.encode(source.tree))
