# `make test` and `make demo` set everything up themselves: a virtual environment, torch and
# the other dependencies, the extension build, then the tests or the demo.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
export MAX_JOBS ?= 2
# ccache, when installed, makes rebuilds after small edits cheap.
export PATH := $(if $(wildcard /usr/lib/ccache),/usr/lib/ccache:)$(PATH)

SOURCES := $(shell find csrc -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh') setup.py pyproject.toml

.PHONY: build test demo bench clean

$(VENV)/.deps: requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet -r requirements-dev.txt
	touch $@

$(VENV)/.built: $(VENV)/.deps $(SOURCES)
	$(PIP) install --quiet --no-build-isolation --no-deps -e .
	touch $@

build: $(VENV)/.built

test: build
	$(PY) -m pytest -q tests

# Trains a small GPT-2 on 2 tensor-parallel ranks (gloo on CPU, NCCL on GPUs): a few minutes.
demo: build
	$(PY) -m torch.distributed.run --standalone --nproc-per-node 2 examples/train_gpt.py

bench: build
	$(PY) benchmarks/bench_split.py

clean:
	rm -rf build python/autoshard/_C*.so python/autoshard/_build_info.py $(VENV)/.built
