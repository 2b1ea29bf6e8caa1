"""Arrays inside snapshots: checking, capturing (into reused buffers), host views, restoring.

numpy lives here; torch in :mod:`savepoint.inference._torch`, imported only when a torch tensor is
met (or asked for), so numpy-only use never imports torch. A captured numpy array is a fresh
C-contiguous, native-order buffer exposed through a read-only view: the view is what callers see,
the buffer is what :class:`~savepoint.inference.history.SnapshotHistory` may refill when the
snapshot it belongs to was never handed out.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from savepoint.codecs import dtypes
from savepoint.codecs.dtypes import DType
from savepoint.errors import UnsupportedStateError
from savepoint.state import arrays

Framework = str  # "auto" | "numpy" | "torch", checked by the callers


_NUMPY_DTYPES: dict[np.dtype[Any], DType] = {}  # accepted numpy dtypes, checked once each


def numpy_dtype(dt: np.dtype[Any], where: str) -> DType:
    found = _NUMPY_DTYPES.get(dt)
    if found is None:
        if dt.hasobject or dt.fields is not None:
            raise UnsupportedStateError(
                f"{where}: numpy arrays of {dt} cannot be snapshotted; use a numeric dtype",
                key=where,
            )
        native = dt.newbyteorder("<") if dt.byteorder == ">" else dt
        found = _NUMPY_DTYPES[dt] = dtypes.from_numpy(native, where)
    return found


def leaves(values: Any, role: str) -> list[tuple[Any, str, DType]]:
    """(array, kind, dtype) for each array of ``values``, all checked before anything is copied."""
    if isinstance(values, (np.ndarray, str, bytes, Mapping)) or arrays.is_torch_tensor(values):
        raise UnsupportedStateError(
            f"{role} must be a sequence of arrays (a list or tuple), got {type(values).__name__}",
            key=role,
        )
    if not isinstance(values, Iterable):
        raise UnsupportedStateError(
            f"{role} must be a sequence of arrays, got {type(values).__name__}", key=role
        )
    out = []
    for i, obj in enumerate(values):
        if type(obj) is np.ndarray:  # the common case first: one dict lookup
            d = _NUMPY_DTYPES.get(obj.dtype) or numpy_dtype(obj.dtype, f"{role}/{i}")
            out.append((obj, "numpy", d))
            continue
        where = f"{role}/{i}"
        if isinstance(obj, np.generic) and not isinstance(obj, (np.str_, np.bytes_, np.void)):
            obj = np.asarray(obj)
        if isinstance(obj, np.ndarray):
            out.append((obj, "numpy", numpy_dtype(obj.dtype, where)))
        elif arrays.is_torch_tensor(obj):
            from savepoint.inference import _torch

            out.append((obj, "torch", _torch.check(obj, where)[0]))
        else:
            raise UnsupportedStateError(
                f"{where}: expected a numpy array or torch tensor, got {type(obj).__name__}; "
                "convert it with np.asarray(x, dtype=...) so its dtype is explicit",
                key=where,
            )
    return out


def capture(obj: Any, kind: str, d: DType, reuse: tuple[Any, Any] | None) -> tuple[Any, Any]:
    """A copy of ``obj`` as (what the snapshot exposes, the writable buffer behind it).

    numpy: a read-only view of a new C-contiguous buffer; torch: a new tensor (its own buffer).
    ``reuse`` is a (view, buffer) pair of an evicted, never handed out snapshot: its buffer is
    filled when dtype and shape (and device) match, and its view is exposed again.
    """
    if kind == "torch":
        from savepoint.inference import _torch

        tensor = _torch.capture(obj, reuse[1] if reuse is not None else None)
        return tensor, tensor
    if reuse is not None:
        buffer = reuse[1]
        if type(buffer) is np.ndarray and buffer.shape == obj.shape and buffer.dtype == d.numpy:
            np.copyto(buffer, obj)  # same dtype up to byte order: an exact copy
            return reuse
    buffer = np.empty(obj.shape, dtype=d.numpy)
    np.copyto(buffer, obj)
    view = buffer.view()
    view.flags.writeable = False
    return view, buffer


def kind_of(a: Any) -> str:
    return "numpy" if isinstance(a, np.ndarray) else "torch"


def dtype_of(a: Any) -> DType:
    if isinstance(a, np.ndarray):
        return dtypes.from_numpy(a.dtype, "")
    return dtypes.from_torch(a.dtype, "")


def host(a: Any) -> np.ndarray[Any, Any]:
    if isinstance(a, np.ndarray):
        return a
    from savepoint.inference import _torch

    return _torch.host(a, dtype_of(a))


def adopt(array: np.ndarray[Any, Any], kind: str, framework: Framework) -> Any:
    """A decoded host array as the snapshot keeps it: read-only numpy, or a CPU torch tensor."""
    want = kind if framework == "auto" else framework
    if want == "torch" and (framework == "torch" or torch_available()):
        from savepoint.inference import _torch

        return _torch.from_host(array, dtypes.from_numpy(array.dtype, ""))
    if array.flags.writeable:
        array.flags.writeable = False
    return array


def torch_available() -> bool:
    """Whether torch can be imported: ``framework="auto"`` gives numpy arrays where it cannot,
    as ``sp.load`` does."""
    if sys.modules.get("torch") is not None:
        return True
    return importlib.util.find_spec("torch") is not None


def fresh(a: Any) -> Any:
    """A writable copy of a snapshot array, for the caller to own."""
    if isinstance(a, np.ndarray):
        return np.array(a, copy=True)
    return a.clone()


def same(a: Any, b: Any) -> bool:
    if kind_of(a) != kind_of(b) or dtype_of(a) != dtype_of(b) or tuple(a.shape) != tuple(b.shape):
        return False
    return host(a).tobytes() == host(b).tobytes()


def target_problem(target: Any, src: Any) -> str | None:
    if (
        type(target) is np.ndarray
        and type(src) is np.ndarray
        and target.dtype == src.dtype
        and target.shape == src.shape
        and target.flags.writeable
    ):
        return None  # the common case, without building descriptions
    d, shape = dtype_of(src), tuple(src.shape)
    if isinstance(target, np.ndarray):
        got = arrays.describe(target)
        assert got is not None
        if got != (d.name, shape):
            return f"{d.name} {list(shape)} in the snapshot, {got[0]} {list(got[1])} in the target"
        if not target.flags.writeable:
            return "the target array is read-only"
        return None
    if arrays.is_torch_tensor(target):
        from savepoint.inference import _torch

        return _torch.check_target(target, d, shape)
    return f"expected a numpy array or torch tensor to restore into, got {type(target).__name__}"


def copy_into(target: Any, src: Any) -> None:
    if isinstance(target, np.ndarray):
        np.copyto(target, src if type(src) is np.ndarray else host(src))  # same dtype: exact
        return
    from savepoint.inference import _torch

    _torch.copy_into(target, src, dtype_of(src))


def same_json(a: Any, b: Any) -> bool:
    """Equality that tells 1 from 1.0 and True from 1, as the encodings do."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_json(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(map(same_json, a, b))
    return bool(a == b)
