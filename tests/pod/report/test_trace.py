"""The Chrome / Perfetto trace of a real in-process run (``Run`` on a ``LocalPod``, no Ray),
one format for every mesh: gzip output, a span per traced step lasting its simulated
time on the run's simulated clock, the slowest device's compute and waits tiling the
step, its op records on their unit's lane adding up to its compute and update, and its
collectives on the lane of their mesh axis adding up to the step's collective seconds."""

from __future__ import annotations

import csv
import gzip
import json

import pytest

from pod.config.plan import build_plan
from pod.config.scenario import parse_scenario

TRANSFORMER = {"name": "transformer", "options": {"embed_dim": 16, "heads": 2, "head_dim": 8,
                                                  "mlp_dim": 32, "layers": 1}}
MESHES = {
    # a replicated MLP on a v2-8: {data: 8}, a device per TensorCore, gradient buckets
    "data": ({"slice": "v2-8"}, {"name": "mlp", "options": {"hidden": [32], "dropout": False}},
             {"name": "digits"}, 64),
    # the sharded transformer: every axis has a lane
    "sharded": ({"slice": "v5e-8", "mesh": {"data": 2, "fsdp": 2, "tensor": 2}}, TRANSFORMER,
                {"name": "text", "options": {"sequence_length": 16}}, 16),
}


@pytest.fixture(scope="module", params=sorted(MESHES))
def traced(request, tmp_path_factory, one_blas_thread):
    from rich.console import Console

    from pod.commands.train import run_training

    pod, model, data, batch = MESHES[request.param]
    plan = build_plan(parse_scenario({
        "name": "trace", "pod": pod, "model": model, "data": data,
        "training": {"global_batch": batch, "steps": 3, "overlap_bucket_bytes": 4096},
        "metrics": {"port": 0}}))
    out = tmp_path_factory.mktemp("trace")
    with open(out / "log.txt", "w") as log:
        summary = run_training(plan, output_dir=out, metrics_port=0, log_every=0,
                               trace_path=out / "trace.json.gz", trace_steps=[0, 2],
                               backend="local", console=Console(file=log))
    raw = (out / "trace.json.gz").read_bytes()
    assert raw[:2] == b"\x1f\x8b"  # gzip's magic: Perfetto opens .json.gz as is
    doc = json.loads(gzip.decompress(raw))
    rows = list(csv.DictReader((out / "steps.csv").open()))
    lanes = {e["tid"]: e["args"]["name"] for e in doc["traceEvents"]
             if e["ph"] == "M" and e["name"] == "thread_name"}
    return plan, summary, doc, rows, lanes


def _step_events(doc, lanes, span):
    """The complete events of one traced step, by lane name."""
    out: dict[str, list] = {}
    end = span["ts"] + span["dur"]
    for e in doc["traceEvents"]:
        if e["ph"] == "X" and span["ts"] - 1e-6 <= e["ts"] <= end + 1e-6:
            out.setdefault(lanes[e["tid"]], []).append(e)
    return out


def test_the_lanes_are_the_meshs(traced):
    plan, _, doc, _, lanes = traced
    (process,) = [e for e in doc["traceEvents"] if e["name"] == "process_name"]
    assert process["args"]["name"].startswith("pod.mesh {")
    axes = {f"ICI {a}" for a in plan.mesh.sizes}
    assert set(lanes.values()) == {"steps", "infeed", "compute (slowest device)", "MXU",
                                   "vector unit", "scalar unit", "host link", *axes}
    assert doc["otherData"]["traced_steps"] == [1, 3]
    for e in doc["traceEvents"]:
        if e["ph"] == "X":
            assert e["dur"] >= 0 and e["ts"] >= 0 and e["tid"] in lanes


def test_one_span_per_traced_step_lasting_its_simulated_time(traced):
    _, _, doc, rows, _ = traced
    spans = [e for e in doc["traceEvents"] if e.get("cat") == "step"]
    assert [e["name"] for e in spans] == ["step 1", "step 3"]
    for span in spans:
        row = rows[int(span["name"].split()[1]) - 1]
        assert span["dur"] == pytest.approx(float(row["simulated_step_seconds"]) * 1e6, rel=1e-9)
    # the spans sit on the simulated clock: step 3 starts where steps 1 and 2 ended
    start = sum(float(r["simulated_step_seconds"]) for r in rows[:2]) * 1e6
    assert spans[1]["ts"] == pytest.approx(start, rel=1e-9)


