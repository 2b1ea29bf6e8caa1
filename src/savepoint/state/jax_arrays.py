"""JAX adapter, save side. Imported only when the state already holds a ``jax.Array`` or a
container only JAX knows (``savepoint.state.arrays`` and ``savepoint.state.tree`` look for
``jax`` in ``sys.modules`` first), so ``import savepoint`` never imports jax.

Leaves: a ``jax.Array`` is stored as one whole tensor, its bytes in C order, whatever its
sharding. ``JaxSource`` reads them from the array's distinct addressable shards (``replica_id``
0): a replicated array is read once, not once per device, and a sharded one shard by shard,
each copied from its own host copy into the parts of the tensor its ``index`` covers (the
shards' boxes tile the array). A load can then place the tensor on any mesh
(:mod:`savepoint.state.jax_restore`). Typed PRNG keys (``jax.random.key``) are stored as their
``jax.random.key_data`` (uint32). Tracers (inside ``jit`` or ``grad``), deleted (donated)
arrays and arrays spread over several processes are refused with UnsupportedStateError.

Containers: a pytree node savepoint does not know itself (an ``nnx.Variable``, a
``flax.struct.dataclass`` such as ``TrainState``, any ``register_pytree_node`` class) is stored
as a dict of its children, keyed by their JAX key path entries (:func:`children`: a field or
attribute name, a dict key, an index); its static (non-pytree) fields are not stored. Dicts,
``FrozenDict`` and ``nnx.State`` (mappings), lists, tuples and NamedTuples (optax states) are
stored as savepoint stores them anyway.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy
import numpy as np

from savepoint.codecs import boxes, dtypes
from savepoint.codecs.dtypes import DType
from savepoint.errors import UnsupportedStateError

__all__ = [
    "JaxSource",
    "box_of",
    "check_restorable",
    "children",
    "is_key_array",
    "key_name",
]


def is_key_array(dtype: Any) -> bool:
    """Whether ``dtype`` is a typed PRNG key dtype (``key<fry>``)."""
    return bool(jax.numpy.issubdtype(dtype, jax.dtypes.prng_key))


def _refuse(arr: Any, key: str) -> None:
    where = key or "<root>"
    if isinstance(arr, jax.core.Tracer):
        raise UnsupportedStateError(
            f"{where}: a traced jax value (inside jit, grad or vmap) has no data to save; save "
            "outside the transformed function",
            key=key,
        )
    if arr.is_deleted():
        raise UnsupportedStateError(
            f"{where}: this jax.Array was deleted (donated to a jitted call?); save the array "
            "that call returned",
            key=key,
        )
    if not arr.is_fully_addressable:
        raise UnsupportedStateError(
            f"{where}: this jax.Array spans several processes (jax.distributed); savepoint "
            "saves arrays whose shards this process holds all of",
            key=key,
        )


def check_restorable(arr: Any, key: str) -> None:
    """Refuse a ``jax.Array`` restore target a load cannot place: a tracer, an array spread
    over several processes (its sharding, dtype and shape are all a load takes from it)."""
    if isinstance(arr, jax.core.Tracer) or not arr.is_fully_addressable:
        _refuse(arr, key)


def box_of(index: Sequence[slice], shape: Sequence[int]) -> boxes.Box:
    """The box a shard's ``index`` (a tuple of slices, ``None`` bounds for whole dimensions)
    selects in an array of ``shape``."""
    out = []
    for s, n in zip(index, shape):
        start, stop, step = s.indices(n)
        if step != 1:  # pragma: no cover - jax shardings slice with unit steps
            raise UnsupportedStateError(f"a shard index with step {step} cannot be stored")
        out.append((start, stop))
    return tuple(out)


class JaxSource:
    """A ``jax.Array``'s bytes for a writer (see :class:`savepoint.state.arrays.TensorSource`),
    assembled from its distinct shards (see the module docstring). A shard's host copy is made
    on the first :meth:`copy_to` that needs it (for arrays on the CPU backend, a view of the
    device buffer) and kept until :meth:`release`."""

    __slots__ = ("_array", "_host", "_id", "_shards", "dtype", "nbytes", "shape")

    kind = "numpy"  # loaded back as numpy without into=; placed by jax_restore with it

    def __init__(self, array: Any, key: str) -> None:
        _refuse(array, key)
        self._id = id(array)
        if is_key_array(array.dtype):
            array = jax.random.key_data(array)
        self.dtype: DType = dtypes.from_numpy(np.dtype(array.dtype), key)
        self.shape = tuple(int(n) for n in array.shape)
        self.nbytes = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize
        self._array = array
        self._shards: list[tuple[boxes.Box, Any]] | None = None
        self._host: dict[int, np.ndarray[Any, Any]] = {}

    def identity(self) -> tuple[Any, ...] | None:
        # The same jax.Array object twice in a state (tied weights) is stored once; arrays are
        # immutable, so the object stands for its data while the state is flattened.
        return None if self.nbytes == 0 else ("jax", self._id)

    def _distinct(self) -> list[tuple[boxes.Box, Any]]:
        if self._shards is None:
            shape = self.shape
            self._shards = [
                (box_of(s.index, shape), s.data)
                for s in self._array.addressable_shards
                if s.replica_id == 0
            ]
        return self._shards

    def _bytes(self, i: int) -> np.ndarray[Any, Any]:
        """Shard ``i``'s bytes on the host, shaped ``(*extents, itemsize)``."""
        host = self._host.get(i)
        if host is None:
            box, data = self._distinct()[i]
            flat = np.ascontiguousarray(np.asarray(data)).reshape(-1).view(np.uint8)
            host = self._host[i] = flat.reshape(*boxes.extents(box), self.dtype.itemsize)
        return host

    def copy_to(self, dst: np.ndarray[Any, Any], start: int) -> None:
        item = self.dtype.itemsize
        stop = start + dst.size
        first, last = start // item, -(-stop // item)
        if start % item or stop % item:  # a cut inside an element: through a scratch buffer
            scratch = np.empty((last - first) * item, dtype=np.uint8)
            self._fill(scratch, first, last)
            offset = start - first * item
            np.copyto(dst, scratch[offset : offset + dst.size])
            return
        self._fill(dst, first, last)

    def _fill(self, out: np.ndarray[Any, Any], first: int, last: int) -> None:
        """Elements ``[first, last)`` of the array in C order into the uint8 buffer ``out``."""
        item = self.dtype.itemsize
        shards = self._distinct()
        if len(shards) == 1 and boxes.is_full(shards[0][0], self.shape):
            np.copyto(out, self._bytes(0).reshape(-1)[first * item : last * item])
            return
        rows = out.reshape(-1, item)
        wanted = boxes.pieces(boxes.Flat(first, last), self.shape)
        for i, (box, _) in enumerate(shards):
            source = boxes.Piece(box, 0)
            for _, piece, common in boxes.overlaps([source], wanted):
                part = rows[piece.offset : piece.offset + boxes.volume(piece.box)]
                part = part.reshape(*boxes.extents(piece.box), item)
                part[boxes.relative(common, piece)] = self._bytes(i)[boxes.relative(common, source)]

    def release(self) -> None:
        self._host = {}


