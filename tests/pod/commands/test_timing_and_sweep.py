"""Timing-only mode agrees with functional runs (in process); sweeps write what they promise."""

from __future__ import annotations

import csv

import pytest

from pod.config.plan import build_plan
from pod.config.scenario import parse_scenario
from pod.commands.sweep import run_sweep, sweep_points
from pod.report.bounds import BOUND_CATEGORIES
from pod.runtime.timing import TimingPod


def scenario(**extra):
    data = {
        "name": "timing-test",
        "pod": {"chip": "v4", "chips": 4},
        "model": {"name": "mlp", "options": {"hidden": [32], "dropout": False}},
        "data": {"name": "digits"},
        "training": {"global_batch": 64, "steps": 3,
                     "optimizer": {"name": "adam", "learning_rate": 0.01}},
        "metrics": {"port": 0},
    }
    data.update(extra)
    return parse_scenario(data)


def test_timing_only_and_functional_report_identical_simulated_times():
    from pod.runtime.local import LocalPod

    plan = build_plan(scenario())
    with LocalPod(plan) as pod:
        functional = [pod.step(s) for s in range(plan.steps)]
    timing = TimingPod(plan)
    costed = [timing.step(s) for s in range(plan.steps)]
    for f, t in zip(functional, costed):
        assert t.step_seconds == f.step_seconds
        for part in ("infeed_seconds", "compute_seconds", "collective_seconds",
                     "exposed_collective_seconds", "update_seconds", "model_flops",
                     "axis_collective_seconds"):
            assert getattr(t, part) == getattr(f, part), part
        assert t.step_seconds > 0


def test_timing_only_reaches_pods_no_host_could_emulate():
    plan = build_plan(scenario(pod={"chip": "v4", "topology": "8x8x8"},
                               training={"global_batch": 32768, "steps": 1}),
                      timing_only=True)
    stats = TimingPod(plan).step(0)
    assert plan.topology.chips == 512 and plan.per_device_batch == 64  # a megacore device per chip
    # weak scaling at a fixed per-device batch: per-chip compute is the same as on 4 chips
    small = TimingPod(build_plan(scenario(training={"global_batch": 256, "steps": 1}))).step(0)
    assert stats.compute_seconds == small.compute_seconds
    assert stats.model_flops == 128 * small.model_flops


def test_sweep_points_expand_the_product_and_set_weak_batches():
    s = scenario(sweep={"scaling": "weak", "per_core_batch": 8, "chips": [1, 2, 4],
                        "allreduce": ["ring", "torus"]})
    points = sweep_points(s)
    assert len(points) == 6
    batches = [p.scenario.training.global_batch for p in points]
    assert batches == [16, 16, 32, 32, 64, 64]  # 8 per core x 2 cores per v4 chip
    assert {p.scenario.pod.allreduce for p in points} == {"ring", "torus"}
    # several per-core batches: a weak-scaling series each
    many = sweep_points(scenario(sweep={"scaling": "weak", "per_core_batch": [8, 16],
                                        "chips": [1, 2]}))
    assert [p.scenario.training.global_batch for p in many] == [16, 32, 32, 64]
    assert len({p.series for p in many}) == 2


def test_sweep_records_a_failed_point_and_goes_on(tmp_path):
    # strong scaling at global batch 96: 96 does not split over 64 devices (64 v4 chips,
    # a megacore device each)
    s = scenario(sweep={"chips": [1, 2, 64], "global_batch": [96], "steps": 2})
    rows = run_sweep(s, tmp_path)
    assert [r["status"] for r in rows] == ["ok", "ok", "failed"]
    assert "global batch 96 does not split over data x fsdp = 64 devices" in rows[2]["error"]
    with (tmp_path / "results.csv").open() as f:
        written = list(csv.DictReader(f))
    assert len(written) == 3 and written[2]["status"] == "failed"
    assert float(written[0]["scaling_efficiency"]) == pytest.approx(1.0)
    # efficiency = examples/s per chip relative to the 1-chip point
    expected = (rows[1]["simulated_examples_per_second"] / 2) / rows[0]["simulated_examples_per_second"]
    assert rows[1]["scaling_efficiency"] == pytest.approx(expected)
    assert rows[1]["communication_fraction"] == pytest.approx(
        rows[1]["exposed_collective_seconds"] / rows[1]["simulated_step_seconds"])
    for name in ("results.md", "throughput.png", "efficiency.png", "breakdown.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    assert "failed: " in (tmp_path / "results.md").read_text()


def test_every_sweep_row_says_what_bounds_its_step(tmp_path):
    """Per row: a bound label, seconds per bound summing to the simulated step, the
    varied parameters as columns; a slices sweep over two generations makes a
    series (and an efficiency baseline) per generation; bounds.png is drawn."""
    s = scenario(pod={"slice": "v4-8"},
                 sweep={"scaling": "weak", "per_core_batch": 8,
                        "slices": ["v3-8", "v3-32", "v4-8", "v4-32"], "allreduce": ["ring"]})
    rows = run_sweep(s, tmp_path)
    assert [r["status"] for r in rows] == ["ok"] * 4
    assert [r["slice"] for r in rows] == ["v3-8", "v3-32", "v4-8", "v4-32"]
    assert [r["generation"] for r in rows] == ["v3", "v3", "v4", "v4"]
    assert rows[0]["scaling_efficiency"] == rows[2]["scaling_efficiency"] == 1.0
    for r in rows:
        parts = {c: r[f"{c}_bound_seconds"] for c in BOUND_CATEGORIES}
        assert sum(parts.values()) == pytest.approx(r["simulated_step_seconds"], rel=1e-9)
        top = max(parts, key=parts.get)
        assert r["bound"].split(" ")[0].lower() == top
        assert r["bound_fraction"] == pytest.approx(parts[top] / r["simulated_step_seconds"])
        if top == "ici":
            assert r["bound"] == f"ICI {r['ici_axes']}"
    with (tmp_path / "results.csv").open() as f:
        header = next(csv.reader(f))
    for column in ("slice", "chips", "allreduce_algorithm", "per_device_batch", "global_batch",
                   "precision", "bound", "ici_axes", "mxu_bound_seconds"):
        assert column in header
    assert (tmp_path / "bounds.png").stat().st_size > 0
    table = (tmp_path / "results.md").read_text().splitlines()
    assert len({line.count("|") for line in table if line.startswith("|")}) == 1
