"""An HLO module's step on the emulated pod: its ops costed, its collectives costed on
their device groups, both placed on the project's clock.

:func:`cost_module` turns a parsed module into the same two things a device
program leaves (``pod.report.clock``): op records (``chip.OpRecord``, the
compute stream) and collective calls (``pod.programs.CollectiveCall``). The
clock is HLO-native: each async start / done pair is one call of kind
``activation`` whose ``overlap_after`` is the records between its start and its
done, so the collective runs beside them and the compute stream waits for it
at its done, as the TPU runs it; a synchronous collective blocks where it is
(``overlap_after`` 0); a collective permute is a ``ppermute`` call waited for
at its done (``wait_record``). The clock's ICI streams are per *lane*: one per
set of device groups (a mesh axis, or a combination of axes), named by the
mesh's axes where the capture knows the mesh; collectives on one lane queue,
lanes run at once. The TPU's async copies (HBM, VMEM, host memory) are calls
on a DMA lane of their own, whose bandwidth the copies in flight share
(``pod.report.clock.SharedLane``). A SparseCore offload (libtpu 0.0.50's gathers) is a
call on the lane "SparseCore", its window from the ``call-update`` that gives it its
operands to ``call-done``: XLA's ``estimated_cycles`` for it at the TensorCore clock
where it gave them ("sparsecore (XLA estimate)"), else the HBM bytes its gathers,
scatters and dynamic slices move at the chip's achieved HBM bandwidth ("sparsecore (HBM
bytes)": a bound from bytes, since no SparseCore rate is published; its HBM traffic does
not slow the TensorCore's here). A CPU-compiled module (approximate) takes the
project's own overlap rules instead: a weights' all-gather is a ``param_gather``
(prefetched one gather ahead), a reduction no matmul reads is a ``grad_reduce``
(only the end of the step waits for it), the rest as their windows
(``pod.hlo.program``).

Where the clock does not fit the HLO: there is no optimizer boundary in a
module (its update is part of the compute stream: ``update_seconds`` is 0), no
infeed (the batch is an argument), and one device stands for all (SPMD: every
device runs the same program; a module whose devices run different code, as
MPMD pipelines do, is costed as device 0's).

Pure: no jax, no ray.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pod.config.mesh import devices_per_chip
from pod.config.sharding import device_chip_spec
from pod.config.slices import Topology
from pod.errors import HloError
from pod.hlo.groups import CollectiveCost, CollectiveModel, Groups
from pod.hlo.module import HOST_SPACE, HloInstruction, HloModule
from pod.hlo.ops import OpCost, OpCoster
from pod.hlo.program import CollectiveInfo, DoneEvent, OpEvent, StartEvent, flatten
from pod.programs.collectives import CollectiveCall
from pod.report.clock import (
    DeviceReport,
    StepClock,
    compute_bound_seconds,
    sustained_clocks,
    sustained_mxu_fraction,
)
from pod.report.stats import StepStats, op_bound

__all__ = ["OpRow", "CollectiveRow", "HloMemory", "HloStep", "cost_module", "lane_name",
           "DMA_HBM", "DMA_HOST", "SPARSECORE"]

#: The clock's lanes of the TPU's async copies: between HBM and VMEM, and to or from host
#: memory (memory space 5, XLA's host offload).
DMA_HBM, DMA_HOST = "DMA HBM<->VMEM", "DMA host"
#: The clock's lane of SparseCore offloads (one at a time: each uses every SparseCore).
SPARSECORE = "SparseCore"


@dataclass(frozen=True)
class OpRow:
    """One HLO instruction's kernels over the step (every loop iteration).

    Attributes:
        name: the instruction, e.g. "fusion.12".
        op_name: the JAX op name XLA kept (``metadata.op_name``).
        source: where the user wrote it: "file:line (function)" of the innermost frame
            that is the user's own code (``HloModule.source_of``), "" when unknown.
        call_chain: the functions that led to it, outermost to innermost, joined by
            " > " (``HloModule.call_chain_of``), "" when the module has no stack frames.
        opcode: the HLO opcode.
        how: how it was costed (``OpCost.how``).
        count: times it ran in the step.
        seconds: simulated seconds it added to the compute stream, all runs.
        flops: MXU FLOPs, all runs.
        hbm_bytes: HBM bytes, all runs.
        bound: what bounds it (``op_bound``: mxu, vpu, scalar, hbm).
        xla_seconds: XLA's own estimate, all runs (None: the module has none).
    """

    name: str
    op_name: str
    source: str
    call_chain: str
    opcode: str
    how: str
    count: int
    seconds: float
    flops: float
    hbm_bytes: int
    bound: str
    xla_seconds: float | None


@dataclass(frozen=True)
class CollectiveRow:
    """One HLO collective (or async copy) over the step.

    Attributes:
        name: the instruction that starts it.
        op_name: its JAX op name.
        op: all_gather, reduce_scatter, allreduce, all_to_all, ppermute or dma.
        lane: the clock's lane (its device groups: mesh axes where known).
        form: async, sync, async collective fusion, window (approximate), dma.
        algorithm: how the ICI model ran it (``CollectiveCost.algorithm``).
        groups: "G groups of N" (or "P pairs").
        nbytes: each device's buffer, bytes.
        count: times it ran in the step.
        seconds: simulated seconds, all runs (hidden or not).
        dcn_seconds: the part across slices, all runs.
    """

    name: str
    op_name: str
    op: str
    lane: str
    form: str
    algorithm: str
    groups: str
    nbytes: int
    count: int
    seconds: float
    dcn_seconds: float


@dataclass(frozen=True)
class HloMemory:
    """HBM per device: XLA's buffer assignment where a TPU compile ran, and this
    module's own estimate (``pod.hlo.memory``).

    Attributes:
        capacity_bytes: one device's HBM.
        xla: XLA's ``memory_analysis()`` figures (argument, output, alias, temp,
            generated code, peak bytes; ``peak_bytes``: its peak, else argument + output
            - alias + temp: ``_xla_figures``), or None.
        xla_platform: "tpu" or "cpu" (whose buffer assignment ``xla`` is).
        estimate_bytes: the peak of the live buffers over the schedule
            (``pod.hlo.memory.peak_bytes``).
    """

    capacity_bytes: int
    xla: dict[str, int] | None = None
    xla_platform: str = ""
    estimate_bytes: int = 0

    @property
    def peak_bytes(self) -> int:
        """The figure the fit is judged by: XLA's TPU buffer assignment when there is
        one, else the estimate."""
        if self.xla is not None and self.xla_platform == "tpu":
            return int(self.xla["peak_bytes"])
        return int(self.estimate_bytes)

    @property
    def fits(self) -> bool:
        """The step fits one device's HBM."""
        return self.peak_bytes <= self.capacity_bytes

    def verdict(self) -> str:
        """One line: the peak, whose figure, and whether it fits."""
        xla = self.xla if self.xla is not None and self.xla_platform == "tpu" else None
        whose = ("estimated from the schedule" if xla is None else
                 "XLA's arguments and temporaries, an upper bound: its peak counts the host "
                 "memory of offloaded activations" if xla.get("peak_counts_host") else
                 "XLA's buffer assignment")
        gib = self.peak_bytes / 2**30
        cap = self.capacity_bytes / 2**30
        if self.fits:
            return f"{gib:.2f} GiB of {cap:.2f} GiB HBM per device ({whose}): fits"
        return (f"does not fit: {gib:.2f} GiB per device ({whose}) exceeds the {cap:.2f} GiB of "
                "HBM")


