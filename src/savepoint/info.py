"""What a checkpoint of any format holds, described without reading its tensor data.

``sp.inspect`` and ``sp.verify`` describe savepoint's own checkpoints with a
:class:`CheckpointInfo`; :func:`savepoint.formats.detect.inspect_any` and ``verify_any``, and
each foreign format's ``inspect`` / ``verify``, describe theirs with the same type. What only
some formats record is empty elsewhere:

===============  ==========================================================================
field            savepoint's format / other formats
===============  ==========================================================================
format           ``"savepoint"`` / ``"shrew"``, ``"safetensors"``, ``"boostr"``, ...
format_version   the manifest's version / the format's own version, None where it has none
writer, created  who wrote it and when / ``""`` (a ``notes`` line says what the file records)
tensors          flat keys of the state tree (a conversion to savepoint's format gives the same)
values           plain values by flat key
stateful         ``Stateful`` objects by key / empty
world_size       ranks of a sharded save, None when unsharded / None
notes            empty / what verify can and cannot check, who wrote the file
===============  ==========================================================================
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

__all__ = ["CheckpointInfo", "TensorInfo", "jsonable"]


@dataclass(frozen=True)
class TensorInfo:
    key: str  # path in the state tree (components joined by "/")
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    file: str
    ref: str  # name in the data file; tied leaves share one (other formats: the key)
    tied_to: str | None = None  # the ref of an earlier leaf this one shares storage with
    shards: int = 1  # pieces it is stored in (sharded checkpoints); ``file`` is then "N shards"


@dataclass(frozen=True)
class CheckpointInfo:
    """A checkpoint described from its headers alone (see the module docstring)."""

    path: str
    format_version: int | None
    writer: str
    created: str
    metadata: dict[str, Any]
    tensors: tuple[TensorInfo, ...]
    values: dict[str, Any]
    files: dict[str, int]
    stateful: dict[str, str] = field(default_factory=dict)
    world_size: int | None = None  # ranks that saved a sharded checkpoint; None when unsharded
    format: str = "savepoint"
    notes: tuple[str, ...] = ()

    @property
    def total_bytes(self) -> int:
        """Bytes of tensor data, each stored tensor counted once."""
        return sum({t.ref: t.nbytes for t in self.tensors}.values())

    @property
    def label(self) -> str:
        """The format and its version as people write it: ``"shrew v2"``, ``"safetensors"``."""
        if self.format_version is None:
            return self.format
        return f"{self.format} v{self.format_version}"

    def to_dict(self) -> dict[str, Any]:
        """The description as JSON-ready data (non-finite floats as text, bytes as a length).

        ``format`` is always present; ``world_size`` only for a sharded checkpoint and ``notes``
        only when there are some.
        """
        return {
            "path": self.path,
            "format": self.format,
            "format_version": self.format_version,
            "writer": self.writer,
            "created": self.created,
            "metadata": self.metadata,
            "total_bytes": self.total_bytes,
            "files": self.files,
            "tensors": [
                {
                    "key": t.key,
                    "dtype": t.dtype,
                    "shape": list(t.shape),
                    "nbytes": t.nbytes,
                    "file": t.file,
                    **({"tied_to": t.tied_to} if t.tied_to else {}),
                    **({"shards": t.shards} if t.shards > 1 else {}),
                }
                for t in self.tensors
            ],
            "values": {k: jsonable(v) for k, v in self.values.items()},
            "stateful": self.stateful,
            **({"world_size": self.world_size} if self.world_size is not None else {}),
            **({"notes": list(self.notes)} if self.notes else {}),
        }


def jsonable(value: Any) -> Any:
    """A plain value as JSON can show it: non-finite floats as text, bytes as their length."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, bytes):
        return {"bytes": len(value)}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value
