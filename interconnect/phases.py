"""A collective as the cost engine reads it: pairs that send, and each pair's bytes per phase.

A :class:`Schedule` lists every message as a :class:`~interconnect.schedule.Transfer`
(which chunk, reduced or copied): what an executor needs to run it. What its
*cost* needs is less: in each phase, how many bytes go from which rank to which
(:mod:`interconnect.cost` routes them and finds the busiest link). So a
collective reaches the cost engine as :class:`PairPhases`: the ``P`` ordered
pairs ``(src, dst)`` that ever send, and per phase a ``(P,)`` array of the bytes
each pair sends in it (0: nothing; two messages of one pair in one phase add
up). The pairs are routed once for every phase.

The builders here emit the regular collectives straight as arrays, without a
Transfer per message, on a *local* torus (a whole slice, or the block one
group of a mesh axis occupies; :func:`interconnect.cost.price` maps the local
ranks onto every group's devices):

- :func:`ring_phases`: the unidirectional ring along ``ring_order()``
  (:func:`interconnect.collectives.ring_allreduce`'s phases);
- :func:`axis_phases`: the multi-axis torus and the bidirectional ring
  (:func:`interconnect.chains.build_axis_collective`'s phases);
- :func:`all_to_all_phases`, :func:`ppermute_phases`: one phase of direct messages.

:func:`schedule_phases` turns any Schedule into PairPhases (the other
algorithms, and the reference the tests hold the builders to: a builder's
phases equal ``schedule_phases`` of the Schedule it stands for).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from interconnect.chains import axis_reduce_scatter_phases
from interconnect.errors import ScheduleError
from interconnect.schedule import Schedule, _check_counts
from interconnect.topology import Torus, link_ids

__all__ = ["PairPhases", "ring_phases", "axis_phases", "all_to_all_phases", "ppermute_phases",
           "schedule_phases"]

_I64 = np.int64


@dataclass(frozen=True, eq=False)
class PairPhases:
    """A collective's phases as bytes per sending pair of ranks.

    Attributes:
        num_ranks: ranks of the (local) torus the pairs name, >= 1.
        src: (P,) int64 sending rank of each pair.
        dst: (P,) int64 receiving rank (``!= src``).
        phase_bytes: one (P,) int64 array per phase, in order: the bytes each
            pair sends in that phase (0: the pair is idle).
    """

    num_ranks: int
    src: np.ndarray
    dst: np.ndarray
    phase_bytes: tuple[np.ndarray, ...]

    @property
    def num_phases(self) -> int:
        """Phases, empty ones included."""
        return len(self.phase_bytes)

    @property
    def num_pairs(self) -> int:
        """P, the pairs that ever send."""
        return int(self.src.size)

    def canonical(self) -> tuple[tuple[tuple[int, int, int], ...], ...]:
        """Per phase, the sorted ``(src, dst, bytes)`` of its sending pairs, each pair once:
        two PairPhases with equal canonical forms cost the same (tests compare builders so)."""
        out = []
        for nbytes in self.phase_bytes:
            sums: dict[tuple[int, int], int] = {}
            for s, d, b in zip(self.src.tolist(), self.dst.tolist(), nbytes.tolist(), strict=True):
                if b:
                    sums[(s, d)] = sums.get((s, d), 0) + b
            out.append(tuple(sorted((s, d, b) for (s, d), b in sums.items())))
        return tuple(out)


def _keyed(num_ranks: int, phases: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]],
           keys: Sequence[np.ndarray] | None = None) -> PairPhases:
    """PairPhases from per-phase ``(src, dst, nbytes)`` arrays of messages.

    Messages are grouped by pair: ``keys`` (one int array per phase, equal for equal pairs,
    small non-negative ints) when the caller has them, else ``src x num_ranks + dst``.
    """
    if keys is None:
        keys = [src * num_ranks + dst for src, dst, _ in phases]
    every = np.concatenate(keys) if keys else np.zeros(0, _I64)
    if every.size and every.max() < 4 * max(every.size, 1 << 16):  # dense ids: no sort
        index = np.full(int(every.max()) + 1, -1, dtype=_I64)
        index[every] = 0
        used = np.flatnonzero(index == 0)
        index[used] = np.arange(used.size)
        inverse = index[every]
    else:
        unique = np.unique(every, return_inverse=True)
        used, inverse = unique[0], unique[1]
    count = used.size
    src = np.empty(count, _I64)
    dst = np.empty(count, _I64)
    out, start = [], 0
    for s, d, nbytes in phases:
        stop = start + s.size
        at = inverse[start:stop]
        src[at], dst[at] = s, d
        out.append(np.bincount(at, weights=nbytes, minlength=count).astype(_I64)
                   if s.size else np.zeros(count, _I64))
        start = stop
    return PairPhases(num_ranks, src, dst, tuple(out))


def ring_phases(op: str, local: Torus, num_elements: int, itemsize: int = 4) -> PairPhases:
    """The unidirectional ring collective along ``local.ring_order()``, as arrays.

    Pair ``i`` is ring position ``i`` to ``i + 1`` (mod n). Parts are cut as
    ``np.array_split`` cuts the buffer; reduce-scatter phase ``s`` sends part
    ``(i - s) mod n`` from position ``i``, all-gather phase ``s`` part
    ``(i + 1 - s) mod n`` (:func:`interconnect.collectives.ring_reduce_scatter`,
    :func:`~interconnect.collectives.ring_all_gather`); an allreduce is both.
    The phases are views of one array (no (phases x n) table is made).

    Raises:
        ScheduleError: an op other than allreduce, reduce_scatter, all_gather, or bad counts.
    """
    n, num_elements, itemsize = _check_counts(local, num_elements, itemsize)
    if op not in ("allreduce", "reduce_scatter", "all_gather"):
        raise ScheduleError(f"ring {op!r} is not valid: expected allreduce, reduce_scatter or "
                            "all_gather")
    if n < 2:
        return PairPhases(n, np.zeros(0, _I64), np.zeros(0, _I64), ())
    order = np.asarray(local.ring_order(), dtype=_I64)
    k = np.arange(n)
    parts = (num_elements // n + (k < num_elements % n)).astype(_I64) * itemsize
    tiled = np.concatenate([parts, parts, parts])
    # position i sends part (i - s) mod n = tiled[n - s + i] (reduce-scatter) or
    # (i + 1 - s) mod n = tiled[n + 1 - s + i] (all-gather)
    rs = tuple(tiled[n - s:2 * n - s] for s in range(n - 1))
    ag = tuple(tiled[n + 1 - s:2 * n + 1 - s] for s in range(n - 1))
    phases = {"allreduce": rs + ag, "reduce_scatter": rs, "all_gather": ag}[op]
    return PairPhases(n, order, np.roll(order, -1), phases)


def axis_phases(op: str, local: Torus, num_elements: int, itemsize: int = 4,
                algorithm: str = "torus") -> PairPhases:
    """The multi-axis torus collective (or the bidirectional ring), as arrays.

    The reduce-scatter's phases come from
    :func:`interconnect.chains.axis_reduce_scatter_phases` (the chains of every
    axis, the parts rotated); the all-gather is those phases backwards with
    every message turned round; the allreduce is both.

    Raises:
        ScheduleError: bad counts.
    """
    n, num_elements, itemsize = _check_counts(local, num_elements, itemsize)
    rs = [(s[b > 0], d[b > 0], b[b > 0], i[b > 0])
          for s, d, b, i in axis_reduce_scatter_phases(op, local, num_elements, itemsize,
                                                       algorithm)]
    # steps along torus axes come with their link ids: pairs keyed by them, no sort
    neighbours = all((i >= 0).all() for *_, i in rs)
    ag = [(d, s, b, link_ids(local, d, s) if neighbours and s.size else i)
          for s, d, b, i in reversed(rs)]
    chosen = {"allreduce": rs + ag, "reduce_scatter": rs, "all_gather": ag}[op]
    return _keyed(n, [(s, d, b) for s, d, b, _ in chosen],
                  [i for *_, i in chosen] if neighbours else None)


def all_to_all_phases(local: Torus, num_elements: int, itemsize: int = 4) -> PairPhases:
    """The direct all-to-all: one phase in which every ordered pair sends ``V / n``.

    Raises:
        ScheduleError: ``num_elements`` not a multiple of the ranks, or bad counts.
    """
    n, num_elements, itemsize = _check_counts(local, num_elements, itemsize)
    if num_elements % n:
        raise ScheduleError(f"all-to-all needs num_elements ({num_elements}) to be a multiple of "
                            f"the {n} ranks (every rank sends an equal chunk to every other)")
    piece = num_elements // n * itemsize
    if not piece or n < 2:
        return PairPhases(n, np.zeros(0, _I64), np.zeros(0, _I64), ())
    src = np.repeat(np.arange(n, dtype=_I64), n)
    dst = np.tile(np.arange(n, dtype=_I64), n)
    keep = src != dst
    src, dst = src[keep], dst[keep]
    return PairPhases(n, src, dst, (np.full(src.size, piece, _I64),))


def ppermute_phases(local: Torus, num_elements: int, itemsize: int = 4, shift: int = 1,
                    axis: int = 0) -> PairPhases:
    """The collective permute along ``axis``: one phase, every rank's whole buffer to the
    rank ``shift`` places on (:func:`interconnect.chains.ppermute`); ranks that would
    send to themselves send nothing.

    Raises:
        ScheduleError: a bad count, shift or axis.
    """
    n, num_elements, itemsize = _check_counts(local, num_elements, itemsize)
    if (isinstance(axis, bool) or not isinstance(axis, (int, np.integer))
            or not 0 <= axis < local.ndim):
        raise ScheduleError(f"ppermute axis {axis!r} is not valid: expected 0..{local.ndim - 1}")
    if isinstance(shift, bool) or not isinstance(shift, (int, np.integer)):
        raise ScheduleError(f"ppermute shift {shift!r} is not valid: expected an int")
    ranks = np.arange(n, dtype=_I64).reshape(local.shape)
    src = ranks.reshape(-1)
    dst = np.roll(ranks, -int(shift), axis=axis).reshape(-1)
    keep = src != dst
    whole = num_elements * itemsize
    return PairPhases(n, src[keep], dst[keep],
                      (np.full(int(keep.sum()), whole, _I64),) if whole and keep.any() else ())


def schedule_phases(schedule: Schedule) -> PairPhases:
    """Any Schedule as PairPhases: its transfers grouped by (src, dst) in each phase."""
    n = schedule.num_ranks
    phases = []
    for phase in schedule.phases:
        if phase:
            columns = tuple(zip(*phase, strict=True))
            src, dst, nbytes = (np.fromiter(columns[c], dtype=_I64, count=len(phase))
                                for c in (0, 1, 3))
        else:
            src = dst = nbytes = np.zeros(0, _I64)
        phases.append((src, dst, nbytes))
    return _keyed(n, phases)
