"""PyTorch files (torch.save) read through torch.load(weights_only=True) only: detection by name
and content, inspect/verify, convert into savepoint's format (ties kept), clear refusals; and
progress reports from verify_any for every format."""

from __future__ import annotations

import collections
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

import savepoint as sp
from savepoint.cli import main
from savepoint.formats import detect, pytorch, shrew

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.torch


def _state() -> dict[str, Any]:
    weight = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    return collections.OrderedDict(
        [
            ("embed.weight", weight),
            ("head.weight", weight),  # tied: the same tensor under two names
            ("head.bias", torch.zeros(2, dtype=torch.bfloat16)),
            ("steps", torch.tensor(7)),
        ]
    )


@pytest.mark.parametrize("zipped", [True, False], ids=["zip", "legacy"])
@pytest.mark.parametrize("suffix", [".pt", ".pth", ".bin", ".ckpt"])
def test_detect_inspect_verify_convert(tmp_path: Path, zipped: bool, suffix: str) -> None:
    path = tmp_path / f"model{suffix}"
    torch.save(_state(), path, _use_new_zipfile_serialization=zipped)
    assert detect.detect(path) == "torch"
    info = detect.inspect_any(path)
    assert info.format == "torch" and info.format_version is None
    assert {t.key: t.tied_to for t in info.tensors} == {
        "embed.weight": None,
        "head.weight": "embed.weight",
        "head.bias": None,
        "steps": None,
    }
    assert info.total_bytes == 24 + 4 + 8  # the tied tensor counted once
    calls: list[tuple[int, int]] = []
    assert (
        detect.verify_any(path, progress=lambda d, t: calls.append((d, t))).tensors == info.tensors
    )
    assert calls[-1] == (36, 36)
    report = sp.convert(path, tmp_path / "ckpt")
    assert (report.source_kind, report.tensors) == ("torch", 3)
    out = sp.load(tmp_path / "ckpt")
    assert out["head.weight"] is out["embed.weight"]  # still tied
    assert torch.equal(out["embed.weight"], _state()["embed.weight"])
    assert out["head.bias"].dtype == torch.bfloat16 and int(out["steps"]) == 7


