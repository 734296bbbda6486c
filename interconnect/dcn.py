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
"""

from __future__ import annotations

from interconnect.errors import ScheduleError

__all__ = ["DCN_OPS", "dcn_collective_bytes", "dcn_collective_seconds"]

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
