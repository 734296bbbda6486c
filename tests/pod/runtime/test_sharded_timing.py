"""Timing-only sharded steps (``pod.runtime.timing.TimingPod``) against functional ones.

The reference is a functional step of every device of the same small layout,
in process (``LocalMesh`` threads, real bf16 numerics, real gathers and
reductions): each device's op records and collective calls, placed in time
by the same clock with the plan's collective costs; the pod's step is the
slowest device's. The timing-only pod runs one device with the MXU and VPU
work skipped and the data movement left out; its figures must be the same,
record for record and call for call. No Ray.
"""

from __future__ import annotations

import numpy as np
import pytest

from chip import Chip
from pod.config.plan import build_plan
from pod.config.scenario import parse_scenario
from pod.config.sharding import device_chip_spec
from pod.report.clock import step_clock as sharded_step_clock
from pod.runtime.base import plan_program
from pod.runtime.device import record_bound
from pod.runtime.timing import TimingPod
from pod.workloads import build_optimizer
from pod.programs.collectives import LocalMesh
from pod.programs import DeviceCoords, ShardedTransformer

pytestmark = pytest.mark.usefixtures("one_blas_thread")

TINY = {"embed_dim": 32, "heads": 4, "head_dim": 8, "mlp_dim": 64, "layers": 2}


def scenario(mesh, slice_name="v5p-16", batch=8, sequence_parallel=False, links=(),
             bucket_bytes=1024, **options):
    """The tiny transformer on ``mesh``; gradient buckets of ``bucket_bytes`` (1 KiB: one
    per layer, many calls to compare)."""
    return parse_scenario({
        "name": "sharded-timing-test",
        "pod": {"slice": slice_name, "mesh": mesh, "links": list(links)},
        "model": {"name": "transformer", "options": {**TINY, **options}},
        "data": {"name": "synthetic_text",
                 "options": {"vocabulary": 64, "sequence_length": 16, "num_examples": 64}},
        "training": {"global_batch": batch, "steps": 2, "sequence_parallel": sequence_parallel,
                     "overlap_bucket_bytes": bucket_bytes,
                     "optimizer": {"name": "adamw", "learning_rate": 0.01}},
        "metrics": {"port": 0},
    })


def functional_reports(plan, steps=2, sequence_parallel=False):
    """Every device's (record seconds, calls, update start) of the last of ``steps``
    functional steps (LocalMesh, numerics on), by device."""
    training = plan.scenario.training
    optimizer = build_optimizer(training.optimizer.name, **training.optimizer.options())
    program = plan_program(plan)  # the plan's gradient buckets, as TimingPod's
    assert isinstance(program, ShardedTransformer)
    assert program.sequence_parallel == (sequence_parallel and plan.mesh.sizes.get("tensor", 1) > 1)
    data = plan.dataset

    def device(comm):
        core = Chip(device_chip_spec(plan.topology.chip), 0, numerics=True,
                    precision=training.precision, sustained=True).cores[0]  # as Device
        coords = DeviceCoords.of(comm)
        shard = program.init_local(training.seed, coords)
        part = program.batch_slice(plan.global_batch, coords)
        for step in range(steps):
            rows = np.arange(step * plan.global_batch, (step + 1) * plan.global_batch)
            x, y = data.x_train[rows][part], data.y_train[rows][part]
            core.take_records()
            comm.take_calls()
            result = program.train_step(core, comm, shard, x, y, step + 1)
            shard = result.shard
        records = core.take_records()
        assert records[result.update_start].name.startswith(optimizer.name)
        return records, comm.take_calls(), result.update_start

    return LocalMesh.for_mesh(plan.mesh).run(device)


