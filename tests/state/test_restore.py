"""savepoint.state.restore.plan: matching a saved tree against live objects, without any I/O.

The saved side is built with tree.flatten and TensorRecords derived from its sources; "reading" is
simulated by copying the source bytes into the planned in-place targets and handing fresh arrays to
``finish``, which is exactly the contract the loader relies on.
"""

from __future__ import annotations

import types
from typing import Any

import numpy as np
import pytest

from savepoint.codecs.manifest import TensorRecord
from savepoint.state import arrays, restore, tree

# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


class Saved:
    """A flattened saved state with what a manifest would record for it."""

    def __init__(self, state: Any) -> None:
        self.flat = tree.flatten(state)
        self.records = {
            name: TensorRecord(
                s.dtype.name, s.shape, "data-00000.safetensors", 0, s.nbytes, "0" * 16
            )
            for name, s in self.flat.tensors.items()
        }
        self.bytes = {}
        for name, s in self.flat.tensors.items():
            buf = np.empty(s.nbytes, dtype=np.uint8)
            s.copy_to(buf, 0)
            s.release()
            self.bytes[name] = buf
        self.fresh_calls: list[tuple[str, str]] = []

    def plan(self, into: Any, node: Any = None) -> restore.Plan:
        return restore.plan(self.flat.tree if node is None else node, into, self.records)

    def array(self, ref: str) -> np.ndarray:
        rec = self.records[ref]
        return self.bytes[ref].copy().view(self.flat.tensors[ref].dtype.numpy).reshape(rec.shape)

    def execute(self, p: restore.Plan) -> Any:
        """Do what load() does after a plan without problems: fill in place, then finish."""
        assert p.problems == []
        for ref, target, _ in p.inplace:
            view = arrays.byte_view(target)
            if view is not None:
                view[:] = self.bytes[ref]
            else:
                np.copyto(target, self.array(ref), casting="no")

        def get(ref: str, kind: str) -> Any:
            assert ref in p.fresh, f"{ref} read although the plan did not ask for it"
            self.fresh_calls.append((ref, kind))
            a = self.array(ref)
            if kind == "torch":
                from savepoint.state import torch_tensors

                return torch_tensors.from_numpy(a, self.flat.tensors[ref].dtype)
            return a[()] if kind == "numpy_scalar" else a

        return p.finish(get)


class Box:
    """A Stateful recording what load_state_dict received."""

    def __init__(self, state: Any) -> None:
        self.state = state
        self.loaded: list[Any] = []

    def state_dict(self) -> Any:
        return self.state

    def load_state_dict(self, d: Any) -> None:
        self.loaded.append(d)


def f32(*shape: int, start: float = 0.0) -> np.ndarray:
    return (np.arange(int(np.prod(shape)), dtype=np.float32) + start).reshape(shape)


# ---------------------------------------------------------------------------------------------
# partial mode (no Stateful)
# ---------------------------------------------------------------------------------------------


def test_partial_into_reads_only_what_it_covers() -> None:
    saved = Saved(
        {"model": {"w": f32(2, 3, start=1), "b": f32(3, start=7)}, "opt": {"m": f32(4)}, "step": 9}
    )
    w = np.zeros((2, 3), dtype=np.float32)
    into = {"model": {"w": w}, "step": 0}
    p = saved.plan(into)
    assert p.problems == []
    assert p.refs == {"model/w"}
    assert [(ref, key) for ref, _, key in p.inplace] == [("model/w", "model/w")]
    assert p.inplace[0][1] is w
    assert into == {"model": {"w": w}, "step": 0}  # planning changes nothing
    assert not w.any()

    out = saved.execute(p)
    assert out is into
    assert out["model"]["w"] is w
    np.testing.assert_array_equal(w, f32(2, 3, start=1))
    assert out["step"] == 9
    assert set(out) == {"model", "step"}  # saved entries not asked for are not added
    assert saved.fresh_calls == []


def test_partial_none_placeholders_get_fresh_tensors_and_values() -> None:
    saved = Saved({"w": f32(3), "s": np.float64(2.5), "v": 7, "t": [f32(1, start=3), "x"]})
    slots: list[Any] = [None, None]
    into: dict[str, Any] = {"w": None, "s": None, "v": None, "t": slots}
    p = saved.plan(into)
    assert p.problems == []
    assert p.inplace == []
    assert p.fresh == {"w", "s", "t/0"}
    out = saved.execute(p)
    np.testing.assert_array_equal(out["w"], f32(3))
    assert type(out["s"]) is np.float64
    assert out["s"] == 2.5
    assert out["v"] == 7
    assert out["t"] is slots
    np.testing.assert_array_equal(slots[0], [3.0])
    assert slots[1] == "x"