@dataclass(frozen=True)
class HloStep:
    """A module's step on the pod (module docstring).

    Attributes:
        stats: the step's figures (``StepStats``: lanes in place of mesh axes).
        clock: the device's clock (spans, waits, per-lane figures).
        ops: per instruction, its kernels over the step (most seconds first).
        collectives: per collective instruction (most seconds first).
        lanes: the clock's lanes, in order of first use.
        trace_rows: every record in order (name, unit, seconds, flops, hbm_bytes,
            bound), for the trace.
        topology: the pod.
        devices: devices the module runs on.
        flops_per_device: the module's MXU FLOPs per device per step (loops counted).
        approximate: costed from a CPU-compiled module.
        memory: HBM per device.
        notes: what was assumed.
        trip_counts: while loop -> trip count.
        module_name: the HLO module's name.
    """

    stats: StepStats
    clock: StepClock
    ops: tuple[OpRow, ...]
    collectives: tuple[CollectiveRow, ...]
    lanes: tuple[str, ...]
    trace_rows: tuple[tuple[Any, ...], ...]
    topology: Topology
    devices: int
    flops_per_device: float
    approximate: bool
    memory: HloMemory
    notes: tuple[str, ...] = ()
    trip_counts: dict[str, int] = field(default_factory=dict)
    module_name: str = ""

    @property
    def step_seconds(self) -> float:
        """Simulated seconds of the step (the critical path)."""
        return self.stats.step_seconds

    @property
    def mfu(self) -> float:
        """The HLO's MXU FLOPs over the step time and the pod's peak (recomputation
        included: what the module really does)."""
        return self.stats.mfu


