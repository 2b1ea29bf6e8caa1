"""Fuzz targets for the binary and inference-snapshot parsers: ``.shrew`` v1/v2, kizzasi JSON and
MessagePack (in memory and through the seed's file helpers), savepoint's snapshot bytes, burn
records (``.mpk``, in memory and as files), training-artifact directories (one file of a copy of
the golden artifact replaced by the input), and format detection (with inspect/verify) on files.

Each target calls the entry points a user calls and lets only CheckpointError through as a
rejection. Beyond "no other exception", the targets check what a parser must agree with:

- a path and the same bytes in memory give the same outcome (shrew, kizzasi, burn);
- whatever decodes re-encodes and decodes to an equal value (a BOOL byte of 2 would break this:
  it decodes, then differs from its own round trip);
- snapshot bytes: the input is tried as mutated and again with its checksum repaired, so that
  mutations reach the checks behind the checksum instead of all stopping at it.
"""

from __future__ import annotations

import io
import math
import re
from pathlib import Path
from typing import Any

import msgpack  # type: ignore[import-untyped]
import numpy as np

from fuzz._harness import Target, register
from savepoint.codecs import checksum, dtypes, kizzasi
from savepoint.errors import CheckpointError
from savepoint.formats import detect, shrew
from savepoint.inference.snapshot import InferenceSnapshot
from savepoint.state.optimizer import OptimizerState

_BF16 = dtypes.BY_NAME["BF16"].numpy
ROUNDTRIP_LIMIT = 256 << 10


def _model() -> dict[str, np.ndarray[Any, Any]]:
    rng = np.random.default_rng(7)
    return {
        "encoder/layer0/weight": rng.standard_normal((4, 3)).astype(np.float32),
        "encoder/layer0/bias": rng.standard_normal(3).astype(np.float64),
        "embed/tokens": np.arange(6, dtype=np.uint8).reshape(2, 3),
        "counts": np.array([1, 2**31, 7], dtype=np.uint32),
        "step": np.array(12345678901, dtype=np.int64),
        "norm/scale": np.linspace(-2, 2, 5).astype(np.float16),
        "head/weight": np.linspace(-1, 1, 8).astype(_BF16).reshape(2, 2, 2),
        "empty": np.zeros((0, 4), dtype=np.float32),
    }


# -- .shrew ------------------------------------------------------------------------------------

SHREW_TOKENS = (
    shrew.MAGIC,
    b"\x01\x00\x00\x00",
    b"\x02\x00\x00\x00",
    b"\xff\xff\xff\xff",
    b"\x00\x00\x00\x00\x00\x00\x00\x00",
    b"\x01",
    b"\x02",
    b"\x03",
    b"\xff",
    b"\x06",
    b"\x07",
    b"\x41\x00\x00\x00",
    b"\xed\xa0\x80",  # a UTF-8-encoded surrogate: not valid UTF-8 for Python
)


def _shrew_v1_seeds(scratch: Path) -> list[bytes]:
    model = _model()
    items = list(model.items())
    return [
        shrew.to_bytes(model),
        shrew.to_bytes(items[:3]),
        shrew.to_bytes({"x": np.float32(1.5) * np.ones((), np.float32)}),
        shrew.to_bytes({}),
    ]


def _shrew_v2_seeds(scratch: Path) -> list[bytes]:
    model = _model()
    state = OptimizerState("adamw")
    state.scalars = {"lr": 3e-4, "beta1": 0.9, "step": 100.0}
    state.buffers = {
        "exp_avg/encoder/layer0/weight": np.linspace(0, 1, 12),
        "exp_avg_sq/encoder/layer0/weight": np.full(12, 1e-8),
        "empty": np.zeros(0),
    }
    full = shrew.TrainingCheckpoint(
        model_params=model,
        optimizer_state=state,
        epoch=3,
        global_step=4567,
        best_loss=0.125,
        loss_history=[2.5, 1.0, 0.5, 0.25, 0.125],
    )
    bare = shrew.TrainingCheckpoint(model_params={"w": np.ones(3, np.float32)})
    return [shrew.training_to_bytes(full), shrew.training_to_bytes(bare)]


