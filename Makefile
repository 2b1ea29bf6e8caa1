# Everything a fresh machine needs: `make demo` and `make test` create .venv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test fuzz torture lint bench clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	# constraints.txt pins torch==2.13.0 (the CPU build) so nothing pulls a CUDA build.
	$(PY) -m pip install --quiet -c constraints.txt -e '.[torch,dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

test: $(STAMP)
	$(PY) -m pytest -q

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
		$(PY) -m pytest -q -p no:cacheprovider tests/faults tests/runs tests/test_resume_exact.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check src tests benchmarks examples
	$(VENV)/bin/mypy

bench: $(STAMP)
	$(PY) benchmarks/bench_save_load.py

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis fuzz-crashes
