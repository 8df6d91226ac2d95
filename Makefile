# The two commands of the README: `make run` and `make test`. Both create .venv if missing.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TORCH  := $(VENV)/.installed-torch
GPUC   := $(VENV)/.installed-gpu-compiler
ARGS   ?=

.PHONY: run test bench bench-torch torch-required gpu-compiler install clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

# The live PyTorch reference is an optional extra: only the tests and bench-torch install it.
# Pinned: an unpinned torch pulls a multi-GB CUDA build; 2.13.0 resolves to the CPU wheel on
# this machine kind. The stamp marks a successful install only: after a failed one, `make
# test` still runs (the PyTorch tests skip, and pytest's summary says why) and the next make
# tries the install again; `make bench-torch` stops.
TORCH_PIN := torch==2.13.0

$(TORCH): $(STAMP)
	@echo "make: installing $(TORCH_PIN) (the PyTorch reference, CPU wheel, about 0.75 GB)"
	@if $(PY) -m pip install -q $(TORCH_PIN); then touch $(TORCH); else \
	  echo "make: $(TORCH_PIN) was not installed (pip failed, above): the PyTorch-reference" \
	       "tests will be skipped; the next make retries the install" >&2; fi

torch-required: $(TORCH)
	@test -f $(TORCH) || { echo "make: bench-torch needs $(TORCH_PIN), which is not installed" >&2; exit 2; }

# XLA:GPU, the compiler every GPU figure comes from (`--dry-run --hardware`, the suite's --plan,
# experiments.predict): jax's CUDA plugin compiles for a GPU cluster's topology with no GPU and
# no driver here (about 4.9 GB installed, `du -sh` of its packages). Like torch: a failed install leaves no stamp,
# the tests that need it skip saying why, and the next make retries.
GPU_COMPILER_PIN := jax[cuda12]==0.10.2

$(GPUC): $(STAMP)
	@echo "make: installing the GPU compiler, $(GPU_COMPILER_PIN) (XLA:GPU without a GPU;" \
	      "about 4.9 GB; about 80 s from a warm pip cache, longer to download)"
	@if $(PY) -m pip install -q "$(GPU_COMPILER_PIN)"; then touch $(GPUC); else \
	  echo "make: $(GPU_COMPILER_PIN) was not installed (pip failed, above): GPU figures" \
	       "fall back to XLA:CPU and the XLA:GPU tests will be skipped; the next make" \
	       "retries the install" >&2; fi

gpu-compiler: $(GPUC)
	@test -f $(GPUC) || { echo "make: the GPU compiler ($(GPU_COMPILER_PIN)) is not installed" >&2; exit 2; }
	@echo "make: the GPU compiler ($(GPU_COMPILER_PIN)) is installed in $(VENV)"

install: $(STAMP)

run: $(STAMP)
	$(PY) -m experiments.run --layout fsdp --mesh 4x8 $(ARGS)

# Both cores; the 25 slowest tests are printed at the end, so a slow addition shows.
test: $(TORCH) $(GPUC)
	$(PY) -m pytest -q -n 2 --dist loadgroup --durations=25 tests

bench: $(STAMP)
	$(PY) scripts/bench_loop.py

bench-torch: torch-required
	$(PY) scripts/bench_vs_torch.py

clean:
	rm -rf $(VENV) runs
