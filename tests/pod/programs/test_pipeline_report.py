"""The pipeline bubble where a user reads it: summary.json, steps.csv, the console table,
the trace (named on the compute lane, and a lane per stage), the bound column, and a sweep over the
microbatches. In process, no Ray."""

from __future__ import annotations

import csv
import json

import pytest

from pod.commands.train import Run
from pod.commands.sweep import sweep_kind, sweep_points
from pod.config.plan import build_plan
from pod.config.scenario import parse_scenario
from pod.report.bounds import step_bounds
from pod.report.clock import BUBBLE
from pod.report.console import summary_rows

pytestmark = pytest.mark.usefixtures("one_blas_thread")


def scenario(**extra):
    data = {
        "name": "pipeline-report",
        "pod": {"slice": "v5e-8", "mesh": {"stage": 2, "data": 4}},
        "model": {"name": "transformer", "options": {
            "embed_dim": 16, "heads": 4, "head_dim": 4, "mlp_dim": 32, "layers": 2}},
        "data": {"name": "synthetic_text",
                 "options": {"vocabulary": 32, "sequence_length": 8, "num_examples": 80},
                 "test_fraction": 0.2},
        "training": {"global_batch": 16, "steps": 2, "microbatches": 2,
                     "pipeline_schedule": "gpipe", "optimizer": {"name": "sgd"}},
        "metrics": {"port": 0}}
    for key, value in extra.items():
        data[key] = {**data.get(key, {}), **value}
    return parse_scenario(data)


def test_a_pipelined_run_reports_its_bubble_everywhere(tmp_path):
    from rich.console import Console

    plan = build_plan(scenario())
    run = Run(plan, output_dir=tmp_path, console=Console(quiet=True), keep_history=True,
              backend="local", trace_path=tmp_path / "trace.json")
    summary = run.run()
    history = run.history
    assert summary["pipeline"] == {"stages": 2, "microbatches": 2, "schedule": "gpipe",
                                   "repeats": 1}
    bubble = sum(s.pipeline_bubble_seconds for s in history[1:]) / (len(history) - 1)
    assert summary["pipeline_bubble_seconds"] == pytest.approx(bubble) and bubble > 0
    assert 0 < summary["pipeline_bubble_fraction"] < 1
    assert summary["collectives_by_axis"]["stage"]["bytes_per_step"] > 0
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk["pipeline_bubble_fraction"] == pytest.approx(summary["pipeline_bubble_fraction"])
    with open(tmp_path / "steps.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert float(rows[-1]["pipeline_bubble_seconds"]) == pytest.approx(
        history[-1].pipeline_bubble_seconds)
    assert float(rows[-1]["pipeline_bubble_fraction"]) == pytest.approx(
        history[-1].pipeline_bubble_fraction)
    # the step is its parts, the bubble among them
    last = history[-1]
    assert last.step_seconds == pytest.approx(
        last.dispatch_seconds + last.exposed_infeed_seconds + last.compute_seconds
        + last.exposed_collective_seconds + last.pipeline_bubble_seconds + last.update_seconds)
    row = [r for r in summary_rows(summary) if r[0].strip() == "pipeline bubble"]
    assert row and "gpipe, 2 stages x 2 microbatches" in row[0][1]
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    lanes = {e["args"]["name"]: e["tid"] for e in events
             if e["ph"] == "M" and e["name"] == "thread_name"}
    waits = [e for e in events if e.get("cat") == "wait" and e["name"] == BUBBLE
             and e["tid"] == lanes["compute (slowest device)"]]
    assert sum(e["dur"] for e in waits) == pytest.approx(last.pipeline_bubble_seconds * 1e6)
    # a lane per stage: each stage's compute and waits tile its own step, one after another,
    # and the slowest device's stage lane is the compute lane
    assert {"stage 0", "stage 1"} <= set(lanes) and "stage 2" not in lanes
    assert [d for d, _, _ in last.stage_timelines] != [] and len(last.stage_timelines) == 2
    step_span = [e for e in events if e.get("cat") == "step"][-1]
    for stage, (device, member_seconds, _) in enumerate(last.stage_timelines):
        lane = sorted((e for e in events if e["ph"] == "X" and e["tid"] == lanes[f"stage {stage}"]
                       and step_span["ts"] <= e["ts"] <= step_span["ts"] + step_span["dur"]),
                      key=lambda e: e["ts"])
        assert lane and all(e["args"]["device"] == device for e in lane)
        for a, b in zip(lane, lane[1:]):
            assert b["ts"] == pytest.approx(a["ts"] + a["dur"], abs=1e-6)
        assert sum(e["dur"] for e in lane) == pytest.approx(member_seconds * 1e6, rel=1e-9)
    slowest = [i for i, (d, _, _) in enumerate(last.stage_timelines) if d == last.traced_device]
    assert len(slowest) == 1
    assert any(e.get("name", "").startswith("ppermute pipeline") for e in events)
    bounds = step_bounds(last, plan.collective_costs, plan.topology.torus)
    assert bounds.seconds["bubble"] == pytest.approx(last.pipeline_bubble_seconds)
    assert sum(bounds.seconds.values()) == pytest.approx(last.step_seconds)


def test_a_stage_less_run_reports_no_pipeline():
    plan = build_plan(scenario(pod={"mesh": {"data": 8}},
                               training={"microbatches": None, "pipeline_schedule": "gpipe"}))
    from pod.runtime.timing import TimingPod

    stats = TimingPod(plan).step(0)
    assert stats.pipeline_bubble_seconds == 0.0 and stats.pipeline_bubble_fraction == 0.0


def test_a_sweep_varies_the_microbatches_and_the_stages():
    spec = scenario(sweep={"mode": "timing", "microbatches": [2, 4],
                           "mesh": [{"stage": 2, "data": 4}, {"data": 8}]})
    points = sweep_points(spec)
    assert [(p.values["pod__mesh"], p.values["training__microbatches"]) for p in points] == [
        ({"stage": 2, "data": 4}, 2), ({"stage": 2, "data": 4}, 4),
        ({"data": 8}, None)]  # a stage-less point clears the pipeline fields and runs once
    assert [p.index for p in points] == [0, 1, 2]
    for p in points:
        build_plan(p.scenario, timing_only=True)
    assert sweep_kind(spec) == "a sweep of mesh and microbatches"
