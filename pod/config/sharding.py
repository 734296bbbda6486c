"""What a sharded step needs resolved from the mesh: each device's groups, and the
cost of a collective over every group of one mesh axis.

A device program (``pod.programs``) calls collectives over a mesh axis;
every device of the pod calls the same ones in the same order (SPMD). What a
device needs to run its part is :class:`DeviceGroups` (per axis: its group in
ring order, the order the ring visits it, and in mesh order, the order of the
shards). What the clock needs is :class:`MeshCollectiveCosts`: per (axis, op,
bytes) the simulated cost of that collective over every group of the axis at
once (``interconnect.group_collective_cost``: by default as XLA runs it, over
every torus axis of the block the mesh axis occupies at once and in both
directions; or one unidirectional ring per group; the groups' phases aligned,
contention where they share links), computed once and kept.

Devices are chips on v4 / v5p (megacore), v5e and v6e; on v2 / v3 each
TensorCore is a device (two per chip, device ``d`` on chip ``d // 2``): the
two share the chip's ICI links, and a ring step between them is an on-chip
copy at one TensorCore's HBM bandwidth (``MeshCollectiveCosts``; an
assumption, see VALIDATION.md).
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from chip import ChipSpec
from interconnect import (
    DCN_OPS,
    GROUP_OPS,
    MESH_ALGORITHMS,
    LinkFaults,
    LinkSpec,
    ScheduleCost,
    Torus,
    dcn_collective_bytes,
    dcn_collective_seconds,
    group_collective_cost,
    group_ppermute_cost,
)
from pod.config.mesh import AXIS_NAMES, Mesh, devices_per_chip

__all__ = ["DeviceGroups", "device_groups", "device_chip_spec", "MeshCollectiveCosts", "AXIS_OPS",
           "SHARDED_MODELS", "on_chip_bandwidth"]

#: Models the sharded device program runs (``pod.programs.transformer``).
SHARDED_MODELS = ("transformer",)


@dataclass(frozen=True)
class DeviceGroups:
    """One device's view of the mesh.

    Attributes:
        device: its device id (chip rank x devices per chip + core, ``Mesh``).
        ring: axis -> its group's device ids in ring order (what the ring visits).
        mesh_order: axis -> the same devices in mesh-index order (shard order).
    """

    device: int
    ring: dict[str, tuple[int, ...]]
    mesh_order: dict[str, tuple[int, ...]]

    def axis_size(self, axis: str) -> int:
        """Devices along ``axis`` (1 for an axis the mesh does not have)."""
        return len(self.mesh_order.get(axis, (self.device,)))

    def axis_index(self, axis: str) -> int:
        """This device's index along ``axis`` in mesh order, 0 for an absent axis."""
        return self.mesh_order.get(axis, (self.device,)).index(self.device)

    def ring_index(self, axis: str) -> int:
        """This device's position in its group's ring order (the device program's
        ``axis_index``: its shard), 0 for an absent axis."""
        return self.ring.get(axis, (self.device,)).index(self.device)


def device_groups(mesh: Mesh, device: int) -> DeviceGroups:
    """The groups ``device`` belongs to, per axis of ``mesh`` (absent axes: itself alone);
    kept per (mesh, device) (a mesh is a value, and a layout search asks again for every
    point of a mesh).

    Raises:
        ValueError: a device id not in the mesh.
    """
    if not 0 <= device < mesh.size:
        raise ValueError(f"device {device} is not in the mesh of {mesh.size} devices")
    return _device_groups(mesh, int(device))


@functools.lru_cache(maxsize=4096)
def _device_groups(mesh: Mesh, device: int) -> DeviceGroups:
    """:func:`device_groups` of a device of the mesh (a ``Mesh`` hashes as itself)."""
    ring: dict[str, tuple[int, ...]] = {}
    order: dict[str, tuple[int, ...]] = {}
    for axis in AXIS_NAMES:
        if axis not in mesh.axis_names:
            ring[axis] = order[axis] = (device,)
            continue
        ring[axis] = next(g for g in mesh.groups(axis, "ring") if device in g)
        order[axis] = next(g for g in mesh.groups(axis, "mesh") if device in g)
    return DeviceGroups(device, ring, order)


