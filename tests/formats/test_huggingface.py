"""Hugging Face model directories without transformers: the sharded export (layout, atomicity,
what it may replace, verified reads, memory) and the directory as a source (load, inspect,
verify, convert, diff; hostile indexes). tests/integrations/test_hf_sharded.py has transformers
read and write them."""

from __future__ import annotations

import json
import mmap
import os
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner, Result

import savepoint as sp
from savepoint.cli import main
from savepoint.engine import pipeline
from savepoint.formats import _files, _kernel_copy, detect, huggingface
from savepoint.formats.export import export

safetensors_np = pytest.importorskip("safetensors.numpy")

INDEX = huggingface.INDEX
MiB = 1 << 20


def invoke(*args: str) -> Result:
    return CliRunner().invoke(main, list(args))


def state(seed: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    model = {
        "embed.weight": rng.standard_normal((64, 16)).astype(np.float32),  # 4096 bytes
        "layers.0.weight": rng.standard_normal((16, 16)).astype(np.float32),  # 1024
        "layers.0.bias": rng.standard_normal(16).astype(np.float64),  # 128
        "layers.1.weight": rng.standard_normal((16, 16)).astype(np.float16),  # 512
        "norm.scale": np.arange(16, dtype=np.int64),  # 128
        "head.weight": rng.standard_normal((64, 16)).astype(np.float32),  # 4096
    }
    return {"model": model, "optimizer": {"m": np.zeros(3)}, "step": 7}


def shards(directory: Path) -> list[str]:
    return sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    sp.save(tmp_path / "ckpt", state(), metadata={"note": "hi"})
    return tmp_path / "ckpt"


# -- the layout -----------------------------------------------------------------------------------


def test_sizes_read_as_save_pretrained_takes_them() -> None:
    assert huggingface.parse_size("5GB") == 5 * 10**9
    assert huggingface.parse_size(" 500mb ") == 500 * 10**6
    assert huggingface.parse_size("1.5GB") == 1_500_000_000
    assert huggingface.parse_size("2GiB") == 2 << 30
    assert huggingface.parse_size("4096") == huggingface.parse_size(4096) == 4096
    assert huggingface.parse_size("10KB") == huggingface.parse_size("10 kb") == 10_000
    for bad in ("", "GB", "5XB", "-1KB", "0", 0, -3, True, 1.5, "nanGB", "infGB"):
        with pytest.raises(ValueError):
            huggingface.parse_size(bad)  # type: ignore[arg-type]


def test_plan_shards_in_order_a_big_tensor_alone() -> None:
    assert huggingface.plan_shards([3, 3, 3], 6) == [[0, 1], [2]]
    assert huggingface.plan_shards([1, 10, 1, 1], 5) == [[1], [0, 2, 3]]  # made when met
    assert huggingface.plan_shards([5, 5], 5) == [[0], [1]]
    assert huggingface.plan_shards([], 5) == []
    assert huggingface.shard_names(1) == ["model.safetensors"]
    assert huggingface.shard_names(2) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]


