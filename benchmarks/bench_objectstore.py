"""Object storage: savepoint's obstore backend against s3fs, on the same moto S3 server.

Both clients move the same bytes to and from one moto server (``ThreadedMotoServer`` in a child
process on 127.0.0.1): one save's worth of uploads (``--files`` blobs of ``--mib`` MiB in all,
written in 16 MiB pieces, as the engine hands them to a ``BlobWriter``) and a full load of them
read back with ranged GETs. savepoint's side is :class:`savepoint.storage.objectstore.ObjectStore`
(``create_blob``/``write``/``finish``, ``open_blob``/``read``); s3fs's side is
``S3FileSystem.open(..., "wb")`` with the same block size, and ``open(..., "rb")`` reads of the
same pieces. Medians of ``--repeat`` rounds, MiB/s, and the ratio s3fs time / obstore time.

A loopback server measures the clients' overhead and concurrency, not a network: moto is the
bottleneck well before S3 would be, so the ratios matter more than the absolute speeds.

    pip install -e '.[dev,bench]'
    python benchmarks/bench_objectstore.py [--mib 256] [--files 8] [--repeat 5]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import numpy as np

SERVE = """
import os, sys, time
from moto.server import ThreadedMotoServer
server = ThreadedMotoServer(ip_address="127.0.0.1", port=int(sys.argv[1]), verbose=False)
server.start()
parent = os.getppid()
while os.getppid() == parent:
    time.sleep(0.2)
server.stop()
"""
KEY, SECRET, REGION = "bench", "bench-secret", "us-east-1"
PIECE = 16 * 1024 * 1024


def start_server() -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVE, str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(endpoint + "/moto-api/", timeout=2):
                return proc, endpoint
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise SystemExit("the moto server did not start") from None
            time.sleep(0.1)


def use_server(endpoint: str) -> Any:
    """Point this process's S3 clients (obstore's environment) at ``endpoint`` and create the
    bucket ``bench``; returns a boto3 client for the benchmark's own housekeeping."""
    import boto3

    os.environ.update(
        {
            "AWS_ACCESS_KEY_ID": KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET,
            "AWS_REGION": REGION,
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_ALLOW_HTTP": "true",
        }
    )
    admin = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name=REGION,
        aws_access_key_id=KEY,
        aws_secret_access_key=SECRET,
    )
    admin.create_bucket(Bucket="bench")
    return admin


