"""The real sharded transformer program on the runtime's pods ({data: 2, fsdp: 2,
tensor: 2}, 8 devices of a v5e 2x4 torus or of a v3-8, a device per TensorCore; 3
steps, tiny dims, fp32 numerics): in this process (``LocalPod``) its parameters equal
the bare program on ``LocalMesh`` bit for bit and single-device training within the
program's own fp32 tolerance (tests/pod/workloads/test_sharded.py); on Ray chip
actors (slow tier) they equal ``LocalPod``'s bit for bit (groups of two: a ring's
sum is ``LocalMesh``'s). And the transformer-sharded scenario through the CLI and
the API, in process: validate and run refuse and accept the same things, resume
and recovery end on the uninterrupted run's bits, faults change time only, the
summary and the trace hold the mesh's axes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from chip import TensorCore, get_chip_spec
from pod.config.plan import build_plan
from pod.config.scenario import parse_scenario
from pod.config.sharding import device_chip_spec
from pod.programs import DeviceCoords
from pod.programs.collectives import LocalMesh
from pod.runtime.base import plan_program
from pod.runtime.local import LocalPod
from pod.workloads import build_optimizer

ROOT = Path(__file__).resolve().parents[3]
TINY = {"embed_dim": 16, "heads": 4, "head_dim": 4, "mlp_dim": 32, "layers": 1}
SEED, STEPS, BATCH = 0, 3, 8
FP32_ATOL = 5e-5  # test_sharded.py's tolerance against one device


def tiny_plan(slice_name: str):
    return build_plan(parse_scenario({
        "name": "sharded-transformer", "pod": {"slice": slice_name,
                                               "mesh": {"data": 2, "fsdp": 2, "tensor": 2}},
        "model": {"name": "transformer", "options": TINY},
        "data": {"name": "synthetic_text",
                 "options": {"vocabulary": 32, "sequence_length": 8, "num_examples": 64}},
        "training": {"global_batch": BATCH, "steps": STEPS, "seed": SEED, "precision": "fp32",
                     "optimizer": {"name": "adamw", "learning_rate": 1e-2}},
        "metrics": {"port": 0}}))


#: 8 devices: v5e-8 (a 2x4 torus, a device per chip), v3-8 (2x2, a device per TensorCore)
SLICES = {"v5e": "v5e-8", "v3": "v3-8"}


def _single(plan, batches):
    model = plan.model
    opt = build_optimizer("adamw", learning_rate=1e-2)
    core = TensorCore(device_chip_spec(plan.topology.chip).core, precision="fp32")
    params = model.init_params(SEED)
    state, losses = opt.init(params), []
    for step, (x, y) in enumerate(batches, 1):
        loss, grads = model.loss_and_grads(core, params, x, y)
        params, state = opt.update(core, grads, state, params, step)
        losses.append(loss)
    return params, losses


def _local_mesh(plan, batches):
    """The bare program on ``LocalMesh`` (no Device, no pod)."""
    program = plan_program(plan)

    def device(comm):
        core = TensorCore(device_chip_spec(plan.topology.chip).core, precision="fp32")
        shard = program.init_local(SEED, DeviceCoords.of(comm))
        part = program.batch_slice(BATCH, shard.coords)
        for step, (x, y) in enumerate(batches, 1):
            shard = program.train_step(core, comm, shard, x[part], y[part], step).shard
        return shard

    return program.assemble(LocalMesh.for_mesh(plan.mesh).run(device))


def _train(pod, plan):
    stats = [pod.step(s) for s in range(plan.steps)]
    assert pod.replicas_identical()
    return stats, pod.checkpoint_state()["params"]


@pytest.fixture(scope="module", params=sorted(SLICES))
def local_run(request):
    plan = tiny_plan(SLICES[request.param])
    with LocalPod(plan) as pod:
        stats, params = _train(pod, plan)
        batches = [pod.batch(s) for s in range(plan.steps)]
    return request.param, plan, stats, params, batches


@pytest.mark.usefixtures("one_blas_thread")
def test_the_sharded_transformer_equals_the_local_mesh_and_one_device(local_run):
    name, plan, stats, got, batches = local_run
    assert plan.mesh.size == 8 and plan.mesh.devices_per_chip == (2 if name == "v3" else 1)
    want_params, want_losses = _single(plan, batches)
    local = _local_mesh(plan, batches)
    assert set(got) == set(local) == set(want_params)
    for key in got:  # the same program, the same float32 sums in the same order
        np.testing.assert_array_equal(got[key], local[key], err_msg=key)
    assert max(float(np.max(np.abs(got[k] - want_params[k]))) for k in got) < FP32_ATOL
    np.testing.assert_allclose([s.loss for s in stats], want_losses, rtol=1e-6)
    assert set(stats[-1].axis_collective_bytes) == {"data", "fsdp", "tensor"}
    chip = get_chip_spec(name)
    assert stats[-1].peak_flops_per_s == pytest.approx(4 * chip.peak_bf16_flops_per_s
                                                       if name == "v3" else
                                                       8 * chip.peak_bf16_flops_per_s)
    tensor_on_chip = all(d // plan.mesh.devices_per_chip == e // plan.mesh.devices_per_chip
                         for d, e in plan.mesh.groups("tensor"))
    assert tensor_on_chip == (name == "v3")  # v3: tensor takes the two cores of a chip


@pytest.mark.slow
def test_on_ray_chip_actors_the_sharded_transformer_trains_to_the_in_process_bits(
        ray_cluster, local_run):
    """Every group has two devices: the ICI transport's ring sums are ``LocalMesh``'s,
    so the losses, the parameters and the simulated steps are the same bits (v3: the
    chip actor holds its two TensorCore devices)."""
    from pod.runtime.pod import Pod

    name, plan, stats, want, _ = local_run
    with Pod(plan) as pod:
        assert len(pod.actors) == plan.topology.chips == (4 if name == "v3" else 8)
        got_stats, got = _train(pod, plan)
    assert [s.loss for s in got_stats] == [s.loss for s in stats]
    assert [s.step_seconds for s in got_stats] == [s.step_seconds for s in stats]
    assert set(got) == set(want)
    for key in got:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def _cli(args):
    """``tpu-pod ARGS`` in this process: (exit code, stdout + stderr)."""
    import contextlib
    import io

    from pod.cli import main

    out = io.StringIO()
    with contextlib.redirect_stderr(out), contextlib.redirect_stdout(out):
        try:
            main(args)
        except SystemExit as exit_:
            return exit_.code, out.getvalue()
    return 0, out.getvalue()


def _scenario(tmp_path, extra=""):
    text = (ROOT / "scenarios" / "transformer-sharded.yaml").read_text() + extra
    path = tmp_path / "s.yaml"
    path.write_text(text)
    return path


def test_the_shipped_scenario_validates():
    code, output = _cli(["validate", str(ROOT / "scenarios" / "transformer-sharded.yaml")])
    assert code == 0, output
    assert "transformer-sharded.yaml: ok" in output


@pytest.mark.parametrize("extra, words", [
    ("faults:\n  - {kind: kill_chip, chip: 9, step: 2}\n", "faults.0.chip"),
    ("faults:\n  - {kind: slow_link, link: \"0->5\", slowdown: 2.0, step: 1}\n",
     "faults.0.link"),
])
def test_validate_and_run_refuse_the_same_line(tmp_path, extra, words):
    path = _scenario(tmp_path, extra)
    checked = _cli(["validate", str(path)])
    ran = _cli(["run", str(path), "--output-dir", str(tmp_path / "out")])
    assert checked[0] == ran[0] == 2
    assert words in checked[1] and words in ran[1]
    assert "Traceback" not in checked[1] + ran[1]


@pytest.mark.slow  # several seconds: the slow tier (make test stays under 3 minutes)
def test_resumed_and_recovered_sharded_runs_end_with_the_uninterrupted_runs_bits(tmp_path):
    """The shipped sharded scenario for 4 steps, checkpoints every 2; a run resumed
    from its step-2 checkpoint to step 4; a run whose chip 3 is killed during step 4
    (every device actor replaced, the step-2 checkpoint restored, steps 3-4 run
    again). The step-4 checkpoints hold the same parameters and AdamW state bit for
    bit (the checkpoint's whole model is sharded onto the devices again, padding and
    all); summary.json's per-axis sums and step count cover 4 steps, as the
    uninterrupted run's."""
    import json
    import shutil

    from pod.state.checkpoint import checkpoint_path, load_checkpoint

    text = (ROOT / "scenarios" / "transformer-sharded.yaml").read_text()
    assert "every_steps: 100" in text
    path = tmp_path / "s.yaml"
    path.write_text(text.replace("every_steps: 100", "every_steps: 2"))
    straight, resumed, start = tmp_path / "straight", tmp_path / "resumed", tmp_path / "start"
    code, output = _cli(["run", str(path), "--steps", "4", "--in-process", "--output-dir",
                         str(straight)])
    assert code == 0, output
    start.mkdir()
    shutil.copy(checkpoint_path(straight / "checkpoints", 2), start)
    code, output = _cli(["run", str(path), "--steps", "4", "--in-process", "--resume", str(start),
                         "--output-dir", str(resumed)])
    assert code == 0, output
    assert "Resuming from" in output and "step 2 of 4" in output
    want = load_checkpoint(checkpoint_path(straight / "checkpoints", 4))
    got = load_checkpoint(checkpoint_path(resumed / "checkpoints", 4))
    assert got.step == 4
    for tree in ("params", "optimizer_state"):
        a, b = getattr(got, tree), getattr(want, tree)
        assert set(a) == set(b)
        for key in a:
            np.testing.assert_array_equal(a[key], b[key], err_msg=f"{tree} {key}")
    assert got.digests == want.digests
    one, two = (json.loads((d / "summary.json").read_text()) for d in (straight, resumed))
    assert two["resumed_from_step"] == 2 and two["steps"] == one["steps"] == 4
    assert two["collectives_by_axis"] == one["collectives_by_axis"]
    assert two["final_loss"] == one["final_loss"]

    killed = tmp_path / "killed"
    path.write_text(path.read_text() + "faults:\n  - {kind: kill_chip, chip: 3, step: 4}\n")
    code, output = _cli(["run", str(path), "--steps", "4", "--in-process", "--output-dir",
                         str(killed)])
    assert code == 0, output
    assert "restored step 2, recomputing 1 step(s)" in output
    got = load_checkpoint(checkpoint_path(killed / "checkpoints", 4))
    for tree in ("params", "optimizer_state"):
        a, b = getattr(got, tree), getattr(want, tree)
        for key in a:
            np.testing.assert_array_equal(a[key], b[key], err_msg=f"killed: {tree} {key}")
    three = json.loads((killed / "summary.json").read_text())
    assert three["faults"][0]["recovered"] is True and three["steps_recomputed"] == 1
    assert three["collectives_by_axis"] == one["collectives_by_axis"]


