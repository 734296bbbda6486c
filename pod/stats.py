"""Per-step statistics, the two clocks kept apart.

Simulated figures (``simulated_*``, or parts of the simulated step) come from
the cost models: what the TPU pod would take. Wall figures (``wall_*``) are
what the emulation took on this host. See ../shared/DESIGN.md, "two clocks".
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

__all__ = ["StepStats"]


@dataclass(frozen=True)
class StepStats:
    """One training step of the pod.

    Simulated step time = infeed + compute + allreduce + update, where
    compute is the slowest TensorCore's forward + backward (every step waits
    for the slowest chip), allreduce = on-chip core reduce + ICI schedule
    time, update = the optimizer on the slowest core.

    Attributes:
        step: zero-based step number.
        loss: mean training loss over the global batch.
        global_batch: examples in the step.
        infeed_seconds: simulated host-to-chip transfer of one chip's batch.
        compute_seconds: simulated forward + backward, slowest core.
        local_reduce_seconds: simulated on-chip reduce of the cores' gradients.
        ici_seconds: simulated ICI allreduce of the chip gradients.
        update_seconds: simulated optimizer update, slowest core.
        model_flops: MXU FLOPs of forward + backward over the whole pod.
        peak_flops_per_s: the pod's peak bf16 FLOP/s.
        wall_seconds: host wall time of the step.
        hbm_used_bytes: per (chip, core) HBM bytes in use after the step.
        hbm_peak_bytes: per (chip, core) HBM high-water mark.
        hbm_capacity_bytes: per core HBM capacity.
        ici_link_bytes: bytes per directed ICI link "src->dst" in this step.
        core_mxu_flops: per (chip, core) MXU FLOPs of forward + backward.
        core_peak_flops_per_s: one TensorCore's peak bf16 FLOP/s.
        ici_link_bandwidth_bytes_per_s: one ICI link's one-way bandwidth.
    """

    step: int
    loss: float
    global_batch: int
    infeed_seconds: float
    compute_seconds: float
    local_reduce_seconds: float
    ici_seconds: float
    update_seconds: float
    model_flops: int
    peak_flops_per_s: float
    wall_seconds: float
    hbm_used_bytes: dict[tuple[int, int], int] = field(default_factory=dict)
    hbm_peak_bytes: dict[tuple[int, int], int] = field(default_factory=dict)
    hbm_capacity_bytes: int = 0
    ici_link_bytes: dict[str, int] = field(default_factory=dict)
    core_mxu_flops: dict[tuple[int, int], int] = field(default_factory=dict)
    core_peak_flops_per_s: float = 0.0
    ici_link_bandwidth_bytes_per_s: float = 0.0

    @property
    def allreduce_seconds(self) -> float:
        """Simulated gradient allreduce: on-chip reduce plus ICI."""
        return self.local_reduce_seconds + self.ici_seconds

    @property
    def step_seconds(self) -> float:
        """Simulated step time in seconds."""
        return self.infeed_seconds + self.compute_seconds + self.allreduce_seconds + self.update_seconds

    @property
    def examples_per_second(self) -> float:
        """Simulated throughput: global batch / simulated step seconds."""
        return self.global_batch / self.step_seconds if self.step_seconds > 0 else 0.0

    @property
    def flops_per_second(self) -> float:
        """Simulated model FLOP/s: model FLOPs / simulated step seconds."""
        return self.model_flops / self.step_seconds if self.step_seconds > 0 else 0.0

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation = model FLOP/s / pod peak bf16 FLOP/s (0..1)."""
        return self.flops_per_second / self.peak_flops_per_s if self.peak_flops_per_s else 0.0

    def mxu_utilization(self) -> dict[tuple[int, int], float]:
        """Per (chip, core): MXU FLOPs / (core peak FLOP/s x simulated step seconds), 0..1."""
        denom = self.core_peak_flops_per_s * self.step_seconds
        return {key: (flops / denom if denom else 0.0) for key, flops in self.core_mxu_flops.items()}

    def ici_link_utilization(self) -> dict[str, float]:
        """Per directed link: bytes / (one-way bandwidth x simulated step seconds), 0..1."""
        denom = self.ici_link_bandwidth_bytes_per_s * self.step_seconds
        return {link: (nbytes / denom if denom else 0.0) for link, nbytes in self.ici_link_bytes.items()}

    def row(self) -> dict[str, float]:
        """A flat record for steps.csv (scalars only)."""
        data = {k: v for k, v in asdict(self).items() if not isinstance(v, dict)}
        data.update(
            simulated_step_seconds=self.step_seconds,
            allreduce_seconds=self.allreduce_seconds,
            simulated_examples_per_second=self.examples_per_second,
            simulated_flops_per_second=self.flops_per_second,
            mfu=self.mfu,
        )
        return data
