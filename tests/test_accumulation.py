"""Gradient accumulation as a scan (issue 52 §4): the whole batch's MaxVio, and memory that
shrinks with the number of micro-batches."""

import jax
import numpy as np
import pytest
from flax import nnx

from mini_moe import config as config_lib
from mini_moe import train

from live_head import live_head

TINY = dict(steps=6, batch_size=32, eval_every=3, checkpoint_every=3, eval_batch_size=64, model_dim=16,
            model_depth=2, model_heads=2, model_mlp_dim=16, model_num_experts=4, model_group_images=4)
CASES = {
    "loss_free_dropless": ("sigmoid_loss_free", dict(model_moe_path="dropless",
                                                      model_router_kwargs={"bias_rate": 0.05, "seq_balance": 1.0})),
    "token_choice_capacity": ("softmax_token_choice", dict(model_router_kwargs={"noise_std": 0.0})),
}
ACCUMULATED = nnx.jit(train.accumulated_grads, static_argnums=(3, 4))


@pytest.fixture(scope="module")
def digits():
    return train.load_data(config_lib.get_config("quick", dataset="digits"))


def _cfg(router, **kw):
    return config_lib.get_config("quick", dataset="digits", router=router, **{**TINY, **kw})


@pytest.mark.parametrize("case", ["loss_free_dropless", "token_choice_capacity"])
def test_an_accumulated_step_reports_the_whole_batchs_max_violation(case, digits):
    """Issue 52 §4: MaxVio (max load / mean load - 1) of an accumulated step is that of the whole
    batch's summed loads, as one step on the whole batch reports it. The mean of the micro-batches'
    MaxVio, logged before, is never smaller (max of a sum <= sum of maxes, and equal micro-batches
    have equal mean loads) and larger whenever their most loaded experts differ."""
    router, kw = CASES[case]
    whole_cfg, split_cfg = _cfg(router, **kw), _cfg(router, grad_accum=4, **kw)
    images, labels = train.batch_at(digits[0], whole_cfg, 0)
    whole, split = live_head(train.make_model(whole_cfg)), live_head(train.make_model(split_cfg))
    one = train._step(whole, train.make_optimizer(whole, whole_cfg), (images, labels), whole_cfg)
    accumulated = train._step(split, train.make_optimizer(split, split_cfg), (images, labels), split_cfg)
    assert float(accumulated["router"]["max_violation"]) == pytest.approx(float(one["router"]["max_violation"]), rel=1e-5)
    _, _, _, _, metrics = ACCUMULATED(live_head(train.make_model(split_cfg)), jax.numpy.asarray(images),
                                      jax.numpy.asarray(labels), split_cfg.aux_loss_weight, 4)
    mean_of_parts = np.mean([[float(layer["max_violation"]) for layer in m] for m in metrics])
    assert mean_of_parts > float(one["router"]["max_violation"]) + 1e-3