def device_chip_spec(spec: ChipSpec) -> ChipSpec:
    """One device of the chip as a chip of one TensorCore, for the sharded device program.

    On v4 / v5p the two TensorCores run as one megacore device [JAX]: modelled
    as one TensorCore with both cores' MXUs, VPU sublanes, VMEM, HBM and HBM
    bandwidth (the compiler splits every op over the two; the chip's peak
    FLOP/s is unchanged). On v2 / v3 each TensorCore is a device [JAX]: one
    core with its share of the chip's HBM and HBM bandwidth (half the chip's
    peak FLOP/s). Chips of one TensorCore (v5e, v6e) are themselves. A device is
    no slice: the specs of several cores keep no ``slice_shapes`` (their names count
    the chip's TensorCores).
    """
    if devices_per_chip(spec) > 1:
        n = spec.tensorcores
        published = spec.published_peak_bf16_flops_per_s
        return dataclasses.replace(
            spec, tensorcores=1, hbm_bytes=spec.hbm_bytes // n,
            hbm_available_bytes=spec.core.hbm_bytes, slice_shapes=(),
            hbm_bandwidth_bytes_per_s=spec.core.hbm_bandwidth_bytes_per_s,
            published_peak_bf16_flops_per_s=None if published is None else published / n)
    if not spec.megacore:
        return spec
    n, core = spec.tensorcores, spec.core
    merged = dataclasses.replace(core, mxus_per_core=core.mxus_per_core * n,
                                 hbm_bytes=spec.hbm_available_bytes,
                                 hbm_bandwidth_bytes_per_s=core.hbm_bandwidth_bytes_per_s * n,
                                 vmem_bytes=core.vmem_bytes * n,
                                 vpu_sublanes=core.vpu_sublanes * n)
    return dataclasses.replace(spec, tensorcores=1, megacore=False, core=merged, slice_shapes=())


def on_chip_bandwidth(spec: ChipSpec) -> float | None:
    """Bandwidth of a copy between two devices of one chip, bytes/s: one TensorCore's
    HBM bandwidth on v2 / v3 (``core.hbm_bandwidth_bytes_per_s``: the copy reads one
    core's HBM and writes the other's, each at its share; no published core-to-core
    figure, an assumption stated in VALIDATION.md); None with one device per chip."""
    return spec.core.hbm_bandwidth_bytes_per_s if devices_per_chip(spec) > 1 else None


#: The collective a device program runs most over each mesh axis (the one whose algorithm
#: ``MeshCollectiveCosts.algorithms`` reports): data and tensor allreduce, fsdp all-gather
#: (and reduce-scatter, the same algorithm), expert all-to-all, stage ppermute.
AXIS_OPS = {"data": "allreduce", "stage": "ppermute", "fsdp": "all_gather",
            "expert": "all_to_all", "tensor": "allreduce"}


