"""Print pip constraints that pin every runtime dependency of mini_moe to its declared floor.

    python3 .ci/floors.py > constraints.txt
    python3 .ci/floors.py --requirements > requirements.txt   # what '.[test,tfds]' needs
    pip install -c constraints.txt -r requirements.txt  # one resolver call: the floors + test tools
    pip install --no-deps -e .                          # then mini_moe itself
    python .ci/floors.py --check    # in that venv: exit 1 unless exactly these are installed,
                                    # or mini_moe imports a package that pyproject does not declare

pyproject.toml is the one place that states the floors: every entry of `[project] dependencies`
and of the `tfds` extra must carry a `>=` floor, which becomes `==`; jaxlib gets jax's floor (a
jax release needs the jaxlib of the same version). The test tools (pytest, hypothesis, POT,
ott-jax, ...) are not pinned: pip picks versions of them that work with the pinned floors, in the
same call. `make floors` runs the unit tests in such a venv. Standard library only: it runs with
any python3 before the venv exists.
"""

import ast
import pathlib
import re
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Extras whose packages are pinned too (tfds: CIFAR and the Fashion-MNIST fallback in mini_moe.data).
PINNED_EXTRAS = ("tfds",)
# Imports of mini_moe that are deliberately not runtime dependencies: each is inside
# `try: ... except ImportError` and only a test or the book needs it.
OPTIONAL_IMPORTS = {
    "ot": "POT, test extra: bench's sparsity_solver comparison, which says how to install it",
    "myst_nb": "book extra: notebook.glue prints the value instead outside a Jupyter Book build",
    "ipywidgets": "book and test extras: explorer's live controls, which say how to install it (the static "
                  "figure needs none)",
    "IPython": "comes with ipywidgets (and any Jupyter kernel): explorer shows its widget with it",
}
# Import name -> distribution name, where they differ.
DISTRIBUTION = {"sklearn": "scikit-learn", "orbax": "orbax-checkpoint",
                "tensorflow_datasets": "tensorflow-datasets"}
# "name>=floor", optionally with more specifiers (",<3") and an environment marker ("; ...").
_FLOOR = re.compile(r"\s*([A-Za-z0-9_.-]+)\s*>=\s*([0-9][^,;\s]*)\s*(?:,[^;]*)?(?:;.*)?")


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def floors(pyproject: pathlib.Path = ROOT / "pyproject.toml") -> dict[str, str]:
    """{distribution: floor} for `[project] dependencies` and the PINNED_EXTRAS, plus jaxlib."""
    pins, unpinned = {}, []
    for dep in requirements(pyproject, PINNED_EXTRAS):
        m = _FLOOR.fullmatch(dep)
        if m:
            pins[_normalize(m[1])] = m[2]
        else:
            unpinned.append(dep)
    if unpinned:
        sys.exit(f"pyproject.toml: no '>=' floor for {', '.join(unpinned)} "
                 f"(in [project] dependencies or the extras {', '.join(PINNED_EXTRAS)})")
    if "jax" in pins:
        pins["jaxlib"] = pins["jax"]
    return pins


def requirements(pyproject: pathlib.Path = ROOT / "pyproject.toml", extras=("test",) + PINNED_EXTRAS) -> list[str]:
    """What ``pip install -e '.[test,tfds]'`` would install besides mini_moe itself: ``[project]
    dependencies`` and those ``extras``, as written in pyproject.toml (``make floors-deps`` installs
    them in one call under the floors' constraints, before mini_moe goes in with ``--no-deps``)."""
    project = tomllib.loads(pyproject.read_text())["project"]
    deps = list(project["dependencies"])
    for extra in extras:
        deps += project["optional-dependencies"][extra]
    return list(dict.fromkeys(deps))


def imported_packages(package: pathlib.Path = ROOT / "mini_moe") -> dict[str, str]:
    """{top-level module: first file importing it} for every non-stdlib import in the package,
    the imports inside functions included."""
    found = {}
    for path in sorted(p for p in package.rglob("*.py") if "results" not in p.relative_to(package).parts):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top != package.name:
                    found.setdefault(top, path.relative_to(ROOT).as_posix())
    return found


def undeclared(pins: dict[str, str]) -> list[str]:
    """mini_moe's imports whose distribution has no floor (and is not in OPTIONAL_IMPORTS)."""
    return [f"{module} ({where})" for module, where in imported_packages().items()
            if module not in OPTIONAL_IMPORTS
            and _normalize(DISTRIBUTION.get(module, module)) not in pins]


def check(pins: dict[str, str]) -> None:
    from importlib.metadata import version
    from packaging.version import Version

    wrong = [f"{name} {version(name)} (floor {want})" for name, want in pins.items()
             if Version(version(name)) != Version(want)]
    print("floors:", ", ".join(f"{name}=={want}" for name, want in pins.items()))
    if wrong:
        sys.exit("installed versions are not the floors: " + ", ".join(wrong))


if __name__ == "__main__":
    pins = floors()
    missing = undeclared(pins)
    if missing:
        sys.exit("mini_moe imports packages that pyproject.toml does not declare with a floor: "
                 + ", ".join(missing))
    if sys.argv[1:] == ["--check"]:
        check(pins)
    elif sys.argv[1:] == ["--requirements"]:
        print("\n".join(requirements()))
    else:
        print("\n".join(f"{name}=={version}" for name, version in pins.items()))
