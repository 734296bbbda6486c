"""Multislice runs (issue 24, items 1 and 4): slices joined by the data-centre network.

- functional, in this process (``LocalPod``): two slices of a v5e-4 with their data (or
  fsdp) axis across the slices end with the parameters of the same mesh on one v5e-8
  (bit for bit: the device program sees the same coordinates and ``LocalMesh`` sums in
  the same group order) and of one device trained on the same global batches (fp32
  tolerance, as tests/pod/programs/test_pipeline.py: the sharded sums add the same
  float32 terms in another order); the transformer and the replicated MLP and CNN;
- functional on Ray (slow tier): the chip actors of the two slices, cross-slice bytes
  over the ICI transport, equal to the in-process run bit for bit (every group of the
  mesh has two devices: a ring's sum is then ``LocalMesh``'s two additions);
- timing-only at the largest published job size (199 v5e-256 slices, 50,944 chips):
  a step in seconds of wall time, holding no model-sized array;
- what the files, the console and the metrics call the axis across slices: the mesh
  axis's own name (``data``) with its DCN part beside it;
- a chip killed in the second slice, recovered from the checkpoint bit for bit.
"""

from __future__ import annotations

import csv
import io
import json
import time
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from pod.config.plan import build_plan
from pod.config.scenario import load_scenario, parse_scenario
from pod.runtime.local import LocalPod
from pod.runtime.timing import TimingPod

pytestmark = pytest.mark.usefixtures("one_blas_thread")

ROOT = Path(__file__).resolve().parents[3]
TINY = {"embed_dim": 32, "heads": 4, "head_dim": 8, "mlp_dim": 64, "layers": 2}
TEXT = {"name": "synthetic_text",
        "options": {"vocabulary": 64, "sequence_length": 16, "num_examples": 64}}
#: the fp32 tolerance of a sharded run against one device (tests/pod/programs/test_pipeline.py)
FP32_ATOL = 5e-5

TWO_SLICES = {"slice": "v5e-4", "slices": 2}
#: name -> (model, two slices, the same mesh on one slice of as many chips)
CASES = {
    "transformer-dcn-data": ("transformer",
                             {**TWO_SLICES, "mesh": {"fsdp": 2, "tensor": 2},
                              "dcn_mesh": {"data": 2}},
                             {"slice": "v5e-8", "mesh": {"data": 2, "fsdp": 2, "tensor": 2}}),
    "transformer-dcn-fsdp": ("transformer",
                             {**TWO_SLICES, "mesh": {"data": 2, "fsdp": 2},
                              "dcn_mesh": {"fsdp": 2}},
                             {"slice": "v5e-8", "mesh": {"data": 2, "fsdp": 4}}),
    "mlp-data": ("mlp", TWO_SLICES, {"slice": "v5e-8"}),
    "cnn-v4-data": ("cnn", {"slice": "v4-8", "slices": 2}, {"slice": "v4-16"}),
}


def scenario(model: str, pod: dict, steps: int = 3, **extra) -> object:
    """A small model on ``pod`` in fp32 (MXU products in float32, as the one-device
    reference computes them)."""
    spec = {"transformer": ({"name": "transformer", "options": TINY}, TEXT),
            "mlp": ({"name": "mlp", "options": {"hidden": [32], "dropout": False}},
                    {"name": "digits"}),
            "cnn": ({"name": "cnn", "options": {"dropout": False}}, {"name": "digits"})}[model]
    return parse_scenario({
        "name": f"multislice-{model}", "pod": pod, "model": spec[0], "data": spec[1],
        "training": {"global_batch": 16, "steps": steps, "precision": "fp32", "seed": 1,
                     "optimizer": {"name": "adamw", "learning_rate": 0.01}},
        "metrics": {"port": 0}, **extra})


def train(plan, backend: str = "local"):
    """(losses, the assembled parameters) after the plan's steps."""
    if backend == "ray":
        from pod.runtime.pod import Pod as pod_class
    else:
        pod_class = LocalPod
    with pod_class(plan) as pod:
        losses = [pod.step(s).loss for s in range(plan.steps)]
        assert pod.replicas_identical()
        state = pod.checkpoint_state()
    return losses, state["params"], state["optimizer_state"]


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float(np.max(np.abs(a[k] - b[k]))) for k in a)


