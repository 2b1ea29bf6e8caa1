"""Exporting a checkpoint as one Hugging Face-style safetensors file: the model's weights under
dotted names, which ``safetensors.torch.load_file`` / ``load_model`` and ``transformers``'
``from_pretrained`` read directly.

What goes in:

- The tensors of one subtree (``subtree``; by default ``"model"`` when the root holds a
  ``"model"`` entry with tensors in it, as a training state does, else the whole tree), each
  named by its path below that subtree joined with ``sep`` (``"."``): ``{"model": {"encoder":
  {"layers": [{"w": t}]}}}`` gives ``"encoder.layers.0.w"``. A torch ``state_dict()`` saved as
  it is already has dotted keys, which stay as they are.
- Tied weights (leaves that share one stored tensor, as ``sp.save`` records them for tied
  parameters) are stored once, under the first name in the checkpoint's order (the state
  dict's), and the other names are left out, as ``transformers``' ``save_pretrained`` does:
  ``from_pretrained`` and ``safetensors.torch.load_model`` re-tie them from the model. Nothing in
  the file records the tie (:attr:`ExportReport.tied` lists it). ``duplicate_tied=True`` stores
  a copy under every name instead, for loaders that do not re-tie (``load_state_dict(strict=
  True)`` of the plain dict).
- ``__metadata__``: ``{"format": "pt"}`` (which ``transformers`` requires), then the
  checkpoint's metadata: string values as they are, any other value JSON-encoded when that
  takes at most :data:`MAX_METADATA_VALUE` characters (a run checkpoint's ``savepoint_run``:
  its step and metrics), else left out.

What is left out by design, and listed in :attr:`ExportReport.dropped` (never an error): every
plain value (a step counter, a config string), every tensor outside the subtree (the optimizer),
metadata values too large, and a metadata ``format`` other than ``"pt"``. So a run's checkpoint
exports without ``--lossy``; ``convert`` stays the lossless, all-or-nothing path.

Refused (:class:`~savepoint.errors.ConversionError`, nothing written): two tensors whose names
collide once joined, the reserved name ``__metadata__``, a name that is not valid UTF-8, a
subtree that is not there or holds no tensor.

A checkpoint written through ``torch.distributed.checkpoint`` with savepoint's
``SavepointWriter`` stores DCP's flat names (``app.model.0.weight``); the export reads it as the
nested state DCP flattened (DCP's own ``planner_data`` mapping, kept in the manifest), so
``subtree="app/model"`` names the model's part and its tensors are named as in the model's
``state_dict`` (``0.weight``). The values DCP serialised itself with ``torch.save`` (every
non-tensor entry: step counters, an optimizer's ``param_groups``) are pickles, never exported,
and listed.

Without ``subtree`` and without a ``"model"`` entry, the whole tree is exported except the
parts shaped like a torch optimizer's state dict (a node holding both ``state`` and
``param_groups``): they are listed as left out. Name a subtree to export one of them anyway.

The source is any checkpoint savepoint reads (savepoint's own on any store, other formats from
local files); the file is written atomically (temporary sibling, fsync, rename), one tensor at a
time, and must not exist unless ``overwrite``.

``hf=True`` writes a Hugging Face model directory at ``dst`` instead, the layout
``save_pretrained`` writes and ``from_pretrained`` reads (:mod:`savepoint.formats.huggingface`):
the same tensors under the same names, split in order into shards of at most ``max_shard_size``
bytes (default 5GB; a larger tensor alone in its shard), ``model.safetensors`` alone when
everything fits in one, else ``model-0000i-of-0000n.safetensors`` and
``model.safetensors.index.json``; the same ``__metadata__`` in every shard; and ``config.json``
when ``config`` names one (a path, copied as it is, or a mapping) or, without it, when the
checkpoint records a model config (``metadata["transformers"]["config"]``, as
``SavepointTrainer`` writes). The directory is built under a hidden sibling name (every file
fsynced) and renamed into place in one step: an export that fails leaves nothing. It must not
exist unless ``overwrite``, which replaces only an empty directory or a Hugging Face model
directory, whole. Memory: tensors are streamed one at a time through two staging buffers made
for the export (at most half the largest tensor each, within 1 and 32 MiB), checked against the
source's checksums as they are read; extra memory is at most twice the largest tensor plus
2 MiB (``tests/formats/test_huggingface.py`` measures it).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from savepoint.errors import ConversionError
from savepoint.formats import _files, _hf_write, huggingface
from savepoint.formats import convert as _convert
from savepoint.formats._files import LazyTensor
from savepoint.formats._progress import Counted, Progress, Tally
from savepoint.formats.detect import detect
from savepoint.storage.paths import PathArg, local_path
from savepoint.storage.paths import resolve as resolve_path

__all__ = ["DEFAULT_MAX_SHARD_SIZE", "ExportReport", "MAX_METADATA_VALUE", "export"]

log = logging.getLogger(__name__)

MAX_METADATA_VALUE = 1024  # characters of a JSON-encoded metadata value kept in __metadata__
DEFAULT_MAX_SHARD_SIZE = "5GB"  # huggingface_hub's (save_pretrained's in transformers 5: 50GB)
_LABEL = "a Hugging Face safetensors file"
_HINT = (
    "export writes the tensors of one subtree under names joined with --sep: choose --subtree "
    "among the keys listed (savepoint inspect CKPT shows the whole tree) or another --sep."
)


@dataclass(frozen=True)
class ExportReport:
    """What :func:`export` wrote: the source (its format and version), the subtree exported
    (``""``: the whole tree), the tensors stored and their bytes, the names left out as tied to
    a stored one (``{left out: stored}``), what was left out by design (each with why), the
    ``__metadata__`` written (in every shard), the files written (their names; with ``hf``: in
    the directory ``destination``, shards first), where ``config.json`` came from (``""``: none
    written; a path, ``"config="`` or ``"metadata['transformers']['config']"``), and the shard
    size limit in bytes (None without ``hf``)."""

    source: str
    destination: str
    source_format: str
    source_version: int | None
    subtree: str
    tensors: int
    bytes: int
    tied: dict[str, str] = field(default_factory=dict)
    dropped: tuple[str, ...] = ()
    metadata: dict[str, str] = field(default_factory=dict)
    files: tuple[str, ...] = ()
    config: str = ""
    max_shard_size: int | None = None


def _find(tree: Any, subtree: str) -> tuple[Any, tuple[Any, ...]]:
    """The node at ``subtree`` ("/"-separated keys; list indices as numbers) and its path."""
    node: Any = tree
    path: tuple[Any, ...] = ()
    for part in [p for p in subtree.split("/") if p]:
        if isinstance(node, Mapping):
            key: Any = part
            if key not in node and part.lstrip("-").isdigit() and int(part) in node:
                key = int(part)
            if key not in node:
                shown = ", ".join(map(str, list(node)[:20])) or "nothing"
                where = "/".join(map(str, path)) or "the root"
                raise ConversionError(
                    "safetensors",
                    [f"{subtree}: no {part!r} under {where} (it holds {shown})"],
                    label=_LABEL,
                    hint=_HINT,
                )
            node, path = node[key], (*path, key)
        elif isinstance(node, (list, tuple)) and part.isdigit() and int(part) < len(node):
            node, path = node[int(part)], (*path, int(part))
        else:
            raise ConversionError(
                "safetensors", [f"{subtree}: {part!r} is not a key there"], label=_LABEL, hint=_HINT
            )
    return node, path


def _utf8(name: str) -> bool:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


@dataclass(frozen=True)
class _Pickled:
    """A value DCP serialised with ``torch.save``: never exported."""

    name: str


def _dcp_view(tree: Any, metadata: Mapping[str, Any]) -> Any:
    """A checkpoint of savepoint's DCP writer (flat names) as the nested state DCP flattened,
    the values DCP pickled as :class:`_Pickled` leaves; any other tree as it is."""
    dcp = metadata.get("dcp")
    if not isinstance(dcp, Mapping) or not isinstance(tree, Mapping) or dcp.get("version") != 1:
        return tree
    opaque = set(dcp.get("bytes") or ())
    paths = dcp.get("planner_data")
    nested: dict[Any, Any] = {}
    for name, value in tree.items():
        leaf = _Pickled(str(name)) if name in opaque else value
        path = paths.get(name) if isinstance(paths, Mapping) else None
        if not isinstance(path, list) or not path:
            path = str(name).split(".")
        node = nested
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):  # a leaf where DCP also has a subtree: keep flat
                node = nested
                path = [name]
                break
            node = child
        if path[-1] in node:
            node = nested
            path = [name]
        node[path[-1]] = leaf
    return nested


def _optimizer_like(node: Any) -> bool:
    return isinstance(node, Mapping) and "state" in node and "param_groups" in node


def _default_subtree(tree: Any) -> str:
    if isinstance(tree, Mapping) and "model" in tree and _convert.has_tensor(tree["model"]):
        return "model"
    return ""


def _metadata(source: Mapping[str, Any], dropped: list[str]) -> dict[str, str]:
    out = {"format": "pt"}
    for key, value in source.items():
        where = f"metadata/{key}"
        if key == "format":
            if value != "pt":
                dropped.append(f"{where}: {value!r}; transformers needs format 'pt' here")
            continue
        if isinstance(value, str):
            out[str(key)] = value
            continue
        try:
            text = json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError):
            dropped.append(f"{where}: not JSON")
            continue
        if len(text) > MAX_METADATA_VALUE:
            dropped.append(
                f"{where}: {len(text)} characters as JSON; __metadata__ keeps values of at most "
                f"{MAX_METADATA_VALUE}"
            )
        else:
            out[str(key)] = text
    return out


class _Selection:
    """One walk of the exported subtree: the tensors to write (``items``, in the checkpoint's
    order), the tied names left out, what is dropped by design, and the problems that refuse
    the export."""

    def __init__(self, base: tuple[Any, ...], sep: str, duplicate_tied: bool, skip: bool) -> None:
        self.base = base
        self.sep = sep
        self.duplicate_tied = duplicate_tied
        self.skip_optimizers = skip
        self.problems: list[str] = []
        self.dropped: list[str] = []
        self.items: list[tuple[str, LazyTensor]] = []
        self.tied: dict[str, str] = {}
        self._stored: dict[int, str] = {}  # id of a stored tensor -> its name
        self._names: dict[str, str] = {}  # name -> the path that has it

    def tensor(self, n: LazyTensor, path: tuple[Any, ...], where: str) -> None:
        name = self.sep.join(str(c) for c in path[len(self.base) :])
        if not name:
            self.problems.append(f"{where}: a tensor at the root of the export has no name")
        elif not _utf8(name):
            self.problems.append(f"{where}: the name is not valid UTF-8")
        elif name == "__metadata__":
            self.problems.append(f"{where}: the name is reserved in safetensors headers")
        elif name in self._names:
            self.problems.append(
                f"{where}: its name {name!r} is also that of {self._names[name]} (with "
                f"{self.sep!r} joining the keys); choose another --sep"
            )
        else:
            self._names[name] = where
            owner = self._stored.get(id(n))
            if owner is not None and not self.duplicate_tied:
                self.tied[name] = owner
                return
            self._stored.setdefault(id(n), name)
            self.items.append((name, n))

    def walk(self, n: Any, path: tuple[Any, ...]) -> None:
        where = "/".join(map(str, path)) or "<root>"
        if isinstance(n, LazyTensor):
            self.tensor(n, path, where)
        elif isinstance(n, _Pickled):
            self.dropped.append(
                f"{where}: a value DCP serialised with torch.save (a pickle), not a tensor"
            )
        elif self.skip_optimizers and path and _optimizer_like(n):
            self.dropped.append(
                f"{where}: an optimizer's state (state and param_groups); name it with "
                "--subtree to export it"
            )
        elif isinstance(n, Mapping):
            for k, v in n.items():
                self.walk(v, (*path, k))
        elif isinstance(n, (list, tuple)) and n:
            for i, v in enumerate(n):
                self.walk(v, (*path, i))
        else:
            text = repr(n)
            text = text if len(text) <= 40 else text[:37] + "..."
            self.dropped.append(f"{where}: a plain value ({text}); the file holds tensors only")


def _select(
    tree: Any, subtree: str | None, sep: str, duplicate_tied: bool
) -> tuple[str, _Selection]:
    """The subtree exported and its selection; ConversionError for what refuses the export."""
    chosen = _default_subtree(tree) if subtree is None else subtree.strip("/")
    node, base = _find(tree, chosen)
    selection = _Selection(base, sep, duplicate_tied, skip=subtree is None and not chosen)
    selection.walk(node, base)
    if isinstance(tree, Mapping) and base:
        for key, value in tree.items():
            if key != base[0]:
                what = "tensors" if _convert.has_tensor(value) else "plain values"
                selection.dropped.append(f"{key}: {what} outside the exported subtree {chosen!r}")
    if not selection.items and not selection.problems:
        selection.problems.append(f"{chosen or '<root>'}: holds no tensor")
    if selection.problems:
        raise ConversionError("safetensors", selection.problems, label=_LABEL, hint=_HINT)
    return chosen, selection


def _check_options(sep: str, hf: bool, max_shard_size: int | str | None, config: Any) -> int:
    """The shard size limit in bytes (0 without ``hf``); ValueError for options that do not go
    together."""
    if not isinstance(sep, str) or not sep:
        raise ValueError(f"sep must be a non-empty string, not {sep!r}")
    if not hf:
        if max_shard_size is not None or config is not None:
            raise ValueError("max_shard_size and config go with hf=True (a directory of shards)")
        return 0
    return huggingface.parse_size(
        DEFAULT_MAX_SHARD_SIZE if max_shard_size is None else max_shard_size
    )


def export(
    src: PathArg,
    dst: str | os.PathLike[str],
    *,
    subtree: str | None = None,
    sep: str = ".",
    overwrite: bool = False,
    duplicate_tied: bool = False,
    progress: Progress | None = None,
    hf: bool = False,
    max_shard_size: int | str | None = None,
    config: str | os.PathLike[str] | Mapping[str, Any] | None = None,
) -> ExportReport:
    """Write the tensors of the checkpoint at ``src`` (any format savepoint reads) as one Hugging
    Face-style safetensors file at ``dst`` (a local path), or with ``hf=True`` as a Hugging Face
    model directory ``dst`` of shards and an index: see the module docstring.

    ``subtree``: the "/"-separated path of the part to export ("" for the whole tree; default
    ``"model"`` when there is one, else the whole tree). ``sep`` joins the components of each
    tensor's path below it. ``progress(done, total)`` is called in bytes as tensors are copied.
    With ``hf``: ``max_shard_size`` (bytes, or ``"5GB"``, ``"500MB"``, ``"2GiB"``; default
    5GB) and ``config`` (a path to a ``config.json`` or a mapping; default: the model config a
    ``SavepointTrainer`` checkpoint records, if any).
    Raises ConversionError (nothing written) for what the file cannot hold (module docstring).
    """
    limit = _check_options(sep, hf, max_shard_size, config)
    start = time.perf_counter()
    src_loc = resolve_path(src, what="source")
    target = os.path.abspath(local_path(dst, what="export target"))
    kind = detect(src_loc.path) if src_loc.is_local else "savepoint"
    if hf:
        _hf_write.check_target(src_loc, target, overwrite)
    else:
        _convert.check_local_target(src_loc, target, overwrite, verb="export", directories=False)
    with _convert.open_source(src_loc, kind) as source:
        chosen, selection = _select(
            _dcp_view(source.tree, source.metadata), subtree, sep, duplicate_tied
        )
        dropped, items = selection.dropped, selection.items
        metadata = _metadata(source.metadata, dropped)
        written = _counted(items, progress)
        if hf:
            config_data, config_from = _hf_write.config_bytes(config, source.metadata)
            files = _hf_write.write_directory(
                target, written, metadata, max_shard_size=limit, config=config_data
            )
        else:
            config_from, files = "", (os.path.basename(target),)
            with _files.atomic_file(target) as tmp:
                _files.write_safetensors(tmp, written, metadata)
        report = ExportReport(
            source=str(src_loc),
            destination=target,
            source_format=kind,
            source_version=source.version,
            subtree=chosen,
            tensors=len(items),
            bytes=sum(t.nbytes for _, t in items),
            tied=selection.tied,
            dropped=tuple(dropped),
            metadata=metadata,
            files=files,
            config=config_from,
            max_shard_size=limit or None,
        )
    log.info(
        "exported %s (%s) -> %s: %d tensors, %d bytes in %d file(s), %d tied name(s) left out, "
        "%d part(s) dropped, in %.2f s",
        *(report.source, chosen or "<root>", target, report.tensors, report.bytes, len(files)),
        *(len(report.tied), len(dropped), time.perf_counter() - start),
    )
    return report


def _counted(
    items: list[tuple[str, LazyTensor]], progress: Progress | None
) -> list[tuple[str, LazyTensor]]:
    """``items``, each tensor counting the bytes copied out of it to ``progress``."""
    if progress is None:
        return items
    tally = Tally.over(progress, (t for _, t in items))
    return [(name, Counted(t, tally)) for name, t in items]
