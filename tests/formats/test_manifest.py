"""savepoint.codecs.manifest: serialisation, the checksum trailer, and every validation rule."""

from __future__ import annotations

import copy
import json
import math
import re
from typing import Any

import pytest

from _support import stable_id
from savepoint.codecs import checksum
from savepoint.codecs import manifest as mf
from savepoint.errors import UnsupportedStateError

FILE = "data-00000.safetensors"
DIGEST = "0123456789abcdef"


def sample_manifest() -> mf.Manifest:
    tree = {
        "t": "dict",
        "items": [
            ["w", {"t": "tensor", "ref": "w", "kind": "torch"}],
            ["tied", {"t": "tensor", "ref": "w", "kind": "torch"}],
            [0, {"t": "tensor", "ref": "e", "kind": "numpy"}],
            ["0", {"t": "tensor", "ref": "s", "kind": "numpy_scalar"}],
            [
                "ключ/\ud800",
                {"t": "list", "items": [{"t": "value", "v": None}, {"t": "value", "v": -0.0}]},
            ],
            [
                "t",
                {"t": "tuple", "items": [{"t": "float", "v": "nan"}, {"t": "float", "v": "-inf"}]},
            ],
            ["b", {"t": "bytes", "v": "AP8="}],
            ["big", {"t": "value", "v": 2**80}],
            [
                "opt",
                {
                    "t": "stateful",
                    "type": "torch.optim.adamw.AdamW",
                    "state": {"t": "dict", "items": [["lr", {"t": "value", "v": 0.001}]]},
                },
            ],
        ],
    }
    return mf.Manifest(
        tree=tree,
        files={
            FILE: mf.FileRecord(size=200, header_size=96, header_xxh3=DIGEST),
            "data-00001.safetensors": mf.FileRecord(size=8, header_size=8, header_xxh3="f" * 16),
        },
        tensors={
            "w": mf.TensorRecord("F32", (2, 3), FILE, 104, 128, "a" * 16),
            "e": mf.TensorRecord("I8", (0, 5), FILE, 128, 128, "b" * 16),
            "s": mf.TensorRecord("F64", (), FILE, 96, 104, "c" * 16),
        },
        metadata={"step": 12, "note": "héllo", "nested": {"a": [1, 2.5, None, True]}, "neg": -0.0},
        writer="savepoint 0.1.0",
        created="2025-01-02T03:04:05.678901Z",
    )


def encode(doc: dict[str, Any]) -> bytes:
    """Serialise any JSON document the way dumps() lays a manifest out, with a valid trailer."""
    members = ",\n".join(
        f" {json.dumps(k)}: {json.dumps(v, separators=(',', ':'), ensure_ascii=True)}"
        for k, v in doc.items()
    )
    return seal(("{\n" + members).encode("ascii"))


def seal(head: bytes) -> bytes:
    return head + f',\n "manifest_xxh3": "{checksum.digest(head)}"\n}}\n'.encode("ascii")


def sample_doc() -> dict[str, Any]:
    raw = mf.dumps(sample_manifest())
    doc = json.loads(raw)
    del doc["manifest_xxh3"]
    return doc


def rejects(doc: dict[str, Any], match: str) -> None:
    with pytest.raises(mf.ManifestError, match=match):
        mf.parse(encode(doc))


# ---------------------------------------------------------------------------------------------
# round trip and layout
# ---------------------------------------------------------------------------------------------


def test_round_trip() -> None:
    m = sample_manifest()
    raw = mf.dumps(m)
    back = mf.parse(raw)
    assert back == m
    assert list(back.tensors) == ["w", "e", "s"]
    assert list(back.files) == [FILE, "data-00001.safetensors"]
    assert [k for k, _ in back.tree["items"]] == [k for k, _ in m.tree["items"]]
    assert type(back.tree["items"][2][0]) is int
    assert math.copysign(1, back.metadata["neg"]) == -1
    assert math.copysign(1, back.tree["items"][4][1]["items"][1]["v"]) == -1
    assert back.tree["items"][7][1]["v"] == 2**80
    assert mf.dumps(back) == raw


