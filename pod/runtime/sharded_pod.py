"""``ShardedPod``: one chip actor per device of a sharded mesh, and one sharded step.

One step: the driver cuts the global batch into one shard per (data, fsdp)
index (devices along tensor share a shard), picks the step's first run id
(above every id used before) and submits one ``ShardedChipActor.step`` per
device; each device runs the whole step, its collectives device to device
(``pod.runtime.mesh_collectives``). The driver waits for every device (the
first error in device order is the cause) and combines the reports: each
device's clock (``pod.report.sharded.sharded_step_clock`` with the plan's
per-axis collective costs), the step's time the slowest device's.
"""

from __future__ import annotations

import secrets
import time
from typing import Any, Sequence

import numpy as np
import ray

from pod.config.mesh import Mesh
from pod.config.sharding import MeshCollectiveCosts, device_chip_spec, device_groups
from pod.report.sharded import ShardedClock, sharded_step_clock
from pod.report.stats import StepStats
from pod.runtime.cluster import ensure_ray, shutdown_ray
from pod.runtime.sharded_actor import ShardedChipActor, ShardedReport, record_stand_ins

__all__ = ["ShardedPod", "batch_shard", "combine_sharded_reports", "device_clock"]

_ACTOR_CPUS = 0.01
#: run ids per step: a step may issue at most this many collectives per device
RUNS_PER_STEP = 1 << 20


def batch_shard(mesh: Mesh, device: int) -> tuple[int, int]:
    """(shard index, number of shards) of ``device``'s part of the batch: the batch is
    split over data x fsdp (data outer), devices along tensor share a shard."""
    groups = device_groups(mesh, device)
    fsdp = groups.axis_size("fsdp")
    return (groups.axis_index("data") * fsdp + groups.axis_index("fsdp"),
            groups.axis_size("data") * fsdp)


def device_clock(report: ShardedReport, costs: MeshCollectiveCosts) -> ShardedClock:
    """One device's simulated step from its report and the plan's collective costs."""
    return sharded_step_clock(record_stand_ins(report), report.calls, costs.seconds,
                              report.update_start)


def combine_sharded_reports(step: int, reports: Sequence[ShardedReport],
                            costs: MeshCollectiveCosts, *, global_batch: int,
                            peak_flops_per_s: float, core_peak_flops_per_s: float,
                            model_flops: int | None, wall: float, replicate: int = 1
                            ) -> StepStats:
    """The step's statistics from every device's report (or one per role, ``replicate``
    devices each, timing-only).

    The step's parts are the slowest device's (by its clock): compute = its
    forward + backward, update = its optimizer, ici = its collectives' cost,
    exposed = what its compute stream waited; ``serial_step_seconds`` is its
    serial sum. Per-axis figures are that device's.
    """
    clocks = [device_clock(r, costs) for r in reports]
    slow = max(range(len(clocks)), key=lambda i: clocks[i].step_seconds)
    c = clocks[slow]
    hardware = replicate * int(sum(r.mxu_flops for r in reports))
    return StepStats(
        step=step, loss=float(np.mean([r.loss for r in reports])), global_batch=global_batch,
        infeed_seconds=0.0, compute_seconds=c.compute_seconds, local_reduce_seconds=0.0,
        ici_seconds=c.collective_seconds, update_seconds=c.update_seconds,
        model_flops=hardware if model_flops is None else int(model_flops),
        hardware_flops=hardware, peak_flops_per_s=peak_flops_per_s, wall_seconds=wall,
        hbm_used_bytes={(r.device, 0): r.hbm.used_bytes for r in reports},
        hbm_peak_bytes={(r.device, 0): r.hbm.peak_bytes for r in reports},
        hbm_capacity_bytes=reports[0].hbm.capacity_bytes,
        core_mxu_flops={(r.device, 0): r.mxu_flops for r in reports},
        core_peak_flops_per_s=core_peak_flops_per_s,
        ici_link_bandwidth_bytes_per_s=costs.link.bandwidth_bytes_per_s,
        chip_compute_seconds={r.device: k.compute_seconds for r, k in zip(reports, clocks)},
        exposed_infeed_seconds=0.0, exposed_allreduce_seconds=c.exposed_seconds,
        axis_collective_bytes=dict(c.axis_bytes), axis_collective_seconds=dict(c.axis_seconds),
        axis_exposed_seconds=dict(c.axis_exposed_seconds))


