"""``OptimizerState``: an optimizer's state as plain named data, and converters for ``torch.optim``.

An ``OptimizerState`` is an optimizer type name, named real scalars (hyperparameters, step counts)
and named float64 buffers (moment estimates), each buffer flattened to one dimension. It knows
nothing about any framework, so it can be saved by one program and read by another; it is a
Stateful, so ``sp.save`` stores it as plain data (its ``state_dict()``), never pickle::

    state = optimizer_state_from_torch(opt)          # float64 copies of opt's state
    sp.save(path, {"optimizer": state})
    restored = OptimizerState.from_state_dict(sp.load(path)["optimizer"])
    optimizer_state_to_torch(restored, new_opt)      # new_opt: same class, same parameters

Naming scheme used by the torch converters (``<i>``: the parameter's index, counting through
``opt.param_groups`` in order, as ``torch.optim.Optimizer.state_dict`` numbers them; ``<k>``: a
param group index)

==================  ============  ================================================================
name                kind          meaning
==================  ============  ================================================================
``lr`` ...          scalar        hyperparameter of param group 0: ``lr``, ``beta1``, ``beta2``,
                                  ``eps``, ``weight_decay``, ``momentum``, ``dampening``, and any
                                  other real or boolean group entry (``amsgrad``, ``nesterov``,
                                  ``maximize``, ``initial_lr``, ...); booleans are 0.0 / 1.0
``lr.g<k>`` ...     scalar        the same for param group ``k >= 1``
``group_size``      scalar        number of parameters in group 0 (``group_size.g<k>`` for k >= 1)
``step.<i>``        scalar        Adam/AdamW step count of parameter ``i``
``m.<i>``           buffer        Adam ``exp_avg``
``v.<i>``           buffer        Adam ``exp_avg_sq``
``max_v.<i>``       buffer        Adam ``max_exp_avg_sq`` (``amsgrad=True``)
``momentum.<i>``    buffer        SGD ``momentum_buffer``
==================  ============  ================================================================

Group 0 uses the plain names so that the common single-group optimizer reads naturally
(``state.get_scalar("lr")``). Implementation switches (``foreach``, ``fused``, ``capturable``,
``differentiable``) are properties of the optimizer object, not of the training state: they are
not stored and the target optimizer keeps its own. Parameters that have no state yet (no gradient
seen) have no entries.

Exactness: buffers are float64 copies of torch state that is float64, float32, float16 or
bfloat16. Every value of those narrower types is exactly representable in float64, so the trip
float32 -> float64 -> float32 gives back the very same bits, and a restored optimizer continues
bit-identically (the tests prove it by training on after a save/load round trip). Step counts and
hyperparameters are Python floats, exact for every value torch stores.
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from savepoint.errors import OptimizerStateError, UnsupportedStateError

__all__ = [
    "F64Array",
    "OptimizerState",
    "optimizer_state_from_torch",
    "optimizer_state_to_torch",
]

F64Array = np.ndarray[Any, np.dtype[np.float64]]
_STATE_KEYS = ("optimizer_type", "scalars", "buffers")


def _torch() -> Any:
    import torch

    return torch


def _is_torch_tensor(obj: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def _to_float(value: Any) -> float:
    """``value`` as a float; TypeError if it is not a real number, ValueError if float64 cannot
    hold it exactly (an integer beyond 2**53, a long double with more precision)."""
    if _is_torch_tensor(value):
        if value.numel() != 1:
            raise TypeError(f"a tensor with {value.numel()} elements is not a scalar")
        value = value.detach().cpu().reshape(()).item()
    elif isinstance(value, np.ndarray) and value.shape == ():
        value = value[()]
    if isinstance(value, (bool, np.bool_)) or not isinstance(
        value, (int, float, np.integer, np.floating)
    ):
        raise TypeError(f"{type(value).__name__} is not a real number")
    as_float = float(value)
    if isinstance(value, (int, np.integer)):
        if not math.isfinite(as_float) or int(as_float) != int(value):
            raise ValueError(f"the integer {int(value)} is not exactly representable as a float64")
    elif isinstance(value, np.floating) and not (np.isnan(value) or value == type(value)(as_float)):
        raise ValueError(f"{value!r} is not exactly representable as a float64")
    return as_float


def _to_buffer(value: Any) -> F64Array:
    """A new 1-D float64 array holding ``value`` (array, tensor, sequence), flattened.

    TypeError if the values are not real numbers (bool, complex, strings, objects); ValueError if
    float64 cannot hold every value exactly (large integers, long doubles).
    """
    if _is_torch_tensor(value):
        torch = _torch()
        t = value.detach()
        if t.is_complex() or t.dtype == torch.bool:
            raise TypeError(f"{t.dtype} is not a real number type")
        wide = t.to(device="cpu", dtype=torch.float64, copy=True)
        if not t.dtype.is_floating_point and not bool((wide.to(t.dtype) == t.cpu()).all()):
            raise ValueError(f"some {t.dtype} values are not exactly representable as float64")
        return np.asarray(wide.reshape(-1).numpy())
    try:
        arr = np.asarray(value)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"not an array of numbers ({exc})") from None
    kind = arr.dtype.kind
    if kind == "f" and arr.dtype.itemsize <= 8:
        return arr.astype(np.float64, copy=True).reshape(-1)  # always exact
    if kind not in "iufV":
        raise TypeError(f"dtype {arr.dtype} is not a real number type")
    try:
        out = arr.astype(np.float64)
    except (TypeError, ValueError):
        raise TypeError(f"dtype {arr.dtype} is not a real number type") from None
    with np.errstate(all="ignore"):
        same = np.array_equal(out.astype(arr.dtype), arr, equal_nan=kind not in "iu")
    if kind in "iu" and same:
        # float64 -> int64 wraps silently at 2**63; compare those in Python ints.
        big = np.abs(out) >= 2.0**53
        same = all(int(f) == int(i) for f, i in zip(out[big].tolist(), arr[big].tolist()))
    if not same:
        raise ValueError(f"some {arr.dtype} values are not exactly representable as float64")
    return out.reshape(-1)


@dataclass(eq=False)
class OptimizerState:
    """An optimizer's state as named real scalars and named float64 buffers.

    ``optimizer_type`` names the algorithm ("Adam", "AdamW", "SGD" for the torch converters) and is
    checked on every load. ``scalars`` maps names to floats; ``buffers`` maps names to 1-D float64
    arrays (``set_buffer`` flattens and copies). Values go in only if float64 holds them exactly:
    every float16/32/64 and bfloat16 value, integers up to 2**53; bools, complex numbers and
    strings are refused (TypeError), inexact values too (ValueError). ``get_scalar`` and
    ``get_buffer`` return None for absent names; ``get_buffer`` returns the stored array itself.

    Two states are equal when type, scalar names and values, and buffer names and contents are
    equal (NaN equals NaN). States are mutable and so unhashable.

    As a Stateful, ``state_dict()`` returns ``{"optimizer_type": str, "scalars": {name: float},
    "buffers": {name: float64 array}}`` holding the live buffers (no copy; ``sp.save`` copies them
    to disk), and ``load_state_dict(d, strict=True)`` validates ``d`` against this state, then
    replaces this state's contents. ``sp.load(path)`` gives back that dict;
    ``OptimizerState.from_state_dict`` turns it into a state again.
    """

    optimizer_type: str
    scalars: dict[str, float] = field(default_factory=dict)
    buffers: dict[str, F64Array] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.optimizer_type, str) or not self.optimizer_type:
            raise TypeError(f"optimizer_type must be a non-empty str, got {self.optimizer_type!r}")
        scalars, buffers = dict(self.scalars), dict(self.buffers)
        self.scalars, self.buffers = {}, {}
        for name, scalar in scalars.items():
            self.set_scalar(name, scalar)
        for name, buffer in buffers.items():
            self.set_buffer(name, buffer)

    # -- access -------------------------------------------------------------------------------

    def set_scalar(self, key: str, value: float) -> None:
        """Set scalar ``key`` to ``value`` (any real number float64 holds exactly)."""
        _check_key(key)
        try:
            self.scalars[key] = _to_float(value)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"scalar {key!r}: {exc}") from None

    def get_scalar(self, key: str) -> float | None:
        return self.scalars.get(key)

    def set_buffer(self, key: str, data: Any) -> None:
        """Store a float64 copy of ``data`` (array, tensor or sequence), flattened to 1-D."""
        _check_key(key)
        try:
            self.buffers[key] = _to_buffer(data)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"buffer {key!r}: {exc}") from None

    def get_buffer(self, key: str) -> F64Array | None:
        return self.buffers.get(key)

    def is_empty(self) -> bool:
        return not self.scalars and not self.buffers

    # -- equality -----------------------------------------------------------------------------

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, OptimizerState):
            return NotImplemented
        if (
            self.optimizer_type != other.optimizer_type
            or self.scalars.keys() != other.scalars.keys()
            or self.buffers.keys() != other.buffers.keys()
        ):
            return False
        for name, a in self.scalars.items():
            b = other.scalars[name]
            if not (a == b or (math.isnan(a) and math.isnan(b))):
                return False
        return all(
            np.array_equal(a, other.buffers[name], equal_nan=True)
            for name, a in self.buffers.items()
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        values = sum(int(b.size) for b in self.buffers.values())
        return (
            f"OptimizerState({self.optimizer_type!r}, {len(self.scalars)} scalars, "
            f"{len(self.buffers)} buffers, {values} buffer values)"
        )

    # -- Stateful -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """``{"optimizer_type", "scalars", "buffers"}``; the buffers are the live arrays."""
        return {
            "optimizer_type": self.optimizer_type,
            "scalars": dict(self.scalars),
            "buffers": dict(self.buffers),
        }

    @classmethod
    def from_state_dict(cls, state_dict: Any) -> OptimizerState:
        """A new state from a ``state_dict()`` tree (as ``sp.load`` returns it), any names.

        Buffers are copied. Raises OptimizerStateError naming every malformed entry.
        """
        parsed, problems = _parse(state_dict, {})
        if parsed is None or problems:
            raise OptimizerStateError("not a valid optimizer state", problems)
        return parsed

    def validate_against(self, expected: OptimizerState, *, strict: bool = True) -> None:
        """Raise OptimizerStateError if this state cannot be loaded into ``expected``.

        The rules, all checked, all reported at once:

        - the optimizer types must be equal;
        - a buffer both states have must have the same number of values;
        - with ``strict`` and a non-empty ``expected``: the scalar names and the buffer names must
          be exactly ``expected``'s (every missing and every unexpected name is listed). An empty
          ``expected`` accepts any names.
        """
        problems = self.problems_against(expected, strict=strict)
        if problems:
            raise OptimizerStateError(
                f"cannot load a {self.optimizer_type} optimizer state into this one", problems
            )

    def problems_against(self, expected: OptimizerState, *, strict: bool = True) -> list[str]:
        """What ``validate_against`` would report, as a list; empty when compatible."""
        problems: list[str] = []
        if self.optimizer_type != expected.optimizer_type:
            problems.append(
                f"optimizer type {self.optimizer_type!r} in the checkpoint, "
                f"{expected.optimizer_type!r} expected"
            )
        if strict and not expected.is_empty():
            for what, have, want in (
                ("scalar", self.scalars.keys(), expected.scalars.keys()),
                ("buffer", self.buffers.keys(), expected.buffers.keys()),
            ):
                missing = sorted(set(want) - set(have))
                unexpected = sorted(set(have) - set(want))
                if missing:
                    problems.append(f"missing {what}(s): {', '.join(map(repr, missing))}")
                if unexpected:
                    problems.append(f"unexpected {what}(s): {', '.join(map(repr, unexpected))}")
        for name, buf in self.buffers.items():
            current = expected.buffers.get(name)
            if current is not None and current.size != buf.size:
                problems.append(
                    f"buffer {name!r} has {buf.size} values in the checkpoint, {current.size} here"
                )
        return problems

    def load_state_dict(self, state_dict: Any, strict: bool = True) -> None:
        """Validate ``state_dict`` against this state, then replace this state's contents with it.

        ``state_dict`` is another OptimizerState (the seed's ``load_state_dict(&OptimizerState)``;
        its buffers are copied, never shared) or a ``state_dict()`` tree: exactly the keys
        ``optimizer_type`` (str),
        ``scalars`` (name -> real number) and ``buffers`` (name -> array or tensor of real
        numbers float64 holds exactly; converted and flattened). On top of those structure
        checks, ``validate_against(self, strict=strict)``'s rules apply. Every problem is reported
        in one OptimizerStateError and this state is left as it was.

        With ``strict`` (the default) a non-empty state defines the expected names and buffer
        sizes: load into a state built the same way (``optimizer_state_from_torch`` of an
        optimizer over the same parameters), or into an empty ``OptimizerState("Adam")`` to accept
        whatever was saved. ``strict=False`` accepts any names but still checks the type and the
        sizes of buffers present on both sides; the state then holds exactly the loaded names.

        Through ``sp.load(path, into=state)`` buffers whose name and size match are read into the
        existing arrays before this method runs (that is what makes the load in place and
        copy-free), and are kept as they are; other buffers are copied. If validation fails
        after such a load, those arrays already hold the checkpoint's values: load a compatible
        checkpoint or rebuild the state.
        """
        if isinstance(state_dict, OptimizerState):
            state_dict = state_dict.state_dict()
        parsed, problems = _parse(state_dict, self.buffers)
        if parsed is not None:
            problems += parsed.problems_against(self, strict=strict)
        if parsed is None or problems:
            raise OptimizerStateError(
                f"cannot load the optimizer state into this {self.optimizer_type} state", problems
            )
        self.scalars, self.buffers = parsed.scalars, parsed.buffers


def _check_key(key: Any) -> None:
    if not isinstance(key, str) or not key:
        raise TypeError(f"names must be non-empty str, got {key!r}")


def _parse(
    state_dict: Any, adopt: Mapping[str, F64Array]
) -> tuple[OptimizerState | None, list[str]]:
    """A new OptimizerState from a state_dict tree, plus every problem found; never raises.

    A buffer value that *is* ``adopt[name]`` (an array sp.load filled in place) is kept as is;
    every other buffer is converted into a new array, so two states never share memory.
    """
    if not isinstance(state_dict, Mapping):
        return None, [
            f"expected a mapping with keys {list(_STATE_KEYS)}, got {type(state_dict).__name__}"
        ]
    problems: list[str] = []
    missing = [k for k in _STATE_KEYS if k not in state_dict]
    unexpected = [k for k in state_dict if k not in _STATE_KEYS]
    if missing:
        problems.append(f"missing key(s): {', '.join(map(repr, missing))}")
    if unexpected:
        problems.append(f"unexpected key(s): {', '.join(map(repr, unexpected))}")
    kind = state_dict.get("optimizer_type")
    state: OptimizerState | None = None
    if isinstance(kind, str) and kind:
        state = OptimizerState(kind)
    elif "optimizer_type" in state_dict:
        problems.append(f"optimizer_type must be a non-empty str, got {kind!r}")
    for section in ("scalars", "buffers"):
        entries = state_dict.get(section, {})
        if not isinstance(entries, Mapping):
            problems.append(f"{section} must be a mapping, got {type(entries).__name__}")
            continue
        for name, value in entries.items():
            if not isinstance(name, str) or not name:
                problems.append(f"{section}: name {name!r} is not a non-empty str")
                continue
            try:
                if section == "scalars":
                    scalar = _to_float(value)
                    if state is not None:
                        state.scalars[name] = scalar
                else:
                    buf = adopt.get(name)
                    if buf is None or value is not buf:
                        buf = _to_buffer(value)
                    if state is not None:
                        state.buffers[name] = buf
            except (TypeError, ValueError) as exc:
                problems.append(f"{section[:-1]} {name!r}: {exc}")
    return state, problems


# ---------------------------------------------------------------------------------------------
# torch.optim converters
# ---------------------------------------------------------------------------------------------

# torch state key -> buffer prefix, per supported optimizer; "step" is a scalar.
_ADAM_BUFFERS = {"exp_avg": "m", "exp_avg_sq": "v", "max_exp_avg_sq": "max_v"}
_SGD_BUFFERS = {"momentum_buffer": "momentum"}
_REQUIRED = {
    "Adam": ("lr", "beta1", "beta2", "eps", "weight_decay"),
    "AdamW": ("lr", "beta1", "beta2", "eps", "weight_decay"),
    "SGD": ("lr", "momentum", "dampening", "weight_decay"),
}
_NOT_STATE = frozenset(
    {"params", "param_names", "foreach", "fused", "capturable", "differentiable"}
)
_PER_PARAM = re.compile(r"^(step|m|v|max_v|momentum)\.(0|[1-9][0-9]*)$")
_PER_GROUP = re.compile(r"^(.+)\.g([1-9][0-9]*)$")


def _kind(opt: Any) -> str:
    torch = _torch()
    supported = {torch.optim.Adam: "Adam", torch.optim.AdamW: "AdamW", torch.optim.SGD: "SGD"}
    # Exact classes: AdamW subclasses Adam, and a user subclass may keep state we do not know.
    name = supported.get(type(opt))
    if name is None:
        cls = type(opt)
        raise UnsupportedStateError(
            f"{cls.__module__}.{cls.__qualname__} is not supported by the OptimizerState "
            f"converters (supported: {', '.join(f'torch.optim.{n}' for n in _REQUIRED)}); save the "
            "optimizer itself with sp.save(path, {'optimizer': opt}) instead"
        )
    return name


def _group_name(name: str, k: int) -> str:
    return name if k == 0 else f"{name}.g{k}"


def _hyper(group: Mapping[str, Any]) -> dict[str, float]:
    """The real and boolean entries of a param group, betas split into beta1/beta2.

    Entries that are not numbers (None, strings, lists) are configuration, not state: skipped.
    """
    out: dict[str, float] = {}
    items: list[tuple[str, Any]] = []
    for key, value in group.items():
        if key in _NOT_STATE or value is None:
            continue
        if key == "betas" and isinstance(value, (tuple, list)) and len(value) == 2:
            items += [("beta1", value[0]), ("beta2", value[1])]
        else:
            items.append((key, value))
    for key, value in items:
        if isinstance(value, bool):
            out[key] = 1.0 if value else 0.0
            continue
        try:
            out[key] = _to_float(value)
        except (TypeError, ValueError):
            continue
    return out


def optimizer_state_from_torch(opt: Any) -> OptimizerState:
    """A float64 copy of a ``torch.optim`` Adam, AdamW or SGD optimizer's state.

    Names follow the module's scheme (``lr``, ``beta1``, ``step.<i>``, ``m.<i>``, ...; group
    ``k >= 1`` as ``lr.g<k>``). Raises UnsupportedStateError for another optimizer class, a
    complex parameter, or a state entry this converter does not know (a newer torch, say), rather
    than dropping state silently.
    """
    kind = _kind(opt)
    buffer_names = _SGD_BUFFERS if kind == "SGD" else _ADAM_BUFFERS
    state = OptimizerState(kind)
    index = 0
    for k, group in enumerate(opt.param_groups):
        for name, value in _hyper(group).items():
            state.scalars[_group_name(name, k)] = value
        state.scalars[_group_name("group_size", k)] = float(len(group["params"]))
        for param in group["params"]:
            if param.is_complex():
                raise UnsupportedStateError(
                    f"parameter {index} is complex; OptimizerState holds real buffers only"
                )
            for key, value in opt.state.get(param, {}).items():
                if key == "step":
                    state.set_scalar(f"step.{index}", value)
                elif key in buffer_names:
                    if value is not None:  # older torch keeps momentum_buffer=None at momentum 0
                        state.set_buffer(f"{buffer_names[key]}.{index}", value)
                else:
                    raise UnsupportedStateError(
                        f"{kind} state entry {key!r} of parameter {index} is not known to the "
                        "OptimizerState converter; save the optimizer itself with sp.save instead"
                    )
            index += 1
    return state


def _restored_like(current: Any, value: float) -> Any:
    """``value`` in the Python type (or tensor dtype and device) the optimizer already uses."""
    if _is_torch_tensor(current):
        return _torch().tensor(value, dtype=current.dtype, device=current.device)
    if isinstance(current, bool):
        return bool(value)
    if isinstance(current, int) and value.is_integer():
        return int(value)
    return value


def optimizer_state_to_torch(state: OptimizerState, opt: Any) -> None:
    """Restore ``state`` into ``opt``, an optimizer of the same class over the same parameters.

    Everything is checked first and every problem reported in one OptimizerStateError, leaving
    ``opt`` untouched: the type, the number of param groups and of parameters in each, names this
    scheme does not know, buffer sizes against the parameters' sizes, required hyperparameters,
    per-parameter entries that must come together (Adam's ``step``/``m``/``v``, plus ``max_v``
    with amsgrad). A hyperparameter the target's param groups lack is a problem unless it is 0
    (a switch that is off, as newer torch versions add).

    Then ``opt.load_state_dict`` receives the state in torch's own layout, so buffers land on each
    parameter's device and dtype exactly as torch restores its own checkpoints; the target keeps
    its implementation switches (foreach, fused, capturable, differentiable).
    """
    torch = _torch()
    kind = _kind(opt)
    problems: list[str] = []
    if state.optimizer_type != kind:
        problems.append(f"the state is for {state.optimizer_type!r}, the optimizer is {kind!r}")
    groups = opt.param_groups
    params = [p for g in groups for p in g["params"]]
    group_of = [k for k, g in enumerate(groups) for _ in g["params"]]

    hyper: dict[int, dict[str, float]] = {}
    per_param: dict[int, dict[str, Any]] = {}
    for name, value in state.scalars.items():
        m = _PER_PARAM.match(name)
        if m:
            if m.group(1) == "step" and kind != "SGD":
                per_param.setdefault(int(m.group(2)), {})["step"] = value
            else:
                problems.append(f"unknown scalar {name!r} for {kind}")
            continue
        g = _PER_GROUP.match(name)
        k, base = (int(g.group(2)), g.group(1)) if g else (0, name)
        hyper.setdefault(k, {})[base] = value
    buffer_names = _SGD_BUFFERS if kind == "SGD" else _ADAM_BUFFERS
    torch_key = {short: key for key, short in buffer_names.items()}
    for name, buf in state.buffers.items():
        m = _PER_PARAM.match(name)
        if not m or m.group(1) not in torch_key:
            problems.append(f"unknown buffer {name!r} for {kind}")
            continue
        per_param.setdefault(int(m.group(2)), {})[torch_key[m.group(1)]] = buf

    saved_groups = sorted(hyper)
    if saved_groups != list(range(len(groups))):
        problems.append(
            f"the state has {len(saved_groups)} param group(s) (indices {saved_groups}), the "
            f"optimizer {len(groups)}"
        )
    new_groups: list[dict[str, Any]] = []
    for k, group in enumerate(groups):
        values = dict(hyper.get(k, {}))
        size = values.pop("group_size", None)
        if size is None or size != len(group["params"]):
            said = "does not give its size" if size is None else f"gives {size:g}"
            problems.append(
                f"param group {k} has {len(group['params'])} parameters, the state {said}"
            )
        missing = [n for n in _REQUIRED[kind] if n not in values]
        if missing:
            problems.append(f"param group {k} lacks {', '.join(map(repr, missing))}")
        new = {key: v for key, v in group.items() if key != "params"}
        for name, value in values.items():
            if name in ("beta1", "beta2"):
                continue
            if name not in group:
                if value != 0:
                    problems.append(
                        f"param group {k}: hyperparameter {name!r}={value:g} is unknown to "
                        f"this torch {kind}"
                    )
                continue
            current = group[name]
            if isinstance(current, bool) and value not in (0.0, 1.0):
                problems.append(f"param group {k}: {name!r} must be 0 or 1, got {value:g}")
                continue
            new[name] = _restored_like(current, value)
        if "beta1" in values and "beta2" in values:
            current_betas = group.get("betas", (0.0, 0.0))
            new["betas"] = tuple(
                _restored_like(c, values[b]) for c, b in zip(current_betas, ("beta1", "beta2"))
            )
        new_groups.append(new)

    for i, entries in sorted(per_param.items()):
        if i >= len(params):
            problems.append(
                f"the state has entries for parameter {i}, the optimizer has {len(params)} "
                "parameters"
            )
            continue
        numel = params[i].numel()
        for key, value in entries.items():
            if key != "step" and value.size != numel:
                problems.append(
                    f"buffer {buffer_names[key]}.{i} has {value.size} values, parameter {i} "
                    f"has {numel}"
                )
        if kind != "SGD":
            k = group_of[i]
            amsgrad = bool(hyper.get(k, {}).get("amsgrad", groups[k].get("amsgrad", False)))
            needed = ["step", "exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if amsgrad else [])
            lacking = [n for n in needed if n not in entries]
            if lacking:
                short = {"step": "step", **buffer_names}
                problems.append(
                    f"parameter {i} lacks {', '.join(f'{short[n]}.{i}' for n in lacking)}"
                )
    if problems:
        raise OptimizerStateError(f"cannot restore the state into this torch {kind}", problems)

    scalar_dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    torch_state: dict[int, dict[str, Any]] = {}
    for i, entries in per_param.items():
        p = params[i]
        out: dict[str, Any] = {}
        for key, value in entries.items():
            if key == "step":
                out[key] = torch.tensor(value, dtype=scalar_dtype)
            else:
                # A copy in the parameter's dtype and device: the optimizer must never share
                # memory with this OptimizerState's buffers.
                out[key] = (
                    torch.from_numpy(value)
                    .to(dtype=p.dtype, device=p.device, copy=True)
                    .reshape(p.shape)
                )
        torch_state[i] = out
    start = 0
    for group, new in zip(groups, new_groups):
        new["params"] = list(range(start, start + len(group["params"])))
        start += len(group["params"])
    opt.load_state_dict({"state": torch_state, "param_groups": new_groups})
