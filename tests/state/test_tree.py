"""savepoint.state.tree: escaping, flattening, tying, rebuilding, leaves and select."""

from __future__ import annotations

import decimal
import fractions
import json
import math
import re
from typing import Any

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import savepoint as sp
from savepoint.state import tree

# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def unescape(name: str) -> str:
    """Inverse of tree.escape for one component (RFC 6901 plus the ~uXXXX extension)."""

    def repl(m: re.Match[str]) -> str:
        s = m.group(0)
        if s == "~0":
            return "~"
        if s == "~1":
            return "/"
        return chr(int(s[2:], 16))

    return re.sub(r"~0|~1|~u[0-9a-f]{4}", repl, name)


def source_array(src: Any) -> np.ndarray:
    """The bytes a TensorSource would write, as an array of its dtype and shape."""
    buf = np.empty(src.nbytes, dtype=np.uint8)
    src.copy_to(buf, 0)
    src.release()
    return buf.view(src.dtype.numpy).reshape(src.shape)


def rebuild(state: Any) -> Any:
    """flatten -> JSON text -> build, with tensors taken from the flattened sources."""
    flat = tree.flatten(state)
    node = json.loads(json.dumps(flat.tree, allow_nan=False, ensure_ascii=True))
    cache: dict[str, np.ndarray] = {}

    def get(ref: str, kind: str) -> Any:
        if ref not in cache:
            cache[ref] = source_array(flat.tensors[ref])
        arr = cache[ref]
        return arr[()] if kind == "numpy_scalar" else arr

    return tree.build(node, get)


def assert_same(actual: Any, expected: Any, where: str = "<root>") -> None:
    """Exact structural equality: container types, key types, float signs and NaNs, array bytes."""
    if isinstance(expected, np.ndarray):
        assert isinstance(actual, np.ndarray), where
        assert actual.dtype == expected.dtype, where
        assert actual.shape == expected.shape, where
        assert actual.tobytes() == np.ascontiguousarray(expected).tobytes(), where
        return
    if isinstance(expected, np.generic):
        assert type(actual) is type(expected), where
        assert actual.tobytes() == expected.tobytes(), where
        return
    if isinstance(expected, (bytes, bytearray, memoryview)):
        assert type(actual) is bytes, where
        assert actual == bytes(expected), where
        return
    if isinstance(expected, dict):
        assert type(actual) is dict, where
        assert [(type(k), k) for k in actual] == [(type(k), k) for k in expected], where
        for k in expected:
            assert_same(actual[k], expected[k], f"{where}/{k!r}")
        return
    if isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected), where
        assert len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_same(a, e, f"{where}/{i}")
        return
    if isinstance(expected, float):
        assert type(actual) is float, where
        assert repr(actual) == repr(expected), where  # -0.0 vs 0.0, nan, inf
        return
    assert type(actual) is type(expected), where
    assert actual == expected, where


class Counter:
    """A minimal Stateful."""

    def __init__(self, n: int = 0) -> None:
        self.n = n
        self.w = np.arange(3, dtype=np.float32) * n

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n, "w": self.w}

    def load_state_dict(self, d: dict[str, Any]) -> None:  # pragma: no cover - not used here
        self.n = d["n"]


# ---------------------------------------------------------------------------------------------
# escaping
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("component", "escaped"),
    [
        ("plain", "plain"),
        ("", ""),
        ("a/b", "a~1b"),
        ("a~b", "a~0b"),
        ("~1", "~01"),  # a literal "~1" must not read back as "/"
        ("~0", "~00"),
        ("~/", "~0~1"),
        ("/~", "~1~0"),
        ("//", "~1~1"),
        ("~u", "~0u"),
        ("~ud800", "~0ud800"),  # looks like an escaped surrogate but is literal text
        ("layer.0.weight", "layer.0.weight"),
        ("é漢字🙂", "é漢字🙂"),
        ("\ud800", "~ud800"),
        ("a\udfffb", "a~udfffb"),
        ("\udbff\udc00", "~udbff~udc00"),  # a surrogate pair in a str is still two lone halves
        ("~\ud800/", "~0~ud800~1"),
        (0, "0"),
        (7, "7"),
        (-3, "-3"),
        (2**70, str(2**70)),
    ],
)
def test_escape_table(component: str | int, escaped: str) -> None:
    assert tree.escape(component) == escaped
    if isinstance(component, str):
        assert unescape(escaped) == component
    escaped.encode("utf-8")  # always valid UTF-8


