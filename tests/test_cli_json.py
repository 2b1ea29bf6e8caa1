"""One JSON shape for every command (docs/cli.md): each ``--json`` prints one object whose first
keys are ``savepoint_cli``, ``command``, ``format`` and ``version``; a failure prints an object
with an ``error`` key and exits nonzero; the documented examples have the same keys."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner, Result

import savepoint as sp
from savepoint.cli import _common, main
from savepoint.formats import shrew

DOCS = Path(__file__).resolve().parents[1] / "docs" / "cli.md"
HEAD = ["savepoint_cli", "command", "format", "version"]


def invoke(*args: str) -> Result:
    return CliRunner().invoke(main, list(args))


def parsed(result: Result) -> dict[str, Any]:
    """The one JSON object on stdout, checked to be standard JSON with the shared keys first."""
    doc = json.loads(result.stdout, parse_constant=lambda c: pytest.fail(f"non-standard {c}"))
    assert isinstance(doc, dict)
    assert list(doc)[:4] == HEAD, list(doc)
    assert doc["savepoint_cli"] == _common.JSON_VERSION == 1
    return doc


@pytest.fixture
def world(tmp_path: Path) -> dict[str, Path]:
    """A run, a sweep, a plain checkpoint, a sharded one and files of other formats."""
    run = tmp_path / "runs" / "demo"
    with sp.CheckpointManager(run, keep_last=2, best_metric="val_loss") as mgr:
        w = np.zeros(4, np.float32)
        for step in range(1, 5):
            w += 0.5
            mgr.log(step, loss=1.0 / step)
            if step % 2 == 0:
                mgr.save(
                    step,
                    {"model": {"w": w, "b": np.ones(2)}, "step": step},
                    metrics={"val_loss": 1.0 / step},
                )
    ckpt = tmp_path / "ckpt"
    sp.save(ckpt, {"w": np.arange(6, dtype=np.float32), "name": "x"}, metadata={"note": "hi"})
    sharded = tmp_path / "sharded"
    full = np.arange(24, dtype=np.float32).reshape(4, 6)
    sp.save(sharded, {"w": sp.Shard(full, (4, 6), (0, 0))})
    v1 = tmp_path / "m.shrew"
    shrew.save_tensors(str(v1), {"w": np.ones(3, np.float32)})
    st = tmp_path / "m.safetensors"
    sp.convert(ckpt, st, lossy=True)
    return {
        "run": run,
        "sweep": tmp_path / "runs",
        "ckpt": ckpt,
        "sharded": sharded,
        "shrew": v1,
        "safetensors": st,
        "tmp": tmp_path,
    }


def commands(world: dict[str, Path]) -> list[tuple[list[str], str, Any]]:
    """(argv, expected format, expected version) of one successful run of every command."""
    t, run, ckpt = world["tmp"], str(world["run"]), str(world["ckpt"])
    return [
        (["inspect", ckpt], "savepoint", 1),
        (["inspect", str(world["shrew"])], "shrew", 1),
        (["inspect", str(world["safetensors"])], "safetensors", None),
        (["verify", ckpt], "savepoint", 1),
        (["verify", str(world["shrew"])], "shrew", 1),
        (["verify", str(world["safetensors"])], "safetensors", None),
        (["verify", run], "savepoint-run", 1),
        (["ls", run], "savepoint-run", 1),
        (["diff", run, "2", "latest"], "savepoint", 1),
        (["diff", ckpt, ckpt], "savepoint", 1),
        (["report", run], "savepoint-report", 1),
        (["report", str(world["sweep"])], "savepoint-comparison", 1),
        (["convert", ckpt, str(t / "copy")], "savepoint", 1),
        (["convert", str(world["shrew"]), str(t / "again.shrew")], "shrew", 1),
        (["convert", ckpt, str(t / "c.safetensors"), "--lossy"], "safetensors", None),
        (["export", run, str(t / "model.safetensors")], "safetensors", None),
        (["consolidate", str(world["sharded"]), str(t / "whole")], "savepoint", 1),
        (["copy", run, str(t / "copied")], "savepoint", 1),
        (["gc", run, "--dry-run"], "savepoint-run", 1),
        (["gc", ckpt, "--dry-run"], "savepoint", None),
    ]


def test_every_command_prints_the_shared_shape(world: dict[str, Path]) -> None:
    seen = set()
    for argv, fmt, version in commands(world):
        result = invoke(*argv, "--json")
        assert result.exit_code in (0, 1), (argv, result.output)  # diff of two steps differs
        doc = parsed(result)
        assert (doc["command"], doc["format"], doc["version"]) == (argv[0], fmt, version), argv
        assert "error" not in doc, argv
        seen.add(argv[0])
    assert seen == set(main.commands), "a command without a --json case here"


def test_every_command_prints_a_json_error_and_exits_nonzero(world: dict[str, Path]) -> None:
    t = world["tmp"]
    missing = str(t / "nothing")
    cases = [
        ["inspect", missing],
        ["verify", missing],
        ["ls", missing],
        ["diff", missing, str(world["ckpt"])],
        ["report", missing],
        ["convert", missing, str(t / "out")],
        ["export", missing, str(t / "out.safetensors")],
        ["consolidate", missing, str(t / "out2")],
        ["copy", missing, str(t / "out3")],
        ["gc", missing],
    ]
    assert {c[0] for c in cases} == set(main.commands)
    for argv in cases:
        result = invoke(*argv, "--json")
        assert result.exit_code == 1, (argv, result.output)
        doc = parsed(result)
        assert doc["command"] == argv[0] and doc["format"] is None and doc["version"] is None
        error = doc["error"]
        assert set(error) == {"type", "message", "path"}
        assert error["type"].endswith("Error") and error["message"], argv
        # The human line is on stderr, as without --json.
        assert result.stderr.startswith("error: "), argv


def test_usage_errors_under_json_are_json_too(world: dict[str, Path]) -> None:
    for argv in (
        ["inspect", "--json", "--bogus", "x"],
        ["diff", str(world["run"]), "2", "not-a-step", "--json"],
        ["report", str(world["run"]), "--plot", str(world["tmp"] / "no" / "x.png"), "--json"],
    ):
        result = invoke(*argv)
        assert result.exit_code == 2, (argv, result.output)
        doc = parsed(result)
        assert doc["error"]["type"] == "UsageError", argv
    # Without --json a usage error prints nothing on stdout.
    assert invoke("inspect", "--bogus", "x").stdout == ""


def test_verify_of_a_broken_run_lists_problems_in_json(world: dict[str, Path]) -> None:
    run = world["run"]
    data = next((run / "checkpoints" / "step-0000000004").glob("*.safetensors"))
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF
    data.write_bytes(bytes(raw))
    result = invoke("verify", str(run), "--json")
    assert result.exit_code == 1
    doc = parsed(result)
    assert doc["format"] == "savepoint-run" and doc["version"] == 1
    assert doc["error"]["type"] == "RunProblems" and doc["verified"] is False
    assert any("step 4 does not verify" in p for p in doc["problems"])


def test_json_stays_clean_with_a_progress_bar(
    world: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_common, "PROGRESS_DELAY", 0.0)
    result = invoke("verify", str(world["ckpt"]), "--json", "--progress")
    assert result.exit_code == 0
    parsed(result)
    assert "verifying" in result.stderr  # the bar went to stderr


def _documented() -> dict[str, list[dict[str, Any]]]:
    """The JSON examples of docs/cli.md, by the command section ("### name") they are in."""
    text = DOCS.read_text(encoding="utf-8")
    out: dict[str, list[dict[str, Any]]] = {}
    section = ""
    for block in re.split(r"(^### \w+$)", text, flags=re.M):
        if block.startswith("### "):
            section = block[4:].strip()
            continue
        for raw in re.findall(r"```json\n(.*?)```", block, flags=re.S):
            out.setdefault(section, []).append(json.loads(raw))
    return out


def test_docs_show_one_example_per_command_with_the_shared_keys() -> None:
    examples = _documented()
    assert set(main.commands) <= set(examples), set(main.commands) - set(examples)
    for name, docs in examples.items():
        for doc in docs:
            assert list(doc)[:4] == HEAD, (name, list(doc))
            assert doc["savepoint_cli"] == 1
            if name:
                assert doc["command"] == name
    assert "error" in examples[""][0]  # the error object, before the command sections


def test_documented_keys_match_what_commands_print(world: dict[str, Path]) -> None:
    """Every key a documented example shows is printed by the command (and vice versa, apart
    from optional ones), so docs/cli.md cannot drift from the code."""
    examples = _documented()
    optional = {"plot", "notes", "world_size", "verify_failures", "tied_to", "shards"}
    printed: dict[tuple[str, str], set[str]] = {}
    for argv, fmt, _ in commands(world):
        doc = json.loads(invoke(*argv, "--json").stdout)
        printed.setdefault((argv[0], fmt), set()).update(doc)
    for name, docs in examples.items():
        for doc in docs:
            if not name:
                continue
            keys = printed[(name, doc["format"])]
            assert set(doc) - optional <= keys, (name, set(doc) - keys)
            assert keys - optional <= set(doc), (name, keys - set(doc))
