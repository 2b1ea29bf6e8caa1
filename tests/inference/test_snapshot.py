"""InferenceSnapshot: what it captures, what it refuses, restoring, and the native format."""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

import savepoint as sp
from inference._snapshots import CONTEXT_CONFIG, snapshots
from savepoint.inference import InferenceSnapshot, SnapshotMetadata

ROOT = Path(__file__).resolve().parents[2]


def small() -> InferenceSnapshot:
    return InferenceSnapshot(
        states=[np.arange(6, dtype=np.float32).reshape(2, 3), np.array([1, 2], np.int64)],
        history=[np.array([0.5, 1.5], np.float32)],
        step_count=12,
        config={"hidden_dim": 2, "layers": [1, 2.5, None]},
        metadata={"description": "d", "model_id": "m", "tags": ["a", "b"], "timestamp": 5},
    )


# -- capture --------------------------------------------------------------------------------


def test_fields_give_back_exactly_what_was_captured() -> None:
    nan = np.array([0x7FC00123], np.uint32).view(np.float32)[0]
    states = [
        np.array([[1.0, -0.0], [nan, np.inf]], np.float32),
        np.array([1.5, -2.0], ml_dtypes.bfloat16),
        np.array(7, np.uint16),
        np.zeros((0, 3), np.float64),
        np.arange(24, dtype=np.int8).reshape(2, 3, 4),
    ]
    snap = InferenceSnapshot(states=states, history=[np.float32(3.0)], step_count=41)
    assert snap.step_count == 41 and snap.version == 1
    for got, want in zip(snap.states, states):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert got.tobytes() == want.tobytes()
    assert snap.history[0].shape == () and snap.history[0] == 3.0  # numpy scalar -> 0-d array
    assert snap.nbytes == sum(a.nbytes for a in states) + 4


def test_arrays_are_copied_and_read_only() -> None:
    live = np.zeros((2, 2), np.float32)
    inputs = [np.ones(3, np.float32)]
    snap = InferenceSnapshot(states=[live], history=inputs)
    live[:] = 5
    inputs[0][:] = 9
    inputs.append(np.zeros(1, np.float32))
    assert snap.states[0].tolist() == [[0, 0], [0, 0]]
    assert snap.history[0].tolist() == [1, 1, 1] and len(snap.history) == 1
    with pytest.raises(ValueError, match="read-only"):
        snap.states[0][0, 0] = 1
    assert isinstance(snap.states, tuple) and isinstance(snap.history, tuple)


def test_non_contiguous_and_big_endian_inputs_keep_their_values() -> None:
    base = np.arange(12, dtype=np.float64).reshape(3, 4)
    big = np.arange(4, dtype=">i4")
    snap = InferenceSnapshot(states=[base.T, base[:, ::2], big])
    assert snap.states[0].tolist() == base.T.tolist() and snap.states[0].flags.c_contiguous
    assert snap.states[1].tolist() == base[:, ::2].tolist()
    assert snap.states[2].dtype == np.dtype("<i4") and snap.states[2].tolist() == [0, 1, 2, 3]


def test_config_is_a_checked_deep_copy() -> None:
    config = {"layers": [{"dim": 4}], "pair": (1, 2)}
    snap = InferenceSnapshot(states=[], config=config)
    config["layers"][0]["dim"] = 5
    assert snap.config == {"layers": [{"dim": 4}], "pair": [1, 2]}  # tuples become lists
    snap.config["layers"].append(1)
    assert snap.config == {"layers": [{"dim": 4}], "pair": [1, 2]}


