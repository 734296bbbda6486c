"""A device mesh laid on the ICI torus, JAX style, and the HBM it leaves per device.

A :class:`Mesh` is an immutable value, as ``jax.sharding.Mesh``: an n-d array
of device ids plus axis names. The axes are ``data``, ``fsdp`` and ``tensor``,
always in that order (data outermost, tensor innermost, as MaxText's
``ici_{data,fsdp,tensor}_parallelism``); a scenario gives a subset of them in
``pod.mesh`` (``{data: 2, fsdp: -1, tensor: 4}``), ``-1`` meaning "the rest"
(at most one axis). Without ``pod.mesh`` the mesh is ``{data: <every
device>}``, today's data-parallel layout.

Devices [JAX]: on v2 and v3 each TensorCore is its own JAX device (2 per
chip); v4 and v5p run their two TensorCores as one "megacore" device; v5e
and v6e have one TensorCore per chip. So a v2-8 (4 chips) has 8 devices, a
v4-32 (16 chips) 16. Device id ``d`` is chip rank ``d // devices_per_chip``,
core ``d % devices_per_chip``: ids follow the torus's row-major ranks with
the chip's cores innermost.

Layout (``jax.experimental.mesh_utils.create_device_mesh`` [JAX-MU], [SB]
"How to Scale Your Model", sharding chapter). The physical axes, innermost
first, are: the TensorCores of a chip (v2 / v3 only), then the torus axes
from the last (fastest, contiguous ranks) to the first. Mesh axes are placed
innermost first (tensor, then fsdp, then data); from each physical axis a
mesh axis takes all that is left of it, nothing, or a contiguous block (the
axis is *split*: the inner block goes to this mesh axis, the rest, strided by
the block, is left to the outer mesh axes; JAX's
``allow_split_physical_axes``), so that the sizes multiply to its size.
Among the choices it prefers, in order: the smallest stride (contiguous
chips), the fewest split axes, the fastest axes. So the innermost mesh axis
with an even size takes the two TensorCores of a v2 / v3 chip. Every mesh
whose sizes multiply to the device count can be laid out this way (each
size divides what is left; deal its prime factors out axis by axis), so the
only layout error is a wrong product.

Invariants (tests/pod/config/test_mesh.py checks each, over 1-D, 2-D and 3-D
tori with and without wraparound):

- every device appears exactly once in ``devices``; the groups along one
  axis (the devices along it, the other axes fixed) partition the devices;
- a group in ring order (:meth:`Mesh.groups`) steps between devices on the
  same chip (v2 / v3 cores) or ``hops_per_step`` ICI hops apart: 1 hop (a
  physical neighbour) unless the group runs over the outer, strided part of
  a split axis. A split cannot keep both parts on neighbours: a torus axis
  of ``a b`` chips has at most ``a b`` links, an ``a x b`` grid of
  neighbours needs ``2ab - a - b``, more unless a = b = 2;
- a group is a closed ring when its last device is as near the first as
  consecutive ones are (wraparound links, or a 2-D sub-torus with an even
  side), else an open line;
- ``{data: N}``: ``devices == arange(N)``, as the data-parallel batch split.

Sources: [JAX] jax.readthedocs.io "TPU devices" (cores per device per
generation); [JAX-MU] ``jax/experimental/mesh_utils.py``; [SB] "How to Scale
Your Model", the sharding and training chapters (FSDP = ZeRO-3).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from chip import ChipSpec
from interconnect import Torus
from pod.config.slices import Topology
from pod.errors import HBMPlanError, ScenarioError
from pod.programs.transformer import device_param_elements, param_layout
from pod.workloads.transformer import TransformerModel

__all__ = ["AXIS_NAMES", "FOLDED_AXES", "SCENARIO_AXES", "fold_axes", "CORES_ARE_DEVICES",
           "AxisBlock", "MeshAxis", "Mesh", "parse_mesh_axes",
           "format_axes", "devices_per_chip", "device_hbm_bytes", "build_mesh", "layout_mesh",
           "sharded_memory_plan", "mesh_memory_plan", "model_figures", "DeviceFigures",
           "fsdp_buffer_bytes"]

#: Mesh axis names, outermost first (MaxText's ici_*_parallelism order: data, stage
#: (pipeline), fsdp, expert, tensor).
AXIS_NAMES = ("data", "stage", "fsdp", "expert", "tensor")

#: MaxText mesh axes a scenario may name that run as part of one of the axes above:
#: name -> that axis. ``fsdp_transpose`` (MaxText ``ici_fsdp_transpose_parallelism``,
#: ``dcn_fsdp_transpose_parallelism``; training-steps.md T7 runs ``-1`` on a v6e-256)
#: is FSDP with the MLP weights split on their other dimension: MaxText's logical axis
#: rules (base.yml at tpu-recipes-v0.1.4, ``logical_axis_rules``) put ``mlp`` on
#: [fsdp_transpose, tensor, ...] and ``embed`` on [fsdp, fsdp_transpose, ...] (on fsdp
#: alone where fsdp_transpose already holds the other dimension), and the batch
#: (``activation_batch``) on [data, fsdp, fsdp_transpose, expert]. So with fsdp a and
#: fsdp_transpose b every weight is split over all a b devices of the fsdp x
#: fsdp_transpose block (the MLP's E x F on both of its dimensions, the attention's and
#: the embedding's E over both axes), every activation keeps its a b batch shards,
#: and XLA all-gathers each weight over the whole block before its matmul (the
#: activations are batch-sharded on the same devices: an all-gather over both axes at
#: once, replica groups spanning the block) and reduce-scatters its gradient over it.
#: That is this emulator's FSDP over one axis of a b devices, laid where MaxText's two
#: adjacent axes lie (fsdp_transpose inner, next to fsdp): the same bytes per device
#: (each weight's 1 / (a b) kept, its whole tensor-local array gathered in bf16),
#: the same collectives on the same devices and links, the same compute (FSDP here
#: cuts each parameter flat, so which dimension MaxText splits changes no size). So
#: ``{fsdp: a, fsdp_transpose: b}`` builds the mesh ``{fsdp: a b}`` and keeps the
#: MaxText split in ``Mesh.folded`` for the reports (``Mesh.label``).
FOLDED_AXES = {"fsdp_transpose": "fsdp"}

#: The axes ``pod.mesh`` and ``pod.dcn_mesh`` take, outermost first (MaxText's order).
SCENARIO_AXES = ("data", "stage", "fsdp", "fsdp_transpose", "expert", "tensor")

#: Generations whose TensorCores are separate JAX devices [JAX]; the others are one
#: device per chip (v4, v5p: megacore; v5e, v6e: one TensorCore).
CORES_ARE_DEVICES = ("v2", "v3")

_GIB = 2**30
#: Bytes of the MXU's copy of a weight per precision (fp32 runs on the float32 weights).
_MXU_COPY_BYTES = {"bf16": 2, "int8": 1, "fp32": 0}
#: Bytes per weight an FSDP all-gather moves and the gathered layer holds: bf16 (XLA
#: converts the float32 master before gathering [SB]; int8 training gathers bf16 and
#: quantises on chip), float32 in fp32 training.
_GATHER_BYTES = {"bf16": 2, "int8": 2, "fp32": 4}
_FLOAT32_BYTES = 4


# ------------------------------------------------------------------ the scenario


def format_axes(axes: Mapping[str, int]) -> str:
    """A mesh as YAML flow text, e.g. ``{data: 2, tensor: 4}``."""
    return "{" + ", ".join(f"{name}: {size}" for name, size in axes.items()) + "}"


def parse_mesh_axes(value: object) -> dict[str, int]:
    """Check ``pod.mesh`` as written: known axis names, sizes >= 1 or one ``-1``.

    Args:
        value: the YAML value, a mapping of axis name to size.

    Returns:
        The axes in mesh order (``SCENARIO_AXES``: data, ..., fsdp, fsdp_transpose, ...,
        tensor), e.g. ``{"data": 2, "tensor": -1}``.

    Raises:
        ScenarioError: one line quoting the mesh and the allowed names or sizes.
    """
    allowed = ", ".join(SCENARIO_AXES)
    if not isinstance(value, Mapping):
        raise ScenarioError(f"must be a mapping of axis name to size such as "
                            f"{{data: 2, tensor: 4}}; axes: {allowed}")
    shown = format_axes(value) if value else "{}"
    if not value:
        raise ScenarioError(f"{shown}: give at least one axis such as {{data: 2, tensor: 4}}; "
                            f"axes: {allowed}")
    for name, size in value.items():
        if name not in SCENARIO_AXES:
            raise ScenarioError(f"{shown}: unknown axis {name!r}; allowed: {allowed}")
        if not isinstance(size, int) or isinstance(size, bool):
            raise ScenarioError(f"{shown}: {name}: {size!r} is not a whole number; give a size "
                                f">= 1, or -1 for the rest of the devices")
        if size < 1 and size != -1:
            raise ScenarioError(f"{shown}: {name}: {size} is not a size; give a size >= 1, or -1 "
                                f"for the rest of the devices (at most one axis)")
    rest = [name for name in value if value[name] == -1]
    if len(rest) > 1:
        raise ScenarioError(f"{shown}: {' and '.join(rest)} are both -1; at most one axis takes "
                            f"the rest of the devices")
    return {name: value[name] for name in SCENARIO_AXES if name in value}


def fold_axes(axes: Mapping[str, int]) -> tuple[dict[str, int], dict[str, int]]:
    """``FOLDED_AXES`` multiplied into the axes they run as (sizes resolved, no -1).

    Returns:
        (the axes in ``AXIS_NAMES`` order, the folded ones as given: ``{}`` when none),
        e.g. ``{fsdp: 2, fsdp_transpose: 4}`` -> ``({fsdp: 8}, {fsdp_transpose: 4})``.
    """
    out = {k: int(v) for k, v in axes.items() if k not in FOLDED_AXES}
    folded = {k: int(v) for k, v in axes.items() if k in FOLDED_AXES}
    for name, size in folded.items():
        out[FOLDED_AXES[name]] = out.get(FOLDED_AXES[name], 1) * size
    return {k: out[k] for k in AXIS_NAMES if k in out}, folded


def devices_per_chip(chip: ChipSpec) -> int:
    """JAX devices per chip: its TensorCores on v2 / v3, else 1 (megacore or one core) [JAX]."""
    return chip.tensorcores if chip.name in CORES_ARE_DEVICES else 1


def device_hbm_bytes(chip: ChipSpec) -> int:
    """HBM of one device, bytes: a TensorCore's share on v2 / v3, the whole chip's otherwise."""
    return chip.hbm_bytes // devices_per_chip(chip)


# ------------------------------------------------------------------ the value


@dataclass(frozen=True)
class AxisBlock:
    """The part of one physical axis a mesh axis occupies.

    Attributes:
        torus_axis: the torus axis (0 = slowest), or None for the TensorCores of a
            chip (v2 / v3).
        size: devices along it.
        stride: chips between consecutive devices along the torus axis (1:
            contiguous; > 1: the outer part of a split axis); 1 for cores.
        wraps: the block closes into a ring over the axis's wraparound link
            (it spans the whole axis, which wraps, and has more than 2 chips).
    """

    torus_axis: int | None
    size: int
    stride: int
    wraps: bool

    @property
    def hops(self) -> int:
        """ICI hops between consecutive devices along the block (0: same chip)."""
        return 0 if self.torus_axis is None else self.stride


@dataclass(frozen=True)
class MeshAxis:
    """One mesh axis and where it lies on the torus.

    Attributes:
        name: data, fsdp or tensor.
        size: devices along it.
        blocks: the physical axes it occupies, slowest first (empty for size 1).
        closed: its groups are closed rings in ring order: the last device is as
            near the first as consecutive ones are (a group of two is a closed
            ring; a group of one is not); else open lines.
        hops_per_step: the largest number of ICI hops between consecutive
            devices of a group in ring order (0: all on one chip).
        ring: the indices along the axis in ring order (a permutation of
            ``range(size)``); :meth:`Mesh.groups` applies it.
        dcn: the axis's factor across slices (multislice, ``pod.dcn_mesh``): the
            outer ``dcn`` part of the axis spans slices over the data-centre
            network, the inner ``size / dcn`` lies in each slice on ``blocks``.
    """

    name: str
    size: int
    blocks: tuple[AxisBlock, ...]
    closed: bool
    hops_per_step: int
    ring: tuple[int, ...] = field(repr=False, default=())  # indices along the axis, ring order
    dcn: int = 1


@dataclass(frozen=True, eq=False)
class Mesh:
    """An immutable device mesh laid on a torus; build it with :func:`build_mesh`.

    Attributes:
        axis_names: mesh axes, outermost first, e.g. ("data", "tensor").
        shape: devices per axis, e.g. (4, 4); the product is the device count.
        devices: int array of that shape holding device ids (read-only); device
            ``d`` is chip rank ``d // devices_per_chip``, core ``d % devices_per_chip``.
        torus: the ICI torus of the chips.
        devices_per_chip: 2 on v2 / v3 (a device per TensorCore), else 1.
        axes: per axis its :class:`MeshAxis` (blocks, ring or line).
        slices: slices joined by the data-centre network (multislice); device
            ``d`` is on slice ``d // slice_devices``, chip ``d // devices_per_chip``
            (chip ranks run on across slices), torus rank ``(d % slice_devices)
            // devices_per_chip`` of its slice's ``torus``.
        slice_mesh: the mesh of one slice (the axes' in-slice parts, laid on
            ``torus``); the mesh itself when there is one slice.
        folded: the MaxText axes the scenario named that run as part of one of these
            (``FOLDED_AXES``), with their sizes (ICI x DCN), e.g.
            ``(("fsdp_transpose", 256),)``; the layout and every cost are those of
            the axis they joined.
    """

    axis_names: tuple[str, ...]
    shape: tuple[int, ...]
    devices: np.ndarray
    torus: Torus
    devices_per_chip: int
    axes: tuple[MeshAxis, ...]
    slices: int = 1
    slice_mesh: Mesh | None = field(default=None, repr=False)
    folded: tuple[tuple[str, int], ...] = ()

    @property
    def label(self) -> str:
        """The mesh as YAML flow text, with the MaxText axes folded into it:
        ``{fsdp: 256} (fsdp_transpose 256 as fsdp)``."""
        return format_axes(self.sizes) + "".join(
            f" ({name} {size} as {FOLDED_AXES[name]})" for name, size in self.folded)

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Mesh) and self._key() == other._key()
                and np.array_equal(self.devices, other.devices))

    def __hash__(self) -> int:
        return hash(self._key())

    def _key(self) -> tuple:
        return (self.axis_names, self.shape, self.torus, self.devices_per_chip, self.slices,
                tuple(a.dcn for a in self.axes))

    @property
    def in_slice(self) -> Mesh:
        """The mesh of one slice (``slice_mesh``, or itself with one slice)."""
        return self.slice_mesh if self.slice_mesh is not None else self

    @property
    def slice_devices(self) -> int:
        """Devices in one slice."""
        return self.size // self.slices

    def dcn_size(self, axis: str) -> int:
        """The factor of ``axis`` across slices (1 for an axis within slices or absent)."""
        return self._axis(axis).dcn if axis in self.axis_names else 1

    @property
    def dcn_sizes(self) -> dict[str, int]:
        """Axis -> its factor across slices, for the axes that cross slices."""
        return {a.name: a.dcn for a in self.axes if a.dcn > 1}

    @property
    def size(self) -> int:
        """Number of devices."""
        return int(self.devices.size)

    @property
    def sizes(self) -> dict[str, int]:
        """Axis name -> size, in mesh order."""
        return dict(zip(self.axis_names, self.shape, strict=True))

    @property
    def batch_shards(self) -> int:
        """Devices that see different examples: data x fsdp x expert (MaxText's
        ``activation_batch``); the tensor devices of a group share theirs."""
        return self.axis_size("data") * self.axis_size("fsdp") * self.axis_size("expert")

    def axis_size(self, axis: str) -> int:
        """Devices along ``axis``; 1 for an axis the mesh does not have (data, fsdp, tensor)."""
        if axis not in AXIS_NAMES:
            raise ValueError(f"mesh axis {axis!r} is unknown; allowed: {', '.join(AXIS_NAMES)}")
        return self.sizes.get(axis, 1)

    def chip_and_core(self, device: int) -> tuple[int, int]:
        """(chip rank, core) of a device id."""
        return divmod(int(device), self.devices_per_chip)

    def _axis(self, axis: str) -> MeshAxis:
        if axis not in self.axis_names:
            raise ValueError(f"mesh axis {axis!r} is not in the mesh {format_axes(self.sizes)}; "
                             f"its axes: {', '.join(self.axis_names)}")
        return self.axes[self.axis_names.index(axis)]

    def torus_axes(self, axis: str) -> tuple[AxisBlock, ...]:
        """The physical axes (or blocks of one) ``axis`` occupies, slowest first."""
        return self._axis(axis).blocks

    def is_ring(self, axis: str) -> bool:
        """Whether the groups along ``axis`` are closed rings (else open lines)."""
        return self._axis(axis).closed

    def groups(self, axis: str, order: str = "ring") -> list[tuple[int, ...]]:
        """All groups along ``axis``: the devices along it with the other axes fixed.

        Args:
            axis: a mesh axis name.
            order: "ring": each group in ring order, the order a ring collective
                visits it (consecutive devices physical neighbours, or on one
                chip); "mesh": in the order of the mesh index (the shard order).

        Returns:
            ``size / axis size`` tuples of device ids, in row-major order of the
            other axes; together they hold every device once. The groups of
            one axis are translates of each other on the torus, so they share
            :meth:`is_ring` and ``hops_per_step``.
        """
        info = self._axis(axis)
        if order not in ("ring", "mesh"):
            raise ValueError(f"order {order!r} is unknown; allowed: ring, mesh")
        index = self.axis_names.index(axis)
        rows = np.moveaxis(self.devices, index, -1).reshape(-1, info.size)
        if order == "ring":
            rows = rows[:, list(info.ring)]
        return [tuple(int(d) for d in row) for row in rows]


# ------------------------------------------------------------------ the layout


@dataclass
class _Physical:
    """A physical axis while mesh axes are placed: what is left of it."""

    torus_axis: int | None
    size: int
    wraps: bool
    left: int
    stride: int = 1


def _physical_axes(torus: Torus, per_chip: int) -> list[_Physical]:
    """The physical axes, innermost first: the chip's cores, then the torus axes, last first."""
    out = [_Physical(None, per_chip, False, per_chip)] if per_chip > 1 else []
    for axis in reversed(range(torus.ndim)):
        size = torus.shape[axis]
        out.append(_Physical(axis, size, bool(torus.wraparound[axis]) and size > 2, size))
    return out


