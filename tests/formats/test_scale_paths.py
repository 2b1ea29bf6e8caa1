"""The many-tensor fast paths of the codecs write and accept exactly what the generic code does.

- ``safetensors.layout``/``header`` write the header ``json.dumps`` of a dict writes;
- ``manifest.dumps`` writes, byte for byte, what ``json.dumps`` of the whole body wrote;
- ``manifest.parse``'s inlined checks of version 1 entries and tree nodes accept what the
  per-entry checks accept and, on hostile input, raise the error those name first.
"""

from __future__ import annotations

import base64
import copy
import dataclasses
import json
import pickle
import struct
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from savepoint.codecs import checksum, dtypes
from savepoint.codecs import manifest as mf
from savepoint.codecs import safetensors as st_format
from savepoint.info import CheckpointInfo, TensorInfo

NAMES = st.lists(
    st.one_of(st.sampled_from(['"', "\\", "\n", "é", "\ud800", "/", "~", "a"]), st.characters()),
    min_size=1,
    max_size=8,
).map("".join)
DTYPES = st.sampled_from(sorted(dtypes.BY_NAME))
SHAPES = st.lists(st.integers(0, 5), max_size=3).map(tuple)


def reference_layout(tensors: list[tuple[str, str, tuple[int, ...], int]]) -> tuple[bytes, list]:
    """safetensors.layout as it was written before its fast path."""
    order = sorted(tensors, key=lambda t: -dtypes.from_name(t[1]).itemsize)
    header: dict[str, Any] = {"__metadata__": st_format.PRODUCER}
    offset = 0
    spans = []
    for name, dtype, shape, nbytes in order:
        header[name] = {
            "dtype": dtype,
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        spans.append((name, dtype, shape, offset, offset + nbytes))
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=True).encode("ascii")
    raw += b" " * (-len(raw) % 8)
    prefix = struct.pack("<Q", len(raw)) + raw
    base = len(prefix)
    return prefix, [(n, d, s, base + b, base + e) for n, d, s, b, e in spans]


@given(
    st.dictionaries(
        NAMES.filter(lambda n: n != "__metadata__"), st.tuples(DTYPES, SHAPES), max_size=12
    )
)
@settings(max_examples=300, deadline=None)
def test_layout_is_the_json_dumps_header(found: dict[str, tuple[str, tuple[int, ...]]]) -> None:
    tensors = [
        (name, dtype, shape, dtypes.BY_NAME[dtype].itemsize * _prod(shape))
        for name, (dtype, shape) in found.items()
    ]
    header, entries = st_format.layout(tensors)
    want_header, want_entries = reference_layout(tensors)
    assert header == want_header
    assert [(e.name, e.dtype, e.shape, e.start, e.end) for e in entries] == want_entries
    # and a reader takes it back (names with surrogate pairs come back joined, as JSON says)
    parsed, _ = st_format.parse_header(header[8:], entries[-1].end if entries else len(header))
    assert [(e.start, e.end) for e in parsed] == [(e.start, e.end) for e in entries]


