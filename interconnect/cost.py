"""The one collective-cost engine: simulated time of a collective on a topology, where
contention lives.

Every collective reaches the clock here, as :class:`~interconnect.phases.PairPhases`
(the pairs of ranks that send and each pair's bytes per phase: built as arrays by
the registry's builders, :mod:`interconnect.registry`, or read off any
:class:`Schedule`), priced by :func:`price`, once per call, for every group of a
mesh axis at once.

Model. Phases run one after the other. In a phase every pair that sends is
routed with :meth:`~interconnect.topology.Torus.route` (around failed links where
it must, :func:`~interconnect.faults.route`) and adds its bytes to every directed
link on its route. The links all run in parallel; the busiest one decides, and a
message pays ``latency_s`` per hop::

    phase_seconds = max_link bytes(link) / W_achieved(k) + latency_s x max_transfer hops(transfer)
    seconds       = collective_fixed_s + sum of phase_seconds

``W_achieved(k) = W x efficiency x k ** -multi_link_exponent``
(:meth:`LinkSpec.achieved_bandwidth_bytes_per_s`), where ``k`` is the
largest number of outgoing links any one chip drives in that phase; the
fixed cost is paid once by every collective over 2 or more chips. With the
default :class:`LinkSpec` (efficiency 1, no exponent, no fixed cost) this is
the textbook model: on a full unidirectional ring a ring allreduce of ``V``
bytes per chip takes ``2 (n-1)/n x V / W`` plus ``2 (n-1) x latency_s``
([SB]). :mod:`interconnect.calibration` holds the fitted constants. A pair of
two devices of one chip (the TensorCores of v2 / v3) loads no link: it is an
on-chip copy beside the phase.

An empty phase (or one with only zero-byte transfers, which are not sent)
takes 0 s. Two transfers sharing a link in one phase take twice the
bandwidth time of one: that is the contention.

One fast path stays: a direct all-to-all whose groups are blocks of the torus has its
messages per link in closed form (:mod:`interconnect.all_to_all`; ``g^2`` pairs are
not routed one by one: 16,384 chips in well under a second), priced by the same
phase formula (:func:`_closed_form_cost`). The six hand-vectorised costs that
re-derived the formula per algorithm were removed (issue 31) after
``benchmarks/collective_engine.py`` showed none more than 3x faster than this engine
on what plans and sweeps cost (BENCHMARKS.md, "One collective-cost engine").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from interconnect.all_to_all import torus_link_counts
from interconnect.errors import ScheduleError, TopologyError
from interconnect.faults import LinkFaults, route
from interconnect.link import LinkSpec
from interconnect.phases import PairPhases, schedule_phases
from interconnect.schedule import Schedule, _check_counts
from interconnect.topology import Torus, link_ids, link_of_id

__all__ = ["ScheduleCost", "price", "schedule_cost", "schedule_time", "collective_cost",
           "cost_work", "check_cost_work", "MAX_COST_WORK"]


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
    16x20x28 torus allreduce takes well under a second. A direct all-to-all
    without failed links takes its link loads in closed form
    (:mod:`interconnect.all_to_all`: the same integers as routing every pair).

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
        ScheduleError: unknown op / algorithm or bad counts; a cost past
            ``MAX_COST_WORK`` (``check_cost_work``), refused before it starts.
        TopologyError: a fault names a missing link, or failures cut a route.
    """
    from interconnect.registry import ALGORITHMS, check_algorithm

    algorithm = algorithm or ALGORITHMS.get(op, ("",))[0]
    entry = check_algorithm(op, algorithm)
    checked = _checked_faults(faults, topology)
    check_cost_work(op, topology, algorithm, checked)
    if fast and op == "all_to_all" and not checked.failed:  # closed form: no pair routed
        n, num_elements, itemsize = _check_counts(topology, num_elements, itemsize)
        if num_elements % n:
            entry.build_phases(topology, num_elements, itemsize)  # its one-line refusal
        counts, max_hops = torus_link_counts(topology)
        return _closed_form_cost(topology, counts, max_hops, num_elements // n * itemsize,
                                 link, checked)
    phases = entry.build_phases(topology, num_elements, itemsize, arrays=fast, shift=shift,
                                axis=axis)
    return price(phases, topology, link, checked)


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
# The engine
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
    return np.concatenate(edge_parts), np.concatenate(id_parts), np.concatenate(hop_parts)


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
    srcs, dsts = link_of_id(topology, used)
    link_bytes = dict(zip(zip(srcs.tolist(), dsts.tolist(), strict=True), totals[used].tolist(),
                          strict=True))
    busiest_seconds = (float((totals * factors).max()) / link.achieved_bandwidth_bytes_per_s(1)
                       if used.size else 0.0)
    fixed = link.collective_fixed_s if topology.num_chips >= 2 else 0.0
    return ScheduleCost(seconds=fixed + float(sum(phase_seconds)),
                        phase_seconds=tuple(phase_seconds), link_bytes=link_bytes,
                        busiest_link_seconds=busiest_seconds, fixed_seconds=fixed)


