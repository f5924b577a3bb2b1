"""``diagnose``, the health report of an MoE run (issue 38 §3, issue 50 §4): a healthy run gives no
warning, each deliberately broken run gives its own warning and no other, a damaged run folder gives
one line naming the file (no traceback), non-finite weights are their own verdict, and hints name
only fixes the router has. The reference runs' calibration is in test_diagnose_reference.py."""

import dataclasses
import inspect
import json
import os
import shutil
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mini_moe import config as config_lib
from mini_moe import diagnose, evaluate, routers, runs, train
from mini_moe.model import VisionMoE
from mini_moe.validate import InputError

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
    # Token Choice with a capacity over groups of images: a prediction may depend on its group
    assert report["batch_invariant"]["invariant"] is False and "capacity factor" in report["batch_invariant"]["why"]
    assert "batch-invariant configuration: no" in diagnose.format_report(report)


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
    assert report["batch_invariant"]["invariant"] is True  # groups of one image: nothing to depend on
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


# ------------------------------------------------------------ damaged run folders (issue 50 §4)


def _newest(run):
    return run / "checkpoints" / str(max(int(p.name) for p in (run / "checkpoints").iterdir()))


def _data_file(run):
    """The newest checkpoint's largest data file (Orbax's OCDBT store under default/d/)."""
    return max((_newest(run) / "default" / "d").iterdir(), key=lambda p: p.stat().st_size)


def _edit_config(change):
    def damage(run):
        cfg = json.loads((run / "config.json").read_text())
        change(cfg["model"])
        (run / "config.json").write_text(json.dumps(cfg))
    return damage


def _unreadable(path_of):
    """chmod 000; as root (as in CI containers), where chmod does not stop reading, a directory
    takes the file's place, which no read can open either."""
    def damage(run):
        path = path_of(run)
        if os.geteuid() == 0:
            path.unlink()
            path.mkdir()
        else:
            path.chmod(0)
    return damage


def _truncate(path_of):
    def damage(run):
        path = path_of(run)
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return damage


def _empty(run):
    for child in run.iterdir():
        shutil.rmtree(child) if child.is_dir() else child.unlink()


#: name -> (how the folder is damaged, the file named in the message, what the message says is wrong)
DAMAGED = {
    "truncated config.json": (_truncate(lambda r: r / "config.json"), "config.json", "not valid JSON"),
    "truncated checkpoint data": (_truncate(_data_file), "checkpoints/150", "truncated, damaged or unreadable"),
    "checkpoint without its data folder": (lambda r: shutil.rmtree(_newest(r) / "default"), "checkpoints/150",
                                           "no default/ folder"),
    "missing key in config.json": (_edit_config(lambda m: m.pop("num_experts")), "checkpoints/150",
                                   "config.json lacks model.num_experts, which took the default"),
    "unknown key in config.json": (_edit_config(lambda m: m.update(new_option=1)), "config.json",
                                   "unknown key(s) model.new_option"),
    "empty folder": (_empty, "", "is not a training run"),
    "checkpoint of more experts": (_edit_config(lambda m: m.update(num_experts=8)), "checkpoints/150",
                                   "holds another configuration than"),
    "checkpoint of another width": (_edit_config(lambda m: m.update(dim=32)), "checkpoints/150",
                                    "is stored as (2, 8), the configuration makes it (2, 16)"),
    "unreadable config.json": (_unreadable(lambda r: r / "config.json"), "config.json", "cannot read it"),
    "unreadable checkpoint data": (_unreadable(_data_file), "checkpoints/150", "truncated, damaged or unreadable"),
}


@pytest.fixture(scope="module")
def damaged(healthy, tmp_path_factory):
    """``{case: folder}``: a copy of the healthy run, damaged in each of the ways of :data:`DAMAGED`."""
    run, _ = healthy
    root = tmp_path_factory.mktemp("damaged")
    folders = {}
    for i, (name, (damage, _, _)) in enumerate(DAMAGED.items()):
        folders[name] = shutil.copytree(run, root / f"case{i}")
        damage(folders[name])
    return folders


