"""Cooldown branches (issue 65's annealed budgets): a warmup-stable-decay schedule, and a run cut
from a constant-rate run's kept checkpoint that is, step for step, the run annealed from the start."""

import json

import jax
import numpy as np
import pytest
from flax import nnx

from mini_moe import config as config_lib
from mini_moe import train

SMALL = dict(steps=10, batch_size=32, eval_every=5, checkpoint_every=2, keep_every=4, eval_batch_size=64,
             model_dim=16, model_depth=1, model_heads=2, model_mlp_dim=16, model_num_experts=4,
             model_group_images=4, warmup_steps=2, schedule="constant", learning_rate=3e-3)


def _cfg(**kw):
    return config_lib.get_config("quick", dataset="digits", router="softmax_token_choice", **{**SMALL, **kw})


def _params(model):
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


@pytest.fixture(scope="module")
def digits():
    return train.load_data(_cfg())


def test_cooldown_schedule_is_the_constant_one_then_falls_linearly_to_zero():
    """Against the schedule written out by hand: warmup 0 -> lr over 100 steps, lr until 800, then
    lr * (1000 - t) / 200."""
    lr, warmup, steps, cooldown = 2e-3, 100, 1000, 200
    rate = train.learning_rate_schedule(lr, warmup, steps, "constant", cooldown)
    constant = train.learning_rate_schedule(lr, warmup, steps, "constant")

    def by_hand(t):
        return lr * t / warmup if t < warmup else lr if t < steps - cooldown else lr * (steps - t) / cooldown

    ts = [0, 50, 100, 400, 799, 800, 850, 900, 999, 1000]
    np.testing.assert_allclose([float(rate(t)) for t in ts], [by_hand(t) for t in ts], rtol=1e-6, atol=1e-12)
    assert all(float(rate(t)) == float(constant(t)) for t in range(0, 801, 20))


def test_cooldown_steps_are_checked():
    with pytest.raises(ValueError, match="cooldown_steps=2 needs schedule='constant'"):
        _cfg(schedule="cosine", cooldown_steps=2)
    with pytest.raises(ValueError, match="cooldown_steps must be at most steps - warmup_steps = 8"):
        _cfg(cooldown_steps=9)
    with pytest.raises(ValueError, match="cooldown_steps must be an integer >= 0"):
        _cfg(cooldown_steps=-1)


def test_a_branch_from_a_kept_checkpoint_is_the_annealed_run_and_resumes(tmp_path, digits, monkeypatch):
    """A constant run of 10 steps keeps step 8; a branch from it with a 2-step cooldown ends with
    the parameters of the run that had the cooldown from its first step (same process: exact). The
    branch records its start, resumes from its own checkpoints, and refuses a changed source."""
    train.train(_cfg(), tmp_path / "constant", progress=False, datasets=digits)
    annealed = _cfg(cooldown_steps=2, keep_every=0)
    train.train(annealed, tmp_path / "straight", progress=False, datasets=digits)
    history = train.train(annealed, tmp_path / "branch", progress=False, datasets=digits,
                          branch_from=(tmp_path / "constant", 8))
    straight, _ = train.load_trained(tmp_path / "straight")
    branch, _ = train.load_trained(tmp_path / "branch")
    for a, b in zip(_params(straight), _params(branch), strict=True):
        np.testing.assert_array_equal(a, b)
    assert history["start"]["step"] == 8 and history["start"]["from"]["step"] == 8
    assert [r["step"] for r in history["eval"]] == [10]  # it trained steps 8 and 9 only
    # and the branch is a real change: the constant run's own step 10 differs
    constant, _ = train.load_trained(tmp_path / "constant")
    assert any(not np.array_equal(a, b) for a, b in zip(_params(constant), _params(branch)))

    # resumed: nothing left to train, the same record
    again = train.train(annealed, tmp_path / "branch", progress=False, datasets=digits,
                        branch_from=(tmp_path / "constant", 8))
    assert again["start"] == history["start"]
    assert json.loads((tmp_path / "branch" / "history.json").read_text())["start"] == history["start"]
    # the same folder from another start point is refused, never silently reused
    with pytest.raises(ValueError, match="holds checkpoints of a run that started at step 8"):
        train.train(annealed, tmp_path / "branch", progress=False, datasets=digits,
                    branch_from=(tmp_path / "constant", 4))


def test_a_branch_must_continue_the_same_constant_run(tmp_path, digits):
    train.train(_cfg(), tmp_path / "constant", progress=False, datasets=digits)
    source = tmp_path / "constant"
    cases = [
        (_cfg(cooldown_steps=2, learning_rate=1e-3), (source, 8), "differs from this configuration in learning_rate"),
        (_cfg(cooldown_steps=2, seed=1), (source, 8), "differs from this configuration in seed"),
        (_cfg(cooldown_steps=4), (source, 8), "must lie where both runs hold the same constant rate"),
        (_cfg(cooldown_steps=2), (source, 6), "did not keep step 6"),
        (_cfg(cooldown_steps=2), (source, 0), r"step must be an integer in \(0, steps=10\)"),
        (_cfg(cooldown_steps=2), (tmp_path / "nothing", 8), "holds no run"),
        (_cfg(cooldown_steps=2), str(source), "must be \\(run folder, kept step\\)"),
    ]
    for cfg, branch_from, message in cases:
        with pytest.raises(ValueError, match=message):
            train.train(cfg, tmp_path / "bad", progress=False, datasets=digits, branch_from=branch_from)
    with pytest.raises(ValueError, match="pass it without init_from and start_step"):
        train.train(_cfg(cooldown_steps=2), tmp_path / "bad", progress=False, datasets=digits,
                    branch_from=(source, 8), start_step=8)
    assert not (tmp_path / "bad").exists()  # a refused start leaves nothing behind
