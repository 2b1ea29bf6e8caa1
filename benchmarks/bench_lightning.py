"""Lightning's checkpointing against ``SavepointCheckpointIO``, same model, same trainer.

A LightningModule of ``--mib`` MiB of float32 weights (8 linear layers) after one AdamW step, so
``trainer.save_checkpoint`` writes the weights, two moment buffers and Lightning's loop state
(about 3x ``--mib``). The trainer's ``CheckpointIO`` is swapped between rounds; each save is timed
two ways:

- blocking: until ``trainer.save_checkpoint`` returns (what the training loop waits for);
- durable: until every byte is on disk. Lightning's ``TorchCheckpointIO`` does not fsync, so its
  durable time is the call plus an fsync of the file and its directory; savepoint's save returns
  durable. Under ``AsyncCheckpointIO`` (Lightning clones every tensor on the training thread, then
  saves in its own thread) the durable time is until its executor has finished (plus the fsync
  for torch).

Loads: ``checkpoint_io.load_checkpoint(path)`` from a cold page cache (the files are fsynced and
dropped with ``posix_fadvise(DONTNEED)`` first), Lightning's ``torch.load`` against savepoint's
verified load.

Medians of ``--repeat`` rounds (the order alternates; round 0 warms up), ratios savepoint /
Lightning (below 1: savepoint faster)::

    python benchmarks/bench_lightning.py [--mib 256] [--repeat 5] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

from bench_hf import Timing, fsync_tree, report, run, size_of
from bench_save_load import evict

warnings.filterwarnings("ignore")


def make_trainer(mib: int, root: str) -> Any:
    import pytorch_lightning as pl
    import torch

    width = int((mib * 2**20 / 4 / 8) ** 0.5)

    class Wide(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(8)))

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return self.net(batch[0]).square().mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

        def train_dataloader(self) -> Any:
            data = torch.utils.data.TensorDataset(torch.randn(4, width))
            return torch.utils.data.DataLoader(data, batch_size=4)

    torch.manual_seed(0)
    trainer = pl.Trainer(
        max_steps=1,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
    )
    trainer.fit(Wide())
    return trainer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="MiB of weights (the checkpoint is ~3x)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    args = ap.parse_args()

    from pytorch_lightning.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

    from savepoint.integrations.lightning import SavepointCheckpointIO

    root = tempfile.mkdtemp(prefix="bench-lightning-", dir=args.dir)
    trainer = make_trainer(args.mib, root)

    def contender(make_io: Callable[[], Any], fsync: bool) -> Callable[[str], Timing]:
        def save(path: str) -> Timing:
            io = make_io()
            trainer.strategy.checkpoint_io = io
            os.makedirs(path)  # the checkpoint (a file or a savepoint directory) goes inside
            t = time.perf_counter()
            trainer.save_checkpoint(os.path.join(path, "last.ckpt"))
            blocking = time.perf_counter() - t
            io.teardown()  # AsyncCheckpointIO: waits for its thread; others: nothing
            if fsync:
                fsync_tree(path)
            return blocking, time.perf_counter() - t, size_of(path)

        return save

    saves = {
        "Lightning (torch.save)": contender(TorchCheckpointIO, fsync=True),
        "SavepointCheckpointIO": contender(SavepointCheckpointIO, fsync=False),
        "Async(torch.save)": contender(lambda: AsyncCheckpointIO(TorchCheckpointIO()), True),
        "Async(Savepoint)": contender(lambda: AsyncCheckpointIO(SavepointCheckpointIO()), False),
    }
    results = run(saves, root, args.repeat)
    print(f"Lightning, {args.mib} MiB of weights + AdamW state, medians of {args.repeat}")
    report("sync saves", {k: results[k] for k in list(saves)[:2]}, "Lightning (torch.save)")
    report("async saves", {k: results[k] for k in list(saves)[2:]}, "Async(torch.save)")

    loads: dict[str, list[float]] = {"torch": [], "savepoint": []}
    paths = {"torch": os.path.join(root, "load-torch"), "savepoint": os.path.join(root, "load-sp")}
    trainer.strategy.checkpoint_io = TorchCheckpointIO()
    trainer.save_checkpoint(paths["torch"])
    trainer.strategy.checkpoint_io = SavepointCheckpointIO()
    trainer.save_checkpoint(paths["savepoint"])
    ios = {"torch": TorchCheckpointIO(), "savepoint": SavepointCheckpointIO()}
    for rnd in range(args.repeat + 1):
        for name in ("torch", "savepoint") if rnd % 2 else ("savepoint", "torch"):
            evict(paths[name])
            t = time.perf_counter()
            ios[name].load_checkpoint(paths[name], weights_only=True)
            if rnd:
                loads[name].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in loads.items()}
    print("cold loads (checkpoint_io.load_checkpoint)")
    print(f"  Lightning (torch.load)       {med['torch']:7.3f} s")
    print(
        f"  SavepointCheckpointIO        {med['savepoint']:7.3f} s   "
        f"ratio {med['savepoint'] / med['torch']:.2f} (verified)"
    )


if __name__ == "__main__":
    main()
