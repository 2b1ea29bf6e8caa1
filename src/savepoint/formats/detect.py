"""Which format a path holds, and ``inspect`` / ``verify`` for every format savepoint reads.

Detection, by path and content (nothing but small marker files and the first 8 bytes is read):

==================  ===================================================================
format              recognised by
==================  ===================================================================
training-artifact   a directory holding ``training_report.json`` (seed 001's trainer; it has a
                    ``manifest.json`` too, so this is checked first)
savepoint           a directory holding ``manifest.json`` (or a path whose checkpoint an
                    interrupted replace left under a hidden name, as ``sp.load`` finds it)
boostr-distributed  a directory holding ``sharding_meta.json``
boostr              a directory holding ``training_state.json``
huggingface         a directory holding ``model.safetensors`` or
                    ``model.safetensors.index.json`` (a Hugging Face model directory), or a
                    file named ``*.safetensors.index.json``
                    (:mod:`savepoint.formats.huggingface`)
shrew               a file starting with ``b"SHRW"`` (its header gives the version)
burn                a file starting with a burn record's ``b"\x83\xa8metadata"``, or any
                    other file named ``*.mpk``
torch               a file named ``*.pt``, ``*.pth``, ``*.bin`` or ``*.ckpt`` that is a zip
                    archive or a legacy ``torch.save`` pickle (read with
                    ``torch.load(weights_only=True)`` only: :mod:`savepoint.formats.pytorch`)
safetensors         any other file named ``*.safetensors``, or whose first 8 bytes are a
                    plausible header length followed by ``{``
dcp, ...            a directory of another training system's checkpoint, by its entries
                    (:mod:`savepoint.formats.foreign`: DCP's ``.metadata`` and ``*.distcp``)
==================  ===================================================================

A file named ``*.shrew`` that does not start with the magic is refused as "not a valid .shrew
file", saying what it starts with instead.

``inspect_any`` and ``verify_any`` describe any of them as a
:class:`~savepoint.info.CheckpointInfo`; for savepoint's own format they are ``sp.inspect`` /
``sp.verify`` (every checksum). The other formats have no
checksums, so ``verify_any`` checks their whole structure and reads every data byte once;
``progress(done, total)`` is called in bytes as it reads, for every format.
"""

from __future__ import annotations

import os
import struct

from savepoint.codecs import manifest as mf
from savepoint.codecs import safetensors as st_format
from savepoint.commit import atomic
from savepoint.errors import CheckpointNotFoundError, IncompatibleCheckpointError
from savepoint.formats import (
    _files,
    boostr,
    burn,
    foreign,
    huggingface,
    pytorch,
    shrew,
    training_artifact,
)
from savepoint.formats._files import open_file
from savepoint.formats._progress import Progress, Tally
from savepoint.info import CheckpointInfo, TensorInfo
from savepoint.storage.paths import local_path

__all__ = ["FORMATS", "LABELS", "by_entries", "detect", "inspect_any", "verify_any"]

FORMATS = (
    "savepoint",
    "shrew",
    "safetensors",
    "boostr",
    "boostr-distributed",
    "burn",
    "training-artifact",
    "torch",
    "huggingface",
    *foreign.KINDS,
)
# Each format as a sentence names one ("X is a ...").
LABELS = {
    "savepoint": "savepoint checkpoint",
    "shrew": ".shrew file",
    "safetensors": "safetensors file",
    "boostr": "boostr checkpoint",
    "boostr-distributed": "distributed boostr checkpoint",
    "burn": "burn record (.mpk)",
    "training-artifact": "training artifact",
    "torch": "PyTorch file (torch.save)",
    "huggingface": "Hugging Face model directory",
    **foreign.LABELS,
}
by_entries = foreign.by_entries  # a directory's format by its entries (pathkind asks on any store)
_BURN_HEAD = b"\x83\xa8metadata"  # fixmap(3), then the key "metadata": rmp-serde's first bytes


def _head(path: str) -> bytes:
    # Never a plain open(): a FIFO named x.shrew would block it forever. open_file refuses
    # anything but a regular file without waiting (CheckpointError subclasses).
    with open_file(path) as f:
        try:
            return f.read(16)
        except OSError as exc:
            raise IncompatibleCheckpointError(
                f"{path} cannot be read: {exc.strerror or exc}", path=path
            ) from None


