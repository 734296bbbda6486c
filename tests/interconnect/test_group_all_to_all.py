"""All-to-all over every group of a mesh axis (the MoE dispatch): each group's result
over real links, the fast cost path equal to the schedule path, the closed form on a
ring, contention between groups."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from interconnect import (LinkFaults, LinkSpec, Torus, concurrent_group_schedule, execute,
                          group_collective_cost, schedule_cost)
from interconnect.collectives import all_to_all
from tests.interconnect.test_groups import tori_and_groups

LINK = LinkSpec(4.5e10, latency_s=1e-6, collective_fixed_s=2e-6)


@settings(max_examples=40, deadline=None)
@given(tg=tori_and_groups(), per_piece=st.integers(0, 5), seed=st.integers(0, 2**16))
def test_every_member_ends_with_piece_i_of_member_i_over_real_links(tg, per_piece, seed):
    torus, groups = tg
    size = len(groups[0])
    schedule = concurrent_group_schedule("all_to_all", groups, torus.num_chips, size * per_piece)
    rng = np.random.default_rng(seed)
    buffers = [rng.integers(-50, 50, size=size * per_piece).astype(np.float32)
               for _ in range(torus.num_chips)]
    out = execute(schedule, buffers)
    for g in groups:
        for j, r in enumerate(g):
            want = np.concatenate([buffers[q][j * per_piece:(j + 1) * per_piece] for q in g])
            np.testing.assert_array_equal(out[r], want)
    links = set(torus.links())
    for phase in schedule.phases:
        for t in phase:
            assert all(h in links for h in torus.route(t.src, t.dst))


@settings(max_examples=40, deadline=None)
@given(tg=tori_and_groups(), per_piece=st.integers(1, 50))
def test_the_fast_path_costs_what_the_schedule_costs(tg, per_piece):
    torus, groups = tg
    size = len(groups[0])
    if size == 1:
        return
    elements = size * per_piece
    fast = group_collective_cost("all_to_all", torus, groups, elements, LINK, 2)
    slow = schedule_cost(concurrent_group_schedule("all_to_all", groups, torus.num_chips,
                                                   elements, 2), torus, LINK)
    assert fast.seconds == pytest.approx(slow.seconds, rel=1e-12)
    assert fast.link_bytes == slow.link_bytes
    for algorithm in ("torus", "ring", "tree"):  # direct whatever the algorithm
        cost = group_collective_cost("all_to_all", torus, groups, elements, LINK, 2,
                                     algorithm=algorithm)
        assert cost.seconds == pytest.approx(fast.seconds, rel=1e-12)


def test_one_group_over_the_whole_torus_is_the_torus_all_to_all():
    torus = Torus((4, 4), wraparound=(True, True))
    whole = schedule_cost(all_to_all(torus, 16 * 1000, 2), torus, LINK)
    group = group_collective_cost("all_to_all", torus, [tuple(range(16))], 16 * 1000, LINK, 2)
    assert group.seconds == pytest.approx(whole.seconds, rel=1e-12)


@pytest.mark.parametrize("n", [4, 8, 16])
def test_a_ring_costs_its_closed_form(n):
    """A closed ring of n (a multiple of 4): the busiest link carries (n/2 - 1) n/4 + n/4
    pieces of V / n ([SB]: about V n / 8 bytes per link; collectives.all_to_all)."""
    torus = Torus((n,), wraparound=(True,))
    v = n * 600                                                         # elements
    cost = group_collective_cost("all_to_all", torus, [tuple(range(n))], v, LINK, 2)
    pieces = (n // 2 - 1) * n // 4 + n // 4
    busiest = pieces * v // n * 2
    want = (LINK.collective_fixed_s + busiest / LINK.achieved_bandwidth_bytes_per_s(2)
            + n // 2 * LINK.latency_s)
    assert max(cost.link_bytes.values()) == busiest
    assert cost.seconds == pytest.approx(want, rel=1e-12)


def test_groups_that_share_links_contend_and_slow_links_slow_them():
    torus = Torus((4,), wraparound=(False,))
    alone = group_collective_cost("all_to_all", torus, [(0, 2)], 4000, LINK)
    both = group_collective_cost("all_to_all", torus, [(0, 2), (1, 3)], 4000, LINK)
    assert both.link_bytes[(1, 2)] == 2 * alone.link_bytes[(1, 2)]
    assert both.seconds > alone.seconds
    slowed = group_collective_cost("all_to_all", torus, [(0, 2)], 4000, LINK,
                                   faults=LinkFaults(slowdowns={(1, 2): 4.0}))
    assert slowed.seconds > alone.seconds


def test_two_cores_of_a_chip_copy_on_chip():
    torus = Torus((2,), wraparound=(False,))
    groups = [(0, 1, 2, 3)]  # devices 0, 1 on chip 0; 2, 3 on chip 1
    cost = group_collective_cost("all_to_all", torus, groups, 4000, LINK, 4,
                                 devices_per_chip=2, on_chip_bytes_per_s=1e15)
    assert cost.link_bytes == {(0, 1): 4 * 1000 * 4, (1, 0): 4 * 1000 * 4}
