"""Tests of the "xla" group collectives: every torus axis of a group's block at once.

References: numpy sums per group (integer-valued floats, so every order is
exact) through the pure executor; the torus's own links for every routed
hop; the schedule path (``schedule_cost`` of the concurrent schedule) for the
fast path; and the textbook closed forms of [SB] (sharding.md, "multi-axis
torus"; tpu-specs.md "Textbook collective costs"), V bytes per device, W one
way per link, n devices over m equal axes:

- reduce-scatter or all-gather with wraparound: (n-1)/n x V / (W_bidi x m),
  W_bidi = 2 W, plus T_min x sum(|X_i|)/2 (one hop of latency per phase,
  floor(a/2) phases per axis of size a);
- without wraparound (lines): twice that bandwidth term, a - 1 phases per axis;
- allreduce: twice the reduce-scatter.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from interconnect import (LinkFaults, LinkSpec, ScheduleError, Torus, calibrated_link,
                          concurrent_group_schedule, execute, group_collective_cost,
                          group_torus_schedule, schedule_cost)

OPS = ["allreduce", "reduce_scatter", "all_gather"]
PASSES = {"allreduce": 2, "reduce_scatter": 1, "all_gather": 1}
BF16 = 2


def block_groups(torus: Torus, split: tuple[int, ...], take: tuple[str, ...]):
    """Groups of a mesh axis laid as pod.config.mesh lays one: per torus axis of size A
    split into an outer block of A / s (stride s) and an inner block of s (contiguous),
    the group takes nothing, the inner block, the outer block or the whole axis.

    Returns:
        (groups, group torus): each group's ranks in row-major order of the group
        torus (one axis per block taken, torus axis 0 first); a block wraps when it
        spans a whole axis that wraps (the whole axis, or the outer block).
    """
    sizes, wraps = [], []
    for axis, (size, s, part) in enumerate(zip(torus.shape, split, take)):
        if part == "whole":
            sizes.append(size), wraps.append(torus.wraparound[axis])
        elif part == "inner":
            sizes.append(s), wraps.append(False)
        elif part == "outer":
            sizes.append(size // s), wraps.append(torus.wraparound[axis])
    found: dict[tuple[int, ...], dict[int, int]] = {}
    for rank in range(torus.num_chips):
        local, key = 0, []
        for c, size, s, part in zip(torus.coords(rank), torus.shape, split, take):
            index, k, width = {"whole": (c, 0, size), "inner": (c % s, c // s, s),
                               "outer": (c // s, c % s, size // s), "none": (0, c, 1)}[part]
            local = local * width + index
            key.append(k)
        found.setdefault(tuple(key), {})[local] = rank
    groups = [tuple(g[i] for i in range(len(g))) for _, g in sorted(found.items())]
    return groups, Torus(tuple(sizes) or (1,), tuple(wraps) or (False,))


@st.composite
def placements(draw, max_chips=32):
    """A small torus and one mesh axis's groups laid on a block of it."""
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.sampled_from([1, 2, 3, 4, 6])) for _ in range(ndim))
    if math.prod(shape) > max_chips:
        shape = shape[:1]
    torus = Torus(shape, wraparound=tuple(draw(st.booleans()) for _ in shape))
    split = tuple(draw(st.sampled_from([d for d in range(1, a + 1) if a % d == 0])) for a in shape)
    take = tuple(draw(st.sampled_from(["none", "inner", "outer", "whole"])) for _ in shape)
    groups, group_torus = block_groups(torus, split, take)
    return torus, groups, group_torus


# ------------------------------------------------------------------ the schedules


@settings(max_examples=80, deadline=None)
@given(p=placements(), op=st.sampled_from(OPS), per_rank=st.integers(0, 7),
       seed=st.integers(0, 2**16))
def test_every_group_ends_with_its_own_result_over_real_links(p, op, per_rank, seed):
    torus, groups, group_torus = p
    size = len(groups[0])
    elements = size * per_rank + per_rank % 3  # uneven splits too
    schedule = concurrent_group_schedule(op, groups, torus.num_chips, elements,
                                         algorithm="torus", group_torus=group_torus)
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
    if size > 1 and op != "allreduce":  # a group's devices own disjoint chunks covering the buffer
        owned = sorted(bounds[schedule.owned_chunks[r]] for r in groups[0])
        assert owned[0][0] == 0 and owned[-1][1] == elements
        assert all(x[1] == y[0] for x, y in zip(owned, owned[1:]))
    links = set(torus.links())
    for phase in schedule.phases:
        for t in phase:
            assert any(t.src in g and t.dst in g for g in groups), "a transfer left its group"
            hops = torus.route(t.src, t.dst)
            assert hops and all(h in links for h in hops)


