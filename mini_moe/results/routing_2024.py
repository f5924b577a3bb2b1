"""The training runs behind chapters 12 and 13 (issue 26): routing since 2024 on ``patch_vote``.

Usage (from the repository root, one training at a time, pinned to one core)::

    taskset -c 1 .venv/bin/python mini_moe/results/routing_2024.py [ARM ...]          # v1
    taskset -c 1 bash mini_moe/results/routing_2024_v2.sh                             # v2

**v1** (issue 26, exploratory): :data:`ARMS` on seeds 0-2, ``routing_2024-<MACHINE>.json``.
**v2** (issue 35, registered in ``routing_2024_v2-preregistration.md`` before its first run):
:data:`ARMS_V2` on :data:`SEEDS_V2`, ``routing_2024_v2-<MACHINE>.json``; ``STUDY=v2`` selects it.
A v2 run refuses to train unless ``mini_moe`` is imported from a clean checkout of the pinned
commit ``SOURCE`` (:func:`mini_moe.confirm.require_pinned`; the shell script pins it in a detached
worktree), records that commit, and with ``COMMIT=1`` commits the results file after every run.
``SEEDS="0 3"`` restricts the seeds (one process per core, each re-reading the file before it
adds its run).

Every arm (:data:`ARMS`) trains the ``patch_vote`` ViT of chapter 8 (:mod:`mini_moe.confirm`'s
task, model and schedule: 2,000 steps, E = 8 experts in every second block) with one router or
layer variant, on :data:`SEEDS`. The seeds run one after the other, every arm of a seed before
the next seed, so a stopped run holds complete paired seeds. Each run trains under
``runs/routing_2024/`` (git-ignored) and, when it finishes, its record is written to
``mini_moe/results/routing_2024-<MACHINE>.json``: the config, test accuracy, the mechanism metrics
of :func:`mini_moe.evaluate.mechanisms`, the training log every 100 steps (loss, accuracy and the
router's metrics: dropped tokens, the load's max violation, the bias spread, ...), and per MoE
layer the tokens each expert processed and the histogram of experts per token on the test set,
and the CPU it trained on (``cpu``: times compare only between runs on the same machine). Runs
already recorded are skipped, so the script resumes.

Activated FLOPs per token: the k = 1 arms (coarse, fine-grained with or without a shared expert,
dropless) activate the same; ``tc_c2`` has twice the slots, the k = 2 arms activate twice the
experts, and ReMoE's count varies per token (about one on average). What is computed differs
again: v1's ``remoe`` had buffers of T slots and so computed every expert on every token (8x);
v2's runs it on the dropless path, which computes only the picks made.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import time

import numpy as np

from mini_moe import bench, confirm, evaluate, study, train
from mini_moe import config as config_lib

MACHINE = os.environ.get("MACHINE", "cpu-2core-xeon")
V2 = os.environ.get("STUDY") == "v2"
OUT = pathlib.Path(f"mini_moe/results/routing_2024{'_v2' if V2 else ''}-{MACHINE}.json")
RUNS = pathlib.Path("runs/routing_2024" + ("_v2" if V2 else ""))
SEEDS = (0, 1, 2)
#: v2's seeds: the smallest n for which the paired t-test over n seeds has power >= 0.8 for a
#: 3-point difference at Holm's first-step level 0.05 / 9, with the largest paired SD of v1 (1.11
#: points, remoe - dropless): n = 6 gives 0.89, n = 5 gives 0.69 (:func:`mini_moe.study.paired_power`).
SEEDS_V2 = (10, 11, 12, 13, 14, 15)  # new seeds: v1 (exploratory) used 0-2
COMMAND = ("taskset -c 1 bash mini_moe/results/routing_2024_v2.sh" if V2 else
           "taskset -c 1 .venv/bin/python mini_moe/results/routing_2024.py")
PREREGISTRATION = pathlib.Path("mini_moe/results/routing_2024_v2-preregistration.md")

TC = "softmax_token_choice"
SWITCH = {"k": 1, "capacity_factor": 1.0, "balance_loss": "switch"}
#: The arms as name -> (router, model overrides, router options).
ARMS = {
    # chapter 12: balancing with a loss (per routing group or per batch) or with a bias
    "tc_switch": (TC, {}, SWITCH),
    "tc_switch_batch": (TC, {}, SWITCH | {"balance_scope": "batch"}),
    "loss_free": ("sigmoid_loss_free", {}, {"k": 1, "capacity_factor": 1.0, "bias_rate": 1e-3}),
    "sigmoid_no_bias": ("sigmoid_loss_free", {}, {"k": 1, "capacity_factor": 1.0, "bias_rate": 0.0}),
    # at k = 1 the sigmoid router's gate, normalised over the one chosen expert, is exactly 1, so
    # the task loss sends its weights no gradient; at k = 2 (c = 2) it does: both routers again
    "tc_switch_k2": (TC, {}, SWITCH | {"k": 2, "capacity_factor": 2.0}),
    "loss_free_k2": ("sigmoid_loss_free", {}, {"k": 2, "capacity_factor": 2.0, "bias_rate": 1e-3}),
    # chapter 13: equal activated FLOPs with finer experts (m = 4: 32 experts of 16 hidden units,
    # k = 4) and with one of them shared (k = 3 routed); capacity and dropless
    "fine": (TC, {"model_fine_grained": 4}, SWITCH),
    "fine_shared": (TC, {"model_fine_grained": 4, "model_shared_experts": 1}, SWITCH),
    "tc_c2": (TC, {}, SWITCH | {"capacity_factor": 2.0}),
    "dropless": (TC, {"model_moe_path": "dropless"}, SWITCH),
    # ReMoE aims at k = 1 expert per token on average; a buffer of C = T slots per expert
    # (capacity factor E) drops nothing, like the dropless path, and is 3x faster on CPU
    "remoe": ("remoe", {}, {"k": 1, "capacity_factor": 8.0}),
}

SIGMOID_K2 = {"k": 2, "capacity_factor": 2.0}
#: v2's arms (issue 35): the headline contrasts of chapters 12 and 13 with the confounds split. At
#: k = 2 (c = 2) the gating is held fixed (DeepSeek-V3's sigmoid, no noise) and only the balancing
#: changes, as in V3's ablations: the bias (``loss_free_k2``), a balancing loss per routing group
#: (V3's sequence-wise loss, ``seq_balance = 1`` times the training's aux_loss_weight 0.01 = the
#: Switch loss's weight; Table 5's auxiliary-loss baseline) or over the batch (Sec. 4.5.3's
#: batch-wise loss). ReMoE runs on the dropless path (the baseline its paper compares with, and it
#: then computes only the picks it makes).
ARMS_V2 = {
    "tc_switch": ARMS["tc_switch"],
    "tc_switch_batch": ARMS["tc_switch_batch"],
    "tc_switch_k2": ARMS["tc_switch_k2"],
    "sig_loss_k2": ("sigmoid_loss_free", {}, SIGMOID_K2 | {"bias_rate": 0.0, "seq_balance": 1.0}),
    "sig_batch_loss_k2": ("sigmoid_loss_free", {}, SIGMOID_K2 | {"bias_rate": 0.0, "seq_balance": 1.0,
                                                                "balance_scope": "batch"}),
    "loss_free_k2": ("sigmoid_loss_free", {}, SIGMOID_K2 | {"bias_rate": 1e-3}),
    "fine": ARMS["fine"],
    "fine_shared": ARMS["fine_shared"],
    "dropless": ARMS["dropless"],
    # every positive gate kept, as the registered runs did (they predate the pick bound, which is
    # opt-in since review F1 of 2026-11-28; pinned so that a change of default cannot change the arm)
    "remoe": ("remoe", {"model_moe_path": "dropless"}, {"k": 1, "active_bound": None}),
}
#: v2's family, declared before its first run: (a, b) tests mean(a - b) over paired seeds,
#: two-sided paired t, Holm over all nine at 0.05.
CONTRASTS_V2 = [
    ("loss_free_k2", "sig_loss_k2"),  # ch12: the bias against a per-group loss, same gating (V3 Table 5)
    ("loss_free_k2", "sig_batch_loss_k2"),  # ch12: the bias against a batch-wise loss (V3 Sec. 4.5.3)
    ("sig_loss_k2", "tc_switch_k2"),  # ch12: sigmoid against noisy softmax gating, both with a per-group loss
    ("tc_switch_batch", "tc_switch"),  # ch12: the Switch loss over the batch against per group (Qiu et al.)
    ("fine", "tc_switch"),  # ch13: fine-grained experts against coarse at c = 1 (granularity and drops)
    ("fine", "dropless"),  # ch13: fine-grained against a coarse layer that drops nothing (granularity)
    ("dropless", "tc_switch"),  # ch13: dropping nothing against c = 1 (drops)
    ("fine_shared", "fine"),  # ch13: one shared expert among the fine ones
    ("remoe", "dropless"),  # ch13: ReMoE against the dropless Top-K MoE its paper compares with
]
if V2:
    ARMS, SEEDS = ARMS_V2, SEEDS_V2
if os.environ.get("SEEDS"):
    SEEDS = tuple(int(s) for s in os.environ["SEEDS"].split())
KEEP_EVERY = 100  # steps between the kept rows of the training log


def config(arm: str, seed: int, arms: dict | None = None) -> config_lib.TrainConfig:
    """The :class:`~mini_moe.config.TrainConfig` of one run of ``arms`` (default: this study's
    :data:`ARMS`; :data:`ARMS_V2` names v2's whatever ``STUDY`` says)."""
    router, model, options = (ARMS if arms is None else arms)[arm]
    return config_lib.get_config(confirm.SCALE, dataset=confirm.DATASET, router=router, seed=seed,
                                 model_placement="every2", model_router_kwargs=options, **model,
                                 **confirm.OVERRIDES)


def contrasts_v2(runs: list[dict], *, contrasts=CONTRASTS_V2, seeds=SEEDS_V2, alpha: float = 0.05) -> list[dict]:
    """v2's registered analysis (routing_2024_v2-preregistration.md): for each contrast (a, b) the
    mean of a - b in test accuracy over the paired ``seeds``, a two-sided paired t-test (df =
    seeds - 1; :func:`mini_moe.study.paired_t`, 95 % CI unadjusted), Holm's adjustment over the
    whole family (``p_holm``) and the registered wording (``verdict``, in points, "after 2,000
    steps"). Refuses an incomplete family: every arm of every contrast needs every seed."""
    by_key = {(r["arm"], r["seed"]): r for r in runs}
    missing = sorted({(arm, seed) for pair in contrasts for arm in pair for seed in seeds} - set(by_key))
    if missing:
        raise ValueError(f"the v2 family needs every seed of every arm; missing {len(missing)} run(s), e.g. "
                         f"{missing[:3]}: run mini_moe/results/routing_2024_v2.sh")
    rows = []
    for a, b in contrasts:
        diffs = [by_key[a, seed]["test_accuracy"] - by_key[b, seed]["test_accuracy"] for seed in seeds]
        rows.append({"a": a, "b": b, "differences": diffs, **study.paired_t(diffs)})
    for row, p in zip(rows, study.holm([r["p_value"] for r in rows])):
        row["p_holm"] = p
        row["verdict"] = study.verdict(row, unit=" points", scale=100, alpha=alpha) + " after 2,000 steps"
    return rows


#: v1's family (exploratory, chosen with its runs; chapter 13): the three layouts; the two ways to drop
#: nothing against c = 1; fine-grained experts against the coarse layers that drop nothing
#: (granularity or avoided drops?); ReMoE against c = 1 and against the dropless Top-K layer its
#: paper compares with. Holm over the nine.
ARMS_V1_CH13 = ("tc_switch", "fine", "fine_shared", "tc_c2", "dropless", "remoe")
CONTRASTS_V1 = [("fine", "tc_switch"), ("fine_shared", "tc_switch"), ("fine_shared", "fine"),
                ("tc_c2", "tc_switch"), ("dropless", "tc_switch"), ("fine", "dropless"), ("fine", "tc_c2"),
                ("remoe", "tc_switch"), ("remoe", "dropless")]


def analysis_v1(results: dict) -> dict:
    """Chapter 13's reading of v1 (``routing_2024-cpu-2core-xeon.json``, exploratory): on the seeds
    where every arm of :data:`ARMS_V1_CH13` ran, ``contrasts`` (:data:`CONTRASTS_V1`, paired t over
    the seeds with Holm over the nine, ``verdict`` in points) and per arm ``arms[arm]``: test
    accuracy (mean and SD over the seeds), ``dropped_tokens`` (no expert at the last training step),
    ``dropped_picks`` per layer on the test set (the share of picks that found a full buffer; None
    for ReMoE, whose buffers of C = T slots hold every token: the file's value for it is superseded,
    see its ``errata``), ``ms_per_step`` and ``gflop`` (one training step, XLA's count)."""
    runs = {arm: {r["seed"]: r for r in results["runs"] if r["arm"] == arm} for arm in ARMS_V1_CH13}
    seeds = sorted(set.intersection(*(set(by_seed) for by_seed in runs.values())))
    if len(seeds) < 2:
        raise ValueError(f"v1's contrasts need two seeds with every arm of {ARMS_V1_CH13}; have {seeds}.")
    for s in seeds:  # ReMoE's buffers hold every token (C = T): none of its picks can drop
        m = runs["remoe"][s]["config"]["model"]
        assert dict(m["router_kwargs"])["capacity_factor"] >= m["num_experts"]
    cells = [{**runs[arm][s], "router": arm, "capacity": 1.0, "seed": s} for arm in ARMS_V1_CH13 for s in seeds]
    rows = [{"a": a, "b": b, **study.compare(cells, a, b)} for a, b in CONTRASTS_V1]
    for row, p in zip(rows, study.holm([r["p_value"] for r in rows])):
        row["p_holm"] = p
        row["verdict"] = study.verdict(row, unit=" points", scale=100)

    def mean(values):
        return float(np.mean(list(values)))

    arms = {}
    for arm, by_seed in runs.items():
        chosen = [by_seed[s] for s in seeds]
        accuracy = [r["test_accuracy"] for r in chosen]
        layers = len(chosen[0]["mechanisms"]["layers"])
        arms[arm] = {
            "test_accuracy": mean(accuracy), "test_sd": float(np.std(accuracy, ddof=1)),
            "dropped_tokens": mean(r["train_log"][-1]["router/dropped"] for r in chosen),
            "dropped_picks": None if arm == "remoe" else
            [mean(r["mechanisms"]["layers"][i]["dropped_routes"] for r in chosen) for i in range(layers)],
            "ms_per_step": 1000 * mean(r["train_seconds"] for r in chosen) / mean(r["steps"] for r in chosen),
            "gflop": mean(r["step_flops"] for r in chosen) / 1e9,
        }
    superseded = mean(layer["dropped_routes"] for s in seeds for layer in runs["remoe"][s]["mechanisms"]["layers"])
    return {"seeds": seeds, "contrasts": rows, "arms": arms, "remoe_superseded_dropped_routes": superseded}


def descriptive_v2(runs: list[dict], arm: str) -> dict:
    """v2's registered descriptive numbers of one arm, mean over its runs (not tested):

    ``test_accuracy`` (and ``test_sd``, over seeds), ``train_loss`` (the logged single-batch losses
    at steps 1,900 and 2,000, the last 100 steps as far as the record keeps them: one row per 100
    steps), per MoE layer on the 10,000 test images ``no_expert`` (tokens that reach no expert) and
    ``experts_per_token``; at the last training step ``max_violation`` (the batch's maximal load
    violation), ``dropped_picks`` (1 - experts per token / routed picks, k m - shared for m fine-grained
    parts; None without a k cap, ReMoE) and
    ``no_expert_last_step``; ``step_flops``; and ``seeds``."""
    chosen = [r for r in runs if r["arm"] == arm]
    if not chosen:
        raise ValueError(f"no run of arm {arm!r}")
    last = [r["train_log"][-1] for r in chosen]
    # routed picks per token: k of each of the m fine-grained parts, less the shared experts
    ks = {None if dict(r["config"]["model"]["router_kwargs"]).get("k") is None else
          dict(r["config"]["model"]["router_kwargs"])["k"] * r["config"]["model"].get("fine_grained", 1)
          - r["config"]["model"].get("shared_experts", 0) for r in chosen}
    k = ks.pop() if len(ks) == 1 else None
    capped = chosen[0]["router"] != "remoe" and k is not None
    layers = len(chosen[0]["mechanisms"]["layers"])
    accuracy = [r["test_accuracy"] for r in chosen]
    return {
        "seeds": sorted(r["seed"] for r in chosen),
        "test_accuracy": float(np.mean(accuracy)),
        "test_sd": float(np.std(accuracy, ddof=1)) if len(accuracy) > 1 else float("nan"),
        "train_loss": float(np.mean([row["loss"] for r in chosen for row in r["train_log"]
                                     if row["step"] > r["steps"] - 101])),
        "no_expert": [float(np.mean([r["mechanisms"]["layers"][i]["unprocessed"] for r in chosen]))
                      for i in range(layers)],
        "experts_per_token": [float(np.mean([r["mechanisms"]["layers"][i]["experts_per_token"] for r in chosen]))
                              for i in range(layers)],
        "max_violation": float(np.mean([row["router/max_violation"] for row in last])),
        "dropped_picks": float(np.mean([1 - row["router/experts_per_token"] / k for row in last])) if capped else None,
        "no_expert_last_step": float(np.mean([row["router/dropped"] for row in last])),
        "step_flops": float(np.mean([r["step_flops"] for r in chosen])),
    }


def routed_counts(model, images: np.ndarray) -> list[dict]:
    """Per MoE layer, on ``images``: the tokens each expert processed and the histogram of the
    number of experts that processed each token (index n: tokens processed by n experts)."""
    _, layers = evaluate.predictions_and_routing(model, images)
    out = []
    for hits, _ in layers:
        per_token = hits.sum(-1).ravel().astype(int)
        out.append({"processed": hits.sum((0, 1)).astype(int).tolist(),
                    "experts_per_token_histogram": np.bincount(per_token, minlength=hits.shape[-1] + 1).tolist()})
    return out


def run(arm: str, seed: int) -> dict:
    """Train (or resume) one run and return its record."""
    cfg = config(arm, seed)
    folder = RUNS / f"{arm}-s{seed}"
    result = study.run_cell(cfg, folder, progress=False, label=arm)
    model, _ = train.load_trained(folder)
    test = train.load_data(cfg)[1]
    history = json.loads((folder / "history.json").read_text())
    log = [row for row in history["train"] if row["step"] % KEEP_EVERY == 0]
    return {"arm": arm, "router": ARMS[arm][0], "seed": seed,
            "config": json.loads(json.dumps(dataclasses.asdict(cfg), default=list)),
            **{k: result[k] for k in ("test_accuracy", "ten_shot_accuracy", "steps", "train_seconds", "step_flops",
                                      "mechanisms", "eval")},
            "train_log": log, "layers": routed_counts(model, test.images)}


def _read() -> dict:
    if OUT.exists():
        return json.loads(OUT.read_text())
    what = ("issue 35: chapters 12 and 13's registered runs on patch_vote (v2)" if V2 else
            "issue 26: chapters 12 and 13's runs on patch_vote")
    record = {"what": what, "command": COMMAND, "machine": bench.machine(), "seeds": list(SEEDS_V2 if V2 else SEEDS),
              "arms": {a: list(ARMS[a]) for a in ARMS}, "runs": []}
    if V2:
        record |= {"contrasts": CONTRASTS_V2, "preregistration": str(PREREGISTRATION)}
    return record


def main(arms) -> None:
    if V2:  # refuse to train with other code than the pinned commit (the .sh refuses before the registration)
        source = os.environ.get("SOURCE", "")
        if not source:
            sys.exit("STUDY=v2 needs SOURCE=<pinned commit> (routing_2024_v2.sh sets it)")
        state = confirm.require_pinned(source)
    for seed in SEEDS:
        for arm in arms:
            if (arm, seed) in {(r["arm"], r["seed"]) for r in _read()["runs"]}:
                continue
            tick = time.perf_counter()
            entry = {**run(arm, seed), "cpu": bench.machine()["cpu"]}
            if V2:
                entry |= {"source_commit": state["commit"], "source_dirty": state["dirty"]}
            record = _read()  # another process (the other core) may have added runs meanwhile
            record["runs"].append(entry)
            record["machine"]["date_last"] = bench.machine()["date"]
            OUT.write_text(json.dumps(record, indent=1) + "\n")
            print(f"{arm}-s{seed}: acc={100 * entry['test_accuracy']:.2f} train_s={entry['train_seconds']} "
                  f"wall_s={time.perf_counter() - tick:.0f}", flush=True)
            if os.environ.get("COMMIT") == "1":  # commit the record alone, as the run finishes
                subprocess.run(["bash", "-c", f'source mini_moe/results/commit_result.sh && '
                                f'commit_result {OUT} "routing_2024 {"v2" if V2 else "v1"}: {arm}-s{seed}"'],
                               check=False)


if __name__ == "__main__":
    unknown = [a for a in sys.argv[1:] if a not in ARMS]
    if unknown:
        sys.exit(f"unknown arms {unknown}; arms: {', '.join(ARMS)}")
    main(sys.argv[1:] or list(ARMS))
