"""OptimizerState: the data type, its Stateful contract, and exact torch.optim round trips."""

from __future__ import annotations

import copy
import math
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import savepoint as sp
from savepoint.errors import OptimizerStateError
from savepoint.state.optimizer import (
    OptimizerState,
    optimizer_state_from_torch,
    optimizer_state_to_torch,
)

# ---------------------------------------------------------------------------------------------
# the data type
# ---------------------------------------------------------------------------------------------


def _adam_state() -> OptimizerState:
    s = OptimizerState("Adam")
    s.set_scalar("lr", 1e-3)
    s.set_scalar("step.0", 7)
    s.set_buffer("m.0", np.arange(6, dtype=np.float32).reshape(2, 3))
    s.set_buffer("v.0", [0.5, 0.25, 0.125, 1.0, 2.0, 4.0])
    return s


def test_set_get_mirror_the_seed() -> None:
    s = _adam_state()
    assert s.optimizer_type == "Adam"
    assert s.get_scalar("lr") == 1e-3 and s.get_scalar("step.0") == 7.0
    assert isinstance(s.get_scalar("step.0"), float)
    assert s.get_scalar("missing") is None and s.get_buffer("missing") is None
    m = s.get_buffer("m.0")
    assert m is not None and m.dtype == np.float64 and m.shape == (6,)  # flattened
    assert m.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert s.get_buffer("m.0") is m  # the stored array, not a copy


def test_set_buffer_copies_its_input() -> None:
    data = np.ones(3)
    s = OptimizerState("SGD")
    s.set_buffer("momentum.0", data)
    data[0] = 5.0
    buf = s.get_buffer("momentum.0")
    assert buf is not None and buf[0] == 1.0


@pytest.mark.parametrize(
    "value",
    [
        np.array([1, -2, 2**53], dtype=np.int64),
        np.array([3, 2**53], dtype=np.uint64),
        np.array([1.5, -0.0, np.inf], dtype=np.float16),
        np.array([1.5, np.nan, 3e38], dtype=ml_dtypes.bfloat16),
        np.array([1e-45, 3.4e38], dtype=np.float32),
        [1, 2.5],
        np.float32(2.5),
    ],
)
def test_buffers_accept_exactly_representable_values(value: Any) -> None:
    s = OptimizerState("Adam")
    s.set_buffer("b", value)
    buf = s.get_buffer("b")
    assert buf is not None and buf.dtype == np.float64
    expected = np.asarray(value).astype(np.float64).reshape(-1)
    assert np.array_equal(buf, expected, equal_nan=True)


@pytest.mark.parametrize(
    ("value", "error"),
    [
        (np.array([2**53 + 1], dtype=np.int64), ValueError),
        (np.array([2**63 - 1], dtype=np.int64), ValueError),
        (np.array([2**64 - 1], dtype=np.uint64), ValueError),
        (np.array([True, False]), TypeError),
        (np.array([1 + 2j]), TypeError),
        (["a", "b"], TypeError),
        ([[1, 2], [3]], TypeError),
    ],
)
def test_buffers_refuse_lossy_or_non_real_values(value: Any, error: type[Exception]) -> None:
    s = OptimizerState("Adam")
    with pytest.raises(error, match="buffer 'b'"):
        s.set_buffer("b", value)
    assert s.get_buffer("b") is None


@pytest.mark.parametrize(
    ("value", "error"),
    [(True, TypeError), (1 + 0j, TypeError), ("0.1", TypeError), (2**53 + 1, ValueError)],
)
def test_scalars_must_be_real_numbers(value: Any, error: type[Exception]) -> None:
    with pytest.raises(error, match="scalar 'lr'"):
        OptimizerState("Adam", scalars={"lr": value})


def test_scalars_accept_numpy_and_non_finite() -> None:
    s = OptimizerState("Adam", scalars={"a": np.float32(0.5), "b": np.int64(3), "c": math.inf})
    s.set_scalar("d", np.array(2.0))
    s.set_scalar("e", math.nan)
    assert s.scalars == {"a": 0.5, "b": 3.0, "c": math.inf, "d": 2.0, "e": s.scalars["e"]}
    assert all(type(v) is float for v in s.scalars.values())


def test_names_must_be_non_empty_strings() -> None:
    with pytest.raises(TypeError):
        OptimizerState("Adam").set_scalar("", 1.0)
    with pytest.raises(TypeError):
        OptimizerState("Adam").set_buffer(3, [1.0])  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        OptimizerState("")


