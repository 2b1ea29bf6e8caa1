"""Planning ``load(into=...)``: match the saved tree against live objects, with no I/O.

The plan says which saved tensors land in which existing tensors (read in place), which must be
created fresh, and every problem found (missing keys, shape or dtype disagreements, wrong types).
The caller checks ``problems`` before reading anything, so a mismatch modifies nothing. After the
reads, ``finish(get)`` puts plain values and fresh tensors into their containers and calls
``load_state_dict`` on every Stateful, innermost first.

Two modes:
- partial (outside any Stateful): ``into`` may cover only part of the checkpoint; saved entries it
  does not mention are not read; entries it has that the checkpoint lacks are problems.
- complete (inside a Stateful): the object's ``load_state_dict`` receives the whole saved subtree;
  its current ``state_dict()`` only supplies tensors to fill in place. torch modules and optimizers
  are checked up front: a shape or dtype mismatch is a problem, and for a ``nn.Module`` so are
  missing and unexpected keys (``load_state_dict`` would raise them only after other parameters
  were already overwritten; an optimizer's would not check shapes at all). For any other object a
  saved array that does not fit the current one is loaded fresh and left to its ``load_state_dict``.

What training scripts hold (see docs/training-state.md, "State from real training scripts"):
- a ``torch.compile``, DDP or DataParallel wrapper is restored through the model it wraps
  (:mod:`savepoint.state.wrappers`); a module's saved keys, or a plain dict of tensors, that differ
  from the target's only by a uniform wrapper prefix (``module.``, ``_orig_mod.``) are renamed;
- a dataclass target takes a saved dict of its fields: every field must be saved and every saved
  key must be a field. A mutable one is updated in place (``setattr``); a frozen one is rebuilt
  with ``dataclasses.replace`` and put into its parent's slot, which must then be assignable (a
  dict, a list, a mutable dataclass, a tuple that is itself remade): at the root, or in a
  read-only mapping, that is a problem unless nothing differs. Tuples (and namedtuples) are
  immutable values too, and are remade the same way;
- a saved 0-d tensor restores into a Python (or numpy) scalar, and a saved scalar fills a 0-d
  tensor, when the conversion is exact (:mod:`savepoint.state._scalars`).
"""

from __future__ import annotations

import dataclasses as dc
import sys
from collections.abc import Callable, Mapping, MutableMapping, MutableSequence
from dataclasses import dataclass, field
from typing import Any, Literal

from savepoint.codecs.manifest import TensorRecord
from savepoint.errors import StateMismatchError
from savepoint.state import _scalars, wrappers
from savepoint.state import tree as tree_mod
from savepoint.state.arrays import describe
from savepoint.state.stateful import is_stateful
from savepoint.state.tree import Key, Node

__all__ = [
    "Getter",
    "Mode",
    "Plan",
    "Planner",
    "Thunk",
    "level_hints",
    "mismatch",
    "needs_new",
    "plan",
]

Getter = Callable[[str, str], Any]
# False: partial (outside any Stateful). Inside one: "checked" (torch modules and optimizers:
# shape and dtype mismatches are problems) or "lenient" (other objects: a mismatching array is
# loaded fresh and handed to the object's load_state_dict, which decides).
Mode = bool | Literal["checked", "lenient"]
Thunk = Callable[[Getter], Any]
_MISSING: Any = object()


@dataclass
class Plan:
    inplace: list[tuple[str, Any, str]] = field(default_factory=list)  # (ref, target, key path)
    fresh: set[str] = field(default_factory=set)
    problems: list[tuple[str, str]] = field(default_factory=list)
    # What may explain some problems: a key of the target a saved key is a likely typo of.
    hints: list[str] = field(default_factory=list)
    finish: Thunk = lambda get: None

    @property
    def refs(self) -> set[str]:
        return self.fresh | {ref for ref, _, _ in self.inplace}


def _is_module(obj: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.nn.Module)


def _is_torch_object(obj: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, (torch.nn.Module, torch.optim.Optimizer))


def _type(obj: Any) -> str:
    return type(obj).__name__


