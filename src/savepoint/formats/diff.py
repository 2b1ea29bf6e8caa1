"""Comparing two checkpoints: which keys differ in presence, dtype or shape, and by how much.

For every tensor present in both with the same dtype and shape, :func:`diff` reports the largest
absolute difference and the relative L2 difference ``||a - b|| / ||a||`` (``||a - b||`` when
``a`` is all zeros), computed in float64 (complex: on magnitudes of the difference) a piece at a
time, so memory stays at one tensor pair. Plain values are compared for equality. Tensors are
read once each; both checkpoints are verified as they are read.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from savepoint.codecs import dtypes
from savepoint.engine.read import Reader
from savepoint.state import tree
from savepoint.storage.paths import PathArg, resolve

__all__ = [
    "DiffReport",
    "TensorDiff",
    "diff",
]

_PIECE = 1 << 22  # elements per piece of the float64 computation


@dataclass(frozen=True)
class TensorDiff:
    key: str
    dtype: str
    shape: tuple[int, ...]
    max_abs: float
    rel_l2: float
    equal: bool


@dataclass
class DiffReport:
    a: str
    b: str
    added: list[str] = field(default_factory=list)  # in b only
    removed: list[str] = field(default_factory=list)  # in a only
    changed: list[tuple[str, str, str]] = field(default_factory=list)  # key, in a, in b
    tensors: list[TensorDiff] = field(default_factory=list)
    values: list[tuple[str, Any, Any]] = field(default_factory=list)  # differing plain values

    @property
    def identical(self) -> bool:
        return not (
            self.added
            or self.removed
            or self.changed
            or self.values
            or any(not t.equal for t in self.tensors)
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "a": self.a,
            "b": self.b,
            "identical": self.identical,
            "added": self.added,
            "removed": self.removed,
            "changed": [{"key": k, "a": x, "b": y} for k, x, y in self.changed],
            "tensors": [
                {
                    "key": t.key,
                    "dtype": t.dtype,
                    "shape": list(t.shape),
                    "max_abs": t.max_abs,
                    "rel_l2": t.rel_l2,
                    "equal": t.equal,
                }
                for t in self.tensors
            ],
            "values": [{"key": k, "a": repr(x), "b": repr(y)} for k, x, y in self.values],
        }


def _leaves(root: tree.Node) -> dict[str, tree.Node]:
    return {tree.join(path): node for path, node in tree.leaves(root)}


def diff(a: PathArg, b: PathArg) -> DiffReport:
    """Compare the checkpoints at ``a`` and ``b``, each a local path, a URL or a Location (see
    the module docstring)."""
    first, second = resolve(a, what="checkpoint path"), resolve(b, what="checkpoint path")
    with Reader.open(first) as ra, Reader.open(second) as rb:
        report = DiffReport(ra.shown, rb.shown)
        la, lb = _leaves(ra.manifest.tree), _leaves(rb.manifest.tree)
        report.removed = [k for k in la if k not in lb]
        report.added = [k for k in lb if k not in la]
        for key, na in la.items():
            nb = lb.get(key)
            if nb is None:
                continue
            ta, tb = na["t"] == "tensor", nb["t"] == "tensor"
            if ta != tb:
                report.changed.append((key, _describe(ra, na), _describe(rb, nb)))
            elif not ta:
                va, vb = tree.plain_value(na), tree.plain_value(nb)
                if not _same_value(va, vb):
                    report.values.append((key, va, vb))
            else:
                rec_a = ra.manifest.tensors[na["ref"]]
                rec_b = rb.manifest.tensors[nb["ref"]]
                if (rec_a.dtype, rec_a.shape) != (rec_b.dtype, rec_b.shape):
                    report.changed.append((key, _describe(ra, na), _describe(rb, nb)))
                else:
                    report.tensors.append(_compare(key, ra, na["ref"], rb, nb["ref"]))
        return report


def _describe(r: Reader, node: tree.Node) -> str:
    if node["t"] != "tensor":
        return f"value {tree.plain_value(node)!r}"
    rec = r.manifest.tensors[node["ref"]]
    return f"{rec.dtype}{list(rec.shape)}"


def _same_value(x: Any, y: Any) -> bool:
    if isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y):
        return True
    return type(x) is type(y) and bool(x == y)


def _read(r: Reader, ref: str) -> np.ndarray[Any, Any]:
    rec = r.manifest.tensors[ref]
    out = np.empty(rec.nbytes, dtype=np.uint8)
    r.transfer([(ref, out)])
    return out.view(dtypes.from_name(rec.dtype).numpy)


def _pieces(x: np.ndarray[Any, Any]) -> Iterator[np.ndarray[Any, Any]]:
    for i in range(0, len(x), _PIECE):
        yield x[i : i + _PIECE]


def _compare(key: str, ra: Reader, ref_a: str, rb: Reader, ref_b: str) -> TensorDiff:
    rec = ra.manifest.tensors[ref_a]
    xa, xb = _read(ra, ref_a), _read(rb, ref_b)
    equal = xa.view(np.uint8).tobytes() == xb.view(np.uint8).tobytes()
    max_abs = 0.0
    sq_diff = 0.0
    sq_a = 0.0
    for pa, pb in zip(_pieces(xa), _pieces(xb)):
        kind = np.complex128 if np.iscomplexobj(pa) else np.float64
        fa, fb = pa.astype(kind), pb.astype(kind)
        d = np.abs(fa - fb)
        with np.errstate(invalid="ignore"):
            both_nan = np.isnan(fa) & np.isnan(fb) if kind is np.float64 else np.zeros(len(d), bool)
            d = np.where(both_nan, 0.0, d)
        if d.size:
            max_abs = max(max_abs, float(np.max(d)))
        sq_diff += float(np.sum(d * d))
        sq_a += float(np.sum(np.abs(fa) ** 2))
    rel = math.sqrt(sq_diff) / math.sqrt(sq_a) if sq_a > 0 else math.sqrt(sq_diff)
    return TensorDiff(key, rec.dtype, rec.shape, max_abs, rel, equal)
