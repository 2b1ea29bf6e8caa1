"""JAX state in one process (the cases of _jax_cases.py: jax.Array leaves, PRNG keys, abstract
targets, Flax linen and NNX, optax, what a load without ``into`` gives, mismatches, damage,
refusals, CheckpointManager, properties), run by a pytest in a fresh interpreter, one result
per case here.

Why not in this process: once JAX has started its runtime, every ``os.fork()`` in the process
warns that it may deadlock (an error under this suite's warning filter), so a test process that
ran JAX would fail the later tests that fork (``tests/async_``, ``tests/distributed``...). No
test module the suite collects imports jax; _jax_cases.py, _sharded.py and _train.py run in
children."""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

if any(importlib.util.find_spec(m) is None for m in ("jax", "flax", "optax")):
    pytest.skip("needs jax, flax and optax (the jax extra)", allow_module_level=True)

pytestmark = pytest.mark.jax

ROOT = Path(__file__).resolve().parents[2]
CASES = Path(__file__).with_name("_jax_cases.py")
NAMES = [
    node.name
    for node in ast.parse(CASES.read_text(encoding="utf-8")).body
    if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")
]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[tuple[str, str]]]:
    """Each case's outcomes (one per parameter set) and their report text."""
    work = tmp_path_factory.mktemp("jax_cases")
    report = work / "report.xml"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:xdist",
            f"--junitxml={report}",
            f"--basetemp={work / 'tmp'}",
            str(CASES),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
        env=env,
    )
    assert report.exists(), proc.stdout + proc.stderr
    found: dict[str, list[tuple[str, str]]] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        outcome, text = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome, text = child.tag, (child.get("message") or "") + "\n" + (child.text or "")
        found.setdefault(case.get("name", "").split("[")[0], []).append((outcome, text))
    return found


@pytest.mark.parametrize("name", NAMES)
def test_case(results: dict[str, list[tuple[str, str]]], name: str) -> None:
    outcomes = results.get(name)
    assert outcomes, f"{name} did not run"
    for outcome, text in outcomes:
        assert outcome == "passed", text