def _prod(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def reference_dumps(m: mf.Manifest) -> bytes:
    """manifest.dumps of an unsharded manifest as it was written before its fast path."""
    body: dict[str, Any] = {
        "format": mf.FORMAT,
        "format_version": m.format_version,
        "writer": m.writer,
        "created": m.created,
        "checksum": checksum.ALGORITHM,
        "metadata": m.metadata,
        "files": {
            n: {"size": f.size, "header_size": f.header_size, "header_xxh3": f.header_xxh3}
            for n, f in m.files.items()
        },
        "tensors": {
            n: {
                "dtype": t.dtype,
                "shape": list(t.shape),
                "file": t.file,
                "offsets": [t.start, t.end],
                "xxh3": t.xxh3,
            }
            for n, t in m.tensors.items()
        },
        "tree": m.tree,
    }
    members = ",\n".join(
        f" {json.dumps(k)}: {json.dumps(v, separators=(',', ':'), ensure_ascii=True, allow_nan=False)}"
        for k, v in body.items()
    )
    head = ("{\n" + members).encode("ascii")
    return head + f',\n "manifest_xxh3": "{checksum.digest(head)}"\n}}\n'.encode("ascii")


def _manifest(
    found: dict[str, tuple[str, tuple[int, ...]]], metadata: dict[str, Any]
) -> mf.Manifest:
    tensors, offset = {}, 64
    for i, (name, (dtype, shape)) in enumerate(found.items()):
        n = dtypes.BY_NAME[dtype].itemsize * _prod(shape)
        tensors[name] = mf.TensorRecord(
            dtype, shape, "data-00000.safetensors", offset, offset + n, f"{i:016x}"
        )
        offset += n
    tree = {"t": "dict", "items": [[n, {"t": "tensor", "ref": n, "kind": "torch"}] for n in found]}
    return mf.Manifest(
        tree=tree,
        files={"data-00000.safetensors": mf.FileRecord(offset, 64, "0" * 16)},
        tensors=tensors,
        metadata=metadata,
        writer="savepoint test",
        created="2026-11-27T00:00:00Z",
    )


@given(
    st.dictionaries(NAMES, st.tuples(DTYPES, SHAPES), max_size=40),
    st.dictionaries(
        NAMES, st.one_of(st.integers(), st.text(), st.booleans(), st.none()), max_size=3
    ),
)
@settings(max_examples=200, deadline=None)
def test_dumps_is_the_json_dumps_manifest(found: dict[str, Any], metadata: dict[str, Any]) -> None:
    m = _manifest(found, metadata)
    raw = mf.dumps(m)
    assert raw == reference_dumps(m)
    back = mf.parse(raw)
    assert back.tensors == m.tensors and back.tree == m.tree


def test_dumps_pieces_join_across_piece_boundaries() -> None:
    found = {f"t{i}": ("F32", (2,)) for i in range(mf._PIECE_ENTRIES * 2 + 3)}
    m = _manifest(found, {})
    assert mf.dumps(m) == reference_dumps(m)


# --- parse: the inlined checks against the per-entry ones -----------------------------------


def _raw_manifest(entries: dict[str, Any], tree: Any = None) -> bytes:
    body = {
        "format": "savepoint",
        "format_version": 1,
        "writer": "w",
        "created": "c",
        "checksum": "xxh3-64",
        "metadata": {},
        "files": {"d.safetensors": {"size": 1000, "header_size": 100, "header_xxh3": "0" * 16}},
        "tensors": entries,
        "tree": tree
        if tree is not None
        else {
            "t": "dict",
            "items": [[n, {"t": "tensor", "ref": n, "kind": "numpy"}] for n in entries],
        },
    }
    head = (
        "{\n" + ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in body.items())
    ).encode()
    return head + f',\n "manifest_xxh3": "{checksum.digest(head)}"\n}}\n'.encode()


GOOD = {
    "dtype": "F32",
    "shape": [2, 3],
    "file": "d.safetensors",
    "offsets": [100, 124],
    "xxh3": "0123456789abcdef",
}
HOSTILE_VALUES = {
    "dtype": ["F33", 3, None, ["F32"], "f32"],
    "shape": [
        [2, True],
        [2.0, 3],
        [-1, 3],
        "23",
        [2, 3, 1, 1] + [1] * 61,
        [2**62, 0],
        [3, 2],
        [[2], 3],
    ],
    "file": ["e.safetensors", 1, None, "../d.safetensors"],
    "offsets": [
        [100],
        [100, 124, 1],
        [True, 24],
        [99, 123],
        [990, 1014],
        [124, 100],
        [100.0, 124],
        "x",
    ],
    "xxh3": [
        "0123456789ABCDEF",
        "0123456789abcde",
        "0123456789abcdeg",
        5,
        None,
        "0123456789abcdef ",
    ],
}


def _first_error(entries: dict[str, Any]) -> str | None:
    files = {"d.safetensors": mf.FileRecord(1000, 100, "0" * 16)}
    for name, t in entries.items():
        try:
            mf._v1_record(name, t, files)
        except mf.ManifestError as exc:
            return str(exc)
    return None


