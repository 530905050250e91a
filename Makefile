# The two commands a user needs (see README): `make demo` and `make test`.
# Both create .venv and install everything on first use.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export UCX_WARN_UNUSED_ENV_VARS = n
export UCX_LOG_LEVEL = error
export PYTHONUNBUFFERED = 1

.PHONY: demo test test-all bench lint venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	@# CPU torch where there is no NVIDIA GPU: an unpinned torch pulls a multi-GB CUDA build.
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install -q torch==2.13.0; fi
	$(PY) -m pip install -q -e '.[compute,ucx,test,dev,report]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m tools.local_cluster $(DEMO_ARGS)

# Worker processes for `make test` (pytest-xdist): most of the suite's time is spent waiting on
# daemons, timers and sockets, so two workers take ~0.56x of the serial wall time even on a
# 2-core machine. A test file's tests stay in one worker (--dist loadfile: module fixtures are
# shared, and a file's daemons are not raced by its own tests). TEST_WORKERS=0 runs serially.
TEST_WORKERS ?= 2

test: $(STAMP)
	$(PY) -m pytest -m "not slow" -n $(TEST_WORKERS) --dist loadfile --durations=25 $(PYTEST_ARGS)

test-all: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

bench: $(STAMP)
	for b in model scale lif membership leases transport storage cluster topology restore ramp export bigrow snapshot cluster_jobs readpath usage fold_reads replay_windows delta_lookups drop_stall repair scan_live plan gpu; do $(PY) -m tools.bench.$$b || exit 1; done

lint: $(STAMP)
	$(PY) -m mypy
	$(VENV)/bin/ruff check giaannd peers tools tests
	$(VENV)/bin/lint-imports

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache
