"""A sharded step on Ray actors (``pod.runtime.sharded_pod``) with a toy device
program: the parameters equal one-device training (numpy), and a timing-only step
(in-process, ``ShapeCollectives``) costs the same as the functional one."""

from __future__ import annotations

import numpy as np
import pytest

from chip import Chip
from chip.spec import V5E
from interconnect import Torus, calibrated_link
from pod.config.mesh import layout_mesh
from pod.config.sharding import MeshCollectiveCosts, device_chip_spec, device_groups
from pod.runtime.mesh_collectives import ShapeCollectives
from pod.runtime.sharded_actor import ShardedReport
from pod.runtime.sharded_pod import ShardedPod, combine_sharded_reports
from pod.runtime.sharded_actor import device_coords
from tests.pod.runtime.toy_sharded import D, K, ToyProgram, reference

pytestmark = pytest.mark.usefixtures("ray_cluster")

SEED, STEPS, BATCH = 3, 4, 16


def _batches():
    rng = np.random.default_rng(9)
    truth = rng.standard_normal((D, K)).astype(np.float32)
    out = []
    for _ in range(STEPS):
        x = rng.standard_normal((BATCH, D)).astype(np.float32)
        out.append((x, (x @ truth).astype(np.float32)))
    return out


@pytest.fixture(scope="module")
def trained():
    mesh = layout_mesh({"data": 2, "fsdp": 2, "tensor": 2}, Torus((2, 4)))
    link = calibrated_link("v5e", V5E.ici_link_bandwidth_bytes_per_s, V5E.ici_latency_s)
    costs = MeshCollectiveCosts(mesh, link)
    with ShardedPod(mesh, V5E, ToyProgram(mesh.sizes), costs, SEED) as pod:
        stats = [pod.step(s, x, y) for s, (x, y) in enumerate(_batches())]
        local = pod.assemble()["w"]
        reports = pod.last_reports
    return mesh, costs, stats, local, reports


def test_sharded_training_equals_one_device_training(trained):
    mesh, _, stats, local, _ = trained
    want = reference(SEED, _batches())
    np.testing.assert_allclose(local, want, rtol=1e-5, atol=1e-6)
    assert stats[-1].loss < stats[0].loss


def test_the_step_reports_per_axis_collectives(trained):
    _, costs, stats, _, _ = trained
    s = stats[-1]
    assert set(s.axis_collective_bytes) == {"data", "fsdp", "tensor"}
    # the fsdp all-gather of W's (D/2, K/2) shard, then the reduce-scatter of the
    # (D, K/2) gradient: the callers' input bytes (the contract's nbytes)
    assert s.axis_collective_bytes["fsdp"] == 4 * D * K // 4 + 4 * D * K // 2
    assert s.ici_seconds == pytest.approx(sum(s.axis_collective_seconds.values()))
    assert s.step_seconds <= s.serial_step_seconds + 1e-15
    assert s.axis_collective_seconds["fsdp"] == pytest.approx(
        costs.seconds("fsdp", "all_gather", 4 * D * K // 4)
        + costs.seconds("fsdp", "reduce_scatter", 4 * D * K // 2))


def test_timing_only_equals_the_functional_step(trained):
    mesh, costs, stats, _, _ = trained
    x, y = _batches()[-1]
    reports = []
    for d in range(mesh.size):  # every device here; a sweep would take one per role
        chip = Chip(device_chip_spec(V5E), d, numerics=True)
        core = chip.cores[0]
        groups = device_groups(mesh, d)
        program = ToyProgram(mesh.sizes)
        comm = ShapeCollectives(groups)
        coords = device_coords(groups)
        part = program.batch_slice(BATCH, coords)
        result = program.train_step(core, comm, program.init_local(SEED, coords),
                                    x[part], y[part], STEPS)
        loss, update_start = result.loss, result.update_start
        records = core.take_records()
        reports.append(ShardedReport(d, loss, tuple(r.seconds for r in records), update_start,
                                     tuple(comm.calls), 0, stats[-1] and _hbm(core)))
    timing = combine_sharded_reports(STEPS - 1, reports, costs, global_batch=BATCH,
                                     peak_flops_per_s=1.0, core_peak_flops_per_s=1.0,
                                     model_flops=0, wall=0.0)
    assert timing.step_seconds == stats[-1].step_seconds
    assert timing.axis_exposed_seconds == stats[-1].axis_exposed_seconds


def _hbm(core):
    from pod.runtime.actor import HbmUsage
    return HbmUsage(core.hbm.used_bytes, core.hbm.peak_bytes, core.hbm.capacity_bytes)
