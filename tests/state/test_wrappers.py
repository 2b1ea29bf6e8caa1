"""torch.compile / DDP / DataParallel wrappers: saved as the model they wrap, loaded into either form.

Unit tests of the key alignment (no torch), then planning against real wrappers (``DataParallel``
and ``torch.compile`` need no process group; DDP is exercised end to end in
tests/test_checkpoint_torch.py, in a child process with a one-rank gloo group).
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest

from savepoint.state import tree, wrappers
from state.test_restore import Saved, f32

# ---------------------------------------------------------------------------------------------
# key alignment
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("keys", "prefix"),
    [
        (["module.a", "module.b.c"], "module."),
        (["_orig_mod.module.a", "_orig_mod.module.b"], "_orig_mod.module."),
        (["module._orig_mod.a"], "module._orig_mod."),
        (["module.a", "b"], ""),  # not every key: not a wrapper
        (["module."], ""),  # a key that is only the prefix keeps it
        (["module.module.x", "module.y"], "module."),
        ([], ""),
        (["module.a", 3], ""),  # int keys: not a state dict of a wrapped model
        (["modules.a"], ""),
    ],
)
def test_common_prefix(keys: list[Any], prefix: str) -> None:
    assert wrappers.common_prefix(keys) == prefix


def test_align_renames_only_a_uniform_prefix_change() -> None:
    plain = ["w", "b"]
    ddp = ["module.w", "module.b"]
    compiled = ["_orig_mod.w", "_orig_mod.b"]
    assert wrappers.align(plain, plain, exact=True) is None  # already fits
    assert wrappers.align(ddp, plain, exact=True) == {"module.w": "w", "module.b": "b"}
    assert wrappers.align(plain, ddp, exact=True) == {"w": "module.w", "b": "module.b"}
    assert wrappers.align(compiled, ddp, exact=True) == {
        "_orig_mod.w": "module.w",
        "_orig_mod.b": "module.b",
    }
    # Stripping must make the sets agree; otherwise nothing is guessed.
    assert wrappers.align(ddp, ["w", "b", "extra"], exact=True) is None
    assert wrappers.align(["module.w", "b"], plain, exact=True) is None
    # Partial: the target may cover part of what was saved.
    assert wrappers.align(ddp, ["w"], exact=False) == {"module.w": "w", "module.b": "b"}
    assert wrappers.align(ddp, ["w"], exact=True) is None
    assert wrappers.align(["module.w", 0], ["w"], exact=False) is None


def test_unwrap_leaves_other_objects_alone() -> None:
    obj = object()
    assert wrappers.unwrap(obj) is obj
    assert wrappers.unwrap({"module": 1}) == {"module": 1}


def test_plain_tensor_dict_with_wrapper_prefix_restores_into_bare_dict() -> None:
    # A user's ddp.state_dict() saved as a plain dict, restored into a bare model's dict of arrays.
    saved = Saved({"model": {"module.w": f32(2, start=1), "module.b": f32(1, start=5)}, "n": 1})
    w, b = np.zeros(2, dtype=np.float32), np.zeros(1, dtype=np.float32)
    into = {"model": {"w": w, "b": b}, "n": 0}
    p = saved.plan(into)
    assert p.problems == []
    assert sorted(key for _, _, key in p.inplace) == ["model/b", "model/w"]
    saved.execute(p)
    np.testing.assert_array_equal(w, [1.0, 2.0])
    np.testing.assert_array_equal(b, [5.0])
    assert set(into["model"]) == {"w", "b"}  # no prefixed keys were added


def test_prefixed_keys_that_do_not_line_up_are_reported_not_guessed() -> None:
    saved = Saved({"model": {"module.w": f32(2), "module.b": f32(1)}})
    p = saved.plan({"model": {"w": np.zeros(2, dtype=np.float32), "c": np.zeros(1)}})
    assert sorted(p.problems) == [
        ("model/c", "not in the checkpoint"),
        ("model/w", "not in the checkpoint"),
    ]


def test_prefix_is_not_stripped_from_dicts_holding_more_than_tensors() -> None:
    # {"module.x": 1} is ordinary data, not a wrapped model's state dict.
    saved = Saved({"cfg": {"module.depth": 3}})
    p = saved.plan({"cfg": {"depth": 0}})
    assert p.problems == [("cfg/depth", "not in the checkpoint")]


# ---------------------------------------------------------------------------------------------
# real torch wrappers
# ---------------------------------------------------------------------------------------------


def _net(torch: Any, seed: int) -> Any:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))


def _compile(torch: Any, model: Any) -> Any:
    """``torch.compile(model)``: wrapping only (nothing runs compiled), or skip where unavailable."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's own deprecations while importing dynamo
            return torch.compile(model)
    except Exception as exc:  # pragma: no cover - depends on the torch build
        pytest.skip(f"torch.compile is not available here: {exc!r}")