@pytest.mark.parametrize("case", sorted(CASES))
def test_two_slices_end_with_one_slices_and_one_devices_parameters(case):
    model, multi, single = CASES[case]
    plan = build_plan(scenario(model, multi))
    assert plan.mesh.slices == 2 and plan.topology.chips == build_plan(scenario(model, single)).topology.chips
    one_device = build_plan(scenario(model, {"chip": plan.topology.chip.name, "chips": 1}))
    with LocalPod(plan) as a, LocalPod(one_device) as b:  # the same global batches
        for step in range(plan.steps):
            xa, ya = a.batch(step)
            xb, yb = b.batch(step)
            assert np.array_equal(xa, xb) and np.array_equal(ya, yb)
    losses, params, opt = train(plan)
    one_slice = build_plan(scenario(model, single))
    same_losses, same_params, same_opt = train(one_slice)
    assert losses == same_losses
    assert all(params[k].tobytes() == same_params[k].tobytes() for k in params)
    assert all(opt[k].tobytes() == same_opt[k].tobytes() for k in opt)
    ref_losses, ref_params, _ = train(one_device)
    assert max_diff(params, ref_params) < FP32_ATOL
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert losses[-1] != losses[0]  # it trained


@pytest.mark.slow
def test_two_slices_on_ray_equal_the_in_process_run_bit_for_bit(ray_cluster):
    """Each slice's chip actors, the data axis's bytes across the slices over the ICI
    transport: groups of two everywhere ({data: 2} across, {fsdp: 2, tensor: 2} in each
    slice), so a ring's sums are LocalMesh's and the bits agree."""
    plan = build_plan(scenario(*CASES["transformer-dcn-data"][:2]))
    assert all(n == 2 for n in plan.mesh.sizes.values())
    ray_losses, ray_params, ray_opt = train(plan, backend="ray")
    losses, params, opt = train(plan)
    assert ray_losses == losses
    assert all(ray_params[k].tobytes() == params[k].tobytes() for k in params)
    assert all(ray_opt[k].tobytes() == opt[k].tobytes() for k in opt)


@pytest.mark.slow
def test_a_replicated_model_on_ray_across_slices_is_within_fp32_of_in_process(ray_cluster):
    """{data: 8} over two slices: a ring of 8 sums in its own order, so the Ray run and the
    in-process one agree to float32 rounding, not bit for bit."""
    plan = build_plan(scenario(*CASES["mlp-data"][:2]))
    ray_losses, ray_params, _ = train(plan, backend="ray")
    losses, params, _ = train(plan)
    assert max_diff(ray_params, params) < FP32_ATOL
    np.testing.assert_allclose(ray_losses, losses, rtol=1e-6)


# ------------------------------------------------------------------ timing-only at scale

def test_the_largest_published_job_costs_a_step_in_seconds_without_model_sized_arrays():
    """MaxText's largest published job size, 199 v5e-256 slices (50,944 chips), on T3's
    16B model with 6 sequences of 2,048 tokens per device: a step costs in seconds of
    wall time (measured here: 0.2-0.4 s for the plan and the step) and the process
    never holds a layer of the model (one gathered layer: 16.2B / 32 x 4 B = 2 GB; a
    device's whole fsdp shard: 258 MB): tracemalloc's peak stays under 200 MiB."""
    import tracemalloc

    base = load_scenario(ROOT / "scenarios/maxtext-m1-16b-2x-v5e-256.yaml")
    sc = base.with_overrides(pod__slices=199, pod__dcn_mesh={"data": 199},
                             training__global_batch=6 * 256 * 199)
    tracemalloc.start()
    try:
        t0 = time.perf_counter()
        plan = build_plan(sc, timing_only=True)
        stats = TimingPod(plan).step(0)
        wall = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert plan.topology.chips == 50_944 and plan.mesh.sizes == {"data": 199, "fsdp": 256}
    assert wall < 60.0, wall                      # seconds; a loose bound for a loaded host
    assert peak < 200 * 2**20, peak
    assert stats.axis_dcn_seconds["data"] > 0
    # T3's ~60% over 1 + jitter x E[max of 199 standard normals] (2.75): each step waits
    # for the slowest of 199 slices (interconnect.dcn.slice_wait_seconds), about 13%
    assert 0.50 < stats.mfu < 0.57


