"""Manifest version 2 (sharded checkpoints): layout, round trip, and hostile shard entries."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from savepoint.codecs import boxes
from savepoint.codecs import manifest as mf

from .test_manifest import encode

A = "data-r00000-00000.safetensors"
B = "data-r00001-00000.safetensors"
D = "0123456789abcdef"


def sample() -> mf.Manifest:
    tree = {
        "t": "dict",
        "items": [
            ["w", {"t": "tensor", "ref": "w", "kind": "torch"}],
            ["f", {"t": "tensor", "ref": "f", "kind": "torch"}],
            ["r", {"t": "tensor", "ref": "r", "kind": "numpy"}],
            ["s", {"t": "tensor", "ref": "s", "kind": "numpy_scalar"}],
        ],
    }
    w = (
        mf.ShardRecord(A, 64, 112, D, ((0, 2), (0, 6))),
        mf.ShardRecord(B, 64, 112, D, ((2, 4), (0, 6))),
    )
    f = (
        mf.ShardRecord(A, 112, 140, D, boxes.Flat(0, 7)),
        mf.ShardRecord(B, 112, 132, D, boxes.Flat(7, 12)),
    )
    return mf.Manifest(
        tree=tree,
        files={
            A: mf.FileRecord(size=160, header_size=64, header_xxh3=D),
            B: mf.FileRecord(size=132, header_size=64, header_xxh3=D),
        },
        tensors={
            "w": mf.whole("F32", (4, 6), w),
            "f": mf.whole("F32", (3, 4), f),
            "r": mf.whole("F32", (3,), (mf.ShardRecord(A, 140, 152, D, ((0, 3),)),)),
            "s": mf.whole("F64", (), (mf.ShardRecord(A, 152, 160, D, ()),)),
        },
        metadata={"step": 3},
        writer="savepoint 0.1.0",
        created="2026-01-01T00:00:00Z",
        format_version=mf.SHARDED,
        world_size=2,
    )


def doc() -> dict[str, Any]:
    d = json.loads(mf.dumps(sample()))
    del d["manifest_xxh3"]
    return d


def test_layout_and_round_trip() -> None:
    raw = mf.dumps(sample())
    assert raw.startswith(b'{\n "format": "savepoint",\n "format_version": 2,\n')
    d = json.loads(raw)
    assert list(d)[:7] == [
        "format",
        "format_version",
        "writer",
        "created",
        "checksum",
        "world_size",
        "metadata",
    ]
    assert d["world_size"] == 2
    assert d["tensors"]["w"]["shards"][1] == {
        "file": B,
        "offsets": [64, 112],
        "xxh3": D,
        "box": [[2, 4], [0, 6]],
    }
    assert d["tensors"]["f"]["shards"][0]["flat"] == [0, 7]
    assert d["tensors"]["s"]["shards"][0]["box"] == []
    back = mf.parse(raw)
    assert back == sample()
    assert back.sharded and back.world_size == 2
    assert back.tensors["w"].is_split and back.tensors["w"].file == ""
    assert back.tensors["w"].nbytes == 96
    # a tensor in one shard is also a plain record: readers map it directly
    r = back.tensors["r"]
    assert not r.is_split and (r.file, r.start, r.end) == (A, 140, 152)


def test_unsharded_manifests_stay_version_1_byte_for_byte() -> None:
    m = sample()
    v1 = mf.Manifest(
        tree={"t": "dict", "items": [["r", {"t": "tensor", "ref": "r", "kind": "numpy"}]]},
        files={A: m.files[A]},
        tensors={"r": mf.TensorRecord("F32", (3,), A, 140, 152, D)},
        writer="w",
        created="c",
    )
    raw = mf.dumps(v1)
    assert b'"format_version": 1' in raw and b"world_size" not in raw and b"shards" not in raw
    assert mf.parse(raw) == v1


def refused(d: dict[str, Any], *words: str) -> None:
    with pytest.raises(mf.ManifestError) as info:
        mf.parse(encode(d))
    for w in words:
        assert w in str(info.value), str(info.value)


def shard(d: dict[str, Any], key: str = "w", i: int = 0) -> dict[str, Any]:
    result: dict[str, Any] = d["tensors"][key]["shards"][i]
    return result


@pytest.mark.parametrize("value", [0, -1, None, "2", 1.0, True])
def test_world_size_must_be_a_positive_integer(value: Any) -> None:
    d = doc()
    d["world_size"] = value
    refused(d, "world_size")


def test_world_size_is_required() -> None:
    d = doc()
    del d["world_size"]
    refused(d, "world_size")


def test_version_1_tensor_entries_are_refused_in_version_2() -> None:
    d = doc()
    d["tensors"]["r"] = {"dtype": "F32", "shape": [3], "file": A, "offsets": [140, 152], "xxh3": D}
    refused(d, "'r'", "dtype, shape, shards")


def _mixed(d: dict[str, Any]) -> None:
    shard(d, "f").update(flat=[0, 8], offsets=[112, 144])
    d["tensors"]["f"]["shards"][1] = {
        "file": B,
        "offsets": [112, 128],
        "xxh3": D,
        "box": [[2, 3], [0, 4]],
    }


HOSTILE: dict[str, tuple[Any, tuple[str, ...]]] = {
    # (mutation of the document, words the error must contain)
    "no shards": (lambda d: d["tensors"]["w"].update(shards=[]), ("non-empty",)),
    "shards not a list": (lambda d: d["tensors"]["w"].update(shards={"0": 1}), ("non-empty",)),
    "both box and flat": (lambda d: shard(d).update(flat=[0, 12]), ("one of box, flat",)),
    "neither box nor flat": (lambda d: shard(d).pop("box"), ("one of box, flat",)),
    "extra member": (lambda d: shard(d).update(rank=0), ("one of box, flat",)),
    "unknown file": (lambda d: shard(d).update(file="other.safetensors"), ("unknown file",)),
    "path in file": (lambda d: shard(d).update(file="../" + A), ("unknown file",)),
    "offsets past the file": (lambda d: shard(d).update(offsets=[150, 198]), ("outside the data",)),
    "offsets in the header": (lambda d: shard(d).update(offsets=[0, 48]), ("outside the data",)),
    "bad checksum": (lambda d: shard(d).update(xxh3="nothex!!nothex!!"), ("bad checksum",)),
    "box with too few dims": (lambda d: shard(d).update(box=[[0, 2]]), ("one [start, stop]",)),
    "box with too many dims": (
        lambda d: shard(d).update(box=[[0, 2], [0, 6], [0, 1]]),
        ("one [start, stop]",),
    ),
    "box reversed": (lambda d: shard(d).update(box=[[2, 0], [0, 6]]), ("start <= stop",)),
    "box negative": (lambda d: shard(d).update(box=[[-2, 0], [0, 6]]), ("one [start, stop]",)),
    "box not integers": (lambda d: shard(d).update(box=[[0.0, 2], [0, 6]]), ("one [start, stop]",)),
    "box bool": (lambda d: shard(d).update(box=[[False, True], [0, 6]]), ("one [start, stop]",)),
    "box outside the shape": (
        lambda d: shard(d, i=1).update(box=[[2, 5], [0, 6]], file=A, offsets=[64, 136]),
        ("outside shape", "[2:5, 0:6]"),
    ),
    "bytes disagree with the box": (
        lambda d: shard(d).update(offsets=[64, 100]),
        ("36 bytes recorded", "[0:2, 0:6] of F32 needs 48"),
    ),
    "overlapping boxes": (
        lambda d: shard(d, i=1).update(box=[[1, 3], [0, 6]]),
        ("do not tile", "overlap"),
    ),
    "a gap between boxes": (
        lambda d: shard(d, i=1).update(box=[[3, 4], [0, 6]], offsets=[64, 88]),
        ("do not tile", "18 of 24"),
    ),
    "the same shard twice": (
        lambda d: d["tensors"]["w"]["shards"].append(copy.deepcopy(shard(d))),
        ("overlap",),
    ),
    "flat ranges overlap": (
        lambda d: shard(d, "f", 1).update(flat=[6, 11]),
        ("flat ranges overlap",),
    ),
    "flat ranges leave a gap": (
        lambda d: shard(d, "f", 1).update(flat=[8, 13]),
        ("outside shape",),
    ),
    "flat range reversed": (lambda d: shard(d, "f").update(flat=[7, 0]), ("start <= stop",)),
    "flat past the end": (
        lambda d: shard(d, "f", 1).update(flat=[7, 20], file=A, offsets=[100, 152]),
        ("outside shape",),
    ),
    "mixed kinds": (lambda d: _mixed(d), ("mixes flat ranges and boxes",)),
    "empty shard": (
        lambda d: d["tensors"]["w"]["shards"].append(
            {"file": A, "offsets": [64, 64], "xxh3": D, "box": [[4, 4], [0, 6]]}
        ),
        ("no element",),
    ),
    "a 0-d tensor with a box": (lambda d: shard(d, "s").update(box=[[0, 1]]), ("one [start, stop]",)),
    "shape not a list": (lambda d: d["tensors"]["w"].update(shape="4x6"), ("shape must be",)),
    "unknown dtype": (lambda d: d["tensors"]["w"].update(dtype="F128"), ("unknown dtype",)),
}  # fmt: skip


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_shard_entries_are_refused(case: str) -> None:
    mutate, words = HOSTILE[case]
    d = doc()
    mutate(d)
    refused(d, *words)


def test_shards_in_any_order_are_accepted() -> None:
    d = doc()
    d["tensors"]["w"]["shards"].reverse()
    d["tensors"]["f"]["shards"].reverse()
    parsed = mf.parse(encode(d))
    assert [s.region for s in parsed.tensors["w"].shards] == [((2, 4), (0, 6)), ((0, 2), (0, 6))]


def test_a_single_box_of_a_tensor_without_elements() -> None:
    d = doc()
    d["tensors"]["w"] = {
        "dtype": "F32",
        "shape": [0, 6],
        "shards": [{"file": A, "offsets": [64, 64], "xxh3": D, "box": [[0, 0], [0, 6]]}],
    }
    assert mf.parse(encode(d)).tensors["w"].nbytes == 0
    d["tensors"]["w"]["shards"].append(dict(d["tensors"]["w"]["shards"][0]))
    refused(d, "exactly one shard")


def test_shard_names_and_stored_shapes() -> None:
    assert mf.shard_name("w", ((0, 4), (0, 6)), (4, 6)) == "w"
    assert mf.shard_name("w", ((2, 4), (0, 6)), (4, 6)) == "w@2,0"
    assert mf.shard_name("f", boxes.Flat(7, 12), (3, 4)) == "f@7"
    assert mf.shard_name("f", boxes.Flat(0, 12), (3, 4)) == "f"
    assert mf.shard_shape(((2, 4), (1, 6))) == (2, 5)
    assert mf.shard_shape(boxes.Flat(7, 12)) == (5,)
    assert mf.shard_shape(()) == ()
