"""`make gpu-check`: the whole GPU check in one command, one report (issue 24).

Usage (from the repository root; ``make gpu-check`` runs the first form)::

    python3 benchmarks/gpu_check.py [--out DIR] [--budget-s 480] [--bench-gib 1]
    python3 benchmarks/gpu_check.py --facts        # print the device facts as JSON and exit

Runs with the interpreter that starts it (on the GPU machine: the image's python3, which has
torch with CUDA; no virtual environment is made, nothing is downloaded):

1. installs the wheels carried in ``.whl/`` (``make gpu-wheels``: packages the image lacks) into
   ``--site`` (default /tmp/site), and gives every child ``PYTHONPATH=src:<site>`` so the checkout
   is imported as it is, without installing it;
2. records the device facts: device, driver, torch, CUDA, cuDNN, NCCL, Triton, CuPy and JAX
   versions, cuFile/GDS presence, and which third-party modules ``import savepoint`` and a save,
   a load and an incremental (blob) save need;
3. runs ``pytest -m cuda`` on every test file that has cuda-marked tests (tests/cuda/ and any file
   naming the marker), each test under a timeout when pytest-timeout is there, all of them
   under ``--test-budget-s``;
4. runs ``benchmarks/bench_gpu.py`` in what is left of ``--budget-s`` (at most 8 minutes in all
   by default);
5. writes one report, ``<name>.md`` and ``<name>.json`` (tests passed, failed with names and
   messages, skipped; the benchmark's figures and ratios against the issue's targets; the device
   facts), in ``--out``: default ``$OUT`` when set (the device tool brings that folder back),
   else the working directory. The pytest and benchmark logs go beside them.

Without CUDA it runs the same steps with the CUDA parts skipped (the cuda tests are collected
and skip; the benchmark runs its CPU smoke mode) and the report says so; it then exits 0. With
CUDA it exits 1 when a test failed or could not run, else 0.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import glob
import importlib.metadata
import json
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
TESTS = ROOT / "tests"
BENCH = ROOT / "benchmarks" / "bench_gpu.py"

# Distributions whose versions the report records (None when not installed).
PACKAGES = [
    "torch",
    "triton",
    "cupy-cuda13x",
    "cupy-cuda12x",
    "jax",
    "jaxlib",
    "numpy",
    "safetensors",
    "ml-dtypes",
    "msgpack",
    "xxhash",
    "click",
    "tqdm",
    "blake3",
    "zstandard",
    "obstore",
    "fsspec",
    "pytest",
    "pytest-timeout",
    "psutil",
    "kvikio",
    "nvidia-cufile",
    "nvidia-nccl-cu13",
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", default=None, help="report folder (default: $OUT, else the cwd)")
    ap.add_argument("--name", default="gpu-check-report", help="report file name, no suffix")
    ap.add_argument("--budget-s", type=float, default=480.0, help="the whole check's time")
    ap.add_argument("--test-budget-s", type=float, default=210.0, help="pytest's share of it")
    ap.add_argument("--test-timeout", type=float, default=150.0, help="seconds for one test")
    ap.add_argument("--bench-gib", type=float, default=None, help="bench_gpu.py --gib")
    ap.add_argument(
        "--bench-args", default="", help="more bench_gpu.py arguments, e.g. '--repeats 1'"
    )
    ap.add_argument("--wheels", default=str(ROOT / ".whl"), help="folder of wheels to install")
    ap.add_argument("--site", default="/tmp/site", help="where the wheels are installed")
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--skip-bench", action="store_true")
    ap.add_argument("--facts", action="store_true", help="print the facts as JSON and exit")
    return ap.parse_args(argv)


# -- facts (run in a child, with the children's environment) -------------------------------------


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _third_party() -> list[str]:
    std = set(sys.stdlib_module_names) | set(sys.builtin_module_names)
    top = {name.split(".")[0] for name, m in list(sys.modules.items()) if m is not None}
    return sorted(n for n in top if n not in std and not n.startswith("_") and n != "savepoint")


def _run_quiet(cmd: list[str], timeout: float = 20.0) -> str | None:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _savepoint_imports() -> dict[str, Any]:
    """Which third-party modules savepoint needs: at import, for a save and a load of numpy
    state, for an incremental save (BLAKE3-named blobs), then for torch tensors."""
    out: dict[str, Any] = {}
    try:
        import numpy as np

        import savepoint as sp

        out["import"] = "ok"
        out["version"] = sp.__version__
        out["file"] = sp.__file__
        out["at_import"] = _third_party()
        with tempfile.TemporaryDirectory() as tmp:
            state = {"w": np.arange(1024, dtype=np.float32), "step": 3}
            sp.save(os.path.join(tmp, "a"), state)
            sp.load(os.path.join(tmp, "a"))
            out["numpy_save_load"] = _third_party()
            try:
                sp.save(os.path.join(tmp, "b"), state, blobs=os.path.join(tmp, "blobs"))
                sp.load(os.path.join(tmp, "b"))
                out["incremental_save"] = _third_party()
            except Exception as exc:  # blake3 missing: say so, go on
                out["incremental_save"] = f"failed: {type(exc).__name__}: {exc}"
            import torch

            sp.save(os.path.join(tmp, "c"), {"w": torch.ones(8, dtype=torch.bfloat16)})
            sp.load(os.path.join(tmp, "c"))
            out["torch_save_load"] = _third_party()
    except Exception as exc:
        out.setdefault("import", f"failed: {type(exc).__name__}: {exc}")
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


def _gds() -> dict[str, Any]:
    """cuFile/GDS presence, without opening the driver (the device load path reports the mode
    it ran in)."""
    import ctypes.util
    import importlib.util

    libs = []
    found = ctypes.util.find_library("cufile")
    if found:
        libs.append(found)
    for base in sys.path:
        libs += glob.glob(os.path.join(base, "nvidia", "cufile", "lib", "libcufile.so*"))
    return {
        "torch_cuda_gds": importlib.util.find_spec("torch.cuda.gds") is not None,
        "libcufile": sorted(set(libs)),
        "nvidia_fs_kernel_module": os.path.exists("/proc/driver/nvidia-fs"),
        "cufile_json": next(
            (
                p
                for p in (os.environ.get("CUFILE_ENV_PATH_JSON"), "/etc/cufile.json")
                if p and os.path.exists(p)
            ),
            None,
        ),
        "kvikio": _version("kvikio"),
        "note": "without the nvidia-fs module cuFile can only run in compatibility mode",
    }


def facts() -> dict[str, Any]:
    out: dict[str, Any] = {
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "packages": {p: _version(p) for p in PACKAGES},
    }
    with contextlib.suppress(OSError), open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                out["memory_gib"] = round(int(line.split()[1]) / 2**20, 1)
    out["savepoint"] = _savepoint_imports()
    out["gds"] = _gds()
    smi = _run_quiet(
        [
            "nvidia-smi",
            "--query-gpu=name,driver_version,memory.total,clocks.max.sm,pcie.link.gen.current",
            "--format=csv,noheader",
        ]
    )
    out["nvidia_smi"] = smi
    try:
        import torch
    except ImportError as exc:
        out["torch"] = {"error": str(exc)}
        out["cuda_available"] = False
        return out
    t: dict[str, Any] = {
        "version": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
    }
    with contextlib.suppress(Exception):
        t["cudnn"] = torch.backends.cudnn.version()
    if torch.cuda.is_available():
        t["device_count"] = torch.cuda.device_count()
        devices = []
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            devices.append(
                {
                    "name": p.name,
                    "capability": f"{p.major}.{p.minor}",
                    "memory_gib": round(p.total_memory / 2**30, 1),
                    "multiprocessors": p.multi_processor_count,
                }
            )
        t["devices"] = devices
        with contextlib.suppress(Exception):
            t["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        with contextlib.suppress(Exception):
            import cupy

            out["cupy_cuda"] = {
                "runtime": cupy.cuda.runtime.runtimeGetVersion(),
                "driver": cupy.cuda.runtime.driverGetVersion(),
            }
    if smi:
        out["driver"] = smi.splitlines()[0].split(",")[1].strip()
    else:
        with contextlib.suppress(Exception):
            import pynvml

            pynvml.nvmlInit()
            out["driver"] = str(pynvml.nvmlSystemGetDriverVersion())
    out["torch"] = t
    out["cuda_available"] = bool(t["cuda_available"])
    return out


# -- the steps ---------------------------------------------------------------------------------


class Check:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.started = time.monotonic()
        self.out_dir = Path(args.out or os.environ.get("OUT") or os.getcwd()).resolve()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
        self.report: dict[str, Any] = {
            "check": "gpu-check",
            "started": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "budget_s": args.budget_s,
            "mode": None,
            "notes": [],
        }
        self.env = dict(os.environ)

    def left(self) -> float:
        return self.args.budget_s - (time.monotonic() - self.started)

    def note(self, text: str) -> None:
        print(f"gpu-check: {text}", flush=True)
        self.report["notes"].append(text)

    def install_wheels(self) -> None:
        wheels = sorted(glob.glob(os.path.join(self.args.wheels, "*.whl")))
        paths = [str(SRC)]
        info: dict[str, Any] = {
            "folder": self.args.wheels,
            "wheels": [Path(w).name for w in wheels],
        }
        if wheels:
            cmd = [
                sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                "--no-compile", "--no-cache-dir", "--upgrade", "--target", self.args.site, *wheels,
            ]  # fmt: skip
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, check=False)
                info["installed"] = proc.returncode == 0
                if proc.returncode:
                    info["error"] = (proc.stdout + proc.stderr)[-2000:]
            except (OSError, subprocess.TimeoutExpired) as exc:
                info["installed"], info["error"] = False, str(exc)
            if info["installed"]:
                paths.append(self.args.site)
            else:
                self.note(f"the wheels in {self.args.wheels} did not install: {info['error']}")
        else:
            info["installed"] = None
            self.note(f"no wheels in {self.args.wheels} (make gpu-wheels); using what is installed")
        old = self.env.get("PYTHONPATH")
        self.env["PYTHONPATH"] = os.pathsep.join([*paths, *([old] if old else [])])
        self.env["PYTHONUNBUFFERED"] = "1"
        self.env["PYTHONDONTWRITEBYTECODE"] = "1"
        self.report["wheels"] = info

    def facts(self) -> dict[str, Any]:
        cmd = [sys.executable, __file__, "--facts"]
        try:
            proc = subprocess.run(
                cmd, env=self.env, capture_output=True, text=True, timeout=180, check=False
            )
        except subprocess.TimeoutExpired:
            return {"error": "the facts child did not finish in 180 s", "cuda_available": False}
        lines = proc.stdout.strip().splitlines()
        try:
            found: dict[str, Any] = json.loads(lines[-1])
        except (IndexError, json.JSONDecodeError):
            return {"error": (proc.stdout + proc.stderr)[-3000:], "cuda_available": False}
        return found

    def test_files(self) -> list[str]:
        files = set(glob.glob(str(TESTS / "cuda" / "test_*.py")))
        for path in glob.glob(str(TESTS / "**" / "test_*.py"), recursive=True):
            with contextlib.suppress(OSError), open(path, encoding="utf-8") as f:
                if "mark.cuda" in f.read():
                    files.add(path)
        return sorted(os.path.relpath(p, ROOT) for p in files)

    def run_tests(self, cuda: bool) -> dict[str, Any]:
        files = self.test_files()
        junit = self.work / "junit.xml"
        log = self.out_dir / f"{self.args.name}-pytest.log"
        cmd = [sys.executable, "-m", "pytest", "-m", "cuda", "-p", "no:cacheprovider", "-v"]
        has_timeout = (
            subprocess.run(
                [sys.executable, "-c", "import pytest_timeout"],
                env=self.env,
                capture_output=True,
                check=False,
            ).returncode
            == 0
        )
        if has_timeout:
            cmd += ["-p", "pytest_timeout", f"--timeout={int(self.args.test_timeout)}"]
        cmd += [f"--junitxml={junit}", *files]
        env = dict(self.env, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
        limit = max(30.0, min(self.args.test_budget_s, self.left() - 60))
        print(f"gpu-check: pytest -m cuda on {len(files)} files, {limit:.0f} s at most", flush=True)
        started = time.monotonic()
        result: dict[str, Any] = {
            "command": " ".join(cmd[1:]),
            "files": files,
            "per_test_timeout_s": self.args.test_timeout if has_timeout else None,
            "limit_s": round(limit),
        }
        result["exit_code"] = run_logged(cmd, env, log, limit)
        if result["exit_code"] is None:
            result["timed_out"] = True
            self.note(f"pytest was stopped at its {limit:.0f} s limit (results from its log)")
        result["seconds"] = round(time.monotonic() - started, 1)
        result["log"] = log.name
        if junit.exists():
            result.update(parse_junit(junit.read_text(encoding="utf-8")))
        else:
            result.update(parse_verbose_log(_tail(log, 1 << 20)))
            result["error"] = "pytest wrote no JUnit results; its log ends: " + _tail(log, 2000)
        if not cuda:
            result["cuda"] = "no CUDA device: every cuda test was collected and skipped"
        return result

    def run_bench(self, cuda: bool) -> dict[str, Any]:
        json_path = self.work / "bench.json"
        log = self.out_dir / f"{self.args.name}-bench.log"
        limit = self.left() - 15
        if limit < 30:
            self.note(f"the benchmark was not run: {self.left():.0f} s of the budget were left")
            return {"skipped": "time budget"}
        cmd = [
            sys.executable,
            str(BENCH),
            "--json",
            str(json_path),
            "--budget-s",
            f"{limit - 20:.0f}",
        ]
        if self.args.bench_gib is not None:
            cmd += ["--gib", str(self.args.bench_gib)]
        cmd += shlex.split(self.args.bench_args)
        if not cuda:
            cmd.append("--cpu-smoke")
        print(f"gpu-check: {' '.join(cmd[1:])}", flush=True)
        started = time.monotonic()
        code = run_logged(cmd, self.env, log, limit)
        if code is None:
            self.note(f"the benchmark was stopped at {limit:.0f} s; its figures so far kept")
        result: dict[str, Any] = {}
        if json_path.exists():
            result = json.loads(json_path.read_text(encoding="utf-8"))
        else:
            result["error"] = "the benchmark wrote no figures: " + _tail(log, 3000)
        result["exit_code"] = code
        result["seconds"] = round(time.monotonic() - started, 1)
        result["log"] = log.name
        return result

    def run(self) -> int:
        self.install_wheels()
        print("gpu-check: device facts", flush=True)
        found = self.facts()
        self.report["facts"] = found
        cuda = bool(found.get("cuda_available"))
        self.report["mode"] = "cuda" if cuda else "cpu"
        if not cuda:
            self.note(
                "no CUDA device here: the CUDA parts are skipped (the cuda tests are collected "
                "and skip; the benchmark runs its CPU smoke mode, whose figures are not GPU "
                "figures)"
            )
        if self.args.skip_tests:
            self.report["tests"] = {"skipped": "--skip-tests"}
        else:
            self.report["tests"] = self.run_tests(cuda)
        self.write()
        if self.args.skip_bench:
            self.report["bench"] = {"skipped": "--skip-bench"}
        else:
            self.report["bench"] = self.run_bench(cuda)
        self.report["seconds"] = round(time.monotonic() - self.started, 1)
        self.write()
        shutil.rmtree(self.work, ignore_errors=True)
        tests = self.report["tests"]
        bad = bool(tests.get("failed") or tests.get("errors") or tests.get("error"))
        print(f"gpu-check: report in {self.out_dir / self.args.name}.md", flush=True)
        return 1 if cuda and bad else 0

    def write(self) -> None:
        base = self.out_dir / self.args.name
        with open(f"{base}.json", "w", encoding="utf-8") as f:
            json.dump(self.report, f, indent=2, default=str)
        Path(f"{base}.md").write_text(render_markdown(self.report), encoding="utf-8")


def run_logged(cmd: list[str], env: dict[str, str], log: Path, limit: float) -> int | None:
    """Run ``cmd`` from the repository root, output to ``log``, in a process group of its own;
    past ``limit`` seconds the whole group is killed (children holding the GPU included) and
    None is returned, else the exit code."""
    with open(log, "w", encoding="utf-8") as f:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            return proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return None


_OUTCOME = re.compile(r"^(\S+::\S+?) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b(.*)$")


def _outcomes(
    passed: list[Any], failed: list[Any], errors: list[Any], skipped: list[Any]
) -> dict[str, Any]:
    """The tests' part of the report, with its counts."""
    lists = {"passed": passed, "failed": failed, "errors": errors, "skipped": skipped}
    return {**lists, "counts": {k: len(v) for k, v in lists.items()}}


