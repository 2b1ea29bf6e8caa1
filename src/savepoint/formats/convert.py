"""Converting checkpoints between savepoint's format, ``.shrew`` v1/v2, safetensors files, boostr
directories, burn records and training artifacts, one tensor at a time.

Every format is read as a state tree, the shape ``sp.save`` would store, whose tensors stay on
disk until the writer copies them:

==================  ==========================================================================
format              tree (metadata)
==================  ==========================================================================
savepoint           the saved tree (the manifest's metadata)
shrew v1            ``{name: tensor}`` in file order
shrew v2            ``{"model": {name: tensor}, "optimizer": {"optimizer_type", "scalars",
                    "buffers"} (as ``OptimizerState.state_dict()``; only with an optimizer
                    section), "epoch", "global_step", "best_loss", "loss_history"}``
safetensors         ``{name: tensor}`` in header order (the header's ``__metadata__``)
boostr              ``{"model": {...}, "optimizer": {...} (when present), "step", "epoch",
                    "learning_rate"}`` (``training_state.json``'s metadata map)
boostr-distributed  read only: the consolidated checkpoint, as boostr
burn                ``{dotted name: tensor}`` in file order (the record's metadata)
training-artifact   read only: ``{"model": {dotted name: tensor}, "best_validation_model":
                    {...} (only from its own directory), "optimizer_state": a U8 tensor (when
                    present), "manifest": {...}, "report": {...}}``
torch               read only: what ``torch.load(weights_only=True)`` gives (a state dict, or a
                    dict of them), tensors lazy; never unpickled otherwise (see
                    :mod:`savepoint.formats.pytorch`)
huggingface         read only (``export(hf=True)`` writes it): ``{name: tensor}``, shard by shard
                    (the first shard's ``__metadata__``)
dcp, ...            other systems' directories (:mod:`savepoint.formats.foreign`); ``dcp`` is
                    ``{fqn: tensor}`` (``{"dcp": ...}``), a target too (``formats.dcp_export``)
==================  ==========================================================================

Writing a tree into a format:

- savepoint holds everything; savepoint -> savepoint copies the manifest's tree exactly (types,
  stateful nodes, ties) and checks every checksum while copying.
- Flat formats (shrew v1, safetensors) take every tensor under the name of its path, components
  joined by ``/`` (``{"model": {"w": t}}`` gives ``"model/w"``); two tensors with one name are
  refused. Plain values have no place there.
- shrew v2 takes the ``"model"`` subtree as its model section (or, without a ``"model"`` key,
  every entry but the training fields), an ``"optimizer"`` shaped like
  ``OptimizerState.state_dict()``, ``epoch``, ``global_step`` (or ``step``), ``best_loss``,
  ``loss_history``. boostr likewise takes ``"model"``, an ``"optimizer"`` of tensors, ``step``
  (or ``global_step``), ``epoch`` and ``learning_rate``; absent fields get the format's defaults.
- burn takes the ``"model"`` subtree (or the whole tree) and names each tensor by its path joined
  with ``.`` (``{"model": {"layers": [{"w": t}]}}`` gives ``"layers.0.w"``), nested back into a
  record as :func:`savepoint.formats.burn.save_record` does; it holds tensors only.
- dtypes: .shrew holds F32, F64, U8, U32, I64, F16, BF16; burn the integer, float (F16 to F64)
  and bool dtypes; safetensors and boostr every dtype savepoint has. Metadata: savepoint holds
  any JSON; safetensors and boostr a str -> str map; burn its own ``BurnMetadata`` (``float``,
  ``int``, ``format``, ``version``, ``settings``: kept from a burn source); .shrew none.

Whatever the target cannot hold is listed, all at once, in a :class:`ConversionError` before
anything is written; ``lossy=True`` leaves those parts out instead and lists them in the
returned :class:`ConversionReport`. Nothing is ever cast or renamed silently.

Streaming: tensors are copied from the source's file (mapped, or read by offset) into the
writer's bounded buffers one at a time, so converting a checkpoint of any size holds at most one
tensor in memory (a TensorParallel concatenation, an optimizer buffer widened to float64),
usually none. Every destination is written atomically. ``progress(done, total)`` is called in
bytes as tensors are copied.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from savepoint import checkpoint
from savepoint.codecs import dtypes
from savepoint.engine.read import Reader
from savepoint.errors import (
    CheckpointError,
    CheckpointWriteError,
    ConversionError,
    IncompatibleCheckpointError,
    UnsupportedStateError,
    UnsupportedStorageError,
)
from savepoint.formats import _files, boostr, burn, huggingface, pytorch, shrew, training_artifact
from savepoint.formats._files import LazyTensor, MappedTensor, SafetensorsFile
from savepoint.formats._progress import Counted, Progress, Tally
from savepoint.formats._targets import check_local_target, check_replaceable
from savepoint.formats.detect import detect
from savepoint.formats.foreign import KINDS as FOREIGN
from savepoint.formats.foreign import WRITERS, open_tree
from savepoint.state import tree as tree_mod
from savepoint.state.arrays import TensorSource
from savepoint.storage.paths import Location, PathArg, local_path
from savepoint.storage.paths import resolve as resolve_path

__all__ = [
    "ConversionReport",
    "TARGETS",
    "check_local_target",
    "check_replaceable",
    "convert",
    "counting",
    "encode",
    "has_tensor",
    "open_source",
]

log = logging.getLogger(__name__)

TARGETS = ("savepoint", "shrew", "shrew-v1", "shrew-v2", "safetensors", "boostr", "burn", "dcp")
_V2_FIELDS = ("optimizer", "epoch", "global_step", "step", "best_loss", "loss_history")
_BOOSTR_FIELDS = ("optimizer", "step", "global_step", "epoch", "learning_rate")
_OPTIMIZER_KEYS = ("optimizer_type", "scalars", "buffers")
_U64 = 1 << 64
_F64 = dtypes.from_name("F64")
_LABELS = {
    "savepoint": "savepoint's format",
    "shrew-v1": ".shrew v1",
    "shrew-v2": ".shrew v2",
    "safetensors": "a safetensors file",
    "boostr": "a boostr checkpoint",
    "burn": "a burn record",
    "dcp": "a torch.distributed.checkpoint checkpoint",
}


@dataclass(frozen=True)
class ConversionReport:
    """What ``convert`` did: paths, formats (``source_format`` with its version, e.g.
    ``"shrew v2"``; ``source_kind`` the format alone, as ``detect`` names it, and
    ``source_version`` its version, None where it has none), tensors and bytes written, and what
    ``lossy`` left out (empty otherwise)."""

    source: str
    destination: str
    source_format: str
    destination_format: str
    tensors: int
    bytes: int
    dropped: tuple[str, ...] = ()
    source_kind: str = ""
    source_version: int | None = None


# ---------------------------------------------------------------------------------------------
# sources
# ---------------------------------------------------------------------------------------------


@dataclass
class _Source:
    format: str
    label: str
    tree: Any
    metadata: dict[str, Any]
    native: tuple[tree_mod.Node, dict[str, TensorSource]] | None = None
    version: int | None = None


class _Assembled(_files.Materialized):
    """A native tensor stored as several shards: read (and checked) whole on the first copy,
    dropped on release."""

    def __init__(self, reader: Reader, ref: str, kind: str) -> None:
        rec = reader.manifest.tensors[ref]
        super().__init__(dtypes.from_name(rec.dtype), rec.shape, kind=kind)
        self._reader = reader
        self._ref = ref

    def make(self) -> np.ndarray[Any, Any]:
        out = np.empty(self.nbytes, dtype=np.uint8)
        self._reader.transfer([(self._ref, out)], verify=True)
        return out


@contextlib.contextmanager
def open_source(path: PathArg, kind: str) -> Iterator[_Source]:
    """The checkpoint at ``path`` (of format ``kind``, as ``detect`` names it) as a lazy tree:
    savepoint's own on any store, other formats from local files."""
    if kind == "savepoint":
        with _open_native(path) as source:
            yield source
        return
    local = local_path(path, what="source")
    if kind == "shrew":
        with shrew.ShrewFile(local) as f:
            yield _Source(kind, f"shrew v{f.version}", f.tree(), {}, version=f.version)
    elif kind == "torch":
        with pytorch.open_tree(local) as tree:
            yield _Source(kind, "torch", tree, {})
    elif kind in FOREIGN:
        with open_tree(kind, local) as (label, tree, metadata):
            yield _Source(kind, label, tree, metadata)
    elif kind == "burn":
        with burn.open_record(local) as record:
            yield _Source(kind, kind, record.tensors(), record.metadata.to_dict())
    elif kind == "training-artifact":
        with training_artifact.open_artifact(local) as artifact:
            yield _Source(kind, kind, artifact.tree(), {})
    elif kind == "safetensors":
        # A top-level file may be a symlink (the Hugging Face cache is made of them).
        with SafetensorsFile(os.path.realpath(local)) as st:
            yield _Source(kind, kind, {n: st.tensor(n) for n in st.names()}, dict(st.metadata))
    elif kind == "huggingface":
        with huggingface.open_repository(local) as repo:
            yield _Source(kind, kind, {n: repo.tensor(n) for n in repo.names()}, repo.metadata)
    else:
        opened = boostr.open_distributed if kind == "boostr-distributed" else boostr.open_checkpoint
        with opened(local) as d:
            yield _Source(kind, kind, d.tree(), dict(d.state.metadata))