def test_compute_and_waits_tile_the_step_and_the_ops_add_up(traced):
    plan, _, doc, rows, lanes = traced
    for span in [e for e in doc["traceEvents"] if e.get("cat") == "step"]:
        row = rows[int(span["name"].split()[1]) - 1]
        lane = _step_events(doc, lanes, span)
        origin = span["ts"] + (float(row["dispatch_seconds"])
                               + float(row["exposed_infeed_seconds"])) * 1e6
        stream = sorted(lane["compute (slowest device)"], key=lambda e: e["ts"])
        t = origin
        for e in stream:                                  # no gap, no overlap
            assert e["ts"] == pytest.approx(t, abs=1e-6)
            t = e["ts"] + e["dur"]
        assert t == pytest.approx(span["ts"] + span["dur"], rel=1e-9)
        waits = sum(e["dur"] for e in stream if e["cat"] == "wait")
        assert waits == pytest.approx(float(row["exposed_collective_seconds"]) * 1e6, abs=1e-6)
        for e in stream:
            if e["cat"] == "wait":
                assert e["name"] == f"wait for {e['args']['axis']}"
        # every op record of the slowest device on its unit's lane, one after another
        ops = sorted((e for name in ("MXU", "vector unit", "scalar unit")
                      for e in lane.get(name, ())), key=lambda e: (e["ts"], e["dur"]))
        assert ops and all(e["args"]["device"] == row_device(span) for e in ops)
        for a, b in zip(ops, ops[1:]):
            assert b["ts"] >= a["ts"] + a["dur"] - 1e-6
        busy = (float(row["compute_seconds"]) + float(row["update_seconds"])) * 1e6
        assert sum(e["dur"] for e in ops) == pytest.approx(busy, rel=1e-9)
        assert max(e["ts"] + e["dur"] for e in ops) <= t + 1e-6
        # the collectives on their axis's lane: the step's collective seconds
        ici = [e for name, events in lane.items() if name.startswith("ICI ")
               for e in events]
        assert {e["args"]["axis"] for e in ici} == {a for a in plan.mesh.sizes
                                                   if plan.mesh.sizes[a] > 1}
        for e in ici:
            assert lanes[e["tid"]] == f"ICI {e['args']['axis']}"
        assert sum(e["dur"] for e in ici) == pytest.approx(
            float(row["collective_seconds"]) * 1e6, rel=1e-9)


def row_device(span):
    return span["args"]["slowest_device"]


def test_the_infeed_ends_where_the_compute_starts(traced):
    """Each step's infeed ends where its compute starts, having run behind the step
    before when overlapped (only its exposed part inside the step)."""
    _, _, doc, rows, _ = traced
    feeds = [e for e in doc["traceEvents"] if e.get("cat") == "infeed"]
    spans = [e for e in doc["traceEvents"] if e.get("cat") == "step"]
    assert len(feeds) == len(spans) == 2
    for feed, span in zip(feeds, spans):
        row = rows[int(span["name"].split()[1]) - 1]
        assert feed["args"]["infeed_seconds"] == pytest.approx(float(row["infeed_seconds"]))
        compute_start = span["ts"] + (float(row["dispatch_seconds"])
                                      + float(row["exposed_infeed_seconds"])) * 1e6
        assert feed["ts"] + feed["dur"] == pytest.approx(compute_start, abs=1e-6)
        if span["ts"] > 0:  # the first step's is cut at the run's start
            assert feed["dur"] == pytest.approx(float(row["infeed_seconds"]) * 1e6, rel=1e-9)
        assert feed["ts"] >= 0


def test_a_partly_exposed_infeed_runs_behind_the_step_before_and_into_this_one():
    """Infeed 3 s of which 1 s exposed, a step starting at 10 s after a 0.5 s dispatch:
    the transfer runs [8.5, 11.5] and compute starts at 11.5 (simulated seconds)."""
    from pod.report.stats import StepStats
    from pod.report.trace import step_events

    stats = StepStats(step=1, loss=0.0, global_batch=8, infeed_seconds=3.0, compute_seconds=4.0,
                      collective_seconds=0.0, update_seconds=1.0, model_flops=0,
                      peak_flops_per_s=1.0, wall_seconds=0.0, exposed_infeed_seconds=1.0,
                      dispatch_seconds=0.5)
    events = {e["cat"]: e for e in step_events(stats, ["data"], start_s=10.0)}
    assert (events["infeed"]["ts"], events["infeed"]["dur"]) == (8.5e6, 3e6)
    assert events["step"]["ts"] == 10e6 and events["step"]["dur"] == pytest.approx(6.5e6)
    assert events["compute"]["ts"] == 11.5e6 and events["compute"]["dur"] == 5e6
