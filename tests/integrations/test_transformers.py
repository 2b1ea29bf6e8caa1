"""savepoint under Hugging Face transformers: SavepointTrainer and SavepointCallback.

The promise tested is exact resume through Trainer's own resume logic: a run trained to
``max_steps`` without stopping and runs resumed (fresh model, other initial weights) from the
savepoint checkpoints written mid-epoch end with bit-identical parameters, optimizer and scheduler
state, and the same log history (every step's loss, grad norm and learning rate). The model is a
one-layer GPT-2 built from a config (dropout on), trained on CPU on a tiny in-memory dataset.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402

import savepoint as sp  # noqa: E402
from savepoint.integrations import transformers as sp_hf  # noqa: E402
from savepoint.integrations.transformers import (  # noqa: E402
    SavepointCallback,
    SavepointTrainer,
)

MAX_STEPS = 10  # 24 samples, batch size 4: 6 steps per epoch; saves at 4 and 8 are mid-epoch


class Tokens(torch.utils.data.Dataset):  # type: ignore[misc]
    def __init__(self, n: int = 24, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, 64, (n, 16), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def make(
    out: Path, cls: type = SavepointTrainer, *, init_seed: int = 0, callbacks: Any = None, **kw: Any
) -> Any:
    transformers.set_seed(init_seed)
    config = GPT2Config(
        n_layer=1,
        n_embd=32,
        n_head=2,
        vocab_size=64,
        n_positions=16,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config)
    args = dict(
        output_dir=str(out),
        max_steps=MAX_STEPS,
        save_steps=4,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        warmup_steps=2,
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
        report_to=[],
        logging_steps=1,
        use_cpu=True,
        disable_tqdm=True,
        log_level="error",
    )
    args.update(kw)
    return cls(
        model=model,
        args=TrainingArguments(**args),
        train_dataset=Tokens(),
        eval_dataset=Tokens(8, seed=1),
        callbacks=callbacks,
    )


def assert_same_training(a: Any, b: Any) -> None:
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    oa, ob = a.optimizer.state_dict(), b.optimizer.state_dict()
    assert oa["param_groups"] == ob["param_groups"]
    assert oa["state"].keys() == ob["state"].keys()
    for i in oa["state"]:
        for name, t in oa["state"][i].items():
            assert torch.equal(t, ob["state"][i][name]), (i, name)
    assert a.lr_scheduler.state_dict() == b.lr_scheduler.state_dict()
    assert a.state.global_step == b.state.global_step == MAX_STEPS
    assert a.state.epoch == b.state.epoch


def step_logs(trainer: Any) -> list[dict[str, Any]]:
    return [h for h in trainer.state.log_history if "loss" in h]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """An uninterrupted plain-Trainer run, and a SavepointTrainer run with checkpoints."""
    root = tmp_path_factory.mktemp("hf")
    plain = make(root / "plain", Trainer, save_strategy="no")
    plain.train()
    run = make(root / "run")
    run.train()
    return plain, run


def test_savepoint_trainer_trains_like_trainer(reference: Any) -> None:
    plain, run = reference
    assert_same_training(plain, run)
    assert step_logs(plain) == step_logs(run)
    assert len(step_logs(run)) == MAX_STEPS


@pytest.mark.parametrize("step", [4, 8])
def test_resume_is_exact(reference: Any, tmp_path: Path, step: int) -> None:
    plain, run = reference
    checkpoint = Path(run.args.output_dir) / f"checkpoint-{step}"
    resumed = make(tmp_path / "resumed", init_seed=5)  # other initial weights
    torch.manual_seed(123)  # and other generators
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert_same_training(plain, resumed)
    assert step_logs(resumed) == step_logs(plain)
    assert resumed.state.log_history[:-1] == run.state.log_history[:-1]  # all but the run summary


def test_checkpoints_are_savepoint_checkpoints(reference: Any) -> None:
    _, run = reference
    out = Path(run.args.output_dir)
    assert sorted(os.listdir(out)) == ["checkpoint-10", "checkpoint-4", "checkpoint-8"]
    path = out / "checkpoint-4"
    assert sorted(p.name for p in path.iterdir()) == ["data-00000.safetensors", "manifest.json"]
    info = sp.verify(path)
    meta = info.metadata["transformers"]
    assert meta["global_step"] == 4 and meta["model_class"] == "GPT2LMHeadModel"
    assert meta["config"]["n_embd"] == 32 and meta["training_args"]["save_steps"] == 4
    assert meta["contents"] == ["model", "optimizer", "rng", "scheduler", "trainer_state"]
    tree = sp.load(path)
    state = json.loads(tree["trainer_state"])
    assert state["global_step"] == 4 and state["epoch"] == pytest.approx(4 / 6)
    assert [h["loss"] for h in state["log_history"]] == [h["loss"] for h in step_logs(run)[:4]]
    assert set(tree["rng"]["process_0"]) >= {"python", "numpy", "torch"}
    assert tree["scheduler"]["last_epoch"] == 4
    # Tied weights: the LM head is the embedding, stored once and restored tied.
    assert "model/transformer.wte.weight" in {t.key for t in info.tensors}
    model = make(Path("unused"), Trainer, init_seed=3).model
    sp.load(path, into={"model": model})
    assert model.lm_head.weight is model.transformer.wte.weight
    assert torch.equal(model.lm_head.weight, tree["model"]["transformer.wte.weight"])


def test_resume_from_a_url(reference: Any, tmp_path: Path) -> None:
    plain, run = reference
    url = "memory://hf-test/checkpoint-8"
    sp.convert(Path(run.args.output_dir) / "checkpoint-8", url)
    resumed = make(tmp_path / "resumed", init_seed=5)
    resumed.train(resume_from_checkpoint=url)
    assert_same_training(plain, resumed)


def test_callback_on_a_plain_trainer(reference: Any, tmp_path: Path) -> None:
    plain, _ = reference
    trainer = make(tmp_path / "cb", Trainer, callbacks=[SavepointCallback(metadata={"who": "cb"})])
    trainer.train()
    assert_same_training(plain, trainer)
    names = sorted(os.listdir(tmp_path / "cb"))
    assert names == ["checkpoint-10", "checkpoint-4", "checkpoint-8"]  # nothing left aside
    for name in names:
        assert sp.verify(tmp_path / "cb" / name).metadata["who"] == "cb"

    resumed = make(tmp_path / "cb-resumed", Trainer, init_seed=5)
    SavepointCallback.resume(resumed, tmp_path / "cb" / "checkpoint-8")
    assert_same_training(plain, resumed)
    assert step_logs(resumed) == step_logs(plain)
    assert "_load_rng_state" not in vars(resumed)  # the instance is left as it was


def test_resume_true_takes_the_newest_and_retention_works(tmp_path: Path) -> None:
    first = make(tmp_path / "out", save_total_limit=2, max_steps=8)
    first.train()
    assert sorted(os.listdir(tmp_path / "out")) == ["checkpoint-4", "checkpoint-8"]
    assert sp_hf.last_checkpoint(str(tmp_path / "out")) == str(tmp_path / "out" / "checkpoint-8")
    again = make(tmp_path / "out", save_total_limit=2, init_seed=5)
    again.train(resume_from_checkpoint=True)
    assert again.state.global_step == MAX_STEPS
    assert sorted(os.listdir(tmp_path / "out")) == ["checkpoint-10", "checkpoint-8"]
    with pytest.raises(sp.CheckpointNotFoundError, match="No savepoint checkpoint"):
        make(tmp_path / "empty").train(resume_from_checkpoint=True)


@pytest.mark.parametrize("added", ["init", "add_callback", "path"])
def test_the_usual_resume_on_a_plain_trainer_with_the_callback(
    reference: Any, tmp_path: Path, added: str
) -> None:
    """Trainer.train(resume_from_checkpoint=True or a path) on a plain Trainer carrying a
    SavepointCallback, however added, resumes exactly from the savepoint checkpoint (Trainer
    alone fails: "Can't find a valid checkpoint")."""
    plain, run = reference
    out = tmp_path / "out"
    sp.convert(Path(run.args.output_dir) / "checkpoint-8", out / "checkpoint-8")
    if added == "add_callback":
        resumed = make(out, Trainer, init_seed=5)
        resumed.add_callback(SavepointCallback())
    else:
        resumed = make(out, Trainer, init_seed=5, callbacks=[SavepointCallback()])
    torch.manual_seed(123)
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-8") if added == "path" else True)
    assert_same_training(plain, resumed)
    assert step_logs(resumed) == step_logs(plain)
    assert sorted(os.listdir(out)) == ["checkpoint-10", "checkpoint-8"]
    sp.verify(out / "checkpoint-10")  # the callback's checkpoint, not Trainer's files


def test_no_checkpoint_for_the_usual_resume_is_a_savepoint_error(tmp_path: Path) -> None:
    trainer = make(tmp_path / "none", Trainer, callbacks=[SavepointCallback()])
    with pytest.raises(sp.CheckpointNotFoundError, match="No savepoint checkpoint"):
        trainer.train(resume_from_checkpoint=True)


def test_export_pretrained_gives_a_from_pretrained_directory(
    reference: Any, tmp_path: Path
) -> None:
    _, run = reference
    checkpoint = Path(run.args.output_dir) / "checkpoint-8"
    folder = sp_hf.export_pretrained(checkpoint, tmp_path / "hf")
    assert sorted(os.listdir(folder)) == ["config.json", "model.safetensors"]
    model = transformers.GPT2LMHeadModel.from_pretrained(folder)
    saved = sp.load(checkpoint, keys=["model"])["model"]
    for name, value in model.state_dict().items():
        assert torch.equal(value, saved[name]), name
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    with pytest.raises(sp.CheckpointWriteError, match="overwrite"):
        sp_hf.export_pretrained(checkpoint, folder)
    sp_hf.export_pretrained(checkpoint, folder, overwrite=True)
    sp.save(tmp_path / "other", {"model": {"w": torch.ones(2)}})
    with pytest.raises(sp.IncompatibleCheckpointError, match="no model config"):
        sp_hf.export_pretrained(tmp_path / "other", tmp_path / "hf2")
    assert not (tmp_path / "hf2").exists()


def test_best_model_at_end(tmp_path: Path) -> None:
    kw = dict(
        eval_strategy="steps",
        eval_steps=4,
        load_best_model_at_end=True,
        metric_for_best_model="loss",
        greater_is_better=False,  # eval loss rises on this data: the best is the first
    )
    for cls, callbacks in ((SavepointTrainer, None), (Trainer, [SavepointCallback()])):
        trainer = make(tmp_path / cls.__name__, cls, callbacks=callbacks, **kw)
        trainer.train()
        best = trainer.state.best_model_checkpoint
        assert best is not None and best.endswith("checkpoint-4")
        saved = sp.load(best, keys=["model"])["model"]
        for k, v in trainer.model.state_dict().items():
            assert torch.equal(v, saved[k]), (cls.__name__, k)


def test_save_only_model(tmp_path: Path) -> None:
    trainer = make(tmp_path / "m", save_only_model=True, max_steps=4)
    trainer.train()
    tree = sp.load(tmp_path / "m" / "checkpoint-4")
    assert sorted(tree) == ["model", "trainer_state"]


def test_trainer_format_checkpoints_still_resume(reference: Any, tmp_path: Path) -> None:
    plain, _ = reference
    old = make(tmp_path / "old", Trainer)
    old.train()
    resumed = make(tmp_path / "new", init_seed=5)
    resumed.train(resume_from_checkpoint=str(tmp_path / "old" / "checkpoint-4"))
    assert_same_training(plain, resumed)


def test_unsupported_runs_are_refused() -> None:
    args = SimpleNamespace(world_size=2, deepspeed=None, fsdp=None)
    with pytest.raises(sp.UnsupportedStateError, match="2 processes"):
        sp_hf._check_supported(args)
    args = SimpleNamespace(world_size=1, deepspeed="ds.json", fsdp=None)
    with pytest.raises(sp.UnsupportedStateError, match="DeepSpeed"):
        sp_hf._check_supported(args)
