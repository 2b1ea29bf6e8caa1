"""Dataclass configs: saved as plain dicts of their fields, restored into a dataclass of the type
passed in ``into=`` (never into a class the checkpoint names)."""

from __future__ import annotations

import dataclasses
import json
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import savepoint as sp
from savepoint.state import tree
from state.test_restore import Saved, f32


@dataclasses.dataclass
class Optim:
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)


@dataclasses.dataclass
class TrainConfig:
    lr: float = 1e-3
    layers: list[int] = dataclasses.field(default_factory=lambda: [64, 64])
    name: str = "run"
    optim: Optim = dataclasses.field(default_factory=Optim)
    mask: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(3, dtype=np.float32))


@dataclasses.dataclass(frozen=True)
class Frozen:
    lr: float = 1e-3
    tags: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class FrozenOuter:
    inner: Frozen = Frozen()
    depth: int = 1


@dataclasses.dataclass(frozen=True)
class Derived:
    width: int = 2
    area: int = dataclasses.field(init=False, default=0)

    def __post_init__(self) -> None:
        object.__setattr__(self, "area", self.width * self.width)


def saved_config() -> TrainConfig:
    return TrainConfig(
        lr=0.25,
        layers=[8, 16, 32],
        name="big",
        optim=Optim(lr=0.5, betas=(0.8, 0.9)),
        mask=f32(3, start=1),
    )


def test_dataclass_is_saved_as_a_plain_dict_of_its_fields() -> None:
    flat = tree.flatten({"config": saved_config()})
    node = flat.tree["items"][0][1]
    assert node["t"] == "dict"
    assert [k for k, _ in node["items"]] == ["lr", "layers", "name", "optim", "mask"]
    assert list(flat.tensors) == ["config/mask"]
    text = json.dumps(flat.tree)
    assert "TrainConfig" not in text and "test_dataclasses" not in text  # no class is named


def test_without_into_the_plain_dict_comes_back(tmp_path: Path) -> None:
    sp.save(tmp_path / "c", {"config": saved_config()})
    cfg = sp.load(tmp_path / "c")["config"]
    assert type(cfg) is dict
    assert cfg["optim"] == {"lr": 0.5, "betas": (0.8, 0.9)}
    np.testing.assert_array_equal(cfg["mask"], [1.0, 2.0, 3.0])


def test_mutable_dataclass_is_restored_in_place() -> None:
    saved = Saved({"config": saved_config(), "step": 3})
    cfg = TrainConfig()
    mask, layers, optim = cfg.mask, cfg.layers, cfg.optim
    into = {"config": cfg, "step": 0}
    p = saved.plan(into)
    assert p.problems == []
    assert [key for _, _, key in p.inplace] == ["config/mask"]
    assert (cfg.lr, cfg.layers, cfg.name) == (1e-3, [64, 64], "run")  # planning changes nothing
    out = saved.execute(p)
    assert out["config"] is cfg
    assert (cfg.lr, cfg.layers, cfg.name) == (0.25, [8, 16, 32], "big")
    assert cfg.layers is layers and cfg.optim is optim and cfg.mask is mask  # filled in place
    assert cfg.optim == Optim(lr=0.5, betas=(0.8, 0.9))
    np.testing.assert_array_equal(mask, [1.0, 2.0, 3.0])


def test_missing_and_unknown_fields_are_named() -> None:
    @dataclasses.dataclass
    class Other:
        lr: float = 0.0
        layers: list[int] = dataclasses.field(default_factory=list)
        dropout: float = 0.1

    saved = Saved({"config": saved_config()})
    p = saved.plan({"config": Other()})
    assert sorted(p.problems) == [
        ("config/dropout", "not in the checkpoint (a field of Other)"),
        ("config/mask", "not a field of Other"),
        ("config/name", "not a field of Other"),
        ("config/optim", "not a field of Other"),
    ]


def test_dataclass_target_for_something_else_is_a_problem() -> None:
    saved = Saved({"config": [1, 2], "x": {"lr": 1.0}})
    p = saved.plan({"config": Optim(), "x": Optim()})
    assert sorted(p.problems) == [
        ("config", "the checkpoint holds a list here, found Optim"),
        ("x/betas", "not in the checkpoint (a field of Optim)"),
    ]


