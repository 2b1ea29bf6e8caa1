"""savepoint.formats.shrew: golden files built from the spec, round trips, hostile input, models."""

from __future__ import annotations

import io
import math
import os
import struct
import tracemalloc
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import savepoint as sp
from _support import load_generator
from savepoint.codecs import dtypes
from savepoint.errors import (
    CheckpointError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    StateMismatchError,
    UnsupportedStateError,
)
from savepoint.formats import shrew
from savepoint.formats._files import LazyTensor

GOLDEN = Path(__file__).resolve().parent.parent / "golden" / "shrew"


gen = load_generator(GOLDEN / "make_shrew_golden.py", "shrew_golden")
GOLDEN_FILES = sorted(gen.files())
V1_FILES = [n for n in GOLDEN_FILES if n.startswith("v1")]
V2_FILES = [n for n in GOLDEN_FILES if n.startswith("v2")]


def golden(name: str) -> bytes:
    return (GOLDEN / name).read_bytes()


def same(a: Any, b: Any) -> None:
    assert isinstance(a, np.ndarray) and isinstance(b, np.ndarray)
    assert (a.dtype, a.shape) == (b.dtype, b.shape)
    assert a.tobytes() == b.tobytes()


def same_tensors(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert list(got) == list(want)
    for k in want:
        same(got[k], want[k])


# ---------------------------------------------------------------------------------------------
# golden files
# ---------------------------------------------------------------------------------------------


def test_golden_files_match_their_generator() -> None:
    on_disk = sorted(p.name for p in GOLDEN.glob("*.shrew"))
    assert on_disk == GOLDEN_FILES
    for name, data in gen.files().items():
        assert golden(name) == data, f"{name} differs from make_shrew_golden.py's bytes"


@pytest.mark.parametrize("name", V1_FILES)
def test_v1_golden_reads_exactly_and_writes_back_identically(name: str, tmp_path: Path) -> None:
    data = golden(name)
    loaded = shrew.from_bytes(data)
    same_tensors(loaded, gen.expected(name))
    same_tensors(shrew.load_tensors(GOLDEN / name), gen.expected(name))
    assert shrew.to_bytes(loaded) == data
    assert shrew.to_bytes(list(gen.expected(name).items())) == data
    shrew.save_tensors(tmp_path / name, loaded)
    assert (tmp_path / name).read_bytes() == data
    assert shrew.read_version(GOLDEN / name) == 1


@pytest.mark.parametrize("name", V2_FILES)
def test_v2_golden_reads_exactly_and_writes_back_identically(name: str, tmp_path: Path) -> None:
    data = golden(name)
    want = gen.expected(name)
    ckpt = shrew.training_from_bytes(data)
    same_tensors(dict(ckpt.model_params), want["model_params"])
    if want["optimizer_state"] is None:
        assert ckpt.optimizer_state is None
    else:
        kind, scalars, buffers = want["optimizer_state"]
        assert ckpt.optimizer_state == sp.OptimizerState(kind, scalars, buffers)
    assert ckpt.epoch == want["epoch"] and ckpt.global_step == want["global_step"]
    assert repr(ckpt.best_loss) == repr(want["best_loss"])
    assert ckpt.loss_history == want["loss_history"]
    assert shrew.training_to_bytes(ckpt) == data
    shrew.save_training(tmp_path / name, ckpt)
    assert (tmp_path / name).read_bytes() == data
    assert shrew.read_version(io.BytesIO(data)) == 2


@pytest.mark.parametrize("name", V1_FILES)
def test_seed_named_stream_functions_v1(name: str) -> None:
    # write_checkpoint / read_checkpoint: the seed's names, on binary streams.
    data = golden(name)
    same_tensors(shrew.read_checkpoint(io.BytesIO(data)), gen.expected(name))
    out = io.BytesIO(b"head")
    out.seek(4)
    shrew.write_checkpoint(out, gen.expected(name))
    assert out.getvalue() == b"head" + data


@pytest.mark.parametrize("name", V2_FILES)
def test_seed_named_stream_functions_v2(name: str) -> None:
    data = golden(name)
    ckpt = shrew.read_training_checkpoint(io.BytesIO(data))
    same_tensors(dict(ckpt.model_params), gen.expected(name)["model_params"])
    assert ckpt.global_step == gen.expected(name)["global_step"]
    out = io.BytesIO()
    shrew.write_training_checkpoint(out, ckpt)
    assert out.getvalue() == data


def test_training_checkpoint_builders_are_the_seeds() -> None:
    state = sp.OptimizerState("Adam", {"lr": 0.001}, {"m": np.zeros(2)})
    base = shrew.TrainingCheckpoint(model_params={"w": np.ones(2, np.float32)})
    built = (
        base.with_optimizer_state(state)
        .with_epoch(3)
        .with_global_step(300)
        .with_best_loss(0.25)
        .with_loss_history((1.0, 0.5))
    )
    assert (built.epoch, built.global_step, built.best_loss) == (3, 300, 0.25)
    assert built.loss_history == [1.0, 0.5] and built.optimizer_state is state
    assert built.model_params is base.model_params
    # Each builder returns a copy: the seed's defaults stay on the original.
    assert (base.epoch, base.global_step, base.best_loss, base.loss_history) == (0, 0, math.inf, [])
    assert base.optimizer_state is None
    assert shrew.training_from_bytes(shrew.training_to_bytes(built)).global_step == 300


def test_errors_carry_the_seeds_texts() -> None:
    v1, v2 = golden(V1_FILES[0]), golden(V2_FILES[0])
    with pytest.raises(CorruptCheckpointError) as bad_magic:
        shrew.from_bytes(b"SHRX" + v1[4:])
    assert "Invalid checkpoint: expected magic [83, 72, 82, 87], got [83, 72, 82, 88]" in str(
        bad_magic.value
    )
    with pytest.raises(IncompatibleCheckpointError, match="Unsupported checkpoint version: 3"):
        shrew.read_checkpoint(io.BytesIO(b"SHRW" + struct.pack("<I", 3) + v1[8:]))
    with pytest.raises(IncompatibleCheckpointError) as v2_as_v1:
        shrew.read_checkpoint(io.BytesIO(v2))
    assert "Unsupported checkpoint version: 2 (expected 1)" in str(v2_as_v1.value)
    with pytest.raises(IncompatibleCheckpointError) as v1_as_v2:
        shrew.read_training_checkpoint(io.BytesIO(v1))
    assert "Unsupported training checkpoint version: 1 (expected 2)" in str(v1_as_v2.value)


def test_seed_test_values() -> None:
    # The seed's test_training_checkpoint_roundtrip, against the hand-built file.
    ckpt = shrew.load_training(GOLDEN / "v2_adam.shrew")
    assert list(ckpt.model_params) == ["layer1/weight", "layer1/bias"]
    assert ckpt.model_params["layer1/weight"].shape == (2, 2)
    opt = ckpt.optimizer_state
    assert opt is not None and opt.optimizer_type == "Adam"
    assert (opt.get_scalar("t"), opt.get_scalar("lr"), opt.get_scalar("beta1")) == (
        100.0,
        0.001,
        0.9,
    )
    m0 = opt.get_buffer("m.0")
    assert m0 is not None and m0.tolist() == [0.01, 0.02, 0.03, 0.04]
    assert (ckpt.epoch, ckpt.global_step, ckpt.best_loss) == (10, 5000, 0.032)
    assert ckpt.loss_history == [1.5, 0.8, 0.4, 0.1, 0.05, 0.032]


def _v2(sections: list[bytes]) -> bytes:
    return b"SHRW" + struct.pack("<I", 2) + b"".join(sections) + b"\xff"


def _section_model(tensors: list[Any]) -> bytes:
    return b"\x01" + gen.u32(len(tensors)) + b"".join(gen.tensor(*t) for t in tensors)


def _section_meta(epoch: int, step: int, best: float, history: list[float]) -> bytes:
    return (
        b"\x03"
        + gen.u64(epoch)
        + gen.u64(step)
        + gen.f64(best)
        + gen.u32(len(history))
        + b"".join(map(gen.f64, history))
    )


def _section_opt(
    kind: str, scalars: list[tuple[str, float]], buffers: list[tuple[str, list[float]]]
) -> bytes:
    out = b"\x02" + gen.key(kind) + gen.u32(len(scalars))
    out += b"".join(gen.key(k) + gen.f64(v) for k, v in scalars)
    out += gen.u32(len(buffers))
    for k, values in buffers:
        out += gen.key(k) + gen.u64(len(values)) + b"".join(map(gen.f64, values))
    return out


def test_reader_accepts_any_section_and_key_order() -> None:
    # The seed's writer emits scalars and buffers in HashMap order, and its reader takes sections
    # in any order; savepoint reads all of those and writes its canonical order.
    model = _section_model([("w", gen.F32, [2], [1.0, 2.0])])
    meta = _section_meta(1, 2, 0.5, [0.5])
    opt = _section_opt("Adam", [("lr", 0.1), ("beta1", 0.9)], [("v.0", [2.0]), ("m.0", [1.0])])
    canonical = shrew.training_from_bytes(_v2([model, opt, meta]))
    for order in ([meta, opt, model], [opt, meta, model], [model, meta, opt]):
        other = shrew.training_from_bytes(_v2(order))
        assert other.optimizer_state == canonical.optimizer_state
        assert list(other.optimizer_state.scalars) == ["lr", "beta1"]  # type: ignore[union-attr]
        same_tensors(dict(other.model_params), dict(canonical.model_params))
        assert (other.epoch, other.global_step, other.loss_history) == (1, 2, [0.5])
    written = shrew.training_to_bytes(canonical)
    sorted_opt = _section_opt(
        "Adam", [("beta1", 0.9), ("lr", 0.1)], [("m.0", [1.0]), ("v.0", [2.0])]
    )
    assert written == _v2([model, sorted_opt, meta])


# ---------------------------------------------------------------------------------------------
# round trips
# ---------------------------------------------------------------------------------------------

SHREW_DTYPES = list(shrew.TAG_OF)
KEYS = st.text(st.characters(blacklist_categories=("Cs",)), max_size=8)


@st.composite
def tensor_sets(draw: Any) -> list[tuple[str, np.ndarray]]:
    names = draw(st.lists(KEYS, max_size=5, unique=True))
    out = []
    for name in names:
        d = dtypes.from_name(draw(st.sampled_from(SHREW_DTYPES)))
        shape = tuple(draw(st.lists(st.integers(0, 3), max_size=3)))
        n = math.prod(shape) * d.itemsize
        raw = draw(st.binary(min_size=n, max_size=n))
        out.append((name, np.frombuffer(raw, dtype=d.numpy).reshape(shape).copy()))
    return out


@settings(max_examples=60, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(tensor_sets())
def test_v1_round_trip_keeps_every_bit(tensors: list[tuple[str, np.ndarray]]) -> None:
    data = shrew.to_bytes(tensors)
    back = shrew.from_bytes(data)
    assert list(back) == [n for n, _ in tensors]
    for name, a in tensors:
        same(back[name], a)  # NaN payloads, -0.0, every integer
    assert shrew.to_bytes(back) == data


@settings(max_examples=40, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(
    tensor_sets(),
    st.integers(0, 2**64 - 1),
    st.integers(0, 2**64 - 1),
    st.floats(allow_nan=False),
    st.lists(st.floats(allow_nan=False), max_size=5),
    st.dictionaries(KEYS.filter(bool), st.floats(allow_nan=False), max_size=3),
)
def test_v2_round_trip(
    tensors: list[tuple[str, np.ndarray]],
    epoch: int,
    step: int,
    best: float,
    history: list[float],
    scalars: dict[str, float],
) -> None:
    state = sp.OptimizerState("Adam", scalars, {"m.0": np.array(history, np.float64)})
    ckpt = shrew.TrainingCheckpoint(dict(tensors), state, epoch, step, best, history)
    data = shrew.training_to_bytes(ckpt)
    back = shrew.training_from_bytes(data)
    same_tensors(dict(back.model_params), dict(tensors))
    assert back.optimizer_state == state
    assert (back.epoch, back.global_step, back.loss_history) == (epoch, step, history)
    assert repr(back.best_loss) == repr(best)
    assert shrew.training_to_bytes(back) == data


def test_int64_beyond_2_53_is_exact_from_numpy_and_torch() -> None:
    torch = pytest.importorskip("torch")
    values = [2**53 + 1, 2**62 + 3, -(2**63), 2**63 - 1]
    for source in (np.array(values, np.int64), torch.tensor(values, dtype=torch.int64)):
        back = shrew.from_bytes(shrew.to_bytes({"i": source}))["i"]
        assert back.dtype == np.int64 and back.tolist() == values
    back_t = shrew.from_bytes(shrew.to_bytes({"i": np.array(values)}), framework="torch")["i"]
    assert back_t.dtype == torch.int64 and back_t.tolist() == values


@pytest.mark.torch
def test_torch_inputs_and_outputs_keep_dtype_and_values() -> None:
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(0)
    tensors = {
        "f32": torch.randn(3, 4, generator=g),
        "f64": torch.randn(2, dtype=torch.float64, generator=g),
        "f16": torch.randn(5, generator=g).half(),
        "bf16": torch.randn(2, 2, generator=g).bfloat16(),
        "u8": torch.arange(256, dtype=torch.uint8),
        "u32": torch.tensor([0, 2**32 - 1], dtype=torch.uint32),
        "i64": torch.tensor([-1, 2**60], dtype=torch.int64),
        "noncontig": torch.randn(4, 6, generator=g).t(),
        "scalar": torch.tensor(1.5),
    }
    data = shrew.to_bytes(tensors)
    as_torch = shrew.from_bytes(data, framework="torch")
    as_numpy = shrew.from_bytes(data)
    for name, t in tensors.items():
        assert as_torch[name].dtype == t.dtype and as_torch[name].shape == t.shape
        assert torch.equal(as_torch[name], t), name
        assert as_numpy[name].shape == tuple(t.shape)
    assert as_numpy["bf16"].dtype == ml_dtypes.bfloat16
    assert as_numpy["noncontig"].tobytes() == tensors["noncontig"].contiguous().numpy().tobytes()


@pytest.mark.parametrize(
    ("dtype", "name"),
    [
        (np.bool_, "BOOL"),
        (np.int8, "I8"),
        (np.int32, "I32"),
        (np.uint64, "U64"),
        (np.complex64, "C64"),
        (ml_dtypes.float8_e4m3fn, "F8_E4M3"),
    ],
)
def test_dtypes_without_a_tag_are_refused_by_name(dtype: Any, name: str, tmp_path: Path) -> None:
    target = tmp_path / "x.shrew"
    target.write_bytes(b"previous")
    with pytest.raises(UnsupportedStateError) as err:
        shrew.save_tensors(target, {"ok": np.zeros(2, np.float32), "layer/bad": np.zeros(2, dtype)})
    assert "layer/bad" in str(err.value) and name in str(err.value)
    assert err.value.key == "layer/bad"
    assert target.read_bytes() == b"previous"
    assert sorted(os.listdir(tmp_path)) == ["x.shrew"]


def test_torch_bool_and_int32_are_refused() -> None:
    torch = pytest.importorskip("torch")
    for t in (torch.zeros(2, dtype=torch.bool), torch.zeros(2, dtype=torch.int32)):
        with pytest.raises(UnsupportedStateError, match=r"cannot be stored in \.shrew"):
            shrew.to_bytes({"t": t})


def test_writer_refuses_duplicates_non_tensors_and_bad_keys() -> None:
    with pytest.raises(UnsupportedStateError, match="appears twice"):
        shrew.to_bytes([("a", np.zeros(1)), ("a", np.ones(1))])
    with pytest.raises(UnsupportedStateError, match="not a numpy array"):
        shrew.to_bytes({"a": [1.0, 2.0]})
    with pytest.raises(UnsupportedStateError, match="UTF-8"):
        shrew.to_bytes({"\ud800": np.zeros(1)})
    with pytest.raises(UnsupportedStateError, match="not a str"):
        shrew.to_bytes([(1, np.zeros(1))])  # type: ignore[list-item]
    with pytest.raises(UnsupportedStateError, match="u64"):
        shrew.training_to_bytes(shrew.TrainingCheckpoint(epoch=2**64))
    with pytest.raises(UnsupportedStateError, match="OptimizerState"):
        shrew.training_to_bytes(shrew.TrainingCheckpoint(optimizer_state={"lr": 1.0}))  # type: ignore[arg-type]


def test_streams_read_and_write_from_their_position() -> None:
    buf = io.BytesIO()
    buf.write(b"prefix")
    shrew.save_tensors(buf, {"a": np.arange(3, dtype=np.float32)})
    end = buf.tell()
    buf.write(b"")
    buf.seek(6)
    same(shrew.load_tensors(buf)["a"], np.arange(3, dtype=np.float32))
    assert buf.tell() == end

    class OneWay(io.RawIOBase):
        """A non-seekable stream that hands out at most 5 bytes per read."""

        def __init__(self, data: bytes) -> None:
            self.data, self.pos = data, 0

        def readable(self) -> bool:
            return True

        def readinto(self, b: Any) -> int:
            n = min(5, len(b), len(self.data) - self.pos)
            b[:n] = self.data[self.pos : self.pos + n]
            self.pos += n
            return n

    data = golden("v2_adam.shrew")
    ckpt = shrew.load_training(OneWay(data))  # type: ignore[arg-type]
    assert shrew.training_to_bytes(ckpt) == data
    with pytest.raises(CorruptCheckpointError, match="unexpected bytes"):
        shrew.load_training(OneWay(data + b"\x00"))  # type: ignore[arg-type]
    with pytest.raises(CorruptCheckpointError):
        shrew.load_training(OneWay(data[:-3]))  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# hostile input
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", GOLDEN_FILES)
def test_every_truncation_is_a_corrupt_checkpoint(name: str) -> None:
    data = golden(name)
    read = shrew.from_bytes if name.startswith("v1") else shrew.training_from_bytes
    for n in range(len(data)):
        with pytest.raises(CorruptCheckpointError):
            read(data[:n])


@pytest.mark.parametrize("name", GOLDEN_FILES)
def test_trailing_bytes_are_refused(name: str) -> None:
    read = shrew.from_bytes if name.startswith("v1") else shrew.training_from_bytes
    with pytest.raises(CorruptCheckpointError, match="unexpected bytes after"):
        read(golden(name) + b"\x00")


def _v1(*tensors: bytes, count: int | None = None) -> bytes:
    return (
        b"SHRW" + gen.u32(1) + gen.u32(len(tensors) if count is None else count) + b"".join(tensors)
    )


def test_malformed_headers_and_records() -> None:
    good = gen.tensor("w", gen.F32, [2], [1.0, 2.0])
    cases: list[tuple[bytes, type[CheckpointError], str]] = [
        (b"SHRX" + gen.u32(1) + gen.u32(0), CorruptCheckpointError, "not a .shrew file"),
        (b"SHRW" + gen.u32(3) + gen.u32(0), IncompatibleCheckpointError, "version 3"),
        (b"SHRW" + gen.u32(0), IncompatibleCheckpointError, "version 0"),
        (_v1(good, good), CorruptCheckpointError, "appears twice"),
        (
            _v1(gen.key("w") + b"\x07" + gen.u32(1) + gen.u32(2) + gen.u64(8) + b"\x00" * 8),
            CorruptCheckpointError,
            "unknown dtype tag 7",
        ),
        (
            _v1(gen.key("w") + b"\x00" + gen.u32(1) + gen.u32(2) + gen.u64(12) + b"\x00" * 12),
            CorruptCheckpointError,
            "disagrees",
        ),
        (
            _v1(gen.u32(2) + b"\xff\xfe" + b"\x00" + gen.u32(0) + gen.u64(4) + b"\x00" * 4),
            CorruptCheckpointError,
            "UTF-8",
        ),
        (
            _v1(gen.key("w") + b"\x00" + gen.u32(65) + gen.u32(1) * 65 + gen.u64(4) + b"\x00" * 4),
            IncompatibleCheckpointError,
            "65 dimensions",
        ),
    ]
    for data, error, message in cases:
        with pytest.raises(error, match=message):
            shrew.from_bytes(data)


def test_malformed_v2_sections() -> None:
    model = _section_model([("w", gen.F32, [1], [1.0])])
    meta = _section_meta(0, 0, 1.0, [])
    opt = _section_opt("Adam", [("lr", 0.1)], [])
    cases: list[tuple[bytes, type[CheckpointError], str]] = [
        (_v2([model, meta, b"\x04"]), CorruptCheckpointError, "unknown section tag 0x04"),
        (_v2([model, model, meta]), CorruptCheckpointError, "model section appears twice"),
        (_v2([model, opt, opt, meta]), CorruptCheckpointError, "optimizer section appears twice"),
        (_v2([model, meta, meta]), CorruptCheckpointError, "metadata section appears twice"),
        (_v2([meta]), CorruptCheckpointError, "model section is missing"),
        (_v2([model]), CorruptCheckpointError, "metadata section is missing"),
        (_v2([model, meta])[:-1], CorruptCheckpointError, "end tag"),
        (
            _v2([model, _section_opt("Adam", [("lr", 0.1), ("lr", 0.2)], []), meta]),
            CorruptCheckpointError,
            "scalar 'lr' appears twice",
        ),
        (
            _v2([model, _section_opt("Adam", [], [("m", [1.0]), ("m", [1.0])]), meta]),
            CorruptCheckpointError,
            "buffer 'm' appears twice",
        ),
        (
            _v2([model, _section_opt("", [], []), meta]),
            IncompatibleCheckpointError,
            "empty type name",
        ),
        (
            _v2([model, _section_opt("Adam", [("", 1.0)], []), meta]),
            IncompatibleCheckpointError,
            "empty key",
        ),
    ]
    for data, error, message in cases:
        with pytest.raises(error, match=message):
            shrew.training_from_bytes(data)


def test_versions_are_not_mixed_up() -> None:
    with pytest.raises(IncompatibleCheckpointError, match="load_training"):
        shrew.from_bytes(golden("v2_adam.shrew"))
    with pytest.raises(IncompatibleCheckpointError, match="load_tensors"):
        shrew.training_from_bytes(golden("v1_dtypes.shrew"))


HUGE = [
    ("key length", _v1(gen.u32(2**32 - 1) + b"abc")),
    ("ndim", _v1(gen.key("w") + b"\x00" + gen.u32(2**32 - 1))),
    (
        "data length",
        _v1(
            gen.key("w")
            + b"\x02"
            + gen.u32(1)
            + gen.u32(2**32 - 1)
            + gen.u64(2**32 - 1)
            + b"\x00" * 8
        ),
    ),
    (
        "data length vs dims",
        _v1(gen.key("w") + b"\x02" + gen.u32(2) + gen.u32(2**31) + gen.u32(2**31) + gen.u64(2**62)),
    ),
    ("tensor count", _v1(count=2**32 - 1)),
    (
        "buffer length",
        _v2(
            [
                _section_model([]),
                b"\x02" + gen.key("A") + gen.u32(0) + gen.u32(1) + gen.key("m") + gen.u64(2**61),
            ]
        ),
    ),
    (
        "loss history",
        _v2([_section_model([]), b"\x03" + gen.u64(0) * 2 + gen.f64(0.0) + gen.u32(2**32 - 1)]),
    ),
    ("optimizer type", _v2([b"\x02" + gen.u32(2**32 - 1)])),
]


@pytest.mark.parametrize(("what", "data"), HUGE, ids=[h[0] for h in HUGE])
@pytest.mark.parametrize("seekable", [True, False])
def test_huge_lengths_fail_before_allocating(what: str, data: bytes, seekable: bool) -> None:
    class Stream(io.BytesIO):
        def seekable(self) -> bool:
            return seekable

    read = shrew.load_tensors if data[4] == 1 else shrew.load_training
    tracemalloc.start()
    try:
        with pytest.raises(CorruptCheckpointError):
            read(Stream(data))  # type: ignore[arg-type]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"{what}: {peak} bytes allocated"


# ---------------------------------------------------------------------------------------------
# paths, atomic writes
# ---------------------------------------------------------------------------------------------


class Exploding(LazyTensor):
    def __init__(self) -> None:
        super().__init__(dtypes.from_name("F32"), (1 << 21,))

    def copy_to(self, dst: np.ndarray, start: int) -> None:
        if start > 0:
            raise OSError(5, "device on fire")
        dst[:] = 0


def test_failed_write_leaves_the_previous_file_and_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "w.shrew"
    shrew.save_tensors(target, {"a": np.ones(2, np.float32)})
    before = target.read_bytes()
    with pytest.raises(sp.CheckpointWriteError, match="device on fire"):
        shrew.save_tensors(target, {"a": np.ones(2, np.float32), "b": Exploding()})
    assert target.read_bytes() == before
    assert os.listdir(tmp_path) == ["w.shrew"]


def test_missing_file_is_not_found(tmp_path: Path) -> None:
    with pytest.raises(sp.CheckpointNotFoundError):
        shrew.load_tensors(tmp_path / "nope.shrew")
    with pytest.raises(sp.CheckpointNotFoundError):
        shrew.ShrewFile(tmp_path / "nope.shrew")


def test_shrew_file_streams_without_reading_data(tmp_path: Path) -> None:
    with shrew.ShrewFile(GOLDEN / "v2_adam.shrew") as f:
        assert f.version == 2 and list(f.tensors) == ["layer1/weight", "layer1/bias"]
        same(f.tensors["layer1/weight"].load(), np.array([[1, 2], [3, 4]], np.float32))
        assert f.buffers["m.0"].load().tolist() == [0.01, 0.02, 0.03, 0.04]
        tree = f.tree()
        assert tree["optimizer"]["scalars"] == {"beta1": 0.9, "lr": 0.001, "t": 100.0}
        assert tree["epoch"] == 10 and tree["global_step"] == 5000
    info = shrew.inspect(GOLDEN / "v2_adam.shrew")
    assert [t.key for t in info.tensors] == [
        "model/layer1/weight",
        "model/layer1/bias",
        "optimizer/buffers/m.0",
        "optimizer/buffers/v.0",
    ]
    assert info.values["global_step"] == 5000 and info.format_version == 2
    assert shrew.verify(GOLDEN / "v1_dtypes.shrew").total_bytes == 16 + 24 + 3 + 8 + 24 + 4 + 4
    bad = tmp_path / "bad.shrew"
    bad.write_bytes(golden("v1_dtypes.shrew")[:-1])
    with pytest.raises(CorruptCheckpointError):
        shrew.verify(bad)


# ---------------------------------------------------------------------------------------------
# models and optimizers
# ---------------------------------------------------------------------------------------------


def test_load_into_a_mapping_updates_present_entries_only() -> None:
    data = shrew.to_bytes({"w": np.full(3, 7.0, np.float32), "unknown": np.zeros(1)})
    target = {"w": np.zeros(3, np.float32), "b": np.ones(2, np.float32)}
    w = target["w"]
    assert shrew.load(io.BytesIO(data), target) == 1
    assert target["w"] is w and w.tolist() == [7.0] * 3
    assert target["b"].tolist() == [1.0, 1.0]
    with pytest.raises(StateMismatchError) as err:
        shrew.load(io.BytesIO(data), {"w": np.zeros(4, np.float32)})
    assert "F32 [3] in the file, F32 [4] here" in str(err.value)


@pytest.mark.torch
def test_load_into_a_torch_model_returns_the_count(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    source = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    path = tmp_path / "model.shrew"
    shrew.save(path, source)
    target = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    assert shrew.load(path, target) == 4
    for a, b in zip(source.parameters(), target.parameters()):
        assert torch.equal(a, b)
    # Only what the file has: a file with one known and one unknown entry.
    partial = tmp_path / "partial.shrew"
    shrew.save_tensors(partial, {"0.bias": torch.full((4,), 9.0), "extra": torch.zeros(1)})
    fresh = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    weight = fresh[0].weight.detach().clone()
    assert shrew.load(partial, fresh) == 1
    assert torch.equal(fresh[0].bias, torch.full((4,), 9.0))
    assert torch.equal(fresh[0].weight, weight)
    # A shape disagreement changes nothing.
    wrong = tmp_path / "wrong.shrew"
    shrew.save_tensors(wrong, {"0.bias": torch.zeros(5), "2.bias": torch.zeros(2)})
    with pytest.raises(StateMismatchError):
        shrew.load(wrong, fresh)
    assert torch.equal(fresh[0].bias, torch.full((4,), 9.0))
    # v2 files load their model section.
    ckpt_path = tmp_path / "train.shrew"
    shrew.save_training(ckpt_path, shrew.TrainingCheckpoint.from_torch(source))
    assert shrew.load(ckpt_path, fresh) == 4


@pytest.mark.torch
def test_training_checkpoint_resumes_a_torch_run_bit_exactly(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")

    def make() -> tuple[Any, Any]:
        torch.manual_seed(1)
        model = torch.nn.Linear(4, 3)
        return model, torch.optim.Adam(model.parameters(), lr=0.01)

    def step(model: Any, opt: Any, i: int) -> float:
        g = torch.Generator().manual_seed(100 + i)
        x, y = torch.randn(8, 4, generator=g), torch.randn(8, 3, generator=g)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return float(loss.detach())

    model, opt = make()
    losses = [step(model, opt, i) for i in range(3)]
    ckpt = shrew.TrainingCheckpoint.from_torch(
        model, opt, epoch=1, global_step=3, best_loss=min(losses), loss_history=losses
    )
    state = sp.optimizer_state_from_torch(opt)
    path = tmp_path / "train.shrew"
    shrew.save_training(path, ckpt)
    expected = [step(model, opt, i) for i in range(3, 6)]

    loaded = shrew.load_training(path)
    assert loaded.optimizer_state == state
    assert loaded.loss_history == losses and loaded.global_step == 3
    model2, opt2 = make()
    assert loaded.restore(model2, opt2) == 2
    assert [step(model2, opt2, i) for i in range(3, 6)] == expected
    with pytest.raises(IncompatibleCheckpointError, match="no optimizer state"):
        shrew.TrainingCheckpoint(loaded.model_params).restore(model2, opt2)


def test_temporaries_of_dead_writers_are_tidied(tmp_path: Path) -> None:
    import subprocess
    import sys

    from savepoint.commit.names import HOST, TMP_TAG

    child = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    dead = int(child.stdout)
    leftover = tmp_path / f".w.shrew{TMP_TAG}{HOST}-{dead}-0123abcd"
    leftover.write_bytes(b"half a file")
    live = tmp_path / f".w.shrew{TMP_TAG}{HOST}-{os.getpid()}-0123abcd"
    live.write_bytes(b"someone else's")
    shrew.save_tensors(tmp_path / "w.shrew", {"a": np.ones(1)})
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["w.shrew", live.name])


# -- bounds on what a file's structure may cost (issue 11) ----------------------------------------

# One-letter keys outside Latin-1: two or three bytes of file, a 76-byte str each.
_KEYS = [chr(c).encode() for c in range(0x100, 0xD800)]


def _tiny_tensors(count: int) -> bytes:
    # 0-d U8 tensors: 20 bytes of file each, the smallest a distinct key allows.
    return b"".join(
        gen.u32(len(k)) + k + b"\x02" + gen.u32(0) + gen.u64(1) + b"\x07" for k in _KEYS[:count]
    )


def _opt_section(scalars: int, buffers: int) -> bytes:
    out = b"\x02" + gen.key("adam") + gen.u32(scalars)
    out += b"".join(gen.u32(len(k)) + k + gen.f64(0.5) for k in _KEYS[:scalars])
    out += gen.u32(buffers) + b"".join(gen.u32(len(k)) + k + gen.u64(0) for k in _KEYS[:buffers])
    return out


def _hostile_shrew(kind: str, size: int) -> bytes:
    if kind == "v1 tiny tensors":
        n = size // 20
        return b"SHRW" + gen.u32(1) + gen.u32(n) + _tiny_tensors(n)
    meta = b"\x03" + gen.u64(0) * 2 + gen.f64(0.0) + gen.u32(0)
    if kind == "v2 tiny tensors":
        n = size // 20
        return _v2([b"\x01" + gen.u32(n) + _tiny_tensors(n), meta])
    if kind == "v2 scalars":
        return _v2([_section_model([]), _opt_section(size // 15, 0), meta])
    if kind == "v2 empty buffers":
        return _v2([_section_model([]), _opt_section(0, size // 15), meta])
    n = size // 8  # a long loss history
    return _v2(
        [_section_model([]), b"\x03" + gen.u64(0) * 2 + gen.f64(0.0) + gen.u32(n) + bytes(8 * n)]
    )


HOSTILE = ["v1 tiny tensors", "v2 tiny tensors", "v2 scalars", "v2 empty buffers", "loss history"]


@pytest.mark.parametrize("reader", ["bytes", "inspect"])
@pytest.mark.parametrize("kind", HOSTILE)
def test_memory_is_bounded_by_the_file_size(
    kind: str, reader: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """peak traced memory <= 16 x file + BUDGET_SLACK + 1 MiB, for the densest valid files.

    The slack is lowered to 64 KiB so that a 200 KiB file shows the proportional part. Before
    the record budget, a file of empty optimizer buffers with one-letter keys cost 37 x its size.
    """
    from savepoint.codecs import shrew as codec

    slack = 64 << 10
    monkeypatch.setattr(codec, "BUDGET_SLACK", slack, raising=False)
    data = _hostile_shrew(kind, 200 << 10)
    path = tmp_path / "hostile.shrew"
    path.write_bytes(data)
    version = data[4]
    read: Any = {
        "bytes": lambda: (shrew.from_bytes if version == 1 else shrew.training_from_bytes)(data),
        "inspect": lambda: shrew.inspect(path),
        "verify": lambda: shrew.verify(path),
    }[reader]
    refused = None
    tracemalloc.start()
    try:
        try:
            read()
        except CorruptCheckpointError as exc:
            refused = str(exc)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert refused is None or "records" in refused
    assert peak <= 16 * len(data) + slack + (1 << 20), f"{peak} bytes for {len(data)}"


def test_real_files_are_far_from_the_record_budget() -> None:
    # 20,000 small named tensors (a 0-d float32 each, 30-byte keys): accepted with the real budget.
    tensors = {
        f"model.layers.{i:05d}.norm.weight": np.float32(i) * np.ones((), np.float32)
        for i in range(20_000)
    }
    data = shrew.to_bytes(tensors)
    assert len(shrew.from_bytes(data)) == 20_000


def test_a_zero_element_shape_numpy_cannot_describe_is_incompatible() -> None:
    # 2**32-1 x 2**32-1 x 2**32-1 x 0: no data, but numpy cannot make an array of that shape.
    dims = [2**32 - 1, 2**32 - 1, 2**32 - 1, 0]
    record = gen.key("w") + b"\x00" + gen.u32(4) + b"".join(gen.u32(d) for d in dims) + gen.u64(0)
    for data in (_v1(record), _v2([b"\x01" + gen.u32(1) + record, b"\x03" + bytes(28)])):
        read = shrew.from_bytes if data[4] == 1 else shrew.training_from_bytes
        with pytest.raises(IncompatibleCheckpointError, match="too large"):
            read(data)


def test_more_than_64_dims_is_incompatible_and_short_dims_corrupt() -> None:
    record = gen.key("w") + b"\x00" + gen.u32(65) + gen.u32(1) * 65 + gen.u64(4) + bytes(4)
    with pytest.raises(IncompatibleCheckpointError, match="65 dimensions"):
        shrew.from_bytes(_v1(record))
    with pytest.raises(CorruptCheckpointError, match=r"truncated|remain"):
        shrew.from_bytes(_v1(gen.key("w") + b"\x00" + gen.u32(65) + gen.u32(1) * 10))
