"""Command line: ``python -m mini_moe {train,evaluate,diagnose,labs,bench,study,subtasks} ...`` (``--help`` on each).

A user's error (a bad argument or option value, missing data, a missing optional package:
:class:`mini_moe.validate.InputError`, which every check of the package raises) ends in one
message on stderr, ``mini_moe: error: ...``, and exit status 2; set ``MINI_MOE_TRACEBACK=1`` to
see the traceback instead. Any other exception is a bug and shows its traceback.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import pathlib
import sys

import mini_moe
from mini_moe import data as data_lib
from mini_moe.routers import ROUTERS
from mini_moe.validate import InputError

ROUTER_CHOICES = sorted(ROUTERS) + ["dense"]


class _HelpFormatter(argparse.HelpFormatter):
    """argparse's help, with the examples epilog printed line by line instead of re-wrapped."""

    def _fill_text(self, text, width, indent):
        if text.startswith("examples:"):
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


def _examples(*lines: str) -> dict:
    """``add_parser`` keywords that end a command's --help with examples."""
    return {"epilog": "examples:\n" + "\n".join(f"  {line}" for line in lines), "formatter_class": _HelpFormatter}


def _report(result: dict, as_json: bool) -> None:
    """Print a result: one JSON line with --json (for scripts), else a two-column table."""
    if as_json:
        print(json.dumps(result))
        return
    width = max(map(len, result), default=0)
    for key, value in result.items():
        print(f"{key:{width}s}  {value:.4f}" if isinstance(value, float) else f"{key:{width}s}  {value}")


def _check_minutes(minutes: float | None) -> None:
    if minutes is not None and not minutes > 0:
        raise InputError(f"--minutes must be > 0 (minutes of training), got {minutes!r}.")


def _parse_override(text: str):
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"--set expects KEY=VALUE, got {text!r}")
    try:
        value = ast.literal_eval(value)
    except (ValueError, SyntaxError):
        pass  # a plain string
    return key.strip(), value


def _parse_mesh(text: str):
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise argparse.ArgumentTypeError(f"--mesh expects DATAxEXPERT such as 2x4, got {text!r}")
    return (int(parts[0]), int(parts[1]))


