# `make test` and `make demo` set everything up themselves: a virtual environment, pinned torch
# and the other pinned dependencies, the extension build, then the tests or the demo.
#
#   make test                          # torch 2.13.0 CPU (the default, from the local wheel cache)
#   make test TORCH="torch==2.14.1"    # another torch, e.g. a CUDA build on a GPU machine
#   make cuda-check                    # compile (and link) the CUDA kernels without running them
#   make conformance                   # the full conformance matrix (tests/conformance, 2/3/4 ranks)
#   make lint                          # ruff over the Python sources
#   make test-gpu                      # on a GPU machine: build with its torch, run the GPU-marked tests
#   make bench-gpu                     # on a GPU machine: the GPU benchmarks, into benchmarks/results
PYTHON ?= python3
TORCH ?= torch==2.13.0+cpu
DTYPE ?= fp32
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
export MAX_JOBS ?= 2
# ccache, when installed, makes rebuilds after small edits cheap, also across checkouts.
export PATH := $(if $(wildcard /usr/lib/ccache),/usr/lib/ccache:)$(PATH)
export CCACHE_BASEDIR ?= $(CURDIR)
# pip builds in a new temporary directory each time, and -g would put it in every cache key.
export CCACHE_NOHASHDIR ?= 1

# The CUDA compile check: a torch whose CUDA matches this machine's nvcc (13.0).
CUDA_CHECK_TORCH ?= torch==2.14.1
CUDA_VENV := .venv-cuda
CUDA_CHECK_DIR := build/cuda-check

SOURCES := $(shell find csrc build_tools -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' -o -name '*.py') setup.py pyproject.toml

# The torch spec in use is remembered in the environment, so that changing TORCH reinstalls.
TORCH_STAMP := $(VENV)/.torch-spec
$(shell mkdir -p $(VENV) && [ "$$(cat $(TORCH_STAMP) 2>/dev/null)" = "$(TORCH)" ] || echo "$(TORCH)" > $(TORCH_STAMP))

.PHONY: build test demo bench conformance cuda-check clean sweep lint test-gpu bench-gpu

$(VENV)/.deps: requirements-dev.txt constraints.txt $(TORCH_STAMP)
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --disable-pip-version-check "$(TORCH)" -r requirements-dev.txt -c constraints.txt
	touch $@

$(VENV)/.built: $(VENV)/.deps $(SOURCES)
	$(PIP) install --quiet --no-build-isolation --no-deps -e .
	touch $@

build: $(VENV)/.built

test: build
	$(PY) -m pytest -q tests

# Trains a small Llama on 2 tensor-parallel ranks (gloo on CPU, NCCL on GPUs): a few minutes.
# DTYPE=bf16 trains in bfloat16 with fp32 master weights (the example reads DTYPE).
demo: build
	DTYPE=$(DTYPE) $(PY) -m torch.distributed.run --standalone --nproc-per-node 2 examples/train_lm.py

# The full conformance matrix: every architecture of tests/conformance at 2, 3 and 4 ranks
# (make test runs its small part).
conformance: build
	$(PY) -m pytest -q tests/conformance --conformance-full

# Every architecture of the installed transformers, built from a tiny config, sharded at 2 gloo
# ranks and judged against the unsharded model; resumes after an interruption (FRESH=1 restarts).
# Writes benchmarks/results/sweep_cpu.txt and .json. Under 2 hours on 2 cores.
sweep: build
	$(PY) benchmarks/sweep/run.py --jobs 2 $(if $(FRESH),--fresh)
	$(PY) benchmarks/sweep/coverage_doc.py

# ruff over the Python sources (rules in pyproject.toml), then the import layers of the package
# (build_tools/check_layers.py); needs only the environment, not the build.
lint: $(VENV)/.deps
	$(VENV)/bin/ruff check python tests benchmarks examples build_tools setup.py
	$(PY) build_tools/check_layers.py

bench: build
	$(PY) benchmarks/bench_split.py

# Builds a copy of the sources against a CUDA build of torch in a second environment, with the
# CUDA kernels required, then checks that every op has a CUDA kernel registered. Nothing runs
# on a GPU; this keeps CUDA compile errors from landing unseen on machines without one.
cuda-check:
	[ -x $(CUDA_VENV)/bin/python ] || $(PYTHON) -m venv $(CUDA_VENV)
	$(CUDA_VENV)/bin/pip install --quiet --disable-pip-version-check "$(CUDA_CHECK_TORCH)" numpy ninja setuptools wheel -c constraints.txt
	rm -rf $(CUDA_CHECK_DIR)/src && mkdir -p $(CUDA_CHECK_DIR)/src
	cp -r csrc python build_tools setup.py pyproject.toml README.md $(CUDA_CHECK_DIR)/src/
	find $(CUDA_CHECK_DIR)/src/python -name '_C*.so' -delete
	cd $(CUDA_CHECK_DIR)/src && AUTOSHARD_BUILD_CUDA=1 $(CURDIR)/$(CUDA_VENV)/bin/python setup.py build_ext --inplace \
		> $(CURDIR)/$(CUDA_CHECK_DIR)/build.log 2>&1 || { tail -60 $(CURDIR)/$(CUDA_CHECK_DIR)/build.log; exit 1; }
	grep '^autoshard: ' $(CUDA_CHECK_DIR)/build.log
	$(CUDA_VENV)/bin/python build_tools/check_cuda_kernels.py $(CUDA_CHECK_DIR)/src/python

# On a machine with a GPU and a CUDA build of torch already installed (GPU_PYTHON's), where
# nothing may be downloaded: builds the extension in place with that torch (CUDA kernels
# required, for the visible GPU's architecture only), then runs every test marked gpu.
GPU_PYTHON ?= python3
GPU_JOBS ?= $(shell nproc)
GPU_PYTEST_ARGS ?= -n 4
test-gpu:
	AUTOSHARD_BUILD_CUDA=1 MAX_JOBS=$(GPU_JOBS) $(GPU_PYTHON) setup.py build_ext --inplace
	PYTHONPATH=$(CURDIR)/python $(GPU_PYTHON) -m pytest -q -m gpu -p no:cacheprovider $(GPU_PYTEST_ARGS) tests

# The GPU benchmarks after make test-gpu's build; each writes benchmarks/results/<name>_cuda.json.
# A failing benchmark does not stop the others; the target fails at the end.
bench-gpu:
	cd benchmarks && failed=""; for bench in bench_split bench_embedding bench_optim bench_layers bench_world_one; do \
		PYTHONPATH=$(CURDIR)/python $(GPU_PYTHON) $$bench.py || failed="$$failed $$bench"; done; \
		[ -z "$$failed" ] || { echo "failed:$$failed"; exit 1; }

clean:
	rm -rf build python/autoshard/_C*.so python/autoshard/_build_info.py $(VENV)/.built
