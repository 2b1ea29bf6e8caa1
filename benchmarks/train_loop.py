"""A small real training loop for ``bench_async.py --loop real`` (issue 27), and the CPU clocks
that say where a background save's CPU time goes.

The model: a decoder-only transformer (``torch.nn``, CPU; pre-norm blocks with a causal mask)
whose input is the token embedding plus hashed bigram and trigram embeddings (an "over-tokenized"
input: large n-gram tables looked up per token, as in Huang et al. 2025), trained with fused
AdamW on random tokens. The two n-gram tables are sized so that the parameters and AdamW's two
moments (float32) are the requested size: nothing is padded, every saved byte is a parameter or
an optimizer moment the step updates. A step's compute is small (a batch of 4 x 64 tokens
through 4 blocks of width 256 and an 8192-token output head); what grows with the size is what
any dense AdamW step pays: the n-gram tables' dense gradients and the optimizer's pass over
every parameter (about 160 ms a step at 1 GiB and 550 ms at 4 GiB on the 2-core development
machine, before the change below).

The n-gram tables' gradients (``steady=True``, the default since 2026-12-02 late): each table's
gradient is a buffer made once, zeroed in place every step (``zero_grad(set_to_none=False)``),
into which the lookup's backward adds its rows (``index_add_``, the same sums as
``nn.Embedding``'s dense backward). Before, every step's backward allocated each table's dense
gradient anew (two buffers of a third of the state's size, above glibc's mmap threshold: mapped
and page-faulted in every step, then unmapped): the loop's step cost moved with the memory's state
(53 million minor faults in one 4 GiB run, the loop slower alone than during saves).
The step's other buffers (the 8 MiB logits, the token table's and the head's gradients before
they are added in, ...) are freed at the end of each step, and glibc then trimmed the heap's top
and faulted them in again the next step (3,000-6,000 minor faults a step at 128 MiB): with
``steady``, glibc's dynamic thresholds are fixed (``mallopt``: blocks up to 32 MiB, its largest
mmap threshold, come from the heap, and the heap is not trimmed below 2 GiB free), for the whole
process, once. ``steady=False`` (``bench_writers.py --fresh-grads``) keeps both behaviours.

What a user passes to save: ``{"model": model, "optimizer": opt, "rng": sp.RNGState(), "step":
n}`` for savepoint; for DCP the same as state dicts (``model.state_dict()``,
``opt.state_dict()``, ``torch.get_rng_state()``).
"""

from __future__ import annotations

import os
import resource
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import savepoint as sp

GiB = 1 << 30


def _steady_malloc() -> None:
    """glibc's mmap threshold fixed at 32 MiB (its largest) and its trim threshold at 2 GiB, so a
    step's freed buffers stay in the heap for the next (nothing where glibc is not the libc)."""
    import ctypes

    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return
    mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD
    mallopt(-1, (1 << 31) - 1)  # M_TRIM_THRESHOLD (an int: 2 GiB)


