"""The fast paths that make states of many leaves cheap give exactly what the plain code gives:
key escaping, keys carried down walks, tied-tensor detection by identity hash, and the torch
source's cheap construction."""

from __future__ import annotations

import gc
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from savepoint.engine import collector
from savepoint.state import tree


def reference_escape(component: Any) -> str:
    """tree.escape as it was written before its fast path (character by character)."""
    if isinstance(component, int):
        return str(component)
    out = component.replace("~", "~0").replace("/", "~1")
    if any("\ud800" <= ch <= "\udfff" for ch in out):
        out = "".join(f"~u{ord(ch):04x}" if "\ud800" <= ch <= "\udfff" else ch for ch in out)
    return out


# Hostile keys: separators, escapes, lone surrogates, non-ASCII, empty strings.
KEY_TEXT = st.lists(
    st.one_of(
        st.sampled_from(["~", "/", "~0", "~1", "~u", ".", "a", "\ud800", "\udfff", "\udbff"]),
        st.characters(),
    ),
    max_size=12,
).map("".join)
KEYS = st.one_of(KEY_TEXT, st.integers(min_value=-(10**20), max_value=10**20))


@given(KEYS)
@settings(max_examples=500, deadline=None)
def test_escape_fast_path_equals_the_reference(component: Any) -> None:
    assert tree.escape(component) == reference_escape(component)


@given(st.lists(KEYS, max_size=6))
@settings(max_examples=300, deadline=None)
def test_child_key_builds_join(path: list[Any]) -> None:
    key, is_root = "", True
    for component in path:
        key, is_root = tree.child_key(key, is_root, component), False
    assert key == tree.join(tuple(path)) == "/".join(reference_escape(c) for c in path)


NESTED = st.recursive(
    st.one_of(st.none(), st.integers(), st.just(np.zeros(2, np.float32))),
    lambda children: st.one_of(
        st.dictionaries(st.one_of(KEY_TEXT, st.integers(0, 9)), children, max_size=4),
        st.lists(children, max_size=3),
        st.tuples(children, children),
    ),
    max_leaves=25,
)


@given(NESTED)
@settings(max_examples=200, deadline=None)
def test_keyed_leaves_and_flatten_names_follow_join(state: Any) -> None:
    flat = tree.flatten(state)
    slow = [(tree.join(path), node) for path, node in tree.leaves(flat.tree)]
    assert tree.keyed_leaves(flat.tree) == slow
    assert tree.tensor_nodes(flat.tree) == [node for _, node in slow if node["t"] == "tensor"]
    assert tree.refs(flat.tree) == {n["ref"] for _, n in slow if n["t"] == "tensor"}
    # Each stored name is its first leaf's key, unless taken (then a ~N suffix); later leaves
    # of the same array are tied to it.
    seen: set[str] = set()
    for key, node in slow:
        if node["t"] == "tensor" and node["ref"] not in seen:
            ref = node["ref"]
            seen.add(ref)
            assert ref == key or (ref.startswith(key + "~") and ref[len(key) + 1 :].isdigit())
    assert seen == set(flat.tensors)


def test_ties_found_through_hash_collisions(monkeypatch: pytest.MonkeyPatch) -> None:
    """Identities are looked up by their hash; when every hash collides the full identity
    still decides (tied leaves share one record, distinct ones do not)."""
    monkeypatch.setattr(tree, "hash", lambda _: 7, raising=False)
    a = np.arange(4, dtype=np.float32)
    b = np.arange(4, dtype=np.float32)
    flat = tree.flatten({"a": a, "b": b, "a2": a, "b2": b, "view": a[:2]})
    refs = [node["ref"] for _, node in tree.keyed_leaves(flat.tree)]
    assert refs == ["a", "b", "a", "b", "view"]
    assert list(flat.tensors) == ["a", "b", "view"]


torch = pytest.importorskip("torch")


def test_torch_sources_cheap_construction_keeps_behaviour() -> None:
    from savepoint.state import torch_tensors

    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    grad = torch.ones(3, requires_grad=True)
    conj = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64).conj()
    cases = {
        "contiguous": base,
        "transposed": base.t(),
        "requires_grad": grad,
        "parameter": torch.nn.Parameter(torch.ones(2)),
        "conj": conj,
        "neg": torch._neg_view(torch.ones(3)),
        "empty": torch.zeros(0, 3),
        "scalar": torch.tensor(5, dtype=torch.int64),
        "bf16": torch.ones(3, dtype=torch.bfloat16),
    }
    for name, t in cases.items():
        source = torch_tensors.TorchSource(t, name)
        expected = t.detach().resolve_conj().resolve_neg().contiguous()
        assert source.shape == tuple(expected.shape), name
        assert source.nbytes == expected.numel() * expected.element_size(), name
        out = np.empty(source.nbytes, np.uint8)
        source.copy_to(out, 0)
        assert out.tobytes() == expected.reshape(-1).view(torch.uint8).numpy().tobytes(), name
        pointer = source.pointer()
        assert (pointer is not None) == (name not in ("transposed",)), name
    same = torch_tensors.TorchSource(base, "x").identity()
    assert same == torch_tensors.TorchSource(base, "y").identity()
    assert same != torch_tensors.TorchSource(base[:2], "z").identity()
    assert same != torch_tensors.TorchSource(base.view(torch.int32), "w").identity()


def test_collector_pause_nests_and_restores() -> None:
    was = gc.isenabled()
    try:
        gc.enable()
        with collector.paused():
            assert not gc.isenabled()
            with collector.paused():
                assert not gc.isenabled()
            assert not gc.isenabled()
        assert gc.isenabled()
        gc.disable()
        with collector.paused():
            pass
        assert not gc.isenabled()  # the caller's choice is kept
    finally:
        if was:
            gc.enable()
        else:
            gc.disable()


def test_group_pause_is_the_collector_pause() -> None:
    """A sharded save's pause (collectives.gc_paused, held by a background save's thread) and the
    trainer's own (collector.paused) interleave: whichever leaves first must not turn the
    collector back on under the other."""
    from savepoint.distributed import collectives

    was = gc.isenabled()
    try:
        gc.enable()
        background = collectives.gc_paused()
        background.__enter__()
        with collector.paused():
            background.__exit__(None, None, None)
            assert not gc.isenabled()  # the trainer's pause still holds
        assert gc.isenabled()
    finally:
        if was:
            gc.enable()
        else:
            gc.disable()
