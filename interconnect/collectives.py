"""Collective schedules: pure functions that *build* the list of copies.

As in tinygrad's ring allreduce, an algorithm here only describes who sends
which chunk to whom, phase by phase; :mod:`interconnect.execute` runs it on
in-memory buffers, ``pod/collective.py`` runs it over chip actors and
:mod:`interconnect.cost` times it. Allreduce is composed, optax-style, from a
reduce-scatter followed by an all-gather (:func:`chain_schedules`).

Ring collectives over ``n`` ranks walk the ring ``order = topology.ring_order()``;
"position ``i``" is rank ``order[i]`` and its successor is position
``(i + 1) mod n``. The buffer of ``num_elements`` elements is cut into ``n``
chunks as ``np.array_split`` cuts (:func:`chunk_bounds`).

- Reduce-scatter, phase ``s = 0 .. n-2``: position ``i`` sends chunk
  ``(i - s) mod n`` to position ``i + 1``, which adds it to its own. After it,
  position ``p`` holds the full sum of chunk ``(p + 1) mod n``.
- All-gather, phase ``s = 0 .. n-2``: position ``i`` sends chunk
  ``(i + 1 - s) mod n`` to position ``i + 1``, which copies it.

A chunk of zero elements (``num_elements < n``) is never sent: its transfers
are left out, so a phase can be empty (it costs 0 s and executes nothing).
With ``n = 1`` there are no phases.

Textbook cost on a full unidirectional ring of link bandwidth ``W``, ``V``
bytes per rank: ``(n-1)/n x V / W`` for each half, ``2 (n-1)/n x V / W`` for
the allreduce ([SB], "Textbook collective
costs").
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Iterable, Sequence
from itertools import compress, repeat

import numpy as np

from interconnect.errors import ScheduleError
from interconnect.topology import Torus

__all__ = [
    "Transfer",
    "Schedule",
    "chunk_bounds",
    "ring_reduce_scatter",
    "ring_all_gather",
    "ring_allreduce",
    "chain_schedules",
    "axis_rings",
    "halving_doubling_allreduce",
    "tree_allreduce",
    "all_to_all",
    "broadcast",
]


from interconnect.schedule import (  # noqa: E402,F401
    OPS,
    Phase,
    Schedule,
    Transfer,
    _check_bytes,
    _check_counts,
    _gc_paused,
    _make_transfer,
    _non_negative_int,
    _trusted_schedule,
    chunk_bounds,
)


def _ring_phases(
    order: Sequence[int], chunk_nbytes: Sequence[int], reduce: bool, chunk_offset: int
) -> tuple[Phase, ...]:
    """n-1 ring phases; in phase s position i sends chunk (i - s + chunk_offset) mod n."""
    n = len(order)
    order = list(order)
    successors = order[1:] + order[:1]
    chunks = list(range(n))
    nbytes = list(chunk_nbytes)
    any_empty = not all(nbytes)
    phases = []
    with _gc_paused():
        for s in range(n - 1):
            shift = (s - chunk_offset) % n  # chunk of position i is (i - shift) mod n
            cut = n - shift
            phase_chunks = chunks[cut:] + chunks[:cut]
            phase_nbytes = nbytes[cut:] + nbytes[:cut]
            rows: Iterable[tuple[object, ...]] = zip(order, successors, phase_chunks, phase_nbytes,
                                                      repeat(reduce), phase_chunks)
            if any_empty:
                rows = compress(rows, phase_nbytes)
            phases.append(tuple(map(_make_transfer, rows)))
    return tuple(phases)


def _ring_setup(topology: object, num_elements: int, itemsize: int):
    try:
        order = topology.ring_order()  # type: ignore[attr-defined]
        num_ranks = topology.num_chips  # type: ignore[attr-defined]
    except AttributeError:
        raise ScheduleError(
            f"topology {topology!r} is not valid: expected an interconnect.Torus"
        ) from None
    num_elements = _non_negative_int("num_elements", num_elements)
    itemsize = _non_negative_int("itemsize", itemsize)
    if itemsize < 1:
        raise ScheduleError(f"itemsize {itemsize!r} is not valid: expected an int >= 1 "
                            "(bytes per element)")
    _check_bytes(num_elements, itemsize)
    bounds = chunk_bounds(num_elements, num_ranks)
    chunk_nbytes = [(stop - start) * itemsize for start, stop in bounds]
    return order, num_ranks, num_elements, itemsize, bounds, chunk_nbytes


def ring_reduce_scatter(topology: object, num_elements: int, itemsize: int = 4) -> Schedule:
    """Ring reduce-scatter along ``topology.ring_order()``.

    ``n - 1`` phases; in phase ``s`` position ``i`` sends chunk
    ``(i - s) mod n`` to position ``i + 1``, which adds it to its own. After
    the last phase position ``p`` (rank ``ring_order()[p]``) holds the sum of
    chunk ``(p + 1) mod n`` over all ranks. Time on a full unidirectional
    ring: ``(n-1)/n x V / W`` for ``V = num_elements x itemsize`` bytes.

    Args:
        topology: a :class:`~interconnect.topology.Torus` (n = num_chips).
        num_elements: elements per rank's buffer, >= 0.
        itemsize: bytes per element (4 for float32), >= 1.

    Returns:
        A Schedule named ``"ring_reduce_scatter"`` with ``n`` chunks (as
        np.array_split) and ``n - 1`` phases; zero-byte transfers are left out.

    Raises:
        ScheduleError: a bad count or a topology without ``ring_order``.
    """
    order, n, num_elements, itemsize, bounds, chunk_nbytes = _ring_setup(topology, num_elements,
                                                                        itemsize)
    return _trusted_schedule(
        name="ring_reduce_scatter", num_ranks=n, num_elements=num_elements, itemsize=itemsize,
        chunk_bounds=bounds, phases=_ring_phases(order, chunk_nbytes, reduce=True, chunk_offset=0),
        op="reduce_scatter", owned_chunks=_ring_owners(order), root=0,
    )


def ring_all_gather(topology: object, num_elements: int, itemsize: int = 4) -> Schedule:
    """Ring all-gather along ``topology.ring_order()``.

    Expects position ``p`` to hold chunk ``(p + 1) mod n`` (what
    :func:`ring_reduce_scatter` leaves). ``n - 1`` phases; in phase ``s``
    position ``i`` sends chunk ``(i + 1 - s) mod n`` to position ``i + 1``,
    which copies it. Time on a full unidirectional ring: ``(n-1)/n x V / W``.

    Args:
        topology: a :class:`~interconnect.topology.Torus` (n = num_chips).
        num_elements: elements per rank's buffer, >= 0.
        itemsize: bytes per element, >= 1.

    Returns:
        A Schedule named ``"ring_all_gather"`` with ``n - 1`` phases of copies.

    Raises:
        ScheduleError: a bad count or a topology without ``ring_order``.
    """
    order, n, num_elements, itemsize, bounds, chunk_nbytes = _ring_setup(topology, num_elements,
                                                                        itemsize)
    return _trusted_schedule(
        name="ring_all_gather", num_ranks=n, num_elements=num_elements, itemsize=itemsize,
        chunk_bounds=bounds, phases=_ring_phases(order, chunk_nbytes, reduce=False, chunk_offset=1),
        op="all_gather", owned_chunks=_ring_owners(order), root=0,
    )


def _ring_owners(order: Sequence[int]) -> tuple[int, ...]:
    """Chunk owned by each rank after a ring reduce-scatter: position p owns (p + 1) mod n."""
    n = len(order)
    owned = [0] * n
    for position, rank in enumerate(order):
        owned[rank] = (position + 1) % n
    return tuple(owned)


def chain_schedules(name: str, *schedules: Schedule, op: str = "allreduce") -> Schedule:
    """Runs schedules one after the other: their phases concatenated.

    Args:
        name: name of the composed schedule.
        *schedules: at least one; all with the same ``num_ranks``,
            ``num_elements``, ``itemsize`` and ``chunk_bounds``.
        op: what the composition does (default ``"allreduce"``: a
            reduce-scatter followed by an all-gather).

    Returns:
        A Schedule whose phases are those of ``schedules`` in order.

    Raises:
        ScheduleError: no schedules, or schedules that do not match.
    """
    if not schedules:
        raise ScheduleError("chain_schedules needs at least one schedule, got none")
    first = schedules[0]
    key = (first.num_ranks, first.num_elements, first.itemsize, first.chunk_bounds)
    for other in schedules[1:]:
        other_key = (other.num_ranks, other.num_elements, other.itemsize, other.chunk_bounds)
        if other_key != key:
            raise ScheduleError(
                f"cannot chain {other.name!r} after {first.name!r}: num_ranks, num_elements, "
                f"itemsize and chunk_bounds must match"
            )
    if not isinstance(name, str) or not name:
        raise ScheduleError(f"Schedule name {name!r} is not valid: expected a non-empty string")
    return _trusted_schedule(
        name=name, num_ranks=first.num_ranks, num_elements=first.num_elements,
        itemsize=first.itemsize,
        chunk_bounds=first.chunk_bounds, phases=tuple(p for s in schedules for p in s.phases),
        op=op, owned_chunks=(), root=0,
    )


def ring_allreduce(topology: object, num_elements: int, itemsize: int = 4) -> Schedule:
    """Ring allreduce: :func:`ring_reduce_scatter` then :func:`ring_all_gather`.

    Every rank ends with the elementwise sum of all ranks' buffers; every
    rank's copy of a chunk was computed once (at its owner) and copied, so
    all ranks end bit-identical. Time on a full unidirectional ring of link
    bandwidth ``W``: ``2 (n-1)/n x V / W + 2 (n-1) x latency`` for
    ``V = num_elements x itemsize`` bytes ([SB], "Textbook collective
    costs").

    Args:
        topology: a :class:`~interconnect.topology.Torus` (n = num_chips).
        num_elements: elements per rank's buffer, >= 0.
        itemsize: bytes per element (4 for float32), >= 1.

    Returns:
        A Schedule named ``"ring_allreduce"`` with ``n`` chunks and
        ``2 (n - 1)`` phases (none for n = 1); zero-byte transfers left out.
        Repeated calls with an equal Torus and counts return the same
        (immutable) object from a small LRU cache.

    Raises:
        ScheduleError: a bad count or a topology without ``ring_order``.
    """
    _ring_setup(topology, num_elements, itemsize)  # validates before the cache sees the arguments
    if isinstance(topology, Torus):
        return _cached_ring_allreduce(topology, operator.index(num_elements),
                                      operator.index(itemsize))
    return _ring_allreduce(topology, num_elements, itemsize)


def _ring_allreduce(topology: object, num_elements: int, itemsize: int) -> Schedule:
    return chain_schedules(
        "ring_allreduce",
        ring_reduce_scatter(topology, num_elements, itemsize),
        ring_all_gather(topology, num_elements, itemsize),
    )


# Schedules are immutable, so a training loop asking for the same allreduce
# every step gets the one already built.
_cached_ring_allreduce = functools.lru_cache(maxsize=8)(_ring_allreduce)


# ------------------------------------------------------------------------------
# The other algorithms: recursive halving-doubling, binomial tree, all-to-all,
# broadcast (the bidirectional ring, the multi-axis torus and ppermute are in
# interconnect.chains; interconnect.registry names them all).
# ------------------------------------------------------------------------------

class _ChunkTree:
    """Chunk bounds built on demand: a chunk is cut into parts as np.array_split cuts.

    Chunk 0 is the whole buffer; the parts of a chunk are chunks too (chunks
    may nest, so a transfer at a coarse level is one transfer, not many).
    """

    def __init__(self, num_elements: int) -> None:
        self.bounds: list[tuple[int, int]] = [(0, num_elements)]
        self._parts: dict[tuple[int, int], list[int]] = {}

    def split(self, chunk: int, parts: int) -> list[int]:
        key = (chunk, parts)
        found = self._parts.get(key)
        if found is None:
            start, stop = self.bounds[chunk]
            found = []
            for a, b in chunk_bounds(stop - start, parts):
                found.append(len(self.bounds))
                self.bounds.append((start + a, start + b))
            self._parts[key] = found
        return found

    def nbytes(self, chunk: int, itemsize: int) -> int:
        start, stop = self.bounds[chunk]
        return (stop - start) * itemsize


def axis_rings(topology: Torus) -> list[list[list[int]]]:
    """The rings of a multi-dimensional torus collective, axis by axis.

    Args:
        topology: the torus.

    Returns:
        One entry per axis of size >= 2 (axis 0 first): the list of rings
        along that axis, one per combination of the other coordinates; a
        ring lists ranks in the axis's own 1-D ring order
        (``Torus((size,), wraparound).ring_order()``: 0, 1, ..., size-1 when
        the axis wraps; out on even and back on odd coordinates on a line).
    """
    out = []
    ranks = np.arange(topology.num_chips).reshape(topology.shape)
    for axis, size in enumerate(topology.shape):
        if size < 2:
            continue
        order = Torus((size,), (topology.wraparound[axis],)).ring_order()
        lines = np.moveaxis(ranks, axis, -1).reshape(-1, size)[:, order]
        out.append(lines.tolist())
    return out


def halving_doubling_allreduce(topology: Torus, num_elements: int, itemsize: int = 4) -> Schedule:
    """Recursive halving reduce-scatter, then recursive doubling all-gather (Rabenseifner).

    Ranks are taken in ``topology.ring_order()``; ``p' = 2^floor(log2 n)``.
    With ``r = n - p'`` extra ranks, positions ``2j + 1 (j < r)`` first add
    their whole buffer into position ``2j`` and get the result back at the
    end (Thakur, Rabenseifner & Gropp 2005, "Optimization of collective
    communication operations in MPICH"). Among the ``p'`` others (virtual
    rank ``v``), step ``d = 0 .. log2 p' - 1`` pairs ``v`` with ``v xor 2^d``
    (the nearest partners first): each keeps the half of its current chunk
    selected by bit ``d`` of ``v`` and adds the other half into its
    partner's; the all-gather undoes the steps in reverse order with copies.

    Cost on a full bidirectional ring of ``n = 2^k`` chips, busiest link
    (der.: step ``d`` moves ``V / 2^(d+1)`` over ``2^d`` hops and ``2^d``
    routes share the busiest link, except the last step, whose partners are
    half-way round: those tied routes split between both directions, so
    half as many share a link): ``(k - 1/2) x V / (2W)`` per half,
    ``(k - 1/2) V / W`` for the allreduce, plus latency ``2 (n - 1)`` hops.

    Args:
        topology: the torus (n = num_chips).
        num_elements: elements per rank, >= 0.
        itemsize: bytes per element, >= 1.

    Returns:
        A Schedule named ``"halving_doubling_allreduce"``.

    Raises:
        ScheduleError: a bad count or topology.
    """
    n, num_elements, itemsize = _check_counts(topology, num_elements, itemsize)
    order = topology.ring_order()
    tree = _ChunkTree(num_elements)
    whole = tree.nbytes(0, itemsize)
    k = n.bit_length() - 1
    p2 = 1 << k
    extra = n - p2
    virtual = [order[2 * j] for j in range(extra)] + order[2 * extra:]
    pre, post = [], []
    if whole and extra:
        pre = [_make_transfer((order[2 * j + 1], order[2 * j], 0, whole, True, 0))
               for j in range(extra)]
        post = [_make_transfer((order[2 * j], order[2 * j + 1], 0, whole, False, 0))
                for j in range(extra)]
    node = [0] * p2
    history: list[list[int]] = []
    rs_phases, ag_phases = [], []
    for d in range(k):
        phase = []
        history.append(list(node))
        new = list(node)
        for v in range(p2):
            children = tree.split(node[v], 2)
            keep = (v >> d) & 1
            new[v] = children[keep]
            give = children[1 - keep]
            nbytes = tree.nbytes(give, itemsize)
            if nbytes:
                phase.append(_make_transfer((virtual[v], virtual[v ^ (1 << d)], give, nbytes,
                                             True, give)))
        node = new
        rs_phases.append(tuple(phase))
    for d in range(k - 1, -1, -1):
        phase = []
        for v in range(p2):
            nbytes = tree.nbytes(node[v], itemsize)
            if nbytes:
                phase.append(_make_transfer((virtual[v], virtual[v ^ (1 << d)], node[v], nbytes,
                                             False, node[v])))
        node = history[d]
        ag_phases.append(tuple(phase))
    phases = ([tuple(pre)] if pre else []) + rs_phases + ag_phases + ([tuple(post)] if post else [])
    return _trusted_schedule(
        name="halving_doubling_allreduce", num_ranks=n, num_elements=num_elements,
        itemsize=itemsize, chunk_bounds=tuple(tree.bounds), phases=tuple(phases), op="allreduce",
        owned_chunks=(), root=0,
    )


def _binomial_steps(n: int) -> list[int]:
    steps, mask = [], 1
    while mask < n:
        steps.append(mask)
        mask <<= 1
    return steps


def tree_allreduce(topology: Torus, num_elements: int, itemsize: int = 4) -> Schedule:
    """Binomial-tree reduce of whole buffers to one rank, then a binomial-tree broadcast.

    Positions are ``topology.ring_order()``. Reduce step ``m = 1, 2, 4, ...``:
    position ``p`` with ``p mod 2m == m`` adds its buffer into ``p - m``;
    broadcast: the steps in reverse, ``p`` copies to ``p + m``. Each step
    moves the whole ``V`` bytes over ``m`` hops on disjoint stretches of the
    ring, so on a full ring the cost is ``2 ceil(log2 n) x V / W`` plus
    latency ``2 (n - 1)`` hops (der.; a tree trades bandwidth for few steps).

    Args:
        topology: the torus (n = num_chips).
        num_elements: elements per rank, >= 0.
        itemsize: bytes per element, >= 1.

    Returns:
        A Schedule named ``"tree_allreduce"`` with one chunk (the buffer).

    Raises:
        ScheduleError: a bad count or topology.
    """
    n, num_elements, itemsize = _check_counts(topology, num_elements, itemsize)
    order = topology.ring_order()
    whole = num_elements * itemsize
    up, down = [], []
    for m in _binomial_steps(n) if whole else []:
        up.append(tuple(_make_transfer((order[p], order[p - m], 0, whole, True, 0))
                        for p in range(m, n, 2 * m)))
    for m in reversed(_binomial_steps(n)) if whole else []:
        down.append(tuple(_make_transfer((order[p], order[p + m], 0, whole, False, 0))
                          for p in range(0, n - m, 2 * m)))
    return _trusted_schedule(
        name="tree_allreduce", num_ranks=n, num_elements=num_elements, itemsize=itemsize,
        chunk_bounds=((0, num_elements),), phases=tuple(up + down), op="allreduce",
        owned_chunks=(), root=0,
    )


def all_to_all(topology: Torus, num_elements: int, itemsize: int = 4) -> Schedule:
    """Direct all-to-all: chunk ``j`` of rank ``r`` goes to chunk ``r`` of rank ``j``.

    One phase; every message takes its routed path and the busiest link
    decides. On a full 1-D ring of ``n`` chips (``n`` a multiple of 4) a
    link carries ``(n/2 - 1) n/4 + n/4`` of the ``V / n`` chunks: every
    route of 1 to ``n/2 - 1`` hops crossing it, and a quarter of the ``n``
    routes of ``n/2`` hops, whose ties split between the two directions
    (der.; about ``n^2 / 8``).

    Args:
        topology: the torus (n = num_chips).
        num_elements: elements per rank, a multiple of n (chunks must be equal).
        itemsize: bytes per element, >= 1.

    Returns:
        A Schedule named ``"direct_all_to_all"`` with ``n`` equal chunks.

    Raises:
        ScheduleError: ``num_elements`` not a multiple of n, or a bad count.
    """
    n, num_elements, itemsize = _check_counts(topology, num_elements, itemsize)
    if num_elements % n:
        raise ScheduleError(
            f"all-to-all needs num_elements ({num_elements}) to be a multiple of the {n} ranks "
            f"(every rank sends an equal chunk to every other)"
        )
    bounds = chunk_bounds(num_elements, n)
    nbytes = num_elements // n * itemsize
    phase = tuple(_make_transfer((r, j, j, nbytes, False, r)) for r in range(n) for j in range(n)
                  if j != r) if nbytes else ()
    return _trusted_schedule(
        name="direct_all_to_all", num_ranks=n, num_elements=num_elements, itemsize=itemsize,
        chunk_bounds=bounds, phases=(phase,) if phase else (), op="all_to_all",
        owned_chunks=(), root=0,
    )


def broadcast(topology: Torus, num_elements: int, itemsize: int = 4, root: int = 0,
              algorithm: str = "pipelined_ring") -> Schedule:
    """Broadcast rank ``root``'s buffer to every rank.

    ``"pipelined_ring"``: the buffer is cut into ``n`` chunks that stream
    along ``topology.ring_order()`` starting at ``root``: in phase ``s``
    position ``i`` (0 = root) sends chunk ``s - i`` to position ``i + 1``,
    ``2 (n - 1)`` phases of ``V / n``: ``2 (n-1)/n x V / W`` on a full ring.
    ``"tree"``: binomial tree of whole buffers, ``ceil(log2 n) x V / W``.

    Args:
        topology: the torus (n = num_chips).
        num_elements: elements per rank, >= 0.
        itemsize: bytes per element, >= 1.
        root: the rank whose buffer is sent.
        algorithm: ``"pipelined_ring"`` or ``"tree"``.

    Returns:
        A Schedule with ``op == "broadcast"``.

    Raises:
        ScheduleError: a bad count, root or algorithm.
    """
    if algorithm not in ("pipelined_ring", "tree"):
        raise ScheduleError(f"algorithm {algorithm!r} is not available for broadcast: expected "
                            "one of pipelined_ring, tree")
    n, num_elements, itemsize = _check_counts(topology, num_elements, itemsize)
    if isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < n:
        raise ScheduleError(f"broadcast root {root!r} is not valid: expected a rank 0..{n - 1}")
    ring = topology.ring_order()
    start = ring.index(root)
    order = ring[start:] + ring[:start]
    phases = []
    bounds: tuple[tuple[int, int], ...]
    if algorithm == "tree":
        bounds = ((0, num_elements),)
        whole = num_elements * itemsize
        for m in reversed(_binomial_steps(n)) if whole else []:
            phases.append(tuple(_make_transfer((order[p], order[p + m], 0, whole, False, 0))
                                for p in range(0, n - m, 2 * m)))
    else:
        bounds = chunk_bounds(num_elements, n)
        sizes = [(b - a) * itemsize for a, b in bounds]
        for s in range(2 * (n - 1)):
            phase = tuple(_make_transfer((order[i], order[i + 1], s - i, sizes[s - i], False,
                                          s - i))
                          for i in range(n - 1) if 0 <= s - i < n and sizes[s - i])
            phases.append(phase)
    return _trusted_schedule(
        name=f"{algorithm}_broadcast", num_ranks=n, num_elements=num_elements, itemsize=itemsize,
        chunk_bounds=bounds, phases=tuple(phases), op="broadcast", owned_chunks=(), root=root,
    )
