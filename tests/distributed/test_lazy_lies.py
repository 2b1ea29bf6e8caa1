"""Version 7 read lazily by sharded loads, against index files and manifests that lie.

The golden version 7 checkpoint (tests/golden/v7: mesh (2, 2); ``model/w`` F32 [384, 256] split
over the first mesh dimension, ``model/b`` I16 [8, 10] over both, ``replicated`` F64 [3]) is
copied, its indexes and manifest forged, and every record the manifest holds of an index made to
match it (the XXH3 checks cannot help: only the lazy reader's own). Each forged checkpoint is
loaded by every rank of several target layouts (``sp.load(into=...)``: the lazy reader): each
load returns exactly the golden values or raises a CheckpointError; never other values, never a
raw IndexError/KeyError/ValueError/MemoryError, within a small memory bound.
"""

from __future__ import annotations

import json
import shutil
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import savepoint as sp
from faults._util import deadline, forge
from savepoint.codecs import checksum
from savepoint.codecs import manifest as mf
from savepoint.distributed import FlatShard, Shard, layout

GOLDEN = Path(__file__).resolve().parent.parent / "golden" / "v7"
R0, R1, R2, R3 = (f"index-r{r:05d}.json" for r in range(4))
PEAK = 16 << 20
Doc = dict[str, Any]


@pytest.fixture(scope="module")
def truth() -> Any:
    return sp.load(GOLDEN, framework="numpy")


def _shard(full: np.ndarray[Any, Any], mesh: tuple[int, ...], coord: Any, dims: Any) -> Shard:
    box = layout.grid_box(full.shape, mesh, coord, dims)
    local = np.zeros([b - a for a, b in box], full.dtype)
    return Shard(local, full.shape, [a for a, _ in box], grid=layout.Grid(mesh, coord, dims))


def _targets(truth: Any) -> list[Any]:
    """Every rank's ``into`` of several layouts: rows over 4 ranks, the saved (2, 2) mesh, its
    transpose (2, 2) with the dims swapped, one rank holding everything, flat ranges."""
    w, b, rep = truth["model"]["w"], truth["model"]["b"], truth["replicated"]
    out = []
    for mesh, wd, bd in [
        ((4,), (0,), (0,)),
        ((2, 2), (0, None), (0, 1)),
        ((2, 2), (None, 1), (1, 0)),
    ]:
        for coord in np.ndindex(*mesh):
            c = tuple(int(x) for x in coord)
            model = {"w": _shard(w, mesh, c, wd), "b": _shard(b, mesh, c, bd)}
            out.append({"model": model, "replicated": np.zeros_like(rep)})
    out.append({"model": {"w": np.zeros_like(w), "b": np.zeros_like(b)}, "replicated": 0 * rep})
    for start, n in [(0, 7), (255 * 256 + 250, 700), (384 * 256 - 3, 3)]:
        flat = FlatShard(np.zeros(n, w.dtype), w.shape, start)
        out.append({"model": {"w": flat, "b": np.zeros_like(b)}, "replicated": 0 * rep})
    return out


def _local(value: Any) -> Any:
    return value.local if isinstance(value, (Shard, FlatShard)) else value


def _want(value: Any, full: np.ndarray[Any, Any]) -> Any:
    if isinstance(value, Shard):
        return full[tuple(slice(a, b) for a, b in value.box)]
    if isinstance(value, FlatShard):
        return full.reshape(-1)[value.start : value.start + value.local.size]
    return full


def _outcomes(where: Path, truth: Any, verify: bool = True) -> list[str]:
    """Load every target of :func:`_targets`: "ok" (exact) or the CheckpointError's name; a
    load giving other values, or raising anything else, fails the test."""
    got = []
    for into in _targets(truth):
        tracemalloc.start()
        try:
            sp.load(where, into=into, verify=verify)
        except sp.CheckpointError as exc:
            got.append(type(exc).__name__)
            continue
        finally:
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            assert peak < PEAK, peak
        for key, full in [*truth["model"].items(), ("replicated", truth["replicated"])]:
            value = into["replicated"] if key == "replicated" else into["model"][key]
            np.testing.assert_array_equal(_local(value), _want(value, full), err_msg=key)
        got.append("ok")
    return got


