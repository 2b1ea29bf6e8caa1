"""What ``import savepoint`` and ``savepoint --help`` load (issue 25, item 22): nothing a call
has not asked for. Each check runs in a fresh interpreter; the times themselves are measured by
``benchmarks/bench_import.py`` (a test would be flaky on a shared machine)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

import savepoint as sp

# Imported by none of the two: each costs from 20 ms (click) to 1.5 s (ml_dtypes' extension).
HEAVY = (
    "numpy",
    "ml_dtypes",
    "tqdm",
    "matplotlib",
    "safetensors",
    "msgpack",
    "blake3",
    "xxhash",
    "zstandard",
    "torch",
    "jax",
)


def loaded_after(code: str) -> dict[str, list[str]]:
    """The heavy modules and the savepoint modules in ``sys.modules`` after running ``code``."""
    probe = (
        f"{code}\nimport json, sys\n"
        f"print(json.dumps({{'heavy': [m for m in {HEAVY!r} if m in sys.modules], "
        "'savepoint': sorted(m for m in sys.modules if m.split('.')[0] == 'savepoint'), "
        "'click': sorted(m for m in sys.modules if m.split('.')[0] == 'click')}))"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=env
    )
    assert result.returncode == 0, result.stderr
    loaded: dict[str, list[str]] = json.loads(result.stdout.strip().splitlines()[-1])
    return loaded


def test_import_savepoint_loads_only_the_errors() -> None:
    loaded = loaded_after("import savepoint")
    assert loaded["heavy"] == []
    assert loaded["savepoint"] == ["savepoint", "savepoint._version", "savepoint.errors"]
    assert loaded["click"] == []


def test_help_imports_no_command_and_no_framework() -> None:
    code = (
        "import sys\nsys.argv = ['savepoint', '--help']\nfrom savepoint.cli import main\n"
        "try:\n    main()\nexcept SystemExit as exc:\n    assert exc.code == 0, exc.code"
    )
    loaded = loaded_after(code)
    assert loaded["heavy"] == []
    assert loaded["savepoint"] == [
        "savepoint",
        "savepoint._version",
        "savepoint.cli",
        "savepoint.errors",
    ]


def test_a_float32_save_and_load_never_import_ml_dtypes() -> None:
    code = (
        "import tempfile, numpy as np, savepoint as sp\n"
        "d = tempfile.mkdtemp()\n"
        "sp.save(d + '/c', {'w': np.arange(6, dtype=np.float32), 'h': np.ones(2, np.float16), "
        "'lr': 0.5})\n"
        "target = {'w': np.zeros(6, np.float32), 'h': np.zeros(2, np.float16), 'lr': 0.1}\n"
        "sp.load(d + '/c', into=target)\n"
        "assert target['lr'] == 0.5 and target['w'][5] == 5\n"
        "print(sp.inspect(d + '/c'), sp.verify(d + '/c').format)"
    )
    assert "ml_dtypes" not in loaded_after(code)["heavy"]


def test_a_numpy_save_and_load_import_no_jax_adapter_and_a_jax_one_no_torch() -> None:
    """savepoint's jax modules load only once the state holds jax values (and so jax is
    imported); a state of jax arrays never brings torch in (docs/jax.md)."""
    code = (
        "import tempfile, numpy as np, savepoint as sp\n"
        "d = tempfile.mkdtemp()\n"
        "sp.save(d + '/c', {'w': np.ones(3, np.float32)})\n"
        "sp.load(d + '/c', into={'w': np.zeros(3, np.float32)})\n"
    )
    loaded = loaded_after(code)
    assert "jax" not in loaded["heavy"]
    assert not [m for m in loaded["savepoint"] if "jax" in m]
    if importlib.util.find_spec("jax") is None:  # (importorskip would import jax here)
        pytest.skip("needs jax")
    code = (
        "import tempfile, jax.numpy as jnp, savepoint as sp\n"
        "d = tempfile.mkdtemp()\n"
        "sp.save(d + '/c', {'w': jnp.ones(3), 'b': jnp.ones(2, jnp.bfloat16)})\n"
        "out = sp.load(d + '/c', into={'w': jnp.zeros(3), 'b': jnp.zeros(2, jnp.bfloat16)})\n"
        "assert float(out['w'][2]) == 1.0\n"
    )
    loaded = loaded_after(code)
    assert "torch" not in loaded["heavy"]
    assert "savepoint.state.jax_restore" in loaded["savepoint"]


def test_bfloat16_and_float8_still_round_trip() -> None:
    ml_dtypes = pytest.importorskip("ml_dtypes")
    import numpy as np

    from savepoint.codecs import dtypes

    for name, kind in (("BF16", ml_dtypes.bfloat16), ("F8_E4M3", ml_dtypes.float8_e4m3fn)):
        d = dtypes.BY_NAME[name]
        assert d.numpy == np.dtype(kind) and d.itemsize == np.dtype(kind).itemsize
        assert dtypes.from_numpy(np.dtype(kind), "k") is d


def test_every_public_name_resolves_lazily_to_its_object() -> None:
    from savepoint import policies
    from savepoint.checkpoint import save
    from savepoint.runs import policies as home
    from savepoint.runs.manager import CheckpointManager

    assert sp.save is save and sp.CheckpointManager is CheckpointManager
    assert sp.policies is policies and policies.__all__ == home.__all__
    assert all(getattr(policies, n) is getattr(home, n) for n in home.__all__)
    assert set(sp.__all__) <= set(dir(sp))
    for name in sp.__all__:
        assert getattr(sp, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        sp.nope  # noqa: B018
    namespace: dict[str, object] = {}
    exec("from savepoint import *", namespace)
    assert set(sp.__all__) <= set(namespace)


def test_help_lists_each_command_with_its_own_short_help() -> None:
    """``savepoint --help`` lists the commands from a table (so it imports none of them): the
    table must say what each command says of itself."""
    from savepoint.cli import COMMANDS, main

    lazy = CliRunner().invoke(main, ["--help"]).output
    assert set(main.commands) == set(COMMANDS)
    for name, (_, short) in COMMANDS.items():
        assert main.commands[name].short_help == short, name
        assert name in lazy
    import click

    eager = click.Group(name="main", commands=dict(main.commands.items()))
    shown = CliRunner().invoke(eager, ["--help"]).output
    assert lazy.split("Commands:")[1] == shown.split("Commands:")[1]
