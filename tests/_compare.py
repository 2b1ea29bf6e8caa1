"""Exact comparison of state trees, shared by the test modules."""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def same(a: Any, b: Any, where: str = "<root>") -> None:
    """Strict structural equality: exact types, dict key order and key types, bit-exact arrays."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, dict):
        assert [(type(k), k) for k in a] == [(type(k), k) for k in b], f"{where}: keys differ"
        for k in a:
            same(a[k], b[k], f"{where}/{k!r}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}/{i}")
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape, (
            f"{where}: {a.dtype}{a.shape} != {b.dtype}{b.shape}"
        )
        assert np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes(), (
            f"{where}: data"
        )
    elif isinstance(a, np.generic):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), f"{where}: {a!r} != {b!r}"
    elif isinstance(a, float):
        if math.isnan(a):
            assert math.isnan(b), where
        else:
            assert a == b and math.copysign(1, a) == math.copysign(1, b), f"{where}: {a!r} != {b!r}"
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"
