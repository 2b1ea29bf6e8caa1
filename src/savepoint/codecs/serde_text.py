"""JSON text as the seeds' serde_json writes it: floats in ryu's shortest form, serde's layouts.

The seeds (kizzasi, boostr, the burn-based training artifact) write their JSON with serde_json,
whose floats come from ryu (``ryu::Buffer::format_finite``): the shortest decimal that reads back
to the same value *of the field's type* (``f32`` or ``f64``), nearest to the exact value among
the shortest (ties to even), laid out by these rules (``ryu/src/pretty/mod.rs``). With ``d`` the
digits (no trailing zeros), ``n`` their count and ``kk`` the decimal exponent such that
``10**(kk-1) <= |x| < 10**kk``; ``L`` is 16 for f64 and 13 for f32, ``M`` is -5 for f64 and -6
for f32:

- zero: ``0.0`` (``-0.0`` for negative zero);
- an integer value with ``kk <= L``: its digits then ``.0`` (``1.0``, ``100.0``,
  ``1000000000000000.0`` for f64 1e15; f64 1e16 is ``1e16``, f32 1e13 is ``1e13``);
- ``0 < kk <= L``: the digits with the point inside (``12.34``, ``0.5`` is under the next rule);
- ``M < kk <= 0``: ``0.`` then ``-kk`` zeros then the digits (``0.1``, ``0.00001`` for f64 1e-5,
  ``0.000001`` for f32 1e-6);
- otherwise scientific: one digit, then ``.`` and the rest when there are more, then ``e`` and
  the exponent without ``+`` or leading zeros (``1e-7``, ``1e20``, ``1.5e300``, ``5e-324``,
  ``1e-45`` for the smallest f32 subnormal, ``3.4028235e38``).

A leading ``-`` for negative values. serde_json writes non-finite floats as ``null``; the seeds'
readers cannot read that back, so :func:`dumps` refuses them (ValueError) and the callers say why.

:func:`f64_text` takes its digits from Python's ``repr`` (the same shortest, nearest digits);
:func:`f32_text` finds the shortest correctly rounded decimal that reads back to the float32,
checking each candidate with a correct decimal -> float32 rounding (exact arithmetic where
rounding through float64 could differ). Readers take either spelling: these are plain JSON
numbers, and Python's ``repr`` text (``1e-07``, ``0.10000000149011612``) reads as before.

:func:`dumps` writes ``serde_json::to_string`` (compact) or ``to_string_pretty`` (``indent=2``:
two-space indent, ``": "``, ``[]`` and ``{}`` for empty containers, no trailing newline); strings as
``json.dumps(ensure_ascii=False)`` escapes them, which is serde_json's escaping. Python floats
are written as f64; values wrapped in :class:`F32` (a scalar) or :class:`F32List` (a list of
floats) as f32.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable, Mapping
from decimal import ROUND_FLOOR, Decimal, localcontext
from fractions import Fraction
from typing import Any

__all__ = ["F32", "F32List", "dumps", "f32_text", "f64_text", "layout"]

_PACK_F = struct.Struct("<f")
_PACK_D = struct.Struct("<d")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_F32_MIN_NORMAL = 2.0**-126
_F32_MAX = 3.4028234663852886e38


class F32(float):
    """A float written as ryu writes an ``f32`` (the value is rounded to float32 first)."""


class F32List(list[Any]):
    """A list whose floats are written as ryu writes ``f32`` values (integers stay integers)."""


def layout(negative: bool, digits: str, exponent: int, *, wide: bool) -> str:
    """ryu's text for ``digits x 10**exponent`` (``digits`` without trailing zeros)."""
    n = len(digits)
    kk = n + exponent
    limit, low = (16, -5) if wide else (13, -6)
    if exponent >= 0 and kk <= limit:
        body = digits + "0" * exponent + ".0"
    elif 0 < kk <= limit:
        body = digits[:kk] + "." + digits[kk:]
    elif low < kk <= 0:
        body = "0." + "0" * -kk + digits
    elif n == 1:
        body = f"{digits}e{kk - 1}"
    else:
        body = f"{digits[0]}.{digits[1:]}e{kk - 1}"
    return "-" + body if negative else body


