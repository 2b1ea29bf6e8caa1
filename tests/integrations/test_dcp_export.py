"""Getting a model out of a DCP checkpoint written through savepoint (issue 25, item 18).

``savepoint export CKPT OUT.safetensors --subtree app/model`` reads DCP's flat names as the
nested state DCP flattened, leaves out the values DCP pickled and, by default, optimizer state;
``full_state_dict``/``dcp_to_torch_save`` are DCP's ``format_utils.dcp_to_torch_save`` for these
checkpoints (DCP's own hard-codes its ``FileSystemReader`` and its ``.metadata`` file).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")
st_torch = pytest.importorskip("safetensors.torch")

import savepoint as sp  # noqa: E402
from savepoint.cli import main  # noqa: E402
from savepoint.integrations.dcp import (  # noqa: E402
    SavepointWriter,
    dcp_to_torch_save,
    full_state_dict,
)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def trained(path: Path) -> tuple[Any, dict[str, Any]]:
    """A torchtitan-style state (model and optimizer under one key, counters beside them) saved
    by dcp.save through SavepointWriter in one process."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    state = {
        "app": {"model": model.state_dict(), "optim": opt.state_dict()},
        "step": 7,
        "extra": {"note": "x"},
    }
    dcp.save(state, storage_writer=SavepointWriter(path))
    return model, state


def export(*args: str) -> Any:
    return CliRunner().invoke(main, ["export", *args])


def test_export_a_subtree_of_a_dcp_checkpoint(tmp_path: Path) -> None:
    model, _ = trained(tmp_path / "c")
    out = tmp_path / "model.safetensors"
    result = export(str(tmp_path / "c"), str(out), "--subtree", "app/model")
    assert result.exit_code == 0, result.output
    weights = st_torch.load_file(str(out))
    assert sorted(weights) == sorted(model.state_dict())  # the model's own names
    fresh = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    fresh.load_state_dict(weights, strict=True)
    for name, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], value), name


def test_export_without_subtree_leaves_out_optimizer_and_pickles(tmp_path: Path) -> None:
    model, _ = trained(tmp_path / "c")
    out = tmp_path / "all.safetensors"
    result = export(str(tmp_path / "c"), str(out))
    assert result.exit_code == 0, result.output
    assert sorted(st_torch.load_file(str(out))) == sorted(
        f"app.model.{k}" for k in model.state_dict()
    )
    assert "app/optim: an optimizer's state" in result.stdout
    assert "step: a value DCP serialised with torch.save" in result.stdout
    # A subtree that is not there: the keys that are, and no advice to use --lossy.
    missing = export(str(tmp_path / "c"), str(out), "--overwrite", "--subtree", "model")
    assert missing.exit_code == 1
    assert "it holds app, step, extra" in missing.stderr
    assert "--lossy" not in missing.stderr and "--subtree" in missing.stderr


def test_full_state_dict_and_dcp_to_torch_save(tmp_path: Path) -> None:
    _, state = trained(tmp_path / "c")
    back = full_state_dict(tmp_path / "c")
    assert back["step"] == 7 and back["extra"] == {"note": "x"}
    for k, v in state["app"]["model"].items():
        assert torch.equal(back["app"]["model"][k], v)
    assert back["app"]["optim"]["param_groups"] == state["app"]["optim"]["param_groups"]
    dcp_to_torch_save(tmp_path / "c", tmp_path / "full.pt")
    saved = torch.load(tmp_path / "full.pt", weights_only=True)
    moments = state["app"]["optim"]["state"][0]["exp_avg"]
    assert torch.equal(saved["app"]["optim"]["state"]["0"]["exp_avg"], moments)  # DCP's keys
    # savepoint's errors, not DCP's AssertionError or CheckpointException
    with pytest.raises(sp.CheckpointNotFoundError):
        full_state_dict(tmp_path / "absent")
    data = next((tmp_path / "c").glob("data-*.safetensors"))
    raw = bytearray(data.read_bytes())
    raw[-3] ^= 1
    data.write_bytes(bytes(raw))
    with pytest.raises(sp.CorruptCheckpointError, match="checksum mismatch"):
        full_state_dict(tmp_path / "c")