def _same_tensors(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return list(a) == list(b) and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and a[k].tobytes() == b[k].tobytes()
        for k in a
    )


def _both(from_memory: Any, from_path: Any) -> tuple[Any, Any]:
    """Run both readers; they must agree on accepting, and a rejection is re-raised."""
    outcomes = []
    for read in (from_memory, from_path):
        try:
            outcomes.append((read(), None))
        except CheckpointError as exc:
            outcomes.append((None, exc))
    (a, error_a), (b, error_b) = outcomes
    assert (error_a is None) == (error_b is None), (
        f"bytes and path disagree: {error_a!r} vs {error_b!r}"
    )
    if error_a is not None:
        raise error_a
    return a, b


def _parse_shrew_v1(data: bytes, scratch: Path) -> None:
    path = scratch / "fuzz.shrew"
    path.write_bytes(data)
    a, b = _both(lambda: shrew.from_bytes(data), lambda: shrew.load_tensors(path))
    assert _same_tensors(a, b)
    # What decodes round-trips exactly, and a stream reads it the same way.
    assert _same_tensors(shrew.from_bytes(shrew.to_bytes(a)), a)
    assert _same_tensors(shrew.load_tensors(io.BytesIO(data)), a)


def _same_training(a: shrew.TrainingCheckpoint, b: shrew.TrainingCheckpoint) -> bool:
    def same_floats(x: Any, y: Any) -> bool:
        return bool(np.array(x, np.float64).tobytes() == np.array(y, np.float64).tobytes())

    same_opt = (a.optimizer_state is None) == (b.optimizer_state is None)
    if same_opt and a.optimizer_state is not None and b.optimizer_state is not None:
        sa, sb = a.optimizer_state, b.optimizer_state
        same_opt = (
            sa.optimizer_type == sb.optimizer_type
            and list(sa.scalars) == list(sb.scalars)
            and same_floats(list(sa.scalars.values()), list(sb.scalars.values()))
            and _same_tensors(sa.buffers, sb.buffers)
        )
    return (
        _same_tensors(dict(a.model_params), dict(b.model_params))
        and same_opt
        and (a.epoch, a.global_step) == (b.epoch, b.global_step)
        and same_floats(a.best_loss, b.best_loss)
        and same_floats(a.loss_history, b.loss_history)
    )


def _parse_shrew_v2(data: bytes, scratch: Path) -> None:
    path = scratch / "fuzz.shrew"
    path.write_bytes(data)
    a, b = _both(lambda: shrew.training_from_bytes(data), lambda: shrew.load_training(path))
    assert _same_training(a, b)
    # The lazy reader (inspect, verify, conversion) accepts what the eager one accepts.
    info = shrew.verify(path)
    assert len(info.tensors) == len(a.model_params) + (
        len(a.optimizer_state.buffers) if a.optimizer_state is not None else 0
    )
    if a.optimizer_state is not None:
        # The writer sorts optimizer scalars and buffers: compare as sets of names.
        state = a.optimizer_state
        state.scalars = dict(sorted(state.scalars.items()))
        state.buffers = dict(sorted(state.buffers.items()))
    assert _same_training(shrew.training_from_bytes(shrew.training_to_bytes(a)), a)


register(
    Target("shrew_v1", _shrew_v1_seeds, _parse_shrew_v1, tokens=SHREW_TOKENS, memory_factor=20)
)
register(
    Target("shrew_v2", _shrew_v2_seeds, _parse_shrew_v2, tokens=SHREW_TOKENS, memory_factor=20)
)


# -- inference snapshots -------------------------------------------------------------------------


