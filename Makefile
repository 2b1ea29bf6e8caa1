# Everything a fresh machine needs: `make demo` and `make test` create .venv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test fuzz torture lint bench gpu-check gpu-wheels clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	# constraints.txt pins torch==2.13.0 (the CPU build) so nothing pulls a CUDA build.
	$(PY) -m pip install --quiet -c constraints.txt -e '.[torch,dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

# The suite in TEST_WORKERS processes (pytest-xdist), each test file in one of them, so that a
# module's fixtures are built once; TEST_WORKERS=0 runs it in this process (docs/performance.md,
# "Test suite time").
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=15

# Long campaigns; `make test` runs a bounded slice of each.
# make fuzz FUZZ_SECONDS=600 runs every parser for ten minutes, each under a memory cap.
FUZZ_SECONDS ?= 60
FUZZ_MEMORY_MIB ?= 2048
fuzz: $(STAMP)
	cd tests && ../$(PY) fuzz/run.py --seconds $(FUZZ_SECONDS) --memory-mib $(FUZZ_MEMORY_MIB) --crashes ../fuzz-crashes

# Thousands of kills, long reader/writer races, a dense full-disk sweep.
TORTURE_SCALE ?= 25
TORTURE_SECONDS ?= 120
torture: $(STAMP)
	SAVEPOINT_TORTURE=1 SAVEPOINT_TORTURE_SCALE=$(TORTURE_SCALE) SAVEPOINT_TORTURE_SECONDS=$(TORTURE_SECONDS) \
		$(PY) -m pytest -q -p no:cacheprovider tests/faults tests/runs tests/test_resume_exact.py \
		tests/async_/test_process_writer.py tests/integrations/test_dcp.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check src tests benchmarks examples
	$(VENV)/bin/mypy

bench: $(STAMP)
	$(PY) benchmarks/bench_save_load.py

# The GPU check (docs/performance.md, "GPU check"): one command on a GPU machine, at most 8
# minutes. It uses $(PYTHON) as it is (on the GPU image: python3 with CUDA torch), never the venv,
# and downloads nothing: it installs the wheels `make gpu-wheels` put in .whl/, runs every
# cuda-marked test and benchmarks/bench_gpu.py, and writes gpu-check-report.md/.json into $OUT
# (when set) or here. On a machine without CUDA it skips the CUDA parts and says so.
GPU_CHECK_ARGS ?=
gpu-check:
	$(PYTHON) benchmarks/gpu_check.py $(GPU_CHECK_ARGS)

# Wheels of what savepoint needs and the GPU image lacks (blake3; zstandard and obstore for
# compressed blobs and object stores), for CPython 3.12 on x86-64 Linux, into .whl/ (git-ignored).
GPU_WHEELS ?= blake3==1.0.11 zstandard==0.25.0 obstore==0.12.1
gpu-wheels:
	$(PYTHON) -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
		--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		--platform manylinux1_x86_64 -d .whl $(GPU_WHEELS)

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis fuzz-crashes