def parse_verbose_log(text: str) -> dict[str, Any]:
    """Outcomes from ``pytest -v`` output, for a run stopped before it wrote its JUnit file
    (the test it was in is then missing)."""
    passed: list[str] = []
    failed: list[dict[str, str]] = []
    errors: list[dict[str, str]] = []
    skipped: list[dict[str, str]] = []
    for line in text.splitlines():
        m = _OUTCOME.match(line.strip())
        if not m:
            continue
        name, outcome, rest = m.group(1), m.group(2), m.group(3).strip()
        if outcome in ("PASSED", "XPASS"):
            passed.append(name)
        elif outcome == "FAILED":
            failed.append({"name": name, "message": "see the log", "detail": ""})
        elif outcome == "ERROR":
            errors.append({"name": name, "message": "see the log", "detail": ""})
        else:
            skipped.append({"name": name, "reason": rest})
    return _outcomes(passed, failed, errors, skipped)


def _tail(path: Path, n: int) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")[-n:]
    except OSError:
        return ""


def parse_junit(text: str) -> dict[str, Any]:
    """pytest's JUnit XML as counts and lists: passed names, failed/errors with messages,
    skipped with reasons."""
    root = ET.fromstring(text)
    passed: list[str] = []
    failed: list[dict[str, str]] = []
    errors: list[dict[str, str]] = []
    skipped: list[dict[str, str]] = []
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}".lstrip(":")
        seconds = float(case.get("time") or 0)
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                message = (child.get("message") or "").strip()
                detail = (child.text or "").strip()
                entry = {"name": name, "message": message[:2000], "detail": detail[-4000:]}
                if child.tag == "skipped":
                    skipped.append({"name": name, "reason": message[:500]})
                    outcome = "skipped"
                elif child.tag == "failure":
                    failed.append(entry)
                    outcome = "failed"
                else:
                    errors.append(entry)
                    outcome = "error"
        if outcome == "passed":
            passed.append(f"{name} ({seconds:.1f} s)")
    return _outcomes(passed, failed, errors, skipped)


