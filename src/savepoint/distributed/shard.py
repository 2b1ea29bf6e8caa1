"""How a rank says which part of the state it holds.

In a state passed to ``sp.save(path, state, process_group=pg)`` (and as targets of
``sp.load(path, into=state, process_group=pg)``):

- a plain tensor is **replicated**: every rank that has it holds all of it; one rank writes it
  (all ranks must agree on its dtype and shape);
- ``Shard(local, global_shape, offsets)`` is a **box** of a tensor split along one or more
  dimensions (tensor parallel): ``local`` holds elements ``offsets .. offsets + local.shape``;
  ``Shard.split(local, dim, rank, world)`` builds one for ``torch.chunk``-style splits;
- ``FlatShard(local, global_shape, start)`` is a **flat range** (FSDP-style flat parameters): the
  1-D ``local`` holds elements ``[start, start + local.size)`` of the tensor flattened in C order;
- ``Partitioned(mapping)`` is **ZeRO-style partitioned** state: each rank passes the entries it
  owns, the checkpoint holds the union, each key on exactly one rank (to load, each rank passes
  the keys it owns now, under any partition);
- a torch ``DTensor`` is read as a Shard (``Shard(dim)`` placements) or a replicated tensor
  (``Replicate``), from its placements; ``Partial`` and strided placements must be redistributed
  first.

``Shard``, ``FlatShard`` and ``Partitioned`` are saved through the Stateful protocol (their
``state_dict()`` is the local tensor plus a one-string layout, ``"4,6@2,0"``), so every path that
flattens a state carries them unchanged; :mod:`savepoint.distributed.save` recognises their nodes
by type name. This module never imports torch.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, MutableMapping, MutableSequence, Sequence
from typing import Any

import numpy as np

from savepoint.codecs import boxes, dtypes
from savepoint.distributed.layout import Grid, grid_box
from savepoint.errors import UnsupportedStateError
from savepoint.state.stateful import is_stateful
from savepoint.state.wrappers import unwrap

__all__ = [
    "FLAT_SHARD",
    "FlatShard",
    "PARTITIONED",
    "Partitioned",
    "SHARD",
    "Shard",
    "Swap",
    "dtensor_box",
    "from_dtensor",
    "from_dtensors",
    "has_targets",
    "is_dtensor",
    "numel",
    "parse_layout",
    "placeholder",
    "restore",
    "swap_targets",
    "type_name",
]


def _int(x: Any, what: str) -> int:
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
        raise UnsupportedStateError(f"{what} must be an integer, not {x!r}")
    return int(x)


def _checked_grid(grid: Any, ndim: int) -> Grid:
    """``grid`` with plain integers, checked: a mesh of positive sizes, a coordinate inside it,
    and per mesh dimension a dimension of the tensor or None (else UnsupportedStateError)."""
    if not isinstance(grid, Grid):
        raise UnsupportedStateError(f"Shard: grid must be a layout.Grid, not {type(grid).__name__}")
    if not all(isinstance(x, (tuple, list)) for x in (grid.mesh, grid.coord, grid.dims)):
        raise UnsupportedStateError(f"Shard: grid {grid!r} must hold tuples")
    mesh = tuple(_int(n, "Shard: grid.mesh") for n in grid.mesh)
    coord = tuple(_int(c, "Shard: grid.coord") for c in grid.coord)
    dims = tuple(None if d is None else _int(d, "Shard: grid.dims") for d in grid.dims)
    if not (
        len(mesh) == len(coord) == len(dims) > 0
        and all(0 <= c < n for c, n in zip(coord, mesh))
        and all(d is None or 0 <= d < ndim for d in dims)
    ):
        raise UnsupportedStateError(
            f"Shard: grid {grid!r} needs, per mesh dimension, a positive mesh size, a coordinate "
            f"inside it and a dimension of the {ndim}-dimensional tensor (or None)"
        )
    return Grid(mesh, coord, dims)


def _shape(local: Any) -> tuple[int, ...]:
    shape = getattr(local, "shape", None)
    if shape is None or not hasattr(local, "dtype"):
        raise UnsupportedStateError(
            f"a shard's local part must be a numpy array or torch tensor, not {type(local).__name__}"
        )
    return tuple(int(n) for n in shape)


class _Described:
    """Stateful plumbing shared by the descriptions: saved as plain data, never loaded as such."""

    __slots__ = ()

    def load_state_dict(self, state: Any) -> None:
        raise TypeError(
            f"{type(self).__name__} is a sharding description, restored by sp.load(into=...) "
            "itself; put it in a dict or list of the state you load into, not inside an object's "
            "state_dict()"
        )


class Shard(_Described):
    """A box of a tensor of ``global_shape`` held by this rank: ``local`` (numpy or torch, any
    device) holds elements ``offsets[d] .. offsets[d] + local.shape[d]`` on every dimension."""

    __slots__ = ("global_shape", "grid", "local", "offsets")

    def __init__(
        self,
        local: Any,
        global_shape: Sequence[int],
        offsets: Sequence[int],
        *,
        grid: Grid | None = None,
    ) -> None:
        shape = _shape(local)
        self.local = local
        self.global_shape = tuple(_int(n, "global_shape") for n in global_shape)
        self.offsets = tuple(_int(o, "offsets") for o in offsets)
        # ``grid``: the mesh placements this box follows from (a DTensor's), which make a state
        # of such Shards a regular layout (savepoint.distributed.layout): planned compactly.
        self.grid = grid if grid is None else _checked_grid(grid, len(self.global_shape))
        if not (len(shape) == len(self.global_shape) == len(self.offsets)):
            raise UnsupportedStateError(
                f"Shard: local shape {list(shape)}, global_shape {list(self.global_shape)} and "
                f"offsets {list(self.offsets)} must have one entry per dimension"
            )
        if not boxes.inside(self.box, self.global_shape) or min(self.global_shape, default=0) < 0:
            raise UnsupportedStateError(
                f"Shard: a local part of shape {list(shape)} at offsets {list(self.offsets)} does "
                f"not fit in global_shape {list(self.global_shape)}"
            )
        if grid is not None:
            want = grid_box(self.global_shape, grid.mesh, grid.coord, grid.dims)
            if want != self.box:
                raise UnsupportedStateError(
                    f"Shard: the box {boxes.show(self.box)} is not the one its grid "
                    f"{grid.text()} gives ({boxes.show(want)})"
                )

    @property
    def box(self) -> boxes.Box:
        return tuple((o, o + n) for o, n in zip(self.offsets, _shape(self.local)))

    @classmethod
    def split(
        cls, local: Any, dim: int, rank: int, world: int, *, size: int | None = None
    ) -> Shard:
        """This rank's piece of a tensor split along ``dim`` over ``world`` ranks like
        ``torch.chunk`` (and DTensor ``Shard(dim)``): pieces of ``ceil(size / world)``, the last
        ones shorter or empty. ``size`` (the global length along ``dim``) defaults to
        ``local.shape[dim] * world``, an even split."""
        shape = _shape(local)
        if not 0 <= dim < len(shape) or not 0 <= rank < world:
            raise UnsupportedStateError(
                f"Shard.split: dim {dim} of a {len(shape)}-d tensor, rank {rank} of {world}"
            )
        n = shape[dim]
        if size is None:
            size, start = n * world, n * rank
        else:
            chunk = -(-size // world) if world else 0
            start = min(rank * chunk, size)
            expected = max(0, min(chunk, size - start))
            if n != expected:
                raise UnsupportedStateError(
                    f"Shard.split: rank {rank} of {world} holds {expected} of {size} along dim "
                    f"{dim} (torch.chunk), the local part has {n}"
                )
        global_shape = (*shape[:dim], size, *shape[dim + 1 :])
        offsets = tuple(start if d == dim else 0 for d in range(len(shape)))
        return cls(local, global_shape, offsets)

    def state_dict(self) -> dict[str, Any]:
        # One string for the layout keeps the flattened node small (see the module docstring).
        out = {"local": self.local, "layout": _layout(self.global_shape, self.offsets)}
        if self.grid is not None:
            out["grid"] = self.grid.text()
        return out

    def __repr__(self) -> str:
        return f"Shard({boxes.show(self.box)} of {list(self.global_shape)})"


class FlatShard(_Described):
    """Elements ``[start, start + local.size)`` of a tensor of ``global_shape`` flattened in C
    order, held in the 1-D ``local`` (FSDP-style flat parameters; padding is not part of it)."""

    __slots__ = ("global_shape", "local", "start")

    def __init__(self, local: Any, global_shape: Sequence[int], start: int) -> None:
        shape = _shape(local)
        if len(shape) != 1:
            raise UnsupportedStateError(f"FlatShard: local must be 1-D, not of shape {list(shape)}")
        self.local = local
        self.global_shape = tuple(_int(n, "global_shape") for n in global_shape)
        self.start = _int(start, "start")
        if not boxes.inside(self.region, self.global_shape):
            raise UnsupportedStateError(
                f"FlatShard: elements {self.start}..{self.start + shape[0]} do not fit in a "
                f"tensor of shape {list(self.global_shape)}"
            )

    @property
    def region(self) -> boxes.Flat:
        return boxes.Flat(self.start, self.start + _shape(self.local)[0])

    @staticmethod
    def bounds(numel: int, rank: int, world: int) -> tuple[int, int]:
        """``[start, stop)`` of rank ``rank`` when ``numel`` elements are split in ``world``
        contiguous chunks of ``ceil(numel / world)`` (the last ones shorter or empty)."""
        chunk = -(-numel // world)
        start = min(rank * chunk, numel)
        return start, min(start + chunk, numel)

    def state_dict(self) -> dict[str, Any]:
        return {"local": self.local, "layout": _layout(self.global_shape, (self.start,))}

    def __repr__(self) -> str:
        return f"FlatShard({boxes.show(self.region)} of {list(self.global_shape)})"


class Partitioned(_Described):
    """The entries of a mapping that this rank owns (ZeRO-style optimizer state, per-rank RNG
    state under rank-specific keys). Saved: the union over ranks, each key owned by one rank.
    Loaded into: this rank's entries are read, whatever the world size was at save time."""

    __slots__ = ("mapping",)

    def __init__(self, mapping: Mapping[Any, Any]) -> None:
        if not isinstance(mapping, Mapping):
            raise UnsupportedStateError(
                f"Partitioned takes a mapping of the entries this rank owns, not "
                f"{type(mapping).__name__}"
            )
        self.mapping = mapping

    def state_dict(self) -> dict[Any, Any]:
        return dict(self.mapping)

    def __repr__(self) -> str:
        return f"Partitioned({len(self.mapping)} entries)"