def test_export_writes_shards_an_index_and_the_same_metadata_in_each(
    ckpt: Path, tmp_path: Path
) -> None:
    out = tmp_path / "hf"
    report = export(ckpt, out, hf=True, max_shard_size=5000)
    names = shards(out)
    assert names == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert report.files == (*names, INDEX)
    assert report.max_shard_size == 5000 and report.config == ""
    model = state()["model"]
    index = json.loads((out / INDEX).read_text())
    total = sum(v.nbytes for v in model.values())
    assert index["metadata"] == {
        "total_parameters": sum(v.size for v in model.values()),
        "total_size": total,
    }
    # In order: embed alone (4096; the next would pass 5000), then the four small ones, then
    # head.
    assert index["weight_map"] == {
        "embed.weight": names[0],
        "head.weight": names[2],
        "layers.0.bias": names[1],
        "layers.0.weight": names[1],
        "layers.1.weight": names[1],
        "norm.scale": names[1],
    }
    assert list(index["weight_map"]) == sorted(index["weight_map"])  # sort_keys, as HF writes
    assert (out / INDEX).read_text().endswith("}\n")
    for name in names:
        loaded = safetensors_np.load_file(str(out / name))
        for key, value in loaded.items():
            assert index["weight_map"][key] == name and np.array_equal(value, model[key])
        with open(out / name, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        assert header["__metadata__"] == {"format": "pt", "note": "hi"}
    assert report.bytes == total and report.tensors == 6


def test_everything_in_one_shard_is_model_safetensors_alone(ckpt: Path, tmp_path: Path) -> None:
    report = export(ckpt, tmp_path / "hf", hf=True)  # 5GB by default
    assert report.files == ("model.safetensors",)
    assert os.listdir(tmp_path / "hf") == ["model.safetensors"]
    assert report.max_shard_size == 5 * 10**9


def test_config_passes_through(ckpt: Path, tmp_path: Path) -> None:
    text = b'{\n  "model_type": "llama",\n  "hidden_size": 16\n}\n'
    (tmp_path / "config.json").write_bytes(text)
    report = export(ckpt, tmp_path / "a", hf=True, config=tmp_path / "config.json")
    assert (tmp_path / "a" / "config.json").read_bytes() == text
    assert report.config == str(tmp_path / "config.json") and report.files[-1] == "config.json"
    export(ckpt, tmp_path / "b", hf=True, config={"model_type": "gpt2", "n_embd": 16})
    assert json.loads((tmp_path / "b" / "config.json").read_text()) == {
        "model_type": "gpt2",
        "n_embd": 16,
    }
    # A SavepointTrainer checkpoint records its model's config: it is written by default.
    sp.save(tmp_path / "t", state(), metadata={"transformers": {"config": {"model_type": "x"}}})
    made = export(tmp_path / "t", tmp_path / "c", hf=True)
    assert made.config == "metadata['transformers']['config']"
    assert json.loads((tmp_path / "c" / "config.json").read_text()) == {"model_type": "x"}
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(sp.IncompatibleCheckpointError, match="not a JSON object"):
        export(ckpt, tmp_path / "d", hf=True, config=tmp_path / "bad.json")
    (tmp_path / "bad.json").write_text("{nope")
    with pytest.raises(sp.CorruptCheckpointError, match="not valid JSON"):
        export(ckpt, tmp_path / "d", hf=True, config=tmp_path / "bad.json")
    with pytest.raises(sp.CheckpointNotFoundError):
        export(ckpt, tmp_path / "d", hf=True, config=tmp_path / "missing.json")
    with pytest.raises(ValueError, match="go with hf=True"):
        export(ckpt, tmp_path / "d.safetensors", config={"a": 1})
    with pytest.raises(ValueError, match="go with hf=True"):
        export(ckpt, tmp_path / "d.safetensors", max_shard_size="1GB")
    assert not (tmp_path / "d").exists() and not (tmp_path / "d.safetensors").exists()


def test_progress_counts_every_byte(ckpt: Path, tmp_path: Path) -> None:
    calls: list[tuple[int, int]] = []
    export(
        ckpt,
        tmp_path / "hf",
        hf=True,
        max_shard_size=5000,
        progress=lambda d, t: calls.append((d, t)),
    )
    total = sum(v.nbytes for v in state()["model"].values())
    assert calls[-1] == (total, total)


# -- atomic, and what it may replace ----------------------------------------------------------------


def test_a_failure_leaves_no_half_export_and_the_old_one_intact(
    ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "hf"
    export(ckpt, out, hf=True)
    before = {name: (out / name).read_bytes() for name in os.listdir(out)}
    original = _files.write_safetensors
    calls = []

    def failing(*args: Any, **kwargs: Any) -> None:
        calls.append(args[0])
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        original(*args, **kwargs)

    monkeypatch.setattr(_files, "write_safetensors", failing)
    with pytest.raises(sp.CheckpointWriteError):
        export(ckpt, out, hf=True, max_shard_size=5000, overwrite=True)
    assert {name: (out / name).read_bytes() for name in os.listdir(out)} == before
    calls.clear()
    with pytest.raises(sp.CheckpointWriteError):
        export(ckpt, tmp_path / "new", hf=True, max_shard_size=5000)
    assert not (tmp_path / "new").exists()
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "hf"]  # no staging directory left


def test_what_an_export_may_replace(ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    export(ckpt, out, hf=True, max_shard_size=5000)
    with pytest.raises(sp.CheckpointWriteError, match="--overwrite"):
        export(ckpt, out, hf=True)
    export(ckpt, out, hf=True, overwrite=True)  # a Hugging Face directory: replaced whole
    assert os.listdir(out) == ["model.safetensors"]
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(sp.CheckpointWriteError, match="refusing to replace"):
        export(ckpt, tmp_path / "mine", hf=True, overwrite=True)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"
    (tmp_path / "empty").mkdir()
    export(ckpt, tmp_path / "empty", hf=True, overwrite=True)
    (tmp_path / "file").write_text("x")
    with pytest.raises(sp.CheckpointWriteError, match="is a file"):
        export(ckpt, tmp_path / "file", hf=True, overwrite=True)
    for inside in (ckpt, ckpt / "hf", tmp_path):  # the source, inside it, holding it
        with pytest.raises(sp.CheckpointWriteError, match="source"):
            export(ckpt, inside, hf=True, overwrite=True)
    assert sp.load(ckpt)["step"] == 7


def test_reads_are_verified_against_the_checkpoints_checksums(
    ckpt: Path, tmp_path: Path, flip_byte: Callable[..., None]
) -> None:
    flip_byte(ckpt, "model/head.weight", 100)
    with pytest.raises(sp.CorruptCheckpointError, match=r"head\.weight"):
        export(ckpt, tmp_path / "hf", hf=True, max_shard_size=5000)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


class _Tracked(mmap.mmap):
    """Anonymous mappings (the staging buffers) counted while alive."""

    live = 0
    peak = 0

    def __new__(cls, fileno: int, length: int, *args: Any, **kwargs: Any) -> _Tracked:
        obj = super().__new__(cls, fileno, length, *args, **kwargs)
        obj.length = length
        cls.live += length
        cls.peak = max(cls.peak, cls.live)
        return obj

    def __del__(self) -> None:
        type(self).live -= self.length


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel-copy", "staging-pipeline"])
def test_peak_extra_memory_is_at_most_twice_the_largest_tensor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kernel: bool
) -> None:
    """Python and numpy allocations (tracemalloc) plus the staging buffers (anonymous mappings,
    counted while alive) during an export of 10 MiB whose largest tensor is 4 MiB; the source is
    mapped from the page cache and not counted (it is no extra memory). A local checkpoint's
    tensors lie raw in its files, so the kernel copies them (no staging buffer at all); the
    staging pipeline (what a source not stored raw takes) is forced by refusing the kernel
    path."""
    rng = np.random.default_rng(0)
    model = {f"layer{i}": rng.standard_normal(MiB // 4).astype(np.float32) for i in range(6)}
    model["embed"] = rng.standard_normal(MiB).astype(np.float32)  # 4 MiB, the largest
    sp.save(tmp_path / "big", {"model": model})

    class Shim:  # pipeline's `mmap` module, with the tracked mapping
        mmap = _Tracked

    monkeypatch.setattr(pipeline, "mmap", Shim)
    copied: list[int] = []
    real_copy = os.copy_file_range

    def spy(src: int, dst: int, count: int, *args: Any) -> int:
        copied.append(real_copy(src, dst, count, *args))
        return copied[-1]

    monkeypatch.setattr(os, "copy_file_range", spy)
    if not kernel:
        monkeypatch.setattr(_kernel_copy, "write", lambda *a, **k: False)
    else:  # the save wrote O_DIRECT: the kernel copies a source only once it is cached
        monkeypatch.setattr(_kernel_copy, "cached", lambda ranges: True)
    _Tracked.live = _Tracked.peak = 0
    tracemalloc.start()
    try:
        report = export(tmp_path / "big", tmp_path / "hf", hf=True, max_shard_size="3MB")
        _, heap = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(report.files) == 5  # 4 shards and the index
    largest = 4 * MiB
    if kernel:
        assert sum(copied) == 10 * MiB and _Tracked.peak == 0
    else:
        assert not copied
        assert _Tracked.peak > 0, "the staging buffers were not seen"
    assert heap + _Tracked.peak <= 2 * largest, (heap, _Tracked.peak)
    assert _Tracked.live == 0  # none outlives the export
    loaded = sp.load(tmp_path / "hf")
    assert all(np.array_equal(loaded[k], v) for k, v in model.items())


# -- the directory as a source ----------------------------------------------------------------------


@pytest.fixture
def repo(ckpt: Path, tmp_path: Path) -> Path:
    export(ckpt, tmp_path / "hf", hf=True, max_shard_size=5000)
    return tmp_path / "hf"


def test_a_directory_is_detected_and_read_by_every_reader(repo: Path, tmp_path: Path) -> None:
    model = state()["model"]
    assert detect.detect(repo) == "huggingface" == detect.detect(repo / INDEX)
    loaded = sp.load(repo)
    assert list(loaded) == [  # shard by shard, each in the order of its bytes
        "embed.weight",
        "layers.0.bias",
        "norm.scale",
        "layers.0.weight",
        "layers.1.weight",
        "head.weight",
    ]
    assert all(
        np.array_equal(loaded[k], v) and loaded[k].dtype == v.dtype for k, v in model.items()
    )
    assert sp.load(repo / INDEX).keys() == loaded.keys()
    assert sp.load(repo, keys="norm.scale") == {"norm.scale": pytest.approx(model["norm.scale"])}
    into = {k: np.zeros_like(v) for k, v in model.items()}
    sp.load(repo, into=into)
    assert all(np.array_equal(into[k], v) for k, v in model.items())
    info = sp.inspect(repo)
    assert (info.format, info.path, info.metadata) == (
        "huggingface",
        str(repo),
        {"format": "pt", "note": "hi"},
    )
    assert {t.key: t.file for t in info.tensors}[
        "head.weight"
    ] == "model-00003-of-00003.safetensors"
    assert sp.verify(repo).total_bytes == sum(v.nbytes for v in model.values())
    report = sp.convert(repo, tmp_path / "native")
    assert report.source_kind == "huggingface" and report.tensors == 6
    again = sp.load(tmp_path / "native")
    assert again.keys() == loaded.keys()
    assert sp.diff(repo, tmp_path / "native").identical
    assert sp.diff(tmp_path / "native", repo).identical


def test_a_directory_reshards_into_another(repo: Path, tmp_path: Path) -> None:
    """A Hugging Face directory is a source for the export too: the same names, other shards."""
    report = export(repo, tmp_path / "one", hf=True)
    assert report.subtree == "" and report.files == ("model.safetensors",)
    assert report.metadata == {"format": "pt", "note": "hi"}  # the first shard's, carried over
    assert sp.diff(repo, tmp_path / "one").identical
    export(tmp_path / "one", tmp_path / "many", hf=True, max_shard_size=1500)
    assert len(shards(tmp_path / "many")) == 4  # embed and head alone, then two
    assert sp.diff(repo, tmp_path / "many").identical


def test_the_commands_read_a_directory(repo: Path, tmp_path: Path) -> None:
    result = invoke("inspect", str(repo))
    assert result.exit_code == 0 and "huggingface" in result.stdout, result.output
    result = invoke("verify", str(repo), "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["format"] == "huggingface" and set(doc["files"]) == {*shards(repo), INDEX}
    assert invoke("convert", str(repo), str(tmp_path / "one.safetensors")).exit_code == 0
    result = invoke("diff", str(repo), str(tmp_path / "one.safetensors"), "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert (doc["a_format"], doc["b_format"], doc["by_checksum"]) == (
        "huggingface",
        "safetensors",
        0,
    )
    other = state(seed=1)
    sp.save(tmp_path / "other", other["model"])
    result = invoke("diff", str(repo), str(tmp_path / "other"))
    assert result.exit_code == 1 and "head.weight" in result.stdout


def test_the_export_command(ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    result = invoke("export", str(ckpt), str(out), "--hf", "--max-shard-size", "5KB")
    assert result.exit_code == 0, result.output
    assert "in 4 file(s)" in result.stdout and INDEX in result.stdout
    for argv, hint in (
        (["--max-shard-size", "5KB"], "--max-shard-size"),
        (["--config", str(tmp_path / "c.json")], "--config"),
        (["--hf", "--max-shard-size", "lots"], "--max-shard-size"),
    ):
        result = invoke("export", str(ckpt), str(tmp_path / "x"), *argv)
        assert result.exit_code == 2 and hint in result.output, (argv, result.output)
    result = invoke("export", str(ckpt), str(out))  # a directory without --hf
    assert result.exit_code == 2 and "--hf" in result.output
    result = invoke("export", str(ckpt), str(out), "--hf")
    assert result.exit_code == 1 and "--overwrite" in result.stderr


def test_symlinked_files_as_in_the_hugging_face_cache(repo: Path, tmp_path: Path) -> None:
    blobs = tmp_path / "blobs"
    snapshot = tmp_path / "snapshots" / "abc"
    blobs.mkdir()
    snapshot.mkdir(parents=True)
    for i, name in enumerate(os.listdir(repo)):
        (repo / name).rename(blobs / str(i))
        (snapshot / name).symlink_to(blobs / str(i))
    assert sp.load(snapshot).keys() == state()["model"].keys()
    assert sp.verify(snapshot).format == "huggingface"


def _index(repo: Path) -> dict[str, Any]:
    return json.loads((repo / INDEX).read_text())


def _write_index(repo: Path, doc: Any) -> None:
    (repo / INDEX).write_text(json.dumps(doc))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda d: d["weight_map"].update({"head.weight": "../ckpt/data-00000.safetensors"}),
            "not a file name",
        ),
        (lambda d: d["weight_map"].update({"head.weight": "/etc/passwd"}), "not a file name"),
        (lambda d: d["weight_map"].update({"head.weight": 3}), "not a file name"),
        (
            lambda d: d["weight_map"].update({"head.weight": "model-00009-of-00009.safetensors"}),
            "not in",
        ),
        (lambda d: d["weight_map"].pop("norm.scale"), "the index does not list it"),
        (
            lambda d: d["weight_map"].update({"gone": "model-00001-of-00003.safetensors"}),
            "which does not hold it",
        ),
        (
            lambda d: d["weight_map"].update({"layers.0.bias": "model-00003-of-00003.safetensors"}),
            "puts it in",
        ),
        (lambda d: d.pop("weight_map"), "no weight_map"),
        (lambda d: d["metadata"].update({"total_size": -1}), "total_size"),
        (lambda d: d["metadata"].update({"total_size": "12"}), "total_size"),
        (lambda d: d.update({"metadata": [1]}), "metadata is not"),
    ],
)
def test_an_index_that_disagrees_with_its_shards_is_refused(
    repo: Path, change: Callable[[dict[str, Any]], Any], message: str
) -> None:
    doc = _index(repo)
    change(doc)
    _write_index(repo, doc)
    for call in (sp.load, sp.inspect, sp.verify, detect.inspect_any):
        with pytest.raises(sp.CorruptCheckpointError, match=message):
            call(repo)


def test_total_size_is_checked_by_verify(repo: Path) -> None:
    doc = _index(repo)
    doc["metadata"]["total_size"] += 1
    _write_index(repo, doc)
    assert sp.load(repo).keys() == state()["model"].keys()  # informational elsewhere
    with pytest.raises(sp.CorruptCheckpointError, match="total_size"):
        sp.verify(repo)
    assert invoke("verify", str(repo)).exit_code == 1


def test_damaged_files_are_refused(repo: Path) -> None:
    (repo / INDEX).write_bytes(b"{" * 5000)
    with pytest.raises(sp.CorruptCheckpointError, match="not valid JSON"):
        sp.load(repo)
    _write_index(repo, [1])
    with pytest.raises(sp.CorruptCheckpointError, match="not a JSON object"):
        sp.inspect(repo)
    export_dir = repo
    (export_dir / INDEX).unlink()
    # Without an index the shards alone are no model directory savepoint reads.
    with pytest.raises(sp.IncompleteCheckpointError):
        sp.load(export_dir)


def test_a_fifo_in_place_of_the_index_is_refused_without_blocking(repo: Path) -> None:
    (repo / INDEX).unlink()
    os.mkfifo(repo / INDEX)
    with pytest.raises(sp.CheckpointError):
        sp.load(repo / INDEX)
    with pytest.raises(sp.CheckpointError):
        sp.load(repo)


def test_a_single_file_directory_is_read_as_transformers_reads_it(
    repo: Path, tmp_path: Path
) -> None:
    """model.safetensors first, as from_pretrained does, even beside an index."""
    single = {"w": np.ones(3, np.float32)}
    safetensors_np.save_file(single, str(repo / "model.safetensors"), metadata={"format": "pt"})
    assert list(sp.load(repo)) == ["w"]
    assert list(sp.load(repo / INDEX)) != ["w"]  # the index itself still names its shards
