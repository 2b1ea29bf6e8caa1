"""Damaged checkpoints: truncation at every 1/64th of every file, single-bit flips in tensor data,
in safetensors headers (every bit of the 8-byte length prefix included) and in the manifest.

Whatever the damage, ``load`` and ``verify`` must raise a CheckpointError subclass: never another
exception type, a crash, a hang, or an allocation sized by a damaged length field.
"""

from __future__ import annotations

import contextlib
import shutil
import struct
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import savepoint as sp
from savepoint.codecs import manifest as mf
from savepoint.codecs import safetensors as stf

from ._util import MANIFEST, Hang, assert_same, deadline, read_doc

METADATA = {"step": 17, "note": "fault-injection", "nested": {"a": [1, 2, 3]}}
OP_DEADLINE_S = 10.0


def make_state() -> dict[str, Any]:
    rng = np.random.default_rng(20261121)
    return {
        "model": {
            "w": rng.standard_normal((48, 40)).astype(np.float32),
            "b": rng.standard_normal(40).astype(np.float16),
            "emb": rng.standard_normal((64, 16)).astype(ml_dtypes.bfloat16),
        },
        "opt": {
            "m": rng.standard_normal((20, 20)),
            "step": np.int64(17),
            "mask": rng.random(33) > 0.5,
            "idx": rng.integers(-1000, 1000, 25, dtype=np.int32),
            "c": (rng.standard_normal(6) + 1j * rng.standard_normal(6)).astype(np.complex64),
            "empty": np.zeros((0, 3), np.float32),
        },
        "raw": rng.integers(0, 256, 300, dtype=np.uint8),
        "epoch": 3,
        "lr": 1e-3,
        "name": "run-1",
        "flags": [True, None, b"\x00\xffraw"],
        "nan": float("nan"),
        "pair": (1, 2.5, "x"),
    }


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("corruption") / "ckpt"
    sp.save(path, make_state(), metadata=METADATA, max_file_bytes=4096)
    return path


@pytest.fixture
def ckpt(pristine: Path, tmp_path: Path) -> Path:
    """A private copy of the pristine checkpoint, checked intact before the test damages it."""
    path = tmp_path / "ckpt"
    shutil.copytree(pristine, path)
    assert_same(sp.load(path), make_state())
    sp.verify(path)
    return path


def data_files(path: Path) -> list[str]:
    return sorted(read_doc(path)["files"])


def test_fixture_has_several_files_and_dtypes(ckpt: Path) -> None:
    doc = read_doc(ckpt)
    assert len(doc["files"]) >= 3, doc["files"]
    assert {t["dtype"] for t in doc["tensors"].values()} >= {
        "F32",
        "F16",
        "BF16",
        "F64",
        "I64",
        "BOOL",
        "I32",
        "C64",
        "U8",
    }
    assert sp.inspect(ckpt).metadata == METADATA


# ---------------------------------------------------------------------------------------------
# harness
# ---------------------------------------------------------------------------------------------

Op = Callable[[Path], Any]
LOAD_OPS: dict[str, Op] = {
    "load": lambda p: sp.load(p),
    "load(mmap=True)": lambda p: sp.load(p, mmap=True),
    "verify": lambda p: sp.verify(p),
    "verify(direct=True)": lambda p: sp.verify(p, direct=True),
}
MANIFEST_OPS: dict[str, Op] = {**LOAD_OPS, "inspect": lambda p: sp.inspect(p)}


def outcome(op: Op, path: Path, what: str) -> BaseException | str:
    """The CheckpointError ``op`` raised, or a string describing how it misbehaved."""
    try:
        with deadline(OP_DEADLINE_S, what):
            op(path)
    except sp.CheckpointError as exc:
        return exc
    except Hang as exc:
        return f"hang: {exc}"
    except Exception as exc:
        return f"raised {type(exc).__module__}.{type(exc).__qualname__}: {exc}"
    return "returned without an error"


@contextlib.contextmanager
def damaged(file: Path, data: bytes) -> Iterator[None]:
    """Replace ``file``'s bytes with ``data`` for the duration of the block, then restore them."""
    original = file.read_bytes()
    file.write_bytes(data)
    try:
        yield
    finally:
        file.write_bytes(original)


