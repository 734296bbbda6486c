"""The simulated inter-chip interconnect (ICI) of a TPU pod.

Pure Python + numpy; never imports Ray, ``pod`` or ``chip``. One room at a time:

- :mod:`~interconnect.topology`: :class:`Torus`, an immutable ring, 2-D or 3-D
  torus/mesh: ranks <-> coordinates (row-major), neighbours, directed links,
  dimension-order routes, hop counts, a ring order over neighbour links.
- :mod:`~interconnect.link`: :class:`LinkSpec`, bandwidth and latency of one
  link direction (and, once calibrated, its achieved efficiency and the
  fixed cost of a collective).
- :mod:`~interconnect.calibration`: the fitted constants and
  :func:`calibrated_link`.
- :mod:`~interconnect.collectives`: pure functions that build a
  :class:`Schedule` (phases of :class:`Transfer`); allreduce = reduce-scatter
  then all-gather.
- :mod:`~interconnect.chains`: the torus collectives over every axis at once
  (and the bidirectional ring), and :func:`ppermute`.
- :mod:`~interconnect.execute`: :func:`execute` runs a schedule on numpy
  buffers (the reference for the distributed run).
- :mod:`~interconnect.groups`: collectives of every group of a mesh axis at
  once, re-labelled onto torus ranks, and their cost: as XLA runs them
  (every torus axis of the group's block, both directions) or one ring each.
- :mod:`~interconnect.phases`: a collective as the cost engine reads it
  (:class:`PairPhases`: the pairs that send, their bytes per phase), built as
  arrays for the regular algorithms or read off any Schedule.
- :mod:`~interconnect.registry`: the one registry of algorithms, keyed by
  (op, algorithm): each builds its Schedule and its PairPhases.
- :mod:`~interconnect.cost`: the engine, :func:`price` (any PairPhases, every
  group of a mesh axis at once, with per-link contention), and on it
  :func:`schedule_cost` / :func:`schedule_time` (a Schedule) and
  :func:`collective_cost` (any registered algorithm over the whole torus).
- :mod:`~interconnect.faults`: :class:`LinkFaults` (slowed and failed links)
  and :func:`route` around failed links.

Example::

    >>> from interconnect import Torus, LinkSpec, ring_allreduce, schedule_time
    >>> torus = Torus((4, 4))
    >>> schedule = ring_allreduce(torus, num_elements=1 << 20)
    >>> seconds = schedule_time(schedule, torus, LinkSpec(1e11, latency_s=1e-6))
"""

from interconnect.calibration import CALIBRATION, Calibration, calibrated_link
from interconnect.chains import ppermute
from interconnect.collectives import (
    Schedule,
    Transfer,
    all_to_all,
    axis_rings,
    broadcast,
    chain_schedules,
    chunk_bounds,
    halving_doubling_allreduce,
    ring_all_gather,
    ring_allreduce,
    ring_reduce_scatter,
    tree_allreduce,
)
from interconnect.cost import (
    MAX_COST_WORK,
    ScheduleCost,
    check_cost_work,
    collective_cost,
    cost_work,
    price,
    schedule_cost,
    schedule_time,
)
from interconnect.dcn import DCN_OPS, dcn_collective_bytes, dcn_collective_seconds
from interconnect.errors import InterconnectError, LinkSpecError, ScheduleError, TopologyError
from interconnect.execute import execute
from interconnect.faults import LinkFailureError, LinkFaults, parse_link, route
from interconnect.groups import (
    GROUP_OPS,
    concurrent_group_schedule,
    group_collective_cost,
    group_ppermute_cost,
    group_ppermute_schedule,
    group_ring_schedule,
    group_torus_schedule,
    pair_permute_cost,
)
from interconnect.link import LinkSpec
from interconnect.phases import PairPhases, schedule_phases
from interconnect.registry import (
    ALGORITHMS,
    ALLREDUCE_ALGORITHMS,
    FAST_PATHS,
    MESH_ALGORITHMS,
    REGISTRY,
    Algorithm,
    allreduce,
    build_collective,
    check_algorithm,
    collective_phases,
)
from interconnect.schedule import OPS
from interconnect.topology import Torus, parse_shape

__all__ = [
    "DCN_OPS",
    "dcn_collective_bytes",
    "dcn_collective_seconds",
    "InterconnectError",
    "TopologyError",
    "LinkSpecError",
    "ScheduleError",
    "Torus",
    "parse_shape",
    "LinkSpec",
    "Calibration",
    "CALIBRATION",
    "calibrated_link",
    "Transfer",
    "Schedule",
    "chunk_bounds",
    "ring_reduce_scatter",
    "ring_all_gather",
    "chain_schedules",
    "ring_allreduce",
    "OPS",
    "ALGORITHMS",
    "ALLREDUCE_ALGORITHMS",
    "axis_rings",
    "allreduce",
    "halving_doubling_allreduce",
    "tree_allreduce",
    "all_to_all",
    "broadcast",
    "ppermute",
    "build_collective",
    "execute",
    "GROUP_OPS",
    "group_ring_schedule",
    "group_torus_schedule",
    "concurrent_group_schedule",
    "group_collective_cost",
    "group_ppermute_schedule",
    "group_ppermute_cost",
    "pair_permute_cost",
    "ScheduleCost",
    "PairPhases",
    "schedule_phases",
    "collective_phases",
    "REGISTRY",
    "Algorithm",
    "MESH_ALGORITHMS",
    "check_algorithm",
    "price",
    "schedule_cost",
    "schedule_time",
    "collective_cost",
    "cost_work",
    "check_cost_work",
    "MAX_COST_WORK",
    "FAST_PATHS",
    "LinkFailureError",
    "LinkFaults",
    "parse_link",
    "route",
]
