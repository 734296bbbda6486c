"""Collectives on sub-groups: every group of one mesh axis running at once.

A sharded step runs collectives over the devices along one mesh axis (a
*group*: the devices that differ only in that axis's index). Every group of
the axis runs the same collective at the same time, so they share the
torus's links where their routes meet. A group's collective is built on
local positions ``0..g-1`` by the registry (:mod:`interconnect.registry`:
any algorithm of the op) on the group's *local torus*, then mapped onto its
devices: :func:`group_collective_cost` prices every group at once
(:func:`interconnect.cost.price`: the groups' phases aligned, so the
contention of groups that share links is seen, and every message routed
over real links, a step of a ring that is not a neighbour paying its hops);
:func:`concurrent_group_schedule` builds the same as one Schedule of
Transfers (what an executor runs).

The local torus (``algorithm``, one of ``interconnect.ALGORITHMS[op]``):

- ``"torus"``: the collective as XLA runs it on a TPU slice ([SB] sharding.md,
  "multi-axis torus"): over every torus axis the group spans at once, in
  both directions. A group lies on a block of the torus (a mesh axis takes
  one block of each torus axis it spans, ``pod.config.mesh.AxisBlock``):
  its ``group_torus`` gives the block's shape and which of its axes close
  into rings, and the group lists its devices in row-major order of it. The
  collective is the multi-axis schedule of :mod:`interconnect.chains`
  built on that small torus and mapped onto the chips: a step along a block
  with stride ``s`` (the outer part of a split axis) travels ``s`` hops, and
  the groups that interleave on those links contend. Bandwidth term
  ``(n-1)/n x V / (W_bidi x m)`` for a group of ``n`` devices over ``m``
  equal axes with wraparound, twice that on lines.
- the ring-based algorithms (``"ring"``: one unidirectional ring per group,
  one link per device per phase, ``(n-1)/n x V / W``, what the functional
  transport runs; ``"bidirectional_ring"``, ``"halving_doubling"``,
  ``"tree"``): on the 1-D ring of the group's devices in the order given
  (``Mesh.groups(axis, "ring")``: consecutive devices neighbours, or as
  near as the layout allows).
- an all-to-all is direct (every message on its own route) whatever the
  algorithm.

Groups are device ids. With one device per chip (v4 / v5p megacore, v5e,
v6e) a device id is its torus rank. On v2 / v3 each TensorCore is a device
(``devices_per_chip = 2``, device ``d`` on chip ``d // 2``): two devices of
one chip share its ICI links (the groups of both cores load the same
links, which the phase's busiest link sees), and a step between the two
TensorCores of one chip moves no ICI byte; it is an on-chip copy charged
at ``on_chip_bytes_per_s`` (the pod passes one TensorCore's HBM bandwidth:
an assumption, there is no published core-to-core figure; see
VALIDATION.md), in parallel with the phase's ICI transfers (the phase
takes the longer). Failed links with several devices per chip are refused
(not modelled). With ``"torus"`` a block may be the two TensorCores of a
chip (an axis of the group torus of size 2 whose steps stay on a chip).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from interconnect.all_to_all import block_link_counts, torus_link_counts
from interconnect.cost import ScheduleCost, _closed_form_cost, price
from interconnect.errors import ScheduleError
from interconnect.faults import LinkFaults
from interconnect.link import LinkSpec
from interconnect.phases import PairPhases, ppermute_phases
from interconnect.registry import Algorithm, check_algorithm
from interconnect.schedule import Schedule, _make_transfer, _trusted_schedule
from interconnect.topology import Torus

__all__ = ["GROUP_OPS", "CLOSED_FORM_PAIRS", "MAX_ROUTED_PAIRS", "group_ring_schedule",
           "group_torus_schedule", "concurrent_group_schedule", "group_collective_cost",
           "group_ppermute_schedule", "group_ppermute_cost", "pair_permute_cost"]

#: The operations a group collective performs (the device program's four; all_to_all is
#: direct under any algorithm: every message on its own dimension-order route).
GROUP_OPS = ("allreduce", "reduce_scatter", "all_gather", "all_to_all")

#: Above this many messages (groups x size^2) a group all-to-all on blocks of the torus
#: is costed in closed form (``interconnect.all_to_all``): bit-identical, O(chips).
CLOSED_FORM_PAIRS = 1 << 16
#: Most messages routed one by one (groups that are not blocks: about 100 bytes each).
MAX_ROUTED_PAIRS = 1 << 24


def group_ring_schedule(op: str, size: int, num_elements: int, itemsize: int = 4) -> Schedule:
    """One group's ring collective on local positions ``0..size-1`` (ring order).

    Position ``p`` sends to ``p + 1`` (mod ``size``). As the ring builders: a
    reduce-scatter leaves position ``p`` owning chunk ``(p + 1) mod size``;
    an all-gather expects it to hold that chunk.

    Args:
        op: allreduce, reduce_scatter, all_gather or all_to_all (direct).
        size: devices in the group, >= 1.
        num_elements: elements of each device's buffer, >= 0.
        itemsize: bytes per element.

    Returns:
        A Schedule over ``size`` ranks: ``size - 1`` phases (``2 (size - 1)``
        for an allreduce) of ``size`` transfers each.

    Raises:
        ScheduleError: an unknown op or a size below 1.
    """
    if not isinstance(size, int) or size < 1:
        raise ScheduleError(f"group size {size!r} is not valid: expected an int >= 1")
    return _entry(op, "ring").build(_ring(size), num_elements, itemsize)


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
    return _entry(op, "torus").build(group_torus, num_elements, itemsize)


def _entry(op: str, algorithm: str) -> Algorithm:
    """The registry's entry of a group collective (all-to-all: direct).

    Raises:
        ScheduleError: an op that is not a group op, or an algorithm the op does not have.
    """
    if op not in GROUP_OPS:
        raise ScheduleError(f"group collective {op!r} is not valid: expected one of "
                            f"{', '.join(GROUP_OPS)}")
    return check_algorithm(op, "direct" if op == "all_to_all" else algorithm)


def _ring(size: int) -> Torus:
    """The local torus of a group in ring order: one closed ring of its devices."""
    return Torus((max(size, 1),), wraparound=(True,))


def _local_torus(algorithm: str, group_torus: Torus | None, size: int) -> Torus:
    """The torus a group's collective is built on: its block for ``"torus"``, else its ring."""
    return _checked_group_torus(group_torus, size) if algorithm == "torus" else _ring(size)


