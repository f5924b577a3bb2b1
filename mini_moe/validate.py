"""Argument checks shared by every module: each raises a ``ValueError`` that names the
argument, says what was expected and shows what was given."""

from __future__ import annotations

import numpy as np


def check_int(name: str, value, low: int = 1) -> int:
    """``value`` if it is an integer (not a bool) >= ``low``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}.")
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
        raise ValueError(f"{name} must be > 0, got {value!r}.")
    return value