def check_all_refuse(
    path: Path,
    file: Path,
    data: bytes,
    label: str,
    ops: dict[str, Op],
    failures: list[str],
    *,
    key: str | None = None,
    exact: type[sp.CheckpointError] = sp.CorruptCheckpointError,
) -> None:
    """With ``file`` holding ``data``, every op must raise ``exact`` (a CheckpointError subclass),
    naming tensor ``key`` when given; append a description of each misbehaviour to ``failures``."""
    with damaged(file, data):
        for name, op in ops.items():
            result = outcome(op, path, f"{name} with {label}")
            if isinstance(result, str):
                failures.append(f"{label}: {name} {result}")
            elif not isinstance(result, exact):
                failures.append(
                    f"{label}: {name} raised {type(result).__name__} (a CheckpointError, but "
                    f"{exact.__name__} was expected): {result}"
                )
            elif key is not None and getattr(result, "key", None) != key:
                failures.append(f"{label}: {name} blamed key {result.key!r}, not {key!r}")


def report(failures: list[str], cases: int) -> str:
    shown = "\n".join(failures[:25])
    more = f"\n... and {len(failures) - 25} more" if len(failures) > 25 else ""
    return f"{len(failures)} misbehaviour(s) over {cases} damaged variants:\n{shown}{more}"


def flip(data: bytes, pos: int, bit: int) -> bytes:
    out = bytearray(data)
    out[pos] ^= 1 << bit
    return bytes(out)