def _is_dataclass(obj: Any) -> bool:
    return dc.is_dataclass(obj) and not isinstance(obj, type)


def _is_frozen(obj: Any) -> bool:
    return _is_dataclass(obj) and bool(type(obj).__dataclass_params__.frozen)


def _rebuild(obj: Any, values: Mapping[str, Any]) -> Any:
    """A new instance of ``obj``'s dataclass with the restored field ``values``: init fields go
    through ``dataclasses.replace`` (so ``__init__`` and ``__post_init__`` run); fields with
    ``init=False`` are then set to their saved values, as a frozen class's own ``__init__`` sets
    its fields (``object.__setattr__``)."""
    fields = dc.fields(obj)
    new = dc.replace(obj, **{f.name: values[f.name] for f in fields if f.init and f.name in values})
    for f in fields:
        if not f.init and f.name in values:
            object.__setattr__(new, f.name, values[f.name])
    return new


def _remakeable(obj: Any) -> bool:
    """A tuple (or namedtuple) that restoring replaces by a new one, where its slot allows."""
    return type(obj) is tuple or (isinstance(obj, tuple) and hasattr(type(obj), "_make"))


def _remake(obj: Any, values: Any) -> Any:
    return tuple(values) if type(obj) is tuple else type(obj)._make(values)


def _tensor_dict(node: Node, target: Mapping[Any, Any]) -> bool:
    """A saved dict of tensors matched against a non-empty dict of tensors (a plain state dict)."""
    return (
        bool(target)
        and all(child["t"] == "tensor" for _, child in node["items"])
        and all(describe(v) is not None for v in target.values())
    )


def needs_new(child: Node, current: Any) -> bool:
    """Whether restoring ``child`` over ``current`` gives another object, which the parent must
    then assign: a plain value that differs (in value or type), a tensor for a non-tensor, or a
    frozen dataclass with such a field. Arrays, tensors, containers and mutable dataclasses are
    filled in place."""
    t = child["t"]
    if t == "tensor":
        return describe(current) is None
    if t in ("value", "float", "bytes"):
        if describe(current) is not None:
            return False  # a 0-d target is filled in place (anything else is a problem anyway)
        saved = tree_mod.plain_value(child)
        if type(saved) is not type(current):
            return True
        return not (saved == current or (saved != saved and current != current))
    if t in ("list", "tuple") and _remakeable(current):
        items = child["items"]
        if len(items) != len(current):
            return True
        return any(needs_new(c, x) for c, x in zip(items, current))
    if t == "dict" and _is_frozen(current):
        names = {f.name for f in dc.fields(current)}
        return any(
            k in names and needs_new(c, getattr(current, k, _MISSING)) for k, c in child["items"]
        )
    return False


_TYPOS = 3  # keys of one dict missing from the checkpoint that may each be a typo; more is not
_NEAR_NAMES = 5_000  # saved names a typo is compared with, at most


def _near(key: Any, candidates: list[Any], missing: int) -> str | None:
    """The name among ``candidates`` ``key`` is likely a typo of (difflib, ratio 0.75 or
    more), or None; never when ``missing`` keys of the dict are absent (more than
    :data:`_TYPOS`: a renamed state, not typos) or the names are too many to compare."""
    names = [c for c in candidates if isinstance(c, str)]
    if not isinstance(key, str) or not names or missing > _TYPOS or len(names) > _NEAR_NAMES:
        return None
    close = tree_mod.close_matches(key, names, n=1, cutoff=0.75)
    return close[0] if close else None


def mismatch(
    p: Plan,
    root: Node,
    into: Any,
    tensors: Mapping[str, TensorRecord],
    *,
    path: str,
) -> StateMismatchError:
    """The StateMismatchError for the problems of the plan ``p``, with its hints (likely
    typos) and what to pass instead when ``into`` is given one level too high or too low
    (:func:`level_hints`)."""
    hints = [*p.hints, *level_hints(root, into, tensors)]
    return StateMismatchError(p.problems, path=path, hints=hints)


_HINT_TRIES = 16  # keys of the checkpoint's root (or of into) tried as the level meant


