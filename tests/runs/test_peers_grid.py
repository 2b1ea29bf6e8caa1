"""The peer-memory tier with manifest version 7 (a regular state's sharded save: every rank's pieces
in its index file ``index-r<rank>.json``), across real processes: gloo groups on 127.0.0.1, nodes
simulated by groups of ranks (``SAVEPOINT_NODE``), as in ``test_peers_ranks.py``.

One save session (4 ranks as nodes a, a, b, b; a DTensor-like ``Shard(0)`` state and a replicated
tensor: a regular state) is copied for each test:

- the manager saves version 7 (no ``grid=False`` of its own), and every copy of a part holds its
  rank's index, byte for byte, which ``savepoint ls``'s accounting counts;
- node a lost and the step gone from the run directory: restored bit-exactly through the loader
  on 4, 2 and 3 ranks (resharding; ``test_peers_ranks.py`` restores the same kind of state straight into
  the targets on 4, 2 and 6);
- a damaged copy of an index is detected and the other node's copy used; every copy damaged: the
  run directory, the warning naming the index;
- a copy whose index and marker agree with each other but not with the manifest is not used;
- an index damaged between its check and its send keeps no copy of its part;
- a restore fetches only the indexes its load reads (on 4, 2 and 3 ranks), every other one too
  where its plan asks for one it did not fetch; a damaged index no rank reads fails nothing.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from distributed import _launch

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():  # pragma: no cover
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

from savepoint.codecs import checksum  # noqa: E402
from savepoint.codecs import manifest as mf  # noqa: E402
from savepoint.distributed import FlatShard  # noqa: E402
from savepoint.runs import _peer_check, _peer_grid, peers  # noqa: E402

from .test_peers_ranks import data, node_folder  # noqa: E402  (the same sessions' helpers)

WORKER = Path(__file__).with_name("_peers_worker.py")
ENV = {
    "PEERS_NODES": "a,a,b,b",
    "PEERS_TIMEOUT": "30",
    "PEERS_STEPS": "1",
    "PEERS_GRID": "1",  # rows a DTensor-like Shard(0) on a 1-d mesh
    "PEERS_NO_FLAT": "1",  # (no FlatShard: the state is regular, saved as version 7)
    "PEERS_STRAIGHT": "0",  # through the loader (test_peers_ranks.py: straight into targets)
}
STEP = "step-0000000001"
INDEX2 = f"{STEP}/part-00002/index-r00002.json"


def run(scenario: str, world: int, workdir: Path, **env: str) -> _launch.Session:
    session = _launch.run(scenario, world, workdir, worker=WORKER, env={**ENV, **env}, timeout=120)
    assert not session.failures(), session.failures()
    return session


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    workdir = tmp_path_factory.mktemp("peers-grid")
    for outcome in data(run("save", 4, workdir), "outcome"):
        assert outcome["step"] == 1 and outcome["complete"], outcome
    return workdir


@pytest.fixture
def copy(saved: Path, tmp_path: Path) -> Path:
    workdir = tmp_path / "w"
    shutil.copytree(saved, workdir)
    for stale in workdir.glob("*-rank*.json"):
        stale.unlink()
    return workdir


def test_a_regular_state_is_saved_as_version_7_and_each_copy_holds_its_ranks_index(
    saved: Path,
) -> None:
    disk = saved / "run/checkpoints" / STEP
    raw = (disk / mf.NAME).read_bytes()
    assert json.loads(raw)["format_version"] == mf.GRID  # (the manager no longer asks grid=False)
    manifest = mf.parse(raw, read_index=lambda name, size: (disk / name).read_bytes())
    assert sorted(manifest.indices or {}) == [mf.index_name(r) for r in range(4)]
    grid = _peer_grid.head(raw)
    assert grid is not None and grid.indices == manifest.indices
    for node in ("a", "b"):
        usage = {
            n["node"]: n
            for n in peers.usage(str(saved / "mem"), node_folder(saved, node).parent.name)
        }
        (step,) = usage[node]["steps"]
        held = 0
        for part in range(4):
            folder = node_folder(saved, node) / STEP / f"part-{part:05d}"
            index = mf.index_name(part)
            names = sorted(p.name for p in folder.iterdir())
            data_files = sorted(n for n in manifest.files if n.startswith(f"data-r{part:05d}-"))
            assert names == sorted([mf.NAME, index, "part.json", *data_files]), names
            assert (folder / index).read_bytes() == (disk / index).read_bytes()
            marker = json.loads((folder / "part.json").read_text())
            record = manifest.indices[index]  # type: ignore[index]
            assert marker["files"][index] == [record.size, record.xxh3]
            held += sum((folder / n).stat().st_size for n in names if n != "part.json")
            # a receiver checked each data file against its rank's index alone, as a parsed
            # manifest gives them (the sender did not hash it)
            units = grid.units((disk / index).read_bytes())
            for name in data_files:
                assert units(name) == _peer_check.units(manifest, name) is not None
        # savepoint ls: every byte a node holds, the indexes and manifests included
        assert step["bytes"] == held == usage[node]["bytes"], (node, step, held)


def _indexes(saved: Path) -> tuple[dict[str, tuple[int, int]], int]:
    """Each index's rows of ``rows`` (read from the files themselves), and the part whose index
    holds ``rep``."""
    disk = saved / "run/checkpoints" / STEP
    rows, rep = {}, -1
    for part in range(4):
        shards = json.loads((disk / mf.index_name(part)).read_bytes())["shards"]
        for shard in shards.get("model/rows", ()):
            rows[mf.index_name(part)] = (shard["box"][0][0], shard["box"][0][1])
        rep = part if "model/rep" in shards else rep
    assert len(rows) == 4 and rep >= 0, (rows, rep)
    return rows, rep


def test_a_lost_node_is_restored_through_the_loader_fetching_only_the_indexes_it_reads(
    saved: Path, copy: Path
) -> None:
    # 4 ranks onto 4, 2 (resharding) and 3: each rank fetches (or links from its own node's
    # copies) the indexes of the pieces its targets meet and the replicated tensor's, no other
    rows, rep = _indexes(saved)
    shutil.rmtree(node_folder(copy, "a"))  # node a lost: its memory with it
    shutil.rmtree(copy / "run/checkpoints" / STEP)  # only peer memory has the step
    for nodes in ("a,a,b,b", "a,b", "a,b,c"):
        world = len(nodes.split(","))
        session = run("restore", world, copy, PEERS_NODES=nodes)
        for rank, restored in enumerate(data(session, "restored")):  # (bit-exact: compared)
            assert (restored["step"], restored["from"]) == (1, "peer memory"), restored
            assert not restored["warnings"] and restored["straight"] == 0, restored
            lo, hi = FlatShard.bounds(12, rank, world)
            meet = {name for name, (a, b) in rows.items() if a < hi and lo < b}
            want = sorted(meet | {mf.index_name(rep)})
            assert sorted(restored["indexes"]) == want, (nodes, rank, restored)
            assert len(restored["indexes"]) == len(set(restored["indexes"])), restored


def test_a_plan_asking_for_an_index_not_fetched_fetches_every_other_then_its_files(
    saved: Path, copy: Path
) -> None:
    # rank 0 fetches no index first (as if the grid's writer rule failed): its plan asks for
    # one, so it fetches every index in place of its files (over the wire: node a's memory
    # lost), then its files in a second pass that rank 1 joins
    rows, rep = _indexes(saved)
    shutil.rmtree(node_folder(copy, "a"))
    shutil.rmtree(copy / "run/checkpoints" / STEP)
    session = run("restore", 2, copy, PEERS_NODES="a,b", PEERS_GUESS_NONE="0")
    first, second = data(session, "restored")  # (bit-exact: compared)
    for restored in (first, second):
        assert (restored["step"], restored["from"]) == (1, "peer memory"), restored
        assert not restored["warnings"], restored
    assert first["indexes"] == [mf.index_name(p) for p in range(4)], first
    want = {name for name, (a, b) in rows.items() if b > 6} | {mf.index_name(rep)}
    assert sorted(second["indexes"]) == sorted(want), second


def test_only_a_damaged_index_that_a_restore_reads_fails_it(saved: Path, copy: Path) -> None:
    # the replicated tensor alone restored on 2 ranks: it reads the index holding it, so every
    # copy of another index damaged does not fail it; every copy of that one damaged does
    _, rep = _indexes(saved)
    paths = [
        [str(node_folder(copy, node) / f"{STEP}/part-{p:05d}/{mf.index_name(p)}") for node in "ab"]
        for p in ((rep + 1) % 4, rep)
    ]
    damage = json.dumps(paths)
    session = run("corrupt", 2, copy, PEERS_NODES="a,b", PEERS_KEYS="rep", PEERS_DAMAGE=damage)
    for one in data(session, "one copy damaged"):  # (every copy of another index)
        assert (one["step"], one["from"], one["warnings"]) == (1, "peer memory", []), one
        assert one["indexes"] == [mf.index_name(rep)], one
    for every in data(session, "every copy damaged"):  # (and of ``rep``'s): the run directory
        assert (every["step"], every["from"]) == (1, "run directory"), every
        (warning,) = every["warnings"]
        assert f"no verified copy left of {mf.index_name(rep)}" in warning, warning


def test_a_damaged_copy_of_an_index_is_detected_and_the_next_source_used(copy: Path) -> None:
    damage = [[str(node_folder(copy, "b") / INDEX2)], [str(node_folder(copy, "a") / INDEX2)]]
    session = run("corrupt", 4, copy, PEERS_DAMAGE=json.dumps(damage))
    for one in data(session, "one copy damaged"):  # node b's: node a's is fetched
        assert (one["step"], one["from"], one["warnings"]) == (1, "peer memory", []), one
    for every in data(session, "every copy damaged"):  # the run directory's then
        assert (every["step"], every["from"]) == (1, "run directory"), every
        (warning,) = every["warnings"]
        assert "no verified copy left of index-r00002.json" in warning, warning


def test_a_copy_whose_index_and_marker_disagree_with_the_manifest_is_not_used(copy: Path) -> None:
    # node b's copy of part 2: another index, its marker rewritten to match it (the copy verifies
    # against its marker, not against the manifest)
    index = node_folder(copy, "b") / INDEX2
    doc = json.loads(index.read_bytes())
    index.write_bytes(json.dumps(doc, indent=1).encode())  # (the same pieces, other bytes)
    marker_path = index.parent / "part.json"
    marker = json.loads(marker_path.read_text())
    marker["files"][index.name] = [index.stat().st_size, checksum.digest(index.read_bytes())]
    marker_path.write_text(json.dumps(marker))
    damage = [[], [str(node_folder(copy, "a") / INDEX2)]]
    session = run("corrupt", 4, copy, PEERS_DAMAGE=json.dumps(damage))
    for one in data(session, "one copy damaged"):  # set aside: node a's is fetched
        assert (one["step"], one["from"], one["warnings"]) == (1, "peer memory", []), one
    for every in data(session, "every copy damaged"):
        assert (every["step"], every["from"]) == (1, "run directory"), every
        (warning,) = every["warnings"]
        assert "no verified copy left of index-r00002.json" in warning, warning


def test_an_index_damaged_after_its_check_keeps_no_copy_of_its_part(tmp_path: Path) -> None:
    session = run("garble_index", 2, tmp_path, PEERS_NODES="a,b")
    for error, complete, copies in data(session, "step 1"):
        # node b refused the bytes (not the manifest's record of the index), node a's own copy
        # was not committed either (what it wrote is what it sent)
        assert error is not None and "index-r00000.json" in error and not complete, error
        assert copies == {"1": ["a", "b"]}, copies
    for error, complete, copies in data(session, "step 2"):
        assert (error, complete, copies) == (None, True, {"0": ["a", "b"], "1": ["a", "b"]})
