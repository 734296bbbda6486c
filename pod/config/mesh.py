"""A device mesh laid on the ICI torus, JAX style.

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
import functools
import itertools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from chip import PRESETS, ChipSpec
from interconnect import Torus
from pod.config.slices import Topology
from pod.errors import ScenarioError

__all__ = ["AXIS_NAMES", "FOLDED_AXES", "SCENARIO_AXES", "fold_axes", "CORES_ARE_DEVICES",
           "AxisBlock", "MeshAxis", "Mesh", "parse_mesh_axes",
           "format_axes", "devices_per_chip", "device_hbm_bytes", "build_mesh", "layout_mesh",
           "all_meshes"]

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

#: Generations whose TensorCores are separate JAX devices [JAX] (v2, v3): several cores
#: that are not one megacore (``devices_per_chip``); the others are one device per chip
#: (v4, v5p: megacore; v5e, v6e: one TensorCore).
CORES_ARE_DEVICES = tuple(name for name, spec in PRESETS.items()
                          if spec.tensorcores > 1 and not spec.megacore)


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
    """JAX devices per chip: its TensorCores unless they act as one megacore (v2 / v3: 2),
    else 1 (megacore or one core) [JAX]; read off the chip preset, not its name."""
    return 1 if chip.megacore else chip.tensorcores


def device_hbm_bytes(chip: ChipSpec) -> int:
    """HBM a program may use on one device, bytes: a TensorCore's share of the chip's
    available HBM on v2 / v3, the whole chip's otherwise (``ChipSpec.hbm_available_bytes``:
    XLA's own figure where measured, the published capacity otherwise)."""
    return chip.hbm_available_bytes // devices_per_chip(chip)


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
        size = self._sizes.get(axis)
        if size is not None:
            return size
        if axis not in AXIS_NAMES:
            raise ValueError(f"mesh axis {axis!r} is unknown; allowed: {', '.join(AXIS_NAMES)}")
        return 1

    @functools.cached_property
    def _sizes(self) -> dict[str, int]:
        """:attr:`sizes`, made once (the mesh is immutable; :attr:`sizes` gives a copy)."""
        return self.sizes

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
        kept = self._groups.get((axis, order))
        if kept is None:
            info = self._axis(axis)
            if order not in ("ring", "mesh"):
                raise ValueError(f"order {order!r} is unknown; allowed: ring, mesh")
            index = self.axis_names.index(axis)
            rows = np.moveaxis(self.devices, index, -1).reshape(-1, info.size)
            if order == "ring":
                rows = rows[:, list(info.ring)]
            kept = self._groups[(axis, order)] = tuple(map(tuple, rows.tolist()))
        return list(kept)

    @functools.cached_property
    def _groups(self) -> dict[tuple[str, str], tuple[tuple[int, ...], ...]]:
        """:meth:`groups` per (axis, order), made once each (the mesh is immutable; a
        layout search's clock and groups ask for the same thousands of times)."""
        return {}


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
    """Lay mesh axes of known sizes on a torus (the module docstring says how); each
    layout is made once per process (a mesh is a value: a layout search plans every mesh
    of a slice for every remat policy and batch).

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
    return _layout(names, shape, torus, int(per_chip))


@functools.lru_cache(maxsize=1024)
def _layout(names: tuple[str, ...], shape: tuple[int, ...], torus: Torus, per_chip: int) -> Mesh:
    """:func:`layout_mesh` of checked sizes."""
    count = torus.num_chips * per_chip
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


def all_meshes(count: int) -> list[dict[str, int]]:
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

    meshes = [m for m in all_meshes(count) if accepts is None or accepts(m)]
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
