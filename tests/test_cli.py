"""The command line: every offered ``bench --only`` part runs, and user errors end in a
one-line message and a non-zero exit status, never a traceback."""

import functools
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from mini_moe import __main__ as cli
from mini_moe import bench


def _offered_bench_parts(capsys) -> list[str]:
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    return re.search(r"--only \{([^}]*)\}", capsys.readouterr().out).group(1).split(",")


def test_every_offered_bench_part_runs(tmp_path, capsys, monkeypatch):
    parts = _offered_bench_parts(capsys)
    assert parts == list(bench.PARTS) and "routers" in parts
    ran = []
    for part in parts:  # the dispatch and the CLI; the parts themselves are too slow to run here
        monkeypatch.setitem(bench.PARTS, part, functools.partial(lambda repeats, part: ran.append(part) or [], part=part))
    for part in parts:
        out = tmp_path / f"{part}.json"
        assert cli.main(["bench", "--only", part, "--repeats", "1", "--out", str(out)]) == 0
        assert ran[-1] == part and part in json.loads(out.read_text())
    assert ran == parts
    assert f"wrote {out}" in capsys.readouterr().out


def test_bench_routers_times_every_router_forward_and_backward(monkeypatch):
    from mini_moe.routers import general_routers

    monkeypatch.setattr(bench, "time_fn", lambda fn, *args, repeats=20: 2.0)  # no compilation, no timing
    rows = bench.run(repeats=1, only="routers")["routers"]
    assert sorted(r["router"] for r in rows) == general_routers()
    assert all(r["forward_ms"] == 2.0 and r["forward_backward_ms"] == 2.0 for r in rows)


def test_bench_layer_width_times_every_router_at_every_width(monkeypatch):
    """Per width: the dense MLP, the experts alone and every router's layer (Token Choice at
    k = 1), each module built with that width; ratio and excess come from those timings."""
    from mini_moe.layer import MlpExperts
    from mini_moe.model import DenseMlp, MoeLayer
    from mini_moe.routers import general_routers, spec

    timed = []

    def fake_time(fn, module, *args, repeats=20):
        experts = module.experts if isinstance(module, MoeLayer) else module
        width = experts.fc1.kernel.shape[-1] if isinstance(experts, DenseMlp) else experts.w1.shape[-1]
        timed.append((type(module).__name__, width))
        return {DenseMlp: 4.0, MlpExperts: 3.0, MoeLayer: 9.0}[type(module)]

    monkeypatch.setattr(bench, "time_fn", fake_time)
    rows = bench.run(repeats=1, only="layer_width")["layer_width"]
    expected = [(kind, h) for h in bench.LAYER_WIDTHS
                for kind in ["DenseMlp", "MlpExperts"] + ["MoeLayer"] * len(general_routers())]
    assert timed == expected
    assert [(r["hidden"], r["router"]) for r in rows] == [(h, n) for h in bench.LAYER_WIDTHS for n in general_routers()]
    for r in rows:
        assert (r["dense_ms"], r["experts_only_ms"], r["layer_ms"], r["ratio"], r["excess_ms"]) == (4.0, 3.0, 9.0, 2.25, 5.0)
        assert r["options"] == ({"k": 1} if spec(r["router"]).allocation == "token" else {})
    assert "+5.00 ms over it" in bench.summary({"machine": bench.machine(), "layer_width": rows})


