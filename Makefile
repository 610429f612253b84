# te_lab's single entry point: `make test` sets up what the tests need and runs them.
#
#   make test            both passes below (what .ci/run runs)
#   make lint            ruff: lint and import order (pyproject.toml's [tool.ruff]), seconds
#   make cpu-kernels     compile te_lab's C++ CPU kernels for this machine (once: cached)
#   make test-main       .venv: te_lab[dev] with the newest Triton, make lint and cpu-kernels,
#                        then the whole suite
#   make test-triton32   .venv-triton32: the Triton kernels through Triton 3.2's
#                        interpreter, the release Moore Threads ships for MUSA
#   make clean-venvs     remove both environments
#   make demo            set up .venv as `make test` does, then `te-lab demo`: fuse, verify
#                        and profile the demo Llama, write te_lab_report.html
#   make lab             set up .venv, then JupyterLab on the tutorial notebooks (te-lab lab)
#   make bench           the benchmark suite's full CPU run: benchmarks/RESULTS.md,
#                        benchmarks/results-cpu.json and benchmarks/results-cpu.html
#   make bench-gpu       the same on the GPU: benchmarks/RESULTS-gpu.md, results-gpu.*
#   make bench-quick     the quick profile (minutes on a 2-core CPU), report on stdout
#   make gpu-check       on a CUDA or MUSA GPU: every Triton kernel checked and timed, a bf16
#                        training check, a profile with raw traces and the generation
#                        benchmark, into gpu-check/
#
# Set-up runs once: each environment keeps a stamp that is newer than pyproject.toml
# while its install is current, so a second `make test` goes straight to pytest.
# PYTEST_ARGS is passed to both pytest runs (e.g. PYTEST_ARGS='-x -k rms_norm');
# PYTEST_WORKERS sets how many pytest-xdist workers each run uses (default: nproc).

SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := test

PYTHON ?= python3
VENV ?= .venv
VENV_TRITON32 ?= .venv-triton32
PYTEST_ARGS ?=

# torch's CPU build; on this project's machines pip takes it from local disk. A bare
# `torch` (or a range a newer release satisfies) would pull PyPI's multi-GB CUDA build.
CPU_TORCH := torch==2.13.0
# tqdm: te_lab.fuse's progress bar (the surgery tests run Triton kernels too).
TRITON32_PACKAGES := $(CPU_TORCH) triton==3.2.0 'numpy<2.4' tqdm pytest pytest-timeout pytest-xdist
# Triton 3.2's interpreter converts arrays to scalars the way numpy >= 1.25 deprecates,
# thousands of times per run; that warning says nothing about te_lab.
TRITON32_PYTEST_ARGS := -m triton_interpreter -W 'ignore:Conversion of an array with ndim > 0:DeprecationWarning'

STAMP := .te_lab-installed

# "nvidia", "musa" or empty: which GPU driver this machine has. The vendors' tools
# answer only where their driver is loaded.
GPU_VENDOR := $(shell if nvidia-smi -L >/dev/null 2>&1; then echo nvidia; \
                      elif mthreads-gmi >/dev/null 2>&1; then echo musa; fi)

# Prints "torch==X triton==Y" for what a venv holds, reading package metadata (fast:
# torch is not imported).
INSTALLED_VERSIONS := -c 'import importlib.metadata as m; \
  names = {(d.metadata["Name"] or "").lower(): d.version for d in m.distributions()}; \
  print(" ".join(name + "==" + names[name] for name in ("torch", "triton") if name in names))'

# pytest-xdist workers, one per core this process may use (CI's machine: 2). Each test
# file runs whole in one worker (--dist loadfile): a file's module fixtures (the GPU
# compile check, the distributed session) are built once, not once per worker.
PYTEST_WORKERS ?= $(shell nproc 2>/dev/null || echo 1)

# Runs pytest, listing the slowest tests so CI's time budget stays visible; "no tests
# collected" (exit 5) fails with a reason, since both passes have tests to run: none
# means an environment is broken, not that all is well.
# $(1): the venv, $(2): pytest arguments.
define run_pytest
status=0; $(1)/bin/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile --durations=10 $(2) $(PYTEST_ARGS) || status=$$?; \
if [ "$$status" -eq 5 ]; then \
  echo "make: pytest in $(1) collected no tests: PYTEST_ARGS selects none, or the environment" \
       "lacks what the tests need (for the Triton 3.2 pass: an importable triton)" >&2; \
  exit 1; \
fi; \
exit "$$status"
endef

# The main pass: the tests that compare two timings (marker quiet_machine) run after the
# parallel pass, in one process with the machine to themselves (beside another worker's
# tests the load changes between the two measurements they compare). Each pass may
# select nothing under PYTEST_ARGS; both selecting nothing fails as above.
define run_main_pytest
status=0; $(1)/bin/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile --durations=10 -m 'not quiet_machine' \
  $(PYTEST_ARGS) || status=$$?; \
echo "== te_lab's timing comparisons, alone on the machine"; \
quiet=0; $(1)/bin/python -m pytest -n 0 --durations=5 -m quiet_machine $(PYTEST_ARGS) || quiet=$$?; \
if [ "$$status" -eq 5 ] && [ "$$quiet" -eq 5 ]; then \
  echo "make: pytest in $(1) collected no tests: PYTEST_ARGS selects none" >&2; exit 1; \
fi; \
if [ "$$status" -eq 5 ]; then status=0; fi; \
if [ "$$quiet" -eq 5 ]; then quiet=0; fi; \
if [ "$$status" -ne 0 ]; then exit "$$status"; fi; \
exit "$$quiet"
endef

