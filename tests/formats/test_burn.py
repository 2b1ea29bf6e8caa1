"""savepoint.formats.burn: golden records built from the spec, round trips, hostile input."""

from __future__ import annotations

import base64
import os
import struct
from pathlib import Path
from typing import Any

import ml_dtypes
import msgpack  # type: ignore[import-untyped]
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _support import in_thread, load_generator
from savepoint.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    UnsupportedStateError,
)
from savepoint.formats import burn, detect

GOLDEN = Path(__file__).resolve().parent.parent / "golden" / "burn"


gen = load_generator(GOLDEN / "make_golden.py", "burn_golden")


def same(a: Any, b: Any, where: str = "") -> None:
    assert isinstance(a, np.ndarray), where
    assert (a.dtype, a.shape) == (b.dtype, b.shape), where
    assert a.tobytes() == b.tobytes(), where


def same_flat(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert list(got) == list(want)
    for k in want:
        same(got[k], want[k], k)


def pack_record(item: Any, **top: Any) -> bytes:
    """A record built with msgpack-python (for variants of the layout and hostile input)."""
    doc = {
        "metadata": {
            "float": "f32",
            "int": "i32",
            "format": "x",
            "version": "0.20.1",
            "settings": "FullPrecisionSettings",
        },
        "item": item,
        "_b": [],
    }
    doc.update(top)
    return msgpack.packb(doc, use_bin_type=True)


def tensor(raw: bytes, shape: list[int], dtype: Any) -> dict[str, Any]:
    return {"bytes": raw, "shape": shape, "dtype": dtype}


def write(tmp_path: Path, data: bytes, name: str = "r.mpk") -> Path:
    p = tmp_path / name
    p.write_bytes(data)
    return p


# ---------------------------------------------------------------------------------------------
# golden files
# ---------------------------------------------------------------------------------------------


def test_golden_files_match_their_generator() -> None:
    for rel, data in gen.artifact_files().items():
        assert (GOLDEN / rel).read_bytes() == data, f"{rel} differs from make_golden.py's bytes"


@pytest.mark.parametrize("name", sorted(gen.RECORDS))
def test_golden_records_read_exactly(name: str) -> None:
    same_flat(burn.load_record(GOLDEN / name), gen.expected_flat()[name])
    with burn.open_record(GOLDEN / name) as f:
        assert f.ids() == gen.expected_ids()[name]
        assert f.metadata.format == gen.RECORDER


@pytest.mark.parametrize("name", ["model_v0_20.mpk", "bool_v0_21.mpk"])
def test_golden_records_write_back_byte_for_byte(name: str, tmp_path: Path) -> None:
    with burn.open_record(GOLDEN / name) as f:
        burn.write_record(tmp_path / name, f.item, metadata=f.metadata)
        assert burn.encode(f.item, f.metadata) == (GOLDEN / name).read_bytes()
    assert (tmp_path / name).read_bytes() == (GOLDEN / name).read_bytes()


def test_model_golden_tree_keeps_nils_and_primitives() -> None:
    item, meta = burn.decode((GOLDEN / "model_v0_20.mpk").read_bytes())
    assert meta.version == "0.20.1"
    assert item["dropout"] is None
    assert item["layers"][1]["bias"] is None
    assert item["max_len"] == 1000
    assert isinstance(item["eps"], np.float32)
    assert item["eps"] == np.float32(1e-5)
    assert isinstance(item["layers"][0]["weight"], burn.Param)
    assert len(item["blocks"]) == 16


def test_flat_writer_gives_the_golden_bytes(tmp_path: Path) -> None:
    model = gen.artifact_model(1.0)
    ids = {"embed.weight": gen.pid(11), "head.weight": gen.pid(12), "head.steps": gen.pid(13)}
    burn.save_record(tmp_path / "model.mpk", model, ids=ids)
    assert (tmp_path / "model.mpk").read_bytes() == (GOLDEN / "artifact" / "model.mpk").read_bytes()


def test_legacy_record_is_read_only_as_its_values(tmp_path: Path) -> None:
    with burn.open_record(GOLDEN / "legacy_v0_13.mpk") as f:
        burn.write_record(tmp_path / "new.mpk", f.item)
    # Written back in the current form (TensorData with a dtype), same values.
    same_flat(burn.load_record(tmp_path / "new.mpk"), gen.expected_flat()["legacy_v0_13.mpk"])


def test_bool_spelling_follows_the_metadata_version() -> None:
    mask = {"m": np.array([True, False])}
    old = msgpack.unpackb(burn.encode(burn.unflatten(mask)), raw=False)
    assert old["item"]["m"]["param"]["dtype"] == "Bool"
    new = burn.encode(burn.unflatten(mask), burn.Metadata(version="0.21.0"))
    assert msgpack.unpackb(new, raw=False)["item"]["m"]["param"]["dtype"] == {"Bool": "Native"}
    same(burn.decode(new)[0]["m"].value, mask["m"])


# ---------------------------------------------------------------------------------------------
# layout details
# ---------------------------------------------------------------------------------------------


def test_layout_is_what_rmp_serde_writes() -> None:
    data = burn.encode({"w": burn.Param(np.array([1.0], np.float32), "0000000000000")})
    doc = msgpack.unpackb(data, raw=False)
    assert list(doc) == ["metadata", "item", "_b"]
    assert doc["_b"] == []
    assert list(doc["metadata"]) == ["float", "int", "format", "version", "settings"]
    assert doc["item"] == {
        "w": {
            "id": "0000000000000",
            "param": {"bytes": struct.pack("<f", 1.0), "shape": [1], "dtype": "F32"},
        }
    }
    assert data.startswith(b"\x83\xa8metadata\x85")
    assert data.endswith(b"\xa2_b\x90")


def test_param_ids_are_burn_paramid_strings() -> None:
    for name in ("layers.0.weight", "", "é"):
        pid = burn.param_id(name)
        assert len(pid) == 13
        assert set(pid) <= set("0123456789abcdefghijklmnopqrstuv")
        raw = base64.b32hexdecode(pid.upper() + "===")
        assert len(raw) == 8
        assert burn._encode_id(raw) == pid  # canonical: trailing bits zero
    assert burn.param_id("a") == burn.param_id("a") != burn.param_id("b")


@pytest.mark.parametrize(
    ("stem", "name"),
    [("model", "model.mpk"), ("w.v1", "w.mpk"), (".w", ".w.mpk"), ("a.b.c", "a.b.mpk")],
)
def test_file_name_is_rust_set_extension(stem: str, name: str) -> None:
    assert burn.file_name(stem) == name


def test_order_of_map_keys_does_not_matter(tmp_path: Path) -> None:
    raw = np.arange(4, dtype=np.int32).tobytes()
    data = msgpack.packb(
        {
            "_b": None,
            "item": {"x": {"param": {"dtype": "I32", "shape": [2, 2], "bytes": raw}, "id": "a"}},
            "metadata": {
                "settings": "s",
                "version": "0.19.0",
                "format": "f",
                "int": "i32",
                "float": "f32",
            },
            "unknown": 1,
        },
        use_bin_type=True,
    )
    got = burn.load_record(write(tmp_path, data))
    same(got["x"], np.arange(4, dtype=np.int32).reshape(2, 2))


def test_unflatten_builds_arrays_from_indices() -> None:
    tree = burn.unflatten({"a.0.w": 1, "a.2.w": 2, "b.01": 3, "c.x": 4})
    assert tree == {"a": [{"w": 1}, None, {"w": 2}], "b": {"01": 3}, "c": {"x": 4}}


def test_num_params_counts_float_elements_only() -> None:
    t = {
        "w": np.zeros((2, 3), np.float32),
        "h": np.zeros(4, ml_dtypes.bfloat16),
        "i": np.zeros(7, np.int64),
        "m": np.zeros(2, bool),
    }
    assert burn.num_params(t) == 10


def test_inspect_reads_no_tensor_data_and_verify_reads_all(tmp_path: Path) -> None:
    p = write(tmp_path, pack_record({"m": tensor(b"\x00\x02", [2], "Bool")}))
    info = burn.inspect(p)
    assert info.label == "burn"
    assert [(t.key, t.dtype, t.shape) for t in info.tensors] == [("m", "BOOL", (2,))]
    with pytest.raises(CorruptCheckpointError, match="other than 0 and 1"):
        burn.verify(p)
    with pytest.raises(CorruptCheckpointError, match="other than 0 and 1"):
        burn.load_record(p)


def test_torch_framework(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    got = burn.load_record(GOLDEN / "artifact" / "model.mpk", framework="torch")
    assert isinstance(got["embed.weight"], torch.Tensor)
    burn.save_record(tmp_path / "t.mpk", got)
    same_flat(
        burn.load_record(tmp_path / "t.mpk"), burn.load_record(GOLDEN / "artifact" / "model.mpk")
    )


# ---------------------------------------------------------------------------------------------
# round trips
# ---------------------------------------------------------------------------------------------

DTYPES = [
    np.float64,
    np.float32,
    np.float16,
    ml_dtypes.bfloat16,
    np.int64,
    np.int32,
    np.int16,
    np.int8,
    np.uint64,
    np.uint32,
    np.uint16,
    np.uint8,
    np.bool_,
]

names = st.lists(
    st.sampled_from(["w", "bias", "layers", "0", "1", "2", "norm", "é"]), min_size=1, max_size=3
).map(".".join)


@st.composite
def arrays_(draw: Any) -> np.ndarray:
    dtype = np.dtype(draw(st.sampled_from(DTYPES)))
    shape = tuple(draw(st.lists(st.integers(0, 3), max_size=3)))
    n = int(np.prod(shape)) * dtype.itemsize
    raw = draw(st.binary(min_size=n, max_size=n))
    flat = np.frombuffer(raw[:n], np.uint8).copy()
    if dtype == np.bool_:
        flat &= 1
    return flat.view(dtype).reshape(shape)


@st.composite
def flat_states(draw: Any) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for name in draw(st.lists(names, max_size=6, unique=True)):
        try:
            burn.unflatten({**out, name: 0})
        except UnsupportedStateError:
            continue  # a prefix of another name
        out[name] = draw(arrays_())
    return out


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(flat_states())
def test_round_trip_flat(tmp_path: Path, state: dict[str, np.ndarray]) -> None:
    p = tmp_path / "rt.mpk"
    burn.save_record(p, state)
    got = burn.load_record(p)
    assert sorted(got) == sorted(state)
    for k in state:
        same(got[k], state[k], k)
    with burn.open_record(p) as f:
        ids = f.ids()
        assert ids == {k: burn.param_id(k) for k in state}
        assert burn.encode(f.item, f.metadata) == p.read_bytes()


leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=False),
    st.floats(width=32, allow_nan=False).map(np.float32),
    st.text(max_size=40),
    arrays_().map(lambda a: burn.Param(a, burn.param_id(str(a.shape)))),
    arrays_().map(burn.Data),
)
keys = st.text(min_size=1, max_size=20).filter(lambda k: "." not in k)
trees = st.recursive(
    leaves,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(keys, inner, max_size=4)),
    max_leaves=12,
)


