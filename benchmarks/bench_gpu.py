"""GPU state: async-save blocking time, training during the write, verified loads (issue 24).

Usage::

    python3 benchmarks/bench_gpu.py [--gib 1] [--repeats 3] [--load-repeats 2] [--budget-s 300]
                                    [--dir DIR] [--json PATH] [--sections save,step,load,checksum]
    python3 benchmarks/bench_gpu.py --cpu-smoke     # tiny, on the CPU: the code paths, no figures

The state is a model's bfloat16 parameters (``--gib`` GiB of them: square matrices and their
biases) plus fp32 Adam moments (``exp_avg``, ``exp_avg_sq``: 4x the parameter bytes), so the
state is about 5x ``--gib``. Sections, each skipped when the time budget is spent, in this order:

- ``save``: the time ``sp.AsyncCheckpointer().save()`` blocks training (until it returns, and until
  the current CUDA stream may run again: the staging copies done), against a pinned
  device-to-host copy of the same bytes (the floor) and ``torch.distributed.checkpoint.async_save``
  with a pinned ``DefaultStager`` (sync and async staging), same run, warm (one save first);
- ``step``: the step time of a bf16 matmul training loop while a background save writes, against
  its step time with no save running;
- ``load``: a verified ``sp.load(into=)`` into CUDA parameters and ``sp.load(device=)``, against
  the disk's raw read rate (O_DIRECT, the same files) and ``safetensors.torch.load_file(device=)``
  and ``torch.load`` + ``.to()``; every file is evicted from the page cache before each read
  (``posix_fadvise(DONTNEED)``);
- ``checksum``: device-side checksum throughput (``mlh64``: the Triton kernel, and the torch
  operations fallback) over the state's tensors, digests checked against the host's; host XXH3
  and host mlh64 (one core) for reference.

Prints each figure and the ratios against the issue's targets, and writes them as JSON (``--json``;
rewritten after each section, so a run cut short still leaves its figures). Without CUDA (and
without ``--cpu-smoke``) it measures nothing, says so, writes the JSON and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import mmap
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

MiB = 1 << 20
GiB = 1 << 30
SECTIONS = ("save", "step", "load", "checksum")

# The targets: (result key, operator, bound, what it compares).
TARGETS = [
    ("async_blocking_over_pinned_copy", "<=", 1.2, "async save blocking / pinned D2H copy"),
    ("async_blocking_over_dcp_pinned", "<=", 0.5, "async save blocking / DCP async_save pinned"),
    ("step_rate_during_write", ">=", 0.95, "step time without a save / step time during write"),
    ("load_into_over_raw_read", ">=", 0.85, "verified sp.load(into=cuda) / raw disk read"),
    ("load_into_over_safetensors", ">=", 1.0, "sp.load(into=) speed / safetensors load_file"),
    ("load_into_over_torch_load", ">=", 1.0, "sp.load(into=) speed / torch.load + .to()"),
    ("device_checksum_gbps", ">=", 200.0, "device-side checksum throughput, GB/s"),
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--gib", type=float, default=None, help="GiB of bf16 parameters (default 1)")
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds of each save contender")
    ap.add_argument("--load-repeats", type=int, default=2, help="timed rounds of each load")
    ap.add_argument("--budget-s", type=float, default=300.0, help="stop starting sections after")
    ap.add_argument("--dir", default=None, help="scratch directory on the disk to measure")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help=f"comma-separated subset of {','.join(SECTIONS)}",
    )
    ap.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="run every section on the CPU at a tiny size (tests the script, measures nothing)",
    )
    args = ap.parse_args(argv)
    wanted = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(wanted) - set(SECTIONS))
    if unknown:
        ap.error(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    args.sections = wanted
    if args.gib is None:
        args.gib = 2.0 / 1024 if args.cpu_smoke else 1.0
    if args.gib <= 0 or args.repeats < 1 or args.load_repeats < 1:
        ap.error("--gib, --repeats and --load-repeats must be positive")
    return args


class Budget:
    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _fs_type(path: str) -> str:
    """The filesystem type of the mount holding ``path`` (from /proc/mounts)."""
    best, kind = "", "unknown"
    real = os.path.realpath(path)
    with contextlib.suppress(OSError), open("/proc/mounts", encoding="utf-8") as f:
        for line in f:
            parts = line.split()
            if len(parts) < 3 or len(parts[1]) < len(best):
                continue
            if real == parts[1] or real.startswith(parts[1].rstrip("/") + "/"):
                best, kind = parts[1], parts[2]
    return kind


def scratch_dir(given: str | None) -> str:
    """``given``, or a directory on a real disk: the system temp dir unless it is in memory
    (tmpfs), else ``.bench-gpu`` in the working directory."""
    if given:
        return given
    tmp = tempfile.gettempdir()
    if _fs_type(tmp) not in ("tmpfs", "ramfs"):
        return os.path.join(tmp, "savepoint-bench-gpu")
    return os.path.abspath(".bench-gpu")


def mem_available() -> int:
    with contextlib.suppress(OSError), open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


# -- the state -------------------------------------------------------------------------------------


def make_state(torch: Any, param_bytes: int, dim: int, device: Any) -> dict[str, Any]:
    """bf16 parameters (``dim`` x ``dim`` matrices and ``dim`` biases) of about ``param_bytes``,
    with fp32 Adam moments and step counts laid out as ``optimizer.state_dict()`` nests them
    (string keys, so every contender takes the same tree)."""
    layers = max(2, round(param_bytes / (dim * dim * 2)))
    gen = torch.Generator(device=device).manual_seed(0)
    model: dict[str, Any] = {}
    for i in range(layers):
        model[f"layers.{i}.weight"] = torch.randn(
            dim, dim, generator=gen, device=device, dtype=torch.bfloat16
        )
        model[f"layers.{i}.bias"] = torch.randn(
            dim, generator=gen, device=device, dtype=torch.bfloat16
        )
    opt: dict[str, Any] = {}
    for i, p in enumerate(model.values()):
        opt[str(i)] = {
            "step": torch.tensor(100.0, device=device),
            "exp_avg": torch.randn(p.shape, generator=gen, device=device) * 1e-3,
            "exp_avg_sq": torch.rand(p.shape, generator=gen, device=device) * 1e-6,
        }
    return {"model": model, "optimizer": {"state": opt}}


def leaves(state: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    for k, v in state.items():
        name = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict):
            yield from leaves(v, name)
        else:
            yield name, v


def nbytes_of(state: Any) -> int:
    return sum(t.numel() * t.element_size() for _, t in leaves(state))


def empty_like_tree(torch: Any, state: Any) -> Any:
    if isinstance(state, dict):
        return {k: empty_like_tree(torch, v) for k, v in state.items()}
    return torch.zeros_like(state)


# -- timing helpers ------------------------------------------------------------------------------


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        self.torch = torch
        self.args = args
        self.cuda = torch.cuda.is_available() and not args.cpu_smoke
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if self.cuda else torch.device("cpu")
        )
        self.budget = Budget(args.budget_s)
        self.dir = scratch_dir(args.dir)
        self.out: dict[str, Any] = {
            "bench": "bench_gpu",
            "mode": "cuda" if self.cuda else "cpu-smoke",
            "argv": sys.argv[1:],
            "config": {},
            "results": {},
            "ratios": [],
            "errors": {},
            "skipped": {},
        }

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def save_json(self) -> None:
        if self.args.json:
            tmp = self.args.json + ".tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(self.out, f, indent=2, default=str)
            os.replace(tmp, self.args.json)

    def facts(self) -> dict[str, Any]:
        torch = self.torch
        facts: dict[str, Any] = {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "torch_cuda": torch.version.cuda,
            "cpus": os.cpu_count(),
            "scratch_dir": self.dir,
            "scratch_fs": _fs_type(self.dir),
        }
        if self.cuda:
            p = torch.cuda.get_device_properties(self.device)
            facts.update(
                device=p.name,
                device_memory_gib=round(p.total_memory / GiB, 1),
                multiprocessors=p.multi_processor_count,
            )
        else:
            facts["device"] = "cpu (smoke run: no GPU figures)"
        return facts

    def run(self) -> int:
        import savepoint as sp

        args = self.args
        torch = self.torch
        os.makedirs(self.dir, exist_ok=True)
        self.out["device"] = self.facts()
        print(f"bench_gpu: {self.out['device']}", flush=True)
        param_bytes = int(args.gib * GiB)
        # Room for the files (at most 4 states at once: each section deletes what it wrote), the
        # host copies (savepoint's arena, DCP's two stagers, the floor's buffer, torch.load's
        # result: 5 states) and, on the device, the state, the load targets and one loaded copy.
        free_disk = shutil.disk_usage(self.dir).free
        limit = min(free_disk / 4.5, mem_available() / 6 if mem_available() else float("inf"))
        if self.cuda:
            free_dev, _ = torch.cuda.mem_get_info()
            limit = min(limit, (free_dev - 4 * GiB) / 3.2)
        if param_bytes * 5 > limit:
            shrunk = max(int(limit / 5), 64 * MiB)
            self.out["config"]["shrunk_from_gib"] = args.gib
            print(f"  --gib {args.gib} does not fit here; using {shrunk / GiB:.2f}", flush=True)
            param_bytes = shrunk
        dim = 4096 if self.cuda else 256
        state = make_state(torch, param_bytes, dim, self.device)
        self.sync()
        total = nbytes_of(state)
        self.out["config"].update(
            param_gib=round(param_bytes / GiB, 3),
            state_gib=round(total / GiB, 3),
            tensors=sum(1 for _ in leaves(state)),
            repeats=args.repeats,
            load_repeats=args.load_repeats,
            savepoint=sp.__version__,
        )
        print(f"  state: {self.out['config']}", flush=True)
        ck = sp.AsyncCheckpointer()
        sections: dict[str, Callable[[], dict[str, Any]]] = {
            "save": lambda: self.section_save(state, total, ck),
            "step": lambda: self.section_step(state, ck),
            "load": lambda: self.section_load(state, total, ck),
            "checksum": lambda: self.section_checksum(state, total),
        }
        # A rough floor for each section, in seconds per GiB of state, so a section that cannot
        # finish is skipped rather than cut (the orchestrator kills the run at its own limit).
        need = {"save": 6.0, "step": 3.0, "load": 8.0, "checksum": 0.5}
        try:
            for name in args.sections:
                wanted = need[name] * total / GiB + 5
                if self.budget.left() < wanted:
                    why = f"time budget: {self.budget.left():.0f} s left, ~{wanted:.0f} s needed"
                    self.out["skipped"][name] = why
                    print(f"[{name}] skipped ({why})", flush=True)
                    continue
                print(f"[{name}]", flush=True)
                started = time.monotonic()
                try:
                    self.out["results"][name] = sections[name]()
                except Exception as exc:  # one section's failure must not lose the others
                    self.out["errors"][name] = "".join(
                        traceback.format_exception_only(type(exc), exc)
                    ).strip()
                    traceback.print_exc()
                self.out["results"].setdefault(name, {})["seconds"] = round(
                    time.monotonic() - started, 1
                )
                self.save_json()
        finally:
            ck.close()
            shutil.rmtree(self.dir, ignore_errors=True)
        self.out["ratios"] = self.ratios()
        self.print_ratios()
        self.save_json()
        return 0

    # -- save: blocking time -------------------------------------------------------------------

    def section_save(self, state: Any, total: int, ck: Any) -> dict[str, Any]:
        torch = self.torch
        tensors = [t for _, t in leaves(state)]
        res: dict[str, Any] = {"state_bytes": total}
        # The floor: every tensor's bytes copied into one pinned buffer (non-blocking copies on
        # the current stream, then a synchronize), as a hand-written staging would.
        floor = {"buf": torch.empty(total, dtype=torch.uint8, pin_memory=self.cuda)}
        floor["buf"].fill_(0)

        def pinned_copy() -> float:
            self.sync()
            t0 = time.perf_counter()
            pos = 0
            buf = floor["buf"]
            for t in tensors:
                n = t.numel() * t.element_size()
                buf[pos : pos + n].copy_(t.reshape(-1).view(torch.uint8), non_blocking=self.cuda)
                pos += n
            self.sync()
            return time.perf_counter() - t0

        path = os.path.join(self.dir, "sp-async")

        def sp_async() -> dict[str, float]:
            self.sync()
            t0 = time.perf_counter()
            pending = ck.save(path, state)
            returned = time.perf_counter() - t0
            if self.cuda:  # the next kernel on this stream waits for the staging copies
                torch.cuda.current_stream().synchronize()
            blocked = time.perf_counter() - t0
            pending.wait()
            return {"returned": returned, "blocked": blocked, "durable": time.perf_counter() - t0}

        dcp_variants = self._dcp_variants()
        written = [path, *(os.path.join(self.dir, name) for name in dcp_variants)]
        rounds: dict[str, list[Any]] = {"pinned_copy": [], "sp_async": []}
        rounds.update({name: [] for name in dcp_variants})
        for r in range(self.args.repeats + 1):  # round 0 warms up (arena, pinned buffers)
            if r > 1 and self.budget.left() < 30:
                res["cut_short"] = f"after {r - 1} timed round(s): time budget"
                break
            got: dict[str, Any] = {"pinned_copy": pinned_copy(), "sp_async": sp_async()}
            for name, fn in list(dcp_variants.items()):
                try:
                    got[name] = fn(state, os.path.join(self.dir, name))
                except Exception as exc:  # a DCP variant this torch or machine cannot run
                    self.out["errors"][f"save/{name}"] = f"{type(exc).__name__}: {exc}"
                    rounds.pop(name, None)
                    dcp_variants.pop(name).close()
            if r:
                for name, value in got.items():
                    if name in rounds:
                        rounds[name].append(value)
            print(f"  round {r}{' (warm-up)' if r == 0 else ''}: {_short(got)}", flush=True)
        for fn in dcp_variants.values():
            getattr(fn, "close", lambda: None)()
        floor.clear()  # the floor's pinned buffer back before the next section
        gc.collect()
        _remove(*written)
        res["pinned_copy_s"] = _median(rounds.pop("pinned_copy"))
        res["pinned_copy_gbps"] = total / res["pinned_copy_s"] / 1e9
        for name, values in rounds.items():
            for part in ("returned", "blocked", "durable"):
                res[f"{name}_{part}_s"] = _median([v[part] for v in values])
        res["runs"] = {k: v for k, v in rounds.items()}
        return res

    def _dcp_variants(self) -> dict[str, Any]:
        """DCP ``async_save`` with a reused ``DefaultStager``: pinned memory and non-blocking
        copies, sync staging (blocks until staged) and StagingOptions' defaults (async staging:
        training must wait for ``staging_completion``). On the CPU smoke run: CPU options."""
        try:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        except ImportError as exc:
            self.out["errors"]["save/dcp"] = f"no DCP stager in this torch: {exc}"
            return {}
        if self.cuda:
            options = {
                "dcp_pinned_sync": StagingOptions(True, False, False, True),
                "dcp_pinned_async": StagingOptions(True, True, True, True),
            }
        else:
            options = {"dcp_cpu": StagingOptions(False, False, False, False)}
        out: dict[str, Any] = {}
        for name, opts in options.items():
            try:
                stager = DefaultStager(opts)
            except Exception as exc:
                self.out["errors"][f"save/{name}"] = f"{type(exc).__name__}: {exc}"
                continue
            out[name] = _DcpSave(self, dcp, stager)
        return out

    # -- step: training during the background write --------------------------------------------

    def section_step(self, state: Any, ck: Any) -> dict[str, Any]:
        torch = self.torch
        d = 8192 if self.cuda else 192
        dtype = torch.bfloat16 if self.cuda else torch.float32
        gen = torch.Generator(device=self.device).manual_seed(1)
        w1 = torch.randn(d, d, generator=gen, device=self.device, dtype=dtype) / d**0.5
        w2 = torch.randn(d, d, generator=gen, device=self.device, dtype=dtype) / d**0.5
        w1.requires_grad_(True)
        w2.requires_grad_(True)
        x = torch.randn(d, d, generator=gen, device=self.device, dtype=dtype)

        def step() -> float:
            t0 = time.perf_counter()
            y = torch.relu(x @ w1) @ w2
            loss = y.float().square().mean()
            loss.backward()
            with torch.no_grad():
                for w in (w1, w2):
                    assert w.grad is not None
                    w.sub_(w.grad, alpha=1e-3)
                    w.grad = None
            loss.item()  # a training loop's logging: one synchronize a step
            return time.perf_counter() - t0

        for _ in range(5):
            step()
        quiet = [step() for _ in range(30 if self.cuda else 10)]
        during: list[float] = []
        first: list[float] = []
        rounds = 2
        path = os.path.join(self.dir, "sp-step")
        for _ in range(rounds):
            pending = ck.save(path, state)
            first.append(step())  # waits for the staging copies (counted as blocking above)
            n = 0
            while not pending.done() or n < 3:
                during.append(step())
                n += 1
            pending.wait()
            quiet += [step() for _ in range(10 if self.cuda else 5)]
        _remove(path)
        res = {
            "matmul_dim": d,
            "step_s_without_save": _median(quiet),
            "step_s_during_write": _median(during),
            "step_s_during_write_mean": statistics.fmean(during),
            "first_step_after_save_s": _median(first),
            "steps_during_write": len(during),
        }
        res["step_rate_during_write"] = res["step_s_without_save"] / res["step_s_during_write"]
        return res

    # -- load: verified loads against the raw read rate and the peers ---------------------------

    def section_load(self, state: Any, total: int, ck: Any) -> dict[str, Any]:
        """The savepoint checkpoint read is an async save's (on CUDA: mlh64, checked on the
        device when loaded); ``sp_load_into_xxh3`` reads a sync save's (XXH3, checked on the
        host from the pinned pieces)."""
        from safetensors.torch import load_file, save_file

        import savepoint as sp
        from bench_save_load import evict, fsync_path, rm
        from savepoint.engine import device as device_fill

        torch = self.torch
        sp_path = os.path.join(self.dir, "load-sp")
        xxh3_path = os.path.join(self.dir, "load-sp-xxh3")
        st_path = os.path.join(self.dir, "load.safetensors")
        pt_path = os.path.join(self.dir, "load.pt")
        ck.save(sp_path, state).wait()
        sp.save(xxh3_path, state)
        fill_stats: dict[str, Any] = {}
        host = {name: t.detach().cpu() for name, t in leaves(state)}
        save_file(host, st_path)
        torch.save(host, pt_path)
        del host
        gc.collect()
        for p in (st_path, pt_path):
            fsync_path(p)
        data_files = [
            os.path.join(sp_path, f) for f in sorted(os.listdir(sp_path)) if f != "manifest.json"
        ]
        targets = empty_like_tree(torch, state)
        dev = str(self.device)
        reader = RawReader(chunk=64 * MiB if self.cuda else MiB)

        def timed(fn: Callable[[], Any], evict_paths: list[str]) -> float:
            for p in evict_paths:
                evict(p)
            self.sync()
            t0 = time.perf_counter()
            out = fn()
            self.sync()
            took = time.perf_counter() - t0
            del out
            return took

        def into() -> Any:
            out = sp.load(sp_path, into=targets)
            fill_stats["sp_load_into"] = dict(device_fill.stats)
            return out

        def into_xxh3() -> Any:
            out = sp.load(xxh3_path, into=targets)
            fill_stats["sp_load_into_xxh3"] = dict(device_fill.stats)
            return out

        def device_load() -> Any:
            out = sp.load(sp_path, device=dev)
            fill_stats["sp_load_device"] = dict(device_fill.stats)
            return out

        def safetensors_load() -> Any:
            return load_file(st_path, device=dev)

        def torch_load() -> Any:
            loaded = torch.load(pt_path, weights_only=True, map_location="cpu")
            return {k: v.to(dev) for k, v in loaded.items()}

        contenders: dict[str, tuple[Callable[[], Any], list[str]]] = {
            "raw_read": (lambda: reader(data_files), [sp_path]),
            "sp_load_into": (into, [sp_path]),
            "sp_load_into_xxh3": (into_xxh3, [xxh3_path]),
            "sp_load_device": (device_load, [sp_path]),
            "safetensors_load_file": (safetensors_load, [st_path]),
            "torch_load_to": (torch_load, [pt_path]),
        }
        times: dict[str, list[float]] = {k: [] for k in contenders}
        for r in range(self.args.load_repeats):
            if r and self.budget.left() < 20:
                break
            for name, (fn, paths) in contenders.items():
                times[name].append(timed(fn, paths))
                gc.collect()
            print(f"  round {r}: {_short({k: v[-1] for k, v in times.items()})}", flush=True)
        # The loads were right: the targets hold the state's bytes.
        for (name, want), (_, got) in zip(leaves(state), leaves(targets)):
            if not torch.equal(_bytes(torch, want), _bytes(torch, got)):
                raise AssertionError(f"sp.load(into=) gave different bytes for {name}")
        res: dict[str, Any] = {"state_bytes": total, "files": len(data_files)}
        for name, ts in times.items():
            res[f"{name}_s"] = _median(ts)
            res[f"{name}_gbps"] = total / res[f"{name}_s"] / 1e9
        res["raw_read_mode"] = _READ_MODE.get("mode", "?")
        res["device_fill"] = fill_stats  # pieces, tensors checked on the device / the host
        res["runs"] = times
        reader.close()
        for p in (sp_path, xxh3_path, st_path, pt_path):
            rm(p)
        return res

    # -- checksum ----------------------------------------------------------------------------------

    def section_checksum(self, state: Any, total: int) -> dict[str, Any]:
        """Device-side ``mlh64`` (savepoint.codecs.devhash) over every tensor of the state, the
        Triton kernel and the torch-operations fallback, against host XXH3 and host mlh64."""
        import numpy as np
        import xxhash

        from savepoint.codecs import devhash

        torch = self.torch
        res: dict[str, Any] = {}
        n = min(256 * MiB, total)
        host = np.random.default_rng(0).integers(0, 255, size=n, dtype=np.uint8)
        t0 = time.perf_counter()
        xxhash.xxh3_64_intdigest(host)
        res["host_xxh3_one_core_gbps"] = n / (time.perf_counter() - t0) / 1e9
        t0 = time.perf_counter()
        devhash.digest(host[: 32 * MiB])
        res["host_mlh64_one_core_gbps"] = 32 * MiB / (time.perf_counter() - t0) / 1e9
        flats = [t.reshape(-1).view(torch.uint8) for _, t in leaves(state)]
        variants: dict[str, bool | None] = {"torch_ops": False}
        if self.cuda and devhash._triton() is not None:
            variants = {"triton": True, **variants}
        if not self.cuda:
            variants = {"host_numpy": None}  # what torch_window_sums does with CPU tensors
        res["device_checksum_impl"] = next(iter(variants))
        for name, use_triton in variants.items():
            kw = {"use_triton": use_triton} if self.cuda else {}  # the CPU: NumPy, as loads do
            sums = [devhash.torch_window_sums(f, **kw) for f in flats]  # compile, warm up
            self.sync()
            best = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                sums = [devhash.torch_window_sums(f, **kw) for f in flats]
                self.sync()
                best = min(best, time.perf_counter() - t0)
            res[f"device_{name}_gbps"] = total / best / 1e9
            # The device digests are the host's, for a few tensors.
            for f, s in list(zip(flats, sums))[:: max(1, len(flats) // 4)]:
                got = devhash.finish(devhash.fold(s.cpu().numpy()), f.numel())
                if got != devhash.digest(f.cpu().numpy()):
                    raise AssertionError(f"{name}: a device digest differs from the host's")
        res["device_checksum_gbps"] = res[f"device_{res['device_checksum_impl']}_gbps"]
        return res

    # -- report ------------------------------------------------------------------------------------

    def ratios(self) -> list[dict[str, Any]]:
        r = self.out["results"]
        save, step, load = r.get("save", {}), r.get("step", {}), r.get("load", {})
        checksum = r.get("checksum", {})
        values: dict[str, float | None] = {}
        blocked = save.get("sp_async_blocked_s")
        if blocked is not None:
            values["async_blocking_over_pinned_copy"] = blocked / save["pinned_copy_s"]
            dcp = [
                save[k]
                for k in (
                    "dcp_pinned_sync_blocked_s",
                    "dcp_pinned_async_blocked_s",
                    "dcp_cpu_blocked_s",
                )
                if k in save
            ]
            if dcp:  # against DCP's fastest variant
                values["async_blocking_over_dcp_pinned"] = blocked / min(dcp)
        if "step_rate_during_write" in step:
            values["step_rate_during_write"] = step["step_rate_during_write"]
        if "sp_load_into_s" in load:
            into = load["sp_load_into_s"]
            values["load_into_over_raw_read"] = load["raw_read_s"] / into
            values["load_into_over_safetensors"] = load["safetensors_load_file_s"] / into
            values["load_into_over_torch_load"] = load["torch_load_to_s"] / into
        if "device_checksum_gbps" in checksum:
            values["device_checksum_gbps"] = checksum["device_checksum_gbps"]
        out = []
        for key, op, bound, what in TARGETS:
            v = values.get(key)
            met = None if v is None else (v <= bound if op == "<=" else v >= bound)
            if not self.cuda:
                met = None  # CPU smoke figures are not the GPU targets' figures
            out.append(
                {"name": key, "what": what, "value": v, "target": f"{op} {bound}", "met": met}
            )
        return out

    def print_ratios(self) -> None:
        print(f"ratios ({self.out['mode']}):", flush=True)
        for r in self.out["ratios"]:
            v = "-" if r["value"] is None else f"{r['value']:.3f}"
            met = {True: "met", False: "MISSED", None: ""}[r["met"]]
            print(f"  {r['what']:52s} {v:>9s}  ({r['target']}) {met}", flush=True)
        for name, error in self.out["errors"].items():
            print(f"  error in {name}: {error}", flush=True)


class _DcpSave:
    """One DCP ``async_save`` contender with its reused stager; call it to time one save."""

    def __init__(self, bench: Bench, dcp: Any, stager: Any) -> None:
        self.bench, self.dcp, self.stager = bench, dcp, stager

    def __call__(self, state: Any, path: str) -> dict[str, float]:
        from bench_save_load import rm

        rm(path)
        bench = self.bench
        bench.sync()
        t0 = time.perf_counter()
        resp = self.dcp.async_save(
            state, checkpoint_id=path, async_stager=self.stager, no_dist=True
        )
        returned = time.perf_counter() - t0
        staging = getattr(resp, "staging_completion", None)
        upload = getattr(resp, "upload_completion", resp)
        if staging is not None:  # async staging: the state may change only once it is staged
            staging.result()
        if bench.cuda:
            bench.torch.cuda.current_stream().synchronize()
        blocked = time.perf_counter() - t0
        upload.result()
        fsync_tree(path)
        return {"returned": returned, "blocked": blocked, "durable": time.perf_counter() - t0}

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.stager.close()


def _remove(*paths: str) -> None:
    """Delete the checkpoints a section wrote (the disk holds only a few states at once)."""
    for p in paths:
        if os.path.isdir(p):
            shutil.rmtree(p, ignore_errors=True)
        elif os.path.exists(p):
            os.unlink(p)


def fsync_tree(path: str) -> None:
    from bench_save_load import fsync_path

    for root, _, files in os.walk(path):
        for f in files:
            fsync_path(os.path.join(root, f))


_READ_MODE: dict[str, str] = {}


class RawReader:
    """Reads files whole, ``threads`` chunks at a time, with O_DIRECT into aligned buffers
    (buffered reads where the filesystem refuses O_DIRECT): the disk's raw read rate. The
    buffers are allocated and touched once, outside the timed reads."""

    def __init__(self, chunk: int = 64 * MiB, threads: int = 8) -> None:
        self.chunk = chunk
        self.buffers = [mmap.mmap(-1, chunk) for _ in range(threads)]
        for b in self.buffers:
            b.write(b"\1" * chunk)

    def close(self) -> None:
        for b in self.buffers:
            b.close()

    def __call__(self, paths: list[str]) -> int:
        chunk = self.chunk
        jobs = [(p, off) for p in paths for off in range(0, max(os.path.getsize(p), 1), chunk)]
        lock = threading.Lock()
        done = [0]

        def work(buf: mmap.mmap) -> None:
            view = memoryview(buf)
            fds: dict[str, int] = {}
            try:
                while True:
                    with lock:
                        if not jobs:
                            return
                        path, off = jobs.pop()
                    fd = fds.get(path)
                    if fd is None:
                        try:
                            fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
                            _READ_MODE.setdefault("mode", "O_DIRECT")
                        except OSError:
                            fd = os.open(path, os.O_RDONLY)
                            _READ_MODE["mode"] = "buffered"
                        fds[path] = fd
                    try:
                        n = os.preadv(fd, [view], off)
                    except OSError:  # O_DIRECT refused at read time
                        os.close(fd)
                        fd = fds[path] = os.open(path, os.O_RDONLY)
                        _READ_MODE["mode"] = "buffered"
                        n = os.preadv(fd, [view], off)
                    with lock:
                        done[0] += n
            finally:
                for fd in fds.values():
                    os.close(fd)
                view.release()

        n_threads = max(1, min(len(self.buffers), len(jobs)))
        pool = [threading.Thread(target=work, args=(b,)) for b in self.buffers[:n_threads]]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        return done[0]


def _bytes(torch: Any, t: Any) -> Any:
    return t.reshape(-1).view(torch.uint8)


def _short(values: dict[str, Any]) -> str:
    parts = []
    for k, v in values.items():
        if isinstance(v, dict):
            v = v.get("blocked", next(iter(v.values())))
        parts.append(f"{k} {v:.3f}s")
    return ", ".join(parts)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)  # bench_save_load
    try:
        import savepoint  # noqa: F401
    except ImportError:  # run from a checkout without PYTHONPATH=src
        sys.path.insert(0, os.path.join(os.path.dirname(here), "src"))
    try:
        import torch
    except ImportError:
        torch = None  # type: ignore[assignment]
    if torch is None or (not torch.cuda.is_available() and not args.cpu_smoke):
        why = "torch is not installed" if torch is None else "no CUDA device is available"
        print(f"bench_gpu: {why}: nothing measured (--cpu-smoke runs the code paths on the CPU)")
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump({"bench": "bench_gpu", "mode": "skipped", "skipped": why}, f, indent=2)
        return 0
    return Bench(args).run()


if __name__ == "__main__":
    sys.exit(main())
