"""``torch.distributed.checkpoint`` (DCP) on savepoint: a ``StorageWriter``/``StorageReader`` pair.

::

    import torch.distributed.checkpoint as dcp
    from savepoint.integrations.dcp import SavepointReader, SavepointWriter

    dcp.save(state_dict, storage_writer=SavepointWriter("s3://bucket/run/step-100"))
    dcp.load(state_dict, storage_reader=SavepointReader("s3://bucket/run/step-100"))

DCP keeps its planner, its resharding and its collectives; savepoint supplies what is under them:

- the commit protocol: the coordinator opens a :class:`~savepoint.commit.transaction.Transaction`
  in ``prepare_global_plan`` and hands its staging directory to every rank with the plans; each
  rank writes its chunks there (``data-r<rank>-<i>.safetensors``, through the write pipeline:
  checksums fused with the copy, O_DIRECT on local disks, multipart uploads on object stores);
  ``finish`` builds the manifest with savepoint's one builder and commits it through the one
  commit point (:func:`savepoint.engine.save.new_manifest`, :func:`~savepoint.engine.save.commit`),
  manifest last. A save that fails on any rank never reaches ``finish``
  (DCP raises on every rank), so no half-written checkpoint is ever visible: ``dcp.load`` of the
  path still sees the previous checkpoint or none. What the failed attempt wrote is removed by
  the next save through the same writer, by the next save to the path, or by ``savepoint gc``.
- the format: a DCP checkpoint written this way *is* a savepoint sharded checkpoint (manifest
  version 3): every chunk DCP planned is a box shard with its checksum (per block for large
  ones), so ``sp.load``/``sp.verify``/``savepoint inspect`` read it (a flat dict of the fully
  qualified names), and any savepoint load can reshard it. DCP's own metadata (tensor
  properties, the planner's data, which entries are opaque bytes) lives in the manifest's
  ``metadata["dcp"]`` as JSON; nothing is pickled by savepoint. Entries DCP serialises itself
  (``BYTE_IO``: non-tensor values, which DCP's planners write with ``torch.save``) are stored as
  uint8 tensors and handed back to DCP's planner as the same bytes; DCP deserialises them.
- reads: :class:`SavepointReader` reads each ``ReadItem``'s region of the chunk DCP chose, with
  block checksums (a rank restoring part of a chunk reads and checks only the blocks holding it),
  from one pinned generation of the checkpoint, straight into the destination tensor where it is
  a contiguous CPU tensor.

Only DCP checkpoints written by :class:`SavepointWriter` are read with DCP's metadata; other
savepoint checkpoints are offered to DCP as their manifest's tensors under their savepoint names
(``model/w``), box-sharded or whole.

Offline, in one process: :func:`full_state_dict` is the whole nested state DCP saved (what
``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` collects, which reads DCP's own
``.metadata`` file with a hard-coded ``FileSystemReader`` and so cannot read these checkpoints),
and :func:`dcp_to_torch_save` writes it with ``torch.save``. For a model's weights alone, as
safetensors, ``savepoint export CKPT model.safetensors --subtree app/model`` (no pickle).
"""

from __future__ import annotations

import dataclasses
import io
import os
import uuid
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from savepoint.codecs import boxes, dtypes
from savepoint.codecs import manifest as mf
from savepoint.commit.transaction import Transaction, write_error
from savepoint.distributed import plan as dplan
from savepoint.distributed import save as dsave
from savepoint.engine import save as save_engine
from savepoint.engine import sinks
from savepoint.engine.plan import plan_files
from savepoint.engine.read import Reader, RegionCopy, ShardTask
from savepoint.errors import (
    CheckpointError,
    IncompatibleCheckpointError,
    UnsupportedStateError,
)
from savepoint.state import arrays
from savepoint.state.arrays import NumpySource, TensorSource
from savepoint.storage.paths import Location, PathArg
from savepoint.storage.paths import resolve as resolve_path

__all__ = [
    "DCP_VERSION",
    "SavepointReader",
    "SavepointWriter",
    "dcp_to_torch_save",
    "full_state_dict",
]

DCP_VERSION = 1  # the shape of metadata["dcp"]
_MAX_FILE_BYTES = 4 << 30


