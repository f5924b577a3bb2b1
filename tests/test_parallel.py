"""Expert parallelism (mini_moe.parallel) on 8 simulated CPU devices, one check per subprocess
(tests/parallel_check.py): the device count is fixed when JAX starts, and separate checks let
pytest-xdist spread them over the workers instead of one 100-second test."""

import os
import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).with_name("parallel_check.py")
CHECKS = ["equal_to_single_device", "sparse_path_never_reads_dense_tensors", "training_runs_sharded", "errors",
          "global_batch_balance_loss", "loss_free_bias_however_the_batch_is_split"]


@pytest.mark.parametrize("check", CHECKS)
def test_expert_parallel_on_eight_simulated_devices(check, tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}  # the parent's XLA_FLAGS (CI: AVX2, level 0) carry over
    proc = subprocess.run([sys.executable, str(SCRIPT), check, str(tmp_path / "run")], env=env, capture_output=True,
                          text=True, timeout=1200)
    assert proc.returncode == 0 and f"{check}: OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-5000:]


def test_every_check_of_the_script_runs():
    """No check_* function of parallel_check.py is left out of CHECKS."""
    source = SCRIPT.read_text()
    defined = {line.split("(")[0][len("def check_"):] for line in source.splitlines() if line.startswith("def check_")}
    assert defined == set(CHECKS)
