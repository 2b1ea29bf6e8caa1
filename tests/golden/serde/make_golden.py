"""Golden float text: what serde_json (ryu) writes for f64 and f32 values, in ``floats.txt``.

Each line is ``f64 <16 hex digits of the bits> <text>`` or ``f32 <8 hex digits> <text>``. The text
is built here independently of ``savepoint.codecs.serde_text``: the shortest digits come from
numpy's Dragon4 (``np.format_float_scientific(unique=True)``, shortest and nearest for the value's
own type), laid out by ryu's rules (``ryu/src/pretty/mod.rs``, ``format64`` / ``format32``):

- zero is ``0.0`` / ``-0.0``;
- with digits ``d`` (``n`` of them) and ``kk`` such that ``10**(kk-1) <= |x| < 10**kk``: an
  integer with ``kk <= 16`` (f64) / ``13`` (f32) is its digits then ``.0``; ``0 < kk <= 16 / 13``
  puts the point inside the digits; ``-5 / -6 < kk <= 0`` is ``0.`` and ``-kk`` zeros then the
  digits; otherwise ``d[0]``, ``.`` and the rest when ``n > 1``, ``e`` and ``kk - 1`` (no ``+``,
  no leading zeros).

The values exercise every branch and edge: subnormals (the smallest and largest of each type),
1e-7, 1e-5 / 1e-6 (where the two types differ), 1e13 .. 1e22 (where fixed notation ends), negative
zero, integral floats, the extremes. Usage from the repository root::

    .venv/bin/python tests/golden/serde/make_golden.py

Only regenerate on purpose; ``tests/formats/test_serde_text.py`` checks the committed file equals
what this script builds and what savepoint writes.
"""

from __future__ import annotations

import os
import struct

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))

VALUES = [
    0.0,
    -0.0,
    1.0,
    -1.0,
    2.0,
    10.0,
    100.0,
    0.5,
    0.1,
    0.2,
    0.3,
    1.5,
    -2.25,
    0.75,
    3.0,
    1.25,
    1e-7,
    -1e-7,
    1e-6,
    1e-5,
    1e-4,
    0.001,
    1.5e-5,
    1.5e-6,
    1.5e-7,
    0.000123,
    1e12,
    1e13,
    1e14,
    1e15,
    1e16,
    1e17,
    1e20,
    1e21,
    1e22,
    123456789012.0,
    1234567890123.0,
    9007199254740992.0,
    9007199254740993.0,
    16777216.0,
    16777217.0,
    4294967296.0,
    123456.789,
    3e-4,
    0.33333334,
    1 / 3,
    2 / 3,
    3.14159265358979,
    2.718281828459045,
    65504.0,
    6.1e-5,
    5e-324,
    1e-323,
    2.2250738585072014e-308,
    2.225073858507201e-308,
    1.7976931348623157e308,
    1e300,
    1e-300,
    1.401298464324817e-45,
    2.802596928649634e-45,
    1.1754942106924411e-38,
    1.1754943508222875e-38,
    3.4028234663852886e38,
    1e38,
    1e-38,
    1e-45,
    8.5e-42,
    1e30,
    1.5e30,
    7.0e-10,
    299792458.0,
    6.02214076e23,
    1.602176634e-19,
    4.0,
    1024.0,
    0.0009765625,
]


def _layout(text: str, wide: bool) -> str:
    negative = text.startswith("-")
    mantissa, exp = text.lstrip("-").split("e")
    digits = mantissa.replace(".", "").rstrip("0")
    if digits in ("", "0"):
        return "-0.0" if negative else "0.0"
    kk = int(exp) + 1  # one digit before the point in scientific text
    k = kk - len(digits)
    limit, low = (16, -5) if wide else (13, -6)
    if k >= 0 and kk <= limit:
        body = digits + "0" * k + ".0"
    elif 0 < kk <= limit:
        body = digits[:kk] + "." + digits[kk:]
    elif low < kk <= 0:
        body = "0." + "0" * (-kk) + digits
    else:
        body = digits[0] + ("." + digits[1:] if len(digits) > 1 else "") + "e" + str(kk - 1)
    return ("-" if negative else "") + body


def rows() -> list[str]:
    out = []
    for v in VALUES:
        d = np.float64(v)
        out.append(
            f"f64 {struct.unpack('<Q', struct.pack('<d', v))[0]:016x} "
            f"{_layout(np.format_float_scientific(d, unique=True, trim='-'), True)}"
        )
    for v in VALUES:
        with np.errstate(over="ignore"):
            f = np.float32(v)
        if not np.isfinite(f):
            continue
        out.append(
            f"f32 {int(f.view(np.uint32)):08x} "
            f"{_layout(np.format_float_scientific(f, unique=True, trim='-'), False)}"
        )
    return out


def build() -> bytes:
    return ("\n".join(rows()) + "\n").encode("ascii")


def main() -> None:
    with open(os.path.join(HERE, "floats.txt"), "wb") as f:
        f.write(build())
    print("wrote floats.txt")


if __name__ == "__main__":
    main()
