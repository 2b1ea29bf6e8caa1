"""Regenerate the golden DCP checkpoint in ``tests/golden/dcp/``: what torch 2.13's plain
``dcp.save`` (DCP's own FileSystemWriter) writes on 2 gloo ranks.

Usage, from the repository root::

    .venv/bin/python tests/golden/make_golden_dcp.py

The state (:func:`golden_state`, also imported by ``tests/formats/test_dcp_golden.py``, which
needs no torch to check it): ``w`` a float32 DTensor sharded on dim 1 (two column chunks),
``h`` bfloat16, ``t`` a transposed float32 tensor (stored by DCP with its strides), ``n`` an
int64 0-d tensor, and ``step`` (7) and ``name`` ("golden"), values DCP serialises with
``torch.save`` (BYTE_IO). The files are small (16 KiB) and checked in: they are the
fixed point the reader (and the fuzz target ``dcp``) is tested against, whatever torch is
installed later.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
TARGET = os.path.join(HERE, "dcp")


def golden_state() -> dict[str, Any]:
    """The state as numpy arrays (bfloat16 as its uint16 bits) and plain values."""
    w = (np.arange(4 * 6, dtype=np.float32).reshape(4, 6) - 5) / 4
    h_bits = np.array([0x3F80, 0x4000, 0xBF80, 0x0000, 0x7F80], dtype=np.uint16)  # 1 2 -1 0 inf
    t = (np.arange(6, dtype=np.float32).reshape(2, 3) * 1.5).T
    return {
        "w": w,
        "h_bits": h_bits,
        "t": t,
        "n": np.array(-3, np.int64),
        "step": 7,
        "name": "golden",
    }


def _rank(rank: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    g = golden_state()
    mesh = init_device_mesh("cpu", (2,))
    state = {
        "w": distribute_tensor(torch.from_numpy(g["w"]), mesh, [Shard(1)]),
        "h": torch.from_numpy(g["h_bits"].view(np.int16)).view(torch.bfloat16),
        "t": torch.from_numpy(np.ascontiguousarray(g["t"].T)).t(),
        "n": torch.tensor(-3, dtype=torch.int64),
        "step": g["step"],
        "name": g["name"],
    }
    dcp.save(state, checkpoint_id=out)
    dist.destroy_process_group()


def main() -> None:
    if len(sys.argv) == 4:
        _rank(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    staging = TARGET + ".new"
    shutil.rmtree(staging, ignore_errors=True)
    procs = [
        subprocess.Popen([sys.executable, __file__, str(r), str(port), staging]) for r in (0, 1)
    ]
    if any(p.wait() for p in procs):
        raise SystemExit("a rank failed")
    shutil.rmtree(TARGET, ignore_errors=True)
    os.replace(staging, TARGET)
    print(f"wrote {TARGET}: {sorted(os.listdir(TARGET))}")


if __name__ == "__main__":
    main()