def _add_train(sub):
    p = sub.add_parser(
        "train", help="train a V-MoE (or the dense ViT) and write config, checkpoints and history",
        description="Train a V-MoE with any router. Routers: " + ", ".join(ROUTER_CHOICES)
        + ". Datasets: " + ", ".join(data_lib.DATASETS) + ".",
        **_examples("python -m mini_moe train --router soft_moe --dataset fashion_mnist --minutes 5",
                    "python -m mini_moe train --router softmax_token_choice --set 'model_router_kwargs={\"k\": 2}' --steps 500",
                    "python -m mini_moe train --router dense --dataset digits --out runs/dense"),
    )
    p.add_argument("--router", default="soft_moe", choices=ROUTER_CHOICES, help="router name, or 'dense' for the ViT")
    p.add_argument("--dataset", default="fashion_mnist", choices=data_lib.DATASETS)
    p.add_argument("--config", default=None, choices=["quick", "full"],
                   help="scale preset (default: quick on CPU, full on GPU/TPU; env MINI_MOE_SCALE)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=None, help="training steps (overrides the preset)")
    p.add_argument("--minutes", type=float, default=None,
                   help="training-time budget: without --steps, the schedule is sized to fit it (measured "
                   "on this machine); training stops when it is spent")
    p.add_argument("--out", default=None, help="output folder (default: runs/DATASET-ROUTER-sSEED)")
    p.add_argument("--data-dir", default=None, help="folder with the dataset files (e.g. Fashion-MNIST IDX)")
    p.add_argument("--set", dest="overrides", type=_parse_override, action="append", default=[],
                   metavar="KEY=VALUE", help="override a config field, e.g. --set model_num_experts=16 "
                   "--set 'model_router_kwargs={\"k\": 2}' (repeatable)")
    p.add_argument("--no-resume", action="store_true", help="start afresh even if OUT has checkpoints")
    p.add_argument("--mesh", default=None, type=_parse_mesh, metavar="DATAxEXPERT",
                   help="expert parallelism over DATA*EXPERT devices, e.g. 2x4 (on a CPU, simulate devices with "
                   "XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    p.add_argument("--json", action="store_true", help="print the final result as one JSON line")
    p.set_defaults(func=_train)


def _train(args):
    from mini_moe import config as config_lib
    from mini_moe import train as train_lib

    _check_minutes(args.minutes)
    overrides = dict(args.overrides)
    if args.steps is not None:
        overrides["steps"] = args.steps
    if args.minutes is not None:
        overrides["max_seconds"] = 60.0 * args.minutes
    if args.data_dir is not None:
        overrides["data_dir"] = args.data_dir
    if args.mesh is not None:
        overrides["mesh"] = args.mesh
    router = None if args.router == "dense" else args.router
    cfg = config_lib.get_config(args.config, dataset=args.dataset, router=router, seed=args.seed, **overrides)
    out = pathlib.Path(args.out or f"runs/{args.dataset}-{args.router}-s{args.seed}")
    if args.minutes is not None and args.steps is None:
        cfg = train_lib.budget_config(cfg, 60.0 * args.minutes, out_dir=None if args.no_resume else out)
        print(f"{args.minutes:g} minutes of training on this machine: a schedule of {cfg.steps} steps")
    history = train_lib.train(cfg, out, resume=not args.no_resume)
    final = history["eval"][-1] if history["eval"] else {}
    _report({"out": str(out), **final, "train_seconds": round(history["seconds"], 1)}, args.json)


def _add_evaluate(sub):
    p = sub.add_parser("evaluate", help="evaluate a trained run: accuracy, 10-shot probe, router diagnostics, figures",
                       description="Evaluate a folder written by 'train': test accuracy, the 10-shot linear probe, "
                       "router diagnostics and routing stability (written to RUN/evaluation.json), and the expert "
                       "maps (RUN/expert_maps.png).",
                       **_examples("python -m mini_moe evaluate runs/fashion_mnist-soft_moe-s0",
                                   "python -m mini_moe evaluate runs/dense --no-figures --json"))
    p.add_argument("run", help="a folder written by 'train'")
    p.add_argument("--shots", type=int, default=10, help="images per class for the linear probe")
    p.add_argument("--images", type=int, default=2000, help="test images used for router diagnostics")
    p.add_argument("--no-figures", action="store_true")
    p.add_argument("--json", action="store_true", help="print the accuracies as one JSON line")
    p.set_defaults(func=_evaluate)


def _evaluate(args):
    from mini_moe import evaluate as ev
    from mini_moe import train as train_lib

    run = pathlib.Path(args.run)
    model, cfg = train_lib.load_trained(run)
    train_ds, test_ds = train_lib.load_data(cfg)
    subset = test_ds.images[: args.images]
    result = {
        "test_accuracy": ev.accuracy(model, test_ds),
        f"{args.shots}_shot_accuracy": ev.few_shot_accuracy(model, train_ds, test_ds, shots=args.shots),
        "routers": ev.router_report(model, subset),
        "stability": ev.routing_stability(model, subset),
    }
    (run / "evaluation.json").write_text(json.dumps(result, indent=1))
    if not args.no_figures and cfg.model.moe_blocks():
        maps = ev.expert_maps(model, test_ds.images[:8])
        fig = ev.plot_expert_maps(test_ds.images[:8], maps, num_experts=cfg.model.routed_experts,
                                  labels=test_ds.labels[:8])
        fig.savefig(run / "expert_maps.png", dpi=120)
    _report({k: v for k, v in result.items() if k not in ("routers", "stability")}, args.json)
    print(f"wrote {run / 'evaluation.json'}", file=sys.stderr if args.json else sys.stdout)


def _add_diagnose(sub):
    p = sub.add_parser("diagnose", help="a health report of a trained MoE run: balance, drops, stability, grouping",
                       description="Measure, per MoE layer of a folder written by 'train', the load balance, "
                       "dropped picks and tokens, experts per token, router entropy and logit size, routing "
                       "stability against the previous checkpoint and the batch dependence of the predictions; "
                       "each against its router family's threshold, beside the range of the book's reference runs, "
                       "with a hint for each warning; weights that are not finite are a verdict of their own. A "
                       "damaged run folder is a one-line error naming the file (mini_moe.diagnose).",
                       **_examples("python -m mini_moe diagnose runs/patch_vote-softmax_token_choice-s0",
                                   "python -m mini_moe diagnose runs/my-run --json",
                                   "python -m mini_moe diagnose runs/my-run --plot health.png"))
    p.add_argument("run", help="a folder written by 'train'")
    p.add_argument("--images", type=int, default=2000, help="test images to measure on")
    p.add_argument("--json", action="store_true",
                   help="print the report as one line of standard JSON (NaN and infinity as null, listed in non_finite)")
    p.add_argument("--plot", metavar="FILE", help="also write a one-page PNG dashboard")
    p.set_defaults(func=_diagnose)


def _diagnose(args):
    from mini_moe import diagnose

    if args.images < 1:
        raise InputError(f"--images must be >= 1, got {args.images}.")
    report = diagnose.diagnose_run(args.run, images=args.images)
    if args.plot:
        diagnose.plot_report(report).savefig(args.plot, dpi=110)
    print(diagnose.to_json(report) if args.json else diagnose.format_report(report))


def _add_labs(sub):
    p = sub.add_parser("labs", help="the graded labs: list them, check a student's file, or grade a class",
                       description="Check every lab function that a student's .py file or filled-in .ipynb defines "
                       "against the library (mini_moe.labs), each lab in a process of its own that cannot import "
                       "mini_moe, with a time and a memory limit: a table of passed / failed and why, exit status "
                       "1 if one fails. 'grade' does so for every submission in a folder and writes a gradebook.",
                       **_examples("python -m mini_moe labs list",
                                   "python -m mini_moe labs check my_routers.py",
                                   "python -m mini_moe labs check my_routers.py --json",
                                   "python -m mini_moe labs grade submissions/ --out grades.csv --seed 7"))
    p.add_argument("action", choices=["list", "check", "grade"])
    p.add_argument("path", nargs="?", help="the student's .py or .ipynb ('check'), a folder of them ('grade')")
    p.add_argument("--json", action="store_true", help="'check': one JSON line, for an autograder")
    p.add_argument("--out", help="'grade': the gradebook CSV to write (one row per student and lab)")
    p.add_argument("--seed", type=int, default=0, help="the seed of the generated cases (default 0, as on the page)")
    p.add_argument("--timeout", type=float, default=None, help="seconds a lab may take (default 120)")
    p.add_argument("--jobs", type=int, default=None, help="labs checked at once (default: 1 for check, the cores "
                   "for grade)")
    p.add_argument("--unsandboxed", action="store_true", help="'grade' without Linux's Landlock (macOS, old "
                   "kernels): only the process limits hold; a submission could read the library and other "
                   "submissions (book page 15)")
    p.set_defaults(func=_labs)


def _labs(args):
    from mini_moe import labs

    if args.action == "list":
        for name, lab in sorted(labs.LABS.items()):
            print(f"{name:24s} def {lab.function}{lab.signature}")
        return
    if not args.path:
        raise InputError(f"labs {args.action} needs a path: python -m mini_moe labs check FILE.py, or "
                         "labs grade FOLDER --out grades.csv")
    timeout = labs.TIMEOUT if args.timeout is None else args.timeout
    if timeout <= 0:
        raise InputError(f"--timeout must be > 0 seconds, got {timeout}.")
    if args.action == "grade":
        if not args.out:
            raise InputError("labs grade needs --out FILE.csv, the gradebook to write.")
        rows = labs.grade(args.path, seed=args.seed, timeout=timeout, jobs=args.jobs, out=args.out,
                          sandbox="best" if args.unsandboxed else "required")
        students = sorted({r["student"] for r in rows})
        for student in students:
            mine = [r for r in rows if r["student"] == student]
            passed = sum(r["status"] == "passed" for r in mine)
            print(f"{labs.text(student, 24):24s} {passed} of {len([r for r in mine if r['lab']])} labs passed"
                  + ("" if all(r["lab"] for r in mine) else f"  ({labs.text(mine[0]['message'], 200)})"))
        print(f"wrote {args.out}: {len(rows)} rows, {len(students)} students")
        return
    results = labs.check_file(args.path, seed=args.seed, timeout=timeout, jobs=args.jobs or 1)
    if args.json:
        print(json.dumps([{"lab": r.lab, "passed": r.passed, "status": labs.status(r), "cases": r.cases,
                           "message": r.message} for r in results]))
    else:
        for r in results:
            print(f"{r.lab:24s} {'passed' if r.passed else labs.status(r).upper()}")
        for r in results:
            if r.message:
                print(f"\n{r}")
    if not all(r.passed for r in results):
        raise SystemExit(1)


def _add_bench(sub):
    from mini_moe.bench import PARTS

    p = sub.add_parser("bench", help="time routers, MoE layer vs dense MLP, Soft MoE vs E, training throughput",
                       description="Benchmarks, written to a JSON file with the machine and the command, and "
                       "summarised on screen. Parts: " + ", ".join(PARTS) + ".",
                       **_examples("python -m mini_moe bench --only layer --repeats 10 --out layer.json",
                                   "taskset -c 0 python -m mini_moe bench --only dropless"))
    p.add_argument("--out", default="bench.json", help="JSON file to write")
    p.add_argument("--repeats", type=int, default=20, help="timed repetitions per measurement")
    p.add_argument("--only", default=None, choices=list(PARTS), help="run one part only")
    p.set_defaults(func=_bench)


def _bench(args):
    from mini_moe import bench

    results = bench.run(repeats=args.repeats, only=args.only)
    path = pathlib.Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1))
    print(bench.summary(results))
    print(f"wrote {path}")


