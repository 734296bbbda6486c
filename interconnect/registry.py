"""The one registry of collective algorithms, keyed by (op, algorithm).

Each entry says how to build the collective on a *local* torus (a whole slice,
or the block one group of a mesh axis occupies) in two forms: as a
:class:`~interconnect.schedule.Schedule` of Transfers (what an executor runs:
:func:`interconnect.execute.execute`, the pod's ICI transport) and as
:class:`~interconnect.phases.PairPhases` (what :func:`interconnect.cost.price`
prices). Where the entry has no array builder its phases are read off the
Schedule (:func:`~interconnect.phases.schedule_phases`). Ring-based algorithms
walk ``local.ring_order()``: a group's ring is the 1-D ring of its devices in
ring order (``Mesh.groups(axis, "ring")``).

========================= ============================================= =========
op                        algorithms (the first is the default)         built as
========================= ============================================= =========
allreduce                 torus, bidirectional_ring, ring,              arrays for the first
                          halving_doubling, tree                        three
reduce_scatter            torus, bidirectional_ring, ring               arrays
all_gather                torus, bidirectional_ring, ring               arrays
all_to_all                direct                                        arrays
broadcast                 pipelined_ring, tree                          Transfers
ppermute                  direct                                        arrays
========================= ============================================= =========

``torus`` is XLA's collective on a TPU slice ([SB] sharding.md, "multi-axis
torus"): every torus axis of the block at once, both directions
(:mod:`interconnect.chains`); the default everywhere.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from interconnect.chains import build_axis_collective, ppermute
from interconnect.collectives import (
    all_to_all,
    broadcast,
    halving_doubling_allreduce,
    ring_all_gather,
    ring_allreduce,
    ring_reduce_scatter,
    tree_allreduce,
)
from interconnect.errors import ScheduleError
from interconnect.phases import (
    PairPhases,
    all_to_all_phases,
    axis_phases,
    ppermute_phases,
    ring_phases,
    schedule_phases,
)
from interconnect.schedule import OPS, Schedule
from interconnect.topology import Torus

__all__ = ["Algorithm", "REGISTRY", "ALGORITHMS", "ALLREDUCE_ALGORITHMS", "MESH_ALGORITHMS",
           "FAST_PATHS", "check_algorithm", "build_collective", "collective_phases", "allreduce"]


@dataclass(frozen=True)
class Algorithm:
    """One (op, algorithm) of the registry.

    Attributes:
        op: the operation (``interconnect.OPS``).
        name: the algorithm's name.
        schedule: ``(local, num_elements, itemsize, **options) -> Schedule``.
        phases: ``(local, num_elements, itemsize, **options) -> PairPhases`` without a
            Transfer per message, or None (read off ``schedule``).
        options: the keyword options both builders take (``root``; ``shift``, ``axis``).
    """

    op: str
    name: str
    schedule: Callable[..., Schedule]
    phases: Callable[..., PairPhases] | None = None
    options: tuple[str, ...] = ()

    def build(self, local: Torus, num_elements: int, itemsize: int, **options: int) -> Schedule:
        """The Schedule on ``local`` (options it does not take are ignored)."""
        return self.schedule(local, num_elements, itemsize, **self._mine(options))

    def build_phases(self, local: Torus, num_elements: int, itemsize: int, *,
                     arrays: bool = True, **options: int) -> PairPhases:
        """The PairPhases on ``local``: the array builder's, or (``arrays`` False, or none)
        read off the Schedule."""
        if arrays and self.phases is not None:
            return self.phases(local, num_elements, itemsize, **self._mine(options))
        return schedule_phases(self.build(local, num_elements, itemsize, **options))

    def _mine(self, options: dict[str, int]) -> dict[str, int]:
        return {k: v for k, v in options.items() if k in self.options}


def _entries() -> list[Algorithm]:
    rings = {"allreduce": ring_allreduce, "reduce_scatter": ring_reduce_scatter,
             "all_gather": ring_all_gather}
    out = []
    for op in ("allreduce", "reduce_scatter", "all_gather"):
        for name in ("torus", "bidirectional_ring"):
            out.append(Algorithm(op, name, partial(_axis_schedule, op, name),
                                 partial(_axis_phases, op, name)))
        out.append(Algorithm(op, "ring", rings[op], partial(ring_phases, op)))
    out += [Algorithm("allreduce", "halving_doubling", halving_doubling_allreduce),
            Algorithm("allreduce", "tree", tree_allreduce),
            Algorithm("all_to_all", "direct", all_to_all, all_to_all_phases),
            Algorithm("broadcast", "pipelined_ring", partial(_broadcast, "pipelined_ring"),
                      options=("root",)),
            Algorithm("broadcast", "tree", partial(_broadcast, "tree"), options=("root",)),
            Algorithm("ppermute", "direct", ppermute, ppermute_phases, options=("shift", "axis"))]
    return out


def _axis_schedule(op: str, algorithm: str, local: Torus, num_elements: int,
                   itemsize: int) -> Schedule:
    return build_axis_collective(op, local, num_elements, itemsize, algorithm)


def _axis_phases(op: str, algorithm: str, local: Torus, num_elements: int,
                 itemsize: int) -> PairPhases:
    return axis_phases(op, local, num_elements, itemsize, algorithm)


def _broadcast(algorithm: str, local: Torus, num_elements: int, itemsize: int, *,
               root: int = 0) -> Schedule:
    return broadcast(local, num_elements, itemsize, root=root, algorithm=algorithm)


#: (op, algorithm) -> its :class:`Algorithm`, in the order of each op's algorithms.
REGISTRY: dict[tuple[str, str], Algorithm] = {(a.op, a.name): a for a in _entries()}

#: Algorithms per operation, from the registry; the first one of each is its default.
ALGORITHMS: dict[str, tuple[str, ...]] = {
    op: tuple(name for o, name in REGISTRY if o == op) for op in OPS}

#: The allreduce algorithms, as ``pod.allreduce`` names them.
ALLREDUCE_ALGORITHMS = ALGORITHMS["allreduce"]

#: Algorithms a mesh axis may run (``pod.collective_algorithms``): those every reduction
#: over an axis has (allreduce, reduce-scatter, all-gather); an axis's all-to-all and
#: ppermute are always direct.
MESH_ALGORITHMS = tuple(a for a in ALGORITHMS["allreduce"]
                        if all(a in ALGORITHMS[op] for op in ("reduce_scatter", "all_gather")))

#: (op, algorithm) pairs built as arrays (no Transfer per message): cheap at pod scale.
FAST_PATHS = frozenset(key for key, entry in REGISTRY.items() if entry.phases is not None)


def check_algorithm(op: str, algorithm: str) -> Algorithm:
    """The registry's entry for ``(op, algorithm)``.

    Raises:
        ScheduleError: an unknown op, or an algorithm the op does not have (the message
            lists the choices).
    """
    if op not in ALGORITHMS:
        raise ScheduleError(f"operation {op!r} is not valid: expected one of "
                            f"{', '.join(ALGORITHMS)}")
    entry = REGISTRY.get((op, algorithm))
    if entry is None:
        raise ScheduleError(f"algorithm {algorithm!r} is not available for {op}: expected one of "
                            f"{', '.join(ALGORITHMS[op])}")
    return entry


def build_collective(op: str, topology: Torus, num_elements: int, itemsize: int = 4,
                     algorithm: str | None = None, root: int = 0, *, shift: int = 1,
                     axis: int = 0) -> Schedule:
    """The Schedule of any operation and algorithm of the registry.

    Args:
        op: ``"allreduce"``, ``"reduce_scatter"``, ``"all_gather"``,
            ``"all_to_all"``, ``"broadcast"`` or ``"ppermute"``.
        topology: the torus.
        num_elements: elements per rank's buffer (for all-gather: the
            gathered output), >= 0.
        itemsize: bytes per element, >= 1.
        algorithm: one of ``ALGORITHMS[op]``; None takes the first.
        root: broadcast root rank.
        shift: ppermute: places each buffer moves along ``axis``.
        axis: ppermute: the torus axis.

    Returns:
        The Schedule.

    Raises:
        ScheduleError: unknown op or algorithm (the message lists the
            choices), or bad counts.
    """
    entry = check_algorithm(op, algorithm or ALGORITHMS.get(op, ("",))[0])
    return entry.build(topology, num_elements, itemsize, root=root, shift=shift, axis=axis)


def collective_phases(op: str, topology: Torus, num_elements: int, itemsize: int = 4,
                      algorithm: str | None = None, *, root: int = 0, shift: int = 1,
                      axis: int = 0, arrays: bool = True) -> PairPhases:
    """The PairPhases of any operation and algorithm of the registry, as the cost engine
    prices them (arguments as :func:`build_collective`).

    Args:
        arrays: False reads them off the Schedule even where an array builder exists
            (the reference the tests hold the builders to).

    Raises:
        ScheduleError: as :func:`build_collective`.
    """
    entry = check_algorithm(op, algorithm or ALGORITHMS.get(op, ("",))[0])
    return entry.build_phases(topology, num_elements, itemsize, arrays=arrays, root=root,
                              shift=shift, axis=axis)


def allreduce(topology: Torus, num_elements: int, itemsize: int = 4,
              algorithm: str = "torus") -> Schedule:
    """Allreduce by any algorithm of :data:`ALLREDUCE_ALGORITHMS` (see :func:`build_collective`).

    ``"bidirectional_ring"``: every chunk reaches its owner from both sides
    of ``ring_order()`` at once; ``(n-1)/n x V / W`` on a full ring (half the
    unidirectional ring's) in ``2 floor(n/2)`` phases.
    ``"torus"``: every axis at once, the buffer cut into one part per axis,
    each part reducing over the axes in a rotated order
    (:mod:`interconnect.chains`); bandwidth term ``V / (W_bidi x axes)``
    [SB]. On a 1-D ring it is the bidirectional ring.
    """
    return build_collective("allreduce", topology, num_elements, itemsize, algorithm)