def test_stragglers_and_link_faults_slow_a_sharded_run_from_their_step():
    """v5e 2x4, {data: 2, fsdp: 2, tensor: 2}: chip 1 runs 3x slower from step 2, link
    0->4 (in the tensor group of chips 0 and 4 only) at a quarter of its bandwidth from
    step 3. Step 2's compute is exactly 3x step 1's (the slowest device's records x 3);
    step 3's tensor collectives take longer, its data and fsdp ones do not; the
    parameters are those of the fault-free run (faults change time, not numbers)."""
    from pod import api

    text = (ROOT / "scenarios" / "transformer-sharded.yaml").read_text()
    text = text.replace("checkpoint:\n  every_steps: 100\n", "")  # no files to write
    assert "checkpoint" not in text.split("name:")[1]
    faults = ("faults:\n  - {kind: slow_chip, chip: 1, factor: 3.0, step: 2}\n"
              "  - {kind: slow_link, link: \"0->4\", slowdown: 4.0, step: 3}\n")
    assert (0, 4) in api.validate(text).mesh.groups("tensor")
    plain = api.run(text, steps=3, quiet=True, in_process=True).history
    slowed = api.run(text + faults, steps=3, quiet=True, in_process=True).history
    assert slowed[0].compute_seconds == plain[0].compute_seconds
    assert slowed[1].compute_seconds == pytest.approx(3 * plain[1].compute_seconds, rel=1e-12)
    assert slowed[1].axis_collective_seconds == plain[1].axis_collective_seconds
    late, early = slowed[2].axis_collective_seconds, plain[2].axis_collective_seconds
    assert late["tensor"] > early["tensor"]
    assert (late["data"], late["fsdp"]) == (early["data"], early["fsdp"])
    assert [s.loss for s in slowed] == [s.loss for s in plain]


