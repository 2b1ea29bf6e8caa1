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
orbax       ``_CHECKPOINT_METADATA``, or ``_METADATA`` with ``manifest.ocdbt``: an Orbax item or
            step directory, read through tensorstore (:mod:`savepoint.formats.orbax`; the
            ``orbax`` extra)
==========  ===================================================================================

Each reader yields ``(label, tree, metadata)``: the label a conversion report names the source
by, the state tree of lazy tensors and plain values, and the metadata (JSON).

:data:`WRITERS` are the conversion targets among them (``convert``'s ``format``): ``dcp``
(:mod:`savepoint.formats.dcp_export`), each ``writer(source, dst, plan)`` as convert's own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

from savepoint.formats import dcp_export, dcp_import, deepspeed, orbax
from savepoint.formats._progress import Progress
from savepoint.info import CheckpointInfo

__all__ = [
    "KINDS",
    "LABELS",
    "Reader",
    "WRITERS",
    "by_entries",
    "inspect",
    "open_tree",
    "verify",
]

KINDS = ("dcp", "deepspeed", "orbax")
LABELS = {"dcp": dcp_import.LABEL, "deepspeed": deepspeed.LABEL, "orbax": orbax.LABEL}
WRITERS = {"dcp": dcp_export.writer}


def by_entries(entries: Iterable[str]) -> str | None:
    """The format of a directory holding ``entries`` (names), None when none of these."""
    names = list(entries)
    if dcp_import.is_dcp(names):
        return "dcp"
    if deepspeed.is_deepspeed(names):
        return "deepspeed"
    if orbax.is_orbax(names):
        return "orbax"
    return None


class Reader(Protocol):
    """What each format's opened checkpoint offers (see the module docstring)."""

    @property
    def label(self) -> str: ...

    def tree(self) -> Any: ...

    def metadata(self) -> dict[str, Any]: ...

    def describe(self) -> CheckpointInfo: ...

    def check(self, progress: Progress | None) -> None: ...


_OPEN: dict[str, Callable[[str], contextlib.AbstractContextManager[Reader]]] = {
    "dcp": dcp_import.open_checkpoint,
    "deepspeed": deepspeed.open_checkpoint,
    "orbax": orbax.open_checkpoint,
}


@contextlib.contextmanager
def open_tree(kind: str, path: str) -> Iterator[tuple[str, Any, dict[str, Any]]]:
    """``(label, tree, metadata)`` of the checkpoint of format ``kind`` at the local ``path``,
    its tensors readable for the length of the ``with`` block."""
    with _OPEN[kind](path) as ck:
        yield ck.label, ck.tree(), ck.metadata()


def inspect(kind: str, path: str) -> CheckpointInfo:
    """Describe the checkpoint of format ``kind`` at ``path`` (no tensor data read)."""
    with _OPEN[kind](path) as ck:
        return ck.describe()


def verify(kind: str, path: str, *, progress: Progress | None = None) -> CheckpointInfo:
    """Check the checkpoint of format ``kind`` at ``path`` as far as its format allows (every
    CRC-32 where it has them), reading every byte; its description when intact."""
    with _OPEN[kind](path) as ck:
        ck.check(progress)
        return ck.describe()
