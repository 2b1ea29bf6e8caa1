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
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, MutableMapping, MutableSequence
from dataclasses import dataclass, field
from typing import Any, Literal

from savepoint.formats.manifest import TensorRecord
from savepoint.state import tree as tree_mod
from savepoint.state.arrays import describe
from savepoint.state.stateful import is_stateful
from savepoint.state.tree import Key, Node

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


def plan(root: Node, into: Any, tensors: Mapping[str, TensorRecord]) -> Plan:
    p = Plan()

    def fresh(node: Node) -> Thunk:
        p.fresh.update(tree_mod.refs(node))
        return lambda get: tree_mod.build(node, get)

    def bind(node: Node, target: Any, path: tuple[Key, ...], complete: Mode) -> Thunk:
        key = tree_mod.join(path)
        t = node["t"]
        if target is _MISSING:
            return fresh(node)
        if t != "tensor" and is_stateful(target):
            inner = node["state"] if t == "stateful" else node
            template = target.state_dict()
            # torch modules and optimizers are checked up front (their load_state_dict would fail
            # half-way, or not check shapes at all); other objects get the saved tree and judge.
            mode: Mode = "checked" if _is_torch_object(target) else "lenient"
            sub = bind_container(inner, template, path, mode, strict=_is_module(target))

            def load_stateful(get: Getter) -> Any:
                target.load_state_dict(sub(get))
                return target

            return load_stateful
        if t == "stateful":
            return bind(node["state"], target, path, complete)
        if t == "tensor":
            ref = node["ref"]
            found = describe(target)
            if found is None:
                if not complete and target is not None:
                    p.problems.append(
                        (key, f"the checkpoint holds a tensor here, found {_type(target)}")
                    )
                return fresh(node)
            rec = tensors[ref]
            dtype, shape = found
            read_only = getattr(getattr(target, "flags", None), "writeable", True) is False
            if complete == "lenient" and (
                read_only or (dtype, tuple(shape)) != (rec.dtype, rec.shape)
            ):
                return fresh(node)  # the object's own load_state_dict decides what to do with it
            if read_only:
                p.problems.append((key, "the target array is read-only"))
            if dtype != rec.dtype:
                p.problems.append(
                    (key, f"dtype {rec.dtype} in the checkpoint, {dtype} in the target")
                )
            if tuple(shape) != rec.shape:
                p.problems.append(
                    (key, f"shape {list(rec.shape)} in the checkpoint, {list(shape)} in the target")
                )
            p.inplace.append((ref, target, key))
            return lambda get: target
        if t in ("dict", "list", "tuple"):
            return bind_container(node, target, path, complete, strict=False)
        value = tree_mod.plain_value(node)
        if not path and not complete:
            p.problems.append((key, "a plain value cannot be restored in place; use sp.load()"))
        return lambda get: value

    def bind_container(
        node: Node, target: Any, path: tuple[Key, ...], complete: Mode, strict: bool
    ) -> Thunk:
        key = tree_mod.join(path)
        t = node["t"]
        if t == "stateful":
            return bind_container(node["state"], target, path, complete, strict)
        if t == "dict" and isinstance(target, Mapping):
            return bind_dict(node, target, path, complete, strict)
        if t in ("list", "tuple") and isinstance(target, (list, tuple)):
            return bind_sequence(node, target, path, complete)
        if complete and not isinstance(target, (Mapping, list, tuple)):
            return fresh(node)
        p.problems.append((key, f"the checkpoint holds a {t} here, found {_type(target)}"))
        return lambda get: target

    def bind_dict(
        node: Node, target: Mapping[Any, Any], path: tuple[Key, ...], complete: Mode, strict: bool
    ) -> Thunk:
        saved = {k for k, _ in node["items"]}
        if not complete or strict:
            for k in target:
                if k not in saved:
                    p.problems.append((tree_mod.join((*path, k)), "not in the checkpoint"))
        children: list[tuple[Any, Thunk]] = []
        for k, child in node["items"]:
            if k in target:
                children.append((k, bind(child, target[k], (*path, k), complete)))
                if not complete and not isinstance(target, MutableMapping):
                    immutable_slot(child, target[k], (*path, k), target)
            elif complete:
                if strict:
                    p.problems.append(
                        (tree_mod.join((*path, k)), "unexpected key: not in the target")
                    )
                children.append((k, fresh(child)))
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
        node: Node, target: list[Any] | tuple[Any, ...], path: tuple[Key, ...], complete: Mode
    ) -> Thunk:
        items = node["items"]
        key = tree_mod.join(path)
        if len(items) != len(target):
            if complete:
                subs = [
                    bind(c, target[i] if i < len(target) else _MISSING, (*path, i), complete)
                    for i, c in enumerate(items)
                ]
            elif isinstance(target, MutableSequence):
                # A list of another length (a loss history, say) takes the saved contents whole.
                whole = fresh(node)

                def replace(get: Getter) -> Any:
                    target[:] = whole(get)
                    return target

                return replace
            else:
                p.problems.append(
                    (key, f"{len(items)} items in the checkpoint, {len(target)} in the target")
                )
                return lambda get: target
        else:
            subs = [bind(c, target[i], (*path, i), complete) for i, c in enumerate(items)]
        kind = tuple if node["t"] == "tuple" else list
        if complete:
            return lambda get: kind(sub(get) for sub in subs)
        if not isinstance(target, MutableSequence):
            for i, c in enumerate(items):
                immutable_slot(c, target[i], (*path, i), target)

        def fill(get: Getter) -> Any:
            for i, sub in enumerate(subs):
                value = sub(get)
                if isinstance(target, MutableSequence) and value is not target[i]:
                    target[i] = value
            return target

        return fill

    def immutable_slot(child: Node, current: Any, path: tuple[Key, ...], parent: Any) -> None:
        """A problem if restoring ``child`` would need assigning into an immutable container:
        nested containers and arrays are filled in place, equal plain values need nothing."""
        t = child["t"]
        if t == "tensor":
            needs = describe(current) is None
        elif t in ("value", "float", "bytes"):
            saved = tree_mod.plain_value(child)
            needs = not (saved == current or (saved != saved and current != current))
            needs = needs or type(saved) is not type(current)
        else:
            needs = False
        if needs:
            p.problems.append((tree_mod.join(path), f"cannot assign into a {_type(parent)}"))

    p.finish = bind(root, into, (), False)
    return p
