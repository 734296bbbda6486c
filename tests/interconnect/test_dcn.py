"""Tests of interconnect.dcn: a ring collective across slices over the data-centre network.

Reference: the ring textbook forms (tpu-specs.md, "Textbook collective costs"): over a
ring of K members each sends (K-1)/K of its buffer in a reduce-scatter or an all-gather,
twice that in an allreduce, one message per ring step; and a ring executed step by step
in numpy, counting what each member sends.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from interconnect import ScheduleError, dcn_collective_bytes, dcn_collective_seconds

V5E_DCN_BYTES_PER_S = 3.1e9     # tpu-specs.md [SB]: per chip across slices, v5e
V5P_DCN_BYTES_PER_S = 6.25e9    # the same, v5p
LATENCY_S = 2e-5                # chip.spec.DCN_LATENCY_S: an assumption, no published figure


def ring_allreduce_sent_bytes(k: int, nbytes: int) -> tuple[int, np.ndarray]:
    """A ring allreduce over k members, run in numpy piece by piece: (bytes member 0
    sent, the reduced buffers), each member's buffer its index + 1 in every element."""
    pieces = [np.array_split(np.full(nbytes, i + 1.0), k) for i in range(k)]
    sent = 0
    for phase in range(2):                       # reduce-scatter, then all-gather
        for step in range(k - 1):
            outgoing = [pieces[i][(i - step + phase) % k].copy() for i in range(k)]
            sent += outgoing[0].size
            for i in range(k):
                j = (i + 1) % k
                piece = (i - step + phase) % k
                pieces[j][piece] = (pieces[j][piece] + outgoing[i] if phase == 0
                                    else outgoing[i])
    return sent, np.array([np.concatenate(p) for p in pieces])


@pytest.mark.parametrize("k", [2, 3, 4, 7])
def test_the_bytes_a_member_sends_are_what_a_ring_executed_in_numpy_sends(k):
    nbytes = 4 * 7 * 11
    sent, result = ring_allreduce_sent_bytes(k, nbytes)
    assert np.all(result == k * (k + 1) / 2)     # the ring really allreduced
    assert dcn_collective_bytes("allreduce", k, nbytes) == pytest.approx(sent, abs=k)
    assert dcn_collective_bytes("reduce_scatter", k, nbytes) == pytest.approx(sent / 2, abs=k)
    assert dcn_collective_bytes("all_gather", k, nbytes) == pytest.approx(sent / 2, abs=k)


@settings(max_examples=60, deadline=None)
@given(k=st.integers(2, 256), nbytes=st.integers(1, 2**34),
       op=st.sampled_from(["allreduce", "reduce_scatter", "all_gather"]),
       bandwidth=st.sampled_from([V5E_DCN_BYTES_PER_S, V5P_DCN_BYTES_PER_S]),
       senders=st.sampled_from([1, 2]))
def test_seconds_are_the_ring_closed_form(k, nbytes, op, bandwidth, senders):
    rounds = 2 if op == "allreduce" else 1
    want = (senders * rounds * (k - 1) / k * nbytes / bandwidth
            + rounds * (k - 1) * LATENCY_S)
    got = dcn_collective_seconds(op, k, nbytes, bandwidth, LATENCY_S, senders_per_chip=senders)
    assert got == pytest.approx(want, rel=1e-12)


def test_a_published_figure_by_hand():
    """A 1 GiB allreduce over 2 v5e slices: each chip sends half its buffer twice (1 GiB)
    at 3.1e9 B/s, about 0.346 s, plus two DCN messages."""
    got = dcn_collective_seconds("allreduce", 2, 2**30, V5E_DCN_BYTES_PER_S, LATENCY_S)
    assert got == pytest.approx(2**30 / 3.1e9 + 2 * 2e-5, rel=1e-12)
    assert 0.346 < got < 0.347


def test_one_slice_or_nothing_costs_nothing():
    assert dcn_collective_seconds("allreduce", 1, 2**20, 3.1e9, LATENCY_S) == 0.0
    assert dcn_collective_bytes("all_gather", 4, 0) == 0.0


@pytest.mark.parametrize("call, match", [
    (lambda: dcn_collective_seconds("ppermute", 2, 8, 3.1e9, 0.0), "ppermute.*allowed: allreduce"),
    (lambda: dcn_collective_bytes("all_to_all", 2, 8), "all_to_all.*allowed"),
    (lambda: dcn_collective_seconds("allreduce", 2, 8, 0.0, 0.0), "bandwidth 0.0"),
])
def test_bad_arguments_are_one_line_errors(call, match):
    with pytest.raises(ScheduleError, match=match):
        call()
