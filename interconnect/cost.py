"""Simulated time of a collective schedule on a topology: where contention lives.

Model. Phases run one after the other. In a phase every transfer of
``nbytes > 0`` is routed with :meth:`~interconnect.topology.Torus.route` and
adds its ``nbytes`` to every directed link on its route. The links all run
in parallel; the busiest one decides, and a message pays ``latency_s`` per
hop::

    phase_seconds = max_link bytes(link) / W_achieved(k) + latency_s x max_transfer hops(transfer)
    seconds       = collective_fixed_s + sum of phase_seconds

``W_achieved(k) = W x efficiency x k ** -multi_link_exponent``
(:meth:`LinkSpec.achieved_bandwidth_bytes_per_s`), where ``k`` is the
largest number of outgoing links any one chip drives in that phase; the
fixed cost is paid once by every collective over 2 or more chips. With the
default :class:`LinkSpec` (efficiency 1, no exponent, no fixed cost) this is
the textbook model: on a full unidirectional ring a ring allreduce of ``V``
bytes per chip takes ``2 (n-1)/n x V / W`` plus ``2 (n-1) x latency_s``
([SB]). :mod:`interconnect.calibration` holds the fitted constants.

An empty phase (or one with only zero-byte transfers, which are not sent)
takes 0 s. Two transfers sharing a link in one phase take twice the
bandwidth time of one: that is the contention.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import numpy as np

from interconnect.collectives import Schedule
from interconnect.errors import ScheduleError, TopologyError
from interconnect.faults import LinkFaults, route
from interconnect.link import LinkSpec
from interconnect.phases import PairPhases, schedule_phases
from interconnect.topology import Torus, link_ids

__all__ = ["ScheduleCost", "schedule_cost", "schedule_time"]


def _checked_faults(faults: LinkFaults | None, topology: Torus) -> LinkFaults:
    if faults is None:
        return LinkFaults()
    if not isinstance(faults, LinkFaults):
        raise TopologyError(f"faults {faults!r} is not valid: expected an interconnect.LinkFaults")
    faults.check(topology)
    return faults


@dataclass(frozen=True)
class ScheduleCost:
    """Simulated time and per-link traffic of a schedule.

    Attributes:
        seconds: total simulated time, ``fixed_seconds`` plus the sum of
            ``phase_seconds``.
        phase_seconds: simulated seconds of each phase, in order.
        link_bytes: ``{(src, dst): bytes}`` carried by each directed link
            over the whole schedule; links that carried nothing are absent.
        busiest_link_seconds: the longest time any one link spent sending
            (its bytes over its own, possibly slowed, bandwidth); divided by
            ``seconds`` it is the busiest link's utilisation.
        fixed_seconds: the collective's fixed cost
            (``LinkSpec.collective_fixed_s``; 0 on one chip).
    """

    seconds: float
    phase_seconds: tuple[float, ...]
    link_bytes: dict[tuple[int, int], int]
    busiest_link_seconds: float = 0.0
    fixed_seconds: float = 0.0

    @property
    def busiest_link_utilization(self) -> float:
        """Busy time of the busiest link / the schedule's time, 0..1 (0 for an empty schedule)."""
        return self.busiest_link_seconds / self.seconds if self.seconds > 0 else 0.0

    @property
    def total_link_bytes(self) -> int:
        """Bytes summed over all links (a transfer counts once per hop)."""
        return sum(self.link_bytes.values())

    @property
    def max_link_bytes(self) -> int:
        """Bytes on the busiest link over the whole schedule (0 if none)."""
        return max(self.link_bytes.values(), default=0)


