"""A hostile look at a version 7 restore from peer memory (:mod:`savepoint.runs._peer_indexes`: only
the indexes a load reads, and the second pass every rank joins where a rank's prediction failed),
across real processes as in ``test_peers_grid.py``.

One save session (4 ranks as nodes a, a, b, b; steps 1 and 2, both kept) is copied for each test:

- node a lost, on 2 ranks: a peer that stops answering while the indexes are fetched, then while
  the second pass is (one rank's prediction failed), is named within the deadline and every rank
  loads the run directory's copy; the second pass alone; a data file, then an index, that only
  the rank fetching the second pass reads damaged on every copy: the run directory, named; the
  run directory's copy damaged too: the sharded load refuses it and step 1 is restored;
- node b lost, on 2 ranks (rank 1 on a new node, the only one that needs the second pass):
  step 2's part 1 on node a missing, then a copy of step 1's part 1 relabelled as step 2's (its
  marker rewritten to match: it verifies against itself), then of its data files alone (which
  only the loader's checksums refuse: that used to raise DistributedCheckpointError out of
  ``restore``) restores step 1 whole, never a mix; the same relabelled data of part 0 received
  straight into rank 0's targets is refused as it lands (checked against step 2's checksums,
  not only the marker): step 1 restored whole;
- one rank (node b's memory): no rank to exchange with, every index read.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from distributed import _launch

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():  # pragma: no cover
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

from savepoint.codecs import checksum  # noqa: E402
from savepoint.codecs import manifest as mf  # noqa: E402

from .test_peers_ranks import data, node_folder  # noqa: E402

WORKER = Path(__file__).with_name("_peers_worker.py")
TIMEOUT = 2.0
ENV = {
    "PEERS_NODES": "a,a,b,b",
    "PEERS_TIMEOUT": str(TIMEOUT),
    "PEERS_STEPS": "1,2",
    "PEERS_BUDGET": str(1 << 30),  # (both steps kept)
    "PEERS_GRID": "1",
    "PEERS_NO_FLAT": "1",
    "PEERS_STRAIGHT": "0",
}
STEP1, STEP2 = "step-0000000001", "step-0000000002"


def run(scenario: str, world: int, workdir: Path, **env: str) -> _launch.Session:
    session = _launch.run(scenario, world, workdir, worker=WORKER, env={**ENV, **env}, timeout=120)
    assert not session.failures(), session.failures()
    return session


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    workdir = tmp_path_factory.mktemp("peers-hostile")
    for outcome in data(run("save", 4, workdir), "outcome"):
        assert outcome["step"] == 2 and outcome["complete"], outcome
    for node in "ab":
        assert {STEP1, STEP2} <= {p.name for p in node_folder(workdir, node).iterdir()}
    return workdir


@pytest.fixture
def copy(saved: Path, tmp_path: Path) -> Path:
    workdir = tmp_path / "w"
    shutil.copytree(saved, workdir)
    for stale in workdir.glob("*-rank*.json"):
        stale.unlink()
    return workdir


def _rep(workdir: Path) -> int:
    """The part whose index holds the replicated tensor."""
    disk = workdir / "run/checkpoints" / STEP2
    (rep,) = [
        p
        for p in range(4)
        if "model/rep" in json.loads((disk / mf.index_name(p)).read_bytes())["shards"]
    ]
    return rep


def _named(restored: dict[str, Any], *words: str) -> None:
    assert (restored["step"], restored["from"]) == (2, "run directory"), restored
    (warning,) = restored["warnings"]
    assert all(w in warning for w in words), (words, warning)


def test_stalls_and_damage_around_the_second_pass_fall_back_named_on_2_ranks(copy: Path) -> None:
    # node a lost: rank 0 fetches everything from node b (rank 1 serves); rank 1 reads rows 6-12
    # (parts 2, 3) and rep's index. Part ``only`` (0 or 1, not rep's) only rank 0 reads.
    only = 1 - _rep(copy) if _rep(copy) < 2 else 1
    shutil.rmtree(node_folder(copy, "a"))
    held = node_folder(copy, "b") / STEP2 / f"part-{only:05d}"
    (data_file,) = held.glob(f"data-r{only:05d}-*")
    plan = [
        {"label": "stall indexes", "stall": [1, "indexes"]},
        {"label": "stall again", "stall": [1, "files-again"], "guess_none": 0},
        {"label": "again", "guess_none": 0},
        {"label": "bare", "bare": 0},  # (rank 0 restores ``step`` alone: no index, no file)
        {"label": "bare again", "bare": 1, "guess_none": 0},
        {"label": "damaged data", "guess_none": 0, "damage": [str(data_file)]},
        {"label": "damaged index", "guess_none": 0, "damage": [str(held / mf.index_name(only))]},
        {"label": "disk too", "damage": [str(copy / "run/checkpoints" / STEP2 / data_file.name)]},
    ]
    session = run("hostile", 2, copy, PEERS_NODES="a,b", PEERS_PLAN=json.dumps(plan))
    slow = 3 * TIMEOUT + 10  # the deadline, the agreement, the run directory's load
    for restored in data(session, "stall indexes"):
        _named(restored, "rank 1 (node b)", f"within {TIMEOUT:g} s")
        assert "files" not in restored["phases"] and restored["seconds"] < slow, restored
    for restored in data(session, "stall again"):
        _named(restored, "rank 1 (node b)", f"within {TIMEOUT:g} s")
        assert restored["phases"][-1] == "files-again" and restored["seconds"] < slow, restored
    for restored in data(session, "again"):  # (every rank joins it; bit-exact: compared)
        assert (restored["step"], restored["from"], restored["warnings"]) == (2, "peer memory", [])
        assert restored["phases"] == ["manifest", "indexes", "files", "files-again"], restored
    for label, bare in (("bare", 0), ("bare again", 1)):  # a rank that reads no index
        for rank, restored in enumerate(data(session, label)):
            assert (restored["step"], restored["from"], restored["warnings"]) == (
                2,
                "peer memory",
                [],
            )
            assert (restored["indexes"] == []) == (rank == bare), (label, rank, restored)
    for restored in data(session, "damaged data"):  # found in the second pass only
        _named(restored, f"no verified copy left of {data_file.name}")
        assert restored["phases"][-1] == "files-again", restored
    for restored in data(session, "damaged index"):  # fetched in place of rank 0's files
        _named(restored, f"no verified copy left of {mf.index_name(only)}")
        assert restored["phases"][-1] == "files", restored
    for restored in data(session, "disk too"):  # the run directory's step 2 refused by the
        # sharded load's checksums (it used to raise DistributedCheckpointError): step 1
        assert (restored["step"], restored["from"]) == (1, "peer memory"), restored
        peer, disk = restored["warnings"]
        assert "(peer memory) could not be restored" in peer, peer
        assert "(run directory) failed verification" in disk and data_file.name in disk, disk


def _relabelled(workdir: Path, part: int, index: bool) -> Path:
    """Node b's copy of step 2's ``part`` with step 1's data files (node a's; ``index``: and its
    index), its marker rewritten to match them: a copy that verifies against its own marker."""
    forged = workdir / f"forged-{part}-{index}"
    shutil.copytree(node_folder(workdir, "b") / STEP2 / f"part-{part:05d}", forged)
    old = node_folder(workdir, "a") / STEP1 / f"part-{part:05d}"
    marker = json.loads((forged / "part.json").read_text())
    names = [p.name for p in old.glob("data-*")] + ([mf.index_name(part)] if index else [])
    for name in names:
        raw = (old / name).read_bytes()
        (forged / name).write_bytes(raw)
        marker["files"][name] = [len(raw), checksum.digest(raw)]
    (forged / "part.json").write_text(json.dumps(marker))
    return forged


def test_mixed_generations_restore_one_whole_step_on_ranks_that_disagree_on_again(
    copy: Path,
) -> None:
    # node b lost (no rank on it); the run directory empty: peer memory alone. Rank 1 on a new
    # node (c) predicts no index: it alone needs the second pass, which rank 0 joins.
    forged, data_only = _relabelled(copy, 1, True), _relabelled(copy, 1, False)
    straight = _relabelled(copy, 0, False)  # (part 0: rows 0-3 alone, received straight)
    shutil.rmtree(copy / "run/checkpoints")
    (copy / "run/checkpoints").mkdir()
    part1 = node_folder(copy, "a") / STEP2 / "part-00001"
    shutil.copytree(part1, copy / "genuine")
    shutil.rmtree(part1)  # step 2's part 1 held by node b alone
    part0 = node_folder(copy, "a") / STEP2 / "part-00000"
    plan = [
        {"label": "incomplete", "guess_none": 1},
        {"label": "relabelled", "guess_none": 1, "replace": [[str(forged), str(part1)]]},
        {"label": "relabelled data", "guess_none": 1, "replace": [[str(data_only), str(part1)]]},
        {  # (last: a mixed restore fails the scenario on that rank)
            "label": "relabelled straight",
            "straight": True,
            "replace": [[str(copy / "genuine"), str(part1)], [str(straight), str(part0)]],
        },
    ]
    env = {**ENV, "PEERS_NODES": "a,c", "PEERS_PLAN": json.dumps(plan)}
    session = _launch.run("hostile", 2, copy, worker=WORKER, env=env, timeout=120)
    assert not session.failures(), session.failures()
    for restored in data(session, "incomplete"):  # (bit-exact: the worker compared step 1's)
        assert (restored["step"], restored["from"], restored["warnings"]) == (1, "peer memory", [])
        assert restored["phases"][-1] == "files-again", restored
    for restored in data(session, "relabelled"):
        # step 2's part 1 on node a now verifies against its marker, not against step 2's
        # manifest: set aside, step 2 has no copy of it left, and step 1 is restored whole
        assert (restored["step"], restored["from"]) == (1, "peer memory"), restored
        (warning,) = restored["warnings"]
        assert "checkpoint 2" in warning and "index-r00001.json" in warning, warning
    for restored in data(session, "relabelled data"):
        # step 2's own index, step 1's data (the marker vouches for it): the loader's checksums
        # refuse it on every rank, and step 1 is restored whole
        assert (restored["step"], restored["from"]) == (1, "peer memory"), restored
        (warning,) = restored["warnings"]
        assert "checkpoint 2" in warning and "data-r00001" in warning, warning
    for restored in data(session, "relabelled straight"):
        # the bytes received straight into rank 0's targets match the copy's marker but not
        # step 2's checksums (checked as they land): refused, and step 1 restored whole
        assert (restored["step"], restored["from"]) == (1, "peer memory"), restored


def test_one_rank_restores_from_its_nodes_memory_alone(copy: Path) -> None:
    shutil.rmtree(copy / "run/checkpoints" / STEP2)
    session = run("hostile", 1, copy, PEERS_NODES="b", PEERS_PLAN='[{"label": "one"}]')
    (restored,) = data(session, "one")  # (bit-exact: compared)
    assert (restored["step"], restored["from"], restored["warnings"]) == (2, "peer memory", [])
    assert sorted(restored["indexes"]) == [mf.index_name(p) for p in range(4)], restored
