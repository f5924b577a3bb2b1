"""The runner of issue 54's registered upcycling comparison (mini_moe/results/upcycling.py), on its
``smoke`` plan: digits, a tiny model, every arm end to end. Not a result: a check that every cell
produces its record, that a second invocation trains nothing, and that an upcycled cell starts
from exactly what ``upcycle()`` makes of the dense run's checkpoint at N."""

import importlib.util
import json
import math
import pathlib
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _load_runner():
    spec = importlib.util.spec_from_file_location("upcycling_runner", ROOT / "mini_moe/results/upcycling.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


upcycling = _load_runner()


def _numbers(obj):
    """Every number in a JSON-like object."""
    if isinstance(obj, bool) or obj is None or isinstance(obj, str):
        return []
    if isinstance(obj, (int, float)):
        return [obj]
    if isinstance(obj, dict):
        return [x for v in obj.values() for x in _numbers(v)]
    return [x for v in obj for x in _numbers(v)]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    runs = tmp_path_factory.mktemp("upcycling")
    upcycling.main(["smoke", "--runs", str(runs)])
    return runs, json.loads(upcycling.results_path(upcycling.SMOKE, runs).read_text())


def test_the_plans_follow_the_registration():
    plan = upcycling.REGISTERED
    assert (plan.dataset, plan.n, plan.budgets, plan.steps, plan.keep_every) == ("fashion_mnist", 2000, (500, 2000),
                                                                                  4000, 500)
    assert plan.seeds == tuple(range(300, 309)) and plan.probe_images == 2048
    assert plan.probe_after == (0, 10, 25, 50, 100, 250, 500, 1000, 2000)
    dense, tc, frozen = (upcycling.config(a, 300, plan) for a in ("dense", "up_tc", "up_tc_frozen"))
    assert dense.model.router is None and (dense.model.dim, dense.model.mlp_dim, dense.model.patch_size) == (64, 64, 7)
    assert (tc.schedule, tc.learning_rate, tc.warmup_steps, tc.batch_size, tc.steps) == ("constant", 2e-3, 100, 128, 4000)
    assert dict(tc.model.router_kwargs) == {"k": 1, "capacity_factor": 1.0} and tc.model.num_experts == 8
    assert dict(frozen.model.router_kwargs) == {"k": 1, "capacity_factor": 1.0, "frozen": True}
    rows = upcycling.contrasts(plan)
    assert len(rows) == 10 and rows[8][1:5] == ("up_tc", 2500, "scratch_tc", 500)
    assert rows[9][1:5] == ("up_tc", 4000, "up_tc_frozen", 4000)


def test_the_smoke_run_records_every_cell_with_finite_numbers(smoke):
    _, record = smoke
    plan = upcycling.SMOKE
    cells = {(r["arm"], r["seed"]): r for r in record["runs"]}
    assert set(cells) == {(arm, seed) for arm in upcycling.ARMS for seed in plan.seeds}
    for (arm, _), cell in cells.items():
        assert "failed" not in cell, cell
        assert all(math.isfinite(x) for x in _numbers(cell)), arm
        kind = upcycling.ARMS[arm][0]
        start = plan.n if kind == "upcycled" else 0
        assert [r["after"] for r in cell["probe"]][:len(plan.probe_after)] == list(plan.probe_after)
        assert {str(plan.n + m) for m in plan.budgets} <= set(cell["test_accuracy"]), arm
        assert cell["start_step"] == start and "source_commit" in cell
        if kind == "dense":
            continue
        assert len(cell["probe"][0]["layers"]) == 1  # Every-2 in 2 blocks
        if kind == "upcycled":
            assert cell["loss_jump"]["dense_loss_at_n"] == next(r["loss"] for r in cells["dense", 0]["probe"]
                                                                if r["step"] == plan.n)
            first = cell["probe"][0]["layers"][0]["expert_cosine"]
            assert first == pytest.approx(1.0) if upcycling.ARMS[arm][2] == 0 else first < 0.999
            assert cell["start"]["step"] == plan.n
    assert record["machine"]["cpu"] and record["plan"] == "smoke"


def test_a_second_invocation_trains_nothing(smoke, monkeypatch):
    runs, record = smoke

    def refuse(*args, **kwargs):
        raise AssertionError("a finished cell was trained again")

    monkeypatch.setattr(upcycling, "run_cell", refuse)
    upcycling.main(["smoke", "--runs", str(runs)])
    assert json.loads(upcycling.results_path(upcycling.SMOKE, runs).read_text())["runs"] == record["runs"]


def test_the_upcycled_cell_starts_from_upcycle_of_the_dense_checkpoint(smoke):
    """Its step-0 measurement is that of ``upcycle(load_trained(dense, step=N))``, made here anew."""
    from mini_moe import train
    from mini_moe.upcycle import upcycle

    runs, record = smoke
    plan = upcycling.SMOKE
    cell = next(r for r in record["runs"] if r["arm"] == "up_tc")
    cfg = upcycling.config("up_tc", 0, plan)
    dense, _ = train.load_trained(runs / "dense-s0", step=plan.n)
    model = upcycle(dense, router="softmax_token_choice", num_experts=cfg.model.num_experts, seed=0,
                    router_kwargs=dict(cfg.model.router_kwargs))
    images, labels = upcycling.probe_set(train.load_data(cfg)[0], plan)
    row, _ = upcycling.measure(model, images, labels, batch=plan.probe_batch)
    first = cell["probe"][0]
    assert first["step"] == plan.n
    assert first["loss"] == row["loss"] and first["accuracy"] == row["accuracy"]
    for got, want in zip(first["layers"], row["layers"]):
        assert {k: got[k] for k in want} == want
    assert cell["start"]["fingerprint"] == train.state_fingerprint(__import__("flax").nnx.state(model))


def _synthetic_record(plan, rng, *, missing=()):
    """A results record of every arm and planned seed with made-up accuracies at every budget."""
    steps = sorted({b for _, a, sa, b_arm, sb, _ in upcycling.contrasts(plan) for b in (sa, sb)})
    runs = [{"arm": arm, "seed": seed, "test_accuracy": {str(s): float(rng.uniform(0.8, 0.9)) for s in steps}}
            for seed in plan.seeds for arm in upcycling.ARMS if (arm, seed) not in missing]
    return {"runs": runs}


def test_the_analysis_is_scipys_paired_t_with_holms_correction():
    """``analysis`` against an independent computation: SciPy's paired t-test per contrast on the
    accuracy differences in points, and Holm's step-down adjustment written out here."""
    from scipy import stats

    rng = np.random.default_rng(0)
    plan = upcycling.REGISTERED
    record = _synthetic_record(plan, rng)
    out = upcycling.analysis(record, plan)
    acc = {(r["arm"], r["seed"]): r["test_accuracy"] for r in record["runs"]}
    p_values = []
    for row, (number, a, sa, b, sb, _) in zip(out["rows"], upcycling.contrasts(plan)):
        first = [acc[a, s][str(sa)] for s in plan.seeds]
        second = [acc[b, s][str(sb)] for s in plan.seeds]
        test = stats.ttest_rel(first, second)
        assert row["number"] == number and row["seeds"] == list(plan.seeds) and row["df"] == len(plan.seeds) - 1
        assert row["difference"] == pytest.approx(np.mean(np.subtract(first, second)), abs=1e-12)
        assert row["p_value"] == pytest.approx(test.pvalue, rel=1e-9)
        assert row["t"] == pytest.approx(test.statistic, rel=1e-9)
        ci = test.confidence_interval(0.95)  # the unadjusted 95 % interval the verdicts print
        assert (row["ci_low"], row["ci_high"]) == pytest.approx((ci.low, ci.high), rel=1e-9, abs=1e-12)
        p_values.append(test.pvalue)
    order = np.argsort(p_values)
    holm = np.minimum(1, np.maximum.accumulate([(len(p_values) - i) * p_values[j] for i, j in enumerate(order)]))
    expected = np.empty(len(p_values))
    expected[order] = holm
    assert [row["p_holm"] for row in out["rows"]] == pytest.approx(expected.tolist(), rel=1e-9)
    assert out["complete_seeds"] == list(plan.seeds) and not out["exploratory"]


def test_the_analysis_waits_for_every_seed_unless_stopped():
    rng = np.random.default_rng(1)
    plan = upcycling.REGISTERED
    record = _synthetic_record(plan, rng, missing={("scratch_ec", plan.seeds[-1])})
    with pytest.raises(SystemExit, match="8/9 seeds complete"):
        upcycling.analysis(record, plan)
    stopped = upcycling.analysis(record, plan, stopped=True)
    assert stopped["complete_seeds"] == list(plan.seeds[:-1]) and all(r["pairs"] == 8 for r in stopped["rows"])


def test_probe_curve_averages_the_layers_and_leaves_out_failed_runs_and_other_seeds():
    from mini_moe.results import upcycling as up

    def run(seed, values, failed=False):
        probe = [{"after": a, "layers": [{"kl_uniform": v, "update_cosine": None if a == 0 else v},
                                         {"kl_uniform": 2 * v, "update_cosine": None if a == 0 else 3 * v}]}
                 for a, v in zip((0, 10, 100), values)]
        return {"arm": "up_tc", "seed": seed, "probe": probe, **({"failed": "loss"} if failed else {})}

    runs = [run(0, (1.0, 2.0, 3.0)), run(1, (2.0, 4.0, 6.0)), run(2, (9.0, 9.0, 9.0), failed=True),
            run(3, (7.0, 7.0, 7.0))]
    after, kl = up.probe_curve(runs, "up_tc", "kl_uniform", seeds=(0, 1, 2))
    assert after.tolist() == [0, 10, 100]
    np.testing.assert_allclose(kl, [[1.5, 3.0, 4.5], [3.0, 6.0, 9.0]])  # the mean of the two layers
    _, cos = up.probe_curve(runs, "up_tc", "update_cosine", seeds=(0,))
    assert np.isnan(cos[0, 0]) and cos[0, 1] == 4.0  # None at the start: NaN
