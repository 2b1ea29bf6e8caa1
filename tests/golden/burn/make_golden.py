"""Regenerate the golden burn records and the training-artifact directories in this directory,
built byte by byte from the format's specification (the module docstrings of
``savepoint.formats.burn`` and ``savepoint.formats.training_artifact``, themselves read from burn
0.20.1's and rmp-serde 1.3's sources), never with savepoint's writer: the tests check that savepoint
reads exactly :func:`expected_tree` / :func:`expected_flat` from each file and writes each file
back byte for byte.

Usage, from the repository root::

    .venv/bin/python tests/golden/burn/make_golden.py

MessagePack as rmp-serde writes it: every length and unsigned integer in its shortest form
(fixmap 0x80-0x8f, map16 0xde: the 16-field ``dtypes`` struct; fixarray 0x90-0x9f, array16 0xdc; fixstr 0xa0-0xbf, str8 0xd9;
bin8 0xc4, bin16 0xc5; positive fixint, uint8 0xcc, uint16 0xcd), nil 0xc0, float32 0xca,
negative fixint, int8 0xd0, int32 0xd2, true 0xc3 / false 0xc2. Tensor bytes are the values'
little-endian bytes in C order.

Files:

- ``model_v0_20.mpk``: a module record as burn 0.20.1's DefaultRecorder writes it: a Vec of two
  linear layers (the second with ``bias: None``), a ConstantRecord (``dropout``: nil), a 16-block
  Vec (array16), one tensor per dtype (F64 with -0.0 and a subnormal, F32, F16, BF16, I64 extremes,
  I32, I16, I8, U64 max, U32, U16, U8, Bool), an empty (0, 3) tensor, a 0-d tensor, a tensor of
  300 bytes (bin16), a primitive usize field (``max_len``: 1000) and a float32 one (``eps``);
- ``bool_v0_21.mpk``: burn 0.21's boolean spelling, ``{"Bool": "Native"}`` and ``{"Bool": "U32"}``;
- ``legacy_v0_13.mpk``: burn 0.13's ``{"value": [...], "shape": [...]}`` tensors (float32 values,
  integers of several widths, booleans, an empty one), read only;
- ``artifact/``: a training artifact (seed 001) with ``best_validation/``;
- ``sweep/``: ``training_comparison.json`` and one variant (``baseline``) whose best step is its
  last step, so it has no ``best_validation/``.
"""

from __future__ import annotations

import base64
import os
import shutil
import struct

import ml_dtypes
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
RECORDER = "burn_core::record::file::NamedMpkFileRecorder<burn_core::record::settings::FullPrecisionSettings>"


# ---------------------------------------------------------------------------------------------
# MessagePack, by hand
# ---------------------------------------------------------------------------------------------


def fixmap(n: int) -> bytes:
    assert n < 16
    return bytes([0x80 | n])


def map16(n: int) -> bytes:
    return b"\xde" + struct.pack(">H", n)


def fixarray(n: int) -> bytes:
    assert n < 16
    return bytes([0x90 | n])


def array16(n: int) -> bytes:
    return b"\xdc" + struct.pack(">H", n)


def s(text: str) -> bytes:
    raw = text.encode("utf-8")
    if len(raw) < 32:
        return bytes([0xA0 | len(raw)]) + raw
    assert len(raw) < 256
    return b"\xd9" + bytes([len(raw)]) + raw


def uint(v: int) -> bytes:
    if v < 0x80:
        return bytes([v])
    if v < 1 << 8:
        return b"\xcc" + bytes([v])
    if v < 1 << 16:
        return b"\xcd" + struct.pack(">H", v)
    if v < 1 << 32:
        return b"\xce" + struct.pack(">I", v)
    return b"\xcf" + struct.pack(">Q", v)


def sint(v: int) -> bytes:
    if v >= 0:
        return uint(v)
    if v >= -32:
        return struct.pack(">b", v)
    if v >= -128:
        return b"\xd0" + struct.pack(">b", v)
    if v >= -32768:
        return b"\xd1" + struct.pack(">h", v)
    if v >= -(1 << 31):
        return b"\xd2" + struct.pack(">i", v)
    return b"\xd3" + struct.pack(">q", v)


