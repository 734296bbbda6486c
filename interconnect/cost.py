"""Simulated time of a collective schedule on a topology: where contention lives.

Model (DESIGN.md, interconnect/cost.py). Phases run one after the other. In a
phase every transfer of ``nbytes > 0`` is routed with
:meth:`~interconnect.topology.Torus.route` and adds its ``nbytes`` to every
directed link on its route. The links all run in parallel at bandwidth
``W``; the busiest one decides, and a message pays ``latency_s`` per hop::

    phase_seconds = max_link bytes(link) / W + latency_s x max_transfer hops(transfer)
    seconds       = sum of phase_seconds

An empty phase (or one with only zero-byte transfers, which are not sent)
takes 0 s. Two transfers sharing a link in one phase therefore take twice
the bandwidth time of one: that is the contention. On a full unidirectional
ring a ring allreduce of ``V`` bytes per chip gives the textbook
``2 (n-1)/n x V / W`` plus ``2 (n-1) x latency_s`` (tpu-specs.md).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import numpy as np

from interconnect.collectives import Schedule
from interconnect.errors import ScheduleError
from interconnect.link import LinkSpec
from interconnect.topology import Torus

__all__ = ["ScheduleCost", "schedule_cost", "schedule_time"]


@dataclass(frozen=True)
class ScheduleCost:
    """Simulated time and per-link traffic of a schedule.

    Attributes:
        seconds: total simulated time, the sum of ``phase_seconds``.
        phase_seconds: simulated seconds of each phase, in order.
        link_bytes: ``{(src, dst): bytes}`` carried by each directed link
            over the whole schedule; links that carried nothing are absent.
    """

    seconds: float
    phase_seconds: tuple[float, ...]
    link_bytes: dict[tuple[int, int], int]

    @property
    def total_link_bytes(self) -> int:
        """Bytes summed over all links (a transfer counts once per hop)."""
        return sum(self.link_bytes.values())

    @property
    def max_link_bytes(self) -> int:
        """Bytes on the busiest link over the whole schedule (0 if none)."""
        return max(self.link_bytes.values(), default=0)


def schedule_cost(schedule: Schedule, topology: Torus, link: LinkSpec) -> ScheduleCost:
    """Times ``schedule`` on ``topology`` whose every directed link is ``link``.

    Per phase: ``max over links of bytes(link) / link.bandwidth_bytes_per_s
    + link.latency_s x max over transfers of hops`` (see the module
    docstring); zero-byte transfers are not sent and cost nothing.

    Args:
        schedule: the collective; ``schedule.num_ranks`` must equal
            ``topology.num_chips``.
        topology: the torus the ranks live on (rank r is chip r).
        link: bandwidth and latency of one directed link.

    Returns:
        A :class:`ScheduleCost` (simulated seconds, per-phase seconds,
        bytes per directed link).

    Raises:
        ScheduleError: the schedule's ``num_ranks`` differs from the
            topology's ``num_chips``.
    """
    if schedule.num_ranks != topology.num_chips:
        raise ScheduleError(
            f"schedule {schedule.name!r} has num_ranks={schedule.num_ranks} but topology "
            f"{topology.name} has {topology.num_chips} chips: they must be equal"
        )
    bandwidth = link.bandwidth_bytes_per_s
    latency = link.latency_s
    plans: dict[tuple[tuple[int, ...], tuple[int, ...]], _PhasePlan] = {}
    totals: dict[tuple[tuple[int, ...], tuple[int, ...]], np.ndarray] = {}
    phase_seconds = []
    for phase in schedule.phases:
        if not phase:
            phase_seconds.append(0.0)
            continue
        key = (tuple(map(_get_src, phase)), tuple(map(_get_dst, phase)))
        plan = plans.get(key)
        if plan is None:
            plan = plans[key] = _PhasePlan.build(topology, *key)
            totals[key] = np.zeros(len(plan.links), dtype=np.int64)
        nbytes = np.fromiter(map(_get_nbytes, phase), dtype=np.int64, count=len(phase))
        sent = nbytes > 0
        if not sent.any():
            phase_seconds.append(0.0)
            continue
        loads = plan.link_loads(nbytes)
        totals[key] += loads
        max_hops = int(plan.hops[sent].max())
        phase_seconds.append(int(loads.max()) / bandwidth + latency * max_hops)
    link_bytes: dict[tuple[int, int], int] = {}
    for key, plan in plans.items():
        for hop, nbytes in zip(plan.links, totals[key].tolist()):
            if nbytes:
                link_bytes[hop] = link_bytes.get(hop, 0) + nbytes
    return ScheduleCost(
        seconds=float(sum(phase_seconds)), phase_seconds=tuple(phase_seconds), link_bytes=link_bytes
    )


_get_src = operator.attrgetter("src")
_get_dst = operator.attrgetter("dst")
_get_nbytes = operator.attrgetter("nbytes")


@dataclass(frozen=True)
class _PhasePlan:
    """Routes of one phase's (src, dst) pairs, reused by every phase with the same pairs.

    A ring schedule has the same pairs in each phase, so the routes are
    computed once; each phase then costs a few numpy operations.

    Attributes:
        links: distinct directed links used, in first-use order.
        hops: (T,) route length of each transfer.
        link_index: (E,) for each (transfer, link) incidence, index into links.
        transfer_index: (E,) for each incidence, the transfer.
        simple: every transfer uses exactly one link and no link twice
            (then the loads are the transfers' bytes as they are).
    """

    links: tuple[tuple[int, int], ...]
    hops: np.ndarray
    link_index: np.ndarray
    transfer_index: np.ndarray
    simple: bool

    @classmethod
    def build(cls, topology: Torus, srcs: tuple[int, ...], dsts: tuple[int, ...]) -> "_PhasePlan":
        index: dict[tuple[int, int], int] = {}
        routes: dict[tuple[int, int], list[tuple[int, int]]] = {}
        hops, link_index, transfer_index = [], [], []
        for position, pair in enumerate(zip(srcs, dsts)):
            path = routes.get(pair)
            if path is None:
                path = routes[pair] = topology.route(*pair)
            hops.append(len(path))
            for hop in path:
                link_index.append(index.setdefault(hop, len(index)))
                transfer_index.append(position)
        simple = len(link_index) == len(srcs) == len(index) and all(h == 1 for h in hops)
        return cls(
            links=tuple(index),
            hops=np.asarray(hops, dtype=np.int64),
            link_index=np.asarray(link_index, dtype=np.int64),
            transfer_index=np.asarray(transfer_index, dtype=np.int64),
            simple=simple,
        )

    def link_loads(self, nbytes: np.ndarray) -> np.ndarray:
        """(L,) bytes on each of ``links`` given (T,) bytes per transfer."""
        if self.simple:  # transfer t is alone on links[t]
            return nbytes
        loads = np.zeros(len(self.links), dtype=np.int64)
        np.add.at(loads, self.link_index, nbytes[self.transfer_index])
        return loads


def schedule_time(schedule: Schedule, topology: Torus, link: LinkSpec) -> float:
    """Simulated seconds of ``schedule``: ``schedule_cost(...).seconds``.

    Args:
        schedule: the collective (``num_ranks == topology.num_chips``).
        topology: the torus.
        link: one directed link's bandwidth and latency.

    Returns:
        Seconds of simulated time.

    Raises:
        ScheduleError: as :func:`schedule_cost`.
    """
    return schedule_cost(schedule, topology, link).seconds
