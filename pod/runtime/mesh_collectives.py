"""Sub-group collectives of a sharded step, run device to device over ``IciPort``.

A device program calls collectives over mesh axes in the same order on every
device (SPMD); one actor task runs the whole step, so its collectives run
inside that task, one after another, each over the device's group of the
named axis. :class:`GroupTransport` runs one: it builds the group's ring
schedule on local positions (``interconnect.group_ring_schedule``, cached),
takes this device's part (``rank_plans``), renames positions to device ids,
and runs it on the device's ``IciPort`` as a *sequenced* run
(``pod.runtime.ici``): the k-th collective of a step has run id ``base + k``
on every device, so a peer that is several collectives ahead (it finished
collectives over groups this device is not in) has its chunks wait until
this device reaches that collective.

Shard order. A reduce-scatter leaves device ``d`` with the sum of shard
``axis_index(d)`` (its index in mesh order), and an all-gather concatenates
the shards in mesh order, as ``jax.lax.psum_scatter(..., tiled=True)`` and
``all_gather(..., tiled=True)`` do; the ring visits the group in ring order,
so the schedule's chunk owned by ring position ``p`` is mapped to the
element range of that device's shard (all shards the same size).

Reduction order: a ring reduce-scatter adds the group's contributions in
ring order starting after the owner; float32 sums in another order (a
reference that sums in mesh order) agree to rounding, bit-identical when
the group has two devices.

:class:`RuntimeCollectives` is the ``DeviceCollectives`` protocol of the
device program (``pod.workloads.collectives``) over a ``GroupTransport``.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from interconnect import group_ring_schedule
from pod.config.sharding import DeviceGroups
from pod.report.sharded import IssuedCollective
from pod.runtime.collective import rank_plans
from pod.runtime.ici import IciPort

__all__ = ["GroupTransport", "RuntimeCollectives", "ShapeCollectives"]


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

    def _run(self, op: str, axis: str, flat: np.ndarray) -> np.ndarray:
        """Run ``op`` over this device's group of ``axis`` on ``flat`` in place."""
        ring, order = self.groups.ring[axis], self.groups.mesh_order[axis]
        size = len(ring)
        run_id = self.run_base + self.count
        self.count += 1
        if size == 1:
            return flat
        plans, bounds, owned = _local_plans(op, size, flat.size)
        if op != "allreduce":  # chunk owned by ring position q -> that device's shard
            shard = flat.size // size
            mapped = list(bounds)
            for q, device in enumerate(ring):
                m = order.index(device)
                mapped[owned[q]] = (m * shard, (m + 1) * shard)
            bounds = tuple(mapped)
        me = ring.index(self.groups.device)
        plan = [(phase, [(ring[dst], chunk, seq) for dst, chunk, seq in sends],
                 [(ring[src], seq, chunk, reduce) for src, seq, chunk, reduce in receives])
                for phase, sends, receives in plans[me]]
        self.port.run(run_id, plan, self.addresses, flat, bounds, timeout=self.timeout_s,
                      sequenced=True)
        return flat

    def allreduce(self, x: np.ndarray, axis: str) -> np.ndarray:
        """The sum of ``x`` over the group of ``axis`` (same shape, float32)."""
        flat = np.array(x, dtype=np.float32, copy=True).reshape(-1)
        return self._run("allreduce", axis, flat).reshape(np.shape(x))

    def reduce_scatter(self, x: np.ndarray, axis: str) -> np.ndarray:
        """This device's shard (leading axis split in mesh order) of the group's sum.

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
        index, shard = self.groups.axis_index(axis), flat.size // size
        return flat[index * shard:(index + 1) * shard].reshape((x.shape[0] // size,) + x.shape[1:])

    def all_gather(self, x: np.ndarray, axis: str) -> np.ndarray:
        """The group's shards concatenated on the leading axis, in mesh order.

        Args:
            x: (n, ...) this device's shard.

        Returns:
            (g * n, ...) float32.
        """
        x = np.asarray(x, dtype=np.float32)
        size = self.groups.axis_size(axis)
        flat = np.empty(size * x.size, dtype=np.float32)
        index = self.groups.axis_index(axis)
        flat[index * x.size:(index + 1) * x.size] = x.reshape(-1)
        flat = self._run("all_gather", axis, flat)
        return flat.reshape((size * x.shape[0],) + x.shape[1:]) if x.ndim else flat


class RuntimeCollectives:
    """The device program's collectives (``DeviceCollectives``) over a ``GroupTransport``.

    Every call runs at once over the device's group of the axis, and is recorded
    (``calls``) with the number of op records the TensorCore had issued, which
    is what the clock (``pod.report.sharded``) needs.

    Args:
        core: the device's TensorCore (its ``records`` place each call).
        transport: the device's ``GroupTransport`` for this step.
    """

    def __init__(self, core: Any, transport: GroupTransport) -> None:
        self.core = core
        self.transport = transport
        self.calls: list[IssuedCollective] = []

    def axis_size(self, axis: str) -> int:
        """Devices along ``axis``."""
        return self.transport.groups.axis_size(axis)

    def axis_index(self, axis: str) -> int:
        """This device's index along ``axis`` (mesh order)."""
        return self.transport.groups.axis_index(axis)

    def _note(self, axis: str, op: str, nbytes: int, tag: str, kind: str) -> None:
        self.calls.append(IssuedCollective(axis, op, int(nbytes), tag, kind,
                                           len(self.core.records)))

    def all_gather(self, x: np.ndarray, axis: str, *, tag: str = "",
                   kind: str = "param_gather") -> np.ndarray:
        """Shards of the group concatenated on the leading axis, mesh order (float32)."""
        self._note(axis, "all_gather", 4 * np.size(x) * self.axis_size(axis), tag, kind)
        return self.transport.all_gather(x, axis)

    def reduce_scatter(self, x: np.ndarray, axis: str, *, tag: str = "",
                       kind: str = "grad_reduce") -> np.ndarray:
        """This device's shard (leading axis, mesh order) of the group's sum (float32)."""
        self._note(axis, "reduce_scatter", 4 * np.size(x), tag, kind)
        return self.transport.reduce_scatter(x, axis)

    def allreduce(self, x: np.ndarray, axis: str, *, tag: str = "",
                  kind: str = "activation") -> np.ndarray:
        """The group's sum of ``x`` (float32, same shape)."""
        self._note(axis, "allreduce", 4 * np.size(x), tag, kind)
        return self.transport.allreduce(x, axis)


