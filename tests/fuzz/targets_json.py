"""Fuzz targets for the JSON parsers: native manifests (version 1, sharded version 2, and the
incremental versions 4 and 5 read against real blobs), the
safetensors header and standalone safetensors files, boostr's ``training_state.json`` and
``sharding_meta.json``, and a native checkpoint whose data file is the fuzzed input.

Every target calls what a user or the library calls (``sp.inspect``/``sp.load``/``sp.verify``,
``detect.inspect_any``/``verify_any``, ``sp.convert``, the boostr readers, or the module-level
``header_length``/``parse_header`` the readers call) and lets only CheckpointError through as a
rejection. Seeds are real files written by savepoint: several tensors of several dtypes, nested
metadata, a Stateful, tied tensors, several data files, sharded checkpoints of 3 ranks.

Checksums would stop most mutations at the door, so the targets repair them where a writer would
have: ``manifest`` re-seals the manifest's self-checksum (``manifest:raw`` does not), and
``native_data_file`` tries the mutated data file both against the committed manifest and against
one whose file record (size, header size and header checksum) is rewritten to match it.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import struct
from pathlib import Path
from typing import Any

import numpy as np

import savepoint as sp
from fuzz._harness import Target, register
from savepoint import Tier
from savepoint.blobs import BlobPolicy, BlobStore, collect
from savepoint.blobs import gc as blob_gc
from savepoint.codecs import checksum, dtypes
from savepoint.codecs import manifest as mf
from savepoint.codecs import safetensors as st_format
from savepoint.commit import pointer
from savepoint.distributed import FlatShard, Partitioned, Shard, manifests, plan
from savepoint.distributed import save as dsave
from savepoint.formats import _files, boostr, detect
from savepoint.runs.lock import LOCK_FILE, read_holder
from savepoint.state import tree
from savepoint.storage.lease import LeaseLock
from savepoint.storage.memory import MemoryStore
from savepoint.storage.paths import Location

_BF16 = dtypes.BY_NAME["BF16"].numpy
_TRAILER = b',\n "manifest_xxh3"'


class Counter:
    """A Stateful leaf, so seeds hold ``stateful`` tree nodes."""

    def __init__(self) -> None:
        self.n = 3

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n, "history": [1.5, -0.0, None], "w": np.arange(3, dtype=np.int32)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.n = state["n"]


def _model(seed: int = 7) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {
        "encoder.layer0.weight": rng.standard_normal((4, 3)).astype(np.float32),
        "encoder.layer0.bias": rng.standard_normal(3).astype(np.float64),
        "embed.tokens": np.arange(6, dtype=np.uint8).reshape(2, 3),
        "norm.scale": np.linspace(-2, 2, 5).astype(np.float16),
        "head.weight": np.linspace(-1, 1, 8).astype(_BF16).reshape(2, 2, 2),
        "mask": np.array([True, False, True]),
        "counts": np.array([1, 2**31, 7], dtype=np.uint32),
        "empty": np.zeros((0, 4), dtype=np.float32),
        "step": np.array(12345678901, dtype=np.int64),
    }


def _states() -> list[tuple[Any, dict[str, Any]]]:
    """(state, metadata) pairs for the native seeds."""
    model = _model()
    tied = np.arange(4, dtype=np.float32)
    training = {
        "model": model,
        "optimizer": {
            "state": {0: {"exp_avg": np.ones(3, np.float32), "step": 10}, 1: {"step": 10}},
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0, 1]}],
        },
        "tied": {"a": tied, "b": tied},
        "counter": Counter(),
        "rng": b"\x00\x01\xff",
        "epoch": 3,
        "loss": float("nan"),
        "best": float("-inf"),
        "big": 2**80,
        "name": "ключ/x~y",
        7: "seven",
    }
    metadata = {
        "run": {"id": "abc", "tags": ["a", "b"], "lr": 1e-5, "nested": {"deep": [[1, 2], {}]}},
        "note": "é😀",
        "steps": list(range(20)),
    }
    plain = {"history": [0.5, 0.25, 0.125] * 4, "flags": [True, False, None], "w": model["mask"]}
    return [(training, metadata), (plain, {}), ({"only": model["embed.tokens"]}, {"k": "v"})]


def _rank_state(rank: int, world: int) -> dict[str, Any]:
    w = np.arange(10 * 6, dtype=np.float32).reshape(10, 6)
    f = np.arange(5 * 7, dtype=np.float64).reshape(5, 7) / 7
    a, b = FlatShard.bounds(10, rank, world)
    fa, fb = FlatShard.bounds(f.size, rank, world)
    ca, cb = FlatShard.bounds(6, rank, world)
    z = {f"p{i}": np.full((i + 1, 2), i, dtype=np.float32) for i in range(4)}
    return {
        "rows": Shard.split(w[a:b].copy(), 0, rank, world, size=10),
        "cols": Shard(w[:, ca:cb].copy(), w.shape, (0, ca)),
        "flat": FlatShard(f.reshape(-1)[fa:fb].copy(), f.shape, fa),
        "rep": np.arange(12, dtype=np.int16).reshape(3, 4),
        "opt": Partitioned(
            {k: v.copy() for i, (k, v) in enumerate(z.items()) if i % world == rank}
        ),
        "step": 7,
    }


def _save_ranks(path: Path, world: int) -> None:
    """What ``sp.save(path, state, process_group=pg)`` writes on ``world`` ranks, in-process."""
    states = [_rank_state(r, world) for r in range(world)]
    described = [dsave.describe(tree.flatten(s), str(path)) for s in states]
    merged = plan.merge([d[0] for d in described])
    path.mkdir(parents=True)
    results = [
        dsave.write_pieces(
            str(path), str(path), r, merged.writes[r], d[1], max_file_bytes=256, writers=1
        )
        for r, d in enumerate(described)
    ]
    raw = mf.dumps(manifests.manifest(merged, results, {"note": "ranks", "world": world}, world))
    (path / mf.NAME).write_bytes(raw)


def _renamed(raw: bytes, prefix: str) -> tuple[bytes, dict[str, str]]:
    """The manifest ``raw`` with every data file renamed ``prefix + name`` (sealed again), so the
    data files of every seed can live in one directory."""
    m = mf.parse(raw)
    names = {name: prefix + name for name in m.files}
    tensors = {
        ref: mf.TensorRecord(
            t.dtype,
            t.shape,
            names.get(t.file, ""),
            t.start,
            t.end,
            t.xxh3,
            tuple(
                mf.ShardRecord(names[s.file], s.start, s.end, s.xxh3, s.region) for s in t.shards
            ),
        )
        for ref, t in m.tensors.items()
    }
    m.files = {names[n]: f for n, f in m.files.items()}
    m.tensors = tensors
    return mf.dumps(m), names


def _checkpoints(scratch: Path, sharded: bool) -> tuple[Path, list[bytes]]:
    """One directory holding the data files of every seed checkpoint (renamed apart), and the
    seeds: their manifests."""
    home = scratch / ("v2" if sharded else "v1")
    if home.exists():
        shutil.rmtree(home)
    home.mkdir(parents=True)
    made = scratch / "made"
    shutil.rmtree(made, ignore_errors=True)
    if sharded:
        for world in (3, 2):
            _save_ranks(made / f"s{world}", world)
    else:
        for i, (state, metadata) in enumerate(_states()):
            sp.save(
                made / f"s{i}", state, metadata=metadata, max_file_bytes=96 if i == 0 else 1 << 20
            )
    seeds = []
    for k, directory in enumerate(sorted(made.iterdir())):
        raw, names = _renamed((directory / mf.NAME).read_bytes(), f"s{k}-")
        for old, new in names.items():
            shutil.copyfile(directory / old, home / new)
        seeds.append(raw)
    shutil.rmtree(made)
    return home, seeds


# -- native manifests --------------------------------------------------------------------------

MANIFEST_TOKENS = (
    b'"t":"dict","items":[',
    b'{"t":"value","v":',
    b'{"t":"float","v":"nan"}',
    b'{"t":"bytes","v":"AP8="}',
    b'"offsets":[',
    b'"shape":[',
    b'"dtype":"F32"',
    b'"dtype":"BOOL"',
    b'"box":[[0,2],[0,6]]',
    b'"flat":[0,7]',
    b'"format_version": 3',
    b'"blocks":{"size":65536,"xxh3":["0123456789abcdef"]}',
    b'"format_version": 4',
    b'"world_size": 0',
    b'"file":"../x"',
    b"9" * 30,
    _TRAILER,
)


def _seal(head: bytes) -> bytes:
    """A manifest from its ``head`` (every byte before the trailer), as ``manifest.dumps`` ends it."""
    return head + f',\n "manifest_xxh3": "{checksum.digest(head)}"\n}}\n'.encode("ascii")


def _reseal(data: bytes) -> bytes:
    """``data`` with its self-checksum trailer recomputed, as a writer would have sealed it."""
    cut = data.rfind(_TRAILER)
    if cut >= 0:
        return _seal(data[:cut])
    return _seal(data[:-3] if data.endswith(b"\n}\n") else data)


def _read_native(directory: Path) -> None:
    """What a user does with a checkpoint: inspect it, and load and verify what inspects."""
    sp.inspect(directory)
    sp.load(directory, framework="numpy")
    sp.verify(directory)


def _manifest_target(name: str, sharded: bool, reseal: bool) -> Target:
    homes: dict[Path, Path] = {}

    def seeds(scratch: Path) -> list[bytes]:
        home, found = _checkpoints(scratch, sharded)
        homes[scratch] = home
        return found

    def parse(data: bytes, scratch: Path) -> None:
        home = homes[scratch]
        (home / mf.NAME).write_bytes(_reseal(data) if reseal else data)
        _read_native(home)

    return Target(name, seeds, parse, tokens=MANIFEST_TOKENS, text=True)


register(_manifest_target("manifest", sharded=False, reseal=True))
register(_manifest_target("manifest:raw", sharded=False, reseal=False))
register(_manifest_target("manifest:v2", sharded=True, reseal=True))


# -- incremental manifests (versions 4 and 5: tensors and shards as blob recipes) ----------------

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
BLOB_TOKENS = (
    b'"blobs":{"digest":"blake3","size":',
    b'"chunk":65536',
    b'"chunk":1073741824',
    b'"base_xxh3":[',
    b'"patches":[{"blob":"',
    b'"block":512,"count":',
    b'"format_version": 5',
    b'"blob_store": "../blobs"',
    b'"blob_store": "../../../x"',
    b'"world_size": 2',
    *MANIFEST_TOKENS,
)


def _blob_target() -> Target:
    """The golden incremental checkpoints (v4, v4 sharded, v5 patched) in one directory whose
    ``../blobs`` holds all their blobs: a mutated manifest is read against real blobs."""
    homes: dict[Path, Path] = {}

    def seeds(scratch: Path) -> list[bytes]:
        root = scratch / "blobs-home"
        shutil.rmtree(root, ignore_errors=True)
        (root / "ck").mkdir(parents=True)
        found = []
        for name in ("v4", "v4-sharded", "v5"):
            golden = GOLDEN / name
            shutil.copytree(golden / "blobs", root / "blobs", dirs_exist_ok=True)
            for f in (golden / "ck").iterdir():
                if f.name != mf.NAME:
                    shutil.copyfile(f, root / "ck" / f.name)
            found.append((golden / "ck" / mf.NAME).read_bytes())
        homes[scratch] = root / "ck"
        return found

    def parse(data: bytes, scratch: Path) -> None:
        home = homes[scratch]
        (home / mf.NAME).write_bytes(_reseal(data))
        _read_native(home)

    return Target("manifest:blobs", seeds, parse, tokens=BLOB_TOKENS, text=True)


register(_blob_target())


# -- version 7 (regular layouts): the manifest, and a rank's index file against it ----------------

GRID_TOKENS = (
    b'"mesh": [',
    b'"grid":[0,null]',
    b'"grid":[null,null]',
    b'"world_size": 4',
    b'"index-r00001.json":{"size":',
    b'{"shards":{"model/w":[',
    *MANIFEST_TOKENS,
)


def _grid_target(index: bool) -> Target:
    """The golden version 7 checkpoint: a mutated manifest (resealed), or a mutated index file
    (``index``: its record in the manifest rewritten to match, as a writer would have)."""
    homes: dict[Path, Path] = {}
    index_name = "index-r00000.json"

    def seeds(scratch: Path) -> list[bytes]:
        home = scratch / "v7"
        shutil.rmtree(home, ignore_errors=True)
        shutil.copytree(GOLDEN / "v7", home)
        homes[scratch] = home
        return [(home / (index_name if index else mf.NAME)).read_bytes()]

    def parse(data: bytes, scratch: Path) -> None:
        home = homes[scratch]
        if not index:
            (home / mf.NAME).write_bytes(_reseal(data))
            return _read_native(home)
        golden = (GOLDEN / "v7" / mf.NAME).read_bytes()
        old = (GOLDEN / "v7" / index_name).read_bytes()
        record = f'"{index_name}":{{"size":{len(old)},"xxh3":"{checksum.digest(old)}"}}'
        fresh = f'"{index_name}":{{"size":{len(data)},"xxh3":"{checksum.digest(data)}"}}'
        assert record.encode() in golden
        (home / index_name).write_bytes(data)
        (home / mf.NAME).write_bytes(_reseal(golden.replace(record.encode(), fresh.encode())))
        return _read_native(home)

    name = "manifest:v7-index" if index else "manifest:v7"
    return Target(name, seeds, parse, tokens=GRID_TOKENS, text=True)


register(_grid_target(index=False))
register(_grid_target(index=True))

# -- a native checkpoint's data file -----------------------------------------------------------

_NATIVE: dict[Path, tuple[Path, dict[str, str], str]] = {}


def _head(members: dict[str, str]) -> bytes:
    """The head of a manifest from its top-level members (raw JSON text), as dumps lays it out."""
    return ("{\n" + ",\n".join(f" {json.dumps(k)}: {v}" for k, v in members.items())).encode()


def _native_seeds(scratch: Path) -> list[bytes]:
    home = scratch / "native"
    shutil.rmtree(home, ignore_errors=True)
    state, metadata = _states()[0]
    sp.save(home, state, metadata=metadata)
    raw = (home / mf.NAME).read_bytes()
    doc = json.loads(raw[: raw.rfind(_TRAILER)] + b"\n}")
    members = {k: json.dumps(v, separators=(",", ":")) for k, v in doc.items()}
    (data_file,) = doc["files"]
    _NATIVE[scratch] = (home, members, data_file)
    original = (home / data_file).read_bytes()
    n = struct.unpack("<Q", original[:8])[0]
    # The committed file, and one whose header lists its tensors in another order.
    header = json.loads(original[8 : 8 + n])
    reordered = json.dumps(dict(reversed(list(header.items()))), separators=(",", ":")).encode()
    reordered += b" " * (n - len(reordered))
    seeds = [original]
    if len(reordered) == n:
        seeds.append(original[:8] + reordered + original[8 + n :])
    return seeds


def _parse_native_data(data: bytes, scratch: Path) -> None:
    home, members, data_file = _NATIVE[scratch]
    (home / data_file).write_bytes(data)
    manifests = [_seal(_head(members))]
    # Also against a manifest whose record of the file matches the mutated one, so mutations of
    # the header and the data reach the checks behind the size and header checksum.
    if len(data) >= 8:
        header_size = 8 + struct.unpack("<Q", data[:8])[0]
        if header_size <= len(data):
            record = {
                "size": len(data),
                "header_size": header_size,
                "header_xxh3": checksum.digest(data[:header_size]),
            }
            files = json.dumps({data_file: record}, separators=(",", ":"))
            manifests.append(_seal(_head({**members, "files": files})))
    for i, raw in enumerate(manifests):
        (home / mf.NAME).write_bytes(raw)
        try:
            _read_native(home)
        except sp.CheckpointError:
            if i == len(manifests) - 1:
                raise


register(
    Target(
        "native_data_file",
        _native_seeds,
        _parse_native_data,
        tokens=(b'"dtype":"F16"', b'"shape":[', b'"data_offsets":[', b"__metadata__"),
        text=True,
    )
)


# -- safetensors -------------------------------------------------------------------------------

SAFETENSORS_TOKENS = (
    b'"__metadata__":{"format":"pt"}',
    b'"dtype":"BF16"',
    b'"dtype":"F8_E4M3"',
    b'"shape":[]',
    b'"data_offsets":[0,0]',
    b"\xff\xff\xff\xff\xff\xff\xff\x7f",
    b"\x08\x00\x00\x00\x00\x00\x00\x00",
)


def _safetensors_seeds(scratch: Path) -> list[bytes]:
    from safetensors.numpy import save as hf_save

    model = {k: v for k, v in _model().items() if v.dtype != _BF16}
    seeds = [hf_save(model, metadata={"format": "np", "note": "é"}), hf_save({"x": model["mask"]})]
    for i, meta in enumerate(({"producer": "savepoint"}, None)):
        path = scratch / f"seed{i}.safetensors"
        path.unlink(missing_ok=True)
        items = [(k, _files.ArrayTensor.of(v, k)) for k, v in _model(i).items()]
        _files.write_safetensors(str(path), [(k, t) for k, t in items if t is not None], meta)
        seeds.append(path.read_bytes())
    return seeds


def _parse_safetensors_header(data: bytes, scratch: Path) -> None:
    n = st_format.header_length(data[:8], len(data))
    st_format.parse_header(data[8 : 8 + n], len(data))


def _parse_safetensors_file(data: bytes, scratch: Path) -> None:
    path = scratch / "fuzz.safetensors"
    path.write_bytes(data)
    detect.inspect_any(path)
    detect.verify_any(path)
    sp.convert(path, scratch / "converted", overwrite=True)


register(
    Target(
        "safetensors_header",
        _safetensors_seeds,
        _parse_safetensors_header,
        tokens=SAFETENSORS_TOKENS,
        text=True,
    )
)
register(
    Target(
        "safetensors_file",
        _safetensors_seeds,
        _parse_safetensors_file,
        tokens=SAFETENSORS_TOKENS,
        text=True,
    )
)


# -- boostr JSON documents ---------------------------------------------------------------------

BOOSTR_TOKENS = (
    b'"version": 2',
    b'"version": 1',
    b'"step": 18446744073709551615',
    b'"step": 18446744073709551616',
    b'"learning_rate": 1e400',
    b'"learning_rate": -0',
    b'"epoch": 1.0',
    b'"metadata": {"k": 1}',
    b'"strategy": "TensorParallel"',
    b'"strategy": {"ZeroPartitioned": {"stage": 3}}',
    b'"strategy": {"Replicated": null}',
    b'"split_dims": {"w": 0}',
    b'"owned_params": ["w", "b"]',
    b'"rank": 1',
    b'"world_size": 2',
)

_BOOSTR: dict[Path, Path] = {}


def _boostr_home(scratch: Path) -> Path:
    """A single checkpoint and a distributed one of 2 ranks, built once per scratch directory."""
    home = _BOOSTR.get(scratch)
    if home is not None:
        return home
    home = scratch / "boostr"
    shutil.rmtree(home, ignore_errors=True)
    model = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(3, np.float16)}
    optimizer = {"w.m": np.zeros((2, 3), np.float32), "b.m": np.zeros(3, np.float16)}
    state = boostr.TrainingState(step=50, epoch=2, learning_rate=3e-4, metadata={"run": "é"})
    boostr.save(home / "single", model, optimizer, state)
    for r in range(2):
        boostr.save(home / "dist" / f"rank_{r}", model, optimizer, state)
    _BOOSTR[scratch] = home
    return home


def _state_seeds(scratch: Path) -> list[bytes]:
    _boostr_home(scratch)
    state = boostr.TrainingState(step=50, epoch=2, learning_rate=3e-4, metadata={"a": "b", "é": ""})
    return [
        state.to_json(),
        b'{"step": 7}',
        b'{"step": 7, "epoch": 1, "learning_rate": 1, "metadata": {}}',
        b'{"version": 2, "step": 18446744073709551615, "learning_rate": 1e-08, "extra": [1, 2]}',
        b'{\n  "version": 1,\n  "step": 0,\n  "learning_rate": -0.0\n}',
    ]


def _config(rank: int, strategy: Any, owned: list[str], split: dict[str, int] | None) -> Any:
    doc: dict[str, Any] = {"world_size": 2, "rank": rank, "owned_params": owned}
    doc["strategy"] = strategy
    if split is not None:
        doc["split_dims"] = split
    return doc


def _meta_seeds(scratch: Path) -> list[bytes]:
    _boostr_home(scratch)
    docs = [
        [_config(r, "Replicated", [], None) for r in range(2)],
        [_config(r, {"ZeroPartitioned": {"stage": 2}}, [["w"], ["b"]][r], {}) for r in range(2)],
        [_config(r, "TensorParallel", [], {"w": 0}) for r in range(2)],
        [_config(r, {"Replicated": None}, ["w", "b"] if r == 0 else [], None) for r in range(2)],
    ]
    return [
        json.dumps({"version": 2, "world_size": 2, "shards": shards}, indent=2).encode()
        for shards in docs
    ]


def _parse_training_state(data: bytes, scratch: Path) -> None:
    single = _boostr_home(scratch) / "single"
    (single / boostr.STATE).write_bytes(data)
    detect.inspect_any(single)
    boostr.load(single)


def _parse_sharding_meta(data: bytes, scratch: Path) -> None:
    dist = _boostr_home(scratch) / "dist"
    (dist / boostr.SHARDING).write_bytes(data)
    boostr.read_sharding_meta(dist)
    detect.verify_any(dist)
    boostr.load_distributed(dist, 1)


register(
    Target(
        "boostr_json:training_state",
        _state_seeds,
        _parse_training_state,
        tokens=BOOSTR_TOKENS,
        text=True,
    )
)
register(
    Target(
        "boostr_json:sharding_meta",
        _meta_seeds,
        _parse_sharding_meta,
        tokens=BOOSTR_TOKENS,
        text=True,
    )
)


# -- savepoint's own JSON files: a run's books, its blob store, its tiers, locks and pointers ------
#
# Each is parsed by the bounded reader (codecs.bounded_json); each target writes the input where
# the file lives in a real incremental run (in memory: no fsync per input) and calls what reads
# it: a run view, a load, a writer's clearing of dead records with a save session and a
# collection, a manager with a tier, a lease, the lock's holder, a load of an alias pointer.

_RUN_OPTIONS: dict[str, Any] = {
    "incremental": True,
    "keep_last": 2,
    "blob_policy": BlobPolicy(chunk_size=4096, min_blob_bytes=1024),
}
_RUNS: dict[tuple[Path, bool], Location] = {}
RUN_TOKENS = (
    b'"version": 2',
    b'"version": 3',
    b'"checkpoints": [2, 1]',
    b'"best": {"step": 2, "value": 1.0}',
    b'"latest_step": 2',
    b'"format": "savepoint-blobs"',
    b'"digest": "xxh3-128"',
    b'"kind": "gc"',
    b'"pid": 1',
    b'"expires": 1e400',
    b'"run": ',
    b'{"step":3,"loss":NaN}\n',
    b'"savepoint_alias": 1',
    b'"target": "../checkpoints/step-0000000001"',
    b"[" * 1100,  # past json's recursion limit (the bounded reader stops at 512)
    b'{"k":' * 600,
)


def _deep(doc: bytes) -> bytes:
    """``doc`` nested 1,100 arrays deep: past json's recursion limit (the bounded reader refuses
    more than 512 levels before parsing), so the bounded slice always tries one."""
    return b"[" * 1100 + doc.strip() + b"]" * 1100 + b"\n"


def _run_state(step: int) -> dict[str, Any]:
    return {"w": np.arange(1500, dtype=np.float32) + step, "step": step, "lr": 1e-3}


def _run_home(scratch: Path, atomic_rename: bool = True) -> Location:
    """An incremental run of two steps with a loss history and a tier, in memory (pointer
    aliases without ``atomic_rename``), built once per scratch directory."""
    key = (scratch, atomic_rename)
    if key not in _RUNS:
        store = MemoryStore(atomic_rename=atomic_rename)
        run = store.at("/b/run")
        with sp.CheckpointManager(run, tiers=[Tier(store.url("/b/tier"))], **_RUN_OPTIONS) as m:
            for step in (1, 2):
                m.log(step, loss=1.0 / step, metrics={"acc": 0.5})
                m.save(step, _run_state(step), metrics={"val": float(step)})
        _RUNS[key] = run
    return _RUNS[key]


def _file_target(name: str, where: str, call: Any, atomic_rename: bool = True) -> Target:
    """Input written at ``where`` (relative to the run's parent), then ``call(run)``."""

    def seeds(scratch: Path) -> list[bytes]:
        run = _run_home(scratch, atomic_rename)
        real = run.store.read_small(f"/b/{where}", cap=None)
        return [real, _deep(real)]

    def parse(data: bytes, scratch: Path) -> None:
        run = _run_home(scratch, atomic_rename)
        run.store.put(f"/b/{where}", data, exclusive=False)
        call(run)

    return Target(name, seeds, parse, tokens=RUN_TOKENS, text=True)


def _view(run: Location) -> None:
    view = sp.open_run(run)
    assert view.info is not None
    view.steps()
    _ = view.report


def _load_step(run: Location) -> None:
    sp.load(run.join("checkpoints", "step-0000000002"))


def _with_tier(run: Location) -> None:
    sp.CheckpointManager(run, tiers=[Tier(run.store.url("/b/tier"))], **_RUN_OPTIONS).close()


for _where in ("report.json", "run.json"):
    register(_file_target(f"run_json:{_where}", f"run/{_where}", _view))
# The history log: in memory (no appends) its segments, one per save here.
register(_file_target("run_json:history", "run/history/000000000002-000000000002.jsonl", _view))
register(_file_target("blob_store_json", "run/blobs/store.json", _load_step))
register(_file_target("tier_json", "tier/tier.json", _with_tier))
register(
    _file_target(
        "alias_pointer",
        f"run/latest/{pointer.NAME}",
        lambda run: sp.load(run.join("latest")),
        atomic_rename=False,
    )
)


def _record_target(kind: str) -> Target:
    """A save's record under ``blobs/sessions/`` or a collection's under ``blobs/gc/``: a
    writer's clearing of dead records, a save session and a collection read it."""
    folder = "sessions" if kind == "save" else "gc"

    def seeds(scratch: Path) -> list[bytes]:
        _run_home(scratch)
        real = blob_gc._record(kind)
        return [real, blob_gc._record("gc" if kind == "save" else "save"), _deep(real)]

    def parse(data: bytes, scratch: Path) -> None:
        run = _run_home(scratch)
        record = run.join("blobs", folder, "fuzzed.json").path
        run.store.put(record, data, exclusive=False)
        blobs = BlobStore(run.store, run.join("blobs").path, create=False)
        blob_gc.clear_dead_records(blobs)
        with contextlib.suppress(sp.CheckpointWriteError):  # a live collection: no wait
            with blobs.session(wait=0):
                pass
        collect(blobs, [], grace=3600)  # deletes no blob (all younger than an hour)
        with contextlib.suppress(FileNotFoundError):
            run.store.remove(record)

    return Target(f"blob_record:{folder}", seeds, parse, tokens=RUN_TOKENS, text=True)


register(_record_target("save"))
register(_record_target("gc"))

_LEASES: dict[Path, MemoryStore] = {}


def _lease_seeds(scratch: Path) -> list[bytes]:
    store = _LEASES.setdefault(scratch, MemoryStore(atomic_rename=False))
    store.makedirs("/b/run")
    lock = LeaseLock(store, "/b/run/.writer.lock")
    assert lock.acquire()
    held = store.read_small("/b/run/.writer.lock", cap=None)
    lock.release()
    return [held, held.replace(b'"expires": ', b'"expires": 1'), _deep(held)[:4000]]


def _parse_lease(data: bytes, scratch: Path) -> None:
    """The lease object of a run on an object store (what ``CheckpointManager("s3://...")``
    takes): a contender reads it, judges it, and takes it over when it is stale."""
    store = _LEASES[scratch]
    store.put("/b/run/.writer.lock", data, exclusive=False)
    lock = LeaseLock(store, "/b/run/.writer.lock", ttl=60)
    if lock.acquire():
        lock.release()


register(Target("lease", _lease_seeds, _parse_lease, tokens=RUN_TOKENS, text=True))


def _holder_seeds(scratch: Path) -> list[bytes]:
    run = _run_home(scratch)
    with sp.CheckpointManager(run, **_RUN_OPTIONS):
        held = run.store.read_small(run.join(LOCK_FILE).path, cap=None)
        return [held, _deep(held)[:4000]]


def _parse_holder(data: bytes, scratch: Path) -> None:
    run = _run_home(scratch)
    run.store.put(run.join(LOCK_FILE).path, data, exclusive=False)
    read_holder(run)


register(Target("writer_lock_holder", _holder_seeds, _parse_holder, tokens=RUN_TOKENS, text=True))
