"""Argument checks shared by every module, and :class:`InputError`, the one exception they
raise: its message names the argument, says what was expected and shows what was given."""

from __future__ import annotations

import numpy as np


class InputError(ValueError):
    """Input that ``mini_moe`` cannot use: an argument, a configuration value, a file or a
    dataset. Every check in the package raises it (or :class:`DataNotFoundError`,
    :class:`MissingPackageError`), with a message that names the input and the fix.

    A ``ValueError``, so code that catches ``ValueError`` keeps working. The command line
    prints it as one line without a traceback; any other exception is a bug and keeps its
    traceback.
    """


class DataNotFoundError(InputError, FileNotFoundError):
    """A dataset or file that is not on this machine; the message says how to get it."""


class MissingPackageError(InputError, ImportError):
    """An optional package that is not installed; the message gives the ``pip install``."""


def check_int(name: str, value, low: int = 1) -> int:
    """``value`` if it is an integer (not a bool) >= ``low``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise InputError(f"{name} must be an integer >= {low}, got {value!r}.")
    return value


def check_positive(name: str, value, *, integer: bool = False):
    """``value`` if it is > 0 (and an integer, when ``integer``)."""
    if integer:
        return check_int(name, value)
    try:
        valid = not isinstance(value, bool) and bool(value > 0)
    except (TypeError, ValueError):  # not a number (or not a scalar)
        valid = False
    if not valid:
        raise InputError(f"{name} must be > 0, got {value!r}.")
    return value


def moved_names(module: str, moves: dict[str, str]):
    """A module ``__getattr__`` for public names that moved (the CHANGELOG's promise: one release
    with a ``DeprecationWarning``). ``moves`` maps an old name to ``"package.module:name"``;
    reading the old name warns and returns the object at its new home."""
    import importlib
    import warnings

    def __getattr__(name):
        if name not in moves:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        home, _, new = moves[name].partition(":")
        warnings.warn(f"{module}.{name} moved to {home}.{new}; the old name goes in the next release.",
                      DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(home), new)

    return __getattr__
