"""Fuzz targets for the readers of other systems' checkpoint directories (issue 30): a DCP
checkpoint (the golden one of ``tests/golden/dcp/``, one of its files replaced by the input:
``.metadata``, a pickle read through an allow-list, or a ``.distcp`` file of ``torch.save``
archives), a DeepSpeed ZeRO 3 checkpoint (``tests/golden/deepspeed/zero3``, one of its four
``torch.save`` files replaced) and, where tensorstore is installed (the ``orbax`` extra), an Orbax
checkpoint (``tests/golden/orbax``: ``_METADATA``, ``_strings.json`` or an OCDBT file replaced;
tensorstore's own allocations are not traced).

The first byte of an input picks the file the rest replaces. Each input goes through what a user
calls: detection, ``inspect``, ``sp.load`` (every tensor read) and ``verify``; only
CheckpointError may escape. Beyond that: what ``verify`` accepts, ``inspect`` describes the same
way, and ``sp.load`` gives a tree of every tensor ``inspect`` lists.
"""

from __future__ import annotations

import importlib.util
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fuzz._harness import Target, register
from savepoint.errors import CheckpointError
from savepoint.formats import detect
from savepoint.formats.load import load_any
from savepoint.state import tree as tree_mod

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
PICKLE_TOKENS = (
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


def _keys(tree: Any) -> set[str]:
    """The key of every tensor in a loaded tree (``/``-joined, as ``inspect`` names them)."""
    found: set[str] = set()

    def walk(node: Any, path: tuple[Any, ...]) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, (*path, k))
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, (*path, i))
        elif hasattr(node, "shape") and hasattr(node, "dtype"):
            found.add(tree_mod.join(path))

    walk(tree, ())
    return found


def _directory_target(
    name: str, golden: Path, files: tuple[str, ...], kind: str, **options: Any
) -> Target:
    def seeds(scratch: Path) -> list[bytes]:
        return [bytes([i]) + (golden / f).read_bytes() for i, f in enumerate(files)]

    def parse(data: bytes, scratch: Path) -> None:
        directory = scratch / name
        if directory.exists():
            shutil.rmtree(directory)
        shutil.copytree(golden, directory)
        (directory / files[data[0] % len(files) if data else 0]).write_bytes(data[1:])
        assert detect.detect(directory) == kind
        info = detect.inspect_any(directory)
        checked = _or_none(lambda: detect.verify_any(directory))
        loaded = load_any(
            str(directory),
            kind,
            into=None,
            keys=None,
            framework="numpy",
            device=None,
            progress=None,
        )
        assert _keys(loaded) >= {t.key for t in info.tensors if t.tied_to is None}
        if checked is not None:
            assert checked.tensors == info.tensors

    return Target(name, seeds, parse, memory_slack=64 << 20, **options)


def _or_none(call: Callable[[], Any]) -> Any:
    try:
        return call()
    except CheckpointError:
        return None


register(
    _directory_target(
        "dcp",
        GOLDEN / "dcp",
        (".metadata", "__0_0.distcp", "__1_0.distcp"),
        "dcp",
        tokens=PICKLE_TOKENS,
    )
)
register(
    _directory_target(
        "deepspeed",
        GOLDEN / "deepspeed" / "zero3" / "global_step1",
        tuple(
            f"zero_pp_rank_{r}_mp_rank_00_{k}_states.pt" for r in (0, 1) for k in ("model", "optim")
        ),
        "deepspeed",
        tokens=(
            *PICKLE_TOKENS,
            b"\x8c\x0cparam_shapes",
            b"\x8c\x10fp32_flat_groups",
            b"\x8c\x0fpartition_count",
            b"cdeepspeed.runtime.zero.config\nZeroStageEnum\n",
        ),
    )
)
if importlib.util.find_spec("tensorstore") is not None:  # the orbax extra
    register(
        _directory_target(
            "orbax",
            GOLDEN / "orbax",
            (
                "_METADATA",
                "_strings.json",
                "manifest.ocdbt",
                "ocdbt.process_0/manifest.ocdbt",
                "_CHECKPOINT_METADATA",
            ),
            "orbax",
            tokens=(
                b'"key_type": 1',
                b'"value_type": "np.ndarray"',
                b'"value_type": "scalar"',
                b'"use_ocdbt": false',
                b'"use_zarr3": true',
                b"\"('w',)\"",
            ),
            text=True,
        )
    )
