"""Sharded checkpoints within one process (no process group): descriptions, loads into Shard
targets, checksums per shard, consolidation, and what stays true for unsharded checkpoints.

``save_ranks`` writes a checkpoint as N ranks would (the same describe / merge / write / manifest
steps the distributed save runs), all in this process, so the load paths are tested fast.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import savepoint as sp
from savepoint.codecs import manifest as mf
from savepoint.distributed import FlatShard, Partitioned, Shard, manifests, plan
from savepoint.distributed import save as dsave
from savepoint.state import tree

W = np.arange(10 * 6, dtype=np.float32).reshape(10, 6)
F = np.arange(5 * 7, dtype=np.float64).reshape(5, 7) / 7
R = np.arange(12, dtype=np.int16).reshape(3, 4)
Z = {f"p{i}": np.full((i + 1, 2), i, dtype=np.float32) for i in range(4)}


def rank_state(rank: int, world: int) -> dict[str, Any]:
    a, b = FlatShard.bounds(10, rank, world)
    fa, fb = FlatShard.bounds(F.size, rank, world)
    ca, cb = FlatShard.bounds(6, rank, world)
    return {
        "rows": Shard.split(W[a:b].copy(), 0, rank, world, size=10),
        "cols": Shard(W[:, ca:cb].copy(), W.shape, (0, ca)),
        "flat": FlatShard(F.reshape(-1)[fa:fb].copy(), F.shape, fa),
        "rep": R.copy(),
        "opt": Partitioned(
            {k: v.copy() for i, (k, v) in enumerate(Z.items()) if i % world == rank}
        ),
        "step": 7,
    }


def empty_state(rank: int, world: int) -> dict[str, Any]:
    st = rank_state(rank, world)
    for key in ("rows", "cols", "flat"):
        st[key].local[...] = 0
    st["rep"] = np.zeros_like(R)
    st["opt"] = Partitioned({k: np.zeros_like(v) for k, v in st["opt"].mapping.items()})
    st["step"] = 0
    return st


def check(st: dict[str, Any], rank: int, world: int) -> None:
    want = rank_state(rank, world)
    for key in ("rows", "cols", "flat"):
        np.testing.assert_array_equal(st[key].local, want[key].local)
    np.testing.assert_array_equal(st["rep"], R)
    assert set(st["opt"].mapping) == set(want["opt"].mapping)
    for k, v in st["opt"].mapping.items():
        np.testing.assert_array_equal(v, Z[k])
    assert st["step"] == 7


def save_ranks(path: Path, states: list[Any], max_file_bytes: int = 1 << 30) -> None:
    """What ``sp.save(path, state, process_group=pg)`` on len(states) ranks writes."""
    target = str(path)
    described = [dsave.describe(tree.flatten(s), target) for s in states]
    merged = plan.merge([d[0] for d in described])
    staging = path.parent / f".{path.name}.staging"
    staging.mkdir()
    results = [
        dsave.write_pieces(
            target,
            str(staging),
            r,
            merged.writes[r],
            d[1],
            max_file_bytes=max_file_bytes,
            writers=1,
        )
        for r, d in enumerate(described)
    ]
    raw = mf.dumps(manifests.manifest(merged, results, {"note": "ranks"}, len(states)))
    assert mf.parse(raw).world_size == len(states)  # what readers accept
    (staging / "manifest.json").write_bytes(raw)
    os.rename(staging, path)


@pytest.fixture
def sharded(tmp_path: Path) -> Path:
    path = tmp_path / "ckpt3"
    save_ranks(path, [rank_state(r, 3) for r in range(3)])
    return path


def test_import_never_imports_torch(tmp_path: Path) -> None:
    code = (
        "import sys, numpy as np, savepoint as sp, savepoint.distributed as d\n"
        "from savepoint.distributed import consolidate, load, plan, save, shard\n"
        f"sp.save({str(tmp_path / 'c')!r}, {{'w': d.Shard(np.ones((2, 3)), (2, 3), (0, 0))}})\n"
        f"t = {{'w': d.Shard(np.zeros((1, 3)), (2, 3), (1, 0))}}\n"
        f"sp.load({str(tmp_path / 'c')!r}, into=t)\n"
        "assert (t['w'].local == 1).all()\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_layout_on_disk(sharded: Path) -> None:
    manifest = json.loads((sharded / "manifest.json").read_text())
    assert manifest["format_version"] == 3 and manifest["world_size"] == 3
    assert sorted(manifest["files"]) == [f"data-r0000{r}-00000.safetensors" for r in range(3)]
    shards = manifest["tensors"]["rows"]["shards"]
    assert [s["box"] for s in shards] == [[[0, 4], [0, 6]], [[4, 8], [0, 6]], [[8, 10], [0, 6]]]
    assert [s["flat"] for s in manifest["tensors"]["flat"]["shards"]] == [
        [0, 12],
        [12, 24],
        [24, 35],
    ]
    assert len(manifest["tensors"]["rep"]["shards"]) == 1  # replicated: written once
    data = sum(f["size"] - f["header_size"] for f in manifest["files"].values())
    assert data == W.nbytes * 2 + F.nbytes + R.nbytes + sum(v.nbytes for v in Z.values())
    # each data file is an ordinary safetensors file holding this rank's pieces
    from safetensors.numpy import load_file

    pieces = load_file(str(sharded / "data-r00001-00000.safetensors"))
    np.testing.assert_array_equal(pieces["rows@4,0"], W[4:8])
    np.testing.assert_array_equal(pieces["flat@12"], F.reshape(-1)[12:24])


def test_whole_load_and_metadata(sharded: Path) -> None:
    out = sp.load(sharded)
    np.testing.assert_array_equal(out["rows"], W)
    np.testing.assert_array_equal(out["cols"], W)
    np.testing.assert_array_equal(out["flat"], F)
    np.testing.assert_array_equal(out["rep"], R)
    assert {k: v.tolist() for k, v in out["opt"].items()} == {k: v.tolist() for k, v in Z.items()}
    assert out["step"] == 7
    shared = sp.load(sharded, mmap=True)
    np.testing.assert_array_equal(shared["rows"], W)
    np.testing.assert_array_equal(shared["rep"], R)
    picked = sp.load(sharded, keys=["cols", "opt/p2"])
    assert set(picked) == {"cols", "opt"} and set(picked["opt"]) == {"p2"}
    info = sp.inspect(sharded)
    assert info.world_size == 3 and info.metadata == {"note": "ranks"}
    files = {t.key: t.file for t in info.tensors}
    assert files["rows"] == "3 shards" and files["rep"].startswith("data-r")


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_reshard_into_any_layout(sharded: Path, world: int) -> None:
    for rank in range(world):
        st = empty_state(rank, world)
        assert sp.load(sharded, into=st) is st
        check(st, rank, world)


def test_progress_counts_the_bytes_of_the_targets(sharded: Path) -> None:
    seen: list[tuple[int, int]] = []
    st = empty_state(1, 2)
    sp.load(sharded, into=st, progress=lambda done, total: seen.append((done, total)))
    total = st["rows"].local.nbytes + st["cols"].local.nbytes + st["flat"].local.nbytes + R.nbytes
    total += sum(v.nbytes for v in st["opt"].mapping.values())
    assert seen and seen[-1] == (total, total)


def test_targets_that_cannot_be_filled_directly(sharded: Path) -> None:
    torch = pytest.importorskip("torch")
    local = torch.zeros(5, 10).t()  # non-contiguous: read into a host buffer, then copied
    st = {"cols": Shard(local, (10, 6), (0, 1)), "rep": torch.zeros(3, 4, dtype=torch.int16)}
    sp.load(sharded, into=st)
    assert torch.equal(local, torch.from_numpy(W[:, 1:6]))
    assert torch.equal(st["rep"], torch.from_numpy(R))


def test_a_partial_shard_saved_alone_is_refused(tmp_path: Path) -> None:
    with pytest.raises(sp.UnsupportedStateError, match=r"12 of 60.*process_group"):
        sp.save(tmp_path / "c", {"w": Shard(W[:2].copy(), W.shape, (0, 0))})
    assert not (tmp_path / "c").exists()
    assert os.listdir(tmp_path) == []


def test_a_complete_shard_saved_alone_is_a_one_rank_checkpoint(tmp_path: Path) -> None:
    info = sp.save(
        tmp_path / "c", {"w": Shard(W, W.shape, (0, 0)), "f": FlatShard(F.ravel(), F.shape, 0)}
    )
    assert info.format_version == 3 and info.world_size == 1
    out = sp.load(tmp_path / "c")
    np.testing.assert_array_equal(out["w"], W)
    np.testing.assert_array_equal(out["f"], F)


def test_mismatched_targets_modify_nothing(sharded: Path) -> None:
    st = empty_state(0, 2)
    st["rows"] = Shard(np.zeros((5, 6), dtype=np.float64), (10, 6), (0, 0))
    st["extra"] = np.zeros(3)
    with pytest.raises(sp.StateMismatchError) as info:
        sp.load(sharded, into=st)
    assert {k for k, _ in info.value.problems} == {"rows", "extra"}
    assert "dtype F32 in the checkpoint, F64 in the target" in str(info.value)
    assert not st["cols"].local.any() and not st["rep"].any()
    assert isinstance(st["rows"], Shard) and isinstance(st["opt"], Partitioned)  # put back


def test_a_shard_outside_its_tensor_is_refused(sharded: Path) -> None:
    st = {"rows": Shard(np.zeros((5, 6), dtype=np.float32), (12, 6), (7, 0))}
    with pytest.raises(
        sp.StateMismatchError, match=r"shape \[10, 6\] in the checkpoint, \[12, 6\]"
    ):
        sp.load(sharded, into=st)


def _flip(path: Path, key: str, shard: int, offset: int) -> None:
    rec = json.loads((path / "manifest.json").read_text())["tensors"][key]["shards"][shard]
    with open(path / rec["file"], "r+b") as f:
        f.seek(rec["offsets"][0] + offset)
        byte = f.read(1)
        f.seek(rec["offsets"][0] + offset)
        f.write(bytes([byte[0] ^ 0x40]))


def test_a_corrupt_shard_is_caught_whoever_reads_part_of_it(sharded: Path) -> None:
    _flip(sharded, "rows", 1, 4 * 6 * 3)  # row 7, in shard 1 (rows 4..7)
    # A rank whose piece touches rows 4..5 of that shard still checks the whole shard.
    st = {"rows": Shard(np.zeros((2, 6), dtype=np.float32), (10, 6), (4, 0))}
    with pytest.raises(sp.CorruptCheckpointError, match=r"'rows' \(shard 2 of 3, \[4:8, 0:6\]"):
        sp.load(sharded, into=st)
    with pytest.raises(sp.CorruptCheckpointError, match="rows"):
        sp.load(sharded)
    with pytest.raises(sp.CorruptCheckpointError, match="rows"):
        sp.verify(sharded)
    # verify="first" checks before copying anything
    st = {"rows": Shard(np.zeros((6, 6), dtype=np.float32), (10, 6), (4, 0))}
    with pytest.raises(sp.CorruptCheckpointError):
        sp.load(sharded, into=st, verify="first")
    assert not st["rows"].local.any()
    # verify=False reads what is there; shards not touched are fine
    st = {"rows": Shard(np.zeros((4, 6), dtype=np.float32), (10, 6), (0, 0))}
    sp.load(sharded, into=st)
    np.testing.assert_array_equal(st["rows"].local, W[:4])
    sp.load(
        sharded, into={"rows": Shard(np.zeros((2, 6), np.float32), (10, 6), (6, 0))}, verify=False
    )


def test_verify_catches_a_header_that_disagrees(sharded: Path) -> None:
    manifest = json.loads((sharded / "manifest.json").read_text())
    (sharded / "data-r00002-00000.safetensors").unlink()
    with pytest.raises(sp.CorruptCheckpointError, match="missing"):
        sp.verify(sharded)
    assert manifest["world_size"] == 3


def test_consolidate_streams_one_tensor_at_a_time(sharded: Path, tmp_path: Path) -> None:
    from savepoint.distributed import consolidate as cons

    sizes: list[int] = []
    real = cons._AssembledSource.copy_to

    def spy(self: Any, dst: np.ndarray[Any, Any], start: int) -> None:
        live = [s for s in sources if s._data is not None]
        sizes.append(len(live))
        real(self, dst, start)

    sources: list[Any] = []
    original_init = cons._AssembledSource.__init__

    def track(self: Any, *args: Any) -> None:
        original_init(self, *args)
        sources.append(self)

    cons._AssembledSource.copy_to = spy  # type: ignore[method-assign]
    cons._AssembledSource.__init__ = track  # type: ignore[method-assign]
    try:
        info = cons.consolidate(sharded, tmp_path / "whole", max_file_bytes=300)
    finally:
        cons._AssembledSource.copy_to = real  # type: ignore[method-assign]
        cons._AssembledSource.__init__ = original_init  # type: ignore[method-assign]
    assert max(sizes) <= 1  # at most the tensor being written is held
    assert info.format_version == 1 and len(info.files) > 1
    out = sp.load(tmp_path / "whole")
    np.testing.assert_array_equal(out["cols"], W)
    np.testing.assert_array_equal(out["flat"], F)
    assert sp.inspect(tmp_path / "whole").metadata == {"note": "ranks"}
    # an unsharded checkpoint consolidates to itself
    again = cons.consolidate(tmp_path / "whole", tmp_path / "again")
    assert again.total_bytes == info.total_bytes


def test_consolidate_command(sharded: Path, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from savepoint.cli import main

    runner = CliRunner()
    result = runner.invoke(main, ["consolidate", str(sharded), str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("ok: ") and "tensors" in result.output
    result = runner.invoke(main, ["consolidate", str(tmp_path / "missing"), str(tmp_path / "x")])
    assert result.exit_code == 1 and "no checkpoint" in result.output


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda: Shard(np.zeros((2, 3)), (4, 3), (3, 0)), "does not fit"),
        (lambda: Shard(np.zeros((2, 3)), (4, 3, 1), (0, 0)), "one entry per dimension"),
        (lambda: Shard(np.zeros((2, 3)), (4, 3), (0.5, 0)), "must be an integer"),
        (lambda: Shard([1, 2], (2,), (0,)), "numpy array or torch tensor"),
        (lambda: FlatShard(np.zeros((2, 2)), (4,), 0), "1-D"),
        (lambda: FlatShard(np.zeros(3), (2, 2), 2), "do not fit"),
        (lambda: Partitioned([1, 2]), "mapping"),
        (lambda: Shard.split(np.zeros((3, 2)), 0, 3, 4, size=10), "holds 1 of 10"),
        (lambda: Shard.split(np.zeros((3, 2)), 2, 0, 4), "dim 2"),
    ],
)
def test_descriptions_are_checked(make: Any, words: str) -> None:
    with pytest.raises(sp.UnsupportedStateError, match=words):
        make()


def test_split_follows_torch_chunk() -> None:
    pieces = [Shard.split(np.zeros((n, 2)), 0, r, 4, size=10) for r, n in enumerate([3, 3, 3, 1])]
    assert [s.box for s in pieces] == [
        ((0, 3), (0, 2)),
        ((3, 6), (0, 2)),
        ((6, 9), (0, 2)),
        ((9, 10), (0, 2)),
    ]
    assert Shard.split(np.zeros((2, 5)), 1, 1, 3).box == ((0, 2), (5, 10))
    empty = Shard.split(np.zeros((0, 2)), 0, 3, 4, size=5)  # 2, 2, 1, 0
    assert empty.box == ((5, 5), (0, 2))
    assert [FlatShard.bounds(10, r, 4) for r in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 10)]


def test_targets_inside_tuples_are_refused(sharded: Path) -> None:
    st = {"pair": (Shard(np.zeros((2, 6), np.float32), (10, 6), (0, 0)),)}
    with pytest.raises(sp.UnsupportedStateError, match="dicts or lists"):
        sp.load(sharded, into=st)


def test_descriptions_do_not_load_as_statefuls() -> None:
    with pytest.raises(TypeError, match="sharding description"):
        Shard(np.zeros(2), (2,), (0,)).load_state_dict({})


@pytest.mark.parametrize("new_world", [3, 5, 8])
@pytest.mark.parametrize("verify", [True, False])
def test_a_resharding_load_reads_at_most_1_1x_what_each_rank_needs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, new_world: int, verify: bool
) -> None:
    """Saved by 4 ranks (row shards and flat shards of 4 MiB tensors), restored by 3, 5 or 8: on a
    store without views (an object store) each new rank reads at most 1.1x the bytes of its own
    pieces, plus the data files' headers, verified (block checksums) or not."""
    from tests.engine.test_stores import NoViews, _Counted

    big = np.random.default_rng(5).standard_normal((1024, 1024)).astype(np.float32)
    flat = np.random.default_rng(6).standard_normal(1 << 20).astype(np.float32)

    def state(rank: int, world: int, fill: bool = True) -> dict[str, Any]:
        a, b = FlatShard.bounds(1024, rank, world)
        fa, fb = FlatShard.bounds(flat.size, rank, world)
        rows, part = big[a:b], flat[fa:fb]
        if not fill:
            rows, part = np.zeros_like(rows), np.zeros_like(part)
        return {
            "rows": Shard.split(rows.copy(), 0, rank, world, size=1024),
            "flat": FlatShard(part.copy(), flat.shape, fa),
        }

    save_ranks(tmp_path / "c", [state(r, 4) for r in range(4)])
    store = NoViews()
    store.makedirs("/c")
    names = sorted(os.listdir(tmp_path / "c"), key=lambda n: n == mf.NAME)  # manifest last
    for name in names:
        store.put(f"/c/{name}", (tmp_path / "c" / name).read_bytes())
    headers = sum(
        mf.parse(store.read_small("/c/manifest.json", cap=None)).files[n].header_size
        for n in names
        if n != mf.NAME
    )
    counted = _Counted(store, monkeypatch)
    for rank in range(new_world):
        into = state(rank, new_world, fill=False)
        needed = into["rows"].local.nbytes + into["flat"].local.nbytes
        counted.reset()
        sp.load(store.at("/c"), into=into, verify=verify)
        want = state(rank, new_world)
        np.testing.assert_array_equal(into["rows"].local, want["rows"].local)
        np.testing.assert_array_equal(into["flat"].local, want["flat"].local)
        assert counted.bytes <= 1.1 * needed + headers, (rank, counted.bytes, needed)
