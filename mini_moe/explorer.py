"""See the routing of a trained model, image by image (issue 38): :func:`routing_view` computes
what one image's patches do in one MoE layer at a chosen capacity factor, :func:`draw_view` draws
it, and :func:`explore` puts both behind controls (ipywidgets) that re-run the router when moved.

Where no widget frontend is attached (nbval, the HTML build of the book, a script),
:func:`explore` draws a static figure instead: the image at every capacity factor of the list.

    from mini_moe.explorer import explore
    explore(model, test_images)          # in Jupyter, JupyterLab, VS Code or Colab
"""

from __future__ import annotations

import contextlib
import os
import sys

import numpy as np

from mini_moe import evaluate
from mini_moe.validate import InputError

#: Okabe and Ito's colour-blind-safe palette, without its black (which marks dropped patches).
PALETTE = ("#E69F00", "#56B4E9", "#009E73", "#F0E442", "#0072B2", "#D55E00", "#CC79A7", "#999999")


@contextlib.contextmanager
def capacity(model, factor: float | None):
    """Route with capacity factor ``factor`` in every MoE layer whose router has one (Token and
    Expert Choice; Soft MoE has none), for the block; the trained factors come back afterwards.
    ``None`` changes nothing."""
    routers = [block.mlp.router for block in model.blocks if block.use_moe]
    saved = [(r, r.capacity_factor) for r in routers if hasattr(r.allocation, "capacity_factor")]
    if factor is not None and not factor > 0:
        raise InputError(f"capacity_factor must be > 0, got {factor!r}.")
    try:
        if factor is not None:
            for r, _ in saved:
                r.capacity_factor = float(factor)
        yield model
    finally:
        for r, value in saved:
            r.capacity_factor = value


def routing_view(model, images: np.ndarray, *, image: int = 0, layer: int = 0,
                 capacity_factor: float | None = None) -> dict:
    """What the explorer draws: image ``image`` of ``images [N, H, W, C]`` in MoE layer ``layer``
    (0 = the first MoE layer), routed in eval mode with its routing group (the images of the
    model's ``group_images`` that hold it; Soft MoE routes it alone) at ``capacity_factor``
    (None: the trained one).

    Returns a dict of NumPy arrays and numbers, P patches of a ``side x side`` grid, E experts:
      ``expert [side, side]`` the expert with the largest combine weight of each patch, -1 where the
      patch reached no expert (dropped); ``weight [side, side]`` that combine weight;
      ``experts_per_patch [side, side]``; ``load [E]`` the tokens of the whole routing group each
      expert processes, against ``capacity`` (slots per expert); ``dropped_share`` and
      ``experts_per_token`` over the group; ``slots [P, E, S]`` (Soft MoE only, else None): the
      image's dispatch weights, slot s of expert e mixes the patches with weights ``slots[:, e, s]``;
      ``capacity_factor`` (None for Soft MoE), ``num_experts``, ``side``.
    """
    cfg = model.cfg
    moe_layers = [block for block in model.blocks if block.use_moe]
    if not moe_layers:
        raise InputError("routing_view needs a model with MoE layers; this one is dense (router=None).")
    if not 0 <= layer < len(moe_layers):
        raise InputError(f"layer must be in 0..{len(moe_layers) - 1} (the model's MoE layers), got {layer!r}.")
    images = np.asarray(images)
    if not 0 <= image < len(images):
        raise InputError(f"image must be in 0..{len(images) - 1}, got {image!r}.")
    router = moe_layers[layer].mlp.router
    group = 1 if router.per_image else cfg.group_images
    start = image - image % group
    batch = images[start:start + group]
    if len(batch) < group:
        raise InputError(f"image {image} has no complete routing group of {group} images in `images`; "
                         f"pass at least {start + group} images.")
    soft = router.per_image
    with capacity(model, None if soft else capacity_factor), evaluate.eval_mode(model):
        out = evaluate._forward(model, batch, return_routing=True)
        factor = None if soft else float(router.capacity_factor)
    rt = out.routings[layer]
    dispatch, combine = np.asarray(rt.dispatch)[0], np.asarray(rt.combine)[0]  # the one group: [T, E, C]
    patches = cfg.num_patches
    rows = slice((image - start) * patches, (image - start + 1) * patches)
    reached = (dispatch > 0).any(-1)  # [T, E]
    per_expert = combine.sum(-1)  # [T, E]
    side = int(round(np.sqrt(patches)))
    own = reached[rows]
    expert = np.where(own.any(-1), per_expert[rows].argmax(-1), -1)
    return {
        "expert": expert.reshape(side, side),
        "weight": np.where(own.any(-1), per_expert[rows].max(-1), 0.0).reshape(side, side),
        "experts_per_patch": own.sum(-1).reshape(side, side),
        "load": reached.sum(0),
        "capacity": dispatch.shape[-1],
        "dropped_share": float((~reached.any(-1)).mean()),
        "experts_per_token": float(reached.sum(-1).mean()),
        "slots": dispatch[rows] if soft else None,
        "capacity_factor": factor,
        "num_experts": dispatch.shape[1],
        "side": side,
    }