def _split(text: str) -> tuple[str, int]:
    """Digits (no leading or trailing zeros) and exponent of a positive decimal ``text``."""
    mantissa, _, e = text.partition("e")
    whole, _, frac = mantissa.partition(".")
    digits = (whole + frac).lstrip("0")
    stripped = digits.rstrip("0")
    return stripped, (int(e) if e else 0) - len(frac) + len(digits) - len(stripped)


def f64_text(x: float) -> str:
    """serde_json's text of an f64 (finite)."""
    if x == 0:
        return "-0.0" if math.copysign(1.0, x) < 0 else "0.0"
    digits, exponent = _split(repr(abs(x)))
    return layout(x < 0, digits, exponent, wide=True)


def _f32(x: float) -> float:
    """``x`` rounded to the nearest float32 (ties to even); OverflowError past its range."""
    return float(_PACK_F.unpack(_PACK_F.pack(x))[0])


def _bits32(x: float) -> int:
    return int(_U32.unpack(_PACK_F.pack(x))[0])


def _from_bits32(b: int) -> float:
    return float(_PACK_F.unpack(_U32.pack(b))[0])


def _bounds(x: float) -> tuple[Fraction, Fraction]:
    """The decimals that round to float32 ``x`` (> 0): halfway to each neighbour."""
    b = _bits32(x)
    fx = Fraction(x)
    below = Fraction(_from_bits32(b - 1))
    up = fx + (fx - below) if x == _F32_MAX else Fraction(_from_bits32(b + 1))
    return (fx + below) / 2, (fx + up) / 2


def _inside(q: Fraction, lo: Fraction, hi: Fraction, even: bool) -> bool:
    """Whether ``q`` rounds into (lo, hi); a halfway point rounds to the even neighbour."""
    return lo < q < hi or (even and q in (lo, hi))


def _rounds_to(text: str, x: float) -> bool:
    """Whether the decimal ``text`` reads as float32 ``x`` (> 0) under correct rounding."""
    try:
        wide = float(text)
        narrow = _f32(wide)
    except OverflowError:
        return False
    # Rounding to float64 first is exact unless it lands on a float32 halfway point.
    if wide >= _F32_MIN_NORMAL:
        halfway = _U64.unpack(_PACK_D.pack(wide))[0] & ((1 << 29) - 1) == 1 << 28
    else:
        scaled = wide * 2.0**150
        halfway = scaled == int(scaled) and int(scaled) % 2 == 1
    if not halfway:
        return narrow == x
    lo, hi = _bounds(x)
    q = Fraction(text)
    even = _bits32(x) % 2 == 0
    return _inside(q, lo, hi, even)


def _exact32(x: float) -> tuple[str, int]:
    """Shortest, nearest digits of float32 ``x`` (> 0) by exact arithmetic (powers of two, whose
    interval is narrower below than above)."""
    lo, hi = _bounds(x)
    even = _bits32(x) % 2 == 0
    fx = Fraction(x)
    with localcontext() as ctx:
        ctx.prec = 200
        exact = Decimal(x)
        top = exact.adjusted()
        for p in range(1, 10):
            scale = top - p + 1
            floor = int((exact.scaleb(-scale)).to_integral_value(rounding=ROUND_FLOOR))
            best: tuple[Fraction, int, int] | None = None
            for m in (floor, floor + 1):
                q = Fraction(m) * Fraction(10) ** scale
                if _inside(q, lo, hi, even):
                    key = (abs(q - fx), m % 2, m)
                    best = key if best is None or key < best else best
            if best is not None:
                digits = str(best[2])
                stripped = digits.rstrip("0")
                return stripped, scale + len(digits) - len(stripped)
    raise AssertionError(f"no decimal reads back as {x!r}")  # pragma: no cover


def _is_power_of_two32(x: float) -> bool:
    return _bits32(x) & 0x7FFFFF == 0


