"""``savepoint export``: one Hugging Face-style safetensors file that safetensors (and
transformers, where installed) load directly, from a checkpoint or a run, without --lossy."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner, Result

import savepoint as sp
from savepoint.cli import main
from savepoint.formats.export import export

torch = pytest.importorskip("torch")
st_torch = pytest.importorskip("safetensors.torch")

pytestmark = pytest.mark.torch


def invoke(*args: str) -> Result:
    return CliRunner().invoke(main, list(args))


class Tiny(torch.nn.Module):  # type: ignore[misc]
    """A language-model-shaped module whose output head is tied to its embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(2)])
        self.lm_head = torch.nn.Linear(4, 10, bias=False)
        self.lm_head.weight = self.embed.weight  # tied

    def forward(self, x: Any) -> Any:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.lm_head(h)


@pytest.fixture
def run(tmp_path: Path) -> tuple[Path, Tiny]:
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with sp.CheckpointManager(tmp_path / "run", keep_last=3, best_metric="val_loss") as mgr:
        for step in (1, 2):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.01)
            mgr.save(
                step,
                {
                    "model": model.state_dict(),
                    "optimizer": sp.optimizer_state_from_torch(opt),
                    "ema": {"embed.weight": model.embed.weight.detach().clone()},
                    "step": step,
                    "config": {"name": "tiny"},
                },
                metrics={"val_loss": 1.0 / step},
            )
    return tmp_path / "run", model


def test_export_a_run_loads_with_safetensors_and_into_a_tied_module(
    run: tuple[Path, Tiny], tmp_path: Path
) -> None:
    run_dir, model = run
    out = tmp_path / "model.safetensors"
    # A run checkpoint holds plain values and run metadata: no --lossy needed.
    result = invoke("export", str(run_dir), str(out))
    assert result.exit_code == 0, result.output
    assert "(step 2 of the run)" in result.stdout
    assert "lm_head.weight = embed.weight" in result.stdout
    loaded = st_torch.load_file(str(out))
    # Dotted names, the tied head stored once (under the first name, as save_pretrained does).
    assert set(loaded) == {
        "embed.weight",
        "layers.0.weight",
        "layers.0.bias",
        "layers.1.weight",
        "layers.1.bias",
    }
    for name, value in model.state_dict().items():
        if name in loaded:
            assert torch.equal(loaded[name], value), name
    fresh = Tiny()
    missing, unexpected = st_torch.load_model(fresh, str(out))  # strict: raises on a mismatch
    assert (set(missing), list(unexpected)) == (set(), [])
    assert fresh.lm_head.weight is fresh.embed.weight
    assert torch.equal(fresh.lm_head.weight, model.embed.weight)
    from safetensors import safe_open

    with safe_open(str(out), framework="pt") as f:
        metadata = f.metadata()
    assert metadata["format"] == "pt"
    assert json.loads(metadata["savepoint_run"])["step"] == 2


def test_export_loads_with_transformers_from_pretrained(
    run: tuple[Path, Tiny], tmp_path: Path
) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=10, n_positions=8, n_embd=4, n_layer=1, n_head=1, tie_word_embeddings=True
    )
    torch.manual_seed(1)
    hf = transformers.GPT2LMHeadModel(config)
    ckpt = tmp_path / "hf-ckpt"
    sp.save(ckpt, {"model": hf.state_dict(), "step": 7})
    folder = tmp_path / "hf"
    folder.mkdir()
    config.save_pretrained(folder)
    assert invoke("export", str(ckpt), str(folder / "model.safetensors")).exit_code == 0
    again = transformers.GPT2LMHeadModel.from_pretrained(folder)
    for name, value in hf.state_dict().items():
        assert torch.equal(again.state_dict()[name], value), name
    assert again.lm_head.weight.data_ptr() == again.transformer.wte.weight.data_ptr()