def test_every_problem_is_reported_together() -> None:
    saved = Saved(
        {
            "w": f32(2, 3),
            "b": f32(3),
            "i": np.zeros(2, dtype=np.int64),
            "both": f32(4),
            "nested": {"x": f32(1)},
            "tup": (f32(2), 1),
            "d": {"k": 1},
            "tensor": f32(2),
        }
    )
    into = {
        "w": np.zeros((3, 2), dtype=np.float32),  # shape
        "b": np.zeros(3, dtype=np.float64),  # dtype
        "i": np.zeros(2, dtype=np.complex128),  # dtype savepoint cannot even store
        "both": np.zeros((2, 2), dtype=np.float16),  # dtype and shape
        "nested": {"x": np.zeros(1, dtype=np.float32), "y": np.zeros(1)},  # y missing
        "tup": types.MappingProxyType({}),  # container of another kind
        "d": [1],  # container of another kind
        "tensor": "text",  # not a tensor
        "absent": 1,  # not in the checkpoint
    }
    p = saved.plan(into)
    assert sorted(p.problems) == sorted(
        [
            ("w", "shape [2, 3] in the checkpoint, [3, 2] in the target"),
            ("b", "dtype F32 in the checkpoint, F64 in the target"),
            ("i", "dtype I64 in the checkpoint, numpy complex128 in the target"),
            ("both", "dtype F32 in the checkpoint, F16 in the target"),
            ("both", "shape [4] in the checkpoint, [2, 2] in the target"),
            ("nested/y", "not in the checkpoint"),
            ("tup", "the checkpoint holds a tuple here, found mappingproxy"),
            ("d", "the checkpoint holds a dict here, found list"),
            ("tensor", "the checkpoint holds a tensor here, found str"),
            ("absent", "not in the checkpoint"),
        ]
    )


def test_missing_keys_use_escaped_paths_and_key_types() -> None:
    saved = Saved({0: f32(1), "a/b": {"~": f32(1)}})
    p = saved.plan({"0": np.zeros(1, dtype=np.float32), "a/b": {"~": None, "/": 1}})
    assert sorted(p.problems) == [
        ("0", "not in the checkpoint"),
        ("a~1b/~1", "not in the checkpoint"),
    ]


def test_mutable_list_of_another_length_is_replaced_whole() -> None:
    saved = Saved({"hist": [1.0, 0.5, 0.25], "ws": [f32(2), f32(2, start=2)]})
    hist = [9.0]
    ws = [np.zeros(2, dtype=np.float32)]
    p = saved.plan({"hist": hist, "ws": ws})
    assert p.problems == []
    assert p.inplace == []  # no element-wise matching when lengths differ
    assert p.fresh == {"ws/0", "ws/1"}
    assert hist == [9.0]  # not yet
    out = saved.execute(p)
    assert out["hist"] is hist
    assert hist == [1.0, 0.5, 0.25]
    assert out["ws"] is ws
    assert len(ws) == 2
    np.testing.assert_array_equal(ws[1], f32(2, start=2))


def test_list_of_same_length_is_matched_element_wise() -> None:
    saved = Saved({"l": [f32(2, start=3), 4, "s"]})
    a = np.zeros(2, dtype=np.float32)
    lst = [a, 0, "old"]
    p = saved.plan({"l": lst})
    assert p.problems == []
    assert [ref for ref, _, _ in p.inplace] == ["l/0"]
    saved.execute(p)
    assert lst[0] is a
    np.testing.assert_array_equal(a, f32(2, start=3))
    assert lst[1:] == [4, "s"]


def test_tuple_of_another_length_is_replaced_where_its_slot_allows() -> None:
    saved = Saved({"t": (f32(1, start=4), f32(1))})
    into = {"t": (np.zeros(1, dtype=np.float32),)}
    p = saved.plan(into)
    assert p.problems == []
    saved.execute(p)
    assert type(into["t"]) is tuple and len(into["t"]) == 2
    np.testing.assert_array_equal(into["t"][0], [4.0])
    # At the root, or in a read-only mapping, nothing can take a new tuple.
    saved = Saved((f32(1), f32(1)))
    p = saved.plan((np.zeros(1, dtype=np.float32),))
    assert p.problems == [("", "2 items in the checkpoint, 1 in the target")]
    saved = Saved({"m": {"t": (f32(1), f32(1))}})
    p = saved.plan({"m": types.MappingProxyType({"t": (np.zeros(1, dtype=np.float32),)})})
    assert p.problems == [("m/t", "cannot assign into a mappingproxy")]