def _forge(tmp: Path, edit: Callable[[Doc, dict[str, Doc]], Any]) -> Path:
    """A copy of the golden checkpoint with ``edit(manifest, indexes)`` applied, resealed."""
    where = tmp / "c"
    shutil.copytree(GOLDEN, where)
    doc = json.loads((GOLDEN / mf.NAME).read_bytes())
    del doc["manifest_xxh3"]
    indexes = {n: json.loads((GOLDEN / n).read_bytes()) for n in doc["indices"]}
    edit(doc, indexes)
    for name in list(doc["indices"]):
        if name in indexes:
            data = json.dumps(indexes[name], separators=(",", ":")).encode() + b"\n"
            (where / name).write_bytes(data)
            doc["indices"][name] = {"size": len(data), "xxh3": checksum.digest(data)}
    (where / mf.NAME).write_bytes(forge(doc))
    return where


def _b(indexes: dict[str, Doc], name: str) -> list[Doc]:
    listed: list[Doc] = indexes[name]["shards"]["model/b"]
    return listed


def _move_r1_to_r3(doc: Doc, ix: dict[str, Doc]) -> None:
    _b(ix, R3).insert(0, _b(ix, R1).pop())
    del ix[R1]["shards"]["model/b"]


def _rename_r1(doc: Doc, ix: dict[str, Doc]) -> None:
    doc["indices"]["index-r00009.json"] = doc["indices"].pop(R1)
    ix["index-r00009.json"] = ix.pop(R1)


def _reorder(doc: Doc, ix: dict[str, Doc]) -> None:
    # ``replicated`` moves to position 0 (its writer by the rule: rank 0, which does not hold
    # it) and ``model/w`` to 1 (its writers: ranks 1 and 3, which do not hold it)
    t = doc["tensors"]
    doc["tensors"] = {k: t[k] for k in ("replicated", "model/w", "model/b")}


def _r1_names_r0_bytes(doc: Doc, ix: dict[str, Doc]) -> None:
    # r1's piece recorded at r0's bytes (and their checksum): a consistent lie the checksums
    # cannot tell; the lazy reader must say what the eager one says (here: r0's values).
    _b(ix, R1)[0] = {**_b(ix, R0)[0], "box": _b(ix, R1)[0]["box"]}


# case -> (edit, which loads succeed: "all", "some" (those not reading the lie), "none")
LIES: dict[str, tuple[Callable[[Doc, dict[str, Doc]], Any], str]] = {
    # the piece not at the rank the grid says: found through the fallback
    "piece-at-the-wrong-writer": (_move_r1_to_r3, "all"),
    "writer-index-named-otherwise": (_rename_r1, "all"),
    "table-reordered": (_reorder, "all"),
    # lies the lazy reader must refuse in the indexes it reads
    "piece-listed-twice": (lambda d, ix: _b(ix, R1).append(dict(_b(ix, R1)[0])), "some"),
    "piece-overlapping-two-boxes": (
        lambda d, ix: _b(ix, R0).__setitem__(
            0, {**_b(ix, R0)[0], "box": [[0, 4], [0, 10]], "offsets": [196768, 196848]}
        ),
        "some",
    ),
    "piece-box-transposed": (
        lambda d, ix: _b(ix, R1).__setitem__(0, {**_b(ix, R1)[0], "box": [[0, 5], [5, 9]]}),
        "some",
    ),
    "piece-past-its-data-file": (
        lambda d, ix: _b(ix, R1).__setitem__(0, {**_b(ix, R1)[0], "offsets": [140, 180]}),
        "some",
    ),
    "piece-bytes-of-another-checksum": (
        lambda d, ix: _b(ix, R1).__setitem__(
            0, {**_b(ix, R1)[0], "file": _b(ix, R0)[0]["file"], "offsets": [196800, 196840]}
        ),
        "some",
    ),
    "dtype-wider": (lambda d, ix: d["tensors"]["model/b"].__setitem__("dtype", "I32"), "none"),
    "shape-transposed": (
        lambda d, ix: d["tensors"]["model/b"].__setitem__("shape", [10, 8]),
        "none",
    ),
    # the same boxes, other writers: every piece found through the fallback
    "grid-transposed-same-boxes": (
        lambda d, ix: d["tensors"]["model/b"].__setitem__("grid", [1, 0]),
        "all",
    ),
    "mesh-2**30-places": (
        lambda d, ix: (
            d.update(world_size=1 << 30, mesh=[1 << 29, 2]),
            d["tensors"]["model/w"].update(shape=[384, 1 << 30], grid=[1, None]),
        ),
        "some",
    ),
    "mesh-2**30-places-replicated": (
        lambda d, ix: d.update(world_size=1 << 30, mesh=[1 << 15, 1 << 15]),
        "none",
    ),
}


