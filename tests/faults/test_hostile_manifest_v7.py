"""Hostile version 7 manifests and index files (regular layouts, issue 28).

The golden version 7 checkpoint (tests/golden/v7) is forged in memory: its manifest re-sealed
and, unless a case says otherwise, each index record rewritten to match the forged index, so
that only the decoder's own checks stand in the way. Every forgery must be refused with a
ManifestError (a CorruptCheckpointError) quickly and within a small memory bound: never
MemoryError, IndexError, KeyError, TypeError, ZeroDivisionError or a hang. The real paths (a
save by 4 simulated ranks, a resharding load, damage) are at the end.
"""

from __future__ import annotations

import copy
import json
import shutil
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import savepoint as sp
from savepoint.codecs import checksum
from savepoint.codecs import manifest as mf
from savepoint.distributed import Shard, layout, simulate

from ._util import deadline, forge

GOLDEN = Path(__file__).resolve().parent.parent / "golden" / "v7"
DOC: dict[str, Any] = json.loads((GOLDEN / mf.NAME).read_bytes())
del DOC["manifest_xxh3"]
INDEX: dict[str, Any] = {n: json.loads((GOLDEN / n).read_bytes()) for n in DOC["indices"]}
W0, B0 = "index-r00000.json", "index-r00001.json"
PEAK = 8 << 20


def build(
    doc: dict[str, Any], indices: dict[str, Any], reseal: bool = True
) -> tuple[bytes, dict[str, bytes]]:
    """The manifest's bytes and the index files' (``reseal``: index records made to match)."""
    doc = copy.deepcopy(doc)
    blobs = {}
    for name, body in indices.items():
        data = (
            body
            if type(body) is bytes
            else json.dumps(body, separators=(",", ":")).encode() + b"\n"
        )
        blobs[name] = data
        records = doc.get("indices")
        if reseal and type(records) is dict and type(records.get(name)) is dict:
            records[name] = {"size": len(data), "xxh3": checksum.digest(data)}
    return forge(doc), blobs


def parse(raw: bytes, blobs: dict[str, bytes]) -> mf.Manifest:
    def read_index(name: str, size: int) -> bytes:
        if name not in blobs:
            raise FileNotFoundError(name)
        return blobs[name][:size]

    return mf.parse(raw, read_index=read_index)


def refused(raw: bytes, blobs: dict[str, bytes], match: str = "", seconds: float = 5.0) -> None:
    tracemalloc.start()
    try:
        with deadline(seconds, "parse"), pytest.raises(mf.ManifestError, match=match):
            parse(raw, blobs)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < PEAK + 24 * (len(raw) + sum(map(len, blobs.values()))), peak


Edit = Callable[[dict[str, Any], dict[str, Any]], Any]


def at(*path: str, value: Any, index: bool = False) -> Edit:
    def edit(doc: dict[str, Any], indices: dict[str, Any]) -> None:
        node: Any = indices if index else doc
        for key in path[:-1]:
            node = node[int(key)] if type(node) is list else node[key]
        node[int(path[-1]) if type(node) is list else path[-1]] = value

    return edit


