"""A training run that is interrupted and resumed, for the tests that resume must be exact."""

import pytest

from mini_moe import train


def train_interrupted_then_resumed(cfg, out_dir, datasets, monkeypatch, *, fail_at_call: int = 5) -> dict:
    """Train ``cfg`` into ``out_dir``, stopped by a KeyboardInterrupt at the ``fail_at_call``-th
    training step (by default after the checkpoint at step 3 of the tests' 6-step runs), then
    run again, which resumes from the newest checkpoint; returns the resumed run's history."""
    real_step, calls = train._step, {"n": 0}

    def interrupted(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == fail_at_call:
            raise KeyboardInterrupt
        return real_step(*args, **kwargs)

    monkeypatch.setattr(train, "_step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train.train(cfg, out_dir, progress=False, datasets=datasets)
    monkeypatch.setattr(train, "_step", real_step)
    return train.train(cfg, out_dir, progress=False, datasets=datasets)
