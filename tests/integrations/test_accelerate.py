"""savepoint under Hugging Face accelerate: ``save_state``/``load_state`` as one checkpoint.

The promise tested is exact resume: a run trained N steps without stopping and a run stopped
after K steps, saved, rebuilt from fresh objects (other initial weights, scrambled generators)
and resumed to N end with bit-identical parameters and optimizer state and see identical losses
after the resume point. The loop draws from Python's ``random``, NumPy's global generator and
torch's (dropout), so every generator matters.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
accelerate = pytest.importorskip("accelerate")

from accelerate import Accelerator, DataLoaderConfiguration  # noqa: E402
from accelerate.state import AcceleratorState  # noqa: E402

import savepoint as sp  # noqa: E402
from savepoint.integrations.accelerate import (  # noqa: E402
    accelerator_state,
    load_state,
    resume_dataloader,
    save_state,
)

BATCHES = 10  # per epoch: 40 samples, batch size 4
EPOCHS = 3


class Counter:
    """A registered object with a state of its own (and a tensor in it)."""

    def __init__(self) -> None:
        self.seen = 0
        self.total = torch.zeros(2)

    def state_dict(self) -> dict[str, Any]:
        return {"seen": self.seen, "total": self.total}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seen = int(state["seen"])
        self.total = torch.as_tensor(state["total"]).clone()


class Run:
    def __init__(self, *, seed: int, seedable: bool = True, generator: bool = False) -> None:
        AcceleratorState._reset_state(True)
        config = DataLoaderConfiguration(use_seedable_sampler=seedable)
        self.acc = Accelerator(cpu=True, dataloader_config=config)
        torch.manual_seed(seed)
        model = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.Dropout(0.25), torch.nn.Tanh(), torch.nn.Linear(16, 1)
        )
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.LinearLR(
            opt, start_factor=1.0, end_factor=0.1, total_iters=30
        )
        g = torch.Generator().manual_seed(1234)  # the data is the same in every run
        data = torch.utils.data.TensorDataset(
            torch.randn(40, 8, generator=g), torch.randn(40, 1, generator=g)
        )
        shuffle = torch.Generator().manual_seed(seed) if generator else None
        loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True, generator=shuffle)
        self.counter = Counter()
        self.acc.register_for_checkpointing(self.counter)
        self.model, self.opt, self.loader, self.sched = self.acc.prepare(model, opt, loader, sched)

    def train(
        self,
        start: tuple[int, int] = (0, 0),
        stop: int | None = None,
        after_step: Callable[[int, int], None] | None = None,
    ) -> list[float]:
        """Train from (epoch, batch) until ``stop`` steps are done or the end; return the losses.

        Stopping happens between steps, never with a batch fetched and not trained on.
        ``after_step(epoch, batches done in the epoch)`` runs after every step."""
        n = len(self.loader)  # batches per epoch (per process)
        losses: list[float] = []
        for epoch in range(start[0], EPOCHS):
            skip = start[1] if epoch == start[0] else 0
            if stop is not None and epoch * n + skip == stop:
                return losses
            self.loader.set_epoch(epoch)
            for x, y in resume_dataloader(self.acc, self.loader, skip):
                with self.acc.accumulate(self.model):
                    x = x + 0.01 * torch.from_numpy(np.random.randn(*x.shape).astype(np.float32))
                    y = y * (1.0 + 0.01 * random.random())
                    loss = torch.nn.functional.mse_loss(self.model(x), y)
                    self.acc.backward(loss)
                    self.opt.step()
                    self.sched.step()
                    self.opt.zero_grad()
                self.counter.seen += len(x)
                self.counter.total += torch.tensor([loss.item(), 1.0])
                losses.append(loss.item())
                if after_step is not None:
                    after_step(epoch, len(losses) + start[0] * n + start[1] - epoch * n)
                if len(losses) + start[0] * n + start[1] == stop:
                    return losses
        return losses


def scramble() -> None:
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)


def assert_same(a: Run, b: Run) -> None:
    for (name, p), q in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.equal(p, q), name
    sa, sb = a.opt.state_dict(), b.opt.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for k, v in sa["state"].items():
        for name, t in v.items():
            assert torch.equal(t, sb["state"][k][name]), (k, name)
    assert a.sched.state_dict() == b.sched.state_dict()
    assert a.counter.seen == b.counter.seen and torch.equal(a.counter.total, b.counter.total)
    assert a.acc.step == b.acc.step


def seed_all() -> None:
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)


@pytest.mark.parametrize(
    ("seedable", "generator", "stop"),
    [(True, False, 13), (False, False, 10), (True, False, 20), (False, True, 10)],
    ids=[
        "seedable-sampler-mid-epoch",
        "default-sampler-epoch-boundary",
        "seedable-epoch-boundary",
        "sampler-with-own-generator-epoch-boundary",
    ],
)
def test_resume_is_exact(tmp_path: Path, seedable: bool, generator: bool, stop: int) -> None:
    seed_all()
    whole = Run(seed=0, seedable=seedable, generator=generator)
    expected = whole.train()
    assert len(expected) == BATCHES * EPOCHS

    seed_all()
    first = Run(seed=0, seedable=seedable, generator=generator)
    assert first.train(stop=stop) == expected[:stop]
    path = tmp_path / "ckpt"
    save_state(first.acc, path, extra={"epoch": stop // BATCHES, "batch": stop % BATCHES})
    sp.verify(path)
    del first

    resumed = Run(seed=7, seedable=seedable, generator=generator)  # other weights, generators
    scramble()
    extra = load_state(resumed.acc, path)
    assert extra == {"epoch": stop // BATCHES, "batch": stop % BATCHES}
    assert resumed.train((extra["epoch"], extra["batch"])) == expected[stop:]
    assert_same(whole, resumed)


def test_the_epoch_counter_comes_back(tmp_path: Path) -> None:
    """accelerator.load_state leaves a prepared loader at epoch 0: a loop that does not call
    set_epoch replays epoch 0's order. The savepoint checkpoint holds the counter."""
    seed_all()
    whole = Run(seed=0)
    orders = [[x[:, 0].tolist() for x, _ in whole.loader] for _ in range(2)]
    assert orders[0] != orders[1]
    seed_all()
    first = Run(seed=0)
    assert [x[:, 0].tolist() for x, _ in first.loader] == orders[0]
    save_state(first.acc, tmp_path / "ckpt")
    resumed = Run(seed=7)
    load_state(resumed.acc, tmp_path / "ckpt")
    assert [x[:, 0].tolist() for x, _ in resumed.loader] == orders[1]


