"""``sp.load`` of the other formats savepoint reads: a safetensors file, a PyTorch file
(``torch.load(weights_only=True)`` only), a ``.shrew`` file, a burn record, a boostr directory
(single or distributed), a training artifact or a Hugging Face model directory (a
``model.safetensors``, or shards and their index), from a local path.

The tree is the one :mod:`savepoint.formats.convert` reads each format as (its table: a
safetensors file is ``{name: tensor}`` in header order, a PyTorch file what ``torch.load`` gives,
...). Without ``into`` every tensor (or those under ``keys``) is copied out of the file into a
fresh numpy array, or a torch tensor where the file holds torch tensors (``framework`` forces
one or the other; ``device`` moves torch tensors). With ``into`` the tree is matched against the
targets exactly as for a savepoint checkpoint (:mod:`savepoint.state.restore`): every problem is
reported before anything is modified, then each tensor is copied straight into its target.

These formats have no checksums: their structure (headers, sizes, offsets) is checked when the
file is opened, whatever ``verify`` says; ``mmap=True`` changes nothing (the arrays are copies).
Memory: one tensor's bytes at a time besides the result (a file range is read into the
destination).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from savepoint.codecs import manifest as mf
from savepoint.engine import load as load_engine
from savepoint.errors import CheckpointMemoryError
from savepoint.formats import convert
from savepoint.formats._files import CHUNK, LazyTensor, to_framework
from savepoint.state import arrays, restore, tree
from savepoint.state.arrays import TensorSource

__all__ = ["copy_bytes", "load_any"]

log = logging.getLogger(__name__)


def load_any(
    path: str,
    kind: str,
    *,
    into: Any,
    keys: Iterable[str] | str | None,
    framework: load_engine.Framework,
    device: Any,
    progress: load_engine.Progress | None,
    **_ignored: Any,
) -> Any:
    """``sp.load`` of the checkpoint of format ``kind`` (as :func:`detect.detect` names it) at
    the local ``path``; the arguments as ``sp.load``'s, already checked (``verify`` and
    ``mmap`` are ignored: see the module docstring)."""
    started = time.perf_counter()
    with convert.open_source(path, kind) as source:
        flat = convert.encode(source.tree)
        sources: dict[str, Any] = flat.tensors
        records = {
            ref: mf.TensorRecord.plain(t.dtype.name, t.shape, "", 0, t.nbytes, "")
            for ref, t in sources.items()
        }
        root = load_engine.select_node(path, flat.tree, keys)
        if into is None:
            refs = tree.refs(root)
            count = _counter(progress, sources, refs)
            found = load_engine.kinds(root)
            made = {ref: _fresh(sources[ref], found[ref], framework, count) for ref in refs}
            out = tree.build(root, load_engine.getter(made, device))
        else:
            p = restore.plan(root, into, records)
            if p.problems:
                raise restore.mismatch(p, root, into, records, path=path)
            refs = p.refs
            count = _counter(progress, sources, refs)
            for ref, target, _ in p.inplace:
                _fill(sources[ref], target, count)
            found = load_engine.kinds(root)
            made = {ref: _fresh(sources[ref], found[ref], framework, count) for ref in p.fresh}
            out = p.finish(load_engine.getter(made, device))
    if log.isEnabledFor(logging.INFO):
        log.info(
            "loaded %s (%s)%s: %d tensors in %.3f s",
            path,
            kind,
            " into the given state" if into is not None else "",
            len(refs),
            time.perf_counter() - started,
        )
    return out


def _counter(
    progress: load_engine.Progress | None, sources: dict[str, Any], refs: set[str]
) -> load_engine.Counter | None:
    if progress is None:
        return None
    return load_engine.Counter(progress, sum(sources[r].nbytes for r in refs))


def copy_bytes(
    source: TensorSource, dst: np.ndarray[Any, Any], count: Callable[[int], None] | None
) -> None:
    """Every byte of ``source`` into the uint8 array ``dst``, a chunk at a time, each chunk's
    length told to ``count``; the source is released at the end."""
    try:
        for pos in range(0, source.nbytes, CHUNK):
            piece = dst[pos : pos + CHUNK]
            source.copy_to(piece, pos)
            if count is not None:
                count(len(piece))
    finally:
        source.release()


def _fresh(source: LazyTensor, kind: str, framework: str, count: load_engine.Counter | None) -> Any:
    """A new array (or torch tensor) holding ``source``."""
    want_torch = framework == "torch" or (framework == "auto" and kind == "torch")
    try:
        array = np.empty(source.shape, dtype=source.dtype.numpy)
    except MemoryError:
        raise CheckpointMemoryError(
            f"cannot allocate {source.nbytes} bytes for a tensor of shape {list(source.shape)}"
        ) from None
    copy_bytes(source, array.reshape(-1).view(np.uint8), count)
    return to_framework(array, source.dtype, "torch" if want_torch else "numpy")


def _fill(source: LazyTensor, target: Any, count: load_engine.Counter | None) -> None:
    """``source`` copied into an existing array or tensor (checked by the plan)."""
    view = arrays.byte_view(target)
    if view is not None:
        copy_bytes(source, view, count)
        return
    host = np.empty(source.nbytes, dtype=np.uint8)
    copy_bytes(source, host, count)
    shaped = host.view(source.dtype.numpy).reshape(source.shape)
    if isinstance(target, np.ndarray):
        np.copyto(target, shaped, casting="no")
    else:
        from savepoint.state import torch_tensors

        torch_tensors.copy_into(target, shaped, source.dtype)