def test_tuple_of_same_length_fills_tensors_and_checks_values() -> None:
    saved = Saved({"t": (f32(2, start=1), 3, "same")})
    a = np.zeros(2, dtype=np.float32)
    ok = (a, 3, "same")
    p = saved.plan({"t": ok})
    assert p.problems == []
    out = saved.execute(p)
    assert out["t"] is ok  # nothing differs: the same tuple
    np.testing.assert_array_equal(a, f32(2, start=1))

    # A tuple is an immutable value: in a dict (or list) slot it is replaced by a new one, with
    # the arrays in it still filled in place (a config's betas=(0.9, 0.999), say).
    into = {"t": (a, 4, "other")}
    p = saved.plan(into)
    assert p.problems == []
    saved.execute(p)
    assert into["t"] == (a, 3, "same") and into["t"][0] is a
    # Tuples in tuples are remade from the inside out.
    saved = Saved({"t": ((f32(2), 3), "same")})
    into = {"t": ((a, 4), "same")}
    saved.execute(saved.plan(into))
    assert into["t"] == ((a, 3), "same")
    # Where no slot can take a new tuple (the root, a read-only mapping), each difference is
    # reported where it is.
    p = Saved({"m": {"t": ((f32(2), 3), "x")}}).plan(
        {"m": types.MappingProxyType({"t": ((a, 4), "y")})}
    )
    assert sorted(p.problems) == [
        ("m/t/0/1", "cannot assign into a tuple"),
        ("m/t/1", "cannot assign into a tuple"),
    ]
    p = Saved((f32(2), 3, "same")).plan((a, 4, "other"))
    assert sorted(p.problems) == [
        ("1", "cannot assign into a tuple"),
        ("2", "cannot assign into a tuple"),
    ]


def test_namedtuple_is_remade_as_its_own_type() -> None:
    import collections

    Betas = collections.namedtuple("Betas", "b1 b2")
    saved = Saved({"betas": Betas(0.8, 0.9)})
    into = {"betas": Betas(0.9, 0.999)}
    saved.execute(saved.plan(into))
    assert type(into["betas"]) is Betas and into["betas"] == (0.8, 0.9)


def test_read_only_mapping_accepts_tensors_but_not_values() -> None:
    saved = Saved({"m": {"w": f32(2), "n": 1}})
    w = np.zeros(2, dtype=np.float32)
    p = saved.plan({"m": types.MappingProxyType({"w": w})})
    assert p.problems == []
    p = saved.plan({"m": types.MappingProxyType({"w": w, "n": 0})})
    assert p.problems == [("m/n", "cannot assign into a mappingproxy")]


def test_read_only_mapping_is_treated_like_a_tuple() -> None:
    # A tuple accepts nested containers that are filled in place and plain values that already
    # equal the saved ones (nothing needs assigning); a read-only mapping must do the same.
    saved = Saved({"t": ({"x": f32(2, start=1)}, 1), "m": {"sub": {"x": f32(2, start=5)}, "n": 1}})
    tx, mx = np.zeros(2, dtype=np.float32), np.zeros(2, dtype=np.float32)
    into = {"t": ({"x": tx}, 1), "m": types.MappingProxyType({"sub": {"x": mx}, "n": 1})}
    p = saved.plan(into)
    assert p.problems == []
    saved.execute(p)
    np.testing.assert_array_equal(tx, [1.0, 2.0])
    np.testing.assert_array_equal(mx, [5.0, 6.0])


@pytest.mark.parametrize("root", [5, "s", None, 1.5, b"x", [1]], ids=repr)
def test_plain_values_at_the_root_are_reported(root: Any) -> None:
    saved = Saved(root)
    if isinstance(root, list):
        # A list of plain values is a container; its items can be assigned.
        target: list[Any] = [0]
        p = saved.plan(target)
        assert p.problems == []
        assert saved.execute(p) is target
        assert target == [1]
        return
    p = saved.plan(object())
    assert p.problems == [("", "a plain value cannot be restored in place; use sp.load()")]


def test_root_tensor_into_an_array() -> None:
    saved = Saved(f32(2, 2, start=5))
    target = np.zeros((2, 2), dtype=np.float32)
    p = saved.plan(target)
    assert p.problems == []
    assert saved.execute(p) is target
    np.testing.assert_array_equal(target, f32(2, 2, start=5))
    p = saved.plan(np.zeros(3, dtype=np.float32))
    assert p.problems == [("", "shape [2, 2] in the checkpoint, [3] in the target")]


