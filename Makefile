# mini_moe: build the book, run the tests.
#
#   make book   the main job: execute every chapter and build the HTML into _build/html
#   make test   unit tests, every chapter under nbval, the notebook-pair checks, the workflow
#               lint and the offline browser check of a built slice of the book
#   make sync   after editing book/NN_topic.md: update its .ipynb twin (outputs stripped)
#   make floors the unit tests with the lowest jax/flax/optax/orbax/numpy pyproject.toml allows
#
# Everything runs inside a virtual environment in .venv, created on first use from
# pyproject.toml (needs network access to PyPI only).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.mini_moe-installed
CHAPTERS_MD := $(sort $(wildcard book/[0-9][0-9]_*.md))
CHAPTERS_NB := $(CHAPTERS_MD:.md=.ipynb)

.PHONY: venv data book test unit nbval check-notebooks sync clean floors chromium browser-check lint-workflows

venv: $(STAMP)

# Fashion-MNIST comes from Debian's package (IDX files in /usr/share/datasets/fashion-mnist).
FMNIST_DIR := /usr/share/datasets/fashion-mnist
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
data:
	@test -d $(FMNIST_DIR) || { $(SUDO) apt-get update && $(SUDO) apt-get install -y dataset-fashion-mnist; }

# Re-install when the dependency list changes; the stamp keeps later runs instant.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -e '.[test,book]'
	touch $(STAMP)

# A stale _build/.doctrees can hide failing cells, so every build starts from scratch.
book: venv data
	rm -rf _build
	$(VENV)/bin/jupyter-book build . -W -n --keep-going
	@echo "HTML: _build/html/index.html"

test: check-notebooks lint-workflows unit nbval browser-check

# pytest-xdist runs the unit tests on every core (1.6x faster on 2 cores).
unit: venv data
	$(PY) -m pytest -n auto tests

# The declared floors, tested: a second venv with exactly the lowest jax (+ same jaxlib), flax,
# optax, orbax-checkpoint and numpy that pyproject.toml's `dependencies` allow (.ci/floors.py
# turns their `>=` into `==` constraints), the package with its test extra, and the unit tests
# on all cores (pytest-xdist: 1.6x faster on 2 cores). .ci/run deselects a few slow tests.
FLOORS_VENV ?= .venv-floors
FLOORS_PY := $(FLOORS_VENV)/bin/python
FLOORS_STAMP := $(FLOORS_VENV)/.mini_moe-installed
FLOORS_PYTEST_ARGS ?= -n auto

$(FLOORS_STAMP): pyproject.toml .ci/floors.py
	test -x $(FLOORS_PY) || $(PYTHON) -m venv $(FLOORS_VENV)
	$(PYTHON) .ci/floors.py > $(FLOORS_VENV)/constraints.txt
	$(FLOORS_PY) -m pip install --upgrade pip
	$(FLOORS_PY) -m pip install -c $(FLOORS_VENV)/constraints.txt -e '.[test]'
	touch $(FLOORS_STAMP)

floors: $(FLOORS_STAMP) data
	$(FLOORS_PY) .ci/floors.py --check
	$(FLOORS_PY) -m pytest tests $(FLOORS_PYTEST_ARGS)

# --nbval-current-env runs the chapters with the kernel of this venv.
nbval: venv data
	$(PY) -m pytest --nbval-lax --nbval-current-env $(CHAPTERS_NB)

check-notebooks: venv
	$(PY) .ci/notebooks.py check

# actionlint checks .github/workflows (and runs shellcheck on `run:` scripts if it is on PATH).
lint-workflows: venv
	$(VENV)/bin/actionlint -no-color .github/workflows/*.yml
	@echo "actionlint: workflows OK"

# Headless Chromium from Debian's package, for the browser check.
chromium:
	@command -v chromium >/dev/null || command -v chromium-browser >/dev/null || command -v google-chrome >/dev/null \
	  || $(SUDO) apt-get install -y chromium || { $(SUDO) apt-get update && $(SUDO) apt-get install -y chromium; }

# Builds intro + chapter 1 (+ a probe page) into a temporary folder with _config.yml and opens
# the pages in headless Chromium without network: equations typeset, figures loaded.
browser-check: venv data chromium
	$(PY) .ci/browser_check.py

sync: venv
	$(PY) .ci/notebooks.py install
	$(VENV)/bin/jupytext --sync $(CHAPTERS_MD)
	$(PY) .ci/notebooks.py strip

clean:
	rm -rf _build .pytest_cache .hypothesis
