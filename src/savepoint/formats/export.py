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
from savepoint.formats import _files
from savepoint.formats import convert as _convert
from savepoint.formats._files import LazyTensor
from savepoint.formats._progress import Counted, Progress, Tally
from savepoint.formats.detect import detect
from savepoint.storage.paths import PathArg, local_path
from savepoint.storage.paths import resolve as resolve_path

__all__ = ["ExportReport", "MAX_METADATA_VALUE", "export"]

log = logging.getLogger(__name__)

MAX_METADATA_VALUE = 1024  # characters of a JSON-encoded metadata value kept in __metadata__
_LABEL = "a Hugging Face safetensors file"
_HINT = (
    "export writes the tensors of one subtree under names joined with --sep: choose --subtree "
    "among the keys listed (savepoint inspect CKPT shows the whole tree) or another --sep."
)


@dataclass(frozen=True)
class ExportReport:
    """What :func:`export` wrote: the source (its format and version), the subtree exported
    (``""``: the whole tree), the tensors stored and their bytes, the names left out as tied to
    a stored one (``{left out: stored}``), what was left out by design (each with why), and the
    ``__metadata__`` written."""

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


def export(
    src: PathArg,
    dst: str | os.PathLike[str],
    *,
    subtree: str | None = None,
    sep: str = ".",
    overwrite: bool = False,
    duplicate_tied: bool = False,
    progress: Progress | None = None,
) -> ExportReport:
    """Write the tensors of the checkpoint at ``src`` (any format savepoint reads) as one Hugging
    Face-style safetensors file at ``dst`` (a local path): see the module docstring.

    ``subtree``: the "/"-separated path of the part to export ("" for the whole tree; default
    ``"model"`` when there is one, else the whole tree). ``sep`` joins the components of each
    tensor's path below it. ``progress(done, total)`` is called in bytes as tensors are copied.
    Raises ConversionError (nothing written) for what the file cannot hold (module docstring).
    """
    if not isinstance(sep, str) or not sep:
        raise ValueError(f"sep must be a non-empty string, not {sep!r}")
    start = time.perf_counter()
    src_loc = resolve_path(src, what="source")
    target = os.path.abspath(local_path(dst, what="export target"))
    kind = detect(src_loc.path) if src_loc.is_local else "savepoint"
    _convert.check_local_target(src_loc, target, overwrite, verb="export", directories=False)
    with _convert.open_source(src_loc, kind) as source:
        dropped: list[str] = []
        tree = _dcp_view(source.tree, source.metadata)
        chosen = _default_subtree(tree) if subtree is None else subtree.strip("/")
        node, base = _find(tree, chosen)
        skip_optimizers = subtree is None and not chosen
        problems: list[str] = []
        items: list[tuple[str, LazyTensor]] = []
        stored: dict[int, str] = {}  # id of a stored tensor -> its name
        names: dict[str, str] = {}  # name -> the path that has it
        tied: dict[str, str] = {}

        def walk(n: Any, path: tuple[Any, ...]) -> None:
            where = "/".join(map(str, path)) or "<root>"
            if isinstance(n, LazyTensor):
                name = sep.join(str(c) for c in path[len(base) :])
                if not name:
                    problems.append(f"{where}: a tensor at the root of the export has no name")
                    return
                if not _utf8(name):
                    problems.append(f"{where}: the name is not valid UTF-8")
                    return
                if name == "__metadata__":
                    problems.append(f"{where}: the name is reserved in safetensors headers")
                    return
                if name in names:
                    problems.append(
                        f"{where}: its name {name!r} is also that of {names[name]} (with "
                        f"{sep!r} joining the keys); choose another --sep"
                    )
                    return
                names[name] = where
                owner = stored.get(id(n))
                if owner is not None and not duplicate_tied:
                    tied[name] = owner
                    return
                stored.setdefault(id(n), name)
                items.append((name, n))
            elif isinstance(n, _Pickled):
                dropped.append(
                    f"{where}: a value DCP serialised with torch.save (a pickle), not a tensor"
                )
            elif skip_optimizers and path and _optimizer_like(n):
                dropped.append(
                    f"{where}: an optimizer's state (state and param_groups); name it with "
                    "--subtree to export it"
                )
            elif isinstance(n, Mapping):
                for k, v in n.items():
                    walk(v, (*path, k))
            elif isinstance(n, (list, tuple)) and n:
                for i, v in enumerate(n):
                    walk(v, (*path, i))
            else:
                text = repr(n)
                text = text if len(text) <= 40 else text[:37] + "..."
                dropped.append(f"{where}: a plain value ({text}); the file holds tensors only")

        walk(node, base)
        if isinstance(tree, Mapping) and base:
            for key, value in tree.items():
                if key != base[0]:
                    what = "tensors" if _convert.has_tensor(value) else "plain values"
                    dropped.append(f"{key}: {what} outside the exported subtree {chosen!r}")
        if not items and not problems:
            problems.append(f"{chosen or '<root>'}: holds no tensor")
        if problems:
            raise ConversionError("safetensors", problems, label=_LABEL, hint=_HINT)
        metadata = _metadata(source.metadata, dropped)
        written: list[tuple[str, LazyTensor]] = items
        if progress is not None:
            tally = Tally.over(progress, (t for _, t in items))
            written = [(name, Counted(t, tally)) for name, t in items]
        with _files.atomic_file(target) as tmp:
            _files.write_safetensors(tmp, written, metadata)
        nbytes = sum(t.nbytes for _, t in items)
        report = ExportReport(
            source=str(src_loc),
            destination=target,
            source_format=kind,
            source_version=source.version,
            subtree=chosen,
            tensors=len(items),
            bytes=nbytes,
            tied=tied,
            dropped=tuple(dropped),
            metadata=metadata,
        )
    log.info(
        "exported %s (%s) -> %s: %d tensors, %d bytes, %d tied name(s) left out, %d part(s) "
        "dropped, in %.2f s",
        report.source,
        chosen or "<root>",
        target,
        report.tensors,
        nbytes,
        len(tied),
        len(dropped),
        time.perf_counter() - start,
    )
    return report
