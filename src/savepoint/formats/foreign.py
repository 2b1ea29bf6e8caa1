"""The checkpoint directories of other training systems that savepoint reads, behind one door
for detection, ``inspect``, ``verify`` and the lazy trees of ``sp.load``, ``convert``, ``diff``
and ``export``:

==========  ===================================================================================
format      recognised by (the directory's entries), read by
==========  ===================================================================================
dcp         ``.metadata`` and ``*.distcp`` files: torch.distributed.checkpoint's
            ``FileSystemWriter`` (:mod:`savepoint.formats.dcp_import`)
deepspeed   a ``*_model_states.pt`` file (a tag directory), or ``latest`` and
            ``zero_to_fp32.py`` (its save directory): a DeepSpeed ZeRO checkpoint
            (:mod:`savepoint.formats.deepspeed`)
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

from savepoint.formats import dcp_export, dcp_import, deepspeed
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

KINDS = ("dcp", "deepspeed")
LABELS = {"dcp": dcp_import.LABEL, "deepspeed": deepspeed.LABEL}
WRITERS = {"dcp": dcp_export.writer}


def by_entries(entries: Iterable[str]) -> str | None:
    """The format of a directory holding ``entries`` (names), None when none of these."""
    names = list(entries)
    if dcp_import.is_dcp(names):
        return "dcp"
    if deepspeed.is_deepspeed(names):
        return "deepspeed"
    return None


@contextlib.contextmanager
def open_tree(kind: str, path: str) -> Iterator[tuple[str, Any, dict[str, Any]]]:
    """``(label, tree, metadata)`` of the checkpoint of format ``kind`` at the local ``path``,
    its tensors readable for the length of the ``with`` block."""
    if kind == "deepspeed":
        with deepspeed.open_checkpoint(path) as ds:
            label = f"deepspeed zero-{ds.stage}"
            yield label, dict(ds.tensors), ds.metadata()
        return
    with dcp_import.open_checkpoint(path) as ck:
        yield "dcp", ck.tree(), ck.metadata()


def inspect(kind: str, path: str) -> CheckpointInfo:
    if kind == "deepspeed":
        return deepspeed.inspect(path)
    return dcp_import.inspect(path)


def verify(kind: str, path: str, *, progress: Progress | None = None) -> CheckpointInfo:
    if kind == "deepspeed":
        return deepspeed.verify(path, progress=progress)
    return dcp_import.verify(path, progress=progress)
