"""``make gpu-check`` on a machine without CUDA, and the parts of its report only a GPU would
reach (failures, met and missed targets), so the one-command GPU check is known to work before a
GPU machine is lent for its few minutes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _support import load_generator

ROOT = Path(__file__).resolve().parents[1]
gpu_check = load_generator(ROOT / "benchmarks" / "gpu_check.py", "gpu_check")
bench_gpu = load_generator(ROOT / "benchmarks" / "bench_gpu.py", "bench_gpu")


@pytest.mark.slow
def test_the_check_runs_on_a_cpu_machine_and_says_the_cuda_parts_were_skipped(
    tmp_path: Path,
) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this test is the check's CPU mode")
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "gpu_check.py"),
            "--out",
            str(out),
            "--budget-s",
            "240",
            "--wheels",
            str(tmp_path / "no-wheels"),
            "--bench-args",
            "--repeats 1 --load-repeats 1",
        ],
        capture_output=True,
        text=True,
        timeout=400,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((out / "gpu-check-report.json").read_text())
    md = (out / "gpu-check-report.md").read_text()
    assert report["mode"] == "cpu"
    assert "CPU only: no CUDA device was found, so the CUDA parts were skipped" in md
    # Every cuda-marked test was collected (tests/cuda and the RNG test) and skipped.
    tests = report["tests"]
    assert tests["counts"]["failed"] == tests["counts"]["errors"] == 0, tests
    assert tests["counts"]["passed"] == 0
    assert tests["counts"]["skipped"] >= 12
    names = {s["name"] for s in tests["skipped"]}
    assert any("test_rng" in n for n in names) and any("test_cuda_async" in n for n in names)
    assert any("test_devhash_cuda" in n for n in names)
    assert "tests/cuda/test_cuda_state.py" in tests["files"]
    # The facts: versions, and what savepoint imported (the check runs on the device image).
    facts = report["facts"]
    assert facts["torch"]["version"] == torch.__version__
    assert facts["cuda_available"] is False
    assert facts["savepoint"]["import"] == "ok"
    # `import savepoint` itself imports no third-party module (issue 25 item 22); a save and a
    # load of float32 state need numpy and xxhash, not ml_dtypes.
    assert set(facts["savepoint"]["at_import"]) <= {"numpy"}
    assert {"numpy", "xxhash"} <= set(facts["savepoint"]["numpy_save_load"])
    assert "blake3" in facts["savepoint"]["incremental_save"]
    # The benchmark's CPU smoke run: every section ran, no error, no target judged.
    bench = report["bench"]
    assert bench["mode"] == "cpu-smoke" and bench["exit_code"] == 0, bench
    assert set(bench["results"]) == {"save", "step", "load", "checksum"}
    assert bench["errors"] == {}
    assert [r["met"] for r in bench["ratios"]] == [None] * len(bench_gpu.TARGETS)
    assert bench["results"]["load"]["sp_load_into_gbps"] > 0
    assert (out / "gpu-check-report-pytest.log").exists()
    assert (out / "gpu-check-report-bench.log").exists()


JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="1" failures="1" skipped="1" tests="4">
<testcase classname="test_cuda_async" name="test_ok" time="1.5"/>
<testcase classname="test_cuda_async" name="test_bad" time="0.2">
  <failure message="AssertionError: f32: bytes differ">long traceback</failure></testcase>
<testcase classname="test_cuda_runs" name="test_broken" time="0.1">
  <error message="failed on setup with RuntimeError: CUDA error">trace</error></testcase>
<testcase classname="test_cuda_state" name="test_verify_on_device" time="0.0">
  <skipped type="pytest.skip" message="device checksums are not written yet">x</skipped></testcase>
</testsuite></testsuites>"""


