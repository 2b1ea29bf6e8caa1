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

import dataclasses
import json
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from savepoint import _text

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

    @classmethod
    def make(
        cls,
        key: str,
        dtype: str,
        shape: tuple[int, ...],
        nbytes: int,
        file: str,
        ref: str,
        tied_to: str | None = None,
        shards: int = 1,
    ) -> TensorInfo:
        """``TensorInfo(...)``, without the frozen dataclass ``__init__``'s cost of one
        ``object.__setattr__`` per field (a description of a million tensors makes a million):
        the fields go straight into the instance's own ``__dict__``, which CPython then keeps
        as a table sharing its keys with every other instance (4x faster than building a dict
        and assigning it, and smaller)."""
        info = _new(cls)
        d = info.__dict__
        d["key"] = key
        d["dtype"] = dtype
        d["shape"] = shape
        d["nbytes"] = nbytes
        d["file"] = file
        d["ref"] = ref
        d["tied_to"] = tied_to
        d["shards"] = shards
        return info


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

    @classmethod
    def deferred(cls, compute: Callable[[], Described], **fields: Any) -> CheckpointInfo:
        """A description whose ``tensors``, ``values`` and ``stateful`` are made by ``compute()``
        the first time one of them is read (every other field is given now).

        Saves return a description most callers never read; for a state of 100,000 tensors
        building it took longer than writing the data. A deferred description is the same type
        and compares, prints, copies and pickles like any other (each of those reads the fields).
        """
        info = cls.__new__(cls)
        for name in _DEFERRED:
            if name in fields:
                raise TypeError(f"{name} is computed; do not pass it")
        for f in dataclasses.fields(cls):
            if f.name in _DEFERRED:
                continue
            if f.name in fields:
                value = fields.pop(f.name)
            elif f.default is not dataclasses.MISSING:
                value = f.default
            elif f.default_factory is not dataclasses.MISSING:
                value = f.default_factory()
            else:
                raise TypeError(f"missing field {f.name!r}")
            object.__setattr__(info, f.name, value)
        if fields:
            raise TypeError(f"unknown fields {sorted(fields)}")
        object.__setattr__(info, "_compute", compute)
        return info

    if not TYPE_CHECKING:  # (a __getattr__ would make the type checker accept any attribute)

        def __getattr__(self, name: str) -> Any:
            # Only reached for a field not set yet: the deferred ones of a deferred description.
            compute = self.__dict__.get("_compute") if name in _DEFERRED else None
            if compute is None:
                raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
            with _LOCK:
                if "_compute" in self.__dict__:
                    tensors, values, stateful = compute()
                    object.__setattr__(self, "tensors", tensors)
                    object.__setattr__(self, "values", values)
                    object.__setattr__(self, "stateful", stateful)
                    object.__delattr__(self, "_compute")
            return self.__dict__[name]

    def __getstate__(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            object.__setattr__(self, name, value)

    def __str__(self) -> str:
        """The description as ``savepoint inspect`` prints it (``print(sp.inspect(path))``): who
        wrote it (savepoint's format) or its format (the others), its size, its metadata and
        Stateful objects, then a table of the tensors (key, dtype, shape, size, file) and one of
        the plain values. ``repr()`` stays the dataclass's field by field form."""
        lines = [f"checkpoint  {self.path}"]
        if self.format == "savepoint":
            lines.append(f"written by  {self.writer}, format {self.format_version}, {self.created}")
        else:
            lines.append(f"format      {self.label}")
        lines.append(
            f"data        {_text.size(self.total_bytes)} in {len(self.tensors)} tensors, "
            f"{len(self.files)} file(s)"
        )
        if self.metadata:
            meta = json.dumps(self.metadata, sort_keys=True, ensure_ascii=False, default=repr)
            lines.append(f"metadata    {meta}")
        for key, kind in self.stateful.items():
            lines.append(f"stateful    {key or '<root>'}: {kind}")
        if self.tensors:
            # An incremental checkpoint's (format 4) unsharded tensors live in its blob store.
            blobs = self.format == "savepoint" and self.format_version == 4
            rows: list[tuple[str, ...]] = [("key", "dtype", "shape", "size", "file")]
            for t in self.tensors:
                where = t.file
                if not where and t.shards == 1 and blobs and t.nbytes:
                    where = "(blob store)"
                note = where + (f" (tied to {t.tied_to})" if t.tied_to else "")
                rows.append((t.key, t.dtype, _text.shape(t.shape), _text.size(t.nbytes), note))
            lines += ["", _text.table(rows)]
        if self.values:
            lines += ["", _text.table(_text.value_rows(self.values))]
        return "\n".join(lines)

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


Described = tuple[tuple[TensorInfo, ...], dict[str, Any], dict[str, str]]
_new = object.__new__
_DEFERRED = ("tensors", "values", "stateful")
_LOCK = threading.Lock()


def jsonable(value: Any) -> Any:
    """A plain value as JSON can show it: non-finite floats as text, bytes as their length."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, bytes):
        return {"bytes": len(value)}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value