def lane_name(groups: Groups, mesh_axes: Mapping[str, int] | None, op: str = "") -> str:
    """The clock lane of a collective: the mesh axes its groups span ("fsdp",
    "fsdp+tensor") when the mesh is known, else "N groups of M".

    Args:
        groups: device ids (a permute: its pairs).
        mesh_axes: the mesh's axis sizes, major to minor, over the devices in the
            order the module numbers them; None: unknown.
        op: the op (a permute is named after the axes its pairs move along).
    """
    if op == "ppermute":
        flat = [d for pair in groups for d in pair]
        base = f"permute ({len(groups)} pairs)"
    else:
        flat = [d for g in groups for d in g]
        base = f"{len(groups)} groups of {len(groups[0]) if groups else 0}"
    if not mesh_axes or not flat or max(flat) >= math.prod(mesh_axes.values()):
        return base
    names, sizes = list(mesh_axes), tuple(mesh_axes.values())
    coords = np.array(np.unravel_index(np.asarray(flat), sizes)).T
    varying: set[str] = set()
    start = 0
    for member in groups:
        block = coords[start:start + len(member)]
        start += len(member)
        varying |= {names[a] for a in range(len(names)) if len(set(block[:, a])) > 1}
    axes = "+".join(n for n in names if n in varying) or "none"
    if op != "ppermute":
        whole = math.prod(sizes[names.index(n)] for n in varying)
        size = len(groups[0]) if groups else 0
        return axes if size in (whole, 0) else f"{axes} ({size} of {whole})"
    shifts = {int((b - a) % sizes[names.index(axes)]) for a, b in
              zip(coords[0::2, names.index(axes)], coords[1::2, names.index(axes)], strict=True)
              } if axes in names else set()
    if len(shifts) == 1:  # a shift along one axis: its direction names it
        shift = shifts.pop()
        n = sizes[names.index(axes)]
        return f"permute {axes} {'+' if shift <= n // 2 else '-'}{min(shift, n - shift)}"
    return f"permute {axes}"


def _describe(groups: Groups, op: str) -> str:
    if op == "ppermute":
        return f"{len(groups)} pairs"
    return f"{len(groups)} groups of {len(groups[0]) if groups else 0}"


