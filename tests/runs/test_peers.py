"""The peer-memory tier in one process (docs/peers.md): its arguments, the ring of copies, the
eviction rule, a node folder's commits and checks, and a manager that keeps its checkpoints in
its node's memory (saves sync and async, incremental, preemption, restore, budget, ``ls``).

Across processes and nodes: ``test_peers_ranks.py``.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

import savepoint as sp
from _support import run_doc_snippets
from savepoint.cli import main
from savepoint.commit import names
from savepoint.errors import CheckpointWriteError, CorruptCheckpointError
from savepoint.runs import _peer_replicate
from savepoint.runs._peer_folder import NodeFolder, PartRecord, evictions, hash_file
from savepoint.runs._peer_replicate import Replication, fewer_copies, ring
from savepoint.runs.peers import NODE_ENV, PeerMemory, PeerTier, usage

# -- the tier's arguments ------------------------------------------------------------------------


def test_tier_peers_takes_the_issues_arguments_and_checks_them() -> None:
    tier = sp.Tier.peers(replicas=2, node="n1", memory_dir=Path("/tmp/m"), budget=1 << 20)
    assert tier == PeerTier(replicas=2, node="n1", memory_dir="/tmp/m", budget=1 << 20)
    assert sp.Tier.peers() == PeerTier(1, None, None, None)
    for bad, error in [
        ({"replicas": -1}, ValueError),
        ({"replicas": 1.5}, TypeError),
        ({"replicas": True}, TypeError),
        ({"node": ""}, ValueError),
        ({"node": "a/b"}, ValueError),
        ({"node": ".hidden"}, ValueError),
        ({"memory_dir": 3}, TypeError),
        ({"budget": 0}, ValueError),
        ({"budget": 2.5}, ValueError),
        ({"timeout": 0}, ValueError),
        ({"timeout": "1"}, TypeError),
    ]:
        with pytest.raises(error):
            sp.Tier.peers(**bad)


def test_a_memory_dir_that_is_a_url_or_a_file_is_refused_at_once(tmp_path: Path) -> None:
    """Not at the first replication, after the save (a URL made a local folder named 's3:')."""
    (tmp_path / "file").write_bytes(b"x")
    for where, message in [("s3://b/m", "not the URL"), (tmp_path / "file", "is a file")]:
        with pytest.raises(sp.CheckpointArgumentError, match=message):
            sp.Tier.peers(memory_dir=where)
    assert not Path("s3:").exists()


def test_the_node_is_the_argument_else_the_environment_else_the_host(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import socket

    monkeypatch.delenv(NODE_ENV, raising=False)
    assert sp.Tier.peers().node_name() == socket.gethostname()
    monkeypatch.setenv(NODE_ENV, "rack7-host3")
    assert sp.Tier.peers().node_name() == "rack7-host3"
    assert sp.Tier.peers(node="mine").node_name() == "mine"
    monkeypatch.setenv(NODE_ENV, "../x")
    with pytest.raises(ValueError, match=NODE_ENV):
        sp.Tier.peers().node_name()


def test_a_manager_takes_one_peer_tier_among_its_tiers(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="more than one"):
        sp.CheckpointManager(tmp_path / "r", tiers=[sp.Tier.peers(), sp.Tier.peers(node="x")])
    with pytest.raises(TypeError, match=r"list of sp\.Tier"):
        sp.CheckpointManager(tmp_path / "r", tiers=sp.Tier.peers())


# -- where copies go, what is evicted ------------------------------------------------------------


def test_the_ring_sends_each_part_to_the_next_nodes_never_its_own() -> None:
    # 4 ranks on 2 nodes: each rank's part goes to the rank at its index on the other node.
    assert ring(["a", "a", "b", "b"], 1) == [[2], [3], [0], [1]]
    # 6 ranks on 3 nodes, 2 replicas: the next two nodes.
    assert ring(["a", "a", "b", "b", "c", "c"], 2) == [
        [2, 4], [3, 5], [4, 0], [5, 1], [0, 2], [1, 3]
    ]  # fmt: skip
    # More replicas than other nodes: one per other node; a single node: none.
    assert ring(["a", "b"], 5) == [[1], [0]]
    assert ring(["a", "a"], 1) == [[], []]
    assert ring(["a"], 0) == [[]]
    # Uneven nodes: the index wraps on the smaller node.
    assert ring(["a", "a", "a", "b"], 1) == [[3], [3], [3], [0]]


def test_fewer_nodes_than_replicas_is_said_once_not_silent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """All ranks on one machine (one node) with the default replicas=1: no copy leaves the node."""
    assert fewer_copies(["a", "a", "b", "b"], 1) is None
    assert "gets 1 copies" in (fewer_copies(["a", "b"], 2) or "")
    monkeypatch.setattr(_peer_replicate, "_WARNED", set())
    with caplog.at_level("WARNING", logger="savepoint.runs.peers"), _manager(tmp_path) as mgr:
        mgr.save(1, _state(1))
        mgr.save(2, _state(2))
        mgr.wait()
    said = [r.getMessage() for r in caplog.records if "replicas=1" in r.getMessage()]
    assert len(said) == 1 and "on 1 node(s): each part gets 0 copies" in said[0], said


def test_eviction_takes_the_oldest_first_and_never_the_anchor_or_newer() -> None:
    sizes = {1: 10, 2: 10, 3: 10, 4: 10}
    assert evictions(sizes, None, 3) == [1, 2]  # no budget: only the newest complete and after
    assert evictions(sizes, None, None) == [1, 2, 3]  # none known complete: the newest stands in
    assert evictions(sizes, 35, 4) == [1]
    assert evictions(sizes, 35, 4, incoming=10) == [1, 2]
    assert evictions(sizes, 15, 3, incoming=10) == [1, 2]  # step 3 stays, over budget or not
    assert evictions(sizes, 100, 4) == []
    assert evictions({}, 10, None) == []


# -- a node's folder -----------------------------------------------------------------------------


def _copy(
    folder: NodeFolder, step: int, part: int, payload: bytes, digest: str = "0123456789abcdef"
) -> PartRecord:
    staging = folder.staging()
    files = {}
    for name, data in (("manifest.json", b"{}"), (f"data-r{part:05d}-00000.safetensors", payload)):
        Path(staging, name).write_bytes(data)
        files[name] = hash_file(os.path.join(staging, name))
    record = PartRecord(step, part, 2, digest, files, folder.node)
    folder.commit(staging, record)
    return record


def test_a_folder_commits_whole_copies_and_verifies_them(tmp_path: Path) -> None:
    folder = NodeFolder(str(tmp_path / "n"), "n")
    record = _copy(folder, 5, 1, b"x" * 1000)
    assert folder.parts() == {5: {1: record}}
    assert folder.step_bytes() == {5: 1002}
    data = "data-r00001-00000.safetensors"
    assert folder.verify(record, [data, "manifest.json"]) == []
    with open(os.path.join(folder.path(5, 1), data), "r+b") as f:
        f.write(b"y")  # one byte damaged
    (problem,) = folder.verify(record, [data])
    assert problem.startswith(data) and "its marker" in problem
    # A newer copy of the same part replaces it whole.
    again = _copy(folder, 5, 1, b"z" * 10)
    assert folder.parts() == {5: {1: again}} and folder.verify(again, [data]) == []


def test_a_folder_ignores_what_is_not_a_committed_copy_and_tidies_the_dead(
    tmp_path: Path,
) -> None:
    folder = NodeFolder(str(tmp_path / "n"), "n")
    _copy(folder, 3, 0, b"a")
    os.makedirs(folder.path(4, 0))  # no marker (a copy is renamed in with its marker: whatever
    Path(folder.path(4, 1)).mkdir()  # holds none, or not one of ours, is no copy)
    Path(folder.path(4, 1), "part.json").write_text('{"format": "something else"}')
    assert sorted(folder.parts()) == [3]
    # A staging folder of a dead process goes; a live process's stays.
    dead = Path(folder.root, f".copy{names.TMP_TAG}{names.HOST}-999999999-abcd1234")
    dead.mkdir()
    live = Path(folder.staging())
    folder.clean()
    assert not dead.exists() and live.exists()
    folder.evict([3, 4])
    assert folder.parts() == {} and folder.steps() == []


# -- a manager ------------------------------------------------------------------------------------


def _state(step: int) -> dict[str, Any]:
    return {"w": np.arange(4096, dtype=np.float32) * step, "b": np.full(7, step), "step": step}


def _empty() -> dict[str, Any]:
    return {"w": np.zeros(4096, np.float32), "b": np.zeros(7, np.int64), "step": -1}


def _check(state: dict[str, Any], step: int) -> None:
    want = _state(step)
    assert state["step"] == step
    assert np.array_equal(state["w"], want["w"]) and np.array_equal(state["b"], want["b"])


def _manager(tmp_path: Path, **kwargs: Any) -> sp.CheckpointManager:
    tier = sp.Tier.peers(node="n0", memory_dir=tmp_path / "mem", budget=kwargs.pop("budget", None))
    return sp.CheckpointManager(tmp_path / "run", name="r", tiers=[tier], **kwargs)


def _node(tmp_path: Path) -> NodeFolder:
    (run_id,) = os.listdir(tmp_path / "mem")
    return NodeFolder(str(tmp_path / "mem" / run_id / "n0"), "n0")


def _damage(path: str) -> None:
    """Flip the last byte of the file at ``path`` in a new file put in its place (the node's copy
    may be a hard link to the run directory's file, which must stay intact)."""
    data = bytearray(Path(path).read_bytes())
    data[-1] ^= 0xFF
    Path(path + ".new").write_bytes(data)
    os.replace(path + ".new", path)


def _lose_the_run_directorys_checkpoints(tmp_path: Path) -> None:
    shutil.rmtree(tmp_path / "run" / "checkpoints")
    (tmp_path / "run" / "checkpoints").mkdir()


def test_a_run_keeps_its_newest_step_in_memory_and_restores_from_it(tmp_path: Path) -> None:
    with _manager(tmp_path) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, _state(step))
        mgr.wait()
    node = _node(tmp_path)
    assert sorted(node.parts()) == [3]  # no budget: only the newest complete step
    _lose_the_run_directorys_checkpoints(tmp_path)
    with _manager(tmp_path) as mgr:
        state = _empty()
        assert mgr.restore(state) == 3 and mgr.restored_from == "peer memory"
        _check(state, 3)
        assert mgr.peek("step") == {"step": 3}  # a peek reads what it needs, from memory too
        assert mgr.restore(_empty(), step=3, resume=False) == 3