@pytest.mark.parametrize("case", list(DAMAGED))
def test_a_damaged_run_folder_is_an_input_error_naming_the_file(damaged, case):
    _, file, what = DAMAGED[case]
    with pytest.raises(InputError) as info:
        diagnose.diagnose_run(damaged[case], images=8)
    message = str(info.value)
    assert str(damaged[case] / file).rstrip("/") in message and what in message, message
    assert "\n" not in message


def test_every_damaged_run_folder_is_one_line_at_the_cli_with_no_traceback(damaged):
    """Every case in one process (each a call of the CLI's main), so that anything a failed read
    leaves behind (Orbax's pending reads print tracebacks from their threads) shows in its stderr."""
    names = list(DAMAGED)
    code = ("import sys\nfrom mini_moe.__main__ import main\n"
            "print([main(['diagnose', d, '--images', '8']) for d in sys.argv[1:]])")
    proc = subprocess.run([sys.executable, "-c", code, *(str(damaged[n]) for n in names)], capture_output=True,
                          text=True, timeout=600)
    assert proc.stdout.strip() == str([2] * len(names)), proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if not line.startswith("WARNING:absl")]
    assert "Traceback" not in proc.stderr and len(lines) == len(names), proc.stderr
    for name, line in zip(names, lines):
        _, file, what = DAMAGED[name]
        assert line.startswith(f"mini_moe: error: {damaged[name] / file}".rstrip("/")) and what in line, line


def test_a_previous_checkpoint_that_cannot_be_read_costs_only_the_stability(healthy, tmp_path):
    run = shutil.copytree(healthy[0], tmp_path / "run")
    shutil.rmtree(run / "checkpoints" / "75" / "default")
    report = diagnose.diagnose_run(run, images=64)
    assert report["previous_step"] is None and report["layers"][0]["stability"] is None
    assert "no default/ folder" in report["notes"][0] and "note: no stability" in diagnose.format_report(report)


def test_no_image_is_an_input_error(healthy):
    run, images = healthy
    with pytest.raises(InputError, match="images must be >= 1"):
        diagnose.diagnose_run(run, images=0)
    model, _ = train.load_trained(run)
    nan_image = np.where(np.arange(8)[:, None, None, None] == 0, np.nan, images[:8])  # image 0: 64 NaN pixels
    for bad, match in [(images[:0], r"N >= 1, 8, 8, 1\], got \(0, 8, 8, 1\)"),
                       (images[:3, :, :, 0], r"got \(3, 8, 8\)"), (nan_image, "64 non-finite")]:
        with pytest.raises(InputError, match=match):
            diagnose.diagnose(model, bad)


# ------------------------------------------------------------ non-finite weights (issue 50 §4)


def _strict_json(text):
    """``json.loads`` that refuses NaN and Infinity, as strict parsers (and JSON itself) do."""
    def refuse(token):
        raise ValueError(f"not JSON: {token}")
    return json.loads(text, parse_constant=refuse)


def test_a_nan_router_weight_is_non_finite_weights_not_a_collapse(healthy):
    run, images = healthy
    model, _ = train.load_trained(run)
    kernel = next(b for b in model.blocks if b.use_moe).mlp.router.affinity.dense.kernel
    kernel[...] = kernel[...].at[0, 0].set(jnp.nan)
    report = diagnose.diagnose(model, images)
    assert _metrics(report) == ["non_finite"], diagnose.format_report(report)
    finding, = report["findings"]
    assert finding.layer == 0 and "non-finite weights in MoE layer 0" in finding.hint
    assert "blocks.1.mlp.router.affinity.dense.kernel (1 of 64 values)" in finding.hint
    assert "balance" not in finding.hint and "collaps" not in finding.hint
    assert np.isnan(report["layers"][0]["router_entropy"])  # the metric itself stays NaN in Python ...
    out = _strict_json(diagnose.to_json(report))  # ... and is null, flagged, in standard JSON
    assert out["layers"][0]["router_entropy"] is None and "layers[0].router_entropy" in out["non_finite"]
    assert out["findings"][0]["metric"] == "non_finite"


