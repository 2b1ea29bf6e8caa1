"""Strict, bounded JSON for hostile input.

Strict: duplicate keys, ``NaN``/``Infinity`` and numbers that overflow a 64-bit float (``1e400``)
are errors, not silently taken; so is text that is not UTF-8.

Bounded: Python's ``json`` builds objects nobody can meter while it runs, and they cost far more
than the text that describes them (``[],`` is 3 bytes of text and a 56-byte list). So before
``json.loads`` runs, :func:`check` bounds what parsing could cost from the bytes alone, at C speed
(``bytes.translate`` and numpy over the buffer, strings told apart from structure), and refuses
text nested deeper than ``MAX_DEPTH`` or whose cost could exceed the budget. For every text
:func:`loads` accepts::

    peak traced memory <= MEMORY_FACTOR x len(raw) + MEMORY_SLACK       (24 x input + 32 MiB)

counting the raw bytes, the decoded text and every object built; the densest text that gets in
(one-element lists nested 8 deep, 45 bytes of objects per byte when unchecked) is refused long
before that. Real documents sit far below: a 100,000-tensor manifest costs about 6.5 x its size,
a tree of plain values about 13 x. The estimate is an upper bound made of per-token costs measured
with tracemalloc for CPython's objects (``tests/formats/test_manifest_json.py`` holds it to every
shape we know of, on 3.10 to 3.13; the fuzz targets to random ones). Nesting deeper than ``MAX_DEPTH`` (512) is
refused before parsing, so neither the parser nor a later recursive walk can raise
``RecursionError``, whatever the depth.

The estimate comes in three passes, each run only when the one before cannot clear the text:

1. :func:`_quick`: escapes blanked, everything but ``"[]{},:`` dropped (``bytes.translate``),
   the rest counted; every string and non-container value charged the most it can cost.
2. :func:`census`: exact token counts with byte positions (strings of one byte and one-digit
   numbers are cached by CPython and free; only strings that are not keys cost a string).
3. :func:`_objects_cost`: members counted per object (a small dict costs the same for 1 to 5
   members) and distinct keys counted (``json`` shares repeated keys).

Real manifests stop after the first pass (about 5% of their parse time).
"""

from __future__ import annotations

import json
import math
import re
import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "Census",
    "MAX_DEPTH",
    "MEMORY_FACTOR",
    "MEMORY_SLACK",
    "StrictJSONError",
    "census",
    "check",
    "loads",
    "loads_counted",
    "members",
    "quick_counts",
]

MAX_DEPTH = 512
MEMORY_FACTOR = 24
MEMORY_SLACK = 32 << 20

# Worst-case bytes per token, measured with tracemalloc (64-bit CPython 3.10 to 3.13) on the
# densest texts of each kind (tests/formats/test_manifest_json.py): a list with its
# over-allocated item array; a small dict plus the pairs list our hook receives; a member (its
# tuple, dict entry, key string and memo entry, keys all distinct); a slot in a container; a
# string (any width, and ASCII only); a number.
_LIST = 104
_OBJECT = 280
_PAIR = 240
_SLOT = 9
_STRING = 80
_ASCII_STRING = 56
_SCALAR = 32
# The precise pass: a dict of up to 5 members, and of more (base + per member); the growth of the
# largest dict; tuples and list slots of the pairs our hook receives; a pairs list; a distinct
# key (its string and memo entry). A text the census charges more than _REFINE_LIMIT times the
# budget is refused without the precise pass (the census overcharges real documents 3 x at most).
_DICT_SMALL = 176
_DICT_BASE = 64
_DICT_MEMBER = 48
_RESIZE = 24
_TRANSIENT = 65
_PAIRS_LIST = 104
_KEY = 144
_REFINE_LIMIT = 8
if sys.version_info < (3, 11):  # dicts are larger before 3.11
    _OBJECT, _PAIR, _DICT_SMALL, _DICT_MEMBER = 330, 270, 240, 60