def same_tree(a: Any, b: Any) -> None:
    if isinstance(b, (burn.Param, burn.Data)):
        assert type(a) is type(b)
        same(a.value, b.value)
        if isinstance(b, burn.Param):
            assert a.id == b.id
    elif isinstance(b, dict):
        assert list(a) == list(b)
        for k in b:
            same_tree(a[k], b[k])
    elif isinstance(b, list):
        assert isinstance(a, list) and len(a) == len(b)
        for x, y in zip(a, b):
            same_tree(x, y)
    else:
        assert type(a) is type(b) and a == b


@settings(max_examples=80, deadline=None)
@given(trees)
def test_round_trip_tree(tree: Any) -> None:
    data = burn.encode(tree)
    got, meta = burn.decode(data)
    same_tree(got, tree)
    assert meta == burn.Metadata()
    assert burn.encode(got) == data


# ---------------------------------------------------------------------------------------------
# hostile input
# ---------------------------------------------------------------------------------------------


def test_every_truncation_is_a_corrupt_record(tmp_path: Path) -> None:
    data = (GOLDEN / "model_v0_20.mpk").read_bytes()
    for n in range(0, len(data), 7):
        with pytest.raises(CorruptCheckpointError):
            burn.load_record(write(tmp_path, data[:n]))


