"""Manifest version 3: version 2 plus per-block checksums on large shards (layout, round trip,
hostile ``blocks`` members, and version 2 manifests still read as they were)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from savepoint.codecs import boxes, checksum
from savepoint.codecs import manifest as mf

from .test_manifest import encode

A = "data-r00000-00000.safetensors"
D = "0123456789abcdef"
BLOCK = 1024
# a flat shard of 2,600 bytes (650 floats) at offset 64: three blocks of 1 KiB, the last short
BLOCKS = ("1111111111111111", "2222222222222222", "3333333333333333")
N = 2600


def sample(version: int = mf.BLOCKED, blocked: bool = True) -> mf.Manifest:
    tree = {
        "t": "dict",
        "items": [
            ["f", {"t": "tensor", "ref": "f", "kind": "numpy"}],
            ["r", {"t": "tensor", "ref": "r", "kind": "numpy"}],
        ],
    }
    if blocked:
        big = mf.ShardRecord(
            A, 64, 64 + N, checksum.combine(BLOCKS), boxes.Flat(0, 650), BLOCK, BLOCKS
        )
    else:
        big = mf.ShardRecord(A, 64, 64 + N, D, boxes.Flat(0, 650))
    return mf.Manifest(
        tree=tree,
        files={A: mf.FileRecord(size=64 + N + 12, header_size=64, header_xxh3=D)},
        tensors={
            "f": mf.whole("F32", (650,), (big,)),
            "r": mf.whole("F32", (3,), (mf.ShardRecord(A, 64 + N, 76 + N, D, ((0, 3),)),)),
        },
        metadata={},
        writer="savepoint 0.1.0",
        created="2026-01-01T00:00:00Z",
        format_version=version,
        world_size=1,
    )


def doc() -> dict[str, Any]:
    d = json.loads(mf.dumps(sample()))
    del d["manifest_xxh3"]
    return d


def test_layout_and_round_trip() -> None:
    raw = mf.dumps(sample())
    assert raw.startswith(b'{\n "format": "savepoint",\n "format_version": 3,\n')
    d = json.loads(raw)
    assert d["tensors"]["f"]["shards"][0]["blocks"] == {"size": BLOCK, "xxh3": list(BLOCKS)}
    assert "blocks" not in d["tensors"]["r"]["shards"][0]  # small shards are checked whole
    back = mf.parse(raw)
    assert back == sample()
    f = back.tensors["f"]
    assert (f.block, f.blocks) == (BLOCK, BLOCKS)  # a tensor stored whole carries them too
    assert f.layout()[0].blocks == BLOCKS


def test_version_2_manifests_still_read_and_refuse_blocks() -> None:
    v2 = sample(mf.SHARDED, blocked=False)
    assert mf.parse(mf.dumps(v2)) == v2
    d = json.loads(mf.dumps(v2))
    del d["manifest_xxh3"]
    d["tensors"]["f"]["shards"][0]["blocks"] = {"size": BLOCK, "xxh3": list(BLOCKS)}
    d["tensors"]["f"]["shards"][0]["xxh3"] = checksum.combine(BLOCKS)
    with pytest.raises(mf.ManifestError, match="one of box, flat"):
        mf.parse(encode(d))


def blocks(d: dict[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = d["tensors"]["f"]["shards"][0]["blocks"]
    return result


HOSTILE: dict[str, tuple[Any, str]] = {
    "not an object": (lambda d: d["tensors"]["f"]["shards"][0].update(blocks=[BLOCK]), "object"),
    "extra member": (lambda d: blocks(d).update(count=3), "object with size and xxh3"),
    "size not a power of two": (lambda d: blocks(d).update(size=1000), "power of two"),
    "size too small": (lambda d: blocks(d).update(size=512), "power of two"),
    "size a float": (lambda d: blocks(d).update(size=1024.0), "power of two"),
    "size a bool": (lambda d: blocks(d).update(size=True), "power of two"),
    "too few digests": (lambda d: blocks(d).update(xxh3=list(BLOCKS[:2])), "need 3 block"),
    "too many digests": (lambda d: blocks(d).update(xxh3=[*BLOCKS, D]), "need 3 block"),
    "one block is not blocks": (
        lambda d: blocks(d).update(size=4096, xxh3=[D]),
        "need 1 block checksums (at least 2)",
    ),
    "bad digest": (lambda d: blocks(d)["xxh3"].__setitem__(1, "XYZ"), "bad block checksum"),
    "digests disagree with xxh3": (
        lambda d: blocks(d)["xxh3"].__setitem__(1, D),
        "disagree with its xxh3",
    ),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_blocks_are_refused(name: str) -> None:
    mutate, words = HOSTILE[name]
    d = doc()
    mutate(d)
    with pytest.raises(mf.ManifestError) as info:
        mf.parse(encode(d))
    assert words in str(info.value) and "'f'" in str(info.value), str(info.value)


def test_digests_of_blocks() -> None:
    data = bytes(range(256)) * 1000
    whole = checksum.of(data)
    assert whole == checksum.Digest(checksum.digest(data))
    d = checksum.of(data, 65536)
    assert d.blocks == tuple(
        checksum.digest(data[i : i + 65536]) for i in range(0, len(data), 65536)
    )
    streamed = checksum.Hasher(65536)
    for i in range(0, len(data), 7777):
        streamed.update(memoryview(data)[i : i + 7777])
    assert streamed.result() == d
    assert d.xxh3 == checksum.combine(d.blocks) != whole.xxh3
