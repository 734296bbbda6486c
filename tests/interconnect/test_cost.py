"""Tests of interconnect.cost and interconnect.link against closed-form costs.

Textbook references ([SB], "How to Scale Your Model", the "Textbook collective
costs"): on a full unidirectional ring of N chips with one-way link
bandwidth W, an allreduce of V bytes per chip takes 2 (N-1)/N x V / W; small
messages are latency-bound at about one hop latency per phase.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from interconnect import (
    LinkSpec,
    Schedule,
    ScheduleCost,
    ScheduleError,
    Torus,
    Transfer,
    chunk_bounds,
    ring_allreduce,
    schedule_cost,
    schedule_time,
)
from interconnect.errors import InterconnectError, LinkSpecError

GIB = 1 << 30


# ------------------------------------------------------------------ LinkSpec


def test_linkspec_defaults_and_floats():
    link = LinkSpec(45e9)
    assert link.bandwidth_bytes_per_s == 45e9 and link.latency_s == 1e-6
    assert isinstance(LinkSpec(10, 0).latency_s, float)
    assert link.transfer_seconds(90e9, hops=3) == pytest.approx(2.0 + 3e-6)


@pytest.mark.parametrize(
    "bandwidth, latency, fragment",
    [(0, 1e-6, "bandwidth_bytes_per_s 0"), (-5.0, 0, "-5.0"), (1e9, -1e-6, "latency_s -1e-06"),
     (math.inf, 0, "inf"), (math.nan, 0, "nan"), ("fast", 0, "'fast'"), (True, 0, "True")],
)
def test_linkspec_rejects(bandwidth, latency, fragment):
    with pytest.raises(LinkSpecError) as info:
        LinkSpec(bandwidth, latency)
    assert fragment in str(info.value)
    assert isinstance(info.value, ValueError) and isinstance(info.value, InterconnectError)


@pytest.mark.parametrize("field, value", [("efficiency", 0.0), ("efficiency", 1.5), ("multi_link_exponent", -0.1),
                                          ("collective_fixed_s", -1e-6), ("efficiency", math.nan)])
def test_linkspec_rejects_calibration(field, value):
    with pytest.raises(LinkSpecError, match=f"{field} {value!r}"):
        LinkSpec(1e9, **{field: value})


def test_linkspec_achieved_bandwidth():
    link = LinkSpec(9e10, efficiency=0.96, multi_link_exponent=0.25)
    assert link.achieved_bandwidth_bytes_per_s(1) == pytest.approx(0.96 * 9e10)
    assert link.achieved_bandwidth_bytes_per_s(4) == pytest.approx(0.96 * 9e10 / math.sqrt(2))
    assert link.transfer_seconds(0.96 * 9e10) == pytest.approx(1.0 + 1e-6)
    capped = LinkSpec(9e10, efficiency=0.5, multi_link_exponent=1.0, multi_link_cap=2)
    assert capped.achieved_bandwidth_bytes_per_s(6) == capped.achieved_bandwidth_bytes_per_s(2) == 0.25 * 9e10
    with pytest.raises(LinkSpecError, match="multi_link_cap 0.5"):
        LinkSpec(9e10, multi_link_cap=0.5)


def test_linkspec_dma_streams_share_the_links_beyond_them():
    """S streams drive up to S links at the full rate; k > S links get S / k each."""
    link = LinkSpec(9e10, efficiency=0.5, dma_streams=2)
    assert link.achieved_bandwidth_bytes_per_s(1) == link.achieved_bandwidth_bytes_per_s(2) == 0.5 * 9e10
    assert link.achieved_bandwidth_bytes_per_s(6) == pytest.approx(0.5 * 9e10 / 3)
    assert LinkSpec(9e10).achieved_bandwidth_bytes_per_s(6) == 9e10  # default: no limit
    for bad in (0, -1.0, math.nan, True, "2"):
        with pytest.raises(LinkSpecError, match="dma_streams"):
            LinkSpec(9e10, dma_streams=bad)


# ------------------------------------------------------- textbook ring costs


@pytest.mark.parametrize("n", [2, 3, 4, 8, 16, 64])
def test_bandwidth_bound_ring_matches_textbook(n):
    volume_bytes = GIB
    bandwidth = 4.5e10
    textbook_s = 2 * (n - 1) / n * volume_bytes / bandwidth
    t = Torus((n,))
    seconds = schedule_time(ring_allreduce(t, volume_bytes // 4, itemsize=4), t, LinkSpec(bandwidth, 1e-6))
    assert seconds == pytest.approx(textbook_s, rel=0.01)


@pytest.mark.parametrize("n", [2, 5, 8, 32])
def test_small_messages_are_latency_bound(n):
    latency = 1e-6
    t = Torus((n,))
    seconds = schedule_time(ring_allreduce(t, n, itemsize=4), t, LinkSpec(1e12, latency))
    assert seconds == pytest.approx(2 * (n - 1) * latency, rel=0.01)


def test_single_chip_costs_nothing():
    t = Torus((1,))
    cost = schedule_cost(ring_allreduce(t, 1000), t, LinkSpec(1e9))
    assert cost.seconds == 0.0 and cost.phase_seconds == () and cost.link_bytes == {}


def test_phase_times_on_2d_torus():
    """Every ring step is one link: phase = largest chunk sent / W + one latency."""
    t = Torus((4, 4))
    num_elements, itemsize, bandwidth, latency = 1001, 4, 1e9, 2e-6
    sizes = [len(p) * itemsize for p in np.array_split(np.arange(num_elements), 16)]
    cost = schedule_cost(ring_allreduce(t, num_elements, itemsize), t, LinkSpec(bandwidth, latency))
    assert len(cost.phase_seconds) == 30
    # 1001 = 16 x 62 + 9: chunks of 63 or 62 elements; every phase sends every chunk once.
    expected_phase = max(sizes) / bandwidth + latency
    assert cost.phase_seconds == pytest.approx([expected_phase] * 30)
    assert cost.seconds == pytest.approx(30 * expected_phase)


# ----------------------------------------------------------------- link bytes


@pytest.mark.parametrize(
    "shape, wrap", [((8,), True), ((7,), False), ((4, 4), True), ((3, 3), False), ((3, 3, 3), False), ((2, 2, 2), True)]
)
def test_link_bytes_sum_is_bytes_times_hops(shape, wrap):
    t = Torus(shape, wrap)
    schedule = ring_allreduce(t, 1000, itemsize=2)
    cost = schedule_cost(schedule, t, LinkSpec(1e9))
    expected = 0
    for phase in schedule.phases:
        for tr in phase:
            ca, cb = t.coords(tr.src), t.coords(tr.dst)
            hops = sum(
                min(abs(a - b), s - abs(a - b)) if w else abs(a - b)
                for a, b, s, w in zip(ca, cb, t.shape, t.wraparound)
            )
            expected += tr.nbytes * hops
    assert sum(cost.link_bytes.values()) == cost.total_link_bytes == expected
    links = set(t.links())
    assert set(cost.link_bytes) <= links
    assert all(v > 0 for v in cost.link_bytes.values())


def test_link_bytes_on_full_ring():
    """Link i -> i+1 carries every chunk but (i+1) in reduce-scatter and every chunk but (i+2) in all-gather."""
    n, num_elements = 5, 23
    t = Torus((n,))
    sizes = [len(p) * 4 for p in np.array_split(np.arange(num_elements), n)]
    cost = schedule_cost(ring_allreduce(t, num_elements), t, LinkSpec(1e9))
    expected = {(i, (i + 1) % n): 2 * num_elements * 4 - sizes[(i + 1) % n] - sizes[(i + 2) % n] for i in range(n)}
    assert cost.link_bytes == expected
    assert cost.max_link_bytes == max(expected.values())


# ----------------------------------------------------------------- contention


def one_phase(num_ranks, transfers, chunk_elements=1000, num_chunks=4):
    bounds = chunk_bounds(chunk_elements * num_chunks, num_chunks)
    return Schedule("handmade", num_ranks, chunk_elements * num_chunks, 4, bounds, (tuple(transfers),))


def test_two_transfers_on_one_link_take_twice_as_long():
    t = Torus((4,))
    link = LinkSpec(1e9, latency_s=0.0)
    one = schedule_time(one_phase(4, [Transfer(0, 1, 0, 4000, True)]), t, link)
    two = schedule_time(one_phase(4, [Transfer(0, 1, 0, 4000, True), Transfer(0, 1, 1, 4000, True)]), t, link)
    assert one == pytest.approx(4000 / 1e9)
    assert two == pytest.approx(2 * one)


def test_contention_on_a_shared_hop_with_latency():
    # Line of 4 chips: 0 -> 2 goes 0 -> 1 -> 2, 1 -> 2 shares link (1, 2).
    t = Torus((4,), wraparound=False)
    bandwidth, latency = 1e9, 1e-6
    schedule = one_phase(4, [Transfer(0, 2, 0, 4000, True), Transfer(1, 2, 1, 4000, True)])
    cost = schedule_cost(schedule, t, LinkSpec(bandwidth, latency))
    assert cost.seconds == pytest.approx(2 * 4000 / bandwidth + 2 * latency)
    assert cost.link_bytes == {(0, 1): 4000, (1, 2): 8000}


def test_opposite_directions_do_not_contend():
    t = Torus((4,))
    link = LinkSpec(1e9, latency_s=0.0)
    both = one_phase(4, [Transfer(0, 1, 0, 4000, True), Transfer(1, 0, 1, 4000, True)])
    assert schedule_time(both, t, link) == pytest.approx(4000 / 1e9)


def test_empty_phases_and_zero_bytes_cost_nothing():
    t = Torus((3,))
    bounds = ((0, 0), (0, 3))
    schedule = Schedule("z", 3, 3, 4, bounds, ((), (Transfer(0, 1, 0, 0, True),), (Transfer(0, 2, 1, 12, False),)))
    cost = schedule_cost(schedule, t, LinkSpec(1e9, 1e-6))
    assert cost.phase_seconds[:2] == (0.0, 0.0)
    assert cost.phase_seconds[2] == pytest.approx(12 / 1e9 + 1e-6)  # 0 -> 2 is the wraparound link


def test_cost_rejects_mismatched_topology():
    with pytest.raises(ScheduleError, match="num_ranks=4"):
        schedule_cost(ring_allreduce(Torus((4,)), 8), Torus((2, 3)), LinkSpec(1e9))


def test_schedule_cost_is_frozen_value():
    t = Torus((2,))
    cost = schedule_cost(ring_allreduce(t, 8), t, LinkSpec(1e9))
    assert isinstance(cost, ScheduleCost)
    assert cost.seconds == schedule_time(ring_allreduce(t, 8), t, LinkSpec(1e9))
    with pytest.raises(AttributeError):
        cost.seconds = 1.0  # type: ignore[misc]


def test_mesh_ring_pays_extra_latency_not_bandwidth():
    """A line of 6 (no wraparound) walks 0,2,4,5,3,1: the 2-hop steps use distinct links."""
    n, bandwidth, latency = 6, 1e9, 1e-6
    line, ring = Torus((n,), False), Torus((n,), True)
    volume_bytes = 6 * 4 * 1000
    line_s = schedule_time(ring_allreduce(line, volume_bytes // 4), line, LinkSpec(bandwidth, latency))
    ring_s = schedule_time(ring_allreduce(ring, volume_bytes // 4), ring, LinkSpec(bandwidth, latency))
    bandwidth_s = 2 * (n - 1) / n * volume_bytes / bandwidth
    assert ring_s == pytest.approx(bandwidth_s + 2 * (n - 1) * latency)
    assert line_s == pytest.approx(bandwidth_s + 2 * (n - 1) * 2 * latency)
