#!/usr/bin/env bash
# A fresh Colab GPU runtime, emulated on a CPU (issue 27): a new virtual environment pinned to
# the versions Colab ships (googlecolab/backend-info, pip-freeze.gpu.txt, Python 3.12 there),
# then what a chapter's install cell does on Colab (mini_moe is missing, so it pip-installs
# mini_moe, here from this checkout instead of the release tag), a check that this left JAX,
# Flax, Optax and Orbax at Colab's versions (no reinstall, no restart), and chapters 1, 2 and 7
# under nbval in that environment. `make colab-stack` runs it; COLAB_VENV names the venv. While
# pyproject.toml declares jax >= 0.8.1 / flax >= 0.12.1 the install upgrades them and the check
# below fails, as it should: Colab readers would have to reinstall JAX (CHANGELOG, Unreleased).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${COLAB_VENV:-.venv-colab}
PYTHON=${PYTHON:-python3}
# Colab's GPU runtime (2026-11): the packages the chapters import, at its versions.
COLAB_PINS=(jax==0.7.2 jaxlib==0.7.2 flax==0.11.2 optax==0.2.8 orbax-checkpoint==0.12.0
            numpy==2.0.2 scipy==1.16.3 matplotlib==3.10.0 scikit-learn==1.6.1 tensorflow-datasets==4.9.10)

rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "${COLAB_PINS[@]}" ipykernel "nbval>=0.11" "pytest>=8"
# The install cell: %pip install -q "mini_moe @ git+<repository>@<tag>", from this tree instead.
"$VENV/bin/python" -m pip install -q "mini_moe @ file://$PWD"
"$VENV/bin/python" - "${COLAB_PINS[@]}" <<'EOF'
import sys
from importlib.metadata import version

wrong = [f"{pin.split('==')[0]} {version(pin.split('==')[0])} (Colab: {pin.split('==')[1]})"
         for pin in sys.argv[1:] if version(pin.split("==")[0]) != pin.split("==")[1]]
if wrong:
    sys.exit("colab-stack: installing mini_moe changed Colab's packages: " + ", ".join(wrong))
print("colab-stack: mini_moe installed on Colab's versions, nothing reinstalled")
EOF
"$VENV/bin/python" -m pytest --nbval-lax --nbval-current-env -p no:cacheprovider -q \
  book/01_unified_formulation.ipynb book/02_softmax_token_choice.ipynb book/07_router_consistency.ipynb
