"""Property tests: arbitrary state trees survive save/load (and load(into=...)) exactly."""

from __future__ import annotations

import math
import os
import tempfile
from typing import Any

import ml_dtypes
import numpy as np
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import savepoint as sp
from _compare import same

DTYPES = [
    np.dtype(t)
    for t in (
        np.bool_,
        np.uint8,
        np.int8,
        np.uint16,
        np.int16,
        np.uint32,
        np.int32,
        np.uint64,
        np.int64,
        np.float16,
        ml_dtypes.bfloat16,
        np.float32,
        np.float64,
        np.complex64,
        ml_dtypes.float8_e4m3fn,
        ml_dtypes.float8_e5m2,
        ml_dtypes.float8_e4m3fnuz,
        ml_dtypes.float8_e5m2fnuz,
    )
]
# numpy's own multi-byte dtypes also exist big-endian; savepoint must store them by value.
SWAPPABLE = {
    np.dtype(t)
    for t in (
        np.uint16,
        np.int16,
        np.uint32,
        np.int32,
        np.uint64,
        np.int64,
        np.float16,
        np.float32,
        np.float64,
        np.complex64,
    )
}

SETTINGS = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@st.composite
def arrays(draw: Any, *, allow_views: bool = True) -> np.ndarray:
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
    n = math.prod(shape)
    if dtype == np.bool_:
        arr = np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=np.bool_)
    else:
        raw = draw(st.binary(min_size=n * dtype.itemsize, max_size=n * dtype.itemsize))
        arr = np.frombuffer(raw, dtype=np.uint8).copy().view(dtype)
    arr = arr.reshape(shape)
    if allow_views:
        layout = draw(st.sampled_from(["c", "transposed", "reversed", "big-endian"]))
        if layout == "transposed":
            arr = arr.T
        elif layout == "reversed" and arr.ndim:
            arr = arr[::-1]
        elif layout == "big-endian" and dtype in SWAPPABLE:
            arr = arr.astype(dtype.newbyteorder(">"))
    return arr


@st.composite
def numpy_scalars(draw: Any) -> np.generic:
    dtype = draw(st.sampled_from(DTYPES))
    if dtype == np.bool_:
        return np.bool_(draw(st.booleans()))
    raw = draw(st.binary(min_size=dtype.itemsize, max_size=dtype.itemsize))
    return np.frombuffer(raw, dtype=np.uint8).copy().view(dtype).reshape(())[()]


ODD_TEXT = ["", " ", "/", "//", "~", "~0", "~1", "~2", "a/b", "0", "\ud800", "x\udfff", "日本 🎉"]
keys = st.one_of(
    st.sampled_from([*ODD_TEXT, "1", "-1", "a", "b"]),  # collide often: "0" vs 0, "a/b" vs a -> b
    st.integers(min_value=-2, max_value=2),
    st.text(max_size=6),
    st.integers(min_value=-(2**70), max_value=2**70),
)
plain = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=-(2**200), max_value=2**200),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=10),
    st.sampled_from(ODD_TEXT),
    st.binary(max_size=16),
)


def trees(leaves: Any, *, tuples: bool = True) -> Any:
    def extend(children: Any) -> Any:
        options = [st.lists(children, max_size=4), st.dictionaries(keys, children, max_size=4)]
        if tuples:
            options.append(st.lists(children, max_size=4).map(tuple))
        return st.one_of(*options)

    return st.recursive(leaves, extend, max_leaves=12)


def expected(tree: Any) -> Any:
    """What load should return: the same tree with arrays in native byte order."""
    if isinstance(tree, dict):
        return {k: expected(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(expected(v) for v in tree)
    if isinstance(tree, np.ndarray) and tree.dtype.byteorder == ">":
        return tree.astype(tree.dtype.newbyteorder("="))
    return tree


@SETTINGS
@given(
    state=trees(st.one_of(plain, arrays(), numpy_scalars())),
    tie=st.one_of(st.none(), arrays(allow_views=False)),
    metadata=st.dictionaries(st.text(max_size=5), st.one_of(st.integers(), st.text(max_size=5))),
)
@example(state={0: np.zeros(2), "0": np.ones(2)}, tie=None, metadata={})
@example(state={"a/b": np.zeros(1), "a": {"b": np.ones(1)}}, tie=None, metadata={})
@example(state=[np.arange(3), (np.float32(1), b"x")], tie=np.arange(4), metadata={"k": 1})
def test_any_tree_round_trips(state: Any, tie: np.ndarray | None, metadata: dict[str, Any]) -> None:
    root: Any = state if tie is None else {"state": state, "tie": [tie, {"again": tie}]}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ckpt")
        info = sp.save(path, root, metadata=metadata)
        out = sp.load(path)
        same(out, expected(root))
        assert sp.inspect(path).metadata == metadata
        assert sp.verify(path).tensors == info.tensors
        if tie is not None and tie.nbytes:
            assert out["tie"][0] is out["tie"][1]["again"]
        same(sp.load(path, mmap=True), expected(root))


def _target(tree: Any) -> Any:
    """A live object of the same structure: zeroed arrays to fill, placeholders to overwrite."""
    if isinstance(tree, dict):
        return {k: _target(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_target(v) for v in tree]
    if isinstance(tree, np.ndarray):
        return np.zeros(tree.shape, dtype=tree.dtype.newbyteorder("="))
    if isinstance(tree, np.generic):
        return None  # created fresh by the load
    return "placeholder"


def _arrays_by_path(tree: Any, path: tuple[Any, ...] = ()) -> dict[tuple[Any, ...], Any]:
    if isinstance(tree, dict):
        return {p: a for k, v in tree.items() for p, a in _arrays_by_path(v, (*path, k)).items()}
    if isinstance(tree, list):
        return {p: a for i, v in enumerate(tree) for p, a in _arrays_by_path(v, (*path, i)).items()}
    return {path: tree} if isinstance(tree, np.ndarray) else {}


@SETTINGS
@given(
    state=st.dictionaries(
        keys, trees(st.one_of(plain, arrays(), numpy_scalars()), tuples=False), max_size=4
    )
)
def test_load_into_matching_structure_reproduces_saved_values(state: dict[Any, Any]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ckpt")
        sp.save(path, state)
        target = _target(state)
        arrays_before = _arrays_by_path(target)
        assert sp.load(path, into=target) is target
        same(target, expected(state))
        arrays_after = _arrays_by_path(target)
        assert arrays_after.keys() == arrays_before.keys()
        for p, arr in arrays_before.items():
            assert arrays_after[p] is arr, f"{p}: array replaced instead of filled in place"
