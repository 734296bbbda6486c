"""The real sharded transformer program on Ray actors (``ShardedPod``, 8 devices of a
v5e 2x4 torus, or of a v3 2x2 torus, a device per TensorCore; {data: 2, fsdp: 2,
tensor: 2}, 3 steps, tiny dims, fp32 numerics):
its parameters equal the in-process ``LocalMesh`` run of the same program (the
reference the runtime's ICI collectives are checked against) bit for bit, and the
single-device training within the program's own fp32 tolerance
(tests/pod/workloads/test_sharded.py). And the transformer-sharded scenario:
validate and run refuse and accept the same things."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from chip import TensorCore
from chip.spec import V3, V5E
from interconnect import Torus, calibrated_link
from pod.config.mesh import layout_mesh
from pod.config.sharding import MeshCollectiveCosts, device_chip_spec, on_chip_bandwidth
from pod.runtime.sharded_pod import ShardedPod
from pod.workloads import TransformerConfig, TransformerModel, build_optimizer
from pod.programs.collectives import LocalMesh
from pod.programs import DeviceCoords, ShardedTransformer

ROOT = Path(__file__).resolve().parents[3]
TINY = {"vocabulary": 32, "sequence_length": 8, "embed_dim": 16, "heads": 4, "head_dim": 4,
        "mlp_dim": 32, "layers": 1}
SEED, STEPS, BATCH = 0, 3, 8
FP32_ATOL = 5e-5  # test_sharded.py's tolerance against one device


def _batches():
    rng = np.random.default_rng(1)
    shape = (BATCH, TINY["sequence_length"])
    return [(rng.integers(0, TINY["vocabulary"], shape), rng.integers(0, TINY["vocabulary"], shape))
            for _ in range(STEPS)]


def _program(mesh):
    model = TransformerModel(TransformerConfig(**TINY))
    return ShardedTransformer(model, mesh.sizes, build_optimizer("adamw", learning_rate=1e-2))


#: chip -> its 8-device mesh: v5e 2x4 (a device per chip), v3-8 2x2 (a device per TensorCore)
MESHES = {"v5e": (V5E, lambda: layout_mesh({"data": 2, "fsdp": 2, "tensor": 2}, Torus((2, 4)))),
          "v3": (V3, lambda: layout_mesh({"data": 2, "fsdp": 2, "tensor": 2}, Torus((2, 2)),
                                         per_chip=2))}


def _single(chip):
    model = TransformerModel(TransformerConfig(**TINY))
    opt = build_optimizer("adamw", learning_rate=1e-2)
    core = TensorCore(device_chip_spec(chip).core, precision="fp32")
    params = model.init_params(SEED)
    state, losses = opt.init(params), []
    for step, (x, y) in enumerate(_batches(), 1):
        loss, grads = model.loss_and_grads(core, params, x, y)
        params, state = opt.update(core, grads, state, params, step)
        losses.append(loss)
    return params, losses


def _local_mesh(mesh, chip):
    program = _program(mesh)

    def device(comm):
        core = TensorCore(device_chip_spec(chip).core, precision="fp32")
        shard = program.init_local(SEED, DeviceCoords.of(comm))
        part = program.batch_slice(BATCH, shard.coords)
        for step, (x, y) in enumerate(_batches(), 1):
            shard = program.train_step(core, comm, shard, x[part], y[part], step).shard
        return shard

    return program.assemble(LocalMesh.for_mesh(mesh).run(device))


@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.parametrize("name", sorted(MESHES))
def test_ray_sharded_transformer_equals_the_local_mesh_and_one_device(name):
    chip, make_mesh = MESHES[name]
    mesh = make_mesh()
    assert mesh.size == 8
    link = calibrated_link(name, chip.ici_link_bandwidth_bytes_per_s, chip.ici_latency_s)
    costs = MeshCollectiveCosts(mesh, link, on_chip_bandwidth(chip))
    with ShardedPod(mesh, chip, _program(mesh), costs, SEED, precision="fp32") as pod:
        stats = [pod.step(s, x, y) for s, (x, y) in enumerate(_batches())]
        got = pod.assemble()
        identical = pod.replicas_identical()
    want_params, want_losses = _single(chip)
    local = _local_mesh(mesh, chip)
    assert identical
    assert set(got) == set(local)
    for key in got:  # the same ring orders and float32 sums in the same order: the same bits
        np.testing.assert_array_equal(got[key], local[key], err_msg=key)
    assert max(float(np.max(np.abs(got[k] - want_params[k]))) for k in got) < FP32_ATOL
    np.testing.assert_allclose([s.loss for s in stats], want_losses, rtol=1e-6)
    assert set(stats[-1].axis_collective_bytes) == {"data", "fsdp", "tensor"}
    peak = device_chip_spec(chip).peak_bf16_flops_per_s * 8
    assert stats[-1].peak_flops_per_s == pytest.approx(peak)  # 8 chips, or 8 TensorCores
    tensor_on_chip = all(d // mesh.devices_per_chip == e // mesh.devices_per_chip
                         for d, e in mesh.groups("tensor"))
    assert tensor_on_chip == (name == "v3")  # v3: tensor takes the two cores of a chip


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


@pytest.mark.usefixtures("ray_cluster")
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
    code, output = _cli(["run", str(path), "--steps", "4", "--output-dir", str(straight)])
    assert code == 0, output
    start.mkdir()
    shutil.copy(checkpoint_path(straight / "checkpoints", 2), start)
    code, output = _cli(["run", str(path), "--steps", "4", "--resume", str(start),
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
    code, output = _cli(["run", str(path), "--steps", "4", "--output-dir", str(killed)])
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


@pytest.mark.usefixtures("ray_cluster")
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
    plain = api.run(text, steps=3, quiet=True).history
    slowed = api.run(text + faults, steps=3, quiet=True).history
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


@pytest.mark.usefixtures("ray_cluster")
def test_a_sharded_run_writes_its_axes_to_the_summary_and_the_trace(tmp_path):
    """``tpu-pod run`` of the shipped sharded scenario for 2 steps with ``--trace``:
    summary.json holds the mesh and per-axis collectives; the trace has a lane per
    mesh axis whose collectives' bytes add up to the summary's for the traced step,
    and the step's span ends where the simulated clock says."""
    import gzip
    import json

    out, trace = tmp_path / "out", tmp_path / "trace.json.gz"
    code, output = _cli(["run", str(_scenario(tmp_path)), "--steps", "2", "--output-dir",
                         str(out), "--trace", str(trace), "--trace-steps", "2", "--report"])
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
        assert traced * 2 == by_axis[axis]["bytes"], axis  # two equal steps, one traced
    end = max(e["ts"] + e["dur"] for e in spans)
    assert end == pytest.approx((steps[0]["ts"] + steps[0]["dur"]), rel=1e-9)
    # the summary's step time is the mean of the steps after the first: step 2's
    assert steps[0]["dur"] == pytest.approx(summary["simulated_step_seconds"] * 1e6, rel=1e-9)
    # HBM per device: its parameter, gradient and AdamW chunks and the plan's activations
    from pod.config.plan import build_plan
    from pod.config.scenario import load_scenario

    memory = build_plan(load_scenario(_scenario(tmp_path))).memory
    assert summary["hbm_peak_bytes"] == sum(memory[k] for k in ("params", "grads",
                                                                 "optimizer_state", "activations"))
    assert summary["ici_bytes_per_step"] > 0
    # the console's table: the mesh, and per axis a step's bytes as summary.json's / 2
    assert "{data: 2, fsdp: 2, tensor: 2}" in output and "collectives, exposed" in output
    assert "allreduce algorithm" not in output and "HBM peak per device" in output
    page = (out / "report.html").read_text()
    for axis in ("data", "fsdp", "tensor"):
        row = next(line for line in output.splitlines() if line.strip("│ ").startswith(axis + " "))
        assert f"{by_axis[axis]['bytes'] // 2:,} B" in row, row
        assert f"{by_axis[axis]['bytes'] // 2:,} B" in page, axis  # report.html's rows too
    assert "HBM plan per device" in page and "allreduce algorithm" not in page