def test_equality() -> None:
    a, b = _adam_state(), _adam_state()
    assert a == b
    assert not a != b  # noqa: SIM202  (__ne__ falls back on __eq__)
    a.set_scalar("nan", math.nan)
    b.set_scalar("nan", math.nan)
    assert a == b  # NaN equals NaN here: the same state
    b.set_scalar("lr", 2e-3)
    assert a != b
    c = _adam_state()
    c.buffers["m.0"] = c.buffers["m.0"] + 1
    assert c != _adam_state()
    d = _adam_state()
    d.optimizer_type = "AdamW"
    assert d != _adam_state()
    e = _adam_state()
    del e.buffers["v.0"]
    assert e != _adam_state()
    assert _adam_state() != "Adam"
    with pytest.raises(TypeError):
        hash(_adam_state())
    assert "Adam" in repr(a) and "buffers" in repr(a)


def test_state_dict_is_plain_data_with_live_buffers() -> None:
    s = _adam_state()
    d = s.state_dict()
    assert set(d) == {"optimizer_type", "scalars", "buffers"}
    assert d["optimizer_type"] == "Adam"
    assert d["scalars"] == {"lr": 1e-3, "step.0": 7.0}
    assert all(b.dtype == np.float64 and b.ndim == 1 for b in d["buffers"].values())
    assert d["buffers"]["m.0"] is s.buffers["m.0"]
    assert isinstance(s, sp.Stateful)


# ---------------------------------------------------------------------------------------------
# load_state_dict / validate_against
# ---------------------------------------------------------------------------------------------


def test_load_into_empty_state_of_same_type_accepts_any_names() -> None:
    src = _adam_state()
    dst = OptimizerState("Adam")
    dst.load_state_dict(src.state_dict())
    assert dst == src
    # The loaded state owns its buffers: changing the source does not reach it.
    src.buffers["m.0"][0] = 99.0
    assert dst.buffers["m.0"][0] == 0.0


def test_load_reports_every_problem_at_once_and_changes_nothing() -> None:
    dst = _adam_state()
    before = copy.deepcopy(dst)
    bad = {
        "optimizer_type": "SGD",
        "scalars": {"lr": 0.1, "extra": 1.0, "bad": True},
        "buffers": {"m.0": np.zeros(5), "momentum.0": np.zeros(6), "c": np.array([1j])},
        "surplus": 1,
    }
    with pytest.raises(OptimizerStateError) as excinfo:
        dst.load_state_dict(bad)
    err = excinfo.value
    text = str(err)
    assert isinstance(err, sp.IncompatibleCheckpointError) and isinstance(err, ValueError)
    for needle in (
        "unexpected key(s): 'surplus'",
        "scalar 'bad': bool is not a real number",
        "buffer 'c': dtype complex128",
        "optimizer type 'SGD' in the checkpoint, 'Adam' expected",
        "missing scalar(s): 'step.0'",
        "unexpected scalar(s): 'extra'",
        "missing buffer(s): 'v.0'",
        "unexpected buffer(s): 'momentum.0'",
        "buffer 'm.0' has 5 values in the checkpoint, 6 here",
    ):
        assert needle in text, (needle, text)
    assert len(err.problems) == 9
    assert dst == before


def test_non_strict_accepts_other_names_but_checks_type_and_sizes() -> None:
    dst = _adam_state()
    other = {"optimizer_type": "Adam", "scalars": {"lr": 0.5}, "buffers": {"w.0": [1.0]}}
    dst.load_state_dict(other, strict=False)
    assert dst.scalars == {"lr": 0.5} and list(dst.buffers) == ["w.0"]
    with pytest.raises(OptimizerStateError, match="optimizer type"):
        dst.load_state_dict({**other, "optimizer_type": "SGD"}, strict=False)
    with pytest.raises(OptimizerStateError, match="has 2 values in the checkpoint, 1 here"):
        dst.load_state_dict({**other, "buffers": {"w.0": [1.0, 2.0]}}, strict=False)


def test_validate_against() -> None:
    a = _adam_state()
    a.validate_against(_adam_state())
    a.validate_against(OptimizerState("Adam"))
    with pytest.raises(OptimizerStateError, match="'AdamW' expected"):
        a.validate_against(OptimizerState("AdamW"))
    b = _adam_state()
    b.set_buffer("v.0", np.zeros(2))
    assert a.problems_against(b) == ["buffer 'v.0' has 6 values in the checkpoint, 2 here"]


