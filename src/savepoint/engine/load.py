"""Loading and verifying one checkpoint in this process, on the read engine.

:func:`load` is ``sp.load`` below the facade for an unsharded load (the whole tree, or into
existing targets); :func:`verify` checks every data file's header against the manifest and every
checksum. The helpers (:func:`select`, :func:`kinds`, :func:`load_tree`, :func:`getter`,
:class:`Counter`, :func:`files_needed`) are shared with the sharded loads of
:mod:`savepoint.distributed.load` and with consolidation.
"""

from __future__ import annotations

import json
import logging
import struct
import time
from collections.abc import Callable, Iterable
from json.encoder import encode_basestring_ascii
from typing import Any, Literal

import numpy as np

from savepoint.codecs import dtypes, safetensors
from savepoint.codecs import manifest as mf
from savepoint.engine import _direct
from savepoint.engine import device as device_fill
from savepoint.engine.read import Needs, Reader, files_of
from savepoint.errors import CorruptCheckpointError, IncompatibleCheckpointError
from savepoint.state import arrays, restore, tree
from savepoint.storage.paths import Location

__all__ = [
    "Counter",
    "Framework",
    "Progress",
    "Verify",
    "counter",
    "files_needed",
    "getter",
    "kinds",
    "load",
    "load_tree",
    "records_as_dict",
    "select",
    "select_node",
    "verify",
]

log = logging.getLogger(__name__)

Framework = Literal["auto", "numpy", "torch"]
Progress = Callable[[int, int], None]
Verify = bool | Literal["first"]
Keys = Iterable[str] | str | None


class Counter:
    """Turns byte counts into ``progress(done, total)`` calls."""

    def __init__(self, progress: Progress, total: int) -> None:
        self.progress = progress
        self.total = total
        self.done = 0

    def __call__(self, n: int) -> None:
        self.done += n
        self.progress(min(self.done, self.total), self.total)


def counter(
    progress: Progress | None, manifest: mf.Manifest, refs: set[str] | None
) -> Counter | None:
    """A :class:`Counter` over the bytes of ``refs`` (None without ``progress``)."""
    if progress is None:
        return None
    return Counter(progress, sum(manifest.tensors[r].nbytes for r in refs or ()))


def kinds(root: tree.Node) -> dict[str, str]:
    """The kind (numpy, numpy_scalar, torch) of each tensor ref, from its first leaf."""
    out: dict[str, str] = {}
    for node in tree.tensor_nodes(root):
        out.setdefault(node["ref"], node["kind"])
    return out


def getter(made: dict[str, Any], device: Any) -> Callable[[str, str], Any]:
    """The tensor supplier for tree.build: each ref once, so tied leaves stay tied."""
    cache: dict[tuple[str, str], Any] = {}

    def get(ref: str, kind: str) -> Any:
        key = (ref, kind)
        if key not in cache:
            obj = made[ref]
            if device is not None and arrays.is_torch_tensor(obj):
                from savepoint.state import torch_tensors

                obj = torch_tensors.to_device(obj, device)
            cache[key] = obj[()] if kind == "numpy_scalar" and isinstance(obj, np.ndarray) else obj
        return cache[key]

    return get


def select(shown: str, manifest: mf.Manifest, keys: Keys) -> tree.Node:
    """The part of the saved tree under ``keys`` (all of it for None); a key that is not in the
    checkpoint raises IncompatibleCheckpointError naming it (and the nearest key there is)."""
    return select_node(shown, manifest.tree, keys)


def select_node(shown: str, root: tree.Node, keys: Keys) -> tree.Node:
    """:func:`select` of the saved tree ``root``."""
    if keys is None:
        return root
    wanted = [keys] if isinstance(keys, str) else list(keys)
    missing = [k for k in wanted if tree.select(root, [k]) is None]
    if missing:
        shown_keys = []
        for key in missing:
            near = tree.nearest(root, key)
            shown_keys.append(repr(key) + (f" (did you mean {near!r}?)" if near else ""))
        raise IncompatibleCheckpointError(
            f"{shown}: no such key(s) in the checkpoint: {', '.join(shown_keys)}; "
            "`savepoint inspect` lists the keys",
            path=shown,
        )
    selected = tree.select(root, wanted)
    assert selected is not None
    return selected


def records_as_dict(manifest: mf.Manifest) -> None:
    """Give a load the manifest's records as a plain dict: a read manifest keeps them as columns
    (a :class:`~savepoint.codecs.manifest.TensorTable`, all ``inspect`` and ``verify`` need), and
    a load asks for each record several times, where a dict lookup costs a tenth of a call."""
    if isinstance(manifest.tensors, mf.TensorTable):
        manifest.tensors = manifest.tensors.as_dict()