def test_join() -> None:
    assert tree.join(()) == ""
    assert tree.join(("a/b", 0, "~", "")) == "a~1b/0/~0/"
    assert tree.join(("",)) == ""
    assert tree.join(("", "")) == "/"


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_escape_is_invertible_and_utf8(component: str) -> None:
    out = tree.escape(component)
    assert "/" not in out
    out.encode("utf-8")  # no lone surrogates survive
    assert unescape(out) == component
    assert not re.search(r"~[2-9]", out)  # collision suffixes can never come from escaping


@settings(max_examples=100, deadline=None)
@given(st.lists(st.text(), unique=True, max_size=8))
@example(["__metadata__", "a"])
def test_any_str_keys_get_distinct_utf8_names(keys: list[str]) -> None:
    state = {k: np.full(1, i, dtype=np.int32) for i, k in enumerate(keys)}
    flat = tree.flatten(state)
    # "__metadata__", safetensors' reserved key, is never a tensor name: it gets a suffix that
    # escaping never produces ("~2").
    names = [tree.escape(k) for k in keys]
    assert list(flat.tensors) == [n if n != "__metadata__" else n + "~2" for n in names]
    for name in flat.tensors:
        name.encode("utf-8")
    assert_same(rebuild(state), state)


# ---------------------------------------------------------------------------------------------
# name collisions
# ---------------------------------------------------------------------------------------------


def _arr(v: int) -> np.ndarray:
    return np.full(2, v, dtype=np.int64)


@pytest.mark.parametrize(
    ("state", "names"),
    [
        ({0: _arr(1), "0": _arr(2)}, ["0", "0~2"]),
        ({"0": _arr(1), 0: _arr(2)}, ["0", "0~2"]),
        ({"a": {5: _arr(1), "5": _arr(2)}}, ["a/5", "a/5~2"]),
        (
            {0: {0: _arr(1), "0": _arr(2)}, "0": {0: _arr(3), "0": _arr(4)}},
            ["0/0", "0/0~2", "0/0~3", "0/0~4"],
        ),
        # A key holding "/" never meets the nested path it resembles.
        ({"x": [_arr(1)], "x/0": _arr(2), "y": {"0": _arr(3)}}, ["x/0", "x~10", "y/0"]),
        ([_arr(1), {"0": _arr(2)}, (_arr(3),)], ["0", "1/0", "2/0"]),
    ],
)
def test_int_and_str_keys_that_collide_get_suffixes(state: Any, names: list[str]) -> None:
    flat = tree.flatten(state)
    assert list(flat.tensors) == names
    assert_same(rebuild(state), state)


@pytest.mark.parametrize(
    "state",
    [
        {"__metadata__": _arr(1)},
        {"__metadata__": _arr(1), "__metadata__~2": _arr(2)},
        {"__metadata__": {"x": _arr(1)}, "y": _arr(2)},
    ],
    ids=["tensor", "with-lookalike", "nested-is-fine"],
)
def test_no_tensor_is_named_like_the_safetensors_metadata_key(state: Any) -> None:
    # "__metadata__" is reserved in a safetensors header: a tensor of that name makes the data
    # file unreadable (by savepoint's own parse_header and by the safetensors library).
    flat = tree.flatten(state)
    assert "__metadata__" not in flat.tensors
    assert len(set(flat.tensors)) == len(flat.tensors)
    assert_same(rebuild(state), state)


def test_collision_keeps_key_types_in_tree() -> None:
    flat = tree.flatten({0: _arr(1), "0": _arr(2)})
    assert flat.tree == {
        "t": "dict",
        "items": [
            [0, {"t": "tensor", "ref": "0", "kind": "numpy"}],
            ["0", {"t": "tensor", "ref": "0~2", "kind": "numpy"}],
        ],
    }


