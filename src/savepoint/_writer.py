"""Writing the files of one checkpoint into a staging directory (committing is the caller's job).

Tensors are assigned to data files in the order they were found, a new file starting when the
current one would pass ``max_file_bytes``; a tensor larger than that gets a file of its own. Files
are written by up to ``writers`` threads at once, each streaming through its own staging buffers.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from savepoint import _parallel
from savepoint._version import __version__
from savepoint.codecs import checksum, safetensors
from savepoint.codecs import manifest as mf
from savepoint.state.arrays import TensorSource
from savepoint.state.tree import Flat
from savepoint.storage import local

if TYPE_CHECKING:
    from savepoint.async_.staging import Staged


@dataclass(frozen=True)
class FilePlan:
    name: str
    tensors: tuple[str, ...]


def plan_files(flat: Flat, max_file_bytes: int) -> list[FilePlan]:
    files: list[list[str]] = [[]]
    size = 0
    for name, source in flat.tensors.items():
        if files[-1] and size + source.nbytes > max_file_bytes:
            files.append([])
            size = 0
        files[-1].append(name)
        size += source.nbytes
    return [FilePlan(f"data-{i:05d}.safetensors", tuple(names)) for i, names in enumerate(files)]


def write_files(
    directory: str,
    flat: Flat,
    *,
    max_file_bytes: int,
    writers: int,
    direct: bool = True,
    progress: Callable[[int], None] | None = None,
) -> tuple[dict[str, mf.FileRecord], dict[str, mf.TensorRecord]]:
    plans = plan_files(flat, max_file_bytes)

    def write_one(fp: FilePlan) -> tuple[mf.FileRecord, dict[str, mf.TensorRecord]]:
        sources: dict[str, TensorSource] = {n: flat.tensors[n] for n in fp.tensors}
        header, entries = safetensors.layout(
            [(n, s.dtype.name, s.shape, s.nbytes) for n, s in sources.items()]
        )
        ordered = [sources[e.name] for e in entries]
        digests = local.write_file(
            os.path.join(directory, fp.name), header, ordered, direct=direct, progress=progress
        )
        size = entries[-1].end if entries else len(header)
        record = mf.FileRecord(size, len(header), checksum.digest(header))
        tensors = {
            e.name: mf.TensorRecord(e.dtype, e.shape, fp.name, e.start, e.end, digest)
            for e, digest in zip(entries, digests)
        }
        return record, tensors

    if writers > 1 and len(plans) > 1:
        with ThreadPoolExecutor(max_workers=writers, thread_name_prefix="savepoint-file") as pool:
            results = list(pool.map(write_one, plans))
    else:
        results = [write_one(fp) for fp in plans]
    files: dict[str, mf.FileRecord] = {}
    tensors: dict[str, mf.TensorRecord] = {}
    for fp, (record, recs) in zip(plans, results):
        files[fp.name] = record
        tensors.update(recs)
    # Manifest order follows the state, not the file layout.
    return files, {name: tensors[name] for name in flat.tensors}


def write_staged(
    directory: str, staged: Staged, *, direct: bool = True
) -> tuple[dict[str, mf.FileRecord], dict[str, mf.TensorRecord]]:
    """Write a staged state's file images (see savepoint.async_.staging) into ``directory``:
    checksums first, from the images, on all cores; then each image straight to disk."""
    staged.wait()
    jobs = [(f, e) for f in staged.files for e in f.entries]
    digests = _parallel.run_all(
        lambda job: checksum.digest(job[0].image[job[1].start : job[1].end]), jobs
    )
    by_name = {e.name: (f, e, d) for (f, e), d in zip(jobs, digests)}
    files: dict[str, mf.FileRecord] = {}
    for f in staged.files:
        local.write_image(os.path.join(directory, f.name), f.image, f.size, direct=direct)
        files[f.name] = mf.FileRecord(f.size, len(f.header), checksum.digest(f.header))
    tensors = {
        name: mf.TensorRecord(e.dtype, e.shape, f.name, e.start, e.end, d)
        for name in staged.order
        for f, e, d in [by_name[name]]
    }
    return files, tensors


def writer_version() -> str:
    return f"savepoint {__version__}"