# ------------------------------------------------------------------ what the files say

def run_files(tmp_path: Path, sc, **kw) -> tuple[dict, list[dict], str]:
    """``run_training`` in this process: (summary.json, steps.csv rows, console text)."""
    from pod.commands.train import run_training

    log = io.StringIO()
    run_training(build_plan(sc), output_dir=tmp_path, console=Console(file=log, width=200),
                 log_every=1, backend="local", **kw)
    summary = json.loads((tmp_path / "summary.json").read_text())
    rows = list(csv.DictReader((tmp_path / "steps.csv").open()))
    return summary, rows, log.getvalue()


def test_the_files_name_the_axis_across_slices_data_with_its_dcn_part(tmp_path):
    """The DCN data axis is reported as the mesh axis ``data`` (MaxText's
    dcn_data_parallelism is the data axis's factor across slices) and its DCN part
    beside it: summary.json's ``slices``, ``dcn_mesh``, ``collectives_by_axis.data``'s
    ``dcn_*`` figures and ``dcn_bytes_per_step``; steps.csv's ``dcn_collective_seconds``
    and ``dcn_bytes``; the console's title and rows. An axis inside the slices has none."""
    sc = scenario(*CASES["transformer-dcn-data"][:2], steps=2)
    summary, rows, text = run_files(tmp_path, sc)
    assert summary["slices"] == 2 and summary["dcn_mesh"] == {"data": 2}
    assert summary["mesh"] == {"data": 2, "fsdp": 2, "tensor": 2} and summary["chips"] == 8
    data = summary["collectives_by_axis"]["data"]
    assert data["dcn_slices"] == 2
    assert data["dcn_simulated_seconds"] == pytest.approx(data["simulated_seconds"])  # all DCN
    assert data["dcn_bytes_per_step"] == data["bytes_per_step"]   # a 2-ring sends its buffer once
    assert summary["dcn_bytes_per_step"] == data["dcn_bytes_per_step"] > 0
    assert "dcn_slices" not in summary["collectives_by_axis"]["fsdp"]
    last = rows[-1]
    assert float(last["dcn_collective_seconds"]) == pytest.approx(
        float(last["data_collective_seconds"]))
    assert int(last["dcn_bytes"]) == data["dcn_bytes_per_step"]
    assert "2 x v5e-4 (8 chips" in text and "2 slices over the DCN (data x2)" in text
    assert "DCN (2 slices)" in text and "DCN bytes per step per device" in text


def test_one_slice_reports_no_dcn(tmp_path):
    summary, rows, text = run_files(tmp_path, scenario("transformer", {"slice": "v5e-8"},
                                                        steps=1))
    assert summary["slices"] == 1 and summary["dcn_mesh"] == {}
    assert summary["dcn_bytes_per_step"] == 0
    assert all("dcn_slices" not in v for v in summary["collectives_by_axis"].values())
    assert float(rows[0]["dcn_collective_seconds"]) == 0.0 and "DCN" not in text


def test_describe_and_validate_say_the_slices_and_the_dcn(tmp_path):
    from click.testing import CliRunner

    from pod.cli import cli

    path = tmp_path / "two.yaml"
    import yaml
    sc = scenario(*CASES["transformer-dcn-data"][:2], steps=2)
    path.write_text(yaml.safe_dump(sc.model_dump(exclude_none=True)))
    runner = CliRunner()
    ok = runner.invoke(cli, ["validate", str(path)])
    assert ok.exit_code == 0, ok.output
    assert "2 x v5e-4, 8 chips" in ok.output and "mesh {data: 2, fsdp: 2, tensor: 2}" in ok.output
    shown = runner.invoke(cli, ["describe", str(path)], env={"COLUMNS": "200"})
    assert shown.exit_code == 0, shown.output
    assert "DCN" in shown.output and "3.10 GB/s one way" in shown.output
    assert "2 slices of 4 chips" in shown.output
    assert "DCN: " in shown.output and "of the data axis's" in shown.output


