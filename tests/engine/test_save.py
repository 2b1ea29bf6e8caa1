"""savepoint.engine.plan and engine.save: files planned as data, written by ``writers`` threads,
committed through one transaction."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import savepoint as sp
from _concurrency import CountingStore
from savepoint.codecs import manifest as mf
from savepoint.engine import plan, sinks
from savepoint.engine import save as save_engine
from savepoint.state import tree


def sources(*sizes: int) -> dict[str, Any]:
    return tree.flatten({f"t{i}": np.zeros(n, np.uint8) for i, n in enumerate(sizes)}).tensors


@pytest.mark.parametrize(
    ("sizes", "cap", "files"),
    [
        ((), 100, [[]]),
        ((10, 20, 30), 100, [["t0", "t1", "t2"]]),
        ((60, 50, 10), 100, [["t0"], ["t1", "t2"]]),
        ((200, 10), 100, [["t0"], ["t1"]]),  # a tensor bigger than the cap gets a file alone
        ((10, 200, 10), 100, [["t0"], ["t1"], ["t2"]]),
        ((100, 0, 1), 100, [["t0", "t1"], ["t2"]]),
    ],
)
def test_plan_files(sizes: tuple[int, ...], cap: int, files: list[list[str]]) -> None:
    plans = plan.plan_files(sources(*sizes), cap)
    assert [sorted(p.tensors) for p in plans] == files
    assert [p.name for p in plans] == [f"data-{i:05d}.safetensors" for i in range(len(files))]
    for p in plans:
        assert p.size == len(p.header) + sum(e.end - e.start for e in p.entries)


def test_plan_files_names() -> None:
    plans = plan.plan_files(sources(60, 60), 100, lambda i: f"data-r00003-{i:05d}.safetensors")
    assert [p.name for p in plans] == [
        "data-r00003-00000.safetensors",
        "data-r00003-00001.safetensors",
    ]


@pytest.mark.parametrize("writers", [1, 3])
def test_writers_write_files_at_once(writers: int) -> None:
    store = CountingStore()
    state = {f"w{i}": np.full(1000, i, np.float32) for i in range(6)}
    info = sp.save(store.at("/run/ckpt"), state, max_file_bytes=4000, writers=writers)
    assert len(info.files) == 6
    assert store.most == writers
    loaded = sp.load(store.at("/run/ckpt"))
    for k, v in state.items():
        np.testing.assert_array_equal(loaded[k], v)


@pytest.mark.parametrize("direct", [True, False])
def test_direct_is_passed_to_the_store(direct: bool) -> None:
    store = CountingStore()
    state = {f"w{i}": np.full(1000, i, np.float32) for i in range(3)}
    sp.save(store.at("/run/ckpt"), state, max_file_bytes=4000, direct=direct)
    assert store.direct == [direct] * 3
    with sp.AsyncCheckpointer(max_file_bytes=4000, direct=direct) as ck:
        ck.save(store.at("/run/ckpt"), state).wait()
    assert store.direct == [direct] * 6


def test_manifest_records_follow_the_state_order() -> None:
    store = CountingStore()
    state = {"b": np.ones(2000, np.float32), "a": np.ones(10), "c": np.ones(3000, np.int8)}
    directory, manifest = save_engine.save_flat(
        store.at("/run/ckpt"), tree.flatten(state), {}, max_file_bytes=4000, writers=2
    )
    assert list(manifest.tensors) == ["b", "a", "c"]
    assert mf.parse(store.read_small(f"{directory}/manifest.json", cap=None)) == manifest


@pytest.mark.parametrize("bad", [{"x": float("nan")}, {"x": object()}, ["not", "a", "mapping"]])
def test_metadata_is_checked(bad: Any) -> None:
    with pytest.raises(sp.UnsupportedStateError):
        save_engine.check_metadata(bad)


def test_has_shards() -> None:
    plain = tree.flatten({"w": np.ones(3)}).tree
    sharded = tree.flatten({"w": sp.Shard(np.ones(3), (6,), (0,))}).tree
    assert not save_engine.has_shards(plain)
    assert save_engine.has_shards(sharded)


def test_the_manifest_builder_merges_sinks_in_the_state_order() -> None:
    """new_manifest (the writer's step 3): several sinks' records in the state's order, the
    newest version any sink needs, the blob store a sink names."""
    rec = mf.TensorRecord.plain
    files = sinks.Written(
        {"data-00000.safetensors": mf.FileRecord(24, 16, "0" * 16)},
        {"b": rec("uint8", (8,), "data-00000.safetensors", 16, 24, "1" * 16)},
    )
    blobs = sinks.Written(
        {}, {"a": rec("uint8", (8,), "", 0, 8, "2" * 16)}, mf.BLOBS, ("../blobs", "blake3")
    )
    manifest = save_engine.new_manifest({}, [files, blobs], {"k": 1}, order=["a", "b"])
    assert list(manifest.tensors) == ["a", "b"]
    assert list(manifest.files) == ["data-00000.safetensors"]
    assert manifest.format_version == mf.BLOBS
    assert (manifest.blob_store, manifest.blob_digest) == ("../blobs", "blake3")
    assert manifest.metadata == {"k": 1} and manifest.world_size is None
    alone = save_engine.new_manifest({}, [files], {})
    assert alone.tensors is files.tensors and alone.format_version == mf.UNSHARDED


def test_a_streamed_tree_is_dropped_before_the_manifest_is_built(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save that owns a big state keeps its tree as compressed text: nothing in the writer
    holds the tree's dicts while the manifest is encoded (190 MB at a million tensors)."""
    import weakref

    class Node(dict):  # type: ignore[type-arg]  # (a dict that can be weakly referenced)
        pass

    monkeypatch.setattr(plan, "STREAM_ENTRIES", 2)
    flat = tree.flatten({f"t{i}": np.ones(3) for i in range(5)})
    flat.tree = Node(flat.tree)
    alive = weakref.ref(flat.tree)
    seen = []
    real = mf.dump
    monkeypatch.setattr(mf, "dump", lambda m, t=None: seen.append(alive()) or real(m, t))
    from savepoint.storage.paths import resolve

    _, manifest = save_engine.save_flat(
        resolve(str(tmp_path / "ck")), flat, {}, max_file_bytes=1 << 20, writers=1, release=True
    )
    assert seen == [None] and flat.tree == {}
    assert len(manifest.root()["items"]) == 5


@pytest.mark.parametrize(("max_file_bytes", "writers"), [(0, 1), (-5, 1), (100, 0)])
def test_save_options_are_validated(max_file_bytes: int, writers: int) -> None:
    store = CountingStore()
    with pytest.raises(ValueError):
        sp.save(store.at("/x"), {"w": np.ones(3)}, max_file_bytes=max_file_bytes, writers=writers)
    assert store.list("/") == []