# ---------------------------------------------------------------------------------------------
# plain values and round trips
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "node"),
    [
        (None, {"t": "value", "v": None}),
        (True, {"t": "value", "v": True}),
        (False, {"t": "value", "v": False}),
        (0, {"t": "value", "v": 0}),
        (-1, {"t": "value", "v": -1}),
        (2**64 + 1, {"t": "value", "v": 2**64 + 1}),
        (-(2**100), {"t": "value", "v": -(2**100)}),
        (1.5, {"t": "value", "v": 1.5}),
        (-0.0, {"t": "value", "v": -0.0}),
        (5e-324, {"t": "value", "v": 5e-324}),
        (1.7976931348623157e308, {"t": "value", "v": 1.7976931348623157e308}),
        (math.inf, {"t": "float", "v": "inf"}),
        (-math.inf, {"t": "float", "v": "-inf"}),
        (math.nan, {"t": "float", "v": "nan"}),
        ("", {"t": "value", "v": ""}),
        ("héllo\n\x00\ud800", {"t": "value", "v": "héllo\n\x00\ud800"}),
        (b"", {"t": "bytes", "v": ""}),
        (b"\x00\xffab", {"t": "bytes", "v": "AP9hYg=="}),
    ],
)
def test_plain_value_nodes(value: Any, node: dict[str, Any]) -> None:
    flat = tree.flatten({"k": value})
    got = flat.tree["items"][0][1]
    assert got == node
    if isinstance(value, float):
        assert repr(got["v"] if got["t"] == "value" else float(got["v"])) == repr(value)
    assert flat.tensors == {}
    assert_same(rebuild({"k": value}), {"k": value})


def test_bytearray_and_memoryview_come_back_as_bytes() -> None:
    state = {"a": bytearray(b"xy"), "m": memoryview(b"zz")}
    assert rebuild(state) == {"a": b"xy", "m": b"zz"}


def test_nested_round_trip() -> None:
    w = np.arange(12, dtype=np.float32).reshape(3, 4)
    state = {
        "model": {"w": w, "b/ias": np.zeros(4, dtype=np.float16), "": np.ones((), dtype=np.int8)},
        "opt": [
            {"step": 3, "lr": 1e-3, "betas": (0.9, 0.999)},
            [],
            (),
            {},
            (np.uint64(2**64 - 1), np.float32(-0.0), np.bool_(True)),
        ],
        7: {"~x": [None, True, 2**65, -0.0, math.nan, math.inf, -math.inf, "s", b"b"]},
        "ユニコード": ((("deep",),),),
        "empty": np.zeros((0, 5), dtype=np.int32),
    }
    out = rebuild(state)
    assert_same(out, state)
    # dict key types and order survive, tuples stay tuples
    assert list(out) == ["model", "opt", 7, "ユニコード", "empty"]
    assert isinstance(out["opt"][4], tuple)


def test_numpy_scalars_are_tensors_of_kind_numpy_scalar() -> None:
    flat = tree.flatten({"s": np.float64(2.5), "z": np.array(3, dtype=np.int16)})
    kinds = {n["ref"]: n["kind"] for _, n in tree.leaves(flat.tree)}
    assert kinds == {"s": "numpy_scalar", "z": "numpy"}
    assert flat.tensors["s"].shape == ()
    assert flat.tensors["z"].shape == ()
    out = rebuild({"s": np.float64(2.5), "z": np.array(3, dtype=np.int16)})
    assert type(out["s"]) is np.float64
    assert isinstance(out["z"], np.ndarray)
    assert out["z"].shape == ()


def test_stateful_is_flattened_through_state_dict() -> None:
    c = Counter(2)
    flat = tree.flatten({"c": c})
    node = flat.tree["items"][0][1]
    assert node["t"] == "stateful"
    assert node["type"] == f"{Counter.__module__}.Counter"
    assert list(flat.tensors) == ["c/w"]
    assert_same(rebuild({"c": c}), {"c": {"n": 2, "w": c.w}})


def test_tree_is_strict_json() -> None:
    flat = tree.flatten({"a": [math.nan, -math.inf, b"\x01", 2**80]})
    text = json.dumps(flat.tree, allow_nan=False)  # would raise on a bare NaN
    assert "NaN" not in text


# ---------------------------------------------------------------------------------------------
# refusals
# ---------------------------------------------------------------------------------------------


class Opaque:
    pass


