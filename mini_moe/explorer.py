"""See the routing of a trained model, image by image (issue 38): :func:`routing_view` computes
what one image's patches do in one MoE layer at a chosen capacity factor, :func:`draw_view` draws
it, and :func:`explore` puts both behind controls (ipywidgets) that re-run the router when moved.

Where no widget frontend is attached (nbval, the HTML build of the book, a script),
:func:`explore` draws a static figure instead: the image at every capacity factor of the list.

    from mini_moe.explorer import explore
    explore(model, test_images)          # in Jupyter, JupyterLab, VS Code or Colab

The online book has no kernel, so its explorer is precomputed: :func:`export` runs
:func:`routing_view` for every model, image, MoE layer and capacity factor, and :func:`page_html`
wraps that JSON with a small script (``mini_moe/explorer.js``, plain JavaScript, no server and no
network) that draws the same picture in the browser. :func:`save_weights` and :func:`load_weights`
keep a trained model in one small file (float16 weights).
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

import numpy as np

from mini_moe import evaluate, modes
from mini_moe.validate import InputError, moved_names

#: Okabe and Ito's colour-blind-safe palette, without its black (which marks dropped patches).
PALETTE = ("#E69F00", "#56B4E9", "#009E73", "#F0E442", "#0072B2", "#D55E00", "#CC79A7", "#999999")


def routing_view(model, images: np.ndarray, *, image: int = 0, layer: int = 0,
                 capacity_factor: float | None = None) -> dict:
    """What the explorer draws: image ``image`` of ``images [N, H, W, C]`` in MoE layer ``layer``
    (0 = the first MoE layer), routed in eval mode with its routing group (the images of the
    model's ``group_images`` that hold it; Soft MoE routes it alone) at ``capacity_factor``
    (None: the trained one; ignored where :func:`~mini_moe.modes.has_capacity` is False: Soft MoE, the dropless path).

    Returns a dict of NumPy arrays and numbers, P patches of a ``side x side`` grid, E experts:
      ``expert [side, side]`` the expert with the largest combine weight of each patch, -1 where the
      patch reached no expert (dropped); ``weight [side, side]`` that combine weight;
      ``experts_per_patch [side, side]``; ``load [E]`` the tokens of the whole routing group each
      expert processes, against ``capacity`` (slots per expert); ``dropped_share`` (the tokens that
      reached no expert) and ``experts_per_token`` over the group; ``slots [P, E, S]`` (Soft MoE
      only, else None): the image's dispatch weights, slot s of expert e mixes the patches with
      weights ``slots[:, e, s]``; ``capacity_factor`` (None without a capacity: Soft MoE, the
      dropless path), ``num_experts``, ``side``.

    With null experts in the router's choice set (``TokenChoice(null_experts=Z)``: AdaMoE,
    LongCat) the experts are the E real ones, so ``experts_per_patch`` counts a patch's real
    experts and ``experts_per_token`` is the group's mean of that count; a patch whose k picks
    were all null experts has none without being dropped: ``null_only [side, side]`` marks those
    (its ``expert`` is -1 too) and ``null_share`` is their share of the group; both are None
    without null experts.
    """
    moe_layers = modes.moe_layers(model)
    if not 0 <= layer < len(moe_layers):
        raise InputError(f"layer must be in 0..{len(moe_layers) - 1} (the model's MoE layers), got {layer!r}.")
    images = np.asarray(images)
    if not 0 <= image < len(images):
        raise InputError(f"image must be in 0..{len(images) - 1}, got {image!r}.")
    group = modes.group_images(model)
    start = image - image % group
    batch = images[start:start + group]
    if len(batch) < group:
        raise InputError(f"image {image} has no complete routing group of {group} images in `images`; "
                         f"pass at least {start + group} images.")
    routings, factor = _route(model, batch, capacity_factor)
    return _view(*routings[layer], group=0, index=image - start, patches=model.cfg.num_patches, factor=factor,
                 soft=moe_layers[layer].router.per_image)


def offered_capacities(model, capacities) -> list[float] | list[None]:
    """The factors the explorer offers for ``model``: ``capacities`` and the trained one, sorted
    (``[None]`` without a capacity); it opens at the trained one."""
    trained = modes.trained_capacity(model)
    return [None] if trained is None else sorted({float(c) for c in capacities} | {trained})


def _route(model, batch, capacity_factor):
    """One eval-mode forward of ``batch`` (whole routing groups) at ``capacity_factor`` (ignored
    without :func:`~mini_moe.modes.has_capacity`): per MoE layer ``(dispatch, combine, picks)``, the
    first two as NumPy ``[G, T, E, C]``, ``picks [G, T]`` each token's real picks before any capacity
    as the router reports them (None without null experts), and the factor used (None without a
    capacity)."""
    batch = np.asarray(batch)
    factor = capacity_factor if modes.has_capacity(model) else None
    with modes.capacity(model, factor):
        (out, _), = evaluate.forward_batches(model, batch, batch_size=len(batch), routing=True)
    factor = modes.trained_capacity(model) if factor is None else float(factor)
    layers = []
    for mlp, rt, picks in zip(modes.moe_layers(model), out.routings, out.picks):
        dispatch = np.asarray(rt.dispatch)
        real = None
        if mlp.router.allocation.null_experts:  # real picks per token; a token whose picks were all null has none
            real = np.asarray(picks[..., :dispatch.shape[2]]).sum(-1).reshape(dispatch.shape[:2])
        layers.append((dispatch, np.asarray(rt.combine), real))
    return layers, factor


def _view(dispatch, combine, picks, *, group: int, index: int, patches: int, factor, soft: bool) -> dict:
    """:func:`routing_view`'s dict for image ``index`` of routing group ``group`` of one layer's
    ``dispatch, combine [G, T, E, C]`` and real ``picks [G, T]`` (None without null experts)."""
    dispatch, combine = dispatch[group], combine[group]  # [T, E, C]
    null = None if picks is None else picks[group] == 0  # [T]: every pick a null expert
    rows = slice(index * patches, (index + 1) * patches)
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
        "null_only": None if null is None else null[rows].reshape(side, side),
        "null_share": None if null is None else float(null.mean()),
    }


def batch_views(model, images, capacity_factor) -> list[list[dict]]:
    """:func:`routing_view` of every image of ``images`` (whole routing groups) in every MoE layer,
    from one forward pass of the whole batch at ``capacity_factor``: ``[layer][image]``. What the
    online explorer stores (:func:`export`) and what its browser check recomputes."""
    group = modes.group_images(model)
    images = np.asarray(images)
    if len(images) % group:
        raise InputError(f"images must hold whole routing groups of {group} images, got {len(images)}.")
    soft = modes.moe_layers(model)[0].router.per_image
    routings, factor = _route(model, images, capacity_factor)
    return [[_view(*layer, group=i // group, index=i % group, patches=model.cfg.num_patches, factor=factor,
                   soft=soft) for i in range(len(images))] for layer in routings]


def _colour(expert: int) -> str:
    return PALETTE[expert % len(PALETTE)]


def _patches_title(view: dict) -> str:
    """What the left panel of :func:`draw_view` shows: the expert per patch, or with null experts
    the count of real experts per patch."""
    return "patches by expert" if view["null_only"] is None else "real experts per patch"


def draw_view(view: dict, image: np.ndarray | None = None, *, axes=None, title: str = "", slot: tuple | None = None):
    """Draw a :func:`routing_view`: the patches coloured by their expert (opacity: the combine
    weight; black with a cross: dropped), and each expert's load against its capacity. With
    ``slot = (e, s)`` (Soft MoE) the left panel shows slot s of expert e's mixing weight per patch
    instead. With null experts (``view["null_only"]``) each patch shows its count of real experts,
    coloured from pale (0: null experts only, not dropped) to dark (all E), and the numbers give the
    group's mean count and the share of null-only patches. ``image [H, W, C]`` is drawn under the
    patches in grey. Returns the figure."""
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
        null = view["null_only"]
        for r in range(side):
            for c in range(side):
                e = int(view["expert"][r, c])
                if e < 0 and (null is None or not null[r, c]):
                    left.add_patch(Rectangle((c, r), 1, 1, color="black", alpha=0.8))
                    left.plot([c + 0.15, c + 0.85], [r + 0.15, r + 0.85], color="white", lw=1)
                    left.plot([c + 0.15, c + 0.85], [r + 0.85, r + 0.15], color="white", lw=1)
                elif null is not None:  # the count of real experts, whatever they are
                    count = int(view["experts_per_patch"][r, c])
                    shade = count / view["num_experts"]
                    left.add_patch(Rectangle((c, r), 1, 1, color=plt.get_cmap("YlGnBu")(shade), alpha=0.85))
                    left.text(c + 0.5, r + 0.5, str(count), ha="center", va="center", fontsize=9,
                              color="white" if shade > 0.5 else "black")
                else:
                    alpha = 0.25 + 0.75 * float(np.clip(view["weight"][r, c], 0, 1))
                    left.add_patch(Rectangle((c, r), 1, 1, color=_colour(e), alpha=alpha))
                    left.text(c + 0.5, r + 0.5, str(e), ha="center", va="center", fontsize=7)
        left.set_title(title or _patches_title(view) + (" (black: dropped)" if null is None else
                                                         " (0: null experts only; black: dropped)"), fontsize=9)
    left.set_xlim(0, side)
    left.set_ylim(side, 0)
    left.set_xticks([])
    left.set_yticks([])
    experts = np.arange(view["num_experts"])
    right.bar(experts, view["load"], color=[_colour(int(e)) for e in experts])
    if view["capacity_factor"] is not None:
        right.axhline(view["capacity"], color="black", ls="--", lw=0.8, label=f"capacity C = {view['capacity']}")
        right.legend(fontsize=7, loc="upper right")
    right.set_xlabel("expert" if view["null_share"] is None else "real expert")
    right.set_ylabel("tokens of the group")
    factor = "" if view["capacity_factor"] is None else f"c = {view['capacity_factor']:g}, "
    if view["null_share"] is None:
        numbers = f"dropped {view['dropped_share']:.0%}, {view['experts_per_token']:.2f} experts/token"
    else:  # a patch with no real expert that picked one was dropped
        dropped = view["dropped_share"] - view["null_share"]
        numbers = (f"{view['experts_per_token']:.2f} real experts/patch, null only {view['null_share']:.0%}"
                   + (f", dropped {dropped:.0%}" if dropped > 0 else ""))
    right.set_title(factor + numbers, fontsize=9)
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
        moe = modes.moe_layers(model)  # refuses a dense model
        self.soft = moe[0].router.per_image
        group = modes.group_images(model)
        usable = len(self.images) - len(self.images) % group  # images in complete routing groups
        if usable == 0:
            raise InputError(f"images must hold at least one routing group ({group} images), got {len(self.images)}.")
        self.image = widgets.IntSlider(0, 0, usable - 1, description="image")
        self.layer = widgets.IntSlider(0, 0, len(moe) - 1, description="MoE layer")
        factors = offered_capacities(model, capacities)
        self.capacity = widgets.SelectionSlider(options=factors if factors != [None] else [float(capacities[0])],
                                                value=modes.trained_capacity(model) or float(capacities[0]),
                                                description="capacity", disabled=not modes.has_capacity(model))
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
    modes.moe_layers(model)  # refuses a dense model
    factors = list(capacities) if modes.has_capacity(model) else [None]
    fig, axes = plt.subplots(2, len(factors), figsize=(3.4 * len(factors), 6.2), squeeze=False)
    for column, factor in enumerate(factors):
        view = routing_view(model, images, image=image, layer=layer, capacity_factor=factor)
        draw_view(view, np.asarray(images)[image], axes=(axes[0, column], axes[1, column]),
                  title=_patches_title(view) + ("" if factor is None else f", c = {factor:g}"))
    fig.suptitle(f"image {image}, MoE layer {layer + 1}" + ("" if accuracy is None else
                                                             f" (test accuracy {accuracy:.1%})"), fontsize=10)
    fig.tight_layout()
    return fig


# --- the precomputed explorer of the online book -------------------------------------------------

#: Arrays with at least this many elements are stored in float16 by :func:`save_weights`; smaller
#: ones (biases, norms, the loss-free bias) keep float32.
HALF_FROM = 4096


def save_weights(model, cfg, path, *, label: str = "", accuracy: float | None = None,
                 origin: str | None = None) -> pathlib.Path:
    """Write ``model``'s state (parameters and non-trainable state such as the loss-free bias; not
    its random-number state) and its :class:`~mini_moe.config.TrainConfig` ``cfg`` to ``path``
    (.npz, compressed). Large arrays are stored in float16 (:data:`HALF_FROM`): about 0.45 MB for
    chapter 8's model. ``label`` is the name the explorer shows and ``accuracy`` the test accuracy
    to show beside it, which must be measured on the model that :func:`load_weights` returns from
    this file (the stored values, not the float32 ones; mini_moe/results/explorer_models.py does).
    ``origin`` says which run trained it."""
    import jax
    from flax import nnx

    from mini_moe import train

    if cfg.model != model.cfg:
        raise InputError("save_weights: cfg.model must be the model's own configuration (model.cfg).")
    state = nnx.state(model, nnx.Not(nnx.RngState))
    arrays = {}
    for key, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        value = np.asarray(leaf)
        if np.issubdtype(value.dtype, np.floating):
            value = value.astype(np.float16 if value.size >= HALF_FROM else np.float32)
        arrays["state" + jax.tree_util.keystr(key)] = value
    meta = {"config": train.config_to_json(cfg), "label": label, "accuracy": accuracy, "origin": origin}
    path = pathlib.Path(path)
    np.savez_compressed(path, __meta__=np.array(json.dumps(meta)), **arrays)
    return path


def load_weights(path):
    """The model (eval mode, float32) and :class:`~mini_moe.config.TrainConfig` stored by
    :func:`save_weights`, and ``info = {"label", "accuracy", "origin"}``: ``(model, cfg, info)``."""
    import jax
    from flax import nnx

    from mini_moe import runs, train

    path = pathlib.Path(path)
    if not path.is_file():
        raise InputError(f"No explorer weights at {path}; make them with mini_moe/results/explorer_models.py.")
    with np.load(path) as stored:
        meta = json.loads(str(stored["__meta__"]))
        cfg = runs.config_from_json(meta["config"])
        model = train.make_model(cfg)
        state = nnx.state(model, nnx.Not(nnx.RngState))
        leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
        values = []
        for key, leaf in leaves:
            name = "state" + jax.tree_util.keystr(key)
            if name not in stored.files:
                raise InputError(f"{path} has no {name}: it was saved from another model.")
            values.append(np.asarray(stored[name]).astype(np.asarray(leaf).dtype))
    nnx.update(model, jax.tree_util.tree_unflatten(treedef, values))
    model.eval()
    return model, cfg, {key: meta.get(key) for key in ("label", "accuracy", "origin")}


def _percent(values) -> list[int]:
    """Weights in [0, 1] as whole percents (the page's compact form)."""
    return np.rint(100 * np.clip(np.asarray(values, np.float64), 0, 1)).astype(int).ravel().tolist()


def export(models: dict, images: dict, *, capacities=(0.5, 1.0, 2.0), image_sources: dict | None = None) -> dict:
    """The online explorer's data: every model's :func:`routing_view` for every image, MoE layer and
    capacity factor, as plain JSON (weights in whole percents, images as base64 bytes).

    Args:
      models: name -> ``{"model", "dataset", "label", "accuracy", "source"}`` (``accuracy``: the
        model's test accuracy, shown beside its routing; ``source``: where the model comes from, any
        JSON, kept for a reader and for the browser check, which re-computes views from it).
      images: dataset name -> ``float [N, H, W, 1]`` images as the models see them (standardised
        like their training data, ``train.load_data``), whole routing groups; every model routes
        its dataset's images, one forward per capacity factor. They are drawn rescaled to [0, 1]
        per image.
      capacities: the factors offered, with each model's trained one added; a model without a
        capacity (:func:`~mini_moe.modes.has_capacity`) has one
        view per layer and image, under the key ``"none"``.
      image_sources: dataset name -> where its images come from (any JSON), kept like ``source``.

    Returns ``{"datasets": {name: {"images", "size", "source"}}, "models": {name: {"label", "dataset",
    "accuracy", "num_experts", "null_experts", "side", "slots_per_expert", "layers", "capacities",
    "trained_capacity", "capacity", "views", "source"}}}`` where ``capacities`` are
    :func:`offered_capacities` (the explorer opens at ``trained_capacity``), ``null_experts`` is Z
    (0 without; ``num_experts`` counts the real ones) and
    ``views[factor][layer][image]`` holds ``expert``, ``weight``, ``experts`` (per patch, row-major),
    ``load``, ``capacity``, ``dropped`` and ``experts_per_token``, for Soft MoE ``slots`` (the
    image's dispatch weights, ``[P, E, S]`` flattened), and with null experts ``null_only`` (per
    patch, 1 where every pick was a null expert: no real expert, not dropped) and ``null_share``.
    """
    import base64

    out = {"datasets": {}, "models": {}}
    for name, batch in images.items():
        batch = np.asarray(batch)
        if batch.ndim != 4 or batch.shape[-1] != 1:
            raise InputError(f"images[{name!r}] must be [N, H, W, 1] grey images, got shape {batch.shape}.")
        low = batch.min(axis=(1, 2, 3), keepdims=True)
        span = np.maximum(batch.max(axis=(1, 2, 3), keepdims=True) - low, 1e-12)
        pixels = np.rint(255 * (batch - low) / span)[..., 0].astype(np.uint8)
        out["datasets"][name] = {"images": [base64.b64encode(p.tobytes()).decode() for p in pixels],
                                 "size": int(batch.shape[1]), "source": (image_sources or {}).get(name)}
    for name, entry in models.items():
        model, dataset = entry["model"], entry["dataset"]
        if dataset not in images:
            raise InputError(f"models[{name!r}] routes dataset {dataset!r}, which `images` lacks.")
        batch = np.asarray(images[dataset])
        group = modes.group_images(model)
        if len(batch) % group:
            raise InputError(f"images[{dataset!r}] must hold whole routing groups of {group} images for "
                             f"{name!r}, got {len(batch)}.")
        layers = modes.moe_layers(model)
        soft = layers[0].router.per_image
        factors = offered_capacities(model, capacities)
        views, capacity_of = {}, {}
        for factor in factors:
            key = "none" if factor is None else f"{factor:g}"
            views[key] = []
            for layer_views in batch_views(model, batch, factor):
                per_image = []
                for v in layer_views:
                    compact = {"expert": v["expert"].ravel().tolist(), "weight": _percent(v["weight"]),
                               "experts": v["experts_per_patch"].ravel().tolist(), "load": v["load"].tolist(),
                               "dropped": round(v["dropped_share"], 4),
                               "experts_per_token": round(v["experts_per_token"], 4)}
                    if soft:
                        compact["slots"] = _percent(v["slots"])
                    if v["null_only"] is not None:
                        compact["null_only"] = v["null_only"].astype(int).ravel().tolist()
                        compact["null_share"] = round(v["null_share"], 4)
                    per_image.append(compact)
                views[key].append(per_image)
                capacity_of[key] = int(layer_views[0]["capacity"])
        first = views[next(iter(views))][0][0]
        out["models"][name] = {
            "label": entry.get("label", name), "dataset": dataset, "accuracy": entry.get("accuracy"),
            "num_experts": len(first["load"]), "null_experts": len(model.cfg.null_experts),
            "side": int(round(np.sqrt(model.cfg.num_patches))),
            "slots_per_expert": capacity_of[next(iter(views))] if soft else None,
            "layers": len(layers), "capacities": factors, "trained_capacity": modes.trained_capacity(model),
            "capacity": capacity_of if factors[0] is not None else None, "views": views,
            "source": entry.get("source"),
        }
    return out


_ids = iter(range(1, 1 << 30))


def page_html(data: dict, *, title: str = "") -> str:
    """HTML that draws :func:`export`'s ``data`` in a browser: the data as JSON and the explorer's
    script (``mini_moe/explorer.js``, plain JavaScript) inline, so the page works offline and from
    a file. Show it in a notebook with ``IPython.display.HTML(page_html(data))``. Where a model has
    null experts, a note under the explorer says how to read its patches (:func:`null_note`)."""
    import html as html_lib

    script = (pathlib.Path(__file__).with_name("explorer.js")).read_text()
    payload = json.dumps(data, separators=(",", ":")).replace("</", "<\\/")
    element = f"mini-moe-explorer-{os.getpid()}-{next(_ids)}"
    heading = f'<p class="mme-title">{html_lib.escape(title)}</p>' if title else ""
    notes = "".join(f'<p class="mme-note">{html_lib.escape(null_note(m))}</p>'
                    for m in data.get("models", {}).values() if m.get("null_experts"))
    return (f'<div class="mini-moe-explorer" id="{element}">{heading}'
            f'<script type="application/json" class="mme-data">{payload}</script></div>\n{notes}'
            f"<script>{script}</script>")


def null_note(m: dict) -> str:
    """How to read the patches of :func:`export`'s model ``m``, which has null experts: what its
    numbers and black patches mean, with its mean real experts per patch over the stored images
    per MoE layer (at the factor it opens at)."""
    views = m["views"]["none" if m["trained_capacity"] is None else f"{m['trained_capacity']:g}"]
    means = ", ".join(f"{np.mean([v['experts'] for v in layer]):.2f}" for layer in views)
    dropped = ("" if m["capacities"] == [None] else
               " A black patch with a cross had its real picks dropped for capacity.")
    return (f"{m['label']}. Each patch shows how many of the {m['num_experts']} real experts it reached (its "
            f"{m['null_experts']} null experts take no slot and compute nothing): 0, the palest, means null experts "
            f"only, not dropped.{dropped} Real experts per patch over these images, by MoE layer: {means}.")


#: The committed models of the book's explorer page (mini_moe/results/explorer_models.py).
WEIGHTS = pathlib.Path(__file__).resolve().parent / "results" / "explorer-models"


def load_source(source: dict, *, base=None):
    """``(model, cfg, info)`` of an explorer ``source``: ``{"weights": NAME.npz}`` in
    :data:`WEIGHTS` (:func:`load_weights`), or ``{"run": FOLDER}``, a training run's folder (its
    newest checkpoint; ``info`` is then empty), relative to ``base`` (default: the current folder;
    a chapter's runs are relative to ``book/``)."""
    from mini_moe import train

    if "weights" in source:
        return load_weights(WEIGHTS / source["weights"])
    if "run" in source:
        model, cfg = train.load_trained(pathlib.Path(base or ".") / source["run"])
        return model, cfg, {"label": None, "accuracy": None, "origin": str(source["run"])}
    raise InputError(f"source must name 'weights' or 'run', got {source!r}.")


def test_images(cfg, count: int) -> np.ndarray:
    """The first ``count`` test images of ``cfg.dataset``, standardised as the model saw its
    training data (``train.load_data``)."""
    from mini_moe import train

    return np.asarray(train.load_data(cfg)[1].images[:count])


def book_data(*, count: int = 24, names=None, capacities=(0.5, 1.0, 2.0)) -> dict:
    """:func:`export` of the committed models (:data:`WEIGHTS`; ``names``: some of them, default
    all) on the first ``count`` test images of their datasets: the online explorer's data."""
    files = sorted(WEIGHTS.glob("*.npz"))
    if names is not None:
        wanted = {f"{n}.npz" for n in names}
        missing = wanted - {f.name for f in files}
        if missing:
            raise InputError(f"no committed explorer model(s) {sorted(missing)} in {WEIGHTS}.")
        files = [f for f in files if f.name in wanted]
    models, images = {}, {}
    for file in files:
        source = {"weights": file.name}
        model, cfg, info = load_source(source)
        if cfg.dataset not in images:
            images[cfg.dataset] = test_images(cfg, count)
        models[file.stem] = {"model": model, "dataset": cfg.dataset, "label": info["label"],
                             "accuracy": info["accuracy"], "source": source | {"origin": info["origin"]}}
    first = {"split": "test", "first": count}
    return export(models, images, capacities=capacities, image_sources={d: first for d in images})


# Moved after 0.4.0 (issue 64); the old names warn for one release.
__getattr__ = moved_names(__name__, {"capacity": "mini_moe.modes:capacity",
                                     "has_capacity": "mini_moe.modes:has_capacity",
                                     "trained_capacity": "mini_moe.modes:trained_capacity"})