def test_bench_sparsity_solver_reports_ratio_error_and_gap_to_pot(monkeypatch):
    """The solver benchmark at a tiny shape: the ratio is the two routers' times, and the
    objective gap is F minus POT's optimum, computed here again from the same group."""
    from mini_moe import transport

    times = iter([2.0, 6.0] * 2)
    monkeypatch.setattr(bench, "time_fn", lambda fn, *args, repeats=20: next(times))
    monkeypatch.setattr(bench, "SOLVER_SHAPES", {"tiny": (2, 32, 16, 4)})
    rows = bench.run(repeats=1, only="sparsity_solver")["sparsity_solver"]
    assert [r["capacity_factor"] for r in rows] == [1.0, 2.0]
    for row in rows:
        assert row["ratio"] == 3.0 and row["router_iterations"] <= 30
        assert 0 <= row["router_mean_marginal_error"] <= 1
        router = bench.routers_lib.make_router("sparsity_constrained_expert_choice", 16, 4,
                                               capacity_factor=row["capacity_factor"], rngs=bench.nnx.Rngs(0))
        x = bench.jax.random.normal(bench.jax.random.PRNGKey(0), (2, 32, 16))
        probs = bench.jax.nn.softmax(router.logits(x), axis=-1)
        _, info = transport.sparsity_constrained_plan(probs, max_nonzeros=router.allocation.budget(32, 4).capacity, max_iters=30,
                                                      return_info=True)
        pot = bench._pot_semi_dual_optimum(probs[0], router.allocation.budget(32, 4).capacity)["best"]
        assert row["router_objective_gap"][0] == pytest.approx(float(info.objective[0]) - pot, abs=1e-4)
        assert row["pot_objective"] == pytest.approx([pot, row["pot_objective"][1]], abs=1e-4)
        # The error of the plan at POT's semi-dual optimum, recomputed with POT directly.
        import ot

        cap, scores = router.allocation.budget(32, 4).capacity, np.asarray(probs[0], np.float64)
        a, b, regul = np.ones(32), np.full(4, 8.0), ot.smooth.SparsityConstrained(max_nz=cap, gamma=1.0)
        alpha, _ = ot.smooth.solve_semi_dual(a, b, -scores, regul, tol=1e-10, max_iter=5000)
        plan = ot.smooth.get_plan_from_semi_dual(alpha, b, -scores, regul)
        assert np.all((plan > 0).sum(axis=0) <= cap) and np.allclose(plan.sum(axis=0), 8.0)
        assert row["pot_mean_marginal_error"][0] == pytest.approx(np.abs(plan.sum(axis=1) - 1).mean(), abs=1e-4)


def _run_cli(args, tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", TFDS_DATA_DIR=str(tmp_path / "tfds"),
               # offline: any download attempt is refused at once instead of hanging
               HTTP_PROXY="http://127.0.0.1:9", HTTPS_PROXY="http://127.0.0.1:9", NO_PROXY="",
               http_proxy="http://127.0.0.1:9", https_proxy="http://127.0.0.1:9", no_proxy="")
    (tmp_path / "tfds").mkdir(exist_ok=True)
    return subprocess.run([sys.executable, "-m", "mini_moe", "train", "--out", str(tmp_path / "run"),
                           "--steps", "2", *args], capture_output=True, text=True, env=env, timeout=240)