def _candidates(phys: list[_Physical]):
    """Every way to take a mesh axis now: per physical axis, a divisor of what is left of
    it (1: not used; all of it: the whole axis; else a contiguous block)."""
    options = [[f for f in range(1, p.left + 1) if p.left % f == 0] for p in phys]
    yield from itertools.product(*options)


def _place(name: str, size: int, phys: list[_Physical]) -> list[AxisBlock]:
    """Take the physical axes of one mesh axis; see the module docstring for the order.

    A choice always exists when the sizes multiply to the device count: each
    size divides the product of what is left, and its prime factors can be
    dealt out to the axes prime by prime.
    """
    best = None
    for factors in _candidates(phys):
        if math.prod(factors) != size:
            continue
        used = [i for i, f in enumerate(factors) if f > 1]
        blocks = [i for i in used if factors[i] < phys[i].left]
        key = (max((phys[i].stride for i in used), default=1), len(blocks), used,
               [-i for i in blocks])
        if best is None or key < best[0]:
            best = (key, factors)
    if best is None:  # unreachable when the sizes multiply to the devices (see above)
        raise ValueError(f"mesh axis {name} of {size} devices does not divide what is left")
    out = []
    for p, f in zip(phys, best[1], strict=True):
        if f > 1:
            whole = f == p.left and p.stride * p.left == p.size
            out.append(AxisBlock(p.torus_axis, f, p.stride, p.wraps and whole))
            p.stride, p.left = p.stride * f, p.left // f
    return out


