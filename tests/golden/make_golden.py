"""Regenerate the golden checkpoint in ``tests/golden/v1/`` (format version 1).

Usage, from the repository root::

    .venv/bin/python tests/golden/make_golden.py

What it does:

1. ``sp.save`` :func:`golden_state` with :data:`METADATA` into a temporary directory;
2. rewrites ``manifest.json`` with ``created`` set to the fixed :data:`CREATED` (parse, replace the
   field, ``formats.manifest.dumps``; the script first checks that ``dumps(parse(raw)) == raw``, so
   nothing but ``created`` and the trailer checksum changes);
3. replaces ``tests/golden/v1/`` with the result and runs ``sp.verify`` on it.

Everything else savepoint writes is already deterministic (file names, tensor order, header bytes,
manifest layout), so running the script twice gives byte-identical files. The ``writer`` member
records the savepoint version that produced the files ("savepoint 0.1.0").

Only regenerate when the on-disk format changes on purpose, and then as a new directory
(``v2/``) next to ``v1/``: the point of ``v1/`` is that future versions keep reading what 0.1.0
wrote. ``tests/formats/test_golden.py`` imports :func:`golden_state` from this file to know what
the checkpoint must contain, and checks that the current writer still produces exactly these bytes.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import tempfile
from typing import Any

import ml_dtypes
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
TARGET = os.path.join(HERE, "v1")
CREATED = "2025-01-01T00:00:00.000000Z"
METADATA: dict[str, Any] = {
    "step": 1234,
    "run": "golden-v1",
    "config": {"lr": 0.001, "betas": [0.9, 0.999], "tags": ["a", "é"], "none": None},
}


def golden_state() -> dict[Any, Any]:
    """The state stored in ``v1/``. Every call returns equal (not shared) objects."""
    f32 = (np.arange(6, dtype=np.float32) / 4).reshape(2, 3)
    i = np.iinfo
    return {
        "weights": {
            "f32": f32,
            "f64": np.array([[-0.0, math.pi], [math.inf, -math.inf], [math.nan, 1e-300]]),
            "f16": np.array([0.5, -1.25, 65504.0], dtype=np.float16),
            "bf16": np.array([1.0, -2.5, 3.140625], dtype=ml_dtypes.bfloat16),
            "f8_e4m3": np.array([0.5, -1.5, 448.0], dtype=ml_dtypes.float8_e4m3fn),
            "f8_e5m2": np.array([0.25, -3.0, 57344.0], dtype=ml_dtypes.float8_e5m2),
            "f8_e4m3fnuz": np.array([0.125, -240.0], dtype=ml_dtypes.float8_e4m3fnuz),
            "f8_e5m2fnuz": np.array([2.0, -0.5], dtype=ml_dtypes.float8_e5m2fnuz),
            "c64": np.array([1 + 2j, -0.5j], dtype=np.complex64),
            "bool": np.array([[True, False], [False, True]]),
            "i8": np.array([i(np.int8).min, 0, i(np.int8).max], dtype=np.int8),
            "u8": np.arange(5, dtype=np.uint8),
            "i16": np.array([i(np.int16).min, i(np.int16).max], dtype=np.int16),
            "u16": np.array([0, i(np.uint16).max], dtype=np.uint16),
            "i32": np.array([i(np.int32).min, -1, i(np.int32).max], dtype=np.int32),
            "u32": np.array([i(np.uint32).max], dtype=np.uint32),
            "i64": np.array([i(np.int64).min, i(np.int64).max], dtype=np.int64),
            "u64": np.array([i(np.uint64).max, 1], dtype=np.uint64),
        },
        "tied": f32,  # the same array: stored once, comes back as one object
        "zero_d": np.array(42, dtype=np.int32),
        "np_scalar": np.float64(2.5),
        "empty": np.zeros((0, 3), dtype=np.float32),
        "ключ/ü": np.array([7, -7], dtype=np.int16),  # unicode and "/" in one key
        "a~b": {"/": np.ones((), dtype=ml_dtypes.bfloat16)},
        0: np.array([1, 2], dtype=np.uint16),  # int key ...
        "0": np.array([3], dtype=np.uint16),  # ... and the str key it collides with ("0~2")
        "": {"empty key": "value under ''"},
        "nested": {
            "list": [1, [2.5, {"deep": (None, True)}], []],
            "tuple": (np.arange(3, dtype=np.int64), "s", ()),
            "dict_int_keys": {1: "one", 2: {"x": [np.array([0.5], dtype=np.float16)]}},
        },
        "plain": {
            "none": None,
            "true": True,
            "false": False,
            "int": -7,
            "big": 2**70,
            "neg_big": -(2**65),
            "float": 0.1,
            "neg_zero": -0.0,
            "nan": math.nan,
            "inf": math.inf,
            "-inf": -math.inf,
            "str": "héllo ✓ \u2603",
            "empty_str": "",
            "bytes": b"\x00\xffbinary",
            "empty_bytes": b"",
        },
    }


def main() -> int:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "src"))
    import savepoint as sp
    from savepoint.codecs import manifest as mf

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = os.path.join(tmp, "v1")
        sp.save(ckpt, golden_state(), metadata=METADATA)
        path = os.path.join(ckpt, mf.NAME)
        with open(path, "rb") as f:
            raw = f.read()
        m = mf.parse(raw)
        if mf.dumps(m) != raw:
            raise SystemExit("manifest does not re-serialise identically; refusing to rewrite it")
        m.created = CREATED
        with open(path, "wb") as f:
            f.write(mf.dumps(m))
        if os.path.exists(TARGET):
            shutil.rmtree(TARGET)
        shutil.copytree(ckpt, TARGET)
    info = sp.verify(TARGET)
    total = sum(os.path.getsize(os.path.join(TARGET, n)) for n in os.listdir(TARGET))
    print(f"wrote {TARGET}: {len(info.tensors)} tensor leaves, {total} bytes on disk")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