class ShapeCollectives(RuntimeCollectives):
    """Timing-only collectives: results are zeros of the right shape, every call is
    recorded as ``RuntimeCollectives`` records it (so the clock costs it the same).

    Args:
        core: the representative device's TensorCore.
        groups: its groups per mesh axis.
    """

    def __init__(self, core: Any, groups: DeviceGroups) -> None:
        super().__init__(core, transport=None)  # type: ignore[arg-type]
        self.groups = groups

    def axis_size(self, axis: str) -> int:
        """Devices along ``axis``."""
        return self.groups.axis_size(axis)

    def axis_index(self, axis: str) -> int:
        """The device's index along ``axis``."""
        return self.groups.axis_index(axis)

    def all_gather(self, x: np.ndarray, axis: str, *, tag: str = "",
                   kind: str = "param_gather") -> np.ndarray:
        """Zeros shaped like the gathered result."""
        self._note(axis, "all_gather", 4 * np.size(x) * self.axis_size(axis), tag, kind)
        shape = np.shape(x)
        return np.zeros((self.axis_size(axis) * shape[0],) + shape[1:], np.float32)

    def reduce_scatter(self, x: np.ndarray, axis: str, *, tag: str = "",
                       kind: str = "grad_reduce") -> np.ndarray:
        """Zeros shaped like this device's shard."""
        self._note(axis, "reduce_scatter", 4 * np.size(x), tag, kind)
        shape = np.shape(x)
        return np.zeros((shape[0] // self.axis_size(axis),) + shape[1:], np.float32)

    def allreduce(self, x: np.ndarray, axis: str, *, tag: str = "",
                  kind: str = "activation") -> np.ndarray:
        """Zeros shaped like ``x``."""
        self._note(axis, "allreduce", 4 * np.size(x), tag, kind)
        return np.zeros(np.shape(x), np.float32)
