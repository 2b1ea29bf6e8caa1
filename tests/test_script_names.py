"""The benchmarks and examples call only names savepoint has: every ``sp.NAME`` and
``sp.NAME.ATTR`` they write resolves (a benchmark that failed at start once went unnoticed when
``sp.checkpoint`` stopped being a root attribute)."""

from __future__ import annotations

import importlib
import pathlib
import re

import pytest

import savepoint as sp

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "benchmarks").glob("*.py")) + sorted((ROOT / "examples").rglob("*.py"))
USE = re.compile(r"(?<![\w.])sp\.([A-Za-z_]\w*)(?:\.([A-Za-z_]\w*))?")


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_names_resolve(script: pathlib.Path) -> None:
    text = script.read_text()
    if "import savepoint as sp" not in text:
        pytest.skip("does not use the sp alias")
    missing = []
    for m in USE.finditer(text):
        name, attr = m.group(1), m.group(2)
        if not hasattr(sp, name):
            missing.append(f"sp.{name}")
            continue
        value = getattr(sp, name)
        if attr is not None and isinstance(value, type(sp)) and not hasattr(value, attr):
            try:  # a submodule not imported by its package
                importlib.import_module(f"{value.__name__}.{attr}")
            except ImportError:
                missing.append(f"sp.{name}.{attr}")
    assert not missing, f"{script.name} uses names savepoint does not have: {sorted(set(missing))}"
