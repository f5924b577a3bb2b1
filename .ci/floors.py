"""Print pip constraints that pin mini_moe's JAX stack to the lowest versions pyproject.toml allows.

    python3 .ci/floors.py > constraints.txt
    pip install -c constraints.txt -e '.[test]'
    python .ci/floors.py --check    # in that venv: exit 1 unless exactly these are installed

pyproject.toml's `dependencies` is the one place that states the floors: every package named in
PINNED must appear there with a `>=` floor, which becomes `==`; jaxlib gets jax's floor (a jax
release needs the jaxlib of the same version). `make floors` runs the unit tests in such a venv.
"""

import pathlib
import re
import sys
import tomllib

PINNED = ("jax", "flax", "optax", "orbax-checkpoint", "numpy")


def floors(pyproject: pathlib.Path) -> dict[str, str]:
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    found = {}
    for dep in deps:
        m = re.fullmatch(r"\s*([A-Za-z0-9_.-]+)\s*>=\s*([0-9][^,;\s]*)\s*(?:,[^;]*)?", dep)
        if m:
            found[m[1].lower().replace("_", "-")] = m[2]
    missing = [name for name in PINNED if name not in found]
    if missing:
        sys.exit(f"pyproject.toml: no '>=' floor for {', '.join(missing)} in [project] dependencies")
    pins = {name: found[name] for name in PINNED}
    pins["jaxlib"] = pins["jax"]
    return pins


def check(pins: dict[str, str]) -> None:
    from importlib.metadata import version
    from packaging.version import Version

    wrong = [f"{name} {version(name)} (floor {want})" for name, want in pins.items()
             if Version(version(name)) != Version(want)]
    print("floors:", ", ".join(f"{name}=={want}" for name, want in pins.items()))
    if wrong:
        sys.exit("installed versions are not the floors: " + ", ".join(wrong))


if __name__ == "__main__":
    pins = floors(pathlib.Path(__file__).resolve().parent.parent / "pyproject.toml")
    if sys.argv[1:] == ["--check"]:
        check(pins)
    else:
        print("\n".join(f"{name}=={version}" for name, version in pins.items()))
