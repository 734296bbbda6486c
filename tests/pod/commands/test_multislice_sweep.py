"""tpu-pod sweep over the number of slices: ``sweep.num_slices`` (issue 24, item 4), timing mode.

References: each point is the scenario with ``pod.slices: K`` and its DCN axis K long
(``{data: K}`` by default, as MaxText's dcn_data_parallelism); weak scaling's global
batch is per_device_batch x data x fsdp over every slice (by hand); each row equals a
TimingPod step of its point's scenario; the shipped sweep's published points (T3 on one
slice, M1 on two) sit where training-steps.md puts them (within the fidelity table's
error: benchmarks/fidelity.py).
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest

from pod.commands.sweep import COLUMNS, run_sweep, sweep_kind, sweep_points
from pod.config.plan import build_plan
from pod.config.scenario import load_scenario, parse_scenario
from pod.errors import ScenarioError
from pod.runtime.timing import TimingPod

pytestmark = pytest.mark.usefixtures("one_blas_thread")

ROOT = Path(__file__).resolve().parents[3]


def sweep_scenario(dcn_mesh=None, counts=(1, 2, 4), **sweep):
    pod = {"slice": "v5e-4", "mesh": {"fsdp": 2, "tensor": 2}}
    if dcn_mesh is not None:
        pod |= {"slices": math.prod(dcn_mesh.values()), "dcn_mesh": dcn_mesh}
    return parse_scenario({
        "name": "slices", "pod": pod,
        "model": {"name": "transformer", "options": {"embed_dim": 32, "heads": 4, "head_dim": 8,
                                                     "mlp_dim": 64, "layers": 2}},
        "data": {"name": "synthetic_text",
                 "options": {"vocabulary": 64, "sequence_length": 16, "num_examples": 64}},
        "training": {"global_batch": 8, "steps": 2, "optimizer": {"name": "adamw"}},
        "metrics": {"port": 0},
        "sweep": {"mode": "timing", "num_slices": list(counts), "scaling": "weak",
                  "per_device_batch": 2, "steps": 2, **sweep},
    })


def test_each_point_has_its_slices_and_the_dcn_axis_as_long(tmp_path):
    scenario = sweep_scenario()
    points = sweep_points(scenario)
    assert [p.values["pod__slices"] for p in points] == [1, 2, 4]
    assert [p.values["pod__dcn_mesh"] for p in points] == [None, {"data": 2}, {"data": 4}]
    # weak scaling: 2 per device x fsdp 2 in a slice x data K across
    assert [p.scenario.training.global_batch for p in points] == [4, 8, 16]
    assert sweep_kind(scenario) == "weak scaling over slices"
    rows = run_sweep(scenario, tmp_path)
    assert [r["status"] for r in rows] == ["ok"] * 3
    assert [r["slices"] for r in rows] == [1, 2, 4] and [r["chips"] for r in rows] == [4, 8, 16]
    assert [r["dcn_mesh"] for r in rows] == ["", "{data: 2}", "{data: 4}"]
    assert rows[0]["dcn_collective_seconds"] == 0 < rows[1]["dcn_collective_seconds"]
    assert rows[1]["dcn_collective_seconds"] < rows[2]["dcn_collective_seconds"]  # 2 (K-1)/K
    with (tmp_path / "results.csv").open() as f:
        header = next(csv.reader(f))
    assert header == list(COLUMNS) and {"slices", "dcn_mesh", "dcn_collective_seconds"} <= set(header)
    assert (tmp_path / "tokens.png").exists() and (tmp_path / "efficiency.png").exists()
    assert "| slices |" in (tmp_path / "results.md").read_text()
    for point, row in zip(points, rows):
        pod = TimingPod(build_plan(point.scenario, timing_only=True))
        pod.step(0)
        stats = pod.step(1)
        assert row["simulated_step_seconds"] == pytest.approx(stats.step_seconds, rel=1e-12)
        assert row["mfu"] == pytest.approx(stats.mfu, rel=1e-12)
        assert row["dcn_collective_seconds"] == pytest.approx(
            sum(stats.axis_dcn_seconds.values()), rel=1e-12)


def test_the_scenarios_dcn_axis_is_the_one_that_grows():
    points = sweep_points(sweep_scenario({"fsdp": 2}, counts=(1, 2, 4)))
    assert [p.values["pod__dcn_mesh"] for p in points] == [None, {"fsdp": 2}, {"fsdp": 4}]
    assert [p.scenario.training.global_batch for p in points] == [4, 8, 16]
    with pytest.raises(ScenarioError, match=r"sweep.num_slices: pod.dcn_mesh \{data: 2, fsdp: "
                                            r"2\} splits the slices over several axes"):
        sweep_points(sweep_scenario({"data": 2, "fsdp": 2}))


def test_slice_counts_in_sweep_slices_are_one_line():
    with pytest.raises(ScenarioError, match=r"sweep.slices: 2 is a number; sweep.slices lists "
                                            r"slice names .* sweep.num_slices: \[2, 4\]"):
        parse_scenario({"name": "x", "pod": {"slice": "v5e-4"}, "model": {"name": "mlp"},
                        "data": {"name": "digits"}, "training": {"global_batch": 8, "steps": 1},
                        "sweep": {"slices": [2, 4]}})


def test_the_shipped_sweep_puts_t3_and_m1_where_the_fidelity_table_does():
    """scenarios/multislice-16b-v5e-256-slices.yaml's first two points are T3 (one
    v5e-256) and M1 (two): the same plans as the shipped T3 / M1 scenarios, and MFU
    within 10% of the published 61.10% and 59.37% (training-steps.md)."""
    scenario = load_scenario(ROOT / "scenarios/multislice-16b-v5e-256-slices.yaml")
    points = sweep_points(scenario)
    assert [p.values["pod__slices"] for p in points][:2] == [1, 2]
    assert points[-1].scenario.pod.slices == 199            # the largest published job size
    for point, published, name in ((points[0], 0.6110, "maxtext-t3-16b-v5e-256"),
                                   (points[1], 0.5937, "maxtext-m1-16b-2x-v5e-256")):
        shipped = load_scenario(ROOT / f"scenarios/{name}.yaml")
        assert point.scenario.training.global_batch == shipped.training.global_batch
        plan = build_plan(point.scenario, timing_only=True)
        assert dict(plan.mesh.sizes) == dict(build_plan(shipped, timing_only=True).mesh.sizes)
        mfu = TimingPod(plan).step(0).mfu
        assert abs(mfu / published - 1) < 0.10, (name, mfu)