def _old_schedule_cost(schedule: Schedule, topology: Torus, link: LinkSpec,
                       faults: LinkFaults | None = None) -> ScheduleCost:
    """Times ``schedule`` on ``topology`` whose every directed link is ``link``.

    Per phase: ``max over links of bytes(link) x slowdown(link) /
    link.achieved_bandwidth_bytes_per_s(k) + link.latency_s x max over
    transfers of hops``, ``k`` the most links one chip drives in the phase;
    plus ``link.collective_fixed_s`` once when the schedule spans 2 or more
    ranks (see the module docstring). Zero-byte transfers are not sent and
    cost nothing. With failed links, a transfer whose dimension-order route
    crosses one takes the shortest route around them (:func:`route`).

    Args:
        schedule: the collective; ``schedule.num_ranks`` must equal
            ``topology.num_chips``.
        topology: the torus the ranks live on (rank r is chip r).
        link: bandwidth and latency of one directed link.
        faults: slowed and failed links (None: every link healthy).

    Returns:
        A :class:`ScheduleCost` (simulated seconds, per-phase seconds,
        bytes per directed link).

    Raises:
        ScheduleError: the schedule's ``num_ranks`` differs from the
            topology's ``num_chips``.
        TopologyError: a fault names a link the topology lacks, or failed
            links cut a transfer's source off from its destination.
    """
    faults = _checked_faults(faults, topology)
    if schedule.num_ranks != topology.num_chips:
        raise ScheduleError(
            f"schedule {schedule.name!r} has num_ranks={schedule.num_ranks} but topology "
            f"{topology.name} has {topology.num_chips} chips: they must be equal"
        )
    bandwidth = link.achieved_bandwidth_bytes_per_s(1)
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
            plan = plans[key] = _PhasePlan.build(topology, *key, faults=faults)
            totals[key] = np.zeros(len(plan.links), dtype=np.int64)
        nbytes = np.fromiter(map(_get_nbytes, phase), dtype=np.int64, count=len(phase))
        sent = nbytes > 0
        if not sent.any():
            phase_seconds.append(0.0)
            continue
        loads = plan.link_loads(nbytes)
        totals[key] += loads
        max_hops = int(plan.hops[sent].max())
        busiest = int(loads.max()) if plan.factors is None else float((loads * plan.factors).max())
        driven = int(np.bincount(plan.link_srcs[loads > 0]).max())
        phase_seconds.append(busiest / link.achieved_bandwidth_bytes_per_s(driven)
                             + latency * max_hops)
    link_bytes: dict[tuple[int, int], int] = {}
    for key, plan in plans.items():
        for hop, nbytes in zip(plan.links, totals[key].tolist(), strict=True):
            if nbytes:
                link_bytes[hop] = link_bytes.get(hop, 0) + nbytes
    busiest_seconds = max((nbytes * faults.slowdown(hop) / bandwidth
                           for hop, nbytes in link_bytes.items()),
                          default=0.0)
    fixed = link.collective_fixed_s if schedule.num_ranks >= 2 else 0.0
    return ScheduleCost(
        seconds=fixed + float(sum(phase_seconds)), phase_seconds=tuple(phase_seconds),
        link_bytes=link_bytes, busiest_link_seconds=float(busiest_seconds), fixed_seconds=fixed,
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
        link_srcs: (L,) the chip driving each of ``links``.
        factors: (L,) slowdown of each of ``links``, or None when all are 1.
    """

    links: tuple[tuple[int, int], ...]
    hops: np.ndarray
    link_index: np.ndarray
    transfer_index: np.ndarray
    simple: bool
    link_srcs: np.ndarray
    factors: np.ndarray | None = None

    @classmethod
    def build(cls, topology: Torus, srcs: tuple[int, ...], dsts: tuple[int, ...],
              faults: LinkFaults | None = None) -> _PhasePlan:
        index: dict[tuple[int, int], int] = {}
        routes: dict[tuple[int, int], list[tuple[int, int]]] = {}
        hops, link_index, transfer_index = [], [], []
        for position, pair in enumerate(zip(srcs, dsts, strict=True)):
            path = routes.get(pair)
            if path is None:
                path = routes[pair] = route(topology, *pair, faults=faults)
            hops.append(len(path))
            for hop in path:
                link_index.append(index.setdefault(hop, len(index)))
                transfer_index.append(position)
        simple = len(link_index) == len(srcs) == len(index) and all(h == 1 for h in hops)
        factors = None
        if faults is not None and faults.slowdowns:
            factors = np.array([faults.slowdown(hop) for hop in index], dtype=np.float64)
        return cls(
            links=tuple(index),
            hops=np.asarray(hops, dtype=np.int64),
            link_index=np.asarray(link_index, dtype=np.int64),
            transfer_index=np.asarray(transfer_index, dtype=np.int64),
            simple=simple,
            factors=factors,
            link_srcs=np.asarray([hop[0] for hop in index], dtype=np.int64),
        )

    def link_loads(self, nbytes: np.ndarray) -> np.ndarray:
        """(L,) bytes on each of ``links`` given (T,) bytes per transfer."""
        if self.simple:  # transfer t is alone on links[t]
            return nbytes
        loads = np.zeros(len(self.links), dtype=np.int64)
        np.add.at(loads, self.link_index, nbytes[self.transfer_index])
        return loads


def schedule_time(schedule: Schedule, topology: Torus, link: LinkSpec,
                  faults: LinkFaults | None = None) -> float:
    """Simulated seconds of ``schedule``: ``schedule_cost(...).seconds``.

    Args:
        schedule: the collective (``num_ranks == topology.num_chips``).
        topology: the torus.
        link: one directed link's bandwidth and latency.
        faults: slowed and failed links (None: all healthy).

    Returns:
        Seconds of simulated time.

    Raises:
        ScheduleError, TopologyError: as :func:`schedule_cost`.
    """
    return schedule_cost(schedule, topology, link, faults).seconds


# ------------------------------------------------------------------------------
# Fast path: the ring, bidirectional-ring and torus collectives costed from their
# regular structure, without building a Transfer per message.
# ------------------------------------------------------------------------------

#: (op, algorithm) pairs :func:`collective_cost` can time without building the schedule.
_OLD_FAST_PATHS = frozenset(
    (op, algorithm)
    for op in ("allreduce", "reduce_scatter", "all_gather")
    for algorithm in ("ring", "bidirectional_ring", "torus")
)


def _old_collective_cost(op: str, topology: Torus, num_elements: int, link: LinkSpec, *,
                    algorithm: str | None = None, itemsize: int = 4,
                    faults: LinkFaults | None = None, fast: bool = True, shift: int = 1,
                    axis: int = 0) -> ScheduleCost:
    """Simulated cost of a collective, by the fast path where one exists.

    For the ring, bidirectional-ring and torus variants of allreduce,
    reduce-scatter and all-gather on links without failures, the cost is
    computed from the schedule's regular structure (:func:`_ring_family_cost`,
    :func:`_axis_collective_cost`: per phase a vectorised sum of bytes per
    link, no Transfer objects), which
    gives the same seconds and link bytes as ``schedule_cost(build_collective(...))``
    (the tests check it) in a small fraction of the time: a v5p 16x20x28
    torus allreduce takes well under a second. Everything else builds the
    schedule and costs it with :func:`schedule_cost`.

    Args:
        op: the operation (``interconnect.collectives.OPS``).
        topology: the torus.
        num_elements: elements per rank's buffer.
        link: bandwidth and latency of a healthy directed link.
        algorithm: one of ``ALGORITHMS[op]`` (None: the op's default).
        itemsize: bytes per element.
        faults: slowed / failed links.
        fast: False forces the schedule-based reference path.
        shift: ppermute only: places each buffer moves.
        axis: ppermute only: the torus axis it moves along.

    Returns:
        The :class:`ScheduleCost`.

    Raises:
        ScheduleError: unknown op / algorithm or bad counts.
        TopologyError: a fault names a missing link, or failures cut a route.
    """
    from interconnect.collectives import _check_counts
    from interconnect.registry import ALGORITHMS, build_collective
    from interconnect.registry import check_algorithm as _check_algorithm

    algorithm = algorithm or ALGORITHMS.get(op, ("",))[0]
    _check_algorithm(op, algorithm)
    checked = _checked_faults(faults, topology)
    if fast and (op, algorithm) in _OLD_FAST_PATHS and not checked.failed:
        _, num_elements, itemsize = _check_counts(topology, num_elements, itemsize)
        if algorithm == "ring":
            return _ring_family_cost(op, algorithm, topology, num_elements, itemsize, link, checked)
        return _axis_collective_cost(op, algorithm, topology, num_elements, itemsize, link, checked)
    schedule = build_collective(op, topology, num_elements, itemsize, algorithm, shift=shift,
                                axis=axis)
    return _old_schedule_cost(schedule, topology, link, checked)


def _link_ids(topology: Torus, srcs: np.ndarray, dsts: np.ndarray) -> np.ndarray:
    """Integer id of directed links: src x 2 ndim + axis x 2 + (1 if dst is src's +1 neighbour)."""
    shape = np.asarray(topology.shape)
    strides = np.asarray(topology._strides)  # noqa: SLF001 - same package
    cs = (srcs[..., None] // strides) % shape
    cd = (dsts[..., None] // strides) % shape
    axis = np.argmax(cs != cd, axis=-1)
    a = np.take_along_axis(cs, axis[..., None], -1)[..., 0]
    b = np.take_along_axis(cd, axis[..., None], -1)[..., 0]
    plus = (b == (a + 1) % shape[axis]).astype(np.int64)
    return srcs * (2 * topology.ndim) + axis * 2 + plus


def _link_of_id(topology: Torus, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    shape = np.asarray(topology.shape)
    strides = np.asarray(topology._strides)  # noqa: SLF001
    src = ids // (2 * topology.ndim)
    axis = (ids % (2 * topology.ndim)) // 2
    step = np.where(ids % 2 == 1, 1, -1)
    c = (src // strides[axis]) % shape[axis]
    dst = src + (((c + step) % shape[axis]) - c) * strides[axis]
    return src, dst


def _ring_family_cost(op: str, algorithm: str, topology: Torus, num_elements: int, itemsize: int,
                      link: LinkSpec, faults: LinkFaults) -> ScheduleCost:
    """Exact cost of the unidirectional ``"ring"`` collectives along ``ring_order()``.

    The ring is one level of ``a = n`` positions; the parts have sizes of
    np.array_split, part ``k`` of ``S`` elements cut ``a`` ways holding
    ``S // a + (k < S % a)``. Phase ``s`` sends, from every ring position,
    the part the schedule names; a phase is a few numpy operations: bytes
    per link by bincount, the busiest (slowdown-weighted) link, the chips'
    driven links and the longest route of a non-empty message, exactly as
    :func:`schedule_cost` finds them.
    """
    n = topology.num_chips
    nlinks = n * 2 * topology.ndim
    factors = np.ones(nlinks)
    for (src, dst), factor in faults.slowdowns.items():
        factors[_link_ids(topology, np.array([src]), np.array([dst]))[0]] = factor
    slowed = bool(faults.slowdowns)
    order = topology.ring_order()
    levels = [[order]] if n >= 2 else []
    owned_size = np.full(n, num_elements, dtype=np.int64)
    totals = np.zeros(nlinks, dtype=np.int64)
    rs_seconds: list[float] = []
    ag_levels: list[list[float]] = []
    route_cache: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for level in levels:
        rings = np.asarray(level, dtype=np.int64)  # (R, a)
        num_rings, a = rings.shape
        sizes = owned_size[rings[:, 0]]
        k = np.arange(a)
        parts = sizes[:, None] // a + (k[None, :] < (sizes % a)[:, None])  # (R, a) elements
        # routes of every position, translated ring by ring: entries of
        # (ring, position, hop) -> link id
        directions = [(1, parts)]
        entries = []  # per direction: (positions (E,), rings (E,), link ids (E,), hops (E,))
        for step, _ in directions:
            e_pos, e_ring, e_link, e_hops = [], [], [], []
            for i in range(a):
                j = (i + step) % a
                # routes of ring 0, then translated: rings differ by a constant rank offset
                src0, dst0 = int(rings[0, i]), int(rings[0, j])
                path = route_cache.get((src0, dst0))
                if path is None:
                    path = route_cache[(src0, dst0)] = route(topology, src0, dst0)
                offsets = rings[:, i] - src0
                for hop_src, hop_dst in path:
                    ids = _link_ids(topology, hop_src + offsets, hop_dst + offsets)
                    e_pos.append(np.full(num_rings, i))
                    e_ring.append(np.arange(num_rings))
                    e_link.append(ids)
                    e_hops.append(np.full(num_rings, len(path)))
            entries.append(tuple(np.concatenate(x) if x else np.zeros(0, np.int64)
                                 for x in (e_pos, e_ring, e_link, e_hops)))

        def phase(labels_of, directions=directions, entries=entries) -> float:
            loads = np.zeros(nlinks, dtype=np.int64)
            max_hops = 0
            for (step, table), (pos, ring, ids, hops) in zip(directions, entries, strict=True):
                nbytes = table[ring, labels_of(step, pos)] * itemsize
                loads += np.bincount(ids, weights=nbytes, minlength=nlinks).astype(np.int64)
                sent = nbytes > 0
                if sent.any():
                    max_hops = max(max_hops, int(hops[sent].max()))
            if not loads.any():
                return 0.0
            totals[:] += loads
            return _phase_seconds(topology, loads, factors if slowed else None, max_hops, link)

        if op in ("allreduce", "reduce_scatter"):
            rs_seconds.extend(phase(lambda step, pos, s=s, a=a: (pos - s) % a)
                              for s in range(a - 1))
        if op in ("allreduce", "all_gather"):
            ag_levels.append([phase(lambda step, pos, s=s, a=a: (pos + 1 - s) % a)
                              for s in range(a - 1)])
        owned_size[rings.reshape(-1)] = np.roll(parts, -1, axis=1).reshape(-1)
    phase_seconds = rs_seconds + [p for level in reversed(ag_levels) for p in level]
    return _cost_of(topology, phase_seconds, totals, factors, link)


def _phase_seconds(topology: Torus, loads: np.ndarray, factors: np.ndarray | None, max_hops: int,
                   link: LinkSpec) -> float:
    """One phase from its (nlinks,) loads by link id: busiest link at the achieved
    bandwidth, plus latency."""
    busiest = float((loads * factors).max()) if factors is not None else int(loads.max())
    used = np.flatnonzero(loads)
    driven = int(np.bincount(used // (2 * topology.ndim)).max())
    return busiest / link.achieved_bandwidth_bytes_per_s(driven) + link.latency_s * max_hops


def _cost_of(topology: Torus, phase_seconds: list[float], totals: np.ndarray, factors: np.ndarray,
             link: LinkSpec) -> ScheduleCost:
    used = np.flatnonzero(totals)
    srcs, dsts = _link_of_id(topology, used)
    link_bytes = dict(zip(zip(srcs.tolist(), dsts.tolist(), strict=True), totals[used].tolist(),
                          strict=True))
    busiest_seconds = (float((totals * factors).max()) / link.achieved_bandwidth_bytes_per_s(1)
                       if used.size else 0.0)
    fixed = link.collective_fixed_s if topology.num_chips >= 2 else 0.0
    return ScheduleCost(seconds=fixed + float(sum(phase_seconds)),
                        phase_seconds=tuple(phase_seconds), link_bytes=link_bytes,
                        busiest_link_seconds=busiest_seconds, fixed_seconds=fixed)


def _neighbour_tables(topology: Torus) -> tuple[np.ndarray, np.ndarray]:
    """(n, 2 ndim) neighbour rank of each chip per (axis, direction) (-1: none) and its link id."""
    n, ndim = topology.num_chips, topology.ndim
    ranks = np.arange(n, dtype=np.int64)
    strides = np.asarray(topology._strides)  # noqa: SLF001 - same package
    dst = np.full((n, 2 * ndim), -1, dtype=np.int64)
    ids = np.zeros((n, 2 * ndim), dtype=np.int64)
    for axis, size in enumerate(topology.shape):
        c = (ranks // strides[axis]) % size
        for slot, step in ((2 * axis, -1), (2 * axis + 1, 1)):
            nc = c + step
            ok = ((nc >= 0) & (nc < size) if not topology.wraparound[axis]
                  else np.ones(n, dtype=bool))
            nc %= size
            ok &= nc != c
            dst[ok, slot] = ranks[ok] + (nc[ok] - c[ok]) * strides[axis]
            ids[ok, slot] = _link_ids(topology, ranks[ok], dst[ok, slot])
    return dst, ids


def _axis_collective_cost(op: str, algorithm: str, topology: Torus, num_elements: int,
                          itemsize: int, link: LinkSpec, faults: LinkFaults) -> ScheduleCost:
    """Exact cost of the ``"torus"`` and ``"bidirectional_ring"`` collectives (interconnect.chains).

    Takes the reduce-scatter phases as (src, dst, bytes, link) arrays from
    :func:`interconnect.chains.axis_reduce_scatter_phases`. Steps along a
    torus axis come with their link ids; steps of ``ring_order()`` follow
    :meth:`Torus.route`. Per phase: bytes per link by bincount, then
    :func:`_phase_seconds`, exactly as :func:`schedule_cost` would. The
    all-gather runs the phases backwards with every transfer turned round:
    a one-hop transfer then loads the reverse link with the same bytes, so
    its loads are the reduce-scatter's permuted; longer routes are routed
    again (a reversed dimension-order route is not the reverse route).
    """
    from interconnect.chains import axis_reduce_scatter_phases

    n = topology.num_chips
    nlinks = n * 2 * topology.ndim
    factors = np.ones(nlinks)
    for (src, dst), factor in faults.slowdowns.items():
        factors[_link_ids(topology, np.array([src]), np.array([dst]))[0]] = factor
    slowed = factors if faults.slowdowns else None
    neighbour_dst, neighbour_id = _neighbour_tables(topology)
    reverse = np.zeros(nlinks, dtype=np.int64)
    has = neighbour_dst >= 0
    reverse[neighbour_id[has]] = _link_ids(topology, neighbour_dst[has], np.nonzero(has)[0])
    totals = np.zeros(nlinks, dtype=np.int64)
    route_ids: dict[tuple[int, int], np.ndarray] = {}

    def loads_of(srcs, dsts, nbytes, ids):
        """(loads (nlinks,), max hops) of one phase's sent transfers."""
        known = ids >= 0
        if known.all():  # steps along torus axes: one hop each, link ids given
            return np.bincount(ids, weights=nbytes, minlength=nlinks).astype(np.int64), 1
        match = neighbour_dst[srcs] == dsts[:, None]  # (T, 2 ndim)
        near = match.any(axis=1)
        near_ids = neighbour_id[srcs[near], match[near].argmax(axis=1)]
        loads = np.bincount(near_ids, weights=nbytes[near], minlength=nlinks).astype(np.int64)
        max_hops = 1 if near.any() else 0
        for src, dst, size in zip(srcs[~near].tolist(), dsts[~near].tolist(),
                                  nbytes[~near].tolist(), strict=True):
            far = route_ids.get((src, dst))
            if far is None:
                path = np.asarray(topology.route(src, dst), dtype=np.int64)
                far = route_ids[(src, dst)] = _link_ids(topology, path[:, 0], path[:, 1])
            np.add.at(loads, far, size)
            max_hops = max(max_hops, len(far))
        return loads, max_hops

    rs_seconds: list[float] = []
    ag_seconds: list[float] = []
    for srcs, dsts, nbytes, ids in axis_reduce_scatter_phases(op, topology, num_elements,
                                                              itemsize, algorithm):
        sent = nbytes > 0
        if not sent.any():
            rs_seconds.append(0.0)
            ag_seconds.append(0.0)
            continue
        srcs, dsts, nbytes, ids = srcs[sent], dsts[sent], nbytes[sent], ids[sent]
        if op in ("allreduce", "reduce_scatter"):
            loads, max_hops = loads_of(srcs, dsts, nbytes, ids)
            totals += loads
            rs_seconds.append(_phase_seconds(topology, loads, slowed, max_hops, link))
        if op in ("allreduce", "all_gather"):
            if (ids >= 0).all():
                if op == "all_gather":
                    loads, max_hops = loads_of(srcs, dsts, nbytes, ids)
                back = np.zeros(nlinks, dtype=np.int64)
                back[reverse] = loads
            else:
                back, max_hops = loads_of(dsts, srcs, nbytes, np.full(len(ids), -1, dtype=np.int64))
            totals += back
            ag_seconds.append(_phase_seconds(topology, back, slowed, max_hops, link))
    phase_seconds = {"allreduce": rs_seconds + ag_seconds[::-1], "reduce_scatter": rs_seconds,
                     "all_gather": ag_seconds[::-1]}[op]
    return _cost_of(topology, phase_seconds, totals, factors, link)


# ------------------------------------------------------------------------------
# The engine: any collective as PairPhases, priced by one function.
# ------------------------------------------------------------------------------


def price(phases: PairPhases, topology: Torus, link: LinkSpec, faults: LinkFaults | None = None,
          *, members: np.ndarray | None = None, devices_per_chip: int = 1,
          on_chip_bytes_per_s: float | None = None) -> ScheduleCost:
    """Simulated cost of a collective given as :class:`~interconnect.phases.PairPhases`,
    run by every group of ``members`` at once: the one place a collective becomes time.

    Local rank ``r`` of group ``i`` is device ``members[i, r]``, on chip ``device //
    devices_per_chip``. Every pair of every group is routed once (dimension order,
    vectorised; around failed links where it must, :func:`route`). Per phase: the
    bytes of each pair load every link of its route in every group; the phase takes
    ``max over links of bytes x slowdown / link.achieved_bandwidth_bytes_per_s(k) +
    link.latency_s x the longest route of a sending pair`` (``k`` the most links one
    chip drives in the phase), and a pair whose two devices share a chip (v2 / v3
    TensorCores) loads no link: each device copies what it sends that way at
    ``on_chip_bytes_per_s``, one copy after another, beside the ICI transfers (the
    phase takes the longer). The collective adds ``link.collective_fixed_s`` once on a
    torus of 2 or more chips (module docstring). Phases with the same bytes per pair
    cost the same and are costed once.

    Args:
        phases: the collective on local ranks ``0..g-1``.
        topology: the chips' torus.
        link: a healthy directed link (calibrated or not).
        faults: slowed and failed links (None: all healthy).
        members: (R, g) device ids of every group; None: one group, local rank = chip.
        devices_per_chip: devices per chip (2 for the TensorCores of v2 / v3).
        on_chip_bytes_per_s: bandwidth of a copy between two devices of one chip
            (needed when a pair shares a chip).

    Returns:
        The :class:`ScheduleCost`.

    Raises:
        ScheduleError: members of another width than the phases' ranks, or a pair on one
            chip without a positive finite ``on_chip_bytes_per_s``.
        TopologyError: a fault names a link the torus lacks, or failed links cut a pair off.
    """
    faults = _checked_faults(faults, topology)
    if members is None:
        members = np.arange(phases.num_ranks, dtype=np.int64)[None, :]
    members = np.asarray(members, dtype=np.int64)
    if members.ndim != 2 or members.shape[1] != phases.num_ranks:
        raise ScheduleError(f"members of shape {members.shape} do not fit phases over "
                            f"{phases.num_ranks} ranks: expected (groups, {phases.num_ranks})")
    routes = _PairRoutes.build(topology, members, phases, devices_per_chip, faults)
    if routes.on_chip_pair.size and not (on_chip_bytes_per_s is not None
                                         and np.isfinite(on_chip_bytes_per_s)
                                         and on_chip_bytes_per_s > 0):
        raise ScheduleError(f"on_chip_bytes_per_s {on_chip_bytes_per_s!r} is not valid: a step "
                            "between two devices of one chip needs a positive bandwidth in bytes/s")
    nlinks = topology.num_chips * 2 * topology.ndim
    factors, slowed = _slowdowns(topology, faults)
    totals = np.zeros(nlinks, dtype=np.int64)
    memo: dict[bytes, tuple[np.ndarray | None, float]] = {}
    seconds = []
    for nbytes in phases.phase_bytes:
        key = nbytes.tobytes()
        hit = memo.get(key)
        if hit is None:
            hit = memo[key] = routes.phase(nbytes, topology, link, slowed, nlinks,
                                           on_chip_bytes_per_s)
        loads, phase_seconds = hit
        if loads is not None:
            totals += loads
        seconds.append(phase_seconds)
    return _cost_of(topology, seconds, totals, factors, link)


def _slowdowns(topology: Torus, faults: LinkFaults | None) -> tuple[np.ndarray, np.ndarray | None]:
    """(nlinks,) slowdown factor by link id, and the same or None when no link is slowed."""
    factors = np.ones(topology.num_chips * 2 * topology.ndim)
    for (src, dst), factor in (faults.slowdowns.items() if faults is not None else ()):
        factors[link_ids(topology, np.array([src]), np.array([dst]))[0]] = factor
    return factors, (factors if faults is not None and faults.slowdowns else None)


@dataclass(frozen=True)
class _PairRoutes:
    """The routes of every pair of a collective in every group, found once.

    A pair sends the same bytes in every group, so a phase's link loads are one
    bincount of its pairs' bytes over the route entries.

    Attributes:
        entry_pair: (E,) the pair (index into the phases' pairs) of each (group, pair,
            hop) route entry.
        entry_link: (E,) its directed ICI link id (``interconnect.topology.link_ids``).
        pair_hops: (P,) the longest route of the pair over the groups (0: on one chip
            in every group).
        on_chip_pair: (O,) the pair of each (group, pair) whose devices share a chip.
        on_chip_device: (O,) its sending device.
    """

    entry_pair: np.ndarray
    entry_link: np.ndarray
    pair_hops: np.ndarray
    on_chip_pair: np.ndarray
    on_chip_device: np.ndarray

    @classmethod
    def build(cls, topology: Torus, members: np.ndarray, phases: PairPhases,
              devices_per_chip: int, faults: LinkFaults) -> _PairRoutes:
        """Routes of ``phases``' pairs for the groups ``members`` (R, g)."""
        count = phases.num_pairs
        src = members[:, phases.src].reshape(-1)                            # (R x P,)
        dst = members[:, phases.dst].reshape(-1)
        src_chip, dst_chip = src // devices_per_chip, dst // devices_per_chip
        pair = np.tile(np.arange(count, dtype=np.int64), len(members))
        crossing = src_chip != dst_chip
        if faults.failed:  # route around failures only the pairs that send (one may be cut off)
            sends = np.zeros(count, dtype=bool)
            for nbytes in phases.phase_bytes:
                sends |= nbytes > 0
            crossing &= sends[pair]
        ici = np.flatnonzero(crossing)
        edge, ids, hops = _routes(topology, src_chip[ici], dst_chip[ici], faults)
        on_chip = np.flatnonzero(src_chip == dst_chip)
        entry_pair = pair[ici][edge]
        pair_hops = np.zeros(count, dtype=np.int64)
        np.maximum.at(pair_hops, entry_pair, hops)
        return cls(entry_pair, ids, pair_hops, pair[on_chip], src[on_chip])

    def phase(self, nbytes: np.ndarray, topology: Torus, link: LinkSpec,
              slowed: np.ndarray | None, nlinks: int, on_chip_bytes_per_s: float | None
              ) -> tuple[np.ndarray | None, float]:
        """(link loads (nlinks,) or None when no byte crosses a link, seconds) of a phase
        whose pairs send ``nbytes`` (P,)."""
        entry_bytes = nbytes[self.entry_pair]
        loads, seconds = None, 0.0
        if entry_bytes.any():
            loads = np.bincount(self.entry_link, weights=entry_bytes,
                                minlength=nlinks).astype(np.int64)
            seconds = _phase_seconds(topology, loads, slowed,
                                     int(self.pair_hops[nbytes > 0].max()), link)
        copied = nbytes[self.on_chip_pair]
        if copied.any():  # each device copies what it sends on-chip, one copy after another
            assert on_chip_bytes_per_s is not None  # checked by price
            most = np.bincount(self.on_chip_device, weights=copied).max()
            seconds = max(seconds, float(most) / on_chip_bytes_per_s)
        return loads, seconds


def _routes(topology: Torus, srcs: np.ndarray, dsts: np.ndarray,
            faults: LinkFaults | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every (src, dst) chip pair's route, vectorised: dimension order
    (``Torus.route``), or around failed links where that one crosses one (:func:`route`).

    Returns:
        (pair, link id, hops): one entry per hop of every route: the index of the pair,
        the link's id (``interconnect.topology.link_ids``) and the length of the pair's
        route.
    """
    edge, ids, hops = _dimension_order_routes(topology, srcs, dsts)
    if faults is None or not faults.failed or not edge.size:
        return edge, ids, hops
    failed = np.asarray(sorted(faults.failed), dtype=np.int64).reshape(-1, 2)
    failed_ids = link_ids(topology, failed[:, 0], failed[:, 1])
    broken = np.unique(edge[np.isin(ids, failed_ids)])
    if not broken.size:
        return edge, ids, hops
    keep = ~np.isin(edge, broken)
    edge_parts, id_parts, hop_parts = [edge[keep]], [ids[keep]], [hops[keep]]
    for index in broken.tolist():
        path = np.asarray(route(topology, int(srcs[index]), int(dsts[index]), faults=faults),
                          dtype=np.int64).reshape(-1, 2)
        edge_parts.append(np.full(len(path), index, dtype=np.int64))
        id_parts.append(link_ids(topology, path[:, 0], path[:, 1]))
        hop_parts.append(np.full(len(path), len(path), dtype=np.int64))
    return tuple(np.concatenate(parts) for parts in (edge_parts, id_parts, hop_parts))


def _dimension_order_routes(topology: Torus, srcs: np.ndarray, dsts: np.ndarray
                            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every (src, dst) pair's dimension-order route (``Torus.route``), vectorised; as
    :func:`_routes`."""
    shape, strides = np.asarray(topology.shape), np.asarray(topology._strides)  # noqa: SLF001
    current = srcs.copy()
    coords = (srcs[:, None] // strides) % shape                             # (P, ndim)
    target = (dsts[:, None] // strides) % shape
    steps, counts = [], []
    for axis, size in enumerate(topology.shape):
        a, b = coords[:, axis], target[:, axis]
        if topology.wraparound[axis]:  # the shorter way; a tie: + from an even coordinate
            forward, backward = (b - a) % size, (a - b) % size
            tie = forward == backward
            step = np.where(tie, np.where(a % 2 == 0, 1, -1), np.where(forward < backward, 1, -1))
            count = np.minimum(forward, backward)
        else:
            step, count = np.where(b >= a, 1, -1), np.abs(b - a)
        steps.append(step)
        counts.append(count)
    hops = np.sum(counts, axis=0)                                            # (P,)
    edge_parts, id_parts = [], []
    for axis, size in enumerate(topology.shape):
        for k in range(int(counts[axis].max(initial=0))):
            moving = np.flatnonzero(counts[axis] > k)
            c = coords[moving, axis]
            nc = (c + steps[axis][moving]) % size
            nxt = current[moving] + (nc - c) * strides[axis]
            edge_parts.append(moving)
            id_parts.append(link_ids(topology, current[moving], nxt))
            current[moving], coords[moving, axis] = nxt, nc
    edge = np.concatenate(edge_parts) if edge_parts else np.zeros(0, np.int64)
    ids = np.concatenate(id_parts) if id_parts else np.zeros(0, np.int64)
    return edge, ids, hops[edge]


def schedule_cost(schedule: Schedule, topology: Torus, link: LinkSpec,
                  faults: LinkFaults | None = None) -> ScheduleCost:
    """Times ``schedule`` on ``topology`` whose every directed link is ``link``.

    Its transfers, grouped by pair in each phase
    (:func:`~interconnect.phases.schedule_phases`), priced by :func:`price`: per phase
    ``max over links of bytes(link) x slowdown(link) /
    link.achieved_bandwidth_bytes_per_s(k) + link.latency_s x max over
    transfers of hops``, ``k`` the most links one chip drives in the phase;
    plus ``link.collective_fixed_s`` once when the schedule spans 2 or more
    ranks (see the module docstring). Zero-byte transfers are not sent and
    cost nothing. With failed links, a transfer whose dimension-order route
    crosses one takes the shortest route around them (:func:`route`).

    Args:
        schedule: the collective; ``schedule.num_ranks`` must equal
            ``topology.num_chips``.
        topology: the torus the ranks live on (rank r is chip r).
        link: bandwidth and latency of one directed link.
        faults: slowed and failed links (None: every link healthy).

    Returns:
        A :class:`ScheduleCost` (simulated seconds, per-phase seconds,
        bytes per directed link).

    Raises:
        ScheduleError: the schedule's ``num_ranks`` differs from the
            topology's ``num_chips``.
        TopologyError: a fault names a link the topology lacks, or failed
            links cut a transfer's source off from its destination.
    """
    faults = _checked_faults(faults, topology)
    if schedule.num_ranks != topology.num_chips:
        raise ScheduleError(
            f"schedule {schedule.name!r} has num_ranks={schedule.num_ranks} but topology "
            f"{topology.name} has {topology.num_chips} chips: they must be equal"
        )
    return price(schedule_phases(schedule), topology, link, faults)


def collective_cost(op: str, topology: Torus, num_elements: int, link: LinkSpec, *,
                    algorithm: str | None = None, itemsize: int = 4,
                    faults: LinkFaults | None = None, fast: bool = True, shift: int = 1,
                    axis: int = 0) -> ScheduleCost:
    """Simulated cost of a collective over the whole torus, by any algorithm of the
    registry (:mod:`interconnect.registry`).

    The registry's phases (built as arrays where it has an array builder:
    ``interconnect.registry.FAST_PATHS``) priced by :func:`price`: a v5p
    16x20x28 torus allreduce takes well under a second.

    Args:
        op: the operation (``interconnect.OPS``).
        topology: the torus.
        num_elements: elements per rank's buffer.
        link: bandwidth and latency of a healthy directed link.
        algorithm: one of ``ALGORITHMS[op]`` (None: the op's default).
        itemsize: bytes per element.
        faults: slowed / failed links.
        fast: False reads the phases off the Transfer schedule even where an
            array builder exists (the reference the tests compare with).
        shift: ppermute only: places each buffer moves.
        axis: ppermute only: the torus axis it moves along.

    Returns:
        The :class:`ScheduleCost`.

    Raises:
        ScheduleError: unknown op / algorithm or bad counts.
        TopologyError: a fault names a missing link, or failures cut a route.
    """
    from interconnect.registry import collective_phases

    checked = _checked_faults(faults, topology)
    phases = collective_phases(op, topology, num_elements, itemsize, algorithm, shift=shift,
                               axis=axis, arrays=fast)
    return price(phases, topology, link, checked)