def test_frozen_dataclass_in_a_dict_or_list_slot_is_replaced() -> None:
    saved = Saved({"f": Frozen(lr=0.5, tags=("a",)), "l": [FrozenOuter(Frozen(2.0), 3)]})
    original = Frozen()
    outer = FrozenOuter()
    into: dict[str, Any] = {"f": original, "l": [outer]}
    p = saved.plan(into)
    assert p.problems == []
    saved.execute(p)
    assert into["f"] == Frozen(lr=0.5, tags=("a",)) and into["f"] is not original
    assert original == Frozen()  # a frozen instance is never mutated
    assert into["l"][0] == FrozenOuter(Frozen(2.0), 3)
    assert outer == FrozenOuter()


def test_frozen_dataclass_that_is_already_equal_needs_no_slot() -> None:
    saved = Saved({"t": (Frozen(lr=0.5),)})
    same = Frozen(lr=0.5)
    p = saved.plan({"t": (same,)})
    assert p.problems == []
    assert saved.execute(p)["t"][0] is same


def test_frozen_dataclass_where_nothing_can_be_assigned_is_a_problem() -> None:
    saved = Saved({"m": {"f": Frozen(lr=0.5), "t": (Frozen(lr=0.5),)}})
    p = saved.plan({"m": types.MappingProxyType({"f": Frozen(), "t": (Frozen(),)})})
    assert sorted(p.problems) == [
        ("m/f", "a frozen Frozen must be replaced; cannot assign into a mappingproxy"),
        ("m/t/0", "a frozen Frozen must be replaced; cannot assign into a tuple"),
    ]
    p = Saved((Frozen(lr=0.5),)).plan((Frozen(),))
    assert p.problems == [("0", "a frozen Frozen must be replaced; cannot assign into a tuple")]
    root = Saved(Frozen(lr=0.5)).plan(Frozen())
    assert len(root.problems) == 1
    key, why = root.problems[0]
    assert key == "" and "frozen Frozen cannot be changed in place" in why
    assert "into={'config': cfg}" in why


def test_frozen_dataclass_inside_a_mutable_one_is_replaced_by_setattr() -> None:
    @dataclasses.dataclass
    class Holder:
        f: Frozen = Frozen()

    saved = Saved({"h": Holder(Frozen(lr=2.0, tags=("x",)))})
    h = Holder()
    p = saved.plan({"h": h})
    assert p.problems == []
    saved.execute(p)
    assert h.f == Frozen(lr=2.0, tags=("x",))


def test_init_false_fields_come_back_as_saved() -> None:
    saved = Saved({"d": Derived(width=3)})
    into = {"d": Derived()}
    p = saved.plan(into)
    assert p.problems == []
    saved.execute(p)
    assert (into["d"].width, into["d"].area) == (3, 9)
    # A saved value of an init=False field that __post_init__ would compute otherwise wins.
    odd = Derived(width=3)
    object.__setattr__(odd, "area", 10)
    into = {"d": Derived()}
    saved = Saved({"d": odd})
    saved.execute(saved.plan(into))
    assert (into["d"].width, into["d"].area) == (3, 10)


def test_dataclass_in_a_stateful_template_is_rebuilt() -> None:
    class Holder:
        def __init__(self, cfg: Optim) -> None:
            self.cfg = cfg
            self.loaded: list[Any] = []

        def state_dict(self) -> Any:
            return {"cfg": self.cfg}

        def load_state_dict(self, d: Any) -> None:
            self.loaded.append(d)

    saved = Saved({"h": Holder(Optim(lr=0.75))})
    template = Optim()
    h = Holder(template)
    p = saved.plan({"h": h})
    assert p.problems == []
    saved.execute(p)
    assert h.loaded == [{"cfg": Optim(lr=0.75)}]
    assert template == Optim()  # the template itself is not modified before load_state_dict


def test_dataclass_class_object_is_not_state() -> None:
    with pytest.raises(TypeError, match="cannot store a value of type"):
        tree.flatten({"cls": TrainConfig})


def test_unset_init_false_field() -> None:
    @dataclasses.dataclass
    class Lazy:
        n: int = 1
        cache: list[int] = dataclasses.field(init=False)

    with pytest.raises(
        sp.UnsupportedStateError, match=r"config/cache: field 'cache' of .*Lazy has no value"
    ):
        tree.flatten({"config": Lazy()})
    # Restoring into an instance whose field is still unset sets it.
    done = Lazy(n=2)
    done.cache = [1, 2]
    saved = Saved({"config": done})
    target = Lazy()
    saved.execute(saved.plan({"config": target}))
    assert (target.n, target.cache) == (2, [1, 2])