class _Builder:
    """Turns a program's events into records and calls, and keeps the rows."""

    def __init__(self, module: HloModule, topology: Topology, coster: OpCoster,
                 model: CollectiveModel, mesh_axes: Mapping[str, int] | None) -> None:
        self.module, self.topology, self.coster, self.model = module, topology, coster, model
        self.mesh_axes = mesh_axes
        self.records: list[Any] = []
        self.calls: list[CollectiveCall] = []
        self.costs: dict[tuple[str, str, int], float] = {}
        self.lanes: list[str] = []
        self.lane_of: dict[tuple, str] = {}
        self.op_runs: Counter = Counter()
        self.op_cost: dict[int, tuple[Any, Any, OpCost]] = {}
        self.coll_runs: Counter = Counter()
        self.coll: dict[int, tuple[CollectiveInfo, str, CollectiveCost]] = {}
        self.link_bytes: Counter = Counter()
        self.open: dict[int, int] = {}
        core = device_chip_spec(topology.chip).core
        self.hbm_bytes_per_s = core.achieved_hbm_bandwidth_bytes_per_s
        self.clock_hz = core.clock_hz
        self.host_bytes_per_s = topology.chip.host_to_chip_bytes_per_s

    def lane(self, info: CollectiveInfo) -> str:
        if info.op == "dma":
            return DMA_HOST if HOST_SPACE in info.memory_spaces else DMA_HBM
        if info.op == "sparsecore":
            return SPARSECORE
        key = (info.op == "ppermute", frozenset(frozenset(g) for g in info.groups)
               if info.op != "ppermute" else info.groups)  # one lane per set of groups
        hit = self.lane_of.get(key)
        if hit is None:
            name = lane_name(info.groups, self.mesh_axes, info.op)
            taken = set(self.lane_of.values())
            hit, n = name, 2
            while hit in taken:
                hit, n = f"{name} #{n}", n + 1
            self.lane_of[key] = hit
        return hit

    def collective_cost(self, info: CollectiveInfo) -> CollectiveCost:
        if info.op == "dma":
            bw = self.host_bytes_per_s if HOST_SPACE in info.memory_spaces \
                else self.hbm_bytes_per_s
            return CollectiveCost(info.nbytes / bw, algorithm="DMA")
        if info.op == "sparsecore":
            if info.xla_cycles is not None:
                return CollectiveCost(info.xla_cycles / self.clock_hz,
                                      algorithm="sparsecore (XLA estimate)")
            return CollectiveCost(info.nbytes / self.hbm_bytes_per_s,
                                  algorithm="sparsecore (HBM bytes)")
        return self.model.cost(info.op, info.groups, info.nbytes, info.itemsize)

    def op(self, event: OpEvent) -> None:
        cost = self.coster.cost(event.comp, event.instr)
        key = id(event.instr)
        self.op_cost.setdefault(key, (event.comp, event.instr, cost))
        self.op_runs[key] += 1
        self.records.extend(cost.records)

    def start(self, event: StartEvent) -> None:
        info = event.info
        if info.op not in ("dma", "sparsecore") and (
                all(len(set(g)) <= 1 for g in info.groups) or not info.groups):
            return  # every device alone (or sending to itself): nothing moves
        lane = self.lane(info)
        if lane not in self.lanes:
            self.lanes.append(lane)
        key = id(info.instr)
        hit = self.coll.get(key)
        if hit is None or hit[0].nbytes != info.nbytes:
            hit = (info, lane, self.collective_cost(info))
            self.coll[key] = hit
        cost = hit[2]
        self.coll_runs[key] += 1
        self.link_bytes.update(cost.link_bytes)
        self.costs.setdefault((lane, info.op, info.nbytes), cost.seconds)
        self.open[event.key] = len(self.calls)
        self.calls.append(CollectiveCall(lane, info.op, info.nbytes, _tag(info),
                                         info.role or "activation", len(self.records)))

    def done(self, event: DoneEvent) -> None:
        index = self.open.pop(event.key, None)
        if index is None:
            return
        call = self.calls[index]
        waited = len(self.records) - call.after_record
        if call.kind == "grad_reduce":
            return  # only the step's end waits for a gradient reduction
        if call.op == "ppermute":
            self.calls[index] = _replace(call, wait_record=len(self.records))
        else:
            self.calls[index] = _replace(call, overlap_after=waited)


def _replace(call: CollectiveCall, **changes: Any) -> CollectiveCall:
    import dataclasses

    return dataclasses.replace(call, **changes)


def _tag(info: CollectiveInfo) -> str:
    op = info.instr.op_name or (info.source.op_name if info.source is not None else "")
    tail = "/".join(op.split("/")[-2:]) if op else ""
    return f"{info.instr.name}" + (f" ({tail})" if tail else "")


