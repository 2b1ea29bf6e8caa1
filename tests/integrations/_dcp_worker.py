"""One rank of a DCP session (``tests/integrations/test_dcp.py``): ``phase rank world port dir``.

Phases: ``save`` (dcp.save of a DTensor state through SavepointWriter and DCP's FileSystemWriter),
``load`` (dcp.load through SavepointReader and FileSystemReader, each compared with the expected
tensors), ``fail`` (rank 1 cannot write: nothing may be committed), ``loop`` (save forever: a
process to SIGKILL). Writes ``<phase>-rank<r>.json`` with what it saw.
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
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from savepoint.integrations.dcp import SavepointReader, SavepointWriter

W = torch.arange(16 * 12, dtype=torch.float32).reshape(16, 12) / 7
V = torch.arange(10, dtype=torch.float64) - 4.5
R = (torch.arange(9, dtype=torch.float32).reshape(3, 3) / 3).to(torch.bfloat16)


def state(world: int, fill: bool, mesh: Any) -> dict[str, Any]:
    from torch.distributed.tensor import Shard, distribute_tensor

    w, v, r = (W, V, R) if fill else (torch.zeros_like(W), torch.zeros_like(V), torch.zeros_like(R))
    if mesh is None:
        return {"model": {"w": w.clone(), "v": v.clone()}, "r": r.clone(), "step": 7 if fill else 0}
    return {
        "model": {
            "w": distribute_tensor(w, mesh, [Shard(0)]),
            "v": distribute_tensor(v, mesh, [Shard(0)]),
        },
        "r": r.clone(),
        "step": 7 if fill else 0,
    }


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
        sp_path = os.path.join(workdir, "sp")
        fs_path = os.path.join(workdir, "fs")
        if phase == "save":
            st = state(world, True, mesh)
            dcp.save(st, storage_writer=SavepointWriter(sp_path))
            dcp.save(st, storage_writer=FileSystemWriter(fs_path))
            out["checks"]["saved"] = "ok"
        elif phase == "load":
            want = state(world, True, mesh)
            got_sp = state(world, False, mesh)
            got_fs = state(world, False, mesh)
            dcp.load(got_sp, storage_reader=SavepointReader(sp_path))
            dcp.load(got_fs, storage_reader=FileSystemReader(fs_path))
            for key in ("w", "v"):
                a, b, c = (local(s["model"][key]) for s in (got_sp, got_fs, want))
                ok = torch.equal(a, c) and torch.equal(b, c) and a.dtype == c.dtype
                out["checks"][key] = "ok" if ok else f"differs: {a} {b} {c}"
            same_r = torch.equal(got_sp["r"], R) and torch.equal(got_fs["r"], R)
            out["checks"]["r"] = "ok" if same_r else "differs"
            out["checks"]["step"] = "ok" if got_sp["step"] == got_fs["step"] == 7 else "differs"
        elif phase == "fail":
            st = state(world, True, mesh)
            if rank == 1:
                st["bad"] = torch.zeros(2, dtype=torch.complex32)  # a dtype savepoint refuses
            try:
                dcp.save(st, storage_writer=SavepointWriter(os.path.join(workdir, "failed")))
                out["checks"]["raised"] = "no error"
            except BaseException as exc:  # DCP's CheckpointException (a BaseException), every rank
                out["checks"]["raised"] = "ok"
                out["error"] = str(exc)[:2000]
        elif phase == "loop":
            i = 0
            while True:
                i += 1
                st = {"w": torch.full((256, 1024), float(i)), "v": torch.full((7,), float(i))}
                dcp.save(st, storage_writer=SavepointWriter(sp_path))
                with open(os.path.join(workdir, "saved"), "w") as f:
                    f.write(str(i))
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