def files_needed(keys: Keys) -> Needs:
    """What a load of ``keys`` reads: the data files of every tensor under them, which
    ``Reader.open`` pins before the load starts (an ``into`` covering less reads a subset).
    A key that is not in the checkpoint raises IncompatibleCheckpointError from here."""

    def needs(shown: str, manifest: mf.Manifest) -> set[str]:
        records_as_dict(manifest)
        return files_of(manifest, tree.refs(select(shown, manifest, keys)))

    return needs


def load_tree(
    reader: Reader,
    root: tree.Node,
    verify: Verify,
    framework: Framework,
    device: Any,
    share: bool,
    progress: Counter | None,
) -> Any:
    """The saved tree under ``root``, every tensor freshly allocated (or, ``share``, a view of
    the reader's copy-on-write files) and checked."""
    found = kinds(root)
    reader.prepare(found, check_header=bool(verify))
    # Small tensors are made straight from their checked bytes; the others are allocated, then
    # filled by the transfer. A fresh tree is only handed over once complete, so "first" needs
    # no separate pass here.
    made = (
        {}
        if share
        else reader.materialize(found, framework, verify=bool(verify), progress=progress)
    )
    rest = [(ref, kind) for ref, kind in found.items() if ref not in made]
    on_device = {} if share else _allocate_on_device(reader, rest, framework, device)
    fresh = {
        ref: reader.allocate(ref, kind, framework, share_memory=share)
        for ref, kind in rest
        if ref not in on_device
    }
    jobs = [
        (ref, None if share and not reader.is_split(ref) else arrays.byte_view(obj))
        for ref, obj in fresh.items()
    ]
    reader.transfer(jobs, verify=bool(verify), progress=progress)
    device_fill.fill(reader, list(on_device.items()), verify=bool(verify), progress=progress)
    made.update(fresh)
    made.update(on_device)
    return tree.build(root, getter(made, device))


def _allocate_on_device(
    reader: Reader, rest: list[tuple[str, str]], framework: Framework, device: Any
) -> dict[str, Any]:
    """Tensors for ``rest`` allocated straight on ``device`` (a CUDA device) where
    :mod:`savepoint.engine.device` can fill them: no whole host copy of them is ever made."""
    if device is None or framework == "numpy":
        return {}
    from savepoint.state import torch_tensors

    target = torch_tensors.cuda_device(device)
    if target is None:
        return {}
    out: dict[str, Any] = {}
    for ref, kind in rest:
        rec = reader.manifest.tensors[ref]
        if kind != "torch" and framework != "torch":
            continue
        t = torch_tensors.empty(dtypes.from_name(rec.dtype), rec.shape, device=target)
        if device_fill.eligible(rec, t):
            out[ref] = t
    return out


def load(
    location: Location,
    *,
    into: Any,
    keys: Keys,
    verify: Verify,
    framework: Framework,
    device: Any,
    mmap: bool,
    progress: Progress | None,
) -> Any:
    """``sp.load`` of an unsharded load (arguments already checked): see its docstring.

    Logs one INFO line (path, tensors, bytes, seconds, throughput) once loaded."""
    started = time.perf_counter()
    reader = Reader.open(
        location,
        copy_on_write=mmap and into is None,
        needs=files_needed(keys),
        columns=False,
    )
    try:
        manifest = reader.manifest
        records_as_dict(manifest)
        root = select(reader.shown, manifest, keys)
        if into is None:
            # (The refs are only found for the progress counter and the log line.)
            refs = (
                tree.refs(root) if progress is not None or log.isEnabledFor(logging.INFO) else set()
            )
            count = counter(progress, manifest, refs if progress is not None else None)
            out = load_tree(reader, root, verify, framework, device, mmap, count)
        else:
            out, refs = _restore(reader, root, into, verify, framework, device, progress)
    finally:
        reader.close()
    if log.isEnabledFor(logging.INFO):
        took = time.perf_counter() - started
        nbytes = sum(manifest.tensors[r].nbytes for r in refs)
        log.info(
            "loaded %s%s: %d tensors, %d bytes in %.3f s, %.1f MiB/s (checksums %s)",
            reader.shown,
            " into the given state" if into is not None else "",
            len(refs),
            nbytes,
            took,
            nbytes / took / 2**20 if took > 0 else 0.0,
            {True: "checked", False: "not checked", "first": "checked first"}[verify],
        )
    return out