def test_dumps_layout() -> None:
    raw = mf.dumps(sample_manifest())
    raw.decode("ascii")
    assert raw.startswith(b'{\n "format": "savepoint",\n "format_version": 1,\n')
    lines = raw.decode().split("\n")
    assert [line.split(":")[0] for line in lines[1:-2]] == [
        ' "format"',
        ' "format_version"',
        ' "writer"',
        ' "created"',
        ' "checksum"',
        ' "metadata"',
        ' "files"',
        ' "tensors"',
        ' "tree"',
        ' "manifest_xxh3"',
    ]
    m = re.search(rb',\n "manifest_xxh3": "([0-9a-f]{16})"\n}\n\Z', raw)
    assert m is not None
    assert m.group(1).decode() == checksum.digest(raw[: m.start()])
    assert raw == encode(sample_doc())  # the test helper mirrors the real layout


def test_dumps_refuses_non_finite_floats() -> None:
    m = sample_manifest()
    m.metadata["bad"] = math.nan
    with pytest.raises(UnsupportedStateError, match="cannot store"):
        mf.dumps(m)


def test_minimal_manifest() -> None:
    m = mf.Manifest(tree={"t": "dict", "items": []})
    back = mf.parse(mf.dumps(m))
    assert back == m
    assert back.format_version == 1


# ---------------------------------------------------------------------------------------------
# the trailer checksum
# ---------------------------------------------------------------------------------------------


def test_any_flipped_bit_is_detected() -> None:
    raw = mf.dumps(sample_manifest())
    for pos in range(len(raw)):
        for bit in (0x01, 0x20, 0x80):
            edited = bytearray(raw)
            edited[pos] ^= bit
            with pytest.raises(mf.ManifestError):
                mf.parse(bytes(edited))


