"""A small mutation fuzzer for savepoint's parsers, run by pytest (bounded) and ``make fuzz`` (timed).

Why not atheris: its coverage feedback needs the parsers' native code (json, msgpack, numpy) built
with its instrumentation, which these machines do not have, and it runs outside pytest. Hypothesis
is already the project's property-testing tool and shrinks what it finds, so the structured
round-trip tests use it; the byte-level campaign below is a plain seeded mutator, which is what
finds length-field and header bugs fastest and replays any failure from ``(target, seed, index)``.

A target is a parser entry point plus valid seed inputs. Each generated input is a seed with one to
eight stacked mutations (bit flips, interesting integers written over 1/2/4/8 bytes, range deletes,
duplicates and inserts, truncation, splices with another seed, format-specific tokens). For every
input exactly one outcome is allowed: the parser returns, or raises a ``CheckpointError`` subclass.
Anything else (another exception, a hang past ``time_limit_s``, peak traced memory above
``memory_factor * len(input) + memory_slack``) is a failure, kept with the input that caused it.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import random
import signal
import struct
import time
import traceback
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from savepoint.errors import CheckpointError

# Peak traced memory a parser may use for one input, as a multiple of its size (plus slack).
# docs/reliability.md states this bound; a target may ask for a tighter one.
MEMORY_FACTOR = 24
MEMORY_SLACK = 32 << 20

TARGET_MODULES = (
    "fuzz.targets_json",
    "fuzz.targets_binary",
    "fuzz.targets_hf",
    "fuzz.targets_foreign",
)

INTERESTING_INTS = (
    0,
    1,
    0x7F,
    0x80,
    0xFF,
    0x7FFF,
    0x8000,
    0xFFFF,
    0x7FFFFFFF,
    0x80000000,
    0xFFFFFFFF,
    1 << 32,
    (1 << 53) + 1,
    0x7FFFFFFFFFFFFFFF,
    0x8000000000000000,
    0xFFFFFFFFFFFFFFFF,
)
TEXT_TOKENS = (
    b"[",
    b"]",
    b"{",
    b"}",
    b",",
    b":",
    b'"',
    b"null",
    b"true",
    b"-1",
    b"1e400",
    b"-0",
    b"1" * 400,
    b"NaN",
    b"Infinity",
    b'"\\ud800"',
    b'"\\u0000"',
    b"[" * 2000,
    b"[]," * 200,
    b"{}," * 200,
    b"0.5,",
    b'"a":1,"a":2',
)


@dataclass(frozen=True)
class Target:
    """One parser under test.

    ``seeds(scratch)`` returns valid inputs; ``parse(data, scratch)`` feeds one input to the
    parser (writing it into ``scratch`` first if the parser takes a path). ``tokens`` are byte
    strings worth splicing in (magic numbers, field names). ``text`` targets also get JSON-ish
    mutations. ``memory_factor``/``memory_slack`` override the module's bound.
    """

    name: str
    seeds: Callable[[Path], list[bytes]]
    parse: Callable[[bytes, Path], Any]
    tokens: tuple[bytes, ...] = ()
    text: bool = False
    memory_factor: float = MEMORY_FACTOR
    memory_slack: int = MEMORY_SLACK
    max_input: int = 4 << 20


@dataclass
class Failure:
    target: str
    index: int
    kind: str  # "exception", "memory", "timeout"
    detail: str
    data: bytes


@dataclass
class Result:
    target: str
    inputs: int = 0
    rejected: int = 0  # CheckpointError: the expected outcome for most mutated inputs
    accepted: int = 0
    peak_ratio: float = 0.0  # worst (peak - slack) / len(input) seen, when memory is traced
    failures: list[Failure] = field(default_factory=list)


_REGISTRY: dict[str, Target] = {}


def register(target: Target) -> Target:
    if target.name in _REGISTRY:
        raise ValueError(f"fuzz target {target.name!r} registered twice")
    _REGISTRY[target.name] = target
    return target


def all_targets() -> dict[str, Target]:
    for module in TARGET_MODULES:
        with contextlib.suppress(ModuleNotFoundError):
            importlib.import_module(module)
    return dict(sorted(_REGISTRY.items()))


# -- mutations ---------------------------------------------------------------------------------


def _int_bytes(rng: random.Random) -> bytes:
    value = rng.choice(INTERESTING_INTS)
    width = rng.choice((1, 2, 4, 8))
    value &= (1 << (8 * width)) - 1
    return value.to_bytes(width, rng.choice(("little", "big")))


def _mutate_once(rng: random.Random, data: bytearray, others: list[bytes], target: Target) -> None:
    n = len(data)
    op = rng.randrange(10 if target.text else 9)
    pos = rng.randrange(n + 1)
    if op == 0 and n:  # flip one bit
        i = rng.randrange(n)
        data[i] ^= 1 << rng.randrange(8)
    elif op == 1:  # an interesting integer over 1/2/4/8 bytes
        blob = _int_bytes(rng)
        data[pos : pos + len(blob)] = blob
    elif op == 2 and n:  # delete a range
        end = min(n, pos + rng.choice((1, 2, 4, 8, 64, rng.randrange(n + 1))))
        del data[pos:end]
    elif op == 3 and n:  # duplicate a range
        start = rng.randrange(n)
        chunk = bytes(data[start : start + rng.choice((1, 8, 64, 4096))])
        data[pos:pos] = chunk * rng.choice((1, 2, 16))
    elif op == 4:  # insert random bytes
        data[pos:pos] = rng.randbytes(rng.choice((1, 2, 4, 8, 32)))
    elif op == 5 and n:  # truncate
        del data[rng.randrange(n) :]
    elif op == 6 and others:  # splice with another seed
        other = rng.choice(others)
        cut = rng.randrange(len(other) + 1)
        data[pos:] = other[cut:]
    elif op == 7 and (target.tokens or target.text):  # a format token
        token = rng.choice(target.tokens + (TEXT_TOKENS if target.text else ()))
        if rng.random() < 0.5:
            data[pos:pos] = token
        else:
            data[pos : pos + len(token)] = token
    elif op == 8 and n:  # set one byte to an edge value
        data[rng.randrange(n)] = rng.choice((0, 1, 0x7F, 0x80, 0xC0, 0xDC, 0xDD, 0xFE, 0xFF))
    elif op == 9:  # JSON-ish: replace a digit run with an extreme number
        digits = [i for i in range(n) if 0x30 <= data[i] <= 0x39]
        if digits:
            i = rng.choice(digits)
            j = i
            while j < n and 0x30 <= data[j] <= 0x39:
                j += 1
            data[i:j] = rng.choice((b"1e400", b"-1", b"1" * 400, b"0.5", b"18446744073709551616"))


def mutate(rng: random.Random, seed: bytes, others: list[bytes], target: Target) -> bytes:
    data = bytearray(seed)
    for _ in range(rng.choice((1, 1, 1, 2, 2, 3, 4, 8))):
        _mutate_once(rng, data, others, target)
    return bytes(data[: target.max_input])


def inputs(target: Target, seeds: list[bytes], seed: int) -> Iterator[tuple[int, bytes]]:
    """Input ``i`` of the campaign ``(target, seed)``; the seeds themselves come first."""
    if not seeds:
        raise ValueError(f"fuzz target {target.name} has no seed inputs")
    yield from enumerate(seeds)
    index = len(seeds)
    while True:
        rng = random.Random(f"{target.name}:{seed}:{index}")
        yield index, mutate(rng, rng.choice(seeds), seeds, target)
        index += 1


# -- running -----------------------------------------------------------------------------------


class _Timeout(BaseException):
    """Not an Exception, so a parser's ``except Exception`` cannot swallow it."""