def test_export_steps_subtrees_and_separators(run: tuple[Path, Tiny], tmp_path: Path) -> None:
    run_dir, _ = run
    out = tmp_path / "o.safetensors"
    result = invoke("export", str(run_dir), str(out), "--step", "1", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["source"]["step"] == 1 and doc["subtree"] == "model"
    assert doc["tied"] == {"lm_head.weight": "embed.weight"}
    assert any(item.startswith("ema: tensors outside") for item in doc["dropped"])
    assert any(item.startswith("step:") for item in doc["dropped"])
    # The whole state, joined with "/": every tensor, the EMA copy's too.
    step = run_dir / "checkpoints" / "step-0000000002"
    whole = tmp_path / "whole.safetensors"
    result = invoke("export", str(step), str(whole), "--subtree", "", "--sep", "/")
    assert result.exit_code == 0, result.output
    names = set(st_torch.load_file(str(whole)))
    assert {"model/embed.weight", "ema/embed.weight"} <= names
    # A deeper subtree, and --duplicate-tied writing every name.
    layers = tmp_path / "layers.safetensors"
    assert invoke("export", str(step), str(layers), "--subtree", "model").exit_code == 0
    dup = tmp_path / "dup.safetensors"
    assert invoke("export", str(step), str(dup), "--duplicate-tied").exit_code == 0
    both = st_torch.load_file(str(dup))
    assert torch.equal(both["lm_head.weight"], both["embed.weight"])


def test_export_refusals(run: tuple[Path, Tiny], tmp_path: Path) -> None:
    run_dir, _ = run
    out = tmp_path / "o.safetensors"
    assert invoke("export", str(run_dir), str(out)).exit_code == 0
    again = invoke("export", str(run_dir), str(out))
    assert again.exit_code == 1 and "--overwrite" in again.stderr
    assert invoke("export", str(run_dir), str(out), "--overwrite").exit_code == 0
    missing = invoke("export", str(run_dir), str(out), "--overwrite", "--subtree", "nope")
    assert missing.exit_code == 1 and "no 'nope' under the root" in missing.stderr
    step = str(run_dir / "checkpoints" / "step-0000000002")
    assert invoke("export", step, str(out), "--step", "1").exit_code == 2  # not a run
    assert invoke("export", str(run_dir), str(out), "--step", "x").exit_code == 2
    assert invoke("export", str(run_dir), str(out), "--sep", "").exit_code == 2
    gone = invoke("export", str(run_dir), str(out), "--step", "99", "--overwrite")
    assert gone.exit_code == 1


def test_export_refuses_names_that_collide(tmp_path: Path) -> None:
    sp.save(tmp_path / "c", {"a.b": np.ones(2), "a": {"b": np.zeros(2)}})
    result = invoke("export", str(tmp_path / "c"), str(tmp_path / "o.safetensors"))
    assert result.exit_code == 1
    assert "also that of" in result.stderr and "--sep" in result.stderr
    assert not (tmp_path / "o.safetensors").exists()
    ok = invoke("export", str(tmp_path / "c"), str(tmp_path / "o.safetensors"), "--sep", "/")
    assert ok.exit_code == 0, ok.output


def test_export_metadata_strings_and_large_values(tmp_path: Path) -> None:
    sp.save(
        tmp_path / "c",
        {"w": np.ones(2, np.float32)},
        metadata={"note": "hi", "small": {"a": 1}, "big": "x" * 10, "huge": ["y" * 2000]},
    )
    report = export(tmp_path / "c", tmp_path / "o.safetensors")
    assert report.metadata == {
        "format": "pt",
        "note": "hi",
        "small": '{"a":1}',
        "big": "x" * 10,
    }
    assert any(d.startswith("metadata/huge") for d in report.dropped)


def test_export_a_pytorch_file(tmp_path: Path) -> None:
    model = Tiny()
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    report = export(tmp_path / "pytorch_model.bin", tmp_path / "o.safetensors")
    assert report.source_format == "torch" and report.tied == {"lm_head.weight": "embed.weight"}
    fresh = Tiny()
    st_torch.load_model(fresh, str(tmp_path / "o.safetensors"))
    assert torch.equal(fresh.embed.weight, model.embed.weight)


def test_export_progress_counts_the_bytes_written(tmp_path: Path) -> None:
    sp.save(tmp_path / "c", {"model": {"w": np.ones(1000, np.float32)}, "opt": np.ones(50)})
    calls: list[tuple[int, int]] = []
    export(tmp_path / "c", tmp_path / "o.safetensors", progress=lambda d, t: calls.append((d, t)))
    assert calls[-1] == (4000, 4000)
