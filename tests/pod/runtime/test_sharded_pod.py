"""A sharded step of a toy device program (``toy_sharded.ToyProgram``, the whole
``DeviceProgram`` contract) on the runtime's pods, {data: 2, fsdp: 2, tensor: 2} on a
v5e 2x4 torus: the parameters equal one-device training (numpy), the step's
per-axis figures are the plan's costs of the program's calls, a timing-only step
(``ShapeCollectives``, no data moved) costs the same as the functional one, and on
Ray chip actors (slow tier) the parameters are the in-process pod's bits."""

from __future__ import annotations

import numpy as np
import pytest

from chip.spec import V5E
from pod.config.plan import build_plan
from pod.config.scenario import parse_scenario
from pod.config.sharding import device_groups
from pod.programs import DeviceProgram, ShapeCollectives
from pod.report.clock import combine_device_reports
from pod.runtime.device import Device
from pod.runtime.local import LocalPod
from tests.pod.runtime.toy_sharded import (BATCH, D, K, SEED, STEPS, ToyProgram, batches,
                                           reference)

AXES = ("data", "fsdp", "tensor")


def toy_plan():
    """A plan of the right mesh (its model is not used: the toy program replaces it)."""
    return build_plan(parse_scenario({
        "name": "toy", "pod": {"slice": "v5e-8", "mesh": {"data": 2, "fsdp": 2, "tensor": 2}},
        "model": {"name": "transformer", "options": {"embed_dim": 8, "heads": 2, "head_dim": 4,
                                                     "mlp_dim": 8, "layers": 1}},
        "data": {"name": "synthetic_text",
                 "options": {"vocabulary": 16, "sequence_length": 4, "num_examples": 64}},
        "training": {"global_batch": BATCH, "steps": STEPS, "seed": SEED,
                     "optimizer": {"name": "sgd"}},
        "metrics": {"port": 0}}))


class ToyLocalPod(LocalPod):
    """``LocalPod`` running the toy program on the toy batches."""

    def __init__(self, plan):
        super().__init__(plan)
        self.program = ToyProgram(plan.mesh.sizes)

    def batch(self, step):
        return batches()[step]


@pytest.fixture(scope="module")
def trained():
    plan = toy_plan()
    with ToyLocalPod(plan) as pod:
        stats = [pod.step(s) for s in range(STEPS)]
        assert pod.replicas_identical()
        state = pod.checkpoint_state()
        return plan, pod, stats, state["params"]["w"], pod.last_reports


def test_the_toy_keeps_the_device_program_contract():
    assert isinstance(ToyProgram({"data": 2}), DeviceProgram)


def test_sharded_training_equals_one_device_training(trained):
    _, _, stats, local, _ = trained
    want = reference(SEED, batches())
    np.testing.assert_allclose(local, want, rtol=1e-5, atol=1e-6)
    assert stats[-1].loss < stats[0].loss


def test_the_step_reports_per_axis_collectives(trained):
    plan, _, stats, _, _ = trained
    costs = plan.collective_costs
    s = stats[-1]
    assert set(s.axis_collective_bytes) == {"data", "fsdp", "tensor"}
    # the fsdp all-gather of W's (D/2, K/2) shard, then the reduce-scatter of the
    # (D, K/2) gradient: the callers' input bytes (the contract's nbytes)
    assert s.axis_collective_bytes["fsdp"] == 4 * D * K // 4 + 4 * D * K // 2
    assert s.collective_seconds == pytest.approx(sum(s.axis_collective_seconds.values()))
    assert s.step_seconds <= s.serial_step_seconds + 1e-15
    assert s.axis_collective_seconds["fsdp"] == pytest.approx(
        costs.seconds("fsdp", "all_gather", 4 * D * K // 4)
        + costs.seconds("fsdp", "reduce_scatter", 4 * D * K // 2))


def test_timing_only_equals_the_functional_step(trained):
    """Every device again, its collectives ``ShapeCollectives`` (zero results of the
    right size, nothing exchanged): the same records and calls, so the one clock
    gives the functional step's figures."""
    plan, pod, stats, _, functional = trained
    xs, ys = pod.split(*batches()[-1])
    reports = []
    for d in range(plan.mesh.size):
        groups = device_groups(plan.mesh, d)
        device = Device(V5E, d, groups, ToyProgram(plan.mesh.sizes), SEED)
        comm = ShapeCollectives({a: groups.axis_size(a) for a in AXES},
                                {a: groups.ring_index(a) for a in AXES})
        reports.append(device.step(comm, xs[d], ys[d], STEPS - 1, SEED))
    for got, want in zip(reports, functional):
        assert (got.record_seconds, got.calls, got.update_start) == \
            (want.record_seconds, want.calls, want.update_start)
    timing = combine_device_reports(STEPS - 1, reports, plan.collective_costs, pod.context,
                                    infeed_bytes=pod.infeed_bytes(xs, ys), wall_seconds=0.0)
    assert timing.step_seconds == stats[-1].step_seconds
    assert timing.axis_exposed_seconds == stats[-1].axis_exposed_seconds


@pytest.mark.slow
def test_on_ray_chip_actors_the_toy_trains_to_the_in_process_bits(ray_cluster, trained):
    """Groups of two: the ICI ring's sums are LocalMesh's, bit for bit."""
    from pod.runtime.pod import Pod

    class ToyRayPod(Pod):
        def __init__(self, plan):
            super().__init__(plan)
            self.program = ToyProgram(plan.mesh.sizes)

        def batch(self, step):
            return batches()[step]

    plan, _, stats, local, _ = trained
    with ToyRayPod(plan) as pod:
        got = [pod.step(s) for s in range(STEPS)]
        assert pod.replicas_identical()
        w = pod.checkpoint_state()["params"]["w"]
    assert w.tobytes() == local.tobytes()
    assert [s.loss for s in got] == [s.loss for s in stats]
    assert [s.step_seconds for s in got] == [s.step_seconds for s in stats]