LAYOUTS = [
    ({"data": 2, "fsdp": 2, "tensor": 2}, {}),
    ({"data": 2, "fsdp": 2, "tensor": 2}, {"sequence_parallel": True, "remat": "minimal"}),
    ({"fsdp": 8}, {"remat": "full"}),
    ({"data": 2, "tensor": 4}, {"remat": "minimal", "tied_embeddings": False}),
    ({"fsdp": 2, "tensor": 4}, {"norm": "layernorm", "mlp_activation": "gelu",
                                "positions": "learned"}),
    ({"data": 2, "fsdp": 2, "tensor": 2}, {"bucket_bytes": 32 << 20}),  # one gradient bucket
    ({"data": 2, "fsdp": 2, "tensor": 2}, {"slice_name": "v3-8"}),  # a device per TensorCore
    ({"fsdp": 4, "tensor": 2}, {"slice_name": "v3-8", "sequence_parallel": True}),
    ({"fsdp": 2, "tensor": 4}, {"block": "parallel", "mlp_activation": "relu", "remat": "full"}),
    ({"data": 2, "fsdp": 2, "tensor": 2}, {"sequence_parallel": True, "kv_heads": 2,
                                           "use_bias": True, "fused_qkv": True,
                                           "block": "parallel", "remat": "minimal"}),
    ({"fsdp": 4, "tensor": 2}, {"remat": "custom", "attention": "dot_product",
                                "remat_custom": {"decoder_layer_input": "offload",
                                                 "query_proj": "offload", "context": "device"}}),
]


@pytest.mark.parametrize("mesh,options", LAYOUTS, ids=lambda v: str(v))
def test_timing_only_step_equals_the_functional_step(mesh, options):
    """Same records and calls as every functional device; the same simulated step,
    compute, update, exposed and per-axis bytes / seconds / exposed seconds."""
    sequence = options.get("sequence_parallel", False)
    plan = build_plan(scenario(mesh, **options), timing_only=True, sharded_ok=True)
    assert plan.mesh.size == 8
    devices = functional_reports(plan, sequence_parallel=sequence)
    clocks = [sharded_step_clock(records, calls, plan.collective_costs.seconds, start,
                                 kinds=tuple(record_bound(r) for r in records))
              for records, calls, start in devices]
    want = max(clocks, key=lambda c: c.step_seconds)

    pod = TimingPod(plan)  # training.sequence_parallel from the scenario
    assert pod.program.sequence_parallel == sequence
    pod.step(0)
    stats = pod.step(1)
    report = pod.last_report
    for records, calls, _ in devices:  # every device does the same work: one stands for all
        assert report.record_seconds == tuple(r.seconds for r in records)
        assert report.calls == tuple(calls)
    assert len(report.calls) > 10
    assert stats.step_seconds == pytest.approx(want.step_seconds, rel=1e-12)
    assert stats.compute_seconds == pytest.approx(want.compute_seconds, rel=1e-12)
    assert stats.update_seconds == pytest.approx(want.update_seconds, rel=1e-12)
    assert stats.exposed_collective_seconds == pytest.approx(want.exposed_seconds, rel=1e-12,
                                                            abs=1e-15)
    assert stats.axis_collective_bytes == want.axis_bytes
    assert stats.axis_collective_seconds == pytest.approx(want.axis_seconds, rel=1e-12)
    assert stats.axis_exposed_seconds == pytest.approx(want.axis_exposed_seconds, rel=1e-12)
    assert set(stats.axis_collective_bytes) == {a for a, n in mesh.items() if n > 1}


def test_model_flops_and_hardware_flops_count_the_whole_pod():
    """MFU's numerator is the model's 6 N T + attention per example x the global batch;
    the hardware FLOPs are the representative's MXU FLOPs x the devices, which exceed
    the model FLOPs by the recomputation of remat full (and the replicated head work
    of the tensor devices)."""
    plan = build_plan(scenario({"fsdp": 4, "tensor": 2}, remat="full"), timing_only=True,
                      sharded_ok=True)
    stats = TimingPod(plan).step(0)
    assert stats.model_flops == plan.model.model_flops_per_example() * plan.global_batch
    assert stats.hardware_flops > stats.model_flops
    assert stats.mfu == pytest.approx(
        stats.model_flops / stats.step_seconds / (plan.topology.chips * plan.topology.chip.peak_bf16_flops_per_s))


