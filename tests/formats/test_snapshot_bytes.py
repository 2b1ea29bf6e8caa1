"""The compact binary snapshot encoding (``to_bytes``): spec, golden bytes, hostile input."""

from __future__ import annotations

import json
import re
import struct
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.numpy
import xxhash
from hypothesis import given, settings

import savepoint as sp
from _support import load_generator
from inference._snapshots import assert_records_equal, snapshots
from savepoint.codecs import snapshot as snapshot_format
from savepoint.inference import InferenceSnapshot

GOLDEN = Path(__file__).resolve().parent.parent / "golden" / "kizzasi"


gen = load_generator(GOLDEN / "make_golden.py", "kizzasi_make_golden_b")


def craft(header: dict[str, Any], data: bytes, meta: dict[str, str] | None = None) -> bytes:
    """A blob built from the module docstring's spec alone (checksum included)."""
    meta = {"format": "savepoint.inference_snapshot", "version": "1", **(meta or {})}
    meta["xxh3"] = "0" * 16
    raw = json.dumps({"__metadata__": meta, **header}, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    prefix = struct.pack("<Q", len(raw))
    digest = f"{xxhash.xxh3_64_intdigest(prefix + raw + data):016x}"
    raw = raw.replace(b'"xxh3":"0000000000000000"', f'"xxh3":"{digest}"'.encode())
    return prefix + raw + data


def described(step_count: int = 1, states: int = 1, history: int = 0, **extra: Any) -> str:
    doc = {
        "step_count": step_count,
        "config": {},
        "metadata": {"timestamp": 0, "description": "", "model_id": "unknown", "tags": []},
        "states": states,
        "history": history,
        "torch": [],
        **extra,
    }
    return json.dumps(doc)


def test_golden_bytes() -> None:
    raw = (GOLDEN / "savepoint_v1.snapshot").read_bytes()
    assert_records_equal(snapshot_format.decode(raw), gen.golden_record())
    assert snapshot_format.encode(gen.golden_record()) == raw


def test_a_crafted_blob_reads() -> None:
    data = np.arange(6, dtype=np.float32).tobytes()
    blob = craft(
        {"states/0": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}},
        data,
        {"snapshot": described(step_count=5)},
    )
    snap = InferenceSnapshot.from_bytes(blob)
    assert snap.step_count == 5
    assert snap.states[0].tolist() == [[0, 1, 2], [3, 4, 5]]


def test_any_safetensors_reader_opens_it() -> None:
    snap = InferenceSnapshot(
        states=[np.arange(6, dtype=np.float32).reshape(2, 3), np.arange(3, dtype=np.int64)],
        history=[np.ones(4, np.float64)],
        step_count=9,
    )
    loaded = safetensors.numpy.load(snap.to_bytes())
    assert sorted(loaded) == ["history/0", "states/0", "states/1"]
    assert loaded["states/0"].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert loaded["history/0"].dtype == np.float64


def test_arrays_are_aligned_to_their_itemsize() -> None:
    snap = InferenceSnapshot(
        states=[np.zeros(3, np.int8), np.zeros(3, np.float64), np.zeros(1, np.float16)],
        history=[np.zeros(5, np.bool_), np.zeros(2, np.complex64)],
    )
    raw = snap.to_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert n % 8 == 0
    header = json.loads(raw[8 : 8 + n])
    for name, entry in header.items():
        if name != "__metadata__":
            itemsize = np.dtype(snap_dtype(entry["dtype"])).itemsize
            assert entry["data_offsets"][0] % itemsize == 0, name


def snap_dtype(name: str) -> Any:
    from savepoint.codecs import dtypes

    return dtypes.BY_NAME[name].numpy


def test_zero_copy_from_bytes_and_a_copy_otherwise() -> None:
    snap = InferenceSnapshot(states=[np.arange(4, dtype=np.float32)])
    raw = snap.to_bytes()
    view = InferenceSnapshot.from_bytes(raw)
    assert not view.states[0].flags.writeable
    assert not view.states[0].flags.owndata  # a view of raw
    mutable = bytearray(raw)
    copied = InferenceSnapshot.from_bytes(mutable)
    mutable[-4:] = b"\x00" * 4
    assert copied.states[0].tolist() == [0, 1, 2, 3]  # unaffected by later changes
    assert InferenceSnapshot.from_bytes(memoryview(raw)) == snap


