"""``diagnose``, the health report of an MoE run (issue 38 §3): a healthy run gives no warning,
and each deliberately broken run gives its own warning and no other."""

import dataclasses
import json
import subprocess
import sys

import jax.numpy as jnp
import pytest
from flax import nnx

from mini_moe import config as config_lib
from mini_moe import diagnose, train
from mini_moe.model import VisionMoE

TINY = dict(steps=150, batch_size=32, eval_every=150, checkpoint_every=75, eval_batch_size=64, model_dim=16,
            model_depth=2, model_heads=2, model_mlp_dim=16, model_num_experts=4, model_group_images=4)


@pytest.fixture(scope="module")
def healthy(tmp_path_factory):
    """Top-1 Token Choice with buffers for two picks per token (c = 2), trained 150 steps on digits:
    balanced, little dropped, settled. (Expert Choice would warn: its predictions depend on the
    other images of the group by design, 5.5 % of them here.)"""
    run = tmp_path_factory.mktemp("diagnose") / "tc"
    cfg = config_lib.get_config("quick", dataset="digits", router="softmax_token_choice",
                                **{**TINY, "model_router_kwargs": {"capacity_factor": 2.0}})
    train.train(cfg, run, progress=False)
    _, test = train.load_data(cfg)
    return run, test.images[:200]


def _metrics(report):
    return sorted(f.metric for f in report["findings"])


def test_a_healthy_run_gives_no_warning(healthy):
    run, _ = healthy
    report = diagnose.diagnose_run(run, images=200)
    assert report["findings"] == [], diagnose.format_report(report)
    layer = report["layers"][0]
    assert layer["stability"] is not None and report["previous_step"] == 75 and report["step"] == 150
    assert layer["dropped_picks"] == pytest.approx(layer["dropped_tokens"]) and layer["slot_sharpness"] is None
    assert 0 <= layer["router_entropy"] <= 1 and layer["load_max_over_mean"] >= 1
    assert "no warnings" in diagnose.format_report(report)


def test_all_tokens_to_one_expert_is_a_load_warning_only(healthy):
    run, images = healthy
    model, _ = train.load_trained(run)
    block = next(b for b in model.blocks if b.use_moe)
    block.norm2.bias[...] = block.norm2.bias[...].at[0].set(4.0)  # one feature every token carries ...
    kernel = block.mlp.router.affinity.dense.kernel
    kernel[...] = kernel[...].at[0, 0].set(2.0)  # ... that the router reads as "expert 0" (logits stay moderate)
    report = diagnose.diagnose(model, images)
    assert _metrics(report) == ["load_max_over_mean"], diagnose.format_report(report)
    assert report["layers"][0]["load_max_over_mean"] > 3.5  # nearly E = 4 times the mean share


def test_a_capacity_limited_model_evaluated_in_groups_of_one_image(healthy):
    run, images = healthy
    model, cfg = train.load_trained(run)
    single = VisionMoE(dataclasses.replace(cfg.model, group_images=1), rngs=nnx.Rngs(0))
    nnx.update(single, nnx.state(model))
    report = diagnose.diagnose(single, images, trained_group_images=cfg.model.group_images)
    assert _metrics(report) == ["grouping"], diagnose.format_report(report)
    assert diagnose.diagnose(single, images, trained_group_images=1)["findings"] == []


def test_a_loss_free_bias_that_never_moves(healthy):
    _, images = healthy
    cfg = config_lib.get_config("quick", dataset="digits", router="sigmoid_loss_free",
                                **{**TINY, "model_router_kwargs": {"bias_rate": 1e-3, "capacity_factor": 4.0}})
    model = train.make_model(cfg)
    before = [f for f in diagnose.diagnose(model, images)["findings"]]
    assert "bias_frozen" in [f.metric for f in before]
    model(jnp.asarray(images[:32]))  # one training-mode call moves the bias
    after = diagnose.diagnose(model, images)["findings"]
    assert [f.metric for f in after] == [f.metric for f in before if f.metric != "bias_frozen"]


def test_soft_moe_with_a_huge_scale_is_a_hard_router():
    cfg = config_lib.get_config("quick", dataset="digits", router="soft_moe", **TINY)
    _, test = train.load_data(cfg)
    model = train.make_model(cfg)
    block = next(b for b in model.blocks if b.use_moe)
    assert diagnose.diagnose(model, test.images[:64])["findings"] == []
    block.mlp.router.affinity.scale[...] = jnp.asarray(1e4)
    report = diagnose.diagnose(model, test.images[:64])
    assert _metrics(report) == ["slot_sharpness"], diagnose.format_report(report)


def test_bad_input_is_a_clear_error_at_the_cli(tmp_path, healthy):
    run, _ = healthy
    cli = [sys.executable, "-m", "mini_moe", "diagnose"]
    proc = subprocess.run(cli + [str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 2 and "is not a training run" in proc.stderr and "Traceback" not in proc.stderr
    dense = tmp_path / "dense"
    train.train(config_lib.get_config("quick", dataset="digits", router=None, **{**TINY, "steps": 2,
                                                                                  "eval_every": 2}),
                dense, progress=False)
    proc = subprocess.run(cli + [str(dense)], capture_output=True, text=True)
    assert proc.returncode == 2 and "dense model" in proc.stderr and "Traceback" not in proc.stderr
    proc = subprocess.run(cli + [str(run), "--images", "64", "--json", "--plot", str(tmp_path / "health.png")],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["findings"] == [] and len(report["layers"]) == 1
    assert (tmp_path / "health.png").stat().st_size > 10_000
