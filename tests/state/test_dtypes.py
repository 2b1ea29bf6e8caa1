"""savepoint.codecs.dtypes and the numpy side of savepoint.state.arrays: the dtype table."""

from __future__ import annotations

import json
import struct
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import savepoint as sp
from savepoint.codecs import dtypes
from savepoint.state import tree
from savepoint.state.arrays import NumpySource, describe

NAMES = sorted(dtypes.BY_NAME)

EXPECTED = {
    "BOOL": (np.bool_, "bool"),
    "U8": (np.uint8, "uint8"),
    "I8": (np.int8, "int8"),
    "U16": (np.uint16, "uint16"),
    "I16": (np.int16, "int16"),
    "U32": (np.uint32, "uint32"),
    "I32": (np.int32, "int32"),
    "U64": (np.uint64, "uint64"),
    "I64": (np.int64, "int64"),
    "F16": (np.float16, "float16"),
    "BF16": (ml_dtypes.bfloat16, "bfloat16"),
    "F32": (np.float32, "float32"),
    "F64": (np.float64, "float64"),
    "C64": (np.complex64, "complex64"),
    "F8_E4M3": (ml_dtypes.float8_e4m3fn, "float8_e4m3fn"),
    "F8_E5M2": (ml_dtypes.float8_e5m2, "float8_e5m2"),
    "F8_E4M3FNUZ": (ml_dtypes.float8_e4m3fnuz, "float8_e4m3fnuz"),
    "F8_E5M2FNUZ": (ml_dtypes.float8_e5m2fnuz, "float8_e5m2fnuz"),
}


def sample_values(name: str) -> list[Any]:
    """Values exactly representable in the dtype (float8 included), as Python numbers."""
    if name == "BOOL":
        return [True, False, True]
    if name.startswith("U"):
        return [0, 1, 7, 200]
    if name.startswith("I"):
        return [0, 1, -2, 100, -128]
    if name == "C64":
        return [0j, 1 + 2j, -0.5 - 1.5j]
    return [0.0, 1.0, -2.0, 0.5, 1.5, -0.25, 12.0]


def test_table_is_exactly_the_expected_one() -> None:
    assert set(dtypes.BY_NAME) == set(EXPECTED)
    for name, (np_type, torch_name) in EXPECTED.items():
        d = dtypes.BY_NAME[name]
        assert d.name == name
        assert d.numpy == np.dtype(np_type)
        assert d.torch_name == torch_name
        assert d.itemsize == np.dtype(np_type).itemsize
    # one entry per numpy dtype and per torch dtype: lookups in both directions are unambiguous
    assert len({d.numpy for d in dtypes.BY_NAME.values()}) == len(EXPECTED)
    assert len({d.torch_name for d in dtypes.BY_NAME.values()}) == len(EXPECTED)


@pytest.mark.parametrize("name", NAMES)
def test_numpy_lookups(name: str) -> None:
    d = dtypes.from_name(name)
    assert d is dtypes.BY_NAME[name]
    assert dtypes.from_numpy(d.numpy, "k") is d
    assert dtypes.from_numpy(d.numpy.newbyteorder("<"), "k") is d
    assert describe(np.zeros((2, 1), dtype=d.numpy)) == (name, (2, 1))


def test_unknown_name() -> None:
    with pytest.raises(KeyError, match="F128"):
        dtypes.from_name("F128")
    with pytest.raises(KeyError):
        dtypes.from_name("f32")  # names are case-sensitive, as in safetensors