def test_skip_first_batches_alone_is_not_exact(tmp_path: Path) -> None:
    """Why ``resume_dataloader`` exists: starting the skipping loader draws from torch's
    generator after the restore, so the dropout masks that follow differ."""
    seed_all()
    whole = Run(seed=0)
    expected = whole.train()
    seed_all()
    first = Run(seed=0)
    first.train(stop=13)
    save_state(first.acc, tmp_path / "ckpt")
    resumed = Run(seed=7)
    load_state(resumed.acc, tmp_path / "ckpt")
    resumed.loader.set_epoch(1)
    x, y = next(iter(resumed.acc.skip_first_batches(resumed.loader, 3)))
    x = x + 0.01 * torch.from_numpy(np.random.randn(*x.shape).astype(np.float32))
    y = y * (1.0 + 0.01 * random.random())
    assert torch.nn.functional.mse_loss(resumed.model(x), y).item() != expected[13]


def test_checkpoint_holds_everything_without_pickle(tmp_path: Path) -> None:
    run = Run(seed=0)
    run.train(stop=2)
    run.acc.scaler = torch.amp.GradScaler("cpu", init_scale=512.0)
    path = tmp_path / "ckpt"
    info = save_state(run.acc, path, metadata={"run": "demo"})
    assert sorted(p.suffix for p in path.iterdir()) == [".json", ".safetensors"]
    assert info.metadata["run"] == "demo"
    assert info.metadata["accelerate"]["num_processes"] == 1
    tree = sp.load(path)
    assert sorted(tree) == [
        "accelerator",
        "custom",
        "dataloaders",
        "extra",
        "models",
        "optimizers",
        "rng",
        "scaler",
        "schedulers",
    ]
    assert tree["accelerator"]["step"] == run.acc.step == 2
    assert tree["accelerator"]["counts"] == {
        "models": 1,
        "optimizers": 1,
        "schedulers": 1,
        "dataloaders": 1,
        "custom": 1,
    }
    assert tree["custom"][0]["seen"] == 8
    assert tree["scaler"]["scale"] == 512.0
    assert tree["dataloaders"][0]["sampler"]["epoch"] == 0
    assert set(tree["rng"]["process_0"]) >= {"python", "numpy", "torch"}
    assert sorted(tree["models"][0]) == ["0.bias", "0.weight", "3.bias", "3.weight"]

    other = Run(seed=3)
    other.acc.scaler = torch.amp.GradScaler("cpu")
    assert load_state(other.acc, path) is None
    assert other.acc.scaler.get_scale() == 512.0
    assert other.counter.seen == 8


def test_any_url_and_the_tree_for_managers(tmp_path: Path) -> None:
    run = Run(seed=0)
    run.train(stop=3)
    save_state(run.acc, "memory://accelerate-test/ckpt", extra=[1, 2])
    with sp.CheckpointManager(tmp_path / "run", keep_last=2) as mgr:
        mgr.save(3, {"accelerate": accelerator_state(run.acc), "epoch": 0})

    again = Run(seed=5)
    assert load_state(again.acc, "memory://accelerate-test/ckpt") == [1, 2]
    assert_same(run, again)
    third = Run(seed=6)
    with sp.CheckpointManager(tmp_path / "run", read_only=True) as mgr:
        assert mgr.restore({"accelerate": accelerator_state(third.acc), "epoch": -1}) == 3
    assert_same(run, third)


