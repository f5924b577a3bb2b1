"""The pre-registered confirmatory router study on ``patch_vote`` (issue 25, section 3).

Everything the analysis depends on is fixed here, before any confirmatory result, and stated
in ``mini_moe/results/patch_vote-preregistration.md``: the task and model (:data:`DATASET`,
:data:`OVERRIDES`, the ``patch_vote`` configuration of :mod:`mini_moe.config`), the arms
(:data:`ARMS`), the seeds (:data:`SEEDS`), the contrasts (:data:`CONTRASTS`, the arm whose
advantage the contrast claims first, so a positive ``difference`` favours it), Holm's
correction and the TOST equivalence bound (:data:`BOUND`).

One cell is one training run (:func:`mini_moe.study.cell_config` + :func:`mini_moe.study.run_cell`)
in its own folder, resumable from its checkpoints; the cells run seed by seed (every arm of a
seed, then the next seed), so a run stopped at any point holds complete paired seeds.
:func:`collect` gathers the finished cells, with those already in the committed JSON, into
``mini_moe/results/patch_vote-confirmatory-<machine>.json`` and tests the contrasts on the seeds
whose every arm has finished. ``bash mini_moe/results/patch_vote.sh`` runs the cells one by one
and commits that file after each.

Command line (``python -m mini_moe.confirm``)::

    todo --dest JSON          the cells not yet in JSON, in order, one name per line
    run NAME --out DIR        train (or resume) one cell; DIR/NAME/result.json
    collect --out DIR --dest JSON   rewrite JSON from it and DIR's finished cells
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import statistics
import subprocess
import sys

from mini_moe import study
from mini_moe.validate import InputError

#: The task, ``patch_vote`` with V = 4096 patches (:func:`mini_moe.data.patch_vote`).
DATASET = "patch_vote"
#: The scale of its configuration (width 64, depth 4, 4 heads, MLPs and experts of 64, E = 8).
SCALE = "quick"
#: The schedule, identical for every arm and fixed in advance (not tuned per router). 2,000 steps
#: of batch 128, AdamW at 2e-3 with 100 warm-up steps then cosine decay, aux-loss weight 0.01.
OVERRIDES = {"steps": 2000, "learning_rate": 2e-3, "warmup_steps": 100, "eval_every": 500}
#: The arms as (router or None for the dense ViT, capacity factor c), in the order each seed runs them.
ARMS = (
    (None, 1.0),
    ("softmax_token_choice", 1.0),
    ("softmax_expert_choice", 1.0),
    ("sinkhorn_token_choice", 1.0),
    ("soft_moe", 1.0),
    ("softmax_expert_choice", 0.5),
)
#: Ten new seeds (the pilot used 0-2).
SEEDS = tuple(range(100, 110))
#: The contrasts as (name, claim, source, first arm, second arm), difference = first - second.
CONTRASTS = (
    ("positive_control", "Softmax Expert Choice (c = 1) beats the dense ViT of equal activated FLOPs",
     "V-MoE; issue 25's pilot", ("softmax_expert_choice", 1.0), ("dense", 1.0)),
    ("ec_vs_tc", "Softmax Expert Choice beats Softmax Token Choice (c = 1)",
     "paper 000, Figures 1-2", ("softmax_expert_choice", 1.0), ("softmax_token_choice", 1.0)),
    ("sinkhorn_vs_softmax", "Sinkhorn Token Choice beats Softmax Token Choice (c = 1)",
     "paper 000, Figure 1", ("sinkhorn_token_choice", 1.0), ("softmax_token_choice", 1.0)),
    ("soft_vs_ec", "Soft MoE beats Softmax Expert Choice (c = 1)",
     "paper 000, Section 5", ("soft_moe", 1.0), ("softmax_expert_choice", 1.0)),
    ("soft_vs_tc", "Soft MoE beats Softmax Token Choice (c = 1)",
     "paper 000, Section 5", ("soft_moe", 1.0), ("softmax_token_choice", 1.0)),
    ("ec_half_vs_tc", "Softmax Expert Choice at c = 0.5 beats Softmax Token Choice at c = 1",
     "paper 003; paper 000", ("softmax_expert_choice", 0.5), ("softmax_token_choice", 1.0)),
)
#: The primary metric, test accuracy as a fraction (differences are reported in it).
METRIC = "test_accuracy"
#: The family-wise level of Holm's correction.
ALPHA = 0.05
#: The TOST equivalence bound, +-0.5 accuracy points.
BOUND = 0.005
PREREGISTRATION = "mini_moe/results/patch_vote-preregistration.md"


def plan() -> list[tuple[str | None, float, int]]:
    """Every cell ``(router, capacity, seed)``, seed-major."""
    return [(router, capacity, seed) for seed in SEEDS for router, capacity in ARMS]


def cell_names() -> dict[str, tuple[str | None, float, int]]:
    """The cells by name (:func:`mini_moe.study.cell_name`), in :func:`plan` order."""
    return {study.cell_name(*cell): cell for cell in plan()}


def config(router, capacity, seed):
    """The :class:`~mini_moe.config.TrainConfig` of one cell."""
    return study.cell_config(router, capacity, seed, dataset=DATASET, scale=SCALE, **OVERRIDES)


def _git(*args, cwd=None) -> str | None:
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=True, cwd=cwd).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def source_state() -> dict:
    """The code this process imported ``mini_moe`` from: ``{"commit", "dirty"}`` of the checkout
    (or pinned worktree) that holds it; ``dirty`` is True when any tracked file under its
    ``mini_moe/`` differs from the commit, or an untracked one is there."""
    source = pathlib.Path(__file__).resolve().parent
    status = _git("status", "--porcelain", "--", ".", cwd=source)
    return {"commit": _git("rev-parse", "HEAD", cwd=source), "dirty": status is None or bool(status)}


def require_pinned(commit: str) -> dict:
    """Refuse to go on unless ``mini_moe`` was imported from a clean checkout of ``commit``: the
    guard of a registered confirmatory run (issue 34), so that no cell is trained by other code
    than the registration pinned. Returns :func:`source_state`."""
    state = source_state()
    if state["commit"] is None:
        raise InputError("the code's git commit is unknown (mini_moe is not imported from a git checkout); "
                         "a confirmatory cell needs the pinned commit checked out (mini_moe/results/commit_result.sh "
                         "pin_source does it).")
    if not state["commit"].startswith(commit) and not commit.startswith(state["commit"]):
        raise InputError(f"mini_moe comes from commit {state['commit'][:12]}, not the pinned {commit[:12]}: "
                         "check out the pinned commit (pin_source) before training a confirmatory cell.")
    if state["dirty"]:
        raise InputError(f"the checkout of mini_moe at {state['commit'][:12]} has uncommitted changes under mini_moe/; "
                         "a confirmatory cell must be trained by the pinned commit exactly. Commit or discard them.")
    return state


def locked_update(path, update) -> dict:
    """Read the JSON file ``path`` (``{"runs": []}`` when it does not exist), apply ``update`` (a
    function that changes the dict in place) and write it back, all under an exclusive lock on a
    ``.lock`` file beside it: the registered runners run one process per core on one results file,
    and neither may lose the other's cells. Returns the updated dict."""
    import fcntl

    path = pathlib.Path(path)
    with open(path.with_suffix(".lock"), "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        record = json.loads(path.read_text()) if path.exists() else {"runs": []}
        update(record)
        path.write_text(json.dumps(record, indent=1) + "\n")
    return record


def run(name: str, out) -> dict:
    """Train (or resume, or just read) the cell ``name``; its ``result.json`` gets the git commit
    of the code that trained it (``source_commit``; ``source_dirty``: uncommitted changes)."""
    cells = cell_names()
    if name not in cells:
        raise InputError(f"Unknown cell {name!r}; the plan has {len(cells)} cells, e.g. {next(iter(cells))!r}.")
    router, capacity, seed = cells[name]
    folder = pathlib.Path(out) / name
    done = (folder / "result.json").exists()
    result = study.run_cell(config(router, capacity, seed), folder, progress=False, label=router, capacity=capacity)
    if not done:
        state = source_state()  # the code that trained it (maybe a pinned worktree)
        result |= {"source_commit": state["commit"], "source_dirty": state["dirty"]}
        (folder / "result.json").write_text(json.dumps(result, indent=1))
    return result


def _key(cell: dict) -> tuple:
    return (cell["router"], float(cell["capacity"]), int(cell["seed"]))


def tost(differences, bound: float) -> float:
    """Two one-sided paired t-tests of equivalence: the p-value of "the mean difference lies
    within ``(-bound, +bound)``", the larger of the p-values of H0: mean <= -bound and
    H0: mean >= +bound (Schuirmann 1987), Student's t with n - 1 degrees of freedom."""
    from scipy import stats

    d = [float(x) for x in differences]
    if len(d) < 2:
        return math.nan
    mean, se = statistics.fmean(d), statistics.stdev(d) / math.sqrt(len(d))
    if se == 0:
        return 0.0 if abs(mean) < bound else 1.0
    lower = float(stats.t.sf((mean + bound) / se, len(d) - 1))  # H0: mean <= -bound
    upper = float(stats.t.cdf((mean - bound) / se, len(d) - 1))  # H0: mean >= +bound
    return max(lower, upper)


def comparisons(cells: list[dict]) -> tuple[list[int], list[dict]]:
    """The contrasts on the complete seeds (every arm finished): ``(seeds, rows)``.

    Each row: ``name``, ``claim``, ``source``, ``arms`` (first, second: a positive
    ``difference`` favours the first), the :func:`mini_moe.stats.paired_t` statistics of the
    per-seed differences (``difference``, ``stderr``, ``ci_low``, ``ci_high``, ``t``, ``df``,
    ``pairs``), ``p`` (two-sided), ``p_holm`` (Holm over the contrasts), ``tost_p`` and
    ``tost_p_holm`` (equivalence within +-:data:`BOUND`, Holm over the contrasts) and the
    ``verdict``. No rows before two complete seeds.
    """
    acc = {_key(c): c[METRIC] for c in cells}
    arms = [("dense" if r is None else r, c) for r, c in ARMS]
    seeds = sorted({s for *_, s in acc} & set(SEEDS))
    seeds = [s for s in seeds if all((*arm, s) in acc for arm in arms)]
    if len(seeds) < 2:
        return seeds, []
    rows = []
    for name, claim, source, first, second in CONTRASTS:
        diffs = [acc[(*first, s)] - acc[(*second, s)] for s in seeds]
        stats_ = study.paired_t(diffs)
        rows.append({"name": name, "claim": claim, "source": source,
                     "arms": [{"router": first[0], "capacity": first[1]}, {"router": second[0], "capacity": second[1]}],
                     **{k: v for k, v in stats_.items() if k != "p_value"}, "p": stats_["p_value"],
                     "tost_p": tost(diffs, BOUND), "differences": diffs})
    for key in ("p", "tost_p"):
        for row, adjusted in zip(rows, study.holm([row[key] for row in rows])):
            row[key + "_holm"] = adjusted
    for row in rows:
        row["verdict"] = verdict(row)
    return seeds, rows


def verdict(row: dict) -> str:
    """One line: the difference, and which of "first arm higher", "second arm higher",
    "equivalent within +-0.5 points" or "inconclusive" the Holm-adjusted tests support."""
    first, second = (f"{a['router']} (c = {a['capacity']:g})" for a in row["arms"])
    diff = f"{100 * row['difference']:+.2f} points (95 % CI [{100 * row['ci_low']:+.2f}, {100 * row['ci_high']:+.2f}])"
    words = []
    if row["p_holm"] < ALPHA:
        words.append(f"{first if row['difference'] > 0 else second} higher (p_Holm = {row['p_holm']:.2g})")
    if row["tost_p_holm"] < ALPHA:
        words.append(f"equivalent within +-{100 * BOUND:g} points (TOST p_Holm = {row['tost_p_holm']:.2g})")
    if not words:
        words.append(f"inconclusive (p_Holm = {row['p_holm']:.2g}, TOST p_Holm = {row['tost_p_holm']:.2g})")
    return f"{diff}: " + "; ".join(words)


_CELL_FIELDS = ("router", "capacity", "seed", "steps", "test_accuracy", "ten_shot_accuracy", "train_seconds",
                "wall_seconds", "step_flops", "train_flops", "mechanisms", "eval", "source_commit", "source_dirty")


def collect(out, dest, *, command: str | None = None) -> dict:
    """Rewrite ``dest`` from its own cells and the finished cells under ``out``; returns it."""
    from mini_moe import bench

    dest, out = pathlib.Path(dest), pathlib.Path(out)
    old = json.loads(dest.read_text()) if dest.exists() else {}
    cells = {_key(c): c for c in old.get("cells", [])}
    for name, cell in cell_names().items():
        path = out / name / "result.json"
        if path.exists():
            result = json.loads(path.read_text())
            cells[_key(result)] = {k: result[k] for k in _CELL_FIELDS if k in result}
    order = {(("dense" if r is None else r), c, s): i for i, (r, c, s) in enumerate(plan())}
    cells = sorted(cells.values(), key=lambda c: order.get(_key(c), len(order)))
    seeds, rows = comparisons(cells)
    cfg = config(None, 1.0, SEEDS[0])
    results = {
        "what": "issue 25: the pre-registered confirmatory router study on patch_vote (mini_moe.confirm)",
        "preregistration": PREREGISTRATION,
        "preregistration_commit": old.get("preregistration_commit") or _git("log", "-1", "--format=%H", "--",
                                                                            PREREGISTRATION),
        "command": command or old.get("command"),
        "machine": old.get("machine") or bench.machine(),
        "dataset": DATASET, "scale": SCALE, "overrides": OVERRIDES,
        "dense_config": json.loads(json.dumps(dataclasses.asdict(cfg), default=list)),
        "arms": [{"router": "dense" if r is None else r, "capacity": c} for r, c in ARMS],
        "seeds": list(SEEDS), "planned_cells": len(plan()), "finished_cells": len(cells),
        "metric": METRIC, "alpha": ALPHA, "tost_bound": BOUND, "complete_seeds": seeds,
        "wall_seconds": round(sum(c.get("wall_seconds", 0.0) for c in cells), 1),
        "summary": study.summarize(cells) if cells else [],
        "cells": cells,
        "comparisons": rows,
    }
    dest.write_text(json.dumps(results, indent=1) + "\n")
    return results


def arm_label(router: str, capacity: float) -> str:
    """``"softmax_expert_choice c=0.5"``; the dense ViT is ``"dense"``."""
    return "dense" if router == "dense" else f"{router} c={capacity:g}"


def plot(results: dict):
    """The confirmatory study in two panels. Left: test accuracy of every arm, one line per seed
    (the pairing the tests use). Right: each contrast's mean paired difference with its 95 %
    confidence interval, the TOST equivalence band +-``tost_bound`` shaded; a filled marker
    where Holm's adjusted two-sided p < alpha."""
    import matplotlib.pyplot as plt

    arms = [(a["router"], a["capacity"]) for a in results["arms"]]
    acc = {_key(c): c[METRIC] for c in results["cells"]}
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [1.2, 1]})
    for seed in results["complete_seeds"]:
        left.plot(range(len(arms)), [100 * acc[(*arm, seed)] for arm in arms], color="0.6", lw=0.8, marker="o", ms=3)
    means = [[100 * acc[(*arm, s)] for s in results["complete_seeds"]] for arm in arms]
    left.plot(range(len(arms)), [sum(m) / len(m) if m else float("nan") for m in means], "k_", ms=18, mew=2,
              label="mean over seeds")
    left.set_xticks(range(len(arms)), [arm_label(*arm).replace("_", " ") for arm in arms], fontsize=7,
                    rotation=30, ha="right")
    left.set_ylabel("test accuracy (%)")
    left.set_title(f"{len(results['complete_seeds'])} paired seeds (one line each)", fontsize=10)
    left.grid(alpha=0.3, axis="y")
    left.legend(fontsize=8, loc="lower left")
    rows = results["comparisons"]
    bound = 100 * results["tost_bound"]
    right.axvspan(-bound, bound, color="tab:green", alpha=0.15, label=f"TOST band +-{bound:g} points")
    right.axvline(0, color="k", lw=0.8)
    for i, row in enumerate(rows):
        significant = row["p_holm"] < results["alpha"]
        right.errorbar(100 * row["difference"], i, xerr=[[100 * (row["difference"] - row["ci_low"])],
                                                         [100 * (row["ci_high"] - row["difference"])]],
                       fmt="o", color="tab:blue", mfc="tab:blue" if significant else "white", capsize=3)
    right.set_yticks(range(len(rows)), [row["name"] for row in rows], fontsize=8)
    right.invert_yaxis()
    right.set_xscale("symlog", linthresh=1.0)
    reach = max([abs(100 * row[key]) for row in rows for key in ("ci_low", "ci_high", "difference")] + [1.0])
    right.set_xlim(-2 * reach, 2 * reach)
    right.set_xlabel("first arm minus second arm (points; symlog scale)")
    right.set_title("contrasts: mean and 95 % CI (filled: p_Holm < 0.05)", fontsize=10)
    right.grid(alpha=0.3, axis="x")
    right.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    return fig


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mini_moe.confirm", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    todo = sub.add_parser("todo", help="the cells not yet in --dest, in order")
    todo.add_argument("--dest", required=True)
    one = sub.add_parser("run", help="train (or resume) one cell")
    one.add_argument("name")
    one.add_argument("--out", required=True)
    gather = sub.add_parser("collect", help="rewrite --dest from it and --out's finished cells")
    gather.add_argument("--out", required=True)
    gather.add_argument("--dest", required=True)
    gather.add_argument("--command", default=None, help="the command that runs the study, recorded in --dest")
    args = parser.parse_args(argv)
    try:
        if args.what == "todo":
            path = pathlib.Path(args.dest)
            have = {_key(c) for c in json.loads(path.read_text())["cells"]} if path.exists() else set()
            for name, (router, capacity, seed) in cell_names().items():
                if (router or "dense", capacity, seed) not in have:
                    print(name)
        elif args.what == "run":
            r = run(args.name, args.out)
            print(f"{args.name}: test accuracy {100 * r['test_accuracy']:.2f} %, {r['steps']} steps, "
                  f"{r['train_seconds']:.0f} s training, {r['wall_seconds']:.0f} s in all", flush=True)
        else:
            r = collect(args.out, args.dest, command=args.command)
            print(f"{r['finished_cells']}/{r['planned_cells']} cells, complete seeds {r['complete_seeds']}")
            for row in r["comparisons"]:
                print(f"  {row['name']:22s} {row['verdict']}")
    except InputError as e:
        print(f"mini_moe.confirm: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
