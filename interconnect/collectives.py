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
the allreduce (``../shared/reference/tpu-specs.md``, "Textbook collective
costs").
"""

from __future__ import annotations

import contextlib
import gc
import operator
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
import functools
from functools import partial
from itertools import compress, repeat
from typing import NamedTuple

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
]


class _TransferFields(NamedTuple):
    src: int
    dst: int
    chunk: int
    nbytes: int
    reduce: bool


class Transfer(_TransferFields):
    """One chunk sent over the ICI from one rank to another within a phase.

    Immutable (a named tuple, so a schedule of millions of transfers stays
    cheap to build; compare transfers with each other, not with plain tuples).

    Attributes:
        src: sending rank, >= 0.
        dst: receiving rank, >= 0 and != src.
        chunk: index into the schedule's ``chunk_bounds``.
        nbytes: bytes sent, ``chunk elements x itemsize`` (checked by Schedule).
        reduce: True: the receiver adds the chunk to its own
            (``dst[c] = dst[c] + incoming``); False: it overwrites its own.

    Raises:
        ScheduleError: a negative or non-int rank, chunk or byte count, equal
            ``src`` and ``dst``, or a ``reduce`` that is not a bool.
    """

    __slots__ = ()

    def __new__(cls, src: int, dst: int, chunk: int, nbytes: int, reduce: bool) -> "Transfer":
        values = []
        for field, value in (("src", src), ("dst", dst), ("chunk", chunk), ("nbytes", nbytes)):
            values.append(_non_negative_int(f"Transfer {field}", value))
        if values[0] == values[1]:
            raise ScheduleError(f"Transfer src {src!r} equals dst {dst!r}: a transfer must go to another rank")
        if not isinstance(reduce, bool):
            raise ScheduleError(f"Transfer reduce {reduce!r} is not valid: expected True or False")
        return tuple.__new__(cls, (*values, reduce))


def _non_negative_int(what: str, value: object) -> int:
    if isinstance(value, bool):
        raise ScheduleError(f"{what} {value!r} is not valid: expected an int >= 0")
    try:
        result = operator.index(value)
    except TypeError:
        raise ScheduleError(f"{what} {value!r} is not valid: expected an int >= 0") from None
    if result < 0:
        raise ScheduleError(f"{what} {value!r} is not valid: expected an int >= 0")
    return result


Phase = tuple[Transfer, ...]


@dataclass(frozen=True)
class Schedule:
    """A collective as phases of transfers over ``num_ranks`` buffers.

    All transfers of a phase happen at the same time; a phase starts when
    the previous one has finished.

    Attributes:
        name: the algorithm, e.g. ``"ring_allreduce"``.
        num_ranks: number of participating ranks (chips), >= 1.
        num_elements: elements in each rank's buffer, >= 0.
        itemsize: bytes per element (4 for float32), >= 1.
        chunk_bounds: ``(start, stop)`` element ranges, one per chunk, with
            ``0 <= start <= stop <= num_elements`` (as :func:`chunk_bounds`).
        phases: tuple of phases, each a tuple of :class:`Transfer`.

    Raises:
        ScheduleError: a field out of range, a transfer naming a rank or a
            chunk that does not exist, or whose ``nbytes`` is not the chunk's
            ``(stop - start) x itemsize``. The message quotes the offender.
    """

    name: str
    num_ranks: int
    num_elements: int
    itemsize: int
    chunk_bounds: tuple[tuple[int, int], ...]
    phases: tuple[Phase, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ScheduleError(f"Schedule name {self.name!r} is not valid: expected a non-empty string")
        num_ranks = _non_negative_int("Schedule num_ranks", self.num_ranks)
        if num_ranks < 1:
            raise ScheduleError(f"Schedule num_ranks {self.num_ranks!r} is not valid: expected an int >= 1")
        num_elements = _non_negative_int("Schedule num_elements", self.num_elements)
        itemsize = _non_negative_int("Schedule itemsize", self.itemsize)
        if itemsize < 1:
            raise ScheduleError(f"Schedule itemsize {self.itemsize!r} is not valid: expected an int >= 1")
        bounds = []
        for pair in self.chunk_bounds:
            try:
                start, stop = (operator.index(v) for v in pair)
            except (TypeError, ValueError):
                raise ScheduleError(f"chunk bound {pair!r} is not valid: expected (start, stop) ints") from None
            if not 0 <= start <= stop <= num_elements:
                raise ScheduleError(
                    f"chunk bound {pair!r} is not valid: need 0 <= start <= stop <= num_elements ({num_elements})"
                )
            bounds.append((start, stop))
        phases = tuple(tuple(phase) for phase in self.phases)
        for index, phase in enumerate(phases):
            for t in phase:
                if not isinstance(t, Transfer):
                    raise ScheduleError(f"phase {index} holds {t!r}: expected Transfer objects")
                if t.src >= num_ranks or t.dst >= num_ranks:
                    raise ScheduleError(
                        f"phase {index}: {t!r} names a rank outside 0..{num_ranks - 1} (num_ranks={num_ranks})"
                    )
                if t.chunk >= len(bounds):
                    raise ScheduleError(
                        f"phase {index}: {t!r} names chunk {t.chunk}; allowed 0..{len(bounds) - 1}"
                    )
                start, stop = bounds[t.chunk]
                if t.nbytes != (stop - start) * itemsize:
                    raise ScheduleError(
                        f"phase {index}: {t!r} has nbytes {t.nbytes}; chunk {t.chunk} holds "
                        f"{stop - start} elements x {itemsize} bytes = {(stop - start) * itemsize}"
                    )
        object.__setattr__(self, "num_ranks", num_ranks)
        object.__setattr__(self, "num_elements", num_elements)
        object.__setattr__(self, "itemsize", itemsize)
        object.__setattr__(self, "chunk_bounds", tuple(bounds))
        object.__setattr__(self, "phases", phases)

    @property
    def num_phases(self) -> int:
        """Number of phases (2 (n-1) for a ring allreduce)."""
        return len(self.phases)

    @property
    def num_transfers(self) -> int:
        """Number of transfers over all phases."""
        return sum(len(phase) for phase in self.phases)

    @property
    def total_bytes(self) -> int:
        """Bytes sent over all phases (each transfer counted once, not per hop)."""
        return sum(t.nbytes for phase in self.phases for t in phase)


def _trusted_schedule(**fields: object) -> Schedule:
    """Builds a Schedule without re-checking it (builders here make valid ones).

    The per-transfer checks of ``Schedule.__post_init__`` cost about as much
    as building the transfers; the tests construct the builders' output
    through ``Schedule(...)`` to show that it passes them.
    """
    schedule = object.__new__(Schedule)
    for key, value in fields.items():
        object.__setattr__(schedule, key, value)
    return schedule


def chunk_bounds(num_elements: int, num_chunks: int) -> tuple[tuple[int, int], ...]:
    """Cuts ``num_elements`` into ``num_chunks`` contiguous ranges, as np.array_split.

    The first ``num_elements % num_chunks`` chunks hold one element more than
    the others; chunks are empty when ``num_elements < num_chunks``.

    Args:
        num_elements: elements to cut, >= 0.
        num_chunks: number of chunks, >= 1.

    Returns:
        ``num_chunks`` pairs ``(start, stop)``, e.g. ``chunk_bounds(10, 3) ==
        ((0, 4), (4, 7), (7, 10))``.

    Raises:
        ScheduleError: a negative count or ``num_chunks < 1``.
    """
    num_elements = _non_negative_int("num_elements", num_elements)
    num_chunks = _non_negative_int("num_chunks", num_chunks)
    if num_chunks < 1:
        raise ScheduleError(f"num_chunks {num_chunks!r} is not valid: expected an int >= 1")
    base, extra = divmod(num_elements, num_chunks)
    bounds = []
    start = 0
    for index in range(num_chunks):
        stop = start + base + (1 if index < extra else 0)
        bounds.append((start, stop))
        start = stop
    return tuple(bounds)


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Pauses the cyclic garbage collector while millions of tuples are made.

    Transfers hold only ints, so they cannot form cycles; without the pause
    the collector rescans them over and over (about half the build time).
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


_make_transfer = partial(tuple.__new__, Transfer)  # trusted fast path: no checks


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
            rows = zip(order, successors, phase_chunks, phase_nbytes, repeat(reduce))
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
        raise ScheduleError(f"itemsize {itemsize!r} is not valid: expected an int >= 1 (bytes per element)")
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
    order, n, num_elements, itemsize, bounds, chunk_nbytes = _ring_setup(topology, num_elements, itemsize)
    return _trusted_schedule(
        name="ring_reduce_scatter", num_ranks=n, num_elements=num_elements, itemsize=itemsize,
        chunk_bounds=bounds, phases=_ring_phases(order, chunk_nbytes, reduce=True, chunk_offset=0),
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
    order, n, num_elements, itemsize, bounds, chunk_nbytes = _ring_setup(topology, num_elements, itemsize)
    return _trusted_schedule(
        name="ring_all_gather", num_ranks=n, num_elements=num_elements, itemsize=itemsize,
        chunk_bounds=bounds, phases=_ring_phases(order, chunk_nbytes, reduce=False, chunk_offset=1),
    )


def chain_schedules(name: str, *schedules: Schedule) -> Schedule:
    """Runs schedules one after the other: their phases concatenated.

    Args:
        name: name of the composed schedule.
        *schedules: at least one; all with the same ``num_ranks``,
            ``num_elements``, ``itemsize`` and ``chunk_bounds``.

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
        name=name, num_ranks=first.num_ranks, num_elements=first.num_elements, itemsize=first.itemsize,
        chunk_bounds=first.chunk_bounds, phases=tuple(p for s in schedules for p in s.phases),
    )


def ring_allreduce(topology: object, num_elements: int, itemsize: int = 4) -> Schedule:
    """Ring allreduce: :func:`ring_reduce_scatter` then :func:`ring_all_gather`.

    Every rank ends with the elementwise sum of all ranks' buffers; every
    rank's copy of a chunk was computed once (at its owner) and copied, so
    all ranks end bit-identical. Time on a full unidirectional ring of link
    bandwidth ``W``: ``2 (n-1)/n x V / W + 2 (n-1) x latency`` for
    ``V = num_elements x itemsize`` bytes (tpu-specs.md, "Textbook collective
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
        return _cached_ring_allreduce(topology, operator.index(num_elements), operator.index(itemsize))
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
