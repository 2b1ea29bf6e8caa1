"""JAX adapter, load side: ``sp.load(path, into=pytree)`` for a pytree holding ``jax.Array`` or
``jax.ShapeDtypeStruct`` leaves. Imported by the facade only when jax is imported already and
``into`` holds such a leaf (:func:`holds_jax`).

JAX arrays are immutable, so such a load cannot fill ``into`` in place. Instead:

1. :func:`unpack` flattens ``into`` with ``jax.tree_util`` and builds the *plain* target
   savepoint restores into: the same tree as a save of ``into`` walks (dicts for mappings and
   for pytree nodes savepoint does not know, keyed as :func:`savepoint.state.jax_arrays.children`
   keys them; lists for lists and tuples), with a fresh host array of the target's dtype and
   shape for each jax leaf (and for each numpy leaf, copied into it only once the whole load
   succeeded), and every other leaf as it is;
2. the facade restores that plain tree as any other (the planner reports every missing key and
   every shape or dtype mismatch before anything is read; only the tensors ``into`` names are
   read, checksums checked);
3. :meth:`Unpacked.finish` checks that every sequence kept its length, puts each host array on
   its target's devices with the target's sharding (``jax.make_array_from_callback``: each
   device receives its shard's slice, so a checkpoint saved on one mesh loads onto any other),
   rebuilds the pytree with ``into``'s own tree definition (so ``FrozenDict``, ``nnx.State``,
   optax's NamedTuples, ``TrainState`` come back as themselves, static fields included), and
   returns it. Where ``into``'s root is a mutable mapping or a list (``{"params": ...,
   "opt_state": ...}``) its entries are also replaced in place, which is how
   ``CheckpointManager.restore`` (which returns the step) hands the state over.

Memory: every leaf read is held on the host once before it is placed (the state's size), then
on its devices.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, MutableSequence
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from savepoint.errors import StateMismatchError, UnsupportedStateError
from savepoint.state import jax_arrays
from savepoint.state import tree as tree_mod
from savepoint.state.arrays import is_torch_tensor
from savepoint.state.stateful import is_stateful
from savepoint.state.tree import Key

__all__ = [
    "Unpacked",
    "holds_jax",
    "unpack",
]


def _is_target(leaf: Any) -> bool:
    return isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct))


def holds_jax(into: Any) -> bool:
    """Whether ``into`` has a ``jax.Array`` or ``jax.ShapeDtypeStruct`` leaf, looking through
    mappings, lists and tuples (walked here: JAX's flattening sorts dict keys, which fails for
    keys of mixed types that savepoint stores) and other JAX pytree nodes."""
    stack = [into]
    seen: set[int] = set()
    while stack:
        obj = stack.pop()
        if _is_target(obj):
            return True
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, Mapping):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
        elif not (
            obj is None
            or isinstance(obj, (str, bytes, int, float, np.ndarray))
            or is_torch_tensor(obj)
            or is_stateful(obj)  # its state_dict() is restored as any other's
        ):
            try:
                nodes = jax_arrays.children(obj)
            except Exception:  # a node JAX cannot flatten holds nothing a load could place
                nodes = None
            stack.extend(child for _, child in nodes or ())
    return False


class _Mark:
    """Stands for leaf ``i`` of ``into`` while its containers are walked."""

    __slots__ = ("i",)

    def __init__(self, i: int) -> None:
        self.i = i


@dataclass
class Unpacked:
    """``into`` taken apart (see the module docstring): :attr:`plain` to restore into, then
    :meth:`finish` to get the pytree back."""

    into: Any
    plain: Any
    leaves: list[Any]
    treedef: Any
    # Where each leaf's restored value is read from: (container, key) in ``plain``; None: the
    # root itself.
    slots: list[tuple[Any, Any] | None] = field(default_factory=list)
    hosts: dict[int, np.ndarray[Any, Any]] = field(default_factory=dict)
    # The lists made from sequences, with their key path and length, checked after the read.
    sequences: list[tuple[list[Any], str, int]] = field(default_factory=list)

    def finish(self, path: str) -> Any:
        problems = [
            (key, f"{len(seq)} items in the checkpoint, {n} in the target")
            for seq, key, n in self.sequences
            if len(seq) != n
        ]
        if problems:
            raise StateMismatchError(problems, path=path)
        values = []
        for i, leaf in enumerate(self.leaves):
            host = self.hosts.get(i)
            if host is not None and isinstance(leaf, np.ndarray):
                np.copyto(leaf, host, casting="no")
                values.append(leaf)
            elif host is not None:
                values.append(_place(leaf, host))
            else:
                slot = self.slots[i]
                values.append(self.plain if slot is None else slot[0][slot[1]])
        restored = jax.tree_util.tree_unflatten(self.treedef, values)
        return _update_root(self.into, restored)


def _update_root(into: Any, restored: Any) -> Any:
    """Replace the entries of a mutable root (a dict, an ``nnx.State``, a list) with the
    restored ones, and return what ``sp.load`` returns: ``into`` itself then, else the new
    pytree."""
    if isinstance(into, MutableMapping) and isinstance(restored, Mapping):
        for k in list(into):
            if restored[k] is not into[k]:
                into[k] = restored[k]
        return into
    if isinstance(into, MutableSequence) and isinstance(restored, list):
        into[:] = restored
        return into
    return restored


def _host_for(leaf: Any, key: str) -> np.ndarray[Any, Any]:
    """A fresh host array of the dtype and shape ``leaf`` is stored with."""
    if jax_arrays.is_key_array(leaf.dtype):
        data = jax.eval_shape(jax.random.key_data, leaf)
        return np.empty(data.shape, dtype=np.dtype(data.dtype))
    try:
        dtype = np.dtype(leaf.dtype)
    except TypeError:
        raise UnsupportedStateError(
            f"{key or '<root>'}: jax dtype {leaf.dtype} cannot be restored", key=key
        ) from None
    return np.empty(tuple(leaf.shape), dtype=dtype)


def _place(target: Any, host: np.ndarray[Any, Any]) -> Any:
    """``host`` as a jax.Array like ``target``: its sharding (an array's, a ShapeDtypeStruct's
    if it has one, else the default device), its weak type, and for a PRNG key target its key
    type."""
    sharding = getattr(target, "sharding", None)
    value: Any = host
    if jax_arrays.is_key_array(target.dtype):
        impl = (
            jax.random.key_impl(target)
            if isinstance(target, jax.Array)
            else target.dtype._impl  # a ShapeDtypeStruct of a key dtype
        )
        value = jax.random.wrap_key_data(value, impl=impl)
    if sharding is None:
        placed = jax.device_put(value)
    elif isinstance(value, np.ndarray):
        # Each device gets its own slice, made contiguous first (half the time of device_put
        # of the whole array for a column sharding).
        placed = jax.make_array_from_callback(host.shape, sharding, lambda i: _slice(host, i))
    else:
        placed = jax.device_put(value, sharding)
    return _weak(placed) if getattr(target, "weak_type", False) else placed


def _slice(host: np.ndarray[Any, Any], index: Any) -> np.ndarray[Any, Any]:
    """``host[index]`` as a C-contiguous array (a 0-d one stays 0-d)."""
    selection: Any = (*index, Ellipsis)
    part = host[selection]
    return part if part.flags.c_contiguous else np.ascontiguousarray(part)


def _weak(x: Any) -> Any:
    """``x`` weakly typed, as its target was (a scalar made from a Python number: the step of
    a jitted ``TrainState``, ``inject_hyperparams``' rates), so it promotes as it did (a weak
    float32 times bfloat16 stays bfloat16) and a jitted function sees the same types. Through
    JAX's own conversion, which no public function exposes; without it (another JAX version),
    the array stays strongly typed."""
    try:
        from jax._src.lax.lax import _convert_element_type
    except ImportError:  # pragma: no cover - a JAX without it
        return x
    return _convert_element_type(x, weak_type=True)


def unpack(into: Any) -> Unpacked:
    """Step 1 of the module docstring."""
    try:
        leaves, treedef = jax.tree_util.tree_flatten(into)
        marked = jax.tree_util.tree_unflatten(treedef, [_Mark(i) for i in range(len(leaves))])
    except Exception as exc:  # dict keys JAX cannot sort; a node checking its children's types
        raise UnsupportedStateError(
            f"cannot restore into this pytree of jax arrays: JAX cannot take it apart and "
            f"rebuild it ({exc}); dict keys must be of one type"
        ) from None
    out = Unpacked(into=into, plain=None, leaves=leaves, treedef=treedef)
    out.slots = [None] * len(leaves)

    def target(mark: _Mark, key: str) -> Any:
        leaf = leaves[mark.i]
        if _is_target(leaf):
            if isinstance(leaf, jax.Array):
                jax_arrays.check_restorable(leaf, key)
            host = out.hosts[mark.i] = _host_for(leaf, key)
            return host
        if isinstance(leaf, np.ndarray) and leaf.flags.writeable:
            host = out.hosts[mark.i] = np.empty_like(leaf, order="C")
            return host
        return leaf

    def convert(obj: Any, path: tuple[Key, ...]) -> Any:
        if isinstance(obj, _Mark):
            return target(obj, tree_mod.join(path))
        if isinstance(obj, Mapping):
            items: list[tuple[Key, Any]] = list(obj.items())
            made: Any = {}
        elif isinstance(obj, (list, tuple)):
            items = list(enumerate(obj))
            made = [None] * len(items)
            out.sequences.append((made, tree_mod.join(path), len(items)))
        else:
            nodes = jax_arrays.children(obj)
            if nodes is None:  # pragma: no cover - every leaf is a mark
                return obj
            items, made = list(nodes), {}
        for k, child in items:
            made[k] = convert(child, (*path, k))
            if isinstance(child, _Mark):
                out.slots[child.i] = (made, k)
        return made

    out.plain = convert(marked, ())
    return out
