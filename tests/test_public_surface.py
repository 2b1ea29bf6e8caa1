"""The public surface is explicit, for every module of the package.

- every public module (no component of its name starts with ``_``) has a sorted ``__all__`` of
  names it holds, and lists every function and class it defines;
- no module imports a ``_private`` name from another module (``from x import _y``, or ``x._y``
  on an imported module of savepoint), and a private module ``pkg/_m.py`` is imported only by the
  modules under ``pkg/`` (``savepoint/_x.py`` is private to the whole package);
- ``import savepoint`` imports neither torch nor jax.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import savepoint

ROOT = Path(savepoint.__file__).parent


def _name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> Iterator[tuple[str, Path]]:
    for path in sorted(ROOT.rglob("*.py")):
        yield _name(path), path


def _is_public(module: str) -> bool:
    return not any(part.startswith("_") for part in module.split("."))


def _is_module(dotted: str) -> bool:
    base = ROOT.parent.joinpath(*dotted.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


PUBLIC = [m for m, _ in _modules() if _is_public(m)]


@pytest.mark.parametrize("module", PUBLIC)
def test_public_module_has_all(module: str) -> None:
    mod = importlib.import_module(module)
    names = getattr(mod, "__all__", None)
    assert isinstance(names, list), f"{module} has no __all__ list"
    assert names == sorted(set(names)), f"{module}.__all__ is not sorted or repeats a name"
    missing = [n for n in names if not hasattr(mod, n)]
    assert not missing, f"{module}.__all__ names what it does not hold: {missing}"
    unlisted = [
        n
        for n, value in vars(mod).items()
        if not n.startswith("_")
        and (inspect.isfunction(value) or inspect.isclass(value))
        and value.__module__ == module
        and n not in names
    ]
    assert not unlisted, f"{module} defines {unlisted} without listing them in __all__"


def _violations(module: str, path: Path) -> Iterator[str]:
    """Each import of a private name, or of a private module from outside its package."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    modules: dict[str, str] = {}  # local name -> the savepoint module it is bound to

    def private_module(dotted: str) -> str | None:
        """The first private module on the way to ``dotted`` that ``module`` may not import."""
        parts = dotted.split(".")
        for i, part in enumerate(parts[1:], start=1):
            if _private(part):
                owner = ".".join(parts[:i])
                if not (module == owner or module.startswith(owner + ".")):
                    return ".".join(parts[: i + 1])
                break
        return None

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = node.module or ""
            if node.level:  # relative: from the package, one level up per extra dot
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join([*base, source] if source else base)
            if source != "savepoint" and not source.startswith("savepoint."):
                continue
            if (bad := private_module(source)) is not None:
                yield f"line {node.lineno}: imports {bad}"
            for alias in node.names:
                dotted = f"{source}.{alias.name}"
                if _is_module(dotted):
                    modules[alias.asname or alias.name] = dotted
                    if (bad := private_module(dotted)) is not None:
                        yield f"line {node.lineno}: imports {bad}"
                elif _private(alias.name):
                    yield f"line {node.lineno}: imports the private name {dotted}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if not alias.name.startswith("savepoint"):
                    continue
                if (bad := private_module(alias.name)) is not None:
                    yield f"line {node.lineno}: imports {bad}"
                if alias.asname:
                    modules[alias.asname] = alias.name
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in modules
            and _private(node.attr)
        ):
            dotted = f"{modules[node.value.id]}.{node.attr}"
            if not _is_module(dotted):
                yield f"line {node.lineno}: uses the private name {dotted}"
            elif (bad := private_module(dotted)) is not None:
                yield f"line {node.lineno}: uses {bad}"


def test_no_module_imports_private_names() -> None:
    found = {
        module: problems
        for module, path in _modules()
        if (problems := list(_violations(module, path)))
    }
    assert not found, "\n".join(f"{m}: {p}" for m, ps in found.items() for p in ps)


def test_the_scan_sees_private_imports(tmp_path: Path) -> None:
    """The checker itself: each kind of violation is reported, each allowed import is not."""
    source = tmp_path / "m.py"
    source.write_text(
        "from savepoint.formats import _files\n"  # another package's private module
        "from savepoint.formats._files import jsonable\n"  # the same, by its path
        "from savepoint.codecs.manifest import _shard_json\n"  # a private name
        "from savepoint.codecs import manifest\n"
        "manifest._shard_json\n"  # a private name, by attribute
        "from savepoint.state import _scalars as s\n"
        "import savepoint.state.arrays as arrays\n"
        "arrays._PIECE\n",
        encoding="utf-8",
    )
    problems = list(_violations("savepoint.runs.m", source))
    assert len(problems) == 6, problems
    ok = tmp_path / "ok.py"
    ok.write_text(
        "from savepoint.formats import _files\n"
        "from savepoint.formats._files import LazyTensor\n"
        "from savepoint.engine import read\n",
        encoding="utf-8",
    )
    assert not list(_violations("savepoint.formats.convert", ok))
    assert len(list(_violations("savepoint.state.tree", ok))) == 2