def bin_(data: bytes) -> bytes:
    if len(data) < 256:
        return b"\xc4" + bytes([len(data)]) + data
    assert len(data) < 1 << 16
    return b"\xc5" + struct.pack(">H", len(data)) + data


NIL = b"\xc0"


def f32(v: float) -> bytes:
    return b"\xca" + struct.pack(">f", v)


def metadata(version: str) -> bytes:
    return (
        s("metadata")
        + fixmap(5)
        + s("float")
        + s("f32")
        + s("int")
        + s("i32")
        + s("format")
        + s(RECORDER)
        + s("version")
        + s(version)
        + s("settings")
        + s("FullPrecisionSettings")
    )


def record(item: bytes, version: str = "0.20.1") -> bytes:
    """BurnRecord {metadata, item, _b: PhantomData} -> fixmap(3), _b as [] (a unit struct)."""
    return fixmap(3) + metadata(version) + s("item") + item + s("_b") + fixarray(0)


def pid(n: int) -> str:
    """burn's ParamId::serialize: BASE32_DNSSEC (base32hex, lowercase, unpadded) of u64 LE."""
    return base64.b32hexencode(struct.pack("<Q", n)).decode().rstrip("=").lower()


def tensor_data(array: np.ndarray, dtype: bytes) -> bytes:
    raw = np.ascontiguousarray(array).astype(array.dtype.newbyteorder("<")).tobytes()
    shape = fixarray(array.ndim) + b"".join(uint(d) for d in array.shape)
    return fixmap(3) + s("bytes") + bin_(raw) + s("shape") + shape + s("dtype") + dtype


def param(n: int, array: np.ndarray, dtype: bytes) -> bytes:
    return fixmap(2) + s("id") + s(pid(n)) + s("param") + tensor_data(array, dtype)


# ---------------------------------------------------------------------------------------------
# the records
# ---------------------------------------------------------------------------------------------


def arrays_v0_20() -> dict[str, tuple[np.ndarray, str]]:
    """name -> (array, burn dtype), in file order, for the ``dtypes`` struct."""
    i64, u64 = np.iinfo(np.int64), np.iinfo(np.uint64)
    return {
        "f64": (np.array([-0.0, 5e-324, 1.5], np.float64), "F64"),
        "f32": ((np.arange(6, dtype=np.float32) / 4).reshape(2, 3), "F32"),
        "f16": (np.array([0.5, -65504.0], np.float16), "F16"),
        "bf16": (np.array([1.0, -2.5, 3.140625], ml_dtypes.bfloat16), "BF16"),
        "i64": (np.array([i64.min, 2**53 + 1, i64.max], np.int64), "I64"),
        "i32": (np.array([-(2**31), 7], np.int32), "I32"),
        "i16": (np.array([-300, 300], np.int16), "I16"),
        "i8": (np.array([-128, 127], np.int8), "I8"),
        "u64": (np.array([u64.max], np.uint64), "U64"),
        "u32": (np.array([2**32 - 1], np.uint32), "U32"),
        "u16": (np.array([65535], np.uint16), "U16"),
        "u8": (np.array([0, 255], np.uint8), "U8"),
        "mask": (np.array([[True, False], [False, True]]), "Bool"),
        "empty": (np.zeros((0, 3), np.float32), "F32"),
        "scalar": (np.array(2.5, np.float32), "F32"),
        "wide": (np.arange(75, dtype=np.float32), "F32"),  # 300 bytes: bin16
    }


def linear(n: int) -> tuple[np.ndarray, np.ndarray]:
    w = (np.arange(6, dtype=np.float32) + 10 * n).reshape(2, 3)
    b = np.full(3, float(n), np.float32)
    return w, b


