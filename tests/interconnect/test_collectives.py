"""Tests of interconnect.collectives and interconnect.execute.

The reference for every numeric result is numpy (np.sum, np.array_split);
the expected transfer pattern is written from the algorithm's definition.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from interconnect import (
    InterconnectError,
    Schedule,
    ScheduleError,
    Torus,
    Transfer,
    chain_schedules,
    chunk_bounds,
    execute,
    ring_all_gather,
    ring_allreduce,
    ring_reduce_scatter,
)


def revalidated(schedule):
    """Rebuilds a schedule through the public, checking constructor."""
    return Schedule(**{f.name: getattr(schedule, f.name) for f in dataclasses.fields(Schedule)})


def random_buffers(num_ranks, num_elements, seed, integers=False):
    rng = np.random.default_rng(seed)
    if integers:  # integer-valued floats: every summation order is exact
        return [rng.integers(-50, 50, size=num_elements).astype(np.float32) for _ in range(num_ranks)]
    return [rng.standard_normal(num_elements).astype(np.float32) for _ in range(num_ranks)]


# --------------------------------------------------------------- chunk_bounds


@pytest.mark.parametrize("num_elements", [0, 1, 2, 3, 7, 10, 64, 101])
@pytest.mark.parametrize("num_chunks", [1, 2, 3, 4, 7, 9])
def test_chunk_bounds_matches_array_split(num_elements, num_chunks):
    pieces = np.array_split(np.arange(num_elements), num_chunks)
    expected = []
    for piece in pieces:
        start = expected[-1][1] if expected else 0
        expected.append((start, start + len(piece)))
        if len(piece):
            assert piece[0] == start
    assert chunk_bounds(num_elements, num_chunks) == tuple(expected)


@pytest.mark.parametrize("args", [(-1, 2), (4, 0), (4, -3), (4.0, 2), (4, True)])
def test_chunk_bounds_rejects(args):
    with pytest.raises(ScheduleError):
        chunk_bounds(*args)


# ------------------------------------------------------- Transfer, Schedule


def test_transfer_fields_and_validation():
    t = Transfer(0, 1, 2, 16, True)
    assert (t.src, t.dst, t.chunk, t.nbytes, t.reduce) == (0, 1, 2, 16, True)
    with pytest.raises(AttributeError):
        t.src = 3  # type: ignore[misc]
    with pytest.raises(ScheduleError, match="equals dst"):
        Transfer(1, 1, 0, 4, True)
    with pytest.raises(ScheduleError, match="-1"):
        Transfer(-1, 1, 0, 4, True)
    with pytest.raises(ScheduleError, match="reduce 1"):
        Transfer(0, 1, 0, 4, 1)
    with pytest.raises(InterconnectError):
        Transfer(0, 1, 0, 4.5, False)


def test_schedule_validation():
    bounds = chunk_bounds(6, 2)  # (0, 3), (3, 6)
    ok = Schedule("x", 2, 6, 4, bounds, ((Transfer(0, 1, 0, 12, True),),))
    assert ok.num_phases == 1 and ok.num_transfers == 1 and ok.total_bytes == 12
    with pytest.raises(ScheduleError, match="rank outside"):
        Schedule("x", 2, 6, 4, bounds, ((Transfer(0, 2, 0, 12, True),),))
    with pytest.raises(ScheduleError, match="chunk 5"):
        Schedule("x", 2, 6, 4, bounds, ((Transfer(0, 1, 5, 12, True),),))
    with pytest.raises(ScheduleError, match="nbytes 8"):
        Schedule("x", 2, 6, 4, bounds, ((Transfer(0, 1, 0, 8, True),),))
    with pytest.raises(ScheduleError, match="Transfer objects"):
        Schedule("x", 2, 6, 4, bounds, (((0, 1, 0, 12, True),),))
    with pytest.raises(ScheduleError, match="num_ranks 0"):
        Schedule("x", 0, 6, 4, bounds, ())
    with pytest.raises(ScheduleError, match="chunk bound"):
        Schedule("x", 2, 6, 4, ((0, 7),), ())
    with pytest.raises(ScheduleError, match="itemsize 0"):
        Schedule("x", 2, 6, 0, bounds, ())


# ---------------------------------------------------------- ring structure


@pytest.mark.parametrize("n", [2, 3, 5, 8])
def test_ring_allreduce_follows_the_textbook_pattern(n):
    """Phase s of reduce-scatter: position i sends chunk (i - s) mod n to i + 1; then all-gather."""
    num_elements, itemsize = 10 * n + 3, 4
    schedule = ring_allreduce(Torus((n,)), num_elements, itemsize)
    sizes = [len(p) for p in np.array_split(np.arange(num_elements), n)]
    assert schedule.num_ranks == n and schedule.num_phases == 2 * (n - 1)
    for s in range(n - 1):
        expected_rs = {(i, (i + 1) % n, (i - s) % n, sizes[(i - s) % n] * itemsize, True) for i in range(n)}
        expected_ag = {(i, (i + 1) % n, (i + 1 - s) % n, sizes[(i + 1 - s) % n] * itemsize, False) for i in range(n)}
        assert {tuple(t)[:5] for t in schedule.phases[s]} == expected_rs
        assert {tuple(t)[:5] for t in schedule.phases[n - 1 + s]} == expected_ag
    assert revalidated(schedule) == schedule


def test_single_chip_has_no_phases():
    schedule = ring_allreduce(Torus((1,)), 10)
    assert schedule.phases == () and schedule.num_ranks == 1
    out = execute(schedule, [np.arange(10, dtype=np.float32)])
    np.testing.assert_array_equal(out[0], np.arange(10, dtype=np.float32))


def test_zero_byte_transfers_are_left_out():
    schedule = ring_allreduce(Torus((5,)), 2)
    assert schedule.num_phases == 8
    transfers = [t for phase in schedule.phases for t in phase]
    assert transfers and all(t.nbytes == 4 for t in transfers)
    # 2 non-empty chunks, each sent n-1 times in each half.
    assert len(transfers) == 2 * 2 * 4
    assert ring_allreduce(Torus((5,)), 0).num_transfers == 0


@pytest.mark.parametrize(
    "shape, wrap", [((4, 4), True), ((3, 3), False), ((2, 2, 2), True), ((3, 3, 3), False), ((7,), False)]
)
def test_transfers_are_neighbours_or_routed(shape, wrap):
    t = Torus(shape, wrap)
    links = set(t.links())
    order = t.ring_order()
    schedule = ring_allreduce(t, 100)
    for phase in schedule.phases:
        for tr in phase:
            path = t.route(tr.src, tr.dst)
            assert path and all(hop in links for hop in path)
            assert order.index(tr.dst) == (order.index(tr.src) + 1) % t.num_chips


@pytest.mark.parametrize("shape", [(8,), (4, 4), (2, 2, 2), (4, 4, 4)])
def test_transfers_on_full_torus_use_single_links(shape):
    t = Torus(shape)
    assert all(t.has_link(tr.src, tr.dst) for phase in ring_allreduce(t, 1000).phases for tr in phase)


def test_chain_requires_matching_schedules():
    a = ring_reduce_scatter(Torus((4,)), 10)
    with pytest.raises(ScheduleError, match="cannot chain"):
        chain_schedules("bad", a, ring_all_gather(Torus((4,)), 11))
    with pytest.raises(ScheduleError):
        chain_schedules("empty")


def test_builders_reject_bad_arguments():
    with pytest.raises(ScheduleError, match="num_elements -1"):
        ring_allreduce(Torus((4,)), -1)
    with pytest.raises(ScheduleError, match="itemsize 0"):
        ring_allreduce(Torus((4,)), 8, itemsize=0)
    with pytest.raises(ScheduleError, match="topology"):
        ring_allreduce("4x4", 8)


def test_build_1024_ring_quickly():
    start = time.process_time()  # CPU time: wall time on the shared 2-core machines swings 10x with load
    schedule = ring_reduce_scatter(Torus((1024,)), 1 << 20)
    elapsed = time.process_time() - start
    assert schedule.num_transfers == 1024 * 1023
    assert elapsed < 3.0  # about 0.3-0.7 s; generous for busy CI


# ------------------------------------------------------------------ execute


def test_execute_reads_sources_at_phase_start():
    # In one phase ranks 0 and 1 swap chunk 0 by copy: both must see the old values.
    bounds = chunk_bounds(2, 1)
    phase = (Transfer(0, 1, 0, 8, False), Transfer(1, 0, 0, 8, False))
    schedule = Schedule("swap", 2, 2, 4, bounds, (phase,))
    a, b = np.array([1, 2], np.float32), np.array([3, 4], np.float32)
    out = execute(schedule, [a, b])
    np.testing.assert_array_equal(out[0], [3, 4])
    np.testing.assert_array_equal(out[1], [1, 2])
    np.testing.assert_array_equal(a, [1, 2])  # inputs untouched


def test_execute_reduce_adds():
    bounds = chunk_bounds(4, 2)
    schedule = Schedule("r", 2, 4, 4, bounds, ((Transfer(0, 1, 1, 8, True),),))
    out = execute(schedule, [np.array([1, 2, 3, 4], np.float32), np.array([10, 20, 30, 40], np.float32)])
    np.testing.assert_array_equal(out[1], [10, 20, 33, 44])
    np.testing.assert_array_equal(out[0], [1, 2, 3, 4])


def test_execute_rejects_bad_buffers():
    schedule = ring_allreduce(Torus((3,)), 6)
    with pytest.raises(ScheduleError, match="2 buffers"):
        execute(schedule, [np.zeros(6)] * 2)
    with pytest.raises(ScheduleError, match="5 elements"):
        execute(schedule, [np.zeros(6), np.zeros(5), np.zeros(6)])
    with pytest.raises(ScheduleError, match="dtype"):
        execute(schedule, [np.zeros(6), np.zeros(6, np.float32), np.zeros(6)])


@pytest.mark.parametrize("n", range(1, 10))
@pytest.mark.parametrize("num_elements", [0, 1, 5, 17, 64])
def test_ring_allreduce_sums_on_rings(n, num_elements):
    buffers = random_buffers(n, num_elements, seed=n * 100 + num_elements, integers=True)
    originals = [b.copy() for b in buffers]
    out = execute(ring_allreduce(Torus((n,)), num_elements), buffers)
    expected = np.sum(np.stack(buffers), axis=0, dtype=np.float64)
    for rank in range(n):
        assert out[rank].dtype == np.float32 and out[rank].shape == (num_elements,)
        np.testing.assert_array_equal(out[rank], expected)
        np.testing.assert_array_equal(buffers[rank], originals[rank])


@pytest.mark.parametrize(
    "shape, wrap", [((2, 2), True), ((4, 4), True), ((3, 3), False), ((2, 2, 2), True), ((3, 2, 3), False)]
)
def test_ring_allreduce_sums_on_tori_bit_identical(shape, wrap):
    t = Torus(shape, wrap)
    buffers = random_buffers(t.num_chips, 103, seed=7)
    out = execute(ring_allreduce(t, 103), buffers)
    expected = np.sum(np.stack(buffers).astype(np.float64), axis=0)
    for rank in range(t.num_chips):
        assert out[rank].dtype == np.float32
        np.testing.assert_allclose(out[rank], expected, rtol=1e-5, atol=1e-5)
        assert out[rank].tobytes() == out[0].tobytes()  # every rank bit-identical


def test_execute_keeps_shape():
    t = Torus((2, 2))
    buffers = [np.full((3, 4), r, np.float32) for r in range(4)]
    out = execute(ring_allreduce(t, 12), buffers)
    for o in out:
        assert o.shape == (3, 4)
        np.testing.assert_array_equal(o, np.full((3, 4), 6, np.float32))


@st.composite
def tori(draw):
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    wrap = tuple(draw(st.booleans()) for _ in shape)
    return Torus(shape, wrap)


@given(tori(), st.integers(0, 40), st.integers(0, 2**32 - 1))
@settings(max_examples=120, deadline=None)
def test_ring_allreduce_property(t, num_elements, seed):
    n = t.num_chips
    buffers = random_buffers(n, num_elements, seed, integers=True)
    schedule = ring_allreduce(t, num_elements)
    assert revalidated(schedule) == schedule
    assert schedule.num_phases == 2 * (n - 1)
    out = execute(schedule, buffers)
    expected = np.sum(np.stack(buffers), axis=0, dtype=np.float64)
    links = set(t.links())
    for phase in schedule.phases:
        for tr in phase:
            assert tr.nbytes > 0
            assert all(hop in links for hop in t.route(tr.src, tr.dst))
    for rank in range(n):
        np.testing.assert_array_equal(out[rank], expected)
        assert out[rank].tobytes() == out[0].tobytes()


@pytest.mark.parametrize("n", [2, 3, 6])
def test_reduce_scatter_leaves_owned_chunk_summed(n):
    t = Torus((n,))
    buffers = random_buffers(n, 4 * n + 1, seed=n, integers=True)
    out = execute(ring_reduce_scatter(t, 4 * n + 1), buffers)
    total = np.sum(np.stack(buffers), axis=0)
    pieces = np.array_split(np.arange(4 * n + 1), n)
    for position, rank in enumerate(t.ring_order()):
        owned = pieces[(position + 1) % n]
        np.testing.assert_array_equal(out[rank][owned], total[owned])


def test_schedule_pickles():
    import pickle

    schedule = ring_allreduce(Torus((2, 2)), 10)
    again = pickle.loads(pickle.dumps(schedule))
    assert again == schedule
    assert isinstance(again.phases[0][0], Transfer)
    assert pickle.loads(pickle.dumps(Torus((4, 4), (True, False)))) == Torus((4, 4), (True, False))