def _layout(global_shape: Sequence[int], starts: Sequence[int]) -> str:
    """``"4,6@2,0"``: the global shape, then the offsets (a Shard) or the start (a FlatShard)."""
    return ",".join(map(str, global_shape)) + "@" + ",".join(map(str, starts))


def parse_layout(text: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The (global shape, starts) written by a Shard's or FlatShard's ``state_dict``."""
    shape, _, starts = text.partition("@")
    return (
        tuple(int(n) for n in shape.split(",") if n),
        tuple(int(n) for n in starts.split(",") if n),
    )


def type_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


SHARD = type_name(Shard)
FLAT_SHARD = type_name(FlatShard)
PARTITIONED = type_name(Partitioned)


# ---------------------------------------------------------------------------------------------
# DTensor
# ---------------------------------------------------------------------------------------------


def is_dtensor(obj: Any) -> bool:
    module = sys.modules.get("torch.distributed.tensor")
    cls = getattr(module, "DTensor", None) if module is not None else None
    return cls is not None and isinstance(obj, cls)


def from_dtensor(dt: Any, key: str = "") -> Any:
    """A Shard for a DTensor sharded with ``Shard(dim)`` placements; its local tensor when it is
    replicated on every mesh dimension."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor import Shard as ShardPlacement

    for p in dt.placements:
        if type(p) not in (Replicate, ShardPlacement):
            raise UnsupportedStateError(
                f"{key or '<root>'}: DTensor placement {p} cannot be saved as it is; "
                "redistribute to Shard(dim) or Replicate placements first",
                key=key,
            )
    local = dt.to_local()
    if all(type(p) is Replicate for p in dt.placements):
        return local
    global_shape = tuple(int(n) for n in dt.shape)
    box = dtensor_box(global_shape, dt.device_mesh, dt.placements)
    if box is None or boxes.extents(box) != tuple(local.shape):
        # Not a layout the chunk rule describes (or this rank is outside the mesh): ask torch.
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        local_shape, offsets = compute_local_shape_and_global_offset(
            dt.shape, dt.device_mesh, dt.placements
        )
        if tuple(local.shape) != tuple(local_shape):  # pragma: no cover - torch invariant
            raise UnsupportedStateError(
                f"{key or '<root>'}: DTensor local shape {list(local.shape)} differs from its "
                f"placements' {list(local_shape)}",
                key=key,
            )
        return Shard(local, global_shape, tuple(offsets))
    grid = None
    mesh = dt.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is not None:
        dims = tuple(p.dim % len(global_shape) if p.is_shard() else None for p in dt.placements)
        grid = Grid(tuple(int(n) for n in mesh.shape), tuple(int(c) for c in coordinate), dims)
    return Shard(local, global_shape, tuple(start for start, _ in box), grid=grid)


def dtensor_box(shape: tuple[int, ...], mesh: Any, placements: Sequence[Any]) -> boxes.Box | None:
    """This rank's box of a DTensor with ``Shard(dim)`` / ``Replicate`` placements: each mesh
    dimension, left to right, splits the current piece along its tensor dimension like
    ``torch.chunk``. (torch's own helper allocates an ``arange`` as long as the dimension.)"""
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return None
    start = [0] * len(shape)
    size = list(shape)
    for i, p in enumerate(placements):
        if not p.is_shard():
            continue
        d = p.dim % len(shape)
        chunk = -(-size[d] // mesh.size(i))
        first = min(coordinate[i] * chunk, size[d])
        size[d] = max(0, min(chunk, size[d] - first))
        start[d] += first
    return tuple((a, a + n) for a, n in zip(start, size))


class _StatefulView:
    """Stands in for a Stateful while flattening: its state_dict() has DTensors converted."""

    __slots__ = ("_active", "_obj")

    def __init__(self, obj: Any, active: set[int]) -> None:
        self._obj = obj
        self._active = active

    def state_dict(self) -> Any:
        if id(self._obj) in self._active:
            raise UnsupportedStateError("the state contains a reference cycle")
        self._active.add(id(self._obj))
        try:
            return _convert(self._obj.state_dict(), self._active)
        finally:
            self._active.discard(id(self._obj))

    def load_state_dict(self, state: Any) -> Any:  # pragma: no cover - never loaded through
        return self._obj.load_state_dict(state)


_VIEW_TYPES: dict[type, type] = {}


def _view_of(obj: Any, active: set[int]) -> Any:
    # The manifest records a Stateful's type by module and qualified name; a subclass carrying
    # the original's names keeps that record identical to an unconverted save.
    cls = type(obj)
    view = _VIEW_TYPES.get(cls)
    if view is None:
        view = type(
            cls.__name__,
            (_StatefulView,),
            {"__module__": cls.__module__, "__qualname__": cls.__qualname__, "__slots__": ()},
        )
        _VIEW_TYPES[cls] = view
    return view(obj, active)


def from_dtensors(state: Any) -> Any:
    """``state`` with every DTensor replaced by its Shard (or local tensor when replicated),
    inside containers and Stateful objects alike; no tensor data is copied. ``sp.save`` with a
    process group does this itself; call it before handing a state holding DTensors to an
    ``AsyncCheckpointer`` or ``CheckpointManager(async_save=True)``."""
    if "torch.distributed.tensor" not in sys.modules:
        return state  # no DTensor can exist
    return _convert(state, set())


def _convert(obj: Any, active: set[int]) -> Any:
    if is_dtensor(obj):
        return from_dtensor(obj)
    if isinstance(obj, (str, bytes, bytearray, memoryview, np.ndarray)) or obj is None:
        return obj
    if isinstance(obj, (Shard, FlatShard)):
        return obj
    if isinstance(obj, Partitioned):
        return Partitioned(_convert(obj.mapping, active))
    if isinstance(obj, (Mapping, list, tuple)):
        if id(obj) in active:
            raise UnsupportedStateError("the state contains a reference cycle")
        active.add(id(obj))
        try:
            if isinstance(obj, Mapping):
                return {k: _convert(v, active) for k, v in obj.items()}
            items = [_convert(v, active) for v in obj]
            return items if isinstance(obj, list) else tuple(items)
        finally:
            active.discard(id(obj))
    if is_stateful(obj) and not _is_tensor(obj):
        # A compiled or DDP model is saved under its inner model's keys, as without a group.
        return _view_of(unwrap(obj), active)
    return obj


def _is_tensor(obj: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


# ---------------------------------------------------------------------------------------------
# load targets
# ---------------------------------------------------------------------------------------------


def has_targets(into: Any) -> bool:
    """Whether ``into`` holds Shard, FlatShard, Partitioned or DTensor targets, looking through
    dicts, lists and tuples (not inside Stateful objects: pass ``process_group`` for those)."""
    stack = [into]
    seen: set[int] = set()
    while stack:
        obj = stack.pop()
        if isinstance(obj, (Shard, FlatShard, Partitioned)) or is_dtensor(obj):
            return True
        if isinstance(obj, (Mapping, list, tuple)) and id(obj) not in seen:
            seen.add(id(obj))
            stack.extend(obj.values() if isinstance(obj, Mapping) else obj)
    return False


def placeholder(spec: Shard | FlatShard) -> np.ndarray[Any, Any]:
    """A stand-in target with the global shape and dtype of ``spec`` and no memory of its own,
    so the generic restore planner checks keys, shapes and dtypes against the checkpoint."""
    local = spec.local
    if isinstance(local, np.ndarray):
        d = dtypes.from_numpy(local.dtype, "")
    else:
        d = dtypes.from_torch(local.dtype, "")
    base = np.zeros(1, dtype=d.numpy)
    shape = spec.global_shape
    return np.lib.stride_tricks.as_strided(base, shape=shape, strides=(0,) * len(shape))


Swap = tuple[Any, Any, Any]  # (container, key, original value)


def swap_targets(into: Any) -> tuple[Any, list[Swap], dict[int, Shard | FlatShard]]:
    """Put placeholders in place of Shard and FlatShard targets and the owned mapping in place of
    each Partitioned, inside ``into``'s dicts and lists (undone by :func:`restore`).

    Returns the root to plan with, the swaps made, and the sharded target behind each
    placeholder (by ``id``)."""
    swaps: list[Swap] = []
    specs: dict[int, Shard | FlatShard] = {}

    def substitute(value: Any) -> Any:
        if isinstance(value, (Shard, FlatShard)):
            ph = placeholder(value)
            specs[id(ph)] = value
            return ph
        if isinstance(value, Partitioned):
            walk(value.mapping)
            return value.mapping
        walk(value)
        return value

    def walk(obj: Any) -> None:
        if isinstance(obj, MutableMapping):
            for k, v in list(obj.items()):
                new = substitute(v)
                if new is not v:
                    swaps.append((obj, k, v))
                    obj[k] = new
        elif isinstance(obj, MutableSequence):
            for i, v in enumerate(list(obj)):
                new = substitute(v)
                if new is not v:
                    swaps.append((obj, i, v))
                    obj[i] = new
        elif isinstance(obj, (tuple, Mapping)):
            items = obj.values() if isinstance(obj, Mapping) else obj
            for v in items:
                if isinstance(v, (Shard, FlatShard, Partitioned)):
                    raise UnsupportedStateError(
                        f"{type(v).__name__} targets must sit in dicts or lists (a "
                        f"{type(obj).__name__} cannot be updated in place)"
                    )
                walk(v)

    try:
        root = substitute(into)
    except BaseException:
        restore(swaps)
        raise
    return root, swaps, specs


def restore(swaps: list[Swap]) -> None:
    for container, key, value in reversed(swaps):
        container[key] = value


def numel(shape: Sequence[int]) -> int:
    return math.prod(shape)
