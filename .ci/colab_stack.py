"""A fresh Colab GPU runtime, emulated on a CPU (issue 27).

1. A new virtual environment pinned to the versions Colab's GPU runtime ships
   (googlecolab/backend-info, pip-freeze.gpu.txt, 2026-11; Python 3.12 there, this machine's
   Python here): JAX 0.7.2 with its CUDA plugin, Flax 0.11.2, Optax, Orbax and the rest that the
   chapters import.
2. The chapters' install cell (``.ci/notebooks.py``'s ``install_cell()``, with pip cloning this
   repository instead of GitHub, at the commit the cell names) on a GPU and on a TPU: with an ``nvidia-smi``
   on PATH, or ``TPU_ACCELERATOR_TYPE`` set, the cell's upgrade runs as ``pip install --dry-run
   --report``, and the report must hold JAX's accelerator build at one version (jaxlib, the
   CUDA plugin and its PJRT, or libtpu), at or above the floor: the pip command that a Colab
   reader's GPU or TPU runtime gets upgrades JAX without losing the accelerator.
3. The install cell for real, on this CPU, as a notebook under nbval in the new environment:
   it upgrades what is below the floors (JAX and Flax), installs mini_moe from a wheel that pip
   builds from the pinned commit (never this checkout: the venv must not import it), and leaves the
   rest of Colab's packages as they were.
4. Chapters 1, 2, 7, 11, 14 and 16 under nbval in that environment, run from a temporary folder so
   that the checkout's ``mini_moe/`` cannot shadow the installed one, then the labs page
   with the library's solutions in place of its stubs (.ci/labs.py): one lab opens and checks in
   a fresh Colab-like runtime.

    python .ci/colab_stack.py        # make colab-stack; COLAB_VENV names the venv (.venv-colab)
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import nbformat

sys.path.insert(0, str(Path(__file__).resolve().parent))
from notebooks import ROOT, floors, install_cell  # noqa: E402

VENV = ROOT / os.environ.get("COLAB_VENV", ".venv-colab")
PY = VENV / "bin" / "python"
#: Colab's GPU runtime (2026-11): JAX with its CUDA plugin, and the packages the chapters import.
COLAB_PINS = {"jax": "0.7.2", "jaxlib": "0.7.2", "jax-cuda12-plugin": "0.7.2", "jax-cuda12-pjrt": "0.7.2",
              "flax": "0.11.2", "optax": "0.2.8", "orbax-checkpoint": "0.12.0", "numpy": "2.0.2",
              "scipy": "1.16.3", "matplotlib": "3.10.0", "scikit-learn": "1.6.1", "tensorflow-datasets": "4.9.10"}
#: Chapters 1, 2 and 7, and the pages that use the newest API (11: the dropless kernels; 14: the labs;
#: 16: the explorer), executed with the mini_moe that the install cell installs.
CHAPTERS = ["01_unified_formulation", "02_softmax_token_choice", "07_router_consistency", "11_making_it_fast",
            "14_labs", "16_explorer"]


def sh(*command, env=None, capture=False, cwd=None) -> str | None:
    print("+", " ".join(map(str, command)), flush=True)
    return subprocess.run(list(map(str, command)), check=True, text=True, stdout=subprocess.PIPE if capture else None,
                          env={**os.environ, **(env or {})}, cwd=cwd).stdout


def release(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def installed() -> dict[str, str]:
    listing = json.loads(sh(PY, "-m", "pip", "list", "--format", "json", capture=True))
    return {p["name"].lower().replace("_", "-"): p["version"] for p in listing}


def cell_source() -> str:
    """Chapter 16's install cell (mini_moe with its tfds extra), as a reader's runtime runs it, with
    one change: pip clones this repository (``git+file://``) instead of GitHub, at the commit the
    cell names. So pip builds mini_moe's wheel from that commit, as on Colab, not from the checkout."""
    text = (ROOT / "book" / "16_explorer.md").read_text()
    source = install_cell(text).split("\n", 2)[2]  # without the ":tags:" line
    source, n = re.subn(r'^MINI_MOE = "(mini_moe\S*) @ git\+\S+@(\S+)"$', rf'MINI_MOE = "\1 @ git+file://{ROOT}@\2"',
                        source, flags=re.M)
    assert n == 1, "the install cell names mini_moe @ git+URL@REF in one MINI_MOE line"
    return source


def upgrade_report(accelerator: str, tmp: Path) -> dict[str, str]:
    """Run the install cell in the Colab venv as if ``accelerator`` were attached, with its upgrade
    as a pip dry run; the packages and versions pip would install."""
    report = tmp / f"{accelerator}.json"
    shim = f'''
import subprocess, sys
def _pip(args):
    assert args.startswith("install -q -U "), args
    subprocess.run([sys.executable, "-m", "pip", *args.split()[:3], "--dry-run", "--report", {str(report)!r},
                    *[a.strip('"') for a in args.split()[3:]]], check=True)
    raise SystemExit(0)  # the upgrade is what this checks
'''
    code = shim + re.sub(r"^( *)%pip (.*)$", r"\1_pip(f'''\2''')", cell_source(), flags=re.M)
    env = {"PATH": os.environ["PATH"]}
    if accelerator == "GPU":
        (tmp / "nvidia-smi").write_text("#!/bin/sh\n")
        (tmp / "nvidia-smi").chmod(0o755)
        env["PATH"] = f"{tmp}:{env['PATH']}"
    else:
        env["TPU_ACCELERATOR_TYPE"] = "v5litepod-1"  # Colab's TPU runtime: one v5e chip
    sh(PY, "-c", code, env=env)
    return {item["metadata"]["name"].lower(): item["metadata"]["version"]
            for item in json.loads(report.read_text())["install"]}


def check_accelerator_upgrade(accelerator: str, plan: dict[str, str]) -> None:
    jax = plan.get("jax")
    if jax is None or release(jax) < release(floors()["jax"]):
        raise SystemExit(f"colab-stack: on a {accelerator} the install cell would not upgrade JAX to the floor: {plan}")
    # At JAX's own version: jaxlib and the CUDA plugin; libtpu has version numbers of its own.
    same_version = ["jaxlib", "jax-cuda12-plugin", "jax-cuda12-pjrt"] if accelerator == "GPU" else ["jaxlib"]
    companions = same_version + (["libtpu"] if accelerator == "TPU" else [])
    missing = [name for name in companions if name not in plan]
    mismatched = [f"{name} {plan[name]}" for name in same_version if name in plan and plan[name] != jax]
    if missing or mismatched:
        raise SystemExit(f"colab-stack: on a {accelerator} the upgrade to JAX {jax} would leave the accelerator "
                         f"build behind: missing {missing}, other versions {mismatched}")
    print(f"colab-stack: on a {accelerator} the install cell upgrades to JAX {jax} with "
          + ", ".join(f"{name} {plan[name]}" for name in companions), flush=True)


def main() -> None:
    shutil.rmtree(VENV, ignore_errors=True)
    sh(os.environ.get("PYTHON", sys.executable), "-m", "venv", VENV)
    sh(PY, "-m", "pip", "install", "-q", "--upgrade", "pip")
    sh(PY, "-m", "pip", "install", "-q", *[f"{name}=={v}" for name, v in COLAB_PINS.items()],
       "ipykernel", "nbclient", "nbval>=0.11", "pytest>=8")
    before = installed()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for accelerator in ("GPU", "TPU"):
            check_accelerator_upgrade(accelerator, upgrade_report(accelerator, tmp))
        notebook = tmp / "install_cell.ipynb"
        nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(cell_source())]), notebook)
        sh(PY, "-m", "pytest", "--nbval-lax", "--nbval-current-env", "-p", "no:cacheprovider", "-q", notebook)
    after = installed()
    below = [name for name, floor in floors().items() if release(after[name]) < release(floor)]
    changed = sorted(name for name in COLAB_PINS if after.get(name) != before[name])
    upgraded = {name for name, floor in floors().items() if release(before[name]) < release(floor)}
    if below or "mini-moe" not in after or not set(changed) <= upgraded | {"jaxlib"}:
        raise SystemExit(f"colab-stack: after the install cell: below the floors {below}, changed {changed} "
                         f"(only {sorted(upgraded)} and jaxlib should), mini_moe installed: {'mini-moe' in after}")
    print("colab-stack: the install cell upgraded", ", ".join(f"{n} {before[n]} -> {after[n]}" for n in changed),
          "and left the rest of Colab's packages as they were", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        where = sh(PY, "-c", "import mini_moe; print(mini_moe.__file__)", capture=True, cwd=tmp).strip()
        if Path(where).resolve().is_relative_to((ROOT / "mini_moe").resolve()):  # an editable install's
            raise SystemExit(f"colab-stack: the Colab venv imports mini_moe from the checkout ({where}), "
                             "not from what the install cell installed")
        print(f"colab-stack: mini_moe imported from {where}", flush=True)
        for name in CHAPTERS:
            shutil.copy(ROOT / "book" / f"{name}.ipynb", tmp)
        sh(PY, "-m", "pytest", "--nbval-lax", "--nbval-current-env", "-p", "no:cacheprovider", "-q",
           *[f"{name}.ipynb" for name in CHAPTERS], cwd=tmp)
    sh(PY, ROOT / ".ci" / "labs.py")


if __name__ == "__main__":
    main()
