"""Orbax checkpoints (``orbax-checkpoint``: ``PyTreeCheckpointer``, ``StandardCheckpointer``, a
``CheckpointManager`` step), read through ``tensorstore``: ``pip install 'savepoint[orbax]'``.

An Orbax item directory holds ``_METADATA`` (JSON: the tree, each leaf's path and kind), its
arrays in a zarr store (zarr v2, or v3 with ``use_zarr3``) inside tensorstore's OCDBT key-value
database (``manifest.ocdbt``, ``ocdbt.process_*/``, ``d/``; or, without ``use_ocdbt``, one
directory per array), its strings in ``_strings.json``, and ``_CHECKPOINT_METADATA``. A
``CheckpointManager`` step directory holds ``_CHECKPOINT_METADATA`` and one item directory per
item (``default/`` for a single one).

- ``_METADATA`` is read with savepoint's bounded JSON parser; each leaf is placed by its
  ``key_metadata`` (a dict key, or a list index) into nested dicts and lists, as Orbax restores
  it (a tuple comes back a list).
- Arrays (``np.ndarray``, ``jax.Array``, sharded or not) are opened through tensorstore under
  their parameter names (the path joined with ``.``), their dtype and shape read from the zarr
  metadata; each is read whole when first copied (tensorstore decodes whole chunks; Orbax writes
  a shard per chunk) and dropped after: one tensor in memory at a time, as when Orbax restores.
- ``scalar`` leaves (Python and numpy numbers, bools) become plain values, ``string`` leaves
  come from ``_strings.json``; ``None``, ``Dict`` and ``List`` (empty containers) as they are.
  Any other kind is refused, naming it.

The tree's tensors are numpy arrays (``framework="auto"``; an Orbax checkpoint holds JAX or
numpy state). zarr chunks carry no checksums here: ``verify`` checks the structure and decodes
every array; a damaged chunk is what tensorstore's decompression reports. A directory with
``_METADATA`` of another layout (Orbax's msgpack ``checkpoint`` file of old) is refused.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

from savepoint.codecs import bounded_json, dtypes
from savepoint.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
)
from savepoint.formats._files import Materialized
from savepoint.formats._progress import Progress, Tally
from savepoint.info import CheckpointInfo, TensorInfo
from savepoint.state import tree as tree_mod
from savepoint.storage import local
from savepoint.storage.paths import local_path

__all__ = [
    "CHECKPOINT_METADATA",
    "LABEL",
    "METADATA",
    "OrbaxCheckpoint",
    "is_orbax",
    "open_checkpoint",
]

LABEL = "Orbax checkpoint"
METADATA = "_METADATA"
CHECKPOINT_METADATA = "_CHECKPOINT_METADATA"
_STRINGS = "_strings.json"
_MAX_JSON = 256 << 20
_SEQUENCE, _DICT = 1, 2  # orbax's KeyType
_ARRAYS = ("np.ndarray", "jax.Array")


def is_orbax(entries: Iterable[str]) -> bool:
    """Whether a directory holding ``entries`` is an Orbax checkpoint (an item directory, or a
    ``CheckpointManager`` step directory)."""
    names = set(entries)
    if CHECKPOINT_METADATA in names:
        return True
    return METADATA in names and bool(names & {"manifest.ocdbt", "_sharding", "d"})


class _BadJSON(ValueError):
    pass


def _tensorstore() -> Any:
    try:
        import tensorstore
    except ImportError:
        raise IncompatibleCheckpointError(
            "reading an Orbax checkpoint needs tensorstore: pip install 'savepoint[orbax]'"
        ) from None
    return tensorstore


def _json(path: str, what: str) -> Any:
    try:
        raw = local.read_small(path, cap=_MAX_JSON)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{path} is missing", path=path) from None
    try:
        return bounded_json.loads(raw, _BadJSON, what)
    except _BadJSON as exc:
        raise CorruptCheckpointError(str(exc), path=path) from None


class _Leaf:
    """One leaf of an item: its path in the tree, kind and parameter name."""

    __slots__ = ("keys", "kind", "name")

    def __init__(self, keys: tuple[str | int, ...], kind: str, name: str) -> None:
        self.keys, self.kind, self.name = keys, kind, name


def _leaves(meta: Any, where: str) -> tuple[list[_Leaf], bool, bool]:
    """The leaves ``_METADATA`` lists, and its ``use_ocdbt`` and ``use_zarr3``."""
    if not isinstance(meta, dict) or not isinstance(meta.get("tree_metadata"), dict):
        raise CorruptCheckpointError(f"{where} has no tree_metadata", path=where)
    out = []
    for _, entry in meta["tree_metadata"].items():
        keys_raw = entry.get("key_metadata") if isinstance(entry, dict) else None
        value = entry.get("value_metadata") if isinstance(entry, dict) else None
        if not isinstance(keys_raw, list) or not isinstance(value, dict):
            raise CorruptCheckpointError(f"{where}: a malformed tree_metadata entry", path=where)
        keys: list[str | int] = []
        for k in keys_raw:
            key, kind = (k.get("key"), k.get("key_type")) if isinstance(k, dict) else (None, None)
            if not isinstance(key, str) or kind not in (_SEQUENCE, _DICT):
                raise IncompatibleCheckpointError(
                    f"{where}: a key {k!r} that is neither a dict key nor a list index "
                    "(savepoint reads those)",
                    path=where,
                )
            if kind == _SEQUENCE and not key.isdigit():
                raise CorruptCheckpointError(f"{where}: a list index {key!r}", path=where)
            keys.append(int(key) if kind == _SEQUENCE else key)
        kind = value.get("value_type")
        if not isinstance(kind, str):
            raise CorruptCheckpointError(f"{where}: a leaf without a value_type", path=where)
        out.append(_Leaf(tuple(keys), kind, ".".join(map(str, keys))))
    return out, bool(meta.get("use_ocdbt", True)), bool(meta.get("use_zarr3", False))


_MAX_KEYS = 100  # path length of a leaf (savepoint's trees nest no deeper)


class _Seq(dict):  # type: ignore[type-arg]
    """A list being built: index -> item (Orbax lists its leaves sorted as strings)."""


class _Box:
    """A leaf's value, told apart from the containers built around it."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


