"""Tests of mini_moe.figures: the pictures draw exactly what the routing tensors hold."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import jax
import numpy as np
import pytest
from matplotlib.colors import to_rgba

from mini_moe import figures, routing


def _token_choice():
    probs = jax.nn.softmax(jax.random.normal(jax.random.key(0), (8, 4)) + np.array([2.0, 0, 0, 0]), axis=-1)
    return routing.token_choice(probs, capacity=2, k=1)


def _lines(fig, color):
    return [line for line in fig.axes[0].lines if to_rgba(line.get_color()) == to_rgba(color)
            and len(line.get_xdata()) == 2]


def test_layer_diagram_draws_one_line_per_weight():
    rt = _token_choice()
    fig = figures.layer_diagram(rt)
    kept = int((np.asarray(rt.dispatch) > 0).sum())
    assert len(_lines(fig, "tab:blue")) == kept == len(_lines(fig, "tab:green"))
    dropped = int((~(np.asarray(rt.dispatch) > 0).any(axis=(1, 2))).sum())
    assert dropped > 0  # the popular expert overflows
    red_labels = [t for t in fig.axes[0].texts if to_rgba(t.get_color()) == to_rgba("tab:red")]
    assert len(red_labels) == 2 * dropped  # x_t and y_t of every dropped token
    soft = routing.soft_routing(jax.random.normal(jax.random.key(1), (6, 3, 2)))
    fig = figures.layer_diagram(soft)
    assert len(_lines(fig, "tab:blue")) == 6 * 3 * 2  # every token in every slot


def test_routing_heatmaps_show_the_tensors():
    rt = _token_choice()
    fig = figures.routing_heatmaps(rt, "t")
    images = [ax.images[0].get_array() for ax in fig.axes if ax.images]
    np.testing.assert_array_equal(images[0], np.asarray(rt.dispatch).reshape(8, -1))
    np.testing.assert_allclose(images[1], np.asarray(rt.combine).reshape(8, -1))


def test_figures_reject_grouped_tensors():
    rt = routing.token_choice(np.random.default_rng(0).random((2, 8, 4)), capacity=2)
    with pytest.raises(ValueError, match="one group"):
        figures.layer_diagram(rt)
    with pytest.raises(ValueError, match="one group"):
        figures.routing_heatmaps(rt)


def test_all_to_all_diagram_is_a_transpose():
    fig = figures.all_to_all_diagram(devices=2, experts_per_device=2)
    before, after = ([t.get_text() for t in ax.texts if "←" in t.get_text()] for ax in fig.axes[:2])
    assert sorted(before) == sorted(after)  # the same blocks, rearranged
    assert len(before) == 2 * 4  # every device holds one block per expert, then per (own expert, source)


def test_compute_maps_prints_each_positions_mean_and_plots_each_class_mean():
    rng = np.random.default_rng(0)
    counts = [rng.integers(0, 4, (30, 16)), rng.integers(0, 4, (30, 16))]
    labels = np.arange(30) % 3
    fig = figures.compute_maps(counts, labels, ["a", "b", "c"], "t")
    for layer, ax in enumerate(fig.axes[:2]):
        printed = [float(t.get_text()) for t in ax.texts]
        np.testing.assert_allclose(printed, np.round(counts[layer].mean(0), 2), atol=1e-9)  # row-major, as patchify
    class_panel = fig.axes[2]
    for layer, line in enumerate(class_panel.get_lines()[:2]):
        np.testing.assert_allclose(line.get_ydata(), [counts[layer][labels == c].mean() for c in range(3)])
    with pytest.raises(ValueError, match="square number of patches"):
        figures.compute_maps([np.zeros((30, 15))], labels, ["a", "b", "c"])
    with pytest.raises(ValueError, match=r"labels must be \[N\]"):
        figures.compute_maps(counts, labels[:5], ["a", "b", "c"])
