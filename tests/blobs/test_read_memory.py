"""The memory a blob read holds, against hostile and extreme recipes (issue 25, items 4-6).

- A version 5 recipe may name up to 1,024 patches: a checked read applies them one at a time,
  so it holds the tensor and one patch, never every patch at once.
- A compressed blob is decompressed straight into its destination (no second copy of the
  content), after its zstd frame's claimed content size was found to be the one its recipe
  accounts for: a frame claiming more is refused before anything is allocated for it.
- Running out of memory while decompressing is CheckpointMemoryError, never "corrupt".

Peaks are measured with tracemalloc (numpy's buffers and Python's bytes are traced; zstd's own
small context is not)."""

from __future__ import annotations

import json
import struct
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import savepoint as sp
from _support import encode_manifest
from savepoint.blobs import BlobPolicy, BlobStore, Compression, frame
from savepoint.blobs.patch import encode_patch
from savepoint.codecs import checksum
from savepoint.codecs import manifest as mf
from savepoint.codecs.recipe import Recipe
from savepoint.errors import CheckpointMemoryError, CorruptCheckpointError

MiB = 1 << 20


def peak(fn: Callable[[], Any]) -> tuple[Any, int]:
    """``fn()`` and the peak of the memory traced while it ran."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        result = fn()
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


# -- item 5: many patches ---------------------------------------------------------------------


def table(k: int) -> np.ndarray[Any, Any]:
    """A 2 MiB float32 table, compressible (so its patches are small zstd blobs)."""
    return ((np.arange(2048 * 256) % 7 + k) / 4).astype(np.float32).reshape(2048, 256)


def forged_chain(tmp_path: Path, count: int) -> tuple[Path, np.ndarray[Any, Any]]:
    """A checkpoint of one 2 MiB tensor whose (forged) recipe names ``count`` patches, each a
    whole new content of the tensor (every 1 KiB block), alternating between two small zstd
    blobs: 2 MiB of patch content each, ``count`` x 2 MiB in all. Returns the checkpoint and
    the content it describes."""
    ck, store_dir = tmp_path / "ck", tmp_path / "blobs"
    policy = BlobPolicy(chunk_size=MiB, min_blob_bytes=4 << 10, compression=Compression())
    sp.save(ck, {"emb": table(0)}, blobs=store_dir, blob_policy=policy)
    store = BlobStore.open(store_dir, create=False)
    doc: dict[str, Any] = json.loads((ck / mf.NAME).read_bytes())
    del doc["manifest_xxh3"]
    recipe = doc["tensors"]["emb"]["blobs"]
    block = 1024
    patches = []
    for k in (1, 2):
        content = encode_patch(table(k).reshape(-1).view(np.uint8), np.arange(2048), block)
        put = store.put(content, compression=Compression(min_saving=0.0, probe=False))
        assert store.info(put.digest).stored < 64 << 10  # a small zstd blob
        patches.append(
            {"blob": put.digest, "block": block, "count": 2048, "xxh3": checksum.digest(content)}
        )
    final = table(1 + (count - 1) % 2)
    flat = final.reshape(-1).view(np.uint8)
    recipe["base_xxh3"] = recipe["xxh3"]
    recipe["xxh3"] = [checksum.digest(flat[i : i + MiB]) for i in range(0, flat.size, MiB)]
    recipe["patches"] = [patches[i % 2] for i in range(count)]
    doc["tensors"]["emb"]["xxh3"] = checksum.combine(recipe["xxh3"])
    doc["format_version"] = 5
    (ck / mf.NAME).write_bytes(encode_manifest(doc))
    return ck, final


@pytest.mark.parametrize("op", ["load", "load-into", "verify", "materialize"])
def test_many_patches_are_applied_one_at_a_time(tmp_path: Path, op: str) -> None:
    """128 patches of 2 MiB each on a 2 MiB tensor. Before, a checked load read every patch
    before applying any: 256 MiB here (2.1 GiB with 1,024 patches). Now the tensor and one
    patch (and, for verify and materialize, a copy of the tensor)."""
    ck, final = forged_chain(tmp_path, 128)
    if op == "load":
        got, used = peak(lambda: sp.load(ck)["emb"])
    elif op == "load-into":
        into = {"emb": np.zeros_like(final)}
        _, used = peak(lambda: sp.load(ck, into=into))
        got = into["emb"]
    elif op == "verify":
        _, used = peak(lambda: sp.verify(ck))
        got = final
    else:
        _, used = peak(lambda: sp.copy(ck, tmp_path / "plain", materialize=True))
        got = sp.load(tmp_path / "plain")["emb"]
    assert got.tobytes() == final.tobytes()
    assert used < 16 * MiB, f"{op} peaked at {used / MiB:.0f} MiB for a 2 MiB tensor"


def test_a_patch_that_does_not_match_its_check_is_still_refused_when_named_again(
    tmp_path: Path,
) -> None:
    """A patch naming the blob of the patch before it is not read again, but its own check is
    still compared: a recipe naming one blob under two different checks is corrupt."""
    ck, _ = forged_chain(tmp_path, 2)
    doc: dict[str, Any] = json.loads((ck / mf.NAME).read_bytes())
    del doc["manifest_xxh3"]
    patches = doc["tensors"]["emb"]["blobs"]["patches"]
    patches[1] = {**patches[0], "xxh3": patches[1]["xxh3"]}
    (ck / mf.NAME).write_bytes(encode_manifest(doc))
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        sp.load(ck)
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        sp.verify(ck)


# -- item 6: decompression into the destination ---------------------------------------------------


def claiming_frame(content: int, blocks: int) -> bytes:
    """A zstd frame whose header claims ``content`` bytes and holds ``blocks`` RLE blocks of
    128 KiB of zeros (4 bytes each): 32 KiB of frame can claim 1 GiB."""
    out = bytearray(struct.pack("<IB", 0xFD2FB528, 0b1110_0000))  # single segment, 8-byte size
    out += struct.pack("<Q", content)
    for i in range(blocks):
        last = int(i == blocks - 1)
        out += ((128 << 10) << 3 | 1 << 1 | last).to_bytes(3, "little") + b"\0"  # RLE block
    return bytes(out)


def test_a_frame_claiming_more_than_its_recipe_allocates_nothing_for_the_claim(
    tmp_path: Path,
) -> None:
    """A blob whose header says 64 KiB (what its recipe expects) holding a 32 KiB zstd frame
    that claims 1 GiB: refused from the frame header. Before, zstd allocated the 1 GiB first."""
    store = BlobStore.open(tmp_path / "blobs")
    payload = claiming_frame(1 << 30, 8192)
    assert len(payload) < 33 << 10
    digest = "ab" * 32
    path = tmp_path / "blobs" / "data" / "ab" / digest
    path.parent.mkdir(parents=True)
    path.write_bytes(frame.pack_header(frame.ZSTD, 0, 64 << 10, len(payload)) + payload)

    def read() -> CorruptCheckpointError:
        with pytest.raises(CorruptCheckpointError) as info:
            store.read(digest, size=64 << 10)
        return info.value

    error, used = peak(read)
    assert used < 2 * MiB, f"{used / MiB:.0f} MiB allocated for a 64 KiB blob"
    assert "claims 1073741824 bytes" in str(error)
    # The frame's own claim agrees with its blob header but not with the recipe: refused by
    # the header check, before the payload is read.
    path.write_bytes(frame.pack_header(frame.ZSTD, 0, 1 << 30, len(payload)) + payload)
    with pytest.raises(CorruptCheckpointError, match="were expected"):
        store.read(digest, size=64 << 10)


def test_a_compressed_payload_larger_than_zstd_makes_is_refused_before_it_is_read() -> None:
    bound = frame.compress_bound(64 << 10)
    frame.parse_header(frame.pack_header(frame.ZSTD, 0, 64 << 10, bound), shown="x")
    with pytest.raises(CorruptCheckpointError, match="larger than zstd ever makes it"):
        frame.parse_header(frame.pack_header(frame.ZSTD, 0, 64 << 10, bound + 1), shown="x")


def test_a_frame_without_its_content_size_is_refused() -> None:
    import zstandard

    data = b"a" * 1000
    payload = zstandard.ZstdCompressor(write_content_size=False).compress(data)
    out = np.empty(1000, np.uint8)
    with pytest.raises(CorruptCheckpointError, match="does not record its content size"):
        frame.decode(frame.Header(frame.ZSTD, 0, 1000, len(payload)), payload, out, shown="x")


@pytest.mark.parametrize("shuffle", [False, True])
def test_a_compressed_blob_decompresses_into_its_destination(tmp_path: Path, shuffle: bool) -> None:
    """A 32 MiB tensor stored as one zstd blob: a read into a destination allocates no second
    copy of it (before: the decompressed bytes, then a copy, 2x the tensor)."""
    store = BlobStore.open(tmp_path / "blobs")
    data = np.zeros(8 * MiB, np.float32)
    data[::4097] = np.arange(data[::4097].size)
    recipe = store.put_chunked(data, chunk_size=32 * MiB, compression=Compression(shuffle=shuffle))
    assert store.info(recipe.digests[0]).codec == "zstd"
    out = np.empty(32 * MiB, np.uint8)
    _, used = peak(lambda: store.read_recipe(recipe, out=out))
    assert out.view(np.float32).tobytes() == data.tobytes()
    assert used < 4 * MiB, f"{used / MiB:.1f} MiB beyond the destination"


def test_a_load_of_a_compressed_tensor_holds_the_tensor_once(tmp_path: Path) -> None:
    data = np.zeros((4096, 2048), np.float32)  # 32 MiB in one chunk, a few KiB compressed
    data[:, 7] = 1.0
    policy = BlobPolicy(chunk_size=32 * MiB, compression=Compression())
    sp.save(tmp_path / "ck", {"w": data}, blobs=tmp_path / "blobs", blob_policy=policy)
    got, used = peak(lambda: sp.load(tmp_path / "ck")["w"])
    assert got.tobytes() == data.tobytes()
    assert used < 32 * MiB + 4 * MiB, f"{used / MiB:.1f} MiB for a 32 MiB tensor"


# -- item 4: out of memory while decompressing -------------------------------------------------


class _Exhausted:
    """A zstd decompressor that runs out of memory, whatever it is asked."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def __getattr__(self, name: str) -> Any:
        def fail(*args: Any, **kwargs: Any) -> Any:
            raise self.error

        return fail