@pytest.mark.parametrize(
    "item",
    [
        b"\xc6\xff\xff\xff\xff",  # bin32 of 4 GiB
        b"\xdd\xff\xff\xff\xff",  # array32 of 4 billion
        b"\xdf\xff\xff\xff\xff",  # map32 of 4 billion pairs
        b"\xdb\xff\xff\xff\xff",  # str32
    ],
)
def test_huge_declared_lengths_fail_fast(tmp_path: Path, item: bytes) -> None:
    head = pack_record(None)
    data = head.replace(b"\xa4item\xc0", b"\xa4item" + item)
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        burn.load_record(write(tmp_path, data))


def test_deep_nesting_is_refused_without_recursion_error(tmp_path: Path) -> None:
    deep = b"\x91" * 100_000 + b"\xc0"
    data = pack_record(None).replace(b"\xa4item\xc0", b"\xa4item" + deep)
    with pytest.raises(CorruptCheckpointError, match="nested deeper"):
        burn.load_record(write(tmp_path, data))


def test_millions_of_tiny_values_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(burn, "MAX_VALUES", 1000)
    many = b"\xdc" + struct.pack(">H", 5000) + b"\x90" * 5000
    data = pack_record(None).replace(b"\xa4item\xc0", b"\xa4item" + many)
    with pytest.raises(CorruptCheckpointError, match="more than 1000 values"):
        burn.load_record(write(tmp_path, data))


