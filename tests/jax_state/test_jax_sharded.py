"""jax.Arrays sharded over 8 devices (XLA's forced host devices on the CPU) saved and restored
onto other meshes bit-exactly: each scenario of _sharded.py runs in a fresh interpreter, because
the device count is fixed when jax is first imported (this process may have imported it)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

if any(importlib.util.find_spec(m) is None for m in ("jax", "flax", "optax")):
    pytest.skip("needs jax, flax and optax (the jax extra)", allow_module_level=True)

pytestmark = pytest.mark.jax

CHILD = Path(__file__).with_name("_sharded.py")


@pytest.mark.parametrize("scenario", ["reshard", "flax", "property"])
def test_sharded_scenario(tmp_path: Path, scenario: str) -> None:
    """reshard: 8 devices -> a (2, 4) mesh -> 4 other devices -> one device, every sharding
    kind (rows, columns, a grid, partly replicated, replicated, bf16, int8, PRNG keys, a
    scalar), each distinct shard read once. flax: a linen TrainState with optax adamw and an
    NNX state sharded on 8 devices, restored onto a (2, 4) mesh from abstract targets; a
    CheckpointManager with async saves. property: hypothesis over meshes, specs, shapes and
    dtypes, and byte ranges of a sharded array's image."""
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "PYTHONPATH": os.pathsep.join(sys.path),
    }
    result = subprocess.run(
        [sys.executable, "-W", "error", str(CHILD), scenario, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"ok {scenario}" in result.stdout