@pytest.mark.parametrize(
    ("state", "key", "fragments"),
    [
        (set(), "", ["<root>", "set"]),
        ({"a": {"b": {1, 2}}}, "a/b", ["a/b", "set"]),
        ({"a": frozenset()}, "a", ["frozenset"]),
        ({"x": [1, object()]}, "x/1", ["x/1", "builtins.object"]),
        ({"o": Opaque()}, "o", ["o", "Opaque"]),
        ({"c": 1 + 2j}, "c", ["c", "complex"]),
        ({"d": decimal.Decimal("1.5")}, "d", ["decimal.Decimal"]),
        ({"f": fractions.Fraction(1, 3)}, "f", ["Fraction"]),
        ({"r": range(3)}, "r", ["range"]),
        ({"e": ...}, "e", ["ellipsis"]),
        ({"k/e~y": {1}}, "k~1e~0y", ["k~1e~0y", "set"]),
        ({"d": {(1, 2): 3}}, "d", ["d", "(1, 2)", "tuple"]),
        ({"d": {1.5: 3}}, "d", ["d", "1.5", "float"]),
        ({"d": {True: 3}}, "d", ["d", "True", "bool"]),
        ({"d": {None: 3}}, "d", ["d", "NoneType"]),
        ({"d": {np.int64(1): 3}}, "d", ["d", "int64"]),
        ({5: {"x": {b"k": 1}}}, "5/x", ["5/x", "bytes"]),
        ({"o": np.array([1, None], dtype=object)}, "o", ["o", "objects"]),
        ({"s": [np.array([(1, "a")], dtype=[("i", "i4"), ("o", "O")])]}, "s/0", ["s/0"]),
        ({"t": np.datetime64("2024-01-01")}, "t", ["t", "datetime64"]),
        ({"c": np.zeros(2, dtype=np.complex128)}, "c", ["c", "complex128"]),
    ],
)
def test_unsupported_leaves_name_path_and_type(state: Any, key: str, fragments: list[str]) -> None:
    with pytest.raises(sp.UnsupportedStateError) as info:
        tree.flatten(state)
    assert info.value.key == key
    assert isinstance(info.value, TypeError)
    message = str(info.value)
    assert message.startswith(f"{key or '<root>'}:")
    for fragment in fragments:
        assert fragment in message


def _list_cycle() -> Any:
    a: list[Any] = [1]
    a.append(a)
    return {"a": a}


def _dict_cycle() -> Any:
    d: dict[str, Any] = {"x": 1}
    d["self"] = d
    return d


def _tuple_cycle() -> Any:
    inner: list[Any] = []
    t = (inner,)
    inner.append(t)
    return {"t": t}


def _deep_cycle() -> Any:
    root: dict[str, Any] = {"a": {"b": [{}]}}
    root["a"]["b"][0]["back"] = root["a"]
    return root


@pytest.mark.parametrize(
    ("make", "key"),
    [
        (_list_cycle, "a/1"),
        (_dict_cycle, "self"),
        (_tuple_cycle, "t/0/0"),
        (_deep_cycle, "a/b/0/back"),
    ],
)
def test_reference_cycles_are_refused(make: Any, key: str) -> None:
    with pytest.raises(sp.UnsupportedStateError, match="cycle") as info:
        tree.flatten(make())
    assert info.value.key == key
    assert str(info.value).startswith(f"{key}:")


def test_shared_containers_without_a_cycle_are_fine() -> None:
    shared = [1, {"x": 2}]
    state = {"a": shared, "b": shared, "c": [shared, shared]}
    assert_same(rebuild(state), {"a": shared, "b": shared, "c": [shared, shared]})


# ---------------------------------------------------------------------------------------------
# tied arrays
# ---------------------------------------------------------------------------------------------


def _refs_by_key(flat: tree.Flat) -> dict[str, str]:
    return {tree.join(path): node["ref"] for path, node in tree.leaves(flat.tree)}


def test_same_array_twice_is_stored_once() -> None:
    w = np.arange(6, dtype=np.float32)
    flat = tree.flatten({"enc": {"w": w}, "dec": [w], "again": w})
    assert list(flat.tensors) == ["enc/w"]
    assert _refs_by_key(flat) == {"enc/w": "enc/w", "dec/0": "enc/w", "again": "enc/w"}
    out = rebuild({"enc": {"w": w}, "dec": [w], "again": w})
    assert out["dec"][0] is out["enc"]["w"] is out["again"]