def _restore(
    reader: Reader,
    root: tree.Node,
    into: Any,
    verify: Verify,
    framework: Framework,
    device: Any,
    progress: Progress | None,
) -> tuple[Any, set[str]]:
    """The ``into`` half of :func:`load`: returns what ``sp.load`` returns, and the refs read."""
    manifest = reader.manifest
    p = restore.plan(root, into, manifest.tensors)
    if p.problems:
        raise restore.mismatch(p, root, into, manifest.tensors, path=reader.shown)
    refs = p.refs
    count = counter(progress, manifest, refs)
    direct = [
        (ref, target)
        for ref, target, _ in p.inplace
        if verify != "first" and device_fill.eligible(manifest.tensors[ref], target)
    ]
    taken = {ref for ref, _ in direct}
    jobs, after = reader.fill_jobs(
        (ref, target) for ref, target, _ in p.inplace if ref not in taken
    )
    reader.prepare(refs, check_header=bool(verify))
    found = kinds(root)
    made = {ref: reader.allocate(ref, found[ref], framework) for ref in p.fresh}
    jobs += [(ref, arrays.byte_view(obj)) for ref, obj in made.items()]
    if verify == "first":
        reader.transfer([(ref, None) for ref, _ in jobs])
    reader.transfer(jobs, verify=verify is True, progress=count)
    device_fill.fill(reader, direct, verify=verify is True, progress=count)
    for step in after:
        step()
    return p.finish(getter(made, device)), refs


def verify(
    reader: Reader, progress: Progress | None, *, blobs: bool = True, direct: bool = False
) -> None:
    """Check every data file's header entries against the manifest and every checksum; raise a
    CorruptCheckpointError describing the first problem. ``blobs=False``: leave out the tensors
    stored as blobs (a copy checks each blob it copies itself). ``direct``: read the data files
    past the page cache where every tensor is in a local data file (:mod:`._direct`), else as
    without it."""
    manifest = reader.manifest
    direct = direct and _direct.possible(reader.generation)
    if direct:
        for name in manifest.files:  # (size and header checked; no mapping, no read-ahead)
            reader.generation.open_file(name, view=False)
    wanted = (
        set(manifest.tensors)
        if blobs
        else {r for r, rec in manifest.tensors.items() if rec.recipe is None}
    )
    count = counter(progress, manifest, wanted)
    expected_sharded = _expected_entries(manifest) if manifest.sharded else {}
    table = manifest.tensors
    by_file = (
        _records_by_file(manifest)
        if not manifest.sharded and not isinstance(table, mf.TensorTable)
        else {}
    )
    for name in manifest.files:
        if isinstance(table, mf.TensorTable):
            if _table_header_as_written(reader, name, table):
                continue
        elif not manifest.sharded and _header_as_written(reader, name, by_file.get(name, [])):
            continue
        if manifest.sharded:
            # Shards are matched by position, dtype and shape; their names are informative.
            expected: Any = sorted(expected_sharded.get(name, []))
            found: Any = sorted(
                (e.start, e.end, e.dtype, e.shape) for e in reader.header_entries(name)
            )
        else:
            expected = {
                ref: (rec.dtype, rec.shape, rec.start, rec.end)
                for ref, rec in manifest.tensors.items()
                if rec.file == name
            }
            found = {
                e.name: (e.dtype, e.shape, e.start, e.end) for e in reader.header_entries(name)
            }
        if found != expected:
            raise CorruptCheckpointError(
                f"{reader.shown}: data file {name} does not hold what the manifest records",
                path=reader.shown,
            )
    if direct:
        _direct.check(reader.generation, count)
        return
    rest = reader.check_small(
        table if isinstance(table, mf.TensorTable) else table.items(), progress=count
    )
    if not blobs:
        rest = [ref for ref in rest if table[ref].recipe is None]
    reader.transfer([(ref, None) for ref in rest], progress=count)


def _records_by_file(manifest: mf.Manifest) -> dict[str, list[tuple[str, mf.TensorRecord]]]:
    out: dict[str, list[tuple[str, mf.TensorRecord]]] = {}
    for ref, rec in manifest.tensors.items():
        out.setdefault(rec.file, []).append((ref, rec))
    return out


