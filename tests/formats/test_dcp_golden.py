"""The golden DCP checkpoint (``tests/golden/dcp/``, written by torch 2.13's plain ``dcp.save`` on
2 gloo ranks: ``make_golden_dcp.py``) read by savepoint without torch: in a process where
``import torch`` fails, ``sp.load``/``sp.inspect``/``sp.verify`` give the exact values; its
``.metadata`` references nothing outside the allow-list; each global of the allow-list is needed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import savepoint as sp
from savepoint.formats import _dcp_metadata, _torch_archive

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "dcp"
sys.path.insert(0, str(GOLDEN.parent))
from make_golden_dcp import golden_state  # noqa: E402

_CHILD = """
import json, sys
sys.modules["torch"] = None  # import torch fails here
import numpy as np, savepoint as sp
got = sp.load(sys.argv[1])
info = sp.verify(sys.argv[1])
print(json.dumps({
    "kinds": {k: type(v).__name__ for k, v in got.items()},
    "w": got["w"].tolist(), "t": got["t"].tolist(), "n": int(got["n"]),
    "h": got["h"].view(np.uint16).tolist(), "dtypes": {k: str(v.dtype) for k, v in got.items()},
    "bytes": info.metadata["dcp"]["bytes"], "torch": "torch" in sys.modules and sys.modules["torch"] is not None,
}))
"""


def test_read_without_torch_bit_exact() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(GOLDEN)], capture_output=True, text=True, check=True
    )
    got = json.loads(out.stdout)
    want = golden_state()
    assert not got["torch"] and set(got["kinds"].values()) == {"ndarray"}
    assert np.array_equal(np.array(got["w"], np.float32), want["w"])
    assert np.array_equal(np.array(got["t"], np.float32), want["t"])
    assert got["h"] == want["h_bits"].tolist() and got["n"] == -3
    assert got["dtypes"]["h"] == "bfloat16" and got["dtypes"]["step"] == "uint8"
    assert sorted(got["bytes"]) == ["name", "step"]


def test_inspect_describes_it() -> None:
    info = sp.inspect(GOLDEN)
    by_key = {t.key: t for t in info.tensors}
    assert by_key["w"].shards == 2 and by_key["w"].file == "2 shards"
    assert (by_key["h"].dtype, by_key["h"].shape) == ("BF16", (5,))
    assert info.writer == "torch.distributed.checkpoint 1.0.0"
    assert set(info.files) == {".metadata", "__0_0.distcp", "__1_0.distcp"}


def _globals(data: bytes) -> set[str]:
    """The globals the pickle ``data`` names, as it is read through the allow-list."""
    import io
    import pickle

    found: set[str] = set()

    class Recording(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> object:
            found.add(f"{module}.{name}")
            return _dcp_metadata._ALLOWED[(module, name)]

    Recording(io.BytesIO(data)).load()
    return found


def test_the_allow_list_admits_what_torch_writes() -> None:
    used = _globals((GOLDEN / ".metadata").read_bytes())
    assert {
        "torch.distributed.checkpoint.metadata.Metadata",
        "torch.distributed.checkpoint.metadata.TensorStorageMetadata",
        "torch.distributed.checkpoint.metadata.BytesStorageMetadata",
        "torch.distributed.checkpoint.metadata.ChunkStorageMetadata",
        "torch.distributed.checkpoint.metadata.TensorProperties",
        "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING",
        "torch.distributed.checkpoint.metadata.MetadataIndex",
        "torch.distributed.checkpoint.metadata.StorageMeta",
        "torch.distributed.checkpoint.filesystem._StorageInfo",
        "torch.Size",
        "torch.serialization._get_layout",
        "torch.float32",
        "torch.bfloat16",
        "torch.int64",
        "pathlib.PosixPath",  # FileSystemWriter's checkpoint_id, always a Path
    } == used


@pytest.mark.parametrize(
    ("module", "name"),
    [("os", "system"), ("builtins", "eval"), ("torch", "load"), ("posix", "system")],
)
def test_any_other_global_is_named(module: str, name: str) -> None:
    evil = f"c{module}\n{name}\n(X\x01\x00\x00\x00xtR.".encode()
    with pytest.raises(sp.IncompatibleCheckpointError, match=rf"global {module}\.{name},"):
        _dcp_metadata.decode(evil, path="x", what="x/.metadata")
    with pytest.raises(sp.IncompatibleCheckpointError, match=rf"global {module}\.{name},"):
        _torch_archive.unpickle(evil, _torch_archive.TENSOR_GLOBALS, path="x", what="x")