def test_a_nan_head_weight_is_flagged(healthy):
    run, images = healthy
    model, _ = train.load_trained(run)
    model.head.kernel[...] = model.head.kernel[...].at[3, 2].set(jnp.inf)
    report = diagnose.diagnose(model, images)
    assert _metrics(report) == ["non_finite"], diagnose.format_report(report)
    assert report["findings"][0].layer is None and "head.kernel (1 of 160 values)" in report["findings"][0].hint
    assert _strict_json(diagnose.to_json(report))["non_finite"] == []  # the routing metrics are all finite


def test_the_cli_json_is_standard_json(healthy, tmp_path):
    run = shutil.copytree(healthy[0], tmp_path / "run")
    model, cfg = train.load_trained(run)
    kernel = next(b for b in model.blocks if b.use_moe).mlp.router.affinity.dense.kernel
    kernel[...] = kernel[...].at[:, 1].set(jnp.nan)
    manager = runs.checkpoints(run)
    train.save_checkpoint(manager, 300, model, train.make_optimizer(model, cfg))
    proc = subprocess.run([sys.executable, "-m", "mini_moe", "diagnose", str(run), "--images", "32", "--json"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    out = _strict_json(proc.stdout)
    assert [f["metric"] for f in out["findings"]] == ["non_finite"] and out["step"] == 300
    assert "layers[0].router_entropy" in out["non_finite"]


# ------------------------------------------------------------ the router family decides (issue 50 §4)


def _tiny(router, **options):
    cfg = config_lib.get_config("quick", dataset="digits", router=router,
                                **{**TINY, "model_router_kwargs": options.pop("router_kwargs", {}), **options})
    return train.make_model(cfg)


def test_expert_choice_drops_by_design_and_its_hint_names_only_its_fixes(healthy):
    _, images = healthy
    model = _tiny("softmax_expert_choice", router_kwargs={"capacity_factor": 0.5})
    rules = diagnose.thresholds(model)
    # c = 0.5: E C = T/2 slots for T tokens, so half the tokens are unpicked whatever the router does
    assert rules["dropped_tokens"] == ("max", 0.8) and "load_max_over_mean" not in rules
    kernel = next(b for b in model.blocks if b.use_moe).mlp.router.affinity.dense.kernel
    kernel[...] = jnp.broadcast_to(kernel[...][:, :1], kernel.shape)  # every expert ranks the tokens alike
    report = diagnose.diagnose(model, images)
    finding = next(f for f in report["findings"] if f.metric == "dropped_tokens")
    assert report["layers"][0]["dropped_tokens"] > 0.85  # the experts take the same half of the tokens
    assert "capacity factor" in finding.hint and "pick the same tokens" in finding.hint
    assert all("balance" not in f.hint and "dropless" not in f.hint for f in report["findings"]), report["findings"]


@pytest.mark.parametrize("router", sorted(n for n, s in routers.ROUTERS.items() if s.data is None))  # not raw_oracle
def test_a_hint_never_names_a_fix_the_router_does_not_have(router):
    model = _tiny(router)
    layer = next(b for b in model.blocks if b.use_moe).mlp
    token = isinstance(layer.router.allocation, routers.TokenChoice)
    options = set(inspect.signature(routers.spec(router).build).parameters)
    for problem in ("balance", "drops"):
        hint = diagnose._fixes(model, problem)
        assert ("dropless" in hint) <= token
        assert ("balance_loss" in hint or "aux_loss_weight" in hint) <= ("balance_loss" in options)
        assert ("bias_rate" in hint) <= ("bias_rate" in options)
        assert ("capacity_factor" in hint) <= ("capacity_factor" in options)
        # a transport plan balances already and a hash router learns nothing: no other allocation to suggest
        plan_or_hash = router in ("sinkhorn_token_choice", "svmoe", "hash")
        assert ("Expert Choice, Sinkhorn" in hint) <= (token and not plan_or_hash)
    rules = diagnose.thresholds(model)
    assert ("router_logit_lse_sq" in rules) == ("z_loss" in options)
    assert ("load_max_over_mean" in rules) == (token and router not in ("remoe", "top_p"))


def test_a_model_that_drops_nothing_must_not_depend_on_its_group():
    dropless = _tiny("softmax_token_choice", model_moe_path="dropless")
    assert diagnose.family(dropless) == "token k=1 dropless"
    rules = diagnose.thresholds(dropless)
    assert rules["batch_dependence"] == ("max", diagnose.NO_DROP_BATCH_DEPENDENCE) and "dropped_tokens" not in rules
    capped = diagnose.thresholds(_tiny("softmax_token_choice"))
    assert capped["batch_dependence"] == diagnose.THRESHOLDS["batch_dependence"]
    assert diagnose.family(_tiny("soft_moe")) == "soft"


def test_the_report_prints_threshold_reference_and_margin(healthy):
    model = _tiny("softmax_expert_choice")  # "expert c=1": a family with reference runs
    report = diagnose.diagnose(model, healthy[1][:64])
    rule = report["thresholds"]["dropped_tokens"]
    low, high = diagnose.REFERENCES["expert c=1"]["dropped_tokens"]
    assert rule == {"direction": "max", "threshold": 0.3, "reference": [low, high],
                    "reference_margin": round(0.3 - high, 4)}
    text = diagnose.format_report(report)
    row = next(line for line in text.splitlines() if line.startswith("dropped_tokens"))
    assert "<= 0.3" in row and f"{low:.3f}-{high:.3f}" in row and f"{0.3 - high:.3f}" in row
    assert "confirmatory cells of chapter 8" in text
    assert _strict_json(diagnose.to_json(report))["thresholds"]["dropped_tokens"]["reference"] == [low, high]


# ------------------------------------------------------------ one home for the metrics (issue 50 §4)


def test_remoe_drops_a_share_of_the_picks_it_made_not_of_k_equals_e(healthy):
    _, images = healthy
    images = images[:64]  # 16 groups of 4, one batch: no padding copy
    dropless = _tiny("remoe", model_moe_path="dropless")
    layer = evaluate.routing_record(dropless, images, batch_size=64)[1][0]
    summary = evaluate.routing_summary(layer)
    assert summary["dropped_routes"] == 0.0  # nothing can drop on the dropless path ...
    assert 1 - summary["experts_per_token"] / 4 > 0.2  # ... where dividing by k = E found a fifth or more
    assert diagnose.diagnose(dropless, images)["layers"][0]["dropped_picks"] == 0.0
    capped = _tiny("remoe")  # buffers of C = k T / E: the picks past them drop
    layer = evaluate.routing_record(capped, images, batch_size=64)[1][0]
    made = layer["picks"].mean()
    assert made == pytest.approx(layer["scalars"]["active_experts"])  # the router's own count of its positive gates
    assert evaluate.routing_summary(layer)["dropped_routes"] == pytest.approx(1 - layer["hits"].sum(-1).mean() / made)
    assert 0 < evaluate.routing_summary(layer)["dropped_routes"] < 1 - layer["hits"].sum(-1).mean() / 4


@pytest.mark.parametrize("router", ["softmax_token_choice", "soft_moe"])
def test_padding_copies_do_not_count_and_batches_weigh_their_images(healthy, router):
    """12 images (3 routing groups of 4) in batches of 8: the second batch is one real group and one
    padding copy of it, routed alike. Counted per image, that gives what one unpadded batch of 12
    gives; counted per batch, the last group would weigh as much as the first two."""
    _, images = healthy
    model = _tiny(router)
    images = images[:12]
    for padded, whole in [(evaluate.router_report(model, images, batch_size=8),
                           evaluate.router_report(model, images, batch_size=12)),
                          (diagnose.diagnose(model, images, batch_size=8)["layers"],
                           diagnose.diagnose(model, images, batch_size=12)["layers"])]:
        for a, b in zip(padded, whole):
            for key in ("dropped", "experts_per_token", "z_loss", "router_logit_lse_sq", "slot_sharpness",
                        "router_entropy", "dropped_tokens"):
                if a.get(key) is not None:
                    assert a[key] == pytest.approx(b[key], rel=1e-5), key
