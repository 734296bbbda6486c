"""pod.config.sharding: device groups, the plan's per-axis collective costs, and the
one-line refusals of meshes the runtime cannot shard."""

from __future__ import annotations

import pytest

from chip.spec import V4, V5E
from interconnect import LinkSpec, Torus, group_collective_cost
from pod.config.mesh import layout_mesh
from pod.config.sharding import (MeshCollectiveCosts, check_sharded_mesh, device_chip_spec,
                                 device_groups)
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
        check_sharded_mesh(mesh, "mlp", "v5e")
    v3 = layout_mesh({"data": 2, "tensor": 4}, Torus((2, 2)), per_chip=2)
    with pytest.raises(ScenarioError, match="v3 \\(a device per TensorCore\\)"):
        check_sharded_mesh(v3, "transformer", "v3")
    check_sharded_mesh(layout_mesh({"data": 4}, Torus((2, 2))), "mlp", "v5e")  # data parallel


def test_a_megacore_device_has_the_chips_peak():
    assert device_chip_spec(V4).peak_bf16_flops_per_s == V4.peak_bf16_flops_per_s
    assert device_chip_spec(V4).tensorcores == 1 and device_chip_spec(V5E) is V5E