def _memory_errors() -> list[BaseException]:
    import zstandard

    return [
        MemoryError(),
        zstandard.ZstdError("zstd decompress error: Allocation error : not enough memory"),
    ]


@pytest.mark.parametrize("error", _memory_errors(), ids=["MemoryError", "zstd-allocation"])
def test_running_out_of_memory_while_decompressing_is_a_memory_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: BaseException
) -> None:
    """Before: CorruptCheckpointError("... does not decompress: ") on an intact checkpoint."""
    data = np.zeros(1 << 18, np.float32)
    policy = BlobPolicy(chunk_size=MiB, min_blob_bytes=4 << 10, compression=Compression())
    sp.save(tmp_path / "ck", {"w": data}, blobs=tmp_path / "blobs", blob_policy=policy)
    monkeypatch.setattr(frame, "_decompressor", lambda: _Exhausted(error))
    for read in (lambda: sp.load(tmp_path / "ck"), lambda: sp.verify(tmp_path / "ck")):
        with pytest.raises(CheckpointMemoryError) as info:
            read()
        assert not isinstance(info.value, CorruptCheckpointError)
        assert "out of memory" in str(info.value) and "not found damaged" in str(info.value)
    monkeypatch.undo()
    assert sp.load(tmp_path / "ck")["w"].tobytes() == data.tobytes()


def test_a_recipe_is_read_the_same_through_every_path(tmp_path: Path) -> None:
    """Ranges, verify and patched chunks agree with the whole read (the streaming paths)."""
    ck, final = forged_chain(tmp_path, 3)
    recipe = mf.parse((ck / mf.NAME).read_bytes()).tensors["emb"].recipe
    assert isinstance(recipe, Recipe)
    store = BlobStore.open(tmp_path / "blobs", create=False)
    flat = final.reshape(-1).view(np.uint8)
    assert store.read_recipe(recipe).tobytes() == flat.tobytes()
    for lo, hi in [(0, 10), (MiB - 5, MiB + 5), (123, 2 * MiB), (MiB, MiB)]:
        for verify in (True, False):
            got = store.read_recipe(recipe, start=lo, end=hi, verify=verify)
            assert got.tobytes() == flat[lo:hi].tobytes()
    for i in range(2):
        assert store.read_chunk(recipe, i).tobytes() == flat[i * MiB : (i + 1) * MiB].tobytes()
    store.verify_recipe(recipe)
    assert not store.patches_in_memory(recipe)
