"""Regenerate the golden device-checksum checkpoint: ``tests/golden/v6/`` (format version 6).

Usage, from the repository root::

    .venv/bin/python tests/golden/make_golden_devhash.py

``v6/ck`` is an async save (a staged state written by the background writer) of
:func:`golden_state` in which the tensors ``model/w`` and ``odd`` were hashed with ``mlh64``
(:mod:`savepoint.codecs.devhash`), as a CUDA tensor is while it is staged, and the small one
with XXH3 (the size threshold is lowered to 4 KiB to keep the files small): a version 6 manifest mixing both. ``created`` is fixed as in ``make_golden.py``. Only
regenerate when the format changes on purpose (then as a new directory);
``tests/formats/test_golden_devhash.py`` checks that the current writer produces the same bytes.
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
METADATA: dict[str, Any] = {"step": 7, "run": "golden-devhash"}


def golden_state() -> dict[str, Any]:
    w = (np.arange(128 * 160, dtype=np.float32) / 7 - 3).reshape(128, 160)  # 80 KiB: 2 windows
    return {
        "model": {"w": w, "b": np.linspace(-1, 1, 33, dtype=np.float32)},
        "odd": np.arange(70001, dtype=np.uint8),  # an odd byte count, hashed as mlh64
        "step": 7,
    }


def write(target: str) -> None:
    """The golden checkpoint, written at ``target/ck``."""
    from savepoint.async_ import staging
    from savepoint.codecs import manifest as mf
    from savepoint.engine.save import save_staged
    from savepoint.state import tree
    from savepoint.storage.paths import resolve

    flat = tree.flatten(golden_state())
    before = staging.DEVICE_HASH_CPU, staging.DEVICE_HASH_MIN
    # What a CUDA state gets from its device, for tensors of 4 KiB or more.
    staging.DEVICE_HASH_CPU, staging.DEVICE_HASH_MIN = True, 4096
    try:
        staged = staging.StagingArena().stage(flat, 1 << 30)
        save_staged(resolve(os.path.join(target, "ck")), staged, METADATA, direct=False)
    finally:
        staging.DEVICE_HASH_CPU, staging.DEVICE_HASH_MIN = before
    path = os.path.join(target, "ck", mf.NAME)
    with open(path, "rb") as f:
        m = mf.parse(f.read(), columns=False)
    m.created = CREATED
    m.writer = "savepoint golden"
    with open(path, "wb") as f:
        f.write(mf.dumps(m))


def main() -> int:
    if not any(p.endswith("src") for p in sys.path[:2]) and "PYTHONPATH" not in os.environ:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "src"))
    target = os.path.join(HERE, "v6")
    with tempfile.TemporaryDirectory() as tmp:
        write(tmp)
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(tmp, target)
    print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
