"""Cost of inference snapshots: take, restore, and every encoding, per MiB of state.

Usage::

    .venv/bin/python benchmarks/bench_snapshot.py [--layers 32] [--hidden 1024] [--state 16]
        [--steps 256] [--input 1024] [--repeats 50] [--dir /tmp]

The state is ``layers`` float32 matrices of ``hidden x state`` (the seed's HiddenState) plus a
history of ``steps`` float32 input vectors of length ``input``: 2 MiB + 1 MiB with the defaults.
Each operation runs once to warm up, then ``repeats`` times; the table shows medians, in ms and in
ms per MiB of array data. Rows:

- ``memcpy floor``: ``np.copyto`` of every array into already-touched buffers of the same shapes
  (what a take or a restore cannot beat);
- ``take (new buffers)``: ``InferenceSnapshot(states=..., history=...)``, allocating its copies;
- ``take (ring, reused)``: ``SnapshotHistory.take`` on a full ring, copying into the buffers of
  the snapshot it evicts;
- ``restore``: ``snapshot.restore_into(states, history)`` into the live arrays and list;
- ``to_bytes``/``from_bytes``, ``to_msgpack``/``from_msgpack``, ``to_json``/``from_json``;
- ``save``/``load``: the native checkpoint directory (durable: fsynced), in ``--dir``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from savepoint.inference import InferenceSnapshot, SnapshotHistory

MiB = 1 << 20


def median_ms(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm-up: first-touch allocation, caches, imports
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--state", type=int, default=16)
    parser.add_argument("--steps", type=int, default=256)
    parser.add_argument("--input", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--dir", default=None, help="where save/load write (default: a tmp dir)")
    parser.add_argument("--skip-json", action="store_true", help="JSON is slow; skip it")
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    states = [
        rng.standard_normal((args.hidden, args.state), dtype=np.float32) for _ in range(args.layers)
    ]
    inputs = [rng.standard_normal(args.input, dtype=np.float32) for _ in range(args.steps)]
    config = {"num_layers": args.layers, "hidden_dim": args.hidden, "state_dim": args.state}
    snap = InferenceSnapshot(states=states, history=inputs, step_count=1000, config=config)
    mib = snap.nbytes / MiB
    print(
        f"state: {args.layers} x {args.hidden}x{args.state} float32 + {args.steps} inputs of "
        f"{args.input} float32 = {mib:.2f} MiB in {args.layers + args.steps} arrays; "
        f"median of {args.repeats}"
    )

    floor_dst = [np.empty_like(a) for a in states + inputs]

    def memcpy() -> None:
        for dst, src in zip(floor_dst, states + inputs):
            np.copyto(dst, src)

    ring = SnapshotHistory(4)
    for _ in range(4):
        ring.take(states=states, history=inputs, step_count=1000, config=config)

    def take_ring() -> None:
        ring.take(states=states, history=inputs, step_count=1000, config=config)

    live_states = [np.empty_like(a) for a in states]
    live_history = [np.empty_like(a) for a in inputs]

    rows: list[tuple[str, Callable[[], Any], int]] = [
        ("memcpy floor", memcpy, args.repeats),
        (
            "take (new buffers)",
            lambda: InferenceSnapshot(
                states=states, history=inputs, step_count=1000, config=config
            ),
            args.repeats,
        ),
        ("take (ring, reused)", take_ring, args.repeats),
        ("restore", lambda: snap.restore_into(live_states, live_history), args.repeats),
    ]
    blob = snap.to_bytes()
    packed = snap.to_msgpack()
    rows += [
        ("to_bytes", snap.to_bytes, args.repeats),
        ("from_bytes", lambda: InferenceSnapshot.from_bytes(blob), args.repeats),
        ("to_msgpack", snap.to_msgpack, max(args.repeats // 5, 3)),
        ("from_msgpack", lambda: InferenceSnapshot.from_msgpack(packed), max(args.repeats // 5, 3)),
    ]
    if not args.skip_json:
        text = snap.to_json()
        rows += [
            ("to_json", snap.to_json, max(args.repeats // 10, 3)),
            ("from_json", lambda: InferenceSnapshot.from_json(text), max(args.repeats // 10, 3)),
        ]
    workdir = tempfile.mkdtemp(prefix="savepoint-bench-snapshot-", dir=args.dir)
    path = os.path.join(workdir, "snap")
    rows += [
        ("save (native, fsync)", lambda: snap.save(path), max(args.repeats // 5, 3)),
        ("load (native, warm)", lambda: InferenceSnapshot.load(path), max(args.repeats // 5, 3)),
    ]
    sizes = {"to_bytes": len(blob), "to_msgpack": len(packed)}
    if not args.skip_json:
        sizes["to_json"] = len(text.encode("utf-8"))
    try:
        print(f"{'operation':<22} {'ms':>9} {'ms/MiB':>9}")
        for name, fn, repeats in rows:
            ms = median_ms(fn, repeats)
            extra = f"   ({sizes[name] / MiB:.2f} MiB encoded)" if name in sizes else ""
            print(f"{name:<22} {ms:9.3f} {ms / mib:9.3f}{extra}")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    assert InferenceSnapshot.from_bytes(blob) == snap
    assert all(np.array_equal(a, b) for a, b in zip(live_states, states))


if __name__ == "__main__":
    main()