# -- the markdown report ---------------------------------------------------------------------------


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "-" if v is None else str(v)


def render_markdown(r: dict[str, Any]) -> str:
    facts = r.get("facts") or {}
    torch_facts = facts.get("torch") or {}
    devices = torch_facts.get("devices") or []
    device = devices[0]["name"] if devices else "no CUDA device"
    lines = [f"# GPU check: {device}", ""]
    if r.get("mode") == "cpu":
        lines += [
            "**CPU only: no CUDA device was found, so the CUDA parts were skipped** (the cuda "
            "tests were collected and skipped; the benchmark ran its CPU smoke mode: its "
            "figures are not GPU figures).",
            "",
        ]
    packages = facts.get("packages") or {}
    rows = [
        ("started", r.get("started")),
        ("mode", r.get("mode")),
        ("device", ", ".join(map(_device_line, devices)) or "none"),
        ("driver", facts.get("driver") or facts.get("nvidia_smi")),
        ("torch", torch_facts.get("version")),
        ("CUDA (torch)", torch_facts.get("cuda")),
        ("cuDNN", torch_facts.get("cudnn")),
        ("NCCL", torch_facts.get("nccl")),
        ("CuPy CUDA runtime / driver", facts.get("cupy_cuda")),
        ("triton", packages.get("triton")),
        ("cupy", packages.get("cupy-cuda13x") or packages.get("cupy-cuda12x")),
        ("jax", packages.get("jax")),
        ("python", f"{facts.get('python')} ({facts.get('executable')})"),
        ("CPUs / memory", f"{facts.get('cpus')} / {facts.get('memory_gib')} GiB"),
        ("cuFile / GDS", _gds_line(facts.get("gds") or {})),
        ("wheels", _wheels_line(r.get("wheels") or {})),
        ("took", f"{r.get('seconds', '-')} s of a {r.get('budget_s')} s budget"),
    ]
    lines += ["| | |", "| --- | --- |"]
    lines += [f"| {k} | {_fmt(v)} |" for k, v in rows]
    lines += [""]
    for note in r.get("notes", []):
        lines.append(f"- {note}")
    lines += ["", "## Tests (`pytest -m cuda`)", ""]
    tests = r.get("tests") or {}
    counts = tests.get("counts")
    if counts:
        lines.append(
            f"{counts['passed']} passed, {counts['failed']} failed, {counts['errors']} errors, "
            f"{counts['skipped']} skipped in {tests.get('seconds')} s "
            f"(exit code {tests.get('exit_code')}; log {tests.get('log')})"
        )
    for key in ("cuda", "error", "skipped") if not counts else ("cuda", "error"):
        if isinstance(tests.get(key), str):
            lines.append(f"{key}: {tests[key]}")
    for title, key in (("Failed", "failed"), ("Errors", "errors")):
        items = tests.get(key) or []
        if items:
            lines += ["", f"### {title}", ""]
            for item in items:
                first = (item["message"] or item["detail"]).splitlines()[:6]
                lines.append(f"- `{item['name']}`: " + " / ".join(s.strip() for s in first))
    if tests.get("passed"):
        lines += ["", "<details><summary>passed</summary>", ""]
        lines += [f"- `{name}`" for name in tests["passed"]]
        lines += ["", "</details>"]
    if tests.get("skipped") and counts and r.get("mode") == "cuda":
        lines += ["", "Skipped:", ""]
        lines += [f"- `{s['name']}`: {s['reason']}" for s in tests["skipped"]]
    lines += ["", "## Benchmark (`benchmarks/bench_gpu.py`)", ""]
    bench = r.get("bench") or {}
    if "ratios" in bench:
        cfg = bench.get("config", {})
        lines.append(
            f"mode {bench.get('mode')}, state {cfg.get('state_gib')} GiB ({cfg.get('param_gib')} "
            f"GiB bf16 parameters + fp32 Adam moments, {cfg.get('tensors')} tensors), "
            f"scratch on {bench.get('device', {}).get('scratch_fs')}, "
            f"{bench.get('seconds')} s (log {bench.get('log')})"
        )
        lines += ["", "| target | value | bound | met |", "| --- | --- | --- | --- |"]
        for ratio in bench["ratios"]:
            met = {True: "yes", False: "**no**", None: "-"}[ratio["met"]]
            lines.append(
                f"| {ratio['what']} | {_fmt(ratio['value'])} | {ratio['target']} | {met} |"
            )
        for name, res in (bench.get("results") or {}).items():
            figures = {k: v for k, v in res.items() if not isinstance(v, (dict, list))}
            lines += ["", f"**{name}**: " + ", ".join(f"{k} {_fmt(v)}" for k, v in figures.items())]
        for name, why in (bench.get("skipped") or {}).items():
            lines.append(f"- section {name} skipped: {why}")
        for name, error in (bench.get("errors") or {}).items():
            lines.append(f"- error in {name}: {error}")
    else:
        for key in ("skipped", "error"):
            if key in bench:
                lines.append(f"{key}: {bench[key]}")
    sp_facts = facts.get("savepoint") or {}
    lines += ["", "## What savepoint imported", ""]
    for key in ("import", "at_import", "numpy_save_load", "incremental_save", "torch_save_load"):
        if key in sp_facts:
            v = sp_facts[key]
            lines.append(f"- {key}: {', '.join(v) if isinstance(v, list) else v}")
    if facts.get("error"):
        lines += ["", f"facts error: {facts['error']}"]
    return "\n".join(lines) + "\n"


def _device_line(d: dict[str, Any]) -> str:
    return (
        f"{d['name']} ({d['memory_gib']} GiB, {d['multiprocessors']} SMs, "
        f"capability {d['capability']})"
    )


def _gds_line(g: dict[str, Any]) -> str:
    if not g:
        return "-"
    return (
        f"torch.cuda.gds {'yes' if g.get('torch_cuda_gds') else 'no'}; libcufile "
        f"{', '.join(g.get('libcufile') or []) or 'not found'}; nvidia-fs module "
        f"{'loaded' if g.get('nvidia_fs_kernel_module') else 'absent (compatibility mode only)'}; "
        f"cufile.json {g.get('cufile_json') or 'none'}; kvikio {g.get('kvikio') or 'no'}"
    )


def _wheels_line(w: dict[str, Any]) -> str:
    names = ", ".join(w.get("wheels") or []) or "none"
    state = {True: "installed", False: "FAILED to install", None: "nothing to install"}
    return f"{names} ({state.get(w.get('installed'), '-')})"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.facts:
        print(json.dumps(facts(), default=str))
        return 0
    return Check(args).run()


if __name__ == "__main__":
    sys.exit(main())
