"""Collectives across slices over the data-centre network (DCN), in closed form.

A multislice job joins identical slices by the data-centre network: each TPU
host's network interfaces, shared by its chips, carry what crosses slices
([SB] "How to Scale Your Model": about 6.25e9 B/s per chip on v5p, 3.1e9 on
v5e, an order of magnitude below one ICI link). XLA keeps a collective over a
mesh axis that spans slices hierarchical (MaxText's multislice: the DCN part of
an axis is its outermost factor): inside each slice over the ICI first, so
that only each device's shard crosses the DCN, then across slices, then
inside the slice again (``pod.config.sharding.MeshCollectiveCosts``).

Across K slices each device's part goes round a ring of K (one device per
slice: the same position in every slice); the bytes a chip sends leave
through its share of the host's interfaces, so a chip whose devices all take
part (the two TensorCores of v2 / v3) sends for each of them. Per message one
DCN latency; no contention model beyond the per-chip share (the DCN is a
switched network, not a torus).

The per-step cost of going multislice (issue 29): the slices meet once per
step, at the cross-slice reduction of the gradients, and each slice's step
varies a little from step to step (its hosts' input pipelines, the chips'
power management, the runtime); a job of K slices runs every step at its
slowest slice's pace. With each slice's step spread as a normal variable of
standard deviation ``jitter x step`` (independent across slices), the job waits
``jitter x step x E[max of K standard normals]`` a step on average beyond one
slice's mean step (:func:`slice_wait_seconds`): 0.564 of a standard deviation
for 2 slices, 1.424 for 8. The published multislice runs show it: 2.6% (M1,
2 x v5e-256) and 2.8% (M2, 2 x v5p-128) per-device drops, 6.8% at 8 slices
(M3, 8 x v4-128), a ratio of 2.5 where E[max] gives 2.52, while their DCN
bandwidth terms differ by 4x and are hidden behind the backward pass. The
jitter is fitted on M1-M3 with the step clock
(``interconnect.calibration.SLICE_STEP_JITTER``).
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from interconnect.errors import ScheduleError

__all__ = ["DCN_OPS", "dcn_collective_bytes", "dcn_collective_seconds",
           "expected_max_standard_normal", "slice_wait_seconds"]

#: Operations a DCN collective can be (as ``interconnect.GROUP_OPS``).
DCN_OPS = ("allreduce", "reduce_scatter", "all_gather")


def _check_op(op: str) -> None:
    if op not in DCN_OPS:
        raise ScheduleError(f"DCN collective {op!r} is unknown; allowed: {', '.join(DCN_OPS)}")


def dcn_collective_bytes(op: str, slices: int, nbytes: float) -> float:
    """Bytes one device sends across the DCN in a ring collective over ``slices`` slices.

    Args:
        op: allreduce, reduce_scatter or all_gather.
        slices: K, the slices the group spans (one device in each).
        nbytes: the device's whole buffer, bytes (an all-gather's gathered result).

    Returns:
        ``2 (K-1)/K x nbytes`` for an allreduce (a reduce-scatter then an
        all-gather round the ring), ``(K-1)/K x nbytes`` for a reduce-scatter or
        an all-gather (the ring textbook forms, tpu-specs.md); 0 for one slice.

    Raises:
        ScheduleError: an unknown op.
    """
    _check_op(op)
    k = int(slices)
    if k <= 1 or nbytes <= 0:
        return 0.0
    rounds = 2 if op == "allreduce" else 1
    return rounds * (k - 1) / k * float(nbytes)


def dcn_collective_seconds(op: str, slices: int, nbytes: float, bytes_per_s: float,
                           latency_s: float, *, senders_per_chip: int = 1) -> float:
    """Simulated seconds of a ring collective over ``slices`` slices, across the DCN.

    Args:
        op: allreduce, reduce_scatter or all_gather.
        slices: K, the slices the group spans (one device in each).
        nbytes: each device's whole buffer, bytes (an all-gather's gathered result).
        bytes_per_s: DCN bandwidth per chip, one direction.
        latency_s: one message across the DCN.
        senders_per_chip: devices of one chip in such groups at once (2 on v2 / v3),
            sharing the chip's bandwidth.

    Returns:
        ``senders x V / bytes_per_s + messages x latency_s``, with V = 2 (K-1)/K
        nbytes and 2 (K-1) messages for an allreduce, (K-1)/K nbytes and K-1
        messages for a reduce-scatter or all-gather (the ring textbook forms,
        tpu-specs.md); 0 for one slice.

    Raises:
        ScheduleError: an unknown op, or a bandwidth that is not positive.
    """
    _check_op(op)
    if not bytes_per_s > 0:
        raise ScheduleError(f"DCN bandwidth {bytes_per_s!r} is not a positive number of bytes/s")
    k = int(slices)
    if k <= 1 or nbytes <= 0:
        return 0.0
    rounds = 2 if op == "allreduce" else 1
    volume = dcn_collective_bytes(op, k, nbytes)
    return senders_per_chip * volume / bytes_per_s + rounds * (k - 1) * latency_s


@lru_cache(maxsize=64)
def expected_max_standard_normal(n: int) -> float:
    """E[max of ``n`` independent standard normal variables], by quadrature.

    ``integral of x n phi(x) Phi(x)^(n-1) dx`` on a grid of 0.001 over [-12, 12]
    (phi, Phi: the standard normal density and distribution, Phi by the
    error function): 0 for n = 1, 1/sqrt(pi) = 0.5642 for 2, 1.4236 for 8 (the
    textbook order statistics), to 1e-6.

    Raises:
        ScheduleError: ``n`` is not an integer >= 1.
    """
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ScheduleError(f"slices {n!r} is not valid: expected an integer >= 1")
    if n == 1:
        return 0.0
    x = np.linspace(-12.0, 12.0, 24001)
    pdf = np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
    cdf = 0.5 * (1.0 + np.array([math.erf(v / math.sqrt(2.0)) for v in x]))
    integrand = x * n * pdf * cdf ** (n - 1)
    return float(np.sum((integrand[1:] + integrand[:-1]) * np.diff(x)) / 2.0)


def slice_wait_seconds(step_seconds: float, slices: int, jitter: float) -> float:
    """What a job of ``slices`` slices waits a step for its slowest slice, seconds.

    ``jitter x step_seconds x expected_max_standard_normal(slices)`` (the module
    docstring): each slice's step varies with standard deviation ``jitter x
    step_seconds``, independently, and the slices meet once a step.

    Args:
        step_seconds: one slice's step, seconds (>= 0).
        slices: slices of the job (1: no wait).
        jitter: the spread of one slice's step as a fraction of it (>= 0;
            ``interconnect.calibration.SLICE_STEP_JITTER``).

    Raises:
        ScheduleError: a bad slice count, or a negative step or jitter.
    """
    if not step_seconds >= 0 or not jitter >= 0:
        raise ScheduleError(f"slice wait of a step of {step_seconds!r} s at jitter {jitter!r}: "
                            "both must be numbers >= 0")
    return float(jitter) * float(step_seconds) * expected_max_standard_normal(slices)