F32_4 = np.arange(4, dtype=np.float32).tobytes()


MALFORMED = [
    (b"", CorruptCheckpointError, "empty"),
    (b"\x1f\x8b\x08\x00", IncompatibleCheckpointError, "gzip"),
    (pack_record(None) + b"\x00", CorruptCheckpointError, "follow the record"),
    (msgpack.packb({"item": None}), CorruptCheckpointError, "'metadata'"),
    (msgpack.packb([1, 2]), CorruptCheckpointError, "not a burn record"),
    (pack_record(None, metadata={"float": 1}), CorruptCheckpointError, "metadata"),
    (pack_record(None, _b=5), CorruptCheckpointError, "_b"),
    (pack_record({1: None}), IncompatibleCheckpointError, "not a string"),
    (pack_record(msgpack.ExtType(1, b"x")), CorruptCheckpointError, "extension"),
    (
        pack_record(None).replace(b"\xa4item\xc0", b"\xa4item\xc1"),
        CorruptCheckpointError,
        "0xc1",
    ),
    (
        pack_record(None).replace(b"\xa4item\xc0", b"\xa4item\xa2\xff\xfe"),
        CorruptCheckpointError,
        "UTF-8",
    ),
    (
        pack_record(None).replace(b"\xa4item\xc0", b"\xa4item\x82\xa1a\xc0\xa1a\xc0"),
        CorruptCheckpointError,
        "twice",
    ),
    (pack_record({"w": tensor(F32_4, [3], "F32")}), CorruptCheckpointError, "16 bytes"),
    (pack_record({"w": tensor(F32_4, [2, -2], "F32")}), CorruptCheckpointError, "shape"),
    (pack_record({"w": tensor(F32_4, "4", "F32")}), CorruptCheckpointError, "shape"),
    (
        pack_record({"w": tensor(b"", [1] * 65 + [0], "F32")}),
        IncompatibleCheckpointError,
        "66 dimensions",
    ),
    (pack_record({"w": tensor(F32_4, [4], "F128")}), IncompatibleCheckpointError, "F128"),
    (pack_record({"w": tensor(F32_4, [4], 7)}), CorruptCheckpointError, "DType"),
    (
        pack_record({"w": tensor(F32_4, [4], {"QFloat": {}})}),
        IncompatibleCheckpointError,
        "quant",
    ),
    (
        # found by fuzzing: an unhashable store raised TypeError
        pack_record({"w": tensor(F32_4, [4], {"Bool": [1]})}),
        IncompatibleCheckpointError,
        "is not one savepoint knows",
    ),
    (
        pack_record({"w": tensor(F32_4, [4], {"Bool": "U16"})}),
        IncompatibleCheckpointError,
        "Bool",
    ),
    (pack_record({"w": tensor([1, 2], [2], "U8")}), CorruptCheckpointError, "bin"),
    (
        pack_record({"w": {"id": 5, "param": tensor(F32_4, [4], "F32")}}),
        CorruptCheckpointError,
        "id",
    ),
    (
        pack_record({"w": {"value": [1.5, 2], "shape": [2]}}),
        IncompatibleCheckpointError,
        "0.13",
    ),
    (pack_record({"w": {"value": [1, 2], "shape": [3]}}), CorruptCheckpointError, "2 values"),
    (
        pack_record({"a.b": tensor(b"", [0], "F32"), "a": {"b": tensor(b"", [0], "F32")}}),
        IncompatibleCheckpointError,
        "two tensors",
    ),
]


@pytest.mark.parametrize(("data", "error", "match"), MALFORMED, ids=[m for _, _, m in MALFORMED])
def test_malformed_records(tmp_path: Path, data: bytes, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        burn.load_record(write(tmp_path, data))


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.data())
def test_damaged_bytes_give_checkpoint_errors_only(tmp_path: Path, data: Any) -> None:
    raw = bytearray((GOLDEN / "model_v0_20.mpk").read_bytes())
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    try:
        burn.verify(write(tmp_path, bytes(raw)))
    except CheckpointError:
        pass


