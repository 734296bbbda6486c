"""pod.config.sharding: device groups, the plan's per-axis collective costs, and the
one-line refusals of meshes the runtime cannot shard."""

from __future__ import annotations

import pytest

from chip.spec import V2, V3, V4, V5E
from interconnect import LinkSpec, Torus, group_collective_cost
from pod.config.mesh import layout_mesh
from pod.config.sharding import (MeshCollectiveCosts, check_sharded_mesh, device_chip_spec,
                                 device_groups, on_chip_bandwidth)
from pod.errors import ScenarioError


def test_device_groups_partition_each_axis():
    mesh = layout_mesh({"data": 2, "fsdp": 2, "tensor": 2}, Torus((2, 2, 2)))
    for axis in ("data", "fsdp", "tensor"):
        seen = set()
        for d in range(8):
            g = device_groups(mesh, d)
            assert d in g.ring[axis] and sorted(g.ring[axis]) == sorted(g.mesh_order[axis])
            assert g.mesh_order[axis][g.axis_index(axis)] == d
            seen.add(g.mesh_order[axis])
        assert sorted(x for grp in seen for x in grp) == list(range(8))


def test_the_plans_cost_is_the_group_cost_and_cached():
    mesh = layout_mesh({"data": 2, "tensor": 4}, Torus((2, 4)))
    link = LinkSpec(1e11, latency_s=1e-6)
    costs = MeshCollectiveCosts(mesh, link)
    want = group_collective_cost("allreduce", mesh.torus, mesh.groups("tensor"), 1024, link)
    assert costs.cost("tensor", "allreduce", 4096) == want
    assert costs.cost("tensor", "allreduce", 4096) is costs.cost("tensor", "allreduce", 4096)
    assert costs.seconds("fsdp", "allreduce", 4096) == 0.0  # an absent axis
    gathered = group_collective_cost("all_gather", mesh.torus, mesh.groups("tensor"), 1024, link)
    assert costs.cost("tensor", "all_gather", 1024) == gathered  # a piece of 256 float32
    with pytest.raises(ValueError, match="ops"):
        costs.cost("tensor", "broadcast", 4)


def test_meshes_the_runtime_cannot_shard_are_one_line():
    mesh = layout_mesh({"data": 2, "fsdp": 2}, Torus((2, 2)))
    with pytest.raises(ScenarioError, match="only the transformer model does; mlp trains"):
        check_sharded_mesh(mesh, "mlp")
    v3 = layout_mesh({"data": 2, "tensor": 4}, Torus((2, 2)), per_chip=2)
    check_sharded_mesh(v3, "transformer")  # a device per TensorCore: run sharded
    check_sharded_mesh(layout_mesh({"data": 4}, Torus((2, 2))), "mlp")  # data parallel


def test_a_megacore_device_has_the_chips_peak():
    assert device_chip_spec(V4).peak_bf16_flops_per_s == V4.peak_bf16_flops_per_s
    assert device_chip_spec(V4).tensorcores == 1 and device_chip_spec(V5E) is V5E


def test_a_v2_v3_device_is_one_tensorcore():
    """[JAX]: each TensorCore of a v2 / v3 chip is a device: half the chip's peak, HBM
    and HBM bandwidth; a copy between the two runs at one core's HBM bandwidth."""
    for chip in (V2, V3):
        device = device_chip_spec(chip)
        assert device.tensorcores == 1 and device.core == chip.core
        assert device.peak_bf16_flops_per_s == chip.peak_bf16_flops_per_s / 2
        assert device.hbm_bytes == chip.hbm_bytes // 2
        assert device.hbm_bandwidth_bytes_per_s == chip.hbm_bandwidth_bytes_per_s / 2
        assert on_chip_bandwidth(chip) == chip.hbm_bandwidth_bytes_per_s / 2
    assert on_chip_bandwidth(V4) is None and on_chip_bandwidth(V5E) is None


def test_a_v3_mesh_costs_its_core_axis_on_chip_and_shares_links():
    """v3-8 (2x2 chips, 8 devices) {fsdp: 4, tensor: 2}: tensor takes the two cores of a
    chip (no ICI byte, one core's HBM bandwidth per phase); fsdp's two groups (core 0's
    chips and core 1's) cost one ring of chips moving twice the bytes."""
    mesh = layout_mesh({"fsdp": 4, "tensor": 2}, Torus((2, 2)), per_chip=2)
    assert all(d // 2 == e // 2 for d, e in mesh.groups("tensor"))
    link = LinkSpec(1e11, latency_s=1e-6)
    costs = MeshCollectiveCosts(mesh, link, on_chip_bandwidth(V3))
    tensor = costs.cost("tensor", "allreduce", 4096)
    assert not tensor.link_bytes
    assert tensor.seconds == pytest.approx(2 * 2048 / on_chip_bandwidth(V3), rel=1e-12)
    chips = [tuple(d // 2 for d in g) for g in mesh.groups("fsdp")]
    assert chips[0] == chips[1]
    one_ring = group_collective_cost("reduce_scatter", mesh.torus, chips[:1], 2 * 1024, link)
    fsdp = costs.cost("fsdp", "reduce_scatter", 4096)
    assert fsdp.seconds == pytest.approx(one_ring.seconds, rel=1e-12)
    assert fsdp.link_bytes == one_ring.link_bytes


def test_link_bytes_of_a_steps_calls_are_the_ring_closed_form():
    """{tensor: 4} on a 4-chip ring: an allreduce of N bytes sends 2 (g - 1) / g N from
    each of the g devices over one hop, 2 (g - 1) N on the links in all; three calls
    three times that; a 2-device axis on the two cores of v3 chips moves no ICI byte."""
    from pod.programs.collectives import CollectiveCall

    mesh = layout_mesh({"tensor": 4}, Torus((4,), wraparound=(True,)))
    costs = MeshCollectiveCosts(mesh, LinkSpec(1e11))
    n = 4096
    calls = [CollectiveCall("tensor", "allreduce", n, "t", "activations", 0)] * 3
    links = costs.link_bytes(calls)
    assert sum(links.values()) == 3 * 2 * 3 * n
    assert all("->" in k for k in links)
    v3 = layout_mesh({"fsdp": 4, "tensor": 2}, Torus((2, 2)), per_chip=2)
    on_chip = MeshCollectiveCosts(v3, LinkSpec(1e11), on_chip_bandwidth(V3))
    assert on_chip.link_bytes(calls[:1]) == {}
