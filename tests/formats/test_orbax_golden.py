"""The golden Orbax checkpoint (``tests/golden/orbax/``: orbax-checkpoint 0.12.8's
``PyTreeCheckpointer``, OCDBT + zarr v2) read by savepoint through tensorstore alone, in a
process where ``import jax`` and ``import orbax`` fail. Skipped without the ``orbax`` extra.
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

pytest.importorskip("tensorstore")

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "orbax"
sys.path.insert(0, str(GOLDEN.parent))
from make_golden_orbax import golden_state  # noqa: E402

_CHILD = """
import json, sys
sys.modules["jax"] = None
sys.modules["orbax"] = None
import numpy as np, savepoint as sp
got = sp.load(sys.argv[1])
print(json.dumps({"w": got["w"].tolist(), "b": got["b"].view(np.uint16).tolist(),
                  "k": got["nested"][0].tolist(), "z": got["nested"][1]["z"].tolist(),
                  "dtypes": [str(got["w"].dtype), str(got["b"].dtype), str(got["nested"][1]["z"].dtype)],
                  "step": got["step"], "name": got["name"], "format": sp.verify(sys.argv[1]).format}))
"""


def test_read_without_jax_or_orbax(tmp_path: Path) -> None:
    copy = tmp_path / "moved"  # nothing in it names where it was written
    shutil.copytree(GOLDEN, copy)
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(copy)], capture_output=True, text=True, check=True
    )
    got, want = json.loads(out.stdout), golden_state()
    assert np.array_equal(np.array(got["w"], np.float32), want["w"])
    assert got["b"] == want["b_bits"].tolist() and got["k"] == [0, 1, 2]
    assert np.array_equal(np.array(got["z"], np.float16), want["nested"][1]["z"])
    assert got["dtypes"] == ["float32", "bfloat16", "float16"]
    assert (got["step"], got["name"], got["format"]) == (3, "golden", "orbax")


def test_inspect_lists_arrays_and_values() -> None:
    info = sp.inspect(GOLDEN)
    assert {t.key: t.dtype for t in info.tensors} == {
        "b": "BF16",
        "nested/0": "I32",
        "nested/1/z": "F16",
        "w": "F32",
    }
    assert info.values == {"name": "golden", "step": 3}
    assert info.metadata["orbax"]["checkpoint_metadata"]["item_handlers"].endswith(
        "PyTreeCheckpointHandler"
    )


def test_leaves_that_do_not_nest_are_refused(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    shutil.copytree(GOLDEN, ck)
    meta = json.loads((ck / "_METADATA").read_text())
    entry = meta["tree_metadata"]["('step',)"]
    entry["key_metadata"] = [{"key": "w", "key_type": 2}, {"key": "0", "key_type": 1}]
    (ck / "_METADATA").write_text(json.dumps(meta))
    with pytest.raises(sp.CorruptCheckpointError, match=r"do not nest|two leaves at one path"):
        sp.load(ck)
