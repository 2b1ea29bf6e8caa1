"""DCP's own checkpoints in and out of savepoint (issue 30): ``dcp.save`` through DCP's
FileSystemWriter on 2 gloo ranks (DTensors sharded on dim 0 and dim 1, a tensor stored with its
strides, bf16, 0-d, non-tensor values) imported by savepoint in one process, bit-exact, without
unpickling anything but DCP's metadata types; savepoint's DCP export (``convert --format dcp``)
loaded by ``dcp.load`` on 1 and 3 ranks; what the export cannot hold, listed; hostile files.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

import savepoint as sp  # noqa: E402
from distributed import _launch  # noqa: E402
from savepoint.cli import main  # noqa: E402
from savepoint.integrations.dcp import SavepointReader, full_state_dict  # noqa: E402

from ._dcp_interop_worker import full_state  # noqa: E402

WORKER = Path(__file__).with_name("_dcp_interop_worker.py")
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def run(phase: str, world: int, workdir: Path) -> None:
    session = _launch.run(phase, world, workdir, worker=WORKER)
    assert not session.failures(), session.failures()


def flat(state: Any, prefix: str = "") -> dict[str, Any]:
    """``state`` flattened as DCP names it (dicts and lists of tensors walked; tuples whole)."""
    out: dict[str, Any] = {}
    items = state.items() if isinstance(state, dict) else enumerate(state)
    for k, v in items:
        name = f"{prefix}{k}"
        walk = isinstance(v, dict) or (
            isinstance(v, list) and any(isinstance(e, (dict, list, torch.Tensor)) for e in v)
        )
        out.update(flat(v, name + ".") if walk else {name: v})
    return out


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and bool(torch.equal(a, b))
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return bool(a == b)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    workdir = tmp_path_factory.mktemp("dcp-interop")
    run("save", 2, workdir)
    return workdir / "dcp"


def test_dcp_save_on_2_ranks_imports_bit_exact_in_one_process(saved: Path) -> None:
    assert sorted(os.listdir(saved)) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    got = sp.load(saved)
    want = flat(full_state())
    assert set(got) == set(want)
    for name, value in want.items():
        if isinstance(value, torch.Tensor):
            assert same(got[name], value), name
        else:  # a BYTE_IO value: its torch.save bytes, never unpickled by savepoint
            assert isinstance(got[name], np.ndarray) and got[name].dtype == np.uint8
            assert torch.load(io.BytesIO(got[name].tobytes()), weights_only=False) == value
    info = sp.inspect(saved)
    assert info.format == "dcp" and info.metadata["dcp"]["version"] == 1
    assert {t.key: t.shards for t in info.tensors}["model.w"] == 2
    assert sorted(info.metadata["dcp"]["bytes"]) == sorted(
        k for k, v in want.items() if not isinstance(v, torch.Tensor)
    )
    assert any("never unpickles" in n for n in info.notes)
    seen: list[tuple[int, int]] = []
    assert sp.verify(saved, progress=lambda d, t: seen.append((d, t))).format == "dcp"
    assert seen and seen[-1][0] == seen[-1][1]


def test_dcp_safetensors_serialization_on_2_ranks_imports_bit_exact(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """``FileSystemWriter(serialization_format=SAFETENSORS)``: each rank's file holds its
    BYTE_IO items, then one safetensors blob of its chunks (sharded on dim 0 and dim 1)."""
    workdir = tmp_path_factory.mktemp("dcp-st")
    run("save_safetensors", 2, workdir)
    saved = workdir / "dcp-st"
    got = sp.load(saved)
    want = flat(full_state())
    assert set(got) == set(want)
    for name, value in want.items():
        if isinstance(value, torch.Tensor):
            assert same(got[name], value), name
    assert sp.verify(saved).format == "dcp"
    into = {k: torch.zeros_like(v) for k, v in want.items() if isinstance(v, torch.Tensor)}
    sp.load(saved, into=into)
    assert all(same(into[k], want[k]) for k in into)
    # A blob that disagrees with .metadata is refused, naming the tensor.
    data = saved / "__0_0.distcp"
    raw = data.read_bytes()
    at = raw.index(b'"model.w"')
    data.write_bytes(raw[:at] + b'"model.x"' + raw[at + 9 :])
    with pytest.raises(sp.CorruptCheckpointError, match=r"model\.w"):
        sp.load(saved)


def test_dcp_hugging_face_storage_both_ways(tmp_path: Path) -> None:
    """DCP's HuggingFaceStorageWriter writes a Hugging Face directory savepoint reads as one;
    DCP's HuggingFaceStorageReader reads savepoint's sharded export (its padded headers too)."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter

    g = torch.Generator().manual_seed(5)
    w = {"model.w": torch.randn(300, 70, generator=g), "model.b": torch.arange(9.0).bfloat16()}
    dcp.save(
        w, storage_writer=HuggingFaceStorageWriter(path=str(tmp_path / "theirs")), no_dist=True
    )
    got = sp.load(tmp_path / "theirs", framework="torch")
    assert sp.inspect(tmp_path / "theirs").format == "huggingface"
    assert set(got) == set(w) and all(same(got[k], v) for k, v in w.items())
    sp.save(tmp_path / "ck", {"model": {"w": w["model.w"], "b": w["model.b"]}})
    sp.export(tmp_path / "ck", tmp_path / "ours", hf=True, max_shard_size=50_000)
    assert len([f for f in os.listdir(tmp_path / "ours") if f.endswith(".safetensors")]) == 2
    into = {"w": torch.zeros(300, 70), "b": torch.zeros(9, dtype=torch.bfloat16)}
    reader = HuggingFaceStorageReader(str(tmp_path / "ours"))
    dcp.load(into, storage_reader=reader, no_dist=True)
    assert same(into["w"], w["model.w"]) and same(into["b"], w["model.b"])