def test_the_report_of_a_cuda_run_names_failures_and_judges_the_targets() -> None:
    tests = gpu_check.parse_junit(JUNIT)
    assert tests["counts"] == {"passed": 1, "failed": 1, "errors": 1, "skipped": 1}
    assert tests["failed"][0]["name"] == "test_cuda_async::test_bad"
    assert tests["failed"][0]["message"] == "AssertionError: f32: bytes differ"
    assert tests["errors"][0]["name"] == "test_cuda_runs::test_broken"
    tests.update(seconds=12.0, exit_code=1, log="x-pytest.log")

    args = bench_gpu.parse_args(["--gib", "1"])
    bench = bench_gpu.Bench.__new__(bench_gpu.Bench)  # no torch, no device: only the ratios
    bench.args, bench.cuda = args, True
    bench.out = {"mode": "cuda", "errors": {}, "results": {}}
    bench.out["results"] = {
        "save": {
            "sp_async_blocked_s": 0.5,
            "pinned_copy_s": 0.45,
            "dcp_pinned_sync_blocked_s": 2.0,
            "dcp_pinned_async_blocked_s": 0.8,
        },
        "step": {"step_rate_during_write": 0.9},
        "load": {
            "sp_load_into_s": 2.0,
            "raw_read_s": 1.8,
            "safetensors_load_file_s": 3.0,
            "torch_load_to_s": 5.0,
        },
        "checksum": {"device_checksum_gbps": 250.0},
    }
    bench.out["ratios"] = bench.ratios()
    ratios = {r["name"]: r for r in bench.out["ratios"]}
    assert ratios["async_blocking_over_pinned_copy"]["value"] == pytest.approx(0.5 / 0.45)
    assert ratios["async_blocking_over_pinned_copy"]["met"] is True
    # Against DCP's faster variant (async staging here), not the slower one.
    assert ratios["async_blocking_over_dcp_pinned"]["value"] == pytest.approx(0.5 / 0.8)
    assert ratios["async_blocking_over_dcp_pinned"]["met"] is False
    assert ratios["step_rate_during_write"]["met"] is False
    assert ratios["load_into_over_raw_read"]["value"] == pytest.approx(0.9)
    assert ratios["load_into_over_raw_read"]["met"] is True
    assert ratios["load_into_over_safetensors"]["met"] is True
    assert ratios["device_checksum_gbps"]["met"] is True
    bench.print_ratios()

    report = {
        "mode": "cuda",
        "started": "2026-12-02T00:00:00+00:00",
        "budget_s": 480,
        "seconds": 400.0,
        "notes": [],
        "wheels": {"wheels": ["blake3-1.0.11.whl"], "installed": True},
        "facts": {
            "driver": "580.159.04",
            "torch": {
                "version": "2.11.0+cu130",
                "cuda": "13.0",
                "devices": [
                    {
                        "name": "NVIDIA H200",
                        "memory_gib": 139.8,
                        "multiprocessors": 132,
                        "capability": "9.0",
                    }
                ],
            },
            "gds": {"torch_cuda_gds": True, "libcufile": [], "nvidia_fs_kernel_module": False},
            "savepoint": {"import": "ok", "at_import": ["numpy", "xxhash"]},
        },
        "tests": tests,
        "bench": {
            "mode": "cuda",
            "config": {"state_gib": 5.0, "param_gib": 1.0, "tensors": 192},
            "ratios": bench.ratios(),
            "results": bench.out["results"],
            "skipped": {"checksum": "time budget"},
            "errors": {"save/dcp_pinned_async": "RuntimeError: no shm"},
        },
    }
    md = gpu_check.render_markdown(report)
    assert md.startswith("# GPU check: NVIDIA H200\n")
    assert "CPU only" not in md
    assert "| driver | 580.159.04 |" in md and "| torch | 2.11.0+cu130 |" in md
    assert "1 passed, 1 failed, 1 errors, 1 skipped" in md
    assert "- `test_cuda_async::test_bad`: AssertionError: f32: bytes differ" in md
    assert "- `test_cuda_runs::test_broken`: failed on setup" in md
    assert "| async save blocking / DCP async_save pinned | 0.625 | <= 0.5 | **no** |" in md
    assert "| async save blocking / pinned D2H copy | 1.111 | <= 1.2 | yes |" in md
    assert "section checksum skipped: time budget" in md
    assert "error in save/dcp_pinned_async: RuntimeError: no shm" in md
    assert "nvidia-fs module absent (compatibility mode only)" in md


def test_the_benchmark_without_cuda_measures_nothing_and_says_so(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this test is the no-CUDA path")
    out = tmp_path / "bench.json"
    assert bench_gpu.main(["--json", str(out)]) == 0
    assert json.loads(out.read_text()) == {
        "bench": "bench_gpu",
        "mode": "skipped",
        "skipped": "no CUDA device is available",
    }
    with pytest.raises(SystemExit):
        bench_gpu.parse_args(["--sections", "save,nonsense"])
    assert bench_gpu.parse_args(["--cpu-smoke"]).gib < 0.01
    assert bench_gpu.parse_args(["--sections", "load"]).sections == ["load"]


def test_a_check_stopped_at_its_limit_keeps_what_its_log_says(tmp_path: Path) -> None:
    log = tmp_path / "log"
    started = time.monotonic()
    code = gpu_check.run_logged(
        [sys.executable, "-c", "print('started', flush=True); import time; time.sleep(60)"],
        dict(os.environ),
        log,
        1.0,
    )
    assert code is None and time.monotonic() - started < 30
    assert log.read_text() == "started\n"
    got = gpu_check.parse_verbose_log(
        "tests/cuda/test_cuda_async.py::test_a PASSED                       [ 10%]\n"
        "tests/cuda/test_cuda_async.py::test_b FAILED                       [ 20%]\n"
        "tests/cuda/test_cuda_state.py::test_c[x-1] SKIPPED (needs CUDA)   [ 30%]\n"
        "tests/cuda/test_cuda_runs.py::test_d ERROR                         [ 40%]\n"
        "some other line\n"
    )
    assert got["counts"] == {"passed": 1, "failed": 1, "errors": 1, "skipped": 1}
    assert got["failed"][0]["name"] == "tests/cuda/test_cuda_async.py::test_b"
    assert got["skipped"][0]["name"] == "tests/cuda/test_cuda_state.py::test_c[x-1]"
