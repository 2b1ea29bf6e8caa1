"""Fuzz targets for the readers of other systems' checkpoint directories (issue 30): a DCP
checkpoint (the golden one of ``tests/golden/dcp/``, one of its files replaced by the input:
``.metadata``, a pickle read through an allow-list, or a ``.distcp`` file of ``torch.save``
archives) and a DeepSpeed ZeRO 3 checkpoint (``tests/golden/deepspeed/zero3``, one of its four
``torch.save`` files replaced).

Each input goes through what a user calls: detection, ``inspect``, ``sp.load`` (every tensor
assembled from its chunks) and ``verify``; only CheckpointError may escape. Beyond that: what
``verify`` accepts, ``sp.load`` reads, and both list the same tensors.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from fuzz._harness import Target, register
from savepoint.errors import CheckpointError
from savepoint.formats import detect
from savepoint.formats.load import load_any

DCP_GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "dcp"
DCP_FILES = (".metadata", "__0_0.distcp", "__1_0.distcp")
DCP_TOKENS = (
    b"\x8c\x05torch\x94\x8c\x04Size\x94\x93",
    b"cos\nsystem\n",
    b"ctorch._utils\n_rebuild_tensor_v2\n",
    b"ctorch\nFloatStorage\n",
    b"PK\x03\x04",
    b"PK\x01\x02",
    b"PK\x05\x06",
    b"PK\x06\x06",
    b"archive/data/0",
    b"\x8c\x0crelative_path",
)


def _dcp_seeds(scratch: Path) -> list[bytes]:
    return [bytes([i]) + (DCP_GOLDEN / name).read_bytes() for i, name in enumerate(DCP_FILES)]


def _parse_dcp(data: bytes, scratch: Path) -> None:
    directory = scratch / "dcp"
    if directory.exists():
        shutil.rmtree(directory)
    shutil.copytree(DCP_GOLDEN, directory)
    name = DCP_FILES[data[0] % len(DCP_FILES)] if data else DCP_FILES[0]
    (directory / name).write_bytes(data[1:])
    assert detect.detect(directory) == "dcp"
    info = detect.inspect_any(directory)
    try:
        checked = detect.verify_any(directory)
    except CheckpointError:
        checked = None
    loaded = load_any(
        str(directory), "dcp", into=None, keys=None, framework="numpy", device=None, progress=None
    )
    assert set(loaded) == {t.key for t in info.tensors}
    if checked is not None:
        assert checked.tensors == info.tensors


register(
    Target(
        "dcp",
        _dcp_seeds,
        _parse_dcp,
        tokens=DCP_TOKENS,
        memory_slack=64 << 20,
    )
)


# -- DeepSpeed ZeRO ------------------------------------------------------------------------------

DS_GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "deepspeed" / "zero3" / "global_step1"
DS_FILES = (
    "zero_pp_rank_0_mp_rank_00_model_states.pt",
    "zero_pp_rank_0_mp_rank_00_optim_states.pt",
    "zero_pp_rank_1_mp_rank_00_model_states.pt",
    "zero_pp_rank_1_mp_rank_00_optim_states.pt",
)


def _ds_seeds(scratch: Path) -> list[bytes]:
    return [bytes([i]) + (DS_GOLDEN / name).read_bytes() for i, name in enumerate(DS_FILES)]


def _parse_ds(data: bytes, scratch: Path) -> None:
    directory = scratch / "global_step1"
    if directory.exists():
        shutil.rmtree(directory)
    shutil.copytree(DS_GOLDEN, directory)
    name = DS_FILES[data[0] % len(DS_FILES)] if data else DS_FILES[0]
    (directory / name).write_bytes(data[1:])
    assert detect.detect(directory) == "deepspeed"
    info = detect.inspect_any(directory)
    try:
        checked = detect.verify_any(directory)
    except CheckpointError:
        checked = None
    loaded = load_any(
        str(directory),
        "deepspeed",
        into=None,
        keys=None,
        framework="numpy",
        device=None,
        progress=None,
    )
    assert set(loaded) == {t.key for t in info.tensors}
    if checked is not None:
        assert checked.tensors == info.tensors


register(
    Target(
        "deepspeed",
        _ds_seeds,
        _parse_ds,
        tokens=(
            *DCP_TOKENS,
            b"\x8c\x0cparam_shapes",
            b"\x8c\x10fp32_flat_groups",
            b"\x8c\x0fpartition_count",
            b"cdeepspeed.runtime.zero.config\nZeroStageEnum\n",
        ),
        memory_slack=64 << 20,
    )
)