_CHUNK = 1 << 18  # bytes per numpy pass: its temporaries take a few MiB at most

# Byte classes for the census: 1 quote, 2 backslash, 3 '[', 4 '{', 5 ']', 6 '}', 7 ',', 8 ':'.
_CLASS = np.zeros(256, np.uint8)
for _i, _ch in enumerate(b'"\\[{]},:', start=1):
    _CLASS[_ch] = _i
_DEPTH = np.array([0, 0, 0, 1, 1, -1, -1, 0, 0], np.int32)
# What the first byte after '[', ',' or ':' starts: 0 a number (or whitespace: assume the worst),
# 1 a string, 2 a container or nothing (']', '}'), 3 a literal (true, false, null: no object).
_FIRST = np.zeros(256, np.uint8)
_FIRST[ord('"')] = 1
for _ch in b"[]{}":
    _FIRST[_ch] = 2
for _ch in b"tfn":
    _FIRST[_ch] = 3
_NOT_SPECIAL = bytes(b for b in range(256) if b not in b'"[]{},:')
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abAB]")


class StrictJSONError(ValueError):
    pass


@dataclass(frozen=True)
class Census:
    """Token counts of a JSON text outside strings, as :func:`census` found them.

    ``width`` is the bytes per character of the decoded text and ``content`` an upper bound on
    the bytes per character of the strings built from it; ``string_bytes`` is the text inside
    strings of two or more bytes (shorter ones are cached by CPython and cost nothing), and
    ``strings`` counts those strings that are not keys. ``scalars`` counts numbers (and values
    after whitespace, assumed to be numbers) longer than one character.
    """

    size: int
    width: int
    content: int
    ascii: bool
    lists: int
    objects: int
    pairs: int
    commas: int
    strings: int
    string_bytes: int
    scalars: int
    depth: int

    def base_cost(self) -> int:
        """Everything but objects and their members: raw bytes, decoded text, string contents,
        lists, container slots, value strings and numbers."""
        slots = self.commas + self.lists + self.objects + 1
        string = _ASCII_STRING if self.ascii else _STRING
        return (
            self.size * (1 + self.width)
            + self.string_bytes * self.content
            + _LIST * self.lists
            + _SLOT * slots
            + string * self.strings
            + _SCALAR * self.scalars
        )

    def cost(self) -> int:
        """An upper bound on the peak memory of parsing the text (raw bytes included), charging
        every object and member the most one can cost."""
        return self.base_cost() + _OBJECT * self.objects + _PAIR * self.pairs


@dataclass
class _Detail:
    """What the second, precise pass collects: the objects' open, close and ':' events with the
    level of their container, and the byte span of every key."""

    kinds: list[np.ndarray[Any, Any]] = field(default_factory=list)
    levels: list[np.ndarray[Any, Any]] = field(default_factory=list)
    key_starts: list[np.ndarray[Any, Any]] = field(default_factory=list)
    key_ends: list[np.ndarray[Any, Any]] = field(default_factory=list)


