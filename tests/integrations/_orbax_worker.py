"""Orbax in a process of its own (``tests/integrations/test_orbax.py``), with 8 CPU devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=8``, set by the caller): ``mode out``.

Modes: ``pytree`` (``PyTreeCheckpointer``, OCDBT and zarr v2: the default), ``zarr3``
(``use_zarr3``), ``plain`` (no OCDBT: a directory per array), ``standard``
(``StandardCheckpointer``), ``manager`` (a ``CheckpointManager``'s steps 0 and 1), each of
:func:`state` (a ``jax.Array`` sharded over a 4 x 2 mesh, bf16, numpy arrays, scalars, a string,
None, empty containers, nested lists); and ``read-safetensors FILE`` (Orbax's own safetensors
layout reading ``FILE``, as numpy). Each writes ``out.npz``: every array under its ``/``-joined
path (bf16 as its uint16 bits), and ``out.json``: the plain values.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


def state() -> dict[str, Any]:
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("x", "y"))
    w = jnp.arange(8 * 6, dtype=jnp.float32).reshape(8, 6) / 7
    return {
        "params": {
            "w": jax.device_put(w, NamedSharding(mesh, P("x", "y"))),  # 8 shards
            "b": jnp.linspace(-1, 1, 5).astype(jnp.bfloat16),
            "layers": [
                {"k": np.arange(6, dtype=np.int32).reshape(2, 3)},
                {"k": np.ones(3, np.int64)},
            ],
        },
        "opt": {"count": np.int32(4), "mu": np.full((2, 2), 0.25, np.float64), "empty": {}},
        "step": 7,
        "lr": 1e-3,
        "done": False,
        "name": "run-1",
        "nothing": None,
    }


def flat(tree: Any, prefix: str = "") -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    arrays: dict[str, np.ndarray] = {}
    values: dict[str, Any] = {}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree)
    for k, v in items:
        key = f"{prefix}{k}"
        if isinstance(v, (dict, list, tuple)) and v:
            a, b = flat(v, key + "/")
            arrays.update(a)
            values.update(b)
        elif isinstance(v, (np.ndarray, jax.Array)) and np.ndim(v) > 0:
            host = np.asarray(v)
            arrays[key] = host.view(np.uint16) if host.dtype == jnp.bfloat16 else host
        else:
            values[key] = v.item() if hasattr(v, "item") else v
    return arrays, values


def main() -> None:
    mode, out = sys.argv[1], os.path.abspath(sys.argv[2])
    tree = state()
    if mode in ("standard", "manager"):  # StandardCheckpointer takes arrays and numbers only
        tree = {k: v for k, v in tree.items() if k not in ("name", "nothing")}
    if mode == "pytree":
        ocp.PyTreeCheckpointer().save(out, tree)
    elif mode in ("zarr3", "plain"):
        handler = ocp.PyTreeCheckpointHandler(use_zarr3=mode == "zarr3", use_ocdbt=mode != "plain")
        ocp.Checkpointer(handler).save(out, tree)
    elif mode == "standard":
        with ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save(out, tree)
            checkpointer.wait_until_finished()
    elif mode == "manager":
        with ocp.CheckpointManager(out) as manager:
            for step in (0, 1):
                tree["step"] = step
                manager.save(step, args=ocp.args.StandardSave(tree))
            manager.wait_until_finished()
    elif mode == "read-safetensors":
        from orbax.checkpoint.experimental import v1

        with v1.Context(checkpoint_layout=v1.options.CheckpointLayout.SAFETENSORS):
            tree = v1.load(sys.argv[3])
    else:
        raise SystemExit(f"unknown mode {mode}")
    arrays, values = flat(tree)
    np.savez(out + ".npz", **arrays)
    with open(out + ".json", "w") as f:
        json.dump(values, f)


if __name__ == "__main__":
    main()
