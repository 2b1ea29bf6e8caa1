"""Row-level patches (savepoint.blobs.patch): the patch blob's encoding, applying it to any
byte range, hostile patches, patched recipes in JSON, and ``put_tensor``'s choices (reuse,
patch, rebase) against a real blob store."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from savepoint.blobs import BlobPolicy, BlobStore, FastMemo
from savepoint.blobs.patch import PatchTracker, apply_patch, block_size, encode_patch, put_tensor
from savepoint.codecs import checksum
from savepoint.codecs.recipe import Patch, Recipe
from savepoint.errors import CorruptCheckpointError

KiB = 1 << 10


def _patch_of(content: np.ndarray[Any, Any], blocks: np.ndarray[Any, Any], block: int) -> Patch:
    body = encode_patch(content, blocks, block)
    return Patch("0" * 64, block, int(blocks.size), checksum.digest(body))


@settings(max_examples=200, deadline=None)
@given(
    size=st.integers(1, 5000),
    block_log=st.integers(0, 6),
    data=st.data(),
)
def test_a_patch_applied_to_any_range_gives_the_new_bytes(
    size: int, block_log: int, data: st.DataObject
) -> None:
    block = 1 << block_log
    rng = np.random.default_rng(size * 7 + block_log)
    old = rng.integers(0, 256, size, dtype=np.uint8)
    new = old.copy()
    nblocks = -(-size // block)
    chosen = sorted(data.draw(st.sets(st.integers(0, nblocks - 1), min_size=1, max_size=20)))
    blocks = np.array(chosen, np.int64)
    for b in chosen:
        new[b * block : (b + 1) * block] = rng.integers(0, 256, min(block, size - b * block))
    body = encode_patch(new, blocks, block)
    patch = Patch("0" * 64, block, len(chosen), checksum.digest(body))
    assert body.size == patch.content_size(size)
    lo = data.draw(st.integers(0, size))
    hi = data.draw(st.integers(lo, size))
    out = old[lo:hi].copy()
    apply_patch(body, patch, size, out, lo, hi, shown="p")
    assert out.tobytes() == new[lo:hi].tobytes()


def test_hostile_patches_are_refused() -> None:
    size, block = 1000, 64
    content = np.arange(size, dtype=np.uint8)
    good = encode_patch(content, np.array([1, 3, 15]), block)  # 15: the short last block
    patch = Patch("0" * 64, block, 3, checksum.digest(good))
    out = np.zeros(size, np.uint8)
    apply_patch(good, patch, size, out, 0, size, shown="p")
    assert out[64:128].tobytes() == content[64:128].tobytes()
    assert out[960:].tobytes() == content[960:].tobytes()
    for index in ([3, 1, 15], [1, 1, 15], [1, 3, 16], [1, 3, 1 << 31]):
        bad = good.copy()
        bad[:12].view("<u4")[:] = index
        with pytest.raises(CorruptCheckpointError, match="outside the tensor or out of order"):
            apply_patch(bad, patch, size, np.zeros(size, np.uint8), 0, size, shown="p")
    with pytest.raises(CorruptCheckpointError, match="wrong size"):
        apply_patch(good[:-1], patch, size, out, 0, size, shown="p")


def _recipe_json() -> dict[str, Any]:
    return {
        "digest": "blake3",
        "size": 1000,
        "chunk": 1024,
        "blobs": ["a" * 64],
        "xxh3": ["1" * 16],
        "base_xxh3": ["2" * 16],
        "patches": [{"blob": "b" * 64, "block": 64, "count": 3, "xxh3": "3" * 16}],
    }


def test_a_patched_recipe_round_trips_through_json_and_names_every_blob() -> None:
    recipe = Recipe.from_json(_recipe_json())
    assert Recipe.from_json(recipe.to_json()) == recipe
    assert recipe.names() == ("a" * 64, "b" * 64)
    assert recipe.base() == Recipe("blake3", 1000, 1024, ("a" * 64,), ("2" * 16,))


@pytest.mark.parametrize(
    "change",
    [
        lambda j: j.pop("base_xxh3"),
        lambda j: j.pop("patches"),
        lambda j: j.update(patches=[]),
        lambda j: j.update(base_xxh3=[]),
        lambda j: j.pop("xxh3"),
        lambda j: j["patches"][0].update(count=0),
        lambda j: j["patches"][0].update(count=17),  # 16 blocks of 64 bytes hold 1000
        lambda j: j["patches"][0].update(block=0),
        lambda j: j["patches"][0].update(block=True),
        lambda j: j["patches"][0].update(blob="B" * 64),
        lambda j: j["patches"][0].update(xxh3="x"),
        lambda j: j["patches"][0].update(extra=1),
        lambda j: j["patches"][0].pop("xxh3"),
        lambda j: j.update(patches=[j["patches"][0]] * 1025),
        lambda j: j.update(patches={"a": 1}),
    ],
)
def test_malformed_patched_recipes_are_refused(change: Any) -> None:
    obj = _recipe_json()
    change(obj)
    with pytest.raises(CorruptCheckpointError):
        Recipe.from_json(obj)


def test_block_size_follows_the_rows() -> None:
    assert block_size((1000, 128), 4, 4 << 20) == 512
    assert block_size((1000, 96), 4, 4 << 20) == 256  # 384-byte rows: the largest power of 2
    assert block_size((1000, 3), 4, 4 << 20) == 256  # tiny rows: at least 256 bytes
    assert block_size((10, 1 << 20), 4, 4 << 20) == 64 * KiB  # huge rows: at most 64 KiB
    assert block_size((1 << 20,), 4, 4 << 20) == 4 * KiB  # no rows
    assert block_size((100, 4096), 4, 8 * KiB) == 8 * KiB  # never more than a chunk


# ---------------------------------------------------------------------------------------------
# put_tensor against a store
# ---------------------------------------------------------------------------------------------

POLICY = BlobPolicy(chunk_size=64 * KiB, min_blob_bytes=0, workers=1, max_patches=3)


class Saver:
    """put_tensor in a session, with the tracker committed the way the engine does it."""

    def __init__(self, blobs: BlobStore, policy: BlobPolicy = POLICY) -> None:
        self.blobs, self.policy = blobs, policy
        self.memo, self.tracker = FastMemo(), PatchTracker()

    def save(self, table: np.ndarray[Any, Any], commit: bool = True) -> tuple[Recipe, int]:
        with self.blobs.session() as s:
            before = s.stats.bytes_written
            recipe, entry = put_tensor(
                s,
                table.reshape(-1).view(np.uint8),
                "emb",
                table.shape,
                table.dtype.itemsize,
                self.policy,
                self.memo,
                self.tracker,
            )
            s.sync()
            if commit:
                self.tracker.commit(self.blobs.url(), {"emb": entry})
            return recipe, s.stats.bytes_written - before


def _table(rows: int = 4096) -> np.ndarray[Any, Any]:
    return np.random.default_rng(0).standard_normal((rows, 32), dtype=np.float32)  # 128 B rows


def _restored(blobs: BlobStore, recipe: Recipe, like: np.ndarray[Any, Any]) -> Any:
    return blobs.read_recipe(recipe).view(like.dtype).reshape(like.shape)


def test_unchanged_tensors_reuse_their_recipe_and_changed_rows_become_patches(
    blobs: BlobStore,
) -> None:
    saver = Saver(blobs)
    table = _table()  # 512 KiB, 8 chunks, 2048 blocks of 256 bytes
    first, written = saver.save(table)
    assert not first.patches and written == table.nbytes
    again, written = saver.save(table)
    assert again == first and written == 0
    rng = np.random.default_rng(1)
    history = [table.copy()]
    recipes = [first]
    for _ in range(3):
        rows = rng.choice(4096, 40, replace=False)  # 1% of the rows, in every chunk
        table[rows] += 1.0
        recipe, written = saver.save(table)
        assert recipe.digests == first.digests  # the base is kept
        assert written <= 40 * (256 + 4)  # at most one 256-byte block per changed row
        history.append(table.copy())
        recipes.append(recipe)
    assert [len(r.patches) for r in recipes] == [0, 1, 2, 3]
    for recipe, want in zip(recipes, history):
        got = _restored(blobs, recipe, want)
        assert got.tobytes() == want.tobytes()
        blobs.verify_recipe(recipe)
        # a range that cuts blocks on both sides
        part = blobs.read_recipe(recipe, start=1000, end=300_001)
        assert part.tobytes() == want.reshape(-1).view(np.uint8)[1000:300_001].tobytes()
        part = blobs.read_recipe(recipe, start=1000, end=300_001, verify=False)
        assert part.tobytes() == want.reshape(-1).view(np.uint8)[1000:300_001].tobytes()
    # max_patches (3) reached: the next change rebases to chunks
    table[5] += 1.0
    rebased, written = saver.save(table)
    assert not rebased.patches and written >= 64 * KiB
    assert _restored(blobs, rebased, table).tobytes() == table.tobytes()
    # and the chain starts again from the new base
    table[6] += 1.0
    patched, written = saver.save(table)
    assert patched.digests == rebased.digests and len(patched.patches) == 1


def test_a_big_change_rebases_within_the_budget(blobs: BlobStore) -> None:
    saver = Saver(blobs, BlobPolicy(chunk_size=64 * KiB, min_blob_bytes=0, patch_budget=0.25))
    table = _table()
    saver.save(table)
    table[:1500] += 1.0  # 37% of the rows: over the budget
    recipe, _ = saver.save(table)
    assert not recipe.patches
    table[7] += 1.0  # the rebase knows every block's hash: the next change is a patch
    recipe, written = saver.save(table)
    assert len(recipe.patches) == 1 and written < 1024
    chain = written
    for k in range(1, 40):  # 64 more rows each save: the chain stops at 25% of the bytes
        table[64 * k : 64 * (k + 1)] += 1.0
        recipe, written = saver.save(table)
        if not recipe.patches:
            break
        chain += written
    else:
        raise AssertionError("the chain never rebased")
    assert 0.2 * table.nbytes < chain <= 0.25 * table.nbytes
    assert _restored(blobs, recipe, table).tobytes() == table.tobytes()


def test_a_patch_never_names_a_base_blob_that_was_deleted(blobs: BlobStore) -> None:
    saver = Saver(blobs)
    table = _table()
    first, _ = saver.save(table)
    for d in first.digests[:2]:
        blobs.delete(d)  # e.g. the checkpoint naming them was deleted and collected
    table[3] += 1.0
    recipe, written = saver.save(table)
    assert not recipe.patches and written >= 2 * 64 * KiB  # the missing chunks written again
    assert _restored(blobs, recipe, table).tobytes() == table.tobytes()
    again, written = saver.save(table)  # unchanged, and everything is there: reused
    assert again == recipe and written == 0
    for d in recipe.digests[:1]:
        blobs.delete(d)
    again, written = saver.save(table)
    assert written == 64 * KiB and _restored(blobs, again, table).tobytes() == table.tobytes()


def test_an_uncommitted_save_does_not_move_the_tracker(blobs: BlobStore) -> None:
    saver = Saver(blobs)
    table = _table()
    first, _ = saver.save(table)
    table[3] += 1.0
    saver.save(table, commit=False)  # the manifest never committed
    table[4] += 1.0
    recipe, _ = saver.save(table)  # patched against the first save, with both rows
    assert recipe.digests == first.digests and len(recipe.patches) == 1
    assert recipe.patches[0].count == 2
    assert _restored(blobs, recipe, table).tobytes() == table.tobytes()


def test_a_damaged_patch_is_refused_at_load(blobs: BlobStore) -> None:
    saver = Saver(blobs)
    table = _table()
    saver.save(table)
    table[100] += 1.0
    recipe, _ = saver.save(table)
    patch = recipe.patches[0]
    body = blobs.read(patch.blob).copy()
    body[-1] ^= 0xFF  # a bit flip inside the changed row
    blobs.delete(patch.blob)
    blobs.put(body, digest=patch.blob)  # stored under the old name: only the checks notice
    with pytest.raises(CorruptCheckpointError):
        blobs.read_recipe(recipe)
    with pytest.raises(CorruptCheckpointError):
        blobs.verify_recipe(recipe)
    # Without the blob's own checks, the result's checks still catch it.
    with pytest.raises(CorruptCheckpointError, match="patches are applied"):
        blobs.read_recipe(
            Recipe(
                recipe.algorithm,
                recipe.size,
                recipe.chunk,
                recipe.digests,
                recipe.checks,
                (Patch(patch.blob, patch.block, patch.count, checksum.digest(body)),),
                recipe.base_checks,
            )
        )


def test_a_tensor_changed_everywhere_skips_the_block_hashes(
    blobs: BlobStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An adapter trained at every save: after one save shows it dense, its blocks are not
    hashed while every chunk keeps changing; when the changes turn sparse, one save of chunks
    computes the hashes and the next one patches."""
    saver = Saver(blobs)
    hashed: list[int] = []
    real = PatchTracker.block_hashes

    def counting(self: PatchTracker, data: Any, block: int) -> Any:
        hashed.append(len(data))
        return real(self, data, block)

    monkeypatch.setattr(PatchTracker, "block_hashes", counting)
    table = _table()
    saver.save(table)
    table += 1.0
    recipe, _ = saver.save(table)  # dense: found by hashing, rebased
    assert not recipe.patches and sum(hashed) == 2 * table.nbytes
    for _ in range(2):
        table += 1.0
        recipe, _ = saver.save(table)
        assert not recipe.patches and sum(hashed) == 2 * table.nbytes  # no hashing
    table[9] += 1.0
    recipe, _ = saver.save(table)  # sparse again: chunks, hashed
    assert not recipe.patches and sum(hashed) == 3 * table.nbytes
    table[10] += 1.0
    recipe, written = saver.save(table)
    assert len(recipe.patches) == 1 and written < 1024
    assert _restored(blobs, recipe, table).tobytes() == table.tobytes()


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        (POLICY, [1, 2, 3, 0, 1, 2, 3, 0]),  # the chain cut at max_patches=3
        (  # cut by the budget: a third patch of ~10 KB would pass 5% of the 512 KiB
            BlobPolicy(chunk_size=64 * KiB, min_blob_bytes=0, workers=1, patch_budget=0.05),
            [1, 2, 0, 1, 2, 0, 1, 2],
        ),
    ],
)
def test_scattered_changes_keep_patching_after_every_rebase(
    blobs: BlobStore, policy: BlobPolicy, expected: list[int]
) -> None:
    """1% of the rows, scattered: every chunk changes at every save, yet only the rows are
    written, and a rebase (the chain full) is followed by patches again, not by chunks (a
    full chain is not a sign of a tensor that changes everywhere)."""
    saver = Saver(blobs, policy)
    table = _table()
    saver.save(table)
    rng = np.random.default_rng(7)
    lengths, sizes = [], []
    for _ in range(8):
        table[rng.choice(4096, 40, replace=False)] += 1.0
        recipe, written = saver.save(table)
        lengths.append(len(recipe.patches))
        sizes.append(written)
        assert _restored(blobs, recipe, table).tobytes() == table.tobytes()
    assert lengths == expected
    assert all(size <= 40 * (256 + 4) for size, n in zip(sizes, lengths) if n)
