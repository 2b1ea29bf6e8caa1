"""Version 1 tensor entries: the column fast path and the entry checks.

An unsharded manifest can hold millions of tensor entries, each ``{"dtype", "shape", "file",
"offsets", "xxh3"}``. :func:`records` checks them column by column (sets of types and values,
maps at C speed over the offsets) and keeps the records as columns (a :class:`TensorTable`);
where any entry fails a column check, entry by entry, where :func:`check_entry` names the first
problem. Both are tuned (``benchmarks/bench_scale.py``): measure before changing them.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Mapping
from typing import Any

from savepoint.codecs.manifest._checks import (
    DICT_ONLY,
    INT_ONLY,
    ITEMSIZE,
    LIST_ONLY,
    PAIR_ONLY,
    STR_ONLY,
    byte_range,
    dtype_and_shape,
    is_digest,
    require,
)
from savepoint.codecs.manifest._records import FileRecord, TensorRecord, TensorTable

KEYS = frozenset(("dtype", "shape", "file", "offsets", "xxh3"))  # a version 1 entry's members
_V1_FIELDS = operator.itemgetter("dtype", "shape", "file", "offsets", "xxh3")
_HEX = "0123456789abcdef"
_SIXTEEN = frozenset((16,))
_FIRST = operator.itemgetter(0)
_SECOND = operator.itemgetter(1)


def records(
    raw_tensors: dict[str, Any], files: dict[str, FileRecord], columns: bool = True
) -> Mapping[str, TensorRecord]:
    """Check every version 1 tensor entry; return their records.

    The checks of :func:`check_entry`, made column by column over all the entries at once
    (:func:`_columns`: sets of types and values, maps at C speed over the offsets; a manifest
    can hold millions), the records kept as columns (a :class:`TensorTable`); if any entry
    fails any of them, entry by entry (:func:`_each`), which raises the error naming what is
    wrong."""
    if columns:
        try:
            table = _columns(raw_tensors, files, columns)
            if table is not None:
                return table
        except (TypeError, ValueError, OverflowError, KeyError):
            pass  # a hostile value the column checks cannot take: the entry checks say which
    # A load's records (a dict), or entries the column checks refused: entry by entry (for a
    # load, as fast as the column checks plus a record each, and gentler on the allocator).
    tensors: dict[str, TensorRecord] = {}
    _each(raw_tensors, files, tensors)
    return tensors


def _columns(
    raw_tensors: dict[str, Any], files: dict[str, FileRecord], columns: bool = True
) -> Mapping[str, TensorRecord] | None:
    """:func:`records` column by column (a table, or with ``columns=False`` a dict of
    records); None if any entry fails a check."""
    entries = list(raw_tensors.values())
    if not entries:
        return TensorTable([], cached=True) if columns else {}
    if set(map(type, entries)) != DICT_ONLY or not all(
        map(operator.eq, map(dict.keys, entries), itertools.repeat(KEYS))
    ):
        return None
    fields = zip(*map(_V1_FIELDS, entries))
    del entries
    dts, shapes, names, offsets, digests = fields
    itemsizes = ITEMSIZE
    if not (
        set(map(type, dts)) == STR_ONLY
        and set(dts) <= itemsizes.keys()
        and set(map(type, names)) == STR_ONLY
        and set(names) <= files.keys()
        and set(map(type, digests)) == STR_ONLY
        and set(map(len, digests)) == _SIXTEEN
        and not "".join(digests).strip(_HEX)
        and set(map(type, shapes)) == LIST_ONLY
        and set(map(type, itertools.chain.from_iterable(shapes))) <= INT_ONLY
        and set(map(type, offsets)) == LIST_ONLY
        and set(map(len, offsets)) == PAIR_ONLY
    ):
        return None
    dims = list(map(tuple, shapes))
    del shapes
    counts: dict[tuple[int, ...], tuple[int, ...]] = {}  # each distinct shape, checked, once
    elements = {}
    for d in set(dims):
        if not (
            len(d) <= 64
            and min(d, default=0) >= 0
            and max(d, default=0) < 2**62
            and math.prod([x or 1 for x in d]) * 16 < 2**62
        ):
            return None
        counts[d] = d
        elements[d] = math.prod(d)
    dims = list(map(counts.__getitem__, dims))  # one tuple per distinct shape
    starts = list(map(_FIRST, offsets))
    ends = list(map(_SECOND, offsets))
    del offsets
    if not set(map(type, starts)) | set(map(type, ends)) <= INT_ONLY:
        return None
    # Ranges, with C-level maps over Python ints (any size): inside their file's data, and
    # exactly shape x itemsize long.
    le = operator.le
    if len(files) == 1:
        record = next(iter(files.values()))
        if min(starts) < record.header_size or max(ends) > record.size:
            return None
    else:
        firsts = {name: f.header_size for name, f in files.items()}
        lasts = {name: f.size for name, f in files.items()}
        if not all(map(le, map(firsts.__getitem__, names), starts)) or not all(
            map(le, ends, map(lasts.__getitem__, names))
        ):
            return None
    need = map(operator.mul, map(elements.__getitem__, dims), map(itemsizes.__getitem__, dts))
    if not all(map(le, starts, ends)) or list(map(operator.sub, ends, starts)) != list(need):
        return None
    if not columns:
        return dict(
            zip(raw_tensors, map(TensorRecord.plain, dts, dims, names, starts, ends, digests))
        )
    return TensorTable.from_columns(list(raw_tensors), dts, dims, names, starts, ends, digests)


def _each(
    raw_tensors: dict[str, Any], files: dict[str, FileRecord], tensors: dict[str, TensorRecord]
) -> None:
    """:func:`records` entry by entry: the checks of :func:`check_entry`, inlined for the
    entries that pass them (shapes are checked once per distinct shape, digests without a
    regular expression); an entry that fails any of them goes through :func:`check_entry`."""
    v1_keys = KEYS
    itemsizes = ITEMSIZE
    int_only = INT_ONLY
    counts: dict[tuple[int, ...], int] = {}  # shapes already checked -> element count
    make = TensorRecord.plain
    for name, t in raw_tensors.items():
        if type(t) is dict and t.keys() == v1_keys:
            dtype, shape, file, offsets, xxh3 = (
                t["dtype"],
                t["shape"],
                t["file"],
                t["offsets"],
                t["xxh3"],
            )
            itemsize = itemsizes.get(dtype) if type(dtype) is str else None
            record = files.get(file) if type(file) is str else None
            if (
                itemsize is not None
                and record is not None
                and type(shape) is list
                and type(offsets) is list
                and len(offsets) == 2
                and type(xxh3) is str
                and len(xxh3) == 16
                and not xxh3.strip(_HEX)
            ):
                dims = tuple(shape)
                # Types first: (True,) == (1,), so the cache is only asked about int tuples.
                count = counts.get(dims) if int_only.issuperset(map(type, dims)) else None
                if (
                    count is None
                    and len(dims) <= 64
                    and int_only.issuperset(map(type, dims))
                    and min(dims, default=0) >= 0
                    and max(dims, default=0) < 2**62
                    and math.prod([d or 1 for d in dims]) * itemsize < 2**62
                ):
                    count = counts[dims] = math.prod(dims)
                start, end = offsets
                if (
                    count is not None
                    and type(start) is int
                    and type(end) is int
                    and record.header_size <= start <= end <= record.size
                    and end - start == count * itemsize
                ):
                    tensors[name] = make(dtype, dims, file, start, end, xxh3)
                    continue
        tensors[name] = check_entry(name, t, files)


def check_entry(name: str, t: Any, files: dict[str, FileRecord]) -> TensorRecord:
    """One version 1 tensor entry, checked, with a message naming the first problem."""
    require(
        type(t) is dict and t.keys() == KEYS,
        f"tensor {name!r}: entry must have dtype, shape, file, offsets, xxh3",
    )
    shape, itemsize = dtype_and_shape(name, t)
    start, end = byte_range(f"tensor {name!r}", t, files)
    expected = math.prod(shape) * itemsize
    require(
        end - start == expected,
        f"tensor {name!r}: {end - start} bytes recorded, shape {list(shape)} of {t['dtype']} "
        f"needs {expected}",
    )
    require(is_digest(t["xxh3"]), f"tensor {name!r}: bad checksum")
    return TensorRecord(t["dtype"], shape, t["file"], start, end, t["xxh3"])
