"""Comparing two checkpoints: which keys differ in presence, dtype or shape, and by how much.

For every tensor present in both with the same dtype and shape, :func:`diff` reports the largest
absolute difference and the relative L2 difference ``||a - b|| / ||a||`` (``||a - b||`` when
``a`` is all zeros), computed in float64 (complex: on magnitudes of the difference) a piece at a
time, so memory stays at one tensor pair. Plain values are compared for equality.

Stored checksums first: two tensors of the same dtype and shape whose manifests record the same
XXH3-64 digest *of the same kind* are equal without reading either (``by_checksum``): both
stored whole and checked whole (or both in blocks of the same size: manifest version 3 records
a digest combined from 64 KiB block digests for large shards, which is not the hash of the
bytes), or both split into the same shards with equal digests shard by shard. Digests of
different kinds, and different digests, mean the data is read. A checksum match trusts the
manifest: such tensors are not re-hashed (``savepoint verify`` does that), and ``read_all=True``
reads and compares every tensor anyway. Tensors that are read are verified as they are read,
each once.

Either checkpoint may also be a local file or directory of another format savepoint reads (a
safetensors file, a Hugging Face model directory, ``.shrew``, a PyTorch file, ...): it is read
as the tree :mod:`savepoint.formats.convert` reads it as (a flat ``{name: tensor}`` for
safetensors files and Hugging Face directories). Those formats have no checksums: their tensors
are always read.

:func:`compare` opens both checkpoints and gives the differences the manifests show at once (keys
added, removed, changed in type or shape, plain values) and then each tensor's row as it is
computed, so a caller can print them as they come; :func:`diff` collects everything.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from savepoint.codecs import dtypes
from savepoint.codecs import manifest as mf
from savepoint.engine.read import Reader
from savepoint.errors import CheckpointError
from savepoint.formats import convert, load
from savepoint.formats.detect import detect
from savepoint.state import tree
from savepoint.storage.paths import Location, PathArg, resolve

__all__ = [
    "Comparison",
    "DiffReport",
    "TensorDiff",
    "compare",
    "diff",
    "same_digests",
]

log = logging.getLogger(__name__)
Progress = Callable[[int, int], None]

_PIECE = 1 << 22  # elements per piece of the float64 computation


@dataclass(frozen=True)
class TensorDiff:
    key: str
    dtype: str
    shape: tuple[int, ...]
    max_abs: float
    rel_l2: float
    equal: bool
    by_checksum: bool = False  # equal by the stored checksums, without reading the data


@dataclass
class DiffReport:
    a: str
    b: str
    added: list[str] = field(default_factory=list)  # in b only
    removed: list[str] = field(default_factory=list)  # in a only
    changed: list[tuple[str, str, str]] = field(default_factory=list)  # key, in a, in b
    tensors: list[TensorDiff] = field(default_factory=list)
    values: list[tuple[str, Any, Any]] = field(default_factory=list)  # differing plain values
    a_version: int | None = None  # manifest format versions (other formats: theirs, or None)
    b_version: int | None = None
    a_format: str = "savepoint"  # the formats, as formats.detect names them
    b_format: str = "savepoint"

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
            "a_version": self.a_version,
            "b_version": self.b_version,
            "a_format": self.a_format,
            "b_format": self.b_format,
            "identical": self.identical,
            "compared": len(self.tensors),
            "by_checksum": sum(t.by_checksum for t in self.tensors),
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
                    "by_checksum": t.by_checksum,
                }
                for t in self.tensors
            ],
            "values": [{"key": k, "a": repr(x), "b": repr(y)} for k, x, y in self.values],
        }


def _leaves(root: tree.Node) -> dict[str, tree.Node]:
    return {tree.join(path): node for path, node in tree.leaves(root)}


class _Side:
    """One checkpoint of a comparison: its tree (manifest nodes), its tensor records, whether
    they hold checksums, and how to read a tensor."""

    def __init__(
        self,
        shown: str,
        root: tree.Node,
        records: Mapping[str, mf.TensorRecord],
        *,
        version: int | None,
        format: str = "savepoint",
        checksums: bool = True,
    ) -> None:
        self.shown = shown
        self.root = root
        self.records = records
        self.version = version
        self.format = format
        self.checksums = checksums

    def read(self, ref: str, out: np.ndarray[Any, Any], moved: Callable[[int], None]) -> None:
        """Every byte of the tensor ``ref`` into the uint8 array ``out`` (checked as read)."""
        raise NotImplementedError


class _Native(_Side):
    """A savepoint checkpoint: its reader (checksums verified as tensors are read)."""

    def __init__(self, reader: Reader) -> None:
        manifest = reader.manifest
        super().__init__(
            reader.shown, manifest.tree, manifest.tensors, version=manifest.format_version
        )
        self.reader = reader

    def read(self, ref: str, out: np.ndarray[Any, Any], moved: Callable[[int], None]) -> None:
        self.reader.transfer([(ref, out)], progress=moved)


class _Foreign(_Side):
    """A checkpoint of another format, read as the tree ``convert`` reads it as."""

    def __init__(self, shown: str, source: Any) -> None:
        flat = convert.encode(source.tree)
        records = {
            ref: mf.TensorRecord.plain(t.dtype.name, t.shape, "", 0, t.nbytes, "")
            for ref, t in flat.tensors.items()
        }
        super().__init__(
            shown,
            flat.tree,
            records,
            version=source.version,
            format=source.format,
            checksums=False,
        )
        self.sources = flat.tensors

    def read(self, ref: str, out: np.ndarray[Any, Any], moved: Callable[[int], None]) -> None:
        load.copy_bytes(self.sources[ref], out, moved)


class Comparison:
    """Two open checkpoints compared (see the module docstring): ``report`` holds what the
    manifests show from the start; :meth:`tensors` adds each tensor row to it as it yields it."""

    def __init__(self, ra: _Side, rb: _Side, *, read_all: bool = False) -> None:
        self._ra, self._rb = ra, rb
        self.read_all = read_all
        report = DiffReport(
            ra.shown,
            rb.shown,
            a_version=ra.version,
            b_version=rb.version,
            a_format=ra.format,
            b_format=rb.format,
        )
        la, lb = _leaves(ra.root), _leaves(rb.root)
        report.removed = [k for k in la if k not in lb]
        report.added = [k for k in lb if k not in la]
        self.pairs: list[tuple[str, str, str]] = []  # key, ref in a, ref in b: to compare
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
                rec_a = ra.records[na["ref"]]
                rec_b = rb.records[nb["ref"]]
                if (rec_a.dtype, rec_a.shape) != (rec_b.dtype, rec_b.shape):
                    report.changed.append((key, _describe(ra, na), _describe(rb, nb)))
                else:
                    self.pairs.append((key, na["ref"], nb["ref"]))
        self.report = report

    def planned(self) -> list[tuple[str, str, tuple[int, ...]]]:
        """``(key, dtype, shape)`` of every row :meth:`tensors` will yield, in that order."""
        records = self._ra.records
        return [(key, records[ra].dtype, records[ra].shape) for key, ra, _ in self.pairs]

    def equal_by_checksum(self, ref_a: str, ref_b: str) -> bool:
        """Whether the stored digests prove the two tensors equal (same kind, same value)."""
        if self.read_all or not (self._ra.checksums and self._rb.checksums):
            return False
        return same_digests(self._ra.records[ref_a], self._rb.records[ref_b])

    def bytes_to_read(self) -> int:
        """Bytes :meth:`tensors` will read: both sides of every pair checksums do not settle."""
        return sum(
            2 * self._ra.records[ra].nbytes
            for _, ra, rb in self.pairs
            if not self.equal_by_checksum(ra, rb)
        )

    def tensors(self, progress: Progress | None = None) -> Iterator[TensorDiff]:
        """Each tensor pair's row, in ``a``'s order, as it is computed (also appended to
        ``report.tensors``); ``progress(done, total)`` counts the bytes read."""
        total = self.bytes_to_read()
        done = 0
        start = time.perf_counter()

        def moved(n: int) -> None:
            nonlocal done
            done += n
            if progress is not None:
                progress(min(done, total), total)

        matched = 0
        for key, ref_a, ref_b in self.pairs:
            if self.equal_by_checksum(ref_a, ref_b):
                rec = self._ra.records[ref_a]
                row = TensorDiff(key, rec.dtype, rec.shape, 0.0, 0.0, True, by_checksum=True)
                matched += 1
                log.debug("%s: equal by stored checksum (%d bytes not read)", key, rec.nbytes)
            else:
                row = _compare(key, self._ra, ref_a, self._rb, ref_b, moved)
                log.debug("%s: read and compared (equal: %s)", key, row.equal)
            self.report.tensors.append(row)
            yield row
        log.info(
            "diff %s %s: %d tensors compared, %d by stored checksum, %d bytes read in %.2f s",
            self.report.a,
            self.report.b,
            len(self.pairs),
            matched,
            done,
            time.perf_counter() - start,
        )


def _format(where: Location) -> str:
    """The format at ``where``: another format's name for a local file or directory of one,
    else ``"savepoint"`` (and savepoint's reader words what is wrong). A local file detection
    refuses (a damaged .shrew file, a FIFO) raises its reason."""
    if not where.is_local:
        return "savepoint"
    try:
        return detect(where.path)
    except CheckpointError:
        if os.path.lexists(where.path) and not os.path.isdir(where.path):
            raise
        return "savepoint"


@contextlib.contextmanager
def _opened(where: Location) -> Iterator[_Side]:
    kind = _format(where)
    if kind == "savepoint":
        with Reader.open(where) as reader:
            yield _Native(reader)
        return
    with convert.open_source(where, kind) as source:
        yield _Foreign(str(where), source)


@contextlib.contextmanager
def compare(a: PathArg, b: PathArg, *, read_all: bool = False) -> Iterator[Comparison]:
    """The checkpoints at ``a`` and ``b`` (each a local path, a URL or a Location; a local file
    or directory of another format too) open and compared as far as their manifests (or
    headers) go (see :class:`Comparison`)."""
    first, second = resolve(a, what="checkpoint path"), resolve(b, what="checkpoint path")
    with _opened(first) as ra, _opened(second) as rb:
        yield Comparison(ra, rb, read_all=read_all)


def diff(
    a: PathArg, b: PathArg, *, read_all: bool = False, progress: Progress | None = None
) -> DiffReport:
    """Compare the checkpoints at ``a`` and ``b``, each a local path, a URL or a Location, or a
    local file or directory of another format savepoint reads (see the module docstring);
    ``progress(done, total)`` counts the bytes read."""
    with compare(a, b, read_all=read_all) as comparison:
        for _ in comparison.tensors(progress):
            pass
        return comparison.report


def same_digests(a: mf.TensorRecord, b: mf.TensorRecord) -> bool:
    """Whether the records' stored digests prove two tensors of one dtype and shape equal:
    the same digest over the same kind of hashing (whole, or blocks of one size), for the
    tensor stored whole or for each of the same shards."""
    if a.is_split or b.is_split:
        if not (a.is_split and b.is_split) or len(a.shards) != len(b.shards):
            return False
        return all(
            sa.region == sb.region and sa.block == sb.block and sa.xxh3 == sb.xxh3
            for sa, sb in zip(a.shards, b.shards)
        )
    return a.block == b.block and a.xxh3 == b.xxh3


def _describe(side: _Side, node: tree.Node) -> str:
    if node["t"] != "tensor":
        return f"value {tree.plain_value(node)!r}"
    rec = side.records[node["ref"]]
    return f"{rec.dtype}{list(rec.shape)}"


def _same_value(x: Any, y: Any) -> bool:
    if isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y):
        return True
    return type(x) is type(y) and bool(x == y)


def _read(side: _Side, ref: str, moved: Callable[[int], None]) -> np.ndarray[Any, Any]:
    rec = side.records[ref]
    out = np.empty(rec.nbytes, dtype=np.uint8)
    side.read(ref, out, moved)
    return out.view(dtypes.from_name(rec.dtype).numpy)


def _pieces(x: np.ndarray[Any, Any]) -> Iterator[np.ndarray[Any, Any]]:
    for i in range(0, len(x), _PIECE):
        yield x[i : i + _PIECE]


def _compare(
    key: str, ra: _Side, ref_a: str, rb: _Side, ref_b: str, moved: Callable[[int], None]
) -> TensorDiff:
    rec = ra.records[ref_a]
    xa, xb = _read(ra, ref_a, moved), _read(rb, ref_b, moved)
    equal = bool(np.array_equal(xa.view(np.uint8), xb.view(np.uint8)))  # no copies
    if equal:
        return TensorDiff(key, rec.dtype, rec.shape, 0.0, 0.0, True)
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