def _checked_group_torus(group_torus: Torus | None, size: int) -> Torus:
    """The group's block, checked against the group size (None: one closed ring).

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
        op: allreduce, reduce_scatter, all_gather or all_to_all.
        groups: disjoint groups of equal size, as torus ranks: in ring order
            for the ring-based algorithms (``Mesh.groups(axis, "ring")``), in
            row-major order of ``group_torus`` for ``"torus"``
            (``Mesh.groups(axis, "mesh")``).
        num_ranks: chips of the torus (ranks outside every group take no part).
        num_elements: elements of each device's buffer.
        itemsize: bytes per element.
        algorithm: one of ``interconnect.ALGORITHMS[op]`` (module docstring):
            ``"ring"`` (:func:`group_ring_schedule`), ``"torus"``
            (:func:`group_torus_schedule`), ...
        group_torus: ``"torus"`` only: the block every group occupies (None:
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
    entry = _entry(op, algorithm)
    groups = _checked_groups(groups, num_ranks)
    size = len(groups[0]) if groups else 1
    local = entry.build(_local_torus(algorithm, group_torus, size), num_elements, itemsize)
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

    The registry's phases of ``(op, algorithm)`` (:mod:`interconnect.registry`) on
    the group's local torus, priced over every group at once by
    :func:`interconnect.cost.price`: per phase the busiest link, contention between
    groups included, plus per-hop latency, and the collective's fixed cost once; a
    step between two devices of one chip is an on-chip copy beside the phase. The
    local torus is ``group_torus`` for ``"torus"`` (the block each group occupies,
    its devices in row-major order of it) and the 1-D ring of the group in the order
    given for the ring-based algorithms. An all-to-all is direct whatever
    ``algorithm``. Groups of one device cost nothing (no transfer, no fixed cost).

    Args:
        op: allreduce, reduce_scatter, all_gather or all_to_all.
        topology: the chips' torus.
        groups: the groups as device ids (device ``d`` on torus rank
            ``d // devices_per_chip``): in ring order for the ring-based
            algorithms, in row-major order of ``group_torus`` for ``"torus"``.
        num_elements: elements of each device's buffer (the full buffer: for
            an all-gather, the gathered result).
        link: the (calibrated) link.
        itemsize: bytes per element of what moves (2 for bf16).
        faults: slowed and failed links.
        devices_per_chip: devices per chip (2 for the TensorCores of v2 / v3).
        on_chip_bytes_per_s: bandwidth of a step between two devices of one
            chip, bytes/s (required when ``devices_per_chip > 1``).
        algorithm: one of ``interconnect.ALGORITHMS[op]``: ``"ring"`` (default: one
            unidirectional ring per group), ``"torus"`` (XLA's: every axis of the
            group's block at once, both directions), ``"bidirectional_ring"``, ...
        group_torus: ``"torus"`` only: the block of the torus each group
            occupies, one axis per block (``pod.config.mesh.AxisBlock``: its
            size, and ``wraps``); None: one closed ring in the order given.

    Returns:
        The :class:`ScheduleCost` (simulated seconds, bytes per directed link).

    Raises:
        ScheduleError, TopologyError: as the builders and :func:`interconnect.cost.price`;
            an unknown algorithm; several devices per chip without
            ``on_chip_bytes_per_s`` or with failed links.
    """
    entry = _entry(op, algorithm)
    if all(len(g) <= 1 for g in groups):
        return ScheduleCost(seconds=0.0, phase_seconds=(), link_bytes={})
    groups = _checked_groups(groups, topology.num_chips * _checked_devices(devices_per_chip,
                                                                           on_chip_bytes_per_s,
                                                                           faults))
    if op == "all_to_all":
        closed = _all_to_all_in_closed_form(topology, groups, num_elements, itemsize, link,
                                            faults, devices_per_chip)
        if closed is not None:
            return closed
    local = _local_torus(algorithm, group_torus, len(groups[0]))
    return price(entry.build_phases(local, num_elements, itemsize), topology, link, faults,
                 members=np.asarray(groups, dtype=np.int64), devices_per_chip=devices_per_chip,
                 on_chip_bytes_per_s=on_chip_bytes_per_s)


