"""The direct all-to-all's link loads in closed form: no pair of chips is enumerated.

In a direct all-to-all (:func:`interconnect.collectives.all_to_all`, XLA's on a
TPU slice) every ordered pair ``(s, t)`` of a group sends one piece on its
dimension-order route (:meth:`~interconnect.topology.Torus.route`: axis 0
first, the shorter way round a ring, a tie from an even coordinate forward).
Built pair by pair that is ``g^2`` messages per group: 3.8 GB and 25 s for 128
chips as Transfer objects, 11.8 GB for 16,384 chips as arrays.

When a group is a *block* of the torus, the product ``S_0 x S_1 x S_2`` of one
set of coordinates per axis (a whole torus, or the devices of a mesh axis,
which take one block of each torus axis they span), the load of a link is a
product. A route crosses a link of axis ``d`` at chip ``x`` while its
coordinates before ``d`` are already the destination's and those after ``d``
still the source's; so ``x_e`` must be in ``S_e`` for every other axis and the
other end of that axis is free::

    pairs(x, d, direction) = L_d(x_d, direction) x prod_{e != d} |S_e| [x_e in S_e]

where ``L_d(c, +)`` counts the ordered pairs of ``S_d`` whose 1-D route on
axis ``d`` crosses the link ``c -> c + 1`` (:func:`axis_route_counts`, O(a)
with prefix sums). On a line it is ``#S[0..c] x #S[c+1..]``; on a ring the
sources within the forward reach ``h`` of the link (``h = floor((a-1)/2)``,
and half-way from even coordinates when ``a`` is even) each count the members
between the link and their reach. The ``-`` direction is the ``+`` one of the
mirrored axis (``x -> a - 1 - x`` keeps "a tie from an even coordinate" when
``a`` is even). Groups add up. The result is the same integer count per link
as routing every pair, so a cost computed from it is bit-identical to the
pairwise one; :mod:`tests.interconnect.test_all_to_all` checks it on every
torus shape up to 256 chips.
"""

from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Sequence

import numpy as np

from interconnect.topology import Torus, link_ids

__all__ = ["axis_route_counts", "block_sets", "block_link_counts", "torus_link_counts"]


def axis_route_counts(members: np.ndarray, wraps: bool) -> tuple[np.ndarray, np.ndarray]:
    """Ordered pairs of ``members`` whose route along one axis crosses each link.

    Args:
        members: (a,) bool, the coordinates of the axis a group holds.
        wraps: the axis closes into a ring (and has at least 3 chips).

    Returns:
        (plus, minus), (a,) int64 each: ``plus[c]`` crosses ``c -> c + 1`` (mod a),
        ``minus[c]`` crosses ``c -> c - 1``.
    """
    a = members.size
    m = members.astype(np.int64)
    if not wraps or a < 3:
        below = np.cumsum(m)                                     # #S in [0, c]
        above = m.sum() - below                                  # #S in [c+1, a)
        plus = below * above
        minus = np.zeros(a, np.int64)
        minus[1:] = above[:-1] * below[:-1]                       # #S in [c, a) x #S in [0, c)
        return plus, minus
    return _ring_plus(m), _ring_plus(m[::-1])[::-1]


def _ring_plus(m: np.ndarray) -> np.ndarray:
    """``plus`` of :func:`axis_route_counts` on a ring of ``a = m.size >= 3`` chips.

    A source ``s`` goes forward to the members ``1 .. h`` ahead (``h = (a-1)//2``),
    and ``a/2`` ahead too when ``a`` is even and ``s`` is even. The link out of
    ``c`` carries, from each source in the window ``[c - h + 1, c]``, the messages
    to the members in ``[c + 1, s + h]``. With the axis
    laid out three times over (indices ``a .. 2a - 1`` the real ones) and ``Q`` the
    prefix count of members::

        plus[c] = sum_{s in window} m[s] (Q[s + h + 1] - Q[c + 1])

    which is two window sums. The half-way ties add the even members ``s`` in
    ``[c - a/2 + 1, c]`` whose opposite member is in the group.
    """
    a = m.size
    h = (a - 1) // 2
    m3 = np.tile(m, 3)                                           # (3a,)
    q = np.concatenate(([0], np.cumsum(m3)))                     # q[i] = #members in [0, i)
    idx = np.arange(3 * a)
    reach = np.minimum(idx + h + 1, 3 * a)
    f = m3 * q[reach]                                            # m[s] Q[s + h + 1]
    fq = np.concatenate(([0], np.cumsum(f)))
    c = np.arange(a, 2 * a)                                      # the real links
    lo, hi = c - h + 1, c + 1                                    # window [c - h + 1, c]
    plus = (fq[hi] - fq[lo]) - q[c + 1] * (q[hi] - q[lo])
    if a % 2 == 0:
        k = a // 2
        s = np.arange(a)
        tie = m * np.roll(m, -k) * (s % 2 == 0)                  # even s with s + k a member
        t3 = np.concatenate(([0], np.cumsum(np.tile(tie, 3))))
        plus = plus + (t3[c + 1] - t3[c - k + 1])
    return plus.astype(np.int64)


