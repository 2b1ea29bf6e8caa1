"""savepoint.codecs.safetensors: the layout savepoint writes, checked against the real safetensors
library, and the hostile-input header parser."""

from __future__ import annotations

import itertools
import json
import struct
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import safetensors
import safetensors.numpy
from hypothesis import given, settings
from hypothesis import strategies as st

from savepoint.codecs import dtypes
from savepoint.codecs import safetensors as fmt

NAMES = sorted(dtypes.BY_NAME)
# dtypes safetensors.numpy can hand back (it has no bfloat16 / float8 numpy types)
NUMPY_NAMES = [n for n in NAMES if n != "BF16" and not n.startswith("F8")]
SHAPES = [(3, 2), (), (0,), (2, 0, 3), (1,), (5,)]


def sample(name: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    d = dtypes.from_name(name)
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape))
    if name == "BOOL":
        return rng.integers(0, 2, n).astype(bool).reshape(shape)
    if name.startswith(("U", "I")):
        info = np.iinfo(d.numpy)
        return rng.integers(info.min, info.max, n, dtype=d.numpy, endpoint=True).reshape(shape)
    if name == "C64":
        return (
            (rng.standard_normal(n) + 1j * rng.standard_normal(n))
            .astype(np.complex64)
            .reshape(shape)
        )
    return rng.uniform(-4, 4, n).astype(d.numpy).reshape(shape)


def assemble(tensors: list[tuple[str, np.ndarray]]) -> tuple[bytes, list[fmt.Entry]]:
    """A complete file image as savepoint lays it out."""
    by_name = dict(tensors)
    prefix, entries = fmt.layout(
        [(n, dtypes.from_numpy(a.dtype, n).name, a.shape, a.nbytes) for n, a in tensors]
    )
    data = b"".join(by_name[e.name].tobytes() for e in entries)
    return prefix + data, entries


def header_of(blob: bytes) -> tuple[bytes, int]:
    (n,) = struct.unpack("<Q", blob[:8])
    return blob[8 : 8 + n], len(blob)


# ---------------------------------------------------------------------------------------------
# layout, read back by the safetensors library
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("name", NAMES)
def test_layout_parses_with_safetensors_deserialize(name: str, shape: tuple[int, ...]) -> None:
    arr = sample(name, shape)
    blob, entries = assemble([("t", arr), ("pad", np.arange(3, dtype=np.uint8))])
    got = dict(safetensors.deserialize(blob))
    assert set(got) == {"t", "pad"}
    assert got["t"]["dtype"] == name
    assert got["t"]["shape"] == list(shape)
    assert bytes(got["t"]["data"]) == arr.tobytes()
    assert bytes(got["pad"]["data"]) == b"\x00\x01\x02"
    # and savepoint's own parser agrees with what layout said
    raw, size = header_of(blob)
    parsed, metadata = fmt.parse_header(raw, size)
    assert parsed == entries
    assert metadata == {"producer": "savepoint"}


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("name", NUMPY_NAMES)
def test_layout_parses_with_safetensors_numpy(
    name: str, shape: tuple[int, ...], tmp_path: Path
) -> None:
    arr = sample(name, shape)
    blob, _ = assemble([("a/b~1", arr), ("z", np.float64(1.5).reshape(()))])
    loaded = safetensors.numpy.load(blob)
    assert loaded["a/b~1"].dtype == arr.dtype
    assert loaded["a/b~1"].shape == shape
    assert loaded["a/b~1"].tobytes() == arr.tobytes()
    assert loaded["z"].shape == ()
    path = tmp_path / "x.safetensors"
    path.write_bytes(blob)
    with safetensors.safe_open(str(path), framework="np") as f:
        assert f.metadata() == {"producer": "savepoint"}
        assert f.get_tensor("a/b~1").tobytes() == arr.tobytes()


@pytest.mark.torch
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("name", NAMES)
def test_layout_parses_with_safe_open_torch(
    name: str, shape: tuple[int, ...], tmp_path: Path
) -> None:
    torch = pytest.importorskip("torch")
    arr = sample(name, shape)
    blob, _ = assemble([("w", arr)])
    path = tmp_path / "x.safetensors"
    path.write_bytes(blob)
    with safetensors.safe_open(str(path), framework="pt") as f:
        assert list(f.keys()) == ["w"]
        assert f.metadata() == {"producer": "savepoint"}
        t = f.get_tensor("w")
    assert t.dtype == getattr(torch, dtypes.from_name(name).torch_name)
    assert tuple(t.shape) == shape
    assert t.reshape(-1).view(torch.uint8).numpy().tobytes() == arr.tobytes()


