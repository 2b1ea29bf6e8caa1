"""The storage protocol's shape: the required core, and each capability flag tied to its mixin.

The behaviour of every backend (the dict-backed example of the core alone included) is checked by
``test_contract.py``; this file checks the classes: what a backend must implement, and that a
flag and its methods cannot disagree in a backend class.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from savepoint.storage.base import (
    CAPABILITIES,
    Capabilities,
    HardLinks,
    Lock,
    Locks,
    PinnedContext,
    Renames,
    Store,
)

from ._dictstore import DictStore

CORE = {
    "open_blob",
    "create_blob",
    "put",
    "remove",
    "stat",
    "list",
    "makedirs",
    "mkdir",
    "remove_tree",
    "sync_dir",
}
NONE = Capabilities(False, False, False, False, False, False, False)


def test_the_required_core_is_ten_methods() -> None:
    assert Store.__abstractmethods__ == CORE


def test_the_example_backend_implements_the_core_alone() -> None:
    own = {name for name, value in vars(DictStore).items() if callable(value)}
    assert own - {"__init__", "_parent"} == CORE
    assert not any(isinstance(DictStore(), cap.mixin) for cap in CAPABILITIES)


def test_every_flag_is_in_the_table_or_qualifies_the_core() -> None:
    flags = {f.name for f in dataclasses.fields(Capabilities)}
    tied = {cap.flag for cap in CAPABILITIES}
    assert tied == {"atomic_rename", "hard_links", "locks"}
    assert flags - tied == {"create_only_put", "direct_io", "zero_copy", "durable"}
    for cap in CAPABILITIES:
        assert set(cap.methods) <= cap.mixin.__abstractmethods__


def _core() -> dict[str, Any]:
    """The core's methods, as a class body (they are never called here)."""
    return {name: lambda self, *a, **k: None for name in CORE}


_Core: Any = type("_Core", (Store,), {**_core(), "scheme": "x"})  # the core, no flags fixed


def test_a_flag_claimed_without_its_mixin_fails_at_class_creation() -> None:
    for cap in CAPABILITIES:
        body = {
            **_core(),
            "scheme": "x",
            "capabilities": dataclasses.replace(NONE, **{cap.flag: True}),
        }
        with pytest.raises(TypeError, match=f"{cap.flag}=True but is not a {cap.mixin.__name__}"):
            type("Claims", (Store,), body)


def test_a_mixin_without_its_flag_fails_at_class_creation() -> None:
    body = {**_core(), "scheme": "x", "capabilities": NONE, "link": lambda self, a, b: None}
    with pytest.raises(TypeError, match="hard_links=False but is a HardLinks"):
        type("Links", (HardLinks, Store), body)


def test_a_capability_method_outside_its_mixin_fails_at_class_creation() -> None:
    for name in ("rename", "replace", "exchange", "link"):
        with pytest.raises(TypeError, match=f"defines {name}\\(\\) but is not a"):
            type("Stray", (Store,), {**_core(), name: lambda self, a, b: None})
    # lock() is every store's (an in-process lock, a lease): defining it claims nothing.
    type("OwnLock", (Store,), {**_core(), "lock": lambda self, path: None})


def test_a_mixin_needs_its_methods() -> None:
    # A Renames store must also pin by handle: the default pin by path is wrong where a
    # directory can be replaced under its name.
    class Half(Renames, _Core):
        capabilities = dataclasses.replace(NONE, atomic_rename=True)

        def rename(self, src: str, dst: str) -> None: ...

        def replace(self, src: str, dst: str) -> None: ...

        def exchange(self, a: str, b: str) -> bool:
            return False

    with pytest.raises(TypeError, match="abstract"):
        Half()  # type: ignore[abstract]

    class Whole(Half):
        def pin(self, path: str) -> PinnedContext:
            raise NotImplementedError

    Whole()


def test_a_store_with_every_capability() -> None:
    class All(Renames, HardLinks, Locks, _Core):
        capabilities = Capabilities(True, True, False, True, False, False, True)

        def rename(self, src: str, dst: str) -> None: ...

        def replace(self, src: str, dst: str) -> None: ...

        def exchange(self, a: str, b: str) -> bool:
            return False

        def pin(self, path: str) -> PinnedContext:
            raise NotImplementedError

        def link(self, src: str, dst: str) -> None: ...

        def lock(self, path: str) -> Lock:
            raise NotImplementedError

    All()


def test_the_core_alone_saves_loads_copies_and_runs() -> None:
    import numpy as np

    import savepoint as sp

    store = DictStore()
    state = {"w": np.arange(10.0), "step": 3}
    sp.save(store.at("/ckpt"), state)
    sp.save(store.at("/ckpt"), {**state, "step": 4})  # replaced: a new generation, manifest-last
    sp.copy(store.at("/ckpt"), store.at("/copy"))
    loaded = sp.load(store.at("/copy"))
    assert loaded["step"] == 4 and np.array_equal(loaded["w"], state["w"])
    manager = sp.CheckpointManager(store.at("/run"), keep_last=1)
    for step in range(2):
        manager.save(step, state)
    manager.close()
    with sp.open_run(store.at("/run")) as run:
        assert run.steps() == [1]


def test_an_empty_tensor_at_a_neighbours_offset_reads_back_on_a_store_without_views() -> None:
    """A store without zero-copy views reads neighbouring tensors with one ranged read of their
    span; an empty tensor shares its neighbour's start offset (``[176, 176]`` and ``[176, ...]``)
    and must not end the span there (it did: the big tensor read as empty, 'checksum
    mismatch' on every load of such a checkpoint from S3)."""
    import numpy as np

    import savepoint as sp

    store = DictStore()
    for i, state in enumerate(
        [
            {"w": np.arange(256 * 1024, dtype=np.float32), "empty": np.zeros((0, 3))},
            {"a": np.arange(9), "w": np.ones((64, 64)), "e": np.zeros(0, np.int8), "b": np.ones(3)},
        ]
    ):
        sp.save(store.at(f"/ckpt{i}"), state)
        loaded = sp.load(store.at(f"/ckpt{i}"))
        assert all(np.array_equal(loaded[k], v) for k, v in state.items())
        sp.verify(store.at(f"/ckpt{i}"))