@pytest.mark.parametrize(
    "edit",
    [
        lambda raw: raw[:-1],
        lambda raw: raw[:-30],
        lambda raw: raw[: len(raw) // 2],
        lambda raw: b"",
        lambda raw: raw + b"\n",
        lambda raw: raw + b" ",
        lambda raw: b" " + raw,
        lambda raw: raw.replace(b"\n", b"\r\n"),
        lambda raw: raw.replace(b'"step":12', b'"step":13'),
        lambda raw: raw.replace(b'"step":12', b'"step": 12'),  # same JSON, other bytes
        lambda raw: raw.replace(b'"F32"', b'"F64"'),
        lambda raw: raw.replace(b"savepoint 0.1.0", b"savepoint 9.9.9"),
    ],
    ids=[
        "drop-last",
        "drop-30",
        "half",
        "empty",
        "extra-newline",
        "extra-space",
        "leading-space",
        "crlf",
        "value",
        "whitespace",
        "dtype",
        "writer",
    ],
)
def test_edits_are_detected(edit: Any) -> None:
    raw = mf.dumps(sample_manifest())
    edited = edit(raw)
    assert edited != raw
    with pytest.raises(mf.ManifestError, match=r"trailer|checksum"):
        mf.parse(edited)


def test_reordered_members_with_a_fresh_trailer_still_parse() -> None:
    # The checksum protects bytes, not a member order: a consistent rewrite is a valid manifest.
    doc = sample_doc()
    reordered = {k: doc[k] for k in reversed(list(doc))}
    assert mf.parse(encode(reordered)) == sample_manifest()


def test_size_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    raw = mf.dumps(sample_manifest())
    monkeypatch.setattr(mf._records, "MAX_MANIFEST_BYTES", len(raw) - 1)
    with pytest.raises(mf.ManifestError, match="cap"):
        mf.parse(raw)
    monkeypatch.setattr(mf._records, "MAX_MANIFEST_BYTES", len(raw))
    mf.parse(raw)


# ---------------------------------------------------------------------------------------------
# versions
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", [mf.VERSION + 1, 99, 2**70])
def test_newer_versions_are_refused_with_a_version_error(version: int) -> None:
    doc = sample_doc()
    doc["format_version"] = version
    # A newer format may change anything after the version; that must not turn into corruption.
    doc["checksum"] = "blake3"
    doc["files"] = {"../../elsewhere": {"new": "layout"}}
    doc["tree"] = {"t": "something-new"}
    with pytest.raises(mf.ManifestVersionError) as info:
        mf.parse(encode(doc))
    assert not isinstance(info.value, mf.ManifestError)
    assert str(version) in str(info.value)
    assert "savepoint 0.1.0" in str(info.value)


def test_older_and_current_versions_are_read() -> None:
    for version in (0, 1):  # version 2 (sharded) has another tensor layout: test_manifest_v2
        doc = sample_doc()
        doc["format_version"] = version
        assert mf.parse(encode(doc)).format_version == version


@pytest.mark.parametrize("version", ["1", 1.0, 2.0, True, -1, None, [1]], ids=stable_id)
def test_bad_version_values(version: Any) -> None:
    doc = sample_doc()
    doc["format_version"] = version
    rejects(doc, "format_version")


def test_missing_version() -> None:
    doc = sample_doc()
    del doc["format_version"]
    rejects(doc, "format_version")


# ---------------------------------------------------------------------------------------------
# top-level members
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("member", "value", "match"),
    [
        ("format", "safetensors", "not a savepoint manifest"),
        ("format", None, "not a savepoint manifest"),
        ("checksum", "crc32c", "unknown checksum"),
        ("checksum", None, "unknown checksum"),
        ("writer", 1, "writer must be a string"),
        ("writer", None, "writer must be a string"),
        ("created", 1700000000, "created must be a string"),
        ("metadata", [], "metadata must be an object"),
        ("metadata", None, "metadata must be an object"),
        ("metadata", "x", "metadata must be an object"),
        ("files", [], "files must be an object"),
        ("files", None, "files must be an object"),
        ("tensors", [], "tensors must be an object"),
        ("tensors", "w", "tensors must be an object"),
        ("tree", None, "malformed node"),
        ("tree", [], "malformed node"),
    ],
)
def test_top_level_members(member: str, value: Any, match: str) -> None:
    doc = sample_doc()
    doc[member] = value
    rejects(doc, match)


@pytest.mark.parametrize(
    "member", ["format", "checksum", "writer", "created", "metadata", "files", "tensors", "tree"]
)
def test_missing_members(member: str) -> None:
    doc = sample_doc()
    del doc[member]
    with pytest.raises(mf.ManifestError):
        mf.parse(encode(doc))


@pytest.mark.parametrize(
    "head",
    [b"{\n", b'{\n "format": ', b"[\n 1", b'{\n "a": 1} {"b": 2', b'\xff\xfe{\n "a": 1'],
    ids=["open", "no-value", "array", "two-docs", "bad-utf8"],
)
def test_invalid_json_with_a_valid_trailer(head: bytes) -> None:
    with pytest.raises(mf.ManifestError, match="not valid JSON"):
        mf.parse(seal(head))


def test_non_object_document() -> None:
    # "[\n 1" + trailer is not JSON either; an array whose last member looks like the trailer is.
    with pytest.raises(mf.ManifestError):
        mf.parse(seal(b'[\n "x"'))


def test_deeply_nested_json_is_refused_cleanly() -> None:
    doc = sample_doc()
    depth = 200_000
    nested = "[" * depth + "]" * depth
    doc_text = encode(doc).decode()
    assert '"metadata": {' in doc_text
    doc_text = doc_text.replace('"metadata": {', '"metadata": {"deep":' + nested + ",", 1)
    head = doc_text[: doc_text.rindex(',\n "manifest_xxh3"')].encode()
    with pytest.raises(mf.ManifestError):
        mf.parse(seal(head))


