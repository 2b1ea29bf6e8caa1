"""Small states (1-10 MB): savepoint's save against the frameworks' own save, made durable.

Lightning, accelerate and the transformers Trainer all write a state with ``torch.save``; none of
them fsyncs. The floor here is ``torch.save`` of the same state plus an fsync of the file and its
directory (what a durable framework save costs), measured in the same run. For each size (an MLP
and its Adam state, about 3x the weights) the rounds alternate between:

- ``torch.save`` + fsync: the frameworks' save made durable;
- ``sp.save``: a durable, checksummed checkpoint (atomic commit, manifest);
- a managed save: ``CheckpointManager(keep_last=3).save`` (the above plus the run's books),
  timed until it returns (what the training loop waits for); its background step (the books
  synced, the new checkpoint read back and verified, retention) is then drained untimed, so it
  never lands in another save's round, and reported as its own column (``+background``: the
  save and its drained background step together);
- ``safetensors.torch.save_file`` + fsync of the flat tensors (the fastest plain format).

Medians of ``--repeat`` rounds after one warm-up, ratios to the floor (issue 25's target: at most
1.2x for states of 1-10 MB)::

    python benchmarks/bench_small.py [--sizes 1,3,10] [--repeat 15] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_state(mb: float) -> dict[str, Any]:
    """An MLP whose weights and Adam moments total about ``mb`` MB, after one step."""
    import torch

    torch.manual_seed(0)
    width = max(64, int((mb * 1e6 / 4 / 3 / 4) ** 0.5))
    model = torch.nn.Sequential(
        torch.nn.Linear(width, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, width),
        torch.nn.Linear(width, width),
    )
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 1}


def size_of(state: dict[str, Any]) -> int:
    import torch

    total = 0
    stack: list[Any] = [state]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            total += x.numel() * x.element_size()
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1,3,10", help="state sizes in MB, comma-separated")
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = parser.parse_args()

    root = tempfile.mkdtemp(prefix="bench-small-", dir=args.dir)
    print(
        f"{'state':>8} {'torch.save+fsync':>17} {'sp.save':>15} {'managed':>15} "
        f"{'+background':>15} {'safetensors':>15}"
    )
    try:
        for mb in (float(x) for x in args.sizes.split(",")):
            run_size(mb, os.path.join(root, f"{mb:g}"), args.repeat)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run_size(mb: float, where: str, repeat: int) -> None:
    """One row of the table: the four saves of a state of about ``mb`` MB, alternating."""
    import torch
    from safetensors.torch import save_file

    import savepoint as sp

    state = make_state(mb)
    flat = {k: v.contiguous() for k, v in state["model"].items()}
    os.makedirs(where)
    mgr = sp.CheckpointManager(os.path.join(where, "run"), keep_last=3)
    counter = iter(range(10**9))

    def torch_save() -> None:
        path = os.path.join(where, f"t{next(counter)}.pt")
        torch.save(state, path)
        _fsync(path)
        _fsync(where)

    def sp_save() -> None:
        sp.save(os.path.join(where, f"s{next(counter)}"), state)

    def managed() -> None:
        mgr.save(next(counter), state)

    drained: list[float] = []

    def drain() -> None:
        t0 = time.perf_counter()
        mgr.wait()
        drained.append(time.perf_counter() - t0)

    def st_save() -> None:
        path = os.path.join(where, f"f{next(counter)}.safetensors")
        save_file(flat, path)
        _fsync(path)
        _fsync(where)

    fns: list[tuple[str, Callable[[], None]]] = [
        ("torch", torch_save),
        ("sp", sp_save),
        ("managed", managed),
        ("safetensors", st_save),
    ]
    times: dict[str, list[float]] = {name: [] for name, _ in fns}
    for r in range(repeat + 1):
        for name, fn in fns if r % 2 == 0 else fns[::-1]:
            t0 = time.perf_counter()
            fn()
            if r:
                times[name].append(time.perf_counter() - t0)
            if name == "managed":
                drain()
                if not r:
                    drained.clear()
    mgr.close()
    times["+background"] = [a + b for a, b in zip(times["managed"], drained)]
    med = {k: statistics.median(v) for k, v in times.items()}
    floor = med["torch"]
    print(
        f"{size_of(state) / 1e6:6.1f}MB {floor * 1e3:14.1f} ms "
        + " ".join(
            f"{med[k] * 1e3:7.1f} ms {med[k] / floor:4.2f}x"
            for k in ("sp", "managed", "+background", "safetensors")
        )
    )
    shutil.rmtree(where)


if __name__ == "__main__":
    main()
