"""The cost engine (interconnect.cost.price over PairPhases) against the code it replaces:
the Transfer-by-Transfer schedule_cost and the six hand-vectorised fast paths
(collective_cost's ring and axis paths, group_collective_cost's ring, torus and
all-to-all paths, group_ppermute_cost), on a broad set of tori, groups, devices per
chip, sizes and link faults. Every figure must be the same to the bit; the two known
differences are asserted as such:

- a zero-byte group all-to-all has no phase (as the whole-torus schedule has none),
  where the old fast path had one phase of 0 s: the seconds are equal;
- the old whole-torus axis fast path lost link 0's bytes in the all-gather when a
  torus mixes ring and line axes (its reverse-link table sent every missing link to
  id 0); the engine agrees with schedule_cost there, the old fast path does not.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from interconnect import LinkFaults, ScheduleCost, Torus, calibrated_link
from interconnect.cost import _old_collective_cost as collective_cost
from interconnect.cost import _old_schedule_cost as schedule_cost
from interconnect.cost import price
from interconnect.groups import _old_group_collective_cost as group_collective_cost
from interconnect.groups import _old_group_ppermute_cost as group_ppermute_cost
import interconnect
from interconnect.phases import ppermute_phases
from interconnect.registry import ALGORITHMS, build_collective, check_algorithm, collective_phases
from interconnect.topology import link_of_id


def _figures(cost: ScheduleCost) -> tuple:
    return (cost.seconds, cost.phase_seconds, cost.link_bytes, cost.busiest_link_seconds,
            cost.fixed_seconds)


TORI = [((2,), (True,)), ((3,), (True,)), ((5,), (True,)), ((8,), (True,)), ((6,), (False,)),
        ((2, 2), (True, True)), ((2, 4), (False, False)), ((3, 4), (True, False)),
        ((4, 4), (True, True)), ((1, 5), (True, True)), ((2, 3, 4), (True, True, False)),
        ((4, 4, 4), (True, True, True))]


def _fault_sets(torus: Torus) -> list[LinkFaults | None]:
    links = list(torus.links())
    out: list[LinkFaults | None] = [None, LinkFaults(slowdowns={links[0]: 2.5})]
    if len(links) > 4 and torus.num_chips > 2:
        out.append(LinkFaults(failed=frozenset({links[1]})))
    return out


pytestmark = pytest.mark.slow  # about a minute: every collective of every torus, old and new


@pytest.mark.parametrize("shape,wrap", TORI)
def test_every_whole_torus_collective_costs_what_schedule_cost_gave(shape, wrap):
    link = calibrated_link("v5p", 9e10)
    torus = Torus(shape, wrap)
    for faults in _fault_sets(torus):
        for op, algorithms in ALGORITHMS.items():
            for algorithm in algorithms:
                for elements in (0, 1, 7, 3 * torus.num_chips, 1000):
                    if op == "all_to_all" and elements % torus.num_chips:
                        continue
                    try:
                        old = schedule_cost(build_collective(op, torus, elements, 2, algorithm),
                                            torus, link, faults)
                    except ValueError:  # a failed link that cuts a needed route: both refuse
                        with pytest.raises(ValueError):
                            price(collective_phases(op, torus, elements, 2, algorithm), torus,
                                  link, faults)
                        continue
                    new = price(collective_phases(op, torus, elements, 2, algorithm), torus,
                                link, faults)
                    public = interconnect.collective_cost(op, torus, elements, link,
                                                          algorithm=algorithm, itemsize=2,
                                                          faults=faults)
                    assert _figures(public) == _figures(new)
                    assert _figures(interconnect.schedule_cost(
                        build_collective(op, torus, elements, 2, algorithm), torus, link,
                        faults)) == _figures(new)
                    assert _figures(new) == _figures(old), (op, algorithm, elements, faults)
                    if op in ("allreduce", "reduce_scatter", "all_gather"):
                        fast = collective_cost(op, torus, elements, link, algorithm=algorithm,
                                               itemsize=2, faults=faults)
                        lost_link_0 = (fast.link_bytes != old.link_bytes and algorithm == "torus"
                                       and op != "reduce_scatter" and len(set(wrap)) == 2)
                        if lost_link_0:  # link id 0: chip 0's -1 neighbour on axis 0
                            src, dst = (int(v[0]) for v in link_of_id(torus, np.array([0])))
                            assert fast.link_bytes.get((src, dst), 0) < old.link_bytes[(src, dst)]
                            assert ({k: v for k, v in fast.link_bytes.items() if k != (src, dst)}
                                    == {k: v for k, v in old.link_bytes.items()
                                        if k != (src, dst)})
                        else:
                            assert _figures(fast) == _figures(new), (op, algorithm, elements)


def _groups(ndev: int, size: int, order: str, rng: random.Random) -> list[tuple[int, ...]]:
    devices = list(range(ndev))
    if order == "shuffle":
        rng.shuffle(devices)
    if order == "strided":
        return [tuple(devices[i::ndev // size]) for i in range(ndev // size)]
    return [tuple(devices[i:i + size]) for i in range(0, ndev, size)]


def _new_group_cost(op, torus, groups, elements, link, faults, dpc, bandwidth, algorithm,
                    group_torus) -> ScheduleCost:
    """What group_collective_cost becomes: the registry's phases on the group's local torus,
    priced over every group."""
    if all(len(g) <= 1 for g in groups):
        return ScheduleCost(seconds=0.0, phase_seconds=(), link_bytes={})
    size = len(groups[0])
    name = "direct" if op == "all_to_all" else {"xla": "torus"}.get(algorithm, algorithm)
    local = (group_torus if name == "torus" and group_torus is not None
             else Torus((size,), (True,)))
    phases = check_algorithm(op, name).build_phases(local, elements, 2)
    return price(phases, torus, link, faults, members=np.asarray(groups), devices_per_chip=dpc,
                 on_chip_bytes_per_s=bandwidth)


GROUP_TORI = [((4,), (True,)), ((6,), (False,)), ((2, 4), (False, False)), ((4, 4), (True, True)),
              ((3, 4), (True, False)), ((2, 2, 4), (True, True, True)),
              ((2, 3, 2), (False, True, False)), ((4, 4, 4), (True, True, True))]


@pytest.mark.parametrize("shape,wrap", GROUP_TORI)
@pytest.mark.parametrize("dpc", [1, 2])
def test_every_group_collective_costs_what_the_fast_paths_gave(shape, wrap, dpc):
    link = calibrated_link("v5e", 4.5e10)
    rng = random.Random(hash((shape, dpc)) & 0xFFFF)
    torus = Torus(shape, wrap)
    ndev = torus.num_chips * dpc
    bandwidth = 1e11 if dpc > 1 else None
    faults_sets = _fault_sets(torus) if dpc == 1 else [None, LinkFaults(
        slowdowns={list(torus.links())[-1]: 3.0})]
    for size in [d for d in range(2, ndev + 1) if ndev % d == 0][:4]:
        for order in ("block", "shuffle", "strided"):
            groups = _groups(ndev, size, order, rng)
            for faults in faults_sets:
                for algorithm in ("ring", "xla"):
                    group_torus = Torus((size,), (True,)) if algorithm == "xla" else None
                    if algorithm == "xla" and size % 2 == 0 and size > 2 and order == "block":
                        group_torus = Torus((2, size // 2), (False, True))
                    for op in ("allreduce", "reduce_scatter", "all_gather", "all_to_all"):
                        for elements in (0, 7, size, 5 * size, 1000 * size):
                            if op == "all_to_all" and elements % size:
                                continue
                            args = (op, torus, groups, elements, link, faults, dpc, bandwidth,
                                    algorithm, group_torus)
                            try:
                                old = group_collective_cost(
                                    op, torus, groups, elements, link, 2, faults,
                                    devices_per_chip=dpc, on_chip_bytes_per_s=bandwidth,
                                    algorithm=algorithm, group_torus=group_torus)
                            except ValueError:  # a cut route: both refuse
                                with pytest.raises(ValueError):
                                    _new_group_cost(*args)
                                continue
                            new = _new_group_cost(*args)
                            public = interconnect.group_collective_cost(
                                op, torus, groups, elements, link, 2, faults,
                                devices_per_chip=dpc, on_chip_bytes_per_s=bandwidth,
                                algorithm=algorithm, group_torus=group_torus)
                            assert _figures(public) == _figures(new)
                            if op == "all_to_all" and elements == 0:
                                assert old.phase_seconds in ((0.0,), ()) and new.phase_seconds == ()
                                assert old.seconds == new.seconds
                                continue
                            assert _figures(new) == _figures(old), (size, order, faults,
                                                                    algorithm, op, elements)
                for shift in (1, -1, 2):
                    for elements in (0, 10):
                        phases = ppermute_phases(Torus((size,), (True,)), elements, 2, shift)
                        try:
                            old = group_ppermute_cost(torus, groups, elements, link, 2, faults,
                                                      shift=shift, devices_per_chip=dpc,
                                                      on_chip_bytes_per_s=bandwidth)
                        except ValueError:
                            with pytest.raises(ValueError):
                                price(phases, torus, link, faults, members=np.asarray(groups))
                            continue
                        new = (price(phases, torus, link, faults, members=np.asarray(groups),
                                     devices_per_chip=dpc, on_chip_bytes_per_s=bandwidth)
                               if phases.num_phases
                               else ScheduleCost(seconds=0.0, phase_seconds=(), link_bytes={}))
                        assert _figures(new) == _figures(old), ("ppermute", size, order, shift)
                        assert _figures(interconnect.group_ppermute_cost(
                            torus, groups, elements, link, 2, faults, shift=shift,
                            devices_per_chip=dpc, on_chip_bytes_per_s=bandwidth)) == _figures(new)