W_SHARD = (W0, "shards", "model/w", "0")
B_SHARD = (W0, "shards", "model/b", "0")
CASES: dict[str, tuple[Edit, str]] = {
    "mesh-zero": (at("mesh", value=[0, 2]), "mesh"),
    "mesh-negative": (at("mesh", value=[-2, -2]), "mesh"),
    "mesh-float": (at("mesh", value=[2.0, 2]), "mesh"),
    "mesh-bool": (at("mesh", value=[True, 4]), "mesh"),
    "mesh-text": (at("mesh", value="2,2"), "mesh"),
    "mesh-empty": (at("mesh", value=[]), "mesh"),
    "mesh-missing": (lambda d, i: d.pop("mesh"), "mesh"),
    "mesh-10**12-cells": (at("mesh", value=[10**6, 10**6]), "world_size"),
    "mesh-overflowing": (at("mesh", value=[2**64, 2**64, 0]), "mesh"),
    "world-10**15": (at("world_size", value=10**15), "world_size"),
    "world-zero": (at("world_size", value=0), "world_size"),
    "world-text": (at("world_size", value="4"), "world_size"),
    "grid-too-long": (at("tensors", "model/w", "grid", value=[0, None, None]), "grid"),
    "grid-dimension-outside": (at("tensors", "model/w", "grid", value=[5, None]), "grid"),
    "grid-negative": (at("tensors", "model/w", "grid", value=[-1, None]), "grid"),
    "grid-bool": (at("tensors", "model/w", "grid", value=[True, None]), "grid"),
    "grid-text": (at("tensors", "model/w", "grid", value="0"), "grid"),
    "grid-missing": (lambda d, i: d["tensors"]["model/w"].pop("grid"), "grid"),
    # The grid must give the pieces the indices hold (a reader of some ranks' indices trusts it).
    "grid-says-replicated": (at("tensors", "model/w", "grid", value=[None, None]), "its grid"),
    "grid-other-dimension": (at("tensors", "model/w", "grid", value=[1, None]), "its grid"),
    "grid-says-split": (at("tensors", "replicated", "grid", value=[0, None]), "its grid"),
    "grid-on-a-bigger-mesh": (
        lambda d, i: (d.__setitem__("world_size", 8), d.__setitem__("mesh", [4, 2])),
        "its grid",
    ),
    "tensor-pieces-listed": (at("tensors", "model/w", "shards", value=[]), "grid"),
    "tensor-not-object": (at("tensors", "model/w", value=3), "grid"),
    "tensors-list": (at("tensors", value=[]), "tensors"),
    "shape-10**30": (at("tensors", "model/w", "shape", value=[10**15, 10**15]), "too large"),
    "shape-negative": (at("tensors", "model/w", "shape", value=[-384, 256]), "shape"),
    "shape-zero": (at("tensors", "model/w", "shape", value=[0, 256]), "outside"),
    "dtype-int": (at("tensors", "model/w", "dtype", value=3), "dtype"),
    "tensor-without-pieces": (
        at("tensors", "extra", value={"dtype": "F32", "shape": [2], "grid": [None, None]}),
        "no index",
    ),
    "blob-store": (at("blob_store", value="x"), "blob store"),
    "indices-list": (at("indices", value=[]), "indices"),
    "indices-missing": (lambda d, i: d.pop("indices"), "indices"),
    "index-name-escapes": (
        lambda d, i: d["indices"].__setitem__("../x", d["indices"].pop(B0)),
        "plain file name",
    ),
    "index-name-is-a-data-file": (
        lambda d, i: d["indices"].__setitem__(
            "data-r00000-00000.safetensors", d["indices"].pop(B0)
        ),
        "plain file name",
    ),
    "index-file-missing": (lambda d, i: i.pop(B0), "missing"),
    "index-listed-twice-same-pieces": (
        lambda d, i: (
            d["indices"].__setitem__("index-r00009.json", {}),
            i.__setitem__("index-r00009.json", i[W0]),
        ),
        "overlap",
    ),
    "index-not-object": (at(B0, value=[], index=True), "shards"),
    "index-extra-member": (at(B0, "x", value=1, index=True), "shards"),
    "index-shards-list": (at(B0, "shards", value=[], index=True), "shards"),
    "index-tensor-unlisted": (at(W0, "shards", "zz", value=[], index=True), "not in the manifest"),
    "index-tensor-not-list": (at(W0, "shards", "model/b", value={}, index=True), "list shards"),
    "shard-not-object": (at(*B_SHARD, value=5, index=True), "entry must have"),
    "shard-box-text": (at(*B_SHARD, "box", value="x", index=True), "box"),
    "shard-box-10**30": (at(*B_SHARD, "box", value=[[0, 10**30], [0, 5]], index=True), "outside"),
    "offsets-past-file-end": (
        at(*B_SHARD, "offsets", value=[196808, 10**9], index=True),
        "outside the data",
    ),
    "offsets-negative": (at(*B_SHARD, "offsets", value=[-40, 0], index=True), "offsets"),
    "offsets-2**64": (at(*B_SHARD, "offsets", value=[0, 2**64], index=True), "offsets"),
    "shard-file-unknown": (at(*B_SHARD, "file", value="nope", index=True), "unknown file"),
    "shard-file-int": (at(*B_SHARD, "file", value=3, index=True), "unknown file"),
    "blocks-10**15": (at(*W_SHARD, "blocks", "size", value=1024, index=True), "block checksums"),
    "blocks-size-zero": (at(*W_SHARD, "blocks", "size", value=0, index=True), "block size"),
    "blocks-table-tampered": (
        at(*W_SHARD, "blocks", "xxh3", "0", value="0" * 16, index=True),
        "disagree",
    ),
    "blocks-text": (at(*W_SHARD, "blocks", value="x", index=True), "blocks"),
    "grid-not-tiled": (lambda d, i: i[W0]["shards"].pop("model/b"), "tile"),
    "duplicate-rank-piece": (
        lambda d, i: i[B0]["shards"].__setitem__("model/b", i[W0]["shards"]["model/b"]),
        "overlap",
    ),
    "index-truncated": (at(B0, value=b'{"shards":{', index=True), "JSON"),
    "index-not-utf8": (at(B0, value=b'{"shards":{"\xff":[]}}', index=True), "JSON"),
    "index-deep": (at(B0, value=b"[" * 600 + b"]" * 600, index=True), "deeper"),
    "index-repeated-key": (
        at(B0, value=b'{"shards":{"model/b":[],"model/b":[]}}', index=True),
        "duplicate",
    ),
}


