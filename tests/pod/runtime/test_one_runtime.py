"""One runtime for every mesh (issue 22): the same device program on every back-end
gives the same figures, data parallelism is the mesh ``{data: N}``, and the step's
MFU and device are those of the mesh's devices.

- timing-only (``TimingPod``: one device, shapes only) = functional (``LocalPod``:
  every device in this process), record for record and call for call;
- the chip actor's code (``ChipActor``: devices, their ``IciPort``s, the ring
  transport) run in this process = ``LocalPod``, bit for bit on groups of two;
- a data-parallel scenario = the same scenario written as ``pod.mesh: {data: N}``;
- MFU: model FLOPs of the global batch over the device peak x devices (v2 / v3: a
  device is a TensorCore, half a chip), and a megacore device has both cores' VPUs;
- sweeps: a timing-only sweep never imports Ray; a functional sweep runs a
  sharded mesh (on Ray, in the slow tier).
"""

from __future__ import annotations

import secrets
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from chip import get_chip_spec
from pod.config.plan import build_plan
from pod.config.scenario import parse_scenario
from pod.runtime.local import LocalPod
from pod.runtime.timing import TimingPod

pytestmark = pytest.mark.usefixtures("one_blas_thread")

ROOT = Path(__file__).resolve().parents[3]
TINY = {"embed_dim": 32, "heads": 4, "head_dim": 8, "mlp_dim": 64, "layers": 2}
TEXT = {"name": "synthetic_text",
        "options": {"vocabulary": 64, "sequence_length": 16, "num_examples": 64}}


def cnn(slice_name="v2-8", batch=64, **pod):
    """The quick start's CNN on digits, data parallel."""
    return parse_scenario({
        "name": "one-runtime-cnn", "pod": {"slice": slice_name, **pod}, "model": {"name": "cnn"},
        "data": {"name": "digits"},
        "training": {"global_batch": batch, "steps": 2, "optimizer": {"name": "adam"}},
        "metrics": {"port": 0}})


def transformer(slice_name, mesh=None, batch=8, precision="bf16", **options):
    """A tiny transformer on random tokens (``mesh`` None: no pod.mesh key)."""
    pod = {"slice": slice_name} | ({"mesh": mesh} if mesh is not None else {})
    return parse_scenario({
        "name": "one-runtime-transformer", "pod": pod,
        "model": {"name": "transformer", "options": {**TINY, **options}}, "data": TEXT,
        "training": {"global_batch": batch, "steps": 2, "precision": precision,
                     "optimizer": {"name": "adamw", "learning_rate": 0.01}},
        "metrics": {"port": 0}})


# ------------------------------------------------------------------ timing-only = functional

CASES = {
    "cnn-v2-8-data-8": lambda: cnn(),
    "transformer-v4-8-fsdp-2-tensor-2": lambda: transformer("v4-8", {"fsdp": 2, "tensor": 2}),
    "transformer-v3-8-data-fsdp-tensor": lambda: transformer(
        "v3-8", {"data": 2, "fsdp": 2, "tensor": 2}, remat="minimal"),
}

#: the StepStats figures a timing-only step must reproduce exactly
SAME = ("step_seconds", "compute_seconds", "update_seconds", "collective_seconds",
        "exposed_collective_seconds", "infeed_seconds", "exposed_infeed_seconds",
        "model_flops", "hardware_flops", "peak_flops_per_s", "mfu", "axis_collective_bytes",
        "axis_collective_seconds", "axis_exposed_seconds", "ici_link_bytes",
        "compute_bound_seconds", "update_bound_seconds", "hbm_capacity_bytes")


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_timing_only_step_equals_a_functional_one_record_for_record(case):
    """Every device of the functional step (real numerics, real collectives in
    ``LocalMesh``) records the ops and the collective calls of the timing-only
    device (products skipped, zero views); the two steps' figures are the same floats."""
    plan = build_plan(CASES[case]())
    with LocalPod(plan) as pod:
        functional = [pod.step(s) for s in range(plan.steps)]
        reports = pod.last_reports
    timing = TimingPod(plan)
    timed = [timing.step(s) for s in range(plan.steps)]
    one = timing.last_report
    assert len(one.record_seconds) > 20 and len(reports) == plan.mesh.size > 1
    for report in reports:  # SPMD: every device does the same work, one stands for all
        assert report.record_seconds == one.record_seconds, report.device
        assert report.record_bounds == one.record_bounds, report.device
        assert report.calls == one.calls, report.device
        assert report.update_start == one.update_start, report.device
        assert report.mxu_flops == one.mxu_flops, report.device
        assert report.hbm_peak_bytes == one.hbm_peak_bytes, report.device
    assert len(one.calls) >= 1
    for f, t in zip(functional, timed):
        for name in SAME:
            assert getattr(t, name) == getattr(f, name), name
        assert t.device_mxu_flops == {0: one.mxu_flops}
        assert sum(f.device_mxu_flops.values()) == plan.mesh.size * one.mxu_flops
        assert t.step_seconds > 0