def _all_to_all_in_closed_form(topology: Torus, groups: list[tuple[int, ...]], num_elements: int,
                               itemsize: int, link: LinkSpec, faults: LinkFaults | None,
                               devices_per_chip: int) -> ScheduleCost | None:
    """The groups' direct all-to-all from its messages per link in closed form, when the
    groups are blocks of the torus (a whole torus, a mesh axis's devices) of one device
    per chip without failed links and send more than ``CLOSED_FORM_PAIRS`` messages
    (``interconnect.all_to_all.block_link_counts``: the same integer loads as routing
    every pair, so the same figures to the bit; a 16,384-chip all-to-all in well under a
    second and a few MB); None: route every pair (:func:`interconnect.cost.price`).

    Raises:
        ScheduleError: ``num_elements`` not a multiple of the group size; groups that are
            not blocks with more than ``MAX_ROUTED_PAIRS`` messages.
    """
    size = len(groups[0])
    if num_elements % size:
        raise ScheduleError(f"all-to-all needs num_elements ({num_elements}) to be a multiple "
                            f"of the group size {size}")
    pairs = len(groups) * size * size
    if (devices_per_chip == 1 and not (faults is not None and faults.failed)
            and pairs > CLOSED_FORM_PAIRS):
        whole = len(groups) == 1 and list(groups[0]) == list(range(topology.num_chips))
        found = torus_link_counts(topology) if whole else block_link_counts(topology, groups)
        if found is not None:
            return _closed_form_cost(topology, *found, num_elements // size * itemsize, link,
                                     faults)
    if pairs > MAX_ROUTED_PAIRS:
        raise ScheduleError(f"all-to-all over {len(groups):,} groups of {size:,} devices that "
                            f"are not blocks of the torus: {pairs:,} messages to route, more than "
                            f"the {MAX_ROUTED_PAIRS:,} allowed")
    return None


