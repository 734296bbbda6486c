"""Every collective algorithm: results against numpy, routes, wire bytes, textbook costs.

References: numpy sums / copies for results; closed-form costs from
../shared/reference/tpu-specs.md ("Textbook collective costs": ring
2 (n-1)/n V/W, bidirectional ring half of it) and, where the reference gives
none, formulas derived in each builder's docstring (der.).
"""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from interconnect import LinkSpec, Schedule, ScheduleError, TopologyError, Torus, execute
from interconnect.collectives import ALGORITHMS, build_collective
from interconnect.cost import collective_cost, schedule_cost
from interconnect.faults import LinkFailureError, LinkFaults, route

GIB = 1 << 30


def revalidated(schedule):
    return Schedule(**{f.name: getattr(schedule, f.name) for f in dataclasses.fields(Schedule)})


def check_result(schedule, buffers, rng):
    """Asserts the schedule did its op on ``buffers`` (integer-valued floats: exact)."""
    n, size = schedule.num_ranks, schedule.num_elements
    total = np.sum(np.stack(buffers), axis=0)
    if schedule.op == "allreduce":
        for out in execute(schedule, buffers):
            np.testing.assert_array_equal(out, total)
    elif schedule.op == "reduce_scatter":
        covered = np.zeros(size, dtype=int)
        for rank, out in enumerate(execute(schedule, buffers)):
            start, stop = schedule.chunk_bounds[schedule.owned_chunks[rank]]
            covered[start:stop] += 1
            np.testing.assert_array_equal(out[start:stop], total[start:stop])
        assert (covered == 1).all()  # the owned chunks partition the buffer
    elif schedule.op == "all_gather":
        full = rng.integers(-9, 9, size).astype(np.float32)
        inputs = []
        for rank in range(n):
            x = np.full(size, np.nan, dtype=np.float32)  # only the owned chunk is valid
            start, stop = schedule.chunk_bounds[schedule.owned_chunks[rank]]
            x[start:stop] = full[start:stop]
            inputs.append(x)
        for out in execute(schedule, inputs):
            np.testing.assert_array_equal(out, full)
    elif schedule.op == "broadcast":
        for out in execute(schedule, buffers):
            np.testing.assert_array_equal(out, buffers[schedule.root])
    elif schedule.op == "all_to_all":
        m = size // n
        outs = execute(schedule, buffers)
        for j in range(n):
            for r in range(n):
                np.testing.assert_array_equal(outs[j][r * m:(r + 1) * m], buffers[r][j * m:(j + 1) * m])


tori = st.builds(
    Torus,
    st.lists(st.integers(1, 4), min_size=1, max_size=3).map(tuple),
    st.booleans(),
)
op_algorithms = [(op, algorithm) for op, algorithms in ALGORITHMS.items() for algorithm in algorithms]


@settings(max_examples=60, deadline=None)
@given(t=tori, pair=st.sampled_from(op_algorithms), extra=st.integers(0, 40), seed=st.integers(0, 99))
def test_every_algorithm_property(t, pair, extra, seed):
    """Random tori up to 3-D, sizes not divisible by n: right result, real links, costed bytes."""
    op, algorithm = pair
    n = t.num_chips
    size = n * extra if op == "all_to_all" else extra * 3 + 1  # 3k+1: rarely a multiple of n
    schedule = revalidated(build_collective(op, t, size, 4, algorithm))
    rng = np.random.default_rng(seed)
    buffers = [rng.integers(-50, 50, size).astype(np.float32) for _ in range(n)]
    check_result(schedule, buffers, rng)
    hops_bytes = 0
    for phase in schedule.phases:
        for tr in phase:
            path = t.route(tr.src, tr.dst)
            assert path and all(t.has_link(a, b) for a, b in path)
            assert path[0][0] == tr.src and path[-1][1] == tr.dst
            hops_bytes += tr.nbytes * len(path)
    cost = schedule_cost(schedule, t, LinkSpec(1e9))
    assert sum(cost.link_bytes.values()) == hops_bytes
    assert all(t.has_link(*hop) for hop in cost.link_bytes)