def test_load_converts_non_float64_buffers_and_numbers() -> None:
    dst = OptimizerState("Adam")
    dst.load_state_dict(
        {
            "optimizer_type": "Adam",
            "scalars": {"lr": np.float32(0.25), "step.0": np.int64(4)},
            "buffers": {"m.0": np.array([[1, 2]], dtype=np.int32)},
        }
    )
    assert dst.scalars == {"lr": 0.25, "step.0": 4.0}
    m = dst.get_buffer("m.0")
    assert m is not None and m.dtype == np.float64 and m.tolist() == [1.0, 2.0]


@pytest.mark.parametrize("bad", [None, [], {"optimizer_type": 3, "scalars": [], "buffers": {}}])
def test_from_state_dict_rejects_malformed(bad: Any) -> None:
    with pytest.raises(OptimizerStateError):
        OptimizerState.from_state_dict(bad)


def test_error_survives_pickle() -> None:
    with pytest.raises(OptimizerStateError) as excinfo:
        _adam_state().load_state_dict({"optimizer_type": "SGD", "scalars": {}, "buffers": {}})
    copy_ = pickle.loads(pickle.dumps(excinfo.value))
    assert type(copy_) is OptimizerStateError
    assert str(copy_) == str(excinfo.value) and copy_.problems == excinfo.value.problems


# ---------------------------------------------------------------------------------------------
# through sp.save / sp.load
# ---------------------------------------------------------------------------------------------


def test_save_load_tree_round_trip(ckpt: Path) -> None:
    s = _adam_state()
    s.set_scalar("inf", math.inf)
    sp.save(ckpt, {"optimizer": s})
    info = sp.inspect(ckpt)
    assert {t.dtype for t in info.tensors} == {"F64"}
    tree = sp.load(ckpt)
    assert tree["optimizer"]["optimizer_type"] == "Adam"
    assert OptimizerState.from_state_dict(tree["optimizer"]) == s


def test_save_load_into_fills_existing_buffers_in_place(ckpt: Path) -> None:
    s = _adam_state()
    sp.save(ckpt, {"optimizer": s})
    target = _adam_state()
    target.buffers["m.0"][:] = -1.0
    target.set_scalar("lr", 0.0)
    arrays = dict(target.buffers)
    sp.load(ckpt, into={"optimizer": target})
    assert target == s
    assert all(target.buffers[k] is arrays[k] for k in arrays)  # read in place, no copies


def test_save_load_into_empty_state(ckpt: Path) -> None:
    s = _adam_state()
    sp.save(ckpt, s)
    target = OptimizerState("Adam")
    assert sp.load(ckpt, into=target) is target
    assert target == s


def test_load_into_state_of_another_type_fails_clearly(ckpt: Path) -> None:
    sp.save(ckpt, {"optimizer": _adam_state()})
    target = OptimizerState("SGD")
    with pytest.raises(sp.IncompatibleCheckpointError, match="'SGD' expected"):
        sp.load(ckpt, into={"optimizer": target})
    assert target.is_empty()


def test_load_into_state_with_other_sizes_fails_before_reading(ckpt: Path) -> None:
    sp.save(ckpt, {"optimizer": _adam_state()})
    target = _adam_state()
    target.set_buffer("m.0", np.zeros(4))
    with pytest.raises(sp.IncompatibleCheckpointError, match=r"m\.0"):
        sp.load(ckpt, into={"optimizer": target})
    m = target.get_buffer("m.0")
    assert m is not None and m.tolist() == [0.0] * 4


# ---------------------------------------------------------------------------------------------
# torch converters
# ---------------------------------------------------------------------------------------------


def _torch() -> Any:
    return pytest.importorskip("torch")


def test_importing_savepoint_state_modules_does_not_import_torch() -> None:
    code = (
        "import sys, savepoint, savepoint.state.optimizer, savepoint.state.rng, "
        "savepoint.state.data; assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_float32_through_float64_is_exact() -> None:
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**32, size=200_000, dtype=np.uint64).astype(np.uint32)
    values = bits.view(np.float32)
    values = values[~np.isnan(values)]  # NaN payloads are not values
    specials = np.array([0.0, -0.0, np.inf, -np.inf, 1e-45, -1e-45, 3.4028235e38], np.float32)
    values = np.concatenate([values, specials])
    back = values.astype(np.float64).astype(np.float32)
    assert back.tobytes() == values.tobytes()


