"""The peer-memory tier across real processes: gloo groups on 127.0.0.1, nodes simulated by groups
of ranks (``SAVEPOINT_NODE``), each node's memory a folder of the test's (docs/peers.md).

One save session (4 ranks as nodes a, a, b, b; steps 1 to 3) is copied for each test, which then
loses, damages or stalls what the issue names and restarts new processes:

- node a lost (its folder wiped) and step 3 gone from the run directory: restored bit-exactly
  from node b's copies on 4 ranks, on 2 (resharding) and on 6 (a new node c);
- a damaged copy is detected and the other copy fetched; every copy damaged: the run directory;
- a rank whose sends stop answering is named within the deadline, and the restore falls back to
  the run directory;
- SIGKILL of every rank at a random moment while steps are being replicated: the restore takes
  a complete step whole, never parts of two (a bounded number of kills in ``make test``, more
  under ``SAVEPOINT_TORTURE``: tests/_torture.py).

Each state is rebuilt from its step in ``_peers_worker.py``, so every restore is compared exactly
with what that step saved.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from _torture import campaign
from distributed import _launch

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():  # pragma: no cover
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

WORKER = Path(__file__).with_name("_peers_worker.py")
TIMEOUT = 2.0  # the tier's: seconds a rank showing no sign of life is waited for
ENV = {"PEERS_NODES": "a,a,b,b", "PEERS_TIMEOUT": str(TIMEOUT), "PEERS_STEPS": "1,2,3"}


def run(scenario: str, world: int, workdir: Path, **env: str) -> _launch.Session:
    session = _launch.run(scenario, world, workdir, worker=WORKER, env={**ENV, **env}, timeout=120)
    assert not session.failures(), session.failures()
    return session


def data(session: _launch.Session, key: str) -> list[Any]:
    return [session.results[r]["data"][key] for r in range(session.world)]


def node_folder(workdir: Path, node: str) -> Path:
    (run_id,) = os.listdir(workdir / "mem")
    return workdir / "mem" / run_id / node


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Steps 1-3 saved on 4 ranks (nodes a, a, b, b) and replicated: each node holds a copy of
    every part of step 3 (its own and the other node's), and nothing older."""
    workdir = tmp_path_factory.mktemp("peers-saved")
    session = run("save", 4, workdir)
    for outcome in data(session, "outcome"):
        assert outcome["step"] == 3 and outcome["complete"], outcome
        assert {int(p): sorted(n) for p, n in outcome["copies"].items()} == {
            p: ["a", "b"] for p in range(4)
        }
    for node in ("a", "b"):
        assert sorted(os.listdir(node_folder(workdir, node))) == ["node.json", "step-0000000003"]
    return workdir


@pytest.fixture
def copy(saved: Path, tmp_path: Path) -> Path:
    workdir = tmp_path / "w"
    shutil.copytree(saved, workdir)
    for stale in workdir.glob("*-rank*.json"):
        stale.unlink()
    return workdir


def test_a_lost_node_is_restored_from_the_other_nodes_copies_on_4_2_and_6_ranks(
    copy: Path,
) -> None:
    shutil.rmtree(node_folder(copy, "a"))  # node a lost: its memory with it
    shutil.rmtree(copy / "run/checkpoints/step-0000000003")  # only peer memory has step 3
    for nodes in ("a,a,b,b", "a,b", "a,a,b,b,c,c"):
        world = len(nodes.split(","))
        session = run("restore", world, copy, PEERS_NODES=nodes)
        for restored in data(session, "restored"):
            # (bit-exact: the worker compared every element with step 3's state)
            assert (restored["step"], restored["from"]) == (3, "peer memory"), restored
            assert not restored["warnings"], restored


