"""One rank of a DeepSpeed session (``tests/integrations/test_deepspeed.py``):
``phase rank world port dir``; the phase is ``zero<stage>`` or ``zero<stage>-bf16``.

Trains :class:`Net` (an embedding tied to the output head, a float and an int64 buffer, a
frozen layer, two parameter groups, sizes that do not divide by the world size) one step with DeepSpeed
ZeRO on CPU over gloo and saves ``dir/<phase>/`` with ``engine.save_checkpoint``. Writes
``<phase>-rank<r>.json``.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Any

import torch


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(11, 6)
        self.lin = torch.nn.Linear(6, 7)
        self.register_buffer("scale", torch.linspace(0.5, 2.0, 7))  # bf16 under bf16: upcast
        self.register_buffer("seen", torch.tensor(3, dtype=torch.int64))
        self.frozen = torch.nn.Linear(7, 3)
        self.frozen.requires_grad_(False)
        self.head = torch.nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight  # tied: DeepSpeed records it in shared_params

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        return self.head(h).sum() + self.frozen(self.lin(h) * self.scale.to(h.dtype)).sum()


def main() -> None:
    phase, rank, world, port, workdir = sys.argv[1], *map(int, sys.argv[2:5]), sys.argv[5]
    out: dict[str, Any] = {"checks": {}}
    try:
        os.environ.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        torch.manual_seed(0)
        net = Net()
        stage = int(phase.split("-")[0].removeprefix("zero"))
        decay = [p for n, p in net.named_parameters() if p.requires_grad and "weight" in n]
        rest = [p for n, p in net.named_parameters() if p.requires_grad and "weight" not in n]
        config = {
            "train_batch_size": 4 * world,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
            "zero_optimization": {"stage": stage},
            "bf16": {"enabled": phase.endswith("bf16")},
        }
        engine, *_ = deepspeed.initialize(
            model=net,
            model_parameters=[{"params": decay}, {"params": rest, "weight_decay": 0.0}],
            config=config,
        )
        x = torch.randint(0, 11, (4,))
        engine.backward(engine(x))
        engine.step()
        engine.save_checkpoint(os.path.join(workdir, phase), tag="global_step1")
        out["checks"]["saved"] = "ok"
    except Exception:
        out["checks"]["exception"] = traceback.format_exc()
    finally:
        with open(os.path.join(workdir, f"{phase}-rank{rank}.json"), "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    main()