def _make(kind: str, **kw: Any) -> tuple[Any, Any]:
    t = _torch()
    model = t.nn.Sequential(t.nn.Linear(4, 8), t.nn.Tanh(), t.nn.Linear(8, 2))
    cls = {"Adam": t.optim.Adam, "AdamW": t.optim.AdamW, "SGD": t.optim.SGD}[kind]
    return model, cls(model.parameters(), **kw)


def _batches(n: int) -> list[tuple[Any, Any]]:
    t = _torch()
    g = t.Generator().manual_seed(1234)
    return [(t.randn(16, 4, generator=g), t.randn(16, 2, generator=g)) for _ in range(n)]


def _train(model: Any, opt: Any, batches: list[tuple[Any, Any]]) -> None:
    t = _torch()
    for x, y in batches:
        opt.zero_grad()
        t.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _assert_same_optimizer(a: Any, b: Any) -> None:
    t = _torch()
    sa, sb = a.state_dict(), b.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys()
    for i, entries in sa["state"].items():
        assert entries.keys() == sb["state"][i].keys()
        for key, value in entries.items():
            other = sb["state"][i][key]
            assert value.dtype == other.dtype and value.shape == other.shape, (i, key)
            assert t.equal(value, other), (i, key)


def _assert_same_params(a: Any, b: Any) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert p.dtype == q.dtype
        assert p.detach().numpy().tobytes() == q.detach().numpy().tobytes(), name


CONFIGS = [
    ("Adam", {"lr": 1e-2}),
    ("Adam", {"lr": 1e-2, "amsgrad": True, "weight_decay": 0.1}),
    ("AdamW", {"lr": 1e-2, "amsgrad": False}),
    ("AdamW", {"lr": 1e-2, "amsgrad": True}),
    ("SGD", {"lr": 0.05}),
    ("SGD", {"lr": 0.05, "momentum": 0.9, "dampening": 0.1, "weight_decay": 1e-3}),
    ("SGD", {"lr": 0.05, "momentum": 0.9, "nesterov": True}),
]


@pytest.mark.torch
@pytest.mark.parametrize("how", ["tree", "into"])
@pytest.mark.parametrize(("kind", "kw"), CONFIGS, ids=[f"{k}-{kw}" for k, kw in CONFIGS])
def test_torch_round_trip_continues_bit_identically(
    ckpt: Path, kind: str, kw: dict[str, Any], how: str
) -> None:
    t = _torch()
    batches = _batches(8)
    t.manual_seed(0)
    model, opt = _make(kind, **kw)
    _train(model, opt, batches[:3])

    state = optimizer_state_from_torch(opt)
    assert state.optimizer_type == kind
    n_params = len(list(model.parameters()))
    if kind == "SGD":
        assert state.get_scalar("momentum") == kw.get("momentum", 0)
        expected = {f"momentum.{i}" for i in range(n_params)} if kw.get("momentum") else set()
        assert set(state.buffers) == expected
    else:
        assert state.get_scalar("beta1") == 0.9 and state.get_scalar("beta2") == 0.999
        assert all(state.get_scalar(f"step.{i}") == 3.0 for i in range(n_params))
        names = {"m", "v"} | ({"max_v"} if kw.get("amsgrad") else set())
        assert set(state.buffers) == {f"{n}.{i}" for n in names for i in range(n_params)}
    assert all(b.dtype == np.float64 for b in state.buffers.values())
    sp.save(ckpt, {"model": model, "optimizer": state})

    t.manual_seed(99)  # a different initialisation, overwritten by the restore
    model2, opt2 = _make(kind, **{k: v for k, v in kw.items() if k != "amsgrad"})
    if how == "tree":
        tree = sp.load(ckpt)
        model2.load_state_dict(tree["model"])
        restored = OptimizerState.from_state_dict(tree["optimizer"])
    else:
        restored = OptimizerState(kind)
        sp.load(ckpt, into={"model": model2, "optimizer": restored})
    assert restored == state
    optimizer_state_to_torch(restored, opt2)
    _assert_same_optimizer(opt, opt2)
    assert opt2.param_groups[0]["amsgrad" if kind != "SGD" else "nesterov"] is kw.get(
        "amsgrad" if kind != "SGD" else "nesterov", False
    )

    _train(model, opt, batches[3:])
    _train(model2, opt2, batches[3:])
    _assert_same_params(model, model2)
    _assert_same_optimizer(opt, opt2)
    # The optimizer never shares memory with the state it was restored from.
    assert restored == state


