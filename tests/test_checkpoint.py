"""End-to-end tests of sp.save / sp.load / sp.verify / sp.inspect with numpy and plain state."""

from __future__ import annotations

import copy
import hashlib
import json
import math
import mmap
import os
import sys
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import savepoint as sp
from _compare import same
from _support import in_thread

# The dtypes savepoint stores, by their safetensors name.
DTYPES: dict[str, Any] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "U16": np.dtype(np.uint16),
    "I16": np.dtype(np.int16),
    "U32": np.dtype(np.uint32),
    "I32": np.dtype(np.int32),
    "U64": np.dtype(np.uint64),
    "I64": np.dtype(np.int64),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "C64": np.dtype(np.complex64),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E4M3FNUZ": np.dtype(ml_dtypes.float8_e4m3fnuz),
    "F8_E5M2FNUZ": np.dtype(ml_dtypes.float8_e5m2fnuz),
}


def random_array(dtype: Any, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Arbitrary bit patterns (NaNs, infinities, subnormals included); bools are 0 or 1."""
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    n = math.prod(shape) * dtype.itemsize
    return rng.integers(0, 256, size=n, dtype=np.uint8).view(dtype).reshape(shape)


def backing_object(a: np.ndarray) -> Any:
    x: Any = a
    while isinstance(x, np.ndarray):
        x = x.base
    if isinstance(x, memoryview):
        x = x.obj
    return x


def sha(path: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.iterdir())
        if p.is_file()
    }


def manifest(path: Path) -> dict[str, Any]:
    with open(path / "manifest.json", encoding="utf-8") as f:
        return json.load(f)


def data_file_of(path: Path, ref: str) -> Path:
    return path / manifest(path)["tensors"][ref]["file"]


# ---------------------------------------------------------------------------------------------
# numpy round trips
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(DTYPES))
@pytest.mark.parametrize("shape", [(3, 5), (7,), (), (0,), (2, 0, 3)], ids=str)
def test_numpy_dtype_round_trip(ckpt: Path, name: str, shape: tuple[int, ...]) -> None:
    dtype = DTYPES[name]
    arr = random_array(dtype, shape, seed=len(name))
    info = sp.save(ckpt, {"x": arr})
    assert [(t.key, t.dtype, t.shape) for t in info.tensors] == [("x", name, shape)]
    assert info.tensors[0].nbytes == arr.nbytes
    out = sp.load(ckpt)["x"]
    assert isinstance(out, np.ndarray)  # a 0-d array stays an array, not a scalar
    same(out, arr)
    assert sp.load(ckpt, framework="numpy")["x"].dtype == dtype


@pytest.mark.parametrize("name", list(DTYPES))
def test_numpy_scalar_round_trip(ckpt: Path, name: str) -> None:
    scalar = random_array(DTYPES[name], (), seed=3)[()]
    assert isinstance(scalar, np.generic)
    sp.save(ckpt, {"s": scalar, "nested": [scalar]})
    out = sp.load(ckpt)
    for got in (out["s"], out["nested"][0]):
        assert type(got) is type(scalar)
        assert got.dtype == scalar.dtype
        assert got.tobytes() == scalar.tobytes()
    assert sp.inspect(ckpt).tensors[0].shape == ()


@pytest.mark.parametrize(
    "make",
    [
        lambda a: a.T,
        lambda a: a[::2, 1::3],
        lambda a: a[::-1, ::-2],
        lambda a: np.asfortranarray(a),
        lambda a: a[:, 3],
        lambda a: np.broadcast_to(a[0], (4, 12)),
    ],
    ids=["transposed", "strided", "negative-strides", "fortran", "column", "broadcast"],
)
def test_non_contiguous_round_trip(ckpt: Path, make: Any) -> None:
    base = np.arange(5 * 12, dtype=np.float32).reshape(5, 12)
    view = make(base)
    expected = np.array(view)  # a contiguous copy, taken before saving
    sp.save(ckpt, {"v": view})
    same(sp.load(ckpt)["v"], expected)
    same(view, expected)  # the source is untouched
    assert sp.inspect(ckpt).tensors[0].shape == view.shape


@pytest.mark.parametrize("dt", [">i2", ">u4", ">i8", ">f2", ">f4", ">f8", ">c8"])
def test_big_endian_round_trip(ckpt: Path, dt: str) -> None:
    arr = (np.arange(12) - 5).astype(dt).reshape(3, 4)
    original = arr.copy()
    sp.save(ckpt, {"be": arr, "be_t": arr.T})
    out = sp.load(ckpt)
    native = np.dtype(dt).newbyteorder("=")
    for got, want in ((out["be"], arr), (out["be_t"], arr.T)):
        assert got.dtype == native
        np.testing.assert_array_equal(got, want)
    # saving did not byte-swap the caller's array in place
    assert arr.dtype == np.dtype(dt)
    np.testing.assert_array_equal(arr, original)
    assert arr.tobytes() == original.tobytes()


def test_root_may_be_a_single_leaf(tmp_path: Path) -> None:
    arr = np.arange(4, dtype=np.int16)
    sp.save(tmp_path / "a", arr)
    same(sp.load(tmp_path / "a"), arr)
    sp.save(tmp_path / "v", "just a string")
    assert sp.load(tmp_path / "v") == "just a string"
    sp.save(tmp_path / "s", np.float64(2.5))
    same(sp.load(tmp_path / "s"), np.float64(2.5))


PLAIN_VALUES = [
    0,
    -1,
    2**100,
    -(2**80) + 7,
    2**63,
    0.0,
    -0.0,
    1.5,
    5e-324,
    1.7976931348623157e308,
    float("nan"),
    float("inf"),
    float("-inf"),
    "",
    "plain",
    "ünïcödé 日本語 🎉 \x00 \n\t\"'\\",
    b"",
    bytes(range(256)),
    None,
    True,
    False,
]


@pytest.mark.parametrize("value", PLAIN_VALUES, ids=repr)
def test_plain_value_round_trip(ckpt: Path, value: Any) -> None:
    sp.save(ckpt, {"v": value, "l": [value], "t": (value,)})
    out = sp.load(ckpt)
    same(out, {"v": value, "l": [value], "t": (value,)})


def test_bytearray_and_memoryview_come_back_as_bytes(ckpt: Path) -> None:
    sp.save(ckpt, {"ba": bytearray(b"\x01\x02"), "mv": memoryview(b"xyz")})
    same(sp.load(ckpt), {"ba": b"\x01\x02", "mv": b"xyz"})


def test_nested_containers_keep_types_order_and_key_types(ckpt: Path) -> None:
    state = {
        "z": 1,
        "a": [1, (2, [3, {"deep": (np.arange(3),)}]), []],
        0: "int zero",
        "0": "str zero",
        -5: {1: {2: ()}},
        "empty": {},
        "tuple": (),
        "mixed": [None, True, 1, 1.0, "1", b"1", np.int8(1), np.ones(1, np.int8)],
    }
    sp.save(ckpt, state)
    out = sp.load(ckpt)
    same(out, state)
    assert list(out) == ["z", "a", 0, "0", -5, "empty", "tuple", "mixed"]


WEIRD_KEYS = [
    "a/b",
    "/",
    "//",
    "~",
    "~0",
    "~1",
    "~2",
    "0~2",
    "~u0041",
    "",
    " ",
    "  spaced key  ",
    "ünïcödé",
    "日本",
    "emoji 🎉",
    "tab\tnewline\n",
    "\x00",
    "\ud800",  # a lone surrogate
    "a.weight",
]


def test_weird_keys_round_trip(ckpt: Path) -> None:
    state: dict[Any, Any] = {}
    for i, k in enumerate(WEIRD_KEYS):
        state[k] = {"arr": np.full(2, i, np.int32), k: np.full(3, i, np.int16), "v": k}
    state[0] = np.zeros(1)  # int 0 and "0" both map to the tensor name "0"
    state["0"] = np.ones(1)
    sp.save(ckpt, state)
    same(sp.load(ckpt), state)
    info = sp.inspect(ckpt)
    refs = [t.ref for t in info.tensors]
    assert len(refs) == len(set(refs)) == 2 * len(WEIRD_KEYS) + 2
    sp.verify(ckpt)


def test_escaped_paths_do_not_collide(ckpt: Path) -> None:
    state = {"a/b": {"c": np.zeros(2)}, "a": {"b": {"c": np.ones(2)}, "b/c": np.full(2, 2.0)}}
    sp.save(ckpt, state)
    same(sp.load(ckpt), state)
    assert sorted(t.key for t in sp.inspect(ckpt).tensors) == ["a/b/c", "a/b~1c", "a~1b/c"]


def test_tied_arrays_come_back_tied(ckpt: Path) -> None:
    w = np.arange(6, dtype=np.float32).reshape(2, 3)
    other_view = w[1:]
    state = {"a": w, "b": w, "nested": [w, {"again": w}], "view": other_view, "t": w.T}
    info = sp.save(ckpt, state)
    by_key = {t.key: t for t in info.tensors}
    assert by_key["b"].ref == by_key["nested/0"].ref == by_key["nested/1/again"].ref == "a"
    assert by_key["view"].ref == "view" and by_key["t"].ref == "t"  # different views: own copies
    assert info.total_bytes == w.nbytes + other_view.nbytes + w.nbytes

    out = sp.load(ckpt)
    assert out["a"] is out["b"] is out["nested"][0] is out["nested"][1]["again"]
    assert out["view"] is not out["a"]
    np.testing.assert_array_equal(out["a"], w)
    np.testing.assert_array_equal(out["view"], other_view)
    np.testing.assert_array_equal(out["t"], w.T)
    # the file stores the tied tensor once
    assert len(manifest(ckpt)["tensors"]) == 3

    mapped = sp.load(ckpt, mmap=True)
    assert mapped["a"] is mapped["b"]


def test_metadata_round_trips_through_inspect(ckpt: Path) -> None:
    metadata = {
        "step": 100,
        "lr": 3e-4,
        "note": "ünïcödé",
        "nested": {"list": [1, 2.5, "x", None, True, {"deep": []}]},
        "big": 2**70,
    }
    info = sp.save(ckpt, {"x": np.zeros(1)}, metadata=metadata)
    assert info.metadata == metadata
    assert sp.inspect(ckpt).metadata == metadata
    assert sp.verify(ckpt).metadata == metadata
    assert sp.inspect(ckpt).to_dict()["metadata"] == metadata
    sp.save(ckpt, {"x": np.zeros(1)})
    assert sp.inspect(ckpt).metadata == {}


@pytest.mark.parametrize(
    "metadata",
    [
        {"s": {1, 2}},
        {"o": object()},
        {"nan": float("nan")},
        {"inf": float("inf")},
        {"b": b"x"},
        [1, 2],
    ],
    ids=["set", "object", "nan", "inf", "bytes", "not-a-mapping"],
)
def test_non_json_metadata_is_refused(ckpt: Path, metadata: Any) -> None:
    with pytest.raises(sp.UnsupportedStateError, match="metadata"):
        sp.save(ckpt, {"x": np.zeros(1)}, metadata=metadata)
    assert not ckpt.exists()
    assert os.listdir(ckpt.parent) == []


class _Opaque:
    pass


UNSUPPORTED = {
    "object": (object(), "object"),
    "set": ({1, 2}, "set"),
    "frozenset": (frozenset(), "frozenset"),
    "complex": (1 + 2j, "complex"),
    "class": (_Opaque, "type"),
    "instance": (_Opaque(), "_Opaque"),
    "function": (len, "builtin_function_or_method"),
    "str-array": (np.array(["x", "y"]), "<U1"),
    "bytes-array": (np.array([b"x"]), "S1"),
    "object-array": (np.array([1, "a"], dtype=object), "Python objects"),
    "complex128": (np.zeros(2, np.complex128), "complex128"),
    "datetime64": (np.zeros(2, "datetime64[s]"), "datetime64"),
    "structured": (np.zeros(2, dtype=[("a", "i4"), ("b", "f4")]), "dtype"),
    "complex128-scalar": (np.complex128(1j), "complex128"),
}


@pytest.mark.parametrize("name", list(UNSUPPORTED))
def test_unsupported_leaf_names_key_path_and_type(ckpt: Path, name: str) -> None:
    leaf, type_text = UNSUPPORTED[name]
    sp.save(ckpt, {"ok": 1})  # an existing checkpoint that a failed save must not disturb
    before = sha(ckpt)
    state = {"fine": np.zeros(3), "outer": {"inner": [0, 1, leaf]}}
    with pytest.raises(sp.UnsupportedStateError) as excinfo:
        sp.save(ckpt, state)
    err = excinfo.value
    assert err.key == "outer/inner/2"
    assert "outer/inner/2" in str(err)
    assert type_text in str(err)
    assert isinstance(err, TypeError)
    assert sha(ckpt) == before
    assert sorted(os.listdir(ckpt.parent)) == ["ckpt"]  # no staging directory left behind
    assert sp.load(ckpt) == {"ok": 1}


@pytest.mark.parametrize(
    ("key", "type_name"), [(1.5, "float"), (True, "bool"), ((1, 2), "tuple"), (None, "NoneType")]
)
def test_unsupported_dict_keys(ckpt: Path, key: Any, type_name: str) -> None:
    with pytest.raises(sp.UnsupportedStateError) as excinfo:
        sp.save(ckpt, {"a": {"b": {key: 1}}})
    assert excinfo.value.key == "a/b"
    assert "a/b" in str(excinfo.value) and type_name in str(excinfo.value)
    assert not ckpt.exists()


def test_reference_cycle_is_refused(ckpt: Path) -> None:
    loop: dict[str, Any] = {"x": 1}
    loop["self"] = [loop]
    with pytest.raises(sp.UnsupportedStateError, match="cycle"):
        sp.save(ckpt, {"loop": loop})
    assert not ckpt.exists()
    shared = [1, 2]
    sp.save(ckpt, {"a": shared, "b": shared})  # shared but acyclic is fine
    assert sp.load(ckpt) == {"a": [1, 2], "b": [1, 2]}


# ---------------------------------------------------------------------------------------------
# save: replacing, files, progress
# ---------------------------------------------------------------------------------------------


def test_save_replaces_existing_checkpoint_atomically(ckpt: Path) -> None:
    sp.save(ckpt, {"x": np.zeros(3), "version": 1})
    sp.save(ckpt, {"y": np.ones(2), "version": 2})
    same(sp.load(ckpt), {"y": np.ones(2), "version": 2})
    assert sorted(os.listdir(ckpt.parent)) == ["ckpt"]


def test_save_refuses_foreign_directory_and_files(tmp_path: Path) -> None:
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "precious.txt").write_text("keep me")
    with pytest.raises(sp.CheckpointWriteError) as excinfo:
        sp.save(foreign, {"x": 1})
    assert excinfo.value.path == str(foreign)
    assert os.listdir(foreign) == ["precious.txt"]
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(sp.CheckpointWriteError):
        sp.save(a_file, {"x": 1})
    assert a_file.read_text() == "x"
    empty = tmp_path / "empty"
    empty.mkdir()
    sp.save(empty, {"x": 1})
    assert sp.load(empty) == {"x": 1}


def test_many_files_and_writers(ckpt: Path) -> None:
    state = {f"t{i}": random_array(np.float32, (64,), seed=i) for i in range(10)}
    info = sp.save(ckpt, state, max_file_bytes=600, writers=4)
    assert len(info.files) == 5
    for name, size in info.files.items():
        assert (ckpt / name).stat().st_size == size
    same(sp.load(ckpt), state)
    sp.verify(ckpt)


def test_progress_reports_every_byte(ckpt: Path) -> None:
    state = {"a": np.zeros(1000, np.float64), "b": np.zeros(10, np.int8)}
    calls: list[tuple[int, int]] = []
    sp.save(ckpt, state, progress=lambda done, total: calls.append((done, total)))
    assert calls and calls[-1] == (8010, 8010)
    assert all(total == 8010 for _, total in calls)
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)
    seen: list[tuple[int, int]] = []
    sp.verify(ckpt, progress=lambda done, total: seen.append((done, total)))
    assert seen[-1] == (8010, 8010)


def test_invalid_save_arguments(ckpt: Path) -> None:
    with pytest.raises(ValueError):
        sp.save(ckpt, {"x": 1}, max_file_bytes=0)
    with pytest.raises(ValueError):
        sp.save(ckpt, {"x": 1}, writers=0)
    assert not ckpt.exists()


# ---------------------------------------------------------------------------------------------
# load errors, verify, inspect
# ---------------------------------------------------------------------------------------------


def test_missing_incomplete_and_file_paths(tmp_path: Path) -> None:
    missing = tmp_path / "missing"
    for fn in (sp.load, sp.verify, sp.inspect):
        with pytest.raises(sp.CheckpointNotFoundError) as excinfo:
            fn(missing)
        assert excinfo.value.path == str(missing)
        assert isinstance(excinfo.value, FileNotFoundError)
    empty = tmp_path / "empty"
    empty.mkdir()
    a_file = tmp_path / "file"
    a_file.write_bytes(b"not a checkpoint")
    for path in (empty, a_file):
        for fn in (sp.load, sp.verify, sp.inspect):
            with pytest.raises(sp.IncompleteCheckpointError) as excinfo:
                fn(path)
            assert excinfo.value.path == str(path)


def test_accepts_str_and_pathlike(ckpt: Path) -> None:
    sp.save(str(ckpt), {"x": 1})
    assert sp.load(ckpt) == sp.load(str(ckpt)) == {"x": 1}
    assert sp.inspect(str(ckpt)).path == str(ckpt)


def test_verify_and_load_detect_flipped_data_byte(ckpt: Path, flip_byte: Any) -> None:
    sp.save(ckpt, {"a": np.arange(8, dtype=np.int32), "b": np.arange(8, dtype=np.float64)})
    info = sp.verify(ckpt)
    assert {t.key for t in info.tensors} == {"a", "b"}
    flip_byte(ckpt, "b", 5)
    with pytest.raises(sp.CorruptCheckpointError) as excinfo:
        sp.verify(ckpt)
    assert excinfo.value.key == "b" and excinfo.value.path == str(ckpt)
    assert isinstance(excinfo.value, ValueError)
    with pytest.raises(sp.CorruptCheckpointError):
        sp.load(ckpt)
    with pytest.raises(sp.CorruptCheckpointError):
        sp.load(ckpt, mmap=True)
    # inspect reads the manifest only
    assert {t.key for t in sp.inspect(ckpt).tensors} == {"a", "b"}


def test_verify_false_skips_checksums(ckpt: Path, flip_byte: Any) -> None:
    arr = np.arange(8, dtype=np.uint8)
    sp.save(ckpt, {"a": arr})
    flip_byte(ckpt, "a", 3)
    with pytest.raises(sp.CorruptCheckpointError):
        sp.load(ckpt)
    out = sp.load(ckpt, verify=False)["a"]
    expected = arr.copy()
    expected[3] ^= 0xFF
    np.testing.assert_array_equal(out, expected)
    target = {"a": np.zeros(8, np.uint8)}
    sp.load(ckpt, into=target, verify=False)
    np.testing.assert_array_equal(target["a"], expected)


def test_damaged_manifest_and_truncated_data(ckpt: Path) -> None:
    sp.save(ckpt, {"a": np.arange(100, dtype=np.float32)})
    data = data_file_of(ckpt, "a")
    raw = data.read_bytes()
    data.write_bytes(raw[:-4])
    for fn in (sp.load, sp.verify):
        with pytest.raises(sp.CorruptCheckpointError):
            fn(ckpt)
    data.write_bytes(raw)
    sp.verify(ckpt)

    text = (ckpt / "manifest.json").read_bytes()
    i = text.index(b'"F32"')
    (ckpt / "manifest.json").write_bytes(text[:i] + b'"F64"' + text[i + 5 :])
    for fn in (sp.load, sp.verify, sp.inspect):
        with pytest.raises(sp.CorruptCheckpointError):
            fn(ckpt)
    (ckpt / "manifest.json").write_bytes(text[: len(text) // 2])
    with pytest.raises(sp.CorruptCheckpointError):
        sp.load(ckpt)
    (ckpt / "manifest.json").unlink()
    with pytest.raises(sp.IncompleteCheckpointError):
        sp.load(ckpt)


def test_inspect_describes_everything_from_the_manifest(ckpt: Path) -> None:
    class Counter:
        def __init__(self) -> None:
            self.n = 3

        def state_dict(self) -> dict[str, Any]:
            return {"n": self.n, "w": np.ones(2, np.float16)}

        def load_state_dict(self, sd: dict[str, Any]) -> None:
            self.n = sd["n"]

    state = {
        "w": np.zeros((2, 3), np.float32),
        "s": np.int64(4),
        "step": 7,
        "name": "run",
        "blob": b"abc",
        "nan": float("nan"),
        "ninf": float("-inf"),
        "counter": Counter(),
    }
    saved = sp.save(ckpt, state, metadata={"m": 1})
    info = sp.inspect(ckpt)
    assert info.path == str(ckpt)
    assert info.format_version == 1
    assert info.writer == f"savepoint {sp.__version__}"
    assert info.created.endswith("Z") and info.created[:4].isdigit()
    assert [(t.key, t.dtype, t.shape, t.nbytes) for t in info.tensors] == [
        ("w", "F32", (2, 3), 24),
        ("s", "I64", (), 8),
        ("counter/w", "F16", (2,), 4),
    ]
    assert info.total_bytes == 36
    assert (
        info.values["step"] == 7 and info.values["name"] == "run" and info.values["blob"] == b"abc"
    )
    assert math.isnan(info.values["nan"]) and info.values["ninf"] == float("-inf")
    assert info.values["counter/n"] == 3
    assert info.stateful == {"counter": f"{Counter.__module__}.{Counter.__qualname__}"}
    assert info.files == {n: (ckpt / n).stat().st_size for n in info.files}
    assert [t.key for t in saved.tensors] == [t.key for t in info.tensors]
    as_dict = info.to_dict()
    text = json.dumps(as_dict, allow_nan=False)  # strictly valid JSON despite nan, inf and bytes
    assert json.loads(text)["tensors"][0] == {
        "key": "w",
        "dtype": "F32",
        "shape": [2, 3],
        "nbytes": 24,
        "file": info.tensors[0].file,
    }
    # inspect works with every data file gone
    for name in info.files:
        (ckpt / name).unlink()
    assert sp.inspect(ckpt).tensors == info.tensors


# ---------------------------------------------------------------------------------------------
# load options: keys=, mmap=, framework=
# ---------------------------------------------------------------------------------------------


def _model_state() -> dict[str, Any]:
    return {
        "model": {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(3, np.float32)},
        "opt": {"m": np.zeros(6, np.float64), "lr": 0.1},
        "hist": [np.arange(2), 5, np.arange(3)],
        "step": 9,
    }


def test_keys_selects_prefix_and_exact_paths(ckpt: Path) -> None:
    state = _model_state()
    sp.save(ckpt, state)
    same(sp.load(ckpt, keys="model"), {"model": state["model"]})
    same(sp.load(ckpt, keys="model/w"), {"model": {"w": state["model"]["w"]}})
    same(sp.load(ckpt, keys=["model/b", "step"]), {"model": {"b": state["model"]["b"]}, "step": 9})
    same(sp.load(ckpt, keys=("opt/lr",)), {"opt": {"lr": 0.1}})
    # list positions are kept; unselected items come back as None
    same(sp.load(ckpt, keys="hist/2"), {"hist": [None, None, state["hist"][2]]})
    same(sp.load(ckpt, keys=["model", "model/w"]), {"model": state["model"]})
    # keys= also works with mmap and with into=
    same(sp.load(ckpt, keys="model/w", mmap=True), {"model": {"w": state["model"]["w"]}})
    target = {"model": {"w": np.zeros((2, 3), np.float32)}}
    assert sp.load(ckpt, keys="model/w", into=target) is target
    np.testing.assert_array_equal(target["model"]["w"], state["model"]["w"])


@pytest.mark.parametrize("bad", ["nope", "model/nope", "model/w/extra", "hist/3", "mode"])
def test_unknown_keys_are_incompatible(ckpt: Path, bad: str) -> None:
    sp.save(ckpt, _model_state())
    with pytest.raises(sp.IncompatibleCheckpointError) as excinfo:
        sp.load(ckpt, keys=["model", bad])
    assert repr(bad) in str(excinfo.value)
    assert excinfo.value.path == str(ckpt)
    assert not isinstance(excinfo.value, sp.StateMismatchError)


def test_keys_use_escaped_components(ckpt: Path) -> None:
    state = {"a/b": np.zeros(1), "a": {"b": np.ones(1)}, "t~": {"x": 1, "y": 2}}
    sp.save(ckpt, state)
    same(sp.load(ckpt, keys="a~1b"), {"a/b": state["a/b"]})
    same(sp.load(ckpt, keys="a/b"), {"a": {"b": state["a"]["b"]}})
    same(sp.load(ckpt, keys="t~0/y"), {"t~": {"y": 2}})


@pytest.mark.parametrize(
    "state",
    [
        {"": {"x": np.zeros(2)}, "x": np.ones(3)},
        {"a": {"": np.zeros(2), "b": np.ones(3)}},
        {"a": {"": {"": 1, "c": 2}}, "c": 3},
    ],
    ids=["leading-empty-key", "trailing-empty-key", "nested-empty-keys"],
)
def test_every_key_inspect_lists_can_be_selected(ckpt: Path, state: dict[str, Any]) -> None:
    """``keys=`` accepts the paths inspect prints, including ones with empty components."""
    sp.save(ckpt, state)
    info = sp.inspect(ckpt)
    leaves = {t.key: None for t in info.tensors} | dict.fromkeys(info.values)

    def only(tree: Any, path: tuple[Any, ...]) -> Any:
        if not path:
            return tree
        return {path[0]: only(tree[path[0]], path[1:])}

    paths = {
        "/x": ("", "x"),
        "x": ("x",),
        "a/": ("a", ""),
        "a/b": ("a", "b"),
        "a//": ("a", "", ""),
        "a//c": ("a", "", "c"),
        "c": ("c",),
    }
    for key in leaves:
        same(sp.load(ckpt, keys=key), only(state, paths[key]), f"keys={key!r}")


def test_keys_reads_only_selected_bytes(ckpt: Path, flip_byte: Any) -> None:
    state = {"keep": np.arange(16, dtype=np.int32), "other": np.arange(16, dtype=np.int32)}
    sp.save(ckpt, state)
    flip_byte(ckpt, "other", 0)  # same data file as "keep"
    same(sp.load(ckpt, keys="keep"), {"keep": state["keep"]})
    target = {"keep": np.zeros(16, np.int32)}
    sp.load(ckpt, into=target)  # partial into= reads only what it covers
    np.testing.assert_array_equal(target["keep"], state["keep"])
    with pytest.raises(sp.CorruptCheckpointError):
        sp.load(ckpt)
    with pytest.raises(sp.CorruptCheckpointError):
        sp.load(ckpt, keys="other")


def test_keys_does_not_open_unselected_files(ckpt: Path) -> None:
    state = {"keep": np.arange(64, dtype=np.int64), "other": np.arange(64, dtype=np.int64)}
    sp.save(ckpt, state, max_file_bytes=512)
    other_file = data_file_of(ckpt, "other")
    assert other_file != data_file_of(ckpt, "keep")
    other_file.unlink()
    same(sp.load(ckpt, keys="keep"), {"keep": state["keep"]})
    target = {"keep": np.zeros(64, np.int64)}
    sp.load(ckpt, into=target)
    np.testing.assert_array_equal(target["keep"], state["keep"])
    with pytest.raises(sp.CorruptCheckpointError, match="missing"):
        sp.load(ckpt)


def test_mmap_arrays_are_file_backed_and_copy_on_write(ckpt: Path) -> None:
    state = {"a": np.arange(1024, dtype=np.float32), "s": np.float32(2.0), "v": 1}
    sp.save(ckpt, state)
    files_before = sha(ckpt)
    out = sp.load(ckpt, mmap=True)
    a = out["a"]
    assert isinstance(backing_object(a), mmap.mmap)
    assert not a.flags.owndata
    same(out, state)  # numpy scalars stay scalars
    assert a.flags.writeable
    a[:] = -1.0  # private copy-on-write: the file does not change
    assert (a == -1.0).all()
    assert sha(ckpt) == files_before
    sp.verify(ckpt)
    same(sp.load(ckpt), state)
    fresh = sp.load(ckpt, mmap=True)["a"]
    np.testing.assert_array_equal(fresh, state["a"])

    copied = sp.load(ckpt)["a"]
    assert not isinstance(backing_object(copied), mmap.mmap)


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="MAP_PRIVATE page sharing is Linux behaviour"
)
def test_mmap_reads_from_the_page_cache(ckpt: Path) -> None:
    """An untouched page of a mmap load shows the file's bytes; a copying load does not."""
    sp.save(ckpt, {"a": np.zeros(4096, dtype=np.uint8)})
    mapped = sp.load(ckpt, mmap=True)["a"]
    copied = sp.load(ckpt)["a"]
    start = manifest(ckpt)["tensors"]["a"]["offsets"][0]
    fd = os.open(data_file_of(ckpt, "a"), os.O_WRONLY)
    try:
        os.pwrite(fd, b"\x07" * 16, start)
    finally:
        os.close(fd)
    assert (mapped[:16] == 7).all()
    assert (copied[:16] == 0).all()


def test_framework_numpy_auto_and_invalid(ckpt: Path) -> None:
    state = {"a": np.arange(3, dtype=np.int16), "s": np.uint8(1)}
    sp.save(ckpt, state)
    same(sp.load(ckpt, framework="numpy"), state)
    same(sp.load(ckpt, framework="auto"), state)
    with pytest.raises(ValueError, match="framework"):
        sp.load(ckpt, framework="jax")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# load(into=...)
# ---------------------------------------------------------------------------------------------


def test_into_fills_arrays_in_place_and_assigns_values(ckpt: Path) -> None:
    state = {
        "w": np.arange(6, dtype=np.float32).reshape(2, 3),
        "nested": {"v": np.arange(4, dtype=np.int64), "name": "x", "blob": b"b"},
        "pair": (np.ones(2, np.float16), np.zeros(1, np.bool_)),
        "lst": [np.full(2, 3.0), 4, None],
        "hist": [1.0, 2.0, 3.0],
        "step": 12,
        "fresh": None,
    }
    sp.save(ckpt, {**state, "fresh": np.arange(2)})
    target = {
        "w": np.zeros((2, 3), np.float32),
        "nested": {"v": np.zeros(4, np.int64), "name": "", "blob": b""},
        "pair": (np.zeros(2, np.float16), np.ones(1, np.bool_)),
        "lst": [np.zeros(2), 0, 7],
        "hist": [],
        "step": 0,
        "fresh": None,
    }

    def live_arrays() -> list[Any]:
        return [target["w"], target["nested"]["v"], *target["pair"], target["lst"][0]]

    def live_containers() -> list[Any]:
        return [target["nested"], target["pair"], target["lst"], target["hist"]]

    arrays, containers = live_arrays(), live_containers()
    result = sp.load(ckpt, into=target)
    assert result is target
    assert all(before is after for before, after in zip(arrays, live_arrays()))
    assert all(before is after for before, after in zip(containers, live_containers()))
    state["fresh"] = target["fresh"]
    same(target, state)
    same(target["fresh"], np.arange(2))  # None in the target: a new array is created


def test_into_root_array_and_non_contiguous_target(ckpt: Path) -> None:
    arr = np.arange(12, dtype=np.int32).reshape(3, 4)
    sp.save(ckpt, arr)
    target = np.zeros((3, 4), np.int32)
    assert sp.load(ckpt, into=target) is target
    np.testing.assert_array_equal(target, arr)
    sp.save(ckpt, {"t": arr.T})
    base = np.zeros((3, 4), np.int32)
    view = base.T  # a writable, non-contiguous target
    sp.load(ckpt, into={"t": view})
    np.testing.assert_array_equal(base, arr)


def test_into_reports_every_problem_at_once_and_modifies_nothing(ckpt: Path) -> None:
    sp.save(
        ckpt,
        {
            "a": np.ones((2, 3), np.float32),
            "b": np.ones(4, np.int64),
            "c": {"d": np.ones(5, np.float32), "ok": np.ones(2)},
            "x": np.ones(1),
            "n": 1,
            "lst": [np.ones(2), 3],
            "sub": {"k": 1},
        },
    )
    target = {
        "a": np.zeros((3, 2), np.float32),  # shape
        "b": np.zeros(4, np.int32),  # dtype
        "c": {"d": np.zeros(6, np.float64), "ok": np.zeros(2), "gone": 0},  # dtype + shape, missing
        "x": "not an array",  # a tensor where the target holds a str
        "n": 0,
        "lst": [np.zeros(2), 0],
        "sub": [1],  # a dict in the checkpoint, a list here
        "extra": 5,  # missing from the checkpoint
    }
    snapshot = copy.deepcopy(target)
    objects = {k: id(v) for k, v in target.items()}
    with pytest.raises(sp.StateMismatchError) as excinfo:
        sp.load(ckpt, into=target)
    err = excinfo.value
    assert isinstance(err, sp.IncompatibleCheckpointError) and isinstance(err, ValueError)
    assert err.path == str(ckpt)
    keys = [k for k, _ in err.problems]
    assert sorted(keys) == sorted(["a", "b", "c/d", "c/d", "c/gone", "x", "sub", "extra"])
    text = str(err)
    for k in set(keys):
        assert k in text
    same(target, snapshot)
    assert {k: id(v) for k, v in target.items()} == objects


def test_corrupt_checkpoint_with_into(ckpt: Path, flip_byte: Any) -> None:
    sp.save(ckpt, {"a": np.arange(4, dtype=np.float64), "z": np.arange(3, dtype=np.int8), "n": 3})
    flip_byte(ckpt, "z", 1)
    # verify="first" checks every checksum before touching the target: nothing is modified
    target = {"a": np.zeros(4), "z": np.zeros(3, np.int8), "n": 0}
    snapshot = copy.deepcopy(target)
    with pytest.raises(sp.CorruptCheckpointError) as excinfo:
        sp.load(ckpt, into=target, verify="first")
    assert excinfo.value.key == "z"
    same(target, snapshot)
    # the default checks while copying: the error still names the tensor, plain values stay put
    with pytest.raises(sp.CorruptCheckpointError) as excinfo:
        sp.load(ckpt, into=target)
    assert excinfo.value.key == "z"
    assert target["n"] == 0
    # an intact part of the checkpoint still restores
    part = {"a": np.zeros(4)}
    sp.load(ckpt, into=part, verify="first")
    np.testing.assert_array_equal(part["a"], np.arange(4.0))


def test_invalid_verify_argument(ckpt: Path) -> None:
    sp.save(ckpt, {"a": np.zeros(1)})
    with pytest.raises(ValueError, match="verify"):
        sp.load(ckpt, verify="sometimes")  # type: ignore[arg-type]


# (argument, bad value, the error, what the message says); every one is checked before reading.
BAD_LOAD: list[tuple[str, Any, type[Exception], str]] = [
    ("progress", 5, TypeError, r"load argument progress must be a callable .*, not int \(5\)"),
    ("progress", "print", TypeError, r"load argument progress .*not str"),
    ("mmap", "yes", TypeError, r"load argument mmap must be a bool, not str \('yes'\)"),
    ("mmap", 1, TypeError, r"load argument mmap must be a bool"),
    ("timeout", "x", TypeError, r"load argument timeout must be a number of seconds or None"),
    ("timeout", 0, ValueError, r"load argument timeout must be a positive, finite number"),
    ("timeout", float("nan"), ValueError, r"load argument timeout"),
    ("keys", 5, TypeError, r"load argument keys must be a key \(str\), an iterable of keys"),
    ("keys", b"a", TypeError, r"load argument keys must be .*, not bytes"),
    ("keys", ["a", 1], TypeError, r"load argument keys must be .*; it holds int \(1\)"),
    ("process_group", "nope", TypeError, r"load argument process_group must be a torch"),
]


@pytest.mark.parametrize(("name", "value", "error", "pattern"), BAD_LOAD, ids=repr)
def test_invalid_load_arguments_fail_before_reading(
    ckpt: Path, name: str, value: Any, error: type, pattern: str
) -> None:
    """Before: ``progress=5`` failed mid-load ("'int' object is not callable"), ``keys=5`` with
    "'int' object is not iterable", and ``mmap="yes"`` or ``timeout="x"`` were accepted."""
    sp.save(ckpt, {"a": np.arange(3.0)})
    with pytest.raises(error, match=pattern):
        sp.load(ckpt, **{name: value})
    with pytest.raises(error, match=pattern):  # checked before the path is even looked at
        sp.load(ckpt.parent / "missing", **{name: value})


def test_invalid_verify_arguments_fail_before_reading(ckpt: Path) -> None:
    sp.save(ckpt, {"a": np.arange(3.0)})
    for path in (ckpt, ckpt.parent / "missing"):
        with pytest.raises(TypeError, match=r"verify argument progress must be a callable"):
            sp.verify(path, progress=5)  # type: ignore[arg-type]


def test_valid_load_arguments_still_load(ckpt: Path) -> None:
    sp.save(ckpt, {"a": np.arange(3.0), "b": {"c": 1}})
    seen: list[tuple[int, int]] = []
    loaded = sp.load(
        ckpt, keys=(k for k in ["a", "b/c"]), mmap=True, timeout=5, progress=lambda d, t: None
    )
    np.testing.assert_array_equal(loaded["a"], np.arange(3.0))
    assert loaded["b"] == {"c": 1}
    assert sp.load(ckpt, keys="b") == {"b": {"c": 1}}
    sp.verify(ckpt, progress=lambda d, t: seen.append((d, t)))
    assert seen


def test_read_only_target_is_reported_before_anything_is_modified(ckpt: Path) -> None:
    """A read-only array cannot be restored into; that must not leave a half-restored target."""
    sp.save(ckpt, {"a": np.arange(4, dtype=np.float64), "b": np.arange(3, dtype=np.int64)})
    frozen = np.zeros(3, np.int64)
    frozen.flags.writeable = False
    target = {"a": np.zeros(4), "b": frozen}
    with pytest.raises(sp.IncompatibleCheckpointError, match="read-only"):
        sp.load(ckpt, into=target)
    np.testing.assert_array_equal(target["a"], np.zeros(4))
    np.testing.assert_array_equal(target["b"], np.zeros(3))


class Accumulator:
    """A user-defined Stateful: numpy state plus plain values."""

    def __init__(self, size: int = 3) -> None:
        self.total = np.zeros(size, np.float64)
        self.count = 0
        self.tags: list[str] = []
        self.loaded: list[Any] = []

    def state_dict(self) -> dict[str, Any]:
        return {"total": self.total, "count": self.count, "tags": list(self.tags)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded.append(state)
        self.total = state["total"]
        self.count = state["count"]
        self.tags = list(state["tags"])


def test_user_stateful_round_trip(ckpt: Path) -> None:
    acc = Accumulator()
    acc.total[:] = [1.5, -2.0, 3.25]
    acc.count = 4
    acc.tags = ["a", "b"]
    assert isinstance(acc, sp.Stateful)
    info = sp.save(ckpt, {"acc": acc, "step": 2})
    assert info.stateful == {"acc": f"{__name__}.Accumulator"}

    same(sp.load(ckpt), {"acc": acc.state_dict(), "step": 2})  # comes back as its state dict

    fresh = Accumulator()
    buffer = fresh.total
    target = {"acc": fresh, "step": 0}
    assert sp.load(ckpt, into=target) is target
    assert target["acc"] is fresh and target["step"] == 2
    assert len(fresh.loaded) == 1
    same(fresh.loaded[0], {"total": acc.total, "count": 4, "tags": ["a", "b"]})
    assert fresh.loaded[0]["total"] is buffer  # read in place into the array state_dict() exposed
    np.testing.assert_array_equal(fresh.total, acc.total)
    assert fresh.count == 4 and fresh.tags == ["a", "b"]

    alone = Accumulator()
    assert sp.load(ckpt, keys="acc", into={"acc": alone})["acc"] is alone
    assert alone.count == 4


def test_stateful_as_root_and_mismatch(ckpt: Path) -> None:
    acc = Accumulator(2)
    acc.total[:] = 7
    sp.save(ckpt, acc)
    fresh = Accumulator(2)
    assert sp.load(ckpt, into=fresh) is fresh
    np.testing.assert_array_equal(fresh.total, [7, 7])
    # A user object whose current array does not fit is not judged by savepoint: its own
    # load_state_dict gets the saved array (fresh), and the current one is left untouched.
    other = Accumulator(5)
    old_total = other.total
    assert sp.load(ckpt, into=other) is other
    np.testing.assert_array_equal(other.total, [7, 7])
    assert other.total is not old_total and (old_total == 0).all()


def test_progress_counts_tensor_bytes_and_ends_with_the_save(tmp_path: Path) -> None:
    state = {str(i): np.full(3, i) for i in range(2000)}
    calls: list[tuple[int, int]] = []
    sp.save(tmp_path / "ck", state, max_file_bytes=1000, progress=lambda d, t: calls.append((d, t)))
    total = 2000 * 3 * 8
    assert calls[-1] == (total, total)
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)
    assert sum(1 for d, t in calls if d == t) == 1  # 100% only once, at the end


def test_a_symlinked_checkpoint_path_replaces_what_it_points_to(tmp_path: Path) -> None:
    real = tmp_path / "disk" / "ckpt"
    sp.save(real, {"x": np.ones(4)})
    link = tmp_path / "ckpt"
    link.symlink_to(real)
    sp.save(link, {"x": np.zeros(5)})
    assert link.is_symlink()
    assert sp.load(real)["x"].shape == (5,)


def test_a_parent_that_is_a_file_is_a_clear_write_error(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("x")
    with pytest.raises(sp.CheckpointWriteError) as excinfo:
        sp.save(tmp_path / "afile" / "ckpt", {"a": np.ones(2)})
    assert excinfo.value.path == str(tmp_path / "afile" / "ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


@pytest.mark.parametrize("where", ["manifest", "path"])
def test_fifo_manifest_or_path_is_refused_without_blocking(ckpt: Path, where: str) -> None:
    # Opening a FIFO for reading blocks until a writer appears: readers must refuse it at once.
    if where == "manifest":
        sp.save(ckpt, {"a": np.arange(3)})
        (ckpt / "manifest.json").unlink()
        os.mkfifo(ckpt / "manifest.json")
    else:
        os.mkfifo(ckpt)
    for op in (sp.load, sp.verify, sp.inspect):
        got = in_thread(lambda op=op: op(ckpt))
        assert isinstance(got, (sp.IncompleteCheckpointError, sp.CorruptCheckpointError)), (
            f"{op.__name__}: {got!r}"
        )
        if where != "manifest":  # says what it found, not "a file"
            assert "is a FIFO, not a savepoint checkpoint directory" in str(got)
