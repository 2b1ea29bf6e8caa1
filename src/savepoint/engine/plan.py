"""Save plans as data: which tensors go into which data file, at which offsets.

A plan is computed from tensor descriptions alone (names, dtypes, shapes, byte counts), before any
byte is copied or any file created, so the synchronous writer, the async staging arena and every
rank of a sharded save lay files out the same way.

Split rule: tensors are assigned to files in the order they were found (the state's order), a new
file starting when the current one would pass ``max_file_bytes``; a tensor larger than that gets a
file of its own. Inside a file the tensors are ordered as the safetensors layout puts them
(:func:`savepoint.codecs.safetensors.layout`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from savepoint.codecs import safetensors
from savepoint.state.arrays import TensorSource

__all__ = ["FilePlan", "data_file_name", "plan_files"]


@dataclass(frozen=True)
class FilePlan:
    """One data file: its name, its header bytes and where each tensor lies in it.

    ``entries`` are in file order with absolute byte offsets; ``size`` is the file's length."""

    name: str
    header: bytes
    entries: tuple[safetensors.Entry, ...]

    @property
    def size(self) -> int:
        return self.entries[-1].end if self.entries else len(self.header)

    @property
    def tensors(self) -> tuple[str, ...]:
        return tuple(e.name for e in self.entries)


def data_file_name(index: int) -> str:
    """The name of an unsharded checkpoint's ``index``-th data file."""
    return f"data-{index:05d}.safetensors"


def plan_files(
    tensors: Mapping[str, TensorSource],
    max_file_bytes: int,
    name: Callable[[int], str] = data_file_name,
) -> list[FilePlan]:
    """The files that hold ``tensors`` (in their order), named ``name(0)``, ``name(1)``, ..."""
    groups: list[list[str]] = [[]]
    size = 0
    for key, source in tensors.items():
        if groups[-1] and size + source.nbytes > max_file_bytes:
            groups.append([])
            size = 0
        groups[-1].append(key)
        size += source.nbytes
    plans = []
    for i, group in enumerate(groups):
        header, entries = safetensors.layout(
            [(n, tensors[n].dtype.name, tensors[n].shape, tensors[n].nbytes) for n in group]
        )
        plans.append(FilePlan(name(i), header, tuple(entries)))
    return plans
