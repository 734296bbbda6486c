"""Torus collectives that use every axis's links at once, as XLA's do.

The ``"torus"`` reduce-scatter of a ``d``-axis torus cuts the buffer into
``m`` parts (``m`` = axes of size >= 2). Part ``j`` reduces over the axes in
the rotated order ``j, j+1, ..., j-1``: at every stage each axis carries a
different part, so all links work together and the bandwidth term divides
by the number of axes, ``V / (W_bidi x m)`` ([SB], "multi-axis torus").
Reducing part ``j`` over an axis leaves each chip holding ``1/a`` of what it
held, so the parts shrink level by level exactly as in the sequential
schedule, but the stages overlap instead of adding up.

Over one axis (a **level**) the reduction is a set of **chains**: the data
of group ``g`` (what ring position ``g`` will own) flows from the farthest
positions towards ``g``, each chip adding its own contribution on the way,
from both sides at once:

- a ring of odd size ``a``: from ``(a-1)/2`` positions on each side, in
  ``(a-1)/2`` phases;
- a ring of even size ``a``: the chip opposite ``g`` sends the first half
  of its contribution forward and the second half backward; each chain
  then carries the whole group ``a/2`` hops; ``a/2`` phases. Every directed
  link carries at most ``V/a`` per phase (half of it in the first);
- a line (no wraparound; any axis of size 2): contributions come from the
  two ends, ``a - 1`` phases.

So a chunk travels at most half a ring (``floor(a/2)`` hops), the textbook
latency ``T_min x a / 2`` [SB], and the bandwidth term is the textbook
``(a-1)/a x V / (2 W)`` on a ring and ``(a-1)/a x V / W`` on a line ("about
twice as long without wraparound" [SB]). All chains of a level end in its
last phase; a shorter chain starts later.

The all-gather is the reduce-scatter run backwards (phases reversed, every
transfer turned round into a copy): the broadcast tree of each group is its
reduction tree. The allreduce is the reduce-scatter then the all-gather.

Element layout. The buffer is cut into **atoms**, one per (part, owner
rank). For the allreduce, part ``j`` is a contiguous ``1/m`` of the buffer
and its atoms follow part ``j``'s axis order, so every group a chip sends is
one contiguous range (one transfer). For reduce-scatter and all-gather a
rank must own one contiguous chunk, so the buffer is cut by owner first
(rank order) and each owner's chunk into ``m`` atoms; a group is then a few
ranges (one transfer each).

:func:`build_axis_collective` builds the :class:`Schedule`;
:func:`axis_reduce_scatter_phases` gives the same reduce-scatter phases as
numpy arrays of (src, dst, bytes, link) without Transfer objects, for the
cost fast path.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from interconnect.errors import ScheduleError
from interconnect.schedule import (
    Schedule,
    Transfer,
    _check_counts,
    _gc_paused,
    _make_transfer,
    _trusted_schedule,
    chunk_bounds,
)
from interconnect.topology import Torus

__all__ = ["Chain", "axis_chains", "build_axis_collective", "axis_reduce_scatter_phases",
           "ppermute"]

WHOLE, FIRST_HALF, SECOND_HALF = 0, 1, 2


@dataclass(frozen=True)
class Chain:
    """One reduction path of a level: contributions flowing to ring position ``group``.

    Attributes:
        group: the ring position that ends owning the data (the chain's end).
        half: what the first send carries: ``WHOLE`` (0), ``FIRST_HALF``
            (1, the first ``ceil(e/2)`` of the group's ``e`` elements) or
            ``SECOND_HALF`` (2, the other ``floor(e/2)``); later sends
            carry the whole group.
        path: ring positions, from the farthest contributor to ``group``.
        start: the level's phase of the first send; send ``t`` (from
            ``path[t]`` to ``path[t+1]``) is in phase ``start + t``.
    """

    group: int
    half: int
    path: tuple[int, ...]
    start: int


def axis_chains(size: int, wraps: bool) -> tuple[int, tuple[Chain, ...]]:
    """Phases and chains of a reduce-scatter over one ring or line of ``size`` positions.

    Args:
        size: positions on the axis, >= 1.
        wraps: True when the last position links back to the first (a ring);
            ignored for ``size <= 2`` (one link per direction either way).

    Returns:
        ``(phases, chains)``: ``floor(size/2)`` phases on a ring, ``size - 1``
        on a line, 0 for ``size == 1``; every chain ends in the last phase.
    """
    if size < 2:
        return 0, ()
    chains: list[Chain] = []
    if not wraps or size <= 2:
        last = size - 1
        for g in range(size):
            if g > 0:
                chains.append(Chain(g, WHOLE, tuple(range(0, g + 1)), last - g))
            if g < last:
                chains.append(Chain(g, WHOLE, tuple(range(last, g - 1, -1)), g))
        return last, tuple(chains)

    def forward(g: int, hops: int) -> tuple[int, ...]:
        return tuple((g - hops + t) % size for t in range(hops + 1))

    def backward(g: int, hops: int) -> tuple[int, ...]:
        return tuple((g + hops - t) % size for t in range(hops + 1))

    if size % 2:
        phases = (size - 1) // 2
        for g in range(size):
            chains.append(Chain(g, WHOLE, forward(g, phases), 0))
            chains.append(Chain(g, WHOLE, backward(g, phases), 0))
        return phases, tuple(chains)
    phases = size // 2
    for g in range(size):
        chains.append(Chain(g, FIRST_HALF, forward(g, phases), 0))
        chains.append(Chain(g, SECOND_HALF, backward(g, phases), 0))
    return phases, tuple(chains)


@dataclass(frozen=True)
class _Level:
    """One axis of a part's reduction.

    Attributes:
        rings: (R, a) ranks of every ring (or line) along the axis, by position.
        position: (n,) each rank's position in its ring.
        wraps: the axis is a ring.
        axis: the torus axis, or None for a ring along ``ring_order()``.
    """

    rings: np.ndarray
    position: np.ndarray
    wraps: bool
    axis: int | None = None


def _levels(topology: Torus, algorithm: str) -> list[_Level]:
    """The axes a collective reduces over: the torus axes, or one ring along ring_order()."""
    n = topology.num_chips
    if algorithm == "bidirectional_ring":
        order = np.asarray(topology.ring_order(), dtype=np.int64)
        if n < 2:
            return []
        position = np.empty(n, dtype=np.int64)
        position[order] = np.arange(n)
        return [_Level(order[None, :], position, n >= 3)]
    levels = []
    ranks = np.arange(n, dtype=np.int64).reshape(topology.shape)
    for axis, size in enumerate(topology.shape):
        if size < 2:
            continue
        rings = np.moveaxis(ranks, axis, -1).reshape(-1, size)
        position = np.moveaxis(np.indices(topology.shape)[axis], axis, -1).reshape(-1)
        position_by_rank = np.empty(n, dtype=np.int64)
        position_by_rank[rings.reshape(-1)] = position
        levels.append(_Level(rings, position_by_rank, topology.axis_wraps(axis), axis))
    return levels


def _part_orders(levels: list[_Level]) -> list[list[_Level]]:
    """Part j reduces over the levels in the rotated order j, j+1, ..., j-1."""
    m = len(levels)
    return [levels[j:] + levels[:j] for j in range(m)]


def _split(start: np.ndarray, stop: np.ndarray, parts: int) -> tuple[np.ndarray, np.ndarray]:
    """Each range cut into ``parts`` as :func:`chunk_bounds` cuts: (starts, stops), shape
    (..., parts)."""
    length = (stop - start)[..., None]
    index = np.arange(parts)
    sizes = length // parts + (index < length % parts)
    stops = start[..., None] + np.cumsum(sizes, axis=-1)
    return stops - sizes, stops


def _atom_sizes(n: int, num_elements: int, orders: list[list[_Level]],
                owner_major: bool) -> np.ndarray:
    """(m, n, 2) element range (start, stop) of the atom of (part j, owner rank)."""
    m = max(len(orders), 1)
    atoms = np.zeros((m, n, 2), dtype=np.int64)
    whole_start, whole_stop = np.array(0), np.array(num_elements)
    if owner_major:
        owner_start, owner_stop = _split(whole_start, whole_stop, n)  # (n,)
        starts, stops = _split(owner_start, owner_stop, m)  # (n, m)
        atoms[..., 0], atoms[..., 1] = starts.T, stops.T
        return atoms
    part_start, part_stop = _split(whole_start, whole_stop, m)  # (m,)
    starts, stops = _split(part_start, part_stop, n)  # (m, n), in each part's owner order
    for j in range(m):
        levels = orders[j] if orders else []
        # owners sorted by their positions on the part's levels, the first level most significant
        sequence = (np.lexsort([level.position for level in reversed(levels)]) if levels
                    else np.arange(n))
        atoms[j, sequence, 0], atoms[j, sequence, 1] = starts[j], stops[j]
    return atoms


def _plan(topology: Torus, num_elements: int, algorithm: str, owner_major: bool):
    levels = _levels(topology, algorithm)
    orders = _part_orders(levels)
    atoms = _atom_sizes(topology.num_chips, num_elements, orders, owner_major)
    return orders, atoms


def _halve(ranges: list[tuple[int, int]], half: int) -> list[tuple[int, int]]:
    """The first ceil(e/2) (half 1) or last floor(e/2) (half 2) elements of a range list."""
    if half == WHOLE:
        return ranges
    total = sum(b - a for a, b in ranges)
    cut = (total + 1) // 2
    out, seen = [], 0
    for a, b in ranges:
        lo, hi = ((a, min(b, a + max(cut - seen, 0))) if half == FIRST_HALF
                  else (max(a, a + cut - seen), b))
        if hi > lo:
            out.append((lo, hi))
        seen += b - a
    return out


def _merged(starts: np.ndarray, stops: np.ndarray) -> list[tuple[int, int]]:
    keep = stops > starts
    starts, stops = starts[keep], stops[keep]
    order = np.argsort(starts, kind="stable")
    out: list[tuple[int, int]] = []
    for a, b in zip(starts[order].tolist(), stops[order].tolist(), strict=True):
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def _reduce_scatter_phases(orders, atoms, itemsize: int,
                           chunk_of: dict[tuple[int, int], int]) -> list[list[Transfer]]:
    """Transfers of the reduce-scatter, phase by phase (parts overlapped)."""
    phases: list[list[Transfer]] = []
    make = _make_transfer
    for j, levels in enumerate(orders):
        offset = 0
        previous: list[_Level] = []
        for level in levels:
            count, chains = axis_chains(level.rings.shape[1], level.wraps)
            while len(phases) < offset + count:
                phases.append([])
            for ring in level.rings:
                region = np.ones(atoms.shape[1], dtype=bool)
                for done in previous:
                    region &= done.position == done.position[ring[0]]
                groups = []
                for g in range(len(ring)):
                    owners = region & (level.position == g)
                    groups.append(_merged(atoms[j, owners, 0], atoms[j, owners, 1]))
                for chain in chains:
                    for t in range(len(chain.path) - 1):
                        ranges = (_halve(groups[chain.group], chain.half) if t == 0
                                  else groups[chain.group])
                        src, dst = int(ring[chain.path[t]]), int(ring[chain.path[t + 1]])
                        phase = phases[offset + chain.start + t]
                        for a, b in ranges:
                            chunk = chunk_of.setdefault((a, b), len(chunk_of))
                            phase.append(make((src, dst, chunk, (b - a) * itemsize, True, chunk)))
            previous.append(level)
            offset += count
    return phases


def build_axis_collective(op: str, topology: Torus, num_elements: int, itemsize: int = 4,
                          algorithm: str = "torus") -> Schedule:
    """Reduce-scatter, all-gather or allreduce over every torus axis at once (or one
    bidirectional ring).

    Args:
        op: ``"allreduce"``, ``"reduce_scatter"`` or ``"all_gather"``.
        topology: the torus (n = num_chips).
        num_elements: elements per rank's buffer (for all-gather: the
            gathered output), >= 0.
        itemsize: bytes per element, >= 1.
        algorithm: ``"torus"`` (every axis of size >= 2, the parts rotated)
            or ``"bidirectional_ring"`` (one level over ``ring_order()``).

    Returns:
        A Schedule named ``f"{algorithm}_{op}"``; for reduce-scatter and
        all-gather rank ``r`` owns the element range
        ``chunk_bounds(num_elements, n)[r]``.

    Raises:
        ScheduleError: a bad count, topology, op or algorithm.
    """
    if op not in ("allreduce", "reduce_scatter", "all_gather"):
        raise ScheduleError(f"operation {op!r} is not valid here: expected allreduce, "
                            "reduce_scatter or all_gather")
    if algorithm not in ("torus", "bidirectional_ring"):
        raise ScheduleError(f"algorithm {algorithm!r} is not valid here: expected torus or "
                            "bidirectional_ring")
    n, num_elements, itemsize = _check_counts(topology, num_elements, itemsize)
    owner_major = op != "allreduce"
    orders, atoms = _plan(topology, num_elements, algorithm, owner_major)
    chunk_of: dict[tuple[int, int], int] = {}
    owned: tuple[int, ...] = ()
    if owner_major:
        owned = tuple(chunk_of.setdefault(bound, len(chunk_of))
                      for bound in chunk_bounds(num_elements, n))
    with _gc_paused():
        rs = [tuple(phase) for phase in _reduce_scatter_phases(orders, atoms, itemsize, chunk_of)]
        ag = [tuple(_make_transfer((t.dst, t.src, t.chunk, t.nbytes, False, t.chunk))
                    for t in phase)
              for phase in reversed(rs)]
    phases = {"allreduce": rs + ag, "reduce_scatter": rs, "all_gather": ag}[op]
    # chunk_of numbers its bounds 0, 1, ... in order of first use: this lists them by number
    bounds = sorted(chunk_of, key=chunk_of.__getitem__)
    if not bounds:
        bounds = [(0, num_elements)]
    return _trusted_schedule(
        name=f"{algorithm}_{op}", num_ranks=n, num_elements=num_elements, itemsize=itemsize,
        chunk_bounds=tuple(bounds), phases=tuple(phases), op=op, owned_chunks=owned, root=0,
    )


def axis_reduce_scatter_phases(
        op: str, topology: Torus, num_elements: int, itemsize: int, algorithm: str,
) -> list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """The reduce-scatter phases of :func:`build_axis_collective` as numpy arrays.

    Same transfers' ranks and bytes per phase (zero-byte sends included:
    the caller drops them), one entry per group (not per range), computed
    from the groups' sizes: a group's elements are the sum of its owners'
    atoms. Fast for tori of thousands of chips. The all-gather's phases are
    these reversed, each transfer turned round; the allreduce's, both.

    Args:
        op: the collective whose element layout to use (``"allreduce"``:
            parts first; otherwise owners first).
        topology, num_elements, itemsize, algorithm: as :func:`build_axis_collective`.

    Returns:
        One ``(src (T,), dst (T,), nbytes (T,), link (T,))`` per phase, in
        order; ``link`` is the directed link's id
        (``src x 2 ndim + axis x 2 + (1 if dst is src's +1 neighbour)``) for
        a step along a torus axis, -1 for a step of ``ring_order()`` (which
        the caller routes).
    """
    n = topology.num_chips
    orders, atoms = _plan(topology, num_elements, algorithm, op != "allreduce")
    sizes = atoms[..., 1] - atoms[..., 0]  # (m, n) elements per atom
    rs: list[list[tuple[np.ndarray, ...]]] = []
    two_ndim = 2 * topology.ndim
    for j, levels in enumerate(orders):
        offset = 0
        for k, level in enumerate(levels):
            a = level.rings.shape[1]
            count, chains = axis_chains(a, level.wraps)
            while len(rs) < offset + count:
                rs.append([])
            # one row per chain step: (from position, to position, group, half, phase)
            steps = np.array([(chain.path[t], chain.path[t + 1], chain.group,
                               chain.half if t == 0 else WHOLE, chain.start + t)
                              for chain in chains for t in range(len(chain.path) - 1)],
                             dtype=np.int64)
            frm, to, group, half, phase = steps.T
            rings = level.rings  # (R, a)
            total = _group_elements(sizes[j], levels[:k + 1], n)[rings[:, group]]  # (R, S)
            nbytes = itemsize * np.where(half == WHOLE, total,
                                         np.where(half == FIRST_HALF, (total + 1) // 2, total // 2))
            src, dst = rings[:, frm], rings[:, to]
            if level.axis is None:
                ids = np.full(src.shape, -1, dtype=np.int64)
            else:  # as interconnect.topology.link_ids: the +1 neighbour when to = from + 1 (mod a)
                ids = src * two_ndim + 2 * level.axis + ((to - frm) % a == 1)
            for p in range(count):
                cols = phase == p
                rs[offset + p].append(tuple(x[:, cols].reshape(-1)
                                            for x in (src, dst, nbytes, ids)))
            offset += count
    return [_joined(phase) for phase in rs]


def _joined(parts: list[tuple[np.ndarray, ...]]
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One phase's ``(src, dst, nbytes, link)`` parts, each column concatenated."""
    if not parts:
        return (np.zeros(0, np.int64),) * 4
    src, dst, nbytes, link = (np.concatenate(column) for column in zip(*parts, strict=True))
    return src, dst, nbytes, link


def _group_elements(sizes: np.ndarray, levels: list[_Level], n: int) -> np.ndarray:
    """(n,) elements of the group each rank ends owning after ``levels``: owners that
    match it on every one."""
    key = np.zeros(n, dtype=np.int64)
    for level in levels:
        key = key * (int(level.position.max()) + 1) + level.position
    totals = np.bincount(key, weights=sizes, minlength=int(key.max()) + 1)
    return np.rint(totals[key]).astype(np.int64)


def ppermute(topology: Torus, num_elements: int, itemsize: int = 4, shift: int = 1,
             axis: int = 0) -> Schedule:
    """Collective permute: every rank sends its whole buffer ``shift`` places along ``axis``.

    Rank at coordinate ``c`` on ``axis`` sends to coordinate
    ``(c + shift) mod size`` (the other coordinates unchanged), as
    ``jax.lax.ppermute`` with ``perm = [(i, (i + shift) % size)]`` per axis
    ring. One phase; on a line (no wraparound) the messages that wrap travel
    back along the line over several hops. Cost on a ring with ``shift = 1``:
    ``V / W`` plus one hop ([MARIN] measures this on v5p and v6e).

    Args:
        topology: the torus.
        num_elements: elements per rank, >= 0.
        itemsize: bytes per element, >= 1.
        shift: places to move, any int (negative: the other way).
        axis: the torus axis, 0 <= axis < ndim.

    Returns:
        A Schedule named ``"ppermute"`` with ``op == "ppermute"`` and one
        chunk (the buffer); every rank ends with the buffer of the rank
        ``shift`` places before it.

    Raises:
        ScheduleError: a bad count, shift or axis.
    """
    n, num_elements, itemsize = _check_counts(topology, num_elements, itemsize)
    if (isinstance(axis, bool) or not isinstance(axis, (int, np.integer))
            or not 0 <= axis < topology.ndim):
        raise ScheduleError(f"ppermute axis {axis!r} is not valid: expected 0..{topology.ndim - 1}")
    if isinstance(shift, bool) or not isinstance(shift, (int, np.integer)):
        raise ScheduleError(f"ppermute shift {shift!r} is not valid: expected an int")
    ranks = np.arange(n).reshape(topology.shape)
    # position c holds the rank from c - shift
    sources = np.roll(ranks, int(shift), axis=axis).reshape(-1)
    whole = num_elements * itemsize
    phase = tuple(_make_transfer((int(src), int(dst), 0, whole, False, 0))
                  for src, dst in zip(sources.tolist(), ranks.reshape(-1).tolist(), strict=True)
                  if src != dst) if whole else ()
    return _trusted_schedule(
        name="ppermute", num_ranks=n, num_elements=num_elements, itemsize=itemsize,
        chunk_bounds=((0, num_elements),), phases=(phase,) if phase else (), op="ppermute",
        owned_chunks=(), root=0,
    )
