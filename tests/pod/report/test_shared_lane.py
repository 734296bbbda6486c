"""A DMA lane whose bandwidth the transfers in flight share (``pod.report.clock.SharedLane``):
closed forms of processor sharing, the bound of total bytes over bandwidth, and the two
paths' clocks that run their transfers on it (the HLO path's async copies, the built-in
path's host offload)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pod.programs.collectives import CollectiveCall
from pod.report.clock import DMA, HOST_IN, HOST_OUT, SharedLane, step_clock


@dataclass(frozen=True)
class Rec:
    seconds: float


def test_one_transfer_alone_takes_its_own_time():
    lane = SharedLane()
    a = lane.add(0.5, 2.0)
    assert (lane.start(a), lane.end(a)) == (0.5, 2.5)


def test_two_transfers_started_together_both_finish_at_twice_their_time():
    lane = SharedLane()
    a, b = lane.add(0.0, 1.0), lane.add(0.0, 1.0)
    assert lane.end(a) == lane.end(b) == 2.0


def test_a_small_transfer_under_a_large_one_takes_twice_its_time_and_delays_the_large():
    """256 MiB and 64 MiB at 32 GB/s, the small one issued 1 ms after the large (T5's
    offloads): the small one ends at 1 ms + 2 x its time; the large one at its own time
    plus the small one's (the link was shared while both were in flight)."""
    large, small = 256 * 2**20 / 32e9, 64 * 2**20 / 32e9
    lane = SharedLane()
    a = lane.add(0.0, large)
    b = lane.add(1e-3, small)
    assert lane.end(b) == pytest.approx(1e-3 + 2 * small, rel=1e-12)
    assert lane.end(a) == pytest.approx(large + small, rel=1e-12)
    # a queue would have run the small one after the large: large + small
    assert lane.end(b) < large


def test_a_transfer_started_after_another_ended_is_not_delayed_by_it():
    lane = SharedLane()
    a = lane.add(0.0, 1.0)
    b = lane.add(1.5, 1.0)
    assert (lane.end(a), lane.end(b)) == (1.0, 2.5)
    assert lane.last_end() == 2.5


def test_a_transfer_starting_before_the_lanes_time_is_refused():
    lane = SharedLane()
    lane.add(1.0, 1.0)
    with pytest.raises(ValueError, match="in order of their start"):
        lane.add(0.5, 1.0)
    with pytest.raises(ValueError, match=">= 0"):
        lane.add(2.0, -1.0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.0, 1e-2), min_size=1, max_size=10))
def test_transfers_started_together_end_where_the_closed_form_says(seconds):
    """Processor sharing from one start: sorted by size, the k-th (from 0) ends when the
    k smaller ones are done and it has had its 1/(n-k) share: sum(w[:k]) + (n-k) w[k]."""
    lane = SharedLane()
    handles = [lane.add(0.0, s) for s in seconds]
    order = sorted(range(len(seconds)), key=lambda i: seconds[i])
    w = [seconds[i] for i in order]
    n = len(w)
    for k, i in enumerate(order):
        assert lane.end(handles[i]) == pytest.approx(sum(w[:k]) + (n - k) * w[k], abs=1e-15)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0.0, 1e-2), st.floats(0.0, 1e-2)), min_size=1,
                max_size=10))
def test_total_bytes_over_bandwidth_bounds_the_makespan(transfers):
    """Every transfer takes at least its own time; the lane is work-conserving, so its
    last end is the same as a queue's (each starting when ready and the one before it is
    done), at least the first start plus every transfer's time (total bytes over the
    link's bandwidth) and at most the last start plus it."""
    transfers.sort()
    lane = SharedLane()
    handles = [lane.add(start, seconds) for start, seconds in transfers]
    total = sum(s for _, s in transfers)
    queue = 0.0
    for start, seconds in transfers:
        queue = max(queue, start) + seconds
    for h, (start, seconds) in zip(handles, transfers, strict=True):
        assert lane.end(h) >= start + seconds - 1e-15
    assert lane.last_end() == pytest.approx(queue, abs=1e-14)
    assert transfers[0][0] + total - 1e-14 <= lane.last_end() <= transfers[-1][0] + total + 1e-14


def _dma(tag: str, after: int, waited: int, nbytes: int = 0) -> CollectiveCall:
    return CollectiveCall("DMA host", DMA, nbytes, tag, "activation", after,
                          overlap_after=waited)