def test_keys_an_earlier_attempt_left_in_the_store_are_not_read(copy: Path) -> None:
    """torchrun keeps its store across elastic restarts: the restarted job must not read the
    addresses the killed attempt published (dead ports), only its own."""
    shutil.rmtree(node_folder(copy, "a"))
    shutil.rmtree(copy / "run/checkpoints/step-0000000003")
    session = run("restore", 4, copy, PEERS_STALE="1")
    for restored in data(session, "restored"):
        assert (restored["step"], restored["from"]) == (3, "peer memory"), restored
        assert not restored["warnings"], restored


def test_a_lost_node_is_restored_straight_into_the_targets_on_4_2_and_6_ranks(
    tmp_path: Path,
) -> None:
    # rows a DTensor-like Shard(0) (a regular state): saved as manifest version 7, each part's
    # index file replicated with it (tests/runs/test_peers_grid.py)
    env = {"PEERS_NO_FLAT": "1", "PEERS_STEPS": "1", "PEERS_TIMEOUT": "30", "PEERS_GRID": "1"}
    saved = run("save", 4, tmp_path, **env)
    for outcome in data(saved, "outcome"):
        assert outcome["step"] == 1 and outcome["complete"], outcome
    on_disk = tmp_path / "run/checkpoints/step-0000000001"
    assert json.loads((on_disk / "manifest.json").read_bytes())["format_version"] == 7
    shutil.rmtree(node_folder(tmp_path, "a"))
    shutil.rmtree(tmp_path / "run/checkpoints/step-0000000001")  # only peer memory has it
    for nodes, straight in (("a,a,b,b", {2}), ("a,b", {2}), ("a,a,b,b,c,c", {0, 1})):
        session = run("restore", len(nodes.split(",")), tmp_path, PEERS_NODES=nodes, **env)
        for restored in data(session, "restored"):  # (bit-exact: the worker compared them)
            assert (restored["step"], restored["from"]) == (1, "peer memory"), restored
        # rows and rep; on 6 ranks a rank's rows are part of a stored shard (the loader's, and
        # so is rep where it shares that shard's file)
        assert {r["straight"] for r in data(session, "restored")} == straight, nodes


def test_a_damaged_copy_is_detected_and_the_next_source_used(copy: Path) -> None:
    part2 = "step-0000000003/part-00002/data-r00002-00000.safetensors"
    damage = [[str(node_folder(copy, "b") / part2)], [str(node_folder(copy, "a") / part2)]]
    session = run("corrupt", 4, copy, PEERS_DAMAGE=json.dumps(damage))
    for one in data(session, "one copy damaged"):  # node b's copy: node a's is fetched
        assert (one["step"], one["from"], one["warnings"]) == (3, "peer memory", []), one
    for every in data(session, "every copy damaged"):  # the run directory's then
        assert (every["step"], every["from"]) == (3, "run directory"), every
        (warning,) = every["warnings"]
        assert "no verified copy left of data-r00002-00000.safetensors" in warning, warning


def test_a_peer_that_stops_answering_is_named_and_the_run_directory_used(copy: Path) -> None:
    shutil.rmtree(node_folder(copy, "a"))  # ranks 0 and 1 must fetch from node b: rank 2 hangs
    session = run("stall", 4, copy, PEERS_STALL="2")
    for restored in data(session, "restored"):
        assert (restored["step"], restored["from"]) == (3, "run directory"), restored
        (warning,) = restored["warnings"]
        assert "rank 2 (node b)" in warning and f"within {TIMEOUT:g} s" in warning, warning
        # the deadline, the agreement, and the load from the run directory
        assert restored["seconds"] < 3 * TIMEOUT + 10, restored


def test_bytes_damaged_on_the_wire_are_refused_and_the_senders_copy_still_verifies(
    tmp_path: Path,
) -> None:
    session = run("garble", 2, tmp_path, PEERS_NODES="a,b", PEERS_TIMEOUT="30")
    first, second = data(session, "error"), data(session, "copies")
    for error in first:
        assert error is not None and "does not match its manifest's checksums" in error, error
    for copies in second:  # part 0's copy on node b was refused; its own on node a kept
        assert copies == {"0": ["a"], "1": ["a", "b"]}, copies
    for bad in data(session, "bad"):
        assert bad and all(problems == [] for problems in bad.values()), bad
    for then in data(session, "then"):
        assert then == [2, True, [0, 1]], then


