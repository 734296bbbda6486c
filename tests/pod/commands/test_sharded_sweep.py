"""tpu-pod sweep over sharded layouts: sweep.mesh / remat / per_device_batch (timing mode).

References: the global batch is per_device_batch x data x fsdp (by hand); each
sharded row equals a TimingPod step of the same scenario; a layout
too large for HBM is a row that says so with the plan's need per device."""

from __future__ import annotations

import csv

import pytest

from pod.commands.sweep import COLUMNS, run_sweep, sweep_points
from pod.config.plan import build_plan
from pod.config.scenario import parse_scenario
from pod.runtime.timing import TimingPod

pytestmark = pytest.mark.usefixtures("one_blas_thread")


def sweep_scenario(**model):
    return parse_scenario({
        "name": "layouts", "pod": {"slice": "v5p-16", "mesh": {"fsdp": 8}},
        "model": {"name": "transformer", "options": {"embed_dim": 32, "heads": 4, "head_dim": 8,
                                                     "mlp_dim": 64, "layers": 2, **model}},
        "data": {"name": "synthetic_text",
                 "options": {"vocabulary": 64, "sequence_length": 16, "num_examples": 64}},
        "training": {"global_batch": 8, "steps": 2, "optimizer": {"name": "adamw"}},
        "metrics": {"port": 0},
        "sweep": {"mode": "timing", "mesh": [{"fsdp": 8}, {"data": 2, "fsdp": 2, "tensor": 2}],
                  "remat": ["none", "full"], "per_device_batch": [1, 2], "steps": 2},
    })


def test_layout_sweep_rows_equal_a_timing_pod_step(tmp_path):
    scenario = sweep_scenario()
    points = sweep_points(scenario)
    assert len(points) == 8
    assert [p.scenario.training.global_batch for p in points[:2]] == [8, 16]   # x fsdp 8
    assert [p.scenario.training.global_batch for p in points[4:6]] == [4, 8]   # x data 2 x fsdp 2
    rows = run_sweep(scenario, tmp_path)
    assert all(r["status"] == "ok" for r in rows)
    with (tmp_path / "results.csv").open() as f:
        header = next(csv.reader(f))
    assert list(header) == list(COLUMNS)
    for key in ("mesh", "data", "fsdp", "tensor", "remat", "per_device_batch"):
        assert key in header
    assert (tmp_path / "layouts.png").exists()
    row = rows[5]  # {data: 2, fsdp: 2, tensor: 2}, remat none, 2 per device
    assert (row["data"], row["fsdp"], row["tensor"], row["remat"], row["per_device_batch"]) == \
        (2, 2, 2, "none", 2)
    plan = build_plan(points[5].scenario, timing_only=True, sharded_ok=True)
    pod = TimingPod(plan)
    pod.step(0)
    stats = pod.step(1)
    assert row["simulated_step_seconds"] == pytest.approx(stats.step_seconds, rel=1e-12)
    assert row["exposed_tensor_seconds"] == pytest.approx(stats.axis_exposed_seconds["tensor"],
                                                          rel=1e-12)
    assert row["hbm_per_device_bytes"] == plan.memory["total"]
    assert row["simulated_tokens_per_second"] == pytest.approx(8 * 16 / stats.step_seconds)


def test_a_layout_that_does_not_fit_is_a_row_saying_why(tmp_path):
    """A 2-layer model with 4096-wide layers on 8 v5e chips (16 GiB): {data: 8} keeps
    the whole model and its Adam state per chip and does not fit; {fsdp: 8} does."""
    scenario = sweep_scenario(embed_dim=4096, heads=32, head_dim=128, mlp_dim=16384,
                              layers=8).with_overrides(
        pod__slice="v5e-8", pod__mesh={"fsdp": 8},
        sweep__mesh=[{"data": 8}, {"fsdp": 8}], sweep__remat=["full"], sweep__per_device_batch=[1])
    rows = run_sweep(scenario, tmp_path)
    assert [r["status"] for r in rows] == ["failed", "ok"]
    assert rows[0]["fits"] is False and "does not fit" in rows[0]["error"]
    assert rows[0]["hbm_per_device_bytes"] > 16 * 2**30
    assert rows[1]["fits"] is True and rows[1]["hbm_per_device_bytes"] < 16 * 2**30