def test_the_golden_forgery_is_accepted_unchanged() -> None:
    raw, blobs = build(DOC, INDEX)
    assert raw == (GOLDEN / mf.NAME).read_bytes()
    assert parse(raw, blobs).mesh == (2, 2)


@pytest.mark.parametrize("case", list(CASES))
def test_hostile_members_are_refused(case: str) -> None:
    doc, indices = copy.deepcopy(DOC), copy.deepcopy(INDEX)
    edit, match = CASES[case]
    edit(doc, indices)
    refused(*build(doc, indices), match=match)


# Read lazily (a sharded load's way), an index no piece's writer is never read.
LAZILY_ACCEPTED = {"index-listed-twice-same-pieces"}


@pytest.mark.parametrize("case", list(CASES))
def test_hostile_members_are_refused_when_read_lazily(case: str) -> None:
    doc, indices = copy.deepcopy(DOC), copy.deepcopy(INDEX)
    edit = CASES[case][0]
    edit(doc, indices)
    raw, blobs = build(doc, indices)

    def read_index(name: str, size: int) -> bytes:
        if name not in blobs:
            raise FileNotFoundError(name)
        return blobs[name][:size]

    def every_piece() -> list[Any]:
        m = mf.parse(raw, read_index=read_index, lazy=True)
        return [s for key in m.tensors for s in m.tensors[key].layout()]

    with deadline(5.0, "lazy parse"):
        if case in LAZILY_ACCEPTED:
            assert every_piece() == [
                s for t in parse(*build(DOC, INDEX)).tensors.values() for s in t.layout()
            ]
        else:
            with pytest.raises(mf.ManifestError):
                every_piece()


RECORDS: dict[str, tuple[Any, str]] = {
    "list": ([1, 2], "entry must have"),
    "size-10**15": ({"size": 10**15, "xxh3": "0" * 16}, "larger than the cap"),
    "size-negative": ({"size": -1, "xxh3": "0" * 16}, "bad size"),
    "size-float": ({"size": 354.0, "xxh3": "0" * 16}, "bad size"),
    "size-text": ({"size": "354", "xxh3": "0" * 16}, "bad size"),
    "digest-bad": ({"size": 354, "xxh3": "zz"}, "bad checksum"),
    "digest-stale": ({"size": 354, "xxh3": "0" * 16}, "does not match its recorded"),
    "size-short": ({"size": 100, "xxh3": "dc4d8d6793e0e1fd"}, "does not match its recorded"),
}


@pytest.mark.parametrize("case", list(RECORDS))
def test_hostile_index_records_are_refused(case: str) -> None:
    doc = copy.deepcopy(DOC)
    doc["indices"][W0], match = RECORDS[case]
    refused(*build(doc, INDEX, reseal=False), match=match)


def test_a_tampered_index_whose_record_was_not_updated_is_refused() -> None:
    indices = copy.deepcopy(INDEX)
    indices[W0]["shards"]["model/w"][0]["blocks"]["xxh3"][0] = "0" * 16
    refused(*build(DOC, indices, reseal=False), match=f"{W0}.*does not match")


def test_a_long_mesh_of_huge_sizes_is_refused_in_linear_time() -> None:
    # The product of 80,000 sizes of 2**62 took 12 s (each step a longer multiplication); the
    # message named the whole list (1.6 MB).
    doc = copy.deepcopy(DOC)
    doc["mesh"] = [2**62] * 80_000
    raw, blobs = build(doc, INDEX)
    started = time.perf_counter()
    with pytest.raises(mf.ManifestError, match=r"characters\) does not hold") as info:
        parse(raw, blobs)
    assert time.perf_counter() - started < 2.0
    assert len(str(info.value)) < 200


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=4),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3)
    ),
    max_leaves=6,
)


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix] if prefix else []
    children = node.items() if type(node) is dict else enumerate(node) if type(node) is list else ()
    for key, child in children:
        out += _paths(child, (*prefix, key))
    return out