def _add_study(sub):
    p = sub.add_parser(
        "study", help="train every router at capacity factors 0.5, 1, 2 (and the dense ViT) for several "
        "seeds; results.json + figures", description="The router study of paper 000 at small scale, every "
        "router in the Every-2 placement. Routers: " + ", ".join(sorted(ROUTERS)) + ". Datasets: "
        + ", ".join(data_lib.DATASETS) + ". Resumable: run the same command again to continue.",
        **_examples("python -m mini_moe study --dataset digits --seeds 0 1 --steps 400",
                    "python -m mini_moe study --routers softmax_token_choice soft_moe --capacities 1 --minutes 5"),
    )
    p.add_argument("--dataset", default="fashion_mnist", choices=data_lib.DATASETS)
    p.add_argument("--config", default=None, choices=["quick", "full"], help="scale preset (default: by backend)")
    from mini_moe.study import CAPACITIES, STUDY_ROUTERS, VARIANTS

    p.add_argument("--routers", nargs="+", default=None, choices=STUDY_ROUTERS, metavar="ROUTER",
                   help="routers to train (default: every router; the Figure 3 ablation "
                   + ", ".join(VARIANTS) + " on request)")
    p.add_argument("--capacities", nargs="+", type=float, default=list(CAPACITIES),
                   help="capacity factors c: every expert gets C = round(c T / E) slots (Token Choice: k = 1 for "
                   "c <= 1, k = c above)")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--no-dense", action="store_true", help="skip the dense ViT baseline")
    p.add_argument("--steps", type=int, default=None, help="training steps per cell (overrides the preset)")
    p.add_argument("--minutes", type=float, default=None,
                   help="training-time budget per cell; the schedule is sized to it (instead of --steps)")
    p.add_argument("--out", default=None, help="study folder (default: runs/study-DATASET)")
    p.add_argument("--done", default=None, metavar="RESULTS_JSON",
                   help="results.json of an earlier run of this study (e.g. the committed one): its cells count "
                   "as finished")
    p.add_argument("--set", dest="overrides", type=_parse_override, action="append", default=[],
                   metavar="KEY=VALUE", help="config override for every cell (repeatable)")
    p.set_defaults(func=_study)