def _header_as_written(
    reader: Reader, name: str, records: list[tuple[str, mf.TensorRecord]]
) -> bool:
    """Whether data file ``name``'s header is, byte for byte, the one savepoint writes for the
    manifest's records of that file, at the recorded offsets (so it holds exactly what the
    manifest records, tiling the file). Writing those bytes costs a fraction of parsing and
    checking the header (a 100,000-tensor verify spent 1.5 s there); any other header (another
    writer's layout, a damaged one) is left to the full check, which says what is wrong."""
    record = reader.manifest.files[name]
    ordered = records
    if not _tiles(ordered, record.header_size):
        # The writer's order: offsets ascending; zero-byte tensors at one offset largest
        # itemsize first, then in state order (which the manifest keeps). The manifest's own
        # order is that already unless a file mixes dtypes of several sizes.
        itemsize = _ITEMSIZE
        ordered = sorted(records, key=lambda it: (it[1].start, it[1].end, -itemsize[it[1].dtype]))
        if not _tiles(ordered, record.header_size):
            return False
    end = ordered[-1][1].end if ordered else record.header_size
    if end != record.size or any(ref == "__metadata__" for ref, _ in ordered):
        return False
    head = safetensors.header([(ref, r.dtype, r.shape, r.end - r.start) for ref, r in ordered])
    return len(head) == record.header_size and reader.header_bytes(name) == head


def _table_header_as_written(reader: Reader, name: str, table: mf.TensorTable) -> bool:
    """:func:`_header_as_written` of a table's records of data file ``name``, from its
    columns."""
    record = reader.manifest.files[name]
    if name not in table.files:
        rows = np.zeros(0, dtype=np.int64)
    else:
        code = table.files.index(name)
        rows = np.flatnonzero(np.frombuffer(table.file_of, dtype=np.uint32) == code)
    starts = np.frombuffer(table.starts, dtype=np.int64)[rows]
    ends = np.frombuffer(table.ends, dtype=np.int64)[rows]

    def tiles() -> bool:
        if not rows.size:
            return True
        return int(starts[0]) == record.header_size and bool((starts[1:] == ends[:-1]).all())

    if not tiles():
        # The writer's order (see _header_as_written).
        itemsize = np.array([_ITEMSIZE[d] for d in table.dtypes], dtype=np.int64)
        dtype_of = np.frombuffer(table.dtype_of, dtype=np.uint8)[rows]
        order = np.lexsort((-itemsize[dtype_of], ends, starts))
        rows, starts, ends = rows[order], starts[order], ends[order]
        if not tiles():
            return False
    end = int(ends[-1]) if rows.size else record.header_size
    picked = rows.tolist()
    names = [table.names[i] for i in picked]
    if end != record.size or "__metadata__" in names:
        return False
    # safetensors.header's text, entry by entry with one C-level format call each (the
    # encoded dtypes and shapes once per distinct value): a fifth of its cost.
    dtype_texts = [_encode(d) for d in table.dtypes]
    shape_texts = [json.dumps(list(sh), separators=(",", ":")) for sh in table.shapes]
    offsets = starts - record.header_size
    entries = ",".join(
        map(
            _ENTRY.format,
            map(_encode, names),
            map(dtype_texts.__getitem__, map(table.dtype_of.__getitem__, picked)),
            map(shape_texts.__getitem__, map(table.shape_of.__getitem__, picked)),
            offsets.tolist(),
            (offsets + (ends - starts)).tolist(),
        )
    )
    opening = json.dumps({"__metadata__": safetensors.PRODUCER}, separators=(",", ":"))[:-1]
    text = (opening + ("," if entries else "") + entries + "}").encode("ascii")
    text += b" " * (-len(text) % 8)
    head = struct.pack("<Q", len(text)) + text
    return len(head) == record.header_size and reader.header_bytes(name) == head


_ENTRY = '{}:{{"dtype":{},"shape":{},"data_offsets":[{},{}]}}'
_encode = encode_basestring_ascii


def _tiles(records: list[tuple[str, mf.TensorRecord]], start: int) -> bool:
    """Whether the records, in this order, lie back to back from ``start``."""
    position = start
    for _, rec in records:
        if rec.start != position:
            return False
        position = rec.end
    return True


_ITEMSIZE = {name: d.itemsize for name, d in dtypes.BY_NAME.items()}


def _expected_entries(
    manifest: mf.Manifest,
) -> dict[str, list[tuple[int, int, str, tuple[int, ...]]]]:
    """(start, end, dtype, stored shape) of every shard, by data file."""
    out: dict[str, list[tuple[int, int, str, tuple[int, ...]]]] = {}
    for rec in manifest.tensors.values():
        for shard in rec.layout():
            if shard.recipe is not None:
                continue  # stored as blobs (version 4), in no data file
            out.setdefault(shard.file, []).append(
                (shard.start, shard.end, rec.dtype, mf.shard_shape(shard.region))
            )
    return out
