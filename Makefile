# The two commands of the README: `make run` and `make test`. Both create .venv if missing.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TORCH  := $(VENV)/.installed-torch
ARGS   ?=

.PHONY: run test bench bench-torch install clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

# The live PyTorch reference is an optional extra: only the tests and bench-torch install it.
# Pinned: an unpinned torch pulls a multi-GB CUDA build; 2.13.0 resolves to the CPU wheel on
# this machine kind. Where it cannot be installed, its tests are skipped (and say so).
$(TORCH): $(STAMP)
	$(PY) -m pip install -q torch==2.13.0 || echo "torch==2.13.0 not installed: the PyTorch-reference tests will be skipped"
	touch $(TORCH)

install: $(STAMP)

run: $(STAMP)
	$(PY) -m experiments.run --layout fsdp --mesh 4x8 $(ARGS)

test: $(TORCH)
	$(PY) -m pytest -q tests

bench: $(STAMP)
	$(PY) scripts/bench_loop.py

bench-torch: $(TORCH)
	$(PY) scripts/bench_vs_torch.py

clean:
	rm -rf $(VENV) runs