@pytest.mark.torch
def test_torch_multiple_param_groups_and_scheduler(ckpt: Path) -> None:
    t = _torch()

    def make() -> tuple[Any, Any, Any]:
        model = t.nn.Sequential(t.nn.Linear(4, 8), t.nn.Tanh(), t.nn.Linear(8, 2))
        opt = t.optim.AdamW(
            [
                {"params": model[0].parameters()},
                {"params": model[2].parameters(), "lr": 3e-2, "weight_decay": 0.0},
            ],
            lr=1e-2,
        )
        sched = t.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return model, opt, sched

    batches = _batches(7)
    model, opt, sched = make()
    for b in batches[:3]:
        _train(model, opt, [b])
        sched.step()
    state = optimizer_state_from_torch(opt)
    # group 0 under plain names, group 1 with ".g1"; parameters numbered across groups
    assert state.get_scalar("lr") == opt.param_groups[0]["lr"] == 5e-3
    assert state.get_scalar("lr.g1") == opt.param_groups[1]["lr"] == 1.5e-2
    assert state.get_scalar("initial_lr.g1") == 3e-2
    assert state.get_scalar("weight_decay.g1") == 0.0
    assert state.get_scalar("group_size") == 2.0 and state.get_scalar("group_size.g1") == 2.0
    assert {f"m.{i}" for i in range(4)} <= set(state.buffers)
    sp.save(ckpt, {"model": model, "optimizer": state, "scheduler": sched})

    model2, opt2, sched2 = make()
    restored = OptimizerState("AdamW")
    sp.load(ckpt, into={"model": model2, "optimizer": restored, "scheduler": sched2})
    optimizer_state_to_torch(restored, opt2)
    _assert_same_optimizer(opt, opt2)
    for b in batches[3:]:
        for m, o, s in ((model, opt, sched), (model2, opt2, sched2)):
            _train(m, o, [b])
            s.step()
    _assert_same_params(model, model2)
    _assert_same_optimizer(opt, opt2)


@pytest.mark.torch
def test_torch_parameters_without_state_and_other_dtypes() -> None:
    t = _torch()
    frozen = t.nn.Parameter(t.ones(3))
    live = t.nn.Parameter(t.ones(2, 2, dtype=t.bfloat16))
    lr = t.tensor(0.5)
    opt = t.optim.Adam([frozen, live], lr=lr, foreach=False)
    live.grad = t.full((2, 2), 0.3, dtype=t.bfloat16)
    opt.step()
    state = optimizer_state_from_torch(opt)
    assert set(state.buffers) == {"m.1", "v.1"}  # parameter 0 never had a gradient
    assert state.get_scalar("step.1") == 1.0 and state.get_scalar("step.0") is None
    assert state.get_scalar("lr") == 0.5

    frozen2 = t.nn.Parameter(t.ones(3))
    live2 = t.nn.Parameter(live.detach().clone())
    opt2 = t.optim.Adam([frozen2, live2], lr=t.tensor(0.1), foreach=False)
    optimizer_state_to_torch(state, opt2)
    _assert_same_optimizer(opt, opt2)
    assert isinstance(opt2.param_groups[0]["lr"], t.Tensor)
    assert opt2.param_groups[0]["lr"].item() == 0.5
    assert opt2.state[live2]["exp_avg"].dtype == t.bfloat16
    for o, p in ((opt, live), (opt2, live2)):
        p.grad = t.full((2, 2), -0.7, dtype=t.bfloat16)
        o.step()
    assert t.equal(live, live2)


@pytest.mark.torch
def test_torch_unsupported_optimizer_names_class_and_supported() -> None:
    t = _torch()
    model = t.nn.Linear(2, 2)
    with pytest.raises(sp.UnsupportedStateError) as excinfo:
        optimizer_state_from_torch(t.optim.RMSprop(model.parameters()))
    text = str(excinfo.value)
    assert "torch.optim.rmsprop.RMSprop" in text
    assert all(n in text for n in ("torch.optim.Adam", "torch.optim.AdamW", "torch.optim.SGD"))

    class MyAdam(t.optim.Adam):  # type: ignore[misc]
        pass

    with pytest.raises(sp.UnsupportedStateError, match="MyAdam"):
        optimizer_state_to_torch(OptimizerState("Adam"), MyAdam(model.parameters()))


