"""The routing explorer (issue 38 §2): what it computes equals the library's own routing, capacity
changes what it should, the widget's callback re-routes on every control, and it falls back to a
static figure without a widget frontend."""

import html

import matplotlib

matplotlib.use("Agg")

import numpy as np
import pytest

from mini_moe import config as config_lib
from mini_moe import evaluate, explorer, modes, train


@pytest.fixture(scope="module")
def images():
    return np.random.default_rng(0).uniform(size=(16, 8, 8, 1)).astype(np.float32)


def _model(router, **options):
    cfg = config_lib.get_config("quick", dataset="digits", router=router, model_router_kwargs=options)
    return train.make_model(cfg)


def test_the_view_is_the_librarys_routing_and_capacity_acts(images):
    model = _model("softmax_token_choice", k=1, capacity_factor=1.0)
    group = model.cfg.group_images
    maps = evaluate.expert_maps(model, images[:group])  # [L, B, side, side], -1 where dropped
    view = explorer.routing_view(model, images, image=1, layer=0)
    np.testing.assert_array_equal(view["expert"], maps[0, 1])
    assert view["capacity_factor"] == 1.0
    # the group's load: every processed token counted once per expert that holds it
    T = group * model.cfg.num_patches
    assert view["load"].sum() == round(view["experts_per_token"] * T)
    views = {c: explorer.routing_view(model, images, image=1, layer=0, capacity_factor=c) for c in (0.5, 2.0)}
    for c, v in views.items():
        assert v["capacity_factor"] == c and np.all(v["load"] <= v["capacity"])
    assert views[0.5]["capacity"] < views[2.0]["capacity"]
    assert views[0.5]["dropped_share"] >= views[2.0]["dropped_share"]
    assert views[0.5]["dropped_share"] > 0  # half the slots cannot hold every token
    assert model.blocks[[b.use_moe for b in model.blocks].index(True)].mlp.router.capacity_factor == 1.0  # restored
    with pytest.raises(ValueError, match="layer must be in 0.."):
        explorer.routing_view(model, images, layer=9)
    with pytest.raises(ValueError, match="capacity_factor must be > 0"):
        explorer.routing_view(model, images, capacity_factor=0.0)


def test_soft_moe_views_show_each_slots_mixing_weights(images):
    model = _model("soft_moe")
    view = explorer.routing_view(model, images, image=3, layer=0)
    patches, experts, slots = view["slots"].shape
    assert patches == view["side"] ** 2 and experts == view["num_experts"]
    np.testing.assert_allclose(view["slots"].sum(0), 1.0, rtol=1e-5)  # each slot is a convex mix of the image's patches
    assert view["capacity_factor"] is None and view["dropped_share"] == 0.0


def test_the_widget_reroutes_on_every_control_and_the_static_figure_without_a_frontend(images, monkeypatch):
    model = _model("softmax_expert_choice", capacity_factor=1.0)
    live = explorer.explore(model, images, interactive=True)
    assert isinstance(live, explorer.Explorer) and live.redraws == 1
    live.capacity.value = 2.0
    assert live.redraws == 2 and live.view["capacity_factor"] == 2.0
    live.image.value = 5
    assert live.redraws == 3
    np.testing.assert_array_equal(live.view["expert"], explorer.routing_view(model, images, image=5,
                                                                             capacity_factor=2.0)["expert"])
    live.layer.value = 1
    assert live.redraws == 4
    np.testing.assert_array_equal(live.view["expert"], explorer.routing_view(model, images, image=5, layer=1,
                                                                             capacity_factor=2.0)["expert"])
    group = model.cfg.group_images
    partial = explorer.Explorer(model, images[:group + 1])  # the last image has no complete group
    assert partial.image.max == group - 1
    monkeypatch.setenv("MINI_MOE_STATIC", "1")
    assert not explorer.widget_frontend()
    fig = explorer.explore(model, images, capacities=(0.5, 1.0, 2.0))
    assert len(fig.axes) == 6
    with pytest.raises(ValueError, match="dense"):
        explorer.explore(_model(None), images, interactive=False)