def _place(root: dict[Any, Any], keys: tuple[str | int, ...], where: str) -> _Box:
    """A new leaf at ``keys`` below ``root`` (dicts, and :class:`_Seq` at list indices)."""
    if not keys or len(keys) > _MAX_KEYS:
        raise CorruptCheckpointError(f"{where}: a leaf at a path of {len(keys)} keys", path=where)
    node: Any = root
    for i, key in enumerate(keys[:-1]):
        if isinstance(node, _Seq) != isinstance(key, int):
            raise CorruptCheckpointError(f"{where}: leaves that do not nest", path=where)
        want = _Seq if isinstance(keys[i + 1], int) else dict
        child = node.setdefault(key, want())
        if type(child) is not want:
            raise CorruptCheckpointError(f"{where}: leaves that do not nest", path=where)
        node = child
    if isinstance(node, _Seq) != isinstance(keys[-1], int):
        raise CorruptCheckpointError(f"{where}: leaves that do not nest", path=where)
    if keys[-1] in node:
        raise CorruptCheckpointError(f"{where}: two leaves at one path", path=where)
    box = node[keys[-1]] = _Box(None)
    return box


def _finish(node: Any, where: str) -> Any:
    if isinstance(node, _Box):
        return node.value
    if isinstance(node, _Seq):
        if sorted(node) != list(range(len(node))):
            raise CorruptCheckpointError(f"{where}: a list with missing indices", path=where)
        return [_finish(node[i], where) for i in range(len(node))]
    return {k: _finish(v, where) for k, v in node.items()}


class _Array(Materialized):
    """An array of the item, read whole through tensorstore on its first copy."""

    def __init__(self, store: Any, where: str, name: str) -> None:
        dtype = dtypes.from_numpy(np.dtype(store.dtype.numpy_dtype), name)
        shape = tuple(int(n) for n in store.shape)
        if math.prod(shape) >= 1 << 60:
            raise CorruptCheckpointError(f"{where}: {name} has shape {list(shape)}", path=where)
        super().__init__(dtype, shape)
        self._store = store
        self._where = where
        self._name = name

    def make(self) -> np.ndarray[Any, Any]:
        try:
            array = np.asarray(self._store.read().result(), order="C")
        except MemoryError:
            raise
        except Exception as exc:  # tensorstore: a damaged chunk, a missing key...
            raise CorruptCheckpointError(
                f"{self._where}: {self._name} cannot be read: {exc}", path=self._where
            ) from None
        if array.shape != self.shape:
            raise CorruptCheckpointError(
                f"{self._where}: {self._name} changed shape", path=self._where
            )
        return array.reshape(-1).view(np.uint8)


