"""Resume a DataLoader mid-epoch: the restored run sees exactly the batches the first run had left.

A torch DataLoader over a TensorDataset draws its indices from a ``ResumableSampler``. The first
run stops in the middle of epoch 1 and saves the sampler with ``sp.save``; a fresh sampler and
loader are built, restored with ``sp.load(into=...)``, and the batches they produce are compared
with the batches the uninterrupted run went on to see. Run it: ``python examples/resumable_data.py``.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import torch
from torch.utils.data import DataLoader, TensorDataset

import savepoint as sp
from savepoint import ResumableSampler

BATCH = 4
EPOCHS = 3
STOP_EPOCH, STOP_BATCH = 1, 3  # where the first run is interrupted


def make_loader(
    dataset: TensorDataset,
) -> tuple[DataLoader[tuple[torch.Tensor, ...]], ResumableSampler]:
    sampler = ResumableSampler(dataset, shuffle=True, seed=1234)
    return DataLoader(dataset, batch_size=BATCH, sampler=sampler), sampler


def batch_ids(batch: list[torch.Tensor]) -> list[int]:
    return [int(i) for i in batch[1]]  # the second tensor holds each sample's id


def main() -> None:
    dataset = TensorDataset(torch.randn(22, 3), torch.arange(22))
    workdir = tempfile.mkdtemp(prefix="savepoint-data-")
    path = os.path.join(workdir, "ckpt")
    try:
        # The uninterrupted run. It saves after the batch at (STOP_EPOCH, STOP_BATCH), where a
        # crash will later be pretended.
        loader, sampler = make_loader(dataset)
        batches: list[list[int]] = []
        saved_after = -1
        for epoch in range(EPOCHS):
            sampler.set_epoch(epoch)
            for b, batch in enumerate(loader):
                batches.append(batch_ids(batch))  # ... a training step would run here ...
                if (epoch, b) == (STOP_EPOCH, STOP_BATCH):
                    # num_workers=0: the sampler has handed out exactly the batches seen so far.
                    sp.save(path, {"sampler": sampler, "epoch": epoch})
                    saved_after = len(batches)
        after_save = batches[saved_after:]

        # A new process would start here: fresh sampler and loader, restored in place.
        loader2, sampler2 = make_loader(dataset)
        start = sp.load(path, into={"sampler": sampler2, "epoch": 0})["epoch"]
        print(f"restored at epoch {sampler2.epoch}, index {sampler2.index} of {len(dataset)}")
        resumed: list[list[int]] = []
        for epoch in range(start, EPOCHS):
            sampler2.set_epoch(epoch)  # same epoch: keeps the restored position
            resumed.extend(batch_ids(batch) for batch in loader2)

        if resumed == after_save:
            print(f"resumed run saw the same {len(resumed)} remaining batches: identical")
        else:
            print("resumed batches are DIFFERENT")
            print(" expected:", after_save)
            print(" got:     ", resumed)
            raise SystemExit(1)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