def census(raw: bytes, width: int = 1, detail: _Detail | None = None) -> Census:
    """Count the tokens of ``raw`` outside strings, in bounded memory (chunks of 256 KiB).

    A quote counts as escaped when an odd run of backslashes precedes it; the census is exact for
    valid JSON, and for invalid JSON exact up to the first error (all ``json`` ever parses).
    With ``detail`` it also collects what :func:`_objects_cost` needs.
    """
    a = np.frombuffer(raw, np.uint8)
    n = a.size
    in_string = 0
    open_at = -1  # where the string open at a chunk boundary began
    odd_backslashes = False  # the previous chunk ended in an odd run of backslashes
    after_quote = False  # the previous chunk's last special byte was a real quote
    last_quotes = np.array([-1, -1], np.int64)  # where the last two real quotes were
    depth = max_depth = 0
    counts = np.zeros(9, np.int64)
    strings = string_bytes = scalars = 0
    for start in range(0, n, _CHUNK):
        chunk = a[start : start + _CHUNK]
        kinds = _CLASS.take(chunk)
        pos = np.flatnonzero(kinds)
        if pos.size == 0:
            odd_backslashes = False
            continue
        kinds = kinds[pos]
        quote = kinds == 1
        backslash = np.flatnonzero(kinds == 2)
        if backslash.size or odd_backslashes:
            odd_backslashes = _unescape(quote, pos, backslash, odd_backslashes, chunk[-1] == 92)
        # Real quotes up to and including each special byte (only the parity in the fast pass).
        seen = np.cumsum(quote, dtype=np.int64 if detail is not None else np.uint8)
        outside = ((seen & 1) == in_string) & (kinds >= 3)
        structural = kinds[outside]
        counts += np.bincount(structural, minlength=9)
        if structural.size:
            levels = np.cumsum(_DEPTH.take(structural), dtype=np.int32)
            levels += depth
            max_depth = max(max_depth, int(levels.max()))
            depth = int(levels[-1])
            if detail is not None:
                keys = _key_spans(kinds, quote, outside, seen, pos, start, last_quotes, after_quote)
                _collect(detail, structural, levels, keys)
        quoted = np.flatnonzero(quote)
        if quoted.size:
            values, text, open_at = _strings(kinds, pos, start, quoted, in_string, open_at)
            strings += values
            string_bytes += text
            last_quotes = np.concatenate([last_quotes, pos[quoted[-2:]] + start])[-2:]
            in_string ^= quoted.size & 1
        scalars += _numbers(a, kinds, pos, start, outside)
        after_quote = bool(quote[-1])
    content = _content(raw, width)
    return Census(
        size=n,
        width=width,
        content=content,
        ascii=width == 1 and content == 1 and raw.isascii(),
        lists=int(counts[3]),
        objects=int(counts[4]),
        pairs=int(counts[8]),
        commas=int(counts[7]),
        strings=strings,
        string_bytes=string_bytes,
        scalars=scalars + 1,  # the root may be a number too
        depth=max_depth,
    )


def _strings(
    kinds: np.ndarray[Any, Any],
    pos: np.ndarray[Any, Any],
    start: int,
    quoted: np.ndarray[Any, Any],
    in_string: int,
    open_at: int,
) -> tuple[int, int, int]:
    """For the strings that end in this chunk: how many of two or more bytes are not keys (no
    ':' right after), and how many bytes those of two or more hold; plus where the string still
    open at the end of the chunk began."""
    at = pos[quoted] + start
    if in_string:
        opens = np.concatenate([np.array([open_at], np.int64), at[1::2]])
        closing = quoted[0::2]
    else:
        opens = at[0::2]
        closing = quoted[1::2]
    if opens.size > closing.size:
        open_at = int(opens[-1])
        opens = opens[: closing.size]
    length = pos[closing] + start - opens - 1
    long = length >= 2
    nxt = closing + 1
    key = np.zeros(closing.size, bool)
    within = nxt < kinds.size
    key[within] = kinds[nxt[within]] == 8
    return int(np.count_nonzero(long & ~key)), int(length[long].sum()), open_at


def _numbers(
    a: np.ndarray[Any, Any],
    kinds: np.ndarray[Any, Any],
    pos: np.ndarray[Any, Any],
    start: int,
    outside: np.ndarray[Any, Any],
) -> int:
    """Values after this chunk's '[', ',' and ':' that may be number objects: not a string,
    container or literal, and longer than one byte (0-9 are cached by CPython)."""
    seps = np.flatnonzero(outside & ((kinds == 3) | (kinds == 7) | (kinds == 8)))
    after = pos[seps] + (start + 1)
    np.minimum(after, a.size - 1, out=after)
    number = _FIRST.take(a.take(after)) == 0
    nxt = seps + 1
    within = nxt < kinds.size
    tiny = np.zeros(seps.size, bool)
    tiny[within] = pos[nxt[within]] - pos[seps[within]] == 2
    return int(np.count_nonzero(number & ~tiny))


