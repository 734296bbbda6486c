"""pod.config.sharding: device groups, the plan's per-axis collective costs, and the
one-line refusals of meshes the runtime cannot shard.

References for the costs: the interconnect's own group cost (the plan must call it
with the mesh's groups and blocks), the pure executor (every device ends with its
group's result), the schedule path, and the textbook closed forms of [SB]
(sharding.md; tpu-specs.md "Textbook collective costs").
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from chip.spec import V2, V3, V4, V5E, V5P
from interconnect import (LinkSpec, Torus, calibrated_link, concurrent_group_schedule, execute,
                          group_collective_cost, schedule_cost)
from pod.config.mesh import AXIS_NAMES, layout_mesh
from pod.config.sharding import (MeshCollectiveCosts, device_chip_spec,
                                 device_groups, on_chip_bandwidth)
from pod.errors import ScenarioError

#: every mesh axis's reductions as one unidirectional ring per group
RING = dict.fromkeys(AXIS_NAMES, "ring")


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


def test_the_plans_cost_is_the_xla_group_cost_and_cached():
    """Default: as XLA runs it, the groups in mesh order over the axis's block, bf16."""
    mesh = layout_mesh({"data": 2, "tensor": 4}, Torus((2, 4)))
    link = LinkSpec(1e11, latency_s=1e-6)
    costs = MeshCollectiveCosts(mesh, link)
    assert costs.axis_algorithm("tensor") == "torus" and costs.itemsize == 2
    block = costs.group_torus("tensor")
    assert block == Torus((4,), (True,))
    want = group_collective_cost("allreduce", mesh.torus, mesh.groups("tensor", "mesh"), 2048,
                                 link, 2, algorithm="torus", group_torus=block)
    assert costs.cost("tensor", "allreduce", 4096) == want
    assert costs.cost("tensor", "allreduce", 4096) is costs.cost("tensor", "allreduce", 4096)
    assert costs.seconds("fsdp", "allreduce", 4096) == 0.0  # an absent axis
    gathered = group_collective_cost("all_gather", mesh.torus, mesh.groups("tensor", "mesh"), 2048,
                                     link, 2, algorithm="torus", group_torus=block)
    assert costs.cost("tensor", "all_gather", 1024) == gathered  # a piece of 512 bf16
    with pytest.raises(ValueError, match="ops"):
        costs.cost("tensor", "broadcast", 4)


def test_the_ring_model_is_kept_as_a_choice():
    mesh = layout_mesh({"data": 2, "tensor": 4}, Torus((2, 4)))
    link = LinkSpec(1e11, latency_s=1e-6)
    costs = MeshCollectiveCosts(mesh, link, axis_algorithms=RING, itemsize=4)
    want = group_collective_cost("allreduce", mesh.torus, mesh.groups("tensor"), 1024, link)
    assert costs.cost("tensor", "allreduce", 4096) == want
    xla = MeshCollectiveCosts(mesh, link).cost("tensor", "allreduce", 4096)
    # the bidirectional ring of 4 moves each byte half as far in time: (n-1)/n V / W, not 2x
    assert xla.seconds - 2 * 2 * 1e-6 == pytest.approx((want.seconds - 2 * 3 * 1e-6) / 2)


def test_the_cost_depends_on_bytes_not_on_the_element_size():
    mesh = layout_mesh({"fsdp": 8}, Torus((2, 4)))
    link = LinkSpec(1e11)
    bf16, f32 = MeshCollectiveCosts(mesh, link), MeshCollectiveCosts(mesh, link, itemsize=4)
    for op in ("allreduce", "reduce_scatter", "all_gather"):
        assert bf16.cost("fsdp", op, 8 * 4096) == f32.cost("fsdp", op, 8 * 4096)


@pytest.mark.parametrize("kwargs, fragment", [({"axis_algorithms": {"tensor": "tree"}},
                                               "algorithms torus, bidirectional_ring, ring"),
                                              ({"axis_algorithms": {"model": "ring"}},
                                               "axes data, stage"),
                                              ({"itemsize": 0}, "itemsize 0"),
                                              ({"itemsize": 2.0}, "itemsize 2.0")])