def test_the_hlo_paths_dmas_share_the_host_link_and_the_compute_waits_at_each_done():
    """The HLO path's offloads (op "dma", one lane): a 4 s transfer issued at 0 and a 1 s
    one at 1 s, each waited for at the end of the record after it. Shared, the small one
    ends at 1 + 2 = 3 s (inside its 3 s window: nothing exposed for it), the large one at
    4 + 1 = 5 s. A queue would have ended the small one at 5 s."""
    cost = {4: 4.0, 1: 1.0}
    records = [Rec(1.0), Rec(3.0), Rec(0.5)]
    calls = [_dma("large", 0, 3, nbytes=4), _dma("small", 1, 1, nbytes=1)]
    clock = step_clock(records, calls, lambda axis, op, nbytes: cost[nbytes])
    spans = {s.tag: s for s in clock.spans}
    assert (spans["small"].start, spans["small"].end) == (1.0, 3.0)
    assert (spans["large"].start, spans["large"].end) == (0.0, 5.0)
    # compute: 1 + 3 (the small one done at 3 < 4), then 0.5; the large one's done waits to 5
    assert clock.step_seconds == pytest.approx(5.0)
    assert clock.axis_exposed_seconds == {"DMA host": pytest.approx(0.5)}


def test_the_built_in_paths_reload_shares_the_link_with_an_offload_in_flight():
    """An offload of 4 s and then a reload of 1 s at the same point (``HOST_OUT``,
    ``HOST_IN``), 3 s of compute after: shared, the reload ends at 2 s (a queue: 5 s,
    behind the offload), the compute runs to 5 s and the offload ends there (4 + 1)."""
    kinds = [HOST_OUT, HOST_IN, "mxu"]
    records = [Rec(4.0), Rec(1.0), Rec(3.0)]
    clock = step_clock(records, [], lambda *a: 0.0, kinds=kinds)
    assert clock.step_seconds == pytest.approx(5.0)
    assert clock.exposed_host_seconds == pytest.approx(2.0)
    assert clock.host_seconds == pytest.approx(5.0)


def test_the_built_in_paths_next_reload_starts_once_the_compute_has_the_one_before():
    """Two reloads of 1 s with 0.5 s of compute after each: the second is prefetched when
    the compute has the first (at 1 s), not beside it, so the first is not slowed: the
    compute waits to 1 s, runs to 1.5 s, waits for the second to 2 s, ends at 2.5 s."""
    kinds = [HOST_IN, "mxu", HOST_IN, "mxu"]
    records = [Rec(1.0), Rec(0.5), Rec(1.0), Rec(0.5)]
    clock = step_clock(records, [], lambda *a: 0.0, kinds=kinds)
    assert clock.step_seconds == pytest.approx(2.5)
    assert clock.exposed_host_seconds == pytest.approx(1.5)


def test_the_built_in_paths_offloads_end_the_step_when_still_copying():
    """Two offloads of 1 s issued together share the link and end at 2 s; the compute
    (0.5 s) waits for them at the end of the step."""
    kinds = [HOST_OUT, HOST_OUT, "mxu"]
    records = [Rec(1.0), Rec(1.0), Rec(0.5)]
    clock = step_clock(records, [], lambda *a: 0.0, kinds=kinds)
    assert clock.step_seconds == pytest.approx(2.0)
    assert clock.exposed_host_seconds == pytest.approx(1.5)


def test_a_dma_call_of_another_kind_is_refused():
    call = CollectiveCall("DMA host", DMA, 1, "x", "param_gather", 0)
    with pytest.raises(ValueError, match="kind 'activation'"):
        step_clock([Rec(1.0)], [call], lambda *a: 1.0)


def test_the_hlo_trace_puts_overlapping_transfers_of_a_lane_on_tracks_of_their_own():
    """The HLO path's trace (``pod.hlo.report.trace_lanes``): the two transfers in flight
    together on "DMA host" go on two tracks, the one after them back on the first; a
    queue's spans (an ICI lane) stay on one track."""
    from pod.hlo.report import trace_lanes
    from pod.report.clock import CollectiveSpan

    def span(axis, start, end):
        return CollectiveSpan(axis, DMA, "activation", "x", 1, start, end)

    spans = [span("DMA host", 0.0, 5.0), span("DMA host", 1.0, 3.0), span("fsdp", 0.0, 1.0),
             span("fsdp", 1.0, 2.0), span("DMA host", 5.0, 6.0)]
    lanes, out = trace_lanes(["fsdp", "DMA host"], spans)
    assert lanes == ["fsdp", "DMA host", "DMA host (2)"]
    assert [s.axis for s in out] == ["DMA host", "DMA host (2)", "fsdp", "fsdp", "DMA host"]
    assert [(s.start, s.end) for s in out] == [(s.start, s.end) for s in spans]
