"""Issue 16, scale: the unsharded save holds no Python object per tensor beyond the state's tree
(compact file layouts, a column table of records, the manifest built once in place, headers of
big files made while written), yet writes byte for byte what it wrote before; the library's
log lines."""

from __future__ import annotations

import gc
import json
import logging
import os
import tracemalloc
from typing import Any

import numpy as np
import pytest

import savepoint as sp
from savepoint.codecs import manifest as mf
from savepoint.engine import plan
from savepoint.engine import save as save_engine
from savepoint.state import tree
from savepoint.storage.paths import resolve


def mixed_state(n: int = 60) -> dict[str, Any]:
    """Several dtypes (so files are reordered by itemsize), empty and 0-d tensors, non-ASCII
    and escaped names, a tied tensor, plain values, nesting."""
    shared = np.arange(4, dtype=np.int32)
    state: dict[str, Any] = {
        "a": np.ones(3, np.float32),
        "empty": np.zeros(0, np.float64),
        "caf\u00e9/x": np.ones((2, 2), np.int8),
        'q"uote': np.ones(5, np.float64),
        "scalar": np.array(3, np.int16),
        "tied": [shared, shared],
        "values": {"lr": 0.1, "name": "run", "nan": float("nan"), 7: None},
    }
    state["experts"] = {f"e{i}": np.full(i % 4, i, np.float16) for i in range(n)}
    return state


def _files(path: str) -> dict[str, bytes]:
    out = {}
    for name in sorted(os.listdir(path)):
        with open(os.path.join(path, name), "rb") as f:
            out[name] = f.read()
    return out


def _expected_data(flat: tree.Flat, max_file_bytes: int) -> dict[str, bytes]:
    """The data files as plan_files lays them out (the writer's previous path)."""
    out = {}
    for fp in plan.plan_files(flat.tensors, max_file_bytes):
        parts = [fp.header]
        for e in fp.entries:
            src = flat.tensors[e.name]
            buf = np.empty(src.nbytes, np.uint8)
            src.copy_to(buf, 0)
            parts.append(buf.tobytes())
        out[fp.name] = b"".join(parts)
    return out


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("max_file_bytes", [1 << 30, 24])
@pytest.mark.parametrize("release", [False, True])
def test_layout_and_manifest_are_byte_for_byte(
    tmp_path: Any,
    monkeypatch: pytest.MonkeyPatch,
    stream: bool,
    max_file_bytes: int,
    release: bool,
) -> None:
    if stream:  # every file makes its header while it is written
        monkeypatch.setattr(plan, "STREAM_ENTRIES", 2)
    monkeypatch.setattr(mf._encode, "_TREE_PIECE", 3)  # the tree in many pieces
    state = mixed_state()
    expected = _expected_data(tree.flatten(state), max_file_bytes)
    flat = tree.flatten(state)
    target = str(tmp_path / "ck")
    directory, manifest = save_engine.save_flat(
        resolve(target),
        flat,
        {"m": [1, 2]},
        max_file_bytes=max_file_bytes,
        writers=2,
        release=release,
    )
    files = _files(directory)
    raw = files.pop(mf.NAME)
    assert files == expected
    # The manifest is what the reader parses and the generic writer writes again, exactly.
    parsed = mf.parse(raw)
    assert mf.dumps(parsed) == raw
    assert json.loads(raw)["tree"] == json.loads(json.dumps(tree.flatten(state).tree))
    assert dict(manifest.tensors) == parsed.tensors
    assert manifest.root() == parsed.tree
    if release:
        assert flat.tensors == {}
    assert sp.load(target, into=None)["experts"]["e5"].tolist() == [5.0]
    sp.verify(target)


def test_table_is_a_mapping_of_records() -> None:
    table = mf.TensorTable(["x", "y"])
    table.code(2, "data-00000.safetensors")
    table.set_row(0, table.code(0, "F32"), table.code(1, (2,)), 0, 128, 136)
    table.set_row(1, table.code(0, "U8"), table.code(1, ()), 0, 136, 137)
    table.digests[0] = 0xABC
    table.digests[1] = 1
    assert list(table) == ["x", "y"] and len(table) == 2 and "y" in table and "z" not in table
    assert table["x"] == mf.TensorRecord(
        "F32", (2,), "data-00000.safetensors", 128, 136, "0000000000000abc"
    )
    assert table["y"].nbytes == 1
    with pytest.raises(KeyError):
        table["z"]
    assert dict(table) == {"x": table["x"], "y": table["y"]}


