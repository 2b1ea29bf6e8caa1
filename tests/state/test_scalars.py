"""Python scalars and 0-d tensors standing in for each other on restore, only when exact."""

from __future__ import annotations

import math
import types
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from savepoint.state import _scalars
from state.test_restore import Saved, f32

# ---------------------------------------------------------------------------------------------
# the rules
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("src", "dst", "holds"),
    [
        ("F32", "F64", True),
        ("F16", "F64", True),
        ("BF16", "F64", True),
        ("F8_E4M3", "F16", True),
        ("F8_E5M2FNUZ", "F16", True),
        ("F16", "BF16", False),  # precision
        ("BF16", "F16", False),  # range
        ("F16", "F8_E5M2", False),
        ("F32", "F8_E4M3", False),
        ("F16", "F8_E4M3FNUZ", False),
        ("F8_E5M2", "F8_E4M3", False),  # range (and infinities)
        ("I32", "F64", True),
        ("U32", "F64", True),
        ("I64", "F64", False),  # 2**53 + 1
        ("U8", "BF16", True),
        ("I16", "F16", False),
        ("I16", "F32", True),
        ("I8", "I64", True),
        ("U64", "I64", False),
        ("I8", "U64", False),
        ("I64", "int", True),
        ("U64", "int", True),
        ("BOOL", "int", True),
        ("BOOL", "F16", True),
        ("F32", "int", False),  # a float never becomes an int
        ("I8", "BOOL", False),
        ("C64", "F64", False),
        ("F32", "C64", True),
        ("F64", "C64", False),
    ],
)
def test_holds(src: str, dst: str, holds: bool) -> None:
    assert _scalars.holds(src, dst) is holds


def _every_value(name: str) -> np.ndarray:
    """Every value of a dtype of at most 16 bits."""
    d = {"F16": np.float16, "BF16": ml_dtypes.bfloat16, "I16": np.int16, "U8": np.uint8}[name]
    bits = np.arange(2 ** (8 * np.dtype(d).itemsize), dtype=np.uint64)
    raw = bits.astype(np.uint16 if np.dtype(d).itemsize == 2 else np.uint8)
    return raw.view(d)


@pytest.mark.parametrize(
    ("src", "dst"),
    [
        ("F16", "F32"),
        ("BF16", "F32"),
        ("U8", "BF16"),
        ("U8", "F16"),
        ("I16", "F16"),
        ("F16", "BF16"),
    ],
)
def test_holds_agrees_with_exhaustive_round_trips(src: str, dst: str) -> None:
    # The dtype rule, checked against every value of the small dtypes.
    values = _every_value(src)
    with np.errstate(all="ignore"):
        wide = values.astype(np.float64)
        back = values.astype(_scalars.dtypes.from_name(dst).numpy).astype(np.float64)
    exact = bool(np.all((back == wide) | (np.isnan(back) & np.isnan(wide))))
    assert _scalars.holds(src, dst) is exact


@pytest.mark.parametrize(
    ("value", "dst", "problem"),
    [
        (0.5, "F16", None),
        (0.1, "F16", "0.1 in the checkpoint would become 0.0999755859375 in the F16 target"),
        (0.1, "F64", None),
        (0.1, "F32", "0.1 in the checkpoint would become 0.10000000149011612 in the F32 target"),
        (1e300, "F32", "1e+300 in the checkpoint would become inf in the F32 target"),
        (math.inf, "F16", None),
        (math.inf, "F8_E4M3", "inf in the checkpoint would become nan in the F8_E4M3 target"),
        (math.nan, "BF16", None),
        (3, "F32", None),
        (
            2**53 + 1,
            "F64",
            "9007199254740993 in the checkpoint would become 9007199254740992.0 in the F64 target",
        ),
        (2**2000, "F64", None),  # a problem, checked below: its digits are shortened
        (-128, "I8", None),
        (128, "I8", "128 in the checkpoint does not fit I8"),
        (2**64 - 1, "U64", None),
        (True, "F32", None),
        (True, "I8", None),
        (True, "BOOL", None),
        (
            1,
            "BOOL",
            "the checkpoint holds the int 1 here; a target of dtype BOOL takes only bool values",
        ),
        (
            2.0,
            "I64",
            "the checkpoint holds the float 2.0 here; a target of dtype I64 takes only int or bool values",
        ),
        (0.25, "C64", None),
        ("0.1", "F32", "the checkpoint holds a str here, found a 0-d F32 tensor"),
        (None, "F32", "the checkpoint holds a NoneType here, found a 0-d F32 tensor"),
    ],
)
def test_value_into_tensor(value: Any, dst: str, problem: str | None) -> None:
    got = _scalars.value_into_tensor(value, dst)
    if value == 2**2000:
        assert got is not None and got.endswith("(603 digits) in the checkpoint does not fit F64")
        return
    assert got == problem


# ---------------------------------------------------------------------------------------------
# restore planning (numpy)
# ---------------------------------------------------------------------------------------------


def test_zero_d_arrays_restore_into_python_scalars() -> None:
    saved = Saved(
        {
            "lr": np.array(0.001, dtype=np.float32),
            "loss": np.float64(0.25),  # a numpy scalar is a 0-d tensor too
            "step": np.array(7, dtype=np.int64),
            "flag": np.array(True),
            "count": np.array(3, dtype=np.int32),
            "half": np.array(0.5, dtype=np.float16),
        }
    )
    into: dict[str, Any] = {
        "lr": 0.0,
        "loss": 0.0,
        "step": 0,
        "flag": False,
        "count": 0.0,
        "half": np.float32(0),
    }
    p = saved.plan(into)
    assert p.problems == []
    saved.execute(p)
    assert into == {
        "lr": float(np.float32(0.001)),
        "loss": 0.25,
        "step": 7,
        "flag": True,
        "count": 3.0,
        "half": 0.5,
    }
    assert [type(into[k]) for k in ("lr", "loss", "step", "flag", "count", "half")] == [
        float,
        float,
        int,
        bool,
        float,
        np.float32,
    ]