def level_hints(root: Node, into: Any, tensors: Mapping[str, TensorRecord]) -> list[str]:
    """When ``into`` fits one entry of the saved root (``sp.load(path, into=model)`` for a
    checkpoint saved as ``{"model": model}``), or the saved root fits one entry of ``into``
    (``into={"model": model}`` for a checkpoint saved as ``model.state_dict()``), the ``into=``
    that restores it. Plans only (no I/O), of at most :data:`_HINT_TRIES` candidates each way."""
    hints: list[str] = []
    inner = root
    while inner["t"] == "stateful":
        inner = inner["state"]
    what = _type(into)
    if inner["t"] == "dict":
        for k, child in inner["items"][:_HINT_TRIES]:
            if child["t"] in ("dict", "stateful", "list", "tuple") and _fits(child, into, tensors):
                hints.append(
                    f"the checkpoint holds this state under the key {k!r} (it was saved as "
                    f"{{{k!r}: ...}}): restore it with into={{{k!r}: <the {what}>}}"
                )
                break
    if isinstance(into, Mapping) and not is_stateful(into):
        for k, value in list(into.items())[:_HINT_TRIES]:
            if value is not None and _fits(root, value, tensors):
                hints.append(
                    f"the checkpoint is the state of into[{k!r}] alone (saved without the "
                    f"{k!r} level): restore it with into=<the {_type(value)}> itself"
                )
                break
    return hints


def _fits(node: Node, target: Any, tensors: Mapping[str, TensorRecord]) -> bool:
    try:
        return not plan(node, target, tensors).problems
    except Exception:  # a target's state_dict() failing: no hint, the problems stand
        return False


def plan(root: Node, into: Any, tensors: Mapping[str, TensorRecord]) -> Plan:
    """The plan of restoring the saved tree ``root`` into ``into`` (see :class:`Planner`)."""
    return Planner(tensors).plan(root, into)