def _colour(expert: int) -> str:
    return PALETTE[expert % len(PALETTE)]


def draw_view(view: dict, image: np.ndarray | None = None, *, axes=None, title: str = "", slot: tuple | None = None):
    """Draw a :func:`routing_view`: the patches coloured by their expert (opacity: the combine
    weight; black with a cross: dropped), and each expert's load against its capacity. With
    ``slot = (e, s)`` (Soft MoE) the left panel shows slot s of expert e's mixing weight per patch
    instead. ``image [H, W, C]`` is drawn under the patches in grey. Returns the figure."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    if axes is None:
        fig, axes = plt.subplots(1, 2, figsize=(7, 3.2), gridspec_kw={"width_ratios": [1, 1.3]})
    left, right = axes
    side = view["side"]
    if image is not None:
        left.imshow(np.asarray(image)[..., 0], cmap="gray", extent=(0, side, side, 0), alpha=0.6)
    if slot is not None and view["slots"] is not None:
        mix = view["slots"][:, slot[0], slot[1]].reshape(side, side)
        left.imshow(mix, cmap="magma", extent=(0, side, side, 0), alpha=0.8)
        left.set_title(f"slot {slot[1]} of expert {slot[0]}: mixing weights", fontsize=9)
    else:
        for r in range(side):
            for c in range(side):
                e = int(view["expert"][r, c])
                if e < 0:
                    left.add_patch(Rectangle((c, r), 1, 1, color="black", alpha=0.8))
                    left.plot([c + 0.15, c + 0.85], [r + 0.15, r + 0.85], color="white", lw=1)
                    left.plot([c + 0.15, c + 0.85], [r + 0.85, r + 0.15], color="white", lw=1)
                else:
                    alpha = 0.25 + 0.75 * float(np.clip(view["weight"][r, c], 0, 1))
                    left.add_patch(Rectangle((c, r), 1, 1, color=_colour(e), alpha=alpha))
                    left.text(c + 0.5, r + 0.5, str(e), ha="center", va="center", fontsize=7)
        left.set_title(title or "patches by expert (black: dropped)", fontsize=9)
    left.set_xlim(0, side)
    left.set_ylim(side, 0)
    left.set_xticks([])
    left.set_yticks([])
    experts = np.arange(view["num_experts"])
    right.bar(experts, view["load"], color=[_colour(int(e)) for e in experts])
    if view["capacity_factor"] is not None:
        right.axhline(view["capacity"], color="black", ls="--", lw=0.8, label=f"capacity C = {view['capacity']}")
        right.legend(fontsize=7, loc="upper right")
    right.set_xlabel("expert")
    right.set_ylabel("tokens of the group")
    factor = "" if view["capacity_factor"] is None else f"c = {view['capacity_factor']:g}, "
    right.set_title(f"{factor}dropped {view['dropped_share']:.0%}, {view['experts_per_token']:.2f} experts/token",
                    fontsize=9)
    return left.figure


def _widgets():
    """ipywidgets, or a clear error: it comes with the book extra, not with the package."""
    try:
        import ipywidgets
    except ImportError as e:
        raise InputError("the live explorer needs ipywidgets: pip install ipywidgets (or 'mini_moe[book]'); "
                         "explore(..., interactive=False) draws the static figure without it.") from e
    return ipywidgets


def widget_frontend() -> bool:
    """Whether widgets will show: Colab, VS Code, or a Jupyter server's kernel (which sets
    ``JPY_SESSION_NAME``); not nbval, nbclient or the book's build. ``MINI_MOE_STATIC=1`` forces
    the static figure."""
    if os.environ.get("MINI_MOE_STATIC") == "1":
        return False
    return "google.colab" in sys.modules or "VSCODE_PID" in os.environ or "JPY_SESSION_NAME" in os.environ


class Explorer:
    """The live explorer's state and controls: ``image``, ``layer`` and ``capacity`` (and ``slot``
    for Soft MoE) are ipywidgets; moving one re-runs :func:`routing_view` (``view`` holds the
    latest) and redraws into ``output``. Changing ``.value`` from Python does the same, which is
    how the tests drive it."""

    def __init__(self, model, images, *, capacities=(0.5, 1.0, 2.0), accuracy: float | None = None):
        widgets = _widgets()

        self.model, self.images, self.accuracy = model, np.asarray(images), accuracy
        moe = [block for block in model.blocks if block.use_moe]
        if not moe:
            raise InputError("explore needs a model with MoE layers; this one is dense (router=None).")
        self.soft = moe[0].mlp.router.per_image
        group = 1 if self.soft else model.cfg.group_images
        usable = len(self.images) - len(self.images) % group  # images in complete routing groups
        if usable == 0:
            raise InputError(f"images must hold at least one routing group ({group} images), got {len(self.images)}.")
        self.image = widgets.IntSlider(0, 0, usable - 1, description="image")
        self.layer = widgets.IntSlider(0, 0, len(moe) - 1, description="MoE layer")
        self.capacity = widgets.SelectionSlider(options=[float(c) for c in capacities],
                                                value=float(capacities[len(capacities) // 2]),
                                                description="capacity", disabled=self.soft)
        self.slot = widgets.IntSlider(-1, -1, 0, description="slot (-1: off)", disabled=not self.soft)
        self.output = widgets.Output()
        for control in (self.image, self.layer, self.capacity, self.slot):
            control.observe(self._changed, names="value")
        self.view = None
        self.redraws = 0
        self._changed()

    def _changed(self, change=None) -> None:
        import matplotlib.pyplot as plt

        self.view = routing_view(self.model, self.images, image=self.image.value, layer=self.layer.value,
                                 capacity_factor=None if self.soft else self.capacity.value)
        if self.soft:  # the slots of every expert, numbered e * S + s
            self.slot.max = self.view["num_experts"] * self.view["slots"].shape[-1] - 1
        slot = None if self.slot.value < 0 or not self.soft else divmod(self.slot.value, self.view["slots"].shape[-1])
        with self.output:
            self.output.clear_output(wait=True)
            fig = draw_view(self.view, self.images[self.image.value], slot=slot,
                            title=None if self.accuracy is None else f"test accuracy {self.accuracy:.1%}")
            plt.show()
            plt.close(fig)
        self.redraws += 1

    def widget(self):
        widgets = _widgets()
        return widgets.VBox([widgets.HBox([self.image, self.layer]), widgets.HBox([self.capacity, self.slot]),
                             self.output])


def explore(model, images, *, capacities=(0.5, 1.0, 2.0), image: int = 0, layer: int = 0,
            accuracy: float | None = None, interactive: bool | None = None):
    """The routing explorer for ``model`` on ``images``: live controls where a widget frontend is
    attached (:func:`widget_frontend`; ``interactive`` overrides it), else a static figure of image
    ``image`` in MoE layer ``layer`` at every factor of ``capacities`` (Soft MoE: once, it has no
    capacity). Returns the :class:`Explorer` (displayed) or the figure."""
    import matplotlib.pyplot as plt

    if interactive is None:
        interactive = widget_frontend()
    if interactive:
        explorer = Explorer(model, images, capacities=capacities, accuracy=accuracy)
        try:
            from IPython.display import display
        except ImportError:  # ipywidgets brings IPython; without it there is nothing to show the widget in
            return explorer
        display(explorer.widget())
        return explorer
    moe = [block for block in model.blocks if block.use_moe]
    if not moe:
        raise InputError("explore needs a model with MoE layers; this one is dense (router=None).")
    factors = [None] if moe[0].mlp.router.per_image else list(capacities)
    fig, axes = plt.subplots(2, len(factors), figsize=(3.4 * len(factors), 6.2), squeeze=False)
    for column, factor in enumerate(factors):
        view = routing_view(model, images, image=image, layer=layer, capacity_factor=factor)
        draw_view(view, np.asarray(images)[image], axes=(axes[0, column], axes[1, column]),
                  title="patches by expert" + ("" if factor is None else f", c = {factor:g}"))
    fig.suptitle(f"image {image}, MoE layer {layer + 1}" + ("" if accuracy is None else
                                                             f" (test accuracy {accuracy:.1%})"), fontsize=10)
    fig.tight_layout()
    return fig