def key_name(entry: Any) -> str | int:
    """A JAX key path entry as a savepoint key: a dict key, an attribute name, an index."""
    for attribute in ("key", "name", "idx"):
        if hasattr(entry, attribute):
            value = getattr(entry, attribute)
            if isinstance(value, (str, int)) and not isinstance(value, bool):
                return value
            raise UnsupportedStateError(
                f"pytree key {entry!r} of type {type(value).__name__} cannot be stored; keys "
                "must be str or int"
            )
    raise UnsupportedStateError(f"pytree key {entry!r} cannot be stored")  # pragma: no cover


def children(obj: Any) -> list[tuple[str | int, Any]] | None:
    """``obj``'s children as JAX flattens it one level, keyed by :func:`key_name`; None when
    JAX takes ``obj`` for a leaf (no registered pytree node)."""
    try:
        found, _ = jax.tree_util.tree_flatten_with_path(obj, is_leaf=lambda x: x is not obj)
    except Exception as exc:  # a registered node whose flatten fails on this instance
        raise UnsupportedStateError(
            f"JAX cannot flatten this {type(obj).__module__}.{type(obj).__qualname__} ({exc})"
        ) from None
    if len(found) == 1 and not found[0][0] and found[0][1] is obj:
        return None
    return [(key_name(path[0]), child) for path, child in found]
