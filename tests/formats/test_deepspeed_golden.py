"""The golden DeepSpeed ZeRO checkpoints (``tests/golden/deepspeed/``: DeepSpeed 0.19.8's own
output, ZeRO 2 with bf16 and ZeRO 3, 2 ranks; ``make_golden_deepspeed.py``) read by savepoint as
``zero_to_fp32`` consolidates them, bit-exact against its result (``expected.safetensors``), in
a process where ``import torch`` fails; hostile variants; hand-built layouts (padding, several
groups, a large parameter across ranks, read with bounded memory).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import savepoint as sp
from savepoint.formats import _deepspeed_layout as layout
from savepoint.formats import deepspeed

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "deepspeed"
PHASES = ("zero2-bf16", "zero3")

_CHILD = """
import json, sys
sys.modules["torch"] = None  # import torch fails here
import numpy as np, savepoint as sp
from safetensors.numpy import load_file
got = sp.load(sys.argv[1])
want = load_file(sys.argv[2])
raw = lambda a: np.ascontiguousarray(a).reshape(-1).view(np.uint8).tobytes()
same = {k: (str(got[k].dtype), raw(got[k]) == raw(want[k])) for k in want}
print(json.dumps({"names": list(got), "same": same, "tied": got["head.weight"] is got["emb.weight"],
                  "verify": sp.verify(sys.argv[1]).format}))
