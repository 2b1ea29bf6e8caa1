"""Regenerate the golden patched checkpoint: ``tests/golden/v5/`` (format version 5).

Usage, from the repository root::

    .venv/bin/python tests/golden/make_golden_patches.py

``v5/base`` is an incremental save of :func:`golden_table` into the blob store ``v5/blobs``;
``v5/ck`` is the save after rows 3, 100 and 255 changed (:func:`changed_table`), which the
writer stores as one patch of three 512-byte blocks on ``base``'s chunks (a version 5
manifest). ``created`` is fixed as in ``make_golden.py``. Only regenerate when the format
changes on purpose (then as a new directory); ``tests/formats/test_golden_patches.py`` checks
that the current writer produces the same bytes.
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
METADATA: dict[str, Any] = {"step": 92, "run": "golden-patches"}
CHUNK = 64 << 10
ROWS = (3, 100, 255)


def golden_table() -> np.ndarray[Any, Any]:
    return (np.arange(256 * 128, dtype=np.float32) / 4).reshape(256, 128)  # 128 KiB, 512 B rows


def changed_table() -> np.ndarray[Any, Any]:
    table = golden_table()
    for r in ROWS:
        table[r] = -table[r] - 1
    return table


def policy() -> Any:
    from savepoint.blobs import BlobPolicy

    return BlobPolicy(chunk_size=CHUNK, min_blob_bytes=4 << 10, workers=1)


def write(target: str) -> None:
    """The golden checkpoints, written under ``target`` (``base/``, ``ck/`` and ``blobs/``)."""
    from savepoint.blobs import FastMemo
    from savepoint.blobs.patch import PatchTracker
    from savepoint.checkpoint import DEFAULT_MAX_FILE_BYTES, save_incremental
    from savepoint.codecs import manifest as mf

    memo, tracker = FastMemo(), PatchTracker()
    for name, table in (("base", golden_table()), ("ck", changed_table())):
        save_incremental(
            os.path.join(target, name),
            {"emb": table, "step": 92},
            METADATA,
            os.path.join(target, "blobs"),
            policy(),
            DEFAULT_MAX_FILE_BYTES,
            1,
            False,
            None,
            memo=memo,
            tracker=tracker,
        )
        path = os.path.join(target, name, mf.NAME)
        with open(path, "rb") as f:
            m = mf.parse(f.read())
        m.created = CREATED
        with open(path, "wb") as f:
            f.write(mf.dumps(m))


def main() -> int:
    if not any(p.endswith("src") for p in sys.path[:2]) and "PYTHONPATH" not in os.environ:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "src"))
    target = os.path.join(HERE, "v5")
    with tempfile.TemporaryDirectory() as tmp:
        write(tmp)
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(tmp, target)
    print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
