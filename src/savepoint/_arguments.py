"""Calls of the facade that do not fit its signature, answered in savepoint's terms.

torch habits meet ``sp.save`` and ``sp.load`` first: ``sp.save(state, path)`` (torch.save's
order), ``sp.load(path, model)`` or ``sp.load(path, "cpu")`` (torch.load's second argument is
``map_location``), ``map_location=``, ``weights_only=``, ``strict=`` (load_state_dict's). Python
would raise a bare TypeError about the signature; :func:`guarded` raises
:class:`~savepoint.errors.CheckpointArgumentError` (a TypeError too) naming the savepoint
argument to use instead, and a misspelt keyword gets the nearest name. The check costs a
length and a set comparison per call; the explanation is made only for a call that fails.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable, Mapping
from typing import Any, ParamSpec, TypeVar

from savepoint.errors import CheckpointArgumentError
from savepoint.state.tree import close_matches
from savepoint.storage.paths import Location

__all__ = ["check_path", "guarded"]

P = ParamSpec("P")
R = TypeVar("R")

_NO_PICKLE = (
    "savepoint writes and reads no pickle (safetensors data files and a JSON manifest), so "
    "there is nothing to choose: drop it"
)
# Keywords of torch.save / torch.load / load_state_dict, by the savepoint call they were given to.
_HABITS: dict[str, dict[str, str]] = {
    "load": {
        "map_location": "sp.load's argument is device= (sp.load(path, device='cpu'): torch "
        "tensors come back there; a dict or a function map_location has no equivalent: load, "
        "then move)",
        "weights_only": "savepoint never unpickles: every sp.load is weights-only (tensors, "
        "arrays and plain values), so drop weights_only=",
        "pickle_module": _NO_PICKLE,
        "pickle_load_args": _NO_PICKLE,
        "strict": "sp.load(path, into=...) checks every key, shape and dtype before it "
        "modifies anything; to restore part of a checkpoint, pass into= only that part (a dict "
        "of the objects to restore: the rest is not read), or keys= to select paths",
        "f": "the checkpoint path is sp.load's first argument: sp.load(path)",
        "model": "the objects to restore into are into=: sp.load(path, into=model)",
        "state_dict": "the objects to restore into are into=: sp.load(path, into=state)",
        "target": "the objects to restore into are into=: sp.load(path, into=target)",
    },
    "save": {
        "pickle_module": _NO_PICKLE,
        "pickle_protocol": _NO_PICKLE,
        "_use_new_zipfile_serialization": _NO_PICKLE,
        "_disable_byteorder_record": _NO_PICKLE,
        "obj": "sp.save takes the path first, then the state: sp.save(path, state)",
        "f": "sp.save takes the path first, then the state: sp.save(path, state)",
    },
}


def guarded(f: Callable[P, R]) -> Callable[P, R]:
    """``f``, refusing a call with more positional arguments than ``f`` takes, or a keyword it
    does not have, with a CheckpointArgumentError that says what to pass instead."""
    params = inspect.signature(f).parameters
    positional = sum(
        p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params.values()
    )
    names = frozenset(params)

    @functools.wraps(f)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        if len(args) > positional or not names.issuperset(kwargs):
            raise _refusal(f.__name__, list(params), positional, args, kwargs)
        return f(*args, **kwargs)

    return call


def _refusal(
    name: str,
    params: list[str],
    positional: int,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
) -> CheckpointArgumentError:
    call = f"sp.{name}"
    habits = _HABITS.get(name, {})
    if len(args) > positional:
        extra = args[positional]
        if name == "load":
            if _is_device(extra):
                why = (
                    f"{call} takes one positional argument, the path; torch.load's second one, "
                    "map_location, is device= here: sp.load(path, device=...)"
                )
            else:
                why = (
                    f"{call} takes one positional argument, the path; the objects to restore "
                    "into are into=: sp.load(path, into=model) (or into={'model': model, "
                    "'optimizer': opt})"
                )
        else:
            taken = ", ".join(params[:positional])
            why = (
                f"{call} takes {positional} positional argument(s) ({taken}), "
                f"{len(args)} were given; the others are keyword-only: "
                + ", ".join(f"{p}=" for p in params[positional:])
            )
        return CheckpointArgumentError(why)
    unknown = [k for k in kwargs if k not in params]
    lines = []
    for key in unknown:
        if key in habits:
            lines.append(f"{key}=: {habits[key]}")
            continue
        near = close_matches(key, params, n=1, cutoff=0.6)
        hint = f"did you mean {near[0]}=?" if near else "it takes " + ", ".join(params)
        lines.append(f"{key}=: {call} has no such argument; {hint}")
    return CheckpointArgumentError(f"{call}() got an unexpected argument: " + "; ".join(lines))


def _is_device(value: Any) -> bool:
    """Whether ``value`` looks like torch.load's ``map_location``: a device name, a
    torch.device, a dict of them or a function."""
    if isinstance(value, str):
        return value.split(":")[0] in ("cpu", "cuda", "mps", "meta", "xpu")
    kind = type(value)
    if kind.__module__ == "torch" and kind.__name__ == "device":
        return True
    return callable(value) and not hasattr(value, "state_dict")


def _pathlike(value: Any) -> bool:
    return isinstance(value, (str, os.PathLike, Location))


def check_path(call: str, path: Any, state: Any = None) -> None:
    """Refuse a ``path`` argument of ``call`` that is no path; when the argument after it is
    one (``sp.save(state, path)``, torch.save's order), say that they are swapped."""
    if _pathlike(path):
        return
    if call == "sp.save" and _pathlike(state):
        shown = str(state) if isinstance(state, Location) else os.fspath(state)
        raise CheckpointArgumentError(
            f"sp.save takes the path first, then the state: sp.save({shown!r}, state) "
            f"(this call gave a {type(path).__name__} as the path and a path as the state: "
            "torch.save's order, torch.save(state, path), is the other way round)"
        )
    raise CheckpointArgumentError(
        f"{call}'s first argument is the checkpoint path (a str, an os.PathLike, a URL or a "
        f"Location), not a {type(path).__name__}"
    )
