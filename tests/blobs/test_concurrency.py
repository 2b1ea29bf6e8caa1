"""Concurrent writers of the same blobs: threads on every store kind, processes on a local disk.
Exactly one copy of each blob results, whole, and every writer gets the same recipe."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import numpy as np

from savepoint.blobs import BlobStore, Compression, PutStats

CHUNK = 64 * 1024


def content(seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(300_000) * 0.01).astype(np.float32)


def test_threads_writing_the_same_blobs(blobs: BlobStore) -> None:
    data = content()
    barrier = threading.Barrier(6)
    recipes = []
    stats = PutStats()
    errors: list[BaseException] = []

    def writer(i: int) -> None:
        try:
            barrier.wait()
            policy = Compression(min_saving=0.0) if i % 2 else None  # mixed codecs, same names
            with blobs.session() as s:
                recipes.append(s.put_chunked(data, chunk_size=CHUNK, compression=policy))
                stats.blobs_written += s.stats.blobs_written
                s.sync()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert all(r == recipes[0] for r in recipes)
    assert sorted(blobs.list()) == sorted(set(recipes[0].digests))
    assert len(recipes[0].digests) <= stats.blobs_written  # each written at least once
    assert [n for n, _ in blobs.entries() if ".tmp-" in n] == []
    assert blobs.read_recipe(recipes[0]).tobytes() == data.tobytes()


CHILD = """
import sys, numpy as np
from savepoint.blobs import BlobStore
data = (np.random.default_rng(0).standard_normal(300_000) * 0.01).astype(np.float32)
blobs = BlobStore.open(sys.argv[1])
with blobs.session() as s:
    recipe = s.put_chunked(data, chunk_size=int(sys.argv[2]))
    s.sync()
print(",".join(recipe.digests))
"""


def test_processes_writing_the_same_blobs(tmp_path: Path) -> None:
    root = str(tmp_path / "blobs")
    BlobStore.open(root)  # created once; the children race on the blobs (and its config: fine)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, root, str(CHUNK)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in outs]
    recipes = {out.strip() for out, _ in outs}
    assert len(recipes) == 1
    digests = recipes.pop().split(",")
    blobs = BlobStore.open(root)
    assert sorted(blobs.list()) == sorted(set(digests))
    assert [n for n, _ in blobs.entries() if ".tmp-" in n] == []
    for d in digests:
        blobs.verify(d)


def test_racing_creators_of_a_new_store(tmp_path: Path) -> None:
    root = str(tmp_path / "fresh")
    barrier = threading.Barrier(4)
    made: list[str] = []

    def opener() -> None:
        barrier.wait()
        made.append(BlobStore.open(root).algorithm)

    threads = [threading.Thread(target=opener) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert made == ["blake3"] * 4