def _retyped(truth: Any, case: str) -> Any:
    """The golden values as the forged manifest types them (what the targets must hold)."""
    out = {"model": dict(truth["model"]), "replicated": truth["replicated"]}
    if case == "dtype-wider":
        out["model"]["b"] = truth["model"]["b"].astype(np.int32)
    elif case == "shape-transposed":
        out["model"]["b"] = truth["model"]["b"].reshape(10, 8)
    return out


@pytest.mark.parametrize("case", list(LIES))
def test_a_lying_checkpoint_loads_exactly_or_is_refused(
    truth: Any, tmp_path: Path, case: str
) -> None:
    edit, loads = LIES[case]
    where = _forge(tmp_path, edit)
    if case == "mesh-2**30-places":
        _a_huge_mesh_is_refused_before_any_plan(where)
        return
    got = _outcomes(where, _retyped(truth, case))
    if loads == "all":
        assert set(got) == {"ok"}, got
        sp.verify(where)
        return
    assert set(got) - {"ok"} <= {"CorruptCheckpointError", "ManifestError"}, got
    assert ("ok" in got) == (loads == "some") and set(got) != {"ok"}, got
    with pytest.raises(sp.CorruptCheckpointError):
        sp.verify(where)


def _a_huge_mesh_is_refused_before_any_plan(where: Path) -> None:
    # ``model/w`` [384, 2**30] split over 2**29 ranks: a FlatShard of a few elements planned
    # its reads from every piece of the rows it meets (2**29 of them: MemoryError, or hours)
    tracemalloc.start()
    try:
        for start in (0, 5 << 30):
            into = {
                "model": {
                    "w": FlatShard(np.zeros(8, np.float32), (384, 1 << 30), start),
                    "b": np.zeros((8, 10), np.int16),
                },
                "replicated": np.zeros(3),
            }
            # (the deadline: were every piece listed again, fail in seconds, not after 100 GB)
            with (
                deadline(10.0, "load"),
                pytest.raises(sp.CorruptCheckpointError, match="more than the 4 index files"),
            ):
                sp.load(where, into=into)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < PEAK, peak


def test_a_consistent_lie_reads_as_the_eager_reader_reads_it(truth: Any, tmp_path: Path) -> None:
    where = _forge(tmp_path, _r1_names_r0_bytes)
    eager = sp.load(where, framework="numpy")
    b = eager["model"]["b"]
    assert np.array_equal(b[0:4, 5:10], truth["model"]["b"][0:4, 0:5])  # what the index says
    for verify in (True, False):
        assert set(_outcomes(where, eager, verify)) == {"ok"}


@pytest.mark.parametrize("case", ["piece-bytes-of-another-checksum", "piece-past-its-data-file"])
def test_lies_are_refused_by_the_loads_that_read_them_only(
    truth: Any, tmp_path: Path, case: str
) -> None:
    # the lie is in r1's piece of ``model/b`` ([0, 4) x [5, 10)): the loads of the row layout
    # over 4 ranks (ranks 0 and 1 need rows 0-3 of it: the lie; ranks 2 and 3 do not)
    where = _forge(tmp_path, LIES[case][0])
    got = _outcomes(where, truth)[:4]
    assert got[2:] == ["ok", "ok"], got
    assert "ok" not in got[:2], got