def model_v0_20() -> bytes:
    w0, b0 = linear(0)
    w1, _ = linear(1)
    layers = (
        fixarray(2)
        + fixmap(2)
        + s("weight")
        + param(1, w0, s("F32"))
        + s("bias")
        + param(2, b0, s("F32"))
        + fixmap(2)
        + s("weight")
        + param(3, w1, s("F32"))
        + s("bias")
        + NIL
    )
    blocks = array16(16) + b"".join(
        fixmap(1) + s("w") + param(100 + i, np.array([float(i)], np.float32), s("F32"))
        for i in range(16)
    )
    table = arrays_v0_20()
    dtypes_struct = map16(len(table)) + b"".join(
        s(k) + param(200 + i, a, s(d)) for i, (k, (a, d)) in enumerate(table.items())
    )
    item = (
        fixmap(6)
        + s("layers")
        + layers
        + s("dropout")
        + NIL
        + s("blocks")
        + blocks
        + s("dtypes")
        + dtypes_struct
        + s("max_len")
        + uint(1000)
        + s("eps")
        + f32(1e-5)
    )
    return record(item)


def bool_v0_21() -> bytes:
    native = np.array([True, False, True])
    u32 = np.array([[1, 0], [0, 1]], np.uint32)
    item = (
        fixmap(3)
        + s("mask")
        + param(1, native, fixmap(1) + s("Bool") + s("Native"))
        + s("mask32")
        + param(2, u32, fixmap(1) + s("Bool") + s("U32"))
        + s("weight")
        + param(3, np.array([1.0, 2.0], np.float32), s("F32"))
    )
    return record(item, "0.21.0")


def legacy_param(n: int, values: bytes, count: int, shape: tuple[int, ...]) -> bytes:
    assert count < 16
    return (
        fixmap(2)
        + s("id")
        + s(pid(n))
        + s("param")
        + fixmap(2)
        + s("value")
        + fixarray(count)
        + values
        + s("shape")
        + fixarray(len(shape))
        + b"".join(uint(d) for d in shape)
    )


def legacy_v0_13() -> bytes:
    floats = b"".join(f32(v) for v in (0.0, 0.25, -1.5, 3.0))
    ints = b"".join(sint(v) for v in (0, 127, 200, -1, -100, -70000))
    bools = b"\xc3\xc2\xc3"
    item = (
        fixmap(4)
        + s("weight")
        + legacy_param(1, floats, 4, (2, 2))
        + s("ids")
        + legacy_param(2, ints, 6, (6,))
        + s("mask")
        + legacy_param(3, bools, 3, (3,))
        + s("none")
        + legacy_param(4, b"", 0, (0,))
    )
    return record(item, "0.13.0")


def expected_flat() -> dict[str, dict[str, np.ndarray]]:
    """What load_record gives for each record file."""
    w0, b0 = linear(0)
    w1, _ = linear(1)
    model = {"layers.0.weight": w0, "layers.0.bias": b0, "layers.1.weight": w1}
    model.update({f"blocks.{i}.w": np.array([float(i)], np.float32) for i in range(16)})
    model.update({f"dtypes.{k}": a for k, (a, _) in arrays_v0_20().items()})
    return {
        "model_v0_20.mpk": model,
        "bool_v0_21.mpk": {
            "mask": np.array([True, False, True]),
            "mask32": np.array([[True, False], [False, True]]),
            "weight": np.array([1.0, 2.0], np.float32),
        },
        "legacy_v0_13.mpk": {
            "weight": np.array([[0.0, 0.25], [-1.5, 3.0]], np.float32),
            "ids": np.array([0, 127, 200, -1, -100, -70000], np.int64),
            "mask": np.array([True, False, True]),
            "none": np.zeros(0, np.float32),
        },
    }


def expected_ids() -> dict[str, dict[str, str]]:
    model = {"layers.0.weight": pid(1), "layers.0.bias": pid(2), "layers.1.weight": pid(3)}
    model.update({f"blocks.{i}.w": pid(100 + i) for i in range(16)})
    model.update({f"dtypes.{k}": pid(200 + i) for i, k in enumerate(arrays_v0_20())})
    return {
        "model_v0_20.mpk": model,
        "bool_v0_21.mpk": {"mask": pid(1), "mask32": pid(2), "weight": pid(3)},
        "legacy_v0_13.mpk": {"weight": pid(1), "ids": pid(2), "mask": pid(3), "none": pid(4)},
    }