class ShardedPod:
    """Chip actors for every device of a sharded mesh, running a device program.

    Args:
        mesh: the device mesh (one device per chip).
        chip: the chip preset.
        program: the device program (``ShardedChipActor`` says its methods).
        costs: the plan's per-axis collective costs.
        seed: the scenario seed.
        ray_address: a cluster to join (None: a local one).
        precision, mxu_model: as ``ChipActor``.
    """

    def __init__(self, mesh: Mesh, chip: Any, program: Any, costs: MeshCollectiveCosts,
                 seed: int, *, ray_address: str | None = None, precision: str = "bf16",
                 mxu_model: str = "pipelined") -> None:
        self.mesh, self.chip, self.program, self.costs = mesh, chip, program, costs
        self.seed, self.ray_address = seed, ray_address
        self.precision, self.mxu_model = precision, mxu_model
        self.actors: list[Any] = []
        self.ici_key = secrets.token_bytes(16)
        self._owns_ray = False
        self._run_base = RUNS_PER_STEP  # run ids of the next step start here
        self.last_reports: list[ShardedReport] = []

    def __enter__(self) -> "ShardedPod":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def start(self) -> float:
        """Start (or join) Ray, one actor per device, and tell each its peers' addresses.

        Returns:
            Wall seconds the actors took.
        """
        self._owns_ray = ensure_ray(self.ray_address)
        t0 = time.perf_counter()
        remote = ray.remote(ShardedChipActor).options(num_cpus=_ACTOR_CPUS, max_concurrency=1)
        self.actors = [remote.remote(self.chip, d, device_groups(self.mesh, d), self.program,
                                     self.seed, precision=self.precision,
                                     mxu_model=self.mxu_model)
                       for d in range(self.mesh.size)]
        addresses = dict(enumerate(ray.get([a.ici_address.remote(self.ici_key)
                                            for a in self.actors])))
        ray.get([a.set_peers.remote(addresses) for a in self.actors])
        return time.perf_counter() - t0

    def shutdown(self) -> None:
        """Stop the actors (and the local Ray cluster if this pod started it)."""
        for actor in self.actors:
            try:
                ray.kill(actor)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.actors = []
        if self._owns_ray:
            shutdown_ray()
            self._owns_ray = False

    def step(self, step: int, x: np.ndarray, y: np.ndarray, *, model_flops: int | None = None,
             trace: bool = False) -> StepStats:
        """One sharded step on the global batch ``x``, ``y`` (split over data x fsdp).

        Raises:
            ClusterError: a device failed (its first error, in device order).
        """
        from pod.runtime.coordinator import Pod

        t0 = time.perf_counter()
        base = self._run_base
        self._run_base += RUNS_PER_STEP
        refs = []
        for d, actor in enumerate(self.actors):
            index, shards = batch_shard(self.mesh, d)
            rows = x.shape[0] // shards
            part = slice(index * rows, (index + 1) * rows)
            refs.append(actor.step.remote(step, x[part], y[part], self.seed, base, trace))
        reports = Pod._get_all(self, refs)  # every ref; the first error is the cause
        self.last_reports = reports
        spec = device_chip_spec(self.chip)
        return combine_sharded_reports(
            step, reports, self.costs, global_batch=int(x.shape[0]),
            peak_flops_per_s=spec.peak_bf16_flops_per_s * self.mesh.torus.num_chips,
            core_peak_flops_per_s=spec.core.peak_bf16_flops_per_s, model_flops=model_flops,
            wall=time.perf_counter() - t0)

    def local_params(self) -> list[dict[str, np.ndarray]]:
        """Every device's parameter shards, by device id."""
        return ray.get([a.local_params.remote() for a in self.actors])