DOC_PATHS = [p for p in _paths(DOC) if p[0] != "tree"]
INDEX_PATHS = _paths(INDEX)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_any_one_member_replaced_is_accepted_or_refused_as_corrupt(data: st.DataObject) -> None:
    doc, indices = copy.deepcopy(DOC), copy.deepcopy(INDEX)
    in_index = data.draw(st.booleans())
    path = data.draw(st.sampled_from(INDEX_PATHS if in_index else DOC_PATHS))
    node: Any = indices if in_index else doc
    for key in path[:-1]:
        node = node[key]
    if data.draw(st.booleans()) and type(node) is dict:
        del node[path[-1]]
    else:
        node[path[-1]] = data.draw(JSON)
    raw, blobs = build(doc, indices, reseal=data.draw(st.booleans()))
    try:
        with deadline(5.0, "parse"):
            parse(raw, blobs)
    except mf.ManifestError:
        pass


# ---------------------------------------------------------------------------------------------
# the real paths: a save by 4 simulated ranks (the real protocol and writer)
# ---------------------------------------------------------------------------------------------


def state(rank: int, world: int) -> Any:
    return simulate.model_state(
        rank, world, 6, tp=2, data=True, hidden=32, experts=2, expert_ffn=16, regular=True
    )


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("v7") / "c"
    sim = simulate.simulate_save(4, state, str(path), writer="real")
    assert all(isinstance(r, sp.CheckpointInfo) for r in sim.results), sim.results
    assert sp.verify(path).format_version == mf.GRID
    return path


@pytest.mark.parametrize("world", [2, 6])
def test_a_resharding_load_onto_another_world_size(saved: Path, world: int) -> None:
    full = sp.load(saved, framework="numpy")["model"]
    for rank in range(world):
        into = state(rank, world)
        for value in into["model"].values():
            if isinstance(value, Shard):
                value.local[...] = 0
        sp.load(saved, into=into)
        for key, value in into["model"].items():
            if isinstance(value, Shard):
                want = full[key][tuple(slice(a, b) for a, b in value.box)]
                np.testing.assert_array_equal(value.local, want, err_msg=key)


def test_a_flipped_data_byte_is_caught_naming_the_file(saved: Path, tmp_path: Path) -> None:
    shutil.copytree(saved, tmp_path / "c")
    m = mf.parse((saved / mf.NAME).read_bytes(), read_index=lambda n, s: (saved / n).read_bytes())
    piece = max((s for t in m.tensors.values() for s in t.layout()), key=lambda s: s.nbytes)
    path = tmp_path / "c" / piece.file
    data = bytearray(path.read_bytes())
    data[piece.start + 7] ^= 1
    path.write_bytes(bytes(data))
    for op in (sp.verify, sp.load):
        with pytest.raises(sp.CorruptCheckpointError, match=piece.file):
            op(tmp_path / "c")


@pytest.mark.parametrize("what", ["data", "index"])
def test_a_missing_rank_file_is_named(saved: Path, tmp_path: Path, what: str) -> None:
    shutil.copytree(saved, tmp_path / "c")
    name = "data-r00002-00000.safetensors" if what == "data" else "index-r00002.json"
    (tmp_path / "c" / name).unlink()
    for op in (sp.verify, sp.load):
        with pytest.raises(sp.CorruptCheckpointError, match=name.replace(".", r"\.")):
            op(tmp_path / "c")


def test_an_older_reader_refuses_version_7_as_incompatible(
    saved: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from savepoint.codecs.manifest import _decode

    monkeypatch.setattr(_decode, "VERSION", mf.DEVICE_CHECKS)
    for op in (sp.load, sp.verify, sp.inspect):
        with pytest.raises(sp.IncompatibleCheckpointError, match=r"version 7.*upgrade"):
            op(saved)


# ---------------------------------------------------------------------------------------------
# the save side: a Shard's Grid, as a user may build it
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "grid",
    [
        layout.Grid((0,), (0,), (0,)),  # was ZeroDivisionError
        layout.Grid((2,), (0,), (5,)),  # was IndexError
        layout.Grid((2,), (0,), ("0",)),  # type: ignore[arg-type]  # was TypeError
        layout.Grid((2, 2), (0,), (0, None)),  # was accepted (zip dropped the second dimension)
        layout.Grid((2,), (2,), (0,)),
        layout.Grid(None, (0,), (0,)),  # type: ignore[arg-type]
        "2|0|0",
    ],
    ids=[
        "mesh-zero",
        "dim-outside",
        "dim-text",
        "coord-short",
        "coord-outside",
        "mesh-none",
        "text",
    ],
)
def test_a_bad_grid_is_refused_as_unsupported(grid: Any) -> None:
    with pytest.raises(sp.UnsupportedStateError, match="grid"):
        Shard(np.zeros((1, 3), np.float32), (2, 3), (0, 0), grid=grid)
    assert Shard(np.zeros((1, 3)), (2, 3), (1, 0), grid=layout.Grid((np.int64(2),), (1,), (0,)))