class _LookupInto(torch.autograd.Function):
    """An embedding lookup whose backward adds its rows into the table's existing ``.grad`` (made
    once, zeroed in place) instead of returning a dense gradient allocated anew each step."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(idx)
        ctx.weight = weight
        return nn.functional.embedding(idx, weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None]:
        (idx,) = ctx.saved_tensors
        weight = ctx.weight
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        weight.grad.index_add_(0, idx.reshape(-1), grad.reshape(-1, grad.shape[-1]))
        return None, None


class NgramLM(nn.Module):
    """Token + hashed bigram + hashed trigram embeddings, pre-norm causal blocks, a linear head.
    ``steady``: the n-gram tables' gradients accumulated into buffers made once (see the module
    docstring)."""

    def __init__(
        self,
        vocab: int,
        buckets: int,
        d: int,
        layers: int,
        heads: int,
        seq: int,
        steady: bool = True,
    ) -> None:
        super().__init__()
        self.vocab, self.buckets, self.steady = vocab, buckets, steady
        self.tok = nn.Embedding(vocab, d)
        self.bigram = nn.Embedding(buckets, d)
        self.trigram = nn.Embedding(buckets, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(
                d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True
            )
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        mask = nn.Transformer.generate_square_subsequent_mask(seq)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        prev = nn.functional.pad(x, (1, 0))[:, :-1]
        prev2 = nn.functional.pad(x, (2, 0))[:, :-2]
        h = self.tok(x) + self.pos.weight[:t]
        bi = (prev * self.vocab + x) % self.buckets
        tri = ((prev2 * self.vocab + prev) * self.vocab + x) % self.buckets
        if self.steady:
            h = h + _LookupInto.apply(self.bigram.weight, bi)
            h = h + _LookupInto.apply(self.trigram.weight, tri)
        else:
            h = h + self.bigram(bi)
            h = h + self.trigram(tri)
        mask: torch.Tensor = self.mask[:t, :t]  # type: ignore[index]
        for block in self.blocks:
            h = block(h, src_mask=mask, is_causal=True)
        out: torch.Tensor = self.head(self.norm(h))
        return out


@dataclass
class Shape:
    """The model's and the batch's dimensions (the n-gram tables are sized from ``gib``)."""

    vocab: int = 8192
    d: int = 256
    layers: int = 4
    heads: int = 4
    seq: int = 64
    batch: int = 4


class Trainer:
    """The model, its AdamW and the loop's step; the states a user passes to a save.
    ``steady``: every gradient is a buffer made once and zeroed in place each step (see the
    module docstring); False: set to None each step and allocated anew, as before."""

    def __init__(
        self, gib: float, shape: Shape | None = None, seed: int = 0, steady: bool = True
    ) -> None:
        s = shape or Shape()
        if steady:
            _steady_malloc()
        torch.manual_seed(seed)
        small = NgramLM(s.vocab, 1, s.d, s.layers, s.heads, s.seq)
        rest = sum(p.numel() for n, p in small.named_parameters() if "gram" not in n)
        # parameters + two AdamW moments, float32: 12 bytes a parameter
        buckets = max(1, int((gib * GiB / 12 - rest) / (2 * s.d)))
        self.shape = s
        self.steady = steady
        self.model = NgramLM(s.vocab, buckets, s.d, s.layers, s.heads, s.seq, steady)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=True)
        self.loss = nn.CrossEntropyLoss()
        self.rng = sp.RNGState()
        self.steps = 0
        self.step()  # the moments exist from the first step on

    def step(self) -> float:
        s = self.shape
        x = torch.randint(0, s.vocab, (s.batch, s.seq + 1))
        out = self.model(x[:, :-1])
        loss = self.loss(out.reshape(-1, s.vocab), x[:, 1:].reshape(-1))
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=not self.steady)
        self.steps += 1
        return float(loss.detach())

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors a save writes (parameters, moments, steps, RNG)."""
        params = sum(p.numel() * p.element_size() for p in self.model.parameters())
        moments = sum(
            t.numel() * t.element_size()
            for st in self.opt.state.values()
            for t in st.values()
            if isinstance(t, torch.Tensor)
        )
        return params + moments

    def tensors(self) -> list[torch.Tensor]:
        """The tensors a save copies (for the memcpy it is compared with)."""
        moments = [t for st in self.opt.state.values() for t in st.values()]
        return [*self.model.state_dict().values(), *moments]

    def sp_state(self) -> dict[str, Any]:
        return {"model": self.model, "optimizer": self.opt, "rng": self.rng, "step": self.steps}

    def dcp_state(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.opt.state_dict(),
            "rng": torch.get_rng_state(),
            "step": self.steps,
        }