@pytest.mark.parametrize("shape", [(3,), (4, 4), (2, 3, 2), (3, 3, 3)])
@pytest.mark.parametrize("wrap", [True, False])
@pytest.mark.parametrize("size", [0, 1, 5, 103, 4096])
@pytest.mark.parametrize("op", ["allreduce", "reduce_scatter", "all_gather"])
@pytest.mark.parametrize("algorithm", ["ring", "bidirectional_ring", "torus"])
def test_fast_cost_equals_the_schedule_cost(shape, wrap, size, op, algorithm):
    t = Torus(shape, wrap)
    link = LinkSpec(4.5e10, 1e-6)
    faults = LinkFaults({t.links()[1]: 2.5})
    for f in (None, faults):
        fast = collective_cost(op, t, size, link, algorithm=algorithm, faults=f)
        ref = collective_cost(op, t, size, link, algorithm=algorithm, faults=f, fast=False)
        assert fast.phase_seconds == pytest.approx(ref.phase_seconds, rel=1e-12, abs=1e-18)
        assert fast.link_bytes == ref.link_bytes
        assert fast.busiest_link_seconds == pytest.approx(ref.busiest_link_seconds, rel=1e-12)


def test_v5p_full_pod_torus_allreduce_costs_in_under_a_second():
    t = Torus((16, 20, 28), True)  # 8,960 chips, the largest v5p pod [GC-v5p]
    start = time.perf_counter()
    cost = collective_cost("allreduce", t, 1 << 28, LinkSpec(9e10), algorithm="torus")
    assert time.perf_counter() - start < 1.0
    # axes add, each on V already shrunk: sum_i 2 (a_i - 1)/a_i x V_i / (2 W), V_i = V / prod(a_<i),
    # plus 1 us per phase of one hop
    volume, expected = 4 << 28, 0.0
    for a in (16, 20, 28):
        expected += (a - 1) / a * volume / 9e10 + 2 * (a - 1) * 1e-6
        volume /= a
    assert cost.seconds == pytest.approx(expected, rel=0.01)


# ------------------------------------------------------------ textbook costs

N = 8
V = GIB  # bytes per chip: bandwidth-bound


