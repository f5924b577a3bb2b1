# mini_moe: build the book, run the tests.
#
#   make book   the main job: execute every chapter and build the HTML into _build/html
#   make test   the notebook-pair checks, the workflow lint, the wheel, the unit tests, every
#               chapter under nbval and the whole book built from those executions (-W -n), the
#               labs page with its stubs and with the solutions, the offline browser check of
#               that build, and CI's self-check on throw-away books
#   make sync   after editing book/NN_topic.md: update its .ipynb twin (outputs stripped)
#   make pin    after committing a change to the package: pin every chapter's install cell to HEAD
#   make floors the unit tests with every dependency at the lowest version pyproject.toml allows
#
# Everything runs inside a virtual environment in .venv, created on first use from
# pyproject.toml (needs network access to PyPI only). On Linux, Fashion-MNIST and Chromium come
# from Debian's packages (apt-get); macOS has no apt-get, so there FASHION_MNIST=tfds and
# CHROMIUM=Google Chrome are the defaults (see `data` and `chromium` below).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.mini_moe-installed
CHAPTERS_MD := $(sort $(wildcard book/[0-9][0-9]_*.md))
CHAPTERS_NB := $(CHAPTERS_MD:.md=.ipynb)

.PHONY: mutants device-check device-bundle pin check-pin venv floors-deps data data-apt data-tfds book nbval-book labs book-selfcheck book-static test unit nbval check-notebooks sync clean floors chromium browser-check lint-workflows dist colab-stack

venv: $(STAMP)

UNAME := $(shell uname -s)

# Fashion-MNIST, where mini_moe.data.load("fashion_mnist") finds it without a data_dir:
#   FASHION_MNIST=apt  (default on Linux) Debian's package: IDX files in /usr/share/datasets/fashion-mnist.
#   FASHION_MNIST=tfds (default on macOS: no apt-get, and /usr/share is read-only there) the
#       tensorflow-datasets fallback: prepared once into ~/tensorflow_datasets (or $TFDS_DATA_DIR),
#       which needs network access and TensorFlow. TensorFlow stays out of .venv: a throwaway venv
#       in a temporary folder makes exactly the call mini_moe.data makes (tfds.data_source), and
#       .venv gets array_record to read the prepared files (tfds declares it for Linux only).
FASHION_MNIST ?= $(if $(filter Darwin,$(UNAME)),tfds,apt)
FMNIST_DIR := /usr/share/datasets/fashion-mnist
TFDS_DIR := $(or $(TFDS_DATA_DIR),$(HOME)/tensorflow_datasets)
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
data: data-$(FASHION_MNIST)

data-apt:
	@test -d $(FMNIST_DIR) || { $(SUDO) apt-get update && $(SUDO) apt-get install -y dataset-fashion-mnist; }

