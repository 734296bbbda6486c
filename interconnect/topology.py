"""Chip topologies of the inter-chip interconnect (ICI): ring, 2-D, 3-D torus.

A :class:`Torus` is an immutable value, like a JAX device mesh: a shape (chips
per axis) and, per axis, whether the axis has wraparound links. It covers

- a 1-D ring (``Torus((8,))``) or a line of chips (``wraparound=False``),
- a 2-D torus or mesh (``Torus((4, 4))``, v2/v3/v5e/v6e),
- a 3-D torus or mesh (``Torus((4, 4, 4))``, v4/v5p).

Conventions and invariants (the tests check each of them):

- **Ranks <-> coordinates**: row-major, the last axis varies fastest, as
  ``np.ravel_multi_index`` / ``np.unravel_index`` with the default order "C".
  In a 2x2 torus rank 0 = (0, 0), 1 = (0, 1), 2 = (1, 0), 3 = (1, 1).
- **Links** are directed ``(src, dst)`` rank pairs, one per direction; each
  has its own bandwidth (see :class:`~interconnect.link.LinkSpec`). Two chips
  are neighbours when their coordinates differ on exactly one axis, by 1, or
  by ``size - 1`` when that axis wraps around.
- An axis of **size 1** adds no links. An axis of **size 2** has one link per
  direction between its two chips whether or not it wraps (the wraparound
  link would join the same pair; it is not counted twice).
- **Routes** are dimension-order (axis 0 first, then 1, then 2); on an axis
  with wraparound a route takes the shorter way round. On a tie (half-way
  round an even ring) it goes the positive way from an even coordinate and
  the negative way from an odd one, so tied messages (an all-to-all's)
  share both directions instead of loading one. The hop count is the torus
  Manhattan distance.
- **Ring order** (:meth:`Torus.ring_order`) is a Hamiltonian cycle over
  neighbour links wherever the shape has one; see that method.
"""

from __future__ import annotations

import functools
import math
import operator
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from interconnect.errors import TopologyError

__all__ = ["link_ids", "link_of_id", "MAX_AXES", "parse_shape", "Torus"]

#: Largest number of torus axes (the largest TPU pods are 3-D tori).
MAX_AXES = 3

_SHAPE_RE = re.compile(r"^\s*\d+\s*(?:[xX]\s*\d+\s*)*$")

Link = tuple[int, int]


def parse_shape(text: str) -> tuple[int, ...]:
    """Parses a topology shape written like ``"8"``, ``"4x4"`` or ``"4x4x4"``.

    Args:
        text: chips per axis joined by ``x`` (spaces around numbers and an
            upper-case ``X`` are accepted), 1 to 3 axes, each at least 1.

    Returns:
        The shape as a tuple of ints, e.g. ``parse_shape("2x2") == (2, 2)``.

    Raises:
        TopologyError: ``text`` is not a string of that form; the message
            quotes it and shows the allowed form.
    """
    if not isinstance(text, str) or not _SHAPE_RE.match(text):
        raise TopologyError(
            f"shape {text!r} is not valid: write chips per axis joined by 'x', "
            f"1 to {MAX_AXES} axes, e.g. '8', '4x4' or '4x4x4'"
        )
    shape = tuple(int(part) for part in re.split(r"[xX]", text))
    return _check_shape(shape, shown=repr(text))


def _check_shape(shape: tuple[int, ...], shown: str) -> tuple[int, ...]:
    if not 1 <= len(shape) <= MAX_AXES:
        raise TopologyError(
            f"shape {shown} has {len(shape)} axes; allowed: 1 to {MAX_AXES} "
            f"(ring, 2-D or 3-D torus), e.g. '8', '4x4' or '4x4x4'"
        )
    if any(size < 1 for size in shape):
        raise TopologyError(
            f"shape {shown} is not valid: every axis needs at least 1 chip; "
            f"write it like '8', '4x4' or '4x4x4'"
        )
    return shape


