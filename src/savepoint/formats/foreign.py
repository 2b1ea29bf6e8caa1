"""The checkpoint directories of other training systems that savepoint reads, behind one door
for detection, ``inspect``, ``verify`` and the lazy trees of ``sp.load``, ``convert``, ``diff``
and ``export``:

==========  ===================================================================================
format      recognised by (the directory's entries), read by
==========  ===================================================================================
dcp         ``.metadata`` and ``*.distcp`` files: torch.distributed.checkpoint's
            ``FileSystemWriter`` (:mod:`savepoint.formats.dcp_import`)
==========  ===================================================================================

Each reader yields ``(label, tree, metadata)``: the label a conversion report names the source
by, the state tree of lazy tensors and plain values, and the metadata (JSON).

:data:`WRITERS` are the conversion targets among them (``convert``'s ``format``): ``dcp``
(:mod:`savepoint.formats.dcp_export`), each ``writer(source, dst, plan)`` as convert's own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

from savepoint.formats import dcp_export, dcp_import
from savepoint.formats._progress import Progress
from savepoint.info import CheckpointInfo

__all__ = [
    "KINDS",
    "LABELS",
    "WRITERS",
    "by_entries",
    "inspect",
    "open_tree",
    "verify",
]

KINDS = ("dcp",)
LABELS = {"dcp": dcp_import.LABEL}
WRITERS = {"dcp": dcp_export.writer}


def by_entries(entries: Iterable[str]) -> str | None:
    """The format of a directory holding ``entries`` (names), None when none of these."""
    names = list(entries)
    if dcp_import.is_dcp(names):
        return "dcp"
    return None


@contextlib.contextmanager
def open_tree(kind: str, path: str) -> Iterator[tuple[str, Any, dict[str, Any]]]:
    """``(label, tree, metadata)`` of the checkpoint of format ``kind`` at the local ``path``,
    its tensors readable for the length of the ``with`` block."""
    with dcp_import.open_checkpoint(path) as ck:
        yield "dcp", ck.tree(), ck.metadata()


def inspect(kind: str, path: str) -> CheckpointInfo:
    return dcp_import.inspect(path)


def verify(kind: str, path: str, *, progress: Progress | None = None) -> CheckpointInfo:
    return dcp_import.verify(path, progress=progress)