@settings(max_examples=150, deadline=None)
@given(snapshots())
def test_round_trip_exactly(snap: InferenceSnapshot) -> None:
    assert InferenceSnapshot.from_bytes(snap.to_bytes()) == snap


def test_every_truncation_and_every_bit_flip_is_detected() -> None:
    raw = (GOLDEN / "savepoint_v1.snapshot").read_bytes()
    for n in range(len(raw)):
        with pytest.raises(sp.CorruptCheckpointError):
            snapshot_format.decode(raw[:n])
    for i in range(len(raw)):
        for bit in (0x01, 0x10, 0x80):
            damaged = bytearray(raw)
            damaged[i] ^= bit
            with pytest.raises(sp.CheckpointError):
                snapshot_format.decode(bytes(damaged))


def test_trailing_bytes_are_corrupt() -> None:
    raw = (GOLDEN / "savepoint_v1.snapshot").read_bytes()
    with pytest.raises(sp.CorruptCheckpointError, match="file is"):
        snapshot_format.decode(raw + b"\x00")


def test_a_newer_version_is_incompatible() -> None:
    blob = craft({}, b"", {"version": "2", "snapshot": described(states=0)})
    with pytest.raises(sp.IncompatibleCheckpointError, match="version '2'"):
        InferenceSnapshot.from_bytes(blob)


@pytest.mark.parametrize(
    ("header", "data", "meta", "match"),
    [
        ({}, b"", {"format": "other", "snapshot": described(states=0)}, "not a savepoint"),
        ({}, b"", {"snapshot": described(states=1)}, "named"),
        ({}, b"", {"snapshot": "{"}, "not valid JSON"),
        ({}, b"", {"snapshot": described(states=0, extra=1)}, "must hold"),
        ({}, b"", {"snapshot": described(states=-1)}, "counts"),
        ({}, b"", {"snapshot": described(states=0, torch=["states/0"])}, "torch"),
        ({}, b"", {"snapshot": described(states=0, step_count=-1)}, "step_count"),
        ({}, b"", {"snapshot": described(states=0, config=[1])}, "config"),
        ({}, b"", {"snapshot": described(states=0), "extra": "x"}, "exactly"),
        (
            {"states/00": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}},
            b"\x00" * 4,
            {"snapshot": described()},
            "named",
        ),
        (
            {"states/0": {"dtype": "F32", "shape": [2**61, 0], "data_offsets": [0, 0]}},
            b"",
            {"snapshot": described()},
            "too large",
        ),
        (
            {"states/0": {"dtype": "F32", "shape": [2**31, 2**31], "data_offsets": [0, 4]}},
            b"\x00" * 4,
            {"snapshot": described()},
            "bytes for shape|too large",
        ),
        (
            {"states/0": {"dtype": "F32", "shape": [1] * 65, "data_offsets": [0, 4]}},
            b"\x00" * 4,
            {"snapshot": described()},
            "64",
        ),
        (
            {"states/0": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}},
            b"\x00" * 4,
            {"snapshot": described()},
            "file",
        ),
    ],
)
def test_hostile_blobs(
    header: dict[str, Any], data: bytes, meta: dict[str, str], match: str
) -> None:
    with pytest.raises(sp.CorruptCheckpointError, match=match):
        InferenceSnapshot.from_bytes(craft(header, data, meta))


def test_a_huge_header_length_is_refused_before_reading() -> None:
    with pytest.raises(sp.CorruptCheckpointError, match=r"cap|past the end"):
        InferenceSnapshot.from_bytes(struct.pack("<Q", 2**62) + b"{}")


def test_header_order_does_not_matter() -> None:
    data = np.arange(3, dtype=np.float32).tobytes() + np.arange(2, dtype=np.float32).tobytes()
    entries = {
        "states/0": {"dtype": "F32", "shape": [3], "data_offsets": [0, 12]},
        "history/0": {"dtype": "F32", "shape": [2], "data_offsets": [12, 20]},
    }
    one = craft(entries, data, {"snapshot": described(history=1)})
    other = craft(dict(reversed(list(entries.items()))), data, {"snapshot": described(history=1)})
    assert InferenceSnapshot.from_bytes(one) == InferenceSnapshot.from_bytes(other)


