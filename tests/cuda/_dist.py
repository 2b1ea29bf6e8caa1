"""A one-process NCCL world beside a gloo group, saving and loading through both (run as a script).

    python tests/cuda/_dist.py DIR --device cuda     # backend nccl, tensors on the GPU
    python tests/cuda/_dist.py DIR --device cpu      # backend gloo: the same steps on the CPU

World size 1 (one GPU). NCCL collectives run before, between and after the saves, so a save that
broke the training's group (or interleaved with it) shows. Prints ``OK`` and exits 0 when every
check held; any failure is an exception (exit 1).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import savepoint as sp


def same(a: dict, b: dict) -> None:  # type: ignore[type-arg]
    assert a.keys() == b.keys(), (a.keys(), b.keys())
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].cpu(), b[k].cpu()), k


def main(directory: str, device: str) -> None:
    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        store=dist.FileStore(os.path.join(directory, "store"), 1),
        rank=0,
        world_size=1,
    )
    try:
        world = dist.group.WORLD
        assert dist.get_backend(world) == ("nccl" if cuda else "gloo")
        gloo = dist.new_group(backend="gloo")

        def all_reduce_ok() -> None:
            x = torch.full((1024,), 3.0, device=device)
            dist.all_reduce(x, group=world)
            if cuda:
                torch.cuda.synchronize()
            assert bool((x == 3.0).all()), "the training group's all_reduce broke"

        all_reduce_ok()
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 8)).to(device)
        model = model.to(torch.bfloat16)
        want = {k: v.detach().clone() for k, v in model.state_dict().items()}

        for name, group in (("nccl-world", world), ("gloo", gloo)):
            path = os.path.join(directory, name)
            sp.save(path, {"model": model, "step": 7}, process_group=group)
            all_reduce_ok()
            torch.manual_seed(1)
            other = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 8))
            other = other.to(device).to(torch.bfloat16)
            state = {"model": other, "step": 0}
            sp.load(path, into=state, process_group=group)
            assert state["step"] == 7
            got = other.state_dict()
            assert all(v.device.type == torch.device(device).type for v in got.values())
            same(got, want)
            same(sp.load(path, device=device)["model"], want)  # read whole, without a group

        with sp.AsyncCheckpointer(process_group=world) as ck:
            pending = ck.save(os.path.join(directory, "async"), {"model": model})
            all_reduce_ok()  # while the background write runs
            pending.wait()
        same(sp.load(os.path.join(directory, "async"))["model"], want)
        all_reduce_ok()

        # Through the writer process: the shard copied into the shared arena (page-locked for
        # CUDA) in save(); the collectives in the background thread, the write in the process.
        with sp.AsyncCheckpointer(process_group=world, writer="process") as ck:
            pending = ck.save(os.path.join(directory, "async-process"), {"model": model})
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1)  # after save() returned: not in the checkpoint
            all_reduce_ok()
            pending.wait()
        same(sp.load(os.path.join(directory, "async-process"))["model"], want)
        all_reduce_ok()
    finally:
        dist.destroy_process_group()
    print("OK", flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("directory")
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    main(a.directory, a.device)