def test_plan_works_on_a_selected_subtree() -> None:
    saved = Saved({"a": {"x": f32(1, start=4), "y": f32(1)}, "b": f32(1)})
    node = tree.select(saved.flat.tree, ["a/x"])
    x = np.zeros(1, dtype=np.float32)
    p = saved.plan({"a": {"x": x}}, node=node)
    assert p.problems == []
    assert p.refs == {"a/x"}
    p2 = saved.plan({"a": {"x": x, "y": np.zeros(1, dtype=np.float32)}}, node=node)
    assert p2.problems == [("a/y", "not in the checkpoint")]


# ---------------------------------------------------------------------------------------------
# complete mode (inside a Stateful)
# ---------------------------------------------------------------------------------------------


def test_stateful_gets_the_full_saved_subtree() -> None:
    saved = Saved(
        {"obj": Box({"n": 5, "w": f32(3, start=1), "extra": [1, f32(1, start=8)], 7: "int key"})}
    )
    w = np.zeros(3, dtype=np.float32)
    box = Box({"n": 0, "w": w, "only_here": 1})
    p = saved.plan({"obj": box})
    assert p.problems == []  # keys only the template has are not problems for a plain Stateful
    assert [(ref, t is w) for ref, t, _ in p.inplace] == [("obj/w", True)]
    assert p.fresh == {"obj/extra/1"}
    assert box.loaded == []  # nothing happens while planning

    out = saved.execute(p)
    assert out["obj"] is box
    assert len(box.loaded) == 1
    got = box.loaded[0]
    assert list(got) == ["n", "w", "extra", 7]
    assert got["n"] == 5
    assert got["w"] is w
    np.testing.assert_array_equal(w, f32(3, start=1))
    assert got["extra"][0] == 1
    np.testing.assert_array_equal(got["extra"][1], f32(1, start=8))
    assert got[7] == "int key"


def test_stateful_at_the_root_and_template_mismatches() -> None:
    saved = Saved(Box({"w": f32(2, 2), "v": 1}))
    # A user Stateful whose array does not fit gets the saved one fresh: its load_state_dict
    # decides (torch modules and optimizers are checked up front instead, see below).
    template = np.zeros((2, 3), dtype=np.float16)
    box = Box({"w": template})
    p = saved.plan(box)
    assert p.problems == []
    assert saved.execute(p) is box
    w = box.loaded[0]["w"]
    assert w is not template and (w.dtype, w.shape) == (np.float32, (2, 2))
    assert (template == 0).all()

    box = Box({"w": np.zeros((2, 2), dtype=np.float32)})
    p = saved.plan(box)
    assert saved.execute(p) is box
    assert box.loaded[0]["v"] == 1


def test_stateful_lists_of_another_length_mix_in_place_and_fresh() -> None:
    saved = Saved(Box({"hist": [f32(1, start=1), f32(1, start=2), 3]}))
    first = np.zeros(1, dtype=np.float32)
    box = Box({"hist": [first]})
    p = saved.plan(box)
    assert p.problems == []
    saved.execute(p)
    hist = box.loaded[0]["hist"]
    assert type(hist) is list
    assert hist[0] is first
    np.testing.assert_array_equal(first, [1.0])
    np.testing.assert_array_equal(hist[1], [2.0])
    assert hist[2] == 3


def test_stateful_saved_as_plain_dict_restores_into_dict_target() -> None:
    saved = Saved({"obj": Box({"w": f32(2, start=1), "n": 2})})
    w = np.zeros(2, dtype=np.float32)
    target = {"obj": {"w": w}}
    p = saved.plan(target)
    assert p.problems == []
    out = saved.execute(p)
    np.testing.assert_array_equal(w, [1.0, 2.0])
    assert out["obj"] == {"w": w}


def test_nested_stateful_is_loaded_innermost_first() -> None:
    order: list[str] = []

    class Tracked(Box):
        def __init__(self, name: str, state: Any) -> None:
            super().__init__(state)
            self.name = name

        def load_state_dict(self, d: Any) -> None:
            order.append(self.name)
            super().load_state_dict(d)

    saved = Saved({"outer": Tracked("o", {"inner": Tracked("i", {"x": 1}), "y": 2})})
    inner = Tracked("i", {"x": 0})
    outer = Tracked("o", {"inner": inner, "y": 0})
    p = saved.plan({"outer": outer})
    assert p.problems == []
    saved.execute(p)
    assert order == ["i", "o"]
    assert inner.loaded == [{"x": 1}]
    assert outer.loaded[0]["y"] == 2
    assert outer.loaded[0]["inner"] is inner