@contextlib.contextmanager
def _alarm(seconds: float) -> Iterator[None]:
    def fire(signum: int, frame: Any) -> None:
        raise _Timeout

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def run(
    target: Target,
    scratch: Path,
    *,
    iterations: int | None = None,
    seconds: float | None = None,
    seed: int = 0,
    trace_memory: bool = False,
    time_limit_s: float = 10.0,
    max_failures: int = 20,
) -> Result:
    """Run one campaign: ``iterations`` inputs, or as many as fit in ``seconds``."""
    if iterations is None and seconds is None:
        raise ValueError("give iterations or seconds")
    scratch.mkdir(parents=True, exist_ok=True)
    seeds = target.seeds(scratch)
    result = Result(target.name)
    deadline = time.monotonic() + seconds if seconds is not None else None
    for index, data in inputs(target, seeds, seed):
        if iterations is not None and result.inputs >= iterations:
            break
        if deadline is not None and time.monotonic() > deadline:
            break
        if len(result.failures) >= max_failures:
            break
        result.inputs += 1
        outcome = _one(target, data, scratch, trace_memory, time_limit_s)
        if isinstance(outcome, Failure):
            outcome.index = index
            result.failures.append(outcome)
            continue
        rejected, ratio = outcome
        if rejected:
            result.rejected += 1
        else:
            result.accepted += 1
        result.peak_ratio = max(result.peak_ratio, ratio)
    return result


def _one(
    target: Target, data: bytes, scratch: Path, trace_memory: bool, time_limit_s: float
) -> Failure | tuple[bool, float]:
    """``(rejected, memory ratio)`` for an allowed outcome, else a Failure."""
    rejected = False
    if trace_memory:
        tracemalloc.start()
        tracemalloc.reset_peak()
    try:
        with _alarm(time_limit_s):
            target.parse(data, scratch)
    except CheckpointError:
        rejected = True
    except _Timeout:
        return Failure(target.name, -1, "timeout", f"no answer within {time_limit_s} s", data)
    except Exception as exc:
        detail = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)[-6:])
        return Failure(target.name, -1, "exception", detail, data)
    finally:
        if trace_memory:
            _, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
    ratio = 0.0
    if trace_memory:
        bound = target.memory_factor * len(data) + target.memory_slack
        if peak > bound:
            return Failure(
                target.name,
                -1,
                "memory",
                f"peak traced memory {peak} bytes for a {len(data)}-byte input (bound {bound:.0f})",
                data,
            )
        ratio = max(0.0, peak - target.memory_slack) / max(1, len(data))
    return rejected, ratio


def save_failures(result: Result, directory: Path) -> list[Path]:
    """Write each failing input to ``directory/<target>/<sha>.bin`` with a ``.txt`` beside it."""
    written = []
    for failure in result.failures:
        folder = directory / failure.target
        folder.mkdir(parents=True, exist_ok=True)
        name = hashlib.sha256(failure.data).hexdigest()[:16]
        (folder / f"{name}.bin").write_bytes(failure.data)
        (folder / f"{name}.txt").write_text(
            f"input {failure.index} ({failure.kind})\n{failure.detail}\n", encoding="utf-8"
        )
        written.append(folder / f"{name}.bin")
    return written


def describe(result: Result) -> str:
    lines = [
        f"{result.target}: {result.inputs} inputs, {result.rejected} rejected, "
        f"{result.accepted} accepted, {len(result.failures)} failures"
    ]
    for failure in result.failures[:5]:
        lines.append(f"  input {failure.index} [{failure.kind}] {len(failure.data)} bytes:")
        lines.extend("    " + line for line in failure.detail.strip().splitlines()[-4:])
    return "\n".join(lines)


def le_u64(value: int) -> bytes:
    return struct.pack("<Q", value)
