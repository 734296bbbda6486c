"""The one cost engine (interconnect.cost.price) against a reference written here: a plain
loop over a schedule's Transfers, each routed with Torus.route (or faults.route), link
loads summed in a dict, the phase formula of interconnect/cost.py's docstring applied
as written. Before the engine (commit fa9ad92) the six fast paths it replaced were
compared with it to the bit on a broader set (tests/interconnect/
test_engine_vs_fast_paths.py there: every op and algorithm on 12 tori, groups on 8
tori with 1 and 2 devices per chip, slowed and failed links).

Also: each array builder emits the phases of the Schedule it stands for; the registry
is one table; mesh axes choose from it.
"""

from __future__ import annotations

import random
from collections import defaultdict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from interconnect import (ALGORITHMS, FAST_PATHS, MESH_ALGORITHMS, REGISTRY, LinkFaults,
                          LinkSpec, ScheduleError, Torus, build_collective, collective_cost,
                          collective_phases, concurrent_group_schedule, group_collective_cost,
                          price, route, schedule_cost)
from interconnect.groups import group_ppermute_cost, group_ppermute_schedule

LINK = LinkSpec(1e9, latency_s=1e-6, collective_fixed_s=2e-6, multi_link_exponent=0.3,
                multi_link_cap=2.0, dma_streams=2.5)


def reference_cost(schedule, torus: Torus, link: LinkSpec, faults: LinkFaults | None = None,
                   devices_per_chip: int = 1, on_chip_bytes_per_s: float | None = None):
    """(seconds, phase seconds, link bytes) of ``schedule`` (ranks are devices, device d on
    chip d // devices_per_chip), by the formula, one Transfer at a time."""
    faults = faults or LinkFaults()
    phases, totals = [], defaultdict(int)
    for phase in schedule.phases:
        loads, copies, hops = defaultdict(int), defaultdict(int), 0
        for t in phase:
            if not t.nbytes:
                continue
            a, b = t.src // devices_per_chip, t.dst // devices_per_chip
            if a == b:
                copies[t.src] += t.nbytes
                continue
            path = route(torus, a, b, faults=faults)
            hops = max(hops, len(path))
            for hop in path:
                loads[hop] += t.nbytes
        seconds = 0.0
        if loads:
            busiest = max(n * faults.slowdown(h) for h, n in loads.items())
            driven = max(sum(1 for (s, _) in loads if s == chip) for chip, _ in loads)
            seconds = busiest / link.achieved_bandwidth_bytes_per_s(driven) + link.latency_s * hops
        if copies:
            seconds = max(seconds, max(copies.values()) / on_chip_bytes_per_s)
        for hop, n in loads.items():
            totals[hop] += n
        phases.append(seconds)
    fixed = link.collective_fixed_s if torus.num_chips >= 2 else 0.0
    return fixed + sum(phases), tuple(phases), dict(totals)


def _check(cost, reference) -> None:
    seconds, phases, link_bytes = reference
    assert cost.link_bytes == link_bytes
    assert cost.phase_seconds == pytest.approx(phases, rel=1e-12, abs=1e-18)
    assert cost.seconds == pytest.approx(seconds, rel=1e-12)


@st.composite
def tori(draw):
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.sampled_from([1, 2, 3, 4])) for _ in range(ndim))
    return Torus(shape, tuple(draw(st.booleans()) for _ in range(ndim)))


@settings(max_examples=120, deadline=None)
@given(torus=tori(), key=st.sampled_from(sorted(REGISTRY)), per_rank=st.integers(0, 9),
       slow=st.booleans(), cut=st.booleans())
def test_every_registered_collective_costs_the_formula(torus, key, per_rank, slow, cut):
    """Any (op, algorithm) on any small torus, with a slowed or a failed link: the engine
    (through collective_cost's array builders, and through schedule_cost of the Transfer
    schedule) equals the reference loop."""
    op, algorithm = key
    n = torus.num_chips
    elements = n * per_rank if op == "all_to_all" else per_rank * 3 + 1
    links = list(torus.links())
    faults = None
    if links and slow:
        faults = LinkFaults(slowdowns={links[0]: 3.0})
    if len(links) > 4 and cut:
        faults = LinkFaults(failed=frozenset({links[-1]}))
    schedule = build_collective(op, torus, elements, 2, algorithm)
    try:
        reference = reference_cost(schedule, torus, LINK, faults)
    except ValueError:  # failed links that cut a route the collective needs
        with pytest.raises(ValueError, match="no route"):
            collective_cost(op, torus, elements, LINK, algorithm=algorithm, itemsize=2,
                            faults=faults)
        return
    _check(collective_cost(op, torus, elements, LINK, algorithm=algorithm, itemsize=2,
                           faults=faults), reference)
    _check(schedule_cost(schedule, torus, LINK, faults), reference)