@pytest.mark.torch
def test_wrappers_flatten_to_the_bare_models_keys() -> None:
    torch = pytest.importorskip("torch")
    model = _net(torch, 0)
    bare = tree.flatten({"m": model})
    nested = _compile(torch, torch.nn.DataParallel(model))  # "_orig_mod.module." keys
    for wrapped in (torch.nn.DataParallel(model), _compile(torch, model), nested):
        assert any(k.startswith(("module.", "_orig_mod.")) for k in wrapped.state_dict())
        flat = tree.flatten({"m": wrapped})
        assert flat.tree == bare.tree  # same keys, same recorded type (the inner model's)
        assert list(flat.tensors) == list(bare.tensors)
        assert flat.tree["items"][0][1]["type"] == "torch.nn.modules.container.Sequential"


@pytest.mark.torch
@pytest.mark.parametrize("saved_as", ["plain", "data_parallel", "compiled", "legacy_prefixed"])
@pytest.mark.parametrize("load_into", ["plain", "data_parallel", "compiled"])
def test_module_loads_into_either_form(saved_as: str, load_into: str) -> None:
    torch = pytest.importorskip("torch")

    def form(model: Any, how: str) -> Any:
        if how == "data_parallel":
            return torch.nn.DataParallel(model)
        if how == "compiled":
            return _compile(torch, model)
        return model

    src = _net(torch, 0)
    if saved_as == "legacy_prefixed":
        # What a save before unwrapping (or a user's ddp.state_dict()) holds: prefixed keys.
        saved = Saved({"m": torch.nn.DataParallel(src).state_dict()})
    else:
        saved = Saved({"m": form(src, saved_as)})
    dst = _net(torch, 1)
    target = form(dst, load_into)
    p = saved.plan({"m": target})
    assert p.problems == []
    out = saved.execute(p)
    assert out["m"] is target  # the object passed in comes back, wrapper and all
    for k, v in src.state_dict().items():
        assert torch.equal(dst.state_dict()[k], v), k


@pytest.mark.torch
def test_module_state_dict_target_in_wrapped_form() -> None:
    # Loading into a wrapped model's state dict (prefixed keys) from a bare save.
    torch = pytest.importorskip("torch")
    src, dst = _net(torch, 0), _net(torch, 1)
    saved = Saved({"m": src})
    target = {"m": dict(torch.nn.DataParallel(dst).state_dict())}
    p = saved.plan(target)
    assert p.problems == []
    saved.execute(p)
    assert set(target["m"]) == {f"module.{k}" for k in src.state_dict()}
    assert torch.equal(dst[0].weight, src[0].weight)


@pytest.mark.torch
def test_mismatched_wrapped_module_lists_every_key() -> None:
    torch = pytest.importorskip("torch")
    saved = Saved({"m": torch.nn.DataParallel(torch.nn.Linear(2, 3)).state_dict()})
    p = saved.plan({"m": torch.nn.Linear(2, 3, bias=False)})
    assert sorted(p.problems) == [
        ("m/module.bias", "unexpected key: not in the target"),
        ("m/module.weight", "unexpected key: not in the target"),
        ("m/weight", "not in the checkpoint"),
    ]


@pytest.mark.torch
def test_optimizer_over_wrapped_parameters_is_unaffected() -> None:
    # Optimizer state refers to parameters by index: the wrapper form does not matter.
    torch = pytest.importorskip("torch")
    src = _net(torch, 0)
    wrapped = torch.nn.DataParallel(src)
    opt = torch.optim.Adam(wrapped.parameters(), lr=0.01)
    wrapped(torch.randn(5, 3)).sum().backward()
    opt.step()
    saved = Saved({"m": wrapped, "opt": opt})
    assert saved.flat.tree == Saved({"m": src, "opt": opt}).flat.tree

    dst = _net(torch, 1)
    opt2 = torch.optim.Adam(dst.parameters(), lr=0.5)
    p = saved.plan({"m": dst, "opt": opt2})
    assert p.problems == []
    saved.execute(p)
    want, got = opt.state_dict(), opt2.state_dict()
    assert got["param_groups"] == want["param_groups"]
    for i, state in want["state"].items():
        for name, value in state.items():
            assert torch.equal(got["state"][i][name], value)