# ---------------------------------------------------------------------------------------------
# duplicate keys, anywhere
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ('"format": "savepoint",', '"format": "savepoint",\n "format": "savepoint",'),
        ('"metadata": {"step":12,', '"metadata": {"step":12,"step":12,'),
        ('"nested":{"a":', '"nested":{"a":1,"a":'),
        ('"size":200,', '"size":200,"size":200,'),
        (
            f'"files": {{"{FILE}":',
            f'"files": {{"{FILE}":{{"size":1,"header_size":8,"header_xxh3":"{DIGEST}"}},"{FILE}":',
        ),
        ('"tensors": {"w":', '"tensors": {"w":{},"w":'),
        ('"dtype":"F32",', '"dtype":"F32","dtype":"F32",'),
        ('{"t":"bytes","v":"AP8="}', '{"t":"bytes","v":"AP8=","v":"AP8="}'),
        ('{"t":"bytes",', '{"t":"bytes","t":"bytes",'),
    ],
    ids=[
        "top",
        "metadata",
        "metadata-nested",
        "file-entry",
        "files",
        "tensors",
        "tensor-entry",
        "tree-node",
        "tree-t",
    ],
)
def test_duplicate_json_keys(old: str, new: str) -> None:
    text = encode(sample_doc()).decode()
    head = text[: text.rindex(',\n "manifest_xxh3"')]
    assert old in head, old
    with pytest.raises(mf.ManifestError, match="duplicate key"):
        mf.parse(seal(head.replace(old, new, 1).encode()))


def test_trailer_member_cannot_be_duplicated() -> None:
    text = encode(sample_doc()).decode()
    head = text[: text.rindex(',\n "manifest_xxh3"')] + ',\n "manifest_xxh3": "0000000000000000"'
    with pytest.raises(mf.ManifestError, match="duplicate key"):
        mf.parse(seal(head.encode()))


# ---------------------------------------------------------------------------------------------
# files
# ---------------------------------------------------------------------------------------------


def _rename_file(doc: dict[str, Any], name: str) -> None:
    doc["files"] = {name if k == FILE else k: v for k, v in doc["files"].items()}
    for t in doc["tensors"].values():
        if t["file"] == FILE:
            t["file"] = name


@pytest.mark.parametrize(
    "name",
    [
        "..",
        "../x",
        "a..b",
        "data..safetensors",
        "a/b",
        "/etc/passwd",
        "/abs",
        "C:\\x",
        "a\\b",
        ".hidden",
        ".",
        "",
        "-dash",
        "_under",
        "x" * 201,
        "data-0.safetensors\n",
        "data 0",
        "dätä",
        "a\x00b",
    ],
    ids=stable_id,
)
def test_bad_file_names(name: str) -> None:
    doc = sample_doc()
    _rename_file(doc, name)
    rejects(doc, "not a plain file name")


@pytest.mark.parametrize("name", ["a", "A0", "x" * 200, "data-00000.safetensors", "a.b_c-d", "0"])
def test_good_file_names(name: str) -> None:
    doc = sample_doc()
    _rename_file(doc, name)
    assert name in mf.parse(encode(doc)).files