def _normalise_shape(shape: object) -> tuple[int, ...]:
    if isinstance(shape, str):
        return parse_shape(shape)
    if isinstance(shape, (int, np.integer)) and not isinstance(shape, bool):
        shape = (shape,)
    if not isinstance(shape, Sequence):
        raise TopologyError(
            f"shape {shape!r} is not valid: expected a tuple of ints such as "
            f"(4, 4) or a string such as '4x4'"
        )
    sizes = []
    for size in shape:
        if isinstance(size, bool):
            raise TopologyError(f"shape {tuple(shape)!r} is not valid: axis sizes must be ints, "
                                f"got {size!r}")
        try:
            sizes.append(operator.index(size))
        except TypeError:
            raise TopologyError(
                f"shape {tuple(shape)!r} is not valid: axis sizes must be ints, got {size!r}"
            ) from None
    return _check_shape(tuple(sizes), shown=repr(tuple(sizes)))


def _normalise_wraparound(wraparound: object, ndim: int) -> tuple[bool, ...]:
    if isinstance(wraparound, (bool, np.bool_)):
        return (bool(wraparound),) * ndim
    if isinstance(wraparound, Sequence) and not isinstance(wraparound, str):
        flags = tuple(wraparound)
        if len(flags) == ndim and all(isinstance(f, (bool, np.bool_)) for f in flags):
            return tuple(bool(f) for f in flags)
    raise TopologyError(
        f"wraparound {wraparound!r} is not valid: expected one bool or a tuple of "
        f"{ndim} bools (one per axis)"
    )


