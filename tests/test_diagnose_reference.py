"""``diagnose`` on the book's reference runs (issue 50 §4): :data:`mini_moe.diagnose.REFERENCES` is what
they measure, and none of them warns; each one's margin to each threshold is printed (``pytest -s``).

The reference runs: chapter 8's confirmatory cells (``patch_vote-confirmatory-cpu-2core-epyc.json``,
10 seeds per cell; the metrics their committed ``mechanisms`` hold) and the book's ten committed
explorer models (``mini_moe/results/explorer-models``; every metric but stability, on the first
:data:`IMAGES` test images). ``python tests/test_diagnose_reference.py`` prints the table to paste
into ``REFERENCES``."""

import functools
import pprint

import numpy as np
import pytest

from mini_moe import bench, confirm, diagnose, explorer, train

IMAGES = 1000
CONFIRMATORY = "patch_vote-confirmatory-cpu-2core-epyc.json"
#: The metrics of diagnose's report that the confirmatory cells' ``mechanisms`` hold, by their name there.
FROM_MECHANISMS = {"dropped_tokens": "unprocessed", "dropped_picks": "dropped_routes",
                   "experts_per_token": "experts_per_token", "load_cv": "load_cv"}


@functools.cache
def confirmatory_runs() -> list[dict]:
    """One row per confirmatory MoE cell: its label, family, thresholds, per-layer metrics and batch dependence."""
    rows = []
    for cell in bench.committed(CONFIRMATORY)["cells"]:
        if cell["router"] == "dense":
            continue
        family, thresholds = _family(cell["router"], cell["capacity"])
        layers = [{ours: layer[theirs] for ours, theirs in FROM_MECHANISMS.items()}
                  for layer in cell["mechanisms"]["layers"]]
        rows.append({"run": f"{cell['router']} c={cell['capacity']:g} seed {cell['seed']}",
                     "family": family, "thresholds": thresholds,
                     "layers": layers, "batch_dependence": cell["mechanisms"]["batch_dependence"], "findings": []})
    return rows


@functools.cache
def _family(router: str, capacity: float) -> tuple:
    """A confirmatory cell's family and thresholds: they depend on its configuration, not its seed."""
    model = train.make_model(confirm.config(router, capacity, 0))
    return diagnose.family(model), diagnose.thresholds(model)


@functools.cache
def explorer_runs() -> list[dict]:
    """:func:`diagnose.diagnose` on each committed explorer model, with its label and thresholds."""
    rows = []
    for path in sorted(explorer.WEIGHTS.glob("*.npz")):
        model, cfg, _ = explorer.load_weights(path)
        report = diagnose.diagnose(model, explorer.test_images(cfg, IMAGES),
                                   trained_group_images=cfg.model.group_images)
        rows.append({**report, "run": f"explorer {path.stem}", "thresholds": diagnose.thresholds(model)})
    return rows


def reference_ranges() -> dict:
    """``REFERENCES`` recomputed: per family, per metric, (low, high) over layers and runs (3 decimals)."""
    out = {}
    for row in confirmatory_runs() + explorer_runs():
        entry = out.setdefault(row["family"], {"runs": []})
        entry["runs"].append(row["run"])
        values = {name: [layer[name] for layer in row["layers"]] for name in row["layers"][0]}
        values["batch_dependence"] = [row["batch_dependence"]]
        for name, vs in values.items():
            vs = [v for v in vs if v is not None]
            if vs:
                low, high = entry.get(name, (np.inf, -np.inf))
                entry[name] = (min(low, round(min(vs), 3)), max(high, round(max(vs), 3)))
    for entry in out.values():
        seeds = sum(" seed " in run for run in entry["runs"])
        models = [run.removeprefix("explorer ") for run in entry["runs"] if run.startswith("explorer ")]
        entry["runs"] = "; ".join(([f"{seeds} confirmatory cells of chapter 8"] if seeds else [])
                                  + ([f"explorer: {', '.join(models)}"] if models else []))
    return out


def margins(row: dict) -> dict:
    """Per thresholded metric of one reference run: threshold minus its worst value (max metrics),
    or its worst value minus the threshold (min metrics); positive means no warning."""
    out = {}
    for metric, (direction, threshold) in row["thresholds"].items():
        values = [row["batch_dependence"]] if metric == "batch_dependence" else \
            [layer.get(metric) for layer in row["layers"]]
        values = [v for v in values if v is not None]
        if values:
            out[metric] = round(threshold - max(values) if direction == "max" else min(values) - threshold, 3)
    return out


def test_the_reference_ranges_are_what_the_reference_runs_measure():
    """Equal to the recorded ranges within 0.005: the ranges are rounded to 3 decimals, and another
    jaxlib or code generation (the floors' run) moves a ReLU router's picks at the margin of its
    gate, which moved one bound by 0.001 there."""
    measured = reference_ranges()
    assert measured.keys() == diagnose.REFERENCES.keys()
    for family, entry in measured.items():
        recorded = diagnose.REFERENCES[family]
        assert entry.keys() == recorded.keys() and entry["runs"] == recorded["runs"], family
        for metric, bounds in entry.items():
            if metric != "runs":
                assert np.allclose(bounds, recorded[metric], rtol=0, atol=0.005), (family, metric, bounds)


def test_no_reference_run_warns_and_each_margin_is_positive():
    rows = confirmatory_runs() + explorer_runs()
    assert len(rows) == 50 + 10
    for row in rows:
        assert row["findings"] == [], (row["run"], row["findings"])
        row_margins = margins(row)
        print(row["run"], row["family"], row_margins)
        assert row_margins and min(row_margins.values()) > 0, (row["run"], row_margins)
    # the metrics the review found at the old thresholds are now checked on every run that has them
    checked = {metric for row in rows for metric in margins(row)}
    assert {"dropped_tokens", "batch_dependence", "load_max_over_mean", "router_entropy"} <= checked


@pytest.mark.parametrize("name", ["token k=1 c=1", "expert c=1", "expert c=0.5", "soft"])
def test_the_report_prints_the_reference_range_and_its_margin(name):
    report = next(r for r in explorer_runs() + confirmatory_runs() if r["family"] == name)
    rules = diagnose._references(name, report["thresholds"])["thresholds"]
    assert rules["batch_dependence"]["reference"] == list(diagnose.REFERENCES[name]["batch_dependence"])
    assert rules["batch_dependence"]["reference_margin"] > 0


if __name__ == "__main__":
    pprint.pprint(reference_ranges(), width=120, sort_dicts=False)