def timed(fn: Callable[[], None]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="bytes moved per round, in MiB")
    ap.add_argument("--files", type=int, default=8, help="blobs the bytes are split into")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument(
        "--no-end-to-end",
        action="store_true",
        help="skip sp.save/sp.load of a whole state against torch.save and DCP through s3fs",
    )
    args = ap.parse_args()

    import s3fs

    from savepoint.storage.objectstore import ObjectStore

    proc, endpoint = start_server()
    try:
        admin = use_server(endpoint)

        size = args.mib * 1024 * 1024 // args.files
        rng = np.random.default_rng(0)
        blobs = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(args.files)]

        store = ObjectStore("s3", part_size=PIECE)
        fs = s3fs.S3FileSystem(
            key=KEY,
            secret=SECRET,
            endpoint_url=endpoint,
            client_kwargs={"region_name": REGION},
            default_block_size=PIECE,
            default_fill_cache=False,
            use_listings_cache=False,
        )

        def clear() -> None:
            keys = [o["Key"] for o in admin.list_objects_v2(Bucket="bench").get("Contents", [])]
            if keys:
                admin.delete_objects(Bucket="bench", Delete={"Objects": [{"Key": k} for k in keys]})
            fs.invalidate_cache()

        def sp_save(tag: str) -> None:
            store.makedirs(f"/bench/{tag}")
            for i, blob in enumerate(blobs):
                w = store.create_blob(f"/bench/{tag}/f{i}", size=size)
                for pos in range(0, size, PIECE):
                    w.write(memoryview(blob[pos : pos + PIECE]))
                w.finish()

        def sp_load(tag: str) -> None:
            for i, blob in enumerate(blobs):
                r = store.open_blob(f"/bench/{tag}/f{i}")
                out = np.empty(size, dtype=np.uint8)
                for pos in range(0, size, PIECE):
                    r.read(pos, out[pos : pos + PIECE])
                r.close()
                assert np.array_equal(out, blob)

        def fs_save(tag: str) -> None:
            for i, blob in enumerate(blobs):
                with fs.open(f"bench/{tag}/f{i}", "wb", block_size=PIECE) as f:
                    for pos in range(0, size, PIECE):
                        f.write(memoryview(blob[pos : pos + PIECE]))

        def fs_load(tag: str) -> None:
            for i, blob in enumerate(blobs):
                out = np.empty(size, dtype=np.uint8)
                with fs.open(f"bench/{tag}/f{i}", "rb", block_size=PIECE, cache_type="none") as f:
                    for pos in range(0, size, PIECE):
                        f.seek(pos)
                        piece = f.read(min(PIECE, size - pos))
                        out[pos : pos + len(piece)] = np.frombuffer(piece, dtype=np.uint8)
                assert np.array_equal(out, blob)

        times: dict[str, list[float]] = {
            k: [] for k in ("sp save", "sp load", "fs save", "fs load")
        }
        for rnd in range(args.repeat + 1):  # round 0 warms both clients up and is not counted
            for who, save, load in (("sp", sp_save, sp_load), ("fs", fs_save, fs_load)):
                tag = f"{who}{rnd}"
                t_save = timed(lambda save=save, tag=tag: save(tag))
                t_load = timed(lambda load=load, tag=tag: load(tag))
                clear()
                if rnd:
                    times[f"{who} save"].append(t_save)
                    times[f"{who} load"].append(t_load)
        if not args.no_end_to_end:
            end_to_end(args.mib, args.repeat, fs, clear)
        admin.close()
    finally:
        proc.terminate()
        proc.wait(10)

    mib = args.mib
    print(
        f"{mib} MiB in {args.files} blobs, {args.repeat} rounds, moto server on loopback, "
        f"{os.cpu_count()} CPUs; median seconds (MiB/s)"
    )
    for op in ("save", "load"):
        sp_t = statistics.median(times[f"sp {op}"])
        fs_t = statistics.median(times[f"fs {op}"])
        print(
            f"  {op}: obstore {sp_t:.3f} s ({mib / sp_t:.0f} MiB/s)   s3fs {fs_t:.3f} s "
            f"({mib / fs_t:.0f} MiB/s)   s3fs/obstore {fs_t / sp_t:.2f}x"
        )