data-tfds: venv
	@$(PY) -c "import array_record" 2>/dev/null || $(PY) -m pip install array_record
	@ls "$(TFDS_DIR)"/fashion_mnist/*/dataset_info.json >/dev/null 2>&1 || { \
	  tmp=$$(mktemp -d) && $(PYTHON) -m venv "$$tmp/venv" \
	  && "$$tmp/venv/bin/python" -m pip install tensorflow tensorflow-datasets importlib_resources array_record \
	  && "$$tmp/venv/bin/python" -c 'import tensorflow_datasets as tfds; tfds.data_source("fashion_mnist")' \
	  && rm -rf "$$tmp"; }

# Re-install when the dependency list changes; the stamp keeps later runs instant.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -e '.[test,book,dev]'
	touch $(STAMP)

# The book build: `make book` and `make test` run this one command (tests/test_ci_book.py
# checks that they do and that the README names them). -W -n --keep-going: any warning (a glue key
# defined twice or never, a broken reference, a missing figure) fails the build after listing all.
BOOK_BUILD = $(VENV)/bin/jupyter-book build . -W -n --keep-going
# The Colab notebooks (.ci/colab.py): the executed chapters with glue and cite roles rendered, which
# book.yml publishes on the colab branch that the Colab button opens.
COLAB_NOTEBOOKS = $(PY) .ci/colab.py --out _build/colab/book _build/jupyter_execute/book/[0-9][0-9]_*.ipynb

# A stale _build/.doctrees can hide failing cells, so every build starts from scratch; every
# chapter is executed (_config.yml: execute_notebooks: force).
book: venv data
	rm -rf _build
	$(BOOK_BUILD)
	@echo "HTML: _build/html/index.html"
	$(COLAB_NOTEBOOKS)

# The book without executing a chapter (.ci/book_static.py, about 25 s): the API page and every
# reference under -n, so that a docstring that breaks the nitpicky build fails in CI's first minutes.
book-static: venv
	$(PY) .ci/book_static.py

# CI's book: every chapter under nbval, then the whole book built by BOOK_BUILD from what nbval's
# kernels computed, so each chapter is executed once (.ci/nbval_record.py): nbval fails on a cell
# error, the build on any warning, and `verify` if the build had to execute a chapter itself.
NBVAL_EXECUTED := _build/nbval
# The chapters run two at a time, one whole notebook per pytest-xdist worker (each in its own
# kernel); the timing asserts of chapters 5 and 11 compare two paths timed back to back in one
# kernel, so a neighbour slows both. NBVAL_PARALLEL= runs them one by one.
NBVAL_PARALLEL ?= -n 2 --dist loadfile
# NBVAL_ENV: environment for the chapters' kernels (.ci/run: XLA_FLAGS=--xla_backend_optimization_level=1).
NBVAL_ENV ?=
BOOK_CACHE := _build/.jupyter_cache
nbval-book: venv data
	rm -rf _build
	$(NBVAL_ENV) PYTHONPATH=.ci $(PY) -m pytest -p nbval_record --nbval-record $(NBVAL_EXECUTED) --nbval-lax --nbval-current-env $(NBVAL_PARALLEL) $(CHAPTERS_NB)
	$(PY) .ci/nbval_record.py cache $(NBVAL_EXECUTED) $(BOOK_CACHE) --expect $(words $(CHAPTERS_NB))
	$(BOOK_BUILD) --config $(BOOK_CACHE)/_config.yml
	$(PY) .ci/nbval_record.py verify $(BOOK_CACHE)
	@echo "HTML: _build/html/index.html"
	$(COLAB_NOTEBOOKS)

# The labs page (book/14_labs.ipynb) executed with its stubs (.ci/labs.py): every check says "not
# implemented yet". That each check passes with the library's own function in the stub's place is
# tests/test_labs.py's (the same labs.check call in both unit runs; .ci/labs.py without --stubs-only
# also executes the page so, as .ci/colab_stack.py does).
labs: venv
	$(PY) .ci/labs.py --stubs-only

test: check-notebooks check-pin book-static lint-workflows dist unit nbval-book labs browser-check book-selfcheck

# pytest-xdist runs the unit tests on every core (1.6x faster on 2 cores), one whole file per worker
# (--dist loadfile; `make unit` under .ci/run's flags on the 2-core AMD EPYC: 685 s, against 772-780 s
# with xdist's default spread; we think because tests of one file that compile the same tiny models
# then land on both workers and compile them twice, which was not measured).
# UNIT_ENV: environment for the unit tests, e.g. UNIT_ENV="XLA_FLAGS=--xla_cpu_max_isa=AVX2" (.ci/run
# adds --xla_backend_optimization_level=0 and --xla_cpu_use_fusion_emitters=false).
UNIT_ENV ?=
unit: venv data
	$(UNIT_ENV) $(PY) -m pytest -n auto tests --dist loadfile --durations=30

# The declared floors, tested: a fresh second venv in which ONE pip call installs everything the
# package needs with its test and tfds extras (.ci/floors.py --requirements) under constraints that
# pin every runtime dependency and the tfds extra at exactly its floor (.ci/floors.py turns
# pyproject.toml's `>=` into `==`, jaxlib = jax, and refuses an import of mini_moe that pyproject
# does not declare); the test tools resolve around the floors in that same call. mini_moe itself
# follows without dependencies (pip install --no-deps -e .), so that the first step writes nothing
# in the source tree; the editable install writes mini_moe.egg-info there, as `make dist` does, so
# .ci/run (which runs this target beside `make test` at the lowest CPU priority) starts it only after
# `make dist`'s wheel exists. Then the unit tests on all cores (pytest-xdist: 1.6x faster on 2
# cores); .ci/run runs them at XLA's optimisation level 0 with its older emitters.
# The venv is made again from scratch whenever pyproject.toml or .ci/floors.py changes.
FLOORS_VENV ?= .venv-floors
FLOORS_PY := $(FLOORS_VENV)/bin/python
FLOORS_DEPS := $(FLOORS_VENV)/.dependencies-installed
FLOORS_STAMP := $(FLOORS_VENV)/.mini_moe-installed
FLOORS_PYTEST_ARGS ?= -n auto --dist loadfile

$(FLOORS_DEPS): pyproject.toml .ci/floors.py
	rm -rf $(FLOORS_VENV)
	$(PYTHON) -m venv $(FLOORS_VENV)
	$(PYTHON) .ci/floors.py > $(FLOORS_VENV)/constraints.txt
	$(PYTHON) .ci/floors.py --requirements > $(FLOORS_VENV)/requirements.txt
	$(FLOORS_PY) -m pip install --upgrade pip
	$(FLOORS_PY) -m pip install -c $(FLOORS_VENV)/constraints.txt -r $(FLOORS_VENV)/requirements.txt
	touch $(FLOORS_DEPS)

floors-deps: $(FLOORS_DEPS)

$(FLOORS_STAMP): $(FLOORS_DEPS)
	$(FLOORS_PY) -m pip install --no-deps -e .
	touch $(FLOORS_STAMP)

# The floors run the files whose tests call each third-party API the library uses at its declared
# floor: Flax NNX modules and JAX's transforms (test_layer, test_routing, test_losses), ott-jax and POT
# (test_transport), scikit-learn, tensorflow-datasets' mock data and the IDX reader (test_data), Optax's
# schedules and Orbax's checkpoints with the optimizer state (test_cooldown), TensorStore's reading of a
# checkpoint (test_diagnose's healthy run) and the package's own import surface (test_package). `make unit`
# runs every file at the newest versions. The library's files (all but CI's scripts, the runners and the
# grader) took 3,136 s of pytest's per-test time in one `make unit` (2026-11-29, 2-core AMD EPYC, two
# workers): about 26 minutes of CI run a second time, which put CI over its 50-minute budget. These files
# are the part of them that meets each third-party API; the others meet the same APIs again.
FLOORS_TESTS := tests/test_package.py tests/test_layer.py tests/test_routing.py tests/test_losses.py \
	tests/test_transport.py tests/test_data.py tests/test_cooldown.py \
	tests/test_diagnose.py::test_a_healthy_run_gives_no_warning

floors: $(FLOORS_STAMP) data
	$(FLOORS_PY) .ci/floors.py --check
	$(FLOORS_PY) -m pytest $(FLOORS_TESTS) $(FLOORS_PYTEST_ARGS) --durations=30

# --nbval-current-env runs the chapters with the kernel of this venv. (`make test` runs them in
# nbval-book, which also builds the book from the same executions.)
nbval: venv data
	$(PY) -m pytest --nbval-lax --nbval-current-env $(CHAPTERS_NB)

check-notebooks: venv
	$(PY) .ci/notebooks.py check

# What a Colab reader installs is what CI tests (.ci/pin.py): every chapter's install cell names a
# commit (_config.yml's mini_moe_ref) that holds every mini_moe name, keyword and committed file the
# chapter uses, and whose package (mini_moe/, pyproject.toml) equals this checkout's byte for byte.
# It needs the git history (a shallow clone fails with a message). After committing a change to the
# package: `make pin`, then commit _config.yml and the chapters.
check-pin: venv
	$(PY) .ci/pin.py check

pin: venv
	$(PY) .ci/pin.py pin
	$(MAKE) sync

# actionlint checks .github/workflows (and runs shellcheck on `run:` scripts if it is on PATH).
lint-workflows: venv
	$(VENV)/bin/actionlint -no-color .github/workflows/*.yml
	@echo "actionlint: workflows OK"

# Headless Chromium for the browser check: $CHROMIUM when it is set, else chromium,
# chromium-browser or google-chrome on PATH, else Debian's package. macOS has no apt-get: there
# CHROMIUM defaults to Google Chrome's app (preinstalled on GitHub's macOS runners; elsewhere
# `brew install --cask google-chrome`).
ifeq ($(UNAME),Darwin)
CHROMIUM ?= /Applications/Google Chrome.app/Contents/MacOS/Google Chrome
export CHROMIUM
endif
chromium:
	@if [ -n "$$CHROMIUM" ]; then command -v "$$CHROMIUM" >/dev/null || { echo "CHROMIUM=$$CHROMIUM is not an executable" >&2; exit 1; }; \
	else command -v chromium >/dev/null || command -v chromium-browser >/dev/null || command -v google-chrome >/dev/null \
	  || $(SUDO) apt-get install -y chromium || { $(SUDO) apt-get update && $(SUDO) apt-get install -y chromium; }; fi

# Opens the built book (_build/html, from `make book` or `make nbval-book`) in headless Chromium
# without network: the introduction, every chapter page and the back matter, equations typeset,
# figures loaded, every table a table, no stray value, nothing wider than the column; a full-page
# screenshot of every page goes to _build/screenshots (CI keeps them as an artifact, tests.yml).
browser-check: venv data chromium
	$(PY) .ci/browser_check.py --html _build/html --screenshots _build/screenshots

# CI checks itself: throw-away books in temporary copies of the repository go through nbval-book.
# A good one (with a probe page of LaTeX cell outputs) must build and pass the browser check; one
# with a failing cell, one with a glue key defined twice, one with a broken reference and one with a
# missing figure must each fail (.ci/book_selfcheck.py).
book-selfcheck: venv data chromium
	$(PY) .ci/book_selfcheck.py

sync: venv
	$(PY) .ci/notebooks.py install
	$(VENV)/bin/jupytext --sync $(CHAPTERS_MD)
	$(PY) .ci/notebooks.py strip

# Colab's GPU runtime emulated (.ci/colab_stack.py): its package versions in a fresh .venv-colab;
# the install cell's upgrade on a GPU and a TPU as pip dry runs (JAX's accelerator build at one
# version), then for real on this CPU; chapters 1, 2 and 7 under nbval there.
colab-stack: venv data
	PYTHON=$(PYTHON) $(PY) .ci/colab_stack.py

# The first thing to run on a lent accelerator (issue 55 §3; .ci/device_check.py): unit tests of the
# accelerator path, one chapter at the full configuration, the benchmarks; JSON named by DEVICE. The
# device machine has no network, so no venv is built: its own python with the checkout on PYTHONPATH.
DEVICE ?= gpu-h100
device-check:
	PYTHONPATH=.:$(DEVICE_SITE) $(or $(wildcard $(PY)),python3) .ci/device_check.py --out mini_moe/results/device-check-$(DEVICE).json

# What the device machine lacks, prepared here (it has no network; CONTRIBUTING.md, "On a lent
# accelerator"): nbval and ipykernel for its Python 3.12 as .device/site.tar.xz (without what its
# image already holds), and the Fashion-MNIST IDX files in .device/fmnist. .device/ is kept out of git.
DEVICE_SITE ?= /tmp/site
device-bundle: venv data
	rm -rf .device/site && mkdir -p .device/fmnist
	grep -qx '/.device/' .git/info/exclude 2>/dev/null || echo '/.device/' >> .git/info/exclude
	$(PY) -m pip install -q --target .device/site --python-version 3.12 --only-binary=:all: \
	  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 nbval ipykernel
	cd .device/site && rm -rf jedi* debugpy* pygments* _pytest pytest* py.py pluggy* iniconfig* packaging* psutil* \
	  coverage* a1_coverage.pth tzdata* attr attrs* dateutil python_dateutil* six* typing_extensions* __pycache__ bin share
	tar -C .device -cJf .device/site.tar.xz site && rm -rf .device/site
	cp /usr/share/datasets/fashion-mnist/*.gz .device/fmnist/

# The sdist and the wheel into dist/, as the release workflow builds them: python -m build must
# print no warning (PYTHONDONTWRITEBYTECODE, set on some machines, only makes distutils say that it
# skips byte-compiling), and twine must accept the metadata.
dist: venv
	rm -rf dist
	env -u PYTHONDONTWRITEBYTECODE $(PY) -m build --outdir dist . > dist.log 2>&1 || { cat dist.log; exit 1; }
	@if grep -i "warning" dist.log; then echo "python -m build printed the warnings above (full log: dist.log)" >&2; exit 1; fi
	$(PY) -m twine check --strict dist/*

# Mutation testing of routing.py, layer.py, losses.py (issue 52 §3), routers/, inference.py and
# upcycle.py (issue 66 §3); not part of `make test`: one CPU core, a throw-away copy in
# /tmp/mutants-work, resumable (--results, committed in mini_moe/results for issue 66's run), then the
# report mini_moe/results/mutants-cpu-2core-epyc.json. MUTANTS_ARGS: e.g. --module losses --limit 5.
MUTANTS_ARGS ?= --sample 240 --results mini_moe/results/mutants-run-issue66.jsonl \
	--out mini_moe/results/mutants-issue66-cpu-2core-epyc.json
mutants: venv
	$(PY) .ci/mutants.py --resume $(MUTANTS_ARGS)
	$(PY) .ci/mutants.py --report $(MUTANTS_ARGS)

clean:
	rm -rf _build .pytest_cache .hypothesis