def test_every_dtype_in_one_file_with_awkward_names(tmp_path: Path) -> None:
    tensors = [
        (f"{name}/é~1/{i}", sample(name, shape, seed=i))
        for i, (name, shape) in enumerate(itertools.product(NAMES, [(3,), (), (0, 2)]))
    ]
    tensors.append(("", np.ones(2, dtype=ml_dtypes.bfloat16)))
    blob, entries = assemble(tensors)
    got = dict(safetensors.deserialize(blob))
    assert len(got) == len(tensors)
    for name, arr in tensors:
        assert bytes(got[name]["data"]) == arr.tobytes()
        assert got[name]["shape"] == list(arr.shape)
    raw, size = header_of(blob)
    assert fmt.parse_header(raw, size)[0] == entries


def test_layout_never_writes_a_tensor_into_the_metadata_slot() -> None:
    # "__metadata__" is reserved by the format; layout must refuse such a name rather than emit a
    # header that neither safetensors nor parse_header can read.
    try:
        prefix, entries = fmt.layout([("__metadata__", "F32", (1,), 4), ("x", "U8", (1,), 1)])
    except ValueError:
        return
    blob = prefix + bytes(5)
    assert {name for name, _ in safetensors.deserialize(blob)} == {e.name for e in entries}
    assert fmt.parse_header(*header_of(blob))[0] == entries


def test_layout_of_nothing() -> None:
    prefix, entries = fmt.layout([])
    assert entries == []
    assert safetensors.deserialize(prefix) == []
    assert fmt.parse_header(*header_of(prefix)) == ([], {"producer": "savepoint"})


def test_header_is_ascii_and_padded_to_8_bytes() -> None:
    prefix, _ = fmt.layout([("ключ", "F32", (1,), 4), ("\u00e9", "U8", (), 1)])
    (n,) = struct.unpack("<Q", prefix[:8])
    assert n == len(prefix) - 8
    assert n % 8 == 0
    raw = prefix[8:]
    raw.decode("ascii")
    assert raw[len(raw.rstrip(b" ")) :] == b" " * (n - len(raw.rstrip(b" ")))
    assert set(json.loads(raw)) == {"__metadata__", "ключ", "\u00e9"}


# ---------------------------------------------------------------------------------------------
# ordering and alignment
# ---------------------------------------------------------------------------------------------


def test_order_is_largest_itemsize_first_then_as_given() -> None:
    spec = [
        ("u8", "U8", (3,), 3),
        ("f64", "F64", (1,), 8),
        ("bf16", "BF16", (1,), 2),
        ("c64", "C64", (1,), 8),
        ("f32", "F32", (1,), 4),
        ("b", "BOOL", (1,), 1),
        ("i64", "I64", (0,), 0),
        ("f8", "F8_E4M3", (1,), 1),
    ]
    _, entries = fmt.layout(spec)
    assert [e.name for e in entries] == ["f64", "c64", "i64", "f32", "bf16", "u8", "b", "f8"]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(NAMES), st.lists(st.integers(0, 5), max_size=3)),
        max_size=12,
    )
)
def test_every_tensor_is_aligned_to_its_itemsize(spec: list[tuple[str, list[int]]]) -> None:
    tensors = []
    for i, (name, shape) in enumerate(spec):
        size = int(np.prod(shape)) * dtypes.from_name(name).itemsize
        tensors.append((f"t{i}", name, tuple(shape), size))
    prefix, entries = fmt.layout(tensors)
    assert len(prefix) % 8 == 0
    itemsizes = [dtypes.from_name(e.dtype).itemsize for e in entries]
    assert itemsizes == sorted(itemsizes, reverse=True)
    for e in entries:
        assert e.start % dtypes.from_name(e.dtype).itemsize == 0, e
    # stable: equal itemsizes keep the given order
    for size in set(itemsizes):
        given_order = [t[0] for t in tensors if dtypes.from_name(t[1]).itemsize == size]
        assert [
            e.name for e in entries if dtypes.from_name(e.dtype).itemsize == size
        ] == given_order
    # the spans tile the data region
    pos = len(prefix)
    for e in entries:
        assert e.start == pos
        pos = e.end
    file_size = pos
    assert fmt.parse_header(prefix[8:], file_size)[0] == entries


# ---------------------------------------------------------------------------------------------
# parse_header: accepted input
# ---------------------------------------------------------------------------------------------