def test_weights_round_trip_in_float16_keeps_the_loss_free_bias_and_says_what_is_wrong(images, tmp_path):
    cfg = config_lib.get_config("quick", dataset="digits", router="sigmoid_loss_free",
                                model_router_kwargs={"k": 2, "capacity_factor": 2.0})
    model = train.make_model(cfg)
    routers = [b.mlp.router.affinity for b in model.blocks if b.use_moe]
    for r in routers:  # a trained bias: selection depends on it, so it must survive the file
        r.bias[...] = np.linspace(-2.0, 1.5, r.bias[...].shape[-1]).astype(np.float32)
    path = explorer.save_weights(model, cfg, tmp_path / "m.npz", label="loss-free", accuracy=0.5, origin="a test")
    loaded, loaded_cfg, info = explorer.load_weights(path)
    assert loaded_cfg == cfg and info == {"label": "loss-free", "accuracy": 0.5, "origin": "a test"}
    for a, b in zip(routers, [b.mlp.router.affinity for b in loaded.blocks if b.use_moe]):
        np.testing.assert_array_equal(np.asarray(a.bias[...]), np.asarray(b.bias[...]))  # small arrays stay float32
    big = next(b for b in model.blocks if b.use_moe).mlp.experts.w1
    loaded_big = next(b for b in loaded.blocks if b.use_moe).mlp.experts.w1
    assert big[...].size >= explorer.HALF_FROM
    np.testing.assert_array_equal(np.asarray(loaded_big[...]), np.asarray(big[...]).astype(np.float16).astype(np.float32))
    # the stored model routes like the original up to float16 rounding of its weights
    before = explorer.routing_view(model, images, image=2, layer=0)
    after = explorer.routing_view(loaded, images, image=2, layer=0)
    assert (before["expert"] == after["expert"]).mean() >= 0.9
    with pytest.raises(ValueError, match="No explorer weights"):
        explorer.load_weights(tmp_path / "missing.npz")
    with pytest.raises(ValueError, match="cfg.model must be the model's own"):
        explorer.save_weights(_model("softmax_token_choice"), cfg, tmp_path / "x.npz")


def test_the_export_holds_every_view_the_library_computes(images):
    tc = _model("softmax_token_choice", k=1, capacity_factor=1.0)
    soft = _model("soft_moe")
    cfg = config_lib.get_config("quick", dataset="digits", router="softmax_token_choice", model_moe_path="dropless")
    dropless = train.make_model(cfg)
    data = explorer.export({"tc": {"model": tc, "dataset": "d", "label": "TC", "accuracy": 0.25, "source": {"x": 1}},
                            "soft": {"model": soft, "dataset": "d"}, "dropless": {"model": dropless, "dataset": "d"}},
                           {"d": images}, image_sources={"d": {"first": 16}})
    assert len(data["datasets"]["d"]["images"]) == len(images) and data["datasets"]["d"]["source"] == {"first": 16}
    m = data["models"]["tc"]
    assert m["capacities"] == [0.5, 1.0, 2.0] and m["accuracy"] == 0.25 and m["source"] == {"x": 1}
    assert m["trained_capacity"] == 1.0 and data["models"]["soft"]["trained_capacity"] is None
    assert data["models"]["soft"]["capacities"] == [None] and data["models"]["dropless"]["capacities"] == [None]
    assert data["models"]["soft"]["slots_per_expert"] >= 1 and m["slots_per_expert"] is None
    for layer in range(m["layers"]):
        for image in (0, 9, 15):
            for factor in (0.5, 2.0):
                view = explorer.routing_view(tc, images, image=image, layer=layer, capacity_factor=factor)
                stored = m["views"][f"{factor:g}"][layer][image]
                assert stored["expert"] == view["expert"].ravel().tolist()
                assert stored["load"] == view["load"].tolist() and stored["dropped"] == round(view["dropped_share"], 4)
                np.testing.assert_allclose(stored["weight"], 100 * view["weight"].ravel(), atol=0.5)
            assert m["capacity"][f"{factor:g}"] == view["capacity"]
    view = explorer.routing_view(soft, images, image=4, layer=0)
    np.testing.assert_allclose(data["models"]["soft"]["views"]["none"][0][4]["slots"], 100 * view["slots"].ravel(), atol=0.5)
    nothing_dropped = data["models"]["dropless"]["views"]["none"][0]
    assert all(v["dropped"] == 0 and -1 not in v["expert"] for v in nothing_dropped)
    with pytest.raises(ValueError, match="whole routing groups"):
        explorer.export({"tc": {"model": tc, "dataset": "d"}}, {"d": images[:5]})
    with pytest.raises(ValueError, match="which `images` lacks"):
        explorer.export({"tc": {"model": tc, "dataset": "e"}}, {"d": images})


