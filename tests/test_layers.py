"""docs/architecture.md matches the code, and the code keeps its layers.

- the layer table (read from the doc: the units of each row, top first) covers every module under
  ``src/savepoint``, and names nothing that is not there; the README's layout table has the same rows;
- no module imports a unit of a row above its own, or a peer on its row (module level, inside
  functions, under ``TYPE_CHECKING``) unless the doc lists that import under "Upward imports" with
  its reason; each listed exception is still needed;
- no module but ``runs/manager.py`` touches a private name of ``CheckpointManager``, except the
  known uses the doc lists (each still present);
- every ``file.py`` and ``file.py:name`` the doc cites exists, and the three paths (a managed save,
  a load, an async save) are drawn step by step;
- the error tree drawn in ``savepoint.errors``' docstring holds every exported class, under its
  real parent.

The checkers are tested on small fake trees, each with a planted violation.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

import savepoint.errors
from _architecture import (
    DOC,
    REPO,
    SRC,
    imports,
    layer_problems,
    layer_rows,
    manager_exceptions,
    modules,
    private_names,
    sections,
    table,
    ticked,
    touches,
    unit,
    upward_exceptions,
)

SHOWN = "src/savepoint/"
MANAGER = "runs/manager.py"

# ---------------------------------------------------------------------------------------------
# Layers
# ---------------------------------------------------------------------------------------------


def test_every_module_is_in_a_layer_and_every_layer_exists() -> None:
    rows = layer_rows()
    named = [u for row in rows for u in row]
    assert len(named) == len(set(named)), f"a unit is on two rows of the layer table: {named}"
    units = {unit(m) for m in modules(SRC)}
    assert not units - set(named), (
        f"in no row of the layer table of docs/architecture.md: {sorted(units - set(named))}"
    )
    assert not set(named) - units, (
        f"the layer table names what src/savepoint does not hold: {sorted(set(named) - units)}"
    )


@functools.cache
def _layer_check() -> tuple[list[str], set[tuple[str, str, str]]]:
    return layer_problems(SRC, layer_rows(), upward_exceptions(), SHOWN)


def test_no_import_goes_up_a_layer() -> None:
    problems, _ = _layer_check()
    assert not problems, "\n".join(problems)


def test_each_listed_upward_import_is_still_made() -> None:
    _, used = _layer_check()
    stale = sorted(set(upward_exceptions()) - used)
    assert not stale, (
        "docs/architecture.md lists upward imports that no module makes (or that go down): "
        f"{stale}; remove their rows from 'Upward imports'"
    )


def test_readme_layout_table_has_the_layer_rows() -> None:
    readme = sections((REPO / "README.md").read_text(encoding="utf-8"))["Layout of the code"]
    rows = [[u for u in ticked(r[0]) if u.endswith(("/", ".py"))] for r in table(readme)]
    assert rows == layer_rows(), "README.md's layout table and docs/architecture.md's disagree"


def _tree(root: Path, files: dict[str, str]) -> Path:
    pkg = root / "savepoint"
    for name, text in files.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(text, encoding="utf-8")
    return pkg


def test_the_layer_check_sees_planted_imports(tmp_path: Path) -> None:
    """The checker itself, on a fake tree: each kind of import up a layer is found, with its
    module, line and rule; imports down, within a unit, and listed ones are not."""
    pkg = _tree(
        tmp_path,
        {
            "__init__.py": "from savepoint import top\n",
            "top.py": "from savepoint.low import x\nfrom . import peer\n",
            "peer.py": "",
            "low/__init__.py": "",
            "low/x.py": (
                "from typing import TYPE_CHECKING\n"
                "from savepoint.low import y\n"  # within its unit
                "if TYPE_CHECKING:\n"
                "    from savepoint.top import T\n"  # line 4: up, type-checking only
                "def f():\n"
                "    import savepoint.top\n"  # line 6: up, lazy
                "from .. import top\n"  # line 7: up, relative, at import time
            ),
            "low/y.py": "from savepoint import peer\n",  # line 1: up, "from pkg import module"
            "stray.py": "",
        },
    )
    rows = [["__init__.py"], ["top.py", "peer.py"], ["low/"]]
    problems, _ = layer_problems(pkg, rows, shown="savepoint/")
    text = "\n".join(problems)
    assert "savepoint/stray.py: stray.py is in no row" in text
    assert (
        "savepoint/top.py:2: top.py (row 2) imports peer.py (module); peer.py shares its row"
        in (text)
    )
    for where, what in [
        ("low/x.py:4", "imports top.py (type-checking)"),
        ("low/x.py:6", "imports top.py (lazy)"),
        ("low/x.py:7", "imports top.py (module)"),
        ("low/y.py:1", "imports peer.py (module)"),
    ]:
        assert f"savepoint/{where}: low/ (row 3) {what}" in text, text
    assert "a layer imports only the rows below its own" in text
    assert len(problems) == 6, text
    kinds = {(i.line, i.kind) for i in imports(pkg, "low/x.py")}
    assert kinds == {(2, "module"), (4, "type-checking"), (6, "lazy"), (7, "module")}

    allowed = {("low/x.py", "top.py", "lazy"), ("top.py", "peer.py", "module")}
    problems, used = layer_problems(pkg, rows, allowed, "savepoint/")
    assert used == allowed
    assert len(problems) == 4  # a lazy exception does not cover the module-level import


def test_the_doc_tables_parse_as_the_checks_read_them() -> None:
    doc = "\n".join(
        [
            "## Layers",
            "| layer | owns |",
            "|---|---|",
            "| `a/`, `b.py` | `x|y` and more |",
            "| `c/` | |",
            "### Upward imports",
            "| module | imports | kind | reason |",
            "|---|---|---|---|",
            "| `c/m.py` | `a/n.py` | lazy | because |",
            "### Private names",
            "| module | name | issue |",
            "|---|---|---|",
            "| `a/v.py` | `_x`, `_y` | issue 26 |",
        ]
    )
    assert layer_rows(doc) == [["a/", "b.py"], ["c/"]]
    assert upward_exceptions(doc) == {("c/m.py", "a/n.py", "lazy"): "because"}
    assert manager_exceptions(doc) == {("a/v.py", "_x"), ("a/v.py", "_y")}


# ---------------------------------------------------------------------------------------------
# CheckpointManager's private names
# ---------------------------------------------------------------------------------------------


@functools.cache
def _manager_touches() -> dict[tuple[str, str], list[int]]:
    names = private_names((SRC / MANAGER).read_text(encoding="utf-8"), "CheckpointManager")
    assert {"_life", "_saver", "_settle"} <= names  # (the look finds them at all)
    found: dict[tuple[str, str], list[int]] = {}
    for module in modules(SRC):
        if module != MANAGER:
            text = (SRC / module).read_text(encoding="utf-8")
            for line, name in touches(text, "CheckpointManager", names):
                found.setdefault((module, name), []).append(line)
    return found


def test_only_the_manager_touches_its_private_names() -> None:
    listed = manager_exceptions()
    found = _manager_touches()
    new = [
        f"{SHOWN}{module}:{line}: touches CheckpointManager.{name} outside {MANAGER} "
        "(docs/architecture.md, 'Private names'): give the manager a public method, or move "
        "the code into runs/manager.py"
        for (module, name), lines in sorted(found.items())
        if (module, name) not in listed
        for line in sorted(lines)
    ]
    assert not new, "\n".join(new)


def test_each_listed_manager_exception_is_still_there() -> None:
    stale = sorted(manager_exceptions() - set(_manager_touches()))
    assert not stale, (
        f"docs/architecture.md lists uses of CheckpointManager's private names that are gone: "
        f"{stale}; remove them from 'Private names'"
    )


def test_the_manager_check_sees_planted_touches() -> None:
    manager = (
        "class CheckpointManager:\n"
        "    _flag = True\n"
        "    def __init__(self):\n"
        "        self._books = {}\n"
        "    def _step(self):\n"
        "        pass\n"
        "    def __repr__(self):\n"
        "        return ''\n"
    )
    names = private_names(manager, "CheckpointManager")
    assert names == {"_flag", "_books", "_step"}
    other = (
        "import savepoint as sp\n"
        "from savepoint.runs.manager import CheckpointManager\n"
        "class Sub(CheckpointManager):\n"
        "    _flag = False\n"  # 4: an override
        "    def go(self):\n"
        "        return self._books\n"  # 6: on self, in a subclass
        "class Leaf(Sub):\n"
        "    def _step(self):\n"  # 8: an override, two levels down
        "        pass\n"
        "class View:\n"
        "    def __init__(self):\n"
        "        self._m = Sub()\n"
        "        self._books = {}\n"  # its own attribute: not the manager's
        "    def get(self, other: CheckpointManager):\n"
        "        other._step()\n"  # 15: an annotated parameter
        "        return self._m._books\n"  # 16: a bound attribute
        "def f():\n"
        "    m = sp.CheckpointManager('run')\n"
        "    getattr(m, '_step')()\n"  # 19: getattr
        "    with CheckpointManager('r') as n:\n"
        "        n._books.clear()\n"  # 21: a with target
        "    CheckpointManager._flag\n"  # 22: the class itself
        "    unrelated._books\n"
    )
    found = sorted(touches(other, "CheckpointManager", names))
    assert found == [
        (4, "_flag"),
        (6, "_books"),
        (8, "_step"),
        (15, "_step"),
        (16, "_books"),
        (19, "_step"),
        (21, "_books"),
        (22, "_flag"),
    ]


# ---------------------------------------------------------------------------------------------
# What the doc cites, and the paths it draws
# ---------------------------------------------------------------------------------------------


def _defines(path: Path, qualname: str) -> bool:
    scope: list[ast.stmt] = ast.parse(path.read_text(encoding="utf-8")).body
    for part in qualname.split("."):
        found = [
            n
            for n in scope
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and n.name == part
        ]
        if not found:
            return False
        scope = found[0].body
    return True


CITED = re.compile(r"^([\w/]+\.py)(?::([\w.]+))?$")


FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def _missing_citations(text: str) -> list[str]:
    """Each ``file.py`` or ``file.py:qualified.name`` cited in ``text`` that is not there. Fenced
    code blocks are left out: their three backticks would pair every later citation wrongly."""
    missing = []
    for token in ticked(FENCE.sub("", text)):
        match = CITED.match(token)
        if match is None or token.startswith("pkg/"):  # (the doc's placeholder name)
            continue
        module, name = match.groups()
        path = SRC / module if (SRC / module).is_file() else REPO / module
        if not path.is_file():
            missing.append(f"{token}: no such module")
        elif name is not None and not _defines(path, name):
            missing.append(f"{token}: {module} defines no {name}")
    return missing


def test_every_cited_module_and_name_exists() -> None:
    """Every ``file.py`` (relative to src/savepoint, or to the repository) and every
    ``file.py:qualified.name`` the doc cites is there."""
    missing = _missing_citations(DOC.read_text(encoding="utf-8"))
    assert not missing, "docs/architecture.md cites what is not there:\n" + "\n".join(missing)


def test_the_citation_check_reads_past_a_code_fence() -> None:
    text = "`engine/read.py:Reader`\n\n```python\nx = 1\n```\n\n`engine/read.py:nothing_here`\n"
    assert _missing_citations(text) == [
        "engine/read.py:nothing_here: engine/read.py defines no nothing_here"
    ]


@pytest.mark.parametrize(
    ("title", "first", "least"),
    [
        ("The path of a managed save", "runs/manager.py:CheckpointManager.save", 8),
        ("The path of a load", "checkpoint.py:load", 5),
        ("The path of an async save", "async_/checkpointer.py:AsyncCheckpointer.save", 5),
    ],
)
def test_the_paths_are_drawn_step_by_step(title: str, first: str, least: int) -> None:
    body = sections(DOC.read_text(encoding="utf-8"))[title]
    steps = [line for line in body.splitlines() if re.match(r"\d+\. ", line)]
    assert len(steps) >= least, f"{title}: {len(steps)} steps"
    assert ticked(steps[0])[0] == first
    for step in steps:
        cites = [t for t in ticked(step) if CITED.match(t) and ":" in t]
        assert cites, f"{title}: a step names no function (file.py:name): {step}"


# ---------------------------------------------------------------------------------------------
# The error tree
# ---------------------------------------------------------------------------------------------


def test_the_drawn_error_tree_is_complete_and_right() -> None:
    """Every class savepoint.errors exports is drawn once, under its real parent."""
    doc = savepoint.errors.__doc__ or ""
    drawn: dict[str, str | None] = {}
    parents: list[str] = []
    for line in doc.splitlines():
        match = re.match(r"^    ((?:[│ ]   )*)(?:[├└]── )?([A-Z]\w+)\b", line)
        if match is None or (not match.group(1) and "──" not in line and drawn):
            continue
        depth = len(match.group(1)) // 4 + (1 if "──" in line else 0)
        name = match.group(2)
        assert name not in drawn, f"{name} is drawn twice"
        drawn[name] = parents[depth - 1] if depth else None
        parents[depth:] = [name]
    exported = {
        name: getattr(savepoint.errors, name)
        for name in savepoint.errors.__all__
        if isinstance(getattr(savepoint.errors, name), type)
    }
    assert set(drawn) == set(exported), (
        f"the tree in savepoint.errors' docstring misses {sorted(set(exported) - set(drawn))} "
        f"and draws {sorted(set(drawn) - set(exported))}, which it does not export"
    )
    base = savepoint.errors.CheckpointError
    for name, cls in exported.items():
        real = [b.__name__ for b in cls.__bases__ if issubclass(b, base)]
        assert [drawn[name]] == (real or [None]), f"{name} is drawn under {drawn[name]}: {real}"