def test_fetched_bytes_land_in_the_targets_and_a_byte_damaged_on_the_wire_is_refused(
    tmp_path: Path,
) -> None:
    env = {"PEERS_NODES": "a,b", "PEERS_STEPS": "1", "PEERS_NO_FLAT": "1", "PEERS_TIMEOUT": "30"}
    run("save", 2, tmp_path, **env)
    shutil.rmtree(node_folder(tmp_path, "a"))  # rank 0 fetches every file it needs from b
    session = run("garble_restore", 2, tmp_path, **env)
    # (each restore was compared element by element with step 1's state by the worker)
    assert data(session, "into targets")[0] is True  # rank 0 received straight into them
    for clean in data(session, "clean"):
        assert (clean["step"], clean["from"], clean["warnings"]) == (1, "peer memory", []), clean
    for garbled in data(session, "garbled"):  # refused: the run directory's copy is loaded
        assert (garbled["step"], garbled["from"]) == (1, "run directory"), garbled
        (warning,) = garbled["warnings"]
        assert "does not match its checkpoint's checksums" in warning, warning


def test_a_damaged_copy_of_a_file_landing_in_the_targets_is_fetched_from_the_other_node(
    tmp_path: Path,
) -> None:
    env = {"PEERS_NODES": "a,b", "PEERS_STEPS": "1", "PEERS_NO_FLAT": "1", "PEERS_TIMEOUT": "30"}
    run("save", 2, tmp_path, **env)
    part0 = "step-0000000001/part-00000/data-r00000-00000.safetensors"
    damage = [[str(node_folder(tmp_path, "a") / part0)], [str(node_folder(tmp_path, "b") / part0)]]
    session = run("corrupt", 2, tmp_path, PEERS_DAMAGE=json.dumps(damage), **env)
    for one in data(session, "one copy damaged"):  # node a's: rank 0 gets node b's
        assert (one["step"], one["from"], one["warnings"]) == (1, "peer memory", []), one
    for every in data(session, "every copy damaged"):
        assert (every["step"], every["from"]) == (1, "run directory"), every
        (warning,) = every["warnings"]
        assert "no verified copy left of data-r00000-00000.safetensors" in warning, warning


def churn_and_kill(workdir: Path, rng: random.Random) -> None:
    """Start ``churn`` (a save and its replication after another) on 4 ranks; once step 1 is
    replicated, SIGKILL every rank at a random moment."""
    port = _launch.free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **ENV)
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), "churn", str(r), "4", str(port), str(workdir)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for r in range(4)
    ]
    try:
        deadline = time.monotonic() + 120
        while not (workdir / "replicated-1").exists():
            assert time.monotonic() < deadline, "step 1 was never replicated"
            assert all(p.poll() is None for p in procs), "a rank exited"
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 1.5))
    finally:
        for p in procs:
            p.send_signal(signal.SIGKILL)
        for p in procs:
            p.wait()


@pytest.mark.parametrize("seed", range(campaign(1, 10)))
def test_a_kill_during_replication_never_restores_a_mixed_checkpoint(
    tmp_path: Path, seed: int
) -> None:
    rng = random.Random(seed)
    churn_and_kill(tmp_path, rng)
    replicated = max(int(p.name.split("-")[1]) for p in tmp_path.glob("replicated-*"))
    shutil.rmtree(tmp_path / "run/checkpoints")  # only peer memory is left to restore from
    (tmp_path / "run/checkpoints").mkdir()
    session = run("restore", 4, tmp_path)
    for restored in data(session, "restored"):
        # One step, whole (the worker compared every part with that step's state), from
        # memory; at least the last step known replicated.
        assert restored["from"] == "peer memory", restored
        assert restored["step"] >= replicated, (restored, replicated)
