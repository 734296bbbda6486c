"""The all-to-all in closed form (``interconnect.all_to_all``): the same integer load on
every link as routing every pair of chips, so the same cost to the bit; on every torus
shape up to 256 chips (slow tier), and at 16,384 chips without a pair routed."""

from __future__ import annotations

import itertools
import tracemalloc
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from interconnect import (LinkFaults, LinkSpec, Torus, build_collective, collective_cost,
                          group_collective_cost, schedule_cost)
from interconnect import cost as cost_module
from interconnect import groups as groups_module
from interconnect.all_to_all import axis_route_counts, block_sets
from tests.interconnect.test_groups import tori_and_groups

LINK = LinkSpec(4.5e10, latency_s=1e-6, collective_fixed_s=2e-6)


def _routed_counts(members: np.ndarray, wraps: bool) -> tuple[np.ndarray, np.ndarray]:
    """The reference: every ordered pair routed by ``Torus.route`` on a 1-D torus,
    counted per link and direction (a step to coordinate + 1 is ``plus``)."""
    a = members.size
    torus = Torus((a,), wraps)
    plus, minus = np.zeros(a, np.int64), np.zeros(a, np.int64)
    held = np.flatnonzero(members)
    for s, t in itertools.permutations(held.tolist(), 2):
        for x, y in torus.route(s, t):
            forward = y == x + 1 or (y == 0 and x == a - 1 and a > 2)
            (plus if forward else minus)[x] += 1
    return plus, minus


@pytest.mark.parametrize("a", range(1, 19))
@pytest.mark.parametrize("wraps", [True, False])
def test_one_axis_counts_equal_routing_every_pair(a, wraps):
    rng = np.random.default_rng(a)
    for members in [np.ones(a, bool)] + [rng.random(a) < p for p in (0.3, 0.6, 0.9)]:
        got = axis_route_counts(members, wraps and a > 2)
        want = _routed_counts(members, wraps)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])


def group_all_to_all_cost(op, torus, groups, elements, link, itemsize, faults=None, *,
                          closed_form=False):
    """group_collective_cost's all-to-all; ``closed_form`` True: in closed form whenever the
    groups are blocks (``CLOSED_FORM_PAIRS`` 0), False: every pair routed (the engine)."""
    with mock.patch.object(groups_module, "CLOSED_FORM_PAIRS", 0 if closed_form else 1 << 62):
        return group_collective_cost(op, torus, groups, elements, link, itemsize, faults)


def _pairwise(torus: Torus, elements: int, itemsize: int = 2):
    n = torus.num_chips
    return group_all_to_all_cost("all_to_all", torus, [range(n)], elements, LINK, itemsize)


def _shapes(ndim: int, most: int) -> list[tuple[int, ...]]:
    """Every shape of ``ndim`` axes of at least 2 chips each, at most ``most`` chips."""
    if ndim == 0:
        return [()]
    return [(a, *rest) for a in range(2, most + 1) for rest in _shapes(ndim - 1, most // a)]


@pytest.mark.parametrize("shape", _shapes(1, 12) + _shapes(2, 24) + _shapes(3, 16))
def test_the_torus_all_to_all_is_the_pairwise_schedules_to_the_bit(shape):
    """Against the Transfer-by-Transfer schedule, every wraparound of each axis."""
    for wrap in itertools.product((True, False), repeat=len(shape)):
        torus = Torus(shape, wrap)
        n = torus.num_chips
        closed = collective_cost("all_to_all", torus, n * 3, LINK, itemsize=2)
        assert closed == schedule_cost(build_collective("all_to_all", torus, n * 3, 2), torus,
                                       LINK)


@pytest.mark.slow
@pytest.mark.parametrize("ndim", [1, 2, 3])
@pytest.mark.parametrize("wrap", [True, False])
def test_every_shape_up_to_256_chips_costs_what_routing_every_pair_costs(ndim, wrap):
    """2,715 shapes (1-D 2..256, 2-D and 3-D with at most 256 chips), with and without
    wraparound: the closed form equals the pairwise path (every message routed), whose
    equality with the Transfer schedule the hypothesis test of test_group_all_to_all
    keeps."""
    for shape in _shapes(ndim, 256):
        torus = Torus(shape, wrap)
        n = torus.num_chips
        assert collective_cost("all_to_all", torus, n * 5, LINK, itemsize=2) == \
            _pairwise(torus, n * 5), shape


@settings(max_examples=60, deadline=None)
@given(tg=tori_and_groups(), per_piece=st.integers(0, 9))
def test_groups_that_are_blocks_cost_the_same_in_closed_form(tg, per_piece):
    torus, groups = tg
    size = len(groups[0])
    if size < 2:
        return
    elements = size * per_piece
    closed = group_all_to_all_cost("all_to_all", torus, groups, elements, LINK, 2,
                                   closed_form=True)
    assert closed == group_all_to_all_cost("all_to_all", torus, groups, elements, LINK, 2)


@pytest.mark.parametrize("shape, wrap", [((4, 8), True), ((8, 8), False), ((4, 4, 4), True),
                                         ((16,), True), ((6, 4), (True, False))])
def test_strided_blocks_and_slowed_links(shape, wrap):
    """Groups that take every other coordinate of an axis (the outer part of a split
    mesh axis), with a slowed link: closed form == pairwise, and the groups are blocks."""
    torus = Torus(shape, wrap)
    coords = np.array(list(itertools.product(*map(range, shape))))
    key = coords % 2 @ (2 ** np.arange(len(shape)))                 # parity class per axis
    groups = [tuple(np.flatnonzero(key == k).tolist()) for k in range(2 ** len(shape))]
    faults = LinkFaults(slowdowns={(0, torus.neighbors(0)[0]): 3.0})
    assert all(block_sets(torus, g) is not None for g in groups)
    size = len(groups[0])
    for elements in (0, size, size * 7):
        closed = group_all_to_all_cost("all_to_all", torus, groups, elements, LINK, 4, faults,
                                       closed_form=True)
        assert closed == group_all_to_all_cost("all_to_all", torus, groups, elements, LINK, 4,
                                               faults)


@pytest.mark.parametrize("shape", [(1024,), (8, 8, 16),
                                   pytest.param((16384,), marks=pytest.mark.slow),
                                   pytest.param((16, 32, 32), marks=pytest.mark.slow)])
def test_16384_chips_route_no_pair_and_match_the_textbook_ring_load(shape, monkeypatch):
    """Issue 34: 16,384 chips took 11.8 GB and ended in a traceback. No pair is routed
    now (the pairwise router is replaced by a failure), the memory stays in megabytes,
    and the busiest link carries what a full ring's does: on a ring of ``a`` chips (a
    multiple of 4) a link carries ``(a/2 - 1) a/4 + a/4`` of the ordered pairs
    (``collectives.all_to_all``, der.), times the ``n / a`` rings of that axis."""
    def no_pairs(*args, **kwargs):
        raise AssertionError("a pair was routed")

    monkeypatch.setattr(cost_module, "_routes", no_pairs)
    torus = Torus(shape, True)
    n, piece = torus.num_chips, 6
    tracemalloc.start()
    cost = collective_cost("all_to_all", torus, n * piece // 2, LINK, itemsize=2)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 64 << 20
    ring = max(((a // 2 - 1) * a // 4 + a // 4) * (n // a) for a in shape)
    assert cost.max_link_bytes == ring * piece
