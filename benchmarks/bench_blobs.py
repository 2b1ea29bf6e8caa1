"""Content-addressed blobs (savepoint.blobs): digest speed, chunk size, compression, incremental saves.

Usage::

    .venv/bin/python benchmarks/bench_blobs.py [--only hash chunks compress lora]
        [--sizes 1 16 64 256] [--dir /tmp/sp-bench-blobs] [--repeats 5]

Sections (figures go to docs/blobs.md):

- ``hash``: GiB/s of XXH3-128 and XXH3-64 (xxhash), BLAKE3 on one thread, BLAKE3 with its own
  thread pool (``max_threads=AUTO``) and BLAKE3 over 4 MiB chunks on 2 Python threads (how
  ``put_chunked(workers=2)`` hashes), on 1 MiB..256 MiB buffers of random bytes; medians.
- ``chunks``: a recommendation-style embedding (256 MiB float32, 512-byte rows), saved, then 1%
  of its rows changed and saved again, for chunk sizes 64 KiB..64 MiB: the fraction of bytes the
  second save writes, the number of blobs it writes and holds, and its time on the local store.
  Two patterns of changed rows: uniform (hashed ids) and clustered (Zipf-popular ids numbered by
  popularity, as frequency-sorted vocabularies are).
- ``compress``: zstd ratio and speed, with and without the byte shuffle, at levels 1, 3 and 9, on
  fp32 and bf16 weights of a small MLP trained 300 steps with Adam (and its exp_avg and
  exp_avg_sq), and on freshly initialised normal weights.
- ``read``: restoring 256 MiB of float32 weights from the local store (warm page cache), raw and
  compressed, checked by the recipe's XXH3-64 checks or by BLAKE3, on 1 and 2 threads.
- ``lora``: a 512 MiB state with 95% of its bytes frozen: a full first save, then a save after the
  trainable 5% changed: bytes written and time, with and without the digest memo.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

MiB = 1 << 20


def _median_time(fn: Callable[[], Any], repeats: int, min_time: float = 0.2) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        n, t0 = 0, time.perf_counter()
        while True:
            fn()
            n += 1
            dt = time.perf_counter() - t0
            if dt >= min_time:
                break
        times.append(dt / n)
    return statistics.median(times)


# --------------------------------------------------------------------------------------------
# hash


def bench_hash(sizes: list[int], repeats: int) -> None:
    import blake3
    import xxhash

    def chunked_threads(view: memoryview, chunk: int = 4 * MiB, threads: int = 2) -> None:
        starts = list(range(0, len(view), chunk))

        def work(i: int) -> None:
            for s in starts[i::threads]:
                blake3.blake3(view[s : s + chunk]).digest()

        ts = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()

    print("\n## digest speed (GiB/s, median of", repeats, "runs; random bytes)")
    print(f"{'MiB':>5} {'xxh3-64':>8} {'xxh3-128':>9} {'blake3':>7} {'b3-AUTO':>8} {'b3-2thr':>8}")
    for mib in sizes:
        buf = np.random.default_rng(mib).integers(0, 256, mib * MiB, dtype=np.uint8)
        view = memoryview(buf)
        cases = {
            "xxh3-64": lambda view=view: xxhash.xxh3_64_intdigest(view),
            "xxh3-128": lambda view=view: xxhash.xxh3_128_intdigest(view),
            "blake3": lambda view=view: blake3.blake3(view).digest(),
            "b3-AUTO": lambda view=view: blake3.blake3(
                view, max_threads=blake3.blake3.AUTO
            ).digest(),
            "b3-2thr": lambda view=view: chunked_threads(view),
        }
        row = [mib * MiB / (1 << 30) / _median_time(fn, repeats) for fn in cases.values()]
        print(f"{mib:>5} " + " ".join(f"{v:>8.2f}" for v in row))


# --------------------------------------------------------------------------------------------
# chunks


def _changed_rows(rows: int, pattern: str, rng: np.random.Generator) -> np.ndarray[Any, Any]:
    target = rows // 100
    if pattern == "uniform":
        return rng.choice(rows, target, replace=False)
    # clustered: ids drawn Zipf(1.05) over popularity ranks, rows numbered by rank; draw until 1%
    # of the rows are distinct
    seen: set[int] = set()
    while len(seen) < target:
        ids = rng.zipf(1.05, 4 * target) - 1
        seen.update(int(i) for i in ids[ids < rows])
    return np.array(sorted(seen)[:target])


def bench_chunks(base_dir: str, repeats: int) -> None:
    from savepoint.blobs import BlobStore
    from savepoint.storage.local import LocalStore

    rows, dim = 512 * 1024, 128  # 256 MiB of float32, 512-byte rows
    rng = np.random.default_rng(0)
    table = rng.standard_normal((rows, dim), dtype=np.float32)
    print("\n## chunk size: 256 MiB embedding, 1% of 524288 rows changed between saves")
    print(
        f"{'pattern':>9} {'chunk':>7} {'written':>8} {'blobs new':>9} {'blobs all':>9} "
        f"{'save 2 (s)':>10} {'save 1 (s)':>10}"
    )
    for pattern in ("uniform", "clustered"):
        changed = _changed_rows(rows, pattern, np.random.default_rng(1))
        for chunk in (64 << 10, 256 << 10, 1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB):
            root = os.path.join(base_dir, f"chunks-{pattern}-{chunk}")
            shutil.rmtree(root, ignore_errors=True)
            blobs = BlobStore(LocalStore(), root)
            t0 = time.perf_counter()
            with blobs.session() as s:
                s.put_chunked(table, chunk_size=chunk, workers=2)
                s.sync()
            first = time.perf_counter() - t0
            second = table.copy()
            second[changed] += 0.001
            t0 = time.perf_counter()
            with blobs.session() as s:
                s.put_chunked(second, chunk_size=chunk, workers=2)
                s.sync()
            t2 = time.perf_counter() - t0
            st = s.stats
            total = -(-table.nbytes // chunk)
            print(
                f"{pattern:>9} {chunk >> 10:>6}K {st.bytes_written / table.nbytes:>8.1%} "
                f"{st.blobs_written:>9} {total:>9} {t2:>10.3f} {first:>10.3f}"
            )
            shutil.rmtree(root, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# compress


def _trained_tensors() -> dict[str, np.ndarray[Any, Any]]:
    import ml_dtypes
    import torch

    torch.manual_seed(0)
    width, depth = 1024, 4
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(width, 16))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    teacher = torch.randn(width, 16) / width**0.5
    for _ in range(300):
        x = torch.randn(128, width)
        loss = torch.nn.functional.mse_loss(model(x), torch.tanh(x @ teacher))
        opt.zero_grad()
        loss.backward()
        opt.step()
    weights = [p for p in model.parameters() if p.dim() == 2]
    state = [opt.state[p] for p in weights]

    def cat(ts: list[torch.Tensor]) -> np.ndarray[Any, Any]:
        return torch.cat([t.detach().reshape(-1) for t in ts]).numpy()

    w = cat(weights)
    fresh = np.random.default_rng(0).standard_normal(w.size).astype(np.float32) / width**0.5
    return {
        "fp32 trained weights": w,
        "bf16 trained weights": w.astype(ml_dtypes.bfloat16),
        "fp32 Adam exp_avg": cat([s["exp_avg"] for s in state]),
        "fp32 Adam exp_avg_sq": cat([s["exp_avg_sq"] for s in state]),
        "bf16 Adam exp_avg_sq": cat([s["exp_avg_sq"] for s in state]).astype(ml_dtypes.bfloat16),
        "fp32 normal init": fresh,
        "bf16 normal init": fresh.astype(ml_dtypes.bfloat16),
    }


def bench_compress(repeats: int) -> None:
    from savepoint.blobs import frame

    tensors = _trained_tensors()
    chunk = 4 * MiB
    print("\n## zstd per 4 MiB chunk: stored/raw, compress and decompress GiB/s (one thread)")
    print(
        f"{'tensor':>22} {'MiB':>5} {'level':>5} {'shuffle':>7} {'ratio':>6} {'comp':>6} {'dec':>6}"
    )
    for name, arr in tensors.items():
        raw = memoryview(arr.reshape(-1).view(np.uint8))
        pieces = [raw[i : i + chunk] for i in range(0, len(raw), chunk)]
        for level in (1, 3, 9):
            for shuffle in (False, True):
                policy = frame.Compression(
                    level=level, shuffle=shuffle, min_saving=0.0, probe=False
                )
                encoded = [frame.encode(p, policy, arr.dtype.itemsize) for p in pieces]
                stored = sum(len(e[2]) for e in encoded)

                def comp(
                    policy: frame.Compression = policy,
                    pieces: list[memoryview] = pieces,
                    itemsize: int = arr.dtype.itemsize,
                ) -> None:
                    for p in pieces:
                        frame.encode(p, policy, itemsize)

                headers = [
                    frame.Header(c, s, len(p), len(e)) for (c, s, e), p in zip(encoded, pieces)
                ]
                outs = [np.empty(len(p), np.uint8) for p in pieces]

                def dec(
                    encoded: list[Any] = encoded,
                    headers: list[Any] = headers,
                    outs: list[Any] = outs,
                ) -> None:
                    for (_c, _s, e), h, o in zip(encoded, headers, outs):
                        frame.decode(h, e, o, shown="bench")

                gib = len(raw) / (1 << 30)
                tc = _median_time(comp, max(1, repeats // 2), 0.1)
                td = _median_time(dec, max(1, repeats // 2), 0.1)
                print(
                    f"{name:>22} {len(raw) / MiB:>5.0f} {level:>5} {shuffle!s:>7} "
                    f"{stored / len(raw):>6.3f} {gib / tc:>6.2f} {gib / td:>6.2f}"
                )


# --------------------------------------------------------------------------------------------
# lora


def bench_lora(base_dir: str, repeats: int) -> None:
    from savepoint.blobs import BlobStore, FastMemo
    from savepoint.storage.local import LocalStore

    rng = np.random.default_rng(0)
    frozen = [rng.standard_normal(8 * MiB // 4 * 3, dtype=np.float32) for _ in range(20)]  # 480 MiB
    trainable = [rng.standard_normal(MiB // 4, dtype=np.float32) for _ in range(24)]  # 24 MiB
    total = sum(a.nbytes for a in frozen + trainable)
    print(
        f"\n## LoRA-style: {total / MiB:.0f} MiB, {sum(a.nbytes for a in frozen) / total:.0%} frozen"
    )
    for memo_on in (False, True):
        root = os.path.join(base_dir, f"lora-{memo_on}")
        shutil.rmtree(root, ignore_errors=True)
        blobs = BlobStore(LocalStore(), root)
        memo = FastMemo() if memo_on else None
        t0 = time.perf_counter()
        with blobs.session() as s:
            for a in frozen + trainable:
                s.put_chunked(a, workers=2, memo=memo)
            s.sync()
        full = time.perf_counter() - t0
        times, written = [], []
        for step in range(repeats):
            for a in trainable:
                a += 0.001 * (step + 1)
            t0 = time.perf_counter()
            with blobs.session() as s:
                for a in frozen + trainable:
                    s.put_chunked(a, workers=2, memo=memo)
                s.sync()
            times.append(time.perf_counter() - t0)
            written.append(s.stats.bytes_written)
        inc = statistics.median(times)
        print(
            f"memo={memo_on!s:>5}: full save {full:.3f} s; incremental {inc:.3f} s "
            f"({inc / full:.2f}x), writes {statistics.median(written) / total:.1%} of the bytes"
        )
        shutil.rmtree(root, ignore_errors=True)


def bench_read(base_dir: str, repeats: int) -> None:
    from savepoint.blobs import BlobStore, Compression, Recipe
    from savepoint.storage.local import LocalStore

    data = (np.random.default_rng(0).standard_normal(64 * MiB) * 0.02).astype(np.float32)
    out = np.empty(data.nbytes, np.uint8)
    out.fill(0)
    print("\n## restore 256 MiB float32 from the local store (warm): seconds, median")
    print(f"{'stored':>6} {'check':>7} {'threads':>7} {'time':>7} {'GiB/s':>6}")
    for compressed in (False, True):
        root = os.path.join(base_dir, f"read-{compressed}")
        shutil.rmtree(root, ignore_errors=True)
        blobs = BlobStore(LocalStore(), root)
        policy = Compression() if compressed else None
        recipe = blobs.put_chunked(data, compression=policy, workers=2)
        for full in (False, True):
            for workers in (1, 2):

                def read(
                    full: bool = full,
                    workers: int = workers,
                    blobs: BlobStore = blobs,
                    recipe: Recipe = recipe,
                ) -> None:
                    blobs.read_recipe(recipe, out=out, full=full, workers=workers)

                t = _median_time(read, repeats, 0.0)
                print(
                    f"{'zstd' if compressed else 'raw':>6} {'blake3' if full else 'xxh3':>7} "
                    f"{workers:>7} {t:>7.3f} {data.nbytes / (1 << 30) / t:>6.2f}"
                )
        assert out.tobytes() == data.tobytes()
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=["hash", "chunks", "compress", "read", "lora"])
    parser.add_argument("--sizes", nargs="*", type=int, default=[1, 16, 64, 256])
    parser.add_argument("--dir", default=None)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    base = args.dir or tempfile.mkdtemp(prefix="sp-bench-blobs-")
    os.makedirs(base, exist_ok=True)
    try:
        if "hash" in args.only:
            bench_hash(args.sizes, args.repeats)
        if "chunks" in args.only:
            bench_chunks(base, args.repeats)
        if "compress" in args.only:
            bench_compress(args.repeats)
        if "read" in args.only:
            bench_read(base, args.repeats)
        if "lora" in args.only:
            bench_lora(base, args.repeats)
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
