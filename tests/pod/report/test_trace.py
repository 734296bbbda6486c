"""The Chrome / Perfetto trace of a real run: gzip output, a span per traced step that
lasts the step's simulated time, HBM counter tracks per core, and a flow arrow from
every ICI send to its receive, checked against the allreduce schedule built here."""

from __future__ import annotations

import csv
import gzip
import json
from collections import Counter

import pytest

from interconnect import build_collective
from pod.config.plan import build_plan
from tests.pod.runtime.test_pod import mlp_scenario


@pytest.fixture(scope="module")
def traced(ray_cluster, tmp_path_factory):
    from pod.commands.train import run_training

    out = tmp_path_factory.mktemp("trace")
    plan = build_plan(mlp_scenario(steps=3))
    summary = run_training(plan, output_dir=out, metrics_port=0, log_every=0,
                           trace_path=out / "trace.json.gz", trace_steps=[0, 2])
    raw = (out / "trace.json.gz").read_bytes()
    assert raw[:2] == b"\x1f\x8b"  # gzip's magic: Perfetto opens .json.gz as is
    events = json.loads(gzip.decompress(raw))["traceEvents"]
    rows = list(csv.DictReader((out / "steps.csv").open()))
    return plan, summary, events, rows


def test_one_span_per_traced_step_lasting_its_simulated_time(traced):
    plan, _, events, rows = traced
    spans = [e for e in events if e.get("cat") == "step"]
    assert [e["name"] for e in spans] == ["step 1", "step 3"]
    for span in spans:
        row = rows[int(span["name"].split()[1]) - 1]
        assert span["dur"] == pytest.approx(float(row["simulated_step_seconds"]) * 1e6, rel=1e-9)
    # the spans sit on the simulated clock: step 3 starts where steps 1 and 2 ended
    start = sum(float(r["simulated_step_seconds"]) for r in rows[:2]) * 1e6
    assert spans[1]["ts"] == pytest.approx(start, rel=1e-9)


def test_hbm_counter_tracks_per_chip_and_core(traced):
    plan, summary, events, _ = traced
    counters = [e for e in events if e["ph"] == "C"]
    assert {e["pid"] for e in counters} == set(range(plan.pod.chips))
    cores = {f"core {c}" for c in range(plan.pod.chip.tensorcores)}
    assert all(set(e["args"]) == cores and e["name"] == "HBM in use (bytes)" for e in counters)
    assert max(v for e in counters for v in e["args"].values()) == summary["hbm_peak_bytes"]


def test_a_flow_arrow_from_every_ici_send_to_its_receive(traced):
    plan, _, events, _ = traced
    schedule = build_collective("allreduce", plan.pod.torus, plan.num_params, 4,
                                plan.ici.algorithm)
    expected = Counter((t.src, t.dst) for phase in schedule.phases for t in phase if t.nbytes)
    starts = {e["id"]: e for e in events if e["ph"] == "s"}
    ends = {e["id"]: e for e in events if e["ph"] == "f"}
    assert set(starts) == set(ends) and len(starts) == 2 * sum(expected.values())  # 2 steps
    assert Counter((starts[i]["pid"], ends[i]["pid"]) for i in starts) == \
        Counter({k: 2 * n for k, n in expected.items()})
    for i in starts:
        assert ends[i]["ts"] > starts[i]["ts"] and ends[i].get("bp") == "e"
    names = {(e["pid"], e["name"]) for e in events if e["ph"] == "X" and e.get("cat") == "ici"}
    for src, dst in expected:
        assert (src, f"send to chip {dst}") in names and (dst, f"receive from chip {src}") in names