def test_accepts_files_written_by_safetensors_numpy() -> None:
    arrays = {
        "weight": sample("F32", (4, 3)),
        "bias": sample("F16", (3,)),
        "ids": sample("I64", (2, 2)),
        "flag": np.array(True),
        "empty": np.zeros((0, 4), dtype=np.float64),
        "c": sample("C64", (2,)),
        "u": sample("U16", ()),
    }
    blob = safetensors.numpy.save(arrays, metadata={"format": "np", "k": "v"})
    (n,) = struct.unpack("<Q", blob[:8])
    assert fmt.header_length(blob[:8], len(blob)) == n
    entries, metadata = fmt.parse_header(blob[8 : 8 + n], len(blob))
    assert metadata == {"format": "np", "k": "v"}
    assert {e.name for e in entries} == set(arrays)
    for e in entries:
        arr = arrays[e.name]
        assert e.dtype == dtypes.from_numpy(arr.dtype, e.name).name
        assert e.shape == arr.shape
        assert blob[e.start : e.end] == arr.tobytes()


def test_accepts_safetensors_numpy_without_metadata() -> None:
    blob = safetensors.numpy.save({"x": np.arange(3, dtype=np.int32)})
    entries, metadata = fmt.parse_header(*header_of(blob))
    assert metadata == {}
    assert [(e.name, e.dtype, e.shape) for e in entries] == [("x", "I32", (3,))]


def _header(tensors: dict[str, Any], metadata: Any = None, order: list[str] | None = None) -> bytes:
    doc: dict[str, Any] = {}
    if metadata is not None:
        doc["__metadata__"] = metadata
    for name in order or list(tensors):
        doc[name] = tensors[name]
    return json.dumps(doc).encode()


TENSORS = {
    "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
    "b": {"dtype": "U8", "shape": [3], "data_offsets": [8, 11]},
    "e": {"dtype": "F64", "shape": [0, 7], "data_offsets": [11, 11]},
    "s": {"dtype": "I16", "shape": [], "data_offsets": [11, 13]},
}
DATA = 13


def _file_size(raw: bytes) -> int:
    return 8 + len(raw) + DATA


def test_order_invariance() -> None:
    results = set()
    for order in itertools.permutations(TENSORS):
        raw = _header(TENSORS, {"m": "1"}, list(order))
        entries, metadata = fmt.parse_header(raw, _file_size(raw))
        assert metadata == {"m": "1"}
        base = 8 + len(raw)
        results.add(
            frozenset((e.name, e.dtype, e.shape, e.start - base, e.end - base) for e in entries)
        )
    assert results == {
        frozenset(
            {
                ("a", "F32", (2,), 0, 8),
                ("b", "U8", (3,), 8, 11),
                ("e", "F64", (0, 7), 11, 11),
                ("s", "I16", (), 11, 13),
            }
        )
    }


@pytest.mark.parametrize(
    "tensors",
    [
        {},
        {"z": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}},
        {
            "z1": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]},
            "z2": {"dtype": "I8", "shape": [3, 0], "data_offsets": [0, 0]},
            "x": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
            "z3": {"dtype": "BOOL", "shape": [0], "data_offsets": [1, 1]},
        },
        {"big": {"dtype": "U8", "shape": [1, 1, 1, 1, 1, 1, 1, 1, 1, 4], "data_offsets": [0, 4]}},
    ],
    ids=["no-tensors", "one-empty", "empties-around", "many-dims"],
)
def test_accepts_edge_cases(tensors: dict[str, Any]) -> None:
    raw = _header(tensors) + b"    "  # trailing spaces are allowed padding
    data = max((t["data_offsets"][1] for t in tensors.values()), default=0)
    entries, metadata = fmt.parse_header(raw, 8 + len(raw) + data)
    assert metadata == {}
    assert {e.name for e in entries} == set(tensors)


# ---------------------------------------------------------------------------------------------
# parse_header / header_length: rejected input
# ---------------------------------------------------------------------------------------------


def test_header_length_cap_and_eof() -> None:
    ok = struct.pack("<Q", 16)
    assert fmt.header_length(ok, 24) == 16
    with pytest.raises(fmt.HeaderError, match="exceeds"):
        fmt.header_length(struct.pack("<Q", fmt.MAX_HEADER_BYTES + 1), 10**12)
    with pytest.raises(fmt.HeaderError, match="exceeds"):
        fmt.header_length(struct.pack("<Q", 2**64 - 1), 2**70)
    assert (
        fmt.header_length(struct.pack("<Q", fmt.MAX_HEADER_BYTES), 10**12) == fmt.MAX_HEADER_BYTES
    )
    with pytest.raises(fmt.HeaderError, match="past the end"):
        fmt.header_length(ok, 23)
    with pytest.raises(fmt.HeaderError, match="too short"):
        fmt.header_length(b"\x10\x00\x00", 3)
    with pytest.raises(fmt.HeaderError, match="too short"):
        fmt.header_length(b"", 0)