# ---------------------------------------------------------------------------------------------
# torch
# ---------------------------------------------------------------------------------------------


@pytest.mark.torch
def test_module_is_filled_in_place_and_loaded() -> None:
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    src = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3))
    saved = Saved({"model": src, "step": 4})
    dst = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3))
    params = {k: v for k, v in dst.state_dict().items()}
    ptrs = {k: v.data_ptr() for k, v in params.items()}
    p = saved.plan({"model": dst, "step": 0})
    assert p.problems == []
    assert p.fresh == set()
    assert {ref for ref, _, _ in p.inplace} == {f"model/{k}" for k in params}
    out = saved.execute(p)
    assert out["model"] is dst
    assert out["step"] == 4
    for k, v in dst.state_dict().items():
        assert v.data_ptr() == ptrs[k]  # filled in place, not replaced
        assert torch.equal(v, src.state_dict()[k])


@pytest.mark.torch
def test_module_strict_keys_missing_and_unexpected_both_reported() -> None:
    torch = pytest.importorskip("torch")
    saved = Saved({"m": torch.nn.Linear(2, 3)})
    p = saved.plan({"m": torch.nn.Linear(2, 3, bias=False)})
    assert p.problems == [("m/bias", "unexpected key: not in the target")]

    saved = Saved({"m": torch.nn.Linear(2, 3, bias=False)})
    p = saved.plan({"m": torch.nn.Linear(2, 3)})
    assert p.problems == [("m/bias", "not in the checkpoint")]

    p = Saved({"m": torch.nn.Linear(2, 3)}).plan({"m": torch.nn.Sequential(torch.nn.Linear(2, 4))})
    assert sorted(p.problems) == [
        ("m/0.bias", "not in the checkpoint"),
        ("m/0.weight", "not in the checkpoint"),
        ("m/bias", "unexpected key: not in the target"),
        ("m/weight", "unexpected key: not in the target"),
    ]


@pytest.mark.torch
def test_module_shape_and_dtype_mismatch() -> None:
    torch = pytest.importorskip("torch")
    saved = Saved({"m": torch.nn.Linear(2, 3)})
    p = saved.plan({"m": torch.nn.Linear(2, 4).to(torch.float64)})
    assert sorted(p.problems) == [
        ("m/bias", "dtype F32 in the checkpoint, F64 in the target"),
        ("m/bias", "shape [3] in the checkpoint, [4] in the target"),
        ("m/weight", "dtype F32 in the checkpoint, F64 in the target"),
        ("m/weight", "shape [3, 2] in the checkpoint, [4, 2] in the target"),
    ]


@pytest.mark.torch
def test_optimizer_state_is_passed_whole() -> None:
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    saved = Saved({"opt": opt})

    model2 = torch.nn.Linear(2, 1)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.5, momentum=0.9)
    p = saved.plan({"opt": opt2})
    assert p.problems == []  # the fresh optimizer has no momentum buffers yet: not a problem
    assert p.fresh == {"opt/state/0/momentum_buffer", "opt/state/1/momentum_buffer"}
    saved.execute(p)
    assert opt2.param_groups[0]["lr"] == 0.1
    buf = opt2.state_dict()["state"][0]["momentum_buffer"]
    assert torch.equal(buf, opt.state_dict()["state"][0]["momentum_buffer"])


def test_read_only_target_array_is_a_problem() -> None:
    saved = Saved({"w": f32(2)})
    target = np.zeros(2, dtype=np.float32)
    target.setflags(write=False)
    p = saved.plan({"w": target})
    assert p.problems == [("w", "the target array is read-only")]


@pytest.mark.torch
def test_torch_optimizer_state_is_checked_up_front() -> None:
    # torch's Optimizer.load_state_dict does not compare state shapes, so savepoint does.
    torch = pytest.importorskip("torch")

    def stepped(out: int) -> Any:
        model = torch.nn.Linear(2, out)
        opt = torch.optim.Adam(model.parameters())
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
        return opt

    saved = Saved({"opt": stepped(3)})
    target = stepped(4)
    before = target.state_dict()["state"][0]["exp_avg"].clone()
    p = saved.plan({"opt": target})
    assert ("opt/state/0/exp_avg", "shape [3, 2] in the checkpoint, [4, 2] in the target") in (
        p.problems
    )
    assert torch.equal(target.state_dict()["state"][0]["exp_avg"], before)