def test_python_scalars_fill_zero_d_arrays_in_place() -> None:
    saved = Saved({"lr": 0.5, "step": 7, "flag": True, "wide": 3})
    lr = np.zeros((), dtype=np.float16)
    step = np.zeros((), dtype=np.int64)
    flag = np.zeros((), dtype=np.bool_)
    wide = np.zeros((), dtype=ml_dtypes.bfloat16)
    into = {"lr": lr, "step": step, "flag": flag, "wide": wide}
    p = saved.plan(into)
    assert p.problems == []
    assert lr == 0  # planning changes nothing
    out = saved.execute(p)
    assert out["lr"] is lr and out["step"] is step and out["flag"] is flag and out["wide"] is wide
    assert (float(lr), int(step), bool(flag), float(wide)) == (0.5, 7, True, 3.0)
    # In a tuple the arrays are filled in place: nothing needs assigning.
    t = (np.zeros((), dtype=np.float32),)
    saved = Saved({"t": (0.25,)})
    saved.execute(saved.plan({"t": t}))
    assert float(t[0][()]) == 0.25


def test_lossy_conversions_are_all_reported_before_anything_changes() -> None:
    saved = Saved(
        {
            "w": f32(2, start=1),
            "lr": 0.1,
            "frac": 1.5,
            "big": np.array(2**60, dtype=np.int64),
            "real": np.array(0.5, dtype=np.float32),
            "vec": 1.0,
            "ro": 2.0,
            "text": "s",
        }
    )
    w = np.zeros(2, dtype=np.float32)
    ro = np.zeros((), dtype=np.float64)
    ro.setflags(write=False)
    into = {
        "w": w,
        "lr": np.zeros((), dtype=np.float16),
        "frac": np.zeros((), dtype=np.int32),
        "big": 0.0,
        "real": 0,
        "vec": np.zeros(3),
        "ro": ro,
        "text": np.zeros(()),
    }
    p = saved.plan(into)
    assert sorted(p.problems) == [
        (
            "big",
            "the checkpoint holds a 0-d I64 tensor here; a Python float cannot hold every I64 value",
        ),
        (
            "frac",
            "the checkpoint holds the float 1.5 here; a target of dtype I32 takes only int or bool values",
        ),
        ("lr", "0.1 in the checkpoint would become 0.0999755859375 in the F16 target"),
        (
            "real",
            "the checkpoint holds a 0-d F32 tensor here; a Python int cannot hold every F32 value",
        ),
        ("ro", "the target array is read-only"),
        ("text", "the checkpoint holds a str here, found a 0-d F64 tensor"),
        ("vec", "the checkpoint holds a float here, found a tensor of shape [3]"),
    ]
    assert not w.any()


def test_scalar_at_the_root_cannot_be_replaced_but_a_zero_d_array_is_filled() -> None:
    p = Saved(np.array(1.5)).plan(0.0)
    assert p.problems == [("", "a plain value cannot be restored in place; use sp.load()")]
    target = np.zeros(())
    saved = Saved(1.5)
    assert saved.execute(saved.plan(target)) is target
    assert target[()] == 1.5


def test_zero_d_tensor_into_a_tuple_slot_needs_assigning() -> None:
    saved = Saved({"m": {"lr": np.array(0.5)}})
    p = saved.plan({"m": types.MappingProxyType({"lr": 0.0})})
    assert p.problems == [("m/lr", "cannot assign into a mappingproxy")]
    into = {"t": (0.0,)}
    saved = Saved({"t": (np.array(0.5),)})
    saved.execute(saved.plan(into))
    assert into["t"] == (0.5,)  # the tuple, in a dict slot, is remade


# ---------------------------------------------------------------------------------------------
# torch
# ---------------------------------------------------------------------------------------------


@pytest.mark.torch
def test_torch_zero_d_tensors_and_python_scalars() -> None:
    torch = pytest.importorskip("torch")
    saved = Saved(
        {
            "lr": torch.tensor(0.001),
            "step": torch.tensor(5),
            "b": torch.tensor(0.5, dtype=torch.bfloat16),
        }
    )
    into: dict[str, Any] = {"lr": 0.0, "step": 0, "b": 0.0}
    saved.execute(saved.plan(into))
    assert into == {"lr": torch.tensor(0.001).item(), "step": 5, "b": 0.5}
    assert (type(into["lr"]), type(into["step"])) == (float, int)

    saved = Saved({"lr": 0.25, "step": 5, "on": True})
    lr = torch.nn.Parameter(
        torch.zeros((), dtype=torch.bfloat16)
    )  # requires grad: filled under no_grad
    step = torch.zeros((), dtype=torch.int64)
    on = torch.zeros((), dtype=torch.bool)
    into = {"lr": lr, "step": step, "on": on}
    out = saved.execute(saved.plan(into))
    assert out["lr"] is lr and lr.item() == 0.25
    assert step.item() == 5 and on.item() is True

    p = Saved({"lr": 0.1, "n": 2.0}).plan(
        {"lr": torch.zeros((), dtype=torch.float16), "n": torch.zeros((), dtype=torch.int64)}
    )
    assert sorted(p.problems) == [
        ("lr", "0.1 in the checkpoint would become 0.0999755859375 in the F16 target"),
        (
            "n",
            "the checkpoint holds the float 2.0 here; a target of dtype I64 takes only int or bool values",
        ),
    ]