def test_the_checksum_covers_the_header() -> None:
    snap = InferenceSnapshot(states=[np.zeros((4, 3), np.float32)], step_count=7)
    raw = snap.to_bytes()
    edited = re.sub(rb'\\"step_count\\":7', rb'\\"step_count\\":8', raw)
    assert edited != raw
    with pytest.raises(sp.CorruptCheckpointError, match="checksum"):
        InferenceSnapshot.from_bytes(edited)
    swapped = raw.replace(b'"shape":[4,3]', b'"shape":[3,4]')
    assert swapped != raw
    with pytest.raises(sp.CorruptCheckpointError, match="checksum"):
        InferenceSnapshot.from_bytes(swapped)


def test_not_bytes_is_a_type_error() -> None:
    with pytest.raises(TypeError):
        InferenceSnapshot.from_bytes("text")  # type: ignore[arg-type]


# -- type escapes and bounds (issue 11) ---------------------------------------------------------


@pytest.mark.parametrize("copy", [False, True], ids=["bytes", "bytearray"])
def test_bool_arrays_hold_only_0_and_1(copy: bool) -> None:
    header = {"states/0": {"dtype": "BOOL", "shape": [3], "data_offsets": [0, 3]}}
    good = craft(header, b"\x00\x01\x01", {"snapshot": described()})
    snap = InferenceSnapshot.from_bytes(bytearray(good) if copy else good)
    assert snap.states[0].tolist() == [False, True, True]
    assert InferenceSnapshot.from_bytes(snap.to_bytes()) == snap
    # A 2 would read as True and then differ from its own round trip (its bytes change).
    bad = craft(header, b"\x00\x02\x01", {"snapshot": described()})
    with pytest.raises(sp.CorruptCheckpointError, match="0 or 1"):
        InferenceSnapshot.from_bytes(bytearray(bad) if copy else bad)


@pytest.mark.parametrize(
    "snapshot",
    [
        described().replace('"description": ""', '"description": "\ud800"'),  # a real one
        described().replace('"description": ""', '"description": "\\ud800"'),
        described().replace('"tags": []', '"tags": ["\\udfff"]'),
        described().replace('"config": {}', '"config": {"\\ud83d": 1}'),
    ],
    ids=["record-raw", "description", "tag", "config-key"],
)
def test_a_lone_surrogate_in_the_header_is_corrupt(snapshot: str) -> None:
    # The record is JSON inside the header's JSON: a lone surrogate escaped once is a lone
    # surrogate in the record's text (once UnicodeEncodeError); escaped twice, in a value.
    with pytest.raises(sp.CorruptCheckpointError):
        InferenceSnapshot.from_bytes(craft({}, b"", {"snapshot": snapshot}))


def test_a_lone_surrogate_is_refused_when_saving() -> None:
    with pytest.raises(sp.UnsupportedStateError):
        InferenceSnapshot(states=[], metadata={"model_id": "x\udc00"})


def test_array_counts_are_checked_before_names_are_made() -> None:
    # One 8 MiB array, and counts claiming 8 million arrays: once, 8 million names were built
    # (about 500 MiB) before the header was found to disagree.
    size = 8 << 20
    header = {"states/0": {"dtype": "U8", "shape": [size], "data_offsets": [0, size]}}
    blob = craft(header, bytes(size), {"snapshot": described(states=size)})
    tracemalloc.start()
    try:
        with pytest.raises(sp.CorruptCheckpointError, match="named"):
            InferenceSnapshot.from_bytes(blob)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, peak


def test_a_deep_config_is_corrupt_not_a_recursion_error() -> None:
    for depth in (1_000, 100_000):
        config = '{"a": ' * depth + "1" + "}" * depth
        snapshot = described().replace('"config": {}', f'"config": {config}')
        with pytest.raises(sp.CorruptCheckpointError):
            InferenceSnapshot.from_bytes(craft({}, b"", {"snapshot": snapshot}))