@settings(max_examples=100, deadline=None)
@given(torus=tori(), per_chip=st.sampled_from([1, 2]), op=st.sampled_from(
    ["allreduce", "reduce_scatter", "all_gather", "all_to_all"]),
    algorithm=st.sampled_from(MESH_ALGORITHMS + ("halving_doubling", "tree")),
    per_rank=st.integers(0, 6), seed=st.integers(0, 2**16), slow=st.booleans())
def test_every_group_collective_costs_the_formula(torus, per_chip, op, algorithm, per_rank,
                                                  seed, slow):
    """Every group of a partition of the devices (random order, 1 or 2 devices per chip)
    at once, by any algorithm: the engine equals the reference on the concurrent
    schedule, on-chip copies included."""
    if op != "allreduce" and algorithm in ("halving_doubling", "tree"):
        return
    devices = torus.num_chips * per_chip
    rng = random.Random(seed)
    size = rng.choice([d for d in range(1, devices + 1) if devices % d == 0])
    order = list(range(devices))
    rng.shuffle(order)
    groups = [tuple(order[i:i + size]) for i in range(0, devices, size)]
    elements = size * per_rank
    links = list(torus.links())
    faults = LinkFaults(slowdowns={links[0]: 2.0}) if slow and links else None
    bandwidth = 3e9 if per_chip > 1 else None
    cost = group_collective_cost(op, torus, groups, elements, LINK, 2, faults,
                                 devices_per_chip=per_chip, on_chip_bytes_per_s=bandwidth,
                                 algorithm=algorithm)
    if size == 1:
        assert cost.seconds == 0.0 and not cost.link_bytes
        return
    schedule = concurrent_group_schedule(op, groups, devices, elements, 2, algorithm=algorithm)
    _check(cost, reference_cost(schedule, torus, LINK, faults, per_chip, bandwidth))


@settings(max_examples=60, deadline=None)
@given(torus=tori(), per_chip=st.sampled_from([1, 2]), shift=st.integers(-3, 3),
       seed=st.integers(0, 2**16))
def test_every_group_permute_costs_the_formula(torus, per_chip, shift, seed):
    devices = torus.num_chips * per_chip
    rng = random.Random(seed)
    size = rng.choice([d for d in range(1, devices + 1) if devices % d == 0])
    order = list(range(devices))
    rng.shuffle(order)
    groups = [tuple(order[i:i + size]) for i in range(0, devices, size)]
    cost = group_ppermute_cost(torus, groups, 10, LINK, 2, shift=shift,
                               devices_per_chip=per_chip, on_chip_bytes_per_s=3e9)
    schedule = group_ppermute_schedule(groups, devices, 10, 2, shift)
    if not schedule.phases:  # nothing moves: not even the fixed cost
        assert cost.seconds == 0.0
        return
    _check(cost, reference_cost(schedule, torus, LINK, None, per_chip, 3e9))


@pytest.mark.parametrize("key", sorted(FAST_PATHS))
@pytest.mark.parametrize("shape,wrap", [((5,), (True,)), ((6,), (False,)), ((3, 4), (True, False)),
                                        ((2, 2, 4), (True, True, True))])
def test_each_array_builder_emits_its_schedules_phases(key, shape, wrap):
    """The array builders (no Transfer per message) are the Schedules they stand for:
    per phase, the same bytes between the same pairs."""
    op, algorithm = key
    torus = Torus(shape, wrap)
    for elements in (0, 1, 7, 5 * torus.num_chips):
        if op == "all_to_all" and elements % torus.num_chips:
            continue
        arrays = collective_phases(op, torus, elements, 2, algorithm)
        transfers = collective_phases(op, torus, elements, 2, algorithm, arrays=False)
        assert arrays.canonical() == transfers.canonical()


def test_the_registry_is_one_table():
    """Every op's algorithms come from the registry (first = default); mesh axes choose
    among the ones every reduction has."""
    assert ALGORITHMS["allreduce"][0] == "torus"
    assert set(REGISTRY) == {(op, a) for op, names in ALGORITHMS.items() for a in names}
    assert MESH_ALGORITHMS == ("torus", "bidirectional_ring", "ring")
    assert FAST_PATHS >= {(op, a) for op in ("allreduce", "reduce_scatter", "all_gather")
                          for a in MESH_ALGORITHMS}
    with pytest.raises(ScheduleError, match="expected one of torus, bidirectional_ring, ring"):
        collective_cost("reduce_scatter", Torus((4,)), 8, LINK, algorithm="tree")


def test_price_refuses_members_of_another_width_and_copies_without_a_bandwidth():
    phases = collective_phases("allreduce", Torus((2,), (True,)), 8, 2, "ring")
    with pytest.raises(ScheduleError, match="do not fit phases over 2 ranks"):
        price(phases, Torus((4,)), LINK, members=np.array([[0, 1, 2]]))
    with pytest.raises(ScheduleError, match="on_chip_bytes_per_s None"):
        price(phases, Torus((2,)), LINK, members=np.array([[0, 1]]), devices_per_chip=2)
