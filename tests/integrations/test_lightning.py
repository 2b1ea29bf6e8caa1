"""savepoint as Lightning's CheckpointIO: ModelCheckpoint writes savepoint checkpoints, and a
resumed fit continues bit-exactly (weights, optimizer state, global_step, next losses).

Every test runs under both packages Lightning ships: ``pytorch_lightning`` and the unified
``lightning`` (``lightning.pytorch``); their classes are distinct, and the plugin must be a
``CheckpointIO`` of each."""

from __future__ import annotations

import functools
import importlib
import os
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("pytorch_lightning")

import savepoint as sp  # noqa: E402
from savepoint.integrations.lightning import SavepointCheckpointIO  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),  # Lightning's advice (workers, logging)
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),  # Lightning on torch 2.13 pytree
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
]


@functools.cache
def module_class(pl: Any) -> Any:
    """The test model, a ``LightningModule`` of package ``pl``."""

    class Tiny(pl.LightningModule):  # type: ignore[misc,name-defined]
        def __init__(self, width: int = 16) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(8, width), torch.nn.ReLU(), torch.nn.Linear(width, 1)
            )
            self.losses: list[float] = []

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.losses.append(float(loss))
            return loss

        def configure_optimizers(self) -> Any:
            opt = torch.optim.AdamW(self.parameters(), lr=0.01)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

        def train_dataloader(self) -> Any:
            g = torch.Generator().manual_seed(0)
            x = torch.randn(64, 8, generator=g)
            y = x.sum(dim=1, keepdim=True)
            data = torch.utils.data.TensorDataset(x, y)
            return torch.utils.data.DataLoader(data, batch_size=8, shuffle=False)

    return Tiny


@pytest.fixture(params=["pytorch_lightning", "lightning.pytorch"])
def pl(request: pytest.FixtureRequest) -> Any:
    """The Lightning package under test (``lightning.pytorch`` is the unified package's)."""
    pytest.importorskip(request.param.split(".")[0])
    return importlib.import_module(request.param)


EVERY = 8  # one epoch: 64 samples in batches of 8


def trainer(pl: Any, root: Path, max_steps: int, io: Any, every: int = EVERY, **kw: Any) -> Any:
    ckpt = pl.callbacks.ModelCheckpoint(
        dirpath=root, every_n_train_steps=every, save_top_k=-1, save_last=True
    )
    return pl.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        devices=1,
        plugins=[io],
        callbacks=[ckpt],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
        **kw,
    )


def fit(
    pl: Any,
    root: Path,
    max_steps: int,
    io: Any,
    ckpt_path: str | None = None,
    every: int = EVERY,
) -> Any:
    pl.seed_everything(1, verbose=False)
    model = module_class(pl)()
    trainer(pl, root, max_steps, io, every).fit(model, ckpt_path=ckpt_path)
    return model


def same_model(a: Any, b: Any) -> None:
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), name


@pytest.mark.parametrize("asynchronous", [False, True])
def test_resume_from_a_savepoint_checkpoint_is_exact(
    tmp_path: Path, pl: Any, asynchronous: bool
) -> None:
    def io() -> Any:
        plugin = SavepointCheckpointIO()
        if asynchronous:
            return pl.plugins.io.AsyncCheckpointIO(plugin)
        return plugin

    straight = fit(pl, tmp_path / "straight", 24, io())
    fit(pl, tmp_path / "run", 8, io())
    names = sorted(os.listdir(tmp_path / "run"))
    assert names == ["epoch=0-step=8.ckpt", "last.ckpt"], names
    info = sp.verify(tmp_path / "run" / "last.ckpt")  # a savepoint checkpoint directory
    assert info.format == "savepoint"
    resumed = fit(pl, tmp_path / "run", 24, io(), ckpt_path=str(tmp_path / "run" / "last.ckpt"))
    same_model(straight, resumed)
    assert resumed.losses == straight.losses[8:]  # the next losses, bit-identical
    last = sp.load(tmp_path / "run" / "last.ckpt")
    assert last["global_step"] == 24 and last["epoch"] == 2
    assert last["hyper_parameters"] == {"width": 16}
    steps = [s["state"][0]["step"] for s in last["optimizer_states"]]
    assert [float(s) for s in steps] == [24.0]