@contextlib.contextmanager
def _open_native(path: PathArg) -> Iterator[_Source]:
    kind = "savepoint"
    reader = Reader.open(path)
    try:
        manifest = reader.manifest
        made: dict[str, LazyTensor] = {}

        def get(ref: str, leaf_kind: str) -> LazyTensor:
            if ref not in made:
                rec = manifest.tensors[ref]
                if reader.is_split(ref):
                    # A tensor a sharded save stored in pieces, or an incremental save in
                    # blobs: assembled (read and checked) when first copied.
                    made[ref] = _Assembled(reader, ref, leaf_kind)
                    return made[ref]
                made[ref] = MappedTensor(
                    reader.raw(ref),
                    dtypes.from_name(rec.dtype),
                    rec.shape,
                    kind=leaf_kind,
                    xxh3=rec.xxh3,
                    block=rec.block,
                    name=ref,
                    path=reader.path,
                    file=reader.file_range(ref),
                )
            return made[ref]

        tree = tree_mod.build(manifest.tree, get)
        used = tree_mod.refs(manifest.tree)
        refs: dict[str, TensorSource] = {r: made[r] for r in manifest.tensors if r in used}
        yield _Source(
            kind,
            f"savepoint v{manifest.format_version}",
            tree,
            dict(manifest.metadata),
            (manifest.tree, refs),
            version=manifest.format_version,
        )
    finally:
        reader.close()


