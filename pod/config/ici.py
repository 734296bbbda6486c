"""The ICI decisions of a plan: which collective algorithm a pod runs, and what
it costs at every step once the scenario's link faults are in force.

``choose_algorithm`` picks the fastest algorithm (or costs a given one: ``tpu-pod
collective``); ``IciPlan`` holds a plan's choice for a data axis over the whole
pod (the cost table, ``MeshCollectiveCosts``, costs it at every step).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from interconnect import (
    ALGORITHMS,
    ALLREDUCE_ALGORITHMS,
    FAST_PATHS,
    MAX_COST_WORK,
    LinkFaults,
    LinkSpec,
    ScheduleCost,
    Torus,
    check_cost_work,
    collective_cost,
    cost_work,
)

__all__ = ["choose_algorithm", "IciPlan", "AUTO_MATERIALISE_MAX_CHIPS"]

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
            and on a multi-axis torus of that size only "torus"; never one whose
            ``interconnect.cost_work`` is past ``MAX_COST_WORK``).
        itemsize: bytes per element.
        faults: slowed / failed links.
        candidates: algorithms ``auto`` compares.

    Returns:
        (algorithm name, its ScheduleCost). Ties go to the earlier candidate.

    Raises:
        ScheduleError: unknown algorithm; TopologyError: bad faults.
    """
    if algorithm is not None and algorithm != "auto":
        return algorithm, collective_cost(op, topology, num_elements, link, algorithm=algorithm,
                                          itemsize=itemsize, faults=faults)
    names = list(candidates or ALGORITHMS.get(op, ALLREDUCE_ALGORITHMS))
    if topology.num_chips > AUTO_MATERIALISE_MAX_CHIPS:
        names = [a for a in names if (op, a) in FAST_PATHS] or names[:1]
        if sum(axis > 1 for axis in topology.shape) > 1 and "torus" in names:
            # whole-pod rings cost O(chips^2) to evaluate (2(n-1) phases of n transfers)
            # and lose to per-axis rings on a multi-axis torus at this size: compare none
            names = ["torus"]
    affordable = [a for a in names if cost_work(op, topology, a, faults) <= MAX_COST_WORK]
    if not affordable:  # none can be costed in seconds: the first's one-line refusal
        check_cost_work(op, topology, names[0], faults)
    best: tuple[str, ScheduleCost] | None = None
    for name in affordable:
        cost = collective_cost(op, topology, num_elements, link, algorithm=name, itemsize=itemsize,
                               faults=faults)
        if best is None or cost.seconds < best[1].seconds:
            best = (name, cost)
    assert best is not None
    return best


@dataclass(frozen=True)
class IciPlan:
    """The allreduce of a data axis that spans the whole pod, decided once.

    Attributes:
        algorithm: the allreduce algorithm of such an axis (``pod.allreduce``, or
            ``torus`` when ``auto``: what XLA runs); kept for the whole run, as a real
            pod does not recompile mid-run. What each mesh axis runs is the cost
            table's (``MeshCollectiveCosts.algorithm``).
        num_elements: float32 elements of the model's gradient buffer.
        link: a healthy directed link (bandwidth, latency).
        whole_pod: a data axis spans every device of a slice, so its allreduce runs
            ``algorithm`` over the torus (False: the mesh's collectives run on their
            groups).
    """

    algorithm: str
    num_elements: int
    link: LinkSpec
    whole_pod: bool = False