def test_mid_epoch_resume_matches_lightnings_own_checkpoints(tmp_path: Path, pl: Any) -> None:
    """Resuming mid-epoch, Lightning restarts the epoch's batches (its dataloaders are not
    stateful): whatever it does, it does the same from a savepoint checkpoint as from its own."""
    TorchCheckpointIO = pl.plugins.io.TorchCheckpointIO

    runs = {}
    for name, io in (("sp", SavepointCheckpointIO), ("torch", TorchCheckpointIO)):
        fit(pl, tmp_path / name, 5, io(), every=5)
        runs[name] = fit(pl, tmp_path / name, 12, io(), str(tmp_path / name / "last.ckpt"), every=5)
    same_model(runs["sp"], runs["torch"])
    assert runs["sp"].losses == runs["torch"].losses


def test_pruning_never_deletes_the_checkpoint_resumed_from(tmp_path: Path, pl: Any) -> None:
    """save_top_k=1: the restored ModelCheckpoint state lists the resumed-from checkpoint among
    its best and prunes it at the next better one; savepoint's plugin keeps it."""

    def run(max_steps: int, ckpt_path: str | None = None) -> None:
        pl.seed_everything(1, verbose=False)
        ckpt = pl.callbacks.ModelCheckpoint(
            dirpath=tmp_path / "run",
            every_n_train_steps=3,
            save_top_k=1,
            monitor="step",
            mode="max",
        )
        t = pl.Trainer(
            max_steps=max_steps,
            accelerator="cpu",
            plugins=[SavepointCheckpointIO()],
            callbacks=[ckpt],
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        t.fit(module_class(pl)(), ckpt_path=ckpt_path)

    run(3)
    resumed_from = tmp_path / "run" / "epoch=0-step=3.ckpt"
    assert resumed_from.exists()
    run(9, str(resumed_from))
    assert resumed_from.exists()  # kept although it fell out of the top 1
    sp.verify(resumed_from)
    assert not (tmp_path / "run" / "epoch=0-step=6.ckpt").exists()  # others are pruned
    sp.verify(tmp_path / "run" / "epoch=1-step=9.ckpt")


def test_remove_keeps_the_checkpoint_this_process_resumed_from() -> None:
    """Lightning itself spares the resumed-from checkpoint on local paths only (its
    ``_should_remove_checkpoint``); on object stores it asks the plugin to delete it. The plugin
    refuses for any path it loaded, and deletes the others atomically."""
    io = SavepointCheckpointIO()
    for name in ("a.ckpt", "b.ckpt"):
        io.save_checkpoint({"w": torch.ones(3), "global_step": 1}, f"memory://lightning-t/{name}")
    io.load_checkpoint("memory://lightning-t/a.ckpt")
    io.remove_checkpoint("memory://lightning-t/a.ckpt")
    io.remove_checkpoint("memory://lightning-t/b.ckpt")
    assert torch.equal(sp.load("memory://lightning-t/a.ckpt")["w"], torch.ones(3))
    with pytest.raises(sp.CheckpointNotFoundError):
        sp.load("memory://lightning-t/b.ckpt")
    io.remove_checkpoint("memory://lightning-t/never-written.ckpt")  # absent is fine


def test_values_savepoint_cannot_store_are_refused_by_name(tmp_path: Path) -> None:
    io = SavepointCheckpointIO()
    with pytest.raises(sp.UnsupportedStateError, match="hyper_parameters"):
        io.save_checkpoint({"hyper_parameters": {"fn": object()}}, tmp_path / "x.ckpt")
    assert not (tmp_path / "x.ckpt").exists()
    with pytest.raises(TypeError, match="storage_options"):
        io.save_checkpoint({}, tmp_path / "y.ckpt", storage_options={"a": 1})


def test_the_plugin_is_a_checkpoint_io_of_each_package(pl: Any) -> None:
    """Trainer(plugins=[...]) sorts plugins by isinstance against its own package's classes."""
    assert isinstance(SavepointCheckpointIO(), pl.plugins.io.CheckpointIO)