def test_into_fills_targets_in_place(saved: Path) -> None:
    want = flat(full_state())
    into = {k: torch.zeros_like(v) for k, v in want.items() if isinstance(v, torch.Tensor)}
    target = into["model.c"]
    sp.load(saved, into=into, keys=list(into))
    assert into["model.c"] is target and all(same(into[k], want[k]) for k in into)
    assert not into["model.t"].is_contiguous()  # filled through its strides too


def test_the_cli_reads_it(saved: Path, tmp_path: Path) -> None:
    from click.testing import CliRunner

    for command in (["inspect", str(saved)], ["verify", str(saved)]):
        result = CliRunner().invoke(main, command)
        assert result.exit_code == 0, result.output
    result = CliRunner().invoke(main, ["diff", str(saved), str(saved)])
    assert result.exit_code == 0, result.output
    out = tmp_path / "w.safetensors"
    result = CliRunner().invoke(main, ["export", str(saved), str(out), "--subtree", "model"])
    assert result.exit_code == 0, result.output
    from safetensors.torch import load_file

    assert same(load_file(str(out))["w"], full_state()["model"]["w"])


def test_convert_to_savepoint_keeps_everything_for_dcp_load(saved: Path, tmp_path: Path) -> None:
    report = sp.convert(saved, tmp_path / "sp")
    assert report.source_kind == "dcp" and not report.dropped
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(saved, tmp_path / "own.pt")
    theirs = torch.load(tmp_path / "own.pt", weights_only=False)
    assert same(full_state_dict(tmp_path / "sp"), theirs)  # DCP unpickles its BYTE_IO itself
    back = {"model": {"w": torch.zeros(10, 6)}, "step": 0}
    dcp.load(back, storage_reader=SavepointReader(tmp_path / "sp"))
    assert same(back["model"]["w"], full_state()["model"]["w"]) and back["step"] == 7


def test_dcp_checkpoint_round_trips_through_savepoint(saved: Path, tmp_path: Path) -> None:
    sp.convert(saved, tmp_path / "sp")
    sp.convert(tmp_path / "sp", tmp_path / "again", format="dcp")
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(saved, tmp_path / "a.pt")
    dcp_to_torch_save(tmp_path / "again", tmp_path / "b.pt")
    a, b = (torch.load(tmp_path / n, weights_only=False) for n in ("a.pt", "b.pt"))
    assert same(a, b)


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    workdir = tmp_path_factory.mktemp("dcp-export")
    sp.save(workdir / "ckpt", full_state())
    report = sp.convert(workdir / "ckpt", workdir / "export", format="dcp")
    assert report.destination_format == "dcp" and not report.dropped
    return workdir


