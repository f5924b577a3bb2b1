"""The routing explorer (issue 38 §2): what it computes equals the library's own routing, capacity
changes what it should, the widget's callback re-routes on every control, and it falls back to a
static figure without a widget frontend."""

import matplotlib

matplotlib.use("Agg")

import numpy as np
import pytest

from mini_moe import config as config_lib
from mini_moe import evaluate, explorer, train


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