def test_async_saves_are_replicated_too(tmp_path: Path) -> None:
    with _manager(tmp_path, async_save=True) as mgr:
        for step in (1, 2):
            mgr.save(step, _state(step))
    assert sorted(_node(tmp_path).parts()) == [2]
    _lose_the_run_directorys_checkpoints(tmp_path)
    with _manager(tmp_path) as mgr:
        state = _empty()
        assert mgr.restore(state) == 2 and mgr.restored_from == "peer memory"
        _check(state, 2)


def test_an_incremental_run_keeps_whole_copies_with_their_blobs(tmp_path: Path) -> None:
    with _manager(tmp_path, incremental=True) as mgr:
        for step in (1, 2):
            mgr.save(step, {**_state(1), "big": np.arange(1 << 18, dtype=np.float32) + step})
    (copy,) = _node(tmp_path).parts()[2].values()
    assert any(name.startswith("blobs/") for name in copy.files), copy.files
    shutil.rmtree(tmp_path / "run" / "blobs")  # neither the checkpoints nor their blobs left
    _lose_the_run_directorys_checkpoints(tmp_path)
    with _manager(tmp_path, incremental=True) as mgr:
        state = {**_empty(), "big": np.zeros(1 << 18, np.float32)}
        assert mgr.restore(state) == 2 and mgr.restored_from == "peer memory"
        assert np.array_equal(state["big"], np.arange(1 << 18, dtype=np.float32) + 2)


