"""describe's fast paths (a Shard read in ``state_dict``'s field order, its parsing kept per
distinct text; ``own`` by position; ``layout.written`` with numpy) give exactly what the walk
before them gave: ``Old`` below is that walk (its ``sharded``/``add``/``parse`` are still the
module's, the fast path's fallback), the old ``own`` picks pieces by key, ``written`` by loop."""

from __future__ import annotations

import types
from typing import Any

import numpy as np
import pytest

from savepoint.codecs import boxes
from savepoint.distributed import (
    FlatShard,
    Partitioned,
    Shard,
    describe,
    layout,
    plan,
    save,
    shard,
    simulate,
)
from savepoint.distributed.layout import Grid
from savepoint.state import tree


class Old(describe._Describer):
    def walk(self, node: tree.Node, key: str, is_root: bool) -> tree.Node:
        t, walk = node["t"], self.walk
        if t == "stateful":
            if node["type"] in (shard.SHARD, shard.FLAT_SHARD):
                return self.sharded(node, key)
            if node["type"] == shard.PARTITIONED:
                self.grids.irregular()
                pairs = node["state"]["items"]
                return {
                    "t": plan.PARTITIONED_NODE,
                    "items": [
                        [k, walk(c, tree.child_key(key, is_root, k), False)] for k, c in pairs
                    ],
                }
            return {**node, "state": walk(node["state"], key, is_root)}
        prefix = "" if is_root else key + "/"
        if t == "dict":
            pairs = node["items"]
            return {
                "t": t,
                "items": [[k, walk(c, prefix + tree.escape(k), False)] for k, c in pairs],
            }
        if t in ("list", "tuple"):
            return {
                "t": t,
                "items": [walk(c, f"{prefix}{i}", False) for i, c in enumerate(node["items"])],
            }
        if t == "tensor" and node["ref"] not in self.items:
            source = self.flat.tensors[node["ref"]]
            self.add(node["ref"], source, source.shape, boxes.full(source.shape))
        return node


def outcome(fn: Any) -> Any:
    try:
        return fn()
    except Exception as e:  # (the error is the outcome compared)
        return ("raised", type(e), str(e))


def old_describe(flat: tree.Flat) -> Any:
    walker = Old(flat)
    root = walker.walk(flat.tree, "", True)
    return (
        plan.LocalPlan("p", root, tuple(walker.items.values())),
        walker.sources,
        walker.grids.done(root),
    )


def assert_same(flat: tree.Flat, monkeypatch: pytest.MonkeyPatch) -> None:
    want = outcome(lambda: old_describe(flat))
    got = outcome(lambda: describe.describe_layout(flat, "p"))
    if want[0] == "raised" or got[0] == "raised":
        assert got == want
        return
    (plan0, src0, grid0), (plan1, src1, grid1) = want, got
    assert plan1 == plan0 and list(src1) == list(src0)
    assert all(src1[k] is src0[k] for k in src0)
    assert (grid0 is None) == (grid1 is None)
    if grid1 is None:
        return
    (lay0, coord0), (lay1, coord1) = grid0, grid1
    assert coord1 == coord0 and lay1.digest == lay0.digest
    assert vars(lay1) == vars(lay0)
    run = types.SimpleNamespace(memo_key=None, sources=src1)
    (_, _, own), nbytes = save.SaveRun.own(run, grid1, plan1)  # type: ignore[arg-type]
    monkeypatch.setattr(layout, "_VECTOR_FROM", 1 << 40)  # the loop
    keys = {lay0.keys[i] for i in layout.writes(lay0, coord0)}
    monkeypatch.undo()
    want_own = tuple(item for item in plan0.items if item.key in keys)
    assert own == want_own and nbytes == sum(src0[i.key].nbytes for i in want_own)


def model(rank: int, world: int, **kw: Any) -> Any:
    kw = {"hidden": 6, "experts": 2, "expert_ffn": 4, "data": True} | kw
    return simulate.model_state(rank, world, 30, **kw)


def extras(rank: int) -> dict[Any, Any]:
    a = np.arange(12.0).reshape(4, 3)
    grid = Grid((2,), (rank,), (0,))
    return {
        "flat": FlatShard(np.arange(3.0), (2, 3), 3 * rank),
        "part": Partitioned({f"r{rank}": np.ones(2)}),
        "none": Shard(np.zeros((0, 3)), (0, 3), (0, 0), grid=grid),
        "uneven": Shard(a[:0] if rank else a[:1], (1, 3), (rank, 0), grid=grid),
        "plain": [np.ones(2), (a, a)],
        "offsets": Shard(a[:2], (4, 3), (2 * rank, 0)),
    }


