"""States of many small tensors take the small-tensor paths of the write pipeline and the read
engine (copied and hashed many to a task, made straight from their bytes); every guarantee of
the general path holds there too."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import savepoint as sp
from savepoint.codecs import checksum, dtypes
from savepoint.codecs import manifest as mf
from savepoint.engine import load as load_engine
from savepoint.engine import pipeline
from savepoint.engine.read import SMALL, Reader

torch = pytest.importorskip("torch")

TORCH_DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]


def mixed_state() -> dict[str, Any]:
    """Small tensors of every dtype and several shapes (0-d, empty, odd sizes), numpy arrays, a
    non-contiguous view, a tensor just over the small limit, and tied leaves."""
    g = torch.Generator().manual_seed(0)
    state: dict[str, Any] = {}
    for i, dt in enumerate(TORCH_DTYPES):
        for shape in [(), (0,), (3,), (2, 5), (7, 1, 3)]:
            base = (
                torch.randint(0, 2, shape, generator=g)
                if dt == torch.bool
                else torch.randn(shape, generator=g)
            )
            state[f"t{i}/{len(shape)}/{'x'.join(map(str, shape))}"] = base.to(dt)
    state["np"] = {"f": np.arange(5, dtype=np.float32), "s": np.float64(2.5), "e": np.zeros((0, 2))}
    state["view"] = torch.arange(12.0).reshape(3, 4).t()
    state["big"] = torch.randn(SMALL // 4 + 1, generator=g)
    state["tied"] = [state["t8/1/3"], state["t8/1/3"]]
    return state


def assert_same(a: Any, b: Any) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert a.reshape(-1).view(torch.uint8).tolist() == b.reshape(-1).view(torch.uint8).tolist()
    else:
        np.testing.assert_array_equal(a, b)
        assert type(a) is type(b)


def test_many_small_tensors_round_trip(ckpt: Path) -> None:
    state = mixed_state()
    sp.save(ckpt, state)
    back = sp.load(ckpt)
    assert_same(state, back)
    assert back["tied"][0] is back["tied"][1]
    numpy_back = sp.load(ckpt, framework="numpy")
    assert isinstance(numpy_back["t8/1/3"], np.ndarray)
    np.testing.assert_array_equal(numpy_back["t8/1/3"], state["t8/1/3"].numpy())
    # into existing tensors
    target = {
        k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else v) for k, v in state.items()
    }
    target["tied"] = [torch.zeros(3), torch.zeros(3)]
    sp.load(ckpt, into=target)
    assert_same(state, target)
    info = sp.verify(ckpt)
    assert len(info.tensors) == len(sp.inspect(ckpt).tensors)


def test_header_check_takes_the_written_header(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """verify compares a header savepoint wrote with the bytes the manifest implies, whatever
    order mixed dtypes and zero-byte tensors were saved in; nothing falls to the full parse."""
    state = {
        "e32": torch.zeros(0),
        "e64": torch.zeros(0, dtype=torch.float64),
        "a": torch.ones(3),
        "z16": torch.zeros(0, dtype=torch.float16),
        "b": torch.ones(2, dtype=torch.float64),
        "c": torch.ones(5, dtype=torch.int8),
    }
    sp.save(ckpt, state)
    with Reader.open(str(ckpt)) as reader:
        for name, records in load_engine._records_by_file(reader.manifest).items():
            assert load_engine._header_as_written(reader, name, records)

    def no_parse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the full header parse ran")

    monkeypatch.setattr(Reader, "header_entries", no_parse)
    sp.verify(ckpt)


def _rewrite_manifest(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    raw = (path / "manifest.json").read_bytes()
    doc = json.loads(raw)
    edit(doc)
    m = mf.parse(raw)
    m.files = {n: mf.FileRecord(**f) for n, f in doc["files"].items()}
    m.tensors = {
        n: mf.TensorRecord(t["dtype"], tuple(t["shape"]), t["file"], *t["offsets"], t["xxh3"])
        for n, t in doc["tensors"].items()
    }
    (path / "manifest.json").write_bytes(mf.dumps(m))


def test_verify_still_finds_a_header_that_disagrees(ckpt: Path) -> None:
    """A data file whose header names other tensors than the manifest (its hash recorded, so
    only the content check can tell) fails verify, through the full check."""
    sp.save(ckpt, {"a": torch.ones(2), "b": torch.zeros(2)})
    data = ckpt / "data-00000.safetensors"
    raw = bytearray(data.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    head = raw[8 : 8 + n].replace(b'"a"', b'"c"')
    raw[8 : 8 + n] = head
    data.write_bytes(bytes(raw))

    def edit(doc: dict[str, Any]) -> None:
        doc["files"]["data-00000.safetensors"]["header_xxh3"] = checksum.digest(bytes(raw[: 8 + n]))

    _rewrite_manifest(ckpt, edit)
    with pytest.raises(sp.CorruptCheckpointError, match="does not hold what the manifest records"):
        sp.verify(ckpt)


@pytest.mark.parametrize("how", ["load", "numpy", "into", "verify"])
def test_a_flipped_byte_in_a_small_tensor_is_found(ckpt: Path, flip_byte: Any, how: str) -> None:
    state = {f"w{i}": torch.full((4,), float(i)) for i in range(50)}
    sp.save(ckpt, state)
    flip_byte(ckpt, "w17", 3)
    calls: dict[str, Callable[[], Any]] = {
        "load": lambda: sp.load(ckpt),
        "numpy": lambda: sp.load(ckpt, framework="numpy"),
        "into": lambda: sp.load(ckpt, into={k: torch.zeros(4) for k in state}),
        "verify": lambda: sp.verify(ckpt),
    }
    with pytest.raises(sp.CorruptCheckpointError, match="w17"):
        calls[how]()


def test_a_bool_byte_other_than_0_or_1_is_refused_on_the_small_path(ckpt: Path) -> None:
    sp.save(ckpt, {"m": torch.tensor([True, False, True])})
    raw = json.loads((ckpt / "manifest.json").read_bytes())
    start, _ = raw["tensors"]["m"]["offsets"]
    data = ckpt / raw["tensors"]["m"]["file"]
    with open(data, "r+b") as f:
        f.seek(start)
        f.write(b"\x02")
    for call in (
        lambda: sp.load(ckpt, verify=False),
        lambda: sp.load(ckpt, into={"m": torch.zeros(3, dtype=torch.bool)}, verify=False),
    ):
        with pytest.raises(sp.CorruptCheckpointError, match="BOOL"):
            call()


def test_small_tensors_are_copied_from_their_address(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CPU contiguous tensors take the pointer copy; others (a transposed view) their
    copy_to; both land byte for byte."""
    copies: list[int] = []
    real = pipeline._memmove

    def counting(dst: int, src: int, n: int) -> Any:
        copies.append(n)
        return real(dst, src, n)

    monkeypatch.setattr(pipeline, "_memmove", counting)
    state = {"a": torch.arange(6.0), "t": torch.arange(6.0).reshape(2, 3).t()}
    sp.save(ckpt, state)
    assert copies == [24]
    assert_same(state, sp.load(ckpt))


def test_small_loads_need_no_view_of_new_tensors(ckpt: Path) -> None:
    """Tensors made straight from their bytes own their memory (not views of the file), and
    are writable and resizable like any new tensor."""
    sp.save(ckpt, {"a": torch.arange(4.0)})
    a = sp.load(ckpt)["a"]
    a.add_(1)
    a.resize_(8)
    assert a[:4].tolist() == [1.0, 2.0, 3.0, 4.0]
    assert dtypes.from_torch(a.dtype, "a").name == "F32"
    assert os.path.exists(ckpt / "manifest.json")
