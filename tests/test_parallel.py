"""Expert parallelism (mini_moe.parallel) on 8 simulated CPU devices, in a subprocess."""

import os
import pathlib
import subprocess
import sys


def test_expert_parallel_equals_single_device_and_trains(tmp_path):
    script = pathlib.Path(__file__).with_name("parallel_check.py")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}  # the parent's XLA_FLAGS (CI: AVX2, level 0) carry over
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "run")], env=env, capture_output=True,
                          text=True, timeout=1200)
    assert proc.returncode == 0 and "ALL OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-5000:]
