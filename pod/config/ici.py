"""The ICI decisions of a plan: which collective algorithm a pod runs, and what
it costs at every step once the scenario's link faults are in force.

``choose_algorithm`` picks the fastest algorithm (or checks a given one);
``IciPlan`` holds the choice and its per-step costs, so the runtime never
costs anything itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from interconnect import (ALGORITHMS, ALLREDUCE_ALGORITHMS, FAST_PATHS, LinkFaults, LinkSpec,
                          ScheduleCost, Torus, collective_cost)

__all__ = ["choose_algorithm", "combine_buckets", "IciPlan", "AUTO_MATERIALISE_MAX_CHIPS"]

#: ``auto`` only considers algorithms without a fast cost path up to this many chips
#: (their schedules are built Transfer by Transfer).
AUTO_MATERIALISE_MAX_CHIPS = 1024


def choose_algorithm(op: str, topology: Torus, num_elements: int, link: LinkSpec, *,
                     algorithm: str | None = "auto", itemsize: int = 4,
                     faults: LinkFaults | None = None,
                     candidates: Sequence[str] | None = None) -> tuple[str, ScheduleCost]:
    """The algorithm to run and its simulated cost: the given one, or the fastest.

    Args:
        op: the collective (``interconnect.OPS``).
        topology: the torus.
        num_elements: elements per chip's buffer.
        link: a healthy directed link.
        algorithm: an algorithm name, or "auto"/None for the fastest of
            ``candidates`` (default: every algorithm of ``op``; on pods above
            ``AUTO_MATERIALISE_MAX_CHIPS`` chips only those with a fast cost path,
            and on a multi-axis torus of that size only "torus").
        itemsize: bytes per element.
        faults: slowed / failed links.
        candidates: algorithms ``auto`` compares.

    Returns:
        (algorithm name, its ScheduleCost). Ties go to the earlier candidate.

    Raises:
        ScheduleError: unknown algorithm; TopologyError: bad faults.
    """
    if algorithm not in (None, "auto"):
        return algorithm, collective_cost(op, topology, num_elements, link, algorithm=algorithm,
                                          itemsize=itemsize, faults=faults)
    names = list(candidates or ALGORITHMS.get(op, ALLREDUCE_ALGORITHMS))
    if topology.num_chips > AUTO_MATERIALISE_MAX_CHIPS:
        names = [a for a in names if (op, a) in FAST_PATHS] or names[:1]
        if sum(axis > 1 for axis in topology.shape) > 1 and "torus" in names:
            # whole-pod rings cost O(chips^2) to evaluate (2(n-1) phases of n transfers)
            # and lose to per-axis rings on a multi-axis torus at this size: compare none
            names = ["torus"]
    best: tuple[str, ScheduleCost] | None = None
    for name in names:
        cost = collective_cost(op, topology, num_elements, link, algorithm=name, itemsize=itemsize,
                               faults=faults)
        if best is None or cost.seconds < best[1].seconds:
            best = (name, cost)
    assert best is not None
    return best


def combine_buckets(layers: Sequence[tuple[str, int]], max_elements: int
                    ) -> tuple[tuple[tuple[str, ...], int], ...]:
    """Combine consecutive layers' gradients into allreduce buckets, as XLA's
    all-reduce combiner merges small all-reduces.

    Args:
        layers: (layer, elements) in the order the backward pass finishes them.
        max_elements: a bucket holds at most this many elements, unless a single
            layer is larger (it is a bucket of its own).

    Returns:
        ((layers, elements), ...) in the same order; every layer in exactly one.
    """
    out: list[tuple[tuple[str, ...], int]] = []
    names: list[str] = []
    total = 0
    for name, elements in layers:
        if names and total + elements > max_elements:
            out.append((tuple(names), total))
            names, total = [], 0
        names.append(name)
        total += elements
    if names:
        out.append((tuple(names), total))
    return tuple(out)


@dataclass(frozen=True)
class IciPlan:
    """The allreduce of a data-parallel plan, decided once.

    Attributes:
        algorithm: the allreduce algorithm the pod runs (``pod.allreduce``,
            or the fastest for this pod when ``auto``); kept for the whole
            run, as a real pod does not recompile mid-run.
        num_elements: float32 elements of the gradient buffer.
        link: a healthy directed link (bandwidth, latency).
        costs: (first zero-based step, cost) in step order: the cost of the
            allreduce over the links in force from that step on (``pod.links``
            plus the link faults started by then). The first entry is step 0.
        buckets: the overlapped allreduce's buckets, (layers, elements) in the
            order the backward pass finishes them (empty without overlap); a
            bucket is ready when the backward pass has finished its last layer.
        bucket_costs: (first zero-based step, one cost per bucket), as ``costs``.
    """

    algorithm: str
    num_elements: int
    link: LinkSpec
    costs: tuple[tuple[int, ScheduleCost], ...]
    buckets: tuple[tuple[tuple[str, ...], int], ...] = ()
    bucket_costs: tuple[tuple[int, tuple[ScheduleCost, ...]], ...] = ()

    def cost_at(self, step: int) -> ScheduleCost:
        """The allreduce cost at zero-based ``step``."""
        return [c for s, c in self.costs if s <= step][-1]

    def bucket_costs_at(self, step: int) -> tuple[ScheduleCost, ...]:
        """The cost of each bucket's allreduce at zero-based ``step`` (empty without
        overlap)."""
        if not self.bucket_costs:
            return ()
        return [c for s, c in self.bucket_costs if s <= step][-1]

    @property
    def cost(self) -> ScheduleCost:
        """The cost at step 0."""
        return self.costs[0][1]