def _slow_first(blocks, ndim: int):
    """Sort blocks slowest first: torus axis 0 first, larger strides first, cores last."""
    return sorted(blocks, key=lambda k: (ndim if k.torus_axis is None else k.torus_axis,
                                         -k.stride))


def _snake(shape: tuple[int, ...]) -> list[int]:
    """Row-major indices of a box in boustrophedon order (each step changes one index by 1)."""
    if not shape:
        return [0]
    inner = _snake(shape[1:])
    width = math.prod(shape[1:])
    return [i * width + j for i in range(shape[0]) for j in (inner if i % 2 == 0 else inner[::-1])]


def _ring(blocks: tuple[AxisBlock, ...]) -> tuple[tuple[int, ...], bool]:
    """(indices along the axis in ring order, closed) for blocks ordered slowest first."""
    sizes = tuple(k.size for k in blocks)
    if not sizes:
        return (0,), False
    if len(sizes) <= 3:
        box = Torus(sizes, tuple(k.wraps for k in blocks))
        order = box.ring_order()
        if all(box.has_link(a, b) for a, b in zip(order, order[1:] + order[:1], strict=True)):
            return tuple(order), True
    return tuple(_snake(sizes)), False


def layout_mesh(axes: Mapping[str, int], torus: Torus, per_chip: int = 1) -> Mesh:
    """Lay mesh axes of known sizes on a torus (the module docstring says how).

    Args:
        axes: axis name -> size >= 1, names from :data:`AXIS_NAMES`; the product
            must be ``torus.num_chips * per_chip``.
        torus: the chips' ICI torus.
        per_chip: devices per chip (2 on v2 / v3).

    Returns:
        The mesh.

    Raises:
        ValueError: the sizes do not multiply to the device count (the only
            way a layout fails; :func:`build_mesh` says it in one line).
    """
    names = tuple(name for name in AXIS_NAMES if name in axes)
    shape = tuple(int(axes[name]) for name in names)
    count = torus.num_chips * per_chip
    if math.prod(shape) != count:
        raise ValueError(f"mesh {format_axes(axes)} has {math.prod(shape)} devices, not {count}")
    phys = _physical_axes(torus, per_chip)
    placed = {name: _place(name, size, phys)
              for name, size in reversed(list(zip(names, shape, strict=True)))}
    # every physical axis (split ones as their blocks), slowest first, as the ids lie
    physical = _slow_first([k for blocks in placed.values() for k in blocks], torus.ndim)
    ids = np.arange(count).reshape([k.size for k in physical])
    order: list[int] = []
    mesh_axes: list[MeshAxis] = []
    for name, size in zip(names, shape, strict=True):
        blocks = tuple(_slow_first(placed[name], torus.ndim))
        order.extend(physical.index(k) for k in blocks)
        ring, closed = _ring(blocks)
        hops = max((k.hops for k in blocks), default=0)
        mesh_axes.append(MeshAxis(name, size, blocks, closed and size > 1, hops, ring))
    devices = ids.transpose(order).reshape(shape) if order else ids.reshape(shape)
    devices.flags.writeable = False
    return Mesh(names, shape, devices, torus, per_chip, tuple(mesh_axes))