def _tensors_in(node: Any) -> Iterator[LazyTensor]:
    if isinstance(node, LazyTensor):
        yield node
    elif isinstance(node, Mapping):
        for v in node.values():
            yield from _tensors_in(v)
    elif isinstance(node, (list, tuple)):
        for v in node:
            yield from _tensors_in(v)


def counting(source: _Source, progress: Progress) -> _Source:
    """``source`` with every tensor wrapped to report the bytes copied out of it to
    ``progress(done, total)``; the same tensor (tied leaves) stays one object."""
    tally = Tally.over(progress, _tensors_in(source.tree))
    made: dict[int, Counted] = {}

    def wrap(t: LazyTensor) -> Counted:
        if id(t) not in made:
            made[id(t)] = Counted(t, tally)
        return made[id(t)]

    def walk(node: Any) -> Any:
        if isinstance(node, LazyTensor):
            return wrap(node)
        if isinstance(node, Mapping):
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        if isinstance(node, tuple):
            return tuple(walk(v) for v in node)
        return node

    native = None
    if source.native is not None:
        node, refs = source.native
        native = (
            node,
            {r: wrap(t) if isinstance(t, LazyTensor) else t for r, t in refs.items()},
        )
    return _Source(
        source.format, source.label, walk(source.tree), source.metadata, native, source.version
    )


# ---------------------------------------------------------------------------------------------
# what a target can hold
# ---------------------------------------------------------------------------------------------


@dataclass
class _Plan:
    target: str
    problems: list[str] = field(default_factory=list)

    def cannot(self, where: str, why: str) -> None:
        self.problems.append(f"{where or '<root>'}: {why}")


def _where(path: tuple[Any, ...]) -> str:
    return "/".join(str(c) for c in path)


def has_tensor(node: Any) -> bool:
    if isinstance(node, LazyTensor):
        return True
    if isinstance(node, Mapping):
        return any(has_tensor(v) for v in node.values())
    if isinstance(node, (list, tuple)):
        return any(has_tensor(v) for v in node)
    return False


def _describe(value: Any) -> str:
    if isinstance(value, (Mapping, list, tuple)):
        kind = "dict" if isinstance(value, Mapping) else type(value).__name__
        if has_tensor(value):
            return f"a {kind} holding tensors"
        return f"a {kind} of {len(value)} plain value(s)"
    text = repr(value)
    return (
        f"a plain value ({type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'})"
    )