class OrbaxCheckpoint:
    """An Orbax checkpoint (an item directory, or a step directory of items) opened for
    reading: its tree built (arrays lazy, scalars and strings read), see the module docstring."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._ts = _tensorstore()
        self._context = self._ts.Context({"cache_pool": {"total_bytes_limit": 64 << 20}})
        names = sorted(os.listdir(path))
        if METADATA in names:
            items = {"": path}
        else:
            items = {
                n: os.path.join(path, n)
                for n in names
                if os.path.isfile(os.path.join(path, n, METADATA))
            }
        if not items:
            raise IncompatibleCheckpointError(
                f"{path} holds no Orbax item (a directory with {METADATA}); name a step's item "
                "directory, or a step of a CheckpointManager",
                path=path,
            )
        self.arrays: dict[str, _Array] = {}
        whole = len(items) == 1 and next(iter(items)) in ("", "default")  # the item is the tree
        trees = {n: self._item((() if whole else (n,)), d) for n, d in items.items()}
        self._tree: Any = next(iter(trees.values())) if whole else trees
        self.items = [n for n in items if n]
        found = os.path.join(path, CHECKPOINT_METADATA)
        self.checkpoint_metadata = _json(found, found) if os.path.isfile(found) else None

    def _item(self, prefix: tuple[str, ...], directory: str) -> Any:
        where = os.path.join(directory, METADATA)
        leaves, ocdbt, zarr3 = _leaves(_json(where, where), where)
        strings: Any = {}
        if any(leaf.kind == "string" for leaf in leaves):
            strings = _json(os.path.join(directory, _STRINGS), os.path.join(directory, _STRINGS))
        root: dict[Any, Any] = {}
        boxes = [_place(root, leaf.keys, where) for leaf in leaves]  # the shape first
        for leaf, box in zip(leaves, boxes):
            box.value = self._value(directory, leaf, ocdbt, zarr3, strings)
            if isinstance(box.value, _Array):
                self.arrays[tree_mod.join(prefix + leaf.keys)] = box.value
        return _finish(root, where)

    def _open(self, directory: str, name: str, ocdbt: bool, zarr3: bool) -> Any:
        if ocdbt:
            kv: dict[str, Any] = {"driver": "ocdbt", "base": f"file://{directory}/", "path": name}
        else:
            if name in ("", ".", "..") or any(c in name for c in "/\\\0"):
                raise CorruptCheckpointError(
                    f"{directory}: an array named {name!r}", path=directory
                )
            kv = {"driver": "file", "path": os.path.join(directory, name)}
        spec = {"driver": "zarr3" if zarr3 else "zarr", "kvstore": kv}
        try:
            return self._ts.open(spec, open=True, read=True, context=self._context).result()
        except Exception as exc:  # tensorstore's errors: a missing array, malformed metadata...
            raise CorruptCheckpointError(
                f"{directory}: array {name!r} cannot be opened: {exc}", path=directory
            ) from None

    def _value(self, directory: str, leaf: _Leaf, ocdbt: bool, zarr3: bool, strings: Any) -> Any:
        if leaf.kind in _ARRAYS:
            return _Array(self._open(directory, leaf.name, ocdbt, zarr3), directory, leaf.name)
        if leaf.kind == "scalar":
            array = _Array(self._open(directory, leaf.name, ocdbt, zarr3), directory, leaf.name)
            if array.shape != () or array.dtype.kind not in "biuf":
                raise CorruptCheckpointError(
                    f"{directory}: scalar {leaf.name!r} is a {array.dtype.name}{list(array.shape)}",
                    path=directory,
                )
            return array.load()[()].item()
        if leaf.kind == "string":
            value = strings.get(leaf.name) if isinstance(strings, dict) else None
            if not isinstance(value, str):
                raise CorruptCheckpointError(
                    f"{directory}: string {leaf.name!r} is not in {_STRINGS}", path=directory
                )
            return value
        empty: dict[str, Callable[[], Any]] = {"None": lambda: None, "Dict": dict, "List": list}
        if leaf.kind in empty:
            return empty[leaf.kind]()
        raise IncompatibleCheckpointError(
            f"{directory}: {leaf.name!r} is a {leaf.kind!r} leaf, which savepoint does not read",
            path=directory,
        )

    label = "orbax"

    def tree(self) -> Any:
        """The tree, as Orbax restores it (see the module docstring)."""
        return self._tree

    def metadata(self) -> dict[str, Any]:
        return {"orbax": {"items": self.items, "checkpoint_metadata": self.checkpoint_metadata}}

    def describe(self) -> CheckpointInfo:
        tensors = [
            TensorInfo.make(key, a.dtype.name, a.shape, a.nbytes, "zarr", key)
            for key, a in self.arrays.items()
        ]
        values: dict[str, Any] = {}

        def walk(node: Any, path: tuple[Any, ...]) -> None:
            if isinstance(node, _Array):
                return
            if isinstance(node, dict) and node:
                for k, v in node.items():
                    walk(v, (*path, k))
            elif isinstance(node, list) and node:
                for i, v in enumerate(node):
                    walk(v, (*path, i))
            else:
                values[tree_mod.join(path)] = node

        walk(self._tree, ())
        return CheckpointInfo(
            path=self.path,
            format_version=None,
            writer="orbax",
            created="",
            metadata=self.metadata(),
            tensors=tuple(tensors),
            values=values,
            files={},
            format="orbax",
            notes=(
                "read through tensorstore; Orbax's zarr chunks carry no checksums: verify "
                "checks the structure and decodes every array",
            ),
        )

    def check(self, progress: Progress | None) -> None:
        tally = Tally(progress, sum(a.nbytes for a in self.arrays.values()))
        for a in self.arrays.values():
            tally.drain(a)


@contextlib.contextmanager
def open_checkpoint(path: str | os.PathLike[str]) -> Iterator[OrbaxCheckpoint]:
    """The Orbax checkpoint at ``path`` for the length of a ``with`` block."""
    yield OrbaxCheckpoint(os.path.abspath(local_path(path, what="Orbax checkpoint")))
