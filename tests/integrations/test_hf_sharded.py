"""Hugging Face sharded directories with transformers itself, both ways (issue 30).

Out: a tiny Llama and a GPT-2 with tied embeddings, built from configs (nothing downloaded),
trained one AdamW step, saved by savepoint (a CheckpointManager state, and ``sp.save`` of a
``state_dict()``), exported with ``--hf`` over several shards: ``from_pretrained`` gives
bit-identical weights and the same logits, and the index is byte for byte the one
``save_pretrained`` writes for the same model and shard size.

In: ``save_pretrained(dir, max_shard_size=...)`` read back by ``sp.load``, ``inspect``,
``verify``, ``convert`` and ``diff`` equals the model it saved.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import savepoint as sp  # noqa: E402
from savepoint.cli import main  # noqa: E402
from savepoint.formats import huggingface  # noqa: E402

pytestmark = pytest.mark.torch

SHARD = "40KB"  # a few tensors per shard: every model below takes several


def invoke(*args: str) -> Result:
    return CliRunner().invoke(main, list(args))


def llama() -> Any:
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    return transformers.LlamaForCausalLM(config)


def gpt2() -> Any:
    config = transformers.GPT2Config(
        vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=2, tie_word_embeddings=True
    )
    return transformers.GPT2LMHeadModel(config)


def trained(make: Any) -> tuple[Any, Any]:
    """A model after one AdamW step (so its weights are not the initial ones) and its optimizer."""
    torch.manual_seed(0)
    model = make()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    return model.eval(), opt


def logits(model: Any) -> Any:
    ids = torch.arange(12).reshape(1, 12) % 128
    with torch.no_grad():
        return model(input_ids=ids).logits


def same_weights(a: Any, b: Any) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name, value in sa.items():
        assert value.dtype == sb[name].dtype and torch.equal(value, sb[name]), name


def test_a_llama_run_exported_over_shards_loads_with_from_pretrained(tmp_path: Path) -> None:
    model, opt = trained(llama)
    with sp.CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(1, {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 1})
    model.config.save_pretrained(tmp_path / "cfg")
    out = tmp_path / "hf"
    result = invoke(
        "export", str(tmp_path / "run"), str(out), "--hf", "--max-shard-size", SHARD,
        "--config", str(tmp_path / "cfg" / "config.json"), "--json",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    shards = [f for f in doc["files"] if f.endswith(".safetensors")]
    assert len(shards) >= 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert doc["format"] == "huggingface" and doc["max_shard_size"] == 40_000
    assert any(d.startswith("optimizer: tensors outside") for d in doc["dropped"])
    assert sorted(os.listdir(out)) == sorted([*shards, huggingface.INDEX, "config.json"])
    assert (out / "config.json").read_bytes() == (tmp_path / "cfg" / "config.json").read_bytes()

    again = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    same_weights(model, again)
    assert torch.equal(logits(model), logits(again))

    # save_pretrained of the same model with the same limit: the same shards, byte for byte the
    # same index.
    model.save_pretrained(tmp_path / "theirs", max_shard_size=SHARD)
    theirs = (tmp_path / "theirs" / huggingface.INDEX).read_bytes()
    assert (out / huggingface.INDEX).read_bytes() == theirs


def test_gpt2_with_tied_embeddings_through_the_library_call(tmp_path: Path) -> None:
    model, _ = trained(gpt2)
    sp.save(tmp_path / "ckpt", model.state_dict())  # a state_dict as it is: dotted names
    out = tmp_path / "hf"
    report = sp.export(
        tmp_path / "ckpt", out, hf=True, max_shard_size=SHARD, config=model.config.to_dict()
    )
    assert report.tied == {"lm_head.weight": "transformer.wte.weight"}
    assert len([f for f in report.files if f.startswith("model-")]) >= 3
    index = json.loads((out / huggingface.INDEX).read_text())
    assert "lm_head.weight" not in index["weight_map"]  # stored once, as save_pretrained does
    again = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert again.lm_head.weight.data_ptr() == again.transformer.wte.weight.data_ptr()
    same_weights(model, again)
    assert torch.equal(logits(model), logits(again))
    model.save_pretrained(tmp_path / "theirs", max_shard_size=SHARD)
    assert (out / huggingface.INDEX).read_bytes() == (
        tmp_path / "theirs" / huggingface.INDEX
    ).read_bytes()
    # Their directory and ours hold the same tensors under the same names.
    result = invoke("diff", str(tmp_path / "theirs"), str(out))
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("make", [llama, gpt2], ids=["llama", "gpt2"])
def test_save_pretrained_output_imports_back_equal(make: Any, tmp_path: Path) -> None:
    model, _ = trained(make)
    theirs = tmp_path / "theirs"
    model.save_pretrained(theirs, max_shard_size=SHARD)
    assert (theirs / huggingface.INDEX).exists()
    expected = dict(model.state_dict())
    if model.config.tie_word_embeddings:
        del expected["lm_head.weight"]  # save_pretrained stores the tied head once, as wte
    arrays = sp.load(theirs)  # by path, no option: the format is detected; numpy by default
    assert arrays.keys() == expected.keys()
    for name, value in expected.items():
        assert (arrays[name] == value.numpy()).all() and arrays[name].dtype == value.numpy().dtype
    loaded = sp.load(theirs, framework="torch")
    for name, value in expected.items():
        assert isinstance(loaded[name], torch.Tensor)
        assert loaded[name].dtype == value.dtype and torch.equal(loaded[name], value), name
    # Into a model with other weights: every tensor restored, the tied head re-tied by torch.
    torch.manual_seed(5)
    other = make().eval()
    missing, unexpected = other.load_state_dict(loaded, strict=False)
    assert unexpected == [] and set(missing) <= {"lm_head.weight"}
    same_weights(model, other)
    assert torch.equal(logits(model), logits(other))

    info = sp.inspect(theirs)
    assert info.format == "huggingface" and len(info.tensors) == len(expected)
    assert sp.verify(theirs).total_bytes == sum(v.nbytes for v in expected.values())
    for command in ("inspect", "verify"):
        result = invoke(command, str(theirs), "--json")
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["format"] == "huggingface"
    sp.convert(theirs, tmp_path / "native")
    assert invoke("diff", str(theirs), str(tmp_path / "native")).exit_code == 0
    # And out again, and in again: the same tensors.
    config = theirs / "config.json"
    sp.export(tmp_path / "native", tmp_path / "ours", hf=True, max_shard_size=SHARD, config=config)
    assert invoke("diff", str(theirs), str(tmp_path / "ours")).exit_code == 0
    ours = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    same_weights(model, ours)


def test_a_single_shard_is_model_safetensors_as_save_pretrained_writes(tmp_path: Path) -> None:
    model, _ = trained(gpt2)
    sp.save(tmp_path / "ckpt", {"model": model.state_dict()})
    report = sp.export(tmp_path / "ckpt", tmp_path / "hf", hf=True, config=model.config.to_dict())
    assert report.files == ("model.safetensors", "config.json")
    model.save_pretrained(tmp_path / "theirs")
    assert sorted(os.listdir(tmp_path / "theirs")) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    same_weights(model, again)
    wte = sp.load(tmp_path / "hf", framework="torch")["transformer.wte.weight"]
    assert torch.equal(wte, model.transformer.wte.weight)


def test_plan_shards_is_huggingface_hubs_assignment() -> None:
    """Tensors larger than the limit alone, made when met, the open shard numbered after them.
    (Not empty tensors: huggingface_hub takes their null storages for one shared storage and
    puts them all in the first one's shard; savepoint's exports have no shared storages.)"""
    split = pytest.importorskip("huggingface_hub").split_torch_state_dict_into_shards
    gen = torch.Generator().manual_seed(3)
    for trial in range(40):
        count = int(torch.randint(1, 30, (1,), generator=gen))
        sizes = torch.randint(1, 40, (count,), generator=gen)
        limit = int(torch.randint(1, 60, (1,), generator=gen)) * 4
        state = {f"t{i}": torch.zeros(int(n)) for i, n in enumerate(sizes)}  # float32: 4n bytes
        theirs = split(state, max_shard_size=limit, filename_pattern="model{suffix}.safetensors")
        ours = huggingface.plan_shards([t.nbytes for t in state.values()], limit)
        names = huggingface.shard_names(len(ours))
        mine = {f"t{i}": names[s] for s, shard in enumerate(ours) for i in shard}
        assert mine == theirs.tensor_to_filename, (trial, sizes.tolist(), limit)


def test_a_savepoint_trainer_checkpoint_exports_with_its_recorded_config(tmp_path: Path) -> None:
    """No --config: the model config SavepointTrainer records in the checkpoint is written."""
    from savepoint.integrations.transformers import SavepointTrainer

    class Tokens(torch.utils.data.Dataset):  # type: ignore[misc]
        def __len__(self) -> int:
            return 4

        def __getitem__(self, i: int) -> dict[str, Any]:
            ids = (torch.arange(12) + i) % 128
            return {"input_ids": ids, "labels": ids}

    torch.manual_seed(0)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=1,
        save_steps=1,
        per_device_train_batch_size=2,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        log_level="error",
    )
    trainer = SavepointTrainer(model=gpt2(), args=args, train_dataset=Tokens())
    trainer.train()
    checkpoint = tmp_path / "out" / "checkpoint-1"
    result = invoke(
        "export", str(checkpoint), str(tmp_path / "hf"), "--hf", "--max-shard-size", SHARD
    )
    assert result.exit_code == 0, result.output
    assert "config.json from metadata['transformers']['config']" in result.stdout
    assert "optimizer: tensors outside" in result.stdout
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    model = trainer.model.eval()
    same_weights(model, again)
    assert torch.equal(logits(model), logits(again))