class MatmulLoop:
    """The matmul loop of ``bench_async.py`` as a trainer: a step is 10 float32 384x384
    matmuls (a few ms); the state saved is given (float32 tensors, not the loop's)."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.state = state
        self.a, self.b = torch.randn(384, 384), torch.randn(384, 384)
        self.steps = 0

    def step(self) -> float:
        for _ in range(10):
            self.a = torch.tanh(self.a @ self.b) * 0.5
        self.steps += 1
        return 0.0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state.values())

    def tensors(self) -> list[torch.Tensor]:
        return list(self.state.values())

    def sp_state(self) -> dict[str, Any]:
        return self.state

    def dcp_state(self) -> dict[str, Any]:
        return self.state


# ---------------------------------------------------------------------------------------------
# CPU clocks
# ---------------------------------------------------------------------------------------------

_TICK = os.sysconf("SC_CLK_TCK")


def _thread_seconds(tid: str) -> float:
    try:
        with open(f"/proc/self/task/{tid}/schedstat") as f:
            return int(f.read().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0


def _thread_faults(tid: str) -> int:
    """Minor page faults of one of this process's threads so far."""
    try:
        with open(f"/proc/self/task/{tid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[7])
    except (OSError, ValueError, IndexError):
        return 0


def _process_seconds(pid: int) -> float:
    """utime + stime of a live process (all its threads, those exited too)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICK


def descendants(pid: int) -> list[int]:
    """The live processes below ``pid`` (the writer process, DCP's checkpoint process...)."""
    parents: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        parents.setdefault(ppid, []).append(int(name))
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


class CpuClock:
    """CPU seconds of the training loop's threads (those alive when the clock is made: the main
    thread and torch's intra-op threads, after a warm-up step) and of everything else: the other
    threads of this process (a thread writer, savepoint's pools, DCP's executor), exited ones
    included, plus every live descendant process (the writer process, DCP's checkpoint process)."""

    def __init__(self) -> None:
        self.trainer = set(os.listdir("/proc/self/task"))
        self.cores = len(os.sched_getaffinity(0))

    def read(self) -> tuple[float, float]:
        """(trainer's CPU seconds, the rest's)."""
        trainer = sum(_thread_seconds(t) for t in self.trainer)
        usage = resource.getrusage(resource.RUSAGE_SELF)
        children = sum(_process_seconds(p) for p in descendants(os.getpid()))
        return trainer, usage.ru_utime + usage.ru_stime - trainer + children

    def faults(self) -> int:
        """Minor page faults of the loop's threads so far (``getrusage``'s ``ru_minflt``, per
        thread: a thread writer's or the pools' faults are not the loop's)."""
        return sum(_thread_faults(t) for t in self.trainer)


# ---------------------------------------------------------------------------------------------
# one measurement: steps/s with no save, then during a background save
# ---------------------------------------------------------------------------------------------


@dataclass
class Sample:
    """One save's measurement (rates in steps/s, times in s, CPU in s)."""

    alone: float
    during: float
    blocked: float
    window: float
    save_cpu: float
    trainer_share_alone: float
    trainer_share_during: float
    other_alone: float  # CPU seconds of everything but the loop while it ran alone
    floor: float  # 1 - save_cpu / (cores x window): what the loop keeps if the save's CPU is its
    faults_alone: float = float("nan")  # the loop's threads' minor page faults a step, alone
    faults_during: float = float("nan")  # and during the save

    @property
    def ratio(self) -> float:
        return self.during / self.alone

    @property
    def cpu_per_step(self) -> float:
        """The loop's CPU time per step during the save over alone: above 1 when the save slows
        the loop's own work (memory bandwidth, caches, page faults), not only takes cores."""
        alone = self.trainer_share_alone / self.alone
        return (self.trainer_share_during / self.during) / alone if alone > 0 else float("nan")


def steps_alone(
    trainer: Trainer | MatmulLoop, clock: CpuClock, seconds: float, least: int = 3
) -> tuple[float, float, float]:
    """Steps per second with no save (at least ``least`` steps and ``seconds``), the share of
    the cores the loop's threads used, and the CPU seconds of the rest (what a save left
    running, say)."""
    cpu0, rest0 = clock.read()
    f0 = clock.faults()
    t0 = time.perf_counter()
    n = 0
    while n < least or time.perf_counter() - t0 < seconds:
        trainer.step()
        n += 1
    elapsed = time.perf_counter() - t0
    cpu1, rest1 = clock.read()
    _LAST_FAULTS[:] = [(clock.faults() - f0) / n]
    return n / elapsed, (cpu1 - cpu0) / (clock.cores * elapsed), rest1 - rest0


_LAST_FAULTS: list[float] = [float("nan")]  # the last steps_alone's faults a step


def measure(
    trainer: Trainer | MatmulLoop,
    clock: CpuClock,
    start: Callable[[], Callable[[], None]],
    alone_seconds: float,
) -> Sample:
    """Steps/s alone (right before), then ``start()`` (the save: what it blocks for), then steps
    until its ``wait`` returns; the steps in that window are counted to the fraction of the step
    running when the save was done (each step's end is recorded)."""
    alone, share_alone, other_alone = steps_alone(trainer, clock, alone_seconds)
    faults_alone = _LAST_FAULTS[0]
    f0 = clock.faults()
    t0 = time.perf_counter()
    wait = start()
    t1 = time.perf_counter()
    before = clock.read()
    done = threading.Event()
    after: list[Any] = []

    def waiter() -> None:
        try:
            wait()
        finally:
            after.append((time.perf_counter(), clock.read()))
            done.set()

    threading.Thread(target=waiter, daemon=True).start()
    ends = [t1]
    while True:
        trainer.step()
        ends.append(time.perf_counter())
        if done.is_set() and ends[-1] >= after[0][0]:
            break
    t_done, (trainer_cpu, rest_cpu) = after[0]
    window = t_done - t1
    k = next(i for i, e in enumerate(ends) if e >= t_done)  # the step running at the end
    steps = (k - 1) + (t_done - ends[k - 1]) / (ends[k] - ends[k - 1])
    save_cpu = rest_cpu - before[1]
    return Sample(
        alone=alone,
        during=steps / window,
        blocked=t1 - t0,
        window=window,
        save_cpu=save_cpu,
        trainer_share_alone=share_alone,
        trainer_share_during=(trainer_cpu - before[0]) / (clock.cores * window),
        other_alone=other_alone,
        floor=1 - save_cpu / (clock.cores * window),
        faults_alone=faults_alone,
        faults_during=(clock.faults() - f0) / max(len(ends) - 1, 1),
    )


# ---------------------------------------------------------------------------------------------
# a steadier measurement: saves back to back over a long window, against the loop alone
# ---------------------------------------------------------------------------------------------


@dataclass
class Window:
    """The loop over one long window: alone (``saves == 0``) or saving back to back."""

    rate: float  # steps/s over the window
    seconds: float  # the window's length
    saves: int  # saves done in it (each started at the step boundary after the last was done)
    blocked: float  # seconds save() blocked the loop, summed
    save_cpu: float  # CPU seconds of everything but the loop's threads in the window
    trainer_share: float  # the loop's threads' share of the cores
    faults: float  # the loop's threads' minor page faults a step


def sustained(
    trainer: Trainer | MatmulLoop,
    clock: CpuClock,
    seconds: float,
    start: Callable[[], Callable[[], None]] | None = None,
) -> Window:
    """The loop for at least ``seconds``; with ``start``, saving back to back: a save is started
    at the first step boundary after the last one is done (its ``save()`` blocking inside the
    window), and the window ends when the save in flight at ``seconds`` is done, the steps
    counted to the fraction of the step running then. Without ``start``: the loop alone for
    ``seconds`` (whole steps)."""
    cpu0, rest0 = clock.read()
    f0 = clock.faults()
    t0 = time.perf_counter()
    if start is None:
        n = 0
        while n < 3 or time.perf_counter() - t0 < seconds:
            trainer.step()
            n += 1
        t_end = time.perf_counter()
        cpu1, rest1 = clock.read()
        return Window(
            rate=n / (t_end - t0),
            seconds=t_end - t0,
            saves=0,
            blocked=0.0,
            save_cpu=rest1 - rest0,
            trainer_share=(cpu1 - cpu0) / (clock.cores * (t_end - t0)),
            faults=(clock.faults() - f0) / n,
        )
    saves, blocked = 0, 0.0
    done = threading.Event()
    last: list[tuple[float, tuple[float, float]]] = []

    def begin() -> None:
        nonlocal saves, blocked
        done.clear()
        b0 = time.perf_counter()
        wait = start()
        blocked += time.perf_counter() - b0
        saves += 1

        def waiter() -> None:
            try:
                wait()
            finally:
                last[:] = [(time.perf_counter(), clock.read())]
                done.set()

        threading.Thread(target=waiter, daemon=True).start()

    begin()
    ends = [t0]
    while True:
        trainer.step()
        ends.append(time.perf_counter())
        if done.is_set():
            if last[0][0] - t0 >= seconds:
                break
            begin()
    t_done, (trainer_cpu, rest_cpu) = last[0]
    k = next(i for i, e in enumerate(ends) if e >= t_done)  # the step running at the end
    steps = (k - 1) + (t_done - ends[k - 1]) / (ends[k] - ends[k - 1])
    window = t_done - t0
    return Window(
        rate=steps / window,
        seconds=window,
        saves=saves,
        blocked=blocked,
        save_cpu=rest_cpu - rest0,
        trainer_share=(trainer_cpu - cpu0) / (clock.cores * window),
        faults=(clock.faults() - f0) / max(len(ends) - 1, 1),
    )