def test_fifo_symlink_directory_and_missing_file_are_refused(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo.mpk")
    for op in (burn.load_record, burn.inspect, burn.verify):
        got = in_thread(lambda op=op: op(tmp_path / "fifo.mpk"))
        assert isinstance(got, CorruptCheckpointError), repr(got)
    (tmp_path / "link.mpk").symlink_to(GOLDEN / "artifact" / "model.mpk")
    with pytest.raises(CorruptCheckpointError, match="symlink"):
        burn.load_record(tmp_path / "link.mpk")
    with pytest.raises(CorruptCheckpointError, match="not a regular file"):
        burn.load_record(tmp_path)
    with pytest.raises(CheckpointNotFoundError):
        burn.load_record(tmp_path / "absent.mpk")


# ---------------------------------------------------------------------------------------------
# what the writer refuses
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tensors", "match"),
    [
        ({"c": np.zeros(2, np.complex64)}, "no burn DType"),
        ({"f8": np.zeros(2, ml_dtypes.float8_e4m3fn)}, "no burn DType"),
        ({"a..b": np.zeros(1)}, "empty component"),
        ({"": np.zeros(1)}, "empty component"),
        ({"a": np.zeros(1), "a.b": np.zeros(1)}, "prefix"),
        ({"a.b": np.zeros(1), "a": np.zeros(1)}, "prefix"),
        ({"x": object()}, "object is not a tensor"),
        ({"x": "text"}, "not a tensor"),
        ({"a.99999999": np.zeros(1)}, "holes"),
        ({"\udcff": np.zeros(1)}, "UTF-8"),
    ],
)
def test_writer_refuses(tmp_path: Path, tensors: dict[str, Any], match: str) -> None:
    with pytest.raises(UnsupportedStateError, match=match):
        burn.save_record(tmp_path / "x.mpk", tensors)
    assert not (tmp_path / "x.mpk").exists()
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    ("tree", "match"),
    [
        ({1: None}, "not a str"),
        ({"i": 2**64}, "64-bit"),
        ({"i": -(2**63) - 1}, "64-bit"),
        ({"p": burn.Param(np.zeros(1), id=5)}, "not a str"),  # type: ignore[arg-type]
    ],
)
def test_tree_writer_refuses(tree: Any, match: str) -> None:
    with pytest.raises(UnsupportedStateError, match=match):
        burn.encode(tree)


def test_tree_writer_refuses_deep_nesting() -> None:
    tree: Any = None
    for _ in range(burn.MAX_DEPTH + 5):
        tree = [tree]
    with pytest.raises(UnsupportedStateError, match="nested deeper"):
        burn.encode(tree)


@pytest.mark.parametrize(
    ("values", "want"),
    [
        ([1.5, -2.0], np.array([1.5, -2.0], np.float64)),
        ([1.5, 2.0], np.array([1.5, 2.0], np.float32)),
        ([2**64 - 1, 0], np.array([2**64 - 1, 0], np.uint64)),
        ([-(2**63), 5], np.array([-(2**63), 5], np.int64)),
        ([True, False], np.array([True, False])),
    ],
)
def test_legacy_number_kinds(tmp_path: Path, values: list[Any], want: np.ndarray) -> None:
    data = msgpack.packb(
        {
            "metadata": {k: "x" for k in ("float", "int", "format", "version", "settings")},
            "item": {"w": {"id": "a", "param": {"value": values, "shape": [2]}}},
        },
        use_bin_type=True,
        use_single_float=want.dtype == np.float32,
    )
    same(burn.load_record(write(tmp_path, data))["w"], want)


plugged = pytest.mark.skipif(
    "burn" not in detect.FORMATS,
    reason="savepoint.formats.detect does not know burn records yet",
)


@plugged
def test_detect_and_convert_burn_records(tmp_path: Path) -> None:
    import savepoint as sp
    from savepoint.errors import ConversionError
    from savepoint.formats.convert import convert

    golden = GOLDEN / "model_v0_20.mpk"
    assert detect.detect(golden) == "burn"
    renamed = write(tmp_path, golden.read_bytes(), "weights.bin")
    assert detect.detect(renamed) == "burn"  # by content
    assert detect.inspect_any(golden) == burn.inspect(golden)
    convert(golden, tmp_path / "native")
    assert sp.inspect(tmp_path / "native").metadata["version"] == "0.20.1"
    convert(tmp_path / "native", tmp_path / "back.mpk")
    same_flat(burn.load_record(tmp_path / "back.mpk"), burn.load_record(golden))
    sp.save(tmp_path / "c", {"model": {"c": np.zeros(1, np.complex64)}, "step": 1})
    with pytest.raises(ConversionError) as info:
        convert(tmp_path / "c", tmp_path / "c.mpk")
    assert [p.split(":")[0] for p in info.value.problems] == ["model/c", "step"]
    os.mkfifo(tmp_path / "fifo.mpk")
    got = in_thread(lambda: detect.inspect_any(tmp_path / "fifo.mpk"))
    assert isinstance(got, CheckpointError), repr(got)
