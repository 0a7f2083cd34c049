# Quick start: `make demo` (set up + run the main job), `make test` (set up + run the test suite).
PYTHON ?= python3
VENV   ?= .venv
# The CPU wheel of torch 2.13.0 installs from local disk on the project machines; override on a GPU box,
# e.g. `make TORCH=torch demo` to keep whatever torch your platform gives.
TORCH  ?= torch==2.13.0
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.pisa-installed

.PHONY: setup demo test clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/pisa-attn demo

test: $(STAMP)
	$(PY) -m pytest -q -n 2 --durations=15

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