def end_to_end(mib: int, repeat: int, fs: object, clear: Callable[[], None]) -> None:
    """A whole state (float32 tensors, ``mib`` MiB) saved and loaded into existing tensors:
    ``sp.save``/``sp.load`` to ``s3://`` against ``torch.save``/``torch.load`` through an s3fs
    file and ``torch.distributed.checkpoint`` with its fsspec writer and reader on s3fs, medians
    of ``repeat``, and the peak extra resident memory of one savepoint save and load."""
    import torch

    import savepoint as sp
    from bench_save_load import PeakRSS

    n = mib * 1024 * 1024 // 4 // 16
    state = {f"layer{i}.weight": torch.randn(n) for i in range(16)}
    into = {k: torch.empty_like(v) for k, v in state.items()}

    def sp_save() -> None:
        sp.save("s3://bench/e2e-sp", state)

    def sp_load() -> None:
        sp.load("s3://bench/e2e-sp", into=into)

    def torch_save() -> None:
        with fs.open("bench/e2e-torch.pt", "wb", block_size=PIECE) as f:  # type: ignore[attr-defined]
            torch.save(state, f)

    def torch_load() -> None:
        with fs.open("bench/e2e-torch.pt", "rb", block_size=PIECE) as f:  # type: ignore[attr-defined]
            loaded = torch.load(f, weights_only=True)
        for k, t in into.items():
            t.copy_(loaded[k])

    # The floor: the same bytes as raw obstore calls, with savepoint's part size and concurrency
    # (one multipart put per data file savepoint writes, then parallel ranged GETs of
    # ``read_chunk`` into one buffer per file, as many at once as savepoint's loads run).
    import concurrent.futures

    import obstore
    from obstore.store import S3Store

    from savepoint.engine.read import locate
    from savepoint.storage.objectstore import shared

    sp_save()
    spstore = shared("s3")
    base = locate(spstore, "/bench/e2e-sp")  # the committed generation's directory
    sizes = [
        spstore.stat(f"{base}/{name}").size  # type: ignore[union-attr]
        for name in sorted(spstore.list(base))
        if name.endswith(".safetensors")
    ]
    flat = np.concatenate([t.numpy().view(np.uint8).ravel() for t in state.values()])
    flat = np.resize(flat, sum(sizes)) if sum(sizes) != flat.size else flat
    raw_store = S3Store("bench", client_options={"allow_http": True})
    pool = concurrent.futures.ThreadPoolExecutor(spstore.max_concurrency)

    def raw_put() -> None:
        pos = 0
        for i, size in enumerate(sizes):
            obstore.put(
                raw_store,
                f"e2e-raw/f{i}",
                memoryview(flat[pos : pos + size]),
                chunk_size=spstore.part_size,
                max_concurrency=spstore.max_concurrency,
            )
            pos += size

    def raw_get() -> None:
        chunk = spstore.read_chunk
        for i, size in enumerate(sizes):
            out = np.empty(size, dtype=np.uint8)

            def one(start: int, out: np.ndarray = out, i: int = i, size: int = size) -> None:
                got = obstore.get_range(
                    raw_store, f"e2e-raw/f{i}", start=start, end=min(start + chunk, size)
                )
                out[start : start + len(got)] = np.frombuffer(got, dtype=np.uint8)

            list(pool.map(one, range(0, size, chunk)))

    try:
        from lightning_fabric.utilities.cloud_io import _atomic_save as lightning_save

        lightning_what = "lightning_fabric's _atomic_save"
    except ImportError:
        import io

        import fsspec

        def lightning_save(checkpoint: object, filepath: str) -> None:
            # What Lightning's TorchCheckpointIO does for a remote path (lightning_fabric
            # utilities/cloud_io.py _atomic_save): torch.save to memory, then one fsspec write.
            buffer = io.BytesIO()
            torch.save(checkpoint, buffer)
            fs, path = fsspec.core.url_to_fs(filepath)
            with fs.transaction, fs.open(path, "wb") as f:
                f.write(buffer.getvalue())

        lightning_what = "Lightning's remote save (torch.save to memory, then fsspec; replica)"

    def lightning_remote_save() -> None:
        lightning_save(state, "s3://bench/e2e-lightning.ckpt")

    runs: dict[str, Callable[[], None]] = {
        "savepoint save": sp_save,
        "savepoint load": sp_load,
        "raw obstore put": raw_put,
        "raw obstore get": raw_get,
        "torch.save via s3fs": torch_save,
        "torch.load via s3fs": torch_load,
        "lightning remote save": lightning_remote_save,
    }
    try:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

        def dcp_save() -> None:
            dcp.save(state, storage_writer=FsspecWriter("s3://bench/e2e-dcp", overwrite=True))

        def dcp_load() -> None:
            dcp.load(into, storage_reader=FsspecReader("s3://bench/e2e-dcp"))

        runs["dcp.save via fsspec"] = dcp_save
        runs["dcp.load via fsspec"] = dcp_load
    except ImportError as exc:
        print(f"  (DCP's fsspec writer is not available: {exc})")
    times: dict[str, list[float]] = {k: [] for k in runs}
    for rnd in range(repeat + 1):
        for name, fn in runs.items():
            try:
                t = timed(fn)
            except Exception as exc:  # a peer that cannot run here is reported, not fatal
                print(f"  {name} failed: {exc!r}")
                times.pop(name, None)
                continue
            if rnd and name in times:
                times[name].append(t)
        runs = {k: v for k, v in runs.items() if k in times}
    med = {k: statistics.median(v) for k, v in times.items() if v}
    print(f"\nwhole state: 16 float32 tensors, {mib} MiB; median of {repeat} (s)")
    for k, v in med.items():
        print(f"  {k:22s} {v:7.3f}   {mib / v:6.0f} MiB/s")
    print(f"  (lightning remote save: {lightning_what})")
    for op, floor in (("save", "raw obstore put"), ("load", "raw obstore get")):
        if floor in med:
            print(
                f"  savepoint {op} throughput / {floor}: "
                f"{med[floor] / med[f'savepoint {op}']:.2f}x (target >= 0.9)"
            )
    for op, peers in (
        ("save", ("torch.save via s3fs", "dcp.save via fsspec", "lightning remote save")),
        ("load", ("torch.load via s3fs", "dcp.load via fsspec")),
    ):
        for peer in peers:
            if peer in med:
                print(
                    f"  savepoint {op} time / {peer:22s} {med[f'savepoint {op}'] / med[peer]:.2f}"
                )
    print(f"  peak extra resident memory over a {mib} MiB state:")
    for name, fn in runs.items():
        with PeakRSS() as mem:
            fn()
        print(f"    {name:22s} {mem.extra / 2**20:6.0f} MiB")
    pool.shutdown()
    clear()


if __name__ == "__main__":
    main()
