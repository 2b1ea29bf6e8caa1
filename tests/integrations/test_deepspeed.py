"""DeepSpeed ZeRO checkpoints (issue 30): DeepSpeed itself (``pip install deepspeed``, CPU, gloo,
2 ranks) trains a model one step under ZeRO 1, 2 and 3 (and 2 with bf16) and saves it; savepoint
reads each as DeepSpeed's own ``zero_to_fp32`` consolidates it, bit-exact, by the tag directory
or by the save directory, into a model, and through the CLI. Skipped without DeepSpeed (the
golden copies in ``tests/golden/deepspeed`` are read by ``tests/formats/test_deepspeed_golden.py``
without it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
# The real package, not a namespace package a test directory on sys.path could offer (tests/golden/deepspeed).
pytest.importorskip("deepspeed.utils.zero_to_fp32")

import savepoint as sp  # noqa: E402
from distributed import _launch  # noqa: E402

from ._deepspeed_worker import Net  # noqa: E402

WORKER = Path(__file__).with_name("_deepspeed_worker.py")
PHASES = ("zero1", "zero2", "zero3", "zero2-bf16")
pytestmark = pytest.mark.filterwarnings("ignore")  # DeepSpeed's own deprecation warnings


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    workdir = tmp_path_factory.mktemp("deepspeed")
    for phase in PHASES:
        session = _launch.run(phase, 2, workdir, worker=WORKER, timeout=300)
        assert not session.failures(), session.failures()
    return workdir


def zero_to_fp32(save_dir: Path) -> dict[str, Any]:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return dict(get_fp32_state_dict_from_zero_checkpoint(str(save_dir)))


@pytest.mark.parametrize("phase", PHASES)
def test_reads_as_zero_to_fp32_gives(saved: Path, phase: str) -> None:
    theirs = zero_to_fp32(saved / phase)
    for path in (saved / phase, saved / phase / "global_step1"):  # the save dir: its latest tag
        ours = sp.load(path)
        assert list(ours) == list(theirs)
        for name, t in theirs.items():
            assert ours[name].dtype == t.dtype and torch.equal(ours[name], t), name
        assert ours["head.weight"] is ours["emb.weight"]  # DeepSpeed's shared_params
    info = sp.verify(saved / phase)
    assert info.format == "deepspeed" and info.metadata["deepspeed"]["world_size"] == 2
    assert info.metadata["deepspeed"]["zero_stage"] == int(phase[4])


def test_into_a_model(saved: Path) -> None:
    net = Net()
    net.load_state_dict(sp.load(saved / "zero3"), strict=True)
    assert torch.equal(net.lin.weight, zero_to_fp32(saved / "zero3")["lin.weight"])


def test_the_cli_converts_and_exports_it(saved: Path, tmp_path: Path) -> None:
    from click.testing import CliRunner
    from safetensors.torch import load_file

    from savepoint.cli import main

    ckpt, out = tmp_path / "ckpt", tmp_path / "model.safetensors"
    for args in (
        ["inspect", str(saved / "zero2")],
        ["convert", str(saved / "zero2"), str(ckpt)],
        ["verify", str(ckpt)],
        ["export", str(saved / "zero2"), str(out)],
    ):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 0, (args, result.output)
    theirs = zero_to_fp32(saved / "zero2")
    exported = load_file(str(out))
    assert set(exported) == set(theirs) - {"head.weight"}  # the tie, stored once
    assert all(torch.equal(exported[k], theirs[k]) for k in exported)
    assert sp.inspect(ckpt).metadata["deepspeed"]["zero_stage"] == 2