@pytest.mark.parametrize("world", [1, 3])
def test_the_export_loads_through_dcp_on_1_and_3_ranks(exported: Path, world: int) -> None:
    run("load", world, exported)


def test_the_export_is_laid_out_as_dcp_save_lays_it_out(exported: Path, tmp_path: Path) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    dcp.save(full_state(), checkpoint_id=tmp_path / "own", no_dist=True)
    ours = FileSystemReader(exported / "export").read_metadata()
    theirs = FileSystemReader(tmp_path / "own").read_metadata()
    assert ours.state_dict_metadata.keys() == theirs.state_dict_metadata.keys()
    for fqn, md in theirs.state_dict_metadata.items():
        mine = ours.state_dict_metadata[fqn]
        assert type(mine) is type(md), fqn
        if hasattr(md, "size"):
            assert (mine.size, mine.properties.dtype) == (md.size, md.properties.dtype), fqn
    assert ours.planner_data == theirs.planner_data
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(exported / "export", tmp_path / "a.pt")
    dcp_to_torch_save(tmp_path / "own", tmp_path / "b.pt")
    a, b = (torch.load(tmp_path / n, weights_only=False) for n in ("a.pt", "b.pt"))
    assert same(a, b)  # dict keys as DCP's paths have them: strings ("optim.state.0")
    assert same(a["model"], full_state()["model"])


def test_tied_tensors_are_written_once(tmp_path: Path) -> None:
    w = torch.randn(64, 64)
    sp.save(tmp_path / "c", {"enc": {"w": w}, "dec": {"w": w}})
    sp.convert(tmp_path / "c", tmp_path / "d", format="dcp")
    assert (tmp_path / "d" / "__0_0.distcp").stat().st_size < w.nbytes * 1.5
    back = {"enc": {"w": torch.zeros(64, 64)}, "dec": {"w": torch.zeros(64, 64)}}
    dcp.load(back, checkpoint_id=tmp_path / "d", no_dist=True)
    assert torch.equal(back["enc"]["w"], w) and torch.equal(back["dec"]["w"], w)


def test_what_dcp_cannot_hold_is_listed(tmp_path: Path) -> None:
    state = {"a.b": torch.ones(2), "a": {"b": torch.zeros(2)}, "pair": (torch.ones(1), 2)}
    sp.save(tmp_path / "c", state, metadata={"note": "x"})
    with pytest.raises(sp.ConversionError) as info:
        sp.convert(tmp_path / "c", tmp_path / "d", format="dcp")
    text = str(info.value)
    assert "'a.b' is also that of a.b" in text and "pair: a tuple holding tensors" in text
    assert "metadata/note" in text and not (tmp_path / "d").exists()
    report = sp.convert(tmp_path / "c", tmp_path / "d", format="dcp", lossy=True)
    assert len(report.dropped) == 3
    back = {"a.b": torch.zeros(2)}
    dcp.load(back, checkpoint_id=tmp_path / "d", no_dist=True)
    assert torch.equal(back["a.b"], torch.ones(2))


