"""Collectives on sub-groups: every group of one mesh axis running at once.

A sharded step runs collectives over the devices along one mesh axis (a
*group*: the devices that differ only in that axis's index). Every group of
the axis runs the same collective at the same time, so they share the
torus's links where their routes meet. Here a group's collective is a ring
over the group in the order given (``pod.config.mesh.Mesh.groups(axis)``
returns it in ring order: consecutive devices neighbours, or as near as the
layout allows), built on local positions ``0..g-1`` by the ring builders of
:mod:`interconnect.collectives`, then *re-labelled* onto torus ranks; the
groups' phases are aligned (phase ``s`` of the result holds phase ``s`` of
every group), so :func:`interconnect.cost.schedule_cost` sees the
contention of groups that share links, and every transfer is routed over
real links (dimension-order routes, so a step of a ring that is not a
neighbour pays its hops).

A mesh axis laid over two or three torus axes (a sub-torus) is one ring over
the sub-torus in the mesh's ring order, not the multi-axis chains of
:mod:`interconnect.chains`: the ring is what the functional transport runs,
so the clock and the bytes moved agree. It is slower than the chains on a
large sub-torus (one direction of one axis at a time); the next issue's
pod-scale work may switch the cost to the chains.

Groups are device ids. With one device per chip (v4 / v5p megacore, v5e,
v6e) a device id is its torus rank. On v2 / v3 each TensorCore is a device
(``devices_per_chip = 2``, device ``d`` on chip ``d // 2``): two devices of
one chip share its ICI links (the groups of both cores load the same
links, which the phase's busiest link sees), and a ring step between the
two TensorCores of one chip moves no ICI byte; it is an on-chip copy
charged at ``on_chip_bytes_per_s`` (the pod passes one TensorCore's HBM
bandwidth: an assumption, there is no published core-to-core figure; see
VALIDATION.md), in parallel with the phase's ICI transfers (the phase
takes the longer). Only the fast path (:func:`group_ring_cost`) takes
several devices per chip; failed links (the schedule path) are refused
there.
"""

from __future__ import annotations

from collections.abc import Sequence

from interconnect.collectives import ring_all_gather, ring_allreduce, ring_reduce_scatter
import numpy as np

from interconnect.cost import ScheduleCost, _cost_of, _link_ids, _phase_seconds, schedule_cost
from interconnect.errors import ScheduleError
from interconnect.faults import LinkFaults
from interconnect.link import LinkSpec
from interconnect.schedule import Schedule, _make_transfer, _trusted_schedule
from interconnect.topology import Torus

__all__ = ["GROUP_OPS", "group_ring_schedule", "concurrent_group_schedule",
           "group_collective_cost", "group_ring_cost"]

#: The operations a group collective performs (the device program's three).
GROUP_OPS = ("allreduce", "reduce_scatter", "all_gather")

_BUILDERS = {"allreduce": ring_allreduce, "reduce_scatter": ring_reduce_scatter,
             "all_gather": ring_all_gather}


def group_ring_schedule(op: str, size: int, num_elements: int, itemsize: int = 4) -> Schedule:
    """One group's ring collective on local positions ``0..size-1`` (ring order).

    Position ``p`` sends to ``p + 1`` (mod ``size``). As the ring builders: a
    reduce-scatter leaves position ``p`` owning chunk ``(p + 1) mod size``;
    an all-gather expects it to hold that chunk.

    Args:
        op: allreduce, reduce_scatter or all_gather.
        size: devices in the group, >= 1.
        num_elements: elements of each device's buffer, >= 0.
        itemsize: bytes per element.

    Returns:
        A Schedule over ``size`` ranks: ``size - 1`` phases (``2 (size - 1)``
        for an allreduce) of ``size`` transfers each.

    Raises:
        ScheduleError: an unknown op or a size below 1.
    """
    if op not in _BUILDERS:
        raise ScheduleError(f"group collective {op!r} is not valid: expected one of "
                            f"{', '.join(GROUP_OPS)}")
    if not isinstance(size, int) or size < 1:
        raise ScheduleError(f"group size {size!r} is not valid: expected an int >= 1")
    return _BUILDERS[op](Torus((size,), wraparound=(True,)), num_elements, itemsize)


def _checked_groups(groups: Sequence[Sequence[int]], num_ranks: int) -> list[tuple[int, ...]]:
    """The groups as tuples of ints, checked: equal sizes, disjoint, ranks in range.

    Raises:
        ScheduleError: as :func:`concurrent_group_schedule`.
    """
    groups = [tuple(int(r) for r in g) for g in groups]
    sizes = {len(g) for g in groups}
    if len(sizes) > 1:
        raise ScheduleError(f"groups of sizes {sorted(sizes)}: every group of one axis must "
                            "have the same size")
    flat = [r for g in groups for r in g]
    if len(set(flat)) != len(flat):
        raise ScheduleError("a rank appears twice in the groups: groups must be disjoint (as "
                            "chip ranks: a group's devices on different chips)")
    if any(not 0 <= r < num_ranks for r in flat):
        raise ScheduleError(f"a group names a rank outside 0..{num_ranks - 1}")
    return groups