@pytest.mark.parametrize(
    "view",
    [
        lambda a: a[:],
        lambda a: a[...],
        lambda a: a.view(),
        lambda a: np.asarray(a),
        lambda a: a.reshape(a.shape),
        lambda a: a[:, :],
    ],
    ids=["slice", "ellipsis", "view", "asarray", "reshape-same", "2d-slice"],
)
def test_identical_views_share_one_ref(view: Any) -> None:
    a = np.arange(12, dtype=np.float64).reshape(3, 4)
    v = view(a)
    assert v.__array_interface__["data"][0] == a.__array_interface__["data"][0]
    flat = tree.flatten({"a": a, "v": v})
    assert list(flat.tensors) == ["a"]
    assert _refs_by_key(flat) == {"a": "a", "v": "a"}


@pytest.mark.parametrize(
    "view",
    [
        lambda a: a[1:],  # other start
        lambda a: a[:-1],  # same start, other shape
        lambda a: a[:, ::2],  # other strides and shape
        lambda a: a.T,  # same start and shape (square), other strides
        lambda a: a.reshape(-1),  # same memory, other shape
        lambda a: a.view(np.int64),  # same bytes, other dtype
        lambda a: a.copy(),  # same values, other memory
    ],
    ids=["offset", "shorter", "strided", "transposed", "reshaped", "retyped", "copy"],
)
def test_overlapping_but_different_views_are_stored_separately(view: Any) -> None:
    a = np.arange(16, dtype=np.float64).reshape(4, 4)
    v = view(a)
    flat = tree.flatten({"a": a, "v": v})
    assert list(flat.tensors) == ["a", "v"]
    out = rebuild({"a": a, "v": v})
    assert_same(out, {"a": a, "v": np.ascontiguousarray(v)})


@pytest.mark.torch
def test_tied_torch_tensors_share_one_ref() -> None:
    torch = pytest.importorskip("torch")
    emb = torch.nn.Embedding(5, 3)
    head = torch.nn.Linear(3, 5, bias=False)
    head.weight = emb.weight
    t = torch.arange(10.0)
    flat = tree.flatten(
        {"emb": emb.weight, "head": head.weight, "t": t, "td": t.detach(), "t1": t[1:], "t9": t[:9]}
    )
    assert list(flat.tensors) == ["emb", "t", "t1", "t9"]
    refs = _refs_by_key(flat)
    assert refs["head"] == "emb"
    assert refs["td"] == "t"


# ---------------------------------------------------------------------------------------------
# leaves, refs, select
# ---------------------------------------------------------------------------------------------


def _sample() -> Any:
    return {
        "b": {"y": np.zeros(1), "x": 1},
        "a": [np.ones(1), (2, {"k": "v"})],
        0: Counter(1),
        "a/b": {"~": None},
        "": {"e": 5},
    }


def test_leaves_are_depth_first_in_stored_order() -> None:
    flat = tree.flatten(_sample())
    got = [(path, node["t"]) for path, node in tree.leaves(flat.tree)]
    assert got == [
        (("b", "y"), "tensor"),
        (("b", "x"), "value"),
        (("a", 0), "tensor"),
        (("a", 1, 0), "value"),
        (("a", 1, 1, "k"), "value"),
        ((0, "n"), "value"),
        ((0, "w"), "tensor"),
        (("a/b", "~"), "value"),
        (("", "e"), "value"),
    ]


def test_leaves_of_a_bare_value_and_empty_containers() -> None:
    assert tree.leaves({"t": "value", "v": 1}) == [((), {"t": "value", "v": 1})]
    assert tree.leaves(tree.flatten({"a": [], "b": {}, "c": ()}).tree) == []


def test_refs_collects_every_tensor_ref_once() -> None:
    w = np.zeros(2)
    flat = tree.flatten({"x": [w, w], "y": {"z": np.ones(1)}, "c": Counter(1), "v": 3})
    assert tree.refs(flat.tree) == {"x/0", "y/z", "c/w"}
    assert tree.refs(flat.tree["items"][1][1]) == {"y/z"}


def _select(wanted: list[str]) -> Any:
    node = tree.select(tree.flatten(_sample()).tree, wanted)
    return (
        None
        if node is None
        else [(tree.join(p), n.get("v", n.get("ref"))) for p, n in tree.leaves(node)]
    )