@pytest.mark.parametrize(
    ("member", "value"), [(k, v) for k, values in HOSTILE_VALUES.items() for v in values]
)
def test_parse_refuses_what_the_entry_check_refuses(member: str, value: Any) -> None:
    entries = {"a": dict(GOOD), "b": {**GOOD, member: value}, "c": {**GOOD, "xxh3": "g" * 16}}
    raw = _raw_manifest(entries)
    expected = _first_error(entries)
    if expected is None:
        assert mf.parse(raw).tensors["b"] == mf._v1_record(
            "b", entries["b"], {"d.safetensors": mf.FileRecord(1000, 100, "0" * 16)}
        )
        return
    with pytest.raises(mf.ManifestError) as info:
        mf.parse(raw)
    assert str(info.value) == expected


def test_parse_refuses_entries_of_the_wrong_shape() -> None:
    for bad in ([1], "x", {**GOOD, "extra": 1}, {k: v for k, v in GOOD.items() if k != "xxh3"}):
        entries = {"a": dict(GOOD), "b": bad}
        with pytest.raises(mf.ManifestError) as info:
            mf.parse(_raw_manifest(entries))
        assert str(info.value) == _first_error(entries)


def test_shapes_checked_once_still_check_types() -> None:
    """(1,) and (True,) are equal tuples: a cached shape must not let a bool through."""
    entries = {
        "a": {**GOOD, "shape": [6], "offsets": [100, 124]},
        "b": {**GOOD, "shape": [True], "offsets": [124, 128]},
        "c": {**GOOD, "shape": [1], "offsets": [128, 132]},
    }
    entries["a"]["shape"] = [1]
    entries["a"]["offsets"] = [100, 104]
    with pytest.raises(mf.ManifestError, match="shape must be a list"):
        mf.parse(_raw_manifest(entries))


def _slow_tree_error(root: Any, tensors: dict[str, Any]) -> str | None:
    stack = [root]
    try:
        while stack:
            mf._check_node(stack.pop(), tensors, stack)
    except mf.ManifestError as exc:
        return str(exc)
    return None


LEAF = {"t": "tensor", "ref": "a", "kind": "numpy"}
TREES = [
    {"t": "dict", "items": [["a", LEAF], ["b", LEAF]]},
    {"t": "dict", "items": [["a", LEAF], ["a", LEAF]]},
    {"t": "dict", "items": [[1, LEAF], ["1", LEAF]]},
    {"t": "dict", "items": [[1, LEAF], [1, LEAF]]},
    {"t": "dict", "items": [[True, LEAF]]},
    {"t": "dict", "items": [["a", LEAF, 1]]},
    {"t": "dict", "items": [("a", LEAF)]},
    {"t": "dict", "items": {"a": LEAF}},
    {"t": "dict", "items": [["a", {"t": "tensor", "ref": "zz", "kind": "numpy"}]]},
    {"t": "dict", "items": [["a", {"t": "tensor", "ref": "a", "kind": "jax"}]]},
    {"t": "dict", "items": [["a", {"t": "tensor", "ref": "a", "kind": ["numpy"]}]]},
    {"t": "dict", "items": [["a", {"t": "tensor", "ref": ["a"], "kind": "numpy"}]]},
    {"t": "dict", "items": [["a", {"t": "tensor", "ref": "a", "kind": "numpy", "x": 1}]]},
    {"t": "list", "items": [LEAF, {"t": "value", "v": [1]}]},
    {"t": "dict", "items": [["a", LEAF], ["b", {"t": "bytes", "v": "!!"}]]},
    {
        "t": "stateful",
        "type": "m.C",
        "state": {"t": "dict", "items": [["x", {"t": "float", "v": "nan"}]]},
    },
    {"t": "dict", "items": [["a", ["not", "a node"]]]},
    {"t": "dict", "items": [["a", {"t": 5}]]},
    {"t": "tuple", "items": [{"t": "bytes", "v": base64.b64encode(b"ok").decode()}, {"t": "wat"}]},
]


@pytest.mark.parametrize("root", TREES)
def test_tree_check_matches_the_node_by_node_check(root: Any) -> None:
    tensors = {"a": mf.TensorRecord("F32", (2, 3), "d.safetensors", 100, 124, GOOD["xxh3"])}
    expected = _slow_tree_error(copy.deepcopy(root), tensors)
    if expected is None:
        mf._check_tree(root, tensors)
    else:
        with pytest.raises(mf.ManifestError) as info:
            mf._check_tree(root, tensors)
        assert str(info.value) == expected


# --- deferred descriptions ------------------------------------------------------------------