# ------------------------------------------------------------------ the chip actor's code

def in_process_chips(plan, steps: int):
    """Every chip's ``ChipActor`` in this process, each step's calls in threads: the Ray
    pod's device code and ICI transport (``IciPort`` on loopback) without Ray.

    Returns:
        Per step, every device's ``DeviceReport``; and the devices' final states.
    """
    from pod.runtime.actor import ChipActor
    from pod.runtime.base import chip_devices, plan_program
    from pod.runtime.blas import one_blas_thread

    training = plan.scenario.training
    program = plan_program(plan)
    layout = chip_devices(plan)
    chips = [ChipActor(plan.topology.chip, rank, devices, program, training.seed,
                       devices_per_chip=plan.mesh.devices_per_chip,
                       precision=training.precision,
                       activation_bytes=int(plan.memory.get("activations", 0)),
                       limit_threads=False)
             for rank, devices in enumerate(layout)]
    key = secrets.token_bytes(16)
    addresses = {d: tuple(a) for chip, devices in zip(chips, layout)
                 for (d, _), a in zip(devices, chip.ici_addresses(key))}
    for chip in chips:
        chip.set_peers(addresses)
    batches = LocalPod(plan)  # for its batch and its split only
    out = []
    try:
        # BLAS on one thread as in every chip actor (pod.runtime.blas): the same bits
        with one_blas_thread(), ThreadPoolExecutor(len(chips)) as pool:
            for step in range(steps):
                xs, ys = batches.split(*batches.batch(step))
                futures = [pool.submit(chip.step, step, [xs[d] for d, _ in devices],
                                       [ys[d] for d, _ in devices], training.seed,
                                       (step + 1) << 20)
                           for chip, devices in zip(chips, layout)]
                out.append([r for f in futures for r in f.result(timeout=300)])
        return out, [s for chip in chips for s in chip.shards()]
    finally:
        for chip in chips:
            for port in chip._ports.values():
                port.close()


@pytest.mark.parametrize("make", [
    lambda: transformer("v5e-4", {"fsdp": 2, "tensor": 2}, precision="fp32"),
    lambda: parse_scenario({  # one v2 chip: its two TensorCores, BatchNorm and dropout
        "name": "one-chip", "pod": {"chip": "v2", "chips": 1},
        "model": {"name": "mlp", "options": {"hidden": [16], "batch_norm": True,
                                             "dropout": 0.2}},
        "data": {"name": "digits"},
        "training": {"global_batch": 32, "steps": 3, "optimizer": {"name": "adam"}},
        "metrics": {"port": 0}}),
], ids=["v5e-fsdp-2-tensor-2", "v2-one-chip-data-2"])
def test_the_chip_actors_code_in_process_equals_the_local_pod_bit_for_bit(make):
    """Groups of two: a ring's sum and ``LocalMesh``'s are the same two additions, so
    the ICI transport and the in-process mesh give the same reports (losses, records,
    calls) and the same parameter and optimizer bits at every step."""
    plan = build_plan(make())
    steps = plan.steps
    chip_reports, chip_shards = in_process_chips(plan, steps)
    with LocalPod(plan) as pod:
        for step in range(steps):
            pod.step(step)
            assert pod.last_reports == chip_reports[step], step
        local_shards = pod.shards()
    assert len(chip_shards) == len(local_shards) == plan.mesh.size
    for got, want in zip(chip_shards, local_shards):
        assert got.coords == want.coords
        for tree in ("params", "opt_state", "model_state"):
            a, b = getattr(got, tree), getattr(want, tree)
            assert set(a) == set(b), tree
            for key in a:
                assert a[key].tobytes() == b[key].tobytes(), f"{tree} {key}"
    assert chip_reports[-1][0].loss != chip_reports[0][0].loss  # it trained