def _null_model(router, *, path="auto", **options):
    cfg = config_lib.get_config("quick", dataset="digits", router=router, model_null_experts=("zero",) * 4,
                                model_moe_path=path, model_router_kwargs=options)
    return train.make_model(cfg)


def _null_picks(model, images, layer):
    """``int [B, P]``: the null experts each patch picked in MoE layer ``layer``, from the router's
    own ``null_gates`` on the layer's input, computed here block by block (eager, eval mode)."""
    from mini_moe.model import patchify

    cfg = model.cfg
    with modes.eval_mode(model):
        x = model.embed(patchify(np.asarray(images), cfg.patch_size)) + model.pos[...]
        moe = [b for b in model.blocks if b.use_moe]
        for block in model.blocks:
            if block is moe[layer]:
                h = block.norm2(x + block.attn(block.norm1(x)))
                b, n, d = h.shape
                out = block.mlp.router(h.reshape(b // cfg.group_images, cfg.group_images * n, d))
                return np.asarray((out.null_gates > 0).sum(-1)).reshape(b, n)
            x, _ = block(x)


def test_null_experts_count_real_experts_per_patch_and_are_not_dropped(images):
    """Issue 54 §3: with null experts in the choice set (LongCat, dropless) a patch's count is its
    real experts, k minus the null experts its router picked; a patch whose picks are all null
    experts is null-only, not dropped, in the view, the export and the page."""
    k = 2
    model = _null_model("longcat", path="dropless", k=k, target_real=1.0)
    group = model.cfg.group_images

    def real_bias(value):  # LongCat's selection bias of every real expert (its null experts keep 0)
        for block in model.blocks:
            if block.use_moe:
                bias = block.mlp.router.affinity.bias
                bias[...] = np.where(np.arange(bias[...].shape[-1]) < model.cfg.routed_experts, value, 0.0)

    real_bias(-0.03)  # as the controller does to cut the real experts: some patches pick null experts only
    shares = []
    for layer, views in enumerate(explorer.batch_views(model, images, None)):  # routing_view of every image
        null = _null_picks(model, images, layer)  # [B, P]
        for i, v in enumerate(views):
            np.testing.assert_array_equal(v["experts_per_patch"].ravel(), k - null[i])
            np.testing.assert_array_equal(v["null_only"].ravel(), null[i] == k)
            np.testing.assert_array_equal(v["expert"].ravel() < 0, null[i] == k)  # nothing dropped
            first = i - i % group
            assert v["null_share"] == float((null[first:first + group] == k).mean())
            assert np.isclose(v["experts_per_token"], (k - null[first:first + group]).mean())
        shares += [v["null_share"] for v in views]
    assert 0 < np.mean(shares) < 1  # some patches null-only, not all
    real_bias(-10.0)  # every pick a null expert
    view = explorer.routing_view(model, images, image=3, layer=1)
    assert view["null_only"].all() and (view["experts_per_patch"] == 0).all() and (view["expert"] == -1).all()
    assert view["null_share"] == view["dropped_share"] == 1.0
    fig = explorer.draw_view(view)
    assert "null experts only" in fig.axes[0].get_title() and "null only 100%" in fig.axes[1].get_title()
    data = explorer.export({"lc": {"model": model, "dataset": "d", "label": "LongCat"}}, {"d": images})
    m = data["models"]["lc"]
    assert m["null_experts"] == 4 and m["num_experts"] == model.cfg.routed_experts and m["capacities"] == [None]
    assert all(v["null_only"] == [1] * 16 and v["null_share"] == 1.0 for v in m["views"]["none"][1])
    assert "not dropped" in explorer.null_note(m) and "by MoE layer: 0.00, 0.00" in explorer.null_note(m)
    assert html.escape(explorer.null_note(m)) in explorer.page_html(data)  # the page says so under the explorer


def test_with_null_experts_and_a_capacity_a_patch_without_real_experts_is_null_only_or_dropped(images):
    """AdaMoE on the capacity path at c = 0.25: a patch with no real expert is null-only exactly
    where its router picked null experts only; the others were dropped, and the view says so."""
    k = 2
    model = _null_model("adamoe", k=k, capacity_factor=0.25)
    null = _null_picks(model, images, 0)
    views = explorer.batch_views(model, images, 0.25)[0]
    only = np.stack([v["null_only"].ravel() for v in views])
    none = np.stack([v["expert"].ravel() < 0 for v in views])
    np.testing.assert_array_equal(only, null == k)
    assert (none & ~only).any() and not (only & ~none).any()  # dropped patches beside null-only ones
    dropped = views[0]["dropped_share"] - views[0]["null_share"]
    assert dropped > 0 and f"dropped {dropped:.0%}" in explorer.draw_view(views[0]).axes[1].get_title()
    assert explorer.routing_view(_model("softmax_token_choice"), images)["null_only"] is None


def test_the_page_html_carries_the_data_and_the_script():
    import json
    import re

    data = {"datasets": {}, "models": {"m": {"label": "</script><b>x"}}}
    page = explorer.page_html(data, title="T & U")
    payload = re.search(r'<script type="application/json" class="mme-data">(.*?)</script>', page, re.S).group(1)
    assert json.loads(payload) == data  # "</" is escaped, so the label cannot end the script early
    assert "mountAll" in page and "T &amp; U" in page
    assert explorer.page_html(data) != page  # every explorer gets its own element id


def test_the_committed_models_load_and_fit_their_budget():
    """The book's explorer page loads every committed model; the files stay within the README's
    budget (5 MB in all: ten models of about 0.46 MB) and each says how it was trained and how
    accurate its stored weights are."""
    files = sorted(explorer.WEIGHTS.glob("*.npz"))
    assert len(files) >= 6 and sum(f.stat().st_size for f in files) <= 5e6
    for f in files:
        model, cfg, info = explorer.load_weights(f)
        assert info["label"] and info["origin"] and 0.5 < info["accuracy"] <= 1.0
        assert f.stem.startswith(cfg.dataset + "-")


def test_the_explorer_opens_at_the_trained_capacity_factor(images):
    """Issue 49: a model trained at c = 1.25 is offered 1.25 beside the usual factors, and the
    online explorer (its JSON) and the live one open there."""
    model = _model("softmax_expert_choice", capacity_factor=1.25)
    assert modes.trained_capacity(model) == 1.25
    assert explorer.offered_capacities(model, (0.5, 1.0, 2.0)) == [0.5, 1.0, 1.25, 2.0]
    data = explorer.export({"ec": {"model": model, "dataset": "d"}}, {"d": images})
    m = data["models"]["ec"]
    assert m["capacities"] == [0.5, 1.0, 1.25, 2.0] and m["trained_capacity"] == 1.25 and "1.25" in m["views"]
    pytest.importorskip("ipywidgets")
    assert explorer.Explorer(model, images).capacity.value == 1.25


def test_the_capacity_slider_means_the_configurations_factor_on_a_fine_grained_model(images):
    """Code review B9: with fine_grained = m and shared_experts = K_s the routers run at
    m c - K_s (ModelConfig.routed_options). The explorer's factor c is the configuration's: at c
    it routes exactly as a model configured with c does, and it opens at the trained c."""
    def fine(c):
        cfg = config_lib.get_config("quick", dataset="digits", router="softmax_token_choice", model_fine_grained=2,
                                    model_shared_experts=1, model_router_kwargs={"k": 1, "capacity_factor": c})
        return train.make_model(cfg)  # the same seed: the same weights whatever c is

    model = fine(2.0)
    router = next(b.mlp.router for b in model.blocks if b.use_moe)
    assert router.capacity_factor == 3.0  # 2 * 2 - 1
    assert modes.trained_capacity(model) == 2.0 and 2.0 in explorer.offered_capacities(model, (0.75, 1.5))
    with modes.capacity(model, 1.5):
        assert router.capacity_factor == 2.0  # 2 * 1.5 - 1, not 1.5
    assert router.capacity_factor == 3.0  # restored
    configured = fine(1.5)
    for layer in range(len(model.cfg.moe_blocks())):
        slid = explorer.routing_view(model, images, image=2, layer=layer, capacity_factor=1.5)
        built = explorer.routing_view(configured, images, image=2, layer=layer)
        assert slid["capacity_factor"] == built["capacity_factor"] == 1.5
        assert slid["capacity"] == built["capacity"] and slid["dropped_share"] == built["dropped_share"]
        np.testing.assert_array_equal(slid["expert"], built["expert"])