def _key_spans(
    kinds: np.ndarray[Any, Any],
    quote: np.ndarray[Any, Any],
    outside: np.ndarray[Any, Any],
    seen: np.ndarray[Any, Any],
    pos: np.ndarray[Any, Any],
    start: int,
    last_quotes: np.ndarray[Any, Any],
    after_quote: bool,
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """Byte spans ``[begin, end)`` of the keys before this chunk's ':' outside strings: the text
    between the last two real quotes, taken only where a real quote is the special byte right
    before the ':' (as in valid JSON), so spans never overlap and add up to at most the text."""
    colon = np.flatnonzero(outside & (kinds == 8))
    if colon.size == 0:
        return colon, colon
    before = np.zeros(colon.size, bool)
    before[colon > 0] = quote[colon[colon > 0] - 1]
    if colon[0] == 0:
        before[0] = after_quote
    colon = colon[before]
    quote_at = np.concatenate([last_quotes, pos[quote] + start])
    close = seen[colon] + 1  # index in quote_at of the key's closing quote
    begin = quote_at[close - 1] + 1
    end = quote_at[close]
    ok = begin > 0
    return begin[ok], end[ok]


def _collect(
    detail: _Detail,
    structural: np.ndarray[Any, Any],
    levels: np.ndarray[Any, Any],
    keys: tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]],
) -> None:
    """Keep one chunk's object events with their container's level (a closing bracket belongs
    to the level it closes) and its key spans."""
    keep = (structural == 4) | (structural == 6) | (structural == 8)
    kinds = structural[keep]
    detail.kinds.append(kinds)
    detail.levels.append((levels[keep] + (kinds == 6)).astype(np.int16))
    detail.key_starts.append(keys[0])
    detail.key_ends.append(keys[1])


def _unescape(
    quote: np.ndarray[Any, Any],
    pos: np.ndarray[Any, Any],
    backslash: np.ndarray[Any, Any],
    odd_before: bool,
    ends_in_backslash: bool,
) -> bool:
    """Clear the escaped quotes in ``quote`` (one chunk, compressed to its special bytes at
    ``pos``); ``backslash`` indexes the backslashes. Returns whether the chunk ends in an odd run
    of backslashes (so the next chunk's first byte is escaped)."""
    where = pos[backslash]  # byte offsets of the backslashes in the chunk
    q = np.flatnonzero(quote)
    run_start = np.zeros(0, np.int64)
    if where.size:
        new_run = np.ones(where.size, bool)
        np.not_equal(where[1:], where[:-1] + 1, out=new_run[1:])
        run_start = np.maximum.accumulate(np.where(new_run, where, 0))
    if q.size:
        at = pos[q]
        escaped = np.zeros(q.size, bool)
        if where.size:
            i = np.minimum(np.searchsorted(where, at - 1), where.size - 1)
            touching = where[i] == at - 1
            length = at - run_start[i] + (odd_before & (run_start[i] == 0))
            escaped = touching & (length % 2 == 1)
        if odd_before:
            escaped |= at == 0
        quote[q[escaped]] = False
    if not ends_in_backslash:
        return False
    length = int(where[-1] - run_start[-1] + 1)
    if run_start[-1] == 0 and odd_before:
        length += 1
    return length % 2 == 1