@dataclasses.dataclass(frozen=True)
class _Staging:
    """What the coordinator's global plan tells each rank: where to write, and as which rank."""

    path: str
    rank: int


@dataclasses.dataclass(frozen=True)
class _Stored:
    """A rank's report of one chunk written (a WriteResult's storage_data)."""

    key: str
    shard: mf.ShardRecord
    file: mf.FileRecord


def _as_path(checkpoint_id: Any) -> str:
    if isinstance(checkpoint_id, Location):
        return checkpoint_id.store.url(checkpoint_id.path)
    return str(os.fspath(checkpoint_id))


class SavepointWriter(StorageWriter):
    """A DCP ``StorageWriter`` that commits a savepoint sharded checkpoint at ``path`` (a local
    path or any URL savepoint takes: ``s3://``, ``gs://``, ``az://``, ``memory://``, fsspec).

    ``metadata``: JSON metadata stored with the checkpoint (``sp.inspect`` shows it);
    ``max_file_bytes``, ``writers``, ``direct``: as for ``sp.save``. ``path`` may instead be given
    to ``dcp.save(..., checkpoint_id=...)``.
    """

    def __init__(
        self,
        path: PathArg | None = None,
        *,
        metadata: Mapping[str, Any] | None = None,
        max_file_bytes: int = _MAX_FILE_BYTES,
        writers: int = 1,
        direct: bool = True,
    ) -> None:
        super().__init__()
        self.path = None if path is None else _as_path(path)
        self.metadata = save_engine.check_metadata(metadata)
        if "dcp" in self.metadata:
            raise UnsupportedStateError('metadata key "dcp" is where DCP\'s own metadata goes')
        self.max_file_bytes = max_file_bytes
        self.writers = writers
        self.direct = direct
        self.is_coordinator = False
        self._tx: Transaction | None = None
        self._save_id = ""

    # -- DCP's call order: reset, set_up, prepare_local_plan, [coordinator] prepare_global_plan,
    #    write_data, [coordinator] finish ------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._abort()  # an attempt of this writer that never reached finish()
        if checkpoint_id is not None:
            self.path = _as_path(checkpoint_id)
        self._save_id = uuid.uuid4().hex

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        if self.path is None:
            raise CheckpointError(
                "SavepointWriter has no path: pass one, or checkpoint_id= to dcp.save"
            )

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        where = self._where()
        self._abort()
        self._tx = Transaction(where.store, where.path).begin()
        staging = self._tx.staging
        return [
            dataclasses.replace(p, storage_data=_Staging(staging, rank))
            for rank, p in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        staging = plan.storage_data
        if not isinstance(staging, _Staging):
            raise CheckpointError("SavepointWriter.write_data: the plan did not come from it")
        where = self._where()
        named: dict[str, tuple[WriteItem, dplan.Item]] = {}
        sources: dict[str, TensorSource] = {}
        for item in plan.items:
            key, piece, source = _piece(item, planner.resolve_data(item))
            name = base = mf.shard_name(key, piece.region, piece.shape)
            n = 2
            while name in named or name == "__metadata__":
                name, n = f"{base}~{n}", n + 1
            named[name] = (item, piece)
            sources[name] = source
        results: list[WriteResult] = []
        if named:
            plans = plan_files(
                sources, self.max_file_bytes, lambda i: dsave.file_name(staging.rank, i)
            )
            try:
                files, records = sinks.write_files(
                    Location(where.store, staging.path),
                    plans,
                    sources,
                    writers=self.writers,
                    direct=self.direct,
                    blocked=True,
                )
                where.store.sync_dir(staging.path)
            except OSError as exc:
                if isinstance(exc, CheckpointError):
                    raise
                raise write_error(where.store, where.path, exc) from exc
            for name, (item, piece) in named.items():
                rec = records[name]
                shard = mf.ShardRecord(
                    rec.file, rec.start, rec.end, rec.xxh3, piece.region, rec.block, rec.blocks
                )
                results.append(
                    WriteResult(
                        index=item.index,
                        size_in_bytes=rec.end - rec.start,
                        storage_data=_Stored(piece.key, shard, files[rec.file]),
                    )
                )
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        tx = self._tx
        if tx is None:
            raise CheckpointError("SavepointWriter.finish without prepare_global_plan")
        try:
            manifest = _manifest(metadata, results, self.metadata)
            save_engine.commit(tx, manifest)
        finally:
            self._abort()
            self._tx = None

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path, save_id=self._save_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        try:
            resolve_path(_as_path(checkpoint_id), what="checkpoint path")
        except (CheckpointError, TypeError, ValueError):
            return False
        return True

    # -- internals --------------------------------------------------------------------------

    def _where(self) -> Location:
        assert self.path is not None
        return resolve_path(self.path, what="checkpoint path")

    def _abort(self) -> None:
        tx, self._tx = self._tx, None
        if tx is not None and tx.committed is None:
            tx.abort()


def _piece(item: WriteItem, data: Any) -> tuple[str, dplan.Item, TensorSource]:
    """The savepoint piece (key, dtype, global shape, box) and byte source of one WriteItem."""
    key = item.index.fqn
    if item.type == WriteItemType.BYTE_IO:
        raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
        array = np.frombuffer(raw, dtype=np.uint8)
        piece = dplan.Item(key, "U8", (len(raw),), ((0, len(raw)),))
        return key, piece, NumpySource(array, key)
    td = item.tensor_data
    assert td is not None
    if not isinstance(data, torch.Tensor):
        raise UnsupportedStateError(f"DCP gave {type(data).__name__} for tensor {key!r}")
    dtype = dtypes.from_torch(data.dtype, key).name
    region = tuple((o, o + s) for o, s in zip(td.chunk.offsets, td.chunk.sizes))
    piece = dplan.Item(key, dtype, tuple(td.size), region)
    tensor = data.detach().reshape(tuple(td.chunk.sizes))
    source = arrays.make_source(tensor, key)
    assert source is not None
    return key, piece, source


def _json_planner_data(data: Any) -> Any:
    """DCP's planner data as JSON: the default planners' ``{fqn: (path, ...)}`` (tuples become
    lists; :func:`_planner_data` turns them back), or None. Anything else would need pickle."""
    if data is None:
        return None
    ok = isinstance(data, dict) and all(
        isinstance(k, str)
        and isinstance(v, (tuple, list))
        and all(isinstance(p, (str, int)) and not isinstance(p, bool) for p in v)
        for k, v in data.items()
    )
    if not ok:
        raise UnsupportedStateError(
            f"the DCP planner's data ({type(data).__name__}) is not a mapping of names to paths; "
            "savepoint stores DCP metadata as JSON, never pickled: use DCP's default planners"
        )
    return {k: list(v) for k, v in data.items()}


def _planner_data(raw: Any) -> Any:
    if raw is None:
        return None
    return {k: tuple(v) for k, v in raw.items()}


def _properties(p: TensorProperties) -> dict[str, Any]:
    return {
        "requires_grad": bool(p.requires_grad),
        "pin_memory": bool(p.pin_memory),
        "layout": str(p.layout).removeprefix("torch."),
        "memory_format": str(p.memory_format).removeprefix("torch."),
    }


def _manifest(
    metadata: Metadata, results: list[list[WriteResult]], user: dict[str, Any]
) -> mf.Manifest:
    files: dict[str, mf.FileRecord] = {}
    shards: dict[str, list[mf.ShardRecord]] = {}
    for rank_results in results:
        for r in rank_results:
            stored = r.storage_data
            assert isinstance(stored, _Stored)
            files[stored.shard.file] = stored.file
            shards.setdefault(stored.key, []).append(stored.shard)
    tensors: dict[str, mf.TensorRecord] = {}
    properties: dict[str, dict[str, Any]] = {}
    opaque: list[str] = []
    items: list[list[Any]] = []
    for fqn, md in metadata.state_dict_metadata.items():
        if fqn not in shards:
            raise CheckpointError(f"DCP planned {fqn!r} but no rank wrote it")
        got = sorted(shards[fqn], key=lambda s: dplan.region_order(s.region))
        if isinstance(md, BytesStorageMetadata):
            (only,) = got
            tensors[fqn] = mf.whole("U8", (only.nbytes,), (only,))
            opaque.append(fqn)
            items.append([fqn, {"t": "tensor", "ref": fqn, "kind": "numpy"}])
            continue
        assert isinstance(md, TensorStorageMetadata)
        dtype = dtypes.from_torch(md.properties.dtype, fqn).name
        tensors[fqn] = mf.whole(dtype, tuple(md.size), tuple(got))
        properties[fqn] = _properties(md.properties)
        items.append([fqn, {"t": "tensor", "ref": fqn, "kind": "torch"}])
    dcp_meta = {
        "version": DCP_VERSION,
        "dcp_version": metadata.version,
        "planner_data": _json_planner_data(metadata.planner_data),
        "properties": properties,
        "bytes": opaque,
    }
    written = sinks.Written(files, tensors, mf.BLOCKED)
    tree_node = {"t": "dict", "items": items}
    return save_engine.new_manifest(
        tree_node, [written], {**user, "dcp": dcp_meta}, world_size=len(results)
    )


class SavepointReader(StorageReader):
    """A DCP ``StorageReader`` of a savepoint checkpoint at ``path`` (any path or URL savepoint
    takes). One generation of the checkpoint is pinned from ``read_metadata`` on, so a save
    replacing it meanwhile cannot mix two checkpoints into one load. ``verify`` (default on)
    checks every byte read against the manifest's checksums (by block for large chunks)."""

    def __init__(self, path: PathArg | None = None, *, verify: bool = True) -> None:
        super().__init__()
        self.path = None if path is None else _as_path(path)
        self.verify = verify
        self._reader: Reader | None = None
        self._chunks: dict[tuple[str, tuple[int, ...]], int] = {}

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.close()
        if checkpoint_id is not None:
            self.path = _as_path(checkpoint_id)

    def close(self) -> None:
        reader, self._reader = self._reader, None
        if reader is not None:
            reader.close()

    def _open(self) -> Reader:
        if self._reader is None:
            if self.path is None:
                raise CheckpointError(
                    "SavepointReader has no path: pass one, or checkpoint_id= to dcp.load"
                )
            self._reader = Reader.open(self.path)
        return self._reader

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        manifest = self._open().manifest
        meta = manifest.metadata.get("dcp")
        dcp_meta = meta if isinstance(meta, dict) else {}
        opaque = set(dcp_meta.get("bytes") or ())
        props = dcp_meta.get("properties") or {}
        state: dict[str, Any] = {}
        self._chunks = {}
        for fqn, rec in manifest.tensors.items():
            if fqn in opaque:
                state[fqn] = BytesStorageMetadata()
                self._chunks[(fqn, (0,))] = 0
                continue
            chunks = []
            for i, shard in enumerate(rec.layout()):
                if isinstance(shard.region, boxes.Flat):
                    raise IncompatibleCheckpointError(
                        f"{self._open().shown}: tensor {fqn!r} is stored in flat (FSDP-style) "
                        "shards, which DCP cannot describe; load it with sp.load",
                        path=self._open().shown,
                    )
                offsets = tuple(a for a, _ in shard.region)
                self._chunks[(fqn, offsets)] = i
                chunks.append(
                    ChunkStorageMetadata(
                        offsets=torch.Size(offsets), sizes=torch.Size(boxes.extents(shard.region))
                    )
                )
            p = props.get(fqn, {})
            properties = TensorProperties(
                dtype=getattr(torch, dtypes.from_name(rec.dtype).torch_name),
                requires_grad=bool(p.get("requires_grad", False)),
                pin_memory=bool(p.get("pin_memory", False)),
            )
            state[fqn] = TensorStorageMetadata(properties, torch.Size(rec.shape), chunks)
        return Metadata(
            state_dict_metadata=state,
            planner_data=_planner_data(dcp_meta.get("planner_data")),
            storage_meta=StorageMeta(checkpoint_id=self.path),
            version=dcp_meta.get("dcp_version"),
        )

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self._open()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        reader = self._open()
        if not self._chunks:
            self.read_metadata()
        tasks: dict[tuple[str, int], list[RegionCopy]] = {}
        commits: list[tuple[Any, Any, np.ndarray[Any, Any] | None]] = []
        for ri in plan.items:
            fqn = ri.storage_index.fqn
            rec = reader.manifest.tensors.get(fqn)
            if rec is None:
                raise IncompatibleCheckpointError(
                    f"{reader.shown} holds no {fqn!r}", path=reader.shown
                )
            if ri.type == LoadItemType.BYTE_IO:
                buf = np.empty(rec.nbytes, dtype=np.uint8)
                reader.prepare([fqn], check_header=self.verify)
                reader.transfer([(fqn, buf)], verify=self.verify)
                planner.load_bytes(ri, io.BytesIO(buf.tobytes()))
                continue
            offsets = tuple(ri.storage_index.offset or ())
            index = self._chunks.get((fqn, offsets))
            if index is None:
                raise IncompatibleCheckpointError(
                    f"{reader.shown}: {fqn!r} has no chunk at {list(offsets)}",
                    path=reader.shown,
                )
            shard = rec.layout()[index]
            starts = [a for a, _ in shard.region]  # type: ignore[union-attr]
            want = tuple(
                (s + o, s + o + n) for s, o, n in zip(starts, ri.storage_offsets, ri.lengths)
            )
            target = planner.resolve_tensor(ri).detach()
            host = arrays.byte_view(target)
            staged = None
            if host is None:
                staged = host = np.empty(target.numel() * target.element_size(), np.uint8)
            typed = host.view(dtypes.from_name(rec.dtype).numpy)
            for op in dplan.plan_reads(rec.shape, [shard.region], want):
                dst = typed[op.dst.offset : op.dst.offset + boxes.volume(op.dst.box)]
                dst = dst.reshape(boxes.extents(op.dst.box))
                origin = tuple(start for start, _ in op.dst.box)
                tasks.setdefault((fqn, index), []).append(
                    RegionCopy(op.src, op.region, dst, origin)
                )
            commits.append((ri, target, staged))
        work: list[ShardTask] = [(ref, i, copies) for (ref, i), copies in tasks.items()]
        reader.prepare_files(
            {reader.manifest.tensors[ref].layout()[i].file for ref, i, _ in work},
            check_header=self.verify,
        )
        reader.read_shards(work, verify=self.verify)
        for ri, target, staged in commits:
            if staged is not None:
                shaped = torch.from_numpy(staged).view(target.dtype).reshape(target.shape)
                target.copy_(shaped)
            planner.commit_tensor(ri, target)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return SavepointWriter.validate_checkpoint_id(checkpoint_id)


def full_state_dict(path: PathArg, *, verify: bool = True) -> dict[str, Any]:
    """The whole state a ``dcp.save`` through :class:`SavepointWriter` saved at ``path``, nested
    as it was saved (``{"app": {"model": {...}, "optim": {...}}, "step": 7}``), in this process
    and without a process group: the equivalent of DCP's
    ``format_utils.dcp_to_torch_save`` before its ``torch.save``.

    Tensors are read and checked as any ``SavepointReader`` load; the values DCP serialised
    itself (non-tensor entries) are deserialised by DCP's planner, as ``dcp.load`` does. Memory:
    the whole state, as with DCP's function.
    """
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    reader = SavepointReader(path, verify=verify)
    state: dict[str, Any] = {}
    try:
        reader.read_metadata()  # a missing or damaged checkpoint: savepoint's error, not DCP's
        _load_state_dict(
            state,
            storage_reader=reader,
            planner=_EmptyStateDictLoadPlanner(),  # type: ignore[no-untyped-call]
            no_dist=True,
        )
    except CheckpointException as exc:
        for failure in exc.failures.values():
            inner = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(inner, CheckpointError):
                raise inner from exc
        raise CheckpointError(f"reading {path} through DCP failed: {exc}") from exc
    finally:
        reader.close()
    return state


def dcp_to_torch_save(
    dcp_checkpoint_dir: PathArg, torch_save_path: str | os.PathLike[str], *, verify: bool = True
) -> None:
    """``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` for checkpoints written
    through :class:`SavepointWriter` (on any store savepoint takes): :func:`full_state_dict`,
    then ``torch.save`` to ``torch_save_path`` (torch's own format, a pickle: this is the one
    function of savepoint that writes one, because it is what was asked for; export weights
    without pickle with ``savepoint export``)."""
    torch.save(full_state_dict(dcp_checkpoint_dir, verify=verify), torch_save_path)