def _study(args):
    from mini_moe import study

    overrides = dict(args.overrides)
    if args.steps is not None:
        overrides["steps"] = args.steps
    if args.steps is not None and args.minutes is not None:
        raise InputError("give --steps or --minutes, not both.")
    _check_minutes(args.minutes)
    out = pathlib.Path(args.out or f"runs/study-{args.dataset}")
    command = "python -m mini_moe " + " ".join(args.argv)
    results = study.run_study(out, dataset=args.dataset, routers=args.routers, capacities=args.capacities,
                              seeds=args.seeds, dense=not args.no_dense, scale=args.config,
                              minutes=args.minutes, command=command, done=args.done, **overrides)
    for cost in ("train_seconds", "train_flops"):
        study.plot_study(results, cost=cost).savefig(out / f"accuracy_vs_{cost}.png", dpi=120, bbox_inches="tight")
    study.plot_curves(results).savefig(out / "training_curves.png", dpi=120)
    study.plot_capacity_sweep(results).savefig(out / "capacity_sweep.png", dpi=120, bbox_inches="tight")
    for row in results["summary"]:
        print(f"{row['router']:36s} c={row['capacity']}  test {100 * row['test_accuracy']:.2f} "
              f"+- {100 * row['test_accuracy_std']:.2f}  10-shot {100 * row['ten_shot_accuracy']:.2f}  "
              f"{row['train_seconds']:.0f} s")
    print(f"wrote {out / 'results.json'}")