def block_sets(topology: Torus, members: Sequence[int]) -> list[np.ndarray] | None:
    """A group's coordinate set per axis when it is a block of the torus (the product
    of those sets), else None.

    Args:
        topology: the torus.
        members: the group's chip ranks, each once.
    """
    ranks = np.asarray(members, dtype=np.int64)
    shape, strides = np.asarray(topology.shape), np.asarray(topology._strides)  # noqa: SLF001
    coords = (ranks[:, None] // strides) % shape                              # (g, ndim)
    sets = [np.unique(coords[:, d]) for d in range(topology.ndim)]
    if math.prod(len(s) for s in sets) != len(ranks) or len(np.unique(ranks)) != len(ranks):
        return None
    return sets


def _axis_max_hops(values: np.ndarray, a: int, wraps: bool) -> int:
    """The longest route along one axis between two of its coordinates ``values``."""
    if len(values) < 2:
        return 0
    if not wraps or a < 3:
        return int(values[-1] - values[0])
    ordered, best = values.tolist(), 0
    for s in ordered:  # the member nearest half-way round from s
        target = (s + a // 2) % a
        i = bisect.bisect_left(ordered, target)
        for t in (ordered[i % len(ordered)], ordered[i - 1]):
            forward = (t - s) % a
            best = max(best, min(forward, a - forward))
    return best


def block_link_counts(topology: Torus, groups: Sequence[Sequence[int]]
                      ) -> tuple[np.ndarray, int] | None:
    """Messages per directed link of every group's direct all-to-all, in closed form.

    Args:
        topology: the torus (one device per chip: groups are chip ranks).
        groups: the groups, each a block of the torus (:func:`block_sets`).

    Returns:
        (counts, max_hops): (n x 2 ndim,) int64 messages on each link id
        (``interconnect.topology.link_ids``), and the longest route of a message;
        None when a group is not a block (the caller routes its pairs).
    """
    nlinks = topology.num_chips * 2 * topology.ndim
    counts = np.zeros(nlinks, dtype=np.int64)
    strides = topology._strides  # noqa: SLF001 - same package
    max_hops = 0
    for members in groups:
        sets = block_sets(topology, members)
        if sets is None:
            return None
        wraps = [topology.axis_wraps(d) for d in range(topology.ndim)]
        max_hops = max(max_hops, sum(_axis_max_hops(s, a, w) for s, a, w
                                     in zip(sets, topology.shape, wraps, strict=True)))
        for d, a in enumerate(topology.shape):
            if a < 2 or len(sets[d]) < 2:
                continue
            held = np.zeros(a, dtype=bool)
            held[sets[d]] = True
            factor = math.prod(len(s) for e, s in enumerate(sets) if e != d)
            axes = [np.arange(a) if e == d else s for e, s in enumerate(sets)]
            grid = np.meshgrid(*axes, indexing="ij")
            rank = sum(g * stride for g, stride in zip(grid, strides, strict=True)).reshape(-1)
            c = grid[d].reshape(-1)
            for load, step in zip(axis_route_counts(held, wraps[d]), (1, -1), strict=True):
                pairs = load[c] * factor
                used = pairs > 0
                nc = (c[used] + step) % a
                dst = rank[used] + (nc - c[used]) * strides[d]
                np.add.at(counts, link_ids(topology, rank[used], dst), pairs[used])
    return counts, max_hops


@functools.lru_cache(maxsize=8)
def torus_link_counts(topology: Torus) -> tuple[np.ndarray, int]:
    """:func:`block_link_counts` of one group holding every chip of ``topology``, kept
    for the next message size (``tpu-pod collective`` costs 21 sizes on one torus).
    The array is read-only."""
    found = block_link_counts(topology, [range(topology.num_chips)])
    assert found is not None  # the whole torus is a block
    counts, max_hops = found
    counts.flags.writeable = False
    return counts, max_hops