def _with(name: str, **changes: Any) -> dict[str, Any]:
    out = json.loads(json.dumps(TENSORS))
    if changes.get("_drop"):
        out.pop(name)
        return out
    entry = out[name]
    for k, v in changes.items():
        if v is _DELETE:
            entry.pop(k)
        else:
            entry[k] = v
    return out


_DELETE = object()

BAD_TENSORS = {
    "unknown-dtype": (_with("a", dtype="F128"), "unknown dtype"),
    "lowercase-dtype": (_with("a", dtype="f32"), "unknown dtype"),
    "null-dtype": (_with("a", dtype=None), "unknown dtype"),
    "int-dtype": (_with("a", dtype=4), "unknown dtype"),
    "list-dtype": (_with("a", dtype=["F32"]), "unknown dtype"),
    "dict-dtype": (_with("a", dtype={"F32": 1}), "unknown dtype"),
    "negative-dim": (_with("a", shape=[-2]), "shape"),
    "float-dim": (_with("a", shape=[2.0]), "shape"),
    "bool-dim": (_with("b", shape=[True, 3]), "shape"),
    "str-dim": (_with("a", shape=["2"]), "shape"),
    "null-dim": (_with("a", shape=[None]), "shape"),
    "shape-not-list": (_with("a", shape=2), "shape"),
    "shape-object": (_with("a", shape={"0": 2}), "shape"),
    "offsets-negative": (_with("a", data_offsets=[-8, 0]), "data_offsets"),
    "offsets-float": (_with("a", data_offsets=[0, 8.0]), "data_offsets"),
    "offsets-bool": (_with("b", data_offsets=[8, True]), "data_offsets"),
    "offsets-one": (_with("a", data_offsets=[8]), "data_offsets"),
    "offsets-three": (_with("a", data_offsets=[0, 4, 8]), "data_offsets"),
    "offsets-not-list": (_with("a", data_offsets="0,8"), "data_offsets"),
    "too-few-bytes": (_with("a", data_offsets=[0, 7]), "bytes"),
    "too-many-bytes": (_with("b", shape=[2]), "bytes"),
    "reversed-offsets": (_with("b", data_offsets=[11, 8]), "bytes"),
    "empty-with-bytes": (_with("e", data_offsets=[11, 19]), "bytes"),
    "missing-field": (_with("a", dtype=_DELETE), "exactly"),
    "extra-field": (_with("a", extra=1), "exactly"),
    "entry-not-object": ({**TENSORS, "a": [1, 2]}, "exactly"),
    "entry-null": ({**TENSORS, "a": None}, "exactly"),
    "gap": (
        {
            **_with("b", data_offsets=[9, 12]),
            "s": {"dtype": "I16", "shape": [], "data_offsets": [12, 14]},
        },
        "tile",
    ),
    "overlap": (_with("b", shape=[3], data_offsets=[5, 8]), "tile"),
    "not-from-zero": (
        {"a": {"dtype": "U8", "shape": [13], "data_offsets": [1, 14]}},
        "tile",
    ),
    "duplicate-span": (
        {**TENSORS, "a2": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}},
        "tile",
    ),
    "past-eof": (
        {**TENSORS, "x": {"dtype": "U8", "shape": [1], "data_offsets": [13, 14]}},
        "ends at",
    ),
}


@pytest.mark.parametrize("case", list(BAD_TENSORS))
def test_rejects_bad_tensor_entries(case: str) -> None:
    tensors, match = BAD_TENSORS[case]
    raw = _header(tensors)
    with pytest.raises(fmt.HeaderError, match=match):
        fmt.parse_header(raw, _file_size(raw))