def test_save_result_describes_as_inspect(tmp_path: Any) -> None:
    target = str(tmp_path / "ck")
    saved = sp.save(target, mixed_state())
    seen = sp.inspect(target)
    assert saved.tensors == seen.tensors
    assert saved.values.keys() == seen.values.keys()
    assert saved.stateful == seen.stateful


def test_a_big_save_holds_no_object_per_tensor(tmp_path: Any) -> None:
    """Peak Python memory of a save of 20,000 small tensors, beyond the state: the flattened
    tree and sources (about 300 bytes a tensor) and the manifest (about 200), nothing more per
    tensor (before issue 16's work it was about 1,200 bytes a tensor; now about 570)."""
    n = 20_000
    data = np.random.default_rng(0).standard_normal((n, 16), dtype=np.float32)
    state = {f"layer{i // 100}.expert{i % 100}.w": data[i].copy() for i in range(n)}
    sp.save(str(tmp_path / "warm"), state)  # imports, caches and staging buffers
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        sp.save(str(tmp_path / "ck"), state)
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    assert peak / n < 900, f"{peak / n:.0f} bytes a tensor"


def test_save_and_load_log_one_info_line(tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    target = str(tmp_path / "ck")
    state = {"w": np.ones(4, np.float32), "b": np.zeros(2, np.float32)}
    with caplog.at_level(logging.DEBUG, logger="savepoint"):
        sp.save(target, state)
        sp.load(target, into=state)
        sp.load(target)
    info = [r for r in caplog.records if r.levelno == logging.INFO]
    assert [r.name for r in info] == [
        "savepoint.engine.save",
        "savepoint.engine.load",
        "savepoint.engine.load",
    ]
    assert "2 tensors, 24 bytes" in info[0].getMessage() and target in info[0].getMessage()
    assert "2 tensors, 24 bytes" in info[1].getMessage()
    steps = [r.getMessage() for r in caplog.records if r.name == "savepoint.commit.transaction"]
    assert any("staging directory" in m for m in steps)
    assert any("manifest.json" in m and "fsynced" in m for m in steps)
    assert any(m.startswith("committed") for m in steps)
    # The library configures no handler of its own.
    for name in ("savepoint", "savepoint.engine.save", "savepoint.commit.transaction"):
        assert not logging.getLogger(name).handlers


def test_failed_save_logs_the_abort(tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    target = str(tmp_path / "ck")
    with (
        caplog.at_level(logging.DEBUG, logger="savepoint"),
        pytest.raises(sp.UnsupportedStateError),
    ):
        sp.save(target, {"w": np.ones(2)}, metadata={"x": float("nan")})
    assert not os.path.exists(target)
    with caplog.at_level(logging.DEBUG, logger="savepoint"), pytest.raises(ZeroDivisionError):
        with save_engine.Transaction(resolve(target).store, target):
            raise ZeroDivisionError
    assert any("aborting" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("table", [True, False])
def test_describe_from_columns_as_entry_by_entry(tmp_path: Any, table: bool) -> None:
    from savepoint.engine import describe

    state = mixed_state()
    del state["tied"]  # (ties take the entry-by-entry path)
    del state["values"]["nan"]  # (nan != nan)
    state["more"] = {f"v{i}": i for i in range(20)}
    target = str(tmp_path / "ck")
    sp.save(target, state)
    with open(os.path.join(target, mf.NAME), "rb") as f:
        manifest = mf.parse(f.read())
    assert isinstance(manifest.tensors, mf.TensorTable)
    if not table:
        manifest.tensors = dict(manifest.tensors)
    leaves = tree.keyed_leaves(manifest.tree)
    fast = describe._describe_plain(manifest, leaves)
    assert fast is not None
    assert fast == describe._describe_each(manifest, leaves)