def test_import_savepoint_imports_no_framework() -> None:
    code = (
        "import sys, savepoint, savepoint.formats.detect, savepoint.formats.convert; "
        "loaded = [m for m in ('torch', 'jax') if m in sys.modules]; "
        "assert not loaded, loaded"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert result.returncode == 0, result.stderr


def test_codecs_import_only_errors_and_codecs() -> None:
    """Codecs are the bottom layer: bytes in, values out, nothing of savepoint above them."""
    found = []
    for module, path in _modules():
        if not module.startswith("savepoint.codecs"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = (
                [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else []
            )
            found += [
                f"{module}: {name}"
                for name in names
                if name.startswith("savepoint")
                and name != "savepoint.errors"
                and not name.startswith("savepoint.codecs")
            ]
    assert not found, found


# ---------------------------------------------------------------------------------------------
# What is public (docs/api.md)
# ---------------------------------------------------------------------------------------------

API_DOC = ROOT.parent.parent / "docs" / "api.md"
REPO_ROOT = ROOT.parent.parent
IMPLEMENTATION_MARK = "Implementation, not public API"


def _public_table() -> dict[str, str]:
    """docs/api.md's table of public modules: module -> scope ("names" or "module")."""
    rows: dict[str, str] = {}
    in_table = False
    for line in API_DOC.read_text(encoding="utf-8").splitlines():
        if line.startswith("## "):
            in_table = line.strip() == "## Public modules"
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if in_table and len(cells) == 3 and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = cells[1]
    return rows


def is_public_module(dotted: str, table: dict[str, str]) -> bool:
    """Whether ``dotted`` (a savepoint module) is public by the table: listed, or under a module
    listed with scope "module" and no component of its name private."""
    if dotted in table:
        return True
    parts = dotted.split(".")
    for i in range(len(parts) - 1, 0, -1):
        scope = table.get(".".join(parts[:i]))
        if scope is not None:
            return scope == "module" and not any(p.startswith("_") for p in parts[i:])
    return False


def test_the_public_table_names_real_modules() -> None:
    table = _public_table()
    assert "savepoint" in table and "savepoint.storage.base" in table, table
    assert set(table.values()) <= {"names", "module"}, table
    for module in table:
        assert _is_module(module), f"docs/api.md lists {module}, which does not exist"
        assert module in PUBLIC, f"docs/api.md lists {module}, a private module"


def test_the_public_check_tells_public_from_implementation() -> None:
    table = {"savepoint": "names", "savepoint.formats": "module", "savepoint.runs": "names"}
    assert is_public_module("savepoint.formats.burn", table)
    assert not is_public_module("savepoint.formats._files", table)
    assert is_public_module("savepoint.runs", table)
    assert not is_public_module("savepoint.runs.manager", table)
    assert not is_public_module("savepoint.engine.read", table)


def _documented_imports() -> Iterator[tuple[str, str]]:
    """(where, module) for each savepoint module imported by the README, the Python blocks of
    the user docs (not docs/architecture.md, which describes the implementation) and the
    examples; ``from savepoint.x import y`` counts ``savepoint.x.y`` when that is a module."""
    sources: list[tuple[str, str]] = []
    for doc in [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]:
        if doc.name == "architecture.md":
            continue
        text = doc.read_text(encoding="utf-8")
        for n, block in enumerate(re.findall(r"```python\n(.*?)```", text, flags=re.S)):
            sources.append((f"{doc.relative_to(REPO_ROOT)} block {n + 1}", block))
    for example in sorted((REPO_ROOT / "examples").glob("*.py")):
        sources.append((str(example.relative_to(REPO_ROOT)), example.read_text(encoding="utf-8")))
    for where, code in sources:
        try:
            tree = ast.parse(code)
        except SyntaxError:  # a fragment with "..." placeholders: read its import lines alone
            lines = [ln for ln in code.splitlines() if ln.lstrip().startswith(("import ", "from "))]
            tree = ast.parse("\n".join(ln.strip() for ln in lines if not ln.rstrip().endswith("(")))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "savepoint":
                        yield where, alias.name
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if node.module.split(".")[0] != "savepoint":
                    continue
                yield where, node.module
                for alias in node.names:
                    if _is_module(f"{node.module}.{alias.name}"):
                        yield where, f"{node.module}.{alias.name}"


def test_the_documentation_imports_public_modules_only() -> None:
    table = _public_table()
    found = list(_documented_imports())
    assert len(found) > 10, "the scan found almost no imports: is it reading the docs?"
    wrong = sorted(
        {f"{where}: {module}" for where, module in found if not is_public_module(module, table)}
    )
    assert not wrong, (
        "the docs and examples import implementation modules (docs/api.md); use the public "
        "names instead:\n" + "\n".join(wrong)
    )


def test_implementation_packages_say_so() -> None:
    table = _public_table()
    unmarked = []
    for path in sorted(ROOT.glob("*/__init__.py")):
        package = _name(path)
        if is_public_module(package, table) or any(m.startswith(package + ".") for m in table):
            continue
        if IMPLEMENTATION_MARK not in (importlib.import_module(package).__doc__ or ""):
            unmarked.append(package)
    assert not unmarked, f"implementation packages whose docstring does not say so: {unmarked}"
