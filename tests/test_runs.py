"""A run's folder (issue 66 §2): one reader, `mini_moe.runs`, for train, diagnose, the explorer and
the CLI, so that a damaged folder is the same clear error wherever it is read."""

import inspect
import json
import re
import shutil

import jax
import numpy as np
import pytest
from flax import nnx

from mini_moe import config as config_lib
from mini_moe import diagnose, runs, train
from mini_moe.validate import InputError

SMALL = dict(steps=4, batch_size=32, eval_every=4, checkpoint_every=2, eval_batch_size=64, model_dim=16,
             model_depth=2, model_heads=2, model_mlp_dim=16, model_num_experts=4, model_group_images=4)


def _cfg(**kw):
    return config_lib.get_config("quick", dataset="digits", router="softmax_token_choice", **{**SMALL, **kw})


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("runs") / "run"
    train.train(_cfg(), folder, progress=False)
    return folder


def _params(model):
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


def _copy(run, tmp_path, edit):
    folder = shutil.copytree(run, tmp_path / "copy")
    obj = json.loads((folder / runs.CONFIG).read_text())
    edit(obj)
    (folder / runs.CONFIG).write_text(json.dumps(obj))
    return folder


def test_one_reader_everywhere():
    """`train` re-exports the folder functions of `runs` (the same objects: one implementation),
    and diagnose keeps no reader of its own."""
    assert "runs.restore(" in inspect.getsource(train.load_trained)
    for name in ("check_saved_config", "config_from_json", "config_to_json", "save_checkpoint",
                 "restore_checkpoint"):
        assert getattr(train, name) is getattr(runs, name), name
    assert not any(hasattr(diagnose, name) for name in ("_read_config", "_restore", "_stored_shapes"))


def test_a_config_written_before_a_field_was_added_reads_with_its_default(run, tmp_path):
    """A config.json without `cooldown_steps` (added for issue 65) and without `model.fine_grained`
    loads the same model, with those fields at their defaults, and a resume accepts it."""
    model, cfg = train.load_trained(run)

    def older(obj):
        del obj["cooldown_steps"], obj["model"]["fine_grained"]

    folder = _copy(run, tmp_path, older)
    old_model, old_cfg = train.load_trained(folder)
    assert old_cfg == cfg and old_cfg.cooldown_steps == 0
    assert all(np.array_equal(a, b) for a, b in zip(_params(model), _params(old_model)))
    runs.check_saved_config(folder, cfg)  # the same run: no error


def test_a_missing_key_whose_default_does_not_fit_is_named(run, tmp_path):
    folder = _copy(run, tmp_path, lambda obj: obj["model"].pop("num_experts"))
    with pytest.raises(InputError, match="config.json lacks model.num_experts, which took the default") as info:
        train.load_trained(folder)
    assert str(folder / "checkpoints") in str(info.value)


@pytest.mark.parametrize("damage, says", [
    (lambda path: path.write_text(path.read_text()[:40]), "not valid JSON"),
    (lambda path: path.write_text(path.read_text().replace('"steps"', '"stepz"')), "unknown key(s) stepz"),
])
def test_train_refuses_a_damaged_config_with_the_same_error_as_diagnose(run, tmp_path, damage, says):
    """Resuming into a folder whose config.json is truncated or has an unknown key is an InputError
    naming the file (it was a JSONDecodeError or TypeError traceback from train), as in diagnose."""
    folder = shutil.copytree(run, tmp_path / "copy")
    damage(folder / runs.CONFIG)
    for call in (lambda: train.train(_cfg(), folder, progress=False), lambda: diagnose.diagnose_run(folder, images=8),
                 lambda: train.load_trained(folder)):
        with pytest.raises(InputError, match=re.escape(says)) as info:
            call()
        assert str(folder / runs.CONFIG) in str(info.value)


def test_kept_steps_and_an_unkept_step(run):
    assert runs.kept_steps(run) == [2, 4] and runs.kept_steps(run / "nowhere") == []
    with pytest.raises(InputError, match=r"step=3 is not among the checkpoints kept .*\[2, 4\]"):
        train.load_trained(run, step=3)
    with pytest.raises(InputError, match="holds no run: it has no config.json"):
        train.load_trained(run / "nowhere")
