"""sp.convert and ``savepoint convert``: every pair of formats, exact values, clear refusals,
streaming one tensor at a time; detect / inspect_any / verify_any."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
from click.testing import CliRunner

import savepoint as sp
from savepoint.cli import main
from savepoint.cli._common import is_foreign
from savepoint.errors import ConversionError
from savepoint.formats import boostr, detect, shrew
from savepoint.formats._files import SafetensorsFile
from savepoint.formats.convert import convert

MODEL = {
    "w": (np.arange(6, dtype=np.float32) / 3).reshape(2, 3),
    "big": np.array([2**53 + 1, -(2**63), 2**63 - 1], np.int64),
    "h": np.array([1.5, -0.0, np.inf], dtype=ml_dtypes.bfloat16),
    "s": np.array(np.pi),
    "e": np.zeros((0, 4), np.uint8),
}
STATE = sp.OptimizerState("Adam", {"lr": 0.001, "step.0": 3.0}, {"m.0": np.arange(6.0)})
TRAINING = {
    "model": MODEL,
    "optimizer": STATE,
    "epoch": 3,
    "global_step": 7,
    "best_loss": 0.5,
    "loss_history": [1.0, 0.5],
}


def make_native_flat(p: Path) -> None:
    sp.save(p, MODEL)


def make_native_training(p: Path) -> None:
    sp.save(p, TRAINING)


def make_shrew_v1(p: Path) -> None:
    shrew.save_tensors(p, MODEL)


def make_shrew_v2(p: Path) -> None:
    shrew.save_training(p, shrew.TrainingCheckpoint(MODEL, STATE, 3, 7, 0.5, [1.0, 0.5]))


def make_safetensors(p: Path) -> None:
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    # Written by the safetensors library itself (bfloat16 through torch).
    tensors = {k: torch.from_numpy(v.copy()) for k, v in MODEL.items() if k != "h"}
    tensors["h"] = torch.from_numpy(MODEL["h"].view(np.uint16).copy()).view(torch.bfloat16)
    save_file(tensors, str(p))


def make_boostr(p: Path) -> None:
    boostr.save(
        p, MODEL, {"w.m": MODEL["w"] * 2}, boostr.TrainingState(step=7, epoch=3, learning_rate=0.01)
    )


def make_boostr_distributed(p: Path) -> None:
    halves = [{k: v for k, v in MODEL.items()}, {k: v for k, v in MODEL.items()}]
    halves[0]["w"], halves[1]["w"] = MODEL["w"][:1], MODEL["w"][1:]
    for r, half in enumerate(halves):
        boostr.save(
            p / f"rank_{r}", half, None, boostr.TrainingState(step=7, epoch=3, learning_rate=0.01)
        )
    configs = [
        {
            "world_size": 2,
            "rank": r,
            "owned_params": [],
            "strategy": "TensorParallel",
            "split_dims": {"w": 0} if r == 0 else {},
        }
        for r in range(2)
    ]
    (p / "sharding_meta.json").write_text(
        json.dumps({"version": 2, "world_size": 2, "shards": configs})
    )


SOURCES: dict[str, tuple[str, Callable[[Path], None]]] = {
    "native-flat": ("ckpt", make_native_flat),
    "native-training": ("ckpt", make_native_training),
    "shrew-v1": ("x.shrew", make_shrew_v1),
    "shrew-v2": ("x.shrew", make_shrew_v2),
    "safetensors": ("x.safetensors", make_safetensors),
    "boostr": ("bdir", make_boostr),
    "boostr-distributed": ("ddir", make_boostr_distributed),
}
TARGETS = {
    "savepoint": "out",
    "shrew-v1": "out.shrew",
    "shrew-v2": "out.shrew",
    "safetensors": "out.safetensors",
    "boostr": "outdir",
}
# Which conversions lose nothing (the rest must fail strictly and succeed with lossy=True).
LOSSLESS = {("native-flat", t) for t in TARGETS} | {
    ("native-training", "savepoint"),
    ("native-training", "shrew-v2"),
    ("shrew-v1", "savepoint"),
    ("shrew-v1", "shrew-v1"),
    ("shrew-v1", "shrew-v2"),
    ("shrew-v1", "safetensors"),
    ("shrew-v1", "boostr"),
    ("shrew-v2", "savepoint"),
    ("shrew-v2", "shrew-v2"),
    ("safetensors", "savepoint"),
    ("safetensors", "shrew-v1"),
    ("safetensors", "shrew-v2"),
    ("safetensors", "safetensors"),
    ("safetensors", "boostr"),
    ("boostr", "savepoint"),
    ("boostr", "boostr"),
    ("boostr-distributed", "savepoint"),
    ("boostr-distributed", "boostr"),
}


def read_model(path: Path, target: str) -> dict[str, np.ndarray]:
    """The model tensors found at ``path``, names relative to the model."""
    if target == "savepoint":
        tree = sp.load(path)
        found = tree.get("model", tree)
    elif target == "shrew-v1":
        found = shrew.load_tensors(path)
    elif target == "shrew-v2":
        found = dict(shrew.load_training(path).model_params)
    elif target == "safetensors":
        with SafetensorsFile(str(path)) as f:
            found = {n: np.array(f.tensor(n).load()) for n in f.names()}
    else:
        found = boostr.load(path).model
    return {k.removeprefix("model/"): v for k, v in found.items() if not k.startswith("optimizer/")}


@pytest.mark.parametrize("source", list(SOURCES))
@pytest.mark.parametrize("target", list(TARGETS))
def test_every_pair(source: str, target: str, tmp_path: Path) -> None:
    name, make = SOURCES[source]
    src = tmp_path / name
    make(src)
    dst = tmp_path / TARGETS[target]
    if (source, target) not in LOSSLESS:
        with pytest.raises(ConversionError) as err:
            convert(src, dst, format=target)
        assert isinstance(err.value, sp.UnsupportedStateError)
        assert "cannot hold" in str(err.value) and err.value.problems
        assert not dst.exists(), "a refused conversion must write nothing"
        assert sorted(os.listdir(tmp_path)) == [name]
    report = convert(src, dst, format=target, lossy=True)
    assert bool(report.dropped) == ((source, target) not in LOSSLESS), report.dropped
    assert report.destination_format == target
    got = read_model(dst, target)
    assert sorted(got) == sorted(MODEL)
    for k, want in MODEL.items():
        assert (got[k].dtype, got[k].shape) == (want.dtype, want.shape), k
        assert got[k].tobytes() == want.tobytes(), k
    detect.verify_any(dst)


def test_training_fields_carry_across_formats(tmp_path: Path) -> None:
    make_shrew_v2(tmp_path / "a.shrew")
    convert(tmp_path / "a.shrew", tmp_path / "native")
    tree = sp.load(tmp_path / "native")
    assert sp.OptimizerState.from_state_dict(tree["optimizer"]) == STATE
    assert (tree["epoch"], tree["global_step"], tree["best_loss"], tree["loss_history"]) == (
        3,
        7,
        0.5,
        [1.0, 0.5],
    )
    # Byte for byte back.
    convert(tmp_path / "native", tmp_path / "b.shrew")
    assert (tmp_path / "a.shrew").read_bytes() == (tmp_path / "b.shrew").read_bytes()
    # boostr's step is .shrew's global_step; boostr's default learning rate loses nothing.
    boostr.save(tmp_path / "bo", MODEL, None, boostr.TrainingState(step=11, epoch=2))
    report = convert(tmp_path / "bo", tmp_path / "c.shrew")
    assert report.dropped == () and report.destination_format == "shrew-v2"
    ckpt = shrew.load_training(tmp_path / "c.shrew")
    assert (ckpt.epoch, ckpt.global_step, ckpt.optimizer_state) == (2, 11, None)
    convert(tmp_path / "c.shrew", tmp_path / "bo2", format="boostr")
    assert boostr.load(tmp_path / "bo2").state == boostr.TrainingState(step=11, epoch=2)
    # The boostr files come out identical.
    convert(tmp_path / "bo", tmp_path / "nat2")
    convert(tmp_path / "nat2", tmp_path / "bo3", format="boostr")
    for f in ("model.safetensors", "training_state.json"):
        assert (tmp_path / "bo" / f).read_bytes() == (tmp_path / "bo3" / f).read_bytes()


def test_round_trips_keep_order_and_bytes(tmp_path: Path) -> None:
    make_shrew_v1(tmp_path / "a.shrew")
    convert(tmp_path / "a.shrew", tmp_path / "b.safetensors")
    convert(tmp_path / "b.safetensors", tmp_path / "c.shrew")
    convert(tmp_path / "c.shrew", tmp_path / "native")
    convert(tmp_path / "native", tmp_path / "d.shrew")
    assert (tmp_path / "a.shrew").read_bytes() == (tmp_path / "d.shrew").read_bytes()
    assert list(sp.load(tmp_path / "native")) == list(MODEL)
    # savepoint -> savepoint keeps the tree exactly (ties, tuples, plain values, metadata).
    w = np.ones(3)
    sp.save(
        tmp_path / "n1",
        {"a": w, "b": w, "t": (1, "x", None, b"\x00"), 7: float("nan")},
        metadata={"k": [1]},
    )
    convert(tmp_path / "n1", tmp_path / "n2")
    one, two = sp.inspect(tmp_path / "n1"), sp.inspect(tmp_path / "n2")
    assert one.tensors == two.tensors and repr(one.values) == repr(two.values)
    assert two.metadata == {"k": [1]}
    loaded = sp.load(tmp_path / "n2")
    assert loaded["t"] == (1, "x", None, b"\x00") and np.isnan(loaded[7])


def test_refusals_explain_what_the_target_cannot_hold(tmp_path: Path) -> None:
    sp.save(
        tmp_path / "n",
        {"model": {"w": np.ones(2, np.float32), "flag": np.array([True])}, "run": "r1", "lr": 0.1},
        metadata={"note": "hi", "n": 3},
    )
    with pytest.raises(ConversionError) as err:
        convert(tmp_path / "n", tmp_path / "x.shrew")
    text = str(err.value)
    assert "model/flag: dtype BOOL; .shrew holds only F32, F64, U8, U32, I64, F16, BF16" in text
    assert "run: a plain value (str 'r1')" in text
    assert "lr: a plain value (float 0.1)" in text
    assert "metadata: note, n; .shrew has no metadata" in text
    assert "lossy=True" in text and "--lossy" in text
    report = convert(tmp_path / "n", tmp_path / "x.shrew", lossy=True)
    assert len(report.dropped) == 4 and report.tensors == 1
    assert list(shrew.load_training(tmp_path / "x.shrew").model_params) == ["w"]
    with pytest.raises(ConversionError) as err:
        convert(tmp_path / "n", tmp_path / "x.safetensors")
    assert "metadata/n: a plain value (int 3); safetensors metadata maps str to str" in str(
        err.value
    )
    convert(tmp_path / "n", tmp_path / "x.safetensors", lossy=True)
    with SafetensorsFile(str(tmp_path / "x.safetensors")) as f:
        assert f.metadata == {"note": "hi"} and f.names() == ["model/w", "model/flag"]
    # A torch optimizer's state_dict is not an OptimizerState.
    sp.save(
        tmp_path / "t", {"model": {"w": np.ones(1)}, "optimizer": {"state": {}, "param_groups": []}}
    )
    with pytest.raises(ConversionError, match="optimizer_state_from_torch"):
        convert(tmp_path / "t", tmp_path / "t.shrew")


def test_destination_rules(tmp_path: Path) -> None:
    make_shrew_v1(tmp_path / "a.shrew")
    convert(tmp_path / "a.shrew", tmp_path / "n")
    assert detect.detect(tmp_path / "n") == "savepoint"
    with pytest.raises(sp.CheckpointWriteError, match="already exists"):
        convert(tmp_path / "a.shrew", tmp_path / "n")
    with pytest.raises(sp.CheckpointWriteError, match="source itself"):
        convert(tmp_path / "a.shrew", tmp_path / "a.shrew", overwrite=True)
    convert(tmp_path / "a.shrew", tmp_path / "n", overwrite=True)
    convert(tmp_path / "a.shrew", tmp_path / "b", format="boostr")
    # An existing boostr directory is converted into as boostr.
    assert convert(tmp_path / "n", tmp_path / "b", overwrite=True).destination_format == "boostr"
    with pytest.raises(ValueError, match="unknown target format"):
        convert(tmp_path / "a.shrew", tmp_path / "z", format="pickle")
    with pytest.raises(sp.CheckpointNotFoundError):
        convert(tmp_path / "missing", tmp_path / "z")


def test_detect_inspect_verify_every_format(tmp_path: Path) -> None:
    expected = {
        "native-flat": "savepoint",
        "shrew-v1": "shrew",
        "safetensors": "safetensors",
        "boostr": "boostr",
        "boostr-distributed": "boostr-distributed",
    }
    for source, fmt in expected.items():
        name, make = SOURCES[source]
        path = tmp_path / source / name
        path.parent.mkdir()
        make(path)
        assert detect.detect(path) == fmt
        info = detect.inspect_any(path)
        assert info.format == fmt
        keys = {t.key.removeprefix("model/") for t in info.tensors}
        assert set(MODEL) <= keys, (fmt, keys)
        assert detect.verify_any(path).to_dict()["format"] == fmt
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"hello")
    with pytest.raises(sp.IncompatibleCheckpointError, match="not a checkpoint savepoint knows"):
        detect.detect(odd)
    (tmp_path / "empty").mkdir()
    with pytest.raises(sp.IncompatibleCheckpointError):
        detect.detect(tmp_path / "empty")
    with pytest.raises(sp.CheckpointNotFoundError):
        detect.detect(tmp_path / "nothing")
    # An unnamed safetensors file is recognised by its header.
    safetensors.numpy.save_file({"a": np.ones(1)}, str(tmp_path / "weights.bin"))
    assert detect.detect(tmp_path / "weights.bin") == "safetensors"


def test_verify_any_finds_damage(tmp_path: Path) -> None:
    make_shrew_v1(tmp_path / "a.shrew")
    data = (tmp_path / "a.shrew").read_bytes()
    (tmp_path / "a.shrew").write_bytes(data[:-1])
    with pytest.raises(sp.CorruptCheckpointError):
        detect.verify_any(tmp_path / "a.shrew")
    safetensors.numpy.save_file({"a": np.ones(4)}, str(tmp_path / "b.safetensors"))
    with open(tmp_path / "b.safetensors", "ab") as f:
        f.write(b"\x00")
    with pytest.raises(sp.CorruptCheckpointError, match="file is"):
        detect.verify_any(tmp_path / "b.safetensors")
    sp.save(tmp_path / "n", {"w": np.ones(100)})
    record = json.loads((tmp_path / "n" / "manifest.json").read_text())["tensors"]["w"]
    with open(tmp_path / "n" / record["file"], "r+b") as f:
        f.seek(record["offsets"][0])
        f.write(b"\xff")
    with pytest.raises(sp.CorruptCheckpointError, match="checksum"):
        detect.verify_any(tmp_path / "n")
    # ...and conversion of a damaged native checkpoint fails too, leaving nothing behind.
    with pytest.raises(sp.CorruptCheckpointError, match="checksum mismatch in tensor 'w'"):
        convert(tmp_path / "n", tmp_path / "n.shrew")
    assert not (tmp_path / "n.shrew").exists()


# ---------------------------------------------------------------------------------------------
# streaming
# ---------------------------------------------------------------------------------------------

TENSOR = 8 << 20


@pytest.mark.slow
def test_convert_holds_at_most_one_tensor(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    state = {f"t{i}": rng.standard_normal(TENSOR // 8) for i in range(6)}
    sp.save(tmp_path / "src", state)
    del state
    chain = [
        ("src", "a.shrew", None),
        ("a.shrew", "b.safetensors", None),
        ("b.safetensors", "c", "boostr"),
        ("c", "d", "savepoint"),
        ("d", "e.shrew", None),
        ("e.shrew", "f", None),
    ]
    for src, dst, fmt in chain:
        tracemalloc.start()
        try:
            convert(tmp_path / src, tmp_path / dst, format=fmt)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 2.5 * TENSOR, f"{src} -> {dst}: peak {peak / TENSOR:.2f} tensors"
    want = sp.load(tmp_path / "src")
    got = sp.load(tmp_path / "f")["model"]  # boostr made it a training state
    assert list(got) == list(want)
    for k in want:
        assert got[k].tobytes() == want[k].tobytes()


@pytest.mark.slow
def test_consolidating_tensor_parallel_holds_one_tensor(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    parts = [{f"t{i}": rng.standard_normal((TENSOR // 16, 1)) for i in range(4)} for _ in range(2)]
    for r, part in enumerate(parts):
        boostr.save(tmp_path / "d" / f"rank_{r}", part)
    split = {f"t{i}": 0 for i in range(4)}
    configs = [
        {
            "world_size": 2,
            "rank": r,
            "owned_params": [],
            "strategy": "TensorParallel",
            "split_dims": split,
        }
        for r in range(2)
    ]
    (tmp_path / "d" / "sharding_meta.json").write_text(
        json.dumps({"version": 2, "world_size": 2, "shards": configs})
    )
    tracemalloc.start()
    try:
        convert(tmp_path / "d", tmp_path / "n")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2.5 * TENSOR, f"peak {peak / TENSOR:.2f} tensors"
    got = sp.load(tmp_path / "n")["model"]
    for i in range(4):
        assert (
            got[f"t{i}"].tobytes()
            == np.concatenate([parts[0][f"t{i}"], parts[1][f"t{i}"]]).tobytes()
        )


# ---------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------


def run(*args: str) -> Any:
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_cli_convert_inspect_verify(tmp_path: Path) -> None:
    make_shrew_v2(tmp_path / "a.shrew")
    result = run("convert", str(tmp_path / "a.shrew"), str(tmp_path / "b.safetensors"))
    assert result.exit_code == 1
    assert (
        "error: cannot convert to a safetensors file" in result.stderr and "epoch" in result.stderr
    )
    result = run("convert", "--lossy", str(tmp_path / "a.shrew"), str(tmp_path / "b.safetensors"))
    assert result.exit_code == 0, result.output
    assert "(shrew v2) ->" in result.stdout and "left out (" in result.stdout
    result = run("convert", str(tmp_path / "a.shrew"), str(tmp_path / "n"))
    assert result.exit_code == 0 and "(savepoint)" in result.stdout
    result = run(
        "convert", "--format", "boostr", "--lossy", str(tmp_path / "n"), str(tmp_path / "bo")
    )
    assert result.exit_code == 0
    result = run("convert", str(tmp_path / "a.shrew"), str(tmp_path / "n"))
    assert result.exit_code == 1 and "--overwrite" in result.stderr

    result = run("inspect", str(tmp_path / "a.shrew"))
    assert result.exit_code == 0
    lines = {line.split()[0]: line.split() for line in result.stdout.splitlines() if line.strip()}
    assert lines["format"] == ["format", "shrew", "v2"]
    assert lines["model/w"][1:3] == ["F32", "(2,"]
    assert lines["model/big"][1:3] == ["I64", "(3,)"]
    assert "global_step" in lines and lines["global_step"][1] == "7"
    result = run("inspect", "--json", str(tmp_path / "bo"))
    doc = json.loads(result.stdout)
    assert doc["format"] == "boostr" and doc["values"]["step"] == 7
    result = run("verify", str(tmp_path / "b.safetensors"))
    assert (
        result.exit_code == 0
        and result.stdout.startswith("ok: ")
        and "no checksums" in result.stdout
    )
    assert run("verify", "-q", str(tmp_path / "bo")).stdout == ""
    (tmp_path / "bad.shrew").write_bytes(b"SHRW\x01\x00\x00\x00\x05")
    result = run("verify", str(tmp_path / "bad.shrew"))
    assert result.exit_code == 1 and "error:" in result.stderr
    assert not is_foreign(str(tmp_path / "n"))
    assert not is_foreign(str(tmp_path / "missing"))


def test_docs_formats_md_runs(tmp_path: Path) -> None:
    doc = Path(__file__).resolve().parents[1] / "docs" / "formats.md"
    blocks = re.findall(r"^```python[^\n]*\n(.*?)^```", doc.read_text("utf-8"), re.M | re.S)
    assert blocks
    script = tmp_path / "formats_md.py"
    script.write_text("\n\n".join(blocks), encoding="utf-8")
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert result.returncode == 0, result.stdout + result.stderr


# -- files that are not regular files (issue 11) ------------------------------------------------
#
# A FIFO named x.shrew once made detection, inspect, convert and shrew.load_tensors block forever
# in open() or read(). Every entry point that takes a user's path must answer at once with a
# CheckpointError; each call runs in a thread with a deadline, so a regression fails instead of
# hanging the suite (and the FIFO is then opened for writing, which releases the stuck reader).

SPECIAL = ["fifo", "dev-null", "dev-zero", "directory"]
NAMES = ["x.shrew", "x.safetensors", "x.json", "x.msgpack", "x.bin"]


def _special(tmp_path: Path, kind: str, name: str) -> Path:
    path = tmp_path / name
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    else:  # a name with a format's extension for a character device
        path.symlink_to("/dev/null" if kind == "dev-null" else "/dev/zero")
    return path


def _cli(*args: str) -> None:
    result = CliRunner().invoke(main, list(args))
    if result.exit_code == 1 and "error:" in result.output:
        raise sp.CheckpointError(result.output)
    raise AssertionError(f"exit {result.exit_code}: {result.output} {result.exception!r}")


ENTRY_POINTS: dict[str, Callable[[Path, Path], Any]] = {
    "shrew.load_tensors": lambda p, tmp: shrew.load_tensors(p),
    "shrew.load_training": lambda p, tmp: shrew.load_training(p),
    "shrew.read_version": lambda p, tmp: shrew.read_version(p),
    "shrew.load": lambda p, tmp: shrew.load(p, {}),
    "shrew.inspect": lambda p, tmp: shrew.inspect(p),
    "shrew.verify": lambda p, tmp: shrew.verify(p),
    "detect": lambda p, tmp: detect.detect(p),
    "inspect_any": lambda p, tmp: detect.inspect_any(p),
    "verify_any": lambda p, tmp: detect.verify_any(p),
    "sp.convert": lambda p, tmp: sp.convert(p, tmp / "out"),
    "sp.convert-dst": lambda p, tmp: sp.convert(_source(tmp), p, overwrite=True),
    "InferenceSnapshot.load": lambda p, tmp: sp.InferenceSnapshot.load(p),
    "cli inspect": lambda p, tmp: _cli("inspect", str(p)),
    "cli verify": lambda p, tmp: _cli("verify", str(p)),
    "cli convert": lambda p, tmp: _cli("convert", str(p), str(tmp / "out.safetensors")),
}


def _source(tmp: Path) -> Path:
    src = tmp / "source.shrew"
    if not src.exists():
        make_shrew_v1(src)
    return src


def _within(seconds: float, call: Callable[[], Any], unblock: Path | None) -> BaseException | None:
    """What ``call`` raised (None if it returned); fails if it has not finished in time."""
    outcome: dict[str, BaseException | None] = {}

    def run() -> None:
        try:
            call()
            outcome["error"] = None
        except BaseException as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        if unblock is not None:  # a reader stuck on the FIFO: give it a writer, then EOF
            try:
                os.close(os.open(unblock, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
            thread.join(5)
        pytest.fail(f"no answer within {seconds} s: the call blocked")
    return outcome["error"]


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
@pytest.mark.parametrize("kind", SPECIAL)
def test_special_files_are_refused_without_blocking(kind: str, entry: str, tmp_path: Path) -> None:
    call = ENTRY_POINTS[entry]
    for name in NAMES:
        if entry == "sp.convert-dst" and not name.endswith((".shrew", ".safetensors")):
            continue
        folder = tmp_path / name.replace(".", "-")
        folder.mkdir()
        path = _special(folder, kind, name)
        start = time.monotonic()
        error = _within(2.0, lambda p=path, f=folder: call(p, f), path if kind == "fifo" else None)
        assert isinstance(error, sp.CheckpointError), f"{name}: {error!r}"
        assert time.monotonic() - start < 2.0
        if entry == "sp.convert-dst":
            assert path.is_symlink() or path.exists()  # the special file is left as it was


def test_a_symlink_to_a_regular_file_still_reads(tmp_path: Path) -> None:
    # Refusing devices must not refuse links (the Hugging Face cache is made of them).
    make_shrew_v1(tmp_path / "real.shrew")
    (tmp_path / "link.shrew").symlink_to(tmp_path / "real.shrew")
    assert detect.detect(tmp_path / "link.shrew") == "shrew"
    assert set(shrew.load_tensors(tmp_path / "link.shrew")) == set(MODEL)
    assert len(detect.verify_any(tmp_path / "link.shrew").tensors) == len(MODEL)
