"""A group allreduce in two phases that adds in the ring's order: the ring's bits.

A ring allreduce of ``g`` devices (``interconnect.group_ring_schedule``) is
``2 (g - 1)`` phases, each a hop from one device to the next that must wait
for the hop before it. On a machine with fewer cores than chip actors (the
quick start: 8 devices in 4 actors on 2 cores) every hop waits for the next
device's process to be scheduled, and the 14 hops of a group of 8 were a
large part of a data-parallel step's wall time.

The same sums in two phases: a ring's reduce-scatter leaves each chunk the
left fold ``(((x_a + x_b) + x_c) + ... ) + x_o`` of every device's values in
one order, ending with its owner ``o`` (``fold_orders`` derives the orders
from the schedule itself, by executing it on symbols). Here every device sends
its part of chunk ``c`` straight to the owner (phase 0), which folds them in
that order into a scratch slot (the first copied, the rest added:
``acc = acc + x``, the same float32 additions as the ring's ``x + acc``,
float addition being commutative), then adds the scratch to its own part
(``x_o + acc``, the ring's last addition), and sends the sum to every device
(phase 1, copies). Each device sends and receives ``g - 1`` chunks per phase,
as many messages and bytes as the ring's, in two rounds instead of ``2 (g -
1)``; every element is added in the ring's order, so the result is
bit-identical to the ring's (tested against ``interconnect.execute`` of the
ring schedule). Only the execution changes: the simulated cost is the plan's.

Small buffers go through one device instead (:func:`star_allreduce`): each of
the ``g - 1`` others sends its whole buffer to the group's first position,
which folds every chunk in the same ring order and sends the sum back. That is
``2 (g - 1)`` messages in all instead of ``2 g (g - 1)``: below
``STAR_MAX_BYTES`` a message costs its Python, its system calls and a thread's
wake-up rather than its bytes (the quick start's 176 kB gradient over 8
devices: 14 messages a step instead of 112), and the same additions in the
same order give the same bits.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from interconnect import Schedule, Transfer, group_ring_schedule
from pod.runtime.collective import phase_plans

__all__ = ["DirectAllreduce", "direct_allreduce", "fold_orders", "add_scratch",
           "StarAllreduce", "star_allreduce", "fold_star", "STAR_MAX_BYTES"]

#: Buffers of at most this many bytes allreduce through one device (``star_allreduce``).
#: The star's cost grows with the group times the buffer (the root moves and adds
#: ``g - 1`` buffers alone), the two-phase direct's messages with the group squared.
#: Measured on the quick start's 8 devices (``benchmarks/star_allreduce.py``, load 7,
#: median wall / mean CPU of the 4 actors): 172 KiB 9.2 / 14 ms against 18.4 / 22 ms,
#: 1 MiB 18.5 / 21 against 21.8 / 30, 2 MiB 26.1 / 32 against 24.6 / 33, 4 MiB
#: 59.2 / 68 against 39.4 / 52: the two cross between 1 and 2 MiB.
STAR_MAX_BYTES = 1 << 20


def fold_orders(schedule: Schedule) -> tuple[tuple[int, ...], ...] | None:
    """Per chunk, the ranks whose values ``schedule`` adds into it, in the order of its
    float32 additions, where every chunk ends as one left fold of every rank's value
    (``((x_a + x_b) + x_c) + ...``) that every rank holds; None otherwise (a tree
    adds two partial sums: no single order).

    Executes the schedule on symbols with ``interconnect.execute``'s semantics
    (sources as at the start of the phase; ``dst = dst + incoming`` or a copy).
    """
    n = schedule.num_ranks
    terms: list[list[tuple[int, ...]]] = [[(r,) for _ in schedule.chunk_bounds]
                                          for r in range(n)]
    for phase in schedule.phases:
        start = [list(row) for row in terms]
        for t in phase:
            src, dst = start[t.src][t.chunk], terms[t.dst][t.dst_chunk]
            if not t.reduce:
                terms[t.dst][t.dst_chunk] = src
            elif len(dst) == 1:
                terms[t.dst][t.dst_chunk] = src + dst  # x_d + F == F + x_d
            elif len(src) == 1:
                terms[t.dst][t.dst_chunk] = dst + src
            else:
                return None
    folds = tuple(terms[0])
    if any(tuple(row) != folds for row in terms) or any(sorted(f) != list(range(n))
                                                        for f in folds):
        return None
    return folds


@dataclass(frozen=True)
class DirectAllreduce:
    """A group allreduce's two phases, per local position (module docstring).

    Attributes:
        plans: per position, its ``pod.runtime.ici.RankPlan``.
        bounds: element ranges of the chunks, then of each chunk's scratch slot
            (chunk ``c``'s at index ``len(chunks) + c``, after the buffer's
            ``num_elements``; slots of different owners overlap: a device uses
            only its own).
        owned: per position, (chunk, scratch chunk) of each chunk it owns.
        extra_elements: elements a buffer needs past ``num_elements`` for its slots.
    """

    plans: tuple
    bounds: tuple[tuple[int, int], ...]
    owned: tuple[tuple[tuple[int, int], ...], ...]
    extra_elements: int


@functools.lru_cache(maxsize=64)
def direct_allreduce(size: int, num_elements: int) -> DirectAllreduce | None:
    """The two-phase allreduce with the ring's bits for a group of ``size`` positions
    and buffers of ``num_elements`` float32; None if the ring's sums are not one
    fold per chunk (never for a ring; checked all the same)."""
    ring = group_ring_schedule("allreduce", size, num_elements)
    folds = fold_orders(ring)
    if folds is None:
        return None
    chunks = ring.chunk_bounds
    owner = [fold[-1] for fold in folds]
    slots: list[tuple[int, int]] = []
    used = [0] * size  # scratch elements each owner has laid out so far
    for c, (a, b) in enumerate(chunks):
        start = num_elements + used[owner[c]]
        slots.append((start, start + b - a))
        used[owner[c]] += b - a
    scratch = len(chunks)  # chunk c's slot is chunk scratch + c
    gather: list[Transfer] = [
        Transfer(r, owner[c], c, (b - a) * 4, i > 0, scratch + c)
        for c, (a, b) in enumerate(chunks) for i, r in enumerate(folds[c][:-1])]
    scatter: list[Transfer] = [
        Transfer(owner[c], q, c, (b - a) * 4, False)
        for c, (a, b) in enumerate(chunks) for q in range(size) if q != owner[c]]
    owned = tuple(tuple((c, scratch + c) for c in range(len(chunks)) if owner[c] == p)
                  for p in range(size))
    return DirectAllreduce(tuple(phase_plans(size, [gather, scatter])),
                           tuple(chunks) + tuple(slots), owned, max(used))


def add_scratch(buffer: np.ndarray, bounds: Sequence[tuple[int, int]],
                owned: Sequence[tuple[int, int]]) -> None:
    """The owner's last addition: each owned chunk ``= chunk + its folded slot`` (in
    place; ``buffer`` flat float32 with room for the slots)."""
    for chunk, slot in owned:
        (a, b), (s, e) = bounds[chunk], bounds[slot]
        target = buffer[a:b]
        np.add(target, buffer[s:e], out=target)


@dataclass(frozen=True)
class StarAllreduce:
    """A group allreduce through its first position, the ring's bits (module docstring).

    Attributes:
        plans: per position, its ``pod.runtime.ici.RankPlan``: the root (position 0)
            receives every other position's buffer into slot ``p`` and sends the
            sum from slot ``size``; the others send chunk 0 (their buffer) and
            receive the sum into it.
        root_bounds: the root's buffer: the element range of slot ``p`` for each
            position ``p`` (its own, 0, unused: it folds from its input), then
            the sum's.
        chunks: the ring's chunk element ranges (``group_ring_schedule``).
        folds: per chunk, the positions in the order the ring adds their values
            (``fold_orders``; the owner last).
    """

    plans: tuple
    root_bounds: tuple[tuple[int, int], ...]
    chunks: tuple[tuple[int, int], ...]
    folds: tuple[tuple[int, ...], ...]

    @property
    def root(self) -> int:
        """The position that gathers, folds and sends the sum back."""
        return 0


@functools.lru_cache(maxsize=64)
def star_allreduce(size: int, num_elements: int) -> StarAllreduce | None:
    """The allreduce through one position with the ring's bits for a group of ``size``
    positions and buffers of ``num_elements`` float32; None if the ring's sums are not
    one fold per chunk (never for a ring; checked all the same)."""
    ring = group_ring_schedule("allreduce", size, num_elements)
    folds = fold_orders(ring)
    if folds is None:
        return None
    n, nbytes = int(num_elements), int(num_elements) * 4
    gather = [Transfer(p, 0, 0, nbytes, False, p) for p in range(1, size)]
    scatter = [Transfer(0, p, size, nbytes, False, 0) for p in range(1, size)]
    slots = tuple((p * n, (p + 1) * n) for p in range(size + 1))
    return StarAllreduce(tuple(phase_plans(size, [gather, scatter])), slots,
                         tuple(ring.chunk_bounds), folds)


def fold_star(star: StarAllreduce, buffer: np.ndarray, own: np.ndarray) -> None:
    """The root's folds: slot ``size`` of ``buffer`` (flat float32, ``root_bounds``) gets
    every chunk summed in its ring order, ``((x_a + x_b) + ...) + x_owner``, the
    position's values read from its slot (``own``: the root's, (n,)); the same float32
    additions as the ring's and the two-phase direct's (module docstring)."""
    size = len(star.root_bounds) - 1
    start, _ = star.root_bounds[size]
    values = [own] + [buffer[a:b] for a, b in star.root_bounds[1:size]]
    for (a, b), fold in zip(star.chunks, star.folds, strict=True):
        acc = buffer[start + a:start + b]
        np.add(values[fold[0]][a:b], values[fold[1]][a:b], out=acc)
        for p in fold[2:]:
            np.add(acc, values[p][a:b], out=acc)