@pytest.mark.slow  # 1.4 s at load 6 (8 ports, 6 steps): the fast tier has test_direct.py's
def test_the_data_allreduce_through_one_device_changes_no_bit_and_no_simulated_second(
        monkeypatch):
    """A data-parallel v2-8 (data 8: 8 TensorCores in 4 chips, their ports on loopback;
    an MLP on digits, dropout and all): the chip actors'
    code with the allreduce through one device (``direct.STAR_MAX_BYTES``, the default
    at this size) and in two phases (the threshold 0) give the same reports (losses,
    op records' simulated seconds, collective calls: what the clock reads) and the
    same parameter and optimizer bits after every step of the run."""
    import pod.runtime.mesh_collectives as mesh_collectives

    plan = build_plan(parse_scenario({
        "name": "star", "pod": {"slice": "v2-8"},
        "model": {"name": "mlp", "options": {"hidden": [32], "dropout": 0.2}},
        "data": {"name": "digits"},
        "training": {"global_batch": 64, "steps": 3, "optimizer": {"name": "adam"}},
        "metrics": {"port": 0}}))
    assert plan.mesh.size == 8 and plan.num_params * 4 <= mesh_collectives.STAR_MAX_BYTES
    runs = {}
    for star_max_bytes in (mesh_collectives.STAR_MAX_BYTES, 0):
        monkeypatch.setattr(mesh_collectives, "STAR_MAX_BYTES", star_max_bytes)
        runs[star_max_bytes] = in_process_chips(plan, plan.steps)
    (star_reports, star_shards), (direct_reports, direct_shards) = runs.values()
    assert star_reports == direct_reports
    for got, want in zip(star_shards, direct_shards, strict=True):
        for tree in ("params", "opt_state"):
            a, b = getattr(got, tree), getattr(want, tree)
            assert {k: v.tobytes() for k, v in a.items()} == {k: v.tobytes()
                                                              for k, v in b.items()}, tree
    assert star_reports[-1][0].loss != star_reports[0][0].loss  # it trained


# ------------------------------------------------------------------ data parallelism is {data: N}

def test_a_data_parallel_scenario_costs_what_the_mesh_data_8_costs():
    """The {data: 8} transformer on v5e-8 written without ``pod.mesh`` (the data-parallel
    default) and with ``pod.mesh: {data: 8}``: the same plan and the same step, float
    for float."""
    plain = build_plan(transformer("v5e-8", batch=16))
    mesh = build_plan(transformer("v5e-8", {"data": 8}, batch=16))
    assert dict(plain.mesh.sizes) == dict(mesh.mesh.sizes) == {"data": 8}
    assert plain.memory == mesh.memory and plain.per_device_batch == mesh.per_device_batch == 2
    a, b = TimingPod(plain), TimingPod(mesh)
    for step in range(2):
        sa, sb = a.step(step), b.step(step)
        assert sa.step_seconds == sb.step_seconds > 0
        for name in SAME:
            assert getattr(sa, name) == getattr(sb, name), name
    assert set(sa.axis_collective_seconds) == {"data"}


# ------------------------------------------------------------------ MFU and the device

@pytest.mark.parametrize("slice_name, mesh, devices_per_chip", [
    ("v3-8", {"data": 2, "fsdp": 2, "tensor": 2}, 2),   # a device per TensorCore
    ("v2-8", {"fsdp": 4, "tensor": 2}, 2),
    ("v4-8", {"fsdp": 2, "tensor": 2}, 1),              # a megacore device per chip
])
def test_mfu_is_the_global_batchs_model_flops_over_the_device_peak_times_devices(
        slice_name, mesh, devices_per_chip):
    """Model FLOPs = the model's 6 N T + attention per example x the global batch (not
    the per-device batch); the peak = one device's (half a chip on v2 / v3) x the
    mesh's devices = the chips' peak; timing-only and functional alike."""
    plan = build_plan(transformer(slice_name, mesh, batch=16))
    chip = get_chip_spec(slice_name.split("-")[0])
    assert plan.mesh.devices_per_chip == devices_per_chip
    assert plan.per_device_batch < plan.global_batch
    pod_peak = plan.topology.chips * chip.peak_bf16_flops_per_s
    assert pod_peak == pytest.approx(plan.mesh.size * chip.peak_bf16_flops_per_s
                                     / devices_per_chip)
    model_flops = plan.model.model_flops_per_example() * plan.global_batch
    with LocalPod(plan) as pod:
        functional = pod.step(0)
    for stats in (TimingPod(plan).step(0), functional):
        assert stats.model_flops == model_flops
        assert stats.peak_flops_per_s == pytest.approx(pod_peak, rel=1e-12)
        assert stats.mfu == pytest.approx(model_flops / stats.step_seconds / pod_peak, rel=1e-12)
        assert 0 < stats.mfu < 1


def test_a_timing_only_v3_step_divides_by_the_devices_peak_not_the_chips():
    """The published figure: a v3-8 is 4 chips of 123 TFLOP/s bf16 [Google], 8 TensorCore
    devices of half that; MFU's denominator is 492 TFLOP/s, not 8 chips' worth."""
    plan = build_plan(transformer("v3-8", {"fsdp": 4, "tensor": 2}, batch=16),
                      timing_only=True)
    stats = TimingPod(plan).step(0)
    assert stats.peak_flops_per_s == pytest.approx(4 * 123e12, rel=0.01)
    assert stats.device_peak_flops_per_s == pytest.approx(123e12 / 2, rel=0.01)


