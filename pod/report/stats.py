"""Per-step statistics, the two clocks kept apart.

Simulated figures (``simulated_*``, or parts of the simulated step) come from
the cost models: what the TPU pod would take. Wall figures (``wall_*``) are
what the emulation took on this host (docs/ARCHITECTURE.md, "two clocks").

The one MFU formula (``mfu``) and the one sum of op records
(``RecordTotals``) live here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from chip.calibration import HOST_DISPATCH_SECONDS as _HOST_DISPATCH_SECONDS

__all__ = ["StepStats", "StepTotals", "RecordTotals", "ExpertLoad", "mfu", "maxtext_flops",
           "pipeline_bubble_fraction", "op_bound", "OP_BOUNDS", "HOST_DISPATCH_SECONDS",
           "AXIS_ORDER", "TOTAL_FIELDS", "RUN_FIELDS", "mean_step", "MAXTEXT_FORMULAS"]

#: Which MaxText formula each TFLOP/s-per-device figure uses, said beside the figure
#: (training-steps.md, "The metric"): MaxText's today halves no attention, the 2023
#: one (from 64ee4e938, the v5p table's) halves the causal attention term.
MAXTEXT_FORMULAS = {
    "maxtext_tflops_per_device": "MaxText tpu-recipes-v0.1.4: causal attention not halved",
    "maxtext_2023_tflops_per_device": "MaxText 2023: causal attention halved"}

#: What can bound an op's simulated time: its MXU cycles, its VPU cycles, the
#: scalar unit's issue cycles, or its HBM traffic (the roofline's memory side).
OP_BOUNDS = ("mxu", "vpu", "scalar", "hbm")


def op_bound(record: Any) -> str:
    """What bounds one op record (``chip.OpRecord``): "hbm" when its HBM traffic
    takes longer than its cycles (``bound == "memory"``), else its unit ("mxu",
    "vpu", "scalar")."""
    return "hbm" if record.bound == "memory" else record.unit

#: One host call into the TPU, seconds (``chip.calibration``: [PALLAS] C3). Charged per
#: step only with ``training.host_dispatch: per_step``; training loops run on the device.
HOST_DISPATCH_SECONDS = _HOST_DISPATCH_SECONDS


#: Relative float rounding below which a difference of two sums of seconds is none.
_ROUNDING = 1e-9


def pipeline_bubble_fraction(bubble_seconds: float, compute_seconds: float) -> float:
    """The pipeline bubble's share of the forward and backward passes: bubble /
    (compute + bubble), 0 when both are 0 (the one formula: a step's and a summary's)."""
    total = bubble_seconds + compute_seconds
    return bubble_seconds / total if total > 0 else 0.0


def maxtext_flops(model: Any, per_device_batch: float) -> dict[str, float]:
    """A step's training FLOPs per device as MaxText counts them, for a transformer
    (``pod.workloads.transformer.maxtext_tflops_2025`` / ``maxtext_tflops_2023`` with the
    causal halving; training-steps.md, "The metric"); {} for another model.

    Args:
        model: the plan's model.
        per_device_batch: MaxText's ``per_device_batch_size``: the global batch over
            every device of the mesh (tensor devices count, unlike the plan's
            per-device batch over data x fsdp).

    Returns:
        {"maxtext_flops_per_device": ..., "maxtext_2023_flops_per_device": ...}.
    """
    from pod.workloads.transformer import TransformerModel, maxtext_tflops_2023, maxtext_tflops_2025

    if not isinstance(model, TransformerModel):
        return {}
    cfg = model.config
    return {"maxtext_flops_per_device": maxtext_tflops_2025(cfg, 1) * per_device_batch,
            "maxtext_2023_flops_per_device":
                maxtext_tflops_2023(cfg, 1, causal_halving=True) * per_device_batch}


def mfu(model_flops: float, seconds: float, peak_flops_per_s: float) -> float:
    """Model FLOPs utilisation: model FLOPs / (seconds x peak bf16 FLOP/s), 0..1.

    Model FLOPs count the forward and backward MXU work of the model (no
    recomputation), as the published MFU tables do; 0 when either divisor is 0.
    """
    if seconds <= 0 or peak_flops_per_s <= 0:
        return 0.0
    return model_flops / seconds / peak_flops_per_s


@dataclass(frozen=True)
class RecordTotals:
    """Totals of op records (``chip.OpRecord``) run back to back on one core.

    Attributes:
        seconds: simulated seconds of every op.
        flops: FLOPs of every op; mxu_flops: those of MXU ops.
        hbm_bytes: HBM traffic.
        unit_seconds: simulated seconds per unit ("mxu", "vpu", "scalar").
        bound_seconds: simulated seconds per bound (``op_bound``: "mxu",
            "vpu", "scalar", "hbm").
    """

    seconds: float = 0.0
    flops: int = 0
    mxu_flops: int = 0
    hbm_bytes: int = 0
    unit_seconds: dict[str, float] = field(default_factory=dict)
    bound_seconds: dict[str, float] = field(default_factory=dict)

    @classmethod
    def of(cls, records: Iterable[Any]) -> RecordTotals:
        """Sum a sequence of op records."""
        seconds, flops, mxu_flops, hbm_bytes = 0.0, 0, 0, 0
        units: dict[str, float] = {}
        bounds: dict[str, float] = {}
        for rec in records:
            seconds += rec.seconds
            flops += rec.flops
            hbm_bytes += rec.hbm_bytes
            units[rec.unit] = units.get(rec.unit, 0.0) + rec.seconds
            bound = op_bound(rec)
            bounds[bound] = bounds.get(bound, 0.0) + rec.seconds
            if rec.unit == "mxu":
                mxu_flops += rec.flops
        return cls(seconds, int(flops), int(mxu_flops), int(hbm_bytes), units, bounds)


@dataclass(frozen=True)
class ExpertLoad:
    """The routers' load over the whole pod in one step (a mixture of experts).

    Attributes:
        routed: per MoE layer, per expert: the token choices routed to it (top-k,
            before capacity), summed over every device's tokens.
        kept: per MoE layer, per expert: those within the expert's capacity.
    """

    routed: tuple[tuple[int, ...], ...]
    kept: tuple[tuple[int, ...], ...]

    @classmethod
    def total(cls, per_device: Iterable[Sequence[Any]]) -> ExpertLoad | None:
        """The sum of the devices' ``RouterLoad`` tuples (one per MoE layer each); None
        when no device routed anything (a dense model, or timing-only)."""
        devices = [loads for loads in per_device if loads and loads[0].routed]
        if not devices:
            return None
        routed = tuple(tuple(int(v) for v in np.sum([d[i].routed for d in devices], axis=0))
                       for i in range(len(devices[0])))
        kept = tuple(tuple(int(v) for v in np.sum([d[i].kept for d in devices], axis=0))
                     for i in range(len(devices[0])))
        return cls(routed, kept)

    @property
    def tokens_per_expert(self) -> tuple[int, ...]:
        """Per expert, the token choices routed to it, summed over the MoE layers."""
        return tuple(int(v) for v in np.sum(self.routed, axis=0))

    @property
    def max_over_mean(self) -> float:
        """The most loaded expert's choices over the mean, in the worst layer (1: balanced,
        E / k: every token to the same k experts)."""
        return max((max(r) / (sum(r) / len(r)) if sum(r) else 1.0) for r in self.routed)

    @property
    def dropped_fraction(self) -> float:
        """The share of token choices over capacity, 0..1 (0 dropless)."""
        routed = int(np.sum(self.routed))
        return 1.0 - int(np.sum(self.kept)) / routed if routed else 0.0


@dataclass(frozen=True)
class StepStats:
    """One training step of the pod, on any mesh.

    Simulated step time = dispatch + exposed infeed + the slowest device's
    critical path (``pod.report.clock``): its forward + backward (compute),
    the collectives its compute stream waited for (exposed), its waits for
    other pipeline stages (the pipeline bubble), its update. With
    ``training.overlap`` the collectives run behind the compute as XLA's async
    collectives do and the next batch's infeed behind this step; without it
    both are fully exposed and the step is the plain sum
    (``serial_step_seconds``, an upper bound).

    Attributes:
        step: zero-based step number.
        loss: mean training loss over the global batch.
        global_batch: examples in the step.
        infeed_seconds: simulated host-to-chip transfer of one chip's batch.
        compute_seconds: simulated forward + backward of the slowest device.
        collective_seconds: its collectives' simulated seconds, every mesh axis,
            hidden or not.
        update_seconds: its optimizer update (gradient mean included).
        model_flops: model FLOPs of forward + backward over the whole pod (no
            recomputation; what MFU counts).
        peak_flops_per_s: the pod's peak bf16 FLOP/s (device peak x devices).
        wall_seconds: host wall time of the step.
        hardware_flops: MXU FLOPs the pod executed, recomputation included
            (0: equal to ``model_flops``).
        tokens_per_example: tokens in one example (sequence models; 0 otherwise).
        maxtext_flops_per_device, maxtext_2023_flops_per_device: a step's FLOPs per
            device as MaxText counts them (today's formula; 2023's with the causal
            halving: training-steps.md), for the TFLOP/s per device MaxText prints
            (``maxtext_tflops_per_device``); 0 when MaxText has no formula.
        exposed_collective_seconds: the collectives the compute stream waited for,
            plus what ran past its end (None: all of them).
        exposed_infeed_seconds: the infeed not hidden behind the previous step
            (None: all of it).
        dispatch_seconds: simulated host dispatch of the step (0 in a device loop).
        host_offload_seconds: host-link transfers of offloaded tensors (remat
            ``offload``), all of them; exposed_host_offload_seconds: the part the
            compute waited for (they run beside it).
        hbm_used_bytes: per device, HBM bytes in use after the step.
        hbm_peak_bytes: per device, the HBM high-water mark.
        hbm_capacity_bytes: one device's HBM capacity.
        ici_link_bytes: bytes per directed ICI link "src->dst" in this step.
        ici_link_bandwidth_bytes_per_s: one ICI link's one-way bandwidth.
        device_mxu_flops: per device, MXU FLOPs of the step.
        device_peak_flops_per_s: one device's peak bf16 FLOP/s.
        chip_compute_seconds: per chip, its slowest device's simulated forward +
            backward (a straggler shows here; ``compute_seconds`` is the max).
        axis_collective_bytes: per mesh axis, the bytes of its collectives (the
            slowest device's buffers, in the dtype that moves).
        axis_collective_seconds: per axis, their simulated seconds, all of them.
        axis_exposed_seconds: per axis, the part of the exposed seconds charged
            to it (``pod.report.clock``).
        traced_device, collective_spans, compute_waits: the slowest device, its
            collectives placed in time (``CollectiveSpan``) and its compute
            stream's waits (start, end, axis), for the trace.
        stage_timelines: a pipeline's stages as the slowest device's stage group
            ran them, in stage order: (device, its step seconds, its compute
            stream's waits, as ``compute_waits``); empty without a stage axis.
        compute_bound_seconds: the slowest device's forward + backward seconds by
            what bounds each op (``op_bound``: "mxu", "vpu", "scalar", "hbm").
        update_bound_seconds: the same for its update.
        expert_load: the routers' load (a mixture of experts; None for a dense model
            or a timing-only step).
        test_loss, test_accuracy: the held-out evaluation after this step, where
            the run evaluated (``training.eval_every_steps`` and the last step);
            None elsewhere.
        pipeline_bubble_seconds: what the slowest device's compute stream waited
            for other pipeline stages (``pod.report.clock``; 0 without a stage
            axis).
        axis_dcn_seconds: per mesh axis that spans slices (multislice), the part of
            its ``axis_collective_seconds`` spent across the data-centre network
            (``MeshCollectiveCosts.dcn_seconds``); empty in one slice.
        axis_dcn_bytes: per such axis, the bytes the slowest device sent across the
            DCN (``MeshCollectiveCosts.dcn_bytes``).
    """

    step: int
    loss: float
    global_batch: int
    infeed_seconds: float
    compute_seconds: float
    collective_seconds: float
    update_seconds: float
    model_flops: int
    peak_flops_per_s: float
    wall_seconds: float
    hardware_flops: int = 0
    tokens_per_example: int = 0
    maxtext_flops_per_device: float = 0.0
    maxtext_2023_flops_per_device: float = 0.0
    # None (the default, at run time) is all of it, resolved by __post_init__: a built
    # StepStats holds floats, which is what the type checker is shown (its 0.0 defaults
    # are its own; the constructor's default stays None)
    if TYPE_CHECKING:
        exposed_collective_seconds: float = 0.0
        exposed_infeed_seconds: float = 0.0
    else:
        exposed_collective_seconds: float | None = None
        exposed_infeed_seconds: float | None = None
    dispatch_seconds: float = 0.0
    host_offload_seconds: float = 0.0
    exposed_host_offload_seconds: float = 0.0
    hbm_used_bytes: dict[int, int] = field(default_factory=dict)
    hbm_peak_bytes: dict[int, int] = field(default_factory=dict)
    hbm_capacity_bytes: int = 0
    ici_link_bytes: dict[str, int] = field(default_factory=dict)
    ici_link_bandwidth_bytes_per_s: float = 0.0
    device_mxu_flops: dict[int, int] = field(default_factory=dict)
    device_peak_flops_per_s: float = 0.0
    chip_compute_seconds: dict[int, float] = field(default_factory=dict)
    axis_collective_bytes: dict[str, int] = field(default_factory=dict)
    axis_collective_seconds: dict[str, float] = field(default_factory=dict)
    axis_exposed_seconds: dict[str, float] = field(default_factory=dict)
    traced_device: int = -1
    collective_spans: tuple[Any, ...] = ()
    compute_waits: tuple[tuple[float, float, str], ...] = ()
    stage_timelines: tuple[tuple[int, float, tuple[tuple[float, float, str], ...]], ...] = ()
    compute_bound_seconds: dict[str, float] = field(default_factory=dict)
    update_bound_seconds: dict[str, float] = field(default_factory=dict)
    expert_load: ExpertLoad | None = None
    test_loss: float | None = None
    test_accuracy: float | None = None
    pipeline_bubble_seconds: float = 0.0
    axis_dcn_seconds: dict[str, float] = field(default_factory=dict)
    axis_dcn_bytes: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.hardware_flops:
            object.__setattr__(self, "hardware_flops", self.model_flops)
        if self.exposed_infeed_seconds is None:
            object.__setattr__(self, "exposed_infeed_seconds", self.infeed_seconds)
        if self.exposed_collective_seconds is None:
            object.__setattr__(self, "exposed_collective_seconds", self.collective_seconds)

    @property
    def step_seconds(self) -> float:
        """Simulated step time in seconds: the critical path."""
        return (self.dispatch_seconds + self.exposed_infeed_seconds + self.compute_seconds
                + self.exposed_collective_seconds + self.exposed_host_offload_seconds
                + self.pipeline_bubble_seconds
                + self.update_seconds)

    @property
    def serial_step_seconds(self) -> float:
        """Simulated step time with nothing overlapped (the sum of the parts, an upper bound;
        the pipeline bubble counts whole: nothing hides it)."""
        return (self.dispatch_seconds + self.infeed_seconds + self.compute_seconds
                + self.collective_seconds + self.host_offload_seconds
                + self.pipeline_bubble_seconds + self.update_seconds)

    @property
    def pipeline_bubble_fraction(self) -> float:
        """The bubble's share of the pipelined forward and backward passes: bubble /
        (compute + bubble), 0..1 (GPipe: ``(S - 1) / (M + S - 1)`` with stages of
        equal cost and free transfers, ``pod.programs.pipeline_schedule``)."""
        return pipeline_bubble_fraction(self.pipeline_bubble_seconds, self.compute_seconds)

    @property
    def overlap_fraction(self) -> float:
        """The share of the collectives hidden behind the compute, 0..1: 0 when the hidden
        part is within float rounding of none (the exposed seconds are a sum of the same
        parts in another order: 6e-15 is not a share)."""
        total = self.collective_seconds
        hidden = total - self.exposed_collective_seconds
        if total <= 0 or hidden <= _ROUNDING * total:
            return 0.0
        return min(1.0, hidden / total)

    @property
    def communication_fraction(self) -> float:
        """The share of the simulated step the compute waited for collectives, 0..1."""
        s = self.step_seconds
        return self.exposed_collective_seconds / s if s > 0 else 0.0

    @property
    def examples_per_second(self) -> float:
        """Simulated throughput: global batch / simulated step seconds."""
        return self.global_batch / self.step_seconds if self.step_seconds > 0 else 0.0

    @property
    def tokens_per_second(self) -> float:
        """Simulated tokens/s (sequence models; 0 for others)."""
        return self.examples_per_second * self.tokens_per_example

    @property
    def flops_per_second(self) -> float:
        """Simulated model FLOP/s: model FLOPs / simulated step seconds."""
        return self.model_flops / self.step_seconds if self.step_seconds > 0 else 0.0

    @property
    def tflops(self) -> float:
        """Simulated model TFLOP/s of the pod (``flops_per_second`` / 1e12)."""
        return self.flops_per_second / 1e12

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation = model FLOP/s / pod peak bf16 FLOP/s (0..1)."""
        return mfu(self.model_flops, self.step_seconds, self.peak_flops_per_s)

    @property
    def hfu(self) -> float:
        """Hardware FLOPs utilisation: the MXU FLOPs executed (recomputation included) /
        (simulated seconds x pod peak bf16 FLOP/s), 0..1; MFU without remat."""
        return mfu(self.hardware_flops, self.step_seconds, self.peak_flops_per_s)

    @property
    def emulation_slowdown(self) -> float:
        """Wall seconds per simulated second (0 for a step of no simulated time)."""
        s = self.step_seconds
        return self.wall_seconds / s if s > 0 else 0.0

    @property
    def maxtext_tflops_per_device(self) -> float:
        """TFLOP/s per device as MaxText prints it (today's formula; 0 without one)."""
        s = self.step_seconds
        return self.maxtext_flops_per_device / s / 1e12 if s > 0 else 0.0

    @property
    def maxtext_2023_tflops_per_device(self) -> float:
        """TFLOP/s per device by MaxText's 2023 formula (attention halved)."""
        s = self.step_seconds
        return self.maxtext_2023_flops_per_device / s / 1e12 if s > 0 else 0.0

    def mxu_utilization(self) -> dict[int, float]:
        """Per device: MXU FLOPs / (device peak FLOP/s x simulated step seconds), 0..1."""
        denom = self.device_peak_flops_per_s * self.step_seconds
        return {key: (flops / denom if denom else 0.0)
                for key, flops in self.device_mxu_flops.items()}

    def ici_link_utilization(self) -> dict[str, float]:
        """Per directed link: bytes / (one-way bandwidth x simulated step seconds), 0..1."""
        denom = self.ici_link_bandwidth_bytes_per_s * self.step_seconds
        return {link: (nbytes / denom if denom else 0.0)
                for link, nbytes in self.ici_link_bytes.items()}

    def row(self) -> dict[str, float]:
        """A flat record for steps.csv (scalars only); ``step`` counts from 1, as the
        progress lines do, and the test figures are None where not evaluated. Each
        mesh axis adds its collective and exposed seconds."""
        data = {k: v for k, v in asdict(self).items() if not isinstance(v, (dict, tuple))}
        data.update(
            step=self.step + 1,
            simulated_step_seconds=self.step_seconds,
            serial_step_seconds=self.serial_step_seconds,
            overlap_fraction=self.overlap_fraction,
            hfu=self.hfu,
            simulated_examples_per_second=self.examples_per_second,
            simulated_tokens_per_second=self.tokens_per_second,
            simulated_flops_per_second=self.flops_per_second,
            mfu=self.mfu,
            pipeline_bubble_fraction=self.pipeline_bubble_fraction,
            maxtext_tflops_per_device=self.maxtext_tflops_per_device,
            maxtext_2023_tflops_per_device=self.maxtext_2023_tflops_per_device,
        )
        for axis in AXIS_ORDER:
            data[f"{axis}_collective_seconds"] = self.axis_collective_seconds.get(axis, 0.0)
            data[f"{axis}_exposed_seconds"] = self.axis_exposed_seconds.get(axis, 0.0)
        data["dcn_collective_seconds"] = sum(self.axis_dcn_seconds.values())
        data["dcn_bytes"] = int(sum(self.axis_dcn_bytes.values()))
        data.pop("expert_load", None)
        if self.expert_load is not None:
            data["expert_load_max_over_mean"] = self.expert_load.max_over_mean
            data["expert_dropped_fraction"] = self.expert_load.dropped_fraction
        return data


#: the mesh axes, in the order the files list them (``pod.config.mesh.AXIS_NAMES``)
AXIS_ORDER = ("data", "stage", "fsdp", "expert", "tensor")


#: the StepStats figures a run's summary averages (``StepTotals``).
AXIS_FIELDS = tuple(f"{axis}_{what}" for axis in AXIS_ORDER
                    for what in ("collective_bytes", "collective_seconds", "exposed_seconds",
                                 "dcn_seconds", "dcn_bytes"))
TOTAL_FIELDS = ("step_seconds", "model_flops", "infeed_seconds", "compute_seconds",
                "collective_seconds", "update_seconds", "wall_seconds",
                "serial_step_seconds", "exposed_collective_seconds", "exposed_infeed_seconds",
                "dispatch_seconds", "hardware_flops", "host_offload_seconds",
                "exposed_host_offload_seconds", "pipeline_bubble_seconds", *AXIS_FIELDS)


#: The figures of a step that are its run's (the same at every step: the batch, the pod's
#: peak, ...); ``StepTotals`` keeps the last step's for its mean step.
RUN_FIELDS = ("global_batch", "peak_flops_per_s", "tokens_per_example",
              "maxtext_flops_per_device", "maxtext_2023_flops_per_device",
              "hbm_capacity_bytes", "ici_link_bandwidth_bytes_per_s", "device_peak_flops_per_s")

def _total_value(stats: StepStats, name: str) -> float:
    """A ``TOTAL_FIELDS`` figure of a step: an attribute, or a mesh axis's entry
    ("fsdp_exposed_seconds": ``axis_exposed_seconds["fsdp"]``)."""
    if name in AXIS_FIELDS:
        axis, what = name.split("_", 1)
        figures: dict[str, Mapping[str, float]] = {
            "collective_bytes": stats.axis_collective_bytes,
            "collective_seconds": stats.axis_collective_seconds,
            "exposed_seconds": stats.axis_exposed_seconds,
            "dcn_seconds": stats.axis_dcn_seconds,
            "dcn_bytes": stats.axis_dcn_bytes}
        return float(figures[what].get(axis, 0.0))
    return float(getattr(stats, name))


@dataclass
class StepTotals:
    """Running sums over a run's steps, so a long run keeps O(1) per-step memory.

    The summary's means are over the steps after the first (a real TPU's first
    step compiles); with one step, that step. Plain data in and out
    (``to_dict`` / ``from_dict``), so a checkpoint carries it and a resumed run
    reports what an uninterrupted one would (wall figures aside).

    Attributes:
        steps: steps added.
        first: the first step's figures (``TOTAL_FIELDS``).
        sums: sums of ``TOTAL_FIELDS`` over the steps after the first.
        initial_loss, final_loss: the first and the last step's loss.
        hbm_peak_bytes: maximum HBM high-water mark of any device.
        hbm_capacity_bytes, ici_bytes_per_step: from the last step.
        epoch_steps, epoch_step_seconds, epoch_loss_sum: steps, simulated
            seconds and the sum of training losses in the current epoch
            (``start_epoch`` starts one at each epoch's first step, so a resumed
            or recovered run never merges two epochs).
    """

    steps: int = 0
    first: dict[str, float] = field(default_factory=dict)
    sums: dict[str, float] = field(default_factory=lambda: dict.fromkeys(TOTAL_FIELDS, 0.0))
    initial_loss: float | None = None
    final_loss: float | None = None
    hbm_peak_bytes: int = 0
    hbm_capacity_bytes: int = 0
    ici_bytes_per_step: int = 0
    epoch_steps: int = 0
    epoch_step_seconds: float = 0.0
    epoch_loss_sum: float = 0.0
    expert_steps: int = 0
    expert_routed: list[int] = field(default_factory=list)
    expert_kept: list[int] = field(default_factory=list)
    expert_max_over_mean_sum: float = 0.0
    run: dict[str, float] = field(default_factory=dict)

    @classmethod
    def of(cls, steps: Iterable[StepStats]) -> StepTotals:
        """The totals of these steps, in order."""
        totals = cls()
        for stats in steps:
            totals.add(stats)
        return totals

    def add(self, stats: StepStats) -> None:
        """Account one step."""
        self.run = {k: float(getattr(stats, k)) for k in RUN_FIELDS}
        values = {k: _total_value(stats, k) for k in TOTAL_FIELDS}
        if self.steps == 0:
            self.first, self.initial_loss = values, stats.loss
        else:
            for k, v in values.items():
                self.sums[k] += v
        self.steps += 1
        self.final_loss = stats.loss
        self.hbm_peak_bytes = max([self.hbm_peak_bytes, *stats.hbm_peak_bytes.values()])
        self.hbm_capacity_bytes = stats.hbm_capacity_bytes
        self.ici_bytes_per_step = int(sum(stats.ici_link_bytes.values()))
        self.epoch_steps += 1
        self.epoch_step_seconds += stats.step_seconds
        self.epoch_loss_sum += stats.loss
        load = stats.expert_load
        if load is not None:  # every step's: a router's load is no compilation artefact
            kept = np.sum(load.kept, axis=0)
            if not self.expert_routed:
                self.expert_routed, self.expert_kept = [0] * len(kept), [0] * len(kept)
            self.expert_steps += 1
            self.expert_routed = [a + int(b) for a, b in zip(self.expert_routed,
                                                             load.tokens_per_expert, strict=True)]
            self.expert_kept = [a + int(b) for a, b in zip(self.expert_kept, kept, strict=True)]
            self.expert_max_over_mean_sum += load.max_over_mean

    def mean(self, name: str) -> float:
        """Mean of a ``TOTAL_FIELDS`` figure over the steps after the first (or the first)."""
        if self.steps == 0:
            raise ValueError("no steps yet")
        return self.sums[name] / (self.steps - 1) if self.steps > 1 else self.first[name]

    def mean_stats(self) -> StepStats:
        """The mean step: a ``StepStats`` whose parts are the means of ``mean`` (the steps
        after the first) and whose run figures (batch, peak, ...) are the last step's, so
        every derived figure of a run (MFU, HFU, tokens/s, overlap, ...) is its
        properties', as a step's are. ``step`` is the last step's, ``loss`` the final
        loss; the per-step detail (devices, links, spans) is left empty.

        Raises:
            ValueError: no step yet.
        """
        mean = self.mean
        axes = [a for a in AXIS_ORDER
                if any(mean(f"{a}_{what}") for what in ("collective_bytes", "collective_seconds",
                                                        "exposed_seconds", "dcn_seconds"))]

        def per_axis(what: str) -> dict[str, float]:
            return {a: mean(f"{a}_{what}") for a in axes}

        run = self.run
        return StepStats(
            step=self.steps - 1, loss=float(self.final_loss or 0.0),
            global_batch=int(run.get("global_batch", 0)),
            infeed_seconds=mean("infeed_seconds"), compute_seconds=mean("compute_seconds"),
            collective_seconds=mean("collective_seconds"), update_seconds=mean("update_seconds"),
            model_flops=int(round(mean("model_flops"))),
            hardware_flops=int(round(mean("hardware_flops"))),
            peak_flops_per_s=run.get("peak_flops_per_s", 0.0),
            wall_seconds=mean("wall_seconds"),
            tokens_per_example=int(run.get("tokens_per_example", 0)),
            maxtext_flops_per_device=run.get("maxtext_flops_per_device", 0.0),
            maxtext_2023_flops_per_device=run.get("maxtext_2023_flops_per_device", 0.0),
            exposed_collective_seconds=mean("exposed_collective_seconds"),
            exposed_infeed_seconds=mean("exposed_infeed_seconds"),
            dispatch_seconds=mean("dispatch_seconds"),
            host_offload_seconds=mean("host_offload_seconds"),
            exposed_host_offload_seconds=mean("exposed_host_offload_seconds"),
            pipeline_bubble_seconds=mean("pipeline_bubble_seconds"),
            hbm_capacity_bytes=int(run.get("hbm_capacity_bytes", 0)),
            ici_link_bandwidth_bytes_per_s=run.get("ici_link_bandwidth_bytes_per_s", 0.0),
            device_peak_flops_per_s=run.get("device_peak_flops_per_s", 0.0),
            axis_collective_bytes={a: int(round(v)) for a, v in
                                   per_axis("collective_bytes").items()},
            axis_collective_seconds=per_axis("collective_seconds"),
            axis_exposed_seconds=per_axis("exposed_seconds"),
            axis_dcn_seconds={a: v for a, v in per_axis("dcn_seconds").items() if v},
            axis_dcn_bytes={a: int(round(v)) for a, v in per_axis("dcn_bytes").items() if v})

    def start_epoch(self) -> None:
        """Start a new epoch's sums (called before an epoch's first step)."""
        self.epoch_steps, self.epoch_step_seconds, self.epoch_loss_sum = 0, 0.0, 0.0

    @property
    def epoch_step_seconds_mean(self) -> float:
        """Mean simulated step seconds of the current epoch's steps so far."""
        return self.epoch_step_seconds / max(1, self.epoch_steps)

    @property
    def epoch_loss(self) -> float:
        """Mean training loss of the current epoch's steps so far (Keras' epoch loss)."""
        return self.epoch_loss_sum / max(1, self.epoch_steps)

    def to_dict(self) -> dict:
        """Plain data (for a checkpoint)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict | None) -> StepTotals:
        """The inverse of ``to_dict``; None or {} gives empty totals. Figures that a
        checkpoint of an earlier version lacks start at 0."""
        if not data:
            return cls()
        data = dict(data)
        for key in ("first", "sums"):
            if isinstance(data.get(key), dict):
                data[key] = {k: float(data[key].get(k, 0.0)) for k in TOTAL_FIELDS}
        return cls(**data)


def mean_step(steps: Sequence[StepStats]) -> StepStats:
    """The mean of a run's steps (``StepTotals.mean_stats``: over the steps after the
    first, the first alone when it is the only one), as one ``StepStats``.

    Raises:
        ValueError: no step.
    """
    return StepTotals.of(steps).mean_stats()
