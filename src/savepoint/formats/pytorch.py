"""PyTorch files written by ``torch.save`` (``.pt``, ``.pth``, ``.bin``, ``.ckpt``), read as state
trees through ``torch.load(weights_only=True)`` only.

A file is recognised by its name *and* its first bytes: one of the extensions above, and either a
zip archive (``PK\\x03\\x04``, what ``torch.save`` writes since torch 1.6) or the legacy format
(a pickle whose first object is torch's magic number). Reading needs torch
(``pip install 'savepoint[torch]'``).

Security: savepoint never unpickles arbitrary objects. ``torch.load`` is always called with
``weights_only=True``, whose restricted unpickler builds only tensors, plain containers
(dict, OrderedDict, list, tuple), numbers, strings, None, ``torch.Size``, dtypes and devices.
A file that needs more (a whole pickled model, an optimizer object, a custom class) is refused
with :class:`~savepoint.errors.IncompatibleCheckpointError` naming what it needs; load such a
file yourself, in code that trusts it, and ``sp.save`` its state dict.

The tree: the loaded object as it is, tensors as lazy tensors (zip files are memory-mapped, so
nothing is read until copied), ``OrderedDict`` as dict, ``torch.Size`` as a tuple of ints,
dtypes and devices as their names. Tensors that are the same view of the same storage (tied
weights) become one tensor, as ``sp.save`` stores them. Keys other than strings and integers and
any other type are refused, all listed at once.
"""

from __future__ import annotations

import contextlib
import os
import pickle
from collections.abc import Iterator, Mapping
from typing import Any

from savepoint.errors import (
    CheckpointError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
)
from savepoint.formats._files import ArrayTensor, LazyTensor, open_file
from savepoint.formats._progress import Progress, Tally
from savepoint.info import CheckpointInfo, TensorInfo
from savepoint.state import arrays
from savepoint.state import tree as tree_mod
from savepoint.storage.paths import local_path

__all__ = ["EXTENSIONS", "ZIP_MAGIC", "inspect", "load_tree", "looks_like", "open_tree", "verify"]

EXTENSIONS = (".pt", ".pth", ".bin", ".ckpt")
ZIP_MAGIC = b"PK\x03\x04"
# The legacy format's first pickle is torch's magic number, 0x1950a86a20f9469cfc6c (LONG1).
_LEGACY_MAGIC = b"\x8a\nl\xfc\x9cF\xf9 j\xa8P\x19"


def looks_like(path: str, head: bytes) -> bool:
    """Whether ``path`` (with its first bytes ``head``) is a file ``torch.save`` wrote."""
    if not path.lower().endswith(EXTENSIONS):
        return False
    return head.startswith(ZIP_MAGIC) or (head[:1] == b"\x80" and head[2:14] == _LEGACY_MAGIC)


def _torch(path: str) -> Any:
    try:
        import torch
    except ImportError:
        raise IncompatibleCheckpointError(
            f"{path} is a PyTorch file; reading it needs torch: pip install 'savepoint[torch]'",
            path=path,
        ) from None
    return torch


def _refused(path: str, exc: BaseException) -> IncompatibleCheckpointError:
    text = str(exc)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    reason = next(
        (line for line in lines if "Unsupported" in line or "not an allowed global" in line),
        lines[0] if lines else type(exc).__name__,
    )
    return IncompatibleCheckpointError(
        f"{path} holds more than tensors and plain containers, and savepoint reads PyTorch files "
        f"only through torch.load(weights_only=True), which refuses it ({reason}). savepoint "
        "never unpickles arbitrary objects: if you trust the file, load it yourself "
        "(torch.load(path, weights_only=False)) and sp.save its state dict (model.state_dict(), "
        "or sp.optimizer_state_from_torch(optimizer))",
        path=path,
    )


def _load(path: str) -> Any:
    """``torch.load(path, weights_only=True)`` on the CPU, memory-mapped for zip files."""
    torch = _torch(path)
    with open_file(path) as f:  # refuses FIFOs and devices without blocking
        zipped = f.read(4) == ZIP_MAGIC
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=zipped)
    except pickle.UnpicklingError as exc:
        raise _refused(path, exc) from None
    except MemoryError:
        raise
    except Exception as exc:  # a damaged archive: torch raises RuntimeError, EOFError, ...
        raise CorruptCheckpointError(
            f"{path} cannot be read as a PyTorch file: {type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}",
            path=path,
        ) from None