@dataclass(frozen=True, eq=False)
class MeshCollectiveCosts:
    """The simulated cost of a collective over every group of a mesh axis at once.

    Cached per (axis, op, bytes): a step calls few distinct ones, each many
    times. ``cost`` is pure (the cache only saves time), so the plan stays a
    value.

    Attributes:
        mesh: the device mesh.
        link: the calibrated ICI link.
        on_chip_bytes_per_s: bandwidth of a step between two devices of one
            chip (v2 / v3 TensorCores), bytes/s; None when the mesh has one
            device per chip. The plan passes one TensorCore's HBM bandwidth
            (``on_chip_bandwidth``).
        faults: slowed and failed links in force (``pod.links``, link faults
            started by the step; ``interconnect.LinkFaults``); None: none.
        torus_algorithm: the allreduce algorithm of an axis whose one group is
            every device of the pod (``pod.allreduce``, chosen by the plan:
            ``pod.config.ici.choose_algorithm``), so that data parallelism over
            the whole slice costs what the data-parallel figures of VALIDATION.md
            were checked with; None: the group ring.
        axis_algorithms: mesh axis -> how its collectives run
            (``pod.collective_algorithms``; ``interconnect.MESH_ALGORITHMS``, the
            registry's names); an axis not named runs ``"torus"``, as XLA runs it
            on a TPU slice: over every torus axis of the block the mesh axis
            occupies (``Mesh.torus_axes``) at once, both directions ([SB]
            sharding.md). ``"ring"``: one unidirectional ring per group in ring
            order (what the functional transport runs); ``"bidirectional_ring"``:
            both directions of that ring. An axis's all-to-all and ppermute are
            direct whatever its algorithm.
        itemsize: bytes per element of what moves (2: bf16, the dtype XLA
            moves parameters and activations in [SB] training.md). The cost
            depends on the bytes; the element size only sets how finely a
            buffer splits.
        dcn_bytes_per_s, dcn_latency_s: the data-centre network between slices
            (``chip.ChipSpec``'s, per chip): an axis with a factor across slices
            (``Mesh.dcn_size``) is costed hierarchically (:meth:`cost`).

    Raises:
        ValueError: an unknown axis or algorithm, or an itemsize below 1.
    """

    mesh: Mesh
    link: LinkSpec
    on_chip_bytes_per_s: float | None = None
    faults: LinkFaults | None = None
    torus_algorithm: str | None = None
    axis_algorithms: Mapping[str, str] = field(default_factory=dict)
    itemsize: int = 2
    dcn_bytes_per_s: float = 3.1e9
    dcn_latency_s: float = 0.0
    _cache: dict = field(default_factory=dict, repr=False)
    _seconds: dict = field(default_factory=dict, repr=False)
    _links: dict = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        for axis, algorithm in self.axis_algorithms.items():
            if axis not in AXIS_NAMES or algorithm not in MESH_ALGORITHMS:
                raise ValueError(f"mesh collective algorithm {axis}: {algorithm!r} is unknown; "
                                 f"axes {', '.join(AXIS_NAMES)}, algorithms "
                                 f"{', '.join(MESH_ALGORITHMS)}")
        if (isinstance(self.itemsize, bool) or not isinstance(self.itemsize, int)
                or self.itemsize < 1):
            raise ValueError(f"itemsize {self.itemsize!r} is not valid: bytes per element, an "
                             "int >= 1 (2 for bf16)")

    @property
    def torus(self) -> Torus:
        """The torus of one slice's chips."""
        return self.mesh.torus

    def axis_algorithm(self, axis: str) -> str:
        """The registry's algorithm ``axis``'s reductions run by (``axis_algorithms``, else
        ``"torus"``: XLA's)."""
        return self.axis_algorithms.get(axis, "torus")

    def group_torus(self, axis: str) -> Torus:
        """The block of the torus each group of ``axis`` occupies in a slice, as a torus of
        its own: one axis per ``AxisBlock`` (slowest first), its size, a ring where it
        wraps; the groups of ``Mesh.groups(axis, "mesh")`` list their devices in its
        row-major order."""
        blocks = self.mesh.in_slice.torus_axes(axis)
        return Torus(tuple(k.size for k in blocks), tuple(k.wraps for k in blocks))

    def cost(self, axis: str, op: str, nbytes: int) -> ScheduleCost:
        """Every group of ``axis`` running ``op`` on ``nbytes`` per device at once.

        Args:
            axis: a mesh axis (an absent axis or one of size 1 costs 0).
            op: allreduce, reduce_scatter, all_gather, ppermute (every
                device's buffer to the next position of its group in ring
                order, cyclic: ``interconnect.group_ppermute_cost`` with shift 1;
                a shift of -1, its mirror image, costs the same) or all_to_all
                (direct, ``interconnect.group_collective_cost``, whatever
                ``algorithm``).
            nbytes: bytes of each device's input buffer in the dtype that moves
                (the ``CollectiveCall.nbytes`` of ``pod.programs.collectives``:
                an all-gather's piece, a reduce-scatter's, allreduce's,
                ppermute's or all-to-all's whole buffer).

        Returns:
            ``interconnect.group_collective_cost`` of the axis's groups (in one slice:
            every slice does the same on its own torus). An axis that spans slices
            (``Mesh.dcn_size`` K > 1) is hierarchical, as XLA keeps it: an allreduce
            is a reduce-scatter in the slice, an allreduce of the shard across the
            K slices over the DCN, an all-gather in the slice; a reduce-scatter the
            slice's then the DCN's on the shard; an all-gather the DCN's then the
            slice's (``interconnect.dcn_collective_seconds``). The DCN seconds are a
            phase of the result; its link bytes are the ICI links'.

        Raises:
            ValueError: an unknown axis or op.
        """
        if axis not in AXIS_NAMES or op not in (*GROUP_OPS, "ppermute"):
            raise ValueError(f"collective {op!r} over axis {axis!r}: axes {AXIS_NAMES}, "
                             f"ops {(*GROUP_OPS, 'ppermute')}")
        key = (axis, op, int(nbytes))
        with self._lock:
            hit = self._cache.get(key)
        if hit is not None:
            return hit
        if self.mesh.axis_size(axis) <= 1:
            result = _FREE
        elif op == "ppermute":
            result = self._permute(axis, int(nbytes))
        elif self.mesh.dcn_size(axis) > 1:
            result = self._hierarchical(axis, op, int(nbytes))
        else:
            result = self._in_slice(axis, op, int(nbytes))
        with self._lock:
            self._cache[key] = result
        return result

    def _permute(self, axis: str, nbytes: int) -> ScheduleCost:
        """A ppermute over the groups of ``axis`` in ring order (shift 1), within one
        slice (``interconnect.group_ppermute_cost``).

        Raises:
            ValueError: the axis spans slices (a stage axis over the DCN is not
                modelled; the plan refuses it first).
        """
        if self.mesh.dcn_size(axis) > 1:
            raise ValueError(f"ppermute over {axis}, which spans slices, is not modelled")
        one = self.mesh.in_slice
        if axis not in one.axis_names or one.axis_size(axis) <= 1:
            return _FREE
        return group_ppermute_cost(self.torus, one.groups(axis, "ring"), nbytes // self.itemsize,
                                   self.link, self.itemsize, self.faults,
                                   devices_per_chip=one.devices_per_chip,
                                   on_chip_bytes_per_s=self.on_chip_bytes_per_s)

    def _in_slice(self, axis: str, op: str, nbytes: int) -> ScheduleCost:
        """``op`` over the groups of ``axis`` within one slice."""
        one = self.mesh.in_slice
        if axis not in one.axis_names or one.axis_size(axis) <= 1:
            return _FREE
        if self._whole_torus(axis, op):
            return self._torus_allreduce(nbytes)
        elements = nbytes // self.itemsize
        if op == "all_gather":  # the schedule's buffer is the gathered result
            elements *= one.axis_size(axis)
        algorithm = self.axis_algorithm(axis)
        block = algorithm == "torus"
        groups = tuple(one.groups(axis, "mesh" if block else "ring"))
        group_torus = self.group_torus(axis) if block else None
        key = (op, self.torus, groups, elements, self.link, self.itemsize, self.faults,
               one.devices_per_chip, self.on_chip_bytes_per_s, algorithm, group_torus)
        with _GROUP_COSTS_LOCK:
            hit = _GROUP_COSTS.get(key)
        if hit is not None:
            return hit
        cost = group_collective_cost(
            op, self.torus, groups, elements, self.link, self.itemsize, self.faults,
            devices_per_chip=one.devices_per_chip, on_chip_bytes_per_s=self.on_chip_bytes_per_s,
            algorithm=algorithm, group_torus=group_torus)
        with _GROUP_COSTS_LOCK:
            if len(_GROUP_COSTS) >= _GROUP_COSTS_SIZE:
                _GROUP_COSTS.clear()
            _GROUP_COSTS[key] = cost
        return cost

    def _hierarchical(self, axis: str, op: str, nbytes: int) -> ScheduleCost:
        """``op`` over an axis that spans K slices (:meth:`cost`): the in-slice parts over
        the ICI and the DCN part (:meth:`dcn_seconds`), one after another."""
        if op not in DCN_OPS:  # an all-to-all across slices (the plan refuses it first)
            raise ValueError(f"{op} over {axis}, which spans slices, is not modelled")
        one = self.mesh.in_slice
        g = one.axis_size(axis) if axis in one.axis_names else 1
        k = self.mesh.dcn_size(axis)
        dcn = self.dcn_seconds(axis, op, nbytes)
        parts: list[ScheduleCost | float]
        if op == "allreduce":
            parts = [self._in_slice(axis, "reduce_scatter", nbytes), dcn,
                     self._in_slice(axis, "all_gather", nbytes // g)]
        elif op == "reduce_scatter":
            parts = [self._in_slice(axis, "reduce_scatter", nbytes), dcn]
        else:  # all_gather of a piece: across slices, then in the slice
            parts = [dcn, self._in_slice(axis, "all_gather", k * nbytes)]
        return _combined(parts)

    def _dcn_part(self, axis: str, op: str, nbytes: int) -> tuple[str, float]:
        """(the DCN collective, each device's buffer in bytes) of ``op`` over an axis that
        spans slices: an allreduce or a reduce-scatter reduces the in-slice shard
        (``nbytes / g``, g the axis's devices in a slice) across slices; an
        all-gather gathers the pieces of the K slices (``K x nbytes``)."""
        one = self.mesh.in_slice
        g = one.axis_size(axis) if axis in one.axis_names else 1
        if op == "all_gather":
            return op, float(self.mesh.dcn_size(axis) * nbytes)
        return op, nbytes / g

    def dcn_seconds(self, axis: str, op: str, nbytes: int) -> float:
        """The DCN part of :meth:`cost`'s seconds: 0 for an axis within a slice, for a
        ppermute or an all-to-all (``interconnect.dcn_collective_seconds`` at
        ``dcn_bytes_per_s`` per chip, its devices sharing it)."""
        if self.mesh.dcn_size(axis) <= 1 or op not in DCN_OPS:
            return 0.0
        dcn_op, buffer = self._dcn_part(axis, op, nbytes)
        return dcn_collective_seconds(dcn_op, self.mesh.dcn_size(axis), buffer,
                                      self.dcn_bytes_per_s, self.dcn_latency_s,
                                      senders_per_chip=self.mesh.devices_per_chip)

    def dcn_bytes(self, axis: str, op: str, nbytes: int) -> float:
        """Bytes one device sends across the DCN in :meth:`cost` (0 within a slice;
        ``interconnect.dcn_collective_bytes`` of :meth:`_dcn_part`)."""
        if self.mesh.dcn_size(axis) <= 1 or op not in DCN_OPS:
            return 0.0
        dcn_op, buffer = self._dcn_part(axis, op, nbytes)
        return dcn_collective_bytes(dcn_op, self.mesh.dcn_size(axis), buffer)

    def algorithm_of(self, axis: str, op: str = "allreduce") -> str:
        """The algorithm :meth:`cost` runs ``op`` over ``axis`` with, by the name ``tpu-pod
        collective`` gives it: the plan's ``torus_algorithm`` for an allreduce whose one
        group is the whole slice; else the axis's (:meth:`axis_algorithm`: ``torus`` for
        XLA's group collective, every torus axis of the group's block, both directions,
        unless ``pod.collective_algorithms`` names another); ``direct`` for an
        all-to-all, ``ppermute`` for a ppermute; with ``+dcn`` where the axis
        spans slices (``dcn`` alone when none of it is within a slice); "" for an axis
        of size 1."""
        if self.mesh.axis_size(axis) <= 1:
            return ""
        one = self.mesh.in_slice
        inside = axis in one.axis_names and one.axis_size(axis) > 1
        if not inside:
            name = ""
        elif op == "all_to_all":
            name = "direct"
        elif op == "ppermute":
            name = "ppermute"
        elif self._whole_torus(axis, op):
            name = str(self.torus_algorithm)
        else:
            name = self.axis_algorithm(axis)
        if self.mesh.dcn_size(axis) > 1:
            return f"{name}+dcn" if name else "dcn"
        return name

    def algorithms(self) -> dict[str, str]:
        """Per mesh axis of size > 1 (in mesh order), :meth:`algorithm_of` the collective
        the programs run most over it (``AXIS_OPS``: data and tensor allreduce, fsdp
        all-gather and reduce-scatter, expert all-to-all, stage ppermute)."""
        return {a: self.algorithm_of(a, AXIS_OPS[a]) for a in self.mesh.axis_names
                if self.mesh.axis_size(a) > 1}

    def _whole_torus(self, axis: str, op: str) -> bool:
        """An allreduce over an axis whose one group is every device of a slice."""
        one = self.mesh.in_slice
        return (op == "allreduce" and self.torus_algorithm is not None
                and one.axis_size(axis) == one.size)

    def _torus_allreduce(self, nbytes: int) -> ScheduleCost:
        """The whole pod's allreduce by ``torus_algorithm`` over the chips' torus; with
        two devices per chip (v2 / v3) the chip's devices first add their buffers on
        chip (a float32 add reading two buffers and writing one at one TensorCore's
        HBM bandwidth, the on-chip reduce of the data-parallel figures), then the
        chips allreduce one buffer each."""
        from interconnect import collective_cost

        cost = collective_cost("allreduce", self.torus, max(1, nbytes // self.itemsize), self.link,
                               algorithm=self.torus_algorithm, itemsize=self.itemsize,
                               faults=self.faults)
        if self.mesh.devices_per_chip > 1 and self.on_chip_bytes_per_s:
            local = 3 * nbytes / self.on_chip_bytes_per_s
            cost = dataclasses.replace(cost, seconds=cost.seconds + local,
                                       phase_seconds=(local, *cost.phase_seconds))
        return cost

    def seconds(self, axis: str, op: str, nbytes: int, *, windowed: bool = False) -> float:
        """Simulated seconds of :meth:`cost`; with ``windowed``, of the collective run as
        XLA's collective matmul runs it (:meth:`windowed_steps`): its bytes as
        :meth:`cost`'s, plus the fixed cost of every collective-permute step beyond
        the one the collective pays (``link.collective_fixed_s``). Kept per (axis, op,
        bytes, windowed): the clock asks for the same few thousands of times a step."""
        key = (axis, op, nbytes, windowed)
        seconds = self._seconds.get(key)
        if seconds is None:
            seconds = self.cost(axis, op, nbytes).seconds
            if windowed:
                steps = self.windowed_steps(axis, op)
                seconds += max(0, steps - 1) * self.link.collective_fixed_s
            self._seconds[key] = seconds
        return seconds

    def windowed_steps(self, axis: str, op: str) -> int:
        """Collective-permute steps of ``op`` over ``axis`` decomposed into a collective
        matmul (XLA's windowed einsum, the bidirectional form): the N - 1 chunks of an
        all-gather or reduce-scatter over N devices go round the group's ring both ways
        at once, ``ceil((N - 1) / 2)`` steps, each with its matmul chunk; an allreduce
        is a reduce-scatter (with the matmul that produces it) then an all-gather (with
        the one that consumes it), twice that. Each step is a collective of its own on
        the hardware and pays the fixed cost of one ([MARIN] C11-C14); 0 for an axis of
        one device or another op."""
        n = self.mesh.axis_size(axis) if axis in self.mesh.axis_names else 1
        half = -(-(n - 1) // 2)
        return {"all_gather": half, "reduce_scatter": half, "allreduce": 2 * half}.get(op, 0)

    def link_bytes(self, calls: Iterable[Any]) -> dict[str, int]:
        """Bytes per directed ICI link ("src->dst", chip ranks) when every device issues
        ``calls`` (``CollectiveCall``: axis, op, nbytes), as SPMD devices do in a step:
        the sum of each call's :meth:`cost` link bytes (every group of its axis)."""
        codes: list[np.ndarray] = []
        sums: list[np.ndarray] = []
        for (axis, op, nbytes), count in Counter((c.axis, c.op, int(c.nbytes))
                                                 for c in calls).items():
            code, each = self._link_arrays(axis, op, nbytes)
            codes.append(code)
            sums.append(count * each)
        if not codes:
            return {}
        links, at = np.unique(np.concatenate(codes), return_inverse=True)
        total = np.zeros(len(links), np.int64)
        np.add.at(total, at, np.concatenate(sums))
        src, dst = np.divmod(links, _LINK_CODE)
        return {f"{a}->{b}": v for a, b, v in zip(src.tolist(), dst.tolist(), total.tolist(),
                                                  strict=True)}

    def _link_arrays(self, axis: str, op: str, nbytes: int) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`cost`'s link bytes as arrays, kept: each link as ``src x _LINK_CODE +
        dst`` (int64) and its bytes (``int`` of each, int64)."""
        key = (axis, op, nbytes)
        kept = self._links.get(key)
        if kept is None:
            items = self.cost(axis, op, nbytes).link_bytes.items()
            code = np.fromiter((a * _LINK_CODE + b for (a, b), _ in items), np.int64,
                               len(items))
            each = np.fromiter((int(b) for _, b in items), np.int64, len(items))
            kept = self._links[key] = (code, each)
        return kept


_FREE = ScheduleCost(seconds=0.0, phase_seconds=(), link_bytes={})

#: a directed link (src, dst) as one int64, src x _LINK_CODE + dst (chip ranks below it)
_LINK_CODE = 1 << 31

#: In-slice group collective costs shared by every ``MeshCollectiveCosts`` of this process,
#: keyed by everything ``group_collective_cost`` reads (the groups as device ids, the torus,
#: the calibrated link, ...): meshes whose axis lays out on the same groups (a layout
#: search's {fsdp: 64, tensor: 4} and {data: 2, fsdp: 32, tensor: 4} along tensor) cost
#: them once (the link faults in force are part of the key). Cleared when it holds
#: _GROUP_COSTS_SIZE.
_GROUP_COSTS: dict[tuple, ScheduleCost] = {}
_GROUP_COSTS_SIZE = 20_000
_GROUP_COSTS_LOCK = threading.Lock()


def _combined(parts: Iterable[ScheduleCost | float]) -> ScheduleCost:
    """Costs run one after another: seconds added, ICI link bytes added; a float is a DCN
    phase (no ICI link bytes)."""
    seconds, busiest, fixed = 0.0, 0.0, 0.0
    phases: list[float] = []
    link_bytes: Counter = Counter()
    for part in parts:
        if isinstance(part, ScheduleCost):
            seconds += part.seconds
            phases.extend(part.phase_seconds)
            busiest += part.busiest_link_seconds
            fixed += part.fixed_seconds
            link_bytes.update(part.link_bytes)
        elif part > 0:
            seconds += float(part)
            phases.append(float(part))
    return ScheduleCost(seconds=seconds, phase_seconds=tuple(phases), link_bytes=dict(link_bytes),
                        busiest_link_seconds=busiest, fixed_seconds=fixed)