def _shortest32(a: float) -> int:
    """The fewest significant digits p whose nearest p-digit decimal reads back as float32 ``a``
    (> 0, not a power of two: its interval is symmetric, so this is monotone in p). Most values
    need 8 or 9: those are tried first."""
    if not _rounds_to(f"{a:.7e}", a):
        return 9
    if not _rounds_to(f"{a:.6e}", a):
        return 8
    lo, hi = 1, 7
    while lo < hi:
        mid = (lo + hi) // 2
        if _rounds_to(f"{a:.{mid - 1}e}", a):
            hi = mid
        else:
            lo = mid + 1
    return lo


def f32_text(x: float) -> str:
    """serde_json's text of an f32: ``x`` (a float32 value, or rounded to the nearest one;
    ValueError beyond float32's range)."""
    try:
        x = _f32(x)
    except OverflowError:
        raise ValueError(f"{x!r} is out of range for an f32") from None
    if x == 0:
        return "-0.0" if math.copysign(1.0, x) < 0 else "0.0"
    a = abs(x)
    if _is_power_of_two32(a):
        digits, exponent = _exact32(a)
        return layout(x < 0, digits, exponent, wide=False)
    digits, exponent = _split(f"{a:.{_shortest32(a) - 1}e}")
    return layout(x < 0, digits, exponent, wide=False)


# ---------------------------------------------------------------------------------------------
# documents
# ---------------------------------------------------------------------------------------------


def _scalar(value: Any, f32: bool) -> str:
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, int):
        return int.__repr__(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"Out of range float values are not JSON compliant: {value!r}")
        return f32_text(value) if f32 or isinstance(value, F32) else f64_text(float(value))
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def _items(values: Iterable[Any], f32: bool) -> list[str]:
    if f32:
        cache: dict[float, str] = {}
        out = []
        for v in values:
            if type(v) is float and v != 0:  # 0.0 and -0.0 are equal keys: not cached
                text = cache.get(v)
                if text is None:
                    text = cache[v] = _scalar(v, True)
                out.append(text)
            else:
                out.append(_scalar(v, True))
        return out
    return [_scalar(v, False) for v in values]


def _encode(value: Any, indent: str | None, level: int, out: list[str]) -> None:
    if isinstance(value, Mapping):
        if not value:
            out.append("{}")
            return
        for i, (key, item) in enumerate(value.items()):
            if not isinstance(key, str):
                raise TypeError(f"keys must be str, not {type(key).__name__}")
            sep = "{" if i == 0 else ","
            if indent is None:
                out.append(f"{sep}{json.dumps(key, ensure_ascii=False)}:")
            else:
                pad = "\n" + indent * (level + 1)
                out.append(f"{sep}{pad}{json.dumps(key, ensure_ascii=False)}: ")
            _encode(item, indent, level + 1, out)
        out.append("}" if indent is None else "\n" + indent * level + "}")
        return
    if isinstance(value, (list, tuple)):
        if not value:
            out.append("[]")
            return
        if isinstance(value, F32List) or all(
            not isinstance(v, (Mapping, list, tuple)) for v in value
        ):
            texts = _items(value, isinstance(value, F32List))
            if indent is None:
                out.append("[" + ",".join(texts) + "]")
            else:
                pad = "\n" + indent * (level + 1)
                out.append("[" + pad + ("," + pad).join(texts) + "\n" + indent * level + "]")
            return
        for i, item in enumerate(value):
            out.append(
                ("[" if i == 0 else ",") + ("" if indent is None else "\n" + indent * (level + 1))
            )
            _encode(item, indent, level + 1, out)
        out.append("]" if indent is None else "\n" + indent * level + "]")
        return
    out.append(_scalar(value, False))


def dumps(value: Any, *, indent: int | None = None) -> str:
    """serde_json's ``to_string`` (``indent=None``) or ``to_string_pretty`` (``indent=2``; other
    widths lay out the same way) of a JSON value. Non-finite floats are a ValueError, other types
    a TypeError (as ``json.dumps``)."""
    out: list[str] = []
    _encode(value, None if indent is None else " " * indent, 0, out)
    return "".join(out)
