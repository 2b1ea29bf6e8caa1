"""Orbax checkpoints (issue 30): orbax-checkpoint itself writes them (in a process with 8 CPU
devices: a ``jax.Array`` sharded over a 4 x 2 mesh, bf16, numpy arrays, scalars, a string, None,
empty containers), by ``PyTreeCheckpointer`` (OCDBT + zarr v2), with zarr v3, without OCDBT, by
``StandardCheckpointer`` and as a ``CheckpointManager`` step; savepoint reads each bit-exact
through tensorstore. savepoint's safetensors export is read back by Orbax's own safetensors
layout. Skipped without the ``orbax`` extra (tensorstore) or orbax-checkpoint and jax.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("tensorstore")
pytest.importorskip("jax")
pytest.importorskip("orbax.checkpoint")

import savepoint as sp

WORKER = Path(__file__).with_name("_orbax_worker.py")
MODES = {
    "pytree": "pytree",
    "zarr3": "zarr3",
    "plain": "plain",
    "standard": "standard",
    "manager": "manager/1",  # a CheckpointManager's step directory
}


def run(mode: str, out: Path, *extra: str) -> None:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    env.update(JAX_PLATFORMS="cpu", PYTHONWARNINGS="ignore")
    done = subprocess.run(
        [sys.executable, str(WORKER), mode, str(out), *extra],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("orbax")
    for mode in MODES:
        run(mode, root / mode)
    return root


def flat(tree: Any, path: tuple[Any, ...] = ()) -> dict[str, Any]:
    """Leaves by ``/``-joined path, empty containers as leaves (as the worker writes them)."""
    out: dict[str, Any] = {}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree)
    for k, v in items:
        if isinstance(v, (dict, list)) and v:
            out.update(flat(v, (*path, k)))
        else:
            out["/".join(map(str, (*path, k)))] = v
    return out


@pytest.mark.parametrize("mode", list(MODES))
def test_orbax_writes_savepoint_reads_bit_exact(written: Path, mode: str) -> None:
    got = flat(sp.load(written / MODES[mode]))
    arrays = dict(np.load(written / f"{mode}.npz"))
    values = json.loads((written / f"{mode}.json").read_text())
    assert set(got) == set(arrays) | set(values)
    for key, want in arrays.items():
        a = got[key]
        a = a.view(np.uint16) if a.dtype.name == "bfloat16" else a
        assert a.dtype == want.dtype and np.array_equal(a, want), key
    for key, want in values.items():
        value = got[key]
        if isinstance(value, np.ndarray):  # a numpy scalar StandardCheckpointer kept an array
            assert value.shape == () and mode in ("standard", "manager"), key
            value = value.item()
        assert value == want and type(value) is type(want), key
    info = sp.verify(written / MODES[mode])
    assert info.format == "orbax" and {t.key for t in info.tensors} >= {"params/w", "params/b"}


def test_the_cli_and_convert(written: Path, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from savepoint.cli import main

    for args in (
        ["inspect", str(written / "pytree")],
        ["verify", str(written / "manager" / "1")],
        ["convert", str(written / "pytree"), str(tmp_path / "ckpt")],
        ["diff", str(written / "pytree"), str(tmp_path / "ckpt")],
    ):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 0, (args, result.output)
    back = sp.load(tmp_path / "ckpt")
    assert back["name"] == "run-1" and back["nothing"] is None and back["step"] == 7


def test_savepoint_export_is_read_by_orbax(tmp_path: Path) -> None:
    import ml_dtypes

    model = {
        "w": np.arange(12, dtype=np.float32).reshape(3, 4),
        "b": np.linspace(-1, 1, 5).astype(ml_dtypes.bfloat16),
        "block": {"k": np.arange(6, dtype=np.int32)},
    }
    sp.save(tmp_path / "ckpt", {"model": model, "step": 3})
    sp.export(tmp_path / "ckpt", tmp_path / "model.safetensors")
    run("read-safetensors", tmp_path / "read", str(tmp_path / "model.safetensors"))
    got = dict(np.load(tmp_path / "read.npz"))
    assert set(got) == {"w", "b", "block.k"}  # Orbax's tree: the file's dotted names
    assert np.array_equal(got["w"], model["w"]) and np.array_equal(
        got["block.k"], model["block"]["k"]
    )
    assert np.array_equal(got["b"], model["b"].view(np.uint16))


def test_a_damaged_chunk_is_an_error(written: Path, tmp_path: Path) -> None:
    ck = tmp_path / "plain"
    shutil.copytree(written / "plain", ck)
    chunk = next(
        p for p in (ck / "params.w").rglob("*") if p.is_file() and not p.name.startswith(".")
    )
    chunk.write_bytes(chunk.read_bytes()[:7])
    with pytest.raises(sp.CorruptCheckpointError, match=r"params\.w"):
        sp.verify(ck)


def _metadata(ck: Path, edit: Any) -> None:
    meta = json.loads((ck / "_METADATA").read_text())
    edit(meta["tree_metadata"])
    (ck / "_METADATA").write_text(json.dumps(meta))


def test_hostile_metadata_is_refused(written: Path, tmp_path: Path) -> None:
    ck = tmp_path / "plain"
    shutil.copytree(written / "plain", ck)

    def escape(tree: dict[str, Any]) -> None:
        tree["x"] = {
            "key_metadata": [{"key": "..", "key_type": 2}],
            "value_metadata": {"value_type": "np.ndarray"},
        }

    _metadata(ck, escape)  # without OCDBT an array is a directory: never outside the checkpoint
    with pytest.raises(sp.CorruptCheckpointError, match=r"an array named '\.\.'"):
        sp.load(ck)
    shutil.rmtree(ck)
    shutil.copytree(written / "pytree", ck)

    def unknown(tree: dict[str, Any]) -> None:
        tree["('step',)"]["value_metadata"]["value_type"] = "pickle"

    _metadata(ck, unknown)
    with pytest.raises(sp.IncompatibleCheckpointError, match="'pickle' leaf"):
        sp.inspect(ck)