STATES = [
    lambda: model(0, 8),
    lambda: model(7, 8),  # empty pieces of uneven splits
    lambda: model(3, 4, tp=2),
    lambda: model(1, 4, tp=2, regular=False),
    lambda: model(1, 4, hidden=64, experts=4, expert_ffn=32),
    *[lambda k=k: model(1, 2) | {k: extras(1)[k]} for k in extras(1)],
    lambda: {"a": extras(0)["none"], "b": extras(0)["uneven"]},
    lambda: {"w": Shard(np.ones((2, 3)), (4, 3), (2, 0), grid=Grid((2,), (1,), (0,)))},
    lambda: Shard(np.ones((2, 3)), (4, 3), (2, 0), grid=Grid((2,), (1,), (0,))),  # at the root
    lambda: {1: extras(0)["uneven"], "1": np.ones(3)},  # a key clash
    lambda: {"1": np.ones(3), 1: extras(1)["offsets"]},
    lambda: {
        "a": Shard(np.ones((2, 3)), (4, 3), (2, 0)),
        "b": Shard(np.ones((1, 3)), (4, 3), (2, 0)),
    },
    lambda: {"a/b": {"~c": extras(0)["offsets"]}, "é": extras(0)["none"]},
    lambda: {
        "x": Shard(np.ones((2, 3)), (4, 3), (0, 0), grid=Grid((2,), (0,), (0,))),
        "y": Shard(np.ones((2, 3)), (4, 3), (2, 0), grid=Grid((2,), (1,), (0,))),
    },
]


@pytest.mark.parametrize("make", STATES)
def test_the_description_and_own_pieces_are_the_old_walks(
    make: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert_same(save.flatten(make()), monkeypatch)


def shard_fields(flat: tree.Flat) -> list[Any]:
    return flat.tree["items"][0][1]["state"]["items"]


MALFORMED = [
    lambda f: f.reverse(),  # fields in another order
    lambda f: f.append(["extra", {"t": "value", "v": 1}]),
    lambda f: f.pop(0),  # no local part
    lambda f: f.__setitem__(0, ["local", {"t": "value", "v": 1}]),
    lambda f: f.__setitem__(0, ["local", 5]),
    lambda f: f[2][1].__setitem__("v", None),
    lambda f: f[2][1].pop("v"),
    lambda f: f.__setitem__(2, ["grid", "8|0|0"]),
    lambda f: f.__setitem__(2, ["grod", {"t": "value", "v": "2|1|0"}]),
    lambda f: f.__setitem__(2, ["grid"]),
    lambda f: f[1][1].__setitem__("v", 7),
    lambda f: f[1][1].__setitem__("v", "4,x@1,0"),
    lambda f: f[1][1].__setitem__("v", ["4,3@2,0"]),
    lambda f: f[2][1].__setitem__("v", "2|1"),
    lambda f: f.pop(2),  # no grid: irregular
    lambda f: f[0][1].__setitem__("ref", "missing"),
]


@pytest.mark.parametrize("spoil", MALFORMED)
def test_a_malformed_shard_gives_the_old_error(spoil: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    state = {"w": Shard(np.ones((2, 3)), (4, 3), (2, 0), grid=Grid((2,), (1,), (0,)))}
    flat = save.flatten(state | {"v": state["w"]})
    spoil(shard_fields(flat))
    assert_same(flat, monkeypatch)


@pytest.mark.parametrize("seed", range(6))
def test_written_with_numpy_is_the_loop(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(seed)
    mesh = tuple(int(n) for n in rng.integers(1, 4, size=int(rng.integers(1, 4))))
    choices = [None, *range(3)]
    dims = [tuple(choices[i] for i in rng.integers(0, 4, size=len(mesh))) for _ in range(200)]
    shapes = [tuple(int(n) for n in rng.integers(0, 3, size=2)) for _ in range(200)]
    lay = layout.Layout({}, mesh, [str(i) for i in range(200)], ["F32"] * 200, shapes, dims)
    for coord in np.ndindex(*mesh):
        fast = layout.written(lay, coord)
        monkeypatch.setattr(layout, "_VECTOR_FROM", 1 << 40)
        assert fast == layout.written(lay, coord) and layout.writes(lay, coord) == set(fast)
        monkeypatch.undo()