@pytest.mark.parametrize(
    ("entry", "match"),
    [
        ([], "entry must have"),
        (None, "entry must have"),
        ({"size": 200, "header_size": 96}, "entry must have"),
        ({"size": 200, "header_size": 96, "header_xxh3": DIGEST, "x": 1}, "entry must have"),
        ({"size": -1, "header_size": 8, "header_xxh3": DIGEST}, "bad sizes"),
        ({"size": 200.0, "header_size": 96, "header_xxh3": DIGEST}, "bad sizes"),
        ({"size": "200", "header_size": 96, "header_xxh3": DIGEST}, "bad sizes"),
        ({"size": 200, "header_size": True, "header_xxh3": DIGEST}, "bad sizes"),
        ({"size": 200, "header_size": None, "header_xxh3": DIGEST}, "bad sizes"),
        ({"size": 200, "header_size": 7, "header_xxh3": DIGEST}, "header larger|header"),
        ({"size": 200, "header_size": 0, "header_xxh3": DIGEST}, "header"),
        ({"size": 95, "header_size": 96, "header_xxh3": DIGEST}, "header larger than the file"),
        ({"size": 200, "header_size": 96, "header_xxh3": DIGEST.upper()}, "bad header checksum"),
        ({"size": 200, "header_size": 96, "header_xxh3": DIGEST[:-1]}, "bad header checksum"),
        ({"size": 200, "header_size": 96, "header_xxh3": DIGEST + "0"}, "bad header checksum"),
        ({"size": 200, "header_size": 96, "header_xxh3": "g" * 16}, "bad header checksum"),
        ({"size": 200, "header_size": 96, "header_xxh3": 12345}, "bad header checksum"),
        ({"size": 200, "header_size": 96, "header_xxh3": None}, "bad header checksum"),
    ],
)
def test_file_entries(entry: Any, match: str) -> None:
    doc = sample_doc()
    doc["files"][FILE] = entry
    rejects(doc, match)


def test_header_only_file_is_fine() -> None:
    doc = sample_doc()
    assert mf.parse(encode(doc)).files["data-00001.safetensors"] == mf.FileRecord(8, 8, "f" * 16)


# ---------------------------------------------------------------------------------------------
# tensors
# ---------------------------------------------------------------------------------------------


def _tensor(**changes: Any) -> dict[str, Any]:
    doc = sample_doc()
    entry = doc["tensors"]["w"]
    for k, v in changes.items():
        if v is _DROP:
            entry.pop(k)
        else:
            entry[k] = v
    return doc


_DROP = object()


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"dtype": _DROP}, "entry must have"),
        ({"extra": 1}, "entry must have"),
        ({"dtype": "F128"}, "unknown dtype"),
        ({"dtype": "f32"}, "unknown dtype"),
        ({"dtype": None}, "unknown dtype"),
        ({"dtype": 4}, "unknown dtype"),
        ({"dtype": ["F32"]}, "unknown dtype"),
        ({"dtype": {"F32": 1}}, "unknown dtype"),
        ({"shape": 6}, "shape must be"),
        ({"shape": None}, "shape must be"),
        ({"shape": [2, -3]}, "shape must be"),
        ({"shape": [2.0, 3]}, "shape must be"),
        ({"shape": [True, 6]}, "shape must be"),
        ({"shape": ["2", 3]}, "shape must be"),
        ({"shape": [1] * 65 + [6]}, "at most 64"),
        ({"file": "data-00002.safetensors"}, "unknown file"),
        ({"file": None}, "unknown file"),
        ({"file": 0}, "unknown file"),
        ({"file": [FILE]}, "unknown file"),
        ({"offsets": None}, "offsets must be"),
        ({"offsets": [104]}, "offsets must be"),
        ({"offsets": [104, 116, 128]}, "offsets must be"),
        ({"offsets": [-1, 23]}, "offsets must be"),
        ({"offsets": [104.0, 128]}, "offsets must be"),
        ({"offsets": [False, 24]}, "offsets must be"),
        ({"offsets": "104-128"}, "offsets must be"),
        ({"offsets": [88, 112]}, "outside the data"),  # starts inside the header
        ({"offsets": [0, 24]}, "outside the data"),
        ({"offsets": [190, 214]}, "outside the data"),  # ends past the file
        ({"offsets": [128, 104]}, "outside the data"),  # reversed
        ({"offsets": [104, 127]}, "bytes recorded"),
        ({"offsets": [104, 129]}, "bytes recorded"),
        ({"shape": [3, 3]}, "bytes recorded"),
        ({"shape": []}, "bytes recorded"),  # 0-d is one element, 4 bytes
        ({"shape": [0]}, "bytes recorded"),
        ({"dtype": "F64"}, "bytes recorded"),
        ({"xxh3": "A" * 16}, "bad checksum"),
        ({"xxh3": ""}, "bad checksum"),
        ({"xxh3": None}, "bad checksum"),
    ],
    ids=stable_id,
)
def test_tensor_entries(changes: dict[str, Any], match: str) -> None:
    rejects(_tensor(**changes), match)