def _add_subtasks(sub):
    from mini_moe import subtasks

    p = sub.add_parser("subtasks", help="the controlled experiment: tokens from K known sub-tasks, one MoE layer "
                       "per router (resumable)", description=subtasks.__doc__.split("\n\n")[0],
                       **_examples("python -m mini_moe subtasks --routers dense softmax_expert_choice --seeds 0 1",
                                   "python -m mini_moe subtasks --frequencies skewed --steps 20000 --patience 1000"))
    p.add_argument("--routers", nargs="+", default=list(subtasks.ROUTER_CHOICES),
                   choices=subtasks.ROUTER_CHOICES + subtasks.VARIANT_CHOICES, metavar="ROUTER",
                   help="routers, 'dense' and/or 'dense_wide' (default: all of these), or study variants such as "
                        "softmax_token_choice_frozen (the routing controls)")
    p.add_argument("--frequencies", nargs="+", default=list(subtasks.FREQUENCIES), choices=subtasks.FREQUENCIES)
    p.add_argument("--capacities", nargs="+", type=float, default=[1.0], help="capacity factors c")
    p.add_argument("--seeds", nargs="+", type=int, default=list(range(8)))
    p.add_argument("--steps", type=int, default=None, help="training steps per run (with --patience: the most)")
    p.add_argument("--patience", type=int, default=None,
                   help="stop a run when its validation FVU has not improved by 1 %% within this many steps")
    p.add_argument("--out", default="runs/subtasks.json", help="JSON file (resumed if it exists)")
    p.set_defaults(func=_subtasks)


def _subtasks(args):
    from mini_moe import subtasks

    overrides = {key: value for key in ("steps", "patience") if (value := getattr(args, key)) is not None}
    results = subtasks.run_experiment(args.out, routers=args.routers, frequencies=args.frequencies,
                                      capacities=args.capacities, seeds=args.seeds,
                                      command="python -m mini_moe " + " ".join(args.argv), **overrides)
    for run in results["runs"][-len(args.routers):]:
        c = run["config"]
        print(f"{c['router']:36s} {c['frequencies']:8s} seed {c['seed']}  FVU {run['final']['fvu']:.3f}")
    print(f"wrote {args.out}")


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser: the commands train, evaluate, bench, study and subtasks."""
    parser = argparse.ArgumentParser(
        prog="python -m mini_moe",
        description="mini_moe: routers in Vision Mixture-of-Experts. Routers: " + ", ".join(ROUTER_CHOICES)
        + ". Datasets: " + ", ".join(data_lib.DATASETS) + ". 'python -m mini_moe COMMAND --help' shows a "
        "command's options and examples.",
        **_examples("python -m mini_moe train --router soft_moe --dataset digits --steps 300",
                    "python -m mini_moe evaluate runs/digits-soft_moe-s0"),
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {mini_moe.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_train(sub)
    _add_evaluate(sub)
    _add_diagnose(sub)
    _add_labs(sub)
    _add_bench(sub)
    _add_study(sub)
    _add_subtasks(sub)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    args.argv = argv
    try:
        args.func(args)
    except InputError as e:
        if os.environ.get("MINI_MOE_TRACEBACK"):
            raise
        print(f"mini_moe: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