def cost_module(module: HloModule, topology: Topology, *, devices: Sequence[int] = (),
                mesh_axes: Mapping[str, int] | None = None, approximate: bool = False,
                sustained: bool = True, xla_memory: Mapping[str, int] | None = None,
                xla_platform: str = "") -> HloStep:
    """A module's step on ``topology`` (module docstring).

    Args:
        module: the parsed module (``pod.hlo.parse_hlo``).
        topology: the pod (``pod.config.slices.resolve_pod``); its devices must be the
            module's (a module of one device runs on any pod).
        devices: the module's device id -> physical device (``Placement.devices``);
            empty: row-major torus order.
        mesh_axes: the mesh's axis sizes over the module's device ids (lane names).
        approximate: a CPU-compiled module (``pod.hlo.ops``, ``pod.hlo.program``).
        sustained: MXU at its sustained efficiency (a training step); False: from an
            idle start (a benchmarked single op).
        xla_memory: XLA's ``memory_analysis()`` figures, if a compile ran.
        xla_platform: "tpu" or "cpu": whose buffer assignment ``xla_memory`` is.

    Returns:
        The :class:`HloStep`.

    Raises:
        HloError: the module's devices are not the pod's; an op or loop that
            cannot be costed.
    """
    from pod.hlo.memory import peak_bytes

    pod_devices = topology.chips * devices_per_chip(topology.chip)
    if module.devices not in (1, pod_devices):
        raise HloError(f"the module runs on {module.devices} devices but {topology.name} has "
                       f"{pod_devices}; compile it for this slice, or give the slice it was "
                       "compiled for (--slice)")
    chip = device_chip_spec(topology.chip)
    coster = OpCoster(module, chip.core, sustained=sustained, approximate=approximate)
    model = CollectiveModel.of(topology.chip, topology.torus, topology.slices, devices)
    program = flatten(module, approximate=approximate)
    builder = _Builder(module, topology, coster, model, mesh_axes)
    for event in program.events:
        if isinstance(event, OpEvent):
            builder.op(event)
        elif isinstance(event, StartEvent):
            builder.start(event)
        else:
            builder.done(event)
    records, calls = builder.records, builder.calls
    # windowed: the built-in path's collective matmul; in XLA's HLO a windowed einsum is
    # already its collective-permutes, each costed as written
    # a training step is held to the chip's sustained MXU budget, as the built-in path's
    # (pod.report.clock.sustained_clocks); a benchmarked op from an idle start is not
    flops = float(sum(r.flops for r in records if r.unit == "mxu"))
    report = DeviceReport(device=0, loss=0.0,
                          record_seconds=tuple(float(r.seconds) for r in records),
                          record_bounds=tuple(op_bound(r) for r in records), update_start=None,
                          calls=tuple(calls), mxu_flops=int(flops))
    (clock,), (report,) = sustained_clocks(
        [report], lambda a, o, n, windowed=False: builder.costs[(a, o, n)],
        sustained_mxu_fraction(chip.core) if sustained else 1.0)
    memory = HloMemory(int(chip.core.hbm_bytes),
                       None if xla_memory is None else _xla_figures(xla_memory), xla_platform,
                       peak_bytes(module))
    stats = _stats(clock, report, flops, module.devices, topology, memory,
                   dict(builder.link_bytes))
    return HloStep(
        stats=stats, clock=clock, ops=_op_rows(builder), collectives=_collective_rows(builder),
        lanes=tuple(builder.lanes),
        trace_rows=tuple((r.name, r.unit, r.seconds, r.flops, r.hbm_bytes, op_bound(r))
                         for r in records),
        topology=topology, devices=module.devices, flops_per_device=flops,
        approximate=approximate, memory=memory, notes=tuple(program.notes),
        trip_counts=dict(program.trip_counts), module_name=module.name)


#: How close XLA's peak may come to its arguments plus its host-memory temporaries for the
#: peak to be read as theirs (:func:`peak_counts_host`), bytes.
HOST_PEAK_SLACK_BYTES = 2**20


def peak_counts_host(peak_bytes: int | None, argument_bytes: int, host_temp_bytes: int) -> bool:
    """Whether XLA's ``peak_memory_in_bytes`` is its arguments plus its host-memory
    temporaries (activations offloaded to the host), within ``HOST_PEAK_SLACK_BYTES``: a
    peak that says nothing of HBM. The oracle's T6 (Llama 3.1 70B on v6e-64, layer input
    and q / k / v offloaded): 12.34 GiB of arguments + 45.00 GiB of host memory, to 36 KB,
    where the chip has 31.25 GiB and XLA compiled the step.

    Args:
        peak_bytes: XLA's peak (None or 0: none given).
        argument_bytes: its argument bytes on the device.
        host_temp_bytes: its temporaries in host memory.
    """
    return bool(peak_bytes and host_temp_bytes and abs(
        int(peak_bytes) - int(argument_bytes) - int(host_temp_bytes)) <= HOST_PEAK_SLACK_BYTES)


