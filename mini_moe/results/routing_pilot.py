"""The exploratory pilot of issue 34: does learned routing matter, or only the experts' capacity?

Usage (from the repository root, one training at a time, pinned to one core)::

    COMMIT=1 taskset -c 1 .venv/bin/python mini_moe/results/routing_pilot.py GROUP [GROUP ...]

(``COMMIT=1``: commit the results file after every run.)

Each GROUP names a list of runs (:data:`GROUPS`). Every run is one
:func:`mini_moe.study.run_cell` of :func:`mini_moe.study.cell_config` (the confirmatory
runner's code path), trained under ``runs/routing-pilot/`` (git-ignored) on the training split
less 10,000 validation images (:func:`mini_moe.train.load_data` with ``validation``: the held-out
images are fixed for every run, and every split is standardised with the remaining training
images' statistics; see :func:`splits` for the runs recorded before that): its evaluations
during training are on the validation images. After training, the test
accuracy and, on ``subtask_vote``, the routing accuracy against the right routing
(:func:`mini_moe.evaluate.routing_accuracy`) are measured on the test split. After each run,
finished or failed, its record goes into ``mini_moe/results/routing-pilot-<MACHINE>.json``
(``MACHINE``, default ``cpu-2core-xeon``), with the command and the full config. Runs already
recorded are skipped, so the pilot resumes. The pilot is exploratory: it chooses the task's
difficulty and the schedules; its seeds (0-2) are never reused, its p-values are not a result.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shlex
import subprocess
import sys
import time
import traceback

import numpy as np

from mini_moe import bench, data, evaluate, study, train

MACHINE = os.environ.get("MACHINE", "cpu-2core-xeon")
# On a lent accelerator (no git there): PILOT_OUT and PILOT_RUNS move the record and the runs,
# SOURCE_COMMIT / SOURCE_DIRTY say which checkout was sent, DEADLINE (seconds) stops starting runs
# that would not finish in time, SEEDS (e.g. "0,1") runs only those seeds.
OUT = pathlib.Path(os.environ.get("PILOT_OUT", f"mini_moe/results/routing-pilot-{MACHINE}.json"))
RUNS = pathlib.Path(os.environ.get("PILOT_RUNS", "runs/routing-pilot"))
DEADLINE = time.monotonic() + float(os.environ.get("DEADLINE", "inf"))
VALIDATION = 10_000

DENSE, TC, EC, HASH = None, "softmax_token_choice", "softmax_expert_choice", "hash"
TC_FROZEN, EC_FROZEN = "softmax_token_choice_frozen", "softmax_expert_choice_frozen"


def run(router, seed, dataset="subtask_vote", capacity=1.0, **overrides):
    return dict(router=router, seed=seed, dataset=dataset, capacity=capacity, overrides=overrides)


#: The pilot's runs, by group, in the order they were planned.
GROUPS = {
    # the teachers' width h against the experts' 64 (content d = 4): where does one dense MLP of
    # equal activated FLOPs fall behind, and does learned routing beat frozen routing there?
    # (Stopped after 3 of 12 runs: at h = 4 every arm stayed near 30 % after 2,000 steps, so the
    # per-token probe below came first; the Token Choice run was killed unfinished.)
    "calibrate": [run(r, 0, dataset=f"subtask_vote_d4_h{h}") for h in (4, 16, 64)
                  for r in (DENSE, EC, EC_FROZEN, TC)],
    # the easiest teacher (h = 1) with a longer cap: does the image-level vote learn the values?
    "calibrate_long": [run(r, 0, dataset="subtask_vote_d4_h1", steps=6000, eval_every=500)
                       for r in (DENSE, EC, EC_FROZEN)],
    # faster learning within a 10-minute run (4,000 steps here): twice the learning rate, or a
    # 2-dimensional content
    # (split in two groups so that the two cores can run them side by side)
    "speed_lr": [run(r, 0, dataset="subtask_vote_d4_h1", steps=4000, eval_every=500, learning_rate=4e-3)
                 for r in (DENSE, EC)],
    "speed_d2": [run(r, 0, dataset="subtask_vote_d2_h1", steps=4000, eval_every=500) for r in (DENSE, EC)],
}
# On a lent H100 (device tool, one call, one process per arm side by side on the GPU):
# calibrate_long's task twice as long, with every routing arm and two seeds: does learned routing
# find the sub-tasks given time, and beat frozen or hashed routing? max_seconds bounds a run so that
# the call returns within its limit (a capped run records the steps it reached).
for _label, _router in (("dense", DENSE), ("ec", EC), ("ec_frozen", EC_FROZEN), ("tc", TC),
                        ("tc_frozen", TC_FROZEN), ("hash", HASH)):
    GROUPS[f"gpu_long_{_label}"] = [run(_router, s, dataset="subtask_vote_d4_h1", steps=12000, eval_every=1000,
                                        max_seconds=400) for s in (0, 1)]
    # next (gpu_long left every arm at 80-94 % with a 3-13 point seed spread): the harder teachers,
    # where one expert-sized MLP loses most in the token probe (ran on a lent H100 without hash:
    # seed 0 of both, seed 1 of h = 4; see the results README)
    for _h in (4, 16):
        GROUPS[f"gpu_h{_h}_{_label}"] = [run(_router, s, dataset=f"subtask_vote_d4_h{_h}", steps=12000,
                                             eval_every=1000, max_seconds=400) for s in (0, 1)]

# The capacity task at convergence (study audit 2026-11-25, finding 3 and next experiment 1):
# chapter 8's verdicts hold after 2,000 steps at one shared, untuned learning rate. This group is the
# pilot of an amendment that registers up to three patch_vote contrasts at convergence: each arm at
# three learning rates, a cosine schedule over at most 5,000 steps, stopped early when validation
# accuracy has not risen by 0.2 points within 1,500 steps; the dense ViT of equal activated FLOPs,
# Expert Choice at c = 1, the dense ViT with MLPs of 256 units (0.92 times the MoE model's
# parameters), and Expert Choice frozen (on a task with no right routing, does learning the router
# matter?). Seeds 0 and 1, one group per seed so that the two cores can share the work.
# The first version of this group (d1808eb) had the grid {1e-3, 2e-3, 4e-3}, 6,000 steps capped at
# 570 s of training, and Token Choice as a fifth arm. Its first run (dense, 1e-3, seed 0) learned
# slowly (28.4 % validation accuracy at step 3,000, where chapter 8's dense ViT is at 72 % after
# 2,000 steps at 2e-3) and took 110 ms a step on one core, so the time cap would have cut most runs
# at a step that depends on the machine's load. So the grid moved up, the cap became 5,000 steps
# with no time limit (the wide dense ViT takes longer than 10 minutes; it checkpoints every 500
# steps), and Token Choice, for which the amendment has no contrast left, was dropped. That first
# run stays in the record.
for _seed in (0, 1):
    GROUPS[f"capacity_s{_seed}"] = [
        run(r, _seed, dataset="patch_vote", steps=5000, eval_every=500, patience=1500, min_delta=0.002,
            learning_rate=lr, **extra)
        for r, extra in ((DENSE, {}), (EC, {}), (DENSE, {"model_mlp_dim": 256}), (EC_FROZEN, {}))
        for lr in (2e-3, 4e-3, 8e-3)]

# The pixel task again, with standardised inputs (every run above trained on raw images, a bug of
# this script until 2026-11-26): does the learned router find the sub-tasks now? d = 4, h = 4,
# 4,000 steps, seed 0, on one CPU core, to compare with calibrate (2,000 steps) and gpu_h4 (12,000).
GROUPS["pixel_standardised"] = [run(r, 0, dataset="subtask_vote_d4_h4", steps=4000, eval_every=500)
                                for r in (EC, DENSE, EC_FROZEN)]

# Issue 51's pilot: a harder subtask_vote, asked at fixed budgets. Every run holds its learning rate
# after a 100-step warmup (schedule "constant"), so its validation curve, evaluated every 250 steps,
# gives every budget (500, 1,000, 2,000, 3,000 steps) from one run. Calibration first: teachers wider
# than the experts (h = 16, 64), a larger content (d = 6), and signatures of norm 2 or 1 (in content
# standard deviations; 4 until now) so that a patch's appearance hides its sub-task from a random
# projection. The three targets at the largest budget: the dense ViT of equal activated FLOPs
# at least 10 points below the best MoE, a frozen router's first MoE layer routing at most half of the
# patches home, the best arm below 95 %. Seed 0, the three arms that decide them.
def _v3(router, seed, dataset, learning_rate=2e-3, **extra):
    return run(router, seed, dataset=dataset, steps=3000, eval_every=250, schedule="constant",
               learning_rate=learning_rate, **extra)


for _task in ("d4_h16_s2", "d4_h64_s2", "d6_h16_s2", "d4_h16_s1", "d4_h64_s1", "d8_h16_s2"):
    GROUPS[f"v3_cal_{_task}"] = [_v3(r, 0, f"subtask_vote_{_task}") for r in (DENSE, EC, EC_FROZEN)]
# Signatures of norm 1 at d = 8, the frozen router first (does a fixed router still find the sub-tasks?)
GROUPS["v3_cal_d8_h16_s1"] = [_v3(r, 0, "subtask_vote_d8_h16_s1") for r in (EC_FROZEN, EC, DENSE)]
# d8_h16_s2 met two targets (dense 71.0 %, Expert Choice 82.2 %) but not the third: its frozen router's
# first MoE layer routed 0.60 of the patches home (0.56 at s1). Signatures of norm 0.5:
GROUPS["v3_cal_d8_h16_s0.5"] = [_v3(r, 0, "subtask_vote_d8_h16_s0.5") for r in (EC_FROZEN, EC, DENSE)]
# At s1 and s0.5 the frozen router's first MoE layer still routed 0.56 and 0.59 home, and at s1 the
# dense ViT came within 2 points of Expert Choice: is d8_h16_s2's 11-point gap a seed's? Seed 1:
GROUPS["v3_cal_d8_h16_s2_seed1"] = [_v3(r, 1, "subtask_vote_d8_h16_s2") for r in (DENSE, EC, EC_FROZEN)]
# (d4_h16_s2 put Expert Choice only 1.9 points above the dense ViT, both near 90 %; d4_h64_s2 was
# stopped after its dense run (89.5 %). A per-token probe (token_probe, h = 16, not recorded: 3,000
# steps, one expert-sized MLP on all eight sub-tasks) fell from 0.67 value accuracy at d = 4 to 0.56
# at d = 6 and 0.55 at d = 8, against 0.86-0.87 on one sub-task: a larger content is the knob.)

#: Per-token probes (no ViT): one GELU MLP 49 -> width -> 10 trained with labels on the value of
#: single patches, on one sub-task's patches or on all eight (``"tasks"``), 3,000 Adam steps
#: (3e-3) of 512 patches, value accuracy on 20,000 fresh patches. The capacity argument of
#: :func:`mini_moe.data.subtask_vote` measured directly: does one expert-sized MLP hold one
#: teacher but not eight?
PROBES = {"token_probe": [dict(content=4, teacher=h, tasks=t, width=w) for h in (1, 4, 16)
                          for t, w in ((1, 64), (8, 64), (8, 512))]}


#: Routing before training (no ViT is trained): the frozen Expert Choice model at initialisation,
#: whose router weights are the ones its trained run keeps, measured against the right routing on the
#: test split (standardised as training does). How much of the sub-task sorting does a random
#: projection of an untrained network do, against the 0.56-0.62 of the trained frozen runs?
INIT_ROUTING = {"init_routing": [dict(dataset=f"subtask_vote_{t}", seed=seed) for t in
                                 ("d4_h4", "d4_h16_s2", "d8_h16_s2", "d8_h16_s1", "d8_h16_s0.5") for seed in (0, 1)]}


def init_routing(dataset: str, seed: int) -> dict:
    """Routing accuracy per MoE layer of the untrained frozen Expert Choice model of ``seed``."""
    cfg = study.cell_config(EC_FROZEN, 1.0, seed, dataset=dataset, scale="quick")
    _, _, test = splits(cfg)
    model = train.make_model(cfg)
    model.eval()
    tasks, _ = data.subtask_vote_tasks("test", **data.subtask_vote_options(dataset))
    return {"routing": [{k: v for k, v in layer.items() if k != "counts"}
                        for layer in evaluate.routing_accuracy(model, test.images, tasks)]}


def token_probe(content: int, teacher: int, tasks: int, width: int, *, steps: int = 3000, seed: int = 0) -> dict:
    """One per-token probe of :data:`PROBES` (sub-tasks ``0..tasks-1``): value accuracy on fresh patches."""
    import jax
    import jax.numpy as jnp
    import optax

    model = data.subtask_vote_teacher(content, teacher, 0)
    rng = np.random.default_rng(seed)

    def sample(n):
        k, z = rng.integers(0, tasks, n), rng.standard_normal((n, content))
        values = np.empty(n, np.int64)
        for t in range(tasks):
            values[k == t] = model.values(t, z[k == t])
        return jnp.asarray((model.pixels(k, z).reshape(n, -1) - 0.5) * 8), jnp.asarray(values)

    k1, k2 = jax.random.split(jax.random.key(seed))
    params = {"w1": jax.random.normal(k1, (49, width)) / 7, "b1": jnp.zeros(width),
              "w2": jax.random.normal(k2, (width, 10)) / np.sqrt(width), "b2": jnp.zeros(10)}
    opt = optax.adam(3e-3)
    state = opt.init(params)
    logits = lambda p, x: jax.nn.gelu(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]
    loss = lambda p, x, y: optax.softmax_cross_entropy_with_integer_labels(logits(p, x), y).mean()

    @jax.jit
    def step(p, s, x, y):
        updates, s = opt.update(jax.grad(loss)(p, x, y), s)
        return optax.apply_updates(p, updates), s

    tick = time.perf_counter()
    for _ in range(steps):
        params, state = step(params, state, *sample(512))
    x, y = sample(20_000)
    return {"value_accuracy": float(jnp.mean(logits(params, x).argmax(-1) == y)),
            "seconds": round(time.perf_counter() - tick, 1)}


def name(spec) -> str:
    extra = "".join(f"-{k.removeprefix('model_')}{v}" for k, v in sorted(spec["overrides"].items()))
    return f"{spec['dataset']}{extra}-{study.cell_name(spec['router'], spec['capacity'], spec['seed'])}"


def splits(cfg):
    """``(train, validation, test)`` of ``cfg.dataset``: the training split less the validation
    images, every split standardised with the remaining training images' statistics, as training
    always standardises (:func:`mini_moe.train.load_data`). Until 2026-11-26 (the commit that wrote
    this sentence) it returned the raw images: every run whose record has no ``inputs`` field
    trained and was measured on unstandardised images (the results README says what that
    changed)."""
    return train.load_data(cfg, validation=VALIDATION)


def test_measures(out_dir, dataset: str, test) -> dict:
    """Test accuracy and, on ``subtask_vote``, routing against the right routing, of a trained run."""
    model, _ = train.load_trained(out_dir)
    out = {"test_accuracy": evaluate.accuracy(model, test)}
    options = data.subtask_vote_options(dataset)
    if options is not None and model.cfg.router is not None:
        tasks, _ = data.subtask_vote_tasks("test", **options)
        out["routing"] = evaluate.routing_accuracy(model, test.images, tasks)
    return out


def main(groups) -> None:
    record = json.loads(OUT.read_text()) if OUT.exists() else {
        "what": "issue 34 pilot (exploratory): every run, finished or failed; validation = "
                f"{VALIDATION} training images held out (data.validation_split, seed 0)",
        "machine": bench.machine(), "runs": []}
    done = {r["name"] for r in record["runs"] if r["status"] == "ok"}
    for group in [g for g in groups if g in PROBES]:
        for spec in PROBES[group]:
            run_name = "token_probe-d{content}-h{teacher}-tasks{tasks}-width{width}".format(**spec)
            if run_name in done:
                continue
            entry = {"name": run_name, "group": group, "status": "ok", "seed": 0, **spec,
                     "command": f"COMMIT=1 taskset -c 1 .venv/bin/python mini_moe/results/routing_pilot.py {group}",
                     **token_probe(**spec)}
            record["runs"].append(entry)
            OUT.write_text(json.dumps(record, indent=1) + "\n")
            print(f"{run_name}: {entry['value_accuracy']:.3f}", flush=True)
        if os.environ.get("COMMIT") == "1":
            subprocess.run(["bash", "-c", f'source mini_moe/results/commit_result.sh && '
                            f'commit_result {OUT} "issue 34 pilot: {group}"'], check=False)
    for group in [g for g in groups if g in INIT_ROUTING]:
        for spec in INIT_ROUTING[group]:
            run_name = "init_routing-{dataset}-s{seed}".format(**spec)
            if run_name in done:
                continue
            entry = {"name": run_name, "group": group, "status": "ok", "router": EC_FROZEN, **spec, "steps": 0,
                     "inputs": "standardised", "command": f"taskset -c N .venv/bin/python mini_moe/results/routing_pilot.py {group}",
                     **init_routing(**spec), "source_commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                                                                               text=True).stdout.strip()}
            if OUT.exists():
                record["runs"] = json.loads(OUT.read_text())["runs"]
            record["runs"] = [r for r in record["runs"] if r["name"] != run_name] + [entry]
            OUT.write_text(json.dumps(record, indent=1) + "\n")
            print(f"{run_name}: {[round(layer['routing_accuracy'], 3) for layer in entry['routing']]}", flush=True)
    last_wall = 0.0
    for group in [g for g in groups if g not in PROBES and g not in INIT_ROUTING]:
        for spec in GROUPS[group]:
            run_name = name(spec)
            if run_name in done or (os.environ.get("SEEDS") and str(spec["seed"]) not in os.environ["SEEDS"].split(",")):
                continue
            if time.monotonic() + 1.1 * last_wall > DEADLINE:
                print(f"{run_name}: not started (DEADLINE)", flush=True)
                continue
            command = os.environ.get("PILOT_COMMAND") or (
                f"COMMIT=1 taskset -c {os.environ.get('CORE', '1')} .venv/bin/python "
                f"mini_moe/results/routing_pilot.py {group}")
            command += f"  # run {run_name}"
            entry = {"name": run_name, "group": group, "command": command, "router": spec["router"] or "dense",
                     "capacity": spec["capacity"], "seed": spec["seed"], "dataset": spec["dataset"],
                     "overrides": spec["overrides"]}
            tick = time.perf_counter()
            try:
                cfg = study.cell_config(spec["router"], spec["capacity"], spec["seed"], dataset=spec["dataset"],
                                        scale="quick", **spec["overrides"])
                entry["config"] = json.loads(json.dumps(dataclasses.asdict(cfg), default=list))
                train_part, validation, test = splits(cfg)
                entry["inputs"] = "standardised"
                result = study.run_cell(cfg, RUNS / run_name, progress=False, label=spec["router"],
                                        capacity=spec["capacity"], datasets=(train_part, validation))
                entry |= {"status": "ok", "validation_accuracy": result["test_accuracy"], "steps": result["steps"],
                          "train_seconds": result["train_seconds"], "step_flops": result["step_flops"],
                          "mechanisms": result["mechanisms"],
                          # the evaluations during training are on the validation images (until
                          # 2026-11-27 each entry also kept them under "test_accuracy")
                          "eval": [{"step": e["step"], "seconds": e["seconds"], "validation_accuracy": e["test_accuracy"]}
                                   for e in result["eval"]]}
                entry |= test_measures(RUNS / run_name, spec["dataset"], test)
                entry["wall_seconds"] = round(time.perf_counter() - tick, 1)
            except Exception as e:  # recorded, the pilot goes on
                entry |= {"status": "failed", "error": f"{type(e).__name__}: {e}",
                          "traceback": traceback.format_exc()[-2000:],
                          "wall_seconds": round(time.perf_counter() - tick, 1)}
            last_wall = entry["wall_seconds"]
            entry["source_commit"] = os.environ.get("SOURCE_COMMIT") or subprocess.run(
                ["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
            entry["source_dirty"] = (os.environ["SOURCE_DIRTY"] == "1" if "SOURCE_DIRTY" in os.environ else
                                     bool(subprocess.run(["git", "status", "--porcelain", "--", "mini_moe"],
                                                         capture_output=True, text=True).stdout.strip()))
            if OUT.exists():  # another process (the other core) may have added runs since we started
                record["runs"] = json.loads(OUT.read_text())["runs"]
            record["runs"] = [r for r in record["runs"] if r["name"] != run_name] + [entry]
            record["machine"]["date_last"] = bench.machine()["date"]
            OUT.write_text(json.dumps(record, indent=1) + "\n")
            if os.environ.get("COMMIT") == "1":  # commit the record alone, as the run finishes
                subprocess.run(["bash", "-c", f'source mini_moe/results/commit_result.sh && '
                                f'commit_result {OUT} "routing pilot ({group}): {run_name}"'], check=False)
            acc = entry.get("test_accuracy")
            routing = [round(layer["routing_accuracy"], 3) for layer in entry.get("routing", [])]
            print(f"{run_name}: {entry['status']} test={acc if acc is None else round(100 * acc, 2)} "
                  f"routing={routing} train_s={entry.get('train_seconds')} wall_s={entry['wall_seconds']}", flush=True)


if __name__ == "__main__":
    unknown = [g for g in sys.argv[1:] if g not in GROUPS and g not in PROBES and g not in INIT_ROUTING]
    if unknown or len(sys.argv) < 2:
        sys.exit(f"usage: {shlex.quote(sys.argv[0])} GROUP [GROUP ...]; groups: {', '.join([*GROUPS, *PROBES, *INIT_ROUTING])}")
    main(sys.argv[1:])