def test_the_local_schedule_passes_the_schedule_checks():
    from interconnect import Schedule

    local = group_torus_schedule("allreduce", Torus((2, 3), (False, True)), 37, BF16)
    checked = Schedule(**{f: getattr(local, f) for f in ("name", "num_ranks", "num_elements",
                                                         "itemsize", "chunk_bounds", "phases",
                                                         "op", "owned_chunks", "root")})
    assert checked.num_transfers == local.num_transfers > 0


@settings(max_examples=100, deadline=None)
@given(p=placements(), op=st.sampled_from(OPS), elements=st.integers(0, 60), slow=st.booleans(),
       streams=st.sampled_from([math.inf, 1.0, 2.5]))
def test_fast_path_equals_the_schedule_path(p, op, elements, slow, streams):
    """group_collective_cost (the phases built as arrays) = schedule_cost of the
    concurrent schedule (its Transfers):
    seconds, phases, bytes per link, with a slowed link, uneven parts, fewer DMA
    streams than links driven."""
    torus, groups, group_torus = p
    if len(groups[0]) <= 1:
        return
    link = LinkSpec(1e9, latency_s=1e-6, collective_fixed_s=2e-6, multi_link_exponent=0.3,
                    dma_streams=streams)
    faults = None
    if slow and torus.num_chips > 1:
        faults = LinkFaults(slowdowns={(0, torus.neighbors(0)[0]): 3.0})
    schedule = concurrent_group_schedule(op, groups, torus.num_chips, elements, BF16,
                                         algorithm="torus", group_torus=group_torus)
    reference = schedule_cost(schedule, torus, link, faults)
    fast = group_collective_cost(op, torus, groups, elements, link, BF16, faults,
                                 algorithm="torus", group_torus=group_torus)
    assert fast.seconds == pytest.approx(reference.seconds, rel=1e-12, abs=1e-18)
    assert fast.phase_seconds == pytest.approx(reference.phase_seconds, rel=1e-12, abs=1e-18)
    assert fast.link_bytes == reference.link_bytes
    assert fast.busiest_link_seconds == pytest.approx(reference.busiest_link_seconds, rel=1e-12)


def test_failed_links_take_the_schedule_path_around_them():
    torus = Torus((4,), wraparound=(True,))
    link = LinkSpec(1e9, latency_s=0.0)
    healthy = group_collective_cost("all_gather", torus, [(0, 1, 2, 3)], 4000, link, BF16,
                                    algorithm="torus", group_torus=torus)
    cut = group_collective_cost("all_gather", torus, [(0, 1, 2, 3)], 4000, link, BF16,
                                LinkFaults(failed={(0, 1), (1, 0)}), algorithm="torus",
                                group_torus=torus)
    assert (0, 1) not in cut.link_bytes and cut.seconds > healthy.seconds


# ------------------------------------------------------------------ closed forms


def _one_group(shape, wrap, op, elements, link):
    torus = Torus(shape, wrap)
    return group_collective_cost(op, torus, [tuple(range(torus.num_chips))], elements, link,
                                 BF16, algorithm="torus", group_torus=torus)


@pytest.mark.parametrize("shape", [(3,), (4,), (5,), (8,), (4, 4), (3, 3), (5, 5), (4, 4, 4),
                                   (3, 3, 3)])
