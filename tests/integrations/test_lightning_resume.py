"""Lightning, issue 25 item 16: exact resume with ``ExactResume``, mid-epoch and between epochs,
and ``Model.load_from_checkpoint`` on what ``SavepointCheckpointIO`` wrote.

The model has dropout; the dataset adds noise from torch, ``random`` and ``np.random`` in
``__getitem__``; the training loader shuffles with ``sp.ResumableSampler``; validation runs every
3 batches with a shuffling loader (its iterator draws from torch's generator). A run of 24 steps
without stopping is compared with runs stopped at step k (a checkpoint at k), resumed by a new
Trainer into a model with other initial weights after every generator was scrambled: weights
and every later loss must be bit-identical. k = 5 (mid-epoch), 6 (mid-epoch, the checkpoint
followed by a validation, which Lightning skips when it resumes), 10 (the end of epoch 0).
"""

from __future__ import annotations

import functools
import importlib
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("pytorch_lightning")

import savepoint as sp  # noqa: E402
from savepoint.integrations.lightning import (  # noqa: E402
    ExactResume,
    SavepointCheckpointIO,
    load_from_checkpoint,
)

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),  # Lightning's advice (workers, logging)
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
]

STEPS = 24  # 40 samples in batches of 4: 10 steps per epoch


class Noisy(torch.utils.data.Dataset):  # type: ignore[misc]
    def __init__(self, n: int = 40, noise: bool = True) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=g)
        self.y = self.x.sum(dim=1, keepdim=True)
        self.noise = noise

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> Any:
        x = self.x[i]
        if self.noise:
            x = x + 0.01 * torch.randn(8) + 1e-3 * random.random() + 1e-3 * float(np.random.rand())
        return x, self.y[i]


@functools.cache
def module_class(pl: Any) -> Any:
    class Model(pl.LightningModule):  # type: ignore[misc,name-defined]
        def __init__(
            self, width: int = 16, workers: int = 0, noise: bool = True, plain: bool = False
        ) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(8, width),
                torch.nn.Dropout(0.3),
                torch.nn.ReLU(),
                torch.nn.Linear(width, 1),
            )
            self.losses: list[float] = []

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.losses.append(float(loss))
            return loss

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            self.log("val", torch.nn.functional.mse_loss(self.net(x), y))

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=0.01)

        def train_dataloader(self) -> Any:
            data = Noisy(noise=self.hparams.noise)
            if self.hparams.plain:
                return torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)
            sampler = sp.ResumableSampler(data, seed=3)
            return torch.utils.data.DataLoader(
                data, batch_size=4, sampler=sampler, num_workers=self.hparams.workers
            )

        def val_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(Noisy(8), batch_size=4, shuffle=True)

    return Model


@pytest.fixture(params=["pytorch_lightning", "lightning.pytorch"])
def pl(request: pytest.FixtureRequest) -> Any:
    pytest.importorskip(request.param.split(".")[0])
    return importlib.import_module(request.param)


def fit(
    pl: Any,
    root: Path,
    max_steps: int,
    *,
    every: int = 100,
    ckpt: str | None = None,
    io: Any = None,
    exact: bool = True,
    **hparams: Any,
) -> Any:
    pl.seed_everything(2 if ckpt else 1, verbose=False)  # resumed: other initial weights
    model = module_class(pl)(**hparams)
    callbacks = [
        pl.callbacks.ModelCheckpoint(
            dirpath=root, every_n_train_steps=every, save_top_k=-1, save_last=True
        )
    ]
    if exact:
        callbacks.append(ExactResume())
    trainer = pl.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        devices=1,
        plugins=[io or SavepointCheckpointIO()],
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        val_check_interval=3,
        num_sanity_val_steps=0,
    )
    if ckpt is not None:  # and other generators
        torch.manual_seed(99)
        random.seed(5)
        np.random.seed(7)
    trainer.fit(model, ckpt_path=ckpt)
    return model


_STRAIGHT: dict[tuple[str, int, bool], Any] = {}


def straight(pl: Any, root: Path, workers: int = 0, noise: bool = True) -> Any:
    """The run that never stops (one per package and data set-up)."""
    key = (pl.__name__, workers, noise)
    if key not in _STRAIGHT:
        _STRAIGHT[key] = fit(pl, root / "straight", STEPS, workers=workers, noise=noise)
    return _STRAIGHT[key]


def resumed(pl: Any, root: Path, k: int, **kw: Any) -> Any:
    fit(pl, root / "run", k, every=k, **kw)
    assert sp.verify(root / "run" / "last.ckpt").format == "savepoint"
    return fit(pl, root / "run", STEPS, ckpt=str(root / "run" / "last.ckpt"), **kw)


