"""Sub-group collectives of a sharded step, run device to device over ``IciPort``.

A device program calls collectives over mesh axes in the same order on every
device (SPMD); one actor task runs the whole step, so its collectives run
inside that task, one after another, each over the device's group of the
named axis. :class:`GroupTransport` runs one: it builds the group's ring
schedule on local positions (``interconnect.group_ring_schedule``, cached;
an allreduce over 3 or more devices runs in two phases with the ring's
bits instead, through one device when small: ``pod.runtime.direct``),
takes this device's part (``rank_plans``), renames positions to device ids,
and runs it on the device's ``IciPort`` as a *sequenced* run
(``pod.runtime.ici``): the k-th collective of a step has run id ``base + k``
on every device, so a peer that is several collectives ahead (it finished
collectives over groups this device is not in) has its chunks wait until
this device reaches that collective.

Shard order (the contract of ``pod.programs.collectives``): a device's
index along an axis is its position in the group's ring order; a
reduce-scatter leaves it the sum of shard ``index``, an all-gather
concatenates the shards in ring order. The ring schedule's chunk owned by
ring position ``p`` is mapped to the element range of shard ``p`` (all
shards the same size).

Reduction order: a ring reduce-scatter adds the group's contributions in
ring order starting after the owner; ``LocalMesh`` sums in group order, so
the two agree to float32 rounding, bit-identically when the group has two
devices (a + b == b + a).

:class:`RuntimeCollectives` is the ``DeviceCollectives`` protocol of the
device program (``pod.programs.collectives``) over a ``GroupTransport``.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from interconnect import group_ring_schedule
from pod.config.sharding import DeviceGroups
from pod.programs.collectives import AXES, CollectivesBase
from pod.runtime.collective import rank_plans
from pod.runtime.direct import (
    STAR_MAX_BYTES,
    StarAllreduce,
    add_scratch,
    direct_allreduce,
    fold_star,
    star_allreduce,
)
from pod.runtime.ici import IciPort

__all__ = ["GroupTransport", "RuntimeCollectives", "ALIGN_RUNS", "DIRECT_MIN_GROUP"]

#: run ids between two alignment points (``GroupTransport.align``: a pipeline tick): the
#: most collectives one device may issue between two of them
ALIGN_RUNS = 1 << 10
#: groups of at least this many devices allreduce in two phases (``pod.runtime.direct``:
#: the ring's bits); a group of 2 is one phase each way either way
DIRECT_MIN_GROUP = 3


@functools.lru_cache(maxsize=64)
def _local_plans(op: str, size: int, num_elements: int) -> tuple[Any, tuple, tuple]:
    """(per-position RankPlans, chunk bounds, owned chunk per position) of a group ring."""
    schedule = group_ring_schedule(op, size, num_elements)
    return rank_plans(schedule), schedule.chunk_bounds, schedule.owned_chunks


class GroupTransport:
    """Run one device's part of sub-group collectives, in program order.

    Args:
        port: this device's ``IciPort`` (its rank is the device id).
        groups: the device's groups per axis (``pod.config.sharding.device_groups``).
        addresses: device id -> (host, port) of every device it may send to.
        run_base: the run id of this step's first collective; the k-th is
            ``run_base + k`` (the same on every device; above every id used
            before on these ports).
        timeout_s: wall seconds one collective may wait for its chunks.
    """

    def __init__(self, port: IciPort, groups: DeviceGroups,
                 addresses: dict[int, tuple[str, int]], run_base: int,
                 timeout_s: float = 600.0) -> None:
        self.port = port
        self.groups = groups
        self.addresses = addresses
        self.run_base = int(run_base)
        self.count = 0  # collectives run so far
        self.timeout_s = timeout_s

    def _next_run(self) -> int:
        run_id = self.run_base + self.count
        self.count += 1
        return run_id

    def _run(self, op: str, axis: str, flat: np.ndarray) -> np.ndarray:
        """Run ``op`` over this device's group of ``axis`` on ``flat`` in place."""
        ring = self.groups.ring[axis]
        size = len(ring)
        run_id = self._next_run()
        if size == 1:
            return flat
        plans, bounds, owned = _local_plans(op, size, flat.size)
        if op in ("reduce_scatter", "all_gather"):  # chunk owned by position q -> shard q
            shard = flat.size // size
            mapped = list(bounds)
            for q in range(size):
                mapped[owned[q]] = (q * shard, (q + 1) * shard)
            bounds = tuple(mapped)
        me = ring.index(self.groups.device)
        self.port.run(run_id, self._device_plan(plans[me], ring), self.addresses, flat, bounds,
                      timeout=self.timeout_s, sequenced=True)
        return flat

    def align(self, point: int) -> None:
        """Number the next collective ``point * ALIGN_RUNS`` (from this step's base): every
        device reaches the same points in the same order (the pipeline's ticks), so the
        stages, which issue different numbers of collectives inside their stage, agree
        on the ids of the ppermutes between them.

        Raises:
            RuntimeError: the device issued more than ``ALIGN_RUNS`` collectives since the
                point before (the ids would collide).
        """
        start = int(point) * ALIGN_RUNS
        if self.count > start:
            raise RuntimeError(f"alignment point {point}: {self.count} collectives issued, "
                               f"more than {ALIGN_RUNS} per point")
        self.count = start

    def ppermute(self, x: np.ndarray, axis: str, shift: int) -> np.ndarray:
        """The buffer of the group member ``shift`` positions before this one in ring
        order (cyclic): one phase, the whole buffer to position ``+ shift``, the
        source's into a copy of ``x``.

        Args:
            x: (n,) this device's buffer.

        Returns:
            (n,) float32.
        """
        ring = self.groups.ring[axis]
        flat = np.array(x, dtype=np.float32, copy=True).reshape(-1)
        run_id = self._next_run()
        me = ring.index(self.groups.device)
        dst, src = ring[(me + shift) % len(ring)], ring[(me - shift) % len(ring)]
        if dst == self.groups.device:  # a shift by a multiple of the group: itself
            return flat
        plan = [(0, [(dst, 0, 0)], [(src, 0, 0, False)])]
        self.port.run(run_id, plan, self.addresses, flat, ((0, flat.size),),
                      timeout=self.timeout_s, sequenced=True)
        return flat

    def allreduce(self, x: np.ndarray, axis: str) -> np.ndarray:
        """The sum of ``x`` over the group of ``axis`` (same shape, float32): over groups
        of ``DIRECT_MIN_GROUP`` or more in two phases with the ring's bits, through one
        device up to ``STAR_MAX_BYTES`` (``pod.runtime.direct``)."""
        ring = self.groups.ring[axis]
        size = int(np.size(x))
        if len(ring) < DIRECT_MIN_GROUP:
            flat = np.array(x, dtype=np.float32, copy=True).reshape(-1)
            return self._run("allreduce", axis, flat).reshape(np.shape(x))
        star = star_allreduce(len(ring), size) if 0 < size * 4 <= STAR_MAX_BYTES else None
        if star is not None:
            return self._star(star, ring, x)
        direct = direct_allreduce(len(ring), size)
        if direct is None:
            flat = np.array(x, dtype=np.float32, copy=True).reshape(-1)
            return self._run("allreduce", axis, flat).reshape(np.shape(x))
        run_id = self._next_run()
        flat = np.empty(size + direct.extra_elements, dtype=np.float32)
        flat[:size] = np.ravel(x)
        me = ring.index(self.groups.device)
        owned = direct.owned[me]

        def fold_in(phase: int) -> None:
            if phase == 0:
                add_scratch(flat, direct.bounds, owned)

        self.port.run(run_id, self._device_plan(direct.plans[me], ring), self.addresses, flat,
                      direct.bounds, timeout=self.timeout_s, sequenced=True, after_phase=fold_in)
        return flat[:size].reshape(np.shape(x))

    def _star(self, star: StarAllreduce, ring: tuple[int, ...], x: np.ndarray) -> np.ndarray:
        """The allreduce through the group's first position (``direct.star_allreduce``)."""
        run_id = self._next_run()
        me = ring.index(self.groups.device)
        own = np.ravel(x).astype(np.float32, copy=True)
        plan = self._device_plan(star.plans[me], ring)
        if me != star.root:
            self.port.run(run_id, plan, self.addresses, own, ((0, own.size),),
                          timeout=self.timeout_s, sequenced=True)
            return own.reshape(np.shape(x))
        bounds = star.root_bounds
        flat = np.empty(bounds[-1][1], dtype=np.float32)

        def fold(phase: int) -> None:
            if phase == 0:
                fold_star(star, flat, own)

        self.port.run(run_id, plan, self.addresses, flat, bounds, timeout=self.timeout_s,
                      sequenced=True, after_phase=fold)
        return flat[bounds[-1][0]:].reshape(np.shape(x))

    @staticmethod
    def _device_plan(plan: Any, ring: tuple[int, ...]) -> Any:
        """A position's ``RankPlan`` with positions renamed to the ring's device ids."""
        return [(phase, [(ring[dst], chunk, seq) for dst, chunk, seq in sends],
                 [(ring[src], seq, chunk, reduce) for src, seq, chunk, reduce in receives])
                for phase, sends, receives in plan]

    def reduce_scatter(self, x: np.ndarray, axis: str) -> np.ndarray:
        """This device's shard (leading axis split in ring order) of the group's sum.

        Args:
            x: (g * n, ...) float32, g the group's size.

        Returns:
            (n, ...) float32.

        Raises:
            ValueError: the leading axis does not split into g equal shards.
        """
        x = np.asarray(x)
        size = self.groups.axis_size(axis)
        if x.ndim == 0 or x.shape[0] % size:
            raise ValueError(f"reduce_scatter over {axis}: leading axis of shape {x.shape} does "
                             f"not split into {size} equal shards")
        flat = self._run("reduce_scatter", axis, np.array(x, np.float32, copy=True).reshape(-1))
        index, shard = self.groups.ring_index(axis), flat.size // size
        return flat[index * shard:(index + 1) * shard].reshape((x.shape[0] // size,) + x.shape[1:])

    def all_to_all(self, x: np.ndarray, axis: str) -> np.ndarray:
        """Piece j (ring order) of ``x`` to the device at ring position j; piece i of the
        result from position i (the direct schedule, ``interconnect.all_to_all``).

        Args:
            x: (g * n,) float32, g the group's size.

        Returns:
            (g * n,) float32.
        """
        return self._run("all_to_all", axis, np.array(x, np.float32, copy=True).reshape(-1))

    def all_gather(self, x: np.ndarray, axis: str) -> np.ndarray:
        """The group's shards concatenated on the leading axis, in ring order.

        Args:
            x: (n, ...) this device's shard.

        Returns:
            (g * n, ...) float32.
        """
        x = np.asarray(x, dtype=np.float32)
        size = self.groups.axis_size(axis)
        flat = np.empty(size * x.size, dtype=np.float32)
        index = self.groups.ring_index(axis)
        flat[index * x.size:(index + 1) * x.size] = x.reshape(-1)
        flat = self._run("all_gather", axis, flat)
        return flat.reshape((size * x.shape[0],) + x.shape[1:]) if x.ndim else flat


class RuntimeCollectives(CollectivesBase):
    """The device program's collectives (``pod.programs.collectives.DeviceCollectives``)
    over a ``GroupTransport``: ``CollectivesBase`` checks and records every call
    (a ``CollectiveCall``, what the clock ``pod.report.sharded`` needs), this class
    moves the bytes device to device over the group of the named axis.

    Args:
        transport: the device's ``GroupTransport`` for this step.
    """

    def __init__(self, transport: GroupTransport) -> None:
        groups = transport.groups
        super().__init__({a: groups.axis_size(a) for a in AXES},
                         {a: groups.ring_index(a) for a in AXES})
        self.transport = transport

    def align(self, point: int) -> None:
        self.transport.align(point)

    def _permute(self, axis: str, x: np.ndarray, shift: int) -> np.ndarray:
        return self.transport.ppermute(x, axis, shift)

    def _exchange(self, axis: str, op: str, x: np.ndarray) -> np.ndarray:
        if op == "all_gather":
            return self.transport.all_gather(x, axis)
        if op == "reduce_scatter":
            return self.transport.reduce_scatter(x, axis)
        if op == "all_to_all":
            return self.transport.all_to_all(x, axis)
        return self.transport.allreduce(x, axis)
