"""An HLO collective's devices, and its cost on the pod's ICI (and DCN).

XLA writes the devices of a collective in several forms
(``xla/service/collective_device_list.h``, ``hlo_sharding``'s iota tiles):

- explicit: ``replica_groups={{0,1,2,3},{4,5,6,7}}`` (``{}``: every device);
- iota: ``replica_groups=[2,4]<=[4,2]T(1,0)``: ``iota(8).reshape(4, 2)
  .transpose(1, 0).reshape(2, 4)``, one group per row;
- mesh: ``replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0'}``: the devices
  ``0..7`` laid row-major on a 4 x 2 mesh, a group per position of the axes not
  named (the named ones vary inside a group); an axis may be a part of one,
  ``'axis_0':(2)2`` (size 2, after a major part of size 2);
- a permute's ``source_target_pairs={{0,1},{1,2}}``.

With ``use_global_device_ids`` (SPMD, what JAX emits) the ids are positions in
the executable's device assignment; :class:`Placement` maps them to the chips
of the torus (the TPU compile knows each device's coordinates; a dump alone is
taken in row-major torus order).

A collective is costed as the rest of the emulator costs a mesh axis's
(``pod.config.sharding.MeshCollectiveCosts``): every group at once on the
calibrated link, contention where their routes meet. A group that is a block
of the torus (a product of evenly spaced coordinates per torus axis, as a mesh
axis is) runs as XLA runs it, over every axis of its block in both directions
(``interconnect.group_collective_cost(..., algorithm="torus")``, the registry's name
for XLA's, with the block as its group torus); any other group runs as one ring in
the order given (named so in the cost). A group that spans slices is hierarchical,
as XLA keeps a collective over a multislice axis: the in-slice part over the ICI, the
shard across slices over the DCN (``interconnect.dcn_collective_seconds``).
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from chip import ChipSpec
from interconnect import (
    ScheduleCost,
    Torus,
    calibrated_link,
    dcn_collective_bytes,
    dcn_collective_seconds,
    group_collective_cost,
    pair_permute_cost,
)
from pod.config.mesh import devices_per_chip
from pod.config.sharding import on_chip_bandwidth
from pod.errors import HloError

__all__ = ["Groups", "parse_replica_groups", "parse_pairs", "Placement", "CollectiveCost",
           "CollectiveModel", "group_block"]

Groups = tuple[tuple[int, ...], ...]

#: Chips of one TPU host along the torus axes (libtpu's default ``chips_per_host_bounds``
#: "2x2x1" for v4, v5e, v5p, v6e), clipped to a smaller slice.
HOST_BOUNDS = (2, 2, 1)

_IOTA = re.compile(r"^\[([\d,\s]+)\]<=\[([\d,\s]+)\](?:T\(([\d,\s]+)\))?$")
_MESH = re.compile(r"^mesh\[(.*)\]\s*(\{.*\})?$")


def _ints(text: str) -> list[int]:
    return [int(v) for v in re.findall(r"\d+", text)]


def parse_pairs(text: str) -> tuple[tuple[int, int], ...]:
    """``source_target_pairs={{0,1},{1,2}}`` -> ((0, 1), (1, 2)).

    Raises:
        ValueError: a pair of other than two ids.
    """
    pairs = tuple(tuple(_ints(p)) for p in re.findall(r"\{([\d,\s]*)\}", text.strip()[1:-1]))
    if any(len(p) != 2 for p in pairs):
        raise ValueError(f"source_target_pairs {text[:60]!r} are not pairs of device ids")
    return tuple((p[0], p[1]) for p in pairs)


def parse_replica_groups(text: str, devices: int) -> Groups:
    """The groups of a collective, in any of XLA's forms (module docstring).

    Args:
        text: the ``replica_groups`` attribute's value ("" or "{}": every device).
        devices: the module's devices (replicas x partitions), for the empty form.

    Returns:
        The groups, each a tuple of device ids in the order written.

    Raises:
        ValueError: text in none of the forms, or groups of an iota / mesh form
            that do not multiply out.
    """
    text = text.strip()
    if text in ("", "{}", "{{}}"):
        return (tuple(range(devices)),)
    if text.startswith("{"):
        return tuple(tuple(_ints(g)) for g in re.findall(r"\{([\d,\s]*)\}", text[1:-1]))
    iota = _IOTA.match(text)
    if iota:
        shape, dims = _ints(iota.group(1)), _ints(iota.group(2))
        perm = _ints(iota.group(3)) if iota.group(3) else list(range(len(dims)))
        if math.prod(shape) != math.prod(dims) or sorted(perm) != list(range(len(dims))):
            raise ValueError(f"iota replica groups {text!r} do not multiply out")
        ids = np.arange(math.prod(dims)).reshape(dims).transpose(perm).reshape(shape[0], -1)
        return tuple(tuple(int(v) for v in row) for row in ids)
    mesh = _MESH.match(text)
    if mesh:
        return _mesh_groups(mesh.group(1), mesh.group(2) or "{}", text)
    raise ValueError(f"replica groups {text[:80]!r} are in no form XLA writes")


def _mesh_groups(axes_text: str, chosen_text: str, text: str) -> Groups:
    """Groups of the ``mesh[...] {...}`` form (module docstring)."""
    sizes: dict[str, int] = {}
    for name, size in re.findall(r"'([^']+)'\s*=\s*(\d+)", axes_text):
        sizes[name] = int(size)
    if not sizes:
        raise ValueError(f"mesh replica groups {text[:80]!r} name no axes")
    # each chosen axis, or part of one ('a':(pre)size): split the axes into parts
    parts: list[tuple[str, int, int]] = []  # (axis, pre, size) of the chosen parts
    for item in re.findall(r"'([^']+)'(?::\((\d+)\)(\d+))?", chosen_text):
        name, pre, size = item[0], int(item[1] or 1), int(item[2] or 0)
        if name not in sizes:
            raise ValueError(f"mesh replica groups {text[:80]!r} choose unknown axis {name!r}")
        parts.append((name, pre, size or sizes[name]))
    dims: list[int] = []
    labels: list[tuple[str, int]] = []  # per dimension: (axis, product of the parts before it)
    for name, size in sizes.items():  # each axis cut where a chosen part starts or ends
        cuts = sorted({pre for n, pre, _ in parts if n == name}
                      | {pre * s for n, pre, s in parts if n == name} | {1, size})
        for a, b in zip(cuts[:-1], cuts[1:], strict=True):
            if b % a or b > size:
                raise ValueError(f"mesh replica groups {text[:80]!r}: axis {name} does not split")
            dims.append(b // a)
            labels.append((name, a))
    chosen = {(n, pre) for n, pre, _ in parts}
    inside = [k for k, label in enumerate(labels) if label in chosen]
    outside = [k for k in range(len(dims)) if k not in inside]
    ids = np.arange(math.prod(dims)).reshape(dims).transpose(outside + inside)
    size = math.prod(dims[k] for k in inside)
    return tuple(tuple(int(v) for v in row) for row in ids.reshape(-1, size))


@dataclass(frozen=True)
class Placement:
    """Where the module's devices sit: chips of identical slices joined by the DCN.

    Attributes:
        torus: one slice's ICI torus.
        slices: identical slices (multislice).
        devices_per_chip: 2 on v2 / v3 (a device per TensorCore), else 1.
        devices: device id (as the module writes it) -> physical device (slice x
            devices per slice + chip rank in the slice x devices per chip + core);
            empty: the TPU's own device order (:meth:`physical`).
    """

    torus: Torus
    slices: int = 1
    devices_per_chip: int = 1
    devices: tuple[int, ...] = ()

    @property
    def slice_devices(self) -> int:
        """Devices in one slice."""
        return self.torus.num_chips * self.devices_per_chip

    @property
    def size(self) -> int:
        """Devices of the pod."""
        return self.slice_devices * self.slices

    def physical(self, device: int) -> int:
        """The physical device of a module's device id.

        Raises:
            HloError: an id outside the pod.
        """
        if not 0 <= device < (len(self.devices) or self.size):
            raise HloError(f"device {device} is not among the {self.size} devices of the pod "
                           f"({self.slices} x {self.torus.name}); compile for this slice or give "
                           "the slice the module was compiled for")
        if self.devices:
            return self.devices[device]
        return self.tpu_order(device)

    def tpu_order(self, device: int) -> int:
        """The physical device of the ``device``-th TPU device in the order libtpu lists a
        slice's devices (``jax.devices()``, a compile topology's ``devices``): slice after
        slice, host after host (a host holds a block of :data:`HOST_BOUNDS` chips; hosts
        in order of their position, x fastest), within a host x fastest, the TensorCores
        of a chip together. A mesh reshaped from that order (``Mesh(np.array(devices)
        .reshape(...))``) puts every mesh axis on a block of the torus."""
        slice_index, local = divmod(device, self.slice_devices)
        chip, core = divmod(local, self.devices_per_chip)
        shape = self.torus.shape
        bounds = tuple(min(b, s) for b, s in zip(HOST_BOUNDS, shape, strict=False))
        bounds += (1,) * (len(shape) - len(bounds))
        hosts = tuple(s // b for s, b in zip(shape, bounds, strict=True))
        host, within = divmod(chip, math.prod(bounds))
        at = np.unravel_index(host, hosts[::-1])[::-1]
        offset = np.unravel_index(within, bounds[::-1])[::-1]
        coords = tuple(int(a) * b + int(o) for a, b, o in zip(at, bounds, offset, strict=True))
        rank = int(np.ravel_multi_index(coords, shape))
        return slice_index * self.slice_devices + rank * self.devices_per_chip + core


def group_block(torus: Torus, members: Sequence[int]) -> tuple[Torus, tuple[int, ...]] | None:
    """The block of the torus a group of chip ranks fills, if it is one.

    A block is a product, over the torus axes, of evenly spaced coordinates (as a
    mesh axis occupies the torus, ``pod.config.mesh.AxisBlock``): e.g. ranks whose
    (x, y) are {0, 2} x {0, 1, 2, 3}. Its torus has one axis per torus axis the
    group spans (its number of positions), closing into a ring where the block
    spans a whole torus axis that wraps with more than two positions.

    Args:
        torus: the slice's torus.
        members: the group's chip ranks (distinct).

    Returns:
        (the block as a torus, the members in row-major order of it), or None when
        the group is not a block (then it runs as one ring in the order given).
    """
    coords = np.array([torus.coords(int(r)) for r in members], dtype=np.int64).reshape(
        len(members), torus.ndim)
    sizes, wraps, spans = [], [], []
    for axis in range(torus.ndim):
        values = np.unique(coords[:, axis])
        if len(values) == 1:
            continue
        steps = np.diff(values)
        if np.any(steps != steps[0]):
            return None
        stride, n = int(steps[0]), len(values)
        whole = n * stride == torus.shape[axis]
        sizes.append(n)
        wraps.append(bool(whole and torus.axis_wraps(axis) and n > 2))
        spans.append(axis)
    if math.prod(sizes) != len(members):
        return None
    order = sorted(range(len(members)), key=lambda i: tuple(coords[i, a] for a in spans))
    if not sizes:
        return Torus((1,), (False,)), tuple(int(members[i]) for i in order)
    return Torus(tuple(sizes), tuple(wraps)), tuple(int(members[i]) for i in order)


@dataclass(frozen=True)
class CollectiveCost:
    """One HLO collective's simulated cost over all its groups at once.

    Attributes:
        seconds: simulated seconds, the DCN part included.
        dcn_seconds: the part across the data-centre network (multislice).
        dcn_bytes: bytes one device sends across the DCN.
        link_bytes: bytes per directed ICI link (chip ranks of one slice).
        algorithm: how it was costed, e.g. "xla 2x4 block", "ring (not a block)",
            "direct pairs", "hierarchical: 4 slices".
    """

    seconds: float
    dcn_seconds: float = 0.0
    dcn_bytes: float = 0.0
    link_bytes: dict[tuple[int, int], int] = field(default_factory=dict)
    algorithm: str = ""


_FREE = CollectiveCost(0.0, algorithm="no transfer")

#: HLO collective -> the emulator's op (``interconnect.GROUP_OPS`` and "ppermute").
OPS = {"all-gather": "all_gather", "all-reduce": "allreduce", "reduce-scatter": "reduce_scatter",
       "all-to-all": "all_to_all", "collective-permute": "ppermute",
       "ragged-all-to-all": "all_to_all", "collective-broadcast": "all_gather"}


@dataclass(frozen=True, eq=False)
class CollectiveModel:
    """Costs HLO collectives on a pod's ICI and DCN (module docstring).

    Attributes:
        chip: the chip preset (its link, DCN figures, devices per chip).
        placement: where the module's devices sit.
    """

    chip: ChipSpec
    placement: Placement
    _cache: dict = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def of(cls, chip: ChipSpec, torus: Torus, slices: int = 1,
           devices: Sequence[int] = ()) -> CollectiveModel:
        """The model of ``slices`` slices of ``torus`` of ``chip``, devices placed by
        ``devices`` (empty: row-major torus order)."""
        return cls(chip, Placement(torus, slices, devices_per_chip(chip), tuple(devices)))

    @property
    def link(self):
        """The calibrated ICI link (``interconnect.calibrated_link``)."""
        return calibrated_link(self.chip.name, self.chip.ici_link_bandwidth_bytes_per_s,
                               self.chip.ici_latency_s)

    def cost(self, op: str, groups: Groups, nbytes: int, itemsize: int = 2) -> CollectiveCost:
        """Every group running ``op`` at once.

        Args:
            op: all_gather, reduce_scatter, allreduce, all_to_all (``groups`` as
                written), or ppermute (``groups`` are the (source, target) pairs).
            groups: the module's device ids.
            nbytes: each device's buffer: an all-gather's gathered result, a
                reduce-scatter's, allreduce's or all-to-all's input, a permute's buffer.
            itemsize: bytes per element of what moves.

        Returns:
            The :class:`CollectiveCost`.

        Raises:
            HloError: devices outside the pod, groups of unequal sizes, or an
                all-to-all across slices (not modelled).
        """
        key = (op, groups, int(nbytes), int(itemsize))
        with self._lock:
            hit = self._cache.get(key)
        if hit is not None:
            return hit
        place = self.placement
        physical = tuple(tuple(place.physical(d) for d in g) for g in groups)
        if op == "ppermute":
            result = self._permute(physical, int(nbytes), int(itemsize))
        elif all(len(g) <= 1 for g in physical) or nbytes <= 0:
            result = _FREE
        elif len({len(g) for g in physical}) > 1:
            raise HloError(f"{op} over groups of sizes {sorted({len(g) for g in physical})}: "
                           "groups of unequal sizes are not modelled")
        else:
            by_slice = [{d // place.slice_devices for d in g} for g in physical]
            k = len(by_slice[0])
            if k == 1 and all(len(s) == 1 for s in by_slice):
                result = self._in_slice(op, physical, int(nbytes), int(itemsize))
            else:
                result = self._across_slices(op, physical, k, int(nbytes), int(itemsize))
        with self._lock:
            self._cache[key] = result
        return result

    def _local(self, groups: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
        """Groups of physical devices as device ids within their slice."""
        n = self.placement.slice_devices
        return [tuple(d % n for d in g) for g in groups]

    def _in_slice(self, op: str, groups: Sequence[Sequence[int]], nbytes: int,
                  itemsize: int) -> CollectiveCost:
        """``op`` over groups inside one slice each (every slice does the same)."""
        place = self.placement
        first = {d // place.slice_devices for d in groups[0]}
        local = [g for g, s in zip(self._local(groups), groups, strict=True)
                 if {d // place.slice_devices for d in s} == first]
        elements = max(1, nbytes // itemsize)
        dpc = place.devices_per_chip
        block = group_block(place.torus, local[0]) if dpc == 1 else None
        blocks = [group_block(place.torus, g) for g in local] if block else []
        if block and all(b is not None and b[0] == block[0] for b in blocks):
            ordered = [b[1] for b in blocks if b is not None]
            cost = group_collective_cost(op, place.torus, ordered, elements, self.link, itemsize,
                                         devices_per_chip=dpc, algorithm="torus",
                                         group_torus=block[0])
            how = f"xla {block[0].name} block"
        else:
            cost = group_collective_cost(op, place.torus, local, elements, self.link, itemsize,
                                         devices_per_chip=dpc,
                                         on_chip_bytes_per_s=on_chip_bandwidth(self.chip),
                                         algorithm="ring")
            how = "ring in the order given (the group is not a block of the torus)"
        return CollectiveCost(cost.seconds, link_bytes=dict(cost.link_bytes), algorithm=how)

    def _across_slices(self, op: str, groups: Sequence[Sequence[int]], k: int, nbytes: int,
                       itemsize: int) -> CollectiveCost:
        """``op`` over groups spanning ``k`` slices: in-slice parts over the ICI, the
        shard across the slices over the DCN (``MeshCollectiveCosts._hierarchical``'s
        order: allreduce = reduce-scatter, DCN allreduce, all-gather; reduce-scatter =
        in-slice then DCN; all-gather = DCN then in-slice)."""
        if op == "all_to_all":
            raise HloError("an all-to-all across slices (over the DCN) is not modelled")
        n = self.placement.slice_devices
        parts = [[d for d in g if d // n == s] for g in groups for s in sorted({d // n for d in g})]
        sizes = {len(p) for p in parts}
        if len(sizes) > 1 or any(len({d // n for d in g}) != k for g in groups):
            raise HloError(f"{op} over groups spread unevenly over slices is not modelled")
        g = sizes.pop()
        inner = [tuple(p) for p in parts]
        shard = nbytes // g  # the DCN part's buffer: the in-slice shard (a gather's result)
        dcn = dcn_collective_seconds(op, k, shard, self.chip.dcn_bytes_per_s,
                                     self.chip.dcn_latency_s,
                                     senders_per_chip=self.placement.devices_per_chip)
        sent = dcn_collective_bytes(op, k, shard)
        pieces: list[CollectiveCost] = []
        if g > 1:
            if op in ("allreduce", "reduce_scatter"):
                pieces.append(self._in_slice("reduce_scatter", inner, nbytes, itemsize))
            if op in ("allreduce", "all_gather"):
                pieces.append(self._in_slice("all_gather", inner, nbytes, itemsize))
        links: dict[tuple[int, int], int] = {}
        for p in pieces:
            for key, v in p.link_bytes.items():
                links[key] = links.get(key, 0) + v
        return CollectiveCost(sum(p.seconds for p in pieces) + dcn, dcn, sent, links,
                              f"hierarchical: {g} per slice over the ICI, {k} slices over the DCN")

    def _permute(self, pairs: Groups, nbytes: int, itemsize: int) -> CollectiveCost:
        """A collective permute of (source, target) pairs; a pair across slices is one
        message over the DCN at the chip's DCN bandwidth (beside the ICI pairs)."""
        place = self.placement
        n = place.slice_devices
        inside = [(a, b) for a, b in pairs if a // n == b // n and a // n == pairs[0][0] // n]
        across = [(a, b) for a, b in pairs if a // n != b // n]
        cost: ScheduleCost | None = None
        if inside and nbytes:
            src, dst = zip(*((a % n, b % n) for a, b in inside), strict=True)
            cost = pair_permute_cost(place.torus, src, dst, max(1, nbytes // itemsize), self.link,
                                     itemsize, devices_per_chip=place.devices_per_chip,
                                     on_chip_bytes_per_s=on_chip_bandwidth(self.chip))
        dcn = (place.devices_per_chip * nbytes / self.chip.dcn_bytes_per_s
               + self.chip.dcn_latency_s) if across and nbytes else 0.0
        ici = cost.seconds if cost is not None else 0.0
        return CollectiveCost(max(ici, dcn), dcn if dcn > ici else 0.0,
                              float(nbytes) if across else 0.0,
                              dict(cost.link_bytes) if cost is not None else {},
                              "direct pairs" + (", across slices over the DCN" if across else ""))
