"""The device check (issue 55 §3) in its dry mode: the same steps as on a lent accelerator, on the
CPU, so the script that the next device runs first cannot rot. The dry run collects the device's
unit selection and chapter (CI's unit and nbval stages execute them) and runs every benchmark table
at a tiny shape."""

import json
import subprocess
import sys

from ci_scripts import load

device_check = load("device_check")


def test_the_dry_run_takes_every_step_and_records_the_device(tmp_path):
    out = tmp_path / "device-check.json"
    done = subprocess.run([sys.executable, ".ci/device_check.py", "--dry", "--out", str(out)], capture_output=True,
                          text=True, timeout=900, cwd=device_check.ROOT)
    record = json.loads(out.read_text())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert record["dry"] and record["platform"] == "cpu" and record["device"]
    assert [s["step"] for s in record["steps"]] == ["units", "bench", "chapter"]
    assert all(s["status"] == "ok" for s in record["steps"]), record["steps"]
    units, chapter = record["steps"][0], record["steps"][2]
    # the device's selection finds tests in every unit file, and the chapter's cells are there
    assert set(units["collected"]) == set(device_check.UNIT_FILES) and min(units["collected"].values()) >= 1, units
    assert units["failures"] == [] and "error" not in units["output_tail"].lower(), units["output_tail"]
    assert chapter["collected"] == {device_check.CHAPTER: chapter["collected"][device_check.CHAPTER]}
    assert chapter["collected"][device_check.CHAPTER] >= 10, chapter
    dropless = record["bench"]["dropless"]
    assert {r["k"] for r in dropless} == {1, 2} and all("blocked_time_ratio" in r and "time_ratio" in r for r in dropless)
    routers = {r["router"] for r in record["bench"]["routers_reference"]}
    assert {"softmax_token_choice", "softmax_expert_choice", "soft_moe", "sinkhorn_token_choice"} <= routers


def test_a_failing_or_hanging_step_is_recorded_not_hidden():
    failed = device_check.run_step("x", [sys.executable, "-c", "print('boom'); raise SystemExit(3)"], {}, 60)
    assert failed["status"] == "failed (exit 3)" and "boom" in failed["output_tail"]
    named = device_check.run_step("z", [sys.executable, "-c", "print('tests/t.py::a PASSED'); print('tests/t.py::b FAILED')"],
                                  {}, 60)
    assert named["failures"] == ["tests/t.py::b FAILED"]
    slow = device_check.run_step("y", [sys.executable, "-c", "import time; time.sleep(30)"], {}, 1)
    assert slow["status"] == "timed out after 1 s"
