"""A short manifest skips the reader-bound count (``_encode._small_clears``): no text that short,
whatever its bytes, may cost a reader more than its memory budget."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from savepoint.codecs import bounded_json as bj
from savepoint.codecs.manifest import _encode

N = _encode._SMALL_TEXT


def _budget(size: int) -> int:
    return int(bj.MEMORY_FACTOR * size + bj.MEMORY_SLACK)


@pytest.mark.parametrize(
    "unit",
    [b":", b",", b"{", b"[", b'"', b"[1,", b'{"a":1,', b":1", b'"\\u00e9"', b"\\", b"[[]]", b"{}"],
)
def test_the_worst_texts_of_the_small_size_fit_the_budget(unit: bytes) -> None:
    text = (unit * (N // len(unit) + 1))[:N]
    _, cost, _ = bj.quick_counts(text, 1)
    assert cost <= _budget(N)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(list(b'{}[]:,"\\u0123456789abc ')), min_size=1, max_size=64))
def test_any_mix_of_structural_bytes_fits(pattern: list[int]) -> None:
    unit = bytes(pattern)
    text = (unit * (N // len(unit) + 1))[:N]
    _, cost, _ = bj.quick_counts(text, 1)
    assert cost <= _budget(N)


def test_deep_or_long_texts_are_still_counted() -> None:
    assert _encode._small_clears(b"[" * 10 + b"]" * 10)
    assert not _encode._small_clears(b"[" * (bj.MAX_DEPTH + 1) + b"]" * (bj.MAX_DEPTH + 1))
    assert not _encode._small_clears(b" " * (N + 1))


def test_a_deep_small_manifest_is_still_refused() -> None:
    """The skip never lets through what a reader refuses: depth is still checked."""
    counter = _encode._Counter()
    text = b"[" * (bj.MAX_DEPTH + 5) + b"]" * (bj.MAX_DEPTH + 5)
    counter.add(text, 0)
    assert not counter.clears(len(text), text)
