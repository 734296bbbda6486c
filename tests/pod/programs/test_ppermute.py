"""ppermute: the collective permute of the pipeline (numerics on every back-end in
process, its call record, its cost in closed form on a ring). No Ray."""

from __future__ import annotations

import numpy as np
import pytest

from chip import get_chip_spec
from interconnect import (
    LinkSpec,
    Torus,
    calibrated_link,
    group_ppermute_cost,
    group_ppermute_schedule,
    schedule_cost,
)
from pod.config.mesh import layout_mesh
from pod.config.sharding import MeshCollectiveCosts
from pod.programs.collectives import LocalMesh, ShapeCollectives, defer_wait


@pytest.mark.parametrize("shift", [1, -1, 2, 3])
def test_ppermute_gives_each_device_the_buffer_shift_positions_before(shift):
    sizes = {"stage": 4, "data": 2}

    def body(comm):
        me = comm.axis_index("stage") + 10 * comm.axis_index("data")
        got = comm.ppermute("stage", np.full(3, me, np.float32), shift, tag="x",
                            kind="activation", after_record=0)
        return comm.axis_index("stage"), comm.axis_index("data"), got, list(comm.calls)

    for stage, data, got, calls in LocalMesh(sizes).run(body):
        want = (stage - shift) % 4 + 10 * data
        np.testing.assert_array_equal(got, np.full(3, want, np.float32))
        assert [(c.axis, c.op, c.nbytes, c.shift, c.wait_record) for c in calls] == [
            ("stage", "ppermute", 12, shift, 0)]


def test_ppermute_follows_the_ring_order_of_the_axis():
    mesh = LocalMesh({"stage": 4}, rings={"stage": (0, 2, 3, 1)})

    def body(comm):
        return comm.axis_index("stage"), comm.ppermute(
            "stage", np.full(1, comm.axis_index("stage"), np.float32), 1, tag="x",
            kind="activation", after_record=0)[0]

    assert sorted(mesh.run(body)) == [(0, 3.0), (1, 0.0), (2, 1.0), (3, 2.0)]


def test_an_unused_piece_is_waited_for_nowhere_and_a_used_one_where_defer_wait_says():
    comm = ShapeCollectives({"stage": 2}, {"stage": 1})
    comm.ppermute("stage", np.zeros(4, np.float32), 1, tag="a", kind="activation",
                  after_record=3, used=False, itemsize=2)
    out = comm.ppermute("stage", np.zeros(4, np.float32), -1, tag="b", kind="activation",
                        after_record=5, itemsize=2)
    assert out.shape == (4,)
    defer_wait(comm.calls, 1, 9)
    assert [(c.nbytes, c.wait_record) for c in comm.calls] == [(8, None), (8, 9)]
    with pytest.raises(ValueError, match="cannot wait"):
        defer_wait(comm.calls, 1, 4)
    with pytest.raises(ValueError, match="shift"):
        comm.ppermute("stage", np.zeros(4, np.float32), 1.5, tag="c", kind="activation",
                      after_record=5)


def test_a_one_device_axis_gives_the_buffer_back_and_records_nothing():
    comm = ShapeCollectives({"stage": 1}, {})
    x = np.arange(3, dtype=np.float32)
    assert comm.ppermute("stage", x, 1, tag="x", kind="activation", after_record=0) is x
    assert comm.calls == []


def test_the_ppermute_cost_on_a_ring_is_one_hop_of_the_whole_buffer():
    """Closed form: every device sends V bytes to its ring neighbour over one link:
    V / W(1) + one hop's latency + the collective's fixed cost."""
    link = LinkSpec(bandwidth_bytes_per_s=45e9, latency_s=1e-6)
    torus = Torus((8,), (True,))
    nbytes = 2 * 1_000_000
    for shift in (1, -1):
        cost = group_ppermute_cost(torus, [tuple(range(8))], 1_000_000, link, 2, shift=shift)
        want = nbytes / link.achieved_bandwidth_bytes_per_s(1) + link.latency_s \
            + link.collective_fixed_s
        assert cost.seconds == pytest.approx(want, rel=1e-12)
        assert sorted(cost.link_bytes.values()) == [nbytes] * 8
        schedule = group_ppermute_schedule([tuple(range(8))], 8, 1_000_000, 2, shift)
        assert schedule_cost(schedule, torus, link).seconds == pytest.approx(cost.seconds)


def test_the_mesh_cost_of_a_stage_ppermute_counts_every_group_and_their_contention():
    spec = get_chip_spec("v5e")
    link = calibrated_link("v5e", spec.ici_link_bandwidth_bytes_per_s, spec.ici_latency_s)
    torus = Torus((2, 4), (False, False))
    mesh = layout_mesh({"stage": 4, "data": 2}, torus)
    costs = MeshCollectiveCosts(mesh, link)
    cost = costs.cost("stage", "ppermute", 2 * 4096)
    groups = mesh.groups("stage", "ring")
    assert cost == group_ppermute_cost(torus, groups, 4096, link, 2)
    # a line of 4 (no wraparound): the wrapping piece travels 3 hops back
    hops = max(abs(a % 4 - b % 4) for g in groups for a, b in zip(g, g[1:] + g[:1], strict=True))
    assert hops == 3
    want = 8192 / link.achieved_bandwidth_bytes_per_s(2) + 3 * link.latency_s \
        + link.collective_fixed_s
    assert cost.seconds == pytest.approx(want)
    assert costs.seconds("fsdp", "ppermute", 100) == 0.0  # an axis the mesh does not have