# Fields of another format that hold only their default value lose nothing when left out: the
# target reads them back as that default (boostr's learning_rate 0.0, .shrew's best_loss inf).
_DEFAULTS: dict[str, dict[str, Any]] = {
    "shrew-v2": {"learning_rate": 0.0},
    "boostr": {"best_loss": math.inf, "loss_history": []},
}


def _without_defaults(tree: Any, target: str) -> Any:
    defaults = _DEFAULTS.get(target, {})
    if not isinstance(tree, Mapping) or not any(k in tree for k in defaults):
        return tree

    def default(k: Any, v: Any) -> bool:
        return (
            k in defaults
            and isinstance(v, (int, float, list))
            and not isinstance(v, bool)
            and v == defaults[k]
        )

    return {k: v for k, v in tree.items() if not default(k, v)}


def _tensors(
    node: Any,
    path: tuple[Any, ...],
    base: int,
    plan: _Plan,
    holds: str,
    dtype_ok: Callable[[LazyTensor], str | None] = lambda t: None,
) -> list[tuple[str, LazyTensor]]:
    """Every tensor under ``node`` named by its path below ``base`` components, ``/``-joined;
    plain values, unsupported dtypes and repeated names go to ``plan``."""
    out: list[tuple[str, LazyTensor]] = []
    names: set[str] = set()

    def walk(n: Any, p: tuple[Any, ...]) -> None:
        if isinstance(n, (Mapping, list, tuple)) and n and not has_tensor(n):
            plan.cannot(_where(p), f"{_describe(n)}; {holds}")
        elif isinstance(n, Mapping):
            for k, v in n.items():
                walk(v, (*p, k))
        elif isinstance(n, (list, tuple)):
            for i, v in enumerate(n):
                walk(v, (*p, i))
        elif isinstance(n, LazyTensor):
            name = _where(p[base:])
            why = dtype_ok(n)
            if not _utf8(name):
                plan.cannot(_where(p), "the name is not valid UTF-8 (it holds a lone surrogate)")
            elif why is not None:
                plan.cannot(_where(p), why)
            elif name in names:
                plan.cannot(_where(p), f"a second tensor named {name!r}; {holds} names are flat")
            else:
                names.add(name)
                out.append((name, n))
        else:
            plan.cannot(_where(p), f"{_describe(n)}; {holds}")

    walk(node, path)
    return out


def _utf8(name: str) -> bool:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _shrew_dtype(t: LazyTensor) -> str | None:
    if t.dtype.name in shrew.TAG_OF:
        return None
    return f"dtype {t.dtype.name}; .shrew holds only {', '.join(shrew.TAG_OF)}"


def _split(tree: Any, fields: tuple[str, ...]) -> tuple[Any, dict[str, Any], tuple[Any, ...]]:
    """(model subtree, training fields, path of the model subtree) of a tree."""
    if isinstance(tree, Mapping) and "model" in tree:
        return tree["model"], {k: v for k, v in tree.items() if k != "model"}, ("model",)
    if isinstance(tree, Mapping):
        model = {k: v for k, v in tree.items() if k not in fields}
        return model, {k: v for k, v in tree.items() if k in fields}, ()
    return tree, {}, ()


def _number(value: Any) -> Any:
    """A 0-d tensor's value as a Python number; anything else unchanged."""
    if isinstance(value, LazyTensor) and value.shape == ():
        return value.load()[()].item()
    return value


