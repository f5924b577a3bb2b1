"""Import the repository's .ci/ scripts (notebooks.py, colab.py, which imports floors.py) in
tests: .ci joins sys.path, as it is when the scripts run."""

import importlib.util
import pathlib
import sys

CI = pathlib.Path(__file__).resolve().parents[1] / ".ci"


def load(name: str):
    """The module ``.ci/<name>.py`` (imported once, then reused)."""
    if str(CI) not in sys.path:
        sys.path.append(str(CI))
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, CI / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]