def _snapshots() -> list[InferenceSnapshot]:
    rng = np.random.default_rng(3)
    states = [
        rng.standard_normal((4, 3)).astype(np.float32),
        rng.standard_normal((2, 3, 2)).astype(np.float64),
        np.array([[True, False, True]]),
        np.linspace(-1, 1, 6).astype(_BF16).reshape(3, 2),
        np.array([1 + 2j, np.nan - 1j], dtype=np.complex64),
        np.array([-(2**63), 2**63 - 1, 0], dtype=np.int64),
        np.array([np.nan, np.inf, -np.inf, 0.5], dtype=np.float32).reshape(2, 2),
        np.array(3.5, dtype=np.float16),
    ]
    history = [
        np.arange(3, dtype=np.float32),
        np.array([0, 255, 7], dtype=np.uint8),
        np.array([False, True]),
        np.zeros(0, dtype=np.float32),
    ]
    config = {
        "max_context": 8192,
        "store_history": True,
        "num_layers": 4,
        "hidden_dim": 3,
        "state_dim": 4,
        "schedule": {"warmup": [0.1, 0.5, 1.0], "name": "cosine", "none": None},
    }
    metadata = {
        "timestamp": 1_700_000_000,
        "description": "a fuzz seed: état",
        "model_id": "mamba-130m",
        "tags": ["seed", "bf16", "bool"],
    }
    plain = InferenceSnapshot(
        states=[rng.standard_normal((2, 3)).astype(np.float32) for _ in range(3)],
        history=[rng.standard_normal(3).astype(np.float32) for _ in range(2)],
        step_count=2,
        config={k: config[k] for k in ("max_context", "store_history", "num_layers")},
        metadata={"timestamp": 1_700_000_001},
    )
    rich = InferenceSnapshot(
        states=states, history=history, step_count=17, config=config, metadata=metadata
    )
    return [rich, plain, InferenceSnapshot(states=[], metadata={"timestamp": 0})]


JSON_TOKENS = (
    b'"dtype":"BOOL",',
    b'"dtype":"C64",',
    b'"shape":[2,3],',
    b'"shape":[],',
    b'"nonfinite":[[0,"7fc00000"]],',
    b'"kind":"torch",',
    b'"history_layout":[null],',
    b'"state_data":[2,0,1],',
    b'"\\udc80"',
)


def _json_seeds(scratch: Path) -> list[bytes]:
    seeds = [s.to_json().encode("utf-8") for s in _snapshots()]
    seeds.append(_snapshots()[1].to_json(indent=2).encode("utf-8"))  # the seed's pretty layout
    return seeds


def _roundtrip(snap: InferenceSnapshot, size: int) -> None:
    """Every encoding of a decoded snapshot decodes to an equal one. Skipped for inputs over
    256 KiB: a JSON round trip costs far more than the parse under test (lists of floats)."""
    if size > ROUNDTRIP_LIMIT:
        return
    for encode, decode in (
        (InferenceSnapshot.to_json, InferenceSnapshot.from_json),
        (InferenceSnapshot.to_seed_bytes, InferenceSnapshot.from_seed_bytes),
        (InferenceSnapshot.to_msgpack, InferenceSnapshot.from_msgpack),
        (InferenceSnapshot.to_bytes, InferenceSnapshot.from_bytes),
    ):
        again = decode(encode(snap), framework="numpy")  # type: ignore[operator]
        assert again == snap, f"{decode.__name__} of its own encoding differs"


def _parse_kizzasi_json(data: bytes, scratch: Path) -> None:
    # The seed's load_json (a file) and from_bytes (memory) agree with from_json.
    path = scratch / "fuzz.json"
    path.write_bytes(data)
    snap, from_file = _both(
        lambda: InferenceSnapshot.from_json(data, framework="numpy"),
        lambda: InferenceSnapshot.load_json(path, framework="numpy"),
    )
    assert from_file == snap, "load_json and from_json disagree"
    assert InferenceSnapshot.from_seed_bytes(data, framework="numpy") == snap
    _roundtrip(snap, len(data))


MSGPACK_TOKENS = (
    b"\xdd\x00\x80\x00\x00",
    b"\xdc\xff\xff",
    b"\xc0",
    b"\xc1",
    b"\x90",
    b"\x80",
    b"\x91" * 80,
    b"\xa5dtype\xa4BOOL",
    b"\xa5shape\x92\x02\x03",
    b"\xa9nonfinite\x91\x92\x00\xa87fc00000",
    b"\xa4kind\xa5torch",
    b"\xcb\x7f\xf0\x00\x00\x00\x00\x00\x00",
    b"\xcf\xff\xff\xff\xff\xff\xff\xff\xff",
    b"\xd3\x80\x00\x00\x00\x00\x00\x00\x00",
    b"\xa3\xed\xa0\x80",  # a string holding an encoded surrogate
    b"\xd6\xff\x00\x00\x00\x00",  # a timestamp extension
)


