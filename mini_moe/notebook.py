"""Helpers for the book's chapters: numbers in the prose come from the computation.

A chapter states an executed result in its prose only through :func:`glue`: the cell that
computes the value glues it under a name, and the Markdown inserts it with myst-nb's role,
for example ``{glue:text}`ch02_dropped:.1%```. The built page then shows the number this
run computed, on a laptop CPU in the quick configuration as on a GPU in the full one.

Outside Jupyter Book (Colab, plain Jupyter, nbval without myst-nb) the value is printed
instead, so a reader of the notebook sees the same number next to the cell.
"""

from __future__ import annotations

import numbers

import numpy as np

from mini_moe.validate import InputError

__all__ = ["glue", "listing"]


def _plain(value):
    """Python scalars and strings for values that are NumPy or JAX scalars (0-d arrays)."""
    if isinstance(value, str | bool):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    array = np.asarray(value)
    if array.ndim == 0 and array.dtype.kind in "biuf":
        return array.item()
    raise InputError(
        f"glue: value must be a number or a string to insert in the prose, got {type(value).__name__}; "
        "format lists and tables into a string first."
    )


def glue(name: str, value, *, fmt: str | None = None) -> None:
    """Make ``value`` available to the chapter's prose as ``{glue:text}`name```.

    It returns nothing, so that a cell ending in a ``glue`` call shows no stray value under it
    (until 0.5 it returned the value, which the book printed as a bare number, issue 63).

    Args:
      name: the key the Markdown refers to (unique within the book; chapters prefix it, e.g.
        ``"ch02_dropped"``).
      value: a number (Python, NumPy or 0-d JAX) or a string. Numbers are glued as Python
        ``int``/``float`` so that a format spec in the role (``:.1%``, ``:.2f``, ``:d``) applies.
      fmt: when given, also used for the printed fallback (for example ``".1%"``).
    """
    if not isinstance(name, str) or not name.isidentifier():
        raise InputError(f"glue: name must be an identifier such as 'ch02_dropped', got {name!r}")
    plain = _plain(value)
    try:
        from myst_nb import glue as myst_glue
    except ImportError:  # Colab or plain Jupyter: show the value next to the cell instead
        shown = format(plain, fmt) if fmt else plain
        print(f"[{name}] {shown}")
    else:
        myst_glue(name, plain, display=False)


def listing(items, *, none: str = "none") -> str:
    """Items as an English list for the prose: ``[4, 5, 6]`` -> ``"4, 5 and 6"``.

    Args:
      items: anything iterable (NumPy arrays included); each item is shown with ``str``
        (NumPy integers as plain ints).
      none: the text for an empty list.
    """
    words = [str(_plain(i)) if not isinstance(i, str) else i for i in items]
    if not words:
        return none
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]
