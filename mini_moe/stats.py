"""The statistics the book's comparisons use, in one place: :func:`paired_t` (Student's paired t
test and interval), :func:`holm` (Holm's step-down correction for a family), :func:`wilson` (a
binomial share's interval), :func:`mcnemar` (the exact test of paired binary outcomes) and
:func:`bootstrap_mean` (a percentile interval over resampled units, e.g. images) and
:func:`crossed_bootstrap` (the same over two crossed factors at once, e.g. seeds and images)."""

from __future__ import annotations

import functools
import math
import statistics

import numpy as np

from mini_moe.validate import InputError


def paired_t(differences, *, level: float = 0.95) -> dict:
    """Paired t-test of ``differences`` (one per independent pair) against zero.

    Returns ``{"difference": mean, "stderr": standard error of the mean, "pairs": n,
    "t": mean / stderr, "df": n - 1, "p_value": two-sided p-value of Student's t with n - 1
    degrees of freedom, "ci_low", "ci_high": the ``level`` confidence interval of the mean
    difference, mean -+ t_{(1 + level)/2, n-1} * stderr}``. With one pair every statistic but
    the mean is NaN; with a zero spread the t statistic is infinite (p = 0) unless the mean is
    zero too (t = 0, p = 1).
    """
    from scipy import stats  # a dependency of scikit-learn

    diffs = [float(d) for d in differences]
    if not diffs:
        raise InputError("paired_t needs at least one difference.")
    if not 0 < level < 1:
        raise InputError(f"level must be in (0, 1), got {level!r}.")
    n, mean = len(diffs), statistics.fmean(diffs)
    out = {"difference": mean, "pairs": n, "df": n - 1}
    if n < 2:
        return out | {"stderr": math.nan, "t": math.nan, "p_value": math.nan, "ci_low": math.nan, "ci_high": math.nan}
    stderr = statistics.stdev(diffs) / math.sqrt(n)
    if stderr > 0:
        t = mean / stderr
        p_value = float(2 * stats.t.sf(abs(t), n - 1))
    else:
        t, p_value = (0.0, 1.0) if mean == 0 else (math.copysign(math.inf, mean), 0.0)
    half = float(stats.t.ppf((1 + level) / 2, n - 1)) * stderr
    return out | {"stderr": stderr, "t": t, "p_value": p_value, "ci_low": mean - half, "ci_high": mean + half}


def holm(p_values) -> list[float]:
    """Holm's step-down adjustment of a family of p-values (controls the family-wise error rate).

    The i-th smallest of m p-values is multiplied by m - i + 1 (i = 1, ..., m), the products are
    made non-decreasing in that order and capped at 1; returned in the order given. A comparison
    is significant at level alpha for the whole family when its adjusted p-value is below alpha.
    """
    p = [float(v) for v in p_values]
    if any(not 0 <= v <= 1 for v in p):
        raise InputError(f"p-values must lie in [0, 1], got {p}.")
    m = len(p)
    adjusted = [0.0] * m
    running = 0.0
    for rank, index in enumerate(sorted(range(m), key=lambda i: p[i])):
        running = max(running, min(1.0, (m - rank) * p[index]))
        adjusted[index] = running
    return adjusted


def wilson(successes: int, n: int, *, level: float = 0.95) -> tuple[float, float]:
    """Wilson's score interval for a binomial share ``successes / n``: exactly 0 at the low end
    when nothing succeeded and exactly 1 at the high end when everything did."""
    from scipy import stats

    if not (isinstance(n, (int, np.integer)) and n >= 1 and 0 <= successes <= n):
        raise InputError(f"wilson needs 0 <= successes <= n and n >= 1, got {successes} of {n}.")
    z = float(stats.norm.ppf((1 + level) / 2))
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    low = 0.0 if successes == 0 else max(0.0, centre - half)
    high = 1.0 if successes == n else min(1.0, centre + half)
    return low, high


def mcnemar(first, second) -> dict:
    """The exact McNemar test of two paired binary outcomes (``first[i]``, ``second[i]`` bool):
    the discordant pairs ``b`` (only first) and ``c`` (only second), and the two-sided binomial
    p-value of ``b`` out of ``b + c`` at one half (1 when there is no discordant pair)."""
    from scipy import stats

    first, second = np.asarray(first, bool), np.asarray(second, bool)
    if first.shape != second.shape:
        raise InputError(f"first and second must be paired (one shape), got {first.shape} and {second.shape}.")
    b, c = int(np.sum(first & ~second)), int(np.sum(~first & second))
    p = 1.0 if b + c == 0 else float(stats.binomtest(b, b + c, 0.5).pvalue)
    return {"only_first": b, "only_second": c, "p_value": p}


def bootstrap_mean(values, *, resamples: int = 2000, level: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of ``values [N]`` (one per independent unit, e.g.
    per image), over ``resamples`` resamplings of the units with replacement."""
    values = np.asarray(values, np.float64)
    if values.ndim != 1 or len(values) < 2:
        raise InputError(f"values must be one number per unit, at least 2 units, got shape {values.shape}.")
    rng = np.random.default_rng(seed)
    means = values[rng.integers(0, len(values), (resamples, len(values)))].mean(1)
    tail = (1 - level) / 2
    return float(np.quantile(means, tail)), float(np.quantile(means, 1 - tail))


@functools.lru_cache(maxsize=2)
def _resample_weights(rows: int, cols: int, resamples: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Resampling as weights: each resample's row and column counts divided by the draws, ``[B, S]``
    and ``[B, N]``. They depend on the shape and the seed only, so a page that takes many intervals
    of tables of one shape draws them once (read-only, shared by the calls)."""
    rng = np.random.default_rng(seed)
    row_w = np.stack([np.bincount(r, minlength=rows) for r in rng.integers(0, rows, (resamples, rows))]) / rows
    col_w = np.stack([np.bincount(c, minlength=cols) for c in rng.integers(0, cols, (resamples, cols))]) / cols
    row_w.flags.writeable = col_w.flags.writeable = False
    return row_w, col_w


def crossed_bootstrap(values, *, resamples: int = 2000, level: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the grand mean of ``values [S, N]``, whose rows and columns
    are two crossed random factors (seeds and test images: every seed's model sees the same
    images): each resample draws ``S`` rows and ``N`` columns with replacement, independently, and
    takes the mean of that sub-table. So the interval covers the variation from both the seeds
    and the finite test set, where :func:`paired_t` over per-seed means covers only the first."""
    values = np.asarray(values, np.float64)
    if values.ndim != 2 or min(values.shape) < 2:
        raise InputError(f"values must be a table [seeds, images] with at least 2 of each, got shape {values.shape}.")
    row_w, col_w = _resample_weights(*values.shape, resamples, seed)
    means = np.einsum("bs,sb->b", row_w, values @ col_w.T)
    tail = (1 - level) / 2
    return float(np.quantile(means, tail)), float(np.quantile(means, 1 - tail))