def textbook_seconds(op, algorithm, n, volume, w):
    """Closed forms on a full (wraparound) 1-D ring of n chips, bandwidth term only."""
    log2n = math.ceil(math.log2(n))
    half = (n - 1) / n * volume / w  # tpu-specs.md: unidirectional ring RS or AG
    return {
        ("allreduce", "ring"): 2 * half,
        ("allreduce", "bidirectional_ring"): half,
        ("allreduce", "torus"): half,  # on a 1-D ring the torus algorithm is the bidirectional ring
        ("allreduce", "halving_doubling"): log2n * volume / w,  # der., halving_doubling_allreduce
        ("allreduce", "tree"): 2 * log2n * volume / w,  # der., tree_allreduce
        ("reduce_scatter", "ring"): half,
        ("reduce_scatter", "bidirectional_ring"): half / 2,
        ("reduce_scatter", "torus"): half / 2,
        ("all_gather", "ring"): half,
        ("all_gather", "bidirectional_ring"): half / 2,
        ("all_gather", "torus"): half / 2,
        ("broadcast", "pipelined_ring"): 2 * half,
        ("broadcast", "tree"): log2n * volume / w,
        # der.: a link carries the chunks of every route of length 1..n/2 crossing it
        ("all_to_all", "direct"): (n // 2) * (n // 2 + 1) / 2 * volume / n / w,
    }[(op, algorithm)]


@pytest.mark.parametrize("op, algorithm", op_algorithms)
def test_every_algorithm_matches_its_formula_on_a_full_ring(op, algorithm):
    t, w = Torus((N,)), 4.5e10
    cost = collective_cost(op, t, V // 4, LinkSpec(w, latency_s=1e-6), algorithm=algorithm)
    assert cost.seconds == pytest.approx(textbook_seconds(op, algorithm, N, V, w), rel=0.01)


@pytest.mark.parametrize("algorithm", ["bidirectional_ring", "torus"])
def test_no_wraparound_takes_about_twice_as_long(algorithm):
    link = LinkSpec(4.5e10)
    ring = collective_cost("allreduce", Torus((16,), True), V // 4, link, algorithm=algorithm).seconds
    line = collective_cost("allreduce", Torus((16,), False), V // 4, link, algorithm=algorithm).seconds
    assert line / ring == pytest.approx(2.0, rel=0.05)
    torus = collective_cost("allreduce", Torus((16, 16), True), V // 4, link).seconds
    mesh = collective_cost("allreduce", Torus((16, 16), False), V // 4, link).seconds
    assert mesh / torus == pytest.approx(2.0, rel=0.05)


@pytest.mark.parametrize("size", [1 << 10, 1 << 20, 1 << 28])
def test_2d_torus_beats_a_1d_ring_of_the_same_chips(size):
    link = LinkSpec(4.5e10)
    torus = collective_cost("allreduce", Torus((4, 4)), size, link, algorithm="torus").seconds
    ring = collective_cost("allreduce", Torus((16,)), size, link, algorithm="ring").seconds
    assert torus < ring


def test_small_messages_are_latency_bound():
    link = LinkSpec(4.5e10, latency_s=1e-6)
    cost = collective_cost("allreduce", Torus((4, 4)), 16, link, algorithm="torus")
    # 2 x (3 + 3) phases of one hop: the bytes are negligible
    assert cost.seconds == pytest.approx(12e-6, rel=0.01)


# ------------------------------------------------------------------- faults


def test_slowed_link_slows_the_phases_that_use_it():
    t, link = Torus((8,)), LinkSpec(1e9, latency_s=0.0)
    healthy = collective_cost("allreduce", t, 8000, link, algorithm="ring").seconds
    slowed = collective_cost("allreduce", t, 8000, link, algorithm="ring",
                             faults=LinkFaults({"0->1": 2.0})).seconds
    assert slowed == pytest.approx(2 * healthy)
    # the other direction is not used by a unidirectional ring
    assert collective_cost("allreduce", t, 8000, link, algorithm="ring",
                           faults=LinkFaults({"1->0": 2.0})).seconds == pytest.approx(healthy)


def test_failed_link_is_routed_around():
    t, link = Torus((4, 4)), LinkSpec(1e9, latency_s=1e-6)
    faults = LinkFaults(failed={(0, 1)})
    assert route(t, 0, 1, faults) == [(0, 3), (3, 2), (2, 1)]
    cost = collective_cost("allreduce", t, 4000, link, algorithm="torus", faults=faults)
    assert (0, 1) not in cost.link_bytes
    healthy = collective_cost("allreduce", t, 4000, link, algorithm="torus")
    assert cost.seconds > healthy.seconds


def test_failed_links_that_cut_the_pod_are_a_clear_error():
    line = Torus((4,), False)
    with pytest.raises(LinkFailureError, match=r"no route from chip \d+ to chip \d+ on torus 4 avoids the failed links \(1->2, 2->1\)"):
        collective_cost("allreduce", line, 400, LinkSpec(1e9), algorithm="ring",
                        faults=LinkFaults(failed={(1, 2), (2, 1)}))


@pytest.mark.parametrize("faults, needle", [
    (lambda: LinkFaults({"0->5": 2.0}), "0->5 is not a link of torus 4x4"),
    (lambda: LinkFaults({"0->1": 0.5}), "slowdown 0.5"),
    (lambda: LinkFaults({"0-1": 2.0}), "'src->dst'"),
])
def test_bad_faults_are_named(faults, needle):
    with pytest.raises(TopologyError, match=needle):
        collective_cost("allreduce", Torus((4, 4)), 400, LinkSpec(1e9), faults=faults())


def test_unknown_algorithm_lists_the_choices():
    with pytest.raises(ScheduleError, match="ring, halving_doubling, tree"):
        build_collective("allreduce", Torus((4,)), 8, algorithm="butterfly")
    with pytest.raises(ScheduleError, match="multiple of the 4 ranks"):
        build_collective("all_to_all", Torus((4,)), 10)
