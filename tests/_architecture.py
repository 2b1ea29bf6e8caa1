"""docs/architecture.md as data, and the checkers that hold the code to it.

The doc is the single source: ``tests/test_layers.py`` and ``tests/test_sizes.py`` read its tables
(the layer table, the upward imports, the private names of ``CheckpointManager`` used elsewhere, the
size limits and their exceptions) and measure the code with ``ast`` (nothing is imported). Each
checker takes the package root as an argument, so the tests run it on small fake trees as well.

Modules are named by their path relative to the package root (``engine/save.py``,
``engine/__init__.py``, ``__init__.py``); a *unit* is what a row of the layer table names: a
package (``engine/``) or a top-level module (``checkpoint.py``).
"""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "architecture.md"
SRC = REPO / "src" / "savepoint"

KINDS = ("module", "lazy", "type-checking")

# ---------------------------------------------------------------------------------------------
# The doc
# ---------------------------------------------------------------------------------------------


def sections(text: str) -> dict[str, str]:
    """Each heading's title (without its ``#``) -> the text up to the next heading of any level."""
    found: dict[str, str] = {}
    title, body = "", []
    fenced = False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        if not fenced and re.match(r"#{1,6} ", line):
            found[title] = "\n".join(body)
            title, body = line.lstrip("#").strip(), []
        else:
            body.append(line)
    found[title] = "\n".join(body)
    return found


def cells(line: str) -> list[str]:
    """The cells of one table row; a ``|`` inside backticks does not split."""
    out, cell, ticked = [], "", False
    for ch in line.strip().strip("|"):
        if ch == "`":
            ticked = not ticked
        if ch == "|" and not ticked:
            out.append(cell.strip())
            cell = ""
        else:
            cell += ch
    out.append(cell.strip())
    return out


def table(body: str) -> list[list[str]]:
    """The rows (header and separator left out) of the first table in ``body``."""
    rows: list[list[str]] = []
    for line in body.splitlines():
        if line.startswith("|"):
            rows.append(cells(line))
        elif rows:
            break
    return [r for r in rows[1:] if not all(set(c) <= set("-: ") for c in r)]


