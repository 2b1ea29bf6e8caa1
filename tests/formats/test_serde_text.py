"""Float and JSON text as the seeds' serde_json (ryu) writes it: golden values, layouts, both types."""

from __future__ import annotations

import json
import math
import random
import struct
from pathlib import Path

import numpy as np
import pytest

from _support import load_generator
from savepoint.codecs import serde_text
from savepoint.codecs.serde_text import F32, F32List, dumps, f32_text, f64_text

GOLDEN = Path(__file__).resolve().parent.parent / "golden" / "serde"
gen = load_generator(GOLDEN / "make_golden.py", "serde_make_golden")


def _rows() -> list[tuple[str, str, str]]:
    lines = (GOLDEN / "floats.txt").read_text("ascii").splitlines()
    return [(kind, bits, text) for kind, bits, text in (line.split(" ") for line in lines)]


def _value(kind: str, bits: str) -> float:
    if kind == "f64":
        return float(struct.unpack("<d", struct.pack("<Q", int(bits, 16)))[0])
    return float(struct.unpack("<f", struct.pack("<I", int(bits, 16)))[0])


def test_golden_file_is_what_the_rules_give() -> None:
    assert (GOLDEN / "floats.txt").read_bytes() == gen.build()


@pytest.mark.parametrize(("kind", "bits", "text"), _rows())
def test_golden_float_text(kind: str, bits: str, text: str) -> None:
    value = _value(kind, bits)
    assert (f64_text if kind == "f64" else f32_text)(value) == text
    back = float(text) if kind == "f64" else float(np.float32(float(text)))
    assert struct.pack("<d", back) == struct.pack("<d", value)  # bit for bit, -0.0 included


def test_the_differences_the_issue_names() -> None:
    # savepoint 0.1 wrote Python's repr of the widened value; serde writes these.
    assert f32_text(0.1) == "0.1" and repr(float(np.float32(0.1))) == "0.10000000149011612"
    assert f64_text(1e-7) == "1e-7" and f64_text(1e20) == "1e20" and f64_text(1e16) == "1e16"
    assert f64_text(1e15) == "1000000000000000.0" and f32_text(1e13) == "1e13"
    assert f64_text(1e-5) == "0.00001" and f64_text(1e-6) == "1e-6"
    assert f32_text(1e-6) == "0.000001" and f32_text(1e-7) == "1e-7"
    assert f64_text(-0.0) == f32_text(-0.0) == "-0.0" and f64_text(2.0) == "2.0"
    assert f32_text(2.0**-149) == "1e-45" and f64_text(5e-324) == "5e-324"
    assert f32_text(float(np.finfo(np.float32).max)) == "3.4028235e38"


def test_shortest_digits_agree_with_dragon4_on_random_values() -> None:
    r = random.Random(31)
    for _ in range(4000):
        b = r.getrandbits(32)
        if (b >> 23) & 0xFF == 0xFF:
            continue
        f = np.uint32(b).view(np.float32)
        expected = gen._layout(np.format_float_scientific(f, unique=True, trim="-"), False)
        assert f32_text(float(f)) == expected, hex(b)
    for _ in range(4000):
        b = r.getrandbits(64)
        if (b >> 52) & 0x7FF == 0x7FF:
            continue
        d = np.uint64(b).view(np.float64)
        expected = gen._layout(np.format_float_scientific(d, unique=True, trim="-"), True)
        assert f64_text(float(d)) == expected, hex(b)


def test_every_float32_power_of_two_and_its_neighbours() -> None:
    # Powers of two have a narrower rounding interval below than above: the exact path.
    for e in range(1, 255):
        for b in ((e << 23) - 1, e << 23, (e << 23) + 1):
            f = np.uint32(b).view(np.float32)
            expected = gen._layout(np.format_float_scientific(f, unique=True, trim="-"), False)
            assert f32_text(float(f)) == expected, hex(b)


def test_dumps_lays_out_as_serde_json() -> None:
    doc = {"a": [1, 2.0, None, True, 'é\n"', []], "b": {}, "c": {"d": [{"e": 0.1}]}}
    plain = {"a": [1, 2, None, True, 'é\n"', []], "b": {}, "c": {"d": [{"e": "x"}]}}
    assert dumps(plain, indent=2) == json.dumps(plain, indent=2, ensure_ascii=False)
    assert dumps(plain) == json.dumps(plain, separators=(",", ":"), ensure_ascii=False)
    assert dumps(doc) == '{"a":[1,2.0,null,true,"é\\n\\"",[]],"b":{},"c":{"d":[{"e":0.1}]}}'
    assert dumps({"x": [1e-7, -0.0]}, indent=2) == '{\n  "x": [\n    1e-7,\n    -0.0\n  ]\n}'


def test_f32_markers_and_refusals() -> None:
    wide = float(np.float32(0.1))
    assert dumps([wide]) == "[0.10000000149011612]"  # an f64 field holding that value
    assert dumps(F32List([wide, 1, 0.0, -0.0])) == "[0.1,1,0.0,-0.0]"
    assert dumps({"v": F32(wide)}) == '{"v":0.1}'
    for bad in (math.nan, math.inf, -math.inf):
        with pytest.raises(ValueError):
            dumps([bad])
    with pytest.raises(ValueError, match="out of range for an f32"):
        dumps([F32(1e39)])
    with pytest.raises(TypeError):
        dumps({1: 2})
    with pytest.raises(TypeError):
        dumps([object()])
    assert serde_text.layout(False, "1234", 30, wide=True) == "1.234e33"