def spread(start: int, stop: int, count: int) -> list[int]:
    """About ``count`` positions spread evenly over [start, stop), both ends included."""
    if stop <= start:
        return []
    n = stop - start
    return sorted({start + (i * (n - 1)) // max(count - 1, 1) for i in range(count)})


# ---------------------------------------------------------------------------------------------
# truncation
# ---------------------------------------------------------------------------------------------


def test_truncated_data_files_are_refused(ckpt: Path) -> None:
    failures: list[str] = []
    cases = 0
    for name in data_files(ckpt):
        file = ckpt / name
        original = file.read_bytes()
        for k in range(64):
            cut = len(original) * k // 64
            cases += 1
            check_all_refuse(
                ckpt,
                file,
                original[:cut],
                f"{name} cut to {cut}/{len(original)} B (k={k})",
                LOAD_OPS,
                failures,
            )
    assert not failures, report(failures, cases)
    assert_same(sp.load(ckpt), make_state())  # restored intact


def test_truncated_manifest_is_refused(ckpt: Path) -> None:
    failures: list[str] = []
    file = ckpt / MANIFEST
    original = file.read_bytes()
    for k in range(64):
        cut = len(original) * k // 64
        check_all_refuse(
            ckpt,
            file,
            original[:cut],
            f"manifest cut to {cut}/{len(original)} B (k={k})",
            MANIFEST_OPS,
            failures,
        )
    # The last byte of the trailer too: the newline after the closing brace.
    check_all_refuse(
        ckpt, file, original[:-1], "manifest without its final newline", MANIFEST_OPS, failures
    )
    assert not failures, report(failures, 65)


def test_data_file_grown_missing_or_replaced_is_refused(ckpt: Path) -> None:
    failures: list[str] = []
    name = data_files(ckpt)[0]
    file = ckpt / name
    original = file.read_bytes()
    check_all_refuse(
        ckpt, file, original + b"\0" * 8, f"{name} with 8 bytes appended", LOAD_OPS, failures
    )
    check_all_refuse(ckpt, file, original + original, f"{name} doubled", LOAD_OPS, failures)
    other = (ckpt / data_files(ckpt)[1]).read_bytes()
    check_all_refuse(ckpt, file, other, f"{name} replaced by another data file", LOAD_OPS, failures)
    file.rename(ckpt / "moved-away")
    try:
        for op_name, op in LOAD_OPS.items():
            result = outcome(op, ckpt, f"{op_name} without {name}")
            if not isinstance(result, sp.CorruptCheckpointError):
                failures.append(f"{name} missing: {op_name} -> {result!r}")
    finally:
        (ckpt / "moved-away").rename(file)
    assert not failures, report(failures, 4)


# ---------------------------------------------------------------------------------------------
# bit flips
# ---------------------------------------------------------------------------------------------


def test_bit_flips_in_tensor_data_are_refused_naming_the_tensor(ckpt: Path) -> None:
    doc = read_doc(ckpt)
    failures: list[str] = []
    cases = 0
    for name in data_files(ckpt):
        file = ckpt / name
        original = file.read_bytes()
        header_size = doc["files"][name]["header_size"]
        owners = [
            (t["offsets"][0], t["offsets"][1], ref)
            for ref, t in doc["tensors"].items()
            if t["file"] == name and t["offsets"][1] > t["offsets"][0]
        ]
        positions = spread(header_size, len(original), 200)
        assert positions, f"{name} holds no tensor data"
        for i, pos in enumerate(positions):
            owner = [ref for start, end, ref in owners if start <= pos < end]
            assert len(owner) == 1, (
                f"byte {pos} of {name} belongs to {owner}: data must tile the file"
            )
            cases += 1
            check_all_refuse(
                ckpt,
                file,
                flip(original, pos, i % 8),
                f"{name} byte {pos} bit {i % 8}",
                LOAD_OPS,
                failures,
                key=owner[0],
            )
    assert not failures, report(failures, cases)


def test_bit_flips_in_safetensors_headers_are_refused(ckpt: Path) -> None:
    doc = read_doc(ckpt)
    failures: list[str] = []
    cases = 0
    for name in data_files(ckpt):
        file = ckpt / name
        original = file.read_bytes()
        header_size = doc["files"][name]["header_size"]
        # Every bit of the 8-byte little-endian length prefix...
        for bit in range(64):
            cases += 1
            check_all_refuse(
                ckpt,
                file,
                flip(original, bit // 8, bit % 8),
                f"{name} length prefix bit {bit}",
                LOAD_OPS,
                failures,
            )
        # ...and a spread of bits over the JSON header and its padding.
        for i, pos in enumerate(spread(8, header_size, 64)):
            cases += 1
            check_all_refuse(
                ckpt,
                file,
                flip(original, pos, (i * 3) % 8),
                f"{name} header byte {pos} bit {(i * 3) % 8}",
                LOAD_OPS,
                failures,
            )
    assert not failures, report(failures, cases)


def test_bit_flips_in_the_manifest_are_refused(ckpt: Path) -> None:
    file = ckpt / MANIFEST
    original = file.read_bytes()
    failures: list[str] = []
    positions = spread(0, len(original), 200)
    # The trailer (checksum digits, key, closing brace and newline) gets every byte.
    positions = sorted(set(positions) | set(range(len(original) - 40, len(original))))
    for i, pos in enumerate(positions):
        check_all_refuse(
            ckpt,
            file,
            flip(original, pos, (i * 5) % 8),
            f"manifest byte {pos} bit {(i * 5) % 8}",
            MANIFEST_OPS,
            failures,
        )
    assert not failures, report(failures, len(positions))


# ---------------------------------------------------------------------------------------------
# allocations stay bounded by what is on disk, never by a damaged length field
# ---------------------------------------------------------------------------------------------

PEAK_LIMIT = 4 << 20  # the whole test checkpoint is ~25 KB; hostile claims below are >= 95 MB


def traced_peak(op: Op, path: Path) -> tuple[int, BaseException | str]:
    tracemalloc.start()
    try:
        result = outcome(op, path, "traced load")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak, result


@pytest.mark.parametrize(
    "claimed",
    [
        stf.MAX_HEADER_BYTES - 8,
        stf.MAX_HEADER_BYTES,
        stf.MAX_HEADER_BYTES + 8,
        1 << 40,
        (1 << 64) - 8,
    ],
    ids=["just-under-cap", "cap", "over-cap", "1TiB", "u64-max"],
)
def test_hostile_length_prefix_allocates_nothing_big(ckpt: Path, claimed: int) -> None:
    name = max(data_files(ckpt), key=lambda n: (ckpt / n).stat().st_size)
    file = ckpt / name
    original = file.read_bytes()
    with damaged(file, struct.pack("<Q", claimed) + original[8:]):
        for op_name, op in LOAD_OPS.items():
            peak, result = traced_peak(op, ckpt)
            assert isinstance(result, sp.CorruptCheckpointError), f"{op_name}: {result!r}"
            assert peak < PEAK_LIMIT, (
                f"{op_name}: peak allocation {peak} B for a {len(original)}-B file"
            )


def test_truncated_file_allocates_nothing_like_its_recorded_size(ckpt: Path) -> None:
    # The manifest promises the full size; what is read must follow what is on disk.
    name = max(data_files(ckpt), key=lambda n: (ckpt / n).stat().st_size)
    file = ckpt / name
    original = file.read_bytes()
    with damaged(file, original[: len(original) // 2]):
        for op_name, op in LOAD_OPS.items():
            peak, result = traced_peak(op, ckpt)
            assert isinstance(result, sp.CorruptCheckpointError), f"{op_name}: {result!r}"
            assert peak < PEAK_LIMIT, f"{op_name}: peak allocation {peak} B"


def test_sparse_oversized_manifest_is_refused_without_reading_it(ckpt: Path) -> None:
    file = ckpt / MANIFEST
    original = file.read_bytes()
    try:
        # A sparse file one byte over the 1 GiB cap: no disk used, but reading it would allocate 1 GiB.
        with open(file, "r+b") as f:
            f.truncate(mf.MAX_MANIFEST_BYTES + 1)
        for op_name, op in MANIFEST_OPS.items():
            peak, result = traced_peak(op, ckpt)
            assert isinstance(result, sp.CorruptCheckpointError), f"{op_name}: {result!r}"
            assert peak < PEAK_LIMIT, f"{op_name}: peak allocation {peak} B"
    finally:
        file.write_bytes(original)
    assert_same(sp.load(ckpt), make_state())


def _forge_bool_byte(path: Path, value: int) -> None:
    """Put ``value`` in the first byte of tensor ``mask`` and fix every checksum to match."""
    from savepoint.codecs import checksum

    from ._util import forge, write_manifest

    doc = read_doc(path)
    rec = doc["tensors"]["mask"]
    file = path / rec["file"]
    data = bytearray(file.read_bytes())
    start, end = rec["offsets"]  # from the start of the file
    data[start] = value
    file.write_bytes(bytes(data))
    rec["xxh3"] = checksum.digest(bytes(data[start:end]))
    write_manifest(path, forge(doc))


@pytest.mark.parametrize("value", [2, 0x80, 0xFF])
def test_bool_tensor_with_a_byte_other_than_0_or_1_is_refused(tmp_path: Path, value: int) -> None:
    """A crafted data file whose BOOL tensor holds another byte, with matching checksums, is
    refused naming the tensor (it used to load, and then differ from its own round trip)."""
    path = tmp_path / "ckpt"
    mask = np.array([True, False, True] * 1000)
    sp.save(path, {"mask": mask, "w": np.arange(4.0)})
    _forge_bool_byte(path, 1)  # the same checksum machinery with a legal byte still loads
    np.testing.assert_array_equal(sp.load(path)["mask"], mask)
    _forge_bool_byte(path, value)
    with pytest.raises(sp.CorruptCheckpointError, match="'mask' is BOOL"):
        sp.load(path)
    with pytest.raises(sp.CorruptCheckpointError, match="'mask' is BOOL"):
        sp.verify(path, direct=True)
    target = {"mask": np.zeros_like(mask), "w": np.zeros(4)}
    with pytest.raises(sp.CorruptCheckpointError, match="'mask' is BOOL"):
        sp.load(path, into=target)


def test_sharded_bool_tensor_with_a_byte_other_than_0_or_1_is_refused(tmp_path: Path) -> None:
    """The same for a BOOL tensor split over shards, checked or not (verify=False)."""
    from savepoint.codecs import checksum
    from savepoint.distributed import Shard, manifests, plan
    from savepoint.distributed import save as dsave
    from savepoint.state import tree

    from ._util import forge, write_manifest

    mask = np.arange(40).reshape(4, 10) % 3 == 0
    path = tmp_path / "sharded"
    # What two ranks write (as tests/distributed/test_local.py::save_ranks does, in-process).
    states = [{"mask": Shard(mask[2 * r : 2 * r + 2].copy(), (4, 10), (2 * r, 0))} for r in (0, 1)]
    described = [dsave.describe(tree.flatten(st), str(path)) for st in states]
    merged = plan.merge([d[0] for d in described])
    staging = tmp_path / ".staging"
    staging.mkdir()
    results = [
        dsave.write_pieces(
            str(path), str(staging), r, merged.writes[r], d[1], max_file_bytes=1 << 30, writers=1
        )
        for r, d in enumerate(described)
    ]
    (staging / MANIFEST).write_bytes(mf.dumps(manifests.manifest(merged, results, {}, 2)))
    staging.rename(path)
    doc = read_doc(path)
    shard = doc["tensors"]["mask"]["shards"][1]
    file = path / shard["file"]
    data = bytearray(file.read_bytes())
    start, end = shard["offsets"]
    data[end - 1] = 7
    file.write_bytes(bytes(data))
    shard["xxh3"] = checksum.digest(bytes(data[start:end]))
    write_manifest(path, forge(doc))
    for verify in (True, False):
        with pytest.raises(sp.CorruptCheckpointError, match="'mask' is BOOL"):
            sp.load(path, verify=verify)