@pytest.mark.parametrize("delta", [1, 8, -1, -2, -13])
def test_rejects_trailing_or_missing_bytes(delta: int) -> None:
    raw = _header(TENSORS)
    with pytest.raises(fmt.HeaderError, match=r"ends at byte|tile"):
        fmt.parse_header(raw, _file_size(raw) + delta)


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"{",
        b'{"a": }',
        b"{'a': 1}",
        b"\xff\xfe{}",
        b'{"a": "\xc3"}',
        b"[" * 100_000 + b"]" * 100_000,
        b'{"a": NaN',
        b"{} {}",
    ],
    ids=[
        "empty",
        "open",
        "missing-value",
        "single-quotes",
        "bad-utf8",
        "truncated-utf8",
        "deep",
        "truncated",
        "two-docs",
    ],
)
def test_rejects_invalid_json(raw: bytes) -> None:
    with pytest.raises(fmt.HeaderError, match="not valid JSON"):
        fmt.parse_header(raw, 8 + len(raw))


@pytest.mark.parametrize("raw", [b"[]", b"1", b'"text"', b"null", b"true", b"[{}]"])
def test_rejects_non_object(raw: bytes) -> None:
    with pytest.raises(fmt.HeaderError, match="not a JSON object"):
        fmt.parse_header(raw, 8 + len(raw))


@pytest.mark.parametrize(
    "raw",
    [
        b'{"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},'
        b' "a": {"dtype": "U8", "shape": [1], "data_offsets": [1, 2]}}',
        b'{"a": {"dtype": "U8", "dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}',
        b'{"__metadata__": {"k": "1", "k": "2"}}',
        b'{"__metadata__": {}, "__metadata__": {}}',
        b'{"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}, "\\u0061": {}}',
    ],
    ids=["tensor", "field", "metadata-key", "metadata", "escaped-name"],
)
def test_rejects_duplicate_keys(raw: bytes) -> None:
    with pytest.raises(fmt.HeaderError, match="duplicate key"):
        fmt.parse_header(raw, 8 + len(raw) + 2)


@pytest.mark.parametrize(
    "metadata",
    [[], "x", 1, True, {"k": 1}, {"k": None}, {"k": ["v"]}, {"k": {"n": "v"}}],
    ids=repr,
)
def test_rejects_bad_metadata(metadata: Any) -> None:
    raw = json.dumps({"__metadata__": metadata}).encode()
    with pytest.raises(fmt.HeaderError, match="__metadata__"):
        fmt.parse_header(raw, 8 + len(raw))


def test_null_metadata_is_rejected_too() -> None:
    raw = b'{"__metadata__": null}'
    with pytest.raises(fmt.HeaderError, match="__metadata__"):
        fmt.parse_header(raw, 8 + len(raw))


def test_header_error_is_a_value_error() -> None:
    assert issubclass(fmt.HeaderError, ValueError)


def test_header_error_is_a_checkpoint_error() -> None:
    """The module-level parsers raise what callers (and the fuzz targets) expect of savepoint: a
    CorruptCheckpointError (at HEAD: a bare ValueError)."""
    from savepoint.errors import CorruptCheckpointError

    assert issubclass(fmt.HeaderError, CorruptCheckpointError)
    with pytest.raises(CorruptCheckpointError):
        fmt.header_length(b"\xff" * 8, 100)


# ---------------------------------------------------------------------------------------------
# numbers, nesting and memory in the header's JSON
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"shape": [1] * 65}, "at most 64"),
        ({"shape": [2**62, 1]}, "too large"),
        ({"shape": [2**70, 0]}, "too large"),  # zero elements, absurd dimensions
        ({"shape": [2.0]}, "shape must be"),
        ({"shape": [True]}, "shape must be"),
        ({"data_offsets": [0, 8.0]}, "data_offsets must be"),
        ({"data_offsets": [False, 8]}, "data_offsets must be"),
        ({"data_offsets": [0, 2**64]}, "bytes for shape"),
    ],
)
def test_numbers_in_entries(entry: dict[str, Any], message: str) -> None:
    raw = _header({**TENSORS, "a": {**TENSORS["a"], **entry}})
    with pytest.raises(fmt.HeaderError, match=message):
        fmt.parse_header(raw, _file_size(raw))


@pytest.mark.parametrize(
    ("number", "message"),
    [
        (b"1e400", "out of range for a 64-bit float"),
        (b"NaN", "non-standard number"),
        (b"Infinity", "non-standard number"),
        (b"9" * 5000, "Exceeds the limit"),
    ],
)
def test_numbers_json_refuses(number: bytes, message: str) -> None:
    raw = _header(TENSORS).replace(b'"shape": [2]', b'"shape": [' + number + b"]")
    with pytest.raises(fmt.HeaderError, match=message):
        fmt.parse_header(raw, _file_size(raw))