"""


@pytest.mark.parametrize("phase", PHASES)
def test_read_without_torch_as_zero_to_fp32(phase: str) -> None:
    tag = GOLDEN / phase / "global_step1"
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(tag), str(GOLDEN / phase / "expected.safetensors")],
        capture_output=True,
        text=True,
        check=True,
    )
    got = json.loads(out.stdout)
    assert got["names"][:2] == ["scale", "seen"] and got["names"][-1] == "head.weight"
    assert all(ok for _, ok in got["same"].values()), got["same"]
    assert got["same"]["scale"][0] == "float32"  # a bf16 buffer, upcast as zero_to_fp32 does
    assert got["tied"] and got["verify"] == "deepspeed"


def test_inspect_says_what_it_read_and_what_it_left() -> None:
    info = sp.inspect(GOLDEN / "zero2-bf16" / "global_step1")
    assert info.format == "deepspeed" and info.metadata["deepspeed"]["zero_stage"] == 2
    assert info.metadata["deepspeed"]["world_size"] == 2
    assert any("LossScaler" in n and "never imported" in n for n in info.notes)
    tied = {t.key: t.tied_to for t in info.tensors}
    assert tied["head.weight"] == "emb.weight"
    assert {t.key: t.dtype for t in info.tensors}["frozen.weight"] == "BF16"  # stored so


def _copy(tmp_path: Path, phase: str = "zero3") -> Path:
    tag = tmp_path / phase
    shutil.copytree(GOLDEN / phase / "global_step1", tag)
    return tag


def test_a_flipped_data_bit_is_a_crc_mismatch(tmp_path: Path) -> None:
    tag = _copy(tmp_path)
    from savepoint.formats import _torch_archive

    f = tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    raw = bytearray(f.read_bytes())
    records = _torch_archive.read_index(np.frombuffer(bytes(raw), np.uint8), 0, len(raw))
    data = max((r for n, r in records.items() if "/data/" in n), key=lambda r: r.size)
    raw[data.start + data.size // 2] ^= 0x40  # inside the fp32 partition's bytes
    f.write_bytes(bytes(raw))
    with pytest.raises(sp.CorruptCheckpointError, match="CRC-32 mismatch"):
        sp.verify(tag)


def test_a_missing_rank_is_named(tmp_path: Path) -> None:
    tag = _copy(tmp_path)
    (tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(sp.CorruptCheckpointError, match="partition_count 2, but 1 optimizer"):
        sp.load(tag)


def test_the_save_directory_reads_its_latest_tag(tmp_path: Path) -> None:
    save = tmp_path / "save"
    shutil.copytree(GOLDEN / "zero3" / "global_step1", save / "global_step1")
    (save / "latest").write_text("global_step1")
    (save / "zero_to_fp32.py").write_text("# DeepSpeed copies its script here\n")
    assert sp.inspect(save).metadata["deepspeed"]["tag"] == "global_step1"
    (save / "latest").write_text("../elsewhere")
    with pytest.raises(sp.CorruptCheckpointError, match="not a tag"):
        sp.load(save)


def test_a_tensor_parallel_checkpoint_is_refused_by_name(tmp_path: Path) -> None:
    tag = _copy(tmp_path, "zero2-bf16")
    shutil.copy(tag / "mp_rank_00_model_states.pt", tag / "mp_rank_01_model_states.pt")
    with pytest.raises(sp.IncompatibleCheckpointError, match="ds_to_universal"):
        sp.load(tag)


# -- the reconstruction, on hand-built layouts ---------------------------------------------------


def test_zero2_layout_follows_partitions_paddings_and_alignment() -> None:
    shapes = [[("a", (3, 2)), ("b", (5,))], [("c", (4,))]]
    # group 0: 6 + pad 2 + 5 = 13 elements, aligned to 2 * 2 = 16 over 2 ranks of 8
    slots = layout.zero2(shapes, [[8, 2], [8, 2]], [[2, 0], [0]])
    runs = {s.name: s.runs for s in slots}
    assert runs["a"] == ((0, 0, 6),)
    assert runs["b"] == ((2, 0, 5),)  # after a's padding: rank 1's partition of group 0
    assert runs["c"] == ((1, 0, 2), (3, 0, 2))  # group 1: rank 0's 2 then rank 1's 2
    with pytest.raises(layout.LayoutError, match="consumed 4 elements out of 16"):
        layout.zero2([[("a", (4,))]], [[8], [8]], None)
    with pytest.raises(layout.LayoutError, match="past the end"):
        layout.zero2([[("a", (40,))]], [[8], [8]], None)


def test_zero3_layout_takes_a_share_of_every_rank() -> None:
    slots = layout.zero3([("a", (5,)), ("b", (2, 2))], [[5], [5]])
    runs = {s.name: s.runs for s in slots}
    assert runs["a"] == ((0, 0, 3), (1, 0, 2))  # ceil(5 / 2) = 3 each, cut to 5
    assert runs["b"] == ((0, 3, 2), (1, 3, 2))
    with pytest.raises(layout.LayoutError, match="consumed"):
        layout.zero3([("a", (5,))], [[4], [4]])


def test_a_large_parameter_across_ranks_loads_without_a_second_copy(tmp_path: Path) -> None:
    """A hand-built ZeRO 2 checkpoint (torch.save of DeepSpeed's layout) whose 4 MiB parameter
    spans both ranks' partitions: loaded exactly, its peak traced memory the result itself."""
    torch = pytest.importorskip("torch")
    import tracemalloc

    full = torch.arange(1 << 20, dtype=torch.float32) / 7
    half = full.numel() // 2  # ZeRO 2 partitions are equal; the parameter spans both
    tag = tmp_path / "global_step1"
    tag.mkdir()
    torch.save(
        {
            "module": {"w": torch.zeros(0)},
            "buffer_names": [],
            "param_shapes": [{"w": torch.Size([1024, 1024])}],
            "shared_params": {},
            "ds_version": "hand-built",
        },
        tag / "mp_rank_00_model_states.pt",
    )
    parts = [full[:half].clone(), full[half:].clone()]
    for r, part in enumerate(parts):
        state = {"zero_stage": 2, "partition_count": 2, "single_partition_of_fp32_groups": [part]}
        torch.save(
            {"optimizer_state_dict": state}, tag / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
        )
    tracemalloc.start()
    try:
        got = sp.load(tag, framework="numpy")["w"]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert np.array_equal(got.reshape(-1), full.numpy())
    assert peak < got.nbytes * 1.25 + (1 << 20), peak


def test_a_hostile_global_is_inert_or_named(tmp_path: Path) -> None:
    """A class outside the allow-list is never imported: where savepoint does not need the
    value it stays an inert placeholder (listed); where it does, it is refused by name."""
    torch = pytest.importorskip("torch")

    class Evil:
        def __reduce__(self) -> tuple[object, ...]:
            return (__import__("os").system, (f"touch {tmp_path / 'ran'}",))

    tag = tmp_path / "global_step1"
    tag.mkdir()
    model = {
        "module": {},
        "buffer_names": [],
        "param_shapes": [{"w": torch.Size([4])}],
        "shared_params": {},
        "client": Evil(),
    }
    torch.save(model, tag / "mp_rank_00_model_states.pt")
    state = {
        "zero_stage": 1,
        "partition_count": 1,
        "single_partition_of_fp32_groups": [torch.ones(4)],
    }
    torch.save({"optimizer_state_dict": state}, tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    assert np.array_equal(sp.load(tag, framework="numpy")["w"], np.ones(4, np.float32))
    assert any("posix.system" in n for n in sp.inspect(tag).notes)
    model["param_shapes"] = Evil()
    torch.save(model, tag / "mp_rank_00_model_states.pt")
    with pytest.raises(sp.CorruptCheckpointError, match=r"param_shapes is a posix\.system"):
        sp.load(tag)
    assert not (tmp_path / "ran").exists()
    assert deepspeed.is_deepspeed(["mp_rank_00_model_states.pt"])
