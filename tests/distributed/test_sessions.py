"""Sharded saves and loads across real processes: gloo process groups on 127.0.0.1.

Sessions (each a set of processes running one scenario of ``_worker.py``):

- ``main2``: 2 ranks save every strategy (replicated, tensor parallel along dims 0 and 1, FSDP
  flat ranges, ZeRO-partitioned entries, DTensors on a 2-rank mesh); load 2 -> 2 into DTensors
  and into Shards, 2 -> 1, whole; the manager; a background save; failures on one rank;
- ``main4`` (after ``main2``): 4 ranks save; 3 of them (a subgroup) save too; loads 4 -> 4,
  2 -> 4, 4 -> 3, 2 -> 3, 4 -> 2, 3 -> 2, 4 -> 1, 3 -> 1;
- ``kill``: 3 ranks, rank 1 dies in the middle of a save;
- ``hang``: 2 ranks, rank 1 stops answering in the middle of a save.

Every load is compared exactly with what was saved; the checkpoints are then checked here, in
one process, without the original topology: bytes on disk, whole loads, verify, inspect,
consolidate.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

import savepoint as sp

from . import _launch

pytestmark = pytest.mark.distributed

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():  # pragma: no cover
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

MAIN2 = {
    "save 2",
    "load 2->2 dtensor",
    "load 2->2 shards",
    "load 2->1",
    "load whole with group",
    "module with DTensor parameters",
    "manager sync",
    "manager with a tier",
    "background save",
    "rank raising mid-save",
    "key missing on one rank",
    "dtype differs between ranks",
    "overlapping shards",
    "load mismatch on one rank",
}
MAIN4 = {
    0: {
        "save 4",
        "load 4->4 dtensor",
        "load 2->4 dtensor",
        "save 3",
        "load 4->3",
        "load 2->3",
        "load 4->2",
        "load 3->2",
        "load 4->1",
        "load 3->1",
    },
    1: {
        "save 4",
        "load 4->4 dtensor",
        "load 2->4 dtensor",
        "save 3",
        "load 4->3",
        "load 2->3",
        "load 4->2",
        "load 3->2",
    },
    2: {"save 4", "load 4->4 dtensor", "load 2->4 dtensor", "save 3", "load 4->3", "load 2->3"},
    3: {"save 4", "load 4->4 dtensor", "load 2->4 dtensor"},
}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("sharded")


@pytest.fixture(scope="module")
def main_sessions(workdir: Path) -> dict[str, _launch.Session]:
    first = _launch.run("main2", 2, workdir)
    second = _launch.run("main4", 4, workdir)
    return {"main2": first, "main4": second}


def test_two_ranks(main_sessions: dict[str, _launch.Session]) -> None:
    s = main_sessions["main2"]
    assert s.returncodes == {0: 0, 1: 0}, s.failures()
    for rank in (0, 1):
        assert set(s.results[rank]["checks"]) == MAIN2, s.failures()
    assert all(v == "ok" for v in s.checks().values()), s.failures()


def test_four_ranks_and_subgroups(main_sessions: dict[str, _launch.Session]) -> None:
    s = main_sessions["main4"]
    assert set(s.returncodes.values()) == {0}, s.failures()
    for rank, expected in MAIN4.items():
        assert set(s.results[rank]["checks"]) == expected, s.failures()
    assert all(v == "ok" for v in s.checks().values()), s.failures()


def test_failures_reach_every_rank_with_one_message(
    main_sessions: dict[str, _launch.Session],
) -> None:
    data = [main_sessions["main2"].results[r]["data"] for r in (0, 1)]
    for key, words in [
        ("raising", ["failed on rank 1 of 2", "RuntimeError: injected write failure"]),
        ("missing key", ["failed on rank 1 of 2", "model/rep: missing on rank 1"]),
    ]:
        messages = {d[key]["message"] for d in data}
        assert len(messages) == 1, messages  # the same error on both ranks
        (message,) = messages
        for w in words:
            assert w in message


def _global() -> dict[str, Any]:
    from ._worker import global_tensors

    return global_tensors()


def _unique_bytes() -> int:
    g = _global()
    tensors = [v for k, v in g.items() if k != "zero"] + list(g["zero"].values())
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("name", ["ckpt2", "ckpt3", "ckpt4"])
def test_bytes_on_disk_are_the_unique_bytes(
    main_sessions: dict[str, _launch.Session], workdir: Path, name: str
) -> None:
    manifest = json.loads((workdir / name / "manifest.json").read_text())
    assert manifest["format_version"] == 3
    assert manifest["world_size"] == int(name[-1])
    data = sum(f["size"] - f["header_size"] for f in manifest["files"].values())
    assert data == _unique_bytes()
    # Replicated tensors are written once, whatever the world size.
    for key in ("model/rep", "model/rep_bf16", "model/scalar"):
        assert len(manifest["tensors"][key]["shards"]) == 1
    # Each rank wrote its own files.
    ranks = {int(f.split("-")[1][1:]) for f in manifest["files"]}
    assert ranks <= set(range(manifest["world_size"]))
    files = sorted(p.name for p in (workdir / name).iterdir())
    assert files == sorted([*manifest["files"], "manifest.json"])


@pytest.mark.parametrize("name", ["ckpt2", "ckpt3", "ckpt4"])
def test_one_process_reads_the_whole_tensors(
    main_sessions: dict[str, _launch.Session], workdir: Path, name: str
) -> None:
    g = _global()
    tree = sp.load(workdir / name)
    for key in ("rep", "rep_bf16", "scalar", "tp0", "tp1", "fsdp", "dt0", "dt1"):
        got = tree["model"][key]
        assert isinstance(got, torch.Tensor) and torch.equal(got, g[key]), key
    assert set(tree["optim"]) == set(g["zero"])
    for k, t in g["zero"].items():
        assert torch.equal(tree["optim"][k], t)
    assert tree["step"] == 100 and tree["name"] == "test-run"
    # numpy too, and into existing whole tensors.
    flat = sp.load(workdir / name, framework="numpy", keys="model/tp1")
    assert (flat["model"]["tp1"] == g["tp1"].numpy()).all()
    into = {"model": {"tp0": torch.zeros(10, 6), "fsdp": torch.zeros(7, 5).t()}}
    sp.load(workdir / name, into=into)
    assert torch.equal(into["model"]["tp0"], g["tp0"])
    assert torch.equal(into["model"]["fsdp"], g["fsdp"])


@pytest.mark.parametrize("name", ["ckpt2", "ckpt4"])
def test_verify_inspect_and_consolidate_without_the_topology(
    main_sessions: dict[str, _launch.Session], workdir: Path, tmp_path: Path, name: str
) -> None:
    from click.testing import CliRunner

    from savepoint.cli import main

    info = sp.verify(workdir / name)
    assert info.world_size == int(name[-1]) and info.format_version == 3
    assert info.total_bytes == _unique_bytes()
    by_key = {t.key: t for t in sp.inspect(workdir / name).tensors}
    assert by_key["model/tp0"].shape == (10, 6) and by_key["model/tp0"].shards > 1
    assert by_key["model/rep"].shards == 1
    assert info.to_dict()["world_size"] == int(name[-1])

    out = tmp_path / "whole"
    result = CliRunner().invoke(main, ["consolidate", str(workdir / name), str(out)])
    assert result.exit_code == 0, result.output
    consolidated = sp.verify(out)
    assert consolidated.format_version == 1 and consolidated.world_size is None
    assert math.isclose(consolidated.total_bytes, _unique_bytes())
    g = _global()
    tree = sp.load(out)
    assert torch.equal(tree["model"]["tp1"], g["tp1"])
    assert torch.equal(tree["optim"]["p3"], g["zero"]["p3"])
    assert sp.inspect(out).metadata == sp.inspect(workdir / name).metadata


def test_a_rank_killed_mid_save(tmp_path: Path) -> None:
    s = _launch.run("kill", 3, tmp_path)
    assert s.returncodes[1] == 17, s.output[1]  # rank 1 died as planned
    for rank in (0, 2):
        assert s.results[rank]["checks"] == {
            "previous save": "ok",
            "rank killed mid-save": "ok",
        }, s.failures()
        assert s.results[rank]["data"]["killed"]["elapsed"] < 20
    _previous_is_intact(tmp_path)


def test_a_rank_hanging_mid_save(tmp_path: Path) -> None:
    s = _launch.run("hang", 2, tmp_path, done_when=[0])
    assert s.results[0]["checks"] == {"previous save": "ok", "rank hanging mid-save": "ok"}, (
        s.failures()
    )
    elapsed = s.results[0]["data"]["hung"]["elapsed"]
    assert 3.5 < elapsed < 10, elapsed  # the 4 s timeout, not a hang
    _previous_is_intact(tmp_path)


def _previous_is_intact(directory: Path) -> None:
    """No new manifest was committed, the previous checkpoint verifies, no staging is left."""
    assert sorted(p.name for p in directory.iterdir() if not p.name.endswith(".json")) == ["ckpt"]
    sp.verify(directory / "ckpt")
    tree = sp.load(directory / "ckpt")
    assert torch.equal(tree["model"]["tp0"], _global()["tp0"])


def test_two_ranks_on_an_object_store(
    tmp_path: Path, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sharded save, loads on other world sizes, a managed run and a failing rank, with the
    checkpoints in an S3 bucket (moto on loopback) instead of a shared filesystem."""
    monkeypatch.setenv("SAVEPOINT_TEST_S3_ROOT", f"s3://{s3_bucket}/sessions")
    s = _launch.run("s3", 2, tmp_path, timeout=240)
    for rank in range(2):
        assert rank in s.results, s.failures()
        assert all(v == "ok" for v in s.results[rank]["checks"].values()), s.failures()
        assert len(s.results[rank]["checks"]) == 8, s.results[rank]["checks"]
    # Checked again from this process, without the topology.
    tree = sp.load(f"s3://{s3_bucket}/sessions/ckpt")
    assert torch.equal(tree["model"]["tp0"], _global()["tp0"])
    assert sp.verify(f"s3://{s3_bucket}/sessions/ckpt").world_size == 2


def test_continuous_policy_ranks_agree(tmp_path: Path) -> None:
    """Two gloo ranks whose clocks run at different paces save the same steps with
    sp.policies.Continuous (one all-reduce per question), never below either's minimum."""
    session = _launch.run("continuous", 2, tmp_path, timeout=90)
    assert not session.failures(), session.failures()
    saved = [session.results[r]["data"]["saved"] for r in range(2)]
    assert saved[0] == saved[1] and len(saved[0]) >= 3
    assert session.results[0]["data"]["steps"] == saved[0]