def ticked(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def doc_table(title: str, doc: str | None = None) -> list[list[str]]:
    found = sections(DOC.read_text(encoding="utf-8") if doc is None else doc)
    assert title in found, f"docs/architecture.md has no section {title!r}"
    return table(found[title])


def layer_rows(doc: str | None = None) -> list[list[str]]:
    """The units of each row of the layer table, top row first."""
    rows = [[u for u in ticked(r[0]) if u.endswith(("/", ".py"))] for r in doc_table("Layers", doc)]
    assert rows and all(rows), "the layer table's first column names no unit on some row"
    return rows


def upward_exceptions(doc: str | None = None) -> dict[tuple[str, str, str], str]:
    """(module, imported module, kind) -> reason, from "Upward imports"."""
    out = {}
    for row in doc_table("Upward imports", doc):
        module, target, kind, reason = row[0].strip("`"), row[1].strip("`"), row[2], row[3]
        assert kind in KINDS, f"Upward imports: kind {kind!r} is none of {KINDS}"
        assert reason, f"Upward imports: {module} -> {target} gives no reason"
        out[(module, target, kind)] = reason
    return out


def manager_exceptions(doc: str | None = None) -> set[tuple[str, str]]:
    """(module, private name) pairs listed under "Private names"."""
    out = set()
    for row in doc_table("Private names", doc):
        assert re.search(r"issue \d+", row[2]), f"Private names: {row[:2]} names no issue"
        out |= {(row[0].strip("`"), name) for name in ticked(row[1])}
    return out


# ---------------------------------------------------------------------------------------------
# Modules and units
# ---------------------------------------------------------------------------------------------


@functools.cache
def parse(path: Path) -> tuple[str, ast.Module]:
    """A module's text and tree, read once per test session."""
    text = path.read_text(encoding="utf-8")
    return text, ast.parse(text)


def modules(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py"))


def unit(module: str) -> str:
    """``engine/save.py`` -> ``engine/``; ``checkpoint.py`` -> ``checkpoint.py``."""
    first, _, rest = module.partition("/")
    return first + "/" if rest else first


def dotted(root: Path, module: str) -> str:
    parts = [root.name, *module[: -len(".py")].split("/")]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_of(root: Path, name: str) -> str | None:
    """The module (path) that the dotted ``name`` imports, or None if it is no module of root."""
    parts = name.split(".")
    if parts[0] != root.name:
        return None
    rel = "/".join(parts[1:])
    if (root / rel / "__init__.py").is_file():
        return f"{rel}/__init__.py" if rel else "__init__.py"
    if rel and (root / f"{rel}.py").is_file():
        return f"{rel}.py"
    return None


# ---------------------------------------------------------------------------------------------
# Imports
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Import:
    module: str  # the importing module
    line: int
    target: str  # the imported module
    kind: str  # "module", "lazy" or "type-checking"


def _type_checking(test: ast.expr) -> bool | None:
    """True for ``TYPE_CHECKING`` (or ``typing.TYPE_CHECKING``), False for its negation."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        inner = _type_checking(test.operand)
        return None if inner is None else not inner
    name = test.id if isinstance(test, ast.Name) else getattr(test, "attr", None)
    return True if name == "TYPE_CHECKING" else None


def imports(root: Path, module: str) -> Iterator[Import]:
    """Every import of a module of ``root`` that ``module`` makes, wherever it is made.

    ``from pkg import name`` imports ``pkg.name`` when that is a module, else ``pkg``;
    ``import pkg.mod`` imports ``pkg.mod``; relative imports are resolved."""
    tree = parse(root / module)[1]
    name = dotted(root, module)
    package = name if module.endswith("__init__.py") else name.rpartition(".")[0]

    def found(node: ast.Import | ast.ImportFrom) -> Iterator[str]:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if (target := module_of(root, alias.name)) is not None:
                    yield target
            return
        source = node.module or ""
        if node.level:
            base = package.split(".")[: len(package.split(".")) - node.level + 1]
            source = ".".join([*base, source] if source else base)
        for alias in node.names:
            target = module_of(root, f"{source}.{alias.name}") or module_of(root, source)
            if target is not None:
                yield target

    def visit(node: ast.AST, lazy: bool, typing_only: bool) -> Iterator[Import]:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            kind = "type-checking" if typing_only else "lazy" if lazy else "module"
            for target in dict.fromkeys(found(node)):
                yield Import(module, node.lineno, target, kind)
            return
        if isinstance(node, ast.If) and (guard := _type_checking(node.test)) is not None:
            for child in node.body:
                yield from visit(child, lazy, typing_only or guard)
            for child in node.orelse:
                yield from visit(child, lazy, typing_only or not guard)
            return
        inner = lazy or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            yield from visit(child, inner, typing_only)

    yield from visit(tree, False, False)


def layer_problems(
    root: Path,
    rows: list[list[str]],
    allowed: Iterable[tuple[str, str, str]] = (),
    shown: str = "",
) -> tuple[list[str], set[tuple[str, str, str]]]:
    """Every import against the layer table ``rows`` that ``allowed`` does not list (messages
    naming the module, the line and the rule), and the listed exceptions that were used.
    ``shown``: how messages name ``root`` (``src/savepoint/``)."""
    rank = {u: i for i, row in enumerate(rows) for u in row}
    allowed = set(allowed)
    problems: list[str] = []
    used: set[tuple[str, str, str]] = set()
    for module in modules(root):
        here = unit(module)
        if here not in rank:
            problems.append(
                f"{shown}{module}: {here} is in no row of the layer table of "
                "docs/architecture.md: add it to the row of its layer"
            )
            continue
        for imp in imports(root, module):
            there = unit(imp.target)
            if there == here or there not in rank or rank[there] > rank[here]:
                continue  # (a unit in no row is reported as such, once)
            key = (imp.module, imp.target, imp.kind)
            if key in allowed:
                used.add(key)
                continue
            where = f"{shown}{module}:{imp.line}: {here} (row {rank[here] + 1})"
            what = f"imports {imp.target} ({imp.kind})"
            if rank[there] == rank[here]:
                rule = (
                    f"{there} shares its row: units on one row of the layer table are peers "
                    "and do not import each other"
                )
            else:
                rule = (
                    f"{there} is row {rank[there] + 1}, above it: a layer imports only the "
                    "rows below its own"
                )
            problems.append(
                f"{where} {what}; {rule} (docs/architecture.md, 'Layers'). Move the code down, "
                "or list the import under 'Upward imports' with its reason"
            )
    return problems, used


# ---------------------------------------------------------------------------------------------
# CheckpointManager's private names
# ---------------------------------------------------------------------------------------------


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _terminal(node: ast.expr) -> str | None:
    """``CheckpointManager`` for ``CheckpointManager``, ``sp.CheckpointManager`` or a call's
    function of either form."""
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def private_names(source: str, cls: str) -> set[str]:
    """The private names class ``cls`` of ``source`` defines: its methods, its class
    attributes, and the ``self._x`` attributes its methods set."""
    names: set[str] = set()
    for node in ast.parse(source).body:
        if not (isinstance(node, ast.ClassDef) and node.name == cls):
            continue
        for item in node.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(item.name)
            targets = (
                item.targets
                if isinstance(item, ast.Assign)
                else [item.target]
                if isinstance(item, ast.AnnAssign)
                else []
            )
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        for sub in ast.walk(node):
            if (
                isinstance(sub, ast.Attribute)
                and isinstance(sub.ctx, ast.Store)
                and isinstance(sub.value, ast.Name)
                and sub.value.id == "self"
            ):
                names.add(sub.attr)
    return {n for n in names if _private(n)}


def touches(source: str, cls: str, names: set[str]) -> Iterator[tuple[int, str]]:
    """Where ``source`` (another module than ``cls``'s own) touches one of ``names``, private
    names of class ``cls``: (line, name) for

    - a subclass of ``cls`` (found by name, in this module) that defines one or uses it on
      ``self`` or ``cls``;
    - ``X._name`` where ``X`` is ``cls`` or a subclass (class attribute), or an expression
      bound in this module to an instance of either (``m = CheckpointManager(...)``,
      ``self._m = Sub(...)``, ``with CheckpointManager(...) as m``, or annotated with ``cls``);
    - ``getattr``/``setattr``/``hasattr``/``delattr`` of one on such an expression.

    A static look by names, within one module: it does not follow values through calls, and a
    module that never writes ``cls`` is not looked at."""
    if not re.search(rf"\b{re.escape(cls)}\b", source):
        return
    tree = ast.parse(source)
    classes = {cls}
    subclasses: list[ast.ClassDef] = []
    grew = True
    while grew:
        grew = False
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.ClassDef)
                and node.name not in classes
                and any(_terminal(b) in classes for b in node.bases)
            ):
                classes.add(node.name)
                subclasses.append(node)
                grew = True
    mentions = re.compile(r"\b(" + "|".join(map(re.escape, sorted(classes))) + r")\b")
    bound: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if isinstance(node.value, ast.Call) and _terminal(node.value) in classes:
                bound |= {ast.unparse(t) for t in targets}
        if isinstance(node, ast.AnnAssign) and mentions.search(ast.unparse(node.annotation)):
            bound.add(ast.unparse(node.target))
        if (
            isinstance(node, ast.arg)
            and node.annotation is not None
            and mentions.search(ast.unparse(node.annotation))
        ):
            bound.add(node.arg)
        if (
            isinstance(node, ast.withitem)
            and node.optional_vars is not None
            and isinstance(node.context_expr, ast.Call)
            and _terminal(node.context_expr) in classes
        ):
            bound.add(ast.unparse(node.optional_vars))
    inside: set[int] = set()
    for sub in subclasses:
        for item in sub.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name in names:
                yield item.lineno, item.name
            targets = (
                item.targets
                if isinstance(item, ast.Assign)
                else [item.target]
                if isinstance(item, ast.AnnAssign)
                else []
            )
            for t in targets:
                if isinstance(t, ast.Name) and t.id in names:
                    yield item.lineno, t.id
        inside |= {id(n) for n in ast.walk(sub)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in names:
            receiver = node.value
            text = ast.unparse(receiver)
            if (
                text in bound
                or (
                    isinstance(receiver, (ast.Name, ast.Attribute))
                    and _terminal(receiver) in classes
                )
                or (id(node) in inside and text in ("self", "cls"))
            ):
                yield node.lineno, node.attr
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in names
            and (
                ast.unparse(node.args[0]) in bound
                or _terminal(node.args[0]) in classes
                or (id(node) in inside and ast.unparse(node.args[0]) in ("self", "cls"))
            )
        ):
            yield node.lineno, str(node.args[1].value)


# ---------------------------------------------------------------------------------------------
# Sizes
# ---------------------------------------------------------------------------------------------


def _defs(node: ast.AST, prefix: str = "") -> Iterator[tuple[str, str, int]]:
    """(kind, qualified name, lines) of every class and function inside ``node``."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            kind = "class" if isinstance(child, ast.ClassDef) else "function"
            name = prefix + child.name
            assert child.end_lineno is not None
            yield kind, name, child.end_lineno - child.lineno + 1
            yield from _defs(child, name + ".")
        else:
            yield from _defs(child, prefix)


def sizes(root: Path) -> Iterator[tuple[str, str, int]]:
    """(kind, what, lines) for every file, class and function under ``root``: ``what`` is the
    module (``engine/read.py``) or ``module:qualified.name`` (``engine/read.py:Reader.open``).
    A class or function spans its ``class``/``def`` line to its last line (decorators left out)."""
    for module in modules(root):
        text, tree = parse(root / module)
        yield "file", module, len(text.splitlines())
        for kind, name, lines in _defs(tree):
            yield kind, f"{module}:{name}", lines


def size_limits(doc: str | None = None) -> dict[str, int]:
    return {row[0]: int(row[1]) for row in doc_table("Size limits", doc)}


def size_ceilings(doc: str | None = None) -> dict[tuple[str, str], tuple[int, str]]:
    """(kind, what) -> (ceiling, reason), from "Known exceptions" under "Size limits"."""
    out = {}
    for row in doc_table("Known exceptions", doc):
        what, kind, ceiling, reason = row[0].strip("`"), row[1], int(row[2]), row[3]
        assert reason, f"Known exceptions: {what} gives no reason"
        out[(kind, what)] = (ceiling, reason)
    return out


def size_problems(
    measured: Iterable[tuple[str, str, int]],
    limits: dict[str, int],
    ceilings: dict[tuple[str, str], tuple[int, str]],
    shown: str = "",
) -> list[str]:
    problems = []
    for kind, what, lines in measured:
        listed = ceilings.get((kind, what))
        if listed is not None:
            if lines > listed[0]:
                problems.append(
                    f"{shown}{what}: {kind} of {lines} lines, grown past its ceiling of "
                    f"{listed[0]} in docs/architecture.md ('Known exceptions'): it may shrink, "
                    "not grow"
                )
        elif lines > limits[kind]:
            problems.append(
                f"{shown}{what}: {kind} of {lines} lines, over the limit of {limits[kind]} "
                "(docs/architecture.md, 'Size limits'): split it"
            )
    return problems
