"""Collectives on sub-groups: every group of one mesh axis running at once.

A sharded step runs collectives over the devices along one mesh axis (a
*group*: the devices that differ only in that axis's index). Every group of
the axis runs the same collective at the same time, so they share the
torus's links where their routes meet. A group's collective is built on
local positions ``0..g-1`` (by the ring builders of
:mod:`interconnect.collectives` or the multi-axis chains of
:mod:`interconnect.chains`), then *re-labelled* onto torus ranks; the
groups' phases are aligned (phase ``s`` of the result holds phase ``s`` of
every group), so :func:`interconnect.cost.schedule_cost` sees the
contention of groups that share links, and every transfer is routed over
real links (dimension-order routes, so a step of a ring that is not a
neighbour pays its hops).

Two algorithms (``algorithm``, :data:`GROUP_ALGORITHMS`):

- ``"xla"``: the collective as XLA runs it on a TPU slice ([SB] sharding.md,
  "multi-axis torus"): over every torus axis the group spans at once, in
  both directions. A group lies on a block of the torus (a mesh axis takes
  one block of each torus axis it spans, ``pod.config.mesh.AxisBlock``):
  its ``group_torus`` gives the block's shape and which of its axes close
  into rings, and the group lists its devices in row-major order of it. The
  collective is the multi-axis schedule of :mod:`interconnect.chains`
  (``"torus"``) built on that small torus and re-labelled onto the chips: a
  step along a block with stride ``s`` (the outer part of a split axis)
  travels ``s`` hops, and the groups that interleave on those links
  contend. Bandwidth term ``(n-1)/n x V / (W_bidi x m)`` for a group of
  ``n`` devices over ``m`` equal axes with wraparound, twice that on lines.
- ``"ring"``: one unidirectional ring per group in the order given
  (``Mesh.groups(axis, "ring")``: consecutive devices neighbours, or as
  near as the layout allows), laid through the whole sub-torus; one
  link per device per phase: ``(n-1)/n x V / W``. What the functional
  transport runs; kept for teaching and tests.

Groups are device ids. With one device per chip (v4 / v5p megacore, v5e,
v6e) a device id is its torus rank. On v2 / v3 each TensorCore is a device
(``devices_per_chip = 2``, device ``d`` on chip ``d // 2``): two devices of
one chip share its ICI links (the groups of both cores load the same
links, which the phase's busiest link sees), and a ring step between the
two TensorCores of one chip moves no ICI byte; it is an on-chip copy
charged at ``on_chip_bytes_per_s`` (the pod passes one TensorCore's HBM
bandwidth: an assumption, there is no published core-to-core figure; see
VALIDATION.md), in parallel with the phase's ICI transfers (the phase
takes the longer). Only the fast paths (:func:`group_ring_cost`,
:func:`group_torus_cost`) take several devices per chip; failed links (the
schedule path) are refused there. With ``"xla"`` a block may be the two
TensorCores of a chip (an axis of the group torus of size 2 whose steps
stay on a chip).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np

from interconnect.all_to_all import block_link_counts, torus_link_counts
from interconnect.chains import axis_reduce_scatter_phases, build_axis_collective
from interconnect.collectives import (
    all_to_all,
    ring_all_gather,
    ring_allreduce,
    ring_reduce_scatter,
)
from interconnect.cost import (
    ScheduleCost,
    _all_to_all_cost,
    _cost_of,
    _phase_seconds,
    _slowdowns,
    schedule_cost,
)
from interconnect.errors import ScheduleError
from interconnect.faults import LinkFaults
from interconnect.link import LinkSpec
from interconnect.schedule import Schedule, _make_transfer, _trusted_schedule
from interconnect.topology import Torus, link_ids, link_of_id

__all__ = ["GROUP_OPS", "GROUP_ALGORITHMS", "group_ring_schedule", "group_torus_schedule",
           "concurrent_group_schedule", "group_collective_cost", "group_ring_cost",
           "group_torus_cost", "group_ppermute_schedule", "group_ppermute_cost",
           "group_all_to_all_cost", "pair_permute_cost"]

#: The operations a group collective performs (the device program's four; all_to_all is
#: direct under either algorithm: every message on its own dimension-order route).
GROUP_OPS = ("allreduce", "reduce_scatter", "all_gather", "all_to_all")

#: How a group collective runs: "xla" (every torus axis of the group's block at once,
#: both directions) or "ring" (one unidirectional ring per group); see the module docstring.
GROUP_ALGORITHMS = ("xla", "ring")

_BUILDERS = {"allreduce": ring_allreduce, "reduce_scatter": ring_reduce_scatter,
             "all_gather": ring_all_gather, "all_to_all": all_to_all}


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
    _check_op(op)
    if not isinstance(size, int) or size < 1:
        raise ScheduleError(f"group size {size!r} is not valid: expected an int >= 1")
    return _BUILDERS[op](Torus((size,), wraparound=(True,)), num_elements, itemsize)


def _checked_groups(groups: Sequence[Sequence[int]], num_ranks: int) -> list[tuple[int, ...]]:
    """The groups as tuples of ints, checked: equal sizes, disjoint, ranks in range.

    Raises:
        ScheduleError: as :func:`concurrent_group_schedule`.
    """
    checked = [tuple(int(r) for r in g) for g in groups]
    sizes = {len(g) for g in checked}
    if len(sizes) > 1:
        raise ScheduleError(f"groups of sizes {sorted(sizes)}: every group of one axis must "
                            "have the same size")
    flat = [r for g in checked for r in g]
    if len(set(flat)) != len(flat):
        raise ScheduleError("a rank appears twice in the groups: groups must be disjoint (as "
                            "chip ranks: a group's devices on different chips)")
    if any(not 0 <= r < num_ranks for r in flat):
        raise ScheduleError(f"a group names a rank outside 0..{num_ranks - 1}")
    return checked


def group_torus_schedule(op: str, group_torus: Torus, num_elements: int,
                         itemsize: int = 4) -> Schedule:
    """One group's XLA-style collective on local ranks ``0..n-1`` of its own torus.

    The multi-axis schedule of :func:`interconnect.chains.build_axis_collective`
    (``"torus"``): the buffer cut into one part per axis of size >= 2, each
    part reduced over the axes in a rotated order, every axis used in both
    directions (a ring where it wraps, a line where it does not). Local rank
    ``r`` is the group's ``r``-th device in row-major order of
    ``group_torus``; a reduce-scatter leaves it owning the elements
    ``chunk_bounds(num_elements, n)[r]``.

    Args:
        op: allreduce, reduce_scatter or all_gather.
        group_torus: the block of the torus the group occupies (shape and
            wraparound per block axis).
        num_elements: elements of each device's buffer (all-gather: the
            gathered result), >= 0.
        itemsize: bytes per element (2 for bf16).

    Returns:
        A Schedule over ``group_torus.num_chips`` ranks.

    Raises:
        ScheduleError: an unknown op or bad counts.
    """
    _check_op(op)
    return build_axis_collective(op, group_torus, num_elements, itemsize, "torus")


def _check_op(op: str) -> None:
    if op not in _BUILDERS:
        raise ScheduleError(f"group collective {op!r} is not valid: expected one of "
                            f"{', '.join(GROUP_OPS)}")


def _check_algorithm(algorithm: str) -> None:
    if algorithm not in GROUP_ALGORITHMS:
        raise ScheduleError(f"group algorithm {algorithm!r} is not valid: expected one of "
                            f"{', '.join(GROUP_ALGORITHMS)}")


def _checked_group_torus(group_torus: Torus | None, size: int) -> Torus:
    """The group's torus, checked against the group size (None: one closed ring).

    Raises:
        ScheduleError: not a Torus, or a torus of another number of ranks.
    """
    if group_torus is None:
        return Torus((max(size, 1),), wraparound=(True,))
    if not isinstance(group_torus, Torus):
        raise ScheduleError(f"group_torus {group_torus!r} is not valid: expected an "
                            "interconnect.Torus (the block of the torus a group occupies)")
    if group_torus.num_chips != size:
        raise ScheduleError(f"group_torus {group_torus.name} has {group_torus.num_chips} ranks "
                            f"but the groups have {size} devices: they must be equal")
    return group_torus


def concurrent_group_schedule(op: str, groups: Sequence[Sequence[int]], num_ranks: int,
                              num_elements: int, itemsize: int = 4, *, algorithm: str = "ring",
                              group_torus: Torus | None = None) -> Schedule:
    """Every group's collective at once, re-labelled onto torus ranks.

    Args:
        op: allreduce, reduce_scatter or all_gather.
        groups: disjoint groups of equal size, as torus ranks: in ring order
            for ``"ring"`` (``Mesh.groups(axis, "ring")``), in row-major order
            of ``group_torus`` for ``"xla"`` (``Mesh.groups(axis, "mesh")``).
        num_ranks: chips of the torus (ranks outside every group take no part).
        num_elements: elements of each device's buffer.
        itemsize: bytes per element.
        algorithm: ``"ring"`` (:func:`group_ring_schedule`) or ``"xla"``
            (:func:`group_torus_schedule`).
        group_torus: ``"xla"`` only: the block every group occupies (None:
            one closed ring in the order given).

    Returns:
        A Schedule over ``num_ranks`` ranks whose phase ``s`` holds phase ``s``
        of every group; ``owned_chunks[r]`` (reduce-scatter, all-gather) is the
        chunk rank ``r`` owns in its group (0 for ranks in no group).

    Raises:
        ScheduleError: groups of different sizes, a rank twice (two devices of
            one chip in a group, or overlapping groups), a rank outside
            ``0..num_ranks-1``, an unknown op or algorithm, or a group torus
            whose size is not the groups'.
    """
    _check_algorithm(algorithm)
    groups = _checked_groups(groups, num_ranks)
    size = len(groups[0]) if groups else 1
    if algorithm == "ring" or op == "all_to_all":  # direct: the routes are the torus's
        local = group_ring_schedule(op, size, num_elements, itemsize)
    else:
        local = group_torus_schedule(op, _checked_group_torus(group_torus, size), num_elements,
                                     itemsize)
    phases = tuple(tuple(_make_transfer((g[t.src], g[t.dst], t.chunk, t.nbytes, t.reduce,
                                         t.dst_chunk)) for g in groups for t in phase)
                   for phase in local.phases)
    owned: tuple[int, ...] = ()
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
                          on_chip_bytes_per_s: float | None = None, algorithm: str = "ring",
                          group_torus: Torus | None = None) -> ScheduleCost:
    """Simulated cost of every group's collective running at once.

    :func:`concurrent_group_schedule` costed by :func:`schedule_cost` (per phase
    the busiest link, contention between groups included, plus per-hop
    latency and the collective's fixed cost once), by the fast paths
    (:func:`group_ring_cost`, :func:`group_torus_cost`) unless links have
    failed. Groups of one device cost nothing (no transfer, no fixed cost).

    Args:
        op: allreduce, reduce_scatter or all_gather.
        topology: the chips' torus.
        groups: the groups as device ids (device ``d`` on torus rank
            ``d // devices_per_chip``): in ring order for ``"ring"``, in
            row-major order of ``group_torus`` for ``"xla"``.
        num_elements: elements of each device's buffer (the full buffer: for
            an all-gather, the gathered result).
        link: the (calibrated) link.
        itemsize: bytes per element of what moves (2 for bf16).
        faults: slowed and failed links.
        devices_per_chip: devices per chip (2 for the TensorCores of v2 / v3).
        on_chip_bytes_per_s: bandwidth of a step between two devices of one
            chip, bytes/s (required when ``devices_per_chip > 1``).
        algorithm: ``"ring"`` (default: one unidirectional ring per group) or
            ``"xla"`` (every axis of the group's block at once, both
            directions); :data:`GROUP_ALGORITHMS`, module docstring.
        group_torus: ``"xla"`` only: the block of the torus each group
            occupies, one axis per block (``pod.config.mesh.AxisBlock``: its
            size, and ``wraps``); None: one closed ring in the order given.

    Returns:
        The :class:`ScheduleCost` (simulated seconds, bytes per directed link).

    Raises:
        ScheduleError, TopologyError: as the builders and :func:`schedule_cost`;
            an unknown algorithm; several devices per chip without
            ``on_chip_bytes_per_s`` or with failed links.
    """
    _check_algorithm(algorithm)
    if all(len(g) <= 1 for g in groups):
        return ScheduleCost(seconds=0.0, phase_seconds=(), link_bytes={})
    if not isinstance(devices_per_chip, int) or devices_per_chip < 1:
        raise ScheduleError(f"devices_per_chip {devices_per_chip!r} is not valid: expected an "
                            "int >= 1")
    _check_op(op)
    group_torus = (_checked_group_torus(group_torus, len(groups[0])) if algorithm == "xla"
                   else None)
    if op == "all_to_all" and num_elements % len(groups[0]):
        raise ScheduleError(f"all-to-all needs num_elements ({num_elements}) to be a multiple "
                            f"of the group size {len(groups[0])}")
    if faults is None or not faults.failed:
        groups = _checked_groups(groups, topology.num_chips * devices_per_chip)
        if devices_per_chip > 1 and not (on_chip_bytes_per_s is not None
                                         and np.isfinite(on_chip_bytes_per_s)
                                         and on_chip_bytes_per_s > 0):
            raise ScheduleError(f"on_chip_bytes_per_s {on_chip_bytes_per_s!r} is not valid: "
                                "several devices per chip need the bandwidth of a copy between "
                                "two devices of one chip, a positive number of bytes/s")
        fast = group_ring_cost if algorithm == "ring" else partial(group_torus_cost,
                                                                   group_torus=group_torus)
        if op == "all_to_all":
            fast = group_all_to_all_cost
        return fast(op, topology, groups, num_elements, link, itemsize, faults,
                    devices_per_chip=devices_per_chip, on_chip_bytes_per_s=on_chip_bytes_per_s)
    if devices_per_chip > 1:
        raise ScheduleError("failed links with several devices per chip (v2 / v3 TensorCores) "
                            "are not modelled: the rerouted schedule has chip ranks only")
    schedule = concurrent_group_schedule(op, groups, topology.num_chips, num_elements, itemsize,
                                         algorithm=algorithm, group_torus=group_torus)
    return schedule_cost(schedule, topology, link, faults)


def _ppermute_pairs(groups: Sequence[Sequence[int]], shift: int) -> tuple[np.ndarray, np.ndarray]:
    """(sources, destinations) device ids of every group's permute: position ``i`` of
    each group sends to position ``(i + shift) mod g`` (pairs sending to themselves
    dropped)."""
    rings = np.asarray(groups, dtype=np.int64).reshape(len(groups), -1)       # (R, g)
    dsts = np.roll(rings, -int(shift), axis=1)
    keep = rings != dsts
    return rings[keep], dsts[keep]


def group_ppermute_schedule(groups: Sequence[Sequence[int]], num_ranks: int, num_elements: int,
                            itemsize: int = 4, shift: int = 1) -> Schedule:
    """Every group's collective permute at once, as one phase on torus ranks.

    Position ``i`` of every group (in the order given: ring order for the
    pipeline's stages) sends its whole buffer to position ``(i + shift) mod
    g``, as ``jax.lax.ppermute`` with ``perm = [(i, (i + shift) % g)]``
    (:func:`interconnect.chains.ppermute` on a sub-group).

    Args:
        groups: disjoint groups of equal size, as torus ranks.
        num_ranks: chips of the torus.
        num_elements: elements of each rank's buffer.
        itemsize: bytes per element.
        shift: positions each buffer moves (any int; negative: the other way).

    Returns:
        A Schedule (``op == "ppermute"``, one chunk, at most one phase).

    Raises:
        ScheduleError: as :func:`concurrent_group_schedule`'s group checks.
    """
    groups = _checked_groups(groups, num_ranks)
    srcs, dsts = _ppermute_pairs(groups, shift)
    whole = int(num_elements) * int(itemsize)
    phase = tuple(_make_transfer((int(a), int(b), 0, whole, False, 0))
                  for a, b in zip(srcs.tolist(), dsts.tolist(), strict=True)) if whole else ()
    return _trusted_schedule(name="group_ppermute", num_ranks=num_ranks,
                             num_elements=int(num_elements), itemsize=itemsize,
                             chunk_bounds=((0, int(num_elements)),),
                             phases=(phase,) if phase else (), op="ppermute", owned_chunks=(),
                             root=0)


def group_ppermute_cost(topology: Torus, groups: Sequence[Sequence[int]], num_elements: int,
                        link: LinkSpec, itemsize: int = 4, faults: LinkFaults | None = None, *,
                        shift: int = 1, devices_per_chip: int = 1,
                        on_chip_bytes_per_s: float | None = None) -> ScheduleCost:
    """Simulated cost of every group's collective permute at once (one phase).

    As :func:`schedule_cost` costs :func:`group_ppermute_schedule`: the busiest
    link's bytes at the achieved bandwidth of the links a chip drives, plus
    latency times the longest route, plus the collective's fixed cost; the
    groups contend where their routes share links. On a ring of neighbours
    with ``shift`` 1 every device sends ``V`` bytes over one link: ``V /
    W(1) + latency + fixed`` ([MARIN] measures ``V / W`` plus a hop on v5p
    and v6e). A transfer between two devices of one chip (v2 / v3) loads no
    link: an on-chip copy at ``on_chip_bytes_per_s`` beside the phase (the
    phase takes the longer). Failed links: the schedule path, which routes
    around them.

    Args:
        topology: the chips' torus.
        groups: the groups as device ids (device ``d`` on rank ``d //
            devices_per_chip``), each in the order positions count (ring order).
        num_elements: elements of each device's buffer.
        link: the (calibrated) link.
        itemsize: bytes per element (2 for bf16).
        faults: slowed and failed links.
        shift: positions each buffer moves.
        devices_per_chip: devices per chip (2 for the TensorCores of v2 / v3).
        on_chip_bytes_per_s: bandwidth of a copy between two devices of one chip
            (needed when some pair shares a chip).

    Returns:
        The :class:`ScheduleCost`.

    Raises:
        ScheduleError: bad groups; a pair on one chip without ``on_chip_bytes_per_s``;
            failed links with several devices per chip.
        TopologyError: failed links that cut a pair off.
    """
    groups = _checked_groups(groups, topology.num_chips * devices_per_chip)
    srcs, dsts = _ppermute_pairs(groups, shift)
    if faults is not None and faults.failed and srcs.size and num_elements:
        if devices_per_chip > 1:
            raise ScheduleError("failed links with several devices per chip (v2 / v3 "
                                "TensorCores) are not modelled: the rerouted schedule has chip "
                                "ranks only")
        return schedule_cost(group_ppermute_schedule(groups, topology.num_chips, num_elements,
                                                     itemsize, shift), topology, link, faults)
    return pair_permute_cost(topology, srcs, dsts, num_elements, link, itemsize, faults,
                             devices_per_chip=devices_per_chip,
                             on_chip_bytes_per_s=on_chip_bytes_per_s)


def pair_permute_cost(topology: Torus, sources: Sequence[int] | np.ndarray,
                      targets: Sequence[int] | np.ndarray, num_elements: int, link: LinkSpec,
                      itemsize: int = 4, faults: LinkFaults | None = None, *,
                      devices_per_chip: int = 1,
                      on_chip_bytes_per_s: float | None = None) -> ScheduleCost:
    """Simulated cost of a collective permute given as (source, target) device pairs,
    all sending at once (one phase): XLA's ``collective-permute`` with its
    ``source_target_pairs``, which need not be a shift of equal groups (a pipeline
    without wraparound sends 0 -> 1 -> 2 and nothing back).

    Each source sends its whole buffer on the dimension-order route to its target;
    the phase takes the busiest link's bytes at the achieved bandwidth of the links
    a chip drives, plus latency times the longest route, plus the collective's
    fixed cost (:func:`interconnect.cost.schedule_cost`'s phase; the same figures
    as :func:`group_ppermute_cost` for the pairs of a shift). A pair on one chip
    (v2 / v3 TensorCores) is an on-chip copy at ``on_chip_bytes_per_s`` beside the
    phase (the phase takes the longer); a pair sending to itself moves nothing.

    Args:
        topology: the chips' torus.
        sources, targets: (P,) device ids (device ``d`` on rank ``d // devices_per_chip``).
        num_elements: elements of each source's buffer.
        link: the (calibrated) link.
        itemsize: bytes per element.
        faults: slowed links (failed links: route around them with the schedule of
            :func:`group_ppermute_schedule`, which takes groups).
        devices_per_chip, on_chip_bytes_per_s: as :func:`group_ppermute_cost`.

    Returns:
        The :class:`ScheduleCost`.

    Raises:
        ScheduleError: pairs of different lengths or ranks outside the torus, a
            pair on one chip without ``on_chip_bytes_per_s``, or failed links.
    """
    srcs = np.asarray(sources, dtype=np.int64).reshape(-1)
    dsts = np.asarray(targets, dtype=np.int64).reshape(-1)
    devices = topology.num_chips * devices_per_chip
    if srcs.shape != dsts.shape or (srcs.size and (min(srcs.min(), dsts.min()) < 0
                                                   or max(srcs.max(), dsts.max()) >= devices)):
        raise ScheduleError(f"permute pairs must be equal lists of device ids in 0..{devices - 1}")
    if faults is not None and faults.failed:
        raise ScheduleError("a permute of pairs over failed links is not modelled; give groups "
                            "and a shift (group_ppermute_cost routes around them)")
    keep = srcs != dsts
    srcs, dsts = srcs[keep], dsts[keep]
    whole = int(num_elements) * int(itemsize)
    if srcs.size == 0 or whole == 0:
        return ScheduleCost(seconds=0.0, phase_seconds=(), link_bytes={})
    a, b = srcs // devices_per_chip, dsts // devices_per_chip
    on_chip = a == b
    local = 0.0
    if on_chip.any():
        if not on_chip_bytes_per_s or not np.isfinite(on_chip_bytes_per_s):
            raise ScheduleError(f"on_chip_bytes_per_s {on_chip_bytes_per_s!r} is not valid: a "
                                "permute between two devices of one chip needs a positive "
                                "bandwidth in bytes/s")
        local = whole / on_chip_bytes_per_s
    nlinks = topology.num_chips * 2 * topology.ndim
    factors, slowed = _slowdowns(topology, faults)
    edge, ids, hops = _routes(topology, a[~on_chip], b[~on_chip])
    loads = np.bincount(ids, minlength=nlinks).astype(np.int64) * whole
    seconds = _phase_seconds(topology, loads, slowed, int(hops.max()), link) if ids.size else 0.0
    return _cost_of(topology, [max(seconds, local)], loads, factors, link)


def _routes(topology: Torus, srcs: np.ndarray, dsts: np.ndarray
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every (src, dst) pair's dimension-order route (``Torus.route``), vectorised.

    Returns:
        (edge, link id, hops), one entry per hop of every route: the index of
        the pair, the link's id (``interconnect.topology.link_ids``) and the
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
    factors, slowed = _slowdowns(topology, faults)
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
                assert on_chip_bytes_per_s is not None  # checked by group_collective_cost
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


#: Above this many messages (groups x size^2) a group all-to-all on blocks of the torus
#: is costed in closed form (``interconnect.all_to_all``): bit-identical, O(chips).
CLOSED_FORM_PAIRS = 1 << 16
#: Most messages routed one by one (groups that are not blocks: about 100 bytes each).
MAX_ROUTED_PAIRS = 1 << 24


def group_all_to_all_cost(op: str, topology: Torus, groups: Sequence[Sequence[int]],
                          num_elements: int, link: LinkSpec, itemsize: int = 4,
                          faults: LinkFaults | None = None, *, devices_per_chip: int = 1,
                          on_chip_bytes_per_s: float | None = None,
                          closed_form: bool = False) -> ScheduleCost:
    """The fast path of ``group_collective_cost("all_to_all", ...)``: the same seconds and
    link bytes as ``schedule_cost(concurrent_group_schedule("all_to_all", ...))``.

    Every group's direct all-to-all at once (as XLA issues it on a TPU slice: each
    device DMAs piece j of its buffer to member j): one phase in which every
    ordered pair of a group sends ``num_elements / g`` elements on its
    dimension-order route. The phase takes its busiest link's bytes at the achieved
    bandwidth of the chips' driven links plus latency times the longest route
    (:func:`interconnect.cost.schedule_cost`'s phase), groups contending where their
    routes share links. A piece between two devices of one chip (v2 / v3
    TensorCores) is an on-chip copy, each device's one after another, beside the
    ICI transfers (the phase takes the longer).

    Groups that are blocks of the torus (a whole torus, a mesh axis's devices) with
    one device per chip are costed in closed form above ``CLOSED_FORM_PAIRS``
    messages (``interconnect.all_to_all.block_link_counts``: the same integer loads
    per link, so the same seconds to the bit; a 16,384-chip all-to-all in well under
    a second and a few MB); other groups route every message, at most
    ``MAX_ROUTED_PAIRS``.

    Args:
        op: "all_to_all".
        topology, groups, num_elements, link, itemsize, devices_per_chip,
            on_chip_bytes_per_s: as :func:`group_collective_cost` (groups checked by
            the caller; ``num_elements`` a multiple of the group size).
        faults: slowed links only (failed links reroute: the schedule path).
        closed_form: use the closed form whenever the groups are blocks (tests).

    Returns:
        The :class:`ScheduleCost`.

    Raises:
        ScheduleError: groups that are not blocks with more than ``MAX_ROUTED_PAIRS``
            messages.
    """
    size = len(groups[0])
    factors, slowed = _slowdowns(topology, faults)
    piece = num_elements // size * itemsize                                  # bytes per message
    pairs = len(groups) * size * size
    if devices_per_chip == 1 and (closed_form or pairs > CLOSED_FORM_PAIRS):
        whole = len(groups) == 1 and size == topology.num_chips and \
            list(groups[0]) == list(range(size))
        found = (torus_link_counts(topology) if whole else        # O(chips), no pair routed
                 block_link_counts(topology, groups))
        if found is not None:
            return _all_to_all_cost(topology, *found, piece, link, faults)
    if pairs > MAX_ROUTED_PAIRS:
        raise ScheduleError(f"all-to-all over {len(groups):,} groups of {size:,} devices that "
                            f"are not blocks of the torus: {pairs:,} messages to route, more than "
                            f"the {MAX_ROUTED_PAIRS:,} allowed")
    members = np.asarray(groups, dtype=np.int64).reshape(len(groups), size)    # (R, g)
    nlinks = topology.num_chips * 2 * topology.ndim
    src = np.repeat(members, size, axis=1).reshape(-1)                       # (R g g,)
    dst = np.tile(members, (1, size)).reshape(-1)
    sending = src != dst
    src, dst = src[sending], dst[sending]
    src_chip, dst_chip = src // devices_per_chip, dst // devices_per_chip
    ici = src_chip != dst_chip
    _, ids, hops = _routes(topology, src_chip[ici], dst_chip[ici])
    loads = (np.bincount(ids, minlength=nlinks) * piece).astype(np.int64)
    seconds = (_phase_seconds(topology, loads, slowed, int(hops.max()), link)
               if piece and ids.size else 0.0)
    if piece and not ici.all() and on_chip_bytes_per_s:  # on-chip pieces, one after another
        copies = np.bincount(src[~ici]).max() * piece
        seconds = max(seconds, float(copies) / on_chip_bytes_per_s)
    return _cost_of(topology, [seconds], loads, factors, link)


def group_torus_cost(op: str, topology: Torus, groups: Sequence[Sequence[int]],
                     num_elements: int, link: LinkSpec, itemsize: int = 4,
                     faults: LinkFaults | None = None, *, devices_per_chip: int = 1,
                     on_chip_bytes_per_s: float | None = None,
                     group_torus: Torus | None = None) -> ScheduleCost:
    """The fast path of ``group_collective_cost(..., algorithm="xla")``: the same seconds
    and link bytes as ``schedule_cost(concurrent_group_schedule(..., algorithm="xla"))``
    without a Transfer per message.

    The reduce-scatter's phases on the group torus come as arrays of (local
    src, local dst, bytes) from :func:`interconnect.chains.axis_reduce_scatter_phases`
    (computed once: every group runs the same); each phase is mapped onto
    every group's devices at once, routed (dimension order, vectorised) and
    costed as :func:`schedule_cost` costs it: the busiest link's bytes at the
    achieved bandwidth of the chips' driven links, plus latency times the
    longest route. The all-gather is the reduce-scatter's phases reversed,
    every transfer turned round; the allreduce is both.

    A transfer between two devices of one chip (v2 / v3 TensorCores) loads
    no link: each device copies what it sends on-chip at
    ``on_chip_bytes_per_s``, beside the phase's ICI transfers (the phase
    takes the longer).

    Args:
        op, topology, groups, num_elements, link, itemsize, devices_per_chip,
            on_chip_bytes_per_s, group_torus: as :func:`group_collective_cost`
            (checked by the caller; ``group_torus`` None: one closed ring).
        faults: slowed links only (failed links reroute: the schedule path).

    Returns:
        The :class:`ScheduleCost`.
    """
    size = len(groups[0])
    group_torus = _checked_group_torus(group_torus, size)
    members = np.asarray(groups, dtype=np.int64).reshape(len(groups), size)    # (R, n)
    nlinks = topology.num_chips * 2 * topology.ndim
    factors, slowed = _slowdowns(topology, faults)
    totals = np.zeros(nlinks, dtype=np.int64)
    # (local link id, bytes) per phase; the all-gather turns every transfer round
    rs = [(ids, nbytes) for _, _, nbytes, ids in
          axis_reduce_scatter_phases(op, group_torus, num_elements, itemsize, "torus")]
    turned = [(_reverselink_ids(group_torus, ids), nbytes) for ids, nbytes in reversed(rs)]
    phases = {"allreduce": rs + turned, "reduce_scatter": rs, "all_gather": turned}[op]
    pairs = _PairRoutes.build(topology, members, group_torus, phases, devices_per_chip)

    def phase(ids: np.ndarray, nbytes: np.ndarray) -> float:
        """One phase: local transfers (T,), by local link id, sent in every group at once."""
        pair_bytes = np.bincount(pairs.index[ids], weights=nbytes, minlength=pairs.count)  # (P,)
        entry_bytes = pair_bytes[pairs.entry_pair]                             # (E,)
        seconds = 0.0
        if entry_bytes.any():
            loads = np.bincount(pairs.entry_link, weights=entry_bytes, minlength=nlinks)
            loads = loads.astype(np.int64)
            totals[:] += loads
            hops = int(pairs.entry_hops[entry_bytes > 0].max())
            seconds = _phase_seconds(topology, loads, slowed, hops, link)
        copied = pair_bytes[pairs.on_chip_pair]                                # (O,)
        if copied.any():  # each device copies what it sends on-chip, one after another
            assert on_chip_bytes_per_s is not None  # checked by group_collective_cost
            most = np.bincount(pairs.on_chip_device, weights=copied).max()
            seconds = max(seconds, float(most) / on_chip_bytes_per_s)
        return seconds

    seconds = [phase(ids, nbytes) for ids, nbytes in phases]
    return _cost_of(topology, seconds, totals, factors, link)


def _reverselink_ids(topology: Torus, ids: np.ndarray) -> np.ndarray:
    """Id of the link ``dst -> src`` for each directed link id ``src -> dst``."""
    src, dst = link_of_id(topology, ids)
    return link_ids(topology, dst, src)


@dataclass(frozen=True)
class _PairRoutes:
    """The routes of every local link a group collective uses, in every group.

    A step of the group torus's schedule goes between neighbours of the group
    torus (a local link); every group sends over the same local links, and a
    local link's bytes are the same in every group, so each is routed once per
    group up front and a phase is one bincount of its bytes over the route
    entries.

    Attributes:
        index: (n x 2 ndim,) position of each local link id among the used ones (-1: unused).
        count: P, the local links used.
        entry_pair: (E,) the local link (position) of each (group, link, hop) route entry.
        entry_link: (E,) its directed ICI link id (``interconnect.topology.link_ids``).
        entry_hops: (E,) the length of its route.
        on_chip_pair: (O,) the local link of each (group, link) between two devices of one chip.
        on_chip_device: (O,) its sending device.
    """

    index: np.ndarray
    count: int
    entry_pair: np.ndarray
    entry_link: np.ndarray
    entry_hops: np.ndarray
    on_chip_pair: np.ndarray
    on_chip_device: np.ndarray

    @classmethod
    def build(cls, topology: Torus, members: np.ndarray, group_torus: Torus, phases,
              devices_per_chip: int) -> _PairRoutes:
        """Routes of the local links of ``phases`` ((ids, bytes) per phase) for ``members``
        (R, n)."""
        index = np.full(group_torus.num_chips * 2 * group_torus.ndim, -1, dtype=np.int64)
        for ids, _ in phases:
            index[ids] = 0
        keys = np.flatnonzero(index == 0)
        index[keys] = np.arange(len(keys))
        local_src, local_dst = link_of_id(group_torus, keys)
        src, dst = members[:, local_src].reshape(-1), members[:, local_dst].reshape(-1)  # (R x P,)
        src_chip, dst_chip = src // devices_per_chip, dst // devices_per_chip
        pair = np.tile(np.arange(len(keys)), len(members))
        ici = np.flatnonzero(src_chip != dst_chip)
        edge, ids, hops = _routes(topology, src_chip[ici], dst_chip[ici])
        on_chip = np.flatnonzero(src_chip == dst_chip)
        return cls(index, len(keys), pair[ici][edge], ids, hops, pair[on_chip], src[on_chip])