def test_bad_choices_are_refused(kwargs, fragment):
    mesh = layout_mesh({"fsdp": 4}, Torus((4,)))
    with pytest.raises(ValueError, match=fragment):
        MeshCollectiveCosts(mesh, LinkSpec(1e11), **kwargs)


def test_meshes_the_runtime_cannot_shard_are_one_line():
    """A replicated model on an fsdp mesh is refused by the plan, naming pod.mesh; on a
    data mesh it plans; the transformer plans on a v3 mesh of a device per TensorCore."""
    from pod.config.plan import build_plan
    from pod.config.scenario import parse_scenario

    def plan(model, mesh, slice_name="v4-8"):
        return build_plan(parse_scenario({
            "name": "m", "pod": {"slice": slice_name, "mesh": mesh}, "model": {"name": model},
            "data": {"name": "digits"} if model == "mlp" else
            {"name": "text", "options": {"sequence_length": 64}},
            "training": {"global_batch": 32, "steps": 1}}))

    with pytest.raises(ScenarioError, match="pod.mesh: .*only the transformer model does; mlp"):
        plan("mlp", {"data": 2, "fsdp": 2})
    assert plan("mlp", {"data": 4}).mesh.sizes == {"data": 4}
    assert plan("transformer", {"data": 2, "tensor": 4}, "v3-8").mesh.devices_per_chip == 2


def test_a_megacore_device_has_the_chips_peak():
    assert device_chip_spec(V4).peak_bf16_flops_per_s == V4.peak_bf16_flops_per_s
    assert device_chip_spec(V4).tensorcores == 1 and device_chip_spec(V5E) is V5E


