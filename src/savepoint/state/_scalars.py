"""Python scalars and 0-d tensors standing in for each other, when nothing is lost.

Training scripts move a value between the two forms (an ``lr`` that a scheduler keeps as a 0-d
tensor in one version and as a float in the next), so a restore accepts either side:

- a saved 0-d tensor (or numpy scalar) restores into a ``float``, ``int`` or ``bool`` target (or a
  numpy scalar) when the target's type holds *every* value of the saved dtype: the values are not
  read until after planning, so this is decided by dtype (a float holds every F32 and every I32
  value, not every I64 one);
- a saved ``float``, ``int`` or ``bool`` fills a 0-d array or tensor target when that value is
  exactly representable in the target's dtype (the value is in the manifest, so this is decided
  by value: 0.5 fits F16, 0.1 does not).

Kinds only widen: bool into int or float, int into float; a float never goes into an integer or
bool target, nor an int into a bool one, even when the value would survive (2.0, 1). Everything
else is a problem for the caller to report before anything is modified.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Any

import numpy as np

from savepoint.codecs import dtypes

_INT_RANGE = {
    name: (int(np.iinfo(d.numpy).min), int(np.iinfo(d.numpy).max))
    for name, d in dtypes.BY_NAME.items()
    if d.kind in "iu"
}
# The float dtypes; their specs are computed when first asked for (bfloat16's and float8's need
# ml_dtypes, which is imported only then: see savepoint.codecs.dtypes).
_FLOATS = frozenset(name for name, d in dtypes.BY_NAME.items() if d.kind == "f")


@functools.cache
def _float_spec(name: str) -> tuple[int, float, float, bool]:
    """(significand bits, largest finite value, smallest subnormal, has infinities)."""
    d = dtypes.BY_NAME[name].numpy
    if dtypes.BY_NAME[name].plain is not None:
        info: Any = np.finfo(d)
    else:
        import ml_dtypes

        info = ml_dtypes.finfo(d)  # type: ignore[no-untyped-call]
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # inf into a type without it becomes NaN: that is the test
        has_inf = bool(np.isinf(np.array(np.inf).astype(d).astype(np.float64)))
    return int(info.nmant) + 1, float(info.max), float(info.smallest_subnormal), has_inf


_PYINT = "int"  # a Python int: every integer
_PYTHON = {bool: "BOOL", int: _PYINT, float: "F64"}


def target_dtype(target: Any) -> str | None:
    """The dtype a scalar target holds (``"int"`` for a Python int, unbounded), or None when
    ``target`` is not a Python ``bool``/``int``/``float`` or a storable numpy scalar."""
    python = _PYTHON.get(type(target))
    if python is not None:
        return python
    if isinstance(target, np.generic) and target.dtype.kind in "biufc":
        try:
            return dtypes.from_numpy(target.dtype, "").name
        except Exception:  # a numpy scalar type savepoint cannot store (float128...)
            return None
    return None


def holds(src: str, dst: str) -> bool:
    """Whether every value of dtype ``src`` is exactly a value of dtype ``dst``."""
    if src == dst or src == "BOOL":
        return True
    if dst == "BOOL" or src == "C64":
        return False
    if dst == "C64":
        dst = "F32"  # the real part
    if src in _INT_RANGE:
        lo, hi = _INT_RANGE[src]
        if dst == _PYINT:
            return True
        if dst in _INT_RANGE:
            dlo, dhi = _INT_RANGE[dst]
            return dlo <= lo and hi <= dhi
        bits, largest, _, _ = _float_spec(dst)
        return max(-lo, hi) <= 2**bits and hi <= largest
    if dst not in _FLOATS:
        return False  # a float into an integer
    sbits, smax, ssub, sinf = _float_spec(src)
    dbits, dmax, dsub, dinf = _float_spec(dst)
    return dbits >= sbits and dmax >= smax and dsub <= ssub and (dinf or not sinf)


def _name(dst: str) -> str:
    return {"BOOL": "bool", _PYINT: "int"}.get(dst, dst)


def tensor_into_scalar(src: str, target: Any) -> str | None:
    """Why a saved 0-d ``src`` tensor cannot restore into the scalar ``target`` (None: it can)."""
    dst = target_dtype(target)
    assert dst is not None
    if holds(src, dst):
        return None
    what = f"a Python {type(target).__name__}" if type(target) in _PYTHON else f"a numpy {dst}"
    return f"the checkpoint holds a 0-d {src} tensor here; {what} cannot hold every {src} value"


def to_scalar(value: Any, target: Any) -> Any:
    """``value`` (a 0-d array or tensor, or a numpy scalar) as a scalar of ``target``'s type;
    lossless once :func:`tensor_into_scalar` allowed it."""
    item = value.item()
    kind = type(target)
    if kind in _PYTHON:
        return kind(item)
    return np.array(item, dtype=target.dtype)[()]


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:18]}...{text[-18:]} ({len(text)} digits)"


def value_into_tensor(value: Any, dst: str) -> str | None:
    """Why the saved plain ``value`` cannot fill a 0-d tensor of dtype ``dst`` (None: it can)."""
    if dst not in dtypes.BY_NAME or not isinstance(value, (bool, int, float)):
        return f"the checkpoint holds a {type(value).__name__} here, found a 0-d {dst} tensor"
    if isinstance(value, bool):
        return None
    if dst == "BOOL" or (isinstance(value, float) and dst in _INT_RANGE):
        return (
            f"the checkpoint holds the {type(value).__name__} {_show(value)} here; a target of "
            f"dtype {dst} takes only {'bool' if dst == 'BOOL' else 'int or bool'} values"
        )
    if dst in _INT_RANGE:
        lo, hi = _INT_RANGE[dst]
        return None if lo <= value <= hi else f"{_show(value)} in the checkpoint does not fit {dst}"
    try:
        wide = float(value)
    except OverflowError:
        return f"{_show(value)} in the checkpoint does not fit {dst}"
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # overflow to inf is detected below
        cast = np.array(wide, dtype=np.float64).astype(dtypes.from_name(dst).numpy)
        back = complex(cast.item()).real if dst == "C64" else float(cast.astype(np.float64))
    if back == value or (math.isnan(back) and math.isnan(wide)):
        return None
    return f"{_show(value)} in the checkpoint would become {back!r} in the {dst} target"


def fill(target: Any, value: Any, dst: str) -> None:
    """Write the plain ``value`` into the 0-d array or tensor ``target`` of dtype ``dst``."""
    d = dtypes.from_name(dst)
    host = np.array(value if dst == "BOOL" or dst in _INT_RANGE else float(value), dtype=d.numpy)
    if isinstance(target, np.ndarray):
        np.copyto(target, host, casting="no")
        return
    from savepoint.state import torch_tensors

    torch_tensors.copy_into(target, host, d)