# ------------------------------------------------------------------ faults

V5E_DCN_BYTES_PER_S = 3.1e9    # tpu-specs.md [SB], per chip across slices
DCN_LATENCY_S = 2e-5           # chip.spec.DCN_LATENCY_S (an assumption)


def test_a_slow_dcn_slows_the_cross_slice_collectives_from_its_step(tmp_path):
    """slow_dcn {slice: 1, slowdown: 4} from step 2: every data-axis collective (across
    the two slices) runs at 3.1e9 / 4 B/s from that step on, its latency unchanged (the
    2-slice ring closed form); the collectives inside the slices cost what they did;
    the losses are the clean run's (only the clock changes)."""
    seen, clean = [], []
    fault = {"kind": "slow_dcn", "slice": 1, "slowdown": 4.0, "step": 2}
    model, pod = CASES["transformer-dcn-data"][:2]
    run_files(tmp_path / "slow", scenario(model, pod, faults=[fault]), on_step=seen.append)
    run_files(tmp_path / "clean", scenario(model, pod), on_step=clean.append)
    assert [s.loss for s in seen] == [s.loss for s in clean]
    for step, (s, c) in enumerate(zip(seen, clean)):
        divisor = 4.0 if step >= 1 else 1.0
        data = [span for span in s.collective_spans if span.axis == "data"]
        want = sum(span.nbytes * divisor / V5E_DCN_BYTES_PER_S + 2 * DCN_LATENCY_S
                   for span in data)
        assert s.axis_dcn_seconds["data"] == pytest.approx(want, rel=1e-12), step
        assert s.axis_collective_seconds["data"] == pytest.approx(want, rel=1e-12)
        for axis in ("fsdp", "tensor"):
            assert s.axis_collective_seconds[axis] == c.axis_collective_seconds[axis]
    assert seen[1].step_seconds > clean[1].step_seconds
    assert seen[0].step_seconds == clean[0].step_seconds


def test_a_slow_dcn_names_its_slice_and_needs_slices():
    from pod.errors import ScenarioError

    with pytest.raises(ScenarioError, match=r"faults\.0\.slice: 2 is not a slice of this pod "
                                            r"\(slices 0\.\.1\)"):
        build_plan(scenario(*CASES["mlp-data"][:2],
                            faults=[{"kind": "slow_dcn", "slice": 2, "slowdown": 2.0}]))
    with pytest.raises(ScenarioError, match=r"faults\.0\.kind: slow_dcn .* one slice"):
        build_plan(scenario("mlp", {"slice": "v5e-8"},
                            faults=[{"kind": "slow_dcn", "slice": 0, "slowdown": 2.0}]))
    with pytest.raises(ScenarioError, match="slowdown does not belong to kill_chip"):
        scenario("mlp", TWO_SLICES, faults=[{"kind": "kill_chip", "chip": 1, "slowdown": 2.0}])


CKPT = {"every_steps": 2, "keep": 5}


def final_state(out: Path, step: int = 6) -> dict[str, bytes]:
    from pod.state.checkpoint import checkpoint_path, load_checkpoint

    ck = load_checkpoint(checkpoint_path(out / "checkpoints", step))
    return {k: v.tobytes() for k, v in {**ck.params, **ck.optimizer_state}.items()}


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory):
    out = tmp_path_factory.mktemp("multislice-fault-free")
    summary, _, _ = run_files(out, scenario(*CASES["transformer-dcn-data"][:2], steps=6,
                                            checkpoint=CKPT))
    return out, summary