@pytest.mark.parametrize("name", ["v4", "v5p"])
def test_a_megacore_device_has_both_tensorcores_units(name):
    """On v4 / v5p a device is the chip's two TensorCores as one: twice one core's VPU
    (lanes x sublanes x ALUs per cycle), MXUs and HBM bandwidth, so an elementwise op
    takes the cycles of the closed form at twice one core's width."""
    from interconnect import Torus
    from pod.config.mesh import layout_mesh
    from pod.config.sharding import device_groups
    from pod.programs import ReplicatedProgram
    from pod.runtime.device import Device
    from pod.workloads import build_model, build_optimizer

    spec = get_chip_spec(name)
    assert spec.megacore and spec.tensorcores == 2
    mesh = layout_mesh({"data": 1}, Torus((1,)))
    model = build_model("mlp", (8, 8, 1), 10, hidden=[4], dropout=False)
    program = ReplicatedProgram(model, mesh.sizes, build_optimizer("sgd"))
    device = Device(spec, 0, device_groups(mesh, 0), program, 0)
    core = device.core.spec
    one = spec.core
    assert core.vpu_elements_per_cycle == 2 * one.vpu_elements_per_cycle == \
        2 * one.vpu_lanes * one.vpu_sublanes * one.vpu_alus_per_lane
    assert core.peak_vpu_flops_per_s == pytest.approx(spec.peak_vpu_flops_per_s)
    assert core.peak_bf16_flops_per_s == pytest.approx(spec.peak_bf16_flops_per_s)
    assert core.hbm_bandwidth_bytes_per_s == 2 * one.hbm_bandwidth_bytes_per_s
    elements = 1000 * 2 * one.vpu_elements_per_cycle
    record = device.core.account_vector("add", elements, 0)
    assert record.cycles - record.issue_cycles == 1000  # half of one core's 2,000


# ------------------------------------------------------------------ sweeps

@pytest.mark.slow  # several seconds: the slow tier (make test stays under 3 minutes)
def test_a_timing_only_sweep_never_imports_ray(tmp_path):
    """A layout sweep in timing mode (a fresh process): its rows, and no ``ray`` in
    ``sys.modules`` at the end."""
    code = f"""
import sys
import pod
rows = pod.sweep({{
    "name": "no-ray", "pod": {{"slice": "v5p-16", "mesh": {{"fsdp": 8}}}},
    "model": {{"name": "transformer", "options": {TINY!r}}}, "data": {TEXT!r},
    "training": {{"global_batch": 8, "steps": 2, "optimizer": {{"name": "adamw"}}}},
    "metrics": {{"port": 0}},
    "sweep": {{"mode": "timing", "mesh": [{{"fsdp": 8}}, {{"data": 2, "fsdp": 2, "tensor": 2}}],
               "steps": 2}}}}, output_dir={str(tmp_path)!r})
print([r["status"] for r in rows], "ray" in sys.modules, "pod.runtime.pod" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[-2] == "['ok', 'ok'] False False", out.stdout[-2000:]


@pytest.mark.slow
def test_a_functional_sweep_runs_a_fsdp_tensor_mesh(ray_cluster, tmp_path, monkeypatch):
    """``tpu-pod sweep`` in functional mode over ``sweep.mesh: [{fsdp: 2, tensor: 2}]`` on
    4 v5e chips trains on chip actors; its row's simulated figures are the timing-only
    row's (the same program, the same clock)."""
    import pod.runtime.pod as ray_pod
    from pod.commands.sweep import run_sweep

    started = []

    class Recorded(ray_pod.Pod):
        def start(self, *args, **kwargs):
            started.append(dict(self.plan.mesh.sizes))
            return super().start(*args, **kwargs)

    monkeypatch.setattr(ray_pod, "Pod", Recorded)

    scenario = transformer("v5e-4", {"fsdp": 2, "tensor": 2}).with_overrides(
        sweep={"mesh": [{"fsdp": 2, "tensor": 2}], "steps": 2, "mode": "functional"})
    (functional,) = run_sweep(scenario, tmp_path / "functional")
    (timed,) = run_sweep(scenario, tmp_path / "timing", mode="timing")
    assert functional["status"] == "ok", functional["error"]
    assert started == [{"fsdp": 2, "tensor": 2}]  # the functional point, on chip actors
    assert (functional["fsdp"], functional["tensor"], functional["chips"]) == (2, 2, 4)
    for key in ("simulated_step_seconds", "compute_seconds", "exposed_collective_seconds",
                "collective_fsdp_seconds", "collective_tensor_seconds", "mfu", "bound"):
        assert functional[key] == timed[key], key
