"""``training.pipeline_fsdp_ag_once`` (MaxText's ``pipeline_fsdp_ag_once``): a pipeline
stage all-gathers each of its layers over fsdp once per step instead of once per
microbatch and phase, keeps the gathered weights for the step, and its HBM plan holds
them. In process (LocalMesh, LocalPod, TimingPod); no Ray.
"""

from __future__ import annotations

import numpy as np
import pytest

from chip import TensorCore
from pod.config.plan import build_plan
from pod.programs import DeviceCoords, LocalMesh, PipelinedTransformer
from pod.runtime.local import LocalPod
from pod.runtime.timing import TimingPod
from pod.workloads import TransformerConfig, TransformerModel
from tests.pod.programs.test_pipeline import (
    BATCH,
    FP32_ATOL,
    SPEC,
    TINY,
    batches,
    max_diff,
    optimizer,
    scenario,
    single,
)

pytestmark = pytest.mark.usefixtures("one_blas_thread")

SIZES = {"stage": 2, "fsdp": 2, "tensor": 2}
SCHEDULES = {"gpipe": ("gpipe", 2, 1), "1f1b": ("1f1b", 4, 1), "circular": ("circular", 2, 2)}


def train(schedule, microbatches, repeats, ag_once):
    """Every device of a LocalMesh trained 3 steps: (program, [(shard, losses, gathers)]),
    gathers: the fsdp all-gathers of each step."""
    model = TransformerModel(TransformerConfig(**TINY))
    program = PipelinedTransformer(model, SIZES, optimizer(), microbatches=microbatches,
                                   schedule=schedule, repeats=repeats, fsdp_ag_once=ag_once)
    data = batches()

    def device(comm):
        coords = DeviceCoords.of(comm)
        core = TensorCore(SPEC, precision="fp32")
        shard, part = program.init_local(0, coords), program.batch_slice(BATCH, coords)
        losses, gathers = [], []
        for step, (x, y) in enumerate(data, 1):
            start = len(comm.calls)
            result = program.train_step(core, comm, shard, x[part], y[part], step)
            shard = result.shard
            losses.append(result.loss)
            gathers.append([c for c in comm.calls[start:]
                            if c.axis == "fsdp" and c.op == "all_gather"])
            core.take_records()
        return shard, losses, gathers

    return program, LocalMesh(SIZES).run(device)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_ag_once_trains_the_same_bits_with_m_times_fewer_gathers(schedule):
    name, micro, repeats = SCHEDULES[schedule]
    base, before = train(name, micro, repeats, False)
    once, after = train(name, micro, repeats, True)
    # the same gathered values, the same sums in the same order: the same bits
    for (s0, l0, _), (s1, l1, _) in zip(before, after, strict=True):
        assert s0.coords == s1.coords and l0 == l1
        for k in s0.params:
            np.testing.assert_array_equal(s0.params[k], s1.params[k])
    assert max_diff(once.assemble(s for s, _, _ in after), single()[0]) < FP32_ATOL
    # closed form per stage and step: without, each layer gathers once per microbatch in
    # its forward and again in its backward when that reads the weights (all but the
    # embedding); with, once. Bytes: the layer's tensor-local params x the wire itemsize.
    layers = once.local_model.layers
    for (shard, _, g0), (_, _, g1) in zip(before, after, strict=True):
        mine = [i for i in once._layers[shard.coords.stage] if once._keys[i]]  # noqa: SLF001
        width = {i: once._chunk_count(k for k, _ in once._keys[i])          # noqa: SLF001
                 for i in mine}
        reads = {i: 1 + int(layers[i].backward_reads_params) for i in mine}
        for step0, step1 in zip(g0, g1, strict=True):
            assert len(step1) == len(mine)
            assert len(step0) == micro * sum(reads.values())
            one = sum(c.nbytes for c in step1)
            assert one == sum(width[i] for i in mine) * 4           # fp32 core: 4 B on the wire
            assert sum(c.nbytes for c in step0) == micro * sum(reads[i] * width[i] * 4
                                                               for i in mine)
            # per microbatch and phase as many bytes as ag_once gathers for the step
            forward = [c for c in step0 if c.tag.endswith(" fwd")]
            assert sum(c.nbytes for c in forward) == micro * one


def test_ag_once_timing_only_equals_functional_and_gathers_1_over_m_forward_bytes():
    mesh, training = {"stage": 2, "data": 2, "fsdp": 2}, {"microbatches": 4,
                                                          "pipeline_schedule": "1f1b"}
    plans = {flag: build_plan(scenario(mesh, **training, pipeline_fsdp_ag_once=flag))
             for flag in (False, True)}
    assert plans[True].training.pipeline_fsdp_ag_once
    stats, gathered = {}, {}
    for flag, plan in plans.items():
        with LocalPod(plan) as pod:
            functional = pod.step(1)
            reports = {r.device: r for r in pod.last_reports}
            assert pod.replicas_identical()
            params = pod.checkpoint_state()["params"]
        timing_pod = TimingPod(plan)
        timing = timing_pod.step(1)
        for r in timing_pod.last_reports:
            assert r.calls == reports[r.device].calls
            assert r.record_seconds == reports[r.device].record_seconds
        assert timing.step_seconds == functional.step_seconds
        stats[flag] = (functional, params)
        gathered[flag] = {r.device: (sum(c.nbytes for c in r.calls if c.axis == "fsdp"
                                         and c.op == "all_gather"),
                                     sum(c.nbytes for c in r.calls if c.axis == "fsdp"
                                         and c.op == "all_gather" and c.tag.endswith(" fwd")))
                          for r in timing_pod.last_reports}
    # M = 4: without, each layer's forward gathers once per microbatch (and its backward
    # again); with, each layer once per step: 1 / M of the forward bytes, bf16 on the wire
    for device, (total, _) in gathered[True].items():
        assert 4 * total == gathered[False][device][1]
        assert total < gathered[False][device][0] / 4
    for k, v in stats[False][1].items():
        np.testing.assert_array_equal(v, stats[True][1][k])
    assert stats[True][0].loss == stats[False][0].loss
    assert (stats[True][0].axis_collective_bytes["fsdp"]
            < stats[False][0].axis_collective_bytes["fsdp"])


def test_the_memory_plan_holds_the_stage_weights_instead_of_two_layers():
    """With pipeline_fsdp_ag_once a stage's gathered weights (its tensor-local arrays,
    whole over fsdp, bf16) stay for the step in place of the weight array in use and the
    one prefetched; the other items are the same."""
    mesh = {"stage": 2, "fsdp": 4}
    without = build_plan(scenario(mesh, microbatches=4))
    with_ = build_plan(scenario(mesh, microbatches=4, pipeline_fsdp_ag_once=True))
    a, b = without.memory, with_.memory
    for item in ("params", "grads", "optimizer_state", "activations"):
        assert a[item] == b[item], item
    program = PipelinedTransformer(with_.model, with_.mesh.sizes, optimizer(), microbatches=4)
    stage = int(with_.device_memory.peak.split()[-1])
    held = program.stage_gradient_bytes(stage) // 4                  # tensor-local, whole
    blocks = [i for i in range(len(program.local_model.layers)) if i in program.chunks[stage]
              and program.local_model.layers[i].kind == "transformer_block"]
    largest = program.largest_gathered(blocks)
    assert dict(with_.device_memory.workspace)["gathered weights"] == 2 * held
    assert dict(without.device_memory.workspace)["gathered weights"] == 2 * 2 * largest
    assert b["workspace"] - a["workspace"] == 2 * held - 2 * 2 * largest
    assert b["total"] == sum(v for k, v in b.items() if k != "total")