@pytest.mark.parametrize("chip", [V4, V5P], ids=["v4", "v5p"])
def test_a_megacore_device_is_both_tensorcores(chip):
    """[JAX] megacore: one device with both cores' MXUs, VPU, VMEM, HBM and bandwidth
    (issue 22's surviving mutant gave it one core's VPU: a vector op then took twice
    as long). A VPU-bound op on the device takes half a core's time."""
    from chip import TensorCore

    core, device = chip.core, device_chip_spec(chip).core
    n = chip.tensorcores
    assert n == 2
    assert device.mxus_per_core == n * core.mxus_per_core
    assert device.vpu_sublanes == n * core.vpu_sublanes
    assert device.vmem_bytes == n * core.vmem_bytes
    assert device.hbm_bytes == chip.hbm_available_bytes  # the chip's, not twice a rounded half
    assert device.hbm_bandwidth_bytes_per_s == n * core.hbm_bandwidth_bytes_per_s
    x = np.ones((1024, 1024), np.float32)
    one, both = TensorCore(core), TensorCore(device)
    for c in (one, both):
        c.vector("add", np.add, x, x)
    (a,), (b,) = one.take_records(), both.take_records()
    assert (a.unit, b.unit) == ("vpu", "vpu")
    assert b.seconds == pytest.approx(a.seconds / n, rel=1e-9)


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
    costs = MeshCollectiveCosts(mesh, link, on_chip_bandwidth(V3), axis_algorithms=RING,
                                itemsize=4)
    tensor = costs.cost("tensor", "allreduce", 4096)
    assert not tensor.link_bytes
    assert tensor.seconds == pytest.approx(2 * 2048 / on_chip_bandwidth(V3), rel=1e-12)
    chips = [tuple(d // 2 for d in g) for g in mesh.groups("fsdp")]
    assert chips[0] == chips[1]
    one_ring = group_collective_cost("reduce_scatter", mesh.torus, chips[:1], 2 * 1024, link)
    fsdp = costs.cost("fsdp", "reduce_scatter", 4096)
    assert fsdp.seconds == pytest.approx(one_ring.seconds, rel=1e-12)
    assert fsdp.link_bytes == one_ring.link_bytes


@pytest.mark.parametrize("algorithm", ["torus", "ring"])
def test_link_bytes_of_a_steps_calls_are_the_ring_closed_form(algorithm):
    """{tensor: 4} on a 4-chip ring: an allreduce of N bytes sends 2 (g - 1) / g N from
    each of the g devices over one hop, 2 (g - 1) N on the links in all (one ring, or the
    bidirectional chains: the same bytes, both directions); three calls three times
    that; a 2-device axis on the two cores of v3 chips moves no ICI byte."""
    from pod.programs.collectives import CollectiveCall

    mesh = layout_mesh({"tensor": 4}, Torus((4,), wraparound=(True,)))
    costs = MeshCollectiveCosts(mesh, LinkSpec(1e11), axis_algorithms={"tensor": algorithm})
    n = 4096
    calls = [CollectiveCall("tensor", "allreduce", n, "t", "activations", 0)] * 3
    links = costs.link_bytes(calls)
    assert sum(links.values()) == 3 * 2 * 3 * n
    assert all("->" in k for k in links)
    v3 = layout_mesh({"fsdp": 4, "tensor": 2}, Torus((2, 2)), per_chip=2)
    on_chip = MeshCollectiveCosts(v3, LinkSpec(1e11), on_chip_bandwidth(V3),
                                  axis_algorithms={"tensor": algorithm})
    assert on_chip.link_bytes(calls[:1]) == {}


def test_link_bytes_sum_each_calls_links_in_link_order():
    """Several axes, ops and sizes, repeated: per link the sum over the calls of their
    cost's bytes on it (summed here with a Counter, the calls one by one), keyed
    "src->dst" in (src, dst) order."""
    from collections import Counter

    from pod.programs.collectives import CollectiveCall

    mesh = layout_mesh({"data": 2, "fsdp": 4, "tensor": 2}, Torus((4, 4), (True, True)))
    costs = MeshCollectiveCosts(mesh, LinkSpec(1e11))
    calls = [CollectiveCall("fsdp", "all_gather", 6144, "g", "param_gather", 0)] * 5 + [
        CollectiveCall("fsdp", "reduce_scatter", 24576, "r", "grad_reduce", 0),
        CollectiveCall("data", "allreduce", 8192, "a", "grad_reduce", 0),
        CollectiveCall("tensor", "allreduce", 4096, "t", "activations", 0)] * 2
    want: Counter = Counter()
    for c in calls:
        for link, nbytes in costs.cost(c.axis, c.op, c.nbytes).link_bytes.items():
            want[link] += int(nbytes)
    got = costs.link_bytes(calls)
    assert list(got.items()) == [(f"{a}->{b}", v) for (a, b), v in sorted(want.items())]
    assert len(got) > 8 and costs.link_bytes([]) == {}


def test_a_v3_mesh_costs_its_core_axis_on_chip_and_shares_links_as_xla_runs_it():
    """v3-8 {fsdp: 4, tensor: 2}, "xla": tensor's block is the two cores (one phase per
    pass, half the buffer on-chip); fsdp's groups of both cores run over the same 2x2
    chips: one group of chips moving twice the bytes."""
    mesh = layout_mesh({"fsdp": 4, "tensor": 2}, Torus((2, 2)), per_chip=2)
    link = LinkSpec(1e11, latency_s=1e-6)
    costs = MeshCollectiveCosts(mesh, link, on_chip_bandwidth(V3))
    tensor = costs.cost("tensor", "allreduce", 4096)
    assert not tensor.link_bytes
    assert tensor.seconds == pytest.approx(2 * 2048 / on_chip_bandwidth(V3), rel=1e-12)
    chips = [tuple(d // 2 for d in g) for g in mesh.groups("fsdp", "mesh")]
    assert chips[0] == chips[1]
    block = costs.group_torus("fsdp")
    one = group_collective_cost("reduce_scatter", mesh.torus, chips[:1], 2 * 2048, link, 2,
                                algorithm="torus", group_torus=block)
    fsdp = costs.cost("fsdp", "reduce_scatter", 4096)
    assert fsdp.seconds == pytest.approx(one.seconds, rel=1e-12)
    assert fsdp.link_bytes == one.link_bytes


# ------------------------------------------------- the T1 layout: closed forms


T1_ACTIVATION_BYTES = 8 * 2048 * 10240 * 2  # (B, T, E) per device, bf16 [training-steps.md T1]


def test_the_t1_tensor_allreduce_is_the_bidirectional_ring_closed_form():
    """v5p-128 (4x4x4, wraparound), {fsdp: 16, tensor: 4}: tensor is the innermost torus
    axis, a ring of 4; an allreduce of V bytes is reduce-scatter + all-gather over both
    directions: 2 x (n-1)/n x V / (2 W) [SB], 2 + 2 hops, the fixed cost once."""
    mesh = layout_mesh({"fsdp": 16, "tensor": 4}, Torus((4, 4, 4)))
    w = V5P.ici_link_bandwidth_bytes_per_s
    link = LinkSpec(w, 1e-6, collective_fixed_s=4e-6)
    costs = MeshCollectiveCosts(mesh, link)
    assert costs.group_torus("tensor") == Torus((4,), (True,))
    v = T1_ACTIVATION_BYTES
    want = 2 * (3 / 4 * v / (2 * w) + 2e-6) + 4e-6
    assert costs.seconds("tensor", "allreduce", v) == pytest.approx(want, rel=1e-9)
    ring = MeshCollectiveCosts(mesh, link, axis_algorithms=RING).seconds("tensor", "allreduce", v)
    assert ring == pytest.approx(2 * (3 / 4 * v / w + 3e-6) + 4e-6, rel=1e-9)


def test_the_t1_fsdp_gather_uses_both_axes_of_its_block():
    """fsdp 16 on the 4x4 block of torus axes 0 and 1 (both wrap): an all-gather of a
    piece P per device gathers V = 16 P: (n-1)/n x V / (W_bidi x 2) + 2 + 2 hops."""
    mesh = layout_mesh({"fsdp": 16, "tensor": 4}, Torus((4, 4, 4)))
    w = V5P.ici_link_bandwidth_bytes_per_s
    costs = MeshCollectiveCosts(mesh, LinkSpec(w, 1e-6))
    assert costs.group_torus("fsdp") == Torus((4, 4), (True, True))
    piece = 3 * 2**20  # bytes per device; V splits evenly over 2 parts and 16 owners
    v = 16 * piece
    want = 15 / 16 * v / (2 * w * 2) + 4e-6
    assert costs.seconds("fsdp", "all_gather", piece) == pytest.approx(want, rel=1e-9)


# ------------------------------------------------- every layout: properties


@st.composite
def layouts(draw):
    """A small torus, a mesh laid on it (pod.config.mesh) and one of its axes."""
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.sampled_from((1, 2, 3, 4, 6))) for _ in range(ndim))
    assume(math.prod(shape) <= 36)
    torus = Torus(shape, tuple(draw(st.booleans()) for _ in shape))
    n = torus.num_chips
    tensor = draw(st.sampled_from([d for d in range(1, n + 1) if n % d == 0]))
    fsdp = draw(st.sampled_from([d for d in range(1, n // tensor + 1) if n // tensor % d == 0]))
    mesh = layout_mesh({"data": n // (tensor * fsdp), "fsdp": fsdp, "tensor": tensor}, torus)
    axis = draw(st.sampled_from([a for a in mesh.axis_names]))
    assume(mesh.axis_size(axis) > 1)
    return mesh, axis


@settings(max_examples=60, deadline=None)
@given(layout=layouts())
def test_a_mesh_groups_steps_along_its_block_axes_are_the_blocks_hops(layout):
    """In mesh order a group lists its devices row-major over the axis's blocks: a step
    of one along block k moves ``stride`` chips along that block's torus axis."""
    mesh, axis = layout
    blocks = mesh.torus_axes(axis)
    shape = tuple(k.size for k in blocks)
    for group in mesh.groups(axis, "mesh"):
        grid = np.asarray(group).reshape(shape)
        for k, block in enumerate(blocks):
            a = np.take(grid, range(block.size - 1), axis=k).reshape(-1)
            b = np.take(grid, range(1, block.size), axis=k).reshape(-1)
            for x, y in zip(a.tolist(), b.tolist()):
                cx, cy = mesh.torus.coords(x), mesh.torus.coords(y)
                moved = [i for i in range(mesh.torus.ndim) if cx[i] != cy[i]]
                assert moved == [block.torus_axis]
                assert cy[block.torus_axis] - cx[block.torus_axis] == block.stride


@settings(max_examples=60, deadline=None)
@given(layout=layouts(), op=st.sampled_from(["allreduce", "reduce_scatter", "all_gather"]),
       per_device=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_every_layout_costs_as_its_schedule_and_every_device_ends_right(layout, op, per_device,
                                                                        seed):
    """The plan's cost (fast path) = schedule_cost of the concurrent schedule over the same
    groups and block; executed, every device ends with its group's result."""
    mesh, axis = layout
    link = LinkSpec(1e9, 1e-6, collective_fixed_s=2e-6)
    costs = MeshCollectiveCosts(mesh, link)
    size = mesh.axis_size(axis)
    nbytes = 2 * size * per_device
    elements = nbytes // 2 * (size if op == "all_gather" else 1)
    groups = mesh.groups(axis, "mesh")
    schedule = concurrent_group_schedule(op, groups, mesh.torus.num_chips, elements, 2,
                                         algorithm="torus", group_torus=costs.group_torus(axis))
    reference = schedule_cost(schedule, mesh.torus, link)
    fast = costs.cost(axis, op, nbytes)
    assert fast.seconds == pytest.approx(reference.seconds, rel=1e-12)
    assert fast.link_bytes == reference.link_bytes
    rng = np.random.default_rng(seed)
    buffers = [rng.integers(-9, 9, elements).astype(np.float32) for _ in range(mesh.size)]
    out = execute(schedule, buffers)
    for g in groups:
        total = np.sum([buffers[d] for d in g], axis=0)
        for d in g:
            if op == "allreduce":
                np.testing.assert_array_equal(out[d], total)
            elif op == "reduce_scatter":
                a, b = schedule.chunk_bounds[schedule.owned_chunks[d]]
                np.testing.assert_array_equal(out[d][a:b], total[a:b])


def test_the_t1_tensor_allreduce_on_the_calibrated_link():
    """Issue 23's T1 figure: the ring model moved float32 over one direction; the xla
    model moves bf16 over both: a quarter of the bandwidth term, less the loss of a
    chip driving two links instead of one (``LinkSpec.achieved_bandwidth_bytes_per_s``)."""
    t1 = layout_mesh({"fsdp": 16, "tensor": 4}, Torus((4, 4, 4)))
    link = calibrated_link("v5p", V5P.ici_link_bandwidth_bytes_per_s)
    xla = MeshCollectiveCosts(t1, link).seconds("tensor", "allreduce", T1_ACTIVATION_BYTES)
    ring = MeshCollectiveCosts(t1, link, axis_algorithms=RING).seconds("tensor", "allreduce",
                                                                    2 * T1_ACTIVATION_BYTES)
    loss = link.achieved_bandwidth_bytes_per_s(2) / link.achieved_bandwidth_bytes_per_s(1)
    assert ring / xla == pytest.approx(4 * loss, rel=0.01)


# ---------------------------------------------------------------- a data axis over the whole pod


def _ring_allreduce_seconds(n, nbytes, link):
    """[SB]'s textbook ring allreduce: 2 (n - 1) phases, each moving a 1/n chunk over
    one link and paying one hop."""
    return 2 * (n - 1) * (nbytes / n / link.bandwidth_bytes_per_s + link.latency_s)


@pytest.mark.parametrize("algorithm", ["ring", "bidirectional_ring", "torus"])
def test_an_allreduce_over_the_whole_torus_costs_the_plans_algorithm(algorithm):
    """{data: 8} on a 2x4 torus: one group of every device; its allreduce is costed by the
    plan's whole-torus algorithm (``collective_cost``), not the group model; its other
    ops, and axes that do not span the pod, keep the group model."""
    from interconnect import collective_cost

    torus = Torus((2, 4))
    link = LinkSpec(1e11, latency_s=1e-6)
    mesh = layout_mesh({"data": 8}, torus)
    costs = MeshCollectiveCosts(mesh, link, torus_algorithm=algorithm)
    want = collective_cost("allreduce", torus, 4096, link, algorithm=algorithm, itemsize=2)
    assert costs.cost("data", "allreduce", 8192) == want
    group = MeshCollectiveCosts(mesh, link)
    assert costs.cost("data", "reduce_scatter", 8192) == group.cost("data", "reduce_scatter", 8192)
    assert group.torus_algorithm is None
    if algorithm != "torus":  # XLA's group model of a whole-torus axis is the torus algorithm
        assert group.cost("data", "allreduce", 8192).seconds != want.seconds
    part = layout_mesh({"data": 4, "tensor": 2}, torus)
    assert (MeshCollectiveCosts(part, link, torus_algorithm=algorithm).cost("data", "allreduce",
                                                                          8192)
            == MeshCollectiveCosts(part, link).cost("data", "allreduce", 8192))


def test_the_whole_torus_ring_is_the_textbook_closed_form():
    link = LinkSpec(1e11, latency_s=1e-6)
    mesh = layout_mesh({"data": 4}, Torus((4,)))
    seconds = MeshCollectiveCosts(mesh, link, torus_algorithm="ring").seconds("data", "allreduce",
                                                                            8192)
    assert seconds == pytest.approx(_ring_allreduce_seconds(4, 8192, link), rel=1e-12)


def test_on_v2_v3_the_chips_devices_add_on_chip_first():
    """{data: 8} over 4 v3 chips of two TensorCores: the devices of a chip add their
    buffers on chip (read two, write one: 3 x bytes at one core's HBM bandwidth), then
    the 4 chips ring-allreduce one buffer each."""
    link = LinkSpec(1e11, latency_s=1e-6)
    mesh = layout_mesh({"data": 8}, Torus((4,)), per_chip=2)
    assert mesh.size == 8 and mesh.devices_per_chip == 2
    bandwidth = on_chip_bandwidth(V3)
    cost = MeshCollectiveCosts(mesh, link, bandwidth, torus_algorithm="ring").cost(
        "data", "allreduce", 8192)
    local = 3 * 8192 / bandwidth
    assert cost.seconds == pytest.approx(local + _ring_allreduce_seconds(4, 8192, link), rel=1e-12)
    assert cost.phase_seconds[0] == pytest.approx(local) and len(cost.phase_seconds) == 1 + 6


def test_a_plan_allreduces_a_data_axis_over_the_pod_with_its_chosen_algorithm():
    """The plan passes pod.allreduce (or auto's choice) as the whole-torus algorithm of a
    {data: N} mesh, and none to a sharded mesh (no axis spans the pod)."""
    from pod.config.plan import build_plan
    from pod.config.scenario import parse_scenario

    def plan(mesh=None, allreduce="auto"):
        pod = {"slice": "v5e-8", "allreduce": allreduce, **({"mesh": mesh} if mesh else {})}
        return build_plan(parse_scenario({
            "name": "a", "pod": pod, "model": {"name": "transformer", "options": {
                "embed_dim": 16, "heads": 2, "head_dim": 8, "mlp_dim": 32, "layers": 1}},
            "data": {"name": "text", "options": {"sequence_length": 16}},
            "training": {"global_batch": 16, "steps": 1}}))

    ring = plan(allreduce="ring")
    assert ring.ici.algorithm == ring.collective_costs.torus_algorithm == "ring"
    assert ring.collective_costs.algorithms() == {"data": "ring"}
    auto = plan()
    assert auto.collective_costs.torus_algorithm == auto.ici.algorithm
    sharded = plan({"data": 2, "fsdp": 2, "tensor": 2})
    assert sharded.collective_costs.torus_algorithm is None and not sharded.ici.whole_pod
    # the group collectives as XLA runs them: over every torus axis of the group's block
    assert sharded.collective_costs.algorithms() == {"data": "torus", "fsdp": "torus",
                                                     "tensor": "torus"}


def _plan_with(pod_fields: dict):
    from pod.config.plan import build_plan
    from pod.config.scenario import parse_scenario

    return build_plan(parse_scenario({
        "name": "a", "pod": {"slice": "v5e-8", **pod_fields},
        "model": {"name": "transformer", "options": {
            "embed_dim": 16, "heads": 4, "head_dim": 4, "mlp_dim": 32, "layers": 1}},
        "data": {"name": "text", "options": {"sequence_length": 16}},
        "training": {"global_batch": 16, "steps": 1}}))


def test_a_scenario_chooses_each_mesh_axis_algorithm_from_the_registry():
    """pod.collective_algorithms: {tensor: ring} costs tensor's collectives as one ring per
    group in ring order (the registry's ring), while fsdp, not named, runs torus (XLA's,
    the default) exactly as without the field; {data: ring} is also the algorithm of a
    data axis over the whole slice (pod.allreduce's)."""
    mesh = {"fsdp": 2, "tensor": 4}
    chosen = _plan_with({"mesh": mesh, "collective_algorithms": {"tensor": "ring"}})
    default = _plan_with({"mesh": mesh})
    costs, plain = chosen.collective_costs, default.collective_costs
    assert (costs.axis_algorithm("tensor"), costs.axis_algorithm("fsdp")) == ("ring", "torus")
    one = chosen.mesh.in_slice
    ring = group_collective_cost("allreduce", one.torus, one.groups("tensor", "ring"), 2048,
                                 costs.link, 2, algorithm="ring")
    assert costs.cost("tensor", "allreduce", 4096) == ring
    assert plain.cost("tensor", "allreduce", 4096).seconds < ring.seconds  # both directions
    for op in ("all_gather", "reduce_scatter"):
        assert costs.cost("fsdp", op, 4096) == plain.cost("fsdp", op, 4096)
    assert costs.algorithms() == {"fsdp": "torus", "tensor": "ring"}
    data = _plan_with({"collective_algorithms": {"data": "ring"}})
    assert data.ici.algorithm == data.collective_costs.torus_algorithm == "ring"


def test_a_collective_matmul_pays_a_fixed_cost_per_collective_permute_step():
    """XLA's windowed einsum (issue 29): an all-gather over a tensor axis of 16 runs as
    ceil(15 / 2) = 8 bidirectional collective-permute steps, an allreduce (its
    reduce-scatter and its all-gather) as 16; each pays a collective's fixed cost, of
    which the monolithic collective paid one."""
    mesh = layout_mesh({"data": 2, "tensor": 16}, Torus((2, 16)))
    link = LinkSpec(1e11, latency_s=1e-6, collective_fixed_s=4e-6)
    costs = MeshCollectiveCosts(mesh, link)
    assert costs.windowed_steps("tensor", "all_gather") == 8
    assert costs.windowed_steps("tensor", "reduce_scatter") == 8
    assert costs.windowed_steps("tensor", "allreduce") == 16
    assert costs.windowed_steps("data", "allreduce") == 2       # an axis of 2: one step each way
    assert costs.windowed_steps("fsdp", "allreduce") == 0       # absent: no collective at all
    assert costs.windowed_steps("tensor", "all_to_all") == 0
    plain = costs.seconds("tensor", "allreduce", 1 << 20)
    assert costs.seconds("tensor", "allreduce", 1 << 20, windowed=True) == pytest.approx(
        plain + 15 * 4e-6, rel=1e-12)