def _xla_figures(raw: Mapping[str, int]) -> dict[str, int]:
    """XLA's figures with ``peak_bytes``: its ``peak_memory_in_bytes`` where it gives one
    of HBM, else argument + output - alias + temp (the device's buffers all at once: an
    upper bound of its peak).

    With activations offloaded to host memory, jaxlib's peak can be the arguments plus
    the host temporaries (:func:`peak_counts_host`), which says nothing of HBM: then the
    upper bound, and ``peak_counts_host`` = 1."""
    out = {k: int(v) for k, v in raw.items()}
    bound = (out.get("argument_size_in_bytes", 0) + out.get("output_size_in_bytes", 0)
             - out.get("alias_size_in_bytes", 0) + out.get("temp_size_in_bytes", 0))
    peak = out.get("peak_memory_in_bytes")
    if peak_counts_host(peak, out.get("argument_size_in_bytes", 0),
                        out.get("host_temp_size_in_bytes", 0)):
        out["peak_counts_host"], peak = 1, None
    out["peak_bytes"] = peak or bound
    return out


def _stats(clock: StepClock, report: DeviceReport, flops: float, devices: int,
           topology: Topology, memory: HloMemory, link_bytes: dict) -> StepStats:
    chip = device_chip_spec(topology.chip)
    bounds = compute_bound_seconds(report, clock, len(report.record_seconds))
    peak = chip.peak_bf16_flops_per_s
    return StepStats(
        step=0, loss=0.0, global_batch=0, infeed_seconds=0.0,
        compute_seconds=clock.compute_seconds, collective_seconds=clock.collective_seconds,
        update_seconds=clock.update_seconds, model_flops=int(flops * devices),
        peak_flops_per_s=peak * devices, wall_seconds=0.0,
        exposed_collective_seconds=clock.exposed_seconds, exposed_infeed_seconds=0.0,
        hbm_used_bytes={0: memory.peak_bytes}, hbm_peak_bytes={0: memory.peak_bytes},
        hbm_capacity_bytes=memory.capacity_bytes,
        ici_link_bytes={f"{a}->{b}": int(v) for (a, b), v in sorted(link_bytes.items())},
        ici_link_bandwidth_bytes_per_s=topology.chip.ici_link_bandwidth_bytes_per_s,
        device_mxu_flops={0: int(flops)}, device_peak_flops_per_s=peak,
        chip_compute_seconds={0: clock.compute_seconds},
        axis_collective_bytes=dict(clock.axis_bytes),
        axis_collective_seconds=dict(clock.axis_seconds),
        axis_exposed_seconds=dict(clock.axis_exposed_seconds), traced_device=0,
        collective_spans=clock.spans, compute_waits=clock.waits,
        compute_bound_seconds=bounds)


def _named(module: HloModule, instr: HloInstruction) -> HloInstruction:
    """``instr``, or for a fusion XLA left without an op name the instruction inside it
    that has one (its root first): what layers.csv names it by."""
    if instr.op_name or not instr.called:
        return instr
    comp = module.computations[instr.called[0]]
    for inner in (comp.root, *reversed(comp.instructions)):
        found = _named(module, inner)
        if found.op_name:
            return found
    return instr


def _op_rows(builder: _Builder) -> tuple[OpRow, ...]:
    rows = []
    for key, (comp, instr, cost) in builder.op_cost.items():
        n = builder.op_runs[key]
        if not cost.records:
            continue
        main = cost.records[0]
        named = _named(builder.module, instr)
        rows.append(OpRow(
            name=instr.name, op_name=named.op_name, source=builder.module.source_of(named),
            call_chain=builder.module.call_chain_of(named),
            opcode=instr.opcode, how=cost.how, count=n, seconds=n * cost.seconds,
            flops=n * cost.flops, hbm_bytes=n * sum(r.hbm_bytes for r in cost.records),
            bound=op_bound(main),
            xla_seconds=None if cost.xla_seconds is None else n * cost.xla_seconds))
        del comp
    return tuple(sorted(rows, key=lambda r: -r.seconds))


def _collective_rows(builder: _Builder) -> tuple[CollectiveRow, ...]:
    rows = []
    for key, (info, lane, cost) in builder.coll.items():
        n = builder.coll_runs[key]
        op_name = info.instr.op_name or (info.source.op_name if info.source is not None else "")
        rows.append(CollectiveRow(
            name=info.instr.name, op_name=op_name, op=info.op, lane=lane, form=info.form,
            algorithm=cost.algorithm, groups=_describe(info.groups, info.op) if info.groups
            else "", nbytes=info.nbytes, count=n, seconds=n * cost.seconds,
            dcn_seconds=n * cost.dcn_seconds))
    return tuple(sorted(rows, key=lambda r: -r.seconds))