def _tree(obj: Any, path: str) -> Any:
    """The loaded object as a state tree of lazy tensors and plain values (module docstring)."""
    torch = _torch(path)
    seen: dict[tuple[Any, ...], LazyTensor] = {}
    problems: list[str] = []

    def walk(node: Any, where: tuple[tree_mod.Key, ...]) -> Any:
        key = tree_mod.join(where)
        if isinstance(node, torch.Tensor):
            try:
                source = arrays.make_source(node, key)
            except CheckpointError as exc:
                problems.append(str(exc))
                return None
            assert source is not None
            identity = source.identity()  # the same view of the same storage: tied
            if identity is not None and identity in seen:
                return seen[identity]
            lazy = ArrayTensor(source)
            if identity is not None:
                seen[identity] = lazy
            return lazy
        if isinstance(node, torch.Size):
            return tuple(int(n) for n in node)
        if isinstance(node, (torch.dtype, torch.device)):
            return str(node)
        if node is None or isinstance(node, (bool, str)):
            return node
        if isinstance(node, int):
            return int(node)
        if isinstance(node, float):
            return float(node)
        if isinstance(node, Mapping):
            out: dict[Any, Any] = {}
            for k, v in node.items():
                if isinstance(k, bool) or not isinstance(k, (str, int)):
                    problems.append(f"{key or '<root>'}: a {type(k).__name__} key ({k!r})")
                    continue
                out[k] = walk(v, (*where, k))
            return out
        if isinstance(node, (list, tuple)):
            items = [walk(v, (*where, i)) for i, v in enumerate(node)]
            return items if isinstance(node, list) else tuple(items)
        problems.append(f"{key or '<root>'}: a {type(node).__module__}.{type(node).__name__}")
        return None

    out = walk(obj, ())
    if problems:
        raise IncompatibleCheckpointError(
            f"{path}: torch.load gave values savepoint cannot hold (tensors, plain containers, "
            "numbers, strings and None): " + "; ".join(problems[:20]),
            path=path,
        )
    return out


def load_tree(path: str | os.PathLike[str]) -> Any:
    """The file at ``path`` as a state tree whose tensors are lazy (see the module docstring)."""
    local = os.path.abspath(local_path(path, what="PyTorch file"))
    return _tree(_load(local), local)


@contextlib.contextmanager
def open_tree(path: str | os.PathLike[str]) -> Iterator[Any]:
    """:func:`load_tree` for the length of a ``with`` block (the mapping is dropped after)."""
    yield load_tree(path)


def _describe(path: str, root: Any) -> tuple[CheckpointInfo, list[LazyTensor]]:
    name = os.path.basename(path)
    tensors: list[TensorInfo] = []
    values: dict[str, Any] = {}
    first: dict[int, str] = {}
    unique: list[LazyTensor] = []

    def walk(node: Any, where: tuple[tree_mod.Key, ...]) -> None:
        key = tree_mod.join(where)
        if isinstance(node, LazyTensor):
            owner = first.get(id(node))
            if owner is None:
                first[id(node)] = key
                unique.append(node)
            tensors.append(
                TensorInfo(
                    key,
                    node.dtype.name,
                    node.shape,
                    node.nbytes,
                    name,
                    owner or key,
                    tied_to=owner,
                )
            )
        elif isinstance(node, Mapping):
            for k, v in node.items():
                walk(v, (*where, k))
        elif isinstance(node, (list, tuple)) and node:
            for i, v in enumerate(node):
                walk(v, (*where, i))
        else:
            values[key] = list(node) if isinstance(node, tuple) else node

    walk(root, ())
    info = CheckpointInfo(
        path=path,
        format_version=None,
        writer="",
        created="",
        metadata={},
        tensors=tuple(tensors),
        values=values,
        files={name: os.path.getsize(path)},
        format="torch",
        notes=(
            "read through torch.load(weights_only=True); PyTorch files have no checksums: verify "
            "checks that it loads and reads every byte",
        ),
    )
    return info, unique


def inspect(path: str | os.PathLike[str]) -> CheckpointInfo:
    """Describe the file at ``path`` (keys, dtypes, shapes, plain values) without reading tensor
    data (a zip file is mapped; the legacy format is read whole by torch)."""
    local = os.path.abspath(local_path(path, what="PyTorch file"))
    return _describe(local, load_tree(local))[0]


def verify(path: str | os.PathLike[str], *, progress: Progress | None = None) -> CheckpointInfo:
    """Check that the file loads through ``torch.load(weights_only=True)`` and read every byte
    of tensor data once (the format has no checksums)."""
    local = os.path.abspath(local_path(path, what="PyTorch file"))
    info, unique = _describe(local, load_tree(local))
    tally = Tally(progress, sum(t.nbytes for t in unique))
    for t in unique:
        tally.drain(t)
    return info
