"""Hostile manifests: forged by hand with a valid self-checksum, so that only savepoint's own
checks stand between them and the filesystem.

Everything wrong with a manifest must be refused with a CheckpointError subclass before any data
file is opened (and therefore before anything is mapped or allocated); a data file that is a
symlink or not a regular file must be refused when it is opened.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import savepoint as sp
from savepoint.codecs import manifest as mf
from savepoint.storage.faults import FaultyStore
from savepoint.storage.local import LocalStore
from savepoint.storage.paths import Location

from ._util import (
    MANIFEST,
    Hang,
    assert_same,
    compact,
    deadline,
    doc_members,
    forge,
    head_from_members,
    read_doc,
    seal,
    write_manifest,
)

DATA = "data-00000.safetensors"
PEAK_LIMIT = 4 << 20


def make_state() -> dict[str, Any]:
    return {
        "w": np.arange(6, dtype=np.float32).reshape(2, 3),
        "v": np.arange(4, dtype=np.int64),
        "nested": {"x": np.full(3, 1.5, dtype=np.float16), 7: "seven"},
        "s": 5,
        "b": b"abc",
    }


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    path = tmp_path / "ckpt"
    sp.save(path, make_state(), metadata={"k": "v"})
    assert sorted(os.listdir(path)) == sorted([DATA, MANIFEST])
    # A faithful copy of the data file outside the checkpoint: following a hostile name or
    # symlink to it would "work", so only a refusal passes the tests below.
    shutil.copyfile(path / DATA, tmp_path / "outside.safetensors")
    return path


@pytest.fixture
def doc(ckpt: Path) -> dict[str, Any]:
    return read_doc(ckpt)


class Recorder:
    """A FaultyStore around the local disk, for the ops to read through (``rec.at(ckpt)``): its
    call log says which blobs they opened and how often they viewed (mapped) one."""

    def __init__(self) -> None:
        self.store = FaultyStore(LocalStore())

    def at(self, path: Path) -> Location:
        return self.store.at(str(path))

    def reset(self) -> None:
        self.store.calls.clear()

    @property
    def opened(self) -> list[str]:
        return [c.path for c in self.store.calls if c.kind == "open_blob"]

    @property
    def maps(self) -> int:
        return sum(c.kind == "view" for c in self.store.calls)

    def non_manifest_opens(self) -> list[str]:
        return [p for p in self.opened if os.path.basename(p) != MANIFEST]


@pytest.fixture
def rec() -> Recorder:
    return Recorder()


OPS: dict[str, Callable[[Any], Any]] = {
    "load": lambda p: sp.load(p),
    "load(verify=False)": lambda p: sp.load(p, verify=False),
    "load(mmap=True)": lambda p: sp.load(p, mmap=True),
    "verify": lambda p: sp.verify(p),
    "inspect": lambda p: sp.inspect(p),
}
DATA_OPS = {k: v for k, v in OPS.items() if k != "inspect"}


def run_op(
    op: Callable[[Any], Any], path: Path | Location, what: str, timeout: float = 10.0
) -> BaseException | str:
    try:
        with deadline(timeout, what):
            op(path)
    except sp.CheckpointError as exc:
        return exc
    except Hang as exc:
        return f"hang: {exc}"
    except Exception as exc:
        return f"raised {type(exc).__module__}.{type(exc).__qualname__}: {exc}"
    return "returned without an error"


def assert_refused_before_data(
    ckpt: Path,
    rec: Recorder,
    expected: type[sp.CheckpointError] = sp.CorruptCheckpointError,
    *,
    ops: dict[str, Callable[[Any], Any]] = OPS,
    trace: bool = False,
) -> list[BaseException]:
    """Every op raises ``expected`` from the manifest alone: no data file opened or mapped."""
    problems: list[str] = []
    errors: list[BaseException] = []
    for name, op in ops.items():
        rec.reset()
        if trace:
            tracemalloc.start()
        try:
            result = run_op(op, rec.at(ckpt), name)
            peak = tracemalloc.get_traced_memory()[1] if trace else 0
        finally:
            if trace:
                tracemalloc.stop()
        if isinstance(result, str):
            problems.append(f"{name} {result}")
            continue
        errors.append(result)
        if not isinstance(result, expected):
            problems.append(
                f"{name} raised {type(result).__name__} instead of {expected.__name__}: {result}"
            )
        # The forged manifest's checksum is right: the refusal must come from its content.
        msg = str(result)
        if "checksum does not match" in msg or "no checksum trailer" in msg:
            problems.append(f"{name} refused on the checksum, test forging is broken: {msg}")
        if rec.non_manifest_opens():
            problems.append(
                f"{name} opened {rec.non_manifest_opens()} before refusing the manifest"
            )
        if rec.maps:
            problems.append(f"{name} mapped {rec.maps} file(s) before refusing the manifest")
        if trace and peak >= PEAK_LIMIT:
            problems.append(f"{name}: peak allocation {peak} B")
    assert not problems, "\n".join(problems)
    return errors


# ---------------------------------------------------------------------------------------------
# the forging helpers are faithful
# ---------------------------------------------------------------------------------------------


def test_forged_manifest_matches_dumps_byte_for_byte(ckpt: Path, doc: dict[str, Any]) -> None:
    assert forge(doc) == (ckpt / MANIFEST).read_bytes()


def test_forged_valid_change_is_accepted(ckpt: Path, doc: dict[str, Any], rec: Recorder) -> None:
    doc["metadata"] = {"forged": True}
    write_manifest(ckpt, forge(doc))
    assert sp.inspect(rec.at(ckpt)).metadata == {"forged": True}
    assert_same(sp.load(rec.at(ckpt)), make_state())
    sp.verify(rec.at(ckpt))
    assert rec.maps >= 1 and any(p.endswith(DATA) for p in rec.opened)  # the recorder records


# ---------------------------------------------------------------------------------------------
# data file names that could leave the directory
# ---------------------------------------------------------------------------------------------


def rename_data_file(doc: dict[str, Any], new: str) -> None:
    doc["files"] = {new: doc["files"][DATA]}
    for t in doc["tensors"].values():
        t["file"] = new


HOSTILE_NAMES = {
    "parent": "../outside.safetensors",
    "dotdot": "..",
    "dot": ".",
    "dotdot-inside": "ok/../" + DATA,
    "dot-slash": "./" + DATA,
    "absolute": "<abs>",
    "absolute-root": "/etc/passwd",
    "subdir": "sub/" + DATA,
    "trailing-slash": DATA + "/",
    "backslash": "sub\\" + DATA,
    "backslash-parent": "..\\outside.safetensors",
    "empty": "",
    "hidden": ".hidden",
    "nul": DATA + "\x00",
    "newline": DATA + "\n",
    "home": "~/outside.safetensors",
    "too-long": "d" * 201,
}


@pytest.mark.parametrize("case", list(HOSTILE_NAMES))
def test_data_file_names_that_escape_are_refused(
    case: str, ckpt: Path, doc: dict[str, Any], rec: Recorder
) -> None:
    name = HOSTILE_NAMES[case]
    if name == "<abs>":
        name = str(ckpt.parent / "outside.safetensors")
    # Make the escape routes real, so that following them would succeed.
    (ckpt / "sub").mkdir()
    shutil.copyfile(ckpt / DATA, ckpt / "sub" / DATA)
    (ckpt / "ok").mkdir()
    rename_data_file(doc, name)
    write_manifest(ckpt, forge(doc))
    errors = assert_refused_before_data(ckpt, rec)
    assert all("file name" in str(e) for e in errors), [str(e) for e in errors]


def test_names_in_the_escape_table_would_resolve(ckpt: Path) -> None:
    # Guard for the table above: the escaping names do reach a real copy of the data.
    assert (ckpt / "../outside.safetensors").is_file()
    assert (ckpt.parent / "outside.safetensors").read_bytes() == (ckpt / DATA).read_bytes()


# ---------------------------------------------------------------------------------------------
# symlinks and files that are not regular files
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("target", ["absolute", "relative"])
def test_data_file_symlink_is_refused(ckpt: Path, rec: Recorder, target: str) -> None:
    outside = ckpt.parent / "outside.safetensors"
    (ckpt / DATA).unlink()
    (ckpt / DATA).symlink_to(outside if target == "absolute" else Path("..") / outside.name)
    assert (ckpt / DATA).read_bytes() == outside.read_bytes()
    for name, op in DATA_OPS.items():
        rec.reset()
        result = run_op(op, rec.at(ckpt), name)
        assert isinstance(result, sp.CorruptCheckpointError), f"{name}: {result!r}"
        assert "symlink" in str(result), f"{name}: {result}"
        assert rec.maps == 0, f"{name} mapped the symlinked file"


def test_manifest_symlink_is_refused(ckpt: Path, rec: Recorder) -> None:
    outside = ckpt.parent / "outside-manifest.json"
    shutil.copyfile(ckpt / MANIFEST, outside)
    (ckpt / MANIFEST).unlink()
    (ckpt / MANIFEST).symlink_to(outside)
    errors = assert_refused_before_data(ckpt, rec)
    assert all("symlink" in str(e) for e in errors)


def test_data_file_that_is_a_fifo_is_refused_without_hanging(ckpt: Path) -> None:
    # Opening a FIFO for reading blocks until a writer shows up: the reader must not wait.
    (ckpt / DATA).unlink()
    os.mkfifo(ckpt / DATA)
    for name, op in DATA_OPS.items():
        result = run_op(op, ckpt, name, timeout=3.0)
        assert isinstance(result, sp.CorruptCheckpointError), f"{name}: {result!r}"


def test_data_file_that_is_a_directory_is_refused(ckpt: Path, doc: dict[str, Any]) -> None:
    (ckpt / DATA).unlink()
    (ckpt / DATA).mkdir()
    # Forge the manifest so the recorded size is the directory's own st_size, with one tensor.
    size = os.stat(ckpt / DATA).st_size
    doc["files"][DATA] = {"size": size, "header_size": 8, "header_xxh3": "0" * 16}
    doc["tensors"] = {"w": {**doc["tensors"]["w"], "offsets": [8, 32]}}
    doc["tree"] = {"t": "dict", "items": [["w", {"t": "tensor", "ref": "w", "kind": "numpy"}]]}
    write_manifest(ckpt, forge(doc))
    for name, op in DATA_OPS.items():
        result = run_op(op, ckpt, name)
        assert isinstance(result, sp.CorruptCheckpointError), f"{name}: {result!r}"


# ---------------------------------------------------------------------------------------------
# sizes, lengths and offsets
# ---------------------------------------------------------------------------------------------


def _set(path: tuple[str, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    """A doc mutation: set ``value`` (or ``value(doc)`` if callable) at the key path ``path``."""

    def apply(doc: dict[str, Any]) -> None:
        *parents, last = path
        node = doc
        for p in parents:
            node = node[p]
        node[last] = value(doc) if callable(value) else value

    return apply


def _size(doc: dict[str, Any]) -> int:
    return int(doc["files"][DATA]["size"])


def _hs(doc: dict[str, Any]) -> int:
    return int(doc["files"][DATA]["header_size"])


V = ("tensors", "v", "offsets")  # "v": int64[4], 32 bytes
BAD_RANGES: dict[str, Callable[[dict[str, Any]], None]] = {
    "end-past-eof": _set(V, lambda d: [_size(d) - 16, _size(d) + 16]),
    "start-past-eof": _set(V, lambda d: [_size(d) + 8, _size(d) + 40]),
    "far-past-eof": _set(V, [1 << 70, (1 << 70) + 32]),
    "inside-header": _set(V, lambda d: [_hs(d) - 8, _hs(d) + 24]),
    "at-zero": _set(V, [0, 32]),
    "reversed": _set(V, lambda d: [_hs(d) + 32, _hs(d)]),
    "negative": _set(V, [-32, 0]),
    "float": _set(V, lambda d: [float(_hs(d)), float(_hs(d) + 32)]),
    "bool": _set(V, [True, True]),
    "string": _set(V, lambda d: [str(_hs(d)), str(_hs(d) + 32)]),
    "three": _set(V, lambda d: [_hs(d), _hs(d) + 32, _hs(d) + 32]),
    "one": _set(V, lambda d: [_hs(d)]),
    "null": _set(V, None),
    "nbytes-vs-shape": _set(("tensors", "v", "shape"), [5]),
    "header-past-size": _set(("files", DATA, "header_size"), lambda d: _size(d) + 1),
    "header-under-8": _set(("files", DATA, "header_size"), 7),
    "header-zero": _set(("files", DATA, "header_size"), 0),
    "size-negative": _set(("files", DATA, "size"), -1),
    "size-float": _set(("files", DATA, "size"), lambda d: float(_size(d))),
    "size-bool": _set(("files", DATA, "size"), True),
    "size-string": _set(("files", DATA, "size"), lambda d: str(_size(d))),
    "size-shrunk": _set(("files", DATA, "size"), lambda d: _size(d) - 8),
    "size-missing": lambda d: d["files"][DATA].pop("size"),
    "file-extra-field": _set(("files", DATA, "extra"), 1),
    "header-digest-short": _set(("files", DATA, "header_xxh3"), "abc"),
    "tensor-digest-upper": _set(("tensors", "v", "xxh3"), "ABCDEF0123456789"),
}


@pytest.mark.parametrize("case", list(BAD_RANGES))
def test_bad_sizes_and_offsets_are_refused_before_data(
    case: str, ckpt: Path, doc: dict[str, Any], rec: Recorder
) -> None:
    BAD_RANGES[case](doc)
    write_manifest(ckpt, forge(doc))
    assert_refused_before_data(ckpt, rec)


def test_recorded_size_larger_than_the_file_is_refused_unmapped(
    ckpt: Path, doc: dict[str, Any], rec: Recorder
) -> None:
    # Consistent manifest (ranges inside the recorded size), but the file on disk is shorter.
    doc["files"][DATA]["size"] += 4096
    write_manifest(ckpt, forge(doc))
    for name, op in DATA_OPS.items():
        rec.reset()
        result = run_op(op, rec.at(ckpt), name)
        assert isinstance(result, sp.CorruptCheckpointError), f"{name}: {result!r}"
        assert rec.maps == 0, f"{name} mapped a file whose size disagrees with the manifest"


def test_huge_shape_inconsistent_with_its_range_is_refused_before_data(
    ckpt: Path, doc: dict[str, Any], rec: Recorder
) -> None:
    doc["tensors"]["w"]["shape"] = [2**40, 2**40]
    write_manifest(ckpt, forge(doc))
    assert_refused_before_data(ckpt, rec, trace=True)


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [([2**40, 2**40], "F32"), ([2**15, 2**15], "F32"), ([2**62] * 64, "F64"), ([2**63, 3], "C64")],
    ids=["2^40x2^40-F32", "plausible-4GiB-F32", "64-dims-of-2^62", "2^63x3-C64"],
)
def test_huge_shape_with_consistent_claims_allocates_nothing(
    ckpt: Path, doc: dict[str, Any], rec: Recorder, shape: list[int], dtype: str
) -> None:
    # Every claim agrees (offsets, recorded file size): only the file on disk contradicts it.
    itemsize = {"F32": 4, "F64": 8, "C64": 8}[dtype]
    nbytes = itemsize
    for s in shape:
        nbytes *= s
    hs = doc["files"][DATA]["header_size"]
    doc["tensors"]["w"].update(dtype=dtype, shape=shape, offsets=[hs, hs + nbytes])
    doc["files"][DATA]["size"] = hs + nbytes
    write_manifest(ckpt, forge(doc))
    if nbytes >= 2**62:  # beyond any addressable size: refused by the manifest check itself
        # (the file record's size, past 2**63 for some, may be what is refused first)
        with pytest.raises(sp.CorruptCheckpointError, match=r"too large|bad sizes"):
            sp.inspect(ckpt)
    else:  # plausible: the manifest parses, the file on disk gives it away
        assert sp.inspect(ckpt).tensors[0].shape == tuple(shape)
    for name, op in DATA_OPS.items():
        rec.reset()
        tracemalloc.start()
        try:
            result = run_op(op, rec.at(ckpt), name)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert isinstance(result, sp.CorruptCheckpointError), f"{name}: {result!r}"
        assert peak < PEAK_LIMIT, f"{name}: peak allocation {peak} B for a claimed {nbytes} B"
        assert rec.maps == 0, f"{name} mapped a file whose size disagrees with the manifest"


@pytest.mark.parametrize(
    "shape",
    [[2] * 65, [-1, 6], [2.0, 3.0], [True, 6], ["2", "3"], None, 6, [[2, 3]]],
    ids=["65-dims", "negative", "float", "bool", "strings", "null", "scalar", "nested"],
)
def test_malformed_shapes_are_refused_before_data(
    ckpt: Path, doc: dict[str, Any], rec: Recorder, shape: Any
) -> None:
    doc["tensors"]["w"]["shape"] = shape
    write_manifest(ckpt, forge(doc))
    assert_refused_before_data(ckpt, rec, trace=True)


def test_integer_too_long_to_parse_is_refused(
    ckpt: Path, doc: dict[str, Any], rec: Recorder
) -> None:
    members = doc_members(doc)
    files = compact(doc["files"]).replace(
        f'"size":{doc["files"][DATA]["size"]}', '"size":' + "9" * 5000
    )
    members = [(k, files if k == "files" else v) for k, v in members]
    write_manifest(ckpt, seal(head_from_members(members)))
    assert_refused_before_data(ckpt, rec)


# ---------------------------------------------------------------------------------------------
# duplicate keys
# ---------------------------------------------------------------------------------------------


def _dup_member(key: str) -> Callable[[dict[str, Any]], list[tuple[str, str]]]:
    def build(doc: dict[str, Any]) -> list[tuple[str, str]]:
        members = doc_members(doc)
        i = next(i for i, (k, _) in enumerate(members) if k == key)
        return [*members[: i + 1], members[i], *members[i + 1 :]]

    return build


def _raw_object(pairs: list[tuple[str, Any]]) -> str:
    return "{" + ",".join(f"{json.dumps(k)}:{compact(v)}" for k, v in pairs) + "}"


def _replace_member(doc: dict[str, Any], key: str, raw: str) -> list[tuple[str, str]]:
    return [(k, raw if k == key else v) for k, v in doc_members(doc)]


def _dup_tensor(doc: dict[str, Any]) -> list[tuple[str, str]]:
    t = doc["tensors"]
    pairs = [*t.items(), ("w", t["w"])]
    return _replace_member(doc, "tensors", _raw_object(pairs))


def _dup_tensor_other_range(doc: dict[str, Any]) -> list[tuple[str, str]]:
    # The second "w" would be valid on its own (it describes v's bytes): still a duplicate.
    t = doc["tensors"]
    pairs = [*t.items(), ("w", {**t["v"], "dtype": "I64"})]
    return _replace_member(doc, "tensors", _raw_object(pairs))


def _dup_file(doc: dict[str, Any]) -> list[tuple[str, str]]:
    f = doc["files"]
    return _replace_member(doc, "files", _raw_object([*f.items(), (DATA, f[DATA])]))


def _dup_field_in_tensor(doc: dict[str, Any]) -> list[tuple[str, str]]:
    t = copy.deepcopy(doc["tensors"])
    w = t.pop("w")
    raw_w = _raw_object([*w.items(), ("dtype", w["dtype"])])
    raw = "{" + f'"w":{raw_w},' + _raw_object(list(t.items()))[1:]
    return _replace_member(doc, "tensors", raw)


def _dup_field_in_file(doc: dict[str, Any]) -> list[tuple[str, str]]:
    rec = doc["files"][DATA]
    raw = "{" + f"{json.dumps(DATA)}:" + _raw_object([*rec.items(), ("size", rec["size"])]) + "}"
    return _replace_member(doc, "files", raw)


def _dup_metadata(doc: dict[str, Any]) -> list[tuple[str, str]]:
    return _replace_member(doc, "metadata", '{"k":"v","k":"w"}')


def _dup_in_tree_node(doc: dict[str, Any]) -> list[tuple[str, str]]:
    raw = compact(doc["tree"]).replace('{"t":"value","v":5}', '{"t":"value","v":5,"v":6}')
    assert raw != compact(doc["tree"])
    return _replace_member(doc, "tree", raw)


def _dup_tree_dict_item(key: Any) -> Callable[[dict[str, Any]], list[tuple[str, str]]]:
    def build(doc: dict[str, Any]) -> list[tuple[str, str]]:
        tree = copy.deepcopy(doc["tree"])
        tree["items"].append([key, {"t": "value", "v": 1}])
        tree["items"].append([key, {"t": "value", "v": 2}])
        return _replace_member(doc, "tree", compact(tree))

    return build


def _dup_existing_tree_item(doc: dict[str, Any]) -> list[tuple[str, str]]:
    tree = copy.deepcopy(doc["tree"])
    tree["items"].append(copy.deepcopy(tree["items"][0]))  # "w" twice
    return _replace_member(doc, "tree", compact(tree))


DUPLICATES: dict[str, Callable[[dict[str, Any]], list[tuple[str, str]]]] = {
    "top-tree": _dup_member("tree"),
    "top-files": _dup_member("files"),
    "top-tensors": _dup_member("tensors"),
    "top-format_version": _dup_member("format_version"),
    "top-metadata": _dup_member("metadata"),
    "tensors": _dup_tensor,
    "tensors-different-value": _dup_tensor_other_range,
    "files": _dup_file,
    "field-in-tensor": _dup_field_in_tensor,
    "field-in-file": _dup_field_in_file,
    "metadata": _dup_metadata,
    "field-in-tree-node": _dup_in_tree_node,
    "tree-dict-item-str": _dup_tree_dict_item("k"),
    "tree-dict-item-int": _dup_tree_dict_item(3),
    "tree-dict-item-existing": _dup_existing_tree_item,
}


@pytest.mark.parametrize("case", list(DUPLICATES))
def test_duplicate_keys_are_refused_before_data(
    case: str, ckpt: Path, doc: dict[str, Any], rec: Recorder
) -> None:
    members = DUPLICATES[case](doc)
    write_manifest(ckpt, seal(head_from_members(members)))
    errors = assert_refused_before_data(ckpt, rec)
    assert all("duplicate" in str(e) for e in errors), [str(e) for e in errors]


def test_duplicate_manifest_checksum_member_is_refused(
    ckpt: Path, doc: dict[str, Any], rec: Recorder
) -> None:
    members = [*doc_members(doc), ("manifest_xxh3", '"0000000000000000"')]
    write_manifest(ckpt, seal(head_from_members(members)))
    assert_refused_before_data(ckpt, rec)


def test_int_and_str_tree_keys_are_distinct(ckpt: Path, doc: dict[str, Any]) -> None:
    # Not a duplicate: the int 3 and the string "3" are different keys and both come back.
    doc["tree"]["items"] += [[3, {"t": "value", "v": "int"}], ["3", {"t": "value", "v": "str"}]]
    write_manifest(ckpt, forge(doc))
    loaded = sp.load(ckpt)
    assert loaded[3] == "int" and loaded["3"] == "str"


# ---------------------------------------------------------------------------------------------
# format identification and versions
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", [mf.VERSION + 1, 999, 2**70])
def test_newer_format_version_is_incompatible(
    ckpt: Path, doc: dict[str, Any], rec: Recorder, version: int
) -> None:
    doc["format_version"] = version
    write_manifest(ckpt, forge(doc))
    errors = assert_refused_before_data(ckpt, rec, sp.IncompatibleCheckpointError)
    for e in errors:
        assert not isinstance(e, sp.CorruptCheckpointError)
        assert str(version) in str(e) and "upgrade" in str(e), str(e)


def test_newer_version_with_unknown_layout_is_still_incompatible(
    ckpt: Path, doc: dict[str, Any], rec: Recorder
) -> None:
    # A future format may change everything else: the version decides first.
    doc["format_version"] = mf.VERSION + 1
    doc["files"] = [{"name": DATA}]
    doc["tensors"] = "v2 layout"
    doc["tree"] = {"t": "future-node"}
    write_manifest(ckpt, forge(doc))
    assert_refused_before_data(ckpt, rec, sp.IncompatibleCheckpointError)


@pytest.mark.parametrize(
    "store", ["../../../outside", "/etc", "s3://bucket/blobs", "blobs/../../../x", "../.."]
)
def test_v4_blob_store_outside_the_run_is_refused_before_data(
    ckpt: Path, doc: dict[str, Any], rec: Recorder, store: str
) -> None:
    doc["format_version"] = 4
    doc["blob_store"] = store
    doc["blob_digest"] = "blake3"
    write_manifest(ckpt, forge(doc))
    assert_refused_before_data(ckpt, rec, sp.CorruptCheckpointError)


def test_v4_recipe_larger_than_its_shape_is_refused_before_data(
    ckpt: Path, doc: dict[str, Any], rec: Recorder
) -> None:
    doc["format_version"] = 4
    doc["blob_store"] = "../blobs"
    doc["blob_digest"] = "blake3"
    entry = next(iter(doc["tensors"].values()))
    del entry["file"], entry["offsets"]
    entry["blobs"] = {
        "digest": "blake3",
        "size": 1 << 40,
        "chunk": 1 << 30,
        "blobs": ["a" * 64] * 1024,
    }
    write_manifest(ckpt, forge(doc))
    assert_refused_before_data(ckpt, rec, sp.CorruptCheckpointError)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("format_version", "2"),
        ("format_version", 1.0),
        ("format_version", -1),
        ("format_version", True),
        ("format_version", None),
        ("format", "not-savepoint"),
        ("checksum", "crc32"),
        ("writer", 5),
        ("created", None),
        ("metadata", [1, 2]),
        ("files", []),
        ("tensors", None),
    ],
)
def test_malformed_top_level_members_are_refused(
    ckpt: Path, doc: dict[str, Any], rec: Recorder, key: str, value: Any
) -> None:
    doc[key] = value
    write_manifest(ckpt, forge(doc))
    assert_refused_before_data(ckpt, rec)


@pytest.mark.parametrize(
    "key", ["format", "format_version", "files", "tensors", "tree", "metadata"]
)
def test_missing_top_level_members_are_refused(
    ckpt: Path, doc: dict[str, Any], rec: Recorder, key: str
) -> None:
    del doc[key]
    write_manifest(ckpt, forge(doc))
    assert_refused_before_data(ckpt, rec)


@pytest.mark.parametrize("body", ["[]", '"text"', "null", "1", "{}"])
def test_manifest_that_is_not_an_object_is_refused(ckpt: Path, rec: Recorder, body: str) -> None:
    # The body must still end with the trailer; "[" + ... keeps the JSON invalid or non-object.
    raw = seal(body.encode()[:-1] if body.endswith("}") else body.encode())
    write_manifest(ckpt, raw)
    assert_refused_before_data(ckpt, rec)


# ---------------------------------------------------------------------------------------------
# references and tree nodes
# ---------------------------------------------------------------------------------------------


def _tree_with(node: Any) -> Callable[[dict[str, Any]], None]:
    def apply(doc: dict[str, Any]) -> None:
        doc["tree"]["items"].append(["hostile", node])

    return apply


BAD_REFS: dict[str, Callable[[dict[str, Any]], None]] = {
    "unknown-tensor": _tree_with({"t": "tensor", "ref": "nope", "kind": "numpy"}),
    "null-ref": _tree_with({"t": "tensor", "ref": None, "kind": "numpy"}),
    "int-ref": _tree_with({"t": "tensor", "ref": 0, "kind": "numpy"}),
    "list-ref": _tree_with({"t": "tensor", "ref": ["w"], "kind": "numpy"}),
    "dict-ref": _tree_with({"t": "tensor", "ref": {"w": 1}, "kind": "numpy"}),
    "missing-ref": _tree_with({"t": "tensor", "kind": "numpy"}),
    "unknown-kind": _tree_with({"t": "tensor", "ref": "w", "kind": "pickle"}),
    "missing-kind": _tree_with({"t": "tensor", "ref": "w"}),
    "list-kind": _tree_with({"t": "tensor", "ref": "w", "kind": ["numpy"]}),
    "dict-kind": _tree_with({"t": "tensor", "ref": "w", "kind": {}}),
    "tensor-in-unknown-file": _set(("tensors", "w", "file"), "data-00001.safetensors"),
    "tensor-file-list": _set(("tensors", "w", "file"), [DATA]),
    "unknown-dtype": _set(("tensors", "w", "dtype"), "F128"),
    "lowercase-dtype": _set(("tensors", "w", "dtype"), "f32"),
    "list-dtype": _set(("tensors", "w", "dtype"), ["F32"]),
    "dict-dtype": _set(("tensors", "w", "dtype"), {"F32": 1}),
    "tensor-missing-field": lambda d: d["tensors"]["w"].pop("xxh3"),
    "tensor-not-object": _set(("tensors", "w"), [1, 2]),
}


@pytest.mark.parametrize("case", list(BAD_REFS))
def test_bad_references_are_refused_before_data(
    case: str, ckpt: Path, doc: dict[str, Any], rec: Recorder
) -> None:
    BAD_REFS[case](doc)
    write_manifest(ckpt, forge(doc))
    assert_refused_before_data(ckpt, rec)


BAD_NODES: dict[str, Any] = {
    "null": None,
    "list": [],
    "string": "node",
    "int": 5,
    "empty-object": {},
    "t-null": {"t": None},
    "t-int": {"t": 5},
    "t-list": {"t": ["dict"]},
    "t-unknown": {"t": "pickle", "v": "gASVAAAAAAAAAACMBXBvc2l4lIwGc3lzdGVtlJOU"},
    "dict-no-items": {"t": "dict"},
    "dict-items-object": {"t": "dict", "items": {"a": {"t": "value", "v": 1}}},
    "dict-item-short": {"t": "dict", "items": [["a"]]},
    "dict-item-long": {"t": "dict", "items": [["a", {"t": "value", "v": 1}, 3]]},
    "dict-item-object": {"t": "dict", "items": [{"a": {"t": "value", "v": 1}}]},
    "dict-key-float": {"t": "dict", "items": [[1.5, {"t": "value", "v": 1}]]},
    "dict-key-bool": {"t": "dict", "items": [[True, {"t": "value", "v": 1}]]},
    "dict-key-null": {"t": "dict", "items": [[None, {"t": "value", "v": 1}]]},
    "dict-key-list": {"t": "dict", "items": [[["a"], {"t": "value", "v": 1}]]},
    "dict-child-bad": {"t": "dict", "items": [["a", {"t": "nope"}]]},
    "list-no-items": {"t": "list"},
    "list-items-string": {"t": "list", "items": "abc"},
    "tuple-items-null": {"t": "tuple", "items": None},
    "list-child-bad": {"t": "list", "items": [{"t": "value"}]},
    "stateful-no-type": {"t": "stateful", "state": {"t": "value", "v": 1}},
    "stateful-type-int": {"t": "stateful", "type": 3, "state": {"t": "value", "v": 1}},
    "stateful-no-state": {"t": "stateful", "type": "a.B"},
    "stateful-state-int": {"t": "stateful", "type": "a.B", "state": 1},
    "value-missing": {"t": "value"},
    "value-list": {"t": "value", "v": [1, 2]},
    "value-object": {"t": "value", "v": {"a": 1}},
    "float-number": {"t": "float", "v": 1.5},
    "float-string": {"t": "float", "v": "1.5"},
    "float-list": {"t": "float", "v": ["nan"]},
    "bytes-int": {"t": "bytes", "v": 5},
    "bytes-missing": {"t": "bytes"},
    "bytes-bad-padding": {"t": "bytes", "v": "abc"},
    "bytes-bad-length": {"t": "bytes", "v": "a"},
}


@pytest.mark.parametrize("case", list(BAD_NODES))
def test_malformed_tree_nodes_are_refused_before_data(
    case: str, ckpt: Path, doc: dict[str, Any], rec: Recorder
) -> None:
    _tree_with(BAD_NODES[case])(doc)
    write_manifest(ckpt, forge(doc))
    assert_refused_before_data(ckpt, rec)


@pytest.mark.parametrize("case", ["null", "list", "t-unknown", "dict-no-items", "value-missing"])
def test_malformed_root_node_is_refused_before_data(
    case: str, ckpt: Path, doc: dict[str, Any], rec: Recorder
) -> None:
    doc["tree"] = BAD_NODES[case]
    write_manifest(ckpt, forge(doc))
    assert_refused_before_data(ckpt, rec)


def _chain(kind: str, depth: int, leaf: str) -> str:
    """Raw JSON for ``depth`` nested containers around ``leaf`` (json.dumps would recurse)."""
    opening, closing = {
        "stateful": ('{"t":"stateful","type":"m.C","state":', "}"),
        "list": ('{"t":"list","items":[', "]}"),
        "dict": ('{"t":"dict","items":[["k",', "]]}"),
    }[kind]
    return opening * depth + leaf + closing * depth


@pytest.mark.parametrize(
    ("kind", "depths"),
    # The reader's cap is 512 levels of JSON: the manifest object, then 1 level per stateful
    # node, 2 per list node, 3 per dict node, then the leaf.
    [("stateful", range(500, 520)), ("list", range(250, 260)), ("dict", range(165, 175))],
)
def test_deeply_nested_tree_loads_or_is_refused(
    ckpt: Path, doc: dict[str, Any], kind: str, depths: range
) -> None:
    """Nesting near and past the parser's limit: a CheckpointError or a correct load, whatever the
    depth, never a RecursionError from a later recursive walk of the tree."""
    leaf = '{"t":"tensor","ref":"v","kind":"numpy"}'
    failures = []
    loaded = refused = 0
    for depth in depths:
        write_manifest(
            ckpt, seal(head_from_members(_replace_member(doc, "tree", _chain(kind, depth, leaf))))
        )
        for name, op in OPS.items():
            result = run_op(op, ckpt, f"{name} at depth {depth}")
            if result == "returned without an error":
                loaded += 1
            elif isinstance(result, sp.CheckpointError):
                refused += 1
            else:
                failures.append(f"{kind} depth {depth}: {name} {result}")
    assert not failures, "\n".join(failures[:20])
    assert loaded and refused, (loaded, refused)  # the range straddles the limit


@pytest.mark.parametrize("shape", [[0, 2**64], [0, 2**40, 2**40, 2**40]], ids=["dim-2^64", "2^120"])
def test_zero_element_tensor_with_absurd_dimensions_is_refused(
    tmp_path: Path, shape: list[int]
) -> None:
    # A 0 in the shape makes any byte count match; the other dimensions must still be sane.
    from savepoint.codecs import checksum

    ck = tmp_path / "ck"
    sp.save(ck, {"x": np.zeros((0, 2), np.float32)})
    raw = (ck / "manifest.json").read_bytes()
    head = raw[: raw.rindex(b',\n "manifest_xxh3"')]
    doc = json.loads(head + b"\n}")
    doc["tensors"]["x"]["shape"] = shape
    body = "{\n" + ",\n".join(
        f" {json.dumps(k)}: {json.dumps(v, separators=(',', ':'))}" for k, v in doc.items()
    )
    data = body.encode() + f',\n "manifest_xxh3": "{checksum.digest(body.encode())}"\n}}\n'.encode()
    (ck / "manifest.json").write_bytes(data)
    with pytest.raises(sp.CorruptCheckpointError, match="too large"):
        sp.load(ck)


@pytest.mark.parametrize("unit", ["[],", "{},", '{"":[]},'], ids=["lists", "objects", "members"])
def test_dense_metadata_is_refused_before_data_within_the_memory_bound(
    ckpt: Path, doc: dict[str, Any], rec: Recorder, unit: str
) -> None:
    """At HEAD 4 MiB of ``[],`` in the metadata loaded (30 MiB peaked at 882 MiB; 28 GiB at the
    1 GiB cap). Every entry point now refuses it from the manifest alone, within
    24 x its size + 32 MiB, the bound docs/reliability.md states for every JSON document."""
    metadata = '{"k":[' + unit * ((4 << 20) // len(unit)) + "0]}"
    write_manifest(ckpt, seal(head_from_members(_replace_member(doc, "metadata", metadata))))
    size = os.path.getsize(ckpt / MANIFEST)
    for name, op in OPS.items():
        rec.reset()
        tracemalloc.start()
        try:
            result = run_op(op, rec.at(ckpt), name)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert isinstance(result, sp.CorruptCheckpointError), f"{name}: {result}"
        assert "too many values for its size" in str(result)
        assert not rec.non_manifest_opens() and not rec.maps, name
        assert peak <= 24 * size + (32 << 20), f"{name}: {peak / size:.1f} x"


@pytest.mark.parametrize(("kind", "cap"), [("dict", 170), ("list", 255), ("stateful", 510)])
def test_tree_depths_around_the_save_cap_load_or_are_refused_as_corrupt(
    ckpt: Path, doc: dict[str, Any], kind: str, cap: int
) -> None:
    """The deepest tree sp.save writes (tree.flatten's cap, in JSON levels) loads through every
    entry point; one level deeper, 990 and 100,000 levels are CorruptCheckpointError, never a
    RecursionError."""
    leaf = '{"t":"tensor","ref":"v","kind":"numpy"}'
    for depth in (100, cap, cap + 1, 990, 100_000):
        write_manifest(
            ckpt, seal(head_from_members(_replace_member(doc, "tree", _chain(kind, depth, leaf))))
        )
        for name, op in OPS.items():
            result = run_op(op, ckpt, f"{name} at depth {depth}")
            if depth <= cap:
                assert result == "returned without an error", (kind, depth, name, result)
            else:
                assert isinstance(result, sp.CorruptCheckpointError), (kind, depth, name, result)
