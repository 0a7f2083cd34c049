# Quick start: `make demo` (core install + the demo), `make test` (adds the test extras, runs the suite).
PYTHON ?= python3
VENV   ?= .venv
# The CPU wheel of torch 2.13.0 installs from local disk on the project machines; override on a GPU box,
# e.g. `make TORCH=torch demo` to keep whatever torch your platform gives.
TORCH  ?= torch==2.13.0
PY      = $(VENV)/bin/python
# Two install stamps: the core (torch, numpy, rich, tqdm and pisa-attn: all the demo needs) and
# the test extras on top (Triton for its CPU interpreter, pytest, hypothesis, matplotlib and the
# diffusers stack).
CORE    = $(VENV)/.pisa-core
EXTRAS  = $(VENV)/.pisa-test
# --dist loadscope: a module's tests share one worker, so a module-scoped fixture (the spawned
# process groups, the tiny models) is built once, not once per worker.
# pytest exits with 5 when a marker selects no test; that is not a failure here.
PYTEST  = $(PY) -m pytest -q --durations=15

.PHONY: setup demo test test-slow build-device clean

$(CORE): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e .
	touch $(CORE)

$(EXTRAS): $(CORE)
	$(PY) -m pip install -q -e ".[test]"
	touch $(EXTRAS)

setup: $(EXTRAS)

demo: $(CORE)
	$(VENV)/bin/pisa-attn demo

# Everything but the tests marked `slow` (about 5 minutes on 2 cores, cold). The CPU statement: CUDA is
# hidden, so a GPU machine runs it as CI does (its GPU tests: tests/gpu/run_all.sh).
test: $(EXTRAS)
	CUDA_VISIBLE_DEVICES= $(PYTEST) -n 2 --dist loadscope -m "not slow" || [ $$? -eq 5 ]

# The tests marked `slow` (C++ through inductor, the end-to-end benchmark's tiny run); CI runs them
# after `make test`. Two workers: under `-m slow` each imports only the modules that mark a test slow
# (tests/conftest.py), and the single-threaded benchmark run overlaps inductor's compiles.
test-slow: $(EXTRAS)
	CUDA_VISIBLE_DEVICES= $(PYTEST) -n 2 --dist loadscope -m slow || [ $$? -eq 5 ]

# The sm_90a build tests (Hopper kernels, selection, statistics and the fit: spills, serialised
# tensor-core loops), every variant (`make test` builds a subset of each), with the GPU machines'
# toolchain, Triton 3.6 (its ptxas 12.8 allocates registers unlike newer ones), installed beside the
# venv's Triton and put first on the path.
DEVICE_TRITON ?= triton==3.6.0
build-device: $(EXTRAS)
	$(PY) -m pip install -q --no-deps --target $(VENV)/device-triton "$(DEVICE_TRITON)"
	PYTHONPATH=$(VENV)/device-triton $(PYTEST) tests/test_hopper_build.py tests/test_fp8_build.py tests/test_select_build.py tests/test_prepare_build.py \
		tests/test_calibration.py::test_fit_kernels_build_for_sm90

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
