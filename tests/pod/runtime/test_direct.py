"""The two-phase group allreduce and the one through one device (star), both in
``pod.runtime.direct``, give the ring's bits: in-process ports, one thread per device,
against ``interconnect.execute`` of the ring schedule on float32 data whose sums depend
on the order of the additions."""

from __future__ import annotations

import numpy as np
import pytest

from interconnect import Torus, execute, group_ring_schedule
from pod.config.mesh import layout_mesh
from pod.config.sharding import device_groups
from pod.runtime.direct import direct_allreduce, fold_orders, star_allreduce
from pod.runtime.ici import IciPort
from pod.runtime.mesh_collectives import GroupTransport
from tests.pod.runtime.test_mesh_collectives import run_on_threads


def test_the_ring_adds_each_chunk_in_one_order_ending_with_its_owner():
    ring = group_ring_schedule("allreduce", 4, 8)
    # position p sends to p + 1: chunk c starts at c and ends, summed, at c - 1
    assert fold_orders(ring) == ((0, 1, 2, 3), (1, 2, 3, 0), (2, 3, 0, 1), (3, 0, 1, 2))
    plan = direct_allreduce(4, 8)
    assert plan is not None and plan.extra_elements == 2
    assert all(len(phases) == 2 for phases in plan.plans)  # two rounds, not 2 (g - 1)


def test_a_tree_of_partial_sums_has_no_single_order():
    from interconnect import build_collective

    assert fold_orders(build_collective("allreduce", Torus((8,)), 64, 4, "tree")) is None


@pytest.mark.parametrize(("shape", "elements"), [((3,), 7), ((2, 2), 1001), ((2, 4), 44138),
                                                 ((2, 4), 5), ((5,), 3)])
@pytest.mark.parametrize("star", [False, True], ids=["two-phase", "star"])
def test_the_two_phase_and_the_star_allreduce_give_the_rings_bits(shape, elements, star,
                                                                   monkeypatch):
    """Twice on the same ports; ``star``: through one device (below ``STAR_MAX_BYTES``),
    else in two phases (the threshold set to 0). (5,) with 3 elements: empty chunks."""
    import pod.runtime.mesh_collectives as mesh_collectives

    monkeypatch.setattr(mesh_collectives, "STAR_MAX_BYTES", 1 << 20 if star else 0)
    torus = Torus(shape)
    mesh = layout_mesh({"data": torus.num_chips}, torus)
    n = mesh.size
    ports = [IciPort(d, b"key") for d in range(n)]
    addresses = {d: p.address for d, p in enumerate(ports)}
    rng = np.random.default_rng(elements)
    inputs = {d: (rng.standard_normal(elements) * 10.0 ** rng.integers(-3, 4, elements))
              .astype(np.float32) for d in range(n)}
    results, errors = {}, []

    def run(device):
        try:
            for base in (100, 200):  # twice on the same ports
                comm = GroupTransport(ports[device], device_groups(mesh, device), addresses, base)
                results[(base, device)] = comm.allreduce(inputs[device] * (base // 100), "data")
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    run_on_threads(run, n, ports)
    assert not errors, errors
    ring = device_groups(mesh, 0).ring["data"]
    for base in (100, 200):
        scaled = [inputs[d] * (base // 100) for d in ring]
        want = execute(group_ring_schedule("allreduce", n, elements), scaled)
        for position, d in enumerate(ring):
            assert results[(base, d)].tobytes() == want[position].tobytes(), (base, d)
        if elements > 100:  # the data has teeth: the reverse order gives other bits
            other = scaled[-1].copy()
            for x in scaled[-2::-1]:
                other += x
            assert not np.array_equal(other, want[0])


def test_the_star_sends_two_messages_per_member_in_all():
    star = star_allreduce(8, 44138)
    assert star is not None and star.root == 0
    sends = [len(s) for plan in star.plans for _, s, _ in plan]
    assert sum(sends) == 2 * 7  # the direct's: 2 * 8 * 7 = 112
    assert star.root_bounds[-1] == (8 * 44138, 9 * 44138)