def test_negative_zero_offset_reads_as_zero() -> None:
    raw = _header(TENSORS).replace(b'"data_offsets": [0, 8]', b'"data_offsets": [-0, 8]')
    entries, _ = fmt.parse_header(raw, _file_size(raw))
    assert entries[0].start == 8 + len(raw)


def test_many_huge_dimensions_are_refused_at_once() -> None:
    """1000 dimensions of 4000 digits: refused by count before any product is taken."""
    import time

    big = "1" + "0" * 4000
    raw = _header(TENSORS).replace(
        b'"shape": [2]', f'"shape": [{", ".join([big] * 1000)}]'.encode()
    )
    start = time.perf_counter()
    with pytest.raises(fmt.HeaderError, match="at most 64"):
        fmt.parse_header(raw, _file_size(raw))
    assert time.perf_counter() - start < 5


@pytest.mark.parametrize("depth", [513, 1000, 1_000_000])
def test_deep_nesting_is_refused(depth: int) -> None:
    raw = b'{"__metadata__": ' + b"[" * depth + b"]" * depth + b"}"
    with pytest.raises(fmt.HeaderError, match="nested deeper than 512 levels"):
        fmt.parse_header(raw, 8 + len(raw))


@pytest.mark.parametrize("unit", [b"[],", b"{},", b"[[[[[[[[0]]]]]]]],"])
def test_dense_header_is_refused_within_the_memory_bound(unit: bytes) -> None:
    """At HEAD an 8 MiB header of ``{},`` parsed (about 25 x its size) before its metadata was
    found wrong; 100 MB, the header cap, is 2.5 GB."""
    import tracemalloc

    raw = b'{"__metadata__": [' + unit * ((8 << 20) // len(unit)) + b"0]}"
    tracemalloc.start()
    try:
        with pytest.raises(fmt.HeaderError, match="too many values for its size"):
            fmt.parse_header(raw, 8 + len(raw))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak <= 24 * len(raw) + (32 << 20)


# ---------------------------------------------------------------------------------------------
# safetensors files: special, unreadable, shrinking, unmappable
# ---------------------------------------------------------------------------------------------


def _file(tmp_path: Path) -> Path:
    path = tmp_path / "x.safetensors"
    safetensors.numpy.save_file({"w": np.ones((2, 3), np.float32)}, str(path))
    return path


def test_fifo_named_safetensors_is_refused_without_blocking(tmp_path: Path) -> None:
    import os
    import signal

    from savepoint.errors import CorruptCheckpointError
    from savepoint.formats import _files

    path = tmp_path / "x.safetensors"
    os.mkfifo(path)

    def hang(signum: int, frame: Any) -> None:
        raise TimeoutError("opening a FIFO blocked")

    old = signal.signal(signal.SIGALRM, hang)
    signal.alarm(10)
    try:
        with pytest.raises(CorruptCheckpointError, match="not a regular file"):
            _files.SafetensorsFile(str(path))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def test_unreadable_file_is_a_permission_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    from savepoint.errors import CheckpointPermissionError
    from savepoint.formats import _files

    path = _file(tmp_path)
    real_open = os.open

    def denied(file: Any, flags: int, *args: Any, **kw: Any) -> int:
        if str(file) == str(path):
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, flags, *args, **kw)

    monkeypatch.setattr(os, "open", denied)
    with pytest.raises(CheckpointPermissionError):
        _files.SafetensorsFile(str(path))


@pytest.mark.parametrize("failure", ["shrinks", "io-error", "unmappable"])
def test_read_failures_are_checkpoint_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failure: str
) -> None:
    """At HEAD: a raw EOFError (the file shrank between fstat and read) or OSError escaped."""
    from savepoint.errors import CheckpointError, CorruptCheckpointError
    from savepoint.formats import _files
    from savepoint.storage import local

    path = _file(tmp_path)
    if failure == "unmappable":

        def no_map(fd: int, size: int, **kw: Any) -> Any:
            raise OSError(12, "Cannot allocate memory")

        monkeypatch.setattr(local, "MappedFile", no_map)
    else:

        def fail(fd: int, offset: int, length: int) -> bytes:
            if failure == "shrinks":
                raise EOFError(f"wanted {length} bytes at {offset}")
            raise OSError(5, "Input/output error")

        monkeypatch.setattr(local, "read_exact", fail)
    expected = CorruptCheckpointError if failure == "shrinks" else CheckpointError
    with pytest.raises(expected, match=r"shrank|cannot be read"):
        _files.SafetensorsFile(str(path))
