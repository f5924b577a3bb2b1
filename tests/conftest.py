"""Shared test set-up.

After each test file, JAX's caches of compiled programs are cleared. A pytest-xdist worker runs
about half the suite in one process, and keeps every executable XLA compiled for it; under
jaxlib 0.8.1 (the floors' run, XLA at -O0 with the older emitters) a worker aborted inside XLA's
CPU compiler after about 300 tests (`Fatal Python error: Aborted` in
tests/test_explorer.py, 2026-11-27; an earlier session saw a segfault there after 503 tests in one
process). We think the compiled code a long-lived process accumulates is the cause, and have not
shown it; clearing the caches between files costs only the recompiling of what two files share.

On an accelerator, float32 matrix products run at full precision in the tests. XLA's GPU backend
computes them in TF32 by default (a 10-bit mantissa), so the one-hot dispatch einsum rounds the
tokens that gather copies exactly, and tests that compare two float32 formulations of the same
layer at 1e-5 failed on the first lent H200 (mini_moe/results/device-check-gpu-h200.json). The
tests check the algorithms; what reduced precision costs is tests/test_precision.py's subject,
and it sets its dtypes itself.
"""

import jax
import pytest

if jax.default_backend() != "cpu":
    jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(autouse=True, scope="module")
def _fresh_jax_caches_per_file():
    yield
    jax.clear_caches()