@pytest.mark.torch
@pytest.mark.parametrize("name", NAMES)
def test_numpy_safetensors_torch_agree(name: str) -> None:
    torch = pytest.importorskip("torch")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    d = dtypes.from_name(name)
    td = dtypes.torch_dtype(d)
    assert td is getattr(torch, d.torch_name)
    assert dtypes.from_torch(td, "k") is d
    assert torch.empty((), dtype=td).element_size() == d.itemsize

    values = sample_values(name)
    expected_bytes = np.array(values, dtype=d.numpy).tobytes()
    # torch encodes the same values to the same bytes ...
    if name == "BOOL":
        t = torch.tensor(values, dtype=torch.bool)
    elif name == "C64":
        t = torch.tensor(values, dtype=torch.complex128).to(td)
    elif name.startswith(("U", "I")):
        t = torch.tensor(values, dtype=torch.int64).to(td)
    else:
        t = torch.tensor(values, dtype=torch.float64).to(td)
    assert t.dtype is td
    assert t.view(torch.uint8).numpy().tobytes() == expected_bytes
    # ... and decodes numpy's bytes to the same values
    back = torch.frombuffer(bytearray(expected_bytes), dtype=td)
    if name == "C64":
        assert back.tolist() == values
    elif name.startswith("F") or name == "BF16":
        assert back.to(torch.float64).tolist() == values
    else:
        assert back.tolist() == values

    # the safetensors library calls this torch dtype by the same name
    blob = safetensors_torch.save({"x": t})
    (n,) = struct.unpack("<Q", blob[:8])
    assert json.loads(blob[8 : 8 + n])["x"]["dtype"] == name


@pytest.mark.parametrize(
    "dtype", [">i2", ">u2", ">i4", ">u4", ">i8", ">u8", ">f2", ">f4", ">f8", ">c8"]
)
def test_big_endian_arrays_are_converted(dtype: str) -> None:
    little = np.arange(-3, 9).reshape(3, 4)
    if np.dtype(dtype).kind == "u":
        little = little + 3
    little = little.astype(np.dtype(dtype).newbyteorder("<"))
    big = little.astype(dtype)
    assert big.dtype.byteorder == ">"
    src = NumpySource(big, "k")
    assert src.dtype.numpy == little.dtype
    assert src.shape == (3, 4)
    assert src.nbytes == little.nbytes
    out = np.empty(src.nbytes, dtype=np.uint8)
    src.copy_to(out, 0)
    assert out.tobytes() == little.tobytes()
    # a chunk from the middle, as the writer asks for it
    part = np.empty(5, dtype=np.uint8)
    src.copy_to(part, 3)
    assert part.tobytes() == little.tobytes()[3:8]


def test_big_endian_non_contiguous_and_in_a_tree() -> None:
    big = np.arange(24, dtype=">f4").reshape(4, 6)[:, ::2]
    flat = tree.flatten({"w": big})
    src = flat.tensors["w"]
    assert src.dtype.name == "F32"
    out = np.empty(src.nbytes, dtype=np.uint8)
    src.copy_to(out, 0)
    assert out.tobytes() == np.ascontiguousarray(big, dtype="<f4").tobytes()


@pytest.mark.parametrize(
    "dtype",
    [
        np.complex128,
        np.clongdouble,
        np.longdouble,
        "datetime64[s]",
        "timedelta64[ms]",
        "<U3",
        "S3",
        "V4",
        [("a", "<f4"), ("b", "<i4")],
        ">c16",
    ],
    ids=str,
)
def test_unsupported_numpy_dtypes(dtype: Any) -> None:
    arr = np.zeros(2, dtype=dtype)
    with pytest.raises(sp.UnsupportedStateError) as info:
        NumpySource(arr, "model/x")
    assert info.value.key == "model/x"
    assert str(info.value).startswith("model/x: numpy dtype")
    with pytest.raises(sp.UnsupportedStateError) as info:
        tree.flatten({"model": {"x": arr}})
    assert info.value.key == "model/x"


@pytest.mark.torch
@pytest.mark.parametrize("name", ["complex128", "complex32", "float8_e8m0fnu", "uint1"])
def test_unsupported_torch_dtypes(name: str) -> None:
    torch = pytest.importorskip("torch")
    td = getattr(torch, name, None)
    if td is None:  # pragma: no cover - older torch
        pytest.skip(f"torch has no {name}")
    with pytest.raises(sp.UnsupportedStateError) as info:
        dtypes.from_torch(td, "opt/m")
    assert info.value.key == "opt/m"
    assert name in str(info.value)


@pytest.mark.torch
def test_unsupported_torch_tensor_in_a_tree() -> None:
    torch = pytest.importorskip("torch")
    with pytest.raises(sp.UnsupportedStateError) as info:
        tree.flatten({"a": [torch.zeros(2, dtype=torch.complex128)]})
    assert info.value.key == "a/0"
    assert "complex128" in str(info.value)