@pytest.mark.torch
def test_torch_restore_reports_every_problem_and_leaves_optimizer_alone() -> None:
    t = _torch()
    model, opt = _make("Adam", lr=1e-2)
    _train(model, opt, _batches(2))
    state = optimizer_state_from_torch(opt)
    state.optimizer_type = "AdamW"
    state.set_buffer("m.0", np.zeros(3))  # parameter 0 has 32 values
    del state.scalars["step.1"]
    state.set_scalar("eps.g1", 1e-6)  # a second group the optimizer does not have
    state.set_scalar("mystery", 2.0)  # a hyperparameter torch Adam lacks
    state.set_scalar("harmless", 0.0)  # an unknown switch that is off: ignored
    state.set_buffer("q.0", [1.0])
    del state.scalars["lr"]

    model2 = t.nn.Sequential(t.nn.Linear(4, 8), t.nn.Tanh(), t.nn.Linear(8, 2))
    opt2 = t.optim.Adam(model2.parameters(), lr=7e-3)
    with pytest.raises(OptimizerStateError) as excinfo:
        optimizer_state_to_torch(state, opt2)
    text = str(excinfo.value)
    for needle in (
        "the state is for 'AdamW', the optimizer is 'Adam'",
        "the state has 2 param group(s) (indices [0, 1]), the optimizer 1",
        "param group 0 lacks 'lr'",
        "hyperparameter 'mystery'=2 is unknown",
        "unknown buffer 'q.0'",
        "buffer m.0 has 3 values, parameter 0 has 32",
        "parameter 1 lacks step.1",
    ):
        assert needle in text, (needle, text)
    assert "harmless" not in text
    assert opt2.state_dict()["state"] == {} and opt2.param_groups[0]["lr"] == 7e-3


@pytest.mark.torch
def test_torch_restore_into_other_parameters_fails() -> None:
    t = _torch()
    model, opt = _make("SGD", lr=0.1, momentum=0.5)
    _train(model, opt, _batches(1))
    state = optimizer_state_from_torch(opt)
    other = t.optim.SGD(t.nn.Linear(4, 3).parameters(), lr=0.1, momentum=0.5)
    with pytest.raises(
        OptimizerStateError, match="param group 0 has 2 parameters, the state gives 4"
    ):
        optimizer_state_to_torch(state, other)
    bad = OptimizerState("SGD", scalars={**state.scalars, "step.0": 1.0})
    with pytest.raises(OptimizerStateError, match=r"unknown scalar 'step\.0' for SGD"):
        optimizer_state_to_torch(bad, opt)


@pytest.mark.torch
def test_torch_amsgrad_needs_max_v() -> None:
    model, opt = _make("Adam", lr=1e-2, amsgrad=True)
    _train(model, opt, _batches(1))
    state = optimizer_state_from_torch(opt)
    del state.buffers["max_v.2"]
    _, opt2 = _make("Adam", lr=1e-2)
    with pytest.raises(OptimizerStateError, match=r"parameter 2 lacks max_v\.2"):
        optimizer_state_to_torch(state, opt2)


def test_load_state_dict_accepts_an_optimizer_state_as_the_seed_does() -> None:
    # Seed 004: Stateful::load_state_dict(&OptimizerState), with the same validation.
    saved = OptimizerState("Adam", {"lr": 0.001, "t": 3.0}, {"m.0": np.arange(3.0)})
    target = OptimizerState("Adam", {"lr": 0.1, "t": 0.0}, {"m.0": np.zeros(3)})
    target.load_state_dict(saved)
    assert target == saved
    assert target.buffers["m.0"] is not saved.buffers["m.0"]  # copied, never shared
    saved.buffers["m.0"][0] = 99.0
    assert target.buffers["m.0"][0] == 0.0
    with pytest.raises(OptimizerStateError, match="optimizer type 'SGD'"):
        target.load_state_dict(OptimizerState("SGD", {"lr": 0.1}))
    with pytest.raises(OptimizerStateError, match="has 2 values in the checkpoint, 3 here"):
        target.load_state_dict(OptimizerState("Adam", {"lr": 0.1, "t": 1.0}, {"m.0": [1, 2]}))
    assert target.scalars == {"lr": 0.001, "t": 3.0}  # unchanged by the refused loads
