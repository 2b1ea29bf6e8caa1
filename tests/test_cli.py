"""The ``savepoint`` command line: inspect, verify, exit statuses; in-process and as real programs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from click.testing import CliRunner

import savepoint as sp
from savepoint.cli import main

VENV_SCRIPT = Path(sys.executable).parent / "savepoint"


def invoke(*args: str) -> Any:
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


@pytest.fixture
def good(ckpt: Path) -> Path:
    sp.save(
        ckpt,
        {
            "model": {
                "weight": np.ones((4, 3), np.float32),
                "bias": np.zeros(3, ml_dtypes.bfloat16),
            },
            "step": np.int64(12),
            "tied": None,
            "name": "run-7",
            "history": [0.5, float("nan")],
            "blob": b"\x00\x01",
        },
        metadata={"epoch": 3, "note": "ünï"},
    )
    return ckpt


def test_inspect_lists_keys_dtypes_shapes(good: Path) -> None:
    result = invoke("inspect", str(good))
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert str(good) in out
    lines = {line.split()[0]: line.split() for line in out.splitlines() if line.strip()}
    assert lines["model/weight"][1:3] == ["F32", "(4,"] and "3)" in lines["model/weight"]
    assert lines["model/bias"][1:3] == ["BF16", "(3,)"]
    assert lines["step"][1:3] == ["I64", "()"]
    assert "'run-7'" in lines["name"]
    assert "history/1" in lines and "nan" in lines["history/1"]
    assert '"epoch": 3' in out
    assert "3 tensors" in out
    assert result.stderr == ""


def test_inspect_json_is_valid_and_complete(good: Path) -> None:
    result = invoke("inspect", "--json", str(good))
    assert result.exit_code == 0
    doc = json.loads(result.stdout)
    assert doc["path"] == str(good)
    assert doc["format_version"] == 1
    assert doc["metadata"] == {"epoch": 3, "note": "ünï"}
    tensors = {t["key"]: t for t in doc["tensors"]}
    assert tensors["model/weight"]["dtype"] == "F32" and tensors["model/weight"]["shape"] == [4, 3]
    assert tensors["model/bias"]["dtype"] == "BF16" and tensors["model/bias"]["shape"] == [3]
    assert tensors["step"]["shape"] == [] and tensors["step"]["nbytes"] == 8
    assert doc["total_bytes"] == 48 + 6 + 8
    assert doc["values"]["name"] == "run-7" and doc["values"]["tied"] is None
    assert sum(doc["files"].values()) == sum((good / n).stat().st_size for n in doc["files"])
    json.loads(result.stdout, parse_constant=lambda c: pytest.fail(f"non-standard JSON {c}"))


def test_inspect_shows_stateful_and_ties(ckpt: Path) -> None:
    class Box:
        def __init__(self) -> None:
            self.w = np.ones(2)

        def state_dict(self) -> dict[str, Any]:
            return {"w": self.w, "alias": self.w}

        def load_state_dict(self, sd: dict[str, Any]) -> None:
            self.w = sd["w"]

    sp.save(ckpt, {"box": Box()})
    result = invoke("inspect", str(ckpt))
    assert result.exit_code == 0
    assert "box: " in result.stdout and "Box" in result.stdout
    assert "tied to box/w" in result.stdout
    doc = json.loads(invoke("inspect", "--json", str(ckpt)).stdout)
    assert {t["key"]: t.get("tied_to") for t in doc["tensors"]} == {
        "box/w": None,
        "box/alias": "box/w",
    }
    assert list(doc["stateful"]) == ["box"]


def test_verify_good_checkpoint(good: Path) -> None:
    result = invoke("verify", str(good))
    assert result.exit_code == 0
    assert result.stdout.startswith("ok: ") and "3 tensors" in result.stdout
    quiet = invoke("verify", "-q", str(good))
    assert quiet.exit_code == 0 and quiet.stdout == "" and quiet.stderr == ""


def _damage_data(path: Path) -> None:
    with open(path / "manifest.json", encoding="utf-8") as f:
        rec = json.load(f)["tensors"]["model/weight"]
    with open(path / rec["file"], "r+b") as f:
        f.seek(rec["offsets"][0] + 1)
        f.write(b"\x55")


def _truncate(path: Path) -> None:
    data = next(path.glob("*.safetensors"))
    data.write_bytes(data.read_bytes()[:-1])


def _drop_manifest(path: Path) -> None:
    (path / "manifest.json").unlink()


def _damage_manifest(path: Path) -> None:
    raw = (path / "manifest.json").read_bytes()
    (path / "manifest.json").write_bytes(raw.replace(b'"run-7"', b'"run-8"'))


@pytest.mark.parametrize(
    ("damage", "expect"),
    [
        (_damage_data, "checksum"),
        (_truncate, "bytes"),
        (_drop_manifest, "manifest.json"),
        (_damage_manifest, "checksum"),
    ],
    ids=["flipped-byte", "truncated", "incomplete", "edited-manifest"],
)
def test_verify_bad_checkpoint_exits_1(good: Path, damage: Any, expect: str) -> None:
    damage(good)
    result = invoke("verify", str(good))
    assert result.exit_code == 1
    assert result.stderr.startswith("error: ")
    assert expect in result.stderr
    assert result.stdout == ""


def test_missing_and_incomplete_paths_exit_1(tmp_path: Path) -> None:
    missing = tmp_path / "nothing-here"
    empty = tmp_path / "empty"
    empty.mkdir()
    for cmd in ("verify", "inspect"):
        for path in (missing, empty):
            result = invoke(cmd, str(path))
            assert result.exit_code == 1, (cmd, path)
            assert result.stderr.startswith("error: ") and str(path) in result.stderr
    # Under --json the error is also a JSON object on stdout (docs/cli.md); stderr as always.
    result = invoke("inspect", "--json", str(missing))
    assert result.exit_code == 1 and result.stderr.startswith("error: ")
    doc = json.loads(result.stdout)
    assert doc["error"]["type"] == "CheckpointNotFoundError" and doc["command"] == "inspect"


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["frobnicate"],
        ["verify"],
        ["inspect"],
        ["inspect", "--bogus", "x"],
        ["verify", "a", "b"],
    ],
    ids=[
        "no-command",
        "unknown-command",
        "verify-no-path",
        "inspect-no-path",
        "bad-option",
        "extra-arg",
    ],
)
def test_usage_errors_exit_2(args: list[str]) -> None:
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output


def test_help_and_version() -> None:
    result = invoke("--help")
    assert result.exit_code == 0 and "inspect" in result.stdout and "verify" in result.stdout
    assert invoke("-h").stdout == result.stdout
    version = invoke("--version")
    assert version.exit_code == 0 and sp.__version__ in version.stdout


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONWARNINGS", None)
    return env


def test_python_dash_m_help() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "savepoint", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        env=_env(),
    )
    assert result.returncode == 0, result.stderr
    assert "inspect" in result.stdout and "verify" in result.stdout


@pytest.mark.skipif(
    not VENV_SCRIPT.exists(), reason="the savepoint console script is not installed"
)
def test_console_script(good: Path) -> None:
    result = subprocess.run(
        [str(VENV_SCRIPT), "verify", str(good)],
        capture_output=True,
        text=True,
        timeout=60,
        env=_env(),
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ok: ")
    result = subprocess.run(
        [str(VENV_SCRIPT), "inspect", "--json", str(good)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0 and json.loads(result.stdout)["metadata"]["epoch"] == 3
    _damage_data(good)
    result = subprocess.run(
        [str(VENV_SCRIPT), "verify", str(good)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 1
    assert result.stderr.startswith("error: ") and "checksum" in result.stderr
    result = subprocess.run([str(VENV_SCRIPT)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
