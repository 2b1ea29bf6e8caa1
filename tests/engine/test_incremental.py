"""Incremental saves (issue 17): ``sp.save(..., blobs=...)`` keeps large tensors in a
content-addressed blob store (a version 4 checkpoint), and ``sp.load``/``verify``/``inspect``
read them back through it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import savepoint as sp
from savepoint.blobs import BlobPolicy, BlobStore, Compression
from savepoint.codecs import manifest as mf

SMALL_CHUNKS = BlobPolicy(chunk_size=64 << 10, min_blob_bytes=16 << 10)


def state(seed: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {
        "model": {
            "w": rng.standard_normal((512, 300)).astype(np.float32),  # 600 KiB: 10 chunks
            "b": rng.standard_normal(300).astype(np.float32),  # 1.2 KiB: a data file
            "e": rng.integers(0, 1 << 30, (64, 64), dtype=np.int64),  # 32 KiB: one chunk
            "mask": rng.integers(0, 2, 40000).astype(bool),
        },
        "step": 3,
        "name": "run",
    }


def equal(a: Any, b: Any) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            equal(a[k], b[k])
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape
        assert a.tobytes() == b.tobytes()
    else:
        assert a == b


def blob_bytes(store: BlobStore) -> dict[str, int]:
    return {d: store.info(d).stored for d in store.list()}


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def test_a_numpy_state_round_trips(tmp_path: Path) -> None:
    s = state()
    info = sp.save(tmp_path / "ck", s, blobs=tmp_path / "blobs", blob_policy=SMALL_CHUNKS)
    assert info.format_version == mf.BLOBS
    m = mf.parse((tmp_path / "ck" / mf.NAME).read_bytes())
    assert m.blob_store == "../blobs" and m.blob_digest == "blake3"
    in_blobs = {k for k, t in m.tensors.items() if t.recipe is not None}
    assert in_blobs == {"model/w", "model/e", "model/mask"}
    assert len(m.tensors["model/w"].recipe.digests) == 10
    equal(sp.load(tmp_path / "ck"), s)
    equal(sp.load(tmp_path / "ck", mmap=True), s)
    part = sp.load(tmp_path / "ck", keys=["model/w", "model/b"])
    equal(part["model"]["w"], s["model"]["w"])
    into = {"model": {k: np.zeros_like(v) for k, v in s["model"].items()}}
    sp.load(tmp_path / "ck", into=into, keys="model")
    equal(into["model"], s["model"])
    assert sp.verify(tmp_path / "ck").format_version == 4
    seen = {t.key: t for t in sp.inspect(tmp_path / "ck").tensors}
    assert seen["model/w"].nbytes == 512 * 300 * 4 and seen["model/w"].shape == (512, 300)


def test_a_torch_state_round_trips(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 4))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(3, 256)).sum().backward()
    opt.step()
    s = {"model": model.state_dict(), "opt": opt.state_dict(), "half": torch.ones(9000).bfloat16()}
    sp.save(tmp_path / "ck", s, blobs=tmp_path / "blobs", blob_policy=SMALL_CHUNKS)
    out = sp.load(tmp_path / "ck")
    for k, v in s["model"].items():
        assert torch.equal(out["model"][k], v)
    assert out["half"].dtype == torch.bfloat16 and torch.equal(out["half"], s["half"])
    assert torch.equal(out["opt"]["state"][0]["exp_avg"], s["opt"]["state"][0]["exp_avg"])
    fresh = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 4))
    sp.load(tmp_path / "ck", into={"model": fresh}, keys="model")
    for a, b in zip(fresh.state_dict().values(), model.state_dict().values()):
        assert torch.equal(a, b)


def test_compressed_blobs_round_trip(tmp_path: Path) -> None:
    s = {"z": np.zeros(1 << 20, np.float32), "r": np.arange(1 << 18, dtype=np.float32)}
    policy = BlobPolicy(compression=Compression(level=3), min_blob_bytes=1)
    sp.save(tmp_path / "ck", s, blobs=tmp_path / "blobs", blob_policy=policy)
    equal(sp.load(tmp_path / "ck"), s)
    sp.verify(tmp_path / "ck")
    assert dir_bytes(tmp_path / "blobs") < (1 << 20)  # 5 MiB of content, mostly zeros


def test_an_unchanged_tensor_is_not_written_again(tmp_path: Path) -> None:
    store = BlobStore.open(tmp_path / "blobs")
    s = state()
    sp.save(tmp_path / "a", s, blobs=store, blob_policy=SMALL_CHUNKS)
    first = blob_bytes(store)
    mtimes = {p: p.stat().st_mtime_ns for p in (tmp_path / "blobs" / "data").rglob("*")}
    s["step"] = 4
    s["model"]["b"] += 1  # small: in the data file
    sp.save(tmp_path / "b", s, blobs=store, blob_policy=SMALL_CHUNKS)
    assert blob_bytes(store) == first  # no new blob
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "blobs" / "data").rglob("*")} == mtimes
    # one row of w changes: one chunk of ten is written
    s["model"]["w"][3] += 1
    sp.save(tmp_path / "c", s, blobs=str(tmp_path / "blobs"), blob_policy=SMALL_CHUNKS)
    new = set(blob_bytes(store)) - set(first)
    assert len(new) == 1
    equal(sp.load(tmp_path / "c"), s)
    assert sp.load(tmp_path / "a")["model"]["w"][3].tobytes() != s["model"]["w"][3].tobytes()


def _blob_of(tmp_path: Path, ck: str, key: str, i: int = 0) -> Path:
    m = mf.parse((tmp_path / ck / mf.NAME).read_bytes())
    d = m.tensors[key].recipe.digests[i]
    return tmp_path / "blobs" / "data" / d[:2] / d


def test_a_corrupted_blob_is_a_corrupt_checkpoint(tmp_path: Path) -> None:
    s = state()
    sp.save(tmp_path / "ck", s, blobs=tmp_path / "blobs", blob_policy=SMALL_CHUNKS)
    path = _blob_of(tmp_path, "ck", "model/w", 4)
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x10
    path.chmod(0o644)
    path.write_bytes(bytes(data))
    with pytest.raises(sp.CorruptCheckpointError, match="model/w"):
        sp.load(tmp_path / "ck")
    with pytest.raises(sp.CorruptCheckpointError, match="model/w"):
        sp.verify(tmp_path / "ck")
    with pytest.raises(sp.CorruptCheckpointError):
        sp.load(
            tmp_path / "ck", into={"model": {"w": np.zeros((512, 300), np.float32)}}, keys="model/w"
        )
    # the other tensors still load
    equal(sp.load(tmp_path / "ck", keys="model/e")["model"]["e"], s["model"]["e"])


def test_a_missing_blob_is_a_clear_error(tmp_path: Path) -> None:
    sp.save(tmp_path / "ck", state(), blobs=tmp_path / "blobs", blob_policy=SMALL_CHUNKS)
    _blob_of(tmp_path, "ck", "model/e").unlink()
    with pytest.raises(sp.CorruptCheckpointError, match=r"model/e.*missing"):
        sp.load(tmp_path / "ck")
    with pytest.raises(sp.CorruptCheckpointError, match=r"model/e.*missing"):
        sp.verify(tmp_path / "ck")


def test_a_missing_blob_store_is_a_clear_error(tmp_path: Path) -> None:
    sp.save(tmp_path / "ck", state(), blobs=tmp_path / "blobs", blob_policy=SMALL_CHUNKS)
    (tmp_path / "blobs").rename(tmp_path / "elsewhere")
    with pytest.raises(sp.CorruptCheckpointError, match="blob store"):
        sp.load(tmp_path / "ck")


def test_a_blob_store_far_away_or_elsewhere_is_refused(tmp_path: Path) -> None:
    with pytest.raises(sp.UnsupportedStateError, match="at most 2 levels"):
        sp.save(tmp_path / "a" / "b" / "c" / "ck", state(), blobs=tmp_path / "blobs")
    with pytest.raises(sp.UnsupportedStateError, match="same store"):
        sp.save(tmp_path / "ck", state(), blobs="memory://bucket/blobs")
    assert not (tmp_path / "ck").exists()
    with pytest.raises(ValueError, match="without blobs"):
        sp.save(tmp_path / "ck", state(), blob_policy=SMALL_CHUNKS)


def test_a_memory_store_works(tmp_path: Path) -> None:
    s = state()
    sp.save("memory://t-incremental/run/ck", s, blobs="memory://t-incremental/run/blobs")
    equal(sp.load("memory://t-incremental/run/ck"), s)
    sp.verify("memory://t-incremental/run/ck")


def test_copy_brings_the_blobs_along(tmp_path: Path) -> None:
    # More in tests/test_transfer_blobs.py.
    s = state()
    sp.save(tmp_path / "ck", s, blobs=tmp_path / "blobs", blob_policy=SMALL_CHUNKS)
    sp.copy(tmp_path / "ck", tmp_path / "ck2")  # a sibling: the same store, nothing to copy
    equal(sp.load(tmp_path / "ck2"), s)
    sp.copy(tmp_path / "ck", tmp_path / "other" / "ck")  # the blobs go to other/blobs
    assert set(BlobStore.open(tmp_path / "other" / "blobs").list()) == set(
        BlobStore.open(tmp_path / "blobs").list()
    )
    equal(sp.load(tmp_path / "other" / "ck"), s)


def test_export_writes_plain_safetensors(tmp_path: Path) -> None:
    from safetensors.numpy import load_file

    s = state()
    sp.save(tmp_path / "ck", s, blobs=tmp_path / "blobs", blob_policy=SMALL_CHUNKS)
    sp.convert(tmp_path / "ck", tmp_path / "out.safetensors", lossy=True)
    out = load_file(str(tmp_path / "out.safetensors"))
    assert out["model/w"].tobytes() == s["model"]["w"].tobytes()


def test_a_failed_save_leaves_no_checkpoint_and_closes_its_session(tmp_path: Path) -> None:
    class Boom:
        def state_dict(self) -> dict[str, Any]:
            return {"x": np.zeros(1 << 20, np.float32), "bad": object()}

        def load_state_dict(self, _: Any) -> None:
            pass

    with pytest.raises(sp.CheckpointError):
        sp.save(tmp_path / "ck", {"m": Boom()}, blobs=tmp_path / "blobs")
    assert not (tmp_path / "ck").exists()
    assert not list((tmp_path / "blobs" / "sessions").iterdir())


def _lora_state(frozen: np.ndarray[Any, Any], rng: np.random.Generator) -> dict[str, Any]:
    adapter = rng.standard_normal(frozen.size // 20).astype(np.float32)  # 4.8% of the state
    return {"frozen": frozen, "adapter": adapter, "step": int(rng.integers(100))}


def test_a_lora_style_second_save_writes_at_most_5_percent(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    frozen = rng.standard_normal(16 << 20 >> 2).astype(np.float32)  # 16 MiB, 95%
    store = BlobStore.open(tmp_path / "blobs")
    policy = BlobPolicy(chunk_size=1 << 20, min_blob_bytes=64 << 10)
    t0 = time.perf_counter()
    sp.save(tmp_path / "full", _lora_state(frozen, rng), direct=False)
    full_time = time.perf_counter() - t0
    full_bytes = dir_bytes(tmp_path / "full")
    sp.save(tmp_path / "s0", _lora_state(frozen, rng), blobs=store, blob_policy=policy)
    before = sum(blob_bytes(store).values())
    t0 = time.perf_counter()
    s = _lora_state(frozen, rng)
    sp.save(tmp_path / "s1", s, blobs=store, blob_policy=policy, direct=False)
    second = time.perf_counter() - t0
    written = sum(blob_bytes(store).values()) - before + dir_bytes(tmp_path / "s1")
    print(
        f"LoRA-style: full save {full_bytes} B in {full_time:.3f} s; incremental second save "
        f"{written} B ({written / full_bytes:.1%}) in {second:.3f} s ({second / full_time:.2f}x)"
    )
    assert written <= 0.05 * full_bytes
    equal(sp.load(tmp_path / "s1"), s)


def test_non_contiguous_and_segmented_tensors_round_trip(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from savepoint.engine import sinks

    monkeypatch.setattr(sinks, "BLOB_SEGMENT", 128 << 10)  # several segments per tensor
    base = np.arange(600 * 500, dtype=np.float32).reshape(600, 500)
    s: dict[str, Any] = {"t": base.T, "every_other": base[::2], "big_endian": base.astype(">f4")}
    torch = pytest.importorskip("torch")
    s["torch_t"] = torch.arange(300 * 400, dtype=torch.float64).reshape(300, 400).t()
    sp.save(tmp_path / "ck", s, blobs=tmp_path / "blobs", blob_policy=SMALL_CHUNKS)
    out = sp.load(tmp_path / "ck")
    for k in ("t", "every_other"):
        assert out[k].tobytes() == np.ascontiguousarray(s[k]).tobytes()
    assert np.array_equal(out["big_endian"], base)
    assert torch.equal(out["torch_t"], s["torch_t"])
    sp.verify(tmp_path / "ck")