class Planner:
    """One walk of the saved tree against ``into``, its binding rules one method each.

    Each rule binds a saved node to the live object in its place and returns the thunk that,
    after the reads, gives what the place ends up holding; it records the tensors to read in
    place or fresh, and every problem, in :attr:`p`. ``path`` is the node's key path;
    ``complete`` the mode (:data:`Mode`: False outside any Stateful)."""

    def __init__(self, tensors: Mapping[str, TensorRecord]) -> None:
        self.tensors = tensors
        self.p = Plan()

    def plan(self, root: Node, into: Any) -> Plan:
        self.p.finish = self.bind(root, into, (), False)
        self.check_root(root, into)
        return self.p

    def fresh(self, node: Node) -> Thunk:
        """Nothing to bind to: the saved subtree is built from fresh tensors."""
        self.p.fresh.update(tree_mod.refs(node))
        return lambda get: tree_mod.build(node, get)

    def bind(self, node: Node, target: Any, path: tuple[Key, ...], complete: Mode) -> Thunk:
        """The rule for ``node`` over ``target``: by the target (none, a Stateful), then by
        what was saved (a Stateful's state, a tensor, a container, a plain value)."""
        t = node["t"]
        if target is _MISSING:
            return self.fresh(node)
        if t == "tensor":
            return self.bind_tensor(node, target, path, complete)
        if is_stateful(target):
            return self.bind_stateful(node, target, path)
        if t == "stateful":
            return self.bind(node["state"], target, path, complete)
        if t in ("dict", "list", "tuple"):
            return self.bind_container(node, target, path, complete, strict=False)
        return self.bind_value(node, target, path, complete)

    def bind_stateful(self, node: Node, target: Any, path: tuple[Key, ...]) -> Thunk:
        """A Stateful target: its ``load_state_dict`` gets the whole saved subtree, its current
        ``state_dict()`` supplying the tensors to fill in place."""
        inner = node["state"] if node["t"] == "stateful" else node
        # A compile/DDP wrapper loads through the model it wraps, whose keys are the saved ones.
        obj = wrappers.unwrap(target)
        template = obj.state_dict()
        # torch modules and optimizers are checked up front (their load_state_dict would fail
        # half-way, or not check shapes at all); other objects get the saved tree and judge.
        mode: Mode = "checked" if _is_torch_object(obj) else "lenient"
        sub = self.bind_container(inner, template, path, mode, strict=_is_module(obj))

        def load_stateful(get: Getter) -> Any:
            obj.load_state_dict(sub(get))
            return target

        return load_stateful

    def bind_tensor(self, node: Node, target: Any, path: tuple[Key, ...], complete: Mode) -> Thunk:
        """A saved tensor: read in place into an array or tensor of its dtype and shape (else a
        problem, or fresh for a lenient Stateful), into a scalar where exact, else fresh."""
        p = self.p
        key = tree_mod.join(path)
        ref = node["ref"]
        found = describe(target)
        rec = self.tensors[ref]
        if found is None:
            if not complete and target is not None:
                if rec.shape == () and _scalars.target_dtype(target) is not None:
                    return self.tensor_to_scalar(node, target, path, rec.dtype)
                p.problems.append(
                    (key, f"the checkpoint holds a tensor here, found {_type(target)}")
                )
            return self.fresh(node)
        dtype, shape = found
        read_only = getattr(getattr(target, "flags", None), "writeable", True) is False
        if complete == "lenient" and (read_only or (dtype, tuple(shape)) != (rec.dtype, rec.shape)):
            return self.fresh(node)  # the object's own load_state_dict decides what to do with it
        if read_only:
            p.problems.append((key, "the target array is read-only"))
        if dtype != rec.dtype:
            p.problems.append((key, f"dtype {rec.dtype} in the checkpoint, {dtype} in the target"))
        if tuple(shape) != rec.shape:
            p.problems.append(
                (key, f"shape {list(rec.shape)} in the checkpoint, {list(shape)} in the target")
            )
        p.inplace.append((ref, target, key))
        return lambda get: target

    def bind_value(self, node: Node, target: Any, path: tuple[Key, ...], complete: Mode) -> Thunk:
        """A saved plain value: into a 0-d tensor where it fits, else it replaces the target
        (in its parent's slot; at the root of a partial load, a problem)."""
        key = tree_mod.join(path)
        value = tree_mod.plain_value(node)
        if not complete and describe(target) is not None:
            return self.scalar_to_tensor(value, target, key)
        if not path and not complete:
            self.p.problems.append(
                (key, "a plain value cannot be restored in place; use sp.load()")
            )
        return lambda get: value

    def tensor_to_scalar(self, node: Node, target: Any, path: tuple[Key, ...], dtype: str) -> Thunk:
        """A saved 0-d tensor into a Python or numpy scalar: exact by dtype, or a problem."""
        key = tree_mod.join(path)
        why = _scalars.tensor_into_scalar(dtype, target)
        if why is None and not path:
            why = "a plain value cannot be restored in place; use sp.load()"
        if why is not None:
            self.p.problems.append((key, why))
            return lambda get: target
        read = self.fresh(node)
        return lambda get: _scalars.to_scalar(read(get), target)

    def scalar_to_tensor(self, value: Any, target: Any, key: str) -> Thunk:
        """A saved plain value into an existing array or tensor: only a 0-d one it fits exactly."""
        dtype, shape = describe(target) or ("", ())
        if tuple(shape) != ():
            why: str | None = (
                f"the checkpoint holds a {type(value).__name__} here, found a tensor of shape "
                f"{list(shape)}"
            )
        elif getattr(getattr(target, "flags", None), "writeable", True) is False:
            why = "the target array is read-only"
        else:
            why = _scalars.value_into_tensor(value, dtype)
        if why is not None:
            self.p.problems.append((key, why))
            return lambda get: target

        def put(get: Getter) -> Any:
            _scalars.fill(target, value, dtype)
            return target

        return put

    def bind_container(
        self, node: Node, target: Any, path: tuple[Key, ...], complete: Mode, strict: bool
    ) -> Thunk:
        """A saved container onto a container of its kind (a dict also onto a dataclass); inside
        a Stateful, onto anything else it is built fresh; otherwise a mismatch is a problem."""
        t = node["t"]
        if t == "stateful":
            return self.bind_container(node["state"], target, path, complete, strict)
        if t == "dict" and isinstance(target, Mapping):
            return self.bind_dict(node, target, path, complete, strict)
        if t in ("list", "tuple") and isinstance(target, (list, tuple)):
            return self.bind_sequence(node, target, path, complete)
        if t == "dict" and _is_dataclass(target):
            return self.bind_dataclass(node, target, path, complete)
        if complete and not isinstance(target, (Mapping, list, tuple)):
            return self.fresh(node)
        self.p.problems.append(
            (tree_mod.join(path), f"the checkpoint holds a {t} here, found {_type(target)}")
        )
        return lambda get: target

    def bind_dict(
        self,
        node: Node,
        target: Mapping[Any, Any],
        path: tuple[Key, ...],
        complete: Mode,
        strict: bool,
    ) -> Thunk:
        """A saved dict onto a mapping, key by key: keys renamed where only a wrapper prefix
        differs; the target's keys the checkpoint lacks are problems (with likely typos) in a
        partial or ``strict`` bind; saved keys the target lacks are skipped (partial), built
        fresh (complete) or, with ``strict``, problems too."""
        p = self.p
        items = node["items"]
        # Keys saved from (or for) a wrapped model: rename them when only the prefix differs.
        if strict or (not complete and _tensor_dict(node, target)):
            rename = wrappers.align([k for k, _ in items], list(target), exact=strict)
            if rename is not None:
                items = [[rename[k], child] for k, child in items]
        saved = {k for k, _ in items}
        if not complete or strict:
            absent = [k for k in target if k not in saved]
            spare = [k for k in saved if k not in target] if absent else []
            for k in absent:
                p.problems.append((tree_mod.join((*path, k)), "not in the checkpoint"))
                near = _near(k, spare, len(absent))
                if near is not None:
                    p.hints.append(
                        f"{tree_mod.join((*path, k))!r} is not in the checkpoint, which has "
                        f"{tree_mod.join((*path, near))!r} (a typo?)"
                    )
        children: list[tuple[Any, Thunk]] = []
        for k, child in items:
            if k in target:
                children.append((k, self.bind(child, target[k], (*path, k), complete)))
                if not complete and not isinstance(target, MutableMapping):
                    self.immutable_slot(child, target[k], (*path, k), target)
            elif complete:
                if strict:
                    p.problems.append(
                        (tree_mod.join((*path, k)), "unexpected key: not in the target")
                    )
                children.append((k, self.fresh(child)))
        if complete:
            return lambda get: {k: sub(get) for k, sub in children}

        def fill(get: Getter) -> Any:
            for k, sub in children:
                value = sub(get)
                if isinstance(target, MutableMapping) and value is not target[k]:
                    target[k] = value
            return target

        return fill

    def bind_sequence(
        self,
        node: Node,
        target: list[Any] | tuple[Any, ...],
        path: tuple[Key, ...],
        complete: Mode,
    ) -> Thunk:
        """A saved list or tuple onto a list or tuple, item by item; of another length it
        replaces a list's contents or a tuple whole, is bound as far as it goes inside a
        Stateful, and is otherwise a problem. A tuple that changes is remade."""
        items = node["items"]
        if len(items) != len(target):
            if complete:
                subs = [
                    self.bind(c, target[i] if i < len(target) else _MISSING, (*path, i), complete)
                    for i, c in enumerate(items)
                ]
            else:
                return self.resized_sequence(node, target, path)
        else:
            subs = [self.bind(c, target[i], (*path, i), complete) for i, c in enumerate(items)]
        kind = tuple if node["t"] == "tuple" else list
        if complete:
            return lambda get: kind(sub(get) for sub in subs)
        if _remakeable(target):

            def remake(get: Getter) -> Any:
                values = [sub(get) for sub in subs]
                if all(v is x for v, x in zip(values, target)):
                    return target
                return _remake(target, values)  # the parent puts it in its slot

            return remake
        if not isinstance(target, MutableSequence):
            for i, c in enumerate(items):
                self.immutable_slot(c, target[i], (*path, i), target)

        def fill(get: Getter) -> Any:
            for i, sub in enumerate(subs):
                value = sub(get)
                if isinstance(target, MutableSequence) and value is not target[i]:
                    target[i] = value
            return target

        return fill

    def resized_sequence(
        self, node: Node, target: list[Any] | tuple[Any, ...], path: tuple[Key, ...]
    ) -> Thunk:
        """A saved sequence of another length than ``target``, outside any Stateful: a list (a
        loss history, say) takes the saved contents whole, a tuple is replaced whole in its
        parent's slot; anything else is a problem."""
        if isinstance(target, MutableSequence):
            whole = self.fresh(node)

            def replace(get: Getter) -> Any:
                target[:] = whole(get)
                return target

            return replace
        if _remakeable(target):
            saved_whole = self.fresh(node)
            return lambda get: _remake(target, saved_whole(get))
        self.p.problems.append(
            (
                tree_mod.join(path),
                f"{len(node['items'])} items in the checkpoint, {len(target)} in the target",
            )
        )
        return lambda get: target

    def bind_dataclass(
        self, node: Node, target: Any, path: tuple[Key, ...], complete: Mode
    ) -> Thunk:
        """A saved dict onto a dataclass's fields: all of them, and nothing else."""
        names = [f.name for f in dc.fields(target)]
        saved = dict(node["items"])
        cls = _type(target)
        for name in names:
            if name not in saved:
                self.p.problems.append(
                    (tree_mod.join((*path, name)), f"not in the checkpoint (a field of {cls})")
                )
        for k in saved:
            if k not in names:
                self.p.problems.append((tree_mod.join((*path, k)), f"not a field of {cls}"))
        children = [
            (name, self.bind(saved[name], getattr(target, name, _MISSING), (*path, name), complete))
            for name in names
            if name in saved
        ]
        if complete:  # a Stateful's load_state_dict gets a new instance; the template is untouched
            return lambda get: _rebuild(target, {n: sub(get) for n, sub in children})
        if _is_frozen(target):

            def replace(get: Getter) -> Any:
                values = {n: sub(get) for n, sub in children}
                if all(v is getattr(target, n, _MISSING) for n, v in values.items()):
                    return target
                return _rebuild(target, values)  # the parent puts it in its slot

            return replace

        def fill(get: Getter) -> Any:
            for n, sub in children:
                value = sub(get)
                if value is not getattr(target, n, _MISSING):
                    setattr(target, n, value)
            return target

        return fill

    def immutable_slot(self, child: Node, current: Any, path: tuple[Key, ...], parent: Any) -> None:
        """A problem if restoring ``child`` would need assigning into an immutable container:
        nested containers and arrays are filled in place, equal plain values need nothing. A
        tuple that would need remaking is reported item by item, where the difference is."""
        if not needs_new(child, current):
            return
        if (
            _remakeable(current)
            and child["t"] in ("list", "tuple")
            and len(child["items"]) == len(current)
        ):
            for i, (c, x) in enumerate(zip(child["items"], current)):
                self.immutable_slot(c, x, (*path, i), current)
            return
        what = f"a frozen {_type(current)} must be replaced; " if _is_frozen(current) else ""
        self.p.problems.append((tree_mod.join(path), f"{what}cannot assign into a {_type(parent)}"))

    def check_root(self, root: Node, into: Any) -> None:
        """The root has no slot: an immutable value there that would need replacing (a tuple,
        a frozen dataclass) is a problem."""
        if isinstance(into, tuple) and needs_new(root, into):
            if root["t"] in ("list", "tuple") and len(root["items"]) == len(into):
                for i, (c, x) in enumerate(zip(root["items"], into)):
                    self.immutable_slot(c, x, (i,), into)
            else:
                self.p.problems.append(
                    (
                        "",
                        f"{len(root.get('items', ()))} items in the checkpoint, {len(into)} in "
                        "the target",
                    )
                )
        if _is_frozen(into) and needs_new(root, into):
            self.p.problems.append(
                (
                    "",
                    f"a frozen {_type(into)} cannot be changed in place; pass it inside a dict "
                    "(into={'config': cfg}) and take the new instance from there, or use sp.load()",
                )
            )
