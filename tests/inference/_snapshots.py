"""Shared by the snapshot tests: hypothesis strategies, the seed's reader emulated, comparisons."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from hypothesis import strategies as st

from savepoint.codecs import dtypes
from savepoint.codecs.snapshot import SnapshotRecord
from savepoint.inference import InferenceSnapshot, SnapshotMetadata

DTYPE_NAMES = sorted(dtypes.BY_NAME)
TEXT = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=8)
CONTEXT_CONFIG = {
    "max_context": 8192,
    "store_history": True,
    "num_layers": 2,
    "hidden_dim": 4,
    "state_dim": 3,
}


@st.composite
def arrays(draw: st.DrawFn, max_dims: int = 3, dtype: str | None = None) -> np.ndarray:
    """An array of any stored dtype and small shape whose elements are arbitrary bit patterns
    (NaNs with payloads, signalling NaNs, infinities, subnormals, signed zeros)."""
    name = dtype or draw(st.sampled_from(DTYPE_NAMES))
    d = dtypes.BY_NAME[name]
    shape = tuple(draw(st.lists(st.integers(0, 4), max_size=max_dims)))
    n = math.prod(shape)
    if name == "BOOL":
        values = draw(st.lists(st.booleans(), min_size=n, max_size=n))
        return np.array(values, dtype=np.bool_).reshape(shape)
    raw = draw(st.binary(min_size=n * d.itemsize, max_size=n * d.itemsize))
    return np.frombuffer(raw, dtype=d.numpy).reshape(shape).copy()


config_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | TEXT,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(TEXT, children, max_size=3),
    max_leaves=8,
)
configs = st.dictionaries(TEXT, config_values, max_size=4)
metadatas = st.builds(
    SnapshotMetadata,
    timestamp=st.integers(0, 2**64 - 1),
    description=TEXT,
    model_id=TEXT,
    tags=st.lists(TEXT, max_size=3).map(tuple),
)


@st.composite
def snapshots(draw: st.DrawFn) -> InferenceSnapshot:
    return InferenceSnapshot(
        states=draw(st.lists(arrays(), max_size=4)),
        history=draw(st.lists(arrays(max_dims=2), max_size=4)),
        step_count=draw(st.integers(0, 2**64 - 1)),
        config=draw(configs),
        metadata=draw(metadatas),
    )


def same_array(a: Any, b: Any) -> bool:
    """Kind, dtype, shape and bits."""
    if type(a) is not type(b):
        return False
    if str(a.dtype) != str(b.dtype) or tuple(a.shape) != tuple(b.shape):
        return False
    return _raw(a) == _raw(b)


def _raw(a: Any) -> bytes:
    if isinstance(a, np.ndarray):
        return np.ascontiguousarray(a).tobytes()
    import torch

    t = a.detach().cpu().contiguous().reshape(-1)
    return b"" if t.numel() == 0 else t.view(torch.uint8).numpy().tobytes()


def assert_records_equal(a: SnapshotRecord, b: SnapshotRecord) -> None:
    assert a.version == b.version
    assert a.step_count == b.step_count
    assert a.config == b.config
    assert (a.timestamp, a.description, a.model_id, list(a.tags)) == (
        b.timestamp,
        b.description,
        b.model_id,
        list(b.tags),
    )
    for role in ("states", "history"):
        xs, ys = getattr(a, role), getattr(b, role)
        assert len(xs) == len(ys), role
        for i, (x, y) in enumerate(zip(xs, ys)):
            assert same_array(x, y), f"{role}[{i}]: {x!r} != {y!r}"
        assert a.kinds(role) == b.kinds(role), role


# -- the seed's reader ------------------------------------------------------------------------


class SeedRejects(Exception):
    """What serde (or the seed's ``to_context``) would refuse."""


def _usize(x: Any, what: str) -> int:
    if not (isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**64):
        raise SeedRejects(f"{what}: expected usize, got {x!r}")
    return x


def _f32_list(values: Any, what: str) -> np.ndarray:
    if not isinstance(values, list):
        raise SeedRejects(f"{what}: expected a sequence")
    for v in values:
        # serde's f32 visitor takes any JSON number (integers included), nothing else.
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise SeedRejects(f"{what}: {v!r} is not a number")
    with np.errstate(over="ignore"):
        return np.array([float(v) for v in values], dtype=np.float64).astype(np.float32)


def seed_read(doc: Any) -> dict[str, Any]:
    """Deserialize like ``kizzasi_inference::checkpoint::Checkpoint`` (serde derive: unknown
    fields ignored, every declared field required, strict types), then check what
    ``to_context`` checks (version, state_data length). Returns the f32 data the seed gets."""
    if not isinstance(doc, dict):
        raise SeedRejects("expected struct Checkpoint")
    for name in ("version", "config", "states", "history", "step_count", "metadata"):
        if name not in doc:
            raise SeedRejects(f"missing field `{name}`")
    version = doc["version"]
    if not (isinstance(version, int) and not isinstance(version, bool) and 0 <= version < 2**32):
        raise SeedRejects("version: expected u32")
    config = doc["config"]
    if not isinstance(config, dict):
        raise SeedRejects("expected struct ContextConfig")
    for name in ("max_context", "num_layers", "hidden_dim", "state_dim"):
        if name not in config:
            raise SeedRejects(f"config: missing field `{name}`")
        _usize(config[name], name)
    if not isinstance(config.get("store_history"), bool):
        raise SeedRejects("config: store_history must be a bool")
    if not isinstance(doc["states"], list):
        raise SeedRejects("states: expected a sequence")
    states = []
    for i, s in enumerate(doc["states"]):
        if not isinstance(s, dict):
            raise SeedRejects(f"states[{i}]: expected struct SerializableHiddenState")
        h = _usize(s.get("hidden_dim"), "hidden_dim")
        w = _usize(s.get("state_dim"), "state_dim")
        data = _f32_list(s.get("state_data"), "state_data")
        if not isinstance(s.get("updated"), bool):
            raise SeedRejects("updated: expected a bool")
        states.append((h, w, data))
    if not isinstance(doc["history"], list):
        raise SeedRejects("history: expected a sequence")
    history = [_f32_list(h, f"history[{i}]") for i, h in enumerate(doc["history"])]
    step_count = _usize(doc["step_count"], "step_count")
    meta = doc["metadata"]
    if not isinstance(meta, dict):
        raise SeedRejects("expected struct CheckpointMetadata")
    _usize(meta.get("timestamp"), "timestamp")
    for name in ("description", "model_id"):
        if not isinstance(meta.get(name), str):
            raise SeedRejects(f"{name}: expected a string")
    tags = meta.get("tags")
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise SeedRejects("tags: expected a sequence of strings")
    # to_context
    if version != 1:
        raise SeedRejects(f"Incompatible checkpoint version: expected 1, got {version}")
    for h, w, data in states:
        if data.size != h * w:
            raise SeedRejects(f"DimensionMismatch expected {h * w} got {data.size}")
    return {
        "states": [data.reshape(h, w) for h, w, data in states],
        "history": history,
        "step_count": step_count,
        "metadata": meta,
    }
