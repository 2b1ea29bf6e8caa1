"""savepoint.state.restore.Planner: each binding rule alone, on a minimal saved tree.

Each test calls one rule of a fresh planner and checks its decision: what it reads in place or
fresh, the problems it records, and what its thunk gives after the reads (``GET`` stands for
them). tests/state/test_restore.py checks the whole walk.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import numpy as np

from savepoint.codecs.manifest import TensorRecord
from savepoint.state import restore

# Saved tensors: "w", float32 [2]; "s", a 0-d float32.
RECORDS = {
    "w": TensorRecord.plain("F32", (2,), "data-00000.safetensors", 0, 8, "0" * 16),
    "s": TensorRecord.plain("F32", (), "data-00000.safetensors", 8, 12, "0" * 16),
}
W = {"t": "tensor", "ref": "w", "kind": "numpy"}
S = {"t": "tensor", "ref": "s", "kind": "numpy"}


def value(v: Any) -> dict[str, Any]:
    return {"t": "value", "v": v}


def saved_dict(**items: Any) -> dict[str, Any]:
    return {"t": "dict", "items": [[k, child] for k, child in items.items()]}


def saved_list(*items: Any, t: str = "list") -> dict[str, Any]:
    return {"t": t, "items": list(items)}


def GET(ref: str, kind: str) -> Any:
    """A fresh read: "w" is [7, 7], "s" is 2.5."""
    return np.full(2, 7, np.float32) if ref == "w" else np.array(2.5, np.float32)


def planner() -> restore.Planner:
    return restore.Planner(RECORDS)


class Box:
    """A Stateful recording what its load_state_dict receives."""

    def __init__(self) -> None:
        self.loaded: list[Any] = []

    def state_dict(self) -> Any:
        return {"w": np.zeros(2, np.float32)}

    def load_state_dict(self, state: Any) -> None:
        self.loaded.append(state)


@dataclasses.dataclass
class Config:
    lr: float = 0.1
    steps: int = 1


@dataclasses.dataclass(frozen=True)
class Frozen:
    lr: float = 0.1


def test_fresh_reads_every_tensor_of_the_subtree() -> None:
    pl = planner()
    thunk = pl.fresh(saved_dict(a=W, b=value(1)))
    assert pl.p.fresh == {"w"} and not pl.p.problems
    out = thunk(GET)
    assert out["b"] == 1 and out["a"].tolist() == [7, 7]


def test_bind_builds_fresh_where_the_target_has_nothing() -> None:
    pl = planner()
    assert pl.bind(W, restore._MISSING, ("a",), "lenient")(GET).tolist() == [7, 7]
    assert pl.p.fresh == {"w"}


def test_bind_unwraps_a_saved_stateful_over_a_plain_target() -> None:
    pl = planner()
    target = {"w": np.zeros(2, np.float32)}
    pl.bind({"t": "stateful", "state": saved_dict(w=W)}, target, (), False)
    assert [ref for ref, _, _ in pl.p.inplace] == ["w"] and not pl.p.problems


def test_bind_stateful_hands_the_whole_subtree_to_load_state_dict() -> None:
    pl = planner()
    box = Box()
    thunk = pl.bind_stateful({"t": "stateful", "state": saved_dict(w=W, step=value(3))}, box, ())
    # The template's tensor is filled in place; the saved key it lacks is built fresh.
    assert [key for _, _, key in pl.p.inplace] == ["w"] and not pl.p.problems
    assert thunk(GET) is box
    assert set(box.loaded[0]) == {"w", "step"} and box.loaded[0]["step"] == 3


def test_bind_tensor_reads_in_place_into_a_match() -> None:
    pl = planner()
    target = np.zeros(2, np.float32)
    assert pl.bind_tensor(W, target, ("w",), False)(GET) is target
    assert pl.p.inplace == [("w", target, "w")] and not pl.p.fresh


def test_bind_tensor_reports_a_shape_and_dtype_mismatch() -> None:
    pl = planner()
    pl.bind_tensor(W, np.zeros(3, np.int64), ("w",), False)
    assert [why for _, why in pl.p.problems] == [
        "dtype F32 in the checkpoint, I64 in the target",
        "shape [2] in the checkpoint, [3] in the target",
    ]


def test_bind_tensor_leaves_a_mismatch_to_a_lenient_stateful() -> None:
    pl = planner()
    pl.bind_tensor(W, np.zeros(3, np.float32), ("w",), "lenient")
    assert pl.p.fresh == {"w"} and not pl.p.problems and not pl.p.inplace


def test_bind_tensor_refuses_a_non_tensor_target() -> None:
    pl = planner()
    pl.bind_tensor(W, "text", ("w",), False)
    assert pl.p.problems == [("w", "the checkpoint holds a tensor here, found str")]


def test_bind_value_replaces_a_nested_value_and_refuses_the_root() -> None:
    pl = planner()
    assert pl.bind_value(value(5), 4, ("n",), False)(GET) == 5
    assert not pl.p.problems
    pl.bind_value(value(5), 4, (), False)
    assert [why for _, why in pl.p.problems] == [
        "a plain value cannot be restored in place; use sp.load()"
    ]


def test_tensor_to_scalar_is_exact_or_a_problem() -> None:
    pl = planner()
    assert pl.tensor_to_scalar(S, 1.0, ("lr",), "F32")(GET) == 2.5
    assert pl.p.fresh == {"s"} and not pl.p.problems
    pl = planner()
    pl.tensor_to_scalar(S, 1.0, (), "F32")  # the root has no slot to put the new value in
    assert len(pl.p.problems) == 1 and not pl.p.fresh


def test_scalar_to_tensor_fills_a_0d_array_only() -> None:
    pl = planner()
    target = np.zeros((), np.int64)
    assert pl.scalar_to_tensor(3, target, "n")(GET) is target and int(target) == 3
    pl.scalar_to_tensor(3, np.zeros(2, np.int64), "n")
    assert pl.p.problems == [("n", "the checkpoint holds a int here, found a tensor of shape [2]")]


def test_bind_container_refuses_another_kind_or_builds_it_fresh_in_a_stateful() -> None:
    pl = planner()
    pl.bind_container(saved_dict(a=W), [1], ("x",), False, strict=False)
    assert pl.p.problems == [("x", "the checkpoint holds a dict here, found list")]
    pl = planner()
    assert pl.bind_container(saved_dict(a=W), object(), ("x",), "lenient", strict=False)
    assert pl.p.fresh == {"w"} and not pl.p.problems


def test_bind_dict_reports_absent_keys_with_their_likely_typo() -> None:
    pl = planner()
    pl.bind_dict(saved_dict(weight=W), {"wieght": np.zeros(2, np.float32)}, (), False, False)
    assert pl.p.problems == [("wieght", "not in the checkpoint")]
    assert pl.p.hints == ["'wieght' is not in the checkpoint, which has 'weight' (a typo?)"]


def test_bind_dict_strict_refuses_unexpected_keys() -> None:
    pl = planner()
    got = pl.bind_dict(saved_dict(w=W, extra=value(1)), {"w": np.zeros(2)}, (), "checked", True)
    assert ("extra", "unexpected key: not in the target") in pl.p.problems
    assert set(got(GET)) == {"w", "extra"}  # complete: the whole saved dict, for the Stateful


def test_bind_sequence_fills_a_list_and_remakes_a_tuple() -> None:
    pl = planner()
    target = [0, 1]
    assert pl.bind_sequence(saved_list(value(5), value(6)), target, (), False)(GET) is target
    assert target == [5, 6]
    old = (0, 1)
    new = pl.bind_sequence(saved_list(value(0), value(6), t="tuple"), old, ("t",), False)(GET)
    assert new == (0, 6) and not pl.p.problems


def test_resized_sequence_replaces_a_list_and_a_tuple_whole() -> None:
    pl = planner()
    target = [0]
    assert pl.resized_sequence(saved_list(value(5), value(6)), target, ())(GET) is target
    assert target == [5, 6]
    assert pl.resized_sequence(saved_list(value(5), value(6)), (0,), ())(GET) == (5, 6)
    assert not pl.p.problems


def test_resized_sequence_refuses_a_sequence_it_cannot_remake() -> None:
    class Pair(tuple):  # type: ignore[type-arg]  # a tuple subclass without _make
        pass

    pl = planner()
    pl.resized_sequence(saved_list(value(5), value(6)), Pair((0,)), ("p",))
    assert pl.p.problems == [("p", "2 items in the checkpoint, 1 in the target")]


def test_bind_dataclass_wants_every_field_and_nothing_else() -> None:
    pl = planner()
    pl.bind_dataclass(saved_dict(lr=value(0.5), momentum=value(0.9)), Config(), ("c",), False)
    assert sorted(pl.p.problems) == [
        ("c/momentum", "not a field of Config"),
        ("c/steps", "not in the checkpoint (a field of Config)"),
    ]


def test_bind_dataclass_sets_a_mutable_one_and_rebuilds_a_frozen_one() -> None:
    pl = planner()
    cfg = Config()
    assert pl.bind_dataclass(saved_dict(lr=value(0.5), steps=value(2)), cfg, (), False)(GET) is cfg
    assert (cfg.lr, cfg.steps) == (0.5, 2)
    frozen = Frozen()
    new = pl.bind_dataclass(saved_dict(lr=value(0.5)), frozen, (), False)(GET)
    assert new == Frozen(0.5) and frozen.lr == 0.1 and not pl.p.problems


def test_immutable_slot_refuses_a_value_that_must_be_assigned() -> None:
    pl = planner()
    parent = types.MappingProxyType({"n": 1})
    pl.immutable_slot(value(1), 1, ("n",), parent)  # equal: nothing to assign
    assert not pl.p.problems
    pl.immutable_slot(value(2), 1, ("n",), parent)
    assert pl.p.problems == [("n", "cannot assign into a mappingproxy")]


def test_check_root_refuses_an_immutable_root_that_must_change() -> None:
    pl = planner()
    pl.check_root(saved_list(value(1), value(2), t="tuple"), (1,))
    assert pl.p.problems == [("", "2 items in the checkpoint, 1 in the target")]
    pl = planner()
    pl.check_root(saved_dict(lr=value(0.5)), Frozen())
    assert len(pl.p.problems) == 1 and "a frozen Frozen cannot be changed" in pl.p.problems[0][1]
    pl = planner()
    pl.check_root(saved_dict(lr=value(0.1)), Frozen())  # nothing differs: nothing to say
    assert not pl.p.problems