def _named(snap: InferenceSnapshot) -> bytes:
    """rmp_serde's ``write_named`` layout (every struct a map), from what ``to_msgpack`` writes
    (the seed's ``write``: structs without extra keys as arrays of their fields)."""

    def struct(value: Any, fields: tuple[str, ...]) -> Any:
        return dict(zip(fields, value)) if isinstance(value, list) else value

    doc = struct(msgpack.unpackb(snap.to_msgpack()), kizzasi.CHECKPOINT_FIELDS)
    doc["config"] = struct(doc["config"], kizzasi.CONTEXT_CONFIG_FIELDS)
    doc["states"] = [struct(state, kizzasi.STATE_FIELDS) for state in doc["states"]]
    doc["metadata"] = struct(doc["metadata"], kizzasi.METADATA_FIELDS)
    return msgpack.packb(doc, use_bin_type=True)


def _msgpack_seeds(scratch: Path) -> list[bytes]:
    snaps = _snapshots()
    return [s.to_msgpack() for s in snaps] + [_named(snaps[1])]


def _parse_kizzasi_msgpack(data: bytes, scratch: Path) -> None:
    path = scratch / "fuzz.msgpack"
    path.write_bytes(data)
    snap, from_file = _both(
        lambda: InferenceSnapshot.from_msgpack(data, framework="numpy"),
        lambda: InferenceSnapshot.load_msgpack(path, framework="numpy"),
    )
    assert from_file == snap, "load_msgpack and from_msgpack disagree"
    _roundtrip(snap, len(data))


# The bounds kizzasi states: JSON 32 x input + 128 MiB (the bounded JSON parser, then what the
# document becomes); MessagePack 16 x input + 64 MiB, plus 1 MiB of temporaries.
register(
    Target(
        "kizzasi_json",
        _json_seeds,
        _parse_kizzasi_json,
        tokens=JSON_TOKENS,
        text=True,
        memory_factor=32,
        memory_slack=128 << 20,
    )
)
register(
    Target(
        "kizzasi_msgpack",
        _msgpack_seeds,
        _parse_kizzasi_msgpack,
        tokens=MSGPACK_TOKENS,
        memory_factor=17,
        memory_slack=65 << 20,
    )
)


# -- snapshot bytes ----------------------------------------------------------------------------

_DIGEST = re.compile(rb'"xxh3"\s*:\s*"([0-9a-f]{16})"')


def _repaired(data: bytes) -> bytes | None:
    """``data`` with its header's checksum recomputed (None when there is no single digest)."""
    if len(data) < 8:
        return None
    n = int.from_bytes(data[:8], "little")
    if n > len(data) - 8:
        return None
    header = data[8 : 8 + n]
    found = list(_DIGEST.finditer(header))
    if len(found) != 1:
        return None
    start, end = found[0].span(1)
    hasher = checksum.new()
    for part in (data[:8], header[:start], b"0" * 16, header[end:], data[8 + n :]):
        hasher.update(part)
    digest = checksum.hexdigest(hasher).encode("ascii")
    return data[:8] + header[:start] + digest + header[end:] + data[8 + n :]


def _snapshot_bytes_seeds(scratch: Path) -> list[bytes]:
    return [s.to_bytes() for s in _snapshots()]


def _parse_snapshot_bytes(data: bytes, scratch: Path) -> None:
    repaired = _repaired(data)
    if repaired is not None and repaired != data:
        try:
            _roundtrip(InferenceSnapshot.from_bytes(repaired, framework="numpy"), len(data))
            # A bytearray is copied, not viewed: the same decoder on another path.
            _roundtrip(_decode_copy(repaired), len(data))
        except CheckpointError:
            pass
    _roundtrip(InferenceSnapshot.from_bytes(data, framework="numpy"), len(data))


def _decode_copy(data: bytes) -> InferenceSnapshot:
    return InferenceSnapshot.from_bytes(bytearray(data), framework="numpy")