@pytest.mark.parametrize("args, names", [
    (["--dataset", "mnist"], ["--dataset", "mnist"]),
    (["--dataset", "cifar10", "--data-dir", "EMPTY"], ["cifar10", "data_dir"]),
    (["--dataset", "digits", "--set", "model_patch_size=3"], ["image_size=8", "patch_size=3"]),
    (["--dataset", "digits", "--router", "softmax_token_choice", "--set", "model_num_experts=4",
      "--set", "model_router_kwargs={'k': 9}"], ["k=9", "num_experts=4"]),
])
def test_cli_user_errors_print_a_message_not_a_traceback(tmp_path, args, names):
    args = [str(tmp_path / "tfds") if a == "EMPTY" else a for a in args]
    proc = _run_cli(args, tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    last = proc.stderr.strip().splitlines()
    assert "error:" in proc.stderr and all(name in proc.stderr for name in names), proc.stderr
    assert len(last) <= 12  # a message, not pages of internals


def test_cli_main_returns_2_on_a_user_error(tmp_path, capsys):
    code = cli.main(["train", "--dataset", "digits", "--set", "nonsense=1", "--out", str(tmp_path / "x")])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("mini_moe: error: Unknown config field 'nonsense'")


@pytest.mark.parametrize("args, message", [
    (["--set", "learning_rate=fast"], "learning_rate must be of type float (like its default 0.002), got 'fast' of type str"),
    (["--set", "steps=2.5"], "steps must be of type int"),
    (["--set", "augment=1"], "augment must be of type bool"),
    (["--minutes", "-1"], "--minutes must be > 0"),
    (["--mesh", "1x1", "--set", "model_moe_path=einsum"], "moe_path='einsum' applies on one device"),
])
def test_cli_names_the_flag_or_key_at_fault(tmp_path, capsys, args, message):
    code = cli.main(["train", "--dataset", "digits", "--router", "softmax_token_choice", "--out",
                     str(tmp_path / "x"), *args])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("mini_moe: error: ") and message in err, err
    assert not (tmp_path / "x").exists()  # refused before anything was written


def test_cli_lets_a_bug_show_its_traceback(tmp_path, monkeypatch):
    """Only :class:`InputError` is a user's error: any other exception (here a ValueError from
    inside training, as a bug would raise) propagates with its traceback."""
    from mini_moe import train

    def broken(*args, **kwargs):
        raise ValueError("an internal shape mismatch")

    monkeypatch.setattr(train, "train", broken)
    with pytest.raises(ValueError, match="internal shape mismatch"):
        cli.main(["train", "--dataset", "digits", "--steps", "2", "--out", str(tmp_path / "x")])


def test_version_prints_the_package_version(capsys):
    import mini_moe

    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"python -m mini_moe {mini_moe.__version__}"


def test_every_command_help_ends_with_examples_that_parse(capsys):
    """Every command's --help shows examples, and the parser accepts each of them."""
    import shlex

    commands = ["train", "evaluate", "bench", "study", "subtasks"]
    for command in [[]] + [[c] for c in commands]:
        with pytest.raises(SystemExit):
            cli.main(command + ["--help"])
        text = capsys.readouterr().out
        examples = [line.strip() for line in text.split("examples:\n", 1)[1].splitlines() if line.strip()]
        assert examples, command
        for example in examples:
            argv = shlex.split(example.split("python -m mini_moe ", 1)[1])
            assert cli.build_parser().parse_args(argv).command in commands


def test_soft_moe_expert_costs_flat_flops_growing_bytes():
    """Chapter 6's cost check on small shapes: with E * S fixed, XLA's FLOPs of the compiled
    forward + backward stay within 1 % while the bytes it moves grow with the expert weights (by
    at least the float32 weights read once and their gradients written once). The matmuls' FLOPs
    are the same for every E; XLA's count of the rest varies with E and with XLA's version (at these
    shapes E = 8 counts 0.06 % fewer than E = 1 with jax 0.10.2, 2 % fewer with jax 0.8.1; at
    D = 16, H = 32 the difference reaches 4 %), hence 5 %."""
    dim, hidden = 64, 256
    costs = bench.soft_moe_expert_costs(experts=(1, 8), total_slots=8, images=2, tokens=16, dim=dim, hidden=hidden)
    assert [c["slots_per_expert"] for c in costs] == [8, 1]
    assert max(c["flops"] for c in costs) / min(c["flops"] for c in costs) < 1.05
    weights = 2 * 4 * (8 - 1) * 2 * dim * hidden  # read + gradient written, float32, 7 more experts
    assert costs[1]["bytes"] - costs[0]["bytes"] >= weights
    with pytest.raises(ValueError, match="experts must divide total_slots=8"):
        bench.soft_moe_expert_costs(experts=(3,), total_slots=8)


def test_the_reference_router_shapes_are_issue_36s():
    """bench --only routers_reference times the routers at E = 32, D = 768 and G = 8 groups of 1024
    or 392 tokens; Soft MoE routes each image on its own."""
    from flax import nnx

    for shape, tokens, images in (("g8_t1024", 1024, 1), ("g8_t392", 392, 8)):
        router, x = bench._router_and_tokens("softmax_token_choice", shape, nnx.Rngs(0))
        assert x.shape == (8, tokens, 768) and router.affinity.dense.kernel.shape == (768, 32)
        _, x = bench._router_and_tokens("soft_moe", shape, nnx.Rngs(0))
        assert x.shape == (8 * images, tokens // images, 768)