@pytest.mark.parametrize("op", OPS)
def test_axes_with_wraparound_cost_the_textbook(shape, op):
    """(n-1)/n x V / (W_bidi x m) plus floor(a/2) hops per axis, per pass."""
    w, latency, fixed = 4.5e10, 1e-6, 3e-6
    n, m = math.prod(shape), len(shape)
    elements = n * n * m * 6  # splits evenly at every level
    v = elements * BF16
    cost = _one_group(shape, True, op, elements, LinkSpec(w, latency, collective_fixed_s=fixed))
    half = (n - 1) / n * v / (2 * w * m) + sum(a // 2 for a in shape) * latency
    assert cost.seconds == pytest.approx(PASSES[op] * half + fixed, rel=1e-9)


@pytest.mark.parametrize("shape", [(2,), (3,), (4,), (8,), (2, 2), (4, 4), (3, 3), (2, 2, 2),
                                   (4, 4, 4)])
@pytest.mark.parametrize("op", OPS)
def test_axes_without_wraparound_take_twice_the_bandwidth_term(shape, op):
    """[SB]: without wraparound about twice as long: (n-1)/n x V / (W x m), a - 1 phases
    per axis of a line."""
    w, latency = 4.5e10, 1e-6
    n, m = math.prod(shape), len(shape)
    elements = n * n * m * 6
    v = elements * BF16
    cost = _one_group(shape, False, op, elements, LinkSpec(w, latency))
    half = (n - 1) / n * v / (w * m) + sum(a - 1 for a in shape) * latency
    assert cost.seconds == pytest.approx(PASSES[op] * half, rel=1e-9)


def test_more_axes_divide_the_bandwidth_term():
    """The same 64 devices as a ring of 64, a 8x8 and a 4x4x4 torus: bandwidth terms
    in the ratio 1 : 1/2 : 1/3 ([SB] V / (W_bidi x axes))."""
    link = LinkSpec(1e9, latency_s=0.0)
    elements = 64 * 64 * 6
    one, two, three = (_one_group(s, True, "all_gather", elements, link).seconds
                       for s in ((64,), (8, 8), (4, 4, 4)))
    assert two == pytest.approx(one / 2) and three == pytest.approx(one / 3)


def test_interleaved_strided_groups_share_their_links():
    """fsdp on the outer block of a ring of 8 (stride 2: {0,2,4,6} and {1,3,5,7}): each
    step is 2 hops and every link carries both groups: twice the bandwidth term of one
    ring of 4, 2 hops of latency per phase."""
    torus = Torus((8,), wraparound=(True,))
    groups, group_torus = block_groups(torus, (2,), ("outer",))
    assert groups == [(0, 2, 4, 6), (1, 3, 5, 7)] and group_torus == Torus((4,), (True,))
    w, latency = 1e9, 1e-6
    elements = 4 * 1000
    cost = group_collective_cost("reduce_scatter", torus, groups, elements,
                                 LinkSpec(w, latency), BF16, algorithm="torus",
                                 group_torus=group_torus)
    v = elements * BF16
    assert cost.seconds == pytest.approx(2 * 3 / 4 * v / (2 * w) + 2 * 2 * latency, rel=1e-12)
    alone = group_collective_cost("reduce_scatter", torus, groups[:1], elements,
                                  LinkSpec(w, latency), BF16, algorithm="torus",
                                  group_torus=group_torus)
    assert set(cost.link_bytes.values()) == {2 * b for b in set(alone.link_bytes.values())}


def test_the_v4_cube_all_gather_of_8_mib_in_bf16():
    """Issue 23: 8 MiB gathered over a v4 4x4x4 (64 devices), bf16. [SB]: V / (W_bidi x 3)
    = 31.07 us; the model adds 6 phases of 1 us; on the calibrated link the achieved
    rate and the fixed cost (interconnect.calibration)."""
    w = 4.5e10
    v = 8 << 20
    ideal = _one_group((4, 4, 4), True, "all_gather", v // BF16, LinkSpec(w, 1e-6))
    book = v / (2 * w * 3)
    assert book == pytest.approx(31.07e-6, rel=1e-3)
    # 4 Mi elements over 3 parts and 64 owners do not split evenly: within one element
    assert ideal.seconds == pytest.approx(63 / 64 * book + 6e-6, rel=1e-4)
    link = calibrated_link("v4", w)
    calibrated = _one_group((4, 4, 4), True, "all_gather", v // BF16, link)
    want = 63 / 64 * book / link.achieved_bandwidth_bytes_per_s(6) * w + 6e-6 + link.collective_fixed_s
    assert calibrated.seconds == pytest.approx(want, rel=1e-4)


def test_the_ring_model_is_kept_beside_it():
    """algorithm="ring" (the default of group_collective_cost): one unidirectional ring,
    (n-1)/n x V / W; "xla" on the same ring of 8 is the bidirectional ring, half of it."""
    torus = Torus((8,), wraparound=(True,))
    link = LinkSpec(1e9, latency_s=0.0)
    ring = group_collective_cost("all_gather", torus, [tuple(range(8))], 8000, link, BF16)
    xla = group_collective_cost("all_gather", torus, [tuple(range(8))], 8000, link, BF16,
                                algorithm="torus", group_torus=torus)
    assert ring.seconds == pytest.approx(7 / 8 * 16000 / 1e9)
    assert xla.seconds == pytest.approx(ring.seconds / 2)


# ------------------------------------------- DMA streams and devices per chip


@pytest.mark.parametrize("streams, factor", [(math.inf, 1.0), (6, 1.0), (3, 2.0), (1, 6.0)])
def test_dma_streams_share_the_links_a_chip_drives(streams, factor):
    """A 4x4x4 all-gather drives the six links of every chip in every phase: with S DMA
    streams each link runs at min(1, S / 6) of its rate."""
    torus = Torus((4, 4, 4))
    elements = 64 * 64 * 3 * 6
    full = _one_group((4, 4, 4), True, "all_gather", elements, LinkSpec(1e9, 0.0))
    shared = _one_group((4, 4, 4), True, "all_gather", elements,
                        LinkSpec(1e9, 0.0, dma_streams=streams))
    assert shared.seconds == pytest.approx(factor * full.seconds, rel=1e-12)
    assert torus.num_chips == 64


def test_one_stream_makes_the_bidirectional_ring_cost_the_unidirectional_one():
    """Both directions of a ring on one DMA stream: no faster than one ring."""
    torus = Torus((8,), wraparound=(True,))
    one = group_collective_cost("reduce_scatter", torus, [tuple(range(8))], 8 * 8 * 100,
                                LinkSpec(1e9, 0.0, dma_streams=1), BF16, algorithm="torus",
                                group_torus=torus)
    ring = group_collective_cost("reduce_scatter", torus, [tuple(range(8))], 8 * 8 * 100,
                                 LinkSpec(1e9, 0.0), BF16)
    assert one.seconds == pytest.approx(ring.seconds, rel=1e-12)


@pytest.mark.parametrize("op", OPS)
def test_the_two_tensorcores_of_a_chip_copy_at_the_on_chip_bandwidth(op):
    """A block on the two cores of each chip (v2 / v3): no ICI byte, each pass one phase
    of half the buffer at the on-chip bandwidth, plus the fixed cost."""
    torus = Torus((2, 2))
    groups = [(2 * c, 2 * c + 1) for c in range(4)]
    cost = group_collective_cost(op, torus, groups, 1000, LinkSpec(1e9, 1e-6, collective_fixed_s=3e-6),
                                 BF16, devices_per_chip=2, on_chip_bytes_per_s=4e11,
                                 algorithm="torus", group_torus=Torus((2,), (False,)))
    assert not cost.link_bytes
    assert cost.seconds == pytest.approx(3e-6 + PASSES[op] * 500 * BF16 / 4e11, rel=1e-12)


@pytest.mark.parametrize("op", OPS)
def test_the_groups_of_both_cores_share_their_chips_links(op):
    """Core 0's group and core 1's over the same 2x2 chips load every link twice: one
    group of chips moving twice the bytes."""
    torus = Torus((2, 2))
    gt = Torus((2, 2), False)
    both = group_collective_cost(op, torus, [(0, 2, 4, 6), (1, 3, 5, 7)], 4 * 600, LinkSpec(1e9),
                                 BF16, devices_per_chip=2, on_chip_bytes_per_s=1e12,
                                 algorithm="torus", group_torus=gt)
    chips = group_collective_cost(op, torus, [(0, 1, 2, 3)], 8 * 600, LinkSpec(1e9), BF16,
                                  algorithm="torus", group_torus=gt)
    assert both.seconds == pytest.approx(chips.seconds, rel=1e-12)
    assert both.link_bytes == chips.link_bytes


def test_a_block_over_cores_and_chips_takes_the_slower_of_each_phase():
    """Devices 0, 1 (chip 0) and 2, 3 (chip 1), a 2x2 group torus (chips x cores): every
    phase of the reduce-scatter runs its on-chip copies beside its ICI sends."""
    torus = Torus((2,), wraparound=(False,))
    gt = Torus((2, 2), False)
    link = LinkSpec(1e9, latency_s=1e-6)
    slow_chip = group_collective_cost("reduce_scatter", torus, [(0, 1, 2, 3)], 4000, link, BF16,
                                      devices_per_chip=2, on_chip_bytes_per_s=1e6,
                                      algorithm="torus", group_torus=gt)
    fast_chip = group_collective_cost("reduce_scatter", torus, [(0, 1, 2, 3)], 4000, link, BF16,
                                      devices_per_chip=2, on_chip_bytes_per_s=1e15,
                                      algorithm="torus", group_torus=gt)
    # two parts, each owner's 1000 elements cut in two: phase 0 sends 1000 elements of one
    # part between the chips and 1000 of the other between the cores; phase 1, 500 each
    assert slow_chip.seconds == pytest.approx((1000 + 500) * BF16 / 1e6, rel=1e-9)
    assert fast_chip.link_bytes == slow_chip.link_bytes and fast_chip.seconds < 1e-5


def test_bad_group_tori_and_algorithms_are_refused():
    torus = Torus((2, 2))
    with pytest.raises(ScheduleError, match="group_torus 2x2 has 4 ranks but the groups have 2"):
        group_collective_cost("allreduce", torus, [(0, 1), (2, 3)], 8, LinkSpec(1e9),
                              algorithm="torus", group_torus=Torus((2, 2)))
    with pytest.raises(ScheduleError, match="expected one of torus, bidirectional_ring, ring"):
        group_collective_cost("allreduce", torus, [(0, 1), (2, 3)], 8, LinkSpec(1e9),
                              algorithm="spanning_tree")
    with pytest.raises(ScheduleError, match="expected an interconnect.Torus"):
        concurrent_group_schedule("allreduce", [(0, 1)], 4, 8, algorithm="torus", group_torus=(2,))