def _closed_form_cost(topology: Torus, counts: np.ndarray, max_hops: int, piece_bytes: int,
                      link: LinkSpec, faults: LinkFaults | None) -> ScheduleCost:
    """A direct all-to-all's cost from its messages per link (``counts``: (n x 2 ndim,)
    int64 by link id, ``interconnect.all_to_all.block_link_counts``) and its longest
    route: one phase priced as :func:`price` prices one (the same link loads, so the same
    figures to the bit; tests/interconnect/test_all_to_all_closed_form.py)."""
    factors, slowed = _slowdowns(topology, faults)
    loads = counts * piece_bytes
    seconds = (_phase_seconds(topology, loads, slowed, max_hops, link)
               if piece_bytes and counts.any() else 0.0)
    return _cost_of(topology, [seconds] if piece_bytes and counts.any() else [], loads,
                    factors, link)


# ------------------------------------------------------------------------------
# How much work a cost takes, in closed form: refused before it starts
# ------------------------------------------------------------------------------

#: Most work one collective's cost may take, in ``cost_work`` units (about 10 ns of CPU
#: each here: 2^28 is about 3 s), checked before anything is built per chip or pair.
MAX_COST_WORK = 1 << 28
#: A Transfer object built, routed and costed, in ``cost_work`` units (about 10 us), and
#: each hop of its route (about 1 us).
_TRANSFER_WORK, _HOP_WORK = 1000, 100


def cost_work(op: str, topology: Torus, algorithm: str | None = None,
              faults: LinkFaults | None = None) -> int:
    """About how much work costing ``op`` by ``algorithm`` on ``topology`` takes, in
    closed form, in units of one link's bytes updated in one phase (about 10 ns of CPU
    here), fitted on this code's paths (``benchmarks``-style CPU times, 2 cores):

    - all-to-all (closed form, ``interconnect.all_to_all``) and ppermute (one phase of
      arrays): ``L`` (the links, n x 2 ndim);
    - ``ring`` (arrays, :func:`price`): ``2 (n - 1) L`` (a bincount over the links per
      phase; 1-D 4,096 chips: 1.4 s);
    - ``torus`` (per axis): ``sum_d (a_d L + n a_d^2)`` (the chains of each axis; 1-D
      512: 1.3 s, 16x32x32: 0.7 s); ``bidirectional_ring``: the same over one ring of
      ``n`` (8x8x8: 1.5 s);
    - schedules built Transfer by Transfer (other algorithms, or failed links): the
      transfers x (``_TRANSFER_WORK`` + ``_HOP_WORK`` x their hops; half the diameter
      when they are not ring neighbours): halving-doubling ``2 n log2 n`` transfers
      (16x16x16: 1.9 s), tree ``2 n`` (16x32x32: 0.9 s), pipelined-ring broadcast
      ``2 n^2`` of one hop, ppermute ``n``, all-to-all with failed links ``n^2``.

    Returns:
        The estimate (an int; compare with ``MAX_COST_WORK``).
    """
    from interconnect.registry import FAST_PATHS

    algorithm = algorithm or {"all_to_all": "direct", "broadcast": "pipelined_ring",
                              "ppermute": "direct"}.get(op, "torus")
    n, links = topology.num_chips, topology.num_chips * 2 * topology.ndim
    failed = bool(faults is not None and faults.failed)
    axes = [a for a in topology.shape if a > 1]
    if (op, algorithm) in FAST_PATHS and not failed:
        if op in ("all_to_all", "ppermute"):
            return links
        if algorithm == "ring":
            return 2 * max(n - 1, 0) * links
        rings = axes if algorithm == "torus" else [n]
        return sum(a * links + n * a * a for a in rings)
    half_diameter = max(1, sum(a // 2 if topology.axis_wraps(d) else a - 1
                               for d, a in enumerate(topology.shape)) // 2)
    log_n = max(1, (n - 1).bit_length())
    transfers, hops = {
        "ring": (2 * n * n, 1), "pipelined_ring": (2 * n * n, 1),
        "halving_doubling": (2 * n * log_n, half_diameter), "tree": (2 * n, half_diameter),
        "direct": (n * n if op == "all_to_all" else n, half_diameter),
    }.get(algorithm, (sum(a * n for a in (axes if algorithm == "torus" else [n])), 1))
    return transfers * (_TRANSFER_WORK + _HOP_WORK * hops)


def check_cost_work(op: str, topology: Torus, algorithm: str | None = None,
                    faults: LinkFaults | None = None, *, calls: int = 1,
                    limit: int = MAX_COST_WORK) -> int:
    """``cost_work`` of ``calls`` costs (one per message size), refused past ``limit``.

    Raises:
        ScheduleError: one line naming the op, the algorithm, the torus and the limit.
    """
    work = cost_work(op, topology, algorithm, faults) * calls
    if work > limit:
        sizes = f"{calls} sizes of " if calls > 1 else ""
        raise ScheduleError(
            f"costing {sizes}{op} by {algorithm} on a {topology.name} torus "
            f"({topology.num_chips:,} chips) is about {work:.2g} units of work, more than the "
            f"{limit:.2g} allowed (seconds of CPU); choose another algorithm, fewer sizes or "
            "a smaller torus")
    return work