def test_a_175b_class_step_holds_no_model_sized_array():
    """GPT-3 175B's shapes on 8 devices: every parameter, gradient and optimizer chunk is
    a zero view, so the step's process grows by far less than one gathered block
    (1.8B parameters / tensor 8 = 0.9 GB float32)."""
    import resource

    plan = build_plan(scenario({"fsdp": 1, "tensor": 8}, slice_name="v5p-16", batch=1,
                               embed_dim=12288, heads=96, head_dim=128, mlp_dim=49152, layers=2,
                               mlp_activation="gelu", norm="layernorm", remat="full"),
                      timing_only=True, sharded_ok=True)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    stats = TimingPod(plan).step(0)
    grown_bytes = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
    assert stats.step_seconds > 0
    assert grown_bytes < 300 * 2**20


@pytest.mark.parametrize("options", [
    {}, {"remat": "full", "tied_embeddings": False},
    {"remat": "minimal", "norm": "layernorm", "mlp_activation": "gelu", "positions": "learned"},
    {"remat": "minimal", "block": "parallel", "mlp_activation": "relu", "kv_heads": 2,
     "use_bias": True, "fused_qkv": True},
    {"remat": "full", "mlp_activation": "gated_gelu", "kv_heads": 1, "use_bias": True},
], ids=["rmsnorm-swiglu-rope", "remat-full-untied", "layernorm-gelu-learned-minimal",
        "parallel-relu-gqa-bias-fused-minimal", "geglu-mqa-bias-full"])
def test_transformer_timing_only_records_equal_the_executed_ones(options):
    """One device, no mesh: a timing-only core skips the products and the VPU work
    of the transformer, its loss and AdamW, yet records the same ops, FLOPs, bytes
    and cycles as an executing core."""
    from chip import TensorCore, get_chip_spec
    from pod.workloads import build_model

    model = build_model("transformer", (16,), 64, **{**TINY, **options})
    x = np.random.default_rng(3).integers(0, 64, (4, 16))
    y = np.random.default_rng(4).integers(0, 64, (4, 16))
    runs = []
    for execute in (True, False):
        core = TensorCore(get_chip_spec("v5p").core, numerics=True, execute=execute)
        opt = build_optimizer("adamw", learning_rate=0.01)
        params = model.init_params(0)
        _, grads, _ = model.loss_grads_and_state(core, params, x, y)
        opt.update(core, grads, opt.init(params), params, 1)
        runs.append(core.take_records())
    executed, timed = runs
    assert len(executed) == len(timed) > 50
    assert executed == timed


def test_pod_links_slow_and_reroute_a_sharded_mesh():
    """``pod.links`` on a sharded mesh: a link of one tensor group at a quarter of its
    bandwidth slows the tensor collectives only; failed, the group's ring is routed
    around it (longer); on a v3 (a device per TensorCore) a failed link is one line."""
    from pod.errors import ScenarioError

    mesh = {"fsdp": 2, "tensor": 4}
    base = build_plan(scenario(mesh), timing_only=True, sharded_ok=True)
    a, b = base.mesh.groups("tensor")[0][:2]
    link = f"{a}->{b}"
    assert base.topology.torus.route(a, b) == [(a, b)]  # neighbours
    plain = TimingPod(base).step(0).axis_collective_seconds
    for entry in ({"link": link, "slowdown": 4.0}, {"link": link, "failed": True}):
        plan = build_plan(scenario(mesh, links=[entry]), timing_only=True, sharded_ok=True)
        got = TimingPod(plan).step(0).axis_collective_seconds
        assert got["tensor"] > plain["tensor"], entry
        assert got["fsdp"] == plain["fsdp"], entry
    with pytest.raises(ScenarioError, match=r"pod.links.0: a failed link on a sharded mesh of "
                                            r"a device per TensorCore"):
        build_plan(scenario({"fsdp": 4, "tensor": 2}, slice_name="v3-8",
                            links=[{"link": "0->1", "failed": True}]),
                   timing_only=True, sharded_ok=True)