def concurrent_group_schedule(op: str, groups: Sequence[Sequence[int]], num_ranks: int,
                              num_elements: int, itemsize: int = 4) -> Schedule:
    """Every group's ring collective at once, re-labelled onto torus ranks.

    Args:
        op: allreduce, reduce_scatter or all_gather.
        groups: disjoint groups of equal size, each the torus ranks of its
            devices in ring order (``Mesh.groups(axis)`` mapped to chips).
        num_ranks: chips of the torus (ranks outside every group take no part).
        num_elements: elements of each device's buffer.
        itemsize: bytes per element.

    Returns:
        A Schedule over ``num_ranks`` ranks whose phase ``s`` holds phase ``s``
        of every group; ``owned_chunks[r]`` (reduce-scatter, all-gather) is the
        chunk rank ``r`` owns in its group (0 for ranks in no group).

    Raises:
        ScheduleError: groups of different sizes, a rank twice (two devices of
            one chip in a group, or overlapping groups), or a rank outside
            ``0..num_ranks-1``.
    """
    groups = _checked_groups(groups, num_ranks)
    size = len(groups[0]) if groups else 1
    local = group_ring_schedule(op, size, num_elements, itemsize)
    phases = tuple(tuple(_make_transfer((g[t.src], g[t.dst], t.chunk, t.nbytes, t.reduce,
                                         t.dst_chunk)) for g in groups for t in phase)
                   for phase in local.phases)
    owned = ()
    if local.owned_chunks:
        table = [0] * num_ranks
        for g in groups:
            for position, rank in enumerate(g):
                table[rank] = local.owned_chunks[position]
        owned = tuple(table)
    return _trusted_schedule(name=f"group_{local.name}", num_ranks=num_ranks,
                             num_elements=local.num_elements, itemsize=itemsize,
                             chunk_bounds=local.chunk_bounds, phases=phases, op=local.op,
                             owned_chunks=owned, root=0)


def group_collective_cost(op: str, topology: Torus, groups: Sequence[Sequence[int]],
                          num_elements: int, link: LinkSpec, itemsize: int = 4,
                          faults: LinkFaults | None = None, *, devices_per_chip: int = 1,
                          on_chip_bytes_per_s: float | None = None) -> ScheduleCost:
    """Simulated cost of every group's collective running at once.

    :func:`concurrent_group_schedule` costed by :func:`schedule_cost` (per phase
    the busiest link, contention between groups included, plus per-hop
    latency and the collective's fixed cost once). Groups of one device cost
    nothing (no transfer, no fixed cost).

    Args:
        op: allreduce, reduce_scatter or all_gather.
        topology: the chips' torus.
        groups: the groups as device ids (device ``d`` on torus rank
            ``d // devices_per_chip``), each in ring order.
        num_elements: elements of each device's buffer (the full buffer: for
            an all-gather, the gathered result).
        link: the (calibrated) link.
        itemsize: bytes per element.
        faults: slowed and failed links.
        devices_per_chip: devices per chip (2 for the TensorCores of v2 / v3).
        on_chip_bytes_per_s: bandwidth of a ring step between two devices of
            one chip, bytes/s (required when ``devices_per_chip > 1``).

    Returns:
        The :class:`ScheduleCost` (simulated seconds, bytes per directed link).

    Raises:
        ScheduleError, TopologyError: as the builders and :func:`schedule_cost`;
            several devices per chip without ``on_chip_bytes_per_s`` or with
            failed links.
    """
    if all(len(g) <= 1 for g in groups):
        return ScheduleCost(seconds=0.0, phase_seconds=(), link_bytes={})
    if not isinstance(devices_per_chip, int) or devices_per_chip < 1:
        raise ScheduleError(f"devices_per_chip {devices_per_chip!r} is not valid: expected an "
                            "int >= 1")
    if faults is None or not faults.failed:
        group_ring_schedule(op, 1, 0)  # checks the op
        groups = _checked_groups(groups, topology.num_chips * devices_per_chip)
        if devices_per_chip > 1 and not (on_chip_bytes_per_s is not None
                                         and np.isfinite(on_chip_bytes_per_s)
                                         and on_chip_bytes_per_s > 0):
            raise ScheduleError(f"on_chip_bytes_per_s {on_chip_bytes_per_s!r} is not valid: "
                                "several devices per chip need the bandwidth of a copy between "
                                "two devices of one chip, a positive number of bytes/s")
        return group_ring_cost(op, topology, groups, num_elements, link, itemsize, faults,
                               devices_per_chip=devices_per_chip,
                               on_chip_bytes_per_s=on_chip_bytes_per_s)
    if devices_per_chip > 1:
        raise ScheduleError("failed links with several devices per chip (v2 / v3 TensorCores) "
                            "are not modelled: the rerouted schedule has chip ranks only")
    schedule = concurrent_group_schedule(op, groups, topology.num_chips, num_elements, itemsize)
    return schedule_cost(schedule, topology, link, faults)