def _objects_cost(raw: bytes, detail: _Detail, budget: int) -> int:
    """The precise cost of the objects: each dict as CPython sizes it for its member count, the
    pairs lists and tuples of the largest open object at each level (all that can be alive at
    once), and one key string plus memo entry per distinct key. Stops counting keys once the
    total passes ``budget`` (the set of keys is what costs memory here)."""
    kinds = np.concatenate(detail.kinds) if detail.kinds else np.zeros(0, np.uint8)
    levels = np.concatenate(detail.levels) if detail.levels else np.zeros(0, np.int16)
    detail.kinds.clear()
    detail.levels.clear()
    # Sorted by level (stable), the events of each level read "{ : : } { : }": every object's
    # members follow its opening bracket.
    order = np.argsort(levels, kind="stable")
    kinds = kinds[order]
    levels = levels[order]
    del order
    is_open = kinds == 4
    owner = np.cumsum(is_open, dtype=np.int32)  # object number (1-based) of each event
    objects = int(owner[-1]) if owner.size else 0
    members = np.bincount(owner[kinds == 8], minlength=objects + 1)[1:]
    owner_level = levels[is_open]
    del kinds, levels, is_open, owner
    small = members <= 5
    cost = _DICT_SMALL * int(np.count_nonzero(small))
    cost += int(np.sum(_DICT_BASE + _DICT_MEMBER * members[~small]))
    if members.size:
        cost += _RESIZE * int(members.max())
        # Objects are grouped by level; the largest member count of each level.
        bounds = np.flatnonzero(np.diff(owner_level, prepend=-1))
        largest = np.maximum.reduceat(members, bounds)
        cost += _TRANSIENT * int(largest.sum()) + _PAIRS_LIST * int(bounds.size)
    return cost + _KEY * _distinct_keys(raw, detail, (budget - cost) // _KEY)


def _distinct_keys(raw: bytes, detail: _Detail, limit: int) -> int:
    """How many distinct keys the document holds, or ``limit + 1`` if more than ``limit``."""
    seen: set[bytes] = set()
    step = 1 << 14
    for starts, ends in zip(detail.key_starts, detail.key_ends):
        for i in range(0, starts.size, step):
            spans = map(slice, starts[i : i + step].tolist(), ends[i : i + step].tolist())
            seen.update(map(raw.__getitem__, spans))
            if len(seen) > limit:
                return max(limit, 0) + 1
    return len(seen)


def _content(raw: bytes, width: int) -> int:
    """Bytes per character, at most, of the strings parsed from ``raw`` (whose decoded text has
    ``width``): escapes can make wider characters than the text holds."""
    # One-byte searches run at memchr speed; a two-byte one is several times slower.
    if raw.find(b"\\") < 0 or b"\\u" not in raw:
        return width
    return 4 if _SURROGATE_ESCAPE.search(raw) else max(width, 2)


def _quick(raw: bytes, width: int) -> tuple[int, int]:
    """The nesting depth of ``raw`` and a coarse upper bound on the cost of parsing it, at the
    speed of ``bytes.translate``: escapes are blanked, everything but ``"[]{},:`` dropped, and
    the rest counted as :meth:`Census.cost` does, charging every string and every value that is
    not a string or container the most it can cost."""
    depth, cost, _ = quick_counts(raw, width)
    return depth, cost


def quick_counts(raw: bytes, width: int) -> tuple[int, int, int]:
    """:func:`_quick`, and the number of ``:`` outside strings (for valid JSON, the members of
    all its objects)."""
    text = raw
    if raw.find(b"\\") >= 0:
        # Runs of backslashes pair up from their start, as escapes do inside strings.
        text = raw.replace(b"\\\\", b"..").replace(b'\\"', b"..")
    special = np.frombuffer(text.translate(None, _NOT_SPECIAL), np.uint8)
    del text
    in_string = 0
    depth = max_depth = 0
    counts = np.zeros(9, np.int64)
    quotes = scalars = 0
    step = _CHUNK
    for start in range(0, special.size, step):
        chunk = special[start : start + step + 1]  # one more: what follows the last separator
        kinds = _CLASS.take(chunk[:step])
        quote = kinds == 1
        parity = np.cumsum(quote, dtype=np.uint8)
        parity &= 1
        outside = (parity == in_string) & ~quote
        structural = kinds[outside]
        counts += np.bincount(structural, minlength=9)
        if structural.size:
            levels = np.cumsum(_DEPTH.take(structural), dtype=np.int32)
            levels += depth
            max_depth = max(max_depth, int(levels.max()))
            depth = int(levels[-1])
        # A value that is neither a string nor a container ends at the next ',', ']', '}'.
        opens = np.flatnonzero(outside & ((kinds == 3) | (kinds == 7) | (kinds == 8))) + 1
        follows = _CLASS.take(chunk.take(opens, mode="clip"))
        scalars += int(np.count_nonzero(follows >= 5)) + int(opens.size and opens[-1] >= chunk.size)
        found = int(np.count_nonzero(quote))
        quotes += found
        in_string ^= found & 1
    n = len(raw)
    content = _content(raw, width)
    string = _ASCII_STRING if width == 1 and content == 1 and raw.isascii() else _STRING
    lists, objects, commas, pairs = (int(counts[i]) for i in (3, 4, 7, 8))
    cost = (
        n * (1 + width + content)
        + _LIST * lists
        + _OBJECT * objects
        + _PAIR * pairs
        + _SLOT * (commas + lists + objects + 1)
        + string * max((quotes + 1) // 2 - pairs, 0)
        + _SCALAR * (scalars + 1)
    )
    return max_depth, cost, pairs


def check(
    raw: bytes,
    *,
    width: int = 1,
    max_depth: int = MAX_DEPTH,
    memory_factor: float = MEMORY_FACTOR,
    memory_slack: int = MEMORY_SLACK,
) -> None:
    """Refuse (StrictJSONError) text nested deeper than ``max_depth`` or that could cost more
    than ``memory_factor x len(raw) + memory_slack`` to parse.

    Three passes, each only when the one before cannot clear the text: a coarse one at the speed
    of ``bytes.translate`` (real documents stop here), the census (exact token counts, short
    strings and one-digit numbers free), and a precise one (members per object, distinct keys).
    """
    _check(raw, width, max_depth, memory_factor, memory_slack)


def _check(
    raw: bytes, width: int, max_depth: int, memory_factor: float, memory_slack: int
) -> int | None:
    """:func:`check`; returns the members its first pass counted (None for a text too small
    for that pass to run)."""
    n = len(raw)
    budget = int(memory_factor * n + memory_slack)
    # Below these sizes no document can break either limit.
    if n * 64 <= budget and raw.count(b"[") + raw.count(b"{") <= max_depth:
        return None
    depth, cost, pairs = quick_counts(raw, width)
    if depth > max_depth:
        raise StrictJSONError(f"nested deeper than {max_depth} levels")
    if cost <= budget:
        return pairs
    found = census(raw, width)
    cost = found.cost()
    if cost <= budget:
        return pairs
    base = found.base_cost()
    if base <= budget and cost <= _REFINE_LIMIT * budget:
        detail = _Detail()
        census(raw, width, detail)
        cost = base + _objects_cost(raw, detail, budget - base)
        if cost <= budget:
            return pairs
    raise StrictJSONError(
        f"too many values for its size: parsing {n} bytes could take {cost} bytes of memory, "
        f"over the {memory_factor:g} x size + {memory_slack >> 20} MiB bound ({found.lists} "
        f"arrays, {found.objects} objects, {found.pairs} members, {found.commas} commas)"
    )


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise StrictJSONError(f"duplicate key {k!r}")
            seen.add(k)
    return out


def _no_constant(name: str) -> Any:
    raise StrictJSONError(f"non-standard number {name}")


def _finite(text: str) -> float:
    value = float(text)
    if math.isfinite(value):
        return value
    raise StrictJSONError(f"number {text[:40]} is out of range for a 64-bit float")


def _width(raw: bytes) -> int:
    """Bytes per character of ``raw`` decoded (an upper bound): UTF-8 lead bytes below 0xC4
    encode at most U+00FF, below 0xF0 at most U+FFFF."""
    if raw.isascii():
        return 1
    top = int(np.frombuffer(raw, np.uint8).max())
    return 1 if top < 0xC4 else 2 if top < 0xF0 else 4


def members(value: Any) -> int:
    """How many members all the objects in a parsed ``value`` hold (iteratively: any depth)."""
    count = 0
    stack = [value]
    while stack:
        item = stack.pop()
        if type(item) is dict:
            count += len(item)
            stack.extend(v for v in item.values() if type(v) is dict or type(v) is list)
        elif type(item) is list:
            stack.extend(v for v in item if type(v) is dict or type(v) is list)
    return count


def _serde_int(text: str) -> int | float:
    # serde_json reads "-0" as the float -0.0 (it only ever makes negative integers below 0).
    return -0.0 if text == "-0" else int(text)


def loads(
    raw: bytes,
    error: type[ValueError],
    what: str,
    *,
    max_depth: int = MAX_DEPTH,
    memory_factor: float = MEMORY_FACTOR,
    memory_slack: int = MEMORY_SLACK,
    serde: bool = False,
    strict: bool = True,
) -> Any:
    """Parse UTF-8 JSON under the limits above, raising ``error`` with a message naming ``what``
    on any problem (never RecursionError, MemoryError or a UnicodeError).

    ``serde`` reads numbers as Rust's serde_json does, for documents a Rust program wrote: ``-0``
    is the float ``-0.0``, and a float too large for 64 bits (``1e400``) is left as ``inf`` for
    the caller to refuse by field name (serde_json refuses it only where a value is read, and
    skips unknown members).

    ``strict=False`` keeps the bounds (nesting, memory, UTF-8) but parses as Python's ``json``
    does, for the run files Python's ``json.dumps`` writes (``report.json``, ``run.json``, the
    history log): ``NaN`` and ``Infinity`` are read (a metric may be NaN), and a repeated key
    keeps its last value.
    """
    try:
        # The check runs on the bytes, before the decoded text exists: its own buffers and the
        # text are never alive together.
        check(
            raw,
            width=_width(raw),
            max_depth=max_depth,
            memory_factor=memory_factor,
            memory_slack=memory_slack,
        )
        if not strict:
            return json.loads(raw.decode("utf-8"))
        return json.loads(
            raw.decode("utf-8"),
            object_pairs_hook=_no_duplicates,
            parse_constant=_no_constant,
            parse_float=float if serde else _finite,
            parse_int=_serde_int if serde else None,  # None: json's own (C) int parsing
        )
    except StrictJSONError as exc:
        raise error(f"{what} is not valid JSON: {exc}") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise error(f"{what} is not valid JSON: {exc}") from None


def loads_counted(
    raw: bytes,
    error: type[ValueError],
    what: str,
    *,
    max_depth: int = MAX_DEPTH,
    memory_factor: float = MEMORY_FACTOR,
    memory_slack: int = MEMORY_SLACK,
) -> tuple[Any, int | None]:
    """:func:`loads`, with the duplicate-key check left to a caller that walks the document
    anyway: returns the document and the number of members its text holds (``:`` outside
    strings, from :func:`check`'s first pass).

    ``json`` keeps one member per key, so the objects of the document hold fewer members than
    that number exactly when some object repeats a key: the caller counts (:func:`members`
    counts what it does not walk itself) and, on a shortfall, calls :func:`loads`, which names
    the repeated key. The per-object hook that checks for repeats cost a third of parsing a
    100,000-tensor manifest. For a text too small for the first pass to run (under about
    1 MB) the count is None and duplicates were refused here, as :func:`loads` does."""
    try:
        width = _width(raw)
        pairs = _check(raw, width, max_depth, memory_factor, memory_slack)
        if pairs is None:
            return loads(
                raw,
                error,
                what,
                max_depth=max_depth,
                memory_factor=memory_factor,
                memory_slack=memory_slack,
            ), None
        return json.loads(
            raw.decode("utf-8"),
            parse_constant=_no_constant,
            parse_float=_finite,
        ), pairs
    except StrictJSONError as exc:
        raise error(f"{what} is not valid JSON: {exc}") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise error(f"{what} is not valid JSON: {exc}") from None