def test_a_hostile_metadata_global_is_named_and_never_run(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    dcp.save({"w": torch.ones(3)}, checkpoint_id=ck, no_dist=True)
    marker = tmp_path / "ran"
    evil = b"cos\nsystem\n(X" + len(f"touch {marker}").to_bytes(4, "little")
    evil += f"touch {marker}".encode() + b"tR."
    (ck / ".metadata").write_bytes(evil)
    for call in (sp.load, sp.inspect, sp.verify):
        with pytest.raises(sp.IncompatibleCheckpointError, match=r"global os\.system"):
            call(ck)
    assert not marker.exists()


def test_a_damaged_chunk_is_refused_by_its_crc(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    dcp.save({"w": torch.arange(4096, dtype=torch.float32)}, checkpoint_id=ck, no_dist=True)
    data = ck / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 1  # inside the tensor's bytes
    data.write_bytes(bytes(raw))
    assert sp.inspect(ck).format == "dcp"  # inspect reads .metadata and sizes only
    for call in (sp.load, sp.verify):
        with pytest.raises(sp.CorruptCheckpointError, match="CRC-32 mismatch"):
            call(ck)


def test_each_distinct_chunk_pickle_is_unpickled_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunks whose data.pkl bytes repeat (same dtype, shape, stride) reuse one parse (each
    chunk's dtype and shape are still held to .metadata's, as before)."""
    from savepoint.formats import _torch_archive

    ck = tmp_path / "ck"
    state = {f"w{i}": torch.full((8,), float(i)) for i in range(6)}
    state.update({f"m{i}": torch.full((2, 3), float(i)) for i in range(3)})
    dcp.save(state, checkpoint_id=ck, no_dist=True)
    calls: list[bytes] = []
    real = _torch_archive.unpickle

    def counting(data: bytes, *args: Any, **kwargs: Any) -> Any:
        calls.append(data)
        return real(data, *args, **kwargs)

    monkeypatch.setattr(_torch_archive, "unpickle", counting)
    got = sp.load(ck)
    assert all(torch.equal(got[k], v) for k, v in state.items())
    metadata = (ck / ".metadata").read_bytes()  # read through the same function when
    pickles = [c for c in calls if c != metadata]  # its module imports after the patch
    assert len(pickles) == len(set(pickles)) == 2  # one per shape, not one per chunk


def test_a_truncated_file_is_refused_at_open(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    dcp.save({"w": torch.ones(1000)}, checkpoint_id=ck, no_dist=True)
    data = ck / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:-100])
    with pytest.raises(sp.CorruptCheckpointError, match="truncated"):
        sp.inspect(ck)


def test_loading_holds_no_second_copy(saved: Path) -> None:
    """A tensor of 4 MiB in two column chunks (a Shard(1) save), assembled box by box: the
    load's peak traced memory is the result and a little more, not a second copy."""
    import tracemalloc

    assert {t.key: t.shards for t in sp.inspect(saved).tensors}["model.big"] == 2
    tracemalloc.start()
    try:
        got = sp.load(saved, keys="model.big")["model.big"]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert same(got, full_state()["model"]["big"])
    assert peak < got.nbytes * 1.25 + (1 << 20), peak


def test_a_pickle_is_never_written_for_tensors(exported: Path) -> None:
    """The export's tensor items are torch.save archives whose data.pkl references nothing but
    torch's tensor rebuilders (what torch.load(weights_only=True) admits)."""
    import pickletools
    import zipfile

    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(exported / "export").read_metadata()
    data = (exported / "export" / "__0_0.distcp").read_bytes()
    for index, info in md.storage_data.items():
        if isinstance(md.state_dict_metadata[index.fqn], dcp.metadata.TensorStorageMetadata):
            z = zipfile.ZipFile(io.BytesIO(data[info.offset : info.offset + info.length]))
            found = {
                arg
                for op, arg, _ in pickletools.genops(z.read("archive/data.pkl"))
                if op.name == "GLOBAL"
            }
            assert found <= {
                "torch._utils _rebuild_tensor_v2",
                "torch FloatStorage",
                "torch BFloat16Storage",
                "torch LongStorage",
                "collections OrderedDict",
            }, found
    assert pickle.loads(pickle.dumps(md)).version == "1.0.0"


def test_a_dcp_directory_is_read_as_one_everywhere(tmp_path: Path) -> None:
    """What was "read it with DCP itself" is now read: a damaged one says what is wrong."""
    from click.testing import CliRunner

    d = tmp_path / "dcp"
    d.mkdir()
    (d / ".metadata").write_bytes(b"\x80\x04pickled")
    (d / "__0_0.distcp").write_bytes(b"data")
    for call in (sp.load, sp.inspect, sp.verify):
        with pytest.raises(sp.CorruptCheckpointError, match=r"\.metadata is not a valid pickle"):
            call(d)
    result = CliRunner().invoke(main, ["inspect", str(d)])
    assert result.exit_code == 1 and ".metadata is not a valid pickle" in result.stderr