def _info(computed: list[int]) -> CheckpointInfo:
    def compute() -> Any:
        computed.append(1)
        return (TensorInfo.make("k", "F32", (2,), 8, "f", "k"),), {"v": 1}, {"s": "m.C"}

    return CheckpointInfo.deferred(
        compute, path="p", format_version=1, writer="w", created="c", metadata={}, files={"f": 8}
    )


def test_deferred_info_is_an_ordinary_description() -> None:
    computed: list[int] = []
    plain = CheckpointInfo(
        path="p",
        format_version=1,
        writer="w",
        created="c",
        metadata={},
        tensors=(TensorInfo("k", "F32", (2,), 8, "f", "k"),),
        values={"v": 1},
        files={"f": 8},
        stateful={"s": "m.C"},
    )
    info = _info(computed)
    assert computed == [] and info.path == "p" and info.world_size is None
    assert info == plain and plain == info
    assert computed == [1]
    assert info.tensors[0] == plain.tensors[0] and info.total_bytes == 8
    assert repr(_info([])) == repr(plain)
    assert pickle.loads(pickle.dumps(_info([]))) == plain
    assert copy.deepcopy(_info([])) == plain
    assert dataclasses.replace(_info([]), path="q") == dataclasses.replace(plain, path="q")
    assert _info([]).to_dict() == plain.to_dict()
    with pytest.raises(AttributeError):
        _ = info.nothing  # type: ignore[attr-defined]
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.path = "x"  # type: ignore[misc]


# --- repeated keys in a manifest large enough to be counted, not hooked -----------------------


def _big_manifest_text() -> str:
    found = {f"layer{i}.w": ("F32", (2,)) for i in range(6000)}
    m = _manifest(found, {"run": {"lr": 0.1, "tags": ["a"]}})
    raw = mf.dumps(m)
    assert len(raw) > 1 << 20
    return raw.decode("ascii")


def _resealed(text: str) -> bytes:
    head = text[: text.index(',\n "manifest_xxh3"')].encode("ascii")
    return head + f',\n "manifest_xxh3": "{checksum.digest(head)}"\n}}\n'.encode("ascii")


REPEATS = {
    "top level": ('"writer": "savepoint test"', '"writer": "x", "writer": "savepoint test"'),
    "metadata": ('"lr":0.1', '"lr":0.1,"lr":0.2'),
    "file entry": ('"size":', '"size":1,"size":'),
    "tensor entry": ('"layer7.w":{"dtype":"F32"', '"layer7.w":{"dtype":"F32","dtype":"F32"'),
    "tensors object": ('"layer8.w":{', '"layer9.w":{"dtype":"F32"},"layer8.w":{'),
    "tree tensor node": (
        '{"t":"tensor","ref":"layer3.w"',
        '{"t":"tensor","ref":"layer4.w","ref":"layer3.w"',
    ),
    "tree dict node": ('{"t":"dict","items"', '{"t":"dict","t":"dict","items"'),
    "extra member of a node": (
        '{"t":"tensor","ref":"layer5.w"',
        '{"x":{"a":1,"a":2},"t":"tensor","ref":"layer5.w"',
    ),
}


@pytest.mark.parametrize("where", sorted(REPEATS))
def test_repeated_keys_are_refused_anywhere_in_a_counted_manifest(where: str) -> None:
    from savepoint.codecs import bounded_json

    old, new = REPEATS[where]
    text = _big_manifest_text()
    assert old in text
    raw = _resealed(text.replace(old, new, 1))
    assert bounded_json.loads_counted(raw, mf.ManifestError, "m")[1] is not None
    with pytest.raises(mf.ManifestError, match="duplicate key"):
        mf.parse(raw)


def test_members_readers_ignore_are_counted_not_refused() -> None:
    text = _big_manifest_text()
    text = text.replace(
        '{"t":"tensor","ref":"layer5.w"',
        '{"x":{"a":{"b":[{"c":1}]}},"t":"tensor","ref":"layer5.w"',
        1,
    )
    text = text.replace(
        '"checksum": "xxh3-64"', '"checksum": "xxh3-64",\n "future": {"k": [{"v": 1}]}', 1
    )
    m = mf.parse(_resealed(text))
    assert len(m.tensors) == 6000
