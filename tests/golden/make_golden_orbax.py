"""Regenerate the golden Orbax checkpoint in ``tests/golden/orbax/``: what orbax-checkpoint 0.12.8
(tensorstore 0.1.86) writes for :func:`golden_state` with ``PyTreeCheckpointer`` (OCDBT, zarr
v2, zstd), about 3 KiB. It seeds the fuzz target ``orbax`` and is read by
``tests/formats/test_orbax_golden.py`` (with tensorstore, without orbax or jax).

Usage, from the repository root::

    .venv/bin/python tests/golden/make_golden_orbax.py
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
TARGET = os.path.join(HERE, "orbax")


def golden_state() -> dict[str, Any]:
    """The state (bfloat16 as its uint16 bits under ``b_bits``: the caller views it)."""
    return {
        "w": (np.arange(6, dtype=np.float32).reshape(2, 3) - 2.5) / 4,
        "b_bits": np.array([0x3F80, 0x4000, 0xBF80, 0x7F80], dtype=np.uint16),  # 1 2 -1 inf
        "nested": [np.arange(3, dtype=np.int32), {"z": np.full((2, 2), 0.5, np.float16)}],
        "step": 3,
        "name": "golden",
    }


def main() -> None:
    import ml_dtypes
    import orbax.checkpoint as ocp

    g = golden_state()
    tree = {k: v for k, v in g.items() if k != "b_bits"}
    tree["b"] = g["b_bits"].view(ml_dtypes.bfloat16)
    shutil.rmtree(TARGET, ignore_errors=True)
    ocp.PyTreeCheckpointer().save(TARGET, tree)
    print("wrote", TARGET, sorted(os.listdir(TARGET)))


if __name__ == "__main__":
    main()
