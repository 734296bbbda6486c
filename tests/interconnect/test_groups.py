"""Tests of interconnect.groups: every group of a mesh axis at once.

References: numpy sums per group (integer-valued floats, so every order is
exact), the torus's own links for every routed hop, the textbook ring
closed forms ([SB]: (n-1)/n V / W + (n-1) latency per ring pass).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from interconnect import (LinkSpec, ScheduleError, Torus, concurrent_group_schedule, execute,
                          group_collective_cost, group_ring_schedule)


@st.composite
def tori_and_groups(draw):
    """A small torus and a partition of its chips into equal groups (random order)."""
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.sampled_from([1, 2, 3, 4])) for _ in range(ndim))
    wrap = tuple(draw(st.booleans()) for _ in range(ndim))
    torus = Torus(shape, wraparound=wrap)
    n = torus.num_chips
    size = draw(st.sampled_from([d for d in range(1, n + 1) if n % d == 0]))
    perm = draw(st.permutations(range(n)))
    groups = [tuple(perm[i:i + size]) for i in range(0, n, size)]
    return torus, groups


@settings(max_examples=60, deadline=None)
@given(tg=tori_and_groups(), op=st.sampled_from(["allreduce", "reduce_scatter", "all_gather"]),
       per_rank=st.integers(0, 9), seed=st.integers(0, 2**16))
def test_every_group_ends_with_its_own_result_over_real_links(tg, op, per_rank, seed):
    torus, groups = tg
    size = len(groups[0])
    elements = size * per_rank
    schedule = concurrent_group_schedule(op, groups, torus.num_chips, elements)
    rng = np.random.default_rng(seed)
    buffers = [rng.integers(-50, 50, size=elements).astype(np.float32)
               for _ in range(torus.num_chips)]
    bounds = schedule.chunk_bounds
    if op == "all_gather":  # each rank starts with its owned chunk only
        for r, buf in enumerate(buffers):
            a, b = bounds[schedule.owned_chunks[r]]
            keep = buf[a:b].copy()
            buf[:] = -999
            buf[a:b] = keep
    out = execute(schedule, buffers)
    for g in groups:
        total = np.sum([buffers[r] for r in g], axis=0)
        for r in g:
            if op == "allreduce":
                np.testing.assert_array_equal(out[r], total)
            elif op == "reduce_scatter":
                a, b = bounds[schedule.owned_chunks[r]]
                np.testing.assert_array_equal(out[r][a:b], total[a:b])
            else:
                want = np.empty(elements, np.float32)
                for q in g:
                    a, b = bounds[schedule.owned_chunks[q]]
                    want[a:b] = buffers[q][a:b]
                np.testing.assert_array_equal(out[r], want)
    links = set(torus.links())
    for phase in schedule.phases:
        for t in phase:
            assert any(t.src in g and t.dst in g for g in groups), "a transfer left its group"
            hops = torus.route(t.src, t.dst)
            assert hops and all(h in links for h in hops)
            assert hops[0][0] == t.src and hops[-1][1] == t.dst


@pytest.mark.parametrize("n", [2, 3, 4, 8])
@pytest.mark.parametrize("op,passes", [("allreduce", 2), ("reduce_scatter", 1), ("all_gather", 1)])
def test_one_ring_group_costs_the_textbook_closed_form(n, op, passes):
    torus = Torus((n,), wraparound=(True,))
    link = LinkSpec(1e11, latency_s=1e-6)
    elements = n * 1000
    cost = group_collective_cost(op, torus, [tuple(range(n))], elements, link)
    v = elements * 4
    want = passes * ((n - 1) / n * v / 1e11 + (n - 1) * 1e-6)
    assert cost.seconds == pytest.approx(want, rel=1e-12)


def test_groups_that_share_links_contend():
    torus = Torus((4,), wraparound=(False,))  # a line: 0-1-2-3
    link = LinkSpec(1e9, latency_s=0.0)
    alone = group_collective_cost("allreduce", torus, [(0, 2)], 4000, link)
    both = group_collective_cost("allreduce", torus, [(0, 2), (1, 3)], 4000, link)
    disjoint = group_collective_cost("allreduce", torus, [(0, 1), (2, 3)], 4000, link)
    assert both.seconds == pytest.approx(2 * alone.seconds)  # link 1->2 carries both groups
    assert disjoint.seconds == pytest.approx(alone.seconds)  # no link shared: as one group
    assert both.link_bytes[(1, 2)] == 2 * alone.link_bytes[(1, 2)]


def test_groups_of_one_cost_nothing():
    cost = group_collective_cost("allreduce", Torus((2, 2)), [(0,), (1,), (2,), (3,)], 64,
                                 LinkSpec(1e9, collective_fixed_s=1e-5))
    assert cost.seconds == 0 and not cost.link_bytes


@pytest.mark.parametrize("groups,fragment", [
    ([(0, 1), (2,)], "same size"),
    ([(0, 1), (1, 2)], "appears twice"),
    ([(0, 9)], "outside"),
])
def test_bad_groups_are_refused(groups, fragment):
    with pytest.raises(ScheduleError, match=fragment):
        concurrent_group_schedule("allreduce", groups, 4, 8)


def test_unknown_op_is_refused():
    with pytest.raises(ScheduleError, match="all_gather"):
        group_ring_schedule("broadcast", 2, 8)
    assert math.isclose(group_ring_schedule("allreduce", 1, 8).num_phases, 0)


# ------------------------------------------------------------------ the fast path


@settings(max_examples=80, deadline=None)
@given(tg=tori_and_groups(), op=st.sampled_from(["allreduce", "reduce_scatter", "all_gather"]),
       elements=st.integers(0, 40), slow=st.booleans())
def test_fast_group_cost_equals_the_schedule_path(tg, op, elements, slow):
    """group_collective_cost (the ring's phases built as arrays) = schedule_cost of the
    concurrent schedule (its Transfers), seconds, phases and bytes per link, for any
    groups (random orders: routes of any length), even and uneven parts, with a slowed
    link."""
    from interconnect import LinkFaults, schedule_cost

    torus, groups = tg
    link = LinkSpec(bandwidth_bytes_per_s=1e9, latency_s=1e-6, collective_fixed_s=2e-6,
                    multi_link_exponent=0.3)
    faults = None
    if slow and torus.num_chips > 1:
        src = 0
        dst = torus.neighbors(0)[0]
        faults = LinkFaults(slowdowns={(src, dst): 3.0})
    reference = schedule_cost(concurrent_group_schedule(op, groups, torus.num_chips, elements),
                              torus, link, faults)
    if all(len(g) <= 1 for g in groups):
        return
    fast = group_collective_cost(op, torus, groups, elements, link, faults=faults)
    assert fast.seconds == pytest.approx(reference.seconds, rel=1e-12, abs=1e-18)
    assert fast.phase_seconds == pytest.approx(reference.phase_seconds, rel=1e-12, abs=1e-18)
    assert fast.link_bytes == reference.link_bytes
    assert fast.busiest_link_seconds == pytest.approx(reference.busiest_link_seconds, rel=1e-12)


def test_mesh_axis_cost_on_a_full_v5p_pod_takes_little_work():
    """On the 8,960-chip v5p pod (a 16x20x28 torus), 320 groups of 28 chips along the
    last axis (closed rings, no shared links) cost the textbook ring reduce-scatter:
    (g - 1) phases of V / g bytes per link."""
    torus = Torus((16, 20, 28), wraparound=(True, True, True))
    link = LinkSpec(bandwidth_bytes_per_s=1e9, latency_s=0.0)
    # groups along the last axis (28 chips, a closed ring): translates of each other
    groups = [tuple(base + k for k in range(28)) for base in range(0, torus.num_chips, 28)]
    elements = 28 * 1000
    cost = group_collective_cost("reduce_scatter", torus, groups, elements, link)
    assert cost.seconds == pytest.approx(27 * 1000 * 4 / 1e9, rel=1e-12)


# ------------------------------------------- two devices per chip (v2 / v3 TensorCores)


@pytest.mark.parametrize("op,phases", [("allreduce", 2), ("reduce_scatter", 1), ("all_gather", 1)])
def test_the_two_tensorcores_of_a_chip_copy_at_the_on_chip_bandwidth(op, phases):
    """Groups of the two devices of each chip (device d on chip d // 2) load no ICI
    link: each ring phase copies half the buffer at the on-chip bandwidth."""
    torus = Torus((2, 2))
    link = LinkSpec(1e9, latency_s=1e-6, collective_fixed_s=3e-6)
    groups = [(2 * c, 2 * c + 1) for c in range(4)]
    cost = group_collective_cost(op, torus, groups, 1000, link, devices_per_chip=2,
                                 on_chip_bytes_per_s=4e11)
    assert not cost.link_bytes
    assert cost.seconds == pytest.approx(3e-6 + phases * 500 * 4 / 4e11, rel=1e-12)


@pytest.mark.parametrize("op", ["allreduce", "reduce_scatter", "all_gather"])
def test_the_groups_of_both_cores_share_their_chips_links(op):
    """Core 0's ring and core 1's ring over the same four chips load every link twice:
    the cost of one ring of chips moving twice the bytes (the textbook closed form,
    test_one_ring_group_costs_the_textbook_closed_form)."""
    torus = Torus((4,), wraparound=(True,))
    link = LinkSpec(1e9, latency_s=1e-6)
    both = group_collective_cost(op, torus, [(0, 2, 4, 6), (1, 3, 5, 7)], 4000, link,
                                 devices_per_chip=2, on_chip_bytes_per_s=1e12)
    chips = group_collective_cost(op, torus, [(0, 1, 2, 3)], 8000, link)
    assert both.seconds == pytest.approx(chips.seconds, rel=1e-12)
    assert both.link_bytes == chips.link_bytes


@pytest.mark.parametrize("on_chip", [1e12, 1e8])
def test_a_ring_through_both_cores_takes_the_slower_of_its_ici_and_on_chip_steps(on_chip):
    """Devices 0, 1 (chip 0) and 2, 3 (chip 1) in one ring: two steps cross the link
    between the chips, two stay on a chip; each phase takes the longer."""
    torus = Torus((2,), wraparound=(False,))
    link = LinkSpec(1e9, latency_s=1e-6)
    cost = group_collective_cost("allreduce", torus, [(0, 1, 2, 3)], 4000, link,
                                 devices_per_chip=2, on_chip_bytes_per_s=on_chip)
    part = 1000 * 4
    phase = max(part / 1e9 + 1e-6, part / on_chip)
    assert cost.seconds == pytest.approx(6 * phase, rel=1e-12)
    assert cost.link_bytes == {(0, 1): 6 * part, (1, 0): 6 * part}


def test_several_devices_per_chip_are_refused_without_a_bandwidth_or_with_failed_links():
    from interconnect import LinkFaults

    torus, link = Torus((2, 2)), LinkSpec(1e9)
    groups = [(0, 2, 4, 6), (1, 3, 5, 7)]
    with pytest.raises(ScheduleError, match="on_chip_bytes_per_s None"):
        group_collective_cost("allreduce", torus, groups, 8, link, devices_per_chip=2)
    with pytest.raises(ScheduleError, match="failed links with several devices per chip"):
        group_collective_cost("allreduce", torus, groups, 8, link, devices_per_chip=2,
                              on_chip_bytes_per_s=1e9, faults=LinkFaults(failed={(0, 1)}))
    with pytest.raises(ScheduleError, match="appears twice"):
        group_collective_cost("allreduce", torus, [(0, 1), (1, 2)], 8, link, devices_per_chip=2,
                              on_chip_bytes_per_s=1e9)
    with pytest.raises(ScheduleError, match="outside 0..7"):
        group_collective_cost("allreduce", torus, [(0, 8)], 8, link, devices_per_chip=2,
                              on_chip_bytes_per_s=1e9)