def test_nested_training_state_with_plain_values(tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    torch.save(
        {
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "epoch": 3,
            "shape": torch.Size([2, 3]),
            "dtype": torch.float16,
            "note": None,
        },
        tmp_path / "train.pt",
    )
    sp.convert(tmp_path / "train.pt", tmp_path / "ckpt")
    out = sp.load(tmp_path / "ckpt")
    assert out["epoch"] == 3 and out["shape"] == (2, 3) and out["dtype"] == "torch.float16"
    assert torch.equal(
        out["optimizer"]["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"]
    )
    assert out["optimizer"]["param_groups"][0]["params"] == [0, 1]


def test_objects_beyond_weights_only_are_refused(tmp_path: Path) -> None:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    torch.save({"optimizer": opt}, tmp_path / "bad.pt")
    for call in (detect.inspect_any, lambda p: sp.convert(p, tmp_path / "out")):
        with pytest.raises(sp.IncompatibleCheckpointError) as info:
            call(tmp_path / "bad.pt")
        message = str(info.value)
        assert "weights_only=True" in message and "torch.optim.sgd.SGD" in message
        assert "never unpickles arbitrary objects" in message
    assert not (tmp_path / "out").exists()
    result = CliRunner().invoke(main, ["convert", str(tmp_path / "bad.pt"), str(tmp_path / "o")])
    assert result.exit_code == 1 and "weights_only=True" in result.stderr


def test_damaged_file_is_a_clear_error(tmp_path: Path) -> None:
    torch.save(_state(), tmp_path / "m.pt")
    data = (tmp_path / "m.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(sp.CheckpointError, match="cannot be read as a PyTorch file"):
        detect.inspect_any(tmp_path / "cut.pt")


def test_detection_needs_name_and_content(tmp_path: Path) -> None:
    torch.save(_state(), tmp_path / "m.pt")
    (tmp_path / "m.zip").write_bytes((tmp_path / "m.pt").read_bytes())
    with pytest.raises(sp.IncompatibleCheckpointError):
        detect.detect(tmp_path / "m.zip")
    (tmp_path / "odd.bin").write_bytes(b"hello")
    with pytest.raises(sp.IncompatibleCheckpointError, match="not a checkpoint savepoint knows"):
        detect.detect(tmp_path / "odd.bin")
    assert pytorch.looks_like("x.PT", b"PK\x03\x04....")
    assert not pytorch.looks_like("x.pt", b"garbage")


def test_without_torch_the_message_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.save(_state(), tmp_path / "m.pt")
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(sp.IncompatibleCheckpointError, match=r"savepoint\[torch\]"):
        pytorch.load_tree(tmp_path / "m.pt")


def test_convert_never_writes_pickles(tmp_path: Path) -> None:
    sp.save(tmp_path / "c", {"w": np.ones(2)})
    with pytest.raises(sp.IncompatibleCheckpointError, match="never writes pickles"):
        sp.convert(tmp_path / "c", tmp_path / "out.pt")
    sp.convert(tmp_path / "c", tmp_path / "out.pt", format="savepoint")  # asked for: a directory
    assert (tmp_path / "out.pt" / "manifest.json").exists()


def test_verify_any_reports_progress_for_every_format(tmp_path: Path) -> None:
    sp.save(tmp_path / "native", {"model": {"w": np.ones(100, np.float32)}})
    paths = {"native": tmp_path / "native"}
    for name, target in (
        ("m.shrew", "shrew"),
        ("m.safetensors", "safetensors"),
        ("m.mpk", "burn"),
        ("boostr", "boostr"),
    ):
        sp.convert(tmp_path / "native", tmp_path / name, format=target)
        paths[target] = tmp_path / name
    shrew.save_tensors(str(tmp_path / "v1.shrew"), {"w": np.ones(100, np.float32)})
    paths["v1"] = tmp_path / "v1.shrew"
    for kind, path in paths.items():
        calls: list[tuple[int, int]] = []
        detect.verify_any(path, progress=lambda d, t, c=calls: c.append((d, t)))
        assert calls and calls[-1] == (400, 400), (kind, calls[-3:])
        assert all(d <= t for d, t in calls), kind
    artifact = Path(__file__).resolve().parent.parent / "golden" / "burn" / "artifact"
    calls = []
    info = detect.verify_any(artifact, progress=lambda d, t: calls.append((d, t)))
    assert info.format == "training-artifact" and calls and calls[-1][0] == calls[-1][1] > 0


@pytest.mark.parametrize(
    "pickle_bytes",
    [
        b"\x80\x05\x96" + (1 << 28).to_bytes(8, "little") + b".",  # BYTEARRAY8 of 256 MiB
        b"\x80\x05\x8e" + (1 << 28).to_bytes(8, "little") + b".",  # BINBYTES8 of 256 MiB
        b"\x80\x04\x95" + (1 << 28).to_bytes(8, "little") + b"K\x01.",  # a huge FRAME
    ],
    ids=["bytearray8", "binbytes8", "frame"],
)
def test_a_claimed_length_is_never_allocated_before_it_is_read(pickle_bytes: bytes) -> None:
    """20 bytes of hostile pickle claiming 256 MiB: refused without allocating it (the
    pure-Python unpickler's own BYTEARRAY8 zero-filled the claimed length first)."""
    import tracemalloc

    from savepoint.formats._torch_archive import unpickle

    tracemalloc.start()
    try:
        try:
            found = unpickle(pickle_bytes, {}, path="p", what="p")
        except sp.CorruptCheckpointError:
            found = None
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20
    assert found in (None, 1)
