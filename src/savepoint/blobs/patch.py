"""Row-level patches: an incremental save of a tensor of which a few scattered rows changed.

Fixed-size chunks dedupe changes that are clustered (a fine-tuned layer, appended rows), but a
recommendation model's embedding table changes a few rows *everywhere*: with 512-byte rows, 1% of
the rows changed uniformly touches every 4 MiB chunk (see ``docs/blobs.md``, "Chunking"). A
*patch* stores only the changed blocks (a block is the largest power of two that fits in one
row, 256 bytes to 64 KiB) as one blob, and the tensor's recipe becomes the previous one plus that
patch (:class:`savepoint.codecs.recipe.Patch`). A restore reads the base and applies the chain;
the chain is cut (the tensor written whole as chunks again: a *rebase*) when it holds
``max_patches`` patches or its patches add up to ``patch_budget`` of the tensor's bytes, so a
restore reads at most ``1 + patch_budget`` times the tensor, and the store holds at most that
much per retained tensor beyond the base.

Which blocks changed is found without the previous content: a :class:`PatchTracker` (one per
process or manager, like :class:`~savepoint.blobs.FastMemo`) keeps, for each tensor of the last
committed save, a keyed XXH3-64 per block and a keyed XXH3-128 per chunk (the memo's key).
Chunks whose key did not change are skipped at XXH3 speed; blocks are hashed only in the others.
The tracker is updated only after the manifest that names the new recipe is committed, so a
failed save never leaves it describing content that no checkpoint holds. A hash collision
(probability 2**-64 per changed block, with a seed drawn per tracker and never stored) could
only drop a block's change from a patch; the recipe's checks are of the real content, so the load
would then refuse the tensor as corrupt instead of returning stale rows.

After a restart the tracker is empty: the first save of each tensor is chunked as usual (and
dedupes against the stored chunks), the next ones patch again.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import xxhash

from savepoint.codecs import checksum as _checksum
from savepoint.codecs.recipe import MAX_CHUNK, Patch, Recipe
from savepoint.errors import CorruptCheckpointError

if TYPE_CHECKING:
    from savepoint.blobs.digest import FastMemo
    from savepoint.blobs.gc import SaveSession
    from savepoint.blobs.policy import BlobPolicy

__all__ = [
    "DENSE_PROBE",
    "FROZEN_SAMPLES",
    "MAX_BLOCK",
    "MIN_BLOCK",
    "PatchTracker",
    "apply_patch",
    "block_size",
    "encode_patch",
    "frozen_keys",
    "put_tensor",
]

log = logging.getLogger(__name__)

MIN_BLOCK = 256
DENSE_PROBE = 8  # a tensor changed everywhere is block-hashed again every this many saves
FROZEN_SAMPLES = 256  # blocks of a frozen tensor checked per save (one per chunk, at most)
MAX_BLOCK = 64 << 10
_FLAT_BLOCK = 4 << 10  # the block of tensors without rows (one dimension)


def block_size(shape: tuple[int, ...], itemsize: int, chunk: int) -> int:
    """The patch block of a tensor: the largest power of two that fits in one row (the bytes of
    one index of the first dimension), between :data:`MIN_BLOCK` and :data:`MAX_BLOCK` and at
    most ``chunk`` (so blocks never straddle chunks)."""
    if len(shape) < 2:
        row = _FLAT_BLOCK
    else:
        row = itemsize
        for d in shape[1:]:
            row *= d
    row = max(MIN_BLOCK, min(row, MAX_BLOCK, chunk))
    return 1 << (row.bit_length() - 1)


def _index_dtype(itemsize: int) -> np.dtype[Any]:
    return np.dtype("<u4" if itemsize == 4 else "<u8")


def encode_patch(
    content: np.ndarray[Any, Any], blocks: np.ndarray[Any, Any], block: int
) -> np.ndarray[Any, Any]:
    """The content of the patch blob holding blocks ``blocks`` (sorted block numbers) of
    ``content`` (a flat uint8 array): the block numbers, then the blocks (the last, when short,
    padded with zeros)."""
    size = content.size
    patch = Patch("", block, max(1, blocks.size), "")  # for the sizes only
    isz = patch.index_itemsize(size)
    n = blocks.size
    out = np.zeros(n * (isz + block), np.uint8)
    out[: n * isz].view(_index_dtype(isz))[:] = blocks
    rows = out[n * isz :].reshape(n, block)
    full = size // block
    whole = blocks[blocks < full]
    if whole.size:
        rows[: whole.size] = content[: full * block].reshape(full, block)[whole]
    if whole.size < n:  # the short last block
        tail = size - full * block
        rows[n - 1, :tail] = content[full * block :]
    return out


def apply_patch(
    content: np.ndarray[Any, Any],
    patch: Patch,
    size: int,
    out: np.ndarray[Any, Any],
    lo: int,
    hi: int,
    *,
    shown: str,
) -> None:
    """Apply ``patch`` (its blob's ``content``, a uint8 array) to ``out``, which holds bytes
    ``[lo, hi)`` of a tensor of ``size`` bytes. The block numbers are hostile input: they must
    be strictly increasing and inside the tensor (CorruptCheckpointError naming ``shown``)."""
    block, n = patch.block, patch.count
    isz = patch.index_itemsize(size)
    if content.size != n * (isz + block):
        raise CorruptCheckpointError(f"patch blob {shown} has the wrong size", path=shown)
    idx = content[: n * isz].view(_index_dtype(isz)).astype(np.int64)
    nblocks = -(-size // block)
    if idx[0] < 0 or idx[-1] >= nblocks or (n > 1 and bool(np.any(idx[1:] <= idx[:-1]))):
        raise CorruptCheckpointError(
            f"patch blob {shown} names blocks outside the tensor or out of order", path=shown
        )
    data = content[n * isz :].reshape(n, block)
    first, last = lo // block, -(-hi // block)
    a, b = int(np.searchsorted(idx, first)), int(np.searchsorted(idx, last))
    if a == b:
        return
    sel, rows = idx[a:b], data[a:b]
    # Blocks wholly inside [lo, hi): one scatter into out viewed as whole blocks.
    inner_first = -(-lo // block)  # the first block starting at or after lo
    skip = inner_first * block - lo
    inner_count = max(0, (hi - lo - skip) // block)
    inner = (sel >= inner_first) & (sel < inner_first + inner_count)
    if inner.any():
        grid = out[skip : skip + inner_count * block].reshape(inner_count, block)
        grid[sel[inner] - inner_first] = rows[inner]
    for k in np.flatnonzero(~inner):  # at most two: the blocks cut by lo or hi
        s = int(sel[k]) * block
        e = min(s + block, size)
        a2, b2 = max(s, lo), min(e, hi)
        if a2 < b2:
            out[a2 - lo : b2 - lo] = rows[k, a2 - s : b2 - s]


@dataclass
class _Entry:
    """What the last committed save of a tensor left: its recipe, and the hashes of the content
    that recipe describes (None: not computed; the next save writes chunks)."""

    recipe: Recipe
    block: int
    chunk_keys: list[tuple[int, int]]
    hashes: np.ndarray[Any, Any] | None
    chain: int  # content bytes of the recipe's patches
    dense: int = 0  # saves since a change too big for any patch (0: not known dense)


class PatchTracker:
    """Per-tensor block hashes of the last committed save, per blob store (see the module
    docstring). Thread-safe; one per manager, or one per process for ``sp.save``."""

    def __init__(self) -> None:
        self._seed = int.from_bytes(os.urandom(8), "little")
        self._entries: dict[tuple[str, str], _Entry] = {}
        self._lock = threading.Lock()

    def _get(self, store: str, name: str) -> _Entry | None:
        with self._lock:
            return self._entries.get((store, name))

    def commit(self, store: str, pending: dict[str, _Entry]) -> None:
        """Record a committed save's tensors (those of earlier saves of ``store`` are dropped)."""
        with self._lock:
            for key in [k for k in self._entries if k[0] == store]:
                del self._entries[key]
            for name, entry in pending.items():
                self._entries[(store, name)] = entry

    def forget(self, store: str | None = None) -> None:
        """Drop what is known (of one store): the next saves write chunks."""
        with self._lock:
            for key in [k for k in self._entries if store is None or k[0] == store]:
                del self._entries[key]

    def block_hashes(self, data: Any, block: int) -> np.ndarray[Any, Any]:
        """A keyed XXH3-64 of every ``block`` bytes of ``data`` (a flat uint8 array)."""
        view = memoryview(data)
        n = len(view)
        h = xxhash.xxh3_64_intdigest
        seed = self._seed
        return np.fromiter(
            (h(view[s : s + block], seed) for s in range(0, n, block)),
            np.uint64,
            count=-(-n // block),
        )


def _chunk_keys(data: np.ndarray[Any, Any], chunk: int, memo: FastMemo) -> list[tuple[int, int]]:
    return [memo.key(data[s : s + chunk]) for s in range(0, data.size, chunk)]


def put_tensor(
    session: SaveSession,
    data: np.ndarray[Any, Any],
    name: str,
    shape: tuple[int, ...],
    itemsize: int,
    policy: BlobPolicy,
    memo: FastMemo,
    tracker: PatchTracker,
    *,
    frozen: bool = False,
) -> tuple[Recipe, _Entry]:
    """One tensor (``data``: its bytes, a flat uint8 array) into the blob store of ``session``:
    the previous recipe again when nothing changed, the previous recipe plus a patch of the
    changed blocks when that stays within the policy's chain limits, else chunks (see the module
    docstring). Returns the recipe, and what :meth:`PatchTracker.commit` records once the
    manifest naming it is committed.

    ``frozen``: the caller says the tensor has not changed since its last save (a frozen base
    model): its bytes are not read, but for one block per chunk (at most
    :data:`FROZEN_SAMPLES`, at random) checked against the hashes of the last save; the
    previous recipe is reused when they match and its blobs are all there. A mismatch (the
    promise was wrong) is logged and the tensor saved as any other."""
    chunk = policy.chunk_size
    n = data.size
    block = block_size(shape, itemsize, chunk)
    store = session.blobs.url()
    if frozen:
        reused = _frozen(session, data, name, block, chunk, tracker, store)
        if reused is not None:
            return reused.recipe, reused
    keys = _chunk_keys(data, chunk, memo)
    chunked = functools.partial(
        _chunked, session, data, itemsize, policy, memo, tracker, block, keys
    )
    prev = tracker._get(store, name)
    if (
        prev is None
        or prev.block != block
        or prev.recipe.size != n
        or prev.recipe.chunk != chunk
        or prev.recipe.algorithm != session.blobs.algorithm
    ):
        return chunked(hashes=True)
    changed_chunks = [i for i, k in enumerate(keys) if k != prev.chunk_keys[i]]
    if 0 < prev.dense < DENSE_PROBE and len(changed_chunks) == len(keys):
        # Changed everywhere again (a trained tensor, an adapter): no block hashing. Every
        # DENSE_PROBE saves the blocks are hashed again, so a tensor whose changes became
        # sparse (scattered rows still touch every chunk) is found out.
        return chunked(hashes=None, dense=prev.dense + 1)
    if prev.hashes is None:
        return chunked(hashes=True)
    if not changed_chunks:
        if session.reuse_existing(prev.recipe.names()):
            return prev.recipe, prev
        return chunked(hashes=True)
    per_chunk = chunk // block
    isz = Patch("", block, 1, "").index_itemsize(n)
    budget = policy.patch_budget * n - prev.chain
    hashes = prev.hashes.copy()
    changed_blocks: list[np.ndarray[Any, Any]] = []
    count = 0
    for i in changed_chunks:
        lo = i * per_chunk
        fresh = tracker.block_hashes(data[i * chunk : (i + 1) * chunk], block)
        moved = np.flatnonzero(fresh != hashes[lo : lo + fresh.size]) + lo
        hashes[lo : lo + fresh.size] = fresh
        changed_blocks.append(moved)
        count += moved.size
    checks = list(prev.recipe.checks)
    for i in changed_chunks:
        checks[i] = _checksum.digest(data[i * chunk : (i + 1) * chunk])
    if count == 0:  # the chunks' keys changed, their blocks did not (content put back)
        recipe = Recipe(
            prev.recipe.algorithm,
            n,
            chunk,
            prev.recipe.digests,
            tuple(checks),
            prev.recipe.patches,
            prev.recipe.base_checks,
        )
        if session.reuse_existing(recipe.names()):
            return recipe, _Entry(recipe, block, keys, hashes, prev.chain)
        return chunked(hashes=hashes)
    size = count * (isz + block)
    if (
        len(prev.recipe.patches) >= policy.max_patches
        or size > budget
        or size > MAX_CHUNK
        or not session.reuse_existing(prev.recipe.names())
    ):  # rebase (every block's hash is known: the next save can patch)
        # dense: this change alone is too big for any patch (not a chain that is full)
        return chunked(hashes=hashes, dense=int(size > policy.patch_budget * n))
    blocks = np.concatenate(changed_blocks)
    content = encode_patch(data, blocks, block)
    result = session.put(content, compression=policy.compression, itemsize=itemsize)
    patch = Patch(result.digest, block, count, _checksum.digest(content))
    base_checks = prev.recipe.base_checks if prev.recipe.patches else prev.recipe.checks
    recipe = Recipe(
        prev.recipe.algorithm,
        n,
        chunk,
        prev.recipe.digests,
        tuple(checks),
        (*prev.recipe.patches, patch),
        base_checks,
    )
    return recipe, _Entry(recipe, block, keys, hashes, prev.chain + size)


def frozen_keys(prefixes: Any) -> Callable[[str], bool]:
    """Whether a tensor's key (its flattened name: ``model/base/w``) is declared frozen by
    ``prefixes``: a key equal to one of them, or under one (``model/base`` covers
    ``model/base/w``, not ``model/baseline``). ``prefixes``: an iterable of non-empty
    strings (TypeError/ValueError otherwise)."""
    if isinstance(prefixes, str) or not hasattr(prefixes, "__iter__"):
        raise TypeError(
            f"frozen must be an iterable of key prefixes (('model/base',), say), not {prefixes!r}"
        )
    items = tuple(prefixes)
    for p in items:
        if not isinstance(p, str) or not p.strip("/"):
            raise ValueError(f"frozen: {p!r} is not a key prefix (a non-empty string)")
    exact = frozenset(p.rstrip("/") for p in items)
    under = tuple(p.rstrip("/") + "/" for p in items)
    return lambda key: key in exact or key.startswith(under)


def _frozen(
    session: SaveSession,
    data: np.ndarray[Any, Any],
    name: str,
    block: int,
    chunk: int,
    tracker: PatchTracker,
    store: str,
) -> _Entry | None:
    """The last save's entry of a tensor the caller says is frozen, if a sample of its blocks
    agrees and its blobs are all in the store; None otherwise (the tensor is then saved as any
    other)."""
    prev = tracker._get(store, name)
    n = data.size
    if (
        prev is None
        or prev.hashes is None
        or prev.block != block
        or prev.recipe.size != n
        or prev.recipe.chunk != chunk
        or prev.recipe.algorithm != session.blobs.algorithm
    ):
        return None
    per_chunk = chunk // block
    chunks = len(prev.chunk_keys)
    rng = np.random.default_rng()
    picked = rng.choice(chunks, min(chunks, FROZEN_SAMPLES), replace=False)
    blocks = np.minimum(
        picked * per_chunk + rng.integers(0, per_chunk, picked.size), prev.hashes.size - 1
    )
    for b in blocks.tolist():
        got = tracker.block_hashes(data[b * block : (b + 1) * block], block)
        if got[0] != prev.hashes[b]:
            log.warning(
                "tensor %r was declared frozen but changed since its last save (block %d): "
                "saved as any other tensor",
                name,
                b,
            )
            return None
    if not session.reuse_existing(prev.recipe.names()):
        return None
    return prev


def _chunked(
    session: SaveSession,
    data: np.ndarray[Any, Any],
    itemsize: int,
    policy: BlobPolicy,
    memo: FastMemo,
    tracker: PatchTracker,
    block: int,
    keys: list[tuple[int, int]],
    *,
    hashes: np.ndarray[Any, Any] | bool | None,
    dense: int = 0,
) -> tuple[Recipe, _Entry]:
    """The tensor as chunks (a first save, or a rebase). ``hashes``: its block hashes when known,
    True to compute them, None to leave them unknown (the next save writes chunks again)."""
    recipe = session.put_chunked(
        data,
        chunk_size=policy.chunk_size,
        compression=policy.compression,
        itemsize=itemsize,
        workers=policy.workers,
        memo=memo,
        keys=keys,  # computed once, by put_tensor
    )
    if hashes is True:
        hashes = tracker.block_hashes(data, block)
    return recipe, _Entry(recipe, block, keys, hashes if hashes is not False else None, 0, dense)