def detect(path: str | os.PathLike[str]) -> str:
    """The format at ``path``: one of :data:`FORMATS`.

    Raises CheckpointNotFoundError when nothing is there, IncompatibleCheckpointError when the
    path holds something else (a FIFO, socket or device is refused without being opened for a
    blocking read) and CheckpointPermissionError when a file cannot be read.
    """
    p = os.path.abspath(local_path(path, what="checkpoint path"))
    if os.path.isdir(p):
        if training_artifact.is_artifact(p):
            return "training-artifact"
        if os.path.isfile(os.path.join(p, mf.NAME)):
            return "savepoint"
        if os.path.isfile(os.path.join(p, boostr.SHARDING)):
            return "boostr-distributed"
        if os.path.isfile(os.path.join(p, boostr.STATE)):
            return "boostr"
        if huggingface.is_repository(p):
            return "huggingface"
        found = foreign.by_entries(os.listdir(p))
        if found is not None:
            return found
        if training_artifact.is_sweep(p):
            raise IncompatibleCheckpointError(
                f"{p} is a sweep of training artifacts ({training_artifact.COMPARISON_FILE}): "
                "name one of its variant directories, or read it with "
                "savepoint.formats.training_artifact.load_sweep",
                path=p,
            )
        raise IncompatibleCheckpointError(
            f"{p} is a directory without {mf.NAME} (savepoint), {boostr.STATE} (boostr), "
            f"{boostr.SHARDING} (distributed boostr), {training_artifact.REPORT_FILE} (a "
            f"training artifact), {huggingface.SINGLE} or {huggingface.INDEX} (a Hugging Face "
            "model directory), or the files of a DCP, DeepSpeed or Orbax checkpoint: not a "
            "checkpoint savepoint knows (an interrupted savepoint save leaves no manifest.json: "
            "use an earlier checkpoint)",
            path=p,
        )
    if not os.path.lexists(p):
        if atomic.resolve(p) is not None:
            return "savepoint"
        raise CheckpointNotFoundError(f"no checkpoint at {p}", path=p)
    if p.endswith(huggingface.INDEX_SUFFIX):
        return "huggingface"
    head = _head(p)
    if head.startswith(shrew.MAGIC):
        return "shrew"
    if p.lower().endswith(".shrew"):
        raise IncompatibleCheckpointError(_not_shrew(p, head), path=p)
    if pytorch.looks_like(p, head):
        return "torch"
    if head.startswith(_BURN_HEAD) or p.endswith("." + burn.EXTENSION):
        return "burn"
    if p.endswith(".safetensors"):
        return "safetensors"
    if len(head) >= 9 and head[8:9] == b"{":
        (n,) = struct.unpack("<Q", head[:8])
        if n <= st_format.MAX_HEADER_BYTES:
            return "safetensors"
    raise IncompatibleCheckpointError(
        f"{p} is not a checkpoint savepoint knows (a .shrew file starts with b'SHRW'; a "
        "safetensors file is named *.safetensors; a burn record *.mpk)",
        path=p,
    )


def _not_shrew(path: str, head: bytes) -> str:
    """Why the file at ``path`` named ``*.shrew`` is not one: its first bytes are not the magic."""
    if not head:
        found = "it is empty"
    elif len(head) < len(shrew.MAGIC) and shrew.MAGIC.startswith(head):
        found = f"it ends after {len(head)} byte(s), inside the magic"
    else:
        found = f"it starts with {head[: len(shrew.MAGIC)]!r}"
        if head.startswith(b"PK\x03\x04"):
            found += " (a zip archive: a torch.save file? name it *.pt)"
        elif len(head) >= 9 and head[8:9] == b"{":
            found += " (a safetensors file? name it *.safetensors)"
    return (
        f"{path} is not a valid .shrew file: {found}, and every .shrew file starts with the "
        f"magic {shrew.MAGIC!r}"
    )


def _safetensors(path: str, read_all: bool, progress: Progress | None = None) -> CheckpointInfo:
    with _files.SafetensorsFile(path) as f:
        if read_all:
            tally = Tally(progress, sum(e.end - e.start for e in f.entries))
            for e in f.entries:
                tally.drain(f.tensor(e.name))
        name = os.path.basename(path)
        return CheckpointInfo(
            path=path,
            format_version=None,
            writer="",
            created="",
            metadata=dict(f.metadata),
            tensors=tuple(
                TensorInfo(e.name, e.dtype, e.shape, e.end - e.start, name, e.name)
                for e in f.entries
            ),
            values={},
            files={name: f.size},
            format="safetensors",
            notes=("safetensors files have no checksums: verify checks structure and sizes only",),
        )


def _native(path: str, verify: bool, progress: Progress | None = None) -> CheckpointInfo:
    # The one reference upwards (formats -> checkpoint): savepoint's own format is described by
    # the facade that reads it.
    from savepoint import checkpoint

    return checkpoint.verify(path, progress=progress) if verify else checkpoint.inspect(path)


def inspect_any(path: str | os.PathLike[str]) -> CheckpointInfo:
    """Describe the checkpoint at ``path`` (keys, dtypes, shapes, sizes, values, metadata)
    without reading tensor data; every structural rule of its format is checked."""
    p = os.path.abspath(local_path(path, what="checkpoint path"))
    kind = detect(p)
    if kind == "savepoint":
        return _native(p, verify=False)
    if kind == "shrew":
        return shrew.inspect(p)
    if kind == "safetensors":
        return _safetensors(p, read_all=False)
    if kind == "burn":
        return burn.inspect(p)
    if kind == "training-artifact":
        return training_artifact.inspect(p)
    if kind == "torch":
        return pytorch.inspect(p)
    if kind == "huggingface":
        return huggingface.inspect(p)
    if kind in foreign.KINDS:
        return foreign.inspect(kind, p)
    return boostr.inspect(p)


def verify_any(path: str | os.PathLike[str], *, progress: Progress | None = None) -> CheckpointInfo:
    """Check the checkpoint at ``path`` as far as its format allows; raises a CheckpointError
    subclass on the first problem, returns its description when intact. ``progress(done,
    total)`` is called in bytes as data is read."""
    p = os.path.abspath(local_path(path, what="checkpoint path"))
    kind = detect(p)
    if kind == "savepoint":
        return _native(p, verify=True, progress=progress)
    if kind == "shrew":
        return shrew.verify(p, progress=progress)
    if kind == "safetensors":
        return _safetensors(p, read_all=True, progress=progress)
    if kind == "burn":
        return burn.verify(p, progress=progress)
    if kind == "training-artifact":
        return training_artifact.verify(p, progress=progress)
    if kind == "torch":
        return pytorch.verify(p, progress=progress)
    if kind == "huggingface":
        return huggingface.verify(p, progress=progress)
    if kind in foreign.KINDS:
        return foreign.verify(kind, p, progress=progress)
    return boostr.verify(p, progress=progress)