def test_a_damaged_copy_is_not_restored_the_run_directory_is(tmp_path: Path) -> None:
    with _manager(tmp_path) as mgr:
        mgr.save(1, _state(1))
    (copy,) = _node(tmp_path).parts()[1].values()
    data = next(n for n in copy.files if n.startswith("data-"))
    _damage(os.path.join(_node(tmp_path).path(1, 0), data))
    with _manager(tmp_path) as mgr:
        state = _empty()
        with pytest.warns(UserWarning, match="could not be restored") as caught:
            assert mgr.restore(state) == 1
        assert mgr.restored_from == "run directory"
        assert "no verified copy left" in str(caught[0].message)
        _check(state, 1)


def test_a_budget_keeps_the_newest_steps_that_fit_and_ls_shows_them(tmp_path: Path) -> None:
    with _manager(tmp_path) as mgr:  # (one step's size, measured)
        mgr.save(1, _state(1))
    one = _node(tmp_path).step_bytes()[1]
    shutil.rmtree(tmp_path / "mem")
    shutil.rmtree(tmp_path / "run")
    budget = 2 * one + one // 2
    with _manager(tmp_path, budget=budget) as mgr:
        for step in (1, 2, 3, 4):
            mgr.save(step, _state(step))
    node = _node(tmp_path)
    assert node.step_bytes() == {3: one, 4: one}
    (run_id,) = os.listdir(tmp_path / "mem")
    (found,) = usage(str(tmp_path / "mem"), run_id)
    assert found == {
        "node": "n0",
        "budget": budget,
        "bytes": 2 * one,
        "steps": [{"step": 3, "parts": [0], "bytes": one}, {"step": 4, "parts": [0], "bytes": one}],
    }
    mem = str(tmp_path / "mem")
    result = CliRunner().invoke(main, ["ls", str(tmp_path / "run"), "--peer-memory", mem, "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["peer_memory"] == {"dir": mem, "nodes": [found]}
    text = CliRunner().invoke(main, ["ls", str(tmp_path / "run"), "--peer-memory", mem]).output
    assert f"peer memory ({mem}):" in text and "n0" in text
    assert [line.split()[:3] for line in text.splitlines() if line.startswith(" ")] == [
        ["3", "1", "(#0)"],
        ["4", "1", "(#0)"],
    ]  # how many parts, then which: a bare "0" read as none


def test_a_budget_too_small_for_a_step_keeps_none_and_says_so(tmp_path: Path) -> None:
    with _manager(tmp_path, budget=100) as mgr:
        mgr.save(1, _state(1))
        with pytest.raises(CheckpointWriteError, match="budget of 100 bytes"):
            mgr.wait()
    assert _node(tmp_path).parts() == {}


def test_a_preemption_save_lands_in_peer_memory(tmp_path: Path) -> None:
    tier = sp.Tier(tmp_path / "tier", name="disk")
    peers = sp.Tier.peers(node="n0", memory_dir=tmp_path / "mem")
    with sp.CheckpointManager(tmp_path / "run", tiers=[tier, peers]) as mgr:
        mgr.save(1, _state(1))
        saved = mgr.save_on_preemption(2, _state(2))
    assert saved.copied_to == ("peer memory", "disk"), saved
    assert sorted(_node(tmp_path).parts()) == [2]


def test_damaged_markers_and_files_raise_nothing_but_cost_their_copy(tmp_path: Path) -> None:
    folder = NodeFolder(str(tmp_path / "n"), "n")
    record = _copy(folder, 7, 0, b"q" * 10)
    Path(folder.path(7, 0), "part.json").write_text("{not json")
    assert folder.parts() == {}
    with pytest.raises(CorruptCheckpointError):
        PartRecord.from_json({**record.to_json(), "files": {"../x": [1, "0" * 16]}}, "t")
    with pytest.raises(CorruptCheckpointError):
        PartRecord.from_json({**record.to_json(), "part": 5}, "t")  # outside its world


def test_a_step_is_complete_only_with_every_part_of_one_save(tmp_path: Path) -> None:
    """Parts of two saves of one step (a step saved again after a resume) never make a
    checkpoint: completeness counts the parts sharing one manifest digest."""
    memory = PeerMemory(sp.Tier.peers(node="n", memory_dir=tmp_path / "mem"), None, "run-id")
    folder = memory.ready()
    for part in (0, 1):
        _copy(folder, 4, part, b"four")
    _copy(folder, 5, 0, b"five", digest="aaaaaaaaaaaaaaaa")
    _copy(folder, 5, 1, b"five", digest="bbbbbbbbbbbbbbbb")
    _copy(folder, 6, 0, b"six")  # part 1 of step 6 is nowhere
    assert memory.survey() == {4}


def test_retention_keeps_a_step_until_its_replication_has_read_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = threading.Event()
    run = Replication.run

    def slow(self: Replication, step: int, source: Any) -> Any:
        if step == 1:
            assert gate.wait(30)
        return run(self, step, source)

    monkeypatch.setattr(Replication, "run", slow)
    with _manager(tmp_path, keep_last=1) as mgr:
        mgr.save(1, _state(1))
        mgr.save(2, _state(2))
        assert mgr.steps() == [1, 2]  # retention wanted 1 gone: its replication still reads it
        gate.set()
        mgr.wait()
        mgr.save(3, _state(3))
        assert mgr.steps() == [3]
    assert sorted(_node(tmp_path).parts()) == [3]


def test_on_one_file_system_the_nodes_copy_is_a_link_to_the_run_directorys(
    tmp_path: Path,
) -> None:
    with _manager(tmp_path) as mgr:
        mgr.save(1, _state(1))
    (copy,) = _node(tmp_path).parts()[1].values()
    data = next(n for n in copy.files if n.startswith("data-"))
    run_file = tmp_path / "run" / "checkpoints" / "step-0000000001" / data
    node_file = Path(_node(tmp_path).path(1, 0), data)
    assert os.stat(run_file).st_ino == os.stat(node_file).st_ino


def test_a_failed_restore_from_memory_writes_nothing_into_the_targets(tmp_path: Path) -> None:
    with _manager(tmp_path) as mgr:
        mgr.save(1, _state(1))
    _lose_the_run_directorys_checkpoints(tmp_path)
    (copy,) = _node(tmp_path).parts()[1].values()
    data = next(n for n in copy.files if n.startswith("data-"))
    _damage(os.path.join(_node(tmp_path).path(1, 0), data))
    with _manager(tmp_path) as mgr:
        state = _empty()
        warned = pytest.warns(UserWarning, match="could not be restored")
        with warned, pytest.raises(CorruptCheckpointError, match="no intact"):
            mgr.restore(state)
        assert state["step"] == -1 and not state["w"].any() and not state["b"].any()


def test_the_peers_doc_snippets_run(tmp_path: Path) -> None:
    run_doc_snippets(Path(__file__).parents[2] / "docs" / "peers.md", tmp_path)


def test_a_resumed_run_leaves_no_step_of_its_abandoned_timeline_in_memory(tmp_path: Path) -> None:
    with _manager(tmp_path, budget=1 << 30) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, _state(step))
    with _manager(tmp_path, budget=1 << 30) as mgr:
        assert mgr.restore(_empty(), step=1) == 1  # the run goes on from step 1
        mgr.save(2, _state(20))  # a new step 2: the old 2 and 3 are another timeline
        mgr.wait()
    assert sorted(_node(tmp_path).parts()) == [1, 2]
    _lose_the_run_directorys_checkpoints(tmp_path)
    with _manager(tmp_path) as mgr:
        state = _empty()
        assert mgr.restore(state) == 2 and mgr.restored_from == "peer memory"
        assert np.array_equal(state["w"], _state(20)["w"])


def test_the_wire_listens_where_the_store_is_reached_unless_told(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from savepoint.runs import _peer_wire

    monkeypatch.setattr(_peer_wire, "_store_host", lambda: None)
    monkeypatch.delenv(_peer_wire.ADDR_ENV, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "localhost")
    assert _peer_wire._advertised_host() == "127.0.0.1"
    monkeypatch.setenv(_peer_wire.ADDR_ENV, "10.1.2.3")
    assert _peer_wire._advertised_host() == "10.1.2.3"