.PHONY: test lint cpu-kernels test-main test-triton32 clean-venvs bench bench-gpu bench-quick gpu-check

test: test-main test-triton32

# First, since it takes seconds: a lint error fails the run before the long pytest passes.
lint: $(VENV)/$(STAMP)
	@echo "== ruff check (lint and import order)"
	@$(VENV)/bin/ruff check .

# te_lab's C++ CPU kernels (kernels/cpp/), compiled once per machine into te_lab's cache
# (kernels/cpu_kernels.py). The tests insist on them; the demo, JupyterLab and the
# benchmarks run without them (the ops then choose another backend, and say why).
CPU_KERNELS := $(VENV)/bin/python -c 'import sys; from te_lab.kernels import cpu_kernels; sys.exit(cpu_kernels.main())'

cpu-kernels: $(VENV)/$(STAMP)
	@$(CPU_KERNELS)

test-main: $(VENV)/$(STAMP) lint cpu-kernels
	@echo "== te_lab tests in $(VENV) ($$($(VENV)/bin/python $(INSTALLED_VERSIONS)))"
	@$(call run_main_pytest,$(VENV))

.PHONY: demo lab

demo: $(VENV)/$(STAMP)
	@$(CPU_KERNELS) || true
	@$(VENV)/bin/te-lab demo

lab: $(VENV)/$(STAMP)
	@$(CPU_KERNELS) || true
	@$(VENV)/bin/te-lab lab

BENCH := $(VENV)/bin/python -m te_lab.benchmarks.suite

bench: $(VENV)/$(STAMP)
	@$(CPU_KERNELS) || true
	@$(BENCH) --device cpu --profile cpu --markdown benchmarks/RESULTS.md \
	  --json benchmarks/results-cpu.json --html benchmarks/results-cpu.html > /dev/null

bench-gpu: $(VENV)/$(STAMP)
	@$(BENCH) --profile gpu --markdown benchmarks/RESULTS-gpu.md \
	  --json benchmarks/results-gpu.json --html benchmarks/results-gpu.html > /dev/null

bench-quick: $(VENV)/$(STAMP)
	@$(BENCH) --quick

gpu-check: $(VENV)/$(STAMP)
	@$(VENV)/bin/te-lab gpu-check --out gpu-check

# The environment that the machine's torch build stays in: a torch already in $(VENV)
# (the user's, e.g. Moore Threads' torch + torch_musa, or a CUDA build) is kept; with
# none, the CPU build goes in first on a machine without a GPU, and on an NVIDIA
# machine pip resolves torch>=2.5 to PyPI's default (CUDA) build. The versions of torch
# and triton present before the package install must survive it.
$(VENV)/$(STAMP): pyproject.toml
	@test -x $(VENV)/bin/python || { echo "== creating $(VENV)"; $(PYTHON) -m venv $(VENV); }
	@if $(VENV)/bin/python -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("torch") is None)'; then \
	  echo "== keeping the torch in $(VENV)"; \
	elif [ "$(GPU_VENDOR)" = musa ]; then \
	  echo "make: a MUSA GPU and no torch in $(VENV): install Moore Threads' torch, torch_musa" \
	       "and triton wheels into $(VENV) first (README.md, 'MUSA')" >&2; \
	  exit 1; \
	elif [ "$(GPU_VENDOR)" = nvidia ]; then \
	  echo "== NVIDIA GPU found: pip installs torch's default (CUDA) build with te_lab"; \
	else \
	  echo "== no GPU: installing torch's CPU build ($(CPU_TORCH))"; \
	  $(VENV)/bin/python -m pip install --quiet $(CPU_TORCH); \
	fi
	@before="$$($(VENV)/bin/python $(INSTALLED_VERSIONS))"; \
	echo "== installing te_lab[dev] (editable) into $(VENV)"; \
	$(VENV)/bin/python -m pip install --quiet -e '.[dev]'; \
	after="$$($(VENV)/bin/python $(INSTALLED_VERSIONS))"; \
	for pinned in $$before; do \
	  case " $$after " in *" $$pinned "*) ;; \
	    *) echo "make: installing te_lab[dev] replaced $$pinned (now: $$after)" >&2; exit 1;; \
	  esac; \
	done; \
	echo "== $(VENV) ready: $$after"
	@touch $@

ifeq ($(GPU_VENDOR),)
test-triton32: $(VENV_TRITON32)/$(STAMP)
	@echo "== Triton 3.2 interpreter tests in $(VENV_TRITON32) ($$($(VENV_TRITON32)/bin/python $(INSTALLED_VERSIONS)))"
	@$(call run_pytest,$(VENV_TRITON32),$(TRITON32_PYTEST_ARGS))
else
test-triton32:
	@echo "== skipping the Triton 3.2 interpreter pass: it needs torch's CPU build," \
	      "and this machine has a $(GPU_VENDOR) GPU (CI runs it on CPU-only machines)"
endif

# Only what the Triton kernels' tests import; te_lab goes in without its dependencies
# so that nothing can move torch or triton off the pinned versions.
$(VENV_TRITON32)/$(STAMP): pyproject.toml
	@test -x $(VENV_TRITON32)/bin/python || { echo "== creating $(VENV_TRITON32)"; $(PYTHON) -m venv $(VENV_TRITON32); }
	@echo "== installing $(TRITON32_PACKAGES) into $(VENV_TRITON32)"
	@$(VENV_TRITON32)/bin/python -m pip install --quiet $(TRITON32_PACKAGES)
	@$(VENV_TRITON32)/bin/python -m pip install --quiet --no-deps -e .
	@touch $@

clean-venvs:
	rm -rf $(VENV) $(VENV_TRITON32)