RECORDS = {
    "model_v0_20.mpk": model_v0_20,
    "bool_v0_21.mpk": bool_v0_21,
    "legacy_v0_13.mpk": legacy_v0_13,
}


# ---------------------------------------------------------------------------------------------
# training artifacts (JSON as serde_json::to_string_pretty writes it)
# ---------------------------------------------------------------------------------------------

ARTIFACT_MANIFEST = """{
  "variant": "ddl",
  "config": {
    "d_model": 4,
    "learning_rate": 0.001,
    "layers": [
      2,
      3
    ]
  },
  "num_params": 9,
  "weights_stem": "model"
}"""

ARTIFACT_REPORT = """{
  "variant": "ddl",
  "config": {
    "d_model": 4,
    "learning_rate": 0.001,
    "layers": [
      2,
      3
    ]
  },
  "num_params": 9,
  "steps_completed": 20,
  "best_validation": {
    "step": 15,
    "loss": 0.25
  },
  "best_validation_step": 15,
  "final_loss": 0.5
}"""

SWEEP_MANIFEST = """{
  "variant": "baseline",
  "config": {},
  "num_params": 2,
  "weights_stem": "model"
}"""

SWEEP_REPORT = """{
  "variant": "baseline",
  "config": {},
  "num_params": 2,
  "steps_completed": 5,
  "best_validation": {
    "step": 5,
    "loss": 1.0
  },
  "best_validation_step": 5
}"""

COMPARISON = """{
  "variants": [
    "baseline"
  ],
  "best": "baseline"
}"""

OPTIMIZER_STATE = bytes(range(7)) + b"adam"


def artifact_model(scale: float) -> dict[str, np.ndarray]:
    return {
        "embed.weight": np.arange(6, dtype=np.float32).reshape(2, 3) * scale,
        "head.weight": np.array([1.0, -1.0, 0.5], np.float32) * scale,
        "head.steps": np.array([3], np.int64),
    }


def artifact_weights(scale: float) -> bytes:
    m = artifact_model(scale)
    item = (
        fixmap(2)
        + s("embed")
        + fixmap(1)
        + s("weight")
        + param(11, m["embed.weight"], s("F32"))
        + s("head")
        + fixmap(2)
        + s("weight")
        + param(12, m["head.weight"], s("F32"))
        + s("steps")
        + param(13, m["head.steps"], s("I64"))
    )
    return record(item)


def sweep_weights() -> bytes:
    return record(fixmap(1) + s("w") + param(21, np.array([1.0, 2.0], np.float32), s("F32")))


def artifact_files() -> dict[str, bytes]:
    """Relative path -> bytes, for every file under this directory the generator owns."""
    files = {name: make() for name, make in RECORDS.items()}
    files.update(
        {
            "artifact/manifest.json": ARTIFACT_MANIFEST.encode(),
            "artifact/model.mpk": artifact_weights(1.0),
            "artifact/training_report.json": ARTIFACT_REPORT.encode(),
            "artifact/optimizer_state.bin": OPTIMIZER_STATE,
            "artifact/best_validation/manifest.json": ARTIFACT_MANIFEST.encode(),
            "artifact/best_validation/model.mpk": artifact_weights(0.5),
            "artifact/best_validation/training_report.json": ARTIFACT_REPORT.encode(),
            "sweep/training_comparison.json": COMPARISON.encode(),
            "sweep/baseline/manifest.json": SWEEP_MANIFEST.encode(),
            "sweep/baseline/model.mpk": sweep_weights(),
            "sweep/baseline/training_report.json": SWEEP_REPORT.encode(),
            "sweep/baseline/optimizer_state.bin": b"",
        }
    )
    return files


def main() -> None:
    for sub in ("artifact", "sweep"):
        shutil.rmtree(os.path.join(HERE, sub), ignore_errors=True)
    for rel, data in artifact_files().items():
        path = os.path.join(HERE, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
        print(f"wrote {rel} ({len(data)} bytes)")


if __name__ == "__main__":
    main()