@pytest.mark.parametrize("fault, dead, recomputed", [
    ({"kind": "kill_chip", "chip": 6, "step": 4}, [6], 1),        # slice 1's chip 2
    ({"kind": "kill_host", "host": 1, "step": 5}, [4, 5, 6, 7], 0),  # slice 1's host
], ids=["chip-in-slice-1", "host-of-slice-1"])
def test_a_chip_killed_in_the_second_slice_is_recovered_bit_identical(fault_free, tmp_path,
                                                                      fault, dead, recomputed):
    """A chip of the second slice dies (LocalPod's kill: its next step fails as a dead
    actor's does); the run restores every chip from the newest checkpoint, recomputes
    the steps since and ends with the fault-free run's bits. A host never spans slices:
    host 1 of two v5e-4 slices is slice 1's four chips."""
    reference, ref_summary = fault_free
    summary, rows, log = run_files(tmp_path, scenario(*CASES["transformer-dcn-data"][:2],
                                                      steps=6, checkpoint=CKPT,
                                                      faults=[fault]))
    assert final_state(tmp_path) == final_state(reference)
    assert summary["final_loss"] == ref_summary["final_loss"]
    (event,) = summary["faults"]
    assert event["dead_chips"] == dead and event["recovered"] is True
    assert event["steps_recomputed"] == recomputed
    assert [int(r["step"]) for r in rows] == list(range(1, 7))
    assert summary["replicas_identical"] is True


@pytest.mark.slow
def test_a_chip_actor_killed_in_the_second_slice_on_ray_is_recovered(ray_cluster, fault_free,
                                                                     tmp_path):
    """The same on Ray: ``ray.kill`` of chip 6's actor (slice 1) during step 4, new actors,
    the step-2 checkpoint restored; groups of two everywhere, so the end is the
    in-process fault-free run's bits."""
    from pod.commands.train import run_training

    reference, ref_summary = fault_free
    fault = {"kind": "kill_chip", "chip": 6, "step": 4}
    log = io.StringIO()
    summary = run_training(build_plan(scenario(*CASES["transformer-dcn-data"][:2], steps=6,
                                               checkpoint=CKPT, faults=[fault])),
                           output_dir=tmp_path, console=Console(file=log, width=200),
                           log_every=1, backend="ray")
    assert final_state(tmp_path) == final_state(reference)
    assert summary["final_loss"] == ref_summary["final_loss"]
    (event,) = summary["faults"]
    assert event["dead_chips"] == [6] and event["recovered"] is True
    assert event["steps_recomputed"] == 1 and event["detection_wall_seconds"] > 0


# ------------------------------------------------------------------ the shipped scenario

SHIPPED = ROOT / "scenarios/multislice-transformer-2x-v5e-4.yaml"


def test_the_shipped_multislice_scenario_trains_in_process(tmp_path):
    """``tpu-pod run scenarios/multislice-transformer-2x-v5e-4.yaml --in-process``, 4 steps:
    two slices, the data axis across them, the loss going down."""
    sc = load_scenario(SHIPPED).with_overrides(training__steps=4)
    summary, rows, text = run_files(tmp_path, sc)
    assert summary["completed"] is True and summary["replicas_identical"] is True
    assert (summary["slices"], summary["dcn_mesh"]) == (2, {"data": 2})
    assert summary["final_loss"] < summary["initial_loss"]
    assert summary["collectives_by_axis"]["data"]["dcn_simulated_seconds"] > 0
    assert len(rows) == 4 and "2 x v5e-4" in text


@pytest.mark.slow
def test_the_shipped_multislice_scenario_on_ray_equals_in_process(ray_cluster):
    """The same scenario on Ray chip actors (two slices of 4), 3 steps: groups of two on
    every axis, so the bits of the in-process run."""
    plan = build_plan(load_scenario(SHIPPED).with_overrides(training__steps=3))
    ray_losses, ray_params, _ = train(plan, backend="ray")
    losses, params, _ = train(plan)
    assert ray_losses == losses
    assert all(ray_params[k].tobytes() == params[k].tobytes() for k in params)