register(
    Target(
        "snapshot_bytes",
        _snapshot_bytes_seeds,
        _parse_snapshot_bytes,
        tokens=(b'"dtype":"BOOL"', b'"shape":[', b"\\ud800", b'"torch":["states/0"]'),
        text=True,
        memory_slack=64 << 20,  # the header and the record go through _json (its slack: 64 MiB)
    )
)


# -- detection, inspect and verify on files ------------------------------------------------------


def _detect_seeds(scratch: Path) -> list[bytes]:
    seeds = _shrew_v1_seeds(scratch)[:1] + _shrew_v2_seeds(scratch)[:1]
    path = scratch / "seed.safetensors"
    path.unlink(missing_ok=True)
    from savepoint.formats import _files
    from savepoint.state import arrays

    model = _model()
    _files.write_safetensors(
        str(path),
        [(k, arrays.NumpySource(v, k)) for k, v in model.items()],
        {"producer": "fuzz", "note": "seed"},
    )
    seeds.append(path.read_bytes())
    seeds.append(_snapshots()[0].to_bytes())  # a safetensors file too
    return seeds


def _parse_detect(data: bytes, scratch: Path) -> None:
    error: CheckpointError | None = None
    for name in ("fuzz.shrew", "fuzz.safetensors", "fuzz.bin"):
        path = scratch / name
        path.write_bytes(data)
        try:
            kind = detect.detect(path)
            assert kind in detect.FORMATS
            info = detect.inspect_any(path)
            checked = detect.verify_any(path)
            assert info.tensors == checked.tensors
            assert math.isfinite(len(info.to_dict()))
        except CheckpointError as exc:
            error = exc
    if error is not None:
        raise error


register(
    Target(
        "detect",
        _detect_seeds,
        _parse_detect,
        tokens=(*SHREW_TOKENS, b"{", b'"__metadata__":{', b'"dtype":"F32",'),
        memory_slack=64 << 20,  # safetensors headers go through _json (its slack: 64 MiB)
    )
)


# -- burn records ------------------------------------------------------------------------------

BURN_GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "burn"
BURN_TOKENS = (
    b"\x83\xa8metadata",
    b"\xa4item",
    b"\xa2_b\x90",
    b"\x82\xa2id\xad",
    b"\xa5param\x83",
    b"\xa5bytes\xc4",
    b"\xa5shape\x92\x02\x03",
    b"\xa5dtype\xa3F32",
    b"\xa5dtype\xa4Bool",
    b"\x81\xa4Bool\xa3U32",
    b"\x81\xa6QFloat\xc0",
    b"\xa5value\x93\xca",
    b"\xc6\xff\xff\xff\xff",
    b"\xdf\xff\xff\xff\xff",
    b"\xc1",
    b"\xd6\xff\x00\x00\x00\x00",
)


def _burn_tensors() -> list[dict[str, Any]]:
    rng = np.random.default_rng(11)
    return [
        {
            "encoder.layers.0.weight": rng.standard_normal((3, 2)).astype(np.float32),
            "encoder.layers.1.weight": rng.standard_normal((2, 2)).astype(np.float64),
            "encoder.norm.scale": np.linspace(-1, 1, 4).astype(np.float16),
            "head.bias": np.linspace(-1, 1, 3).astype(_BF16),
            "mask": np.array([[True, False], [False, True]]),
            "steps": np.array([-(2**63), 2**63 - 1], dtype=np.int64),
            "tokens": np.arange(5, dtype=np.uint8),
            "empty": np.zeros((0, 3), dtype=np.float32),
            "scalar": np.array(2.5, dtype=np.float32),
        },
        {"w": np.ones(1, np.float32)},
    ]


