"""DCP's ``.metadata`` file, read without torch and without running anything it names.

``torch.distributed.checkpoint``'s ``FileSystemWriter`` writes ``.metadata`` with
``pickle.dump`` of its ``Metadata`` dataclass. In torch 2.13 that pickle references exactly
these globals (and older versions a subset, under ``torch.distributed._shard.checkpoint`` before
2.0): the dataclasses ``Metadata``, ``TensorStorageMetadata``, ``BytesStorageMetadata``,
``ChunkStorageMetadata``, ``TensorProperties``, ``StorageMeta``, ``MetadataIndex`` and the enum
``_MEM_FORMAT_ENCODING`` of ``torch.distributed.checkpoint.metadata``; ``_StorageInfo`` of
``torch.distributed.checkpoint.filesystem``; ``torch.Size``; dtypes (``torch.float32``...);
``torch.serialization._get_layout`` (called with ``"torch.strided"``); ``pathlib.PosixPath``
(a ``checkpoint_id`` given as a ``Path``) and ``collections.OrderedDict``.

:func:`decode` unpickles it through :func:`savepoint.formats._torch_archive.unpickle` with that
allow-list, each name mapped to an inert stand-in of this module (a dataclass becomes a record
of the state its pickle gives it; ``torch.Size`` a tuple of ints; a path a string): nothing of
torch is imported and no callable of the file's choosing runs. Any other global (``os.system``,
a custom planner's class, HF storage's ``_HFStorageInfo``) is refused with an
IncompatibleCheckpointError naming it. The result is checked and turned into plain records:

- every entry a tensor (dtype savepoint holds, size, chunks that tile it exactly:
  :func:`savepoint.codecs.boxes.check_cover`) or bytes (``BYTE_IO``: a value DCP serialised
  with ``torch.save``);
- every chunk (and every bytes entry) located by ``storage_data``: a file of the checkpoint's
  directory (a plain name, no path), an offset and a length, without stream transforms;
- ``planner_data`` kept where it is the default planners' ``{fqn: (key, ...)}``, else dropped.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from savepoint.codecs import boxes
from savepoint.codecs.dtypes import DType
from savepoint.errors import CorruptCheckpointError, IncompatibleCheckpointError
from savepoint.formats._torch_archive import DTYPE_NAMES, Buildable, DTypeName, unpickle

__all__ = [
    "Chunk",
    "Entry",
    "Item",
    "MAX_BYTES",
    "Metadata",
    "decode",
]

MAX_BYTES = 256 << 20  # the largest .metadata read (a model of 10^5 chunks needs about 20 MiB)

_MAX_DIMS = 64
_MAX_ELEMENTS = 1 << 60  # what any shape may count (times an item size, still an int64 of bytes)
_MODULES = (
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.filesystem",
    "torch.distributed._shard.checkpoint.metadata",
    "torch.distributed._shard.checkpoint.filesystem",
)
_KINDS = (
    "Metadata",
    "TensorStorageMetadata",
    "BytesStorageMetadata",
    "ChunkStorageMetadata",
    "TensorProperties",
    "StorageMeta",
    "MetadataIndex",
    "_MEM_FORMAT_ENCODING",
    "_StorageInfo",
)
_HINT = (
    "; savepoint reads what dcp.save writes through DCP's default planners and FileSystemWriter "
    "(a checkpoint of HuggingFaceStorageWriter is a directory of safetensors files)"
)


class _Obj(Buildable):
    """An instance of an admitted class: the arguments it was made with and the state its
    pickle gave it; nothing of the class it stands for runs."""

    __slots__ = ("args", "state")
    args: tuple[Any, ...]
    state: Any

    def __new__(cls, *args: Any) -> _Obj:
        obj = object.__new__(cls)
        obj.args = args
        obj.state = None
        return obj

    def __setstate__(self, state: Any) -> None:
        self.state = state


_CLASSES: dict[str, type[_Obj]] = {name: type(name, (_Obj,), {"__slots__": ()}) for name in _KINDS}


class _Bad(Exception):
    pass


def _size(*args: Any) -> tuple[int, ...]:
    value = args[0] if args else ()
    if not isinstance(value, (tuple, list)) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        raise ValueError("a torch.Size of something other than integers")
    return tuple(value)


def _layout(name: Any) -> str:
    return str(name)


def _path(*parts: Any) -> str:
    return "/".join(str(p) for p in parts)


_ALLOWED: dict[tuple[str, str], Any] = {
    **{(m, k): c for m in _MODULES for k, c in _CLASSES.items()},
    ("torch", "Size"): _size,
    ("torch.serialization", "_get_layout"): _layout,
    ("collections", "OrderedDict"): dict,
    **{("pathlib", p): _path for p in ("Path", "PosixPath", "WindowsPath", "PurePosixPath")},
    **{("pathlib", p): _path for p in ("PureWindowsPath",)},
    **{("torch", n): DTypeName(n) for n in DTYPE_NAMES},
}


@dataclass(frozen=True)
class Item:
    """Where one stored item is: ``length`` bytes at ``offset`` of the file ``file``."""

    file: str
    offset: int
    length: int


@dataclass(frozen=True)
class Chunk:
    """One chunk of a tensor: the box it holds and the item storing it."""

    box: boxes.Box
    item: Item


@dataclass(frozen=True)
class Entry:
    """One entry of the state dict DCP saved: a tensor (``dtype`` set, its ``chunks``) or
    bytes (``dtype`` None, ``item`` set: a value DCP serialised with ``torch.save``)."""

    fqn: str
    dtype: DType | None
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...] = ()
    item: Item | None = None
    properties: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Metadata:
    entries: dict[str, Entry]
    planner_data: dict[str, list[str | int]] | None
    version: str | None


def _fields(obj: Any, kind: str, where: str) -> dict[str, Any]:
    """The state of a stand-in of ``kind`` as a dict of its fields."""
    if type(obj) is not _CLASSES[kind]:
        raise _Bad(f"{where} is a {type(obj).__name__}, not a {kind}")
    state: Any = obj.state
    if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
        state = {**(state[0] or {}), **state[1]}  # (dict, slots)
    if state is None:
        state = {}
    if not isinstance(state, dict):
        raise _Bad(f"{where}: a {kind} whose state is not its fields")
    return state


def _int(value: Any, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise _Bad(f"{where} is not a non-negative integer")
    return value


def _dims(value: Any, where: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or len(value) > _MAX_DIMS:
        raise _Bad(f"{where} is not a size")
    dims = tuple(_int(v, where) for v in value)
    if math.prod(dims) > _MAX_ELEMENTS:
        raise _Bad(f"{where} is {list(dims)}: more elements than any file holds")
    return dims


def _properties(obj: Any, fqn: str) -> tuple[DType, dict[str, Any]]:
    if type(obj) is not _CLASSES["TensorProperties"]:
        raise _Bad(f"{fqn}: its properties are not TensorProperties")
    state = obj.state
    if isinstance(state, tuple) and len(state) == 5:
        dtype, layout, requires_grad, _, pin_memory = state
    elif isinstance(state, dict):
        dtype, layout = state.get("dtype"), state.get("layout", "torch.strided")
        requires_grad, pin_memory = state.get("requires_grad"), state.get("pin_memory")
    else:
        raise _Bad(f"{fqn}: malformed TensorProperties")
    if not isinstance(dtype, DTypeName):
        raise _Bad(f"{fqn}: its dtype is not a torch dtype")
    found = dtype.dtype()
    if found is None:
        raise _Unsupported(f"{fqn} is a tensor of dtype {dtype}, which savepoint does not hold")
    if layout not in ("torch.strided", None):
        raise _Unsupported(f"{fqn} is a {layout} tensor; savepoint holds strided tensors")
    return found, {
        "requires_grad": bool(requires_grad),
        "pin_memory": bool(pin_memory),
        "layout": "strided",
        "memory_format": "contiguous_format",
    }


class _Unsupported(Exception):
    pass


def _storage(raw: Any) -> dict[tuple[str, tuple[int, ...] | None], Item]:
    if not isinstance(raw, dict):
        raise _Bad("its storage_data is not a mapping (not written by FileSystemWriter?)")
    out: dict[tuple[str, tuple[int, ...] | None], Item] = {}
    for index, info in raw.items():
        key = _fields(index, "MetadataIndex", "a storage_data key")
        fqn, offset = key.get("fqn"), key.get("offset")
        if not isinstance(fqn, str):
            raise _Bad("a storage_data key without a name")
        where = f"the storage of {fqn!r}"
        at = None if offset is None else _dims(offset, f"{where}'s offset")
        s = _fields(info, "_StorageInfo", where)
        name = s.get("relative_path")
        if not isinstance(name, str) or name in ("", ".", "..") or any(c in name for c in "/\\\0"):
            raise _Bad(f"{where} names {name!r}, not a file of the checkpoint's directory")
        if s.get("transform_descriptors"):
            raise _Unsupported(
                f"{where} went through stream transforms ({s['transform_descriptors']!r}), "
                "which savepoint does not read"
            )
        out[(fqn, at)] = Item(
            name, _int(s.get("offset"), f"{where}'s offset"), _int(s.get("length"), where)
        )
    return out


def _tensor(fqn: str, obj: Any, storage: dict[Any, Item]) -> Entry:
    state = _fields(obj, "TensorStorageMetadata", fqn)
    dtype, props = _properties(state.get("properties"), fqn)
    shape = _dims(state.get("size"), f"{fqn}'s size")
    raw_chunks = state.get("chunks")
    if not isinstance(raw_chunks, list):
        raise _Bad(f"{fqn}: its chunks are not a list")
    chunks = []
    for i, c in enumerate(raw_chunks):
        cs = _fields(c, "ChunkStorageMetadata", f"{fqn}'s chunk {i}")
        offsets = _dims(cs.get("offsets"), f"{fqn}'s chunk {i} offsets")
        sizes = _dims(cs.get("sizes"), f"{fqn}'s chunk {i} sizes")
        if len(offsets) != len(shape) or len(sizes) != len(shape):
            raise _Bad(f"{fqn}: chunk {i} has {len(offsets)} dimensions, the tensor {len(shape)}")
        item = storage.get((fqn, offsets))
        if item is None:
            raise _Bad(f"{fqn}: no storage for its chunk at {list(offsets)}")
        chunks.append(Chunk(tuple((o, o + n) for o, n in zip(offsets, sizes)), item))
    why = boxes.check_cover([c.box for c in chunks], shape)
    if why is not None:
        raise _Bad(f"{fqn}: its chunks do not tile its shape {list(shape)}: {why}")
    return Entry(fqn, dtype, shape, tuple(chunks), properties=props)


def _planner_data(raw: Any) -> dict[str, list[str | int]] | None:
    if not isinstance(raw, dict):
        return None
    out: dict[str, list[str | int]] = {}
    for k, v in raw.items():
        if not (
            isinstance(k, str)
            and isinstance(v, (tuple, list))
            and all(isinstance(p, (str, int)) and not isinstance(p, bool) for p in v)
        ):
            return None
        out[k] = list(v)
    return out


def _check(root: Any) -> Metadata:
    state = _fields(root, "Metadata", "the pickle")
    entries_raw = state.get("state_dict_metadata")
    if not isinstance(entries_raw, Mapping):
        raise _Bad("its state_dict_metadata is not a mapping")
    storage = _storage(state.get("storage_data"))
    entries: dict[str, Entry] = {}
    for fqn, md in entries_raw.items():
        if not isinstance(fqn, str):
            raise _Bad(f"an entry named by a {type(fqn).__name__}, not a string")
        if type(md) is _CLASSES["BytesStorageMetadata"]:
            item = storage.get((fqn, None))
            if item is None:
                raise _Bad(f"{fqn}: no storage for its bytes")
            entries[fqn] = Entry(fqn, None, (item.length,), item=item)
        else:
            entries[fqn] = _tensor(fqn, md, storage)
    version = state.get("version")
    return Metadata(
        entries,
        _planner_data(state.get("planner_data")),
        version if isinstance(version, str) else None,
    )


def decode(data: bytes, *, path: str, what: str) -> Metadata:
    """The checked contents of a ``.metadata`` file (see the module docstring); ``path`` is the
    checkpoint's directory, ``what`` names the file in messages."""
    root = unpickle(data, _ALLOWED, path=path, what=what, storages=False, hint=_HINT)
    try:
        return _check(root)
    except _Unsupported as exc:
        raise IncompatibleCheckpointError(f"{what}: {exc}", path=path) from None
    except _Bad as exc:
        raise CorruptCheckpointError(f"{what}: {exc}", path=path) from None
    except (TypeError, ValueError, RecursionError) as exc:  # unhashable keys, odd nesting
        raise CorruptCheckpointError(f"{what} is malformed: {exc}", path=path) from None
