"""Size limits: no file over 700 lines, no class over 400, no function over 80 (issue 26).

The limits and the known exceptions, each with its ceiling (its size when the limit came) and its
reason, are read from docs/architecture.md ("Size limits", "Known exceptions"). A file, class or
function over its limit and not listed fails, and so does a listed one grown past its ceiling; a
listed one may shrink.

``python tests/test_sizes.py`` prints everything over the limits, with its ceiling.
"""

from __future__ import annotations

from pathlib import Path

from _architecture import SRC, size_ceilings, size_limits, size_problems, sizes


def test_nothing_grows_past_the_size_limits() -> None:
    problems = size_problems(sizes(SRC), size_limits(), size_ceilings(), "src/savepoint/")
    assert not problems, "\n".join(problems)


def test_the_known_exceptions_are_over_the_limits_when_listed() -> None:
    """A ceiling at or under its limit is no exception: the row must go."""
    limits = size_limits()
    assert set(limits) == {"file", "class", "function"}
    low = [
        f"{what} ({kind})" for (kind, what), (c, _) in size_ceilings().items() if c <= limits[kind]
    ]
    assert not low, f"docs/architecture.md lists exceptions within the limits: {low}"


def test_the_size_check_sees_growth_and_new_offenders(tmp_path: Path) -> None:
    root = tmp_path / "savepoint"
    root.mkdir()
    body = "".join(f"    x{i} = {i}\n" for i in range(8))
    (root / "a.py").write_text(
        "import functools\n\n@functools.cache\ndef long():\n" + body + "\ndef short():\n    pass\n",
        encoding="utf-8",
    )
    measured = dict(((kind, what), n) for kind, what, n in sizes(root))
    assert measured[("function", "a.py:long")] == 9  # def to last line, the decorator left out
    assert measured[("file", "a.py")] == 15
    limits = {"file": 100, "class": 100, "function": 5}
    problems = size_problems(sizes(root), limits, {}, "savepoint/")
    assert problems == [
        "savepoint/a.py:long: function of 9 lines, over the limit of 5 (docs/architecture.md, "
        "'Size limits'): split it"
    ]
    assert not size_problems(sizes(root), limits, {("function", "a.py:long"): (9, "why")})
    assert not size_problems(sizes(root), limits, {("function", "a.py:long"): (12, "why")})
    grown = size_problems(sizes(root), limits, {("function", "a.py:long"): (8, "why")})
    assert len(grown) == 1
    assert "grown past its ceiling of 8" in grown[0]


def report() -> None:
    limits, ceilings = size_limits(), size_ceilings()
    for kind, what, lines in sizes(SRC):
        listed = ceilings.get((kind, what))
        if lines > limits[kind] or listed is not None:
            ceiling = f"ceiling {listed[0]}" if listed else "NOT LISTED"
            print(f"{kind:8} {lines:5}  {what}  (limit {limits[kind]}, {ceiling})")


if __name__ == "__main__":
    report()
