"""The bounded JSON reader under every manifest and JSON document: memory, nesting and numbers.

``savepoint.codecs.bounded_json`` promises, for any text it parses::

    peak traced memory <= 24 x len(text) + 32 MiB

and refuses (CheckpointError subclasses, before parsing) text nested deeper than 512 levels or
that could cost more. These tests hold it to the densest shapes known for every kind of token,
check that its estimate really is an upper bound, that real manifests take the fast path, and
that the writer never writes a manifest readers would refuse.
"""

from __future__ import annotations

import json
import random
import statistics
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import savepoint as sp
from savepoint.codecs import bounded_json as _json
from savepoint.codecs import checksum
from savepoint.codecs import manifest as mf

MiB = 1 << 20
BOUND_FACTOR = _json.MEMORY_FACTOR
BOUND_SLACK = _json.MEMORY_SLACK
FILE = "data-00000.safetensors"
DIGEST = "0123456789abcdef"

# The densest texts for each kind of token (bytes of objects per byte of text, unchecked, in
# CPython 3.11: about 23, 25, 13, 9, 5, 15, 45, 32, 25, 29).
DENSE = {
    "empty lists": b"[],",
    "empty objects": b"{},",
    "short strings": b'"ab",',
    "floats": b"0.5,",
    "small ints": b"1,",
    "astral strings": '"\U0001f600",'.encode(),
    "nested lists": b"[[[[[[[[0]]]]]]]],",
    "objects of lists": b'{"":[]},',
    "one-member objects": b'{"":0},',
    "pairs": b"[1,2],",
}


