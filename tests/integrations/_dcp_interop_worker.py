"""One rank of a DCP interop session (``tests/integrations/test_dcp_interop.py``):
``phase rank world port dir``.

Phases: ``save`` (plain ``dcp.save`` through DCP's own FileSystemWriter of a state whose big
tensors are DTensors sharded on dim 0 and dim 1, into ``dir/dcp``), ``save_safetensors`` (the
same with ``SerializationFormat.SAFETENSORS``, into ``dir/dcp-st``), ``load`` (``dcp.load`` of
``dir/export``, savepoint's DCP export of :func:`full_state`, into DTensors sharded over this
world's ranks, compared with the expected parts). Writes ``<phase>-rank<r>.json``.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp


def full_state() -> dict[str, Any]:
    """The state every test compares with (deterministic)."""
    g = torch.Generator().manual_seed(30)
    return {
        "model": {
            "w": torch.randn(10, 6, generator=g),  # sharded on dim 0
            "c": torch.randn(4, 9, generator=g),  # sharded on dim 1
            "h": torch.randn(7, generator=g).to(torch.bfloat16),
            "t": torch.randn(6, 5, generator=g).t(),  # stored with its strides by DCP
            "i": torch.arange(5, dtype=torch.int64) - 2,
            "s": torch.tensor(2.5),
            "big": torch.randn(256, 4096, generator=g),  # 4 MiB, sharded on dim 1
        },
        "optim": {
            "state": {0: {"exp_avg": torch.randn(10, 6, generator=g), "step": torch.tensor(3.0)}},
            "param_groups": [{"lr": 0.01, "betas": (0.9, 0.999), "params": ["model.w"]}],
        },
        "step": 7,
        "name": "run-1",
    }


SHARDED = {
    ("model", "w"): 0,
    ("model", "c"): 1,
    ("model", "big"): 1,
    ("optim", "state", 0, "exp_avg"): 0,
}


def _get(state: Any, path: tuple[Any, ...]) -> Any:
    for p in path:
        state = state[p]
    return state


def _set(state: Any, path: tuple[Any, ...], value: Any) -> None:
    _get(state, path[:-1])[path[-1]] = value


def distributed(state: dict[str, Any], mesh: Any) -> dict[str, Any]:
    """``state`` with the tensors of :data:`SHARDED` as DTensors sharded over ``mesh``."""
    from torch.distributed.tensor import Shard, distribute_tensor

    for path, dim in SHARDED.items():
        _set(state, path, distribute_tensor(_get(state, path), mesh, [Shard(dim)]))
    return state


def zeros_like_state(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, dict):
        return {k: zeros_like_state(v) for k, v in state.items()}
    if isinstance(state, list):
        return [zeros_like_state(v) for v in state]
    return None if isinstance(state, (int, float, str, tuple)) else state


def local(t: Any) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def main() -> None:
    phase, rank, world, port, workdir = sys.argv[1], *map(int, sys.argv[2:5]), sys.argv[5]
    out: dict[str, Any] = {"checks": {}}
    mesh = None
    try:
        if world > 1:
            dist.init_process_group(
                "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
            )
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", (world,))
        if phase == "save":
            assert mesh is not None
            dcp.save(distributed(full_state(), mesh), checkpoint_id=os.path.join(workdir, "dcp"))
            out["checks"]["saved"] = "ok"
        elif phase == "save_safetensors":  # DCP's SerializationFormat.SAFETENSORS
            from torch.distributed.checkpoint.filesystem import SerializationFormat

            assert mesh is not None
            state = distributed(full_state(), mesh)
            state["model"]["t"] = state["model"]["t"].contiguous()  # safetensors needs it
            path = os.path.join(workdir, "dcp-st")
            writer = dcp.FileSystemWriter(
                path, serialization_format=SerializationFormat.SAFETENSORS
            )
            dcp.save(state, storage_writer=writer)
            out["checks"]["saved"] = "ok"
        elif phase == "load":
            want = full_state()
            got = zeros_like_state(full_state())
            if mesh is not None:
                want, got = distributed(want, mesh), distributed(got, mesh)
            dcp.load(got, checkpoint_id=os.path.join(workdir, "export"))
            for key in ("w", "c", "h", "t", "i", "s", "big"):
                a, b = local(got["model"][key]), local(want["model"][key])
                same = a.dtype == b.dtype and torch.equal(a, b)
                out["checks"][f"model.{key}"] = "ok" if same else f"differs: {a} {b}"
            a = local(got["optim"]["state"][0]["exp_avg"])
            b = local(want["optim"]["state"][0]["exp_avg"])
            out["checks"]["exp_avg"] = "ok" if torch.equal(a, b) else "differs"
            plain = (got["step"], got["name"], got["optim"]["param_groups"][0]["betas"])
            out["checks"]["values"] = "ok" if plain == (7, "run-1", (0.9, 0.999)) else str(plain)
        if world > 1:
            dist.barrier()
    except Exception:
        out["checks"]["exception"] = traceback.format_exc()
    finally:
        with open(os.path.join(workdir, f"{phase}-rank{rank}.json"), "w") as f:
            json.dump(out, f)
        if world > 1 and dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
