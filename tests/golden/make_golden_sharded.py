"""Regenerate a golden sharded checkpoint: ``tests/golden/v3/`` (format version 3, what sharded
saves write now) or, run against an older tree, ``v2/``.

Usage, from the repository root::

    .venv/bin/python tests/golden/make_golden_sharded.py v3

``v2/`` was written by this script run with the ``src/`` of commit a494a98 (the last writer of
version 2) on ``sys.path``: ``git worktree add /tmp/v2 a494a98``, then
``PYTHONPATH=/tmp/v2/src .venv/bin/python tests/golden/make_golden_sharded.py v2``.

A one-rank sharded save (complete ``sp.Shard`` / ``sp.FlatShard`` pieces, no process group) of
:func:`golden_state`, with ``created`` fixed as in ``make_golden.py``. The large tensor (300 KiB)
gets block checksums in version 3. Only regenerate ``v3/`` when the format changes on purpose
(then as a new directory); ``tests/formats/test_golden_sharded.py`` reads both and checks that the
current writer produces ``v3/`` byte for byte.
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
METADATA: dict[str, Any] = {"step": 77, "run": "golden-sharded"}


def golden_arrays() -> dict[str, np.ndarray[Any, Any]]:
    return {
        "w": (np.arange(256 * 300, dtype=np.float32) / 8).reshape(256, 300),  # 300 KiB
        "f": np.arange(-40, 40, dtype=np.int16).reshape(8, 10),
        "r": np.array([1.5, -2.5, 3.5], dtype=np.float64),
    }


def golden_state(sp: Any) -> dict[str, Any]:
    a = golden_arrays()
    return {
        "model": {"w": sp.Shard(a["w"], a["w"].shape, (0, 0))},
        "flat": sp.FlatShard(a["f"].ravel(), a["f"].shape, 0),
        "replicated": a["r"],
        "step": 77,
    }


def main() -> int:
    version = sys.argv[1] if len(sys.argv) > 1 else "v3"
    if not any(p.endswith("src") for p in sys.path[:2]) and "PYTHONPATH" not in os.environ:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "src"))
    import savepoint as sp
    from savepoint.codecs import manifest as mf

    target = os.path.join(HERE, version)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = os.path.join(tmp, version)
        sp.save(ckpt, golden_state(sp), metadata=METADATA)
        path = os.path.join(ckpt, mf.NAME)
        with open(path, "rb") as f:
            raw = f.read()
        m = mf.parse(raw)
        if f"v{m.format_version}" != version:
            raise SystemExit(f"this savepoint writes format version {m.format_version}")
        if mf.dumps(m) != raw:
            raise SystemExit("manifest does not re-serialise identically; refusing to rewrite it")
        m.created = CREATED
        with open(path, "wb") as f:
            f.write(mf.dumps(m))
        if os.path.exists(target):
            shutil.rmtree(target)
        shutil.copytree(ckpt, target)
    sp.verify(target)
    print(f"wrote {target}: format version {m.format_version}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