def assert_same(a: Any, b: Any, k: int) -> None:
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), name
    assert b.losses == a.losses[k:]


@pytest.mark.parametrize("k", [5, 6, 10])
def test_exact_resume(tmp_path: Path, pl: Any, k: int) -> None:
    assert_same(straight(pl, tmp_path), resumed(pl, tmp_path, k), k)


def test_exact_resume_with_loader_workers(tmp_path: Path) -> None:
    """A loader with a worker process takes indices from the sampler ahead of training: the
    position saved is Lightning's count of batches trained, and the iterator is made again once
    the sampler is back. (Randomness inside workers derives from a seed drawn when the iterator
    starts, which differs: the data here has no noise.)"""
    pl = importlib.import_module("lightning.pytorch")
    expected = straight(pl, tmp_path, workers=1, noise=False)
    assert_same(expected, resumed(pl, tmp_path, 5, workers=1, noise=False), 5)


def test_exact_resume_through_lightnings_own_checkpoint_io(tmp_path: Path) -> None:
    """The state lives in Lightning's callback state: torch.save/torch.load(weights_only=True)
    hold it too."""
    pl = importlib.import_module("lightning.pytorch")
    io = pl.plugins.io.TorchCheckpointIO
    fit(pl, tmp_path / "run", 6, every=6, io=io())
    back = fit(pl, tmp_path / "run", STEPS, ckpt=str(tmp_path / "run" / "last.ckpt"), io=io())
    assert_same(straight(pl, tmp_path), back, 6)


def test_a_checkpoint_saved_without_exact_resume_is_not_exact_and_says_so(tmp_path: Path) -> None:
    """What Lightning alone gives mid-epoch (the epoch's first batches again, other draws)."""
    pl = importlib.import_module("lightning.pytorch")
    fit(pl, tmp_path / "run", 5, every=5, exact=False)
    with pytest.warns(UserWarning, match="saved without ExactResume"):
        back = fit(pl, tmp_path / "run", STEPS, ckpt=str(tmp_path / "run" / "last.ckpt"))
    assert back.losses != straight(pl, tmp_path).losses[5:]


def test_mid_epoch_resume_with_a_loader_that_cannot_resume_is_refused(tmp_path: Path) -> None:
    pl = importlib.import_module("lightning.pytorch")
    with pytest.warns(UserWarning, match="cannot be restored"):
        fit(pl, tmp_path / "run", 5, every=5, plain=True)
    with pytest.raises(sp.DataStateError, match="ResumableSampler") as info:
        fit(pl, tmp_path / "run", STEPS, ckpt=str(tmp_path / "run" / "last.ckpt"), plain=True)
    assert "batch 5 of 10 of epoch 0" in str(info.value)
    # Between epochs, any sampler resumes exactly (the order of an epoch is drawn when it starts).
    fit(pl, tmp_path / "b", 10, every=10, plain=True)
    back = fit(pl, tmp_path / "b", 14, ckpt=str(tmp_path / "b" / "last.ckpt"), plain=True)
    assert back.losses == fit(pl, tmp_path / "c", 14, plain=True).losses[10:]


def test_load_from_checkpoint_reads_savepoint_checkpoints(tmp_path: Path, pl: Any) -> None:
    """Model.load_from_checkpoint(path) raised IsADirectoryError on a savepoint checkpoint."""
    Model = module_class(pl)
    trained = fit(pl, tmp_path / "run", 3, every=3, width=12)
    path = tmp_path / "run" / "last.ckpt"
    for loaded in (
        Model.load_from_checkpoint(path),  # the usual call
        Model.load_from_checkpoint(str(path), map_location="cpu", strict=True),
        load_from_checkpoint(Model, path),
    ):
        assert loaded.hparams.width == 12  # the hyper-parameters saved
        for (name, x), y in zip(trained.state_dict().items(), loaded.state_dict().values()):
            assert torch.equal(x, y), name
    url = f"memory://lightning-load-{pl.__name__}/last.ckpt"
    sp.convert(path, url)
    assert Model.load_from_checkpoint(url).hparams.width == 12
    # Lightning's own files still go to Lightning's loader.
    fit(pl, tmp_path / "torch", 3, every=3, io=pl.plugins.io.TorchCheckpointIO(), width=12)
    torch_file = tmp_path / "torch" / "last.ckpt"
    assert os.path.isfile(torch_file)
    assert Model.load_from_checkpoint(torch_file).hparams.width == 12
    with pytest.raises(FileNotFoundError):
        Model.load_from_checkpoint(tmp_path / "absent.ckpt")