@pytest.mark.parametrize(
    ("wanted", "expected"),
    [
        ([""], [("/e", 5)]),  # "" is the key "", not the root
        (["b"], [("b/y", "b/y"), ("b/x", 1)]),
        (["b/x"], [("b/x", 1)]),
        (["b/x", "b/y"], [("b/y", "b/y"), ("b/x", 1)]),  # stored order, not request order
        (["b/x", "b"], [("b/y", "b/y"), ("b/x", 1)]),
        (["a/1/1/k"], [("a/0", None), ("a/1/0", None), ("a/1/1/k", "v")]),  # positions kept
        (["a/0"], [("a/0", "a/0"), ("a/1", None)]),
        (["0"], [("0/n", 1), ("0/w", "0/w")]),  # int key, inside a Stateful
        (["0/w"], [("0/w", "0/w")]),
        (["a~1b"], [("a~1b/~0", None)]),  # escaped "/" in a key
        (["a~1b/~0"], [("a~1b/~0", None)]),
        (["/e"], [("/e", 5)]),  # "" key: the path starts with the separator
        (["missing"], None),
        (["b/missing"], None),
        (["b/x/deeper"], None),
        (["a/b"], None),  # the key "a/b" is spelled a~1b
        (["a/7"], None),
        (["bb"], None),
    ],
)
def test_select(wanted: list[str], expected: Any) -> None:
    assert _select(wanted) == expected


def test_select_empty_key_is_not_confused_with_a_top_level_key() -> None:
    # {"": {"x": B}} stores B as "/x" (join of ("", "x")); selecting "/x" must give B, not "x".
    a, b = np.zeros(1), np.ones(1)
    flat = tree.flatten({"x": a, "": {"x": b}})
    assert list(flat.tensors) == ["x", "/x"]
    node = tree.select(flat.tree, ["/x"])
    assert node is not None
    assert [(p, n["ref"]) for p, n in tree.leaves(node)] == [(("", "x"), "/x")]


def test_select_keeps_stateful_and_container_kinds() -> None:
    flat = tree.flatten({"c": Counter(1), "t": (1, 2, 3)})
    node = tree.select(flat.tree, ["c/w", "t/1"])
    assert node is not None
    c = node["items"][0][1]
    assert c["t"] == "stateful"
    assert c["type"].endswith("Counter")
    assert [k for k, _ in c["state"]["items"]] == ["w"]
    t = node["items"][1][1]
    assert t == {
        "t": "tuple",
        "items": [{"t": "value", "v": None}, {"t": "value", "v": 2}, {"t": "value", "v": None}],
    }


def test_select_does_not_mutate_the_tree() -> None:
    flat = tree.flatten(_sample())
    before = json.dumps(flat.tree)
    tree.select(flat.tree, ["a/1/1/k", "0/w"])
    assert json.dumps(flat.tree) == before


def _nested(kind: str, depth: int) -> Any:
    x: Any = np.zeros(2)
    for _ in range(depth):
        x = {"k": x} if kind == "dict" else [x]
    return x


# The manifest reader accepts 512 levels of JSON: 170 nested dicts (3 levels each) or 255 lists.
CAPS = {"dict": 170, "list": 255}


@pytest.mark.parametrize("kind", ["dict", "list"])
def test_nesting_up_to_the_cap_saves_and_loads_and_deeper_is_refused(
    kind: str, tmp_path: Any
) -> None:
    """Whatever sp.save accepts, sp.load reads; deeper (990 used to raise RecursionError, and
    100,000 too) is an UnsupportedStateError saying how deep savepoint goes."""
    cap = CAPS[kind]
    for depth in (100, cap):
        path = tmp_path / f"{kind}-{depth}"
        sp.save(path, _nested(kind, depth))
        got = sp.load(path)
        for _ in range(depth):
            got = got["k"] if kind == "dict" else got[0]
        np.testing.assert_array_equal(got, np.zeros(2))
    for depth in (cap + 1, 990, 100_000):
        with pytest.raises(sp.UnsupportedStateError, match="savepoint stores at most 512"):
            sp.save(tmp_path / f"{kind}-{depth}", _nested(kind, depth))
        assert not (tmp_path / f"{kind}-{depth}").exists()


def test_flatten_refuses_deep_nesting_before_recursing() -> None:
    with pytest.raises(sp.UnsupportedStateError, match="nested deeper than 512 levels of JSON"):
        tree.flatten(_nested("dict", 100_000))