def _all_meshes(count: int) -> list[dict[str, int]]:
    """Every {data, fsdp, tensor} split of ``count`` devices (size-1 axes dropped, but data)."""
    out = []
    for tensor in range(1, count + 1):
        for fsdp in range(1, count // tensor + 1):
            if count % (tensor * fsdp) == 0:
                sizes = {"data": count // (tensor * fsdp), "fsdp": fsdp, "tensor": tensor}
                out.append({k: v for k, v in sizes.items() if v > 1 or k == "data"})
    return out


def _examples(given: Mapping[str, int], torus: Torus, per_chip: int,
              accepts: Callable[[dict[str, int]], bool] | None = None) -> str:
    """Two valid meshes nearest the one given that the model runs on (``accepts``): fewest
    sizes changed, then the smallest sum of log-ratios of the sizes (an axis given as -1
    may take any size)."""
    count = torus.num_chips * per_chip
    want = {name: given.get(name, 1) for name in AXIS_NAMES if given.get(name) != -1}

    def distance(axes: dict[str, int]) -> tuple[int, float]:
        changed = sum(axes.get(n, 1) != size for n, size in want.items())
        return changed, sum(abs(math.log(axes.get(n, 1) / size)) for n, size in want.items())

    meshes = [m for m in _all_meshes(count) if accepts is None or accepts(m)]
    near = sorted(meshes, key=distance)  # every one of them can be laid out
    return ", ".join(format_axes(m) for m in near[:2])


def build_mesh(axes: Mapping[str, int] | None, pod: Topology,
               dcn: Mapping[str, int] | None = None, *,
               accepts: Callable[[dict[str, int]], bool] | None = None) -> Mesh:
    """The mesh a scenario's ``pod.mesh`` (and ``pod.dcn_mesh``) asks for, on its pod.

    Args:
        axes: ``pod.mesh`` as :func:`parse_mesh_axes` returns it (one size may
            be -1, "the rest"): the axes within one slice (MaxText's
            ``ici_*_parallelism``); None: ``{data: <every device of a slice>}``.
        pod: the resolved pod (``pod.slices`` slices of ``pod.torus``).
        dcn: ``pod.dcn_mesh``: each axis's factor across slices (MaxText's
            ``dcn_*_parallelism``; the sizes multiply to ``pod.slices``); None:
            ``{data: pod.slices}``.
        accepts: whether the model's program runs on a mesh of these sizes: the meshes
            the error suggests are such (never ``{data: 1, fsdp: 8}`` for a CNN, or
            ``{tensor: 8}`` for 4 heads, which the plan would refuse next); None: any.

    Returns:
        The mesh; its device count is ``pod.chips * devices_per_chip(pod.chip)``,
        each axis ``ici x dcn`` long (the DCN part outer).

    Raises:
        ScenarioError: one line naming the sizes and valid choices, e.g.
            ``pod.mesh: {data: 3, tensor: 4} has 12 devices but the v4-32 slice has
            16; sizes must multiply to 16 (e.g. {data: 4, tensor: 4}, ...)``.
    """
    per_chip = devices_per_chip(pod.chip)
    count = pod.torus.num_chips * per_chip                              # one slice's devices
    axes = parse_mesh_axes(axes) if axes is not None else {"data": count}
    where = (f"the {pod.slice_name} slice" if pod.slice_name else
             f"the {pod.chip.name} {pod.torus.name} pod")
    per_core = " (a device per TensorCore)" if per_chip > 1 else ""
    given = math.prod(size for size in axes.values() if size != -1)
    rest = [name for name, size in axes.items() if size == -1]
    if (rest and count % given) or (not rest and given != count):
        what = (f"the other axes take {given} devices, which does not divide the {count}"
                if rest else f"has {given} devices but")
        examples = _examples(axes, pod.torus, per_chip, accepts)
        tail = f"; sizes must multiply to {count} (e.g. {examples})"
        if rest:
            raise ScenarioError(f"pod.mesh: {format_axes(axes)}: {what} devices of {where}"
                                f"{per_core}{tail}")
        raise ScenarioError(f"pod.mesh: {format_axes(axes)} {what} {where} has {count}"
                            f"{per_core}{tail}")
    if rest:
        axes = {**axes, rest[0]: count // given}
    axes, folded = fold_axes(axes)
    across, folded_dcn = fold_axes(dcn) if dcn else ({}, {})
    one = layout_mesh(axes, pod.torus, per_chip)
    slices = getattr(pod, "slices", 1)
    if slices > 1 or across:
        one = multislice_mesh(one, across or {"data": slices}, slices)
    both = {k: folded.get(k, 1) * folded_dcn.get(k, 1) for k in FOLDED_AXES
            if k in folded or k in folded_dcn}
    return dataclasses.replace(one, folded=tuple(both.items())) if both else one


def multislice_mesh(one: Mesh, dcn: Mapping[str, int], slices: int) -> Mesh:
    """``slices`` copies of a one-slice mesh joined over the data-centre network, each
    axis ``a`` ``dcn[a]`` times longer, its DCN part outermost (MaxText's
    ``create_hybrid_device_mesh``: slice ``s`` holds the devices whose DCN indices
    number ``s`` row-major).

    Args:
        one: the mesh of one slice.
        dcn: axis -> factor across slices; the factors multiply to ``slices``.
        slices: slices.

    Raises:
        ScenarioError: the factors do not multiply to the slices, or an unknown axis.
    """
    if math.prod(dcn.values()) != slices or any(a not in AXIS_NAMES for a in dcn):
        raise ScenarioError(f"pod.dcn_mesh: {format_axes(dcn)} must name mesh axes "
                            f"({', '.join(AXIS_NAMES)}) whose sizes multiply to pod.slices "
                            f"{slices}, e.g. {{data: {slices}}}")
    names = tuple(n for n in AXIS_NAMES if n in one.axis_names or n in dcn)
    ici = [one.axis_size(n) if n in one.axis_names else 1 for n in names]
    outer = [int(dcn.get(n, 1)) for n in names]
    local = one.devices.reshape(ici)                                    # every axis, size 1 too
    n_local = one.size
    slice_of = np.arange(slices).reshape(outer)                         # row-major DCN indices
    full = (slice_of.reshape(*outer, *([1] * len(names))) * n_local
            + local.reshape(*([1] * len(names)), *ici))                 # (dcn..., ici...)
    k = len(names)
    # dcn_i outer of ici_i
    order = [i for pair in zip(range(k), range(k, 2 * k), strict=True) for i in pair]
    shape = tuple(o * i for o, i in zip(outer, ici, strict=True))
    devices = full.transpose(order).reshape(shape)
    devices.flags.writeable = False
    axes = []
    for n, o, i in zip(names, outer, ici, strict=True):
        base = one._axis(n) if n in one.axis_names else MeshAxis(n, 1, (), False, 0, (0,))
        ring = tuple(d * i + r for d in range(o) for r in (base.ring or (0,)))
        axes.append(dataclasses.replace(base, size=o * i, ring=ring, dcn=o,
                                        closed=base.closed or o > 1))
    return Mesh(names, shape, devices, one.torus, one.devices_per_chip, tuple(axes),
                slices=slices, slice_mesh=one)


# ------------------------------------------------------------------ memory


def _gib(nbytes: float) -> str:
    """Bytes as "9.1 GiB" (one decimal, ".0" dropped), or "30.5 MiB" below 1 GiB."""
    value, unit = (nbytes / _GIB, "GiB") if nbytes >= _GIB else (nbytes / 2**20, "MiB")
    return f"{value:.1f}".removesuffix(".0") + f" {unit}"


@dataclass(frozen=True)
class DeviceFigures:
    """What one device of a mesh holds for a model, from the model's own layout.

    Attributes:
        params: parameters the device keeps (its fsdp chunks of its tensor
            slices, replicated arrays whole, padding included).
        largest_layer: parameters of the largest layer on the device after its
            fsdp all-gather (still split by tensor).
        activations: bytes kept in HBM from forward for backward.
        transient: bytes of the largest working set of one layer in backward.
        weight_bytes: bytes of one stored parameter, of its gradient and of its
            optimizer state per slot: 4 (float32 masters), 2 under the transformer's
            ``weight_dtype: bfloat16`` (``pod.workloads.weights``).
    """

    params: int
    largest_layer: int
    activations: int
    transient: int = 0
    weight_bytes: int = _FLOAT32_BYTES


#: (fsdp, tensor, per-device batch) -> the device's figures, None for a layout the
#: model cannot take
FiguresFn = Callable[[int, int, int], "DeviceFigures | None"]


def fsdp_buffer_bytes(layer_params: int, fsdp: int, precision: str,
                      weight_bytes: int = _FLOAT32_BYTES) -> int:
    """The FSDP buffers of one device, bytes: two layers' weights as the MXU reads
    them (the one computing and the next, prefetched: XLA's async all-gathers
    run a layer ahead), and with fsdp > 1 two layers' whole gradients in the
    parameters' dtype (``weight_bytes``: float32, or bf16 under ``weight_dtype:
    bfloat16``; one being reduce-scattered while the next is computed).
    ``layer_params``: the largest layer's parameters on the device (a bound for
    both layers).

    Weights: gathered in bf16 (2 bytes; XLA converts before the all-gather, [SB];
    a bf16-stored parameter is bf16 already) or float32 for fp32 training of float32
    masters; without fsdp, the MXU's copy of the local weights (bf16 2, int8 1, none
    for fp32, which reads the float32 master; none for bf16 weights in bf16).
    """
    if fsdp > 1:
        gathered = min(_GATHER_BYTES.get(precision, 2), weight_bytes)
        return 2 * layer_params * (gathered + weight_bytes)
    if weight_bytes <= _MXU_COPY_BYTES.get(precision, 0):
        return 0  # the MXU reads the stored bf16 weights themselves
    return 2 * layer_params * _MXU_COPY_BYTES.get(precision, 0)


def _sharded_items(params: int, optimizer_bytes_per_param: float, fsdp: int, tensor: int,
                   precision: str, figures: DeviceFigures | None,
                   activation_bytes_per_example: int = 0, per_device_batch: int = 0,
                   largest_layer: int = 0) -> dict[str, int]:
    if figures is None:  # closed forms: everything split evenly
        figures = DeviceFigures(math.ceil(params / (fsdp * tensor)),
                                math.ceil(largest_layer / tensor),
                                math.ceil(per_device_batch * activation_bytes_per_example / tensor))
    local, weight = figures.params, figures.weight_bytes
    items = {
        "params": weight * local,
        "grads": weight * local,
        "optimizer_state": math.ceil(optimizer_bytes_per_param * local),
        "activations": figures.activations,
        "workspace": (fsdp_buffer_bytes(figures.largest_layer, fsdp, precision, weight)
                      + figures.transient),
    }
    return {**items, "total": sum(items.values())}


def _search(items_of: Callable[[int, int, int], dict | None], mesh: Mesh, per_device_batch: int,
            capacity_bytes: int) -> tuple[tuple[dict[str, int], int] | None, bool]:
    """(the mesh of the same devices with more fsdp / tensor sharding that fits, the
    least sharded first (then the least tensor, then the smallest total), and its
    bytes; None when none fits), and whether any other layout could be considered
    (False for a model with no other layout: more sharding is then no advice)."""
    fsdp, tensor, expert = (mesh.axis_size(a) for a in ("fsdp", "tensor", "expert"))
    global_batch = per_device_batch * mesh.batch_shards
    found, considered = None, False
    for axes in _all_meshes(mesh.size // expert):  # the expert axis kept as it is
        f, t = axes.get("fsdp", 1), axes.get("tensor", 1)
        shards = axes["data"] * f * expert
        if f < fsdp or t < tensor or f * t == fsdp * tensor or global_batch % shards:
            continue
        if expert > 1:  # in mesh order
            axes = {k: {**axes, "expert": expert}[k] for k in AXIS_NAMES
                    if k in axes or k == "expert"}
        plan = items_of(f, t, global_batch // shards)
        if plan is None:
            continue  # a layout the model cannot take is never suggested
        considered = True
        key = (f * t, t, plan["total"])
        if plan["total"] <= capacity_bytes and (found is None or key < found[0]):
            found = (key, axes, plan["total"])
    return (None if found is None else (found[1], found[2])), considered


def sharded_memory_plan(model_param_count: int, optimizer_state_bytes_per_param: float,
                        activation_bytes_per_example: int, per_device_batch: int, mesh: Mesh,
                        capacity_bytes: int, precision: str = "bf16",
                        largest_layer_param_count: int | None = None,
                        device_param_count: Callable[[int, int], int | None] | None = None, *,
                        figures: FiguresFn | None = None,
                        alternatives: tuple[tuple[str, FiguresFn], ...] = ()) -> dict[str, int]:
    """One device's HBM under a data / fsdp / tensor mesh (ZeRO-3 plus tensor sharding) [SB].

    With ``p`` the parameters the device keeps (``figures``' exact count; else
    ``device_param_count(fsdp, tensor)``; else ``ceil(P / (fsdp tensor))``):
    params, grads ``4 p`` bytes each (float32 master weights and gradient
    shards); optimizer_state ``ceil(optimizer_state_bytes_per_param * p)``;
    activations, what forward keeps in HBM for backward (``figures``: the
    model's count, remat and offload included; else ``ceil(per_device_batch *
    activation_bytes_per_example / tensor)``); workspace, the FSDP buffers
    (``fsdp_buffer_bytes``) plus the largest working set of one layer in
    backward (``figures``' transient: a block's recomputed activations, or
    the logits and their gradient).

    Args:
        model_param_count: P, trainable parameters.
        optimizer_state_bytes_per_param: e.g. 8.0 for Adam (two float32 slots).
        activation_bytes_per_example: bytes kept per example (closed form only).
        per_device_batch: examples per device per step (global batch / (data x fsdp)).
        mesh, capacity_bytes: the mesh; HBM of one device (:func:`device_hbm_bytes`).
        precision: MXU precision, bf16 | fp32 | int8.
        largest_layer_param_count: L for the closed form (split by tensor); None: P.
        device_param_count: (fsdp, tensor) -> the parameters one device keeps, or
            None for a layout the model cannot take (closed form only).
        figures: (fsdp, tensor, per-device batch) -> :class:`DeviceFigures` from
            the model's own layout (``mesh_memory_plan``), or None for a layout
            it cannot take; replaces the closed forms.
        alternatives: (label, figures) of other versions of the model to name in
            a refusal when one fits this mesh (``"remat full"``).
    Returns:
        Bytes per item (params, grads, optimizer_state, activations, workspace), total.

    Raises:
        HBMPlanError: the total exceeds ``capacity_bytes``; one line naming the mesh, its
            need per device and what would fit: another version of the model on this mesh,
            e.g. ``remat full fits (12.1 GiB per device)``, and the mesh of the same devices
            with more fsdp / tensor sharding that fits, e.g. ``{data: 16} needs 19.5 GiB per
            device and does not fit 16 GiB; {data: 2, fsdp: 8} fits (9.1 GiB per device)``.
            It carries the plan as ``memory_plan``.
    """
    largest = model_param_count if largest_layer_param_count is None else largest_layer_param_count
    args = (model_param_count, optimizer_state_bytes_per_param)
    fsdp, tensor = mesh.axis_size("fsdp"), mesh.axis_size("tensor")

    def items_of(fn: FiguresFn | None, f: int, t: int, batch: int) -> dict[str, int] | None:
        if fn is not None:
            got = fn(f, t, batch)
            return None if got is None else _sharded_items(*args, f, t, precision, got)
        exact = device_param_count(f, t) if device_param_count is not None else None
        if exact is None and device_param_count is not None and (f, t) != (fsdp, tensor):
            return None
        closed = None if exact is None else DeviceFigures(
            exact, math.ceil(largest / t), math.ceil(batch * activation_bytes_per_example / t))
        return _sharded_items(*args, f, t, precision, closed, activation_bytes_per_example, batch,
                              largest)

    # the mesh asked for is planned even where the model cannot split (describe and
    # timing-only sweeps plan any mesh): the closed form then
    items = (items_of(figures, fsdp, tensor, per_device_batch)
             or items_of(None, fsdp, tensor, per_device_batch))
    assert items is not None  # the closed form plans the mesh's own (fsdp, tensor)
    if items["total"] <= capacity_bytes:
        return items
    hints = [f"{label} fits ({_gib(other['total'])} per device)" for label, other in
             ((label, items_of(fn, fsdp, tensor, per_device_batch)) for label, fn in alternatives)
             if other is not None and other["total"] <= capacity_bytes][:1]
    found, considered = _search(lambda f, t, b: items_of(figures, f, t, b), mesh,
                                per_device_batch, capacity_bytes)
    if found:
        hints.append(f"{format_axes(found[0])} fits ({_gib(found[1])} per device)")
    elif considered and not hints:
        hints.append(f"no mesh of {mesh.size} devices fits; use a smaller model or batch, or "
                     "more devices")
    raise _refusal(mesh, items, capacity_bytes, hints)


def _refusal(mesh: Mesh, items: dict[str, int], capacity_bytes: int, hints: list[str]
             ) -> HBMPlanError:
    """The one-line error of a plan that does not fit, with what would (``hints``)."""
    return HBMPlanError(
        f"{format_axes(mesh.sizes)} needs {_gib(items['total'])} per device (params "
        f"{_gib(items['params'])}, grads {_gib(items['grads'])}, optimizer state "
        f"{_gib(items['optimizer_state'])}, activations {_gib(items['activations'])}, workspace "
        f"{_gib(items['workspace'])}) and does not fit {_gib(capacity_bytes)}"
        + "".join(f"; {h}" for h in hints),
        tag="total", requested_bytes=items["total"], free_bytes=capacity_bytes,
        capacity_bytes=capacity_bytes, memory_plan=items)


def model_figures(model, precision: str = "bf16", expert: int = 1) -> FiguresFn:
    """:data:`FiguresFn` of a ``pod.workloads.Model``: its parameters per device (the
    transformer's program layout, ``device_param_elements``, E / ``expert`` of each
    MoE block's experts; else ceil(P / S)), its largest layer (``largest_layer_params``;
    an MoE block with its device's experts on an expert axis) and its activations
    (``activation_memory``: remat, offload, flash attention and the activation
    dtype of ``precision`` included)."""
    moe = isinstance(model, TransformerModel) and bool(model.config.experts) and expert > 1

    def figures(fsdp: int, tensor: int, batch: int) -> DeviceFigures | None:
        memory = model.activation_memory(batch, precision=precision, tensor=tensor)
        if memory is None:
            return None
        largest = model.largest_layer_params(tensor)
        if isinstance(model, TransformerModel):  # the program's own layout, not ceil(P / S)
            try:
                params = device_param_elements(model, fsdp, tensor, expert)
                if moe:
                    largest = _largest_expert_local_layer(model, expert)
            except ValueError:  # tensor does not divide the heads / mlp_dim, expert the experts
                return None
        else:
            params = math.ceil(int(model.num_params) / (fsdp * tensor))
        return DeviceFigures(params, largest, memory.device_bytes, memory.transient_bytes,
                             model.storage_dtype.itemsize)
    return figures


def mesh_memory_plan(model, optimizer_state_bytes: int, global_batch: int, mesh: Mesh,
                     capacity_bytes: int, precision: str = "bf16", *,
                     shardable: bool = True) -> dict[str, int]:
    """:func:`sharded_memory_plan` for any model of ``pod.workloads`` on any mesh
    (``build_plan`` uses it), from the model's own figures (:func:`model_figures`);
    a refusal names a remat policy that fits this mesh (the transformer's
    ``remat_variants``, least recomputation first) and a mesh that fits.

    Args:
        model: a ``pod.workloads.Model``.
        optimizer_state_bytes: the optimizer's state for the whole model, bytes.
        global_batch: examples per step over the pod (split over data x fsdp).
        mesh: the mesh.
        capacity_bytes: HBM of one device.
        precision: the training precision (MXU and activation dtype).
        shardable: the model's program can shard it over fsdp / tensor (the
            transformer); False: a replicated model, for which no other mesh is
            suggested.

    Raises:
        HBMPlanError: as :func:`sharded_memory_plan`, the message starting
            ``pod.mesh: ``.
    """
    params = int(model.num_params)
    batch_shards = mesh.batch_shards
    # the transformer's other remat policies (other models have none)
    variants: dict[str, TransformerModel] = getattr(model, "remat_variants", dict)()
    ranked = sorted(variants.items(), key=lambda kv: kv[1].hardware_flops_per_example())
    expert = mesh.axis_size("expert")
    alternatives = tuple((f"remat {policy}", model_figures(m, precision, expert))
                         for policy, m in ranked)
    figures = model_figures(model, precision, expert)
    if not shardable:  # a replicated model: planned on its own mesh, no other mesh suggested
        own = (mesh.axis_size("fsdp"), mesh.axis_size("tensor"))

        def figures(fsdp: int, tensor: int, batch: int, _all=figures) -> DeviceFigures | None:
            return _all(fsdp, tensor, batch) if (fsdp, tensor) == own else None
    try:
        return sharded_memory_plan(params, optimizer_state_bytes / max(params, 1), 0,
                                   global_batch // batch_shards, mesh, capacity_bytes, precision,
                                   figures=figures, alternatives=alternatives)
    except HBMPlanError as err:
        raise HBMPlanError(f"pod.mesh: {err}", tag=err.tag, requested_bytes=err.requested_bytes,
                           free_bytes=err.free_bytes, capacity_bytes=err.capacity_bytes,
                           memory_plan=err.memory_plan) from None


def _largest_expert_local_layer(model: TransformerModel, expert: int) -> int:
    """Parameters of the largest layer as an fsdp gather assembles it on a device of an
    ``expert`` axis: each MoE block with its E / expert experts (``param_layout``); the
    memory plan's workspace (a whole block's E experts would overstate it expert-fold).

    Raises:
        ValueError: the mesh cannot split the experts (``check_expert_split``).
    """
    per_layer: dict[str, int] = {}
    for p in param_layout(model, {"expert": expert}):
        per_layer[p.layer] = per_layer.get(p.layer, 0) + int(np.prod(p.local_shape))
    return max(per_layer.values())