def test_metadata_defaults_and_forms() -> None:
    before = int(time.time())
    default = InferenceSnapshot(states=[]).metadata
    assert before <= default.timestamp <= int(time.time()) + 1
    assert (default.description, default.model_id, default.tags) == ("", "unknown", ())
    meta = SnapshotMetadata(timestamp=3, description="x", model_id="m", tags=("t",))
    assert InferenceSnapshot(states=[], metadata=meta).metadata is meta
    from_map = InferenceSnapshot(states=[], metadata={"timestamp": 3, "tags": ["t"]}).metadata
    assert from_map.timestamp == 3 and from_map.tags == ("t",) and from_map.model_id == "unknown"
    assert meta.to_dict() == {"timestamp": 3, "description": "x", "model_id": "m", "tags": ["t"]}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"states": [[1.0, 2.0]]}, "expected a numpy array"),
        ({"states": [1.5]}, "expected a numpy array"),
        ({"states": np.zeros((2, 2))}, "sequence of arrays"),
        ({"states": "ab"}, "sequence of arrays"),
        ({"states": 3}, "sequence of arrays"),
        ({"states": [np.array([object()])]}, "cannot be snapshotted"),
        ({"states": [np.zeros(2, dtype=[("a", "f4")])]}, "cannot be snapshotted"),
        ({"states": [np.zeros(2, dtype=np.complex128)]}, "cannot be stored"),
        ({"states": [np.array(["a"])]}, "cannot be stored"),
        ({"states": [], "history": [None]}, "history/0"),
        ({"states": [], "step_count": -1}, "step_count"),
        ({"states": [], "step_count": 2**64}, "step_count"),
        ({"states": [], "step_count": True}, "step_count"),
        ({"states": [], "step_count": 3.0}, "step_count"),
        ({"states": [], "config": {1: "a"}}, "not a string"),
        ({"states": [], "config": {"x": float("nan")}}, "finite"),
        ({"states": [], "config": {"x": 2**64}}, "outside"),
        ({"states": [], "config": {"x": {1, 2}}}, "not JSON"),
        ({"states": [], "config": {"x": "\ud800"}}, "surrogate"),
        ({"states": [], "config": [("a", 1)]}, "mapping"),
        ({"states": [], "metadata": {"tags": "abc"}}, "tags"),
        ({"states": [], "metadata": {"tags": [1]}}, "tags"),
        ({"states": [], "metadata": {"timestamp": 1.5}}, "timestamp"),
        ({"states": [], "metadata": {"timestamp": -1}}, "timestamp"),
        ({"states": [], "metadata": {"model": "x"}}, "unknown metadata field"),
        ({"states": [], "metadata": 5}, "mapping"),
    ],
)
def test_what_a_snapshot_refuses(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(sp.UnsupportedStateError, match=match):
        InferenceSnapshot(**kwargs)


def test_only_version_1() -> None:
    assert InferenceSnapshot(states=[], version=1).version == 1
    with pytest.raises(sp.IncompatibleCheckpointError):
        InferenceSnapshot(states=[], version=2)


def test_equality_is_exact() -> None:
    a = np.array([np.nan], np.float32)
    b = np.array([0x7FC00001], np.uint32).view(np.float32)  # another NaN
    assert InferenceSnapshot(states=[a], metadata={"timestamp": 1}) == InferenceSnapshot(
        states=[a], metadata={"timestamp": 1}
    )
    assert InferenceSnapshot(states=[a], metadata={"timestamp": 1}) != InferenceSnapshot(
        states=[b], metadata={"timestamp": 1}
    )
    one = InferenceSnapshot(states=[], config={"x": 1}, metadata={"timestamp": 1})
    assert one != InferenceSnapshot(states=[], config={"x": 1.0}, metadata={"timestamp": 1})
    assert one != InferenceSnapshot(states=[], config={"x": True}, metadata={"timestamp": 1})
    assert one != InferenceSnapshot(states=[], config={"x": 1}, metadata={"timestamp": 2})
    assert one != "snapshot"
    with pytest.raises(TypeError):
        hash(one)


def test_repr_summarises() -> None:
    text = repr(small())
    assert "step_count=12" in text and "F32[2, 3]" in text and "'m'" in text


# -- restoring ------------------------------------------------------------------------------


def test_restore_into_fills_targets_in_place() -> None:
    snap = small()
    targets = [np.empty((2, 3), np.float32), np.empty(2, np.int64)]
    ids = [id(t) for t in targets]
    history: list[Any] = []
    snap.restore_into(targets, history)
    assert [id(t) for t in targets] == ids
    assert targets[0].tolist() == snap.states[0].tolist() and targets[1].tolist() == [1, 2]
    assert len(history) == 1 and history[0].tolist() == [0.5, 1.5]
    history[0][0] = 9  # the restored history is the caller's own, writable
    assert snap.history[0][0] == 0.5


def test_restore_into_reuses_matching_history_elements() -> None:
    snap = InferenceSnapshot(states=[], history=[np.full(2, i, np.float32) for i in range(3)])
    keep = np.zeros(2, np.float32)
    wrong_shape = np.zeros(3, np.float32)
    history = collections.deque([keep, wrong_shape, keep, np.zeros(2), np.zeros(2)])
    snap.restore_into(history=history)
    assert len(history) == 3
    assert history[0] is keep and history[0].tolist() == [0, 0]
    assert history[1] is not wrong_shape and history[1].tolist() == [1, 1]
    assert history[2] is not keep  # the same object twice would alias two entries
    assert [h.tolist() for h in history] == [[0, 0], [1, 1], [2, 2]]


def test_restore_into_reports_every_problem_before_changing_anything() -> None:
    snap = small()
    frozen = np.zeros(2, np.int64)
    frozen.flags.writeable = False
    targets = [np.full((3, 2), 7, np.float32), frozen]
    history = [np.zeros(2, np.float32)]
    with pytest.raises(sp.StateMismatchError) as excinfo:
        snap.restore_into(targets, history)
    keys = [key for key, _ in excinfo.value.problems]
    assert keys == ["states/0", "states/1"]
    assert "F32 [2, 3] in the snapshot, F32 [3, 2] in the target" in str(excinfo.value)
    assert (targets[0] == 7).all() and history[0].tolist() == [0, 0]
    with pytest.raises(sp.StateMismatchError, match="2 in the snapshot, 1 targets"):
        snap.restore_into([np.empty((2, 3), np.float32)])
    with pytest.raises(sp.StateMismatchError, match="list or deque"):
        snap.restore_into(history=(np.zeros(2),))  # type: ignore[arg-type]
    with pytest.raises(sp.StateMismatchError, match="expected a numpy array"):
        snap.restore_into([[0.0] * 3, np.empty(2, np.int64)])


# -- native format --------------------------------------------------------------------------


def test_save_and_load(tmp_path: Path) -> None:
    snap = small()
    info = snap.save(tmp_path / "snap")
    assert info.metadata["inference_snapshot"]["step_count"] == 12
    assert {t.key for t in info.tensors} == {"states/0", "states/1", "history/0"}
    sp.verify(tmp_path / "snap")
    back = InferenceSnapshot.load(tmp_path / "snap")
    assert back == snap
    assert not back.states[0].flags.writeable
    empty = InferenceSnapshot(states=[], metadata={"timestamp": 0})
    empty.save(tmp_path / "empty")
    assert InferenceSnapshot.load(str(tmp_path / "empty")) == empty


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(snap=snapshots())
def test_native_round_trip_exactly(tmp_path: Path, snap: InferenceSnapshot) -> None:
    snap.save(tmp_path / "s")
    assert InferenceSnapshot.load(tmp_path / "s") == snap


def test_loading_something_else_is_a_clear_error(tmp_path: Path) -> None:
    sp.save(tmp_path / "plain", {"w": np.zeros(2)})
    with pytest.raises(sp.IncompatibleCheckpointError, match="not an inference snapshot"):
        InferenceSnapshot.load(tmp_path / "plain")
    with pytest.raises(sp.CheckpointNotFoundError):
        InferenceSnapshot.load(tmp_path / "missing")


def _forge(path: Path, tree: Any, **record: Any) -> None:
    base = {
        "version": 1,
        "step_count": 0,
        "config": {},
        "metadata": {"timestamp": 0, "description": "", "model_id": "unknown", "tags": []},
        "states": 1,
        "history": 0,
    }
    sp.save(path, tree, metadata={"inference_snapshot": {**base, **record}})


@pytest.mark.parametrize(
    ("tree", "record", "error", "match"),
    [
        (
            {"states": [np.zeros(2)], "history": []},
            {"version": 2},
            sp.IncompatibleCheckpointError,
            "version 2",
        ),
        (
            {"states": [np.zeros(2)], "history": []},
            {"version": "1"},
            sp.CorruptCheckpointError,
            "version",
        ),
        (
            {"states": [np.zeros(2)], "history": []},
            {"states": 2},
            sp.CorruptCheckpointError,
            "exactly the arrays",
        ),
        (
            {"states": [np.zeros(2)], "history": [], "x": 1},
            {},
            sp.CorruptCheckpointError,
            "nothing else",
        ),
        (
            {"states": [np.zeros(2), np.zeros(1)], "history": []},
            {},
            sp.CorruptCheckpointError,
            "exactly",
        ),
        (
            {"states": [np.zeros(2)], "history": []},
            {"extra": 1},
            sp.CorruptCheckpointError,
            "must hold exactly",
        ),
        (
            {"states": [np.zeros(2)], "history": []},
            {"step_count": -1},
            sp.CorruptCheckpointError,
            "step_count",
        ),
        (
            {"states": [np.zeros(2)], "history": []},
            {"config": [1]},
            sp.CorruptCheckpointError,
            "config",
        ),
        (
            {"states": [np.zeros(2)], "history": []},
            {"metadata": {"tags": 1}},
            sp.CorruptCheckpointError,
            "metadata",
        ),
        ({"states": {"0": np.zeros(2)}, "history": []}, {}, sp.CorruptCheckpointError, "states"),
    ],
)
def test_native_layout_is_checked(
    tmp_path: Path, tree: Any, record: dict[str, Any], error: type[Exception], match: str
) -> None:
    _forge(tmp_path / "f", tree, **record)
    with pytest.raises(error, match=match):
        InferenceSnapshot.load(tmp_path / "f")


def test_damaged_native_snapshot_is_corrupt(tmp_path: Path, flip_byte: Any) -> None:
    small().save(tmp_path / "s")
    flip_byte(tmp_path / "s", "states/0", 3)
    with pytest.raises(sp.CorruptCheckpointError, match="checksum"):
        InferenceSnapshot.load(tmp_path / "s")


def test_framework_argument_is_checked() -> None:
    with pytest.raises(ValueError, match="framework"):
        InferenceSnapshot.from_bytes(small().to_bytes(), framework="jax")  # type: ignore[arg-type]


# -- torch ------------------------------------------------------------------------------------


def test_numpy_snapshots_never_import_torch(tmp_path: Path) -> None:
    code = (
        "import sys, numpy as np, savepoint as sp\n"
        "from savepoint.inference import InferenceSnapshot, SnapshotHistory\n"
        "s = InferenceSnapshot(states=[np.zeros((2, 2), np.float32)], history=[np.ones(2)])\n"
        "for enc, dec in [('to_json', 'from_json'), ('to_msgpack', 'from_msgpack'),"
        " ('to_bytes', 'from_bytes')]:\n"
        "    assert getattr(InferenceSnapshot, dec)(getattr(s, enc)()) == s\n"
        f"s.save({str(tmp_path / 's')!r}); assert InferenceSnapshot.load({str(tmp_path / 's')!r}) == s\n"
        "h = SnapshotHistory(2)\n"
        "for i in range(3): h.take(states=[np.zeros(2)], step_count=i)\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.torch
def test_torch_tensors_are_captured_as_torch(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    weight = torch.nn.Parameter(torch.randn(3, 4))
    before = weight.detach().clone()
    states = [
        weight,
        torch.arange(6, dtype=torch.bfloat16).reshape(2, 3).t(),  # non-contiguous
        torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64).conj(),  # a lazy conjugate
        torch.tensor(5, dtype=torch.int64),
        torch.zeros(0, 2, dtype=torch.float16),
    ]
    history = [torch.ones(2), np.zeros(2, np.float32)]
    snap = InferenceSnapshot(states=states, history=history, step_count=3)
    assert all(isinstance(s, torch.Tensor) and not s.requires_grad for s in snap.states)
    assert isinstance(snap.history[1], np.ndarray)
    with torch.no_grad():
        weight.add_(1)
    assert torch.equal(snap.states[0], before)
    assert torch.equal(snap.states[1], torch.arange(6, dtype=torch.bfloat16).reshape(2, 3).t())
    assert snap.states[2].tolist() == [1 - 2j, 3 + 1j]
    for back in (
        InferenceSnapshot.from_json(snap.to_json()),
        InferenceSnapshot.from_msgpack(snap.to_msgpack()),
        InferenceSnapshot.from_bytes(snap.to_bytes()),
    ):
        assert back == snap
        assert isinstance(back.states[0], torch.Tensor) and isinstance(back.history[1], np.ndarray)
    snap.save(tmp_path / "t")
    assert InferenceSnapshot.load(tmp_path / "t") == snap
    as_numpy = InferenceSnapshot.from_bytes(snap.to_bytes(), framework="numpy")
    assert all(isinstance(s, np.ndarray) for s in as_numpy.states)
    assert as_numpy.states[1].dtype == ml_dtypes.bfloat16
    as_torch = InferenceSnapshot.load(tmp_path / "t", framework="torch")
    assert isinstance(as_torch.history[1], torch.Tensor)


@pytest.mark.torch
def test_restore_into_torch_targets() -> None:
    torch = pytest.importorskip("torch")
    snap = InferenceSnapshot(
        states=[np.arange(6, dtype=np.float32).reshape(2, 3), torch.full((2,), 3.0)],
        history=[torch.ones(3, dtype=torch.bfloat16)],
    )
    param = torch.nn.Parameter(torch.zeros(2, 3))
    strided = torch.zeros(3, 2).t()  # a non-contiguous target
    snap.restore_into([param, torch.zeros(2)])
    assert param.tolist() == [[0, 1, 2], [3, 4, 5]] and param.requires_grad
    snap.restore_into([strided, np.zeros(2, np.float32)])
    assert strided.tolist() == [[0, 1, 2], [3, 4, 5]]
    keep = torch.zeros(3, dtype=torch.bfloat16)
    history: list[Any] = [keep]
    snap.restore_into(history=history)
    assert history[0] is keep and keep.tolist() == [1, 1, 1]
    with pytest.raises(sp.StateMismatchError, match="F32 \\[2\\] in the snapshot, F64"):
        snap.restore_into([param, torch.zeros(2, dtype=torch.float64)])


# -- docs ---------------------------------------------------------------------------------------


def test_docs_snippets_run(tmp_path: Path) -> None:
    doc = (ROOT / "docs" / "inference.md").read_text(encoding="utf-8")
    blocks = re.findall(r"^```python\n(.*?)^```", doc, re.M | re.S)
    assert blocks
    script = tmp_path / "inference_doc.py"
    script.write_text("\n\n".join(blocks), encoding="utf-8")
    result = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**os.environ, "PYTHONWARNINGS": "error"},
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_json_output_is_what_the_seed_expects_for_context_configs() -> None:
    snap = InferenceSnapshot(states=[np.zeros((4, 3), np.float32)], config=CONTEXT_CONFIG)
    assert json.loads(snap.to_json())["config"] == CONTEXT_CONFIG


def test_pickles_exactly() -> None:
    import pickle

    snap = small()
    copy = pickle.loads(pickle.dumps(snap))
    assert copy == snap and not copy.states[0].flags.writeable


def test_numpy_integers_are_counts() -> None:
    snap = InferenceSnapshot(
        states=[], step_count=np.int64(5), metadata={"timestamp": np.uint32(9)}
    )
    assert type(snap.step_count) is int and snap.step_count == 5
    assert type(snap.metadata.timestamp) is int and snap.metadata.timestamp == 9
    with pytest.raises(sp.UnsupportedStateError):
        InferenceSnapshot(states=[], step_count=np.bool_(True))


def test_torch_kinds_come_back_as_numpy_without_torch() -> None:
    text = (ROOT / "tests" / "golden" / "kizzasi" / "savepoint_v1.json").as_posix()
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import numpy as np\n"
        "from savepoint.inference import InferenceSnapshot\n"
        f"snap = InferenceSnapshot.from_json(open({text!r}, encoding='utf-8').read())\n"
        "assert all(isinstance(a, np.ndarray) for a in snap.states + snap.history)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
