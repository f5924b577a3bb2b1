"""The models behind the book's routing explorer (book/16_explorer.md, issue 38), committed as
float16 weights in ``mini_moe/results/explorer-models/NAME.npz`` (:func:`mini_moe.explorer.save_weights`).

Every model is one the book's own runs train, with the same configuration:

- on ``patch_vote`` (chapter 8's task): Expert Choice and Soft MoE as chapter 8's registered cells
  of seed 100 (``confirm.config``; the Expert Choice one is chapter 8's live cell), and four arms
  of the v2 runs of chapters 12-13 at seed 10 (``routing_2024.ARMS_V2``): Token Choice with the
  Switch loss at k = 1 and k = 2, DeepSeek-V3's sigmoid router with the loss-free bias (k = 2) and
  ReMoE on the dropless path. The v2 runs' own checkpoints are used where this machine has them
  (``runs/routing_2024_v2/ARM-s10``); otherwise they are trained here with the same configuration.
- on Fashion-MNIST: Token Choice, Expert Choice and Soft MoE with chapter 8's schedule and
  patch_vote's model shape (width 64, MLPs and experts of 64), so that each file stays under
  0.5 MB; the quick Fashion-MNIST model (width 128, MLPs of 256) would take 2.9 MB each. Beside
  them LongCat-Flash's null experts (router ``longcat``: 8 zero experts beside the 8 real ones,
  k = 4, the bias controller aiming at 2 real experts per patch, dropless): the ``longcat`` arm
  of the registered study ``compute-per-patch-preregistration.md``, at seed 100.

    taskset -c 0 .venv/bin/python mini_moe/results/explorer_models.py [NAME ...]

A model whose file exists is skipped; training resumes from its checkpoint in ``runs/explorer``.
"""

from __future__ import annotations

import pathlib
import sys

from mini_moe import confirm, evaluate, explorer, study, train
from mini_moe.results import routing_2024

OUT = pathlib.Path(__file__).resolve().parent / "explorer-models"
RUNS = pathlib.Path("runs/explorer")
V2_RUNS = pathlib.Path("runs/routing_2024_v2")
V2_SEED = 10
SEED = 100  # chapter 8's first registered seed


def _fashion(router: str, capacity: float = 1.0, **overrides):
    return study.cell_config(router, capacity, SEED, dataset="fashion_mnist", scale="quick", model_dim=64,
                             model_mlp_dim=64, **confirm.OVERRIDES, **overrides)


def _longcat():
    """The ``longcat`` arm of compute-per-patch-preregistration.md: capacity 4 sets k = 4 (the
    dropless path ignores the capacity), 8 zero experts, the controller aiming at 2 real experts."""
    return _fashion("longcat", 4.0, model_moe_path="dropless", model_null_experts=("zero",) * 8,
                    model_router_kwargs={"target_real": 2.0, "bias_rate": 0.1})


V2 = "chapters 12-13's v2 run {arm}, seed 10"
CH08 = "chapter 8's registered cell {router}, c = 1, seed 100"
FASHION = "Fashion-MNIST with chapter 8's schedule, width 64, seed 100"

#: name -> (label shown by the explorer, a function returning the TrainConfig, the v2 arm or None,
#: the run that trains it).
MODELS = {
    "patch_vote-token_choice": ("Token Choice, k = 1 (Switch loss)",
                                lambda: routing_2024.config("tc_switch", V2_SEED, routing_2024.ARMS_V2), "tc_switch",
                                V2.format(arm="tc_switch")),
    "patch_vote-token_choice_k2": ("Token Choice, k = 2 (Switch loss)",
                                   lambda: routing_2024.config("tc_switch_k2", V2_SEED, routing_2024.ARMS_V2),
                                   "tc_switch_k2", V2.format(arm="tc_switch_k2")),
    "patch_vote-expert_choice": ("Expert Choice", lambda: confirm.config("softmax_expert_choice", 1.0, SEED), None,
                                 CH08.format(router="softmax_expert_choice") + " (its live cell)"),
    "patch_vote-soft_moe": ("Soft MoE", lambda: confirm.config("soft_moe", 1.0, SEED), None,
                            CH08.format(router="soft_moe")),
    "patch_vote-loss_free_k2": ("Sigmoid gates, loss-free bias, k = 2",
                                lambda: routing_2024.config("loss_free_k2", V2_SEED, routing_2024.ARMS_V2),
                                "loss_free_k2", V2.format(arm="loss_free_k2")),
    "patch_vote-remoe": ("ReMoE (dropless)", lambda: routing_2024.config("remoe", V2_SEED, routing_2024.ARMS_V2),
                         "remoe", V2.format(arm="remoe")),
    "fashion_mnist-token_choice": ("Token Choice, k = 1", lambda: _fashion("softmax_token_choice"), None, FASHION),
    "fashion_mnist-expert_choice": ("Expert Choice", lambda: _fashion("softmax_expert_choice"), None, FASHION),
    "fashion_mnist-soft_moe": ("Soft MoE", lambda: _fashion("soft_moe"), None, FASHION),
    "fashion_mnist-longcat": ("LongCat null experts: 8 zero experts, k = 4, 2 real on average", _longcat, None,
                              FASHION + ", the registered study's longcat arm (compute per patch)"),
}


def make(name: str) -> pathlib.Path:
    """Train (or find) model ``name``, write its weights, then measure the stored model's test
    accuracy (full test set) and store it beside them; returns the file. A file that has its
    accuracy is left alone. For a model with null experts it prints the stored model's mean real
    experts per patch on the test set."""
    label, make_config, arm, origin = MODELS[name]
    path = OUT / f"{name}.npz"
    if not path.exists():
        cfg = make_config()
        folder = V2_RUNS / f"{arm}-s{V2_SEED}" if arm else RUNS / name
        if arm and (folder / "result.json").exists():
            model, saved = train.load_trained(folder)
            if saved != cfg:
                sys.exit(f"{folder} was trained with another configuration than {name}'s")
            print(f"{name}: from the v2 run {folder}")
        else:
            folder = RUNS / name
            study.run_cell(cfg, folder, progress=True, label=label)
            model, _ = train.load_trained(folder)
        OUT.mkdir(parents=True, exist_ok=True)
        explorer.save_weights(model, cfg, path, label=label)
    model, cfg, info = explorer.load_weights(path)
    if info["accuracy"] is None or info["origin"] != origin or info["label"] != label:
        accuracy = info["accuracy"]
        if accuracy is None:
            accuracy = evaluate.accuracy(model, train.load_data(cfg)[1])
            print(f"{name}: test accuracy of the stored model {accuracy:.4f}")
        explorer.save_weights(model, cfg, path, label=label, accuracy=accuracy, origin=origin)
    if cfg.model.null_experts:  # the routing covers the real experts only: a patch's experts are its real ones
        _, layers = evaluate.routing_record(model, train.load_data(cfg)[1].images)
        means = ", ".join(f"{layer['hits'].sum(-1).mean():.3f}" for layer in layers)
        print(f"{name}: real experts per patch on the test set, by MoE layer: {means}")
    print(f"{name}: {path} ({path.stat().st_size / 1e6:.2f} MB)")
    return path


if __name__ == "__main__":
    names = sys.argv[1:] or list(MODELS)
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        sys.exit(f"unknown model(s) {unknown}; expected some of {list(MODELS)}")
    for name in names:
        make(name)