def _routes(topology: Torus, srcs: np.ndarray, dsts: np.ndarray
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every (src, dst) pair's dimension-order route (``Torus.route``), vectorised.

    Returns:
        (edge, link id, hops), one entry per hop of every route: the index of
        the pair, the link's id (``interconnect.cost._link_ids``) and the
        length of the pair's route.
    """
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
    edge, ids = [], []
    for axis, size in enumerate(topology.shape):
        for k in range(int(counts[axis].max(initial=0))):
            moving = np.flatnonzero(counts[axis] > k)
            c = coords[moving, axis]
            nc = (c + steps[axis][moving]) % size
            nxt = current[moving] + (nc - c) * strides[axis]
            edge.append(moving)
            ids.append(_link_ids(topology, current[moving], nxt))
            current[moving], coords[moving, axis] = nxt, nc
    edge = np.concatenate(edge) if edge else np.zeros(0, np.int64)
    ids = np.concatenate(ids) if ids else np.zeros(0, np.int64)
    return edge, ids, hops[edge]


def group_ring_cost(op: str, topology: Torus, groups: Sequence[Sequence[int]],
                    num_elements: int, link: LinkSpec, itemsize: int = 4,
                    faults: LinkFaults | None = None, *, devices_per_chip: int = 1,
                    on_chip_bytes_per_s: float | None = None) -> ScheduleCost:
    """The fast path of :func:`group_collective_cost`: the same seconds and link bytes
    as ``schedule_cost(concurrent_group_schedule(...))`` without a Transfer per message.

    Every phase of a ring sends one part from every ring position to the next,
    so each ring edge (position ``i`` to ``i + 1`` of every group) is routed
    once; phase ``s`` only changes which part an edge carries (reduce-scatter:
    part ``(i - s) mod g``; all-gather: ``(i + 1 - s) mod g``, as the ring
    builders of :mod:`interconnect.collectives`). A phase is then one bincount
    of bytes per link, costed as :func:`schedule_cost` costs it (busiest link at
    the achieved bandwidth of the chips' driven links, plus latency times the
    longest route of a sent message). When the parts are equal (the buffer
    splits evenly) every phase has the same loads and is costed once. Pods of
    thousands of chips cost in well under a second (the schedule path builds
    millions of transfers).

    A ring edge between two devices of one chip (v2 / v3 TensorCores) loads
    no link; its part takes ``bytes / on_chip_bytes_per_s`` beside the
    phase's ICI transfers, and the phase takes the longer of the two.

    Args:
        op, topology, groups, num_elements, link, itemsize, devices_per_chip,
            on_chip_bytes_per_s: as :func:`group_collective_cost` (groups
            checked by the caller).
        faults: slowed links only (failed links reroute: the schedule path).

    Returns:
        The :class:`ScheduleCost`.
    """
    size = len(groups[0])
    rings = np.asarray(groups, dtype=np.int64).reshape(len(groups), size)       # (R, g)
    nlinks = topology.num_chips * 2 * topology.ndim
    factors = np.ones(nlinks)
    for (src, dst), factor in (faults.slowdowns.items() if faults is not None else ()):
        factors[_link_ids(topology, np.array([src]), np.array([dst]))[0]] = factor
    slowed = factors if faults is not None and faults.slowdowns else None
    srcs = rings.reshape(-1) // devices_per_chip                             # edge i of ring r
    dsts = np.roll(rings, -1, axis=1).reshape(-1) // devices_per_chip
    edge, ids, hop = _routes(topology, srcs, dsts)                           # on-chip: no hop
    on_chip = np.flatnonzero(srcs == dsts) % size                            # their positions
    pos = edge % size                                                        # its ring position
    k = np.arange(size)
    parts = (num_elements // size + (k < num_elements % size)) * itemsize   # (g,) bytes
    uniform = bool((parts == parts[0]).all())
    totals = np.zeros(nlinks, dtype=np.int64)
    memo: dict[str, tuple[np.ndarray, float]] = {}

    def phase(shift: int) -> float:
        """One phase: part ``(i + shift) mod g`` leaves every position ``i``."""
        if uniform and "all" in memo:
            loads, seconds = memo["all"]
        else:
            nbytes = parts[(pos + shift) % size]
            loads = np.bincount(ids, weights=nbytes, minlength=nlinks).astype(np.int64)
            sent = nbytes > 0
            seconds = (_phase_seconds(topology, loads, slowed, int(hop[sent].max()), link)
                       if sent.any() else 0.0)
            if on_chip.size:
                copied = int(parts[(on_chip + shift) % size].max())
                seconds = max(seconds, copied / on_chip_bytes_per_s)
            memo["all"] = (loads, seconds)
        totals[:] += loads
        return seconds

    seconds = []
    if op in ("allreduce", "reduce_scatter"):
        seconds += [phase(-s) for s in range(size - 1)]
    if op in ("allreduce", "all_gather"):
        seconds += [phase(1 - s) for s in range(size - 1)]
    return _cost_of(topology, seconds, totals, factors, link)