@dataclass(frozen=True)
class Torus:
    """An immutable ring, 2-D or 3-D torus (or mesh) of chips.

    Attributes:
        shape: chips per axis, 1 to 3 axes, e.g. ``(4, 4)``. A string such as
            ``"4x4"`` is parsed with :func:`parse_shape`.
        wraparound: per axis, whether the last chip links back to the first.
            A single bool applies to every axis; it is normalised to a tuple
            with one bool per axis.

    Raises:
        TopologyError: on construction, for a shape with 0 or more than 3
            axes, a size below 1, or a wraparound that is neither a bool nor
            one bool per axis; by the methods, for a rank outside
            ``[0, num_chips)`` or coordinates outside the shape.
    """

    shape: tuple[int, ...]
    if TYPE_CHECKING:
        # After __post_init__ the attribute is always one bool per axis; the
        # constructor also takes one bool (and a shape string). The type checker
        # sees this signature; at run time the dataclass's own __init__ is used.
        wraparound: tuple[bool, ...]

        def __init__(
            self, shape: tuple[int, ...] | str, wraparound: tuple[bool, ...] | bool = True
        ) -> None: ...
    else:
        wraparound: tuple[bool, ...] | bool = True

    def __post_init__(self) -> None:
        shape = _normalise_shape(self.shape)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "wraparound", _normalise_wraparound(self.wraparound, len(shape)))

    # ----------------------------------------------------------------- sizes

    @property
    def ndim(self) -> int:
        """Number of axes (1 for a ring)."""
        return len(self.shape)

    @functools.cached_property
    def num_chips(self) -> int:
        """Number of chips, the product of the shape (counted once: every rank check asks)."""
        return math.prod(self.shape)

    @property
    def name(self) -> str:
        """The shape as text, e.g. ``"4x4x4"`` (parses back with parse_shape)."""
        return "x".join(str(size) for size in self.shape)

    @functools.cached_property
    def _strides(self) -> tuple[int, ...]:
        strides = [1] * self.ndim
        for axis in range(self.ndim - 2, -1, -1):
            strides[axis] = strides[axis + 1] * self.shape[axis + 1]
        return tuple(strides)

    # ---------------------------------------------------- ranks, coordinates

    def _check_rank(self, rank: int) -> int:
        try:
            value = operator.index(rank)
        except TypeError:
            value = None
        if value is None or isinstance(rank, bool) or not 0 <= value < self.num_chips:
            raise TopologyError(
                f"rank {rank!r} is not in torus {self.name}: allowed 0 to {self.num_chips - 1}"
            )
        return value

    def coords(self, rank: int) -> tuple[int, ...]:
        """Coordinates of a rank (row-major, last axis fastest).

        Args:
            rank: 0 <= rank < num_chips.

        Returns:
            One coordinate per axis, e.g. rank 2 of a 2x2 torus -> (1, 0).

        Raises:
            TopologyError: rank out of range.
        """
        rank = self._check_rank(rank)
        out = []
        for stride, size in zip(self._strides, self.shape, strict=True):
            out.append((rank // stride) % size)
        return tuple(out)

    def rank(self, coords: Sequence[int]) -> int:
        """Rank of a coordinate tuple (inverse of :meth:`coords`).

        Args:
            coords: one int per axis, ``0 <= coords[a] < shape[a]``.

        Returns:
            The row-major rank, e.g. (1, 0) in a 2x2 torus -> 2.

        Raises:
            TopologyError: wrong number of coordinates or one out of range.
        """
        coords = tuple(coords)
        if len(coords) != self.ndim or not all(
            isinstance(c, (int, np.integer)) and not isinstance(c, bool) and 0 <= c < size
            for c, size in zip(coords, self.shape, strict=True)
        ):
            raise TopologyError(
                f"coordinates {coords!r} are not in torus {self.name}: expected "
                f"{self.ndim} ints with 0 <= coords[axis] < {self.shape}"
            )
        return int(sum(int(c) * s for c, s in zip(coords, self._strides, strict=True)))

    # ------------------------------------------------------ neighbours, links

    def axis_wraps(self, axis: int) -> bool:
        """True when the axis has a wraparound link distinct from its others."""
        return self.wraparound[axis] and self.shape[axis] > 2

    def neighbors(self, rank: int) -> list[int]:
        """Ranks joined to ``rank`` by one link, in increasing order.

        A chip has up to 2 neighbours per axis: 2 on an axis with wraparound
        and size >= 3, 1 on an axis of size 2, 0 on an axis of size 1; on a
        mesh axis the end chips have 1.

        Args:
            rank: 0 <= rank < num_chips.

        Returns:
            Sorted list of distinct neighbour ranks (never ``rank`` itself).

        Raises:
            TopologyError: rank out of range.
        """
        rank = self._check_rank(rank)
        found = set()
        for axis, (size, stride) in enumerate(zip(self.shape, self._strides, strict=True)):
            c = (rank // stride) % size
            for step in (-1, 1):
                nc = c + step
                if not 0 <= nc < size:
                    if not self.wraparound[axis]:
                        continue
                    nc %= size
                if nc != c:
                    found.add(rank + (nc - c) * stride)
        return sorted(found)

    @functools.cached_property
    def _links(self) -> tuple[Link, ...]:
        return tuple((src, dst) for src in range(self.num_chips) for dst in self.neighbors(src))

    def links(self) -> list[Link]:
        """Every directed link ``(src, dst)``, without duplicates.

        Returns:
            Sorted by ``src`` then ``dst``; its length is the sum of the
            neighbour counts (e.g. 4x4 torus: 16 x 4 = 64 links).
        """
        return list(self._links)

    def has_link(self, src: int, dst: int) -> bool:
        """Whether a directed link ``src -> dst`` exists (i.e. they are neighbours).

        Raises:
            TopologyError: a rank out of range.
        """
        cs, cd = self.coords(src), self.coords(dst)
        diff = [(axis, abs(a - b))
                for axis, (a, b) in enumerate(zip(cs, cd, strict=True)) if a != b]
        if len(diff) != 1:
            return False
        axis, d = diff[0]
        return d == 1 or (self.wraparound[axis] and d == self.shape[axis] - 1)

    # ----------------------------------------------------------------- routes

    def _axis_steps(self, axis: int, start: int, stop: int) -> tuple[int, int]:
        """(direction +1/-1, number of hops) from start to stop along one axis."""
        size = self.shape[axis]
        if self.wraparound[axis]:
            forward = (stop - start) % size
            backward = (start - stop) % size
            if forward == backward:  # half-way round an even ring: split ties by the start's parity
                return (1, forward) if start % 2 == 0 else (-1, backward)
            return (1, forward) if forward < backward else (-1, backward)
        return (1 if stop >= start else -1), abs(stop - start)

    def route(self, src: int, dst: int) -> list[Link]:
        """Dimension-order route from ``src`` to ``dst``.

        Axis 0 is corrected first, then axis 1, then axis 2. On an axis with
        wraparound the route goes the shorter way round (on a tie: the
        positive direction from an even coordinate on that axis, the negative
        one from an odd coordinate); on a mesh axis it goes straight.

        Args:
            src: source rank.
            dst: destination rank.

        Returns:
            The directed links in order (``[]`` when ``src == dst``); each one
            is in :meth:`links`, the first starts at ``src`` and the last ends
            at ``dst``. Its length equals :meth:`hops`.

        Raises:
            TopologyError: a rank out of range.
        """
        cs, cd = self.coords(src), self.coords(dst)
        path: list[Link] = []
        current = self._check_rank(src)
        for axis, (a, b) in enumerate(zip(cs, cd, strict=True)):
            if a == b:
                continue
            size, stride = self.shape[axis], self._strides[axis]
            step, count = self._axis_steps(axis, a, b)
            c = a
            for _ in range(count):
                nc = (c + step) % size
                nxt = current + (nc - c) * stride
                path.append((current, nxt))
                current, c = nxt, nc
        return path

    def hops(self, src: int, dst: int) -> int:
        """Number of links on :meth:`route` (torus Manhattan distance).

        Per axis the distance is ``|a - b|``, or ``min(|a - b|, size - |a - b|)``
        when the axis wraps; the hop count is their sum.

        Raises:
            TopologyError: a rank out of range.
        """
        cs, cd = self.coords(src), self.coords(dst)
        return sum(self._axis_steps(axis, a, b)[1]
                   for axis, (a, b) in enumerate(zip(cs, cd, strict=True)))

    # ------------------------------------------------------------- ring order

    @functools.cached_property
    def _ring_order(self) -> tuple[int, ...]:
        return tuple(_ring_order(self.shape, self.wraparound, self._strides))

    def ring_order(self) -> list[int]:
        """An order of all ranks forming a ring, over neighbour links where possible.

        The ring visits every rank once and closes from the last back to the
        first. Whenever the shape has a Hamiltonian cycle made of neighbour
        links, every consecutive pair (the closing pair included) is a link:

        - 1-D with wraparound (or size <= 2): ``[0, 1, ..., n-1]``.
        - An axis (the first one of size >= 2) with even size: a snake
          (boustrophedon). With wraparound on that axis it is the plain snake
          that closes over the wraparound link (4x4 torus: rows 0..3 left to
          right, right to left, ...); otherwise the snake skips coordinate 0
          of the other axes and returns along it, so 2x2 -> ``[0, 1, 3, 2]``
          and 2x2x2 -> ``[0, 1, 3, 2, 6, 7, 5, 4]``. 3-D shapes treat the
          remaining axes as one axis walked in their own snake order.
        - All sizes odd but an axis of size >= 3 wraps: a snake that uses the
          wraparound link of that axis once.

        Otherwise (a 1-D line of >= 3 chips, or a mesh whose sizes are all odd:
        the grid is bipartite with an odd number of chips, so no such cycle
        exists) it returns the order whose longest routed step is shortest:
        a line is walked out on even ranks and back on odd ones (every step
        <= 2 hops), an odd mesh ends 2 hops from where it started. Those
        steps travel over :meth:`route`.

        Returns:
            A permutation of ``range(num_chips)``.
        """
        return list(self._ring_order)


# --------------------------------------------------------------- ring orders


def _snake(shape: Sequence[int]) -> list[tuple[int, ...]]:
    """Boustrophedon walk of a box (first axis slowest); steps change one coordinate by 1."""
    if not shape:
        return [()]
    inner = _snake(shape[1:])
    out: list[tuple[int, ...]] = []
    for i in range(shape[0]):
        seq = inner if i % 2 == 0 else inner[::-1]
        out.extend((i,) + point for point in seq)
    return out


def _comb(a: int, b: int) -> list[tuple[int, int]]:
    """Cycle of an a x b grid (a even, b >= 2) with no wraparound links.

    Rows 0..a-1 are snaked over columns 1..b-1, then column 0 leads back up.
    """
    out = [(0, 0)]
    for i in range(a):
        cols = range(1, b) if i % 2 == 0 else range(b - 1, 0, -1)
        out.extend((i, j) for j in cols)
    out.extend((i, 0) for i in range(a - 1, 0, -1))
    return out


def _grid_ring(a: int, b: int, a_wraps: bool) -> list[tuple[int, int]]:
    """Ring order over an a x b grid of (i, j) cells, a >= 2 and b >= 2.

    Neighbours are cells whose i or j differ by 1, plus (0, j) and (a-1, j)
    when ``a_wraps``. Returns a Hamiltonian cycle when one exists, else a
    Hamiltonian path whose ends are 2 steps apart.
    """
    if a % 2 == 0 and a_wraps:
        # Plain snake; closes (a-1, 0) -> (0, 0) over the wraparound link.
        return [(i, j) for i in range(a)
                for j in (range(b) if i % 2 == 0 else range(b - 1, -1, -1))]
    if a % 2 == 0:
        return _comb(a, b)
    if b % 2 == 0:
        return [(i, j) for j, i in _comb(b, a)]
    if a_wraps:
        # a, b odd: row 0 left to right, wrap to row a-1, then snake the
        # columns b-1..0 over rows a-1..1; an odd number of columns ends at
        # (1, 0), next to (0, 0).
        out = [(0, j) for j in range(b)]
        for k, j in enumerate(range(b - 1, -1, -1)):
            rows = range(a - 1, 0, -1) if k % 2 == 0 else range(1, a)
            out.extend((i, j) for i in rows)
        return out
    # a, b odd, no wraparound: no cycle exists. Row 0, then columns b-1..2
    # snaked over rows 1..a-1 (ends at (a-1, 2)), then columns 1, 0 zig-zag
    # up to (1, 1): 2 steps from (0, 0).
    out = [(0, j) for j in range(b)]
    for k, j in enumerate(range(b - 1, 1, -1)):
        rows = range(1, a) if k % 2 == 0 else range(a - 1, 0, -1)
        out.extend((i, j) for i in rows)
    for k, i in enumerate(range(a - 1, 0, -1)):
        out.extend((i, j) for j in ((1, 0) if k % 2 == 0 else (0, 1)))
    return out


def _ring_order(shape: tuple[int, ...], wraparound: tuple[bool, ...],
                strides: tuple[int, ...]) -> list[int]:
    """Ring order of ranks; see Torus.ring_order."""
    axes = [axis for axis, size in enumerate(shape) if size >= 2]
    if not axes:
        return [0]
    if len(axes) == 1:
        (axis,) = axes
        size, stride = shape[axis], strides[axis]
        if wraparound[axis] or size <= 2:
            steps = list(range(size))
        else:  # a line: out on the even positions, back on the odd ones
            steps = list(range(0, size, 2)) + sorted(range(1, size, 2), reverse=True)
        return [s * stride for s in steps]
    wrapping = [axis for axis in axes if wraparound[axis] and shape[axis] >= 3]
    num_chips = int(np.prod(shape))
    a_axis = wrapping[0] if num_chips % 2 == 1 and wrapping else axes[0]
    b_axes = [axis for axis in axes if axis != a_axis]
    b_ranks = [
        sum(c * strides[axis] for c, axis in zip(point, b_axes, strict=True))
        for point in _snake([shape[axis] for axis in b_axes])
    ]
    cells = _grid_ring(shape[a_axis], len(b_ranks), a_axis in wrapping)
    a_stride = strides[a_axis]
    return [i * a_stride + b_ranks[j] for i, j in cells]


# ------------------------------------------------------------------ link ids


def link_ids(topology: Torus, srcs: np.ndarray, dsts: np.ndarray) -> np.ndarray:
    """Integer id of directed links: src x 2 ndim + axis x 2 + (1 if dst is src's +1 neighbour)."""
    shape = np.asarray(topology.shape)
    strides = np.asarray(topology._strides)  # noqa: SLF001 - same module - same module
    cs = (srcs[..., None] // strides) % shape
    cd = (dsts[..., None] // strides) % shape
    axis = np.argmax(cs != cd, axis=-1)
    a = np.take_along_axis(cs, axis[..., None], -1)[..., 0]
    b = np.take_along_axis(cd, axis[..., None], -1)[..., 0]
    plus = (b == (a + 1) % shape[axis]).astype(np.int64)
    return srcs * (2 * topology.ndim) + axis * 2 + plus


def link_of_id(topology: Torus, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    shape = np.asarray(topology.shape)
    strides = np.asarray(topology._strides)  # noqa: SLF001 - same module
    src = ids // (2 * topology.ndim)
    axis = (ids % (2 * topology.ndim)) // 2
    step = np.where(ids % 2 == 1, 1, -1)
    c = (src // strides[axis]) % shape[axis]
    dst = src + (((c + step) % shape[axis]) - c) * strides[axis]
    return src, dst
