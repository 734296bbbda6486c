"""Whether one device's memory fits its HBM, and what would when it does not: the one place
that decides fit, prefetch depth, suggestions and the refusal.

A device program reports what one device holds in a step (``DeviceProgram.memory``,
a ``pod.memory.DeviceMemory``); this module asks for it through a :data:`MemoryOf`
callable (``build_plan`` makes one from its program factory), never through a
program's internals, so ``pod.config`` imports no program (issue 31).

The decision (issue 29 items 2, 3):

- **prefetch that pays for its memory**: an FSDP all-gather runs ahead of the layer
  computing only into HBM that is free. The plan starts at the program's prefetch
  depth (XLA's: one layer ahead) and, while the total does not fit, prefetches one
  layer fewer, down to none; the plan keeps the depth that fits
  (``DeviceMemory.prefetch_layers``), and the clock exposes the gathers that no
  longer run ahead (``pod.report.clock``);
- **the refusal**: when no depth fits, one line naming the mesh, its need per device
  by item, the capacity and what would fit: another version of the model on this
  mesh (a remat policy, least recomputation first, or the layer input offloaded to host
  memory: ``TransformerModel.remat_variants``) and the mesh of the same devices
  with more fsdp / tensor sharding that fits (the least sharded, then the least
  tensor, then the smallest total), e.g. ``pod.mesh: {data: 16} needs 19.5 GiB per
  device (params ..., workspace ...) and does not fit 16 GiB; {data: 2, fsdp: 8}
  fits (9.1 GiB per device)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

from pod.config.mesh import AXIS_NAMES, Mesh, all_meshes, format_axes
from pod.errors import HBMPlanError
from pod.memory import DeviceMemory, format_bytes

__all__ = ["MemoryOf", "fit_memory", "fitting_memory", "split_evenly", "refusal"]

#: (mesh axis sizes, per-device batch, prefetch layers or None for the program's own)
#: -> one device's memory, or None for a layout the model's program cannot run.
MemoryOf = Callable[[Mapping[str, int], int, "int | None"], "DeviceMemory | None"]


def fitting_memory(memory_of: MemoryOf, sizes: Mapping[str, int], per_device_batch: int,
                   capacity_bytes: int) -> tuple[DeviceMemory | None, bool]:
    """The memory at the deepest prefetch that fits (the program's own depth first, then
    one layer fewer, down to 0), and whether it fits; (None, False) for a layout the
    program cannot run. When none fits, the memory at prefetch 0 (the least it needs).
    """
    memory = memory_of(sizes, per_device_batch, None)
    if memory is None:
        return None, False
    while memory.total_bytes > capacity_bytes and memory.prefetch_layers > 0:
        fewer = memory_of(sizes, per_device_batch, memory.prefetch_layers - 1)
        assert fewer is not None  # the same layout, less prefetch
        memory = fewer
    return memory, memory.total_bytes <= capacity_bytes


def fit_memory(memory_of: MemoryOf, mesh: Mesh, per_device_batch: int, capacity_bytes: int, *,
               alternatives: Sequence[tuple[str, MemoryOf]] = (), search: bool = True,
               subject: str | None = None, advice: str = "",
               prefix: str = "pod.mesh: ") -> DeviceMemory:
    """One device's memory on ``mesh`` if it fits ``capacity_bytes`` (at the deepest
    prefetch that fits), else the refusal.

    Args:
        memory_of: the model's program's memory on a mesh (:data:`MemoryOf`).
        mesh: the mesh.
        per_device_batch: examples per device (global batch / (data x fsdp x expert)).
        capacity_bytes: HBM of one device.
        alternatives: (label, memory_of) of other versions of the model to name in a
            refusal when one fits this mesh (``"remat full"``), in the order to try.
        search: look for a mesh of the same devices with more fsdp / tensor sharding
            that fits (False for a model with no other layout, or a pipeline).
        subject: what "needs" in the refusal (default: the mesh, ``{data: 16}``).
        advice: said when nothing that was looked for fits.
        prefix: the refusal's first words, naming the field.

    Returns:
        The ``DeviceMemory`` that fits.

    Raises:
        HBMPlanError: it does not fit (module docstring); it carries the items as
            ``memory_plan`` (:meth:`DeviceMemory.items`).
        ValueError: the program cannot run on ``mesh`` (``memory_of`` gave None).
    """
    memory, fits = fitting_memory(memory_of, mesh.sizes, per_device_batch, capacity_bytes)
    if memory is None:
        raise ValueError(f"the model's program cannot run on {format_axes(mesh.sizes)}")
    if fits:
        return memory
    hints, fits_with = [], ""
    for label, other_of in alternatives:
        other, ok = fitting_memory(other_of, mesh.sizes, per_device_batch, capacity_bytes)
        if ok and other is not None:
            hints.append(f"{label} fits ({format_bytes(other.total_bytes)} per device)")
            fits_with = label
            break
    found, considered = (_search(memory_of, mesh, per_device_batch, capacity_bytes) if search
                         else (None, False))
    if found is not None:
        hints.append(f"{format_axes(found[0])} fits ({format_bytes(found[1])} per device)")
    elif considered and not hints:
        hints.append(f"no mesh of {mesh.size} devices fits; use a smaller model or batch, or "
                     "more devices")
    if advice and not hints:
        hints.append(advice)
    raise refusal(f"{prefix}{subject or format_axes(mesh.sizes)}", memory, capacity_bytes,
                  hints, fits_with=fits_with)


def refusal(subject: str, memory: DeviceMemory, capacity_bytes: int,
            hints: Sequence[str] = (), *, fits_with: str = "") -> HBMPlanError:
    """The one-line error of a plan that does not fit: ``<subject> needs <total> per
    device (<items>) and does not fit <capacity>; <hints>``; ``fits_with`` names the
    version of the model that fits (``HBMPlanError.fits_with``)."""
    return HBMPlanError(
        f"{subject} needs {format_bytes(memory.total_bytes)} per device ({memory.summary()}) "
        f"and does not fit {format_bytes(capacity_bytes)}" + "".join(f"; {h}" for h in hints),
        tag="total", requested_bytes=memory.total_bytes, free_bytes=capacity_bytes,
        capacity_bytes=capacity_bytes, memory_plan=memory.items(), fits_with=fits_with)


def _search(memory_of: MemoryOf, mesh: Mesh, per_device_batch: int, capacity_bytes: int
            ) -> tuple[tuple[dict[str, int], int] | None, bool]:
    """(the mesh of the same devices with more fsdp / tensor sharding that fits, the least
    sharded first (then the least tensor, then the smallest total), and its bytes; None
    when none fits), and whether any other layout could be considered (False for a model
    with no other layout: more sharding is then no advice)."""
    fsdp, tensor, expert = (mesh.axis_size(a) for a in ("fsdp", "tensor", "expert"))
    global_batch = per_device_batch * mesh.batch_shards
    found: tuple[tuple[int, int, int], dict[str, int], int] | None = None
    considered = False
    for axes in all_meshes(mesh.size // expert):  # the expert axis kept as it is
        f, t = axes.get("fsdp", 1), axes.get("tensor", 1)
        shards = axes["data"] * f * expert
        if f < fsdp or t < tensor or f * t == fsdp * tensor or global_batch % shards:
            continue
        if expert > 1:  # in mesh order
            axes = {k: {**axes, "expert": expert}[k] for k in AXIS_NAMES
                    if k in axes or k == "expert"}
        memory, fits = fitting_memory(memory_of, axes, global_batch // shards, capacity_bytes)
        if memory is None:
            continue  # a layout the model cannot take is never suggested
        considered = True
        key = (f * t, t, memory.total_bytes)
        if fits and (found is None or key < found[0]):
            found = (key, axes, memory.total_bytes)
    return (None if found is None else (found[1], found[2])), considered


def split_evenly(memory: DeviceMemory, fsdp: int, tensor: int) -> DeviceMemory:
    """A model's memory on one data device, spread as if every array split evenly over
    ``fsdp`` x ``tensor`` devices (parameters, gradients, optimizer state) and the
    activations and workspace over ``tensor``: the closed form of a mesh the model's own
    program cannot run (``describe`` and timing-only sweeps plan any mesh)."""
    def over(n: int, d: int) -> int:
        return math.ceil(n / d)

    shards = fsdp * tensor
    return DeviceMemory(
        over(memory.parameters_bytes, shards), over(memory.gradients_bytes, shards),
        over(memory.optimizer_state_bytes, shards), over(memory.activations_bytes, tensor),
        over(memory.host_activations_bytes, tensor),
        tuple((name, over(n, tensor)) for name, n in memory.workspace), peak=memory.peak)