def _uint(value: Any) -> int | None:
    value = _number(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < _U64:
        return None
    return value


def _real(value: Any) -> float | None:
    value = _number(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    out = float(value)
    if isinstance(value, int) and int(out) != value:
        return None
    return out


def _step(fields: dict[str, Any], plan: _Plan, name: str) -> int:
    if "step" in fields and "global_step" in fields:
        plan.cannot("step", "both step and global_step are present; the target has one step field")
    value = fields.get("global_step", fields.get("step", 0))
    step = _uint(value)
    if step is None:
        plan.cannot(name, f"{_describe(value)} is not an integer in [0, 2**64)")
        return 0
    return step


def _extra(fields: dict[str, Any], known: tuple[str, ...], plan: _Plan, holds: str) -> None:
    for key, value in fields.items():
        if key not in known:
            plan.cannot(str(key), f"{_describe(value)}; {holds}")


def _metadata_strings(metadata: dict[str, Any], plan: _Plan, label: str) -> dict[str, str]:
    out = {}
    for key, value in metadata.items():
        if isinstance(value, str):
            out[key] = value
        else:
            plan.cannot(f"metadata/{key}", f"{_describe(value)}; {label} metadata maps str to str")
    return out


class _AsFloat64(_files.Materialized):
    """An exact float64 copy of a narrower floating tensor, flattened; made on first copy."""

    def __init__(self, inner: LazyTensor) -> None:
        super().__init__(_F64, (math.prod(inner.shape),))
        self._inner = inner

    def make(self) -> np.ndarray[Any, Any]:
        out: np.ndarray[Any, Any] = self._inner.load().astype(np.float64).reshape(-1)
        return out.view(np.uint8)


def _optimizer_section(node: Any, plan: _Plan) -> shrew.OptimizerSection | None:
    if node is None:
        return None
    ok = (
        isinstance(node, Mapping)
        and set(node) <= set(_OPTIMIZER_KEYS)
        and isinstance(node.get("optimizer_type"), str)
        and bool(node["optimizer_type"])
        and isinstance(node.get("scalars", {}), Mapping)
        and isinstance(node.get("buffers", {}), Mapping)
    )
    if not ok:
        found = ", ".join(map(str, node)) if isinstance(node, Mapping) else type(node).__name__
        plan.cannot(
            "optimizer",
            f"not an sp.OptimizerState (found {found}); .shrew v2 holds an optimizer type, float64 "
            "scalars and float64 buffers (for a torch optimizer, save "
            "sp.optimizer_state_from_torch(opt) instead of the optimizer)",
        )
        return None
    scalars: list[tuple[str, float]] = []
    for key, value in node.get("scalars", {}).items():
        number = _real(value)
        if not isinstance(key, str) or not key or number is None:
            plan.cannot(f"optimizer/scalars/{key}", f"{_describe(value)} is not a real scalar")
        else:
            scalars.append((key, number))
    buffers: list[tuple[str, TensorSource]] = []
    for key, value in node.get("buffers", {}).items():
        where = f"optimizer/buffers/{key}"
        if not isinstance(key, str) or not key or not isinstance(value, LazyTensor):
            plan.cannot(where, f"{_describe(value)} is not a buffer (a float tensor)")
        elif value.dtype.name == "F64":
            buffers.append((key, value))
        elif value.dtype.name in ("F32", "F16", "BF16"):
            buffers.append((key, _AsFloat64(value)))  # exact: float64 holds every such value
        else:
            plan.cannot(where, f"dtype {value.dtype.name}; optimizer buffers are float64")
    return shrew.OptimizerSection(node["optimizer_type"], sorted(scalars), sorted(buffers))


# ---------------------------------------------------------------------------------------------
# writers
# ---------------------------------------------------------------------------------------------


def encode(root: Any) -> tree_mod.Flat:
    """A Flat for save_flat from a tree of containers, plain values and lazy tensors."""
    flat = tree_mod.Flat(tree={})
    refs: dict[int, str] = {}

    def walk(obj: Any, path: tuple[tree_mod.Key, ...]) -> tree_mod.Node:
        if isinstance(obj, LazyTensor):
            ref = refs.get(id(obj))
            if ref is None:
                ref = name = tree_mod.join(path)
                n = 2
                while ref in flat.tensors or ref == "__metadata__":
                    ref, n = f"{name}~{n}", n + 1
                flat.tensors[ref] = obj
                refs[id(obj)] = ref
            return {"t": "tensor", "ref": ref, "kind": obj.kind}
        if obj is None or isinstance(obj, (bool, str)):
            return {"t": "value", "v": obj}
        if isinstance(obj, int):
            return {"t": "value", "v": int(obj)}
        if isinstance(obj, float):
            return (
                {"t": "value", "v": obj} if math.isfinite(obj) else {"t": "float", "v": repr(obj)}
            )
        if isinstance(obj, Mapping):
            return {"t": "dict", "items": [[k, walk(v, (*path, k))] for k, v in obj.items()]}
        if isinstance(obj, (list, tuple)):
            kind = "list" if isinstance(obj, list) else "tuple"
            return {"t": kind, "items": [walk(v, (*path, i)) for i, v in enumerate(obj)]}
        # Every reader here produces only the types above; bytes and the rest never reach this.
        raise UnsupportedStateError(f"{tree_mod.join(path)}: cannot store {type(obj).__name__}")

    flat.tree = walk(root, ())
    return flat


def _sizes(sources: Iterable[TensorSource]) -> tuple[int, int]:
    items = list(sources)
    return len(items), sum(s.nbytes for s in items)


def _write_savepoint(src: _Source, dst: PathArg, plan: _Plan) -> Callable[[], tuple[int, int]]:
    if src.native is not None:
        node, refs = src.native
        flat = tree_mod.Flat(tree=node, tensors=dict(refs))
    else:
        flat = encode(src.tree)
    metadata = json.loads(json.dumps(src.metadata, allow_nan=False))

    def write() -> tuple[int, int]:
        checkpoint.save_flat(dst, flat, metadata)
        return _sizes(flat.tensors.values())

    return write


def _write_flat(src: _Source, dst: str, plan: _Plan, target: str) -> Callable[[], tuple[int, int]]:
    if target == "shrew-v1":
        items = _tensors(src.tree, (), 0, plan, ".shrew v1 holds named tensors only", _shrew_dtype)
        if src.metadata:
            plan.cannot("metadata", f"{', '.join(map(str, src.metadata))}; .shrew has no metadata")

        def write_shrew() -> tuple[int, int]:
            shrew.save_tensors(dst, items)
            return _sizes(t for _, t in items)

        return write_shrew
    items = _tensors(src.tree, (), 0, plan, "a safetensors file holds named tensors only")
    for name, _ in items:
        if name == "__metadata__":
            plan.cannot(name, "the name is reserved in safetensors headers")
    items = [(n, t) for n, t in items if n != "__metadata__"]
    metadata = _metadata_strings(src.metadata, plan, "safetensors")

    def write_st() -> tuple[int, int]:
        with _files.atomic_file(dst) as tmp:
            _files.write_safetensors(tmp, items, metadata)
        return _sizes(t for _, t in items)

    return write_st


def _burn_dtype(t: LazyTensor) -> str | None:
    if t.dtype.name in burn.DTYPES:
        return None
    return f"dtype {t.dtype.name}; burn holds only {', '.join(burn.DTYPES)}"


def _write_burn(src: _Source, dst: str, plan: _Plan) -> Callable[[], tuple[int, int]]:
    holds = "a burn record holds a module's tensors only"
    node, _, base = _split(src.tree, ())
    items = [
        (name.replace("/", "."), t)
        for name, t in _tensors(node, base, len(base), plan, holds, _burn_dtype)
    ]
    if isinstance(src.tree, Mapping) and "model" in src.tree:
        for key, value in src.tree.items():
            if key != "model":
                what = "a tensor" if isinstance(value, LazyTensor) else _describe(value)
                plan.cannot(str(key), f"{what} outside 'model'; {holds}")
    seen: set[str] = set()
    for name, _ in items:
        if name in seen:
            plan.cannot(name, "a second tensor with this dotted name ('/' becomes '.')")
        seen.add(name)
    try:
        tree = burn.unflatten(dict(items))
    except UnsupportedStateError as exc:
        plan.cannot(exc.key or "<names>", exc.message)
        items, tree = [], {}
    fields = ("float", "int", "format", "version", "settings")
    metadata = None
    if set(src.metadata) == set(fields) and all(isinstance(v, str) for v in src.metadata.values()):
        metadata = burn.Metadata(*(src.metadata[f] for f in fields))
    elif src.metadata:
        plan.cannot(
            "metadata",
            f"{', '.join(map(str, src.metadata))}; a burn record's metadata is burn's own "
            f"({', '.join(fields)})",
        )

    def write() -> tuple[int, int]:
        burn.write_record(dst, tree, metadata=metadata)  # atomic: temporary sibling, rename
        return _sizes(t for _, t in items)

    return write


def _write_shrew_v2(src: _Source, dst: str, plan: _Plan) -> Callable[[], tuple[int, int]]:
    holds = (
        ".shrew v2 holds a model of tensors, an optimizer state, epoch, global_step, best_loss "
        "and loss_history"
    )
    model_node, fields, base = _split(_without_defaults(src.tree, "shrew-v2"), _V2_FIELDS)
    model = _tensors(model_node, base, len(base), plan, holds, _shrew_dtype)
    _extra(fields, _V2_FIELDS, plan, holds)
    optimizer = _optimizer_section(fields.get("optimizer"), plan)
    epoch = _uint(fields.get("epoch", 0))
    if epoch is None:
        plan.cannot("epoch", f"{_describe(fields['epoch'])} is not an integer in [0, 2**64)")
    step = _step(fields, plan, "global_step")
    best = _real(fields.get("best_loss", math.inf))
    if best is None:
        plan.cannot("best_loss", f"{_describe(fields['best_loss'])} is not a real number")
    raw_history = fields.get("loss_history", [])
    if isinstance(raw_history, LazyTensor) and raw_history.dtype.name in (
        "F64",
        "F32",
        "F16",
        "BF16",
    ):
        raw_history = raw_history.load().reshape(-1).astype(np.float64).tolist()
    history = [_real(v) for v in raw_history] if isinstance(raw_history, (list, tuple)) else None
    if history is None or any(v is None for v in history):
        plan.cannot("loss_history", "not a list of real numbers")
        history = []
    if src.metadata:
        plan.cannot("metadata", f"{', '.join(map(str, src.metadata))}; .shrew has no metadata")

    def write() -> tuple[int, int]:
        shrew.save_parts(
            dst,
            model,
            optimizer,
            epoch=epoch or 0,
            global_step=step,
            best_loss=math.inf if best is None else best,
            loss_history=[v for v in history if v is not None],
        )
        buffers = optimizer.buffers if optimizer is not None else []
        return _sizes([t for _, t in model] + [t for _, t in buffers])

    return write


def _write_boostr(src: _Source, dst: str, plan: _Plan) -> Callable[[], tuple[int, int]]:
    holds = "a boostr checkpoint holds model and optimizer tensors, step, epoch and learning_rate"
    model_node, fields, base = _split(_without_defaults(src.tree, "boostr"), _BOOSTR_FIELDS)
    model = _tensors(model_node, base, len(base), plan, holds)
    _extra(fields, _BOOSTR_FIELDS, plan, holds)
    opt_node = fields.get("optimizer")
    optimizer = (
        None
        if opt_node is None
        else _tensors(
            opt_node, ("optimizer",), 1, plan, "boostr's optimizer.safetensors holds tensors only"
        )
    )
    for kind, items in (("model", model), ("optimizer", optimizer or [])):
        for name, _ in items:
            if name == "__metadata__":
                plan.cannot(f"{kind}/{name}", "the name is reserved in safetensors headers")
    model = [(n, t) for n, t in model if n != "__metadata__"]
    if optimizer is not None:
        optimizer = [(n, t) for n, t in optimizer if n != "__metadata__"]
    epoch = _uint(fields.get("epoch", 0))
    if epoch is None:
        plan.cannot("epoch", f"{_describe(fields['epoch'])} is not an integer in [0, 2**64)")
    step = _step(fields, plan, "step")
    lr = _real(fields.get("learning_rate", 0.0))
    if lr is None or not math.isfinite(lr):
        plan.cannot("learning_rate", "not a finite real number")
        lr = 0.0
    state = boostr.TrainingState(
        step=step,
        epoch=epoch or 0,
        learning_rate=lr,
        metadata=_metadata_strings(src.metadata, plan, "boostr"),
    )

    def write() -> tuple[int, int]:
        boostr.write(dst, model, optimizer, state)
        return _sizes(t for _, t in [*model, *(optimizer or [])])

    return write


# ---------------------------------------------------------------------------------------------
# convert
# ---------------------------------------------------------------------------------------------


def _is_training(tree: Any) -> bool:
    return isinstance(tree, Mapping) and any(k in tree for k in ("model", *_V2_FIELDS))


def _by_name(dst: str) -> str | None:
    """The format a target's name asks for (``*.shrew``, ``*.safetensors``, ``*.mpk``), if any."""
    lower = dst.lower()
    if lower.endswith(".shrew"):
        return "shrew"
    if lower.endswith(".safetensors"):
        return "safetensors"
    if lower.endswith("." + burn.EXTENSION):
        return "burn"
    return None


def _target(dst: str, fmt: str | None, src: _Source) -> str:
    if fmt is None and dst.lower().endswith((".pt", ".pth")):
        raise IncompatibleCheckpointError(
            f"{dst}: savepoint reads PyTorch files but never writes pickles; write a "
            ".safetensors file (`savepoint export` for a model's weights) or a savepoint "
            "checkpoint (format='savepoint', `--format savepoint`)",
            path=dst,
        )
    if fmt is None:
        fmt = _by_name(dst)
        if fmt is None:
            try:
                found = detect(dst) if os.path.lexists(dst) else "savepoint"
            except CheckpointError:
                found = "savepoint"
            fmt = found if found in ("boostr", "savepoint") else "savepoint"
    if fmt == "shrew":
        fmt = "shrew-v2" if _is_training(src.tree) else "shrew-v1"
    return fmt


def _check_store_target(
    source: Location, target: Location, format: str | None, overwrite: bool
) -> None:
    """A target off the local disk (``memory://``, an object store) takes savepoint's own
    format only, and is not the source, and exists only with ``overwrite``."""
    wanted = format or _by_name(target.path)
    if wanted not in (None, "savepoint"):
        raise UnsupportedStorageError(
            f"target {target}: {_LABELS.get(wanted, wanted)} is written to local paths only; "
            "savepoint's own format is written on every store",
            path=str(target),
            scheme=target.store.scheme,
        )
    if target.store is source.store and target.path == source.path:
        raise CheckpointWriteError(
            f"{target} is the source itself; convert into another path", path=str(target)
        )
    if target.store.stat(target.path) is not None and not overwrite:
        raise CheckpointWriteError(
            f"{target} already exists; pass overwrite=True (savepoint convert --overwrite) to "
            "replace it",
            path=str(target),
        )


def convert(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    format: str | None = None,
    lossy: bool = False,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> ConversionReport:
    """Convert the checkpoint at ``src`` (any format savepoint reads, detected from the path and
    its content) into ``dst``.

    The target format is ``format`` (one of :data:`TARGETS`; ``"shrew"`` picks v2 for a training
    state, with a ``model`` or training fields, and v1 otherwise) or, by default, from ``dst``:
    ``*.shrew``, ``*.safetensors``, ``*.mpk`` (a burn record), an existing boostr directory, else
    savepoint's format.

    Raises ConversionError listing everything the target cannot hold (nothing is written) unless
    ``lossy``, which leaves those parts out and lists them in the report. ``dst`` must not exist
    unless ``overwrite``; then it is replaced atomically (only by the same kind: a file by a
    file, a checkpoint directory by a checkpoint directory).

    ``progress(done, total)`` is called in bytes as tensors are copied.
    """
    if format is not None and format not in TARGETS:
        raise ValueError(f"unknown target format {format!r}; choose one of {', '.join(TARGETS)}")
    src_loc, dst_loc = resolve_path(src, what="source"), resolve_path(dst, what="target")
    # savepoint's own format works on every store; the others are local files.
    kind = detect(src_loc.path) if src_loc.is_local else "savepoint"
    if dst_loc.is_local:
        check_local_target(src_loc, dst_loc.path, overwrite)
    else:
        _check_store_target(src_loc, dst_loc, format, overwrite)
    start = time.perf_counter()
    with open_source(src_loc, kind) as source:
        if progress is not None:
            source = counting(source, progress)
        target = "savepoint" if not dst_loc.is_local else _target(dst_loc.path, format, source)
        plan = _Plan(target)
        if target == "savepoint":
            write = _write_savepoint(source, dst_loc, plan)
        elif target in ("shrew-v1", "safetensors"):
            write = _write_flat(source, dst_loc.path, plan, target)
        elif target == "shrew-v2":
            write = _write_shrew_v2(source, dst_loc.path, plan)
        elif target == "burn":
            write = _write_burn(source, dst_loc.path, plan)
        elif target in WRITERS:
            write = WRITERS[target](source, dst_loc.path, plan)
        else:
            write = _write_boostr(source, dst_loc.path, plan)
        if plan.problems and not lossy:
            raise ConversionError(target, plan.problems, label=_LABELS.get(target, target))
        count, total = write()
        label, version = source.label, source.version
    log.info(
        "converted %s (%s) -> %s (%s): %d tensors, %d bytes in %.2f s%s",
        src_loc,
        label,
        dst_loc,
        target,
        count,
        total,
        time.perf_counter() - start,
        f"; left out {len(plan.problems)} part(s)" if plan.problems else "",
    )
    return ConversionReport(
        source=str(src_loc),
        destination=str(dst_loc),
        source_format=label,
        destination_format=target,
        tensors=count,
        bytes=total,
        dropped=tuple(plan.problems),
        source_kind=kind,
        source_version=version,
    )
