"""Timing-only sharded training: the simulated step of a transformer on a
``{data, fsdp, tensor}`` mesh of any size, from one representative device.

Every device of a sharded mesh runs the same program on arrays of the same
shapes, and each collective is costed over every group of its axis at once
(``pod.config.sharding.MeshCollectiveCosts``), so every device's clock is
the same: one device stands for all (``replicate`` = the mesh's devices in
the FLOP totals). It runs in this process, no actors, no Ray cluster:

- the device program is ``pod.workloads.sharded_timing.ShapeShardedTransformer``
  (the functional program with the data movement that costs nothing left
  out) on a TensorCore of the device's spec (``device_chip_spec``: v4 / v5p
  as one megacore device) with ``execute = False``: every op recorded from
  its shapes, zeros returned;
- its collectives go through :class:`ZeroCollectives` (``ShapeCollectives``:
  every call recorded as the functional transport records it; zero views);
- the records and calls are placed in time by the functional pod's own clock
  (``pod.runtime.sharded_pod.combine_sharded_reports``,
  ``pod.report.sharded.sharded_step_clock``) with the plan's collective costs.

So a timing-only step and a functional step of the same layout report the
same simulated times and per-axis figures (tested on small layouts against
every device of an in-process functional run), and a 175B-class model on
8,960 v5p chips costs a step in about a second of wall time (BENCHMARKS.md).
"""

from __future__ import annotations

import time

import numpy as np

from chip import Chip
from pod.config.plan import TrainingPlan
from pod.config.sharding import device_chip_spec, device_groups
from pod.report.stats import StepStats
from pod.runtime.mesh_collectives import ShapeCollectives
from pod.report.stats import RecordTotals
from pod.runtime.actor import HbmUsage
from pod.runtime.sharded_actor import ShardedReport
from pod.runtime.sharded_pod import combine_sharded_reports
from pod.workloads import build_optimizer
from pod.workloads.layers import timing_zeros
from pod.workloads.sharded_timing import ShapeShardedTransformer

__all__ = ["ShardedTimingPod", "ZeroCollectives"]


class ZeroCollectives(ShapeCollectives):
    """``ShapeCollectives`` whose results are read-only zero views (``timing_zeros``):
    no memory is allocated or cleared for a gathered layer or a summed activation."""

    def _exchange(self, axis: str, op: str, x: np.ndarray) -> np.ndarray:
        size = self.axis_size(axis)
        n = {"all_gather": x.size * size, "reduce_scatter": x.size // size}.get(op, x.size)
        return timing_zeros((n,), np.float32)


class ShardedTimingPod:
    """A sharded pod that only accounts time: one in-process device stands for all.

    Args:
        plan: a checked plan with a mesh (``build_plan(..., sharded_ok=True)``)
            and a transformer model; ``plan.per_core_batch`` is the per-device
            batch (global batch / (data x fsdp)).
        sequence_parallel: Megatron sequence parallelism over tensor (the device
            program's option); None: the scenario's ``training.sequence_parallel``.

    Raises:
        ValueError: the plan's model is not a transformer, or tensor does not
            split its heads and MLP.
    """

    def __init__(self, plan: TrainingPlan, *, sequence_parallel: bool | None = None) -> None:
        from pod.workloads.transformer import TransformerModel

        if not isinstance(plan.model, TransformerModel):
            raise ValueError(f"timing-only sharded steps run the transformer, not "
                             f"{plan.scenario.model.name}")
        self.plan = plan
        training = plan.scenario.training
        if sequence_parallel is None:
            sequence_parallel = training.sequence_parallel
        self.optimizer = build_optimizer(training.optimizer.name, **training.optimizer.options())
        self.program = ShapeShardedTransformer(plan.model, plan.mesh.sizes, self.optimizer,
                                               sequence_parallel=sequence_parallel)
        self.costs = plan.collective_costs
        self.spec = device_chip_spec(plan.pod.chip)
        chip = Chip(self.spec, 0, numerics=True, precision=training.precision,
                    mxu_model=plan.scenario.pod.mxu_model)
        self.core = chip.cores[0]
        self.core.execute = False  # costs from shapes only
        self.groups = device_groups(plan.mesh, 0)
        self.shard = self.program.shape_shard()
        self.per_device_batch = plan.global_batch // self.program.batch_shards
        self.last_report: ShardedReport | None = None

    def step(self, step: int = 0) -> StepStats:
        """Account one training step of the whole pod.

        Returns:
            Its statistics: simulated figures of the pod (every device's clock
            is the representative's), wall seconds of this host's accounting.
        """
        t0 = time.perf_counter()
        cfg = self.plan.model.config
        x = np.zeros((self.per_device_batch, cfg.sequence_length), np.int32)   # (b, T) ids
        y = np.zeros((self.per_device_batch, cfg.sequence_length), np.int64)   # (b, T) labels
        comm = ZeroCollectives(self.groups)
        self.core.take_records()
        result = self.program.train_step(self.core, comm, self.shard, x, y, step + 1)
        self.shard = result.shard
        records = self.core.take_records()
        hbm = self.core.hbm
        report = ShardedReport(
            device=0, loss=float(result.loss),
            record_seconds=tuple(float(r.seconds) for r in records),
            update_start=result.update_start, calls=tuple(comm.calls),
            mxu_flops=RecordTotals.of(records).mxu_flops,
            hbm=HbmUsage(hbm.used_bytes, hbm.peak_bytes, hbm.capacity_bytes))
        self.last_report = report
        mesh = self.plan.mesh
        return combine_sharded_reports(
            step, [report], self.costs, global_batch=self.plan.global_batch,
            peak_flops_per_s=self.spec.peak_bf16_flops_per_s * mesh.size,  # a device x devices
            core_peak_flops_per_s=self.spec.core.peak_bf16_flops_per_s,
            model_flops=self.plan.model.model_flops_per_example() * self.plan.global_batch,
            wall=time.perf_counter() - t0, replicate=mesh.size)
