"""Collective schedules as data: ``Transfer`` (one chunk from one rank to
another in one phase) and ``Schedule`` (phases of transfers over a buffer
cut into chunks), with the checks every builder shares. The builders live in
``interconnect.collectives`` (rings, trees, halving-doubling, all-to-all,
broadcast) and ``interconnect.chains`` (multi-axis torus schedules, ppermute);
both import from here, never from each other at module level.
"""

from __future__ import annotations

import contextlib
import gc
import operator
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple, SupportsIndex

from interconnect.errors import ScheduleError

__all__ = ["Transfer", "Schedule", "chunk_bounds", "OPS"]


class _TransferFields(NamedTuple):
    src: int
    dst: int
    chunk: int
    nbytes: int
    reduce: bool
    dst_chunk: int


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
        dst_chunk: the chunk of the receiver's buffer the data lands in;
            defaults to ``chunk`` (every collective but all-to-all, whose
            rank ``r`` puts its chunk ``j`` into chunk ``r`` of rank ``j``).
            Both chunks must hold the same number of elements.

    Raises:
        ScheduleError: a negative or non-int rank, chunk or byte count, equal
            ``src`` and ``dst``, or a ``reduce`` that is not a bool.
    """

    __slots__ = ()

    def __new__(cls, src: int, dst: int, chunk: int, nbytes: int, reduce: bool,
                dst_chunk: int | None = None) -> Transfer:
        values = []
        if dst_chunk is None:
            dst_chunk = chunk
        for field, value in (("src", src), ("dst", dst), ("chunk", chunk), ("nbytes", nbytes),
                             ("dst_chunk", dst_chunk)):
            values.append(_non_negative_int(f"Transfer {field}", value))
        if values[0] == values[1]:
            raise ScheduleError(f"Transfer src {src!r} equals dst {dst!r}: a transfer must go to "
                                "another rank")
        if not isinstance(reduce, bool):
            raise ScheduleError(f"Transfer reduce {reduce!r} is not valid: expected True or False")
        return tuple.__new__(cls, (*values[:4], reduce, values[4]))


def _non_negative_int(what: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, SupportsIndex):
        raise ScheduleError(f"{what} {value!r} is not valid: expected an int >= 0")
    try:
        result = operator.index(value)
    except TypeError:
        raise ScheduleError(f"{what} {value!r} is not valid: expected an int >= 0") from None
    if result < 0:
        raise ScheduleError(f"{what} {value!r} is not valid: expected an int >= 0")
    return result


Phase = tuple[Transfer, ...]

#: Operations a Schedule can perform (its ``op``).
OPS = ("allreduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "ppermute")


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
        op: the operation the schedule performs, one of :data:`OPS`:
            ``"allreduce"`` (every rank ends with the sum), ``"reduce_scatter"``
            (rank ``r`` ends with the sum of chunk ``owned_chunks[r]``),
            ``"all_gather"`` (rank ``r`` starts with chunk ``owned_chunks[r]``;
            every rank ends with every rank's owned chunk), ``"all_to_all"``
            (chunk ``j`` of rank ``r`` ends in chunk ``r`` of rank ``j``),
            ``"broadcast"`` (every rank ends with rank ``root``'s buffer),
            ``"ppermute"`` (every rank ends with the buffer of another, as
            its transfers say; see :func:`interconnect.chains.ppermute`).
        owned_chunks: for reduce-scatter and all-gather, one chunk per rank
            (see ``op``); empty otherwise.
        root: the broadcasting rank (``op == "broadcast"``), else 0.

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
    op: str = "allreduce"
    owned_chunks: tuple[int, ...] = ()
    root: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ScheduleError(f"Schedule name {self.name!r} is not valid: expected a non-empty "
                                "string")
        num_ranks = _non_negative_int("Schedule num_ranks", self.num_ranks)
        if num_ranks < 1:
            raise ScheduleError(f"Schedule num_ranks {self.num_ranks!r} is not valid: expected an "
                                "int >= 1")
        num_elements = _non_negative_int("Schedule num_elements", self.num_elements)
        itemsize = _non_negative_int("Schedule itemsize", self.itemsize)
        if itemsize < 1:
            raise ScheduleError(f"Schedule itemsize {self.itemsize!r} is not valid: expected an "
                                "int >= 1")
        bounds = []
        for pair in self.chunk_bounds:
            try:
                start, stop = (operator.index(v) for v in pair)
            except (TypeError, ValueError):
                raise ScheduleError(f"chunk bound {pair!r} is not valid: expected (start, stop) "
                                    "ints") from None
            if not 0 <= start <= stop <= num_elements:
                raise ScheduleError(
                    f"chunk bound {pair!r} is not valid: need 0 <= start <= stop <= num_elements "
                    f"({num_elements})"
                )
            bounds.append((start, stop))
        phases = tuple(tuple(phase) for phase in self.phases)
        for index, phase in enumerate(phases):
            for t in phase:
                if not isinstance(t, Transfer):
                    raise ScheduleError(f"phase {index} holds {t!r}: expected Transfer objects")
                if t.src >= num_ranks or t.dst >= num_ranks:
                    raise ScheduleError(
                        f"phase {index}: {t!r} names a rank outside 0..{num_ranks - 1} "
                        f"(num_ranks={num_ranks})"
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
                if t.dst_chunk >= len(bounds) or (
                    bounds[t.dst_chunk][1] - bounds[t.dst_chunk][0] != stop - start
                ):
                    raise ScheduleError(
                        f"phase {index}: {t!r} names dst_chunk {t.dst_chunk}, which does not exist "
                        f"or differs in size from chunk {t.chunk}"
                    )
        if self.op not in OPS:
            raise ScheduleError(f"Schedule op {self.op!r} is not valid: expected one of "
                                f"{', '.join(OPS)}")
        owned = tuple(self.owned_chunks)
        if owned and (len(owned) != num_ranks or any(not 0 <= c < len(bounds) for c in owned)):
            raise ScheduleError(
                f"Schedule owned_chunks {owned!r} is not valid: expected one chunk index per rank"
            )
        if not 0 <= self.root < num_ranks:
            raise ScheduleError(f"Schedule root {self.root!r} is not valid: expected "
                                f"0..{num_ranks - 1}")
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


#: Largest buffer a collective moves, in bytes (64 TiB: far above any chip's HBM, and
#: times any pod's chips and hops still inside int64, where link loads are summed).
MAX_BUFFER_BYTES = 1 << 46


def _check_counts(topology: object, num_elements: int, itemsize: int) -> tuple[int, int, int]:
    try:
        num_ranks = topology.num_chips  # type: ignore[attr-defined]
        topology.ring_order  # type: ignore[attr-defined]  # noqa: B018
    except AttributeError:
        raise ScheduleError(f"topology {topology!r} is not valid: expected an "
                            "interconnect.Torus") from None
    num_elements = _non_negative_int("num_elements", num_elements)
    itemsize = _non_negative_int("itemsize", itemsize)
    if itemsize < 1:
        raise ScheduleError(f"itemsize {itemsize!r} is not valid: expected an int >= 1 "
                            "(bytes per element)")
    _check_bytes(num_elements, itemsize)
    return num_ranks, num_elements, itemsize


def _check_bytes(num_elements: int, itemsize: int) -> None:
    """Refuse a buffer past ``MAX_BUFFER_BYTES`` (a size that would overflow int64 sums).

    Raises:
        ScheduleError: one line with the size and the limit.
    """
    if num_elements * itemsize > MAX_BUFFER_BYTES:
        raise ScheduleError(f"a buffer of {num_elements:,} elements of {itemsize} bytes is "
                            f"{num_elements * itemsize:,} bytes, more than the "
                            f"{MAX_BUFFER_BYTES:,} (64 TiB) a collective may move")
