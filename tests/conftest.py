"""Shared test set-up.

After each test file, JAX's caches of compiled programs are cleared. A pytest-xdist worker runs
about half the suite in one process, and keeps every executable XLA compiled for it; under
jaxlib 0.8.1 (the floors' run, XLA at -O0 with the older emitters) a worker aborted inside XLA's
CPU compiler after about 300 tests (`Fatal Python error: Aborted` in
tests/test_explorer.py, 2026-11-27; an earlier session saw a segfault there after 503 tests in one
process). We think the compiled code a long-lived process accumulates is the cause, and have not
shown it; clearing the caches between files costs only the recompiling of what two files share.
"""

import jax
import pytest


@pytest.fixture(autouse=True, scope="module")
def _fresh_jax_caches_per_file():
    yield
    jax.clear_caches()
