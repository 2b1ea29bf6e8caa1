"""savepoint under torch.distributed.checkpoint: SavepointWriter / SavepointReader.

Saved by 2 gloo ranks (DTensors sharded on dim 0, a replicated tensor, a non-tensor value),
loaded by 1 and by 4 ranks through both savepoint's reader and DCP's own FileSystemReader of
the same state saved by FileSystemWriter: bit-exact, and the same on both. A rank that fails
leaves no checkpoint; SIGKILLs during dcp.save never leave a half-written one.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

import savepoint as sp  # noqa: E402
from _torture import campaign  # noqa: E402
from savepoint.integrations.dcp import SavepointReader, SavepointWriter  # noqa: E402

WORKER = Path(__file__).with_name("_dcp_worker.py")
# DCP warns that it saves in one process when no process group is set up: that is the intent here.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(phase: str, world: int, workdir: Path, timeout: float = 120) -> dict[int, Any]:
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), phase, str(r), str(world), str(port), str(workdir)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    outputs = []
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            p.kill()
            outputs.append(p.communicate()[0])
    results = {}
    for r in range(world):
        path = workdir / f"{phase}-rank{r}.json"
        assert path.exists(), f"rank {r} wrote nothing:\n{outputs[r]}"
        results[r] = json.loads(path.read_text())
        bad = {k: v for k, v in results[r]["checks"].items() if v != "ok"}
        if phase != "fail":
            assert not bad, f"rank {r}: {bad}\n{outputs[r]}"
    return results


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    workdir = tmp_path_factory.mktemp("dcp")
    run_ranks("save", 2, workdir)
    return workdir


@pytest.mark.parametrize("world", [1, 4])
def test_saved_on_2_ranks_loads_on_1_and_4_bit_exact_like_dcps_own(saved: Path, world: int) -> None:
    run_ranks("load", world, saved)


def test_the_checkpoint_is_a_savepoint_checkpoint(saved: Path) -> None:
    info = sp.verify(saved / "sp")
    assert info.format_version == 3 and info.world_size == 2
    assert info.metadata["dcp"]["version"] == 1
    out = sp.load(saved / "sp")
    w = torch.arange(16 * 12, dtype=torch.float32).reshape(16, 12) / 7
    assert torch.equal(out["model.w"], w)
    assert set(out) >= {"model.w", "model.v", "r", "step"}
    names = sorted(os.listdir(saved / "sp"))
    assert names == [
        "data-r00000-00000.safetensors",
        "data-r00001-00000.safetensors",
        "manifest.json",
    ]


def test_a_failing_rank_commits_nothing(tmp_path: Path) -> None:
    results = run_ranks("fail", 2, tmp_path)
    for r in (0, 1):
        assert results[r]["checks"]["raised"] == "ok", results[r]
    assert "complex32" in results[1]["error"] or "complex32" in results[0]["error"]
    with pytest.raises(sp.CheckpointNotFoundError):
        sp.load(tmp_path / "failed")


def test_one_process_round_trip_and_checkpoint_id(tmp_path: Path) -> None:
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "opt": opt.state_dict(), "epoch": 3}
    dcp.save(state, checkpoint_id=str(tmp_path / "c"), storage_writer=SavepointWriter())
    fresh = torch.nn.Linear(8, 4)
    fresh_opt = torch.optim.Adam(fresh.parameters())
    fresh(torch.randn(2, 8)).sum().backward()
    fresh_opt.step()
    back = {"model": fresh.state_dict(), "opt": fresh_opt.state_dict(), "epoch": 0}
    dcp.load(back, checkpoint_id=str(tmp_path / "c"), storage_reader=SavepointReader())
    for k, v in state["model"].items():
        assert torch.equal(back["model"][k], v)
    moments = state["opt"]["state"][0]
    assert torch.equal(back["opt"]["state"][0]["exp_avg"], moments["exp_avg"])
    assert back["epoch"] == 3


def test_a_damaged_chunk_is_refused(tmp_path: Path) -> None:
    state = {"w": torch.randn(64, 64)}
    dcp.save(state, storage_writer=SavepointWriter(tmp_path / "c"))
    data = tmp_path / "c" / "data-r00000-00000.safetensors"
    raw = bytearray(data.read_bytes())
    raw[-5] ^= 1
    data.write_bytes(bytes(raw))
    # DCP wraps every rank's error in its CheckpointException (a BaseException), message kept
    with pytest.raises(BaseException) as info:
        dcp.load({"w": torch.zeros(64, 64)}, storage_reader=SavepointReader(tmp_path / "c"))
    assert "checksum mismatch in tensor 'w'" in str(info.value)


def test_object_store_urls(tmp_path: Path) -> None:
    state = {"w": torch.randn(300, 300), "n": 5}
    dcp.save(state, storage_writer=SavepointWriter("memory://dcp-test/c"))
    back = {"w": torch.zeros(300, 300), "n": 0}
    dcp.load(back, storage_reader=SavepointReader("memory://dcp-test/c"))
    assert torch.equal(back["w"], state["w"]) and back["n"] == 5


def test_sigkill_during_dcp_save_leaves_old_or_new(tmp_path: Path) -> None:
    """SIGKILL a process saving in a loop at random moments: the checkpoint at the path is always
    one whole save (every element equal to one save's counter), never half-written."""
    rng = random.Random(1)
    trials = campaign(3, 6)  # make torture: 6 * SAVEPOINT_TORTURE_SCALE
    seen: set[int] = set()
    marker = tmp_path / "saved"
    for trial in range(trials):
        marker.unlink(missing_ok=True)
        proc = subprocess.Popen(
            [sys.executable, str(WORKER), "loop", "0", "1", "0", str(tmp_path)],
            env=dict(os.environ, PYTHONWARNINGS="ignore"),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 60
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)  # saves are under way once one has committed
        time.sleep(rng.random() * 0.4)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        back = {"w": torch.zeros(256, 1024), "v": torch.zeros(7)}
        dcp.load(back, storage_reader=SavepointReader(tmp_path / "sp"))
        value = float(back["w"][0, 0])
        assert torch.all(back["w"] == value) and torch.all(back["v"] == value), trial
        seen.add(int(value))
        sp.verify(tmp_path / "sp")
    assert seen, "no save ever committed"