def test_a_checkpoint_of_another_mesh_is_refused_in_one_line(tmp_path):
    """--resume checks the scenario: a checkpoint of {data: 2, fsdp: 2, tensor: 2} does
    not continue a run on {fsdp: 4, tensor: 2} (one line naming pod.mesh)."""
    from pod.state.checkpoint import save_checkpoint, checkpoint_path
    from pod.config.plan import build_plan
    from pod.config.scenario import load_scenario
    from pod.state.resume import initial_checkpoint

    plan = build_plan(load_scenario(ROOT / "scenarios" / "transformer-sharded.yaml"))
    (tmp_path / "ck").mkdir()
    save_checkpoint(checkpoint_path(tmp_path / "ck", 0), initial_checkpoint(plan))
    other = _scenario(tmp_path)
    other.write_text(other.read_text().replace("{data: 2, fsdp: 2, tensor: 2}",
                                               "{fsdp: 4, tensor: 2}"))
    code, output = _cli(["run", str(other), "--resume", str(tmp_path / "ck"), "--output-dir",
                         str(tmp_path / "out")])
    assert code == 2 and "pod.mesh" in output and "Traceback" not in output


def test_a_sharded_run_writes_its_axes_to_the_summary_and_the_trace(tmp_path):
    """``tpu-pod run`` of the shipped sharded scenario for 2 steps with ``--trace``:
    summary.json holds the mesh and per-axis collectives; the trace has a lane per
    mesh axis whose collectives' bytes add up to the summary's for the traced step,
    and the step's span ends where the simulated clock says."""
    import gzip
    import json

    out, trace = tmp_path / "out", tmp_path / "trace.json.gz"
    code, output = _cli(["run", str(_scenario(tmp_path)), "--steps", "2", "--in-process",
                         "--output-dir", str(out), "--trace", str(trace), "--trace-steps", "2",
                         "--report"])
    assert code == 0, output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mesh"] == {"data": 2, "fsdp": 2, "tensor": 2}
    by_axis = summary["collectives_by_axis"]
    assert set(by_axis) == {"data", "fsdp", "tensor"}
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    lanes = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert {"steps", "compute (slowest device)", "ICI data", "ICI fsdp", "ICI tensor"} <= \
        set(lanes.values())
    spans = [e for e in events if e["ph"] == "X"]
    steps = [e for e in spans if lanes[e["tid"]] == "steps"]
    assert [e["name"] for e in steps] == ["step 2"]
    for axis in ("data", "fsdp", "tensor"):
        traced = sum(e["args"]["bytes"] for e in spans if lanes[e["tid"]] == f"ICI {axis}")
        assert traced == by_axis[axis]["bytes_per_step"], axis  # two equal steps, one traced
    end = max(e["ts"] + e["dur"] for e in spans)
    assert end == pytest.approx((steps[0]["ts"] + steps[0]["dur"]), rel=1e-9)
    # the summary's step time is the mean of the steps after the first: step 2's
    assert steps[0]["dur"] == pytest.approx(summary["simulated_step_seconds"] * 1e6, rel=1e-9)
    # HBM per device: its parameter, gradient and AdamW chunks (float32, as the program
    # keeps them) and the plan's activations
    from pod.config.plan import build_plan
    from pod.config.scenario import load_scenario
    from pod.runtime.base import plan_program

    plan = build_plan(load_scenario(_scenario(tmp_path)))
    program = plan_program(plan)
    assert summary["hbm_peak_bytes"] == (2 * program.local_param_bytes()
                                         + program.optimizer_state_bytes()
                                         + plan.memory["activations"])
    assert summary["ici_bytes_per_step"] > 0
    # the console's table: the mesh, and per axis a step's bytes as summary.json's
    assert "{data: 2, fsdp: 2, tensor: 2}" in output and "collectives, exposed" in output
    assert "allreduce algorithm" not in output and "HBM peak per device" in output
    page = (out / "report.html").read_text()
    for axis in ("data", "fsdp", "tensor"):
        row = next(line for line in output.splitlines() if line.strip("│ ").startswith(axis + " "))
        assert f"{int(by_axis[axis]['bytes_per_step']):,} B" in row, row
        assert f"{int(by_axis[axis]['bytes_per_step']):,} B" in page, axis  # report.html too
    assert "HBM plan per device" in page and "allreduce algorithm" not in page
