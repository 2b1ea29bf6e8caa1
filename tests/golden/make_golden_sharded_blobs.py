"""Regenerate the golden sharded incremental checkpoint: ``tests/golden/v4-sharded/`` (format
version 4 with ``world_size``: shards that name blob recipes).

Usage, from the repository root::

    .venv/bin/python tests/golden/make_golden_sharded_blobs.py

``v4-sharded/ck`` is a one-rank sharded incremental save (complete ``Shard`` / ``FlatShard``
pieces, no process group, ``blobs=``) of :func:`golden_state` into ``v4-sharded/blobs`` (named
``../blobs``), with ``created`` fixed as in ``make_golden.py``. The policy sends pieces of 4 KiB
or more to the store in chunks of 64 KiB: ``model/w`` (300 KiB, a box shard) is five blobs,
``flat`` (8 KiB, a flat shard) one, ``replicated`` (24 bytes) stays in the data file. Only
regenerate when the format changes on purpose (then as a new directory);
``tests/formats/test_golden_sharded_blobs.py`` checks that the current writer produces the same
bytes.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
CREATED = "2025-01-01T00:00:00.000000Z"
METADATA: dict[str, Any] = {"step": 53, "run": "golden-sharded-blobs"}
CHUNK = 64 << 10
MIN_BLOB = 4 << 10


def golden_arrays() -> dict[str, np.ndarray[Any, Any]]:
    return {
        "w": (np.arange(256 * 300, dtype=np.float32) / 4).reshape(256, 300),  # 300 KiB
        "f": np.arange(-512, 512, dtype=np.int64).reshape(32, 32),  # 8 KiB
        "r": np.array([1.5, -2.5, 3.5], dtype=np.float64),
    }


def golden_state() -> dict[str, Any]:
    from savepoint.distributed import FlatShard, Shard

    a = golden_arrays()
    return {
        "model": {"w": Shard(a["w"], a["w"].shape, (0, 0))},
        "flat": FlatShard(a["f"].ravel(), a["f"].shape, 0),
        "replicated": a["r"],
        "step": 53,
    }


def policy() -> Any:
    from savepoint.blobs import BlobPolicy

    return BlobPolicy(chunk_size=CHUNK, min_blob_bytes=MIN_BLOB, workers=1)


def write(target: str) -> None:
    """The golden checkpoint, written under ``target`` (``ck/`` and ``blobs/``)."""
    import savepoint as sp
    from savepoint.codecs import manifest as mf

    sp.save(
        os.path.join(target, "ck"),
        golden_state(),
        metadata=METADATA,
        blobs=os.path.join(target, "blobs"),
        blob_policy=policy(),
    )
    path = os.path.join(target, "ck", mf.NAME)
    with open(path, "rb") as f:
        m = mf.parse(f.read())
    m.created = CREATED
    with open(path, "wb") as f:
        f.write(mf.dumps(m))


def main() -> int:
    if not any(p.endswith("src") for p in sys.path[:2]) and "PYTHONPATH" not in os.environ:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "src"))
    target = os.path.join(HERE, "v4-sharded")
    with tempfile.TemporaryDirectory() as tmp:
        write(tmp)
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(tmp, target)
    print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