def _burn_seeds(scratch: Path) -> list[bytes]:
    from savepoint.formats import burn

    seeds = [p.read_bytes() for p in sorted(BURN_GOLDEN.glob("*.mpk"))]
    for i, tensors in enumerate(_burn_tensors()):
        path = scratch / f"seed{i}.mpk"
        burn.save_record(path, tensors)
        seeds.append(path.read_bytes())
        path.unlink()
    # A record field named "value" holding numbers (not a legacy tensor: no "shape" beside it).
    # Regression: the reader bulk-decoded it into a numpy array, which the writer then wrote
    # back as a tensor, so decode -> encode changed the record.
    numbers = {
        "f32": [np.float32(1.5), np.float32(-2.0)],
        "f64": [0.25, -1e300],
        "ints": [1, 300, -70000, 2**63 - 1],
        "flags": [True, False],
        "empty": [],
    }
    tree = {"cfg": {k: {"value": v, "name": k} for k, v in numbers.items()}}
    tree["w"] = burn.Param(np.ones(2, np.float32))
    seeds.append(burn.encode(tree))
    path = scratch / "seed_v0_21.mpk"
    burn.save_record(path, _burn_tensors()[0], metadata=burn.Metadata(version="0.21.0"))
    seeds.append(path.read_bytes())
    path.unlink()
    return seeds


def _burn_flat(tree: Any) -> dict[str, np.ndarray[Any, Any]]:
    from savepoint.formats import burn

    return {name: np.asarray(leaf.value) for name, leaf in burn.flatten(tree).items()}


def _parse_burn(data: bytes, scratch: Path) -> None:
    from savepoint.formats import burn

    path = scratch / "fuzz.mpk"
    path.write_bytes(data)
    decoded, loaded = _both(lambda: burn.decode(data), lambda: burn.load_record(path))
    tree, metadata = decoded
    flat = _burn_flat(tree)
    assert _same_tensors(flat, loaded), "decode and load_record disagree"
    # The lazy reader (inspect, verify) accepts what the eager one accepts, with the same tensors.
    info = burn.verify(path)
    assert [t.key for t in info.tensors] == list(loaded)
    if len(data) <= ROUNDTRIP_LIMIT:
        # What decodes re-encodes (as the version it claims) and decodes to the same tensors.
        again, _ = burn.decode(burn.encode(tree, metadata))
        assert _same_tensors(_burn_flat(again), flat), "burn round trip differs"


register(
    Target(
        "burn",
        _burn_seeds,
        _parse_burn,
        tokens=BURN_TOKENS,
        memory_slack=64 << 20,
    )
)


# -- training-artifact directories ----------------------------------------------------------------

ARTIFACT_GOLDEN = BURN_GOLDEN / "artifact"
# The first byte of an input picks the artifact file the rest replaces (mutations that change it
# move the bytes to another file, which is fine: every file must survive any bytes).
ARTIFACT_FILES = ("manifest.json", "training_report.json", "model.mpk")


def _artifact_seeds(scratch: Path) -> list[bytes]:
    return [
        bytes([i]) + (ARTIFACT_GOLDEN / name).read_bytes() for i, name in enumerate(ARTIFACT_FILES)
    ]


def _parse_training_artifact(data: bytes, scratch: Path) -> None:
    import shutil

    from savepoint.formats import training_artifact

    directory = scratch / "artifact"
    if directory.exists():
        shutil.rmtree(directory)
    shutil.copytree(ARTIFACT_GOLDEN, directory)
    name = ARTIFACT_FILES[data[0] % len(ARTIFACT_FILES)] if data else ARTIFACT_FILES[0]
    (directory / name).write_bytes(data[1:])
    loaded = training_artifact.load(directory)
    # verify (every byte read) accepts what load accepts and lists the same tensors.
    keys = {t.key for t in training_artifact.verify(directory).tensors}
    expected = {f"model/{k}" for k in loaded.model}
    if loaded.best_validation_model is not None:
        expected |= {f"best_validation_model/{k}" for k in loaded.best_validation_model}
    assert keys == expected, f"verify lists {sorted(keys)}, load gave {sorted(expected)}"
    assert loaded.manifest.weights_stem
    # Loading writes nothing: the directory holds exactly what was put there.
    assert (directory / name).read_bytes() == data[1:]


register(
    Target(
        "training_artifact",
        _artifact_seeds,
        _parse_training_artifact,
        tokens=(
            *BURN_TOKENS,
            b'"weights_stem":"../x"',
            b'"num_params":',
            b'"best_validation":null',
        ),
        text=True,
        memory_slack=64 << 20,
    )
)