def _array_of(unit: bytes, size: int) -> bytes:
    return b"[" + unit * (size // len(unit)) + b"0]"


def _peak(call: Callable[[], Any]) -> tuple[int, BaseException | None]:
    tracemalloc.start()
    try:
        call()
        error = None
    except Exception as exc:
        error = exc
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak, error


def _forged(value: bytes) -> bytes:
    """A sealed manifest whose metadata is ``{"x": value}`` (``value``: raw JSON)."""
    m = mf.Manifest(tree={"t": "dict", "items": []}, metadata={"x": 0})
    raw = mf.dumps(m)
    head = raw[: raw.rfind(b',\n "manifest_xxh3"')].replace(b'{"x":0}', b'{"x":' + value + b"}")
    return head + f',\n "manifest_xxh3": "{checksum.digest(head)}"\n}}\n'.encode()


# ---------------------------------------------------------------------------------------------
# memory
# ---------------------------------------------------------------------------------------------


# Denser than the bound allows at 8 MiB: refused. (At HEAD the first parsed at 22-29 x, the
# others past the bound: 25 to 45 x.)
REFUSED = {"empty lists", "empty objects", "nested lists", "objects of lists", "one-member objects"}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_dense_manifest_is_refused_before_it_is_parsed(name: str) -> None:
    """At HEAD a manifest whose metadata was 30 MiB of ``[],`` parsed, at 882 MiB (28 GiB at the
    1 GiB cap). Now a text denser than the bound allows is refused before it is parsed, within
    the bound itself."""
    raw = _forged(_array_of(DENSE[name], 8 * MiB))
    peak, error = _peak(lambda: mf.parse(raw))
    assert isinstance(error, sp.CorruptCheckpointError), error
    assert "too many values for its size" in str(error)
    assert peak <= BOUND_FACTOR * len(raw) + BOUND_SLACK, f"{name}: {peak / len(raw):.1f} x"


@pytest.mark.parametrize("size", [MiB // 2, 3 * MiB // 2])
@pytest.mark.parametrize("name", sorted(DENSE))
def test_any_size_parses_under_the_bound_or_is_refused(name: str, size: int) -> None:
    raw = _array_of(DENSE[name], size)
    peak, error = _peak(lambda: _json.loads(raw, sp.CorruptCheckpointError, "text"))
    assert error is None or isinstance(error, sp.CorruptCheckpointError), error
    assert peak <= BOUND_FACTOR * len(raw) + BOUND_SLACK


def _shapes(n: int) -> dict[str, bytes]:
    """Texts of about ``n`` bytes: every dense shape, and the ones each estimate is closest on."""
    out = {name: _array_of(unit, n) for name, unit in DENSE.items()}
    out.update(
        {
            "distinct keys": b"{" + b",".join(b'"%x":0' % i for i in range(n // 9)) + b"}",
            "distinct keys, list values": b"{"
            + b",".join(b'"%x":[]' % i for i in range(n // 10))
            + b"}",
            "six-member objects": _array_of(b'{"":0,"a":0,"b":0,"c":0,"d":0,"e":0},', n),
            "five-member objects": _array_of(b'{"":0,"a":0,"b":0,"c":0,"d":0},', n),
            "value nodes": _array_of(b'{"t":"value","v":0.123},', n),
            "long astral string": ('["\U0001f600' + "a" * n + '"]').encode(),
            "escaped astral string": ('["\\ud83d\\ude00' + "a" * n + '"]').encode(),
            "nine-element lists": _array_of(b"[10,10,10,10,10,10,10,10,10],", n),
            "big ints": b"[" + b",".join([b"9" * 4000] * (n // 4001)) + b"]",
            "whitespace": _array_of(b"[ 1000 , 1000 ] ,", n),
        }
    )
    return out


@pytest.mark.parametrize("name", sorted(_shapes(64)))
def test_every_estimate_is_an_upper_bound(name: str) -> None:
    """Each of the three passes must never underestimate what parsing costs (else the bound
    would not hold for text it lets through)."""
    raw = _shapes(MiB // 2)[name]
    width = _json._width(raw)
    quick = _json._quick(raw, width)[1]
    found = _json.census(raw, width)
    detail = _json._Detail()
    _json.census(raw, width, detail)
    precise = found.base_cost() + _json._objects_cost(raw, detail, 1 << 62)
    # What the estimates bound: the parse itself (the raw bytes, charged too, exist already).
    text = raw.decode("utf-8")
    peak, error = _peak(
        lambda: json.loads(
            text,
            object_pairs_hook=_json._no_duplicates,
            parse_constant=_json._no_constant,
            parse_float=_json._finite,
        )
    )
    assert error is None, error
    slack = 64 << 10  # interpreter noise
    assert peak <= quick + slack, f"quick pass: {peak / len(raw):.2f} > {quick / len(raw):.2f}"
    assert peak <= found.cost() + slack, f"census: {peak / len(raw):.2f}"
    assert peak <= precise + slack, f"precise pass: {peak / len(raw):.2f}"


def _reference(raw: bytes) -> dict[str, int]:
    """Token counts by a byte-at-a-time JSON tokenizer (what census must find)."""
    special = set(b'"\\[{]},:')
    first = {ord('"'): 1, **{c: 2 for c in b"[]{}"}, **{c: 3 for c in b"tfn"}}
    n, in_string, escaped, depth, deepest = len(raw), False, False, 0, 0
    counts = dict.fromkeys(("lists", "objects", "pairs", "commas"), 0)
    strings = string_bytes = scalars = 0
    opened = 0

    def next_special(j: int) -> int:
        while j < n and raw[j] not in special:
            j += 1
        return j

    for i, b in enumerate(raw):
        if in_string:
            if escaped:
                escaped = False
            elif b == 0x5C:
                escaped = True
            elif b == 0x22:
                in_string = False
                length = i - opened - 1
                j = next_special(i + 1)
                if length >= 2:
                    string_bytes += length
                    strings += not (j < n and raw[j] == 0x3A)
            continue
        if b == 0x22:
            in_string, opened = True, i
            continue
        depth += (b in b"[{") - (b in b"]}")
        deepest = max(deepest, depth)
        for key, byte in (("lists", b"["), ("objects", b"{"), ("pairs", b":"), ("commas", b",")):
            counts[key] += b == byte[0]
        if b in b"[,:" and first.get(raw[min(i + 1, n - 1)], 0) == 0:
            j = next_special(i + 1)
            scalars += not (j < n and j - i == 2)
    return {
        **counts,
        "strings": strings,
        "string_bytes": string_bytes,
        "scalars": scalars + 1,
        "depth": deepest,
    }


def _random_doc(rng: random.Random, depth: int = 0) -> Any:
    leaves = [
        0,
        7,
        12,
        -3,
        1.5,
        "",
        "a",
        "ab",
        'q\\"',
        "\\\\",
        "x[]{}:,",
        "é\U0001f600",
        True,
        None,
    ]
    r = rng.random()
    if depth > 5 or r < 0.3:
        return rng.choice(leaves)
    if r < 0.65:
        return [_random_doc(rng, depth + 1) for _ in range(rng.randrange(4))]
    keys = ["k", 'a\\"b', "[", "{}", ":", "\\\\", ""]
    return {rng.choice(keys) + str(i): _random_doc(rng, depth + 1) for i in range(rng.randrange(4))}


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 1 << 18])
def test_census_counts_what_a_tokenizer_counts(monkeypatch: pytest.MonkeyPatch, chunk: int) -> None:
    """Quotes escaped by runs of backslashes, strings and numbers cut by chunk boundaries."""
    monkeypatch.setattr(_json, "_CHUNK", chunk)
    rng = random.Random(chunk)
    for _ in range(150):
        separators = rng.choice([(",", ":"), (", ", ": ")])
        raw = json.dumps(
            _random_doc(rng), ensure_ascii=rng.random() < 0.5, separators=separators
        ).encode()
        want = _reference(raw)
        found = _json.census(raw, _json._width(raw))
        got = {k: getattr(found, k) for k in want}
        quick_depth, quick_cost = _json._quick(raw, _json._width(raw))
        assert quick_depth == want["depth"], raw
        if chunk == 1 << 18:
            assert got == want, raw
            assert quick_cost >= found.cost(), raw
            continue
        # A value cut by a chunk boundary is charged as the worst it could be.
        for key, count in want.items():
            if key in ("strings", "scalars"):
                assert got[key] >= count, (key, raw)
            else:
                assert got[key] == count, (key, raw)


def _manifest(n: int, *, short: bool = False) -> bytes:
    """A real-looking manifest of ``n`` tensors (as ``sp.save`` writes them)."""
    items, tensors = [], {}
    offset = 4096
    for i in range(n):
        name = f"t{i}" if short else f"model/layers.{i // 10}.block{i % 10}.weight"
        tensors[name] = mf.TensorRecord("F32", (2, 3), FILE, offset, offset + 24, DIGEST)
        items.append([name.rsplit("/", 1)[-1], {"t": "tensor", "ref": name, "kind": "numpy"}])
        offset += 24
    m = mf.Manifest(
        tree={"t": "dict", "items": [["model", {"t": "dict", "items": items}]]},
        files={FILE: mf.FileRecord(offset, 4096, DIGEST)},
        tensors=tensors,
        metadata={"config": {"layers": [1, 2, 3], "name": "x[],{}"}},
    )
    return mf.dumps(m)


def test_real_manifests_take_the_fast_path() -> None:
    """A 100,000-tensor manifest (25 MiB) is cleared by the first pass alone, at 18 x against
    the bound's 24 x. Tensor names of two or three characters make the densest real manifests
    (24 x): the first pass, or else the precise one, clears them too."""
    raw = _manifest(100_000)
    depth, cost = _json._quick(raw, 1)
    assert depth <= 8
    assert cost <= 19 * len(raw), cost / len(raw)
    raw = _manifest(30_000, short=True)
    width = _json._width(raw)
    detail = _json._Detail()
    found = _json.census(raw, width, detail)
    assert found.base_cost() + _json._objects_cost(raw, detail, 1 << 62) <= 12 * len(raw)
    _json.check(raw)


def test_the_pre_scan_is_a_small_part_of_parsing() -> None:
    raw = _manifest(10_000)
    ratios = []
    for _ in range(5):  # each round's ratio, then their median: a busy machine slows either
        start = time.perf_counter()
        _json.check(raw)
        check = time.perf_counter() - start
        start = time.perf_counter()
        mf.parse(raw)
        ratios.append(check / (time.perf_counter() - start))
    # About a sixth of a parse in the full suite's worker (the parse itself warmer), a tenth alone.
    assert statistics.median(ratios) < 0.2, ratios


def test_real_manifest_parses_far_below_the_bound() -> None:
    raw = _manifest(2_000)
    peak, error = _peak(lambda: mf.parse(raw))
    assert error is None
    assert peak <= 10 * len(raw) + MiB, peak / len(raw)


# ---------------------------------------------------------------------------------------------
# nesting
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("depth", [513, 1_000, 1_000_000])
@pytest.mark.parametrize("opening", [b"[", b'{"a":'])
def test_deep_nesting_is_refused_before_parsing(depth: int, opening: bytes) -> None:
    closing = b"]" if opening == b"[" else b"}"
    raw = opening * depth + b"0" + closing * depth
    with pytest.raises(sp.CorruptCheckpointError, match="nested deeper than 512 levels"):
        _json.loads(raw, sp.CorruptCheckpointError, "text")
    with pytest.raises(sp.CorruptCheckpointError, match="nested deeper than 512 levels"):
        mf.parse(_forged(raw))


def test_brackets_inside_strings_do_not_count() -> None:
    text = "[" * 100_000 + '"]{' * 1000
    doc = {"t": "dict", "items": [[text, {"t": "value", "v": text}]]}
    raw = json.dumps([doc] * 20).encode()
    assert _json.loads(raw, sp.CorruptCheckpointError, "text") == [doc] * 20


def test_nesting_just_under_the_cap_parses_from_a_deep_stack() -> None:
    raw = b"[" * 511 + b"]" * 511

    def deep(n: int) -> Any:
        return deep(n - 1) if n else _json.loads(raw, sp.CorruptCheckpointError, "text")

    assert deep(200) is not None


class Node:
    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def state_dict(self) -> Any:
        return self.inner

    def load_state_dict(self, state: Any) -> None:
        self.inner = state


def _chain(depth: int) -> Any:
    state: Any = np.zeros(2, np.float32)
    for _ in range(depth):
        state = Node(state)
    return state


def test_writer_refuses_what_readers_refuse(tmp_path: Any) -> None:
    """At HEAD a state nested past the reader's limit was written and could not be loaded."""
    # The manifest object, one level per stateful node, the tensor node: 510 + 2 = 512.
    sp.save(tmp_path / "ok", _chain(510))
    assert sp.load(tmp_path / "ok", framework="numpy") is not None
    with pytest.raises(sp.UnsupportedStateError, match="nested deeper than 512"):
        sp.save(tmp_path / "deep", _chain(511))
    assert not (tmp_path / "deep").exists()


def test_writer_refuses_a_manifest_over_the_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mf._records, "MAX_MANIFEST_BYTES", 4096)
    with pytest.raises(sp.UnsupportedStateError, match="over the"):
        _manifest(100)


def test_writer_refuses_metadata_readers_would_refuse(tmp_path: Any) -> None:
    with pytest.raises(sp.UnsupportedStateError, match="readers would refuse"):
        sp.save(tmp_path / "c", {"x": np.zeros(1)}, metadata={"m": [{}] * 700_000})
    assert not (tmp_path / "c").exists()


# ---------------------------------------------------------------------------------------------
# numbers
# ---------------------------------------------------------------------------------------------

NUMBERS = {
    "1e400": b"1e400",
    "-1e400": b"-1e400",
    "400 digits": b"1" * 400,
    "5000 digits": b"9" * 5000,
    "NaN": b"NaN",
    "Infinity": b"Infinity",
    "-Infinity": b"-Infinity",
    "-0": b"-0",
    "-0.0": b"-0.0",
    "2.0": b"2.0",
    "true": b"true",
    "null": b"null",
    "1e-400": b"1e-400",
}
# Where a number may appear in a v1 manifest, as (member, text before, text after) of a doc
# written by dumps; the number replaces the value there.
FIELDS = {
    "format_version": b'"format_version": 1',
    "size": b'"size":4120',
    "header_size": b'"header_size":96',
    "shape": b'"shape":[2,3]',
    "offsets": b'"offsets":[96,120]',
    "tree value": b'{"t":"value","v":5}',
    "metadata": b'"metadata": {"m":1}',
}


def _numbered(field: str, number: bytes) -> bytes:
    m = mf.Manifest(
        tree={
            "t": "dict",
            "items": [
                ["w", {"t": "tensor", "ref": "w", "kind": "numpy"}],
                ["s", {"t": "value", "v": 5}],
            ],
        },
        files={FILE: mf.FileRecord(4120, 96, DIGEST)},
        tensors={"w": mf.TensorRecord("F32", (2, 3), FILE, 96, 120, DIGEST)},
        metadata={"m": 1},
    )
    raw = mf.dumps(m)
    head = raw[: raw.rfind(b',\n "manifest_xxh3"')]
    site = FIELDS[field]
    assert head.count(site) == 1, (field, head)
    replaced = {
        "format_version": b'"format_version": ' + number,
        "size": b'"size":' + number,
        "header_size": b'"header_size":' + number,
        "shape": b'"shape":[2,' + number + b"]",
        "offsets": b'"offsets":[96,' + number + b"]",
        "tree value": b'{"t":"value","v":' + number + b"}",
        "metadata": b'"metadata": {"m":' + number + b"}",
    }[field]
    head = head.replace(site, replaced)
    return head + f',\n "manifest_xxh3": "{checksum.digest(head)}"\n}}\n'.encode()


@pytest.mark.parametrize("number", sorted(NUMBERS))
@pytest.mark.parametrize("field", sorted(FIELDS))
def test_every_number_in_every_field(field: str, number: str) -> None:
    """Huge integers, out-of-range and non-standard floats, negative zero, floats and bools
    where integers belong: a CheckpointError naming the problem, or the value JSON means."""
    raw = _numbered(field, NUMBERS[number])
    try:
        m = mf.parse(raw)
    except sp.CheckpointError as exc:
        message = str(exc)
        if number in ("1e400", "-1e400"):  # at HEAD: accepted as inf in values and metadata
            assert "out of range for a 64-bit float" in message
        elif number in ("NaN", "Infinity", "-Infinity"):
            assert "non-standard number" in message
        elif number == "5000 digits":  # past Python's 4300-digit limit on parsing integers
            assert "Exceeds the limit" in message
        elif field in ("size", "header_size"):
            assert "bad sizes" in message or "header larger" in message, message
        elif field == "format_version" and number == "400 digits":
            assert "format version" in message  # ManifestVersionError: IncompatibleCheckpointError
            assert len(message) < 400  # the number is shortened
        return
    # Accepted: only where the value is one JSON allows there, as Python reads it.
    value = json.loads(NUMBERS[number])
    if field == "tree value":
        assert m.tree["items"][1][1]["v"] == value
        assert type(m.tree["items"][1][1]["v"]) is type(value)
    elif field == "metadata":
        assert m.metadata == {"m": value}
    else:
        assert number == "-0" and field in ("offsets", "shape", "format_version"), (field, number)
