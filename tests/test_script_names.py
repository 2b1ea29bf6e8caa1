"""The benchmarks and examples call only names savepoint promises: every ``sp.NAME`` they write
is in ``savepoint.__all__`` or a public submodule the root names (``sp.errors``, ``sp.policies``),
and every ``sp.MODULE.ATTR`` is in that module's ``__all__``. A benchmark once failed at start
when ``sp.checkpoint`` stopped being a root attribute: ``hasattr`` would not have caught it, as a
submodule imported by anything earlier is an attribute of the package all the same."""

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
    modules = {"errors", "formats", "integrations", *sp._MODULES}
    missing = []
    for m in USE.finditer(text):
        name, attr = m.group(1), m.group(2)
        if name.startswith("__"):
            continue  # (sp.__file__, sp.__version__: every module has them)
        if name not in sp.__all__ and name not in modules:
            missing.append(f"sp.{name}")
        elif name in modules and attr is not None:
            module = importlib.import_module(f"savepoint.{name}")
            if attr not in getattr(module, "__all__", ()) and not _is_module(name, attr):
                missing.append(f"sp.{name}.{attr}")
    assert not missing, f"{script.name} uses names savepoint does not have: {sorted(set(missing))}"


def _is_module(package: str, name: str) -> bool:
    base = ROOT / "src" / "savepoint" / package / name
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()