def _checked_devices(devices_per_chip: int, on_chip_bytes_per_s: float | None,
                     faults: LinkFaults | None) -> int:
    """``devices_per_chip``, checked with what several devices per chip need.

    Raises:
        ScheduleError: not an int >= 1; several without a positive finite
            ``on_chip_bytes_per_s``, or with failed links.
    """
    if (isinstance(devices_per_chip, bool) or not isinstance(devices_per_chip, int)
            or devices_per_chip < 1):
        raise ScheduleError(f"devices_per_chip {devices_per_chip!r} is not valid: expected an "
                            "int >= 1")
    if devices_per_chip > 1 and faults is not None and faults.failed:
        raise ScheduleError("failed links with several devices per chip (v2 / v3 TensorCores) "
                            "are not modelled: the rerouted schedule has chip ranks only")
    if devices_per_chip > 1 and not (on_chip_bytes_per_s is not None
                                     and np.isfinite(on_chip_bytes_per_s)
                                     and on_chip_bytes_per_s > 0):
        raise ScheduleError(f"on_chip_bytes_per_s {on_chip_bytes_per_s!r} is not valid: "
                            "several devices per chip need the bandwidth of a copy between "
                            "two devices of one chip, a positive number of bytes/s")
    return devices_per_chip


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

    Position ``i`` of every group (in the order given: ring order for the
    pipeline's stages) sends its whole buffer to position ``(i + shift) mod g``
    (``interconnect.phases.ppermute_phases`` on the group's 1-D ring), priced by
    :func:`interconnect.cost.price`: the busiest link's bytes at the achieved
    bandwidth of the links a chip drives, plus latency times the longest route,
    plus the collective's fixed cost; the groups contend where their routes
    share links. On a ring of neighbours with ``shift`` 1 every device sends
    ``V`` bytes over one link: ``V / W(1) + latency + fixed`` ([MARIN] measures
    ``V / W`` plus a hop on v5p and v6e). A transfer between two devices of one
    chip (v2 / v3) loads no link: an on-chip copy at ``on_chip_bytes_per_s``
    beside the phase (the phase takes the longer). Nothing to send (an empty
    buffer, or a shift that keeps every buffer in place) costs nothing, not even
    the fixed cost.

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
    phases = ppermute_phases(_ring(len(groups[0])), num_elements, itemsize, shift=shift)
    if not phases.num_phases:
        return ScheduleCost(seconds=0.0, phase_seconds=(), link_bytes={})
    if devices_per_chip > 1 and faults is not None and faults.failed:
        raise ScheduleError("failed links with several devices per chip (v2 / v3 "
                            "TensorCores) are not modelled: the rerouted schedule has chip "
                            "ranks only")
    return price(phases, topology, link, faults, members=np.asarray(groups, dtype=np.int64),
                 devices_per_chip=devices_per_chip, on_chip_bytes_per_s=on_chip_bytes_per_s)


def pair_permute_cost(topology: Torus, sources: Sequence[int] | np.ndarray,
                      targets: Sequence[int] | np.ndarray, num_elements: int, link: LinkSpec,
                      itemsize: int = 4, faults: LinkFaults | None = None, *,
                      devices_per_chip: int = 1,
                      on_chip_bytes_per_s: float | None = None) -> ScheduleCost:
    """Simulated cost of a collective permute given as (source, target) device pairs,
    all sending at once (one phase): XLA's ``collective-permute`` with its
    ``source_target_pairs``, which need not be a shift of equal groups (a pipeline
    without wraparound sends 0 -> 1 -> 2 and nothing back).

    Each source sends its whole buffer on the dimension-order route to its target,
    priced by :func:`interconnect.cost.price` (one phase of those pairs on the
    devices' ranks): the busiest link's bytes at the achieved bandwidth of the links
    a chip drives, plus latency times the longest route, plus the collective's fixed
    cost; the same figures as :func:`group_ppermute_cost` for the pairs of a shift. A
    pair on one chip (v2 / v3 TensorCores) is an on-chip copy at
    ``on_chip_bytes_per_s`` beside the phase (the phase takes the longer); a pair
    sending to itself moves nothing, and nothing to send costs nothing.

    Args:
        topology: the chips' torus.
        sources, targets: (P,) device ids (device ``d`` on rank ``d // devices_per_chip``).
        num_elements: elements of each source's buffer.
        link: the (calibrated) link.
        itemsize: bytes per element.
        faults: slowed links (failed links: route around them with
            :func:`group_ppermute_cost`, which takes groups).
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
    whole = int(num_elements) * int(itemsize)
    if not keep.any() or whole == 0:
        return ScheduleCost(seconds=0.0, phase_seconds=(), link_bytes={})
    phases = PairPhases(devices, srcs[keep], dsts[keep],
                        (np.full(int(keep.sum()), whole, dtype=np.int64),))
    return price(phases, topology, link, faults, devices_per_chip=devices_per_chip,
                 on_chip_bytes_per_s=on_chip_bytes_per_s)