@pytest.mark.parametrize("entry", [None, [], "w", 1])
def test_tensor_entry_not_an_object(entry: Any) -> None:
    doc = sample_doc()
    doc["tensors"]["w"] = entry
    rejects(doc, "entry must have")


def test_tensor_boundaries_accepted() -> None:
    doc = _tensor(shape=[1] * 62 + [2, 3])  # 64 dims is the limit
    assert mf.parse(encode(doc)).tensors["w"].shape == (1,) * 62 + (2, 3)
    doc = _tensor(offsets=[176, 200])  # ends exactly at the end of the file
    assert mf.parse(encode(doc)).tensors["w"].end == 200
    doc = _tensor(shape=[0], offsets=[200, 200])  # empty at the very end
    assert mf.parse(encode(doc)).tensors["w"].nbytes == 0
    doc = _tensor(shape=[2**40, 0], offsets=[96, 96])  # huge dim times zero
    assert mf.parse(encode(doc)).tensors["w"].shape == (2**40, 0)


def test_huge_shape_does_not_overflow() -> None:
    rejects(_tensor(shape=[2**62, 2**62]), "too large")
    rejects(_tensor(shape=[0, 2**64]), "too large")  # zero elements, yet not allocatable


# ---------------------------------------------------------------------------------------------
# tree
# ---------------------------------------------------------------------------------------------


def _tree(node: Any) -> dict[str, Any]:
    doc = sample_doc()
    doc["tree"] = {"t": "dict", "items": [["ok", {"t": "value", "v": 1}], ["x", node]]}
    return doc


GOOD_NODES = [
    {"t": "value", "v": None},
    {"t": "value", "v": "s"},
    {"t": "value", "v": 1.5},
    {"t": "value", "v": -(2**90)},
    {"t": "float", "v": "inf"},
    {"t": "bytes", "v": ""},
    {"t": "list", "items": []},
    {"t": "tuple", "items": [{"t": "tensor", "ref": "s", "kind": "numpy_scalar"}]},
    {"t": "dict", "items": [[1, {"t": "value", "v": 1}], ["1", {"t": "value", "v": 2}]]},
    {"t": "stateful", "type": "m.C", "state": {"t": "dict", "items": []}},
]


@pytest.mark.parametrize("node", GOOD_NODES, ids=lambda n: json.dumps(n)[:40])
def test_good_tree_nodes(node: Any) -> None:
    assert mf.parse(encode(_tree(node))).tree["items"][1][1] == node