class Opaque:
    def state_dict(self) -> dict[str, Any]:
        return {"fn": print}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def test_what_accelerate_would_pickle_is_refused(tmp_path: Path) -> None:
    run = Run(seed=0)
    run.acc.register_for_checkpointing(Opaque())
    with pytest.raises(sp.UnsupportedStateError, match=r"(?s)custom/1/fn.*pickle") as exc:
        save_state(run.acc, tmp_path / "ckpt")
    assert exc.value.key == "custom/1/fn"
    assert not (tmp_path / "ckpt").exists()


def test_a_mismatch_modifies_nothing(tmp_path: Path) -> None:
    run = Run(seed=0)
    run.train(stop=2)
    save_state(run.acc, tmp_path / "ckpt")

    other = Run(seed=1)
    other.acc.register_for_checkpointing(Counter())  # one more object than was saved
    before = [p.detach().clone() for p in other.model.parameters()]
    with pytest.raises(sp.StateMismatchError, match="custom"):
        load_state(other.acc, tmp_path / "ckpt")
    assert all(torch.equal(p, q) for p, q in zip(before, other.model.parameters()))

    plain = Run(seed=1, seedable=False)  # a plain sampler where a seedable one was saved
    with pytest.raises(sp.StateMismatchError, match="SeedableRandomSampler"):
        load_state(plain.acc, tmp_path / "ckpt")


def test_state_hooks_are_not_silently_skipped(tmp_path: Path) -> None:
    run = Run(seed=0)
    handle = run.acc.register_save_state_pre_hook(lambda models, weights, output_dir: None)
    with pytest.raises(sp.UnsupportedStateError, match="register_save_state_pre_hook"):
        save_state(run.acc, tmp_path / "a")
    save_state(run.acc, tmp_path / "b", ignore_hooks=True)
    handle.remove()
    save_state(run.acc, tmp_path / "c")


# -- several processes (DDP over gloo, accelerate's MULTI_CPU) ----------------------------------


def fingerprint(run: Run) -> str:
    h = hashlib.sha256()
    for p in run.model.parameters():
        h.update(p.detach().numpy().tobytes())
    for state in run.opt.state_dict()["state"].values():
        for t in state.values():
            h.update(t.numpy().tobytes())
    return h.hexdigest()


def worker(phase: str, path: str) -> None:
    """One process of a 2-process run (``python test_accelerate.py PHASE PATH``, with the
    torch.distributed environment variables set): prints this rank's losses and fingerprint."""
    rank = int(os.environ["RANK"])
    seed_all()
    run = Run(seed=0 if phase == "save" else 7)
    assert run.acc.num_processes == 2 and run.acc.distributed_type == "MULTI_CPU"
    if phase == "save":  # the run that never stops, saving after step 7 (mid-epoch 1)

        def after_step(epoch: int, batch: int) -> None:
            if (epoch, batch) == (1, 2):
                save_state(run.acc, path, extra={"epoch": epoch, "batch": batch})

        losses = run.train(after_step=after_step)[7:]
    else:
        random.seed(rank)
        extra = load_state(run.acc, path)
        losses = run.train((extra["epoch"], extra["batch"]))
    print(json.dumps({"rank": rank, "losses": losses, "fingerprint": fingerprint(run)}), flush=True)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    # DDP's autograd hooks make interpreter teardown abort now and then ("terminate called
    # without an active exception", SIGABRT after the results are printed); the checks are done.
    sys.stdout.flush()
    os._exit(0)


def run_ranks(phase: str, path: Path) -> dict[int, Any]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE="2",
            LOCAL_WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            PYTHONWARNINGS="ignore",
        )
        cmd = [sys.executable, __file__, phase, str(path)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True))
    results = {}
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0, out
        line = json.loads(out.strip().splitlines()[-1])
        results[line["rank"]] = line
    return results


@pytest.mark.distributed
def test_resume_is_exact_with_two_processes(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    whole = run_ranks("save", path)
    tree = sp.load(path)
    assert sorted(tree["rng"]) == ["process_0", "process_1"]
    assert sp.inspect(path).metadata["accelerate"]["num_processes"] == 2
    resumed = run_ranks("load", path)
    for rank in (0, 1):
        assert resumed[rank]["losses"] == whole[rank]["losses"]
        assert resumed[rank]["fingerprint"] == whole[rank]["fingerprint"]
    assert resumed[0]["losses"] != resumed[1]["losses"]  # each process has its own data


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2])
