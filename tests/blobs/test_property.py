"""Property tests: any content, chunked at any size, compressed or not, reads back exactly, whole
and by any range; and putting it again writes nothing."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from savepoint.blobs import BlobStore, Compression, PutStats
from savepoint.storage.memory import MemoryStore

BLOBS = BlobStore(MemoryStore(), "/prop")
OBJECT_BLOBS = BlobStore(MemoryStore(atomic_rename=False), "/prop")


@st.composite
def contents(draw: st.DrawFn) -> tuple[np.ndarray, int]:
    itemsize = draw(st.sampled_from([1, 2, 4, 8]))
    count = draw(st.integers(0, 30_000 // itemsize))
    kind = draw(st.sampled_from(["random", "smooth", "zeros", "repeats"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if kind == "random":
        raw = rng.integers(0, 256, count * itemsize, dtype=np.uint8)
    elif kind == "smooth":
        dtype = {1: np.int8, 2: np.float16, 4: np.float32, 8: np.float64}[itemsize]
        raw = (rng.standard_normal(count) * 0.01).astype(dtype).view(np.uint8)
    elif kind == "zeros":
        raw = np.zeros(count * itemsize, np.uint8)
    else:
        raw = np.tile(rng.integers(0, 256, 17, dtype=np.uint8), count * itemsize // 17 + 1)
        raw = raw[: count * itemsize]
    return np.ascontiguousarray(raw), itemsize


policies = st.one_of(
    st.none(),
    st.builds(
        Compression,
        level=st.integers(1, 5),
        min_saving=st.sampled_from([0.0, 0.05, 0.5]),
        shuffle=st.booleans(),
        probe=st.booleans(),
    ),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    contents(),
    st.sampled_from([4096, 8192, 65536]),
    policies,
    st.booleans(),
    st.data(),
)
def test_round_trip(
    content: tuple[np.ndarray, int],
    chunk: int,
    policy: Compression | None,
    object_like: bool,
    data: st.DataObject,
) -> None:
    raw, itemsize = content
    blobs = OBJECT_BLOBS if object_like else BLOBS
    recipe = blobs.put_chunked(raw, chunk_size=chunk, compression=policy, itemsize=itemsize)
    assert recipe.size == raw.size
    assert blobs.read_recipe(recipe).tobytes() == raw.tobytes()
    start = data.draw(st.integers(0, raw.size))
    end = data.draw(st.integers(start, raw.size))
    got = blobs.read_recipe(recipe, start=start, end=end, verify=data.draw(st.booleans()))
    assert got.tobytes() == raw[start:end].tobytes()
    stats = PutStats()
    assert blobs.put_chunked(raw, chunk_size=chunk, stats=stats) == recipe
    assert stats.blobs_written == 0