BAD_NODES = [
    (None, "malformed node"),
    ([], "malformed node"),
    ("value", "malformed node"),
    ({}, "malformed node"),
    ({"t": 1}, "malformed node"),
    ({"t": None}, "malformed node"),
    ({"t": "set", "items": []}, "unknown node type"),
    ({"t": "Value", "v": 1}, "unknown node type"),
    ({"t": "dict"}, "dict node without items"),
    ({"t": "dict", "items": {}}, "dict node without items"),
    ({"t": "dict", "items": [["a"]]}, "malformed dict item"),
    ({"t": "dict", "items": [["a", {"t": "value", "v": 1}, 3]]}, "malformed dict item"),
    ({"t": "dict", "items": [{"a": {"t": "value", "v": 1}}]}, "malformed dict item"),
    ({"t": "dict", "items": [[1.5, {"t": "value", "v": 1}]]}, "not a string or integer"),
    ({"t": "dict", "items": [[True, {"t": "value", "v": 1}]]}, "not a string or integer"),
    ({"t": "dict", "items": [[None, {"t": "value", "v": 1}]]}, "not a string or integer"),
    ({"t": "dict", "items": [[["a"], {"t": "value", "v": 1}]]}, "not a string or integer"),
    (
        {"t": "dict", "items": [["a", {"t": "value", "v": 1}], ["a", {"t": "value", "v": 2}]]},
        "duplicate dict key",
    ),
    (
        {"t": "dict", "items": [[3, {"t": "value", "v": 1}], [3, {"t": "value", "v": 2}]]},
        "duplicate dict key",
    ),
    ({"t": "dict", "items": [["a", None]]}, "malformed node"),
    ({"t": "list"}, "list node without items"),
    ({"t": "tuple", "items": None}, "tuple node without items"),
    ({"t": "list", "items": [{"t": "nope"}]}, "unknown node type"),
    ({"t": "tensor", "ref": "missing", "kind": "numpy"}, "unknown tensor"),
    ({"t": "tensor", "kind": "numpy"}, "unknown tensor"),
    ({"t": "tensor", "ref": None, "kind": "numpy"}, "unknown tensor"),
    ({"t": "tensor", "ref": ["w"], "kind": "numpy"}, "unknown tensor"),
    ({"t": "tensor", "ref": {"w": 1}, "kind": "numpy"}, "unknown tensor"),
    ({"t": "tensor", "ref": "w", "kind": "jax"}, "unknown tensor kind"),
    ({"t": "tensor", "ref": "w"}, "unknown tensor kind"),
    ({"t": "tensor", "ref": "w", "kind": ["numpy"]}, "unknown tensor kind"),
    ({"t": "stateful", "state": {"t": "value", "v": 1}}, "stateful node without a type"),
    ({"t": "stateful", "type": 3, "state": {"t": "value", "v": 1}}, "stateful node without a type"),
    ({"t": "stateful", "type": "m.C"}, "malformed node"),
    ({"t": "value"}, "not a scalar"),
    ({"t": "value", "v": [1]}, "not a scalar"),
    ({"t": "value", "v": {"a": 1}}, "not a scalar"),
    ({"t": "float", "v": "NaN"}, "bad special float"),
    ({"t": "float", "v": 1.5}, "bad special float"),
    ({"t": "float"}, "bad special float"),
    ({"t": "float", "v": ["nan"]}, "bad special float"),
    ({"t": "bytes", "v": 5}, "bytes node without base64 text"),
    ({"t": "bytes"}, "bytes node without base64 text"),
]


@pytest.mark.parametrize(("node", "match"), BAD_NODES, ids=lambda x: json.dumps(x)[:50])
def test_bad_tree_nodes(node: Any, match: str) -> None:
    rejects(_tree(node), match)


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_non_standard_json_numbers_in_values_are_refused(literal: str) -> None:
    # dumps() never writes these (allow_nan=False) and the format says values are finite floats;
    # Python's json module would accept them, so parse() has to refuse them itself.
    text = encode(_tree({"t": "value", "v": 12345})).decode()
    head = text[: text.rindex(',\n "manifest_xxh3"')]
    assert head.count('"v":12345}') == 1
    head = head.replace('"v":12345}', f'"v":{literal}}}')
    with pytest.raises(mf.ManifestError):
        mf.parse(seal(head.encode()))


def test_bad_node_deep_in_the_tree_is_found() -> None:
    node: Any = {"t": "value", "v": [1]}
    for i in range(200):
        node = {"t": "list" if i % 2 else "dict", "items": [node] if i % 2 else [["k", node]]}
    rejects(_tree(node), "not a scalar")


def test_tree_root_may_be_any_node() -> None:
    for root in ({"t": "value", "v": 3}, {"t": "tensor", "ref": "w", "kind": "torch"}):
        doc = sample_doc()
        doc["tree"] = copy.deepcopy(root)
        assert mf.parse(encode(doc)).tree == root
