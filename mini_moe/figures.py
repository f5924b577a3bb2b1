"""Pictures of routing for the book: the tensors of eq. (2), the layer as a diagram, and
expert parallelism's exchange. Every function draws what it is given (nothing is routed here)
and returns the matplotlib figure.

* :func:`routing_heatmaps` — dispatch and combine ``[T, E, C]`` as two heatmaps, a row per token
  and a column per slot, experts separated by red lines, dropped tokens labelled in red.
* :func:`layer_diagram` — eq. (2) as a picture: tokens, the expert slots they are dispatched to,
  and the output tokens the slots are combined into; line opacity is the weight.
* :func:`all_to_all_diagram` — expert parallelism (chapter 10): which device holds which
  (source device, expert) block of slots before and after the all-to-all exchange.
* :func:`compute_maps` — where a model with a variable number of experts per token puts its compute
  (chapter 19): the mean count per patch position for each MoE layer, and per class.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mini_moe.validate import InputError

Array = Any


def _plt():
    import matplotlib.pyplot as plt  # imported on use: the library itself does not need matplotlib

    return plt


def routing_heatmaps(routing, title: str = "", *, annotate=("combine",)):
    """Dispatch and combine tensors ``[T, E, C]`` (one group) as two heatmaps.

    Args:
      routing: a :class:`~mini_moe.routing.Routing` of one group (``dispatch`` of shape ``[T, E, C]``).
      title: the figure's title.
      annotate: which of ``"dispatch"``, ``"combine"`` to print the non-zero values on
        (leave empty for large groups).
    """
    plt = _plt()
    tensors = {"dispatch": np.asarray(routing.dispatch), "combine": np.asarray(routing.combine)}
    if tensors["dispatch"].ndim != 3:
        raise InputError(f"routing tensors must be [T, E, C] (one group), got {tensors['dispatch'].shape}.")
    num_tokens, num_experts, cap = tensors["dispatch"].shape
    dropped = ~(tensors["dispatch"] > 0).any(axis=(1, 2))
    small = num_tokens <= 40 and num_experts * cap <= 40  # room for tick labels and numbers
    width, height = (2.2 + 0.4 * num_experts * cap, 1.4 + 0.35 * num_tokens) if small else (5.5, 4.5)
    side_by_side = num_experts * cap <= 8 or not small  # wide labelled pictures go one above the other
    fig, axes = plt.subplots(1 if side_by_side else 2, 2 if side_by_side else 1,
                             figsize=(2 * width, height) if side_by_side else (width, 2 * height),
                             constrained_layout=True)
    for ax, (name, tensor) in zip(axes, tensors.items()):
        flat = tensor.reshape(num_tokens, num_experts * cap)
        image = ax.imshow(flat, cmap="Greys" if name == "dispatch" else "viridis",
                          vmin=0.0, vmax=max(float(flat.max()), 1e-6), aspect="auto", interpolation="nearest")
        fig.colorbar(image, ax=ax, shrink=0.85)
        for r in range(1, num_experts):
            ax.axvline(r * cap - 0.5, color="tab:red", linewidth=1.5 if small else 0.8)
        top = ax.secondary_xaxis("top")
        top.set_xticks([r * cap + (cap - 1) / 2 for r in range(num_experts)],
                       [f"expert {r}" if small else str(r) for r in range(num_experts)], fontsize=8 if small else 6)
        if small:
            ax.set_xticks(range(num_experts * cap), [str(c) for c in range(cap)] * num_experts, fontsize=7)
            ax.set_yticks(range(num_tokens), [f"token {t}" for t in range(num_tokens)])
            for t in np.flatnonzero(dropped):
                ax.get_yticklabels()[t].set_color("tab:red")
            ax.set_xlabel("slot c within each expert")
        else:
            ax.set_xlabel("slots, expert by expert")
            ax.set_ylabel(f"token ({int(dropped.sum())} of {num_tokens} reach no slot)")
        ax.set_title(name)
        if small and name in annotate:
            for t, j in zip(*np.nonzero(flat)):
                red, green, blue, _ = image.cmap(image.norm(flat[t, j]))
                dark = 0.299 * red + 0.587 * green + 0.114 * blue < 0.5
                ax.text(j, t, f"{flat[t, j]:.2f}", ha="center", va="center", fontsize=6.5,
                        color="white" if dark else "black")
    fig.suptitle(title)
    return fig


def layer_diagram(routing, title: str = "", *, expert_names=None):
    """Eq. (2) as a picture: tokens on the left, each expert's slots in the middle, the output
    tokens on the right. A line from token t to slot (e, c) has opacity ``dispatch[t, e, c]``; a
    line from slot (e, c) to output t has opacity proportional to ``combine[t, e, c]``. Tokens no
    slot takes are red.

    Args:
      routing: a :class:`~mini_moe.routing.Routing` of one group (``[T, E, C]``).
      title: the figure's title.
      expert_names: labels of the experts (default ``f_0``, ``f_1``, ...).
    """
    plt = _plt()
    from matplotlib.patches import FancyBboxPatch

    dispatch, combine = np.asarray(routing.dispatch, float), np.asarray(routing.combine, float)
    if dispatch.ndim != 3:
        raise InputError(f"routing tensors must be [T, E, C] (one group), got {dispatch.shape}.")
    num_tokens, num_experts, cap = dispatch.shape
    slots = num_experts * cap
    height = max(num_tokens, slots + num_experts - 1)
    token_y = np.linspace(height - 1, 0, num_tokens)
    slot_y = np.array([height - 1 - (e * (cap + 1) + c) * (height - 1) / max(slots + num_experts - 2, 1)
                       for e in range(num_experts) for c in range(cap)])
    fig, ax = plt.subplots(figsize=(7, 0.32 * height + 1.2))
    x_in, x_slot, x_out = 0.0, 1.0, 2.0
    top_combine = max(float(combine.max()), 1e-9)
    for t in range(num_tokens):
        for j in range(slots):
            e, c = divmod(j, cap)
            if dispatch[t, e, c] > 1e-3:
                ax.plot([x_in + 0.08, x_slot - 0.12], [token_y[t], slot_y[j]], color="tab:blue",
                        alpha=min(1.0, float(dispatch[t, e, c])), lw=1.0)
            if combine[t, e, c] > 1e-3 * top_combine:
                ax.plot([x_slot + 0.12, x_out - 0.08], [slot_y[j], token_y[t]], color="tab:green",
                        alpha=min(1.0, float(combine[t, e, c]) / top_combine), lw=1.0)
    dropped = ~(dispatch > 0).any(axis=(1, 2))
    for t in range(num_tokens):
        color = "tab:red" if dropped[t] else "black"
        ax.plot(x_in, token_y[t], "o", color=color, ms=6)
        ax.text(x_in - 0.08, token_y[t], f"x{t}", ha="right", va="center", fontsize=8, color=color)
        ax.plot(x_out, token_y[t], "o", color=color, ms=6)
        ax.text(x_out + 0.08, token_y[t], f"y{t}", ha="left", va="center", fontsize=8, color=color)
    names = expert_names or [f"f_{e}" for e in range(num_experts)]
    for e in range(num_experts):
        ys = slot_y[e * cap:(e + 1) * cap]
        box = FancyBboxPatch((x_slot - 0.12, ys.min() - 0.4), 0.24, ys.max() - ys.min() + 0.8,
                             boxstyle="round,pad=0.02", fc="0.93", ec="0.4")
        ax.add_patch(box)
        ax.text(x_slot, ys.max() + 0.55, f"expert {names[e]}", ha="center", va="bottom", fontsize=8)
        for y in ys:
            ax.plot(x_slot, y, "s", color="0.3", ms=5)
    ax.text(x_in, height + 0.6, "tokens", ha="center")
    ax.text(x_slot, height + 1.3, "slots (C per expert)", ha="center")
    ax.text(x_out, height + 0.6, "outputs", ha="center")
    ax.text((x_in + x_slot) / 2, -1.3, "dispatch", ha="center", color="tab:blue")
    ax.text((x_slot + x_out) / 2, -1.3, "combine", ha="center", color="tab:green")
    ax.set_xlim(-0.5, 2.5)
    ax.set_ylim(-1.8, height + 2.0)
    ax.axis("off")
    ax.set_title(title)
    return fig


def all_to_all_diagram(devices: int = 4, experts_per_device: int = 2):
    """Expert parallelism's exchange as two grids of slot blocks.

    Before: device d holds the slots its own tokens filled, one block per expert (all E
    experts). After the all-to-all: device d holds the blocks of its own experts, one from
    every source device. The colour of a block is the device whose tokens filled it.
    """
    plt = _plt()
    from matplotlib.patches import Rectangle

    num_experts = devices * experts_per_device
    colors = plt.cm.tab10(np.arange(devices) % 10)
    fig, axes = plt.subplots(1, 2, figsize=(10, 0.5 * num_experts + 1.5))
    for ax, stage in zip(axes, ("before", "after")):
        for d in range(devices):
            ax.add_patch(Rectangle((d * 1.3 - 0.1, -0.1), 1.2, num_experts + 0.2, fc="none", ec="0.3"))
            ax.text(d * 1.3 + 0.5, num_experts + 0.3, f"device {d}", ha="center")
            for row in range(num_experts):
                if stage == "before":  # row = expert, filled by this device's tokens
                    source, expert = d, row
                else:  # device d holds experts d*epd .. ; rows: (expert, source device)
                    expert = d * experts_per_device + row // devices
                    source = row % devices
                ax.add_patch(Rectangle((d * 1.3, num_experts - 1 - row), 1.0, 0.9, fc=colors[source], alpha=0.75))
                ax.text(d * 1.3 + 0.5, num_experts - 1 - row + 0.45, f"e{expert} ← d{source}",
                        ha="center", va="center", fontsize=7)
        ax.set_xlim(-0.3, devices * 1.3)
        ax.set_ylim(-0.4, num_experts + 0.9)
        ax.axis("off")
        ax.set_title("before all_to_all: each device's slots for every expert" if stage == "before"
                     else "after: each device holds its own experts' slots from every device", fontsize=9)
    return fig


def compute_maps(counts, labels, class_names, title: str = "", *, vmin: float = 1, vmax: float = 3):
    """Mean real experts per patch (``counts``, per MoE layer ``[N, P]`` with ``P`` a square grid
    of patches, e.g. ``mini_moe.results.compute_per_patch.real_experts``) as one heatmap per
    layer by patch position, the value printed in each cell, and a panel of the mean per class
    (``labels [N]``, ``class_names`` in label order); a dotted line marks 2 experts."""
    plt = _plt()
    counts = [np.asarray(c, np.float64) for c in counts]
    labels = np.asarray(labels)
    side = int(round(np.sqrt(counts[0].shape[-1])))
    if side * side != counts[0].shape[-1] or any(c.shape != counts[0].shape for c in counts):
        raise InputError(f"counts must be per layer [N, P] with P a square number of patches, got shapes "
                         f"{[c.shape for c in counts]}.")
    if labels.shape != counts[0].shape[:1]:
        raise InputError(f"labels must be [N] = {counts[0].shape[:1]}, got {labels.shape}.")
    fig, axes = plt.subplots(1, len(counts) + 1, figsize=(4.3 * (len(counts) + 1), 3.8))
    for layer, (ax, count) in enumerate(zip(axes, counts)):
        heat = count.mean(0).reshape(side, side)
        im = ax.imshow(heat, cmap="viridis", vmin=vmin, vmax=vmax)
        for (i, j), v in np.ndenumerate(heat):
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", color="w", fontsize=9)
        ax.set(title=f"MoE layer {layer + 1}, by patch position", xticks=[], yticks=[])
    fig.colorbar(im, ax=list(axes[:-1]), shrink=0.8)
    classes = range(len(class_names))
    for layer, count in enumerate(counts):
        axes[-1].plot(classes, [count[labels == c].mean() for c in classes], "o-", label=f"layer {layer + 1}")
    axes[-1].axhline(2, color="grey", lw=0.8, ls=":")
    axes[-1].set(xticks=list(classes), title="mean real experts per patch, by class", ylabel="real experts")
    axes[-1].set_xticklabels(class_names, rotation=60, fontsize=8)
    axes[-1].legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10, y=1.04)
    return fig
