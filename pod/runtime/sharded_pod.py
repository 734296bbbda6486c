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
from pod.runtime.cluster import ensure_ray, kill_actors, shutdown_ray
from pod.runtime.admission import SHARDED_ACTOR_CPUS
from pod.runtime.sharded_actor import (ShardedChipActor, ShardedReport, device_coords,
                                       record_stand_ins)

__all__ = ["ShardedPod", "ShardedTrainingPod", "batch_shard", "combine_sharded_reports",
           "device_clock"]

_ACTOR_CPUS = SHARDED_ACTOR_CPUS  # a token share per device actor; admission checks it
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
                            model_flops: int | None, wall: float, replicate: int = 1,
                            ici_link_bytes: dict[str, int] | None = None) -> StepStats:
    """The step's statistics from every device's report (or one per role, ``replicate``
    devices each, timing-only).

    The step's parts are the slowest device's (by its clock): compute = its
    forward + backward, update = its optimizer, ici = its collectives' cost,
    exposed = what its compute stream waited; ``serial_step_seconds`` is its
    serial sum. Per-axis figures are that device's. ``ici_link_bytes``: the
    pod's bytes per link (``MeshCollectiveCosts.link_bytes``), if computed.
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
        ici_link_bytes=dict(ici_link_bytes or {}),
        chip_compute_seconds={r.device: k.compute_seconds for r, k in zip(reports, clocks)},
        exposed_infeed_seconds=0.0, exposed_allreduce_seconds=c.exposed_seconds,
        axis_collective_bytes=dict(c.axis_bytes), axis_collective_seconds=dict(c.axis_seconds),
        axis_exposed_seconds=dict(c.axis_exposed_seconds), traced_device=reports[slow].device,
        collective_spans=c.spans, compute_waits=c.waits)


class ShardedPod:
    """Chip actors for every device of a sharded mesh, running a device program.

    Args:
        mesh: the device mesh (an actor per device: per chip, or per TensorCore on v2 / v3).
        chip: the chip preset.
        program: the device program (``ShardedChipActor`` says its methods).
        costs: the plan's per-axis collective costs.
        seed: the scenario seed.
        ray_address: a cluster to join (None: a local one).
        precision, mxu_model, activation_bytes: as ``ShardedChipActor``.
    """

    def __init__(self, mesh: Mesh, chip: Any, program: Any, costs: MeshCollectiveCosts,
                 seed: int, *, ray_address: str | None = None, precision: str = "bf16",
                 mxu_model: str = "pipelined", activation_bytes: int = 0) -> None:
        self.mesh, self.chip, self.program, self.costs = mesh, chip, program, costs
        self.seed, self.ray_address = seed, ray_address
        self.precision, self.mxu_model = precision, mxu_model
        self.activation_bytes = activation_bytes
        self.actors: list[Any] = []
        self._slowdowns: dict[int, float] = {}  # device -> straggler factor in force
        self.ici_key = secrets.token_bytes(16)
        self._owns_ray = False
        self._run_base = RUNS_PER_STEP  # run ids of the next step start here
        self.last_reports: list[ShardedReport] = []
        self.coords = [device_coords(device_groups(mesh, d)) for d in range(mesh.size)]

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
        return self._start_actors()

    def _start_actors(self) -> float:
        """One new actor per device, each told its peers' ICI addresses; wall seconds."""
        t0 = time.perf_counter()
        remote = ray.remote(ShardedChipActor).options(num_cpus=_ACTOR_CPUS, max_concurrency=1)
        self.actors = [remote.remote(self.chip, d, device_groups(self.mesh, d), self.program,
                                     self.seed, precision=self.precision,
                                     mxu_model=self.mxu_model,
                                     activation_bytes=self.activation_bytes)
                       for d in range(self.mesh.size)]
        self._slowdowns = {}
        addresses = dict(enumerate(ray.get([a.ici_address.remote(self.ici_key)
                                            for a in self.actors])))
        ray.get([a.set_peers.remote(addresses) for a in self.actors])
        return time.perf_counter() - t0

    def devices_of(self, ranks: Any) -> list[int]:
        """The device ids on these chip ranks (two per chip on v2 / v3)."""
        per_chip, ranks = self.mesh.devices_per_chip, set(ranks)
        return [d for d in range(self.mesh.size) if d // per_chip in ranks]

    def kill_chips(self, ranks: Any) -> None:
        """Kill the device actors of these chips (``ray.kill``, no restart): an injected
        fault (``kill_chip``, ``kill_host``)."""
        for d in self.devices_of(ranks):
            ray.kill(self.actors[d], no_restart=True)

    def failed_chips(self, timeout_s: float = 10.0) -> tuple[list[int], list[int]]:
        """(dead, hung) chip ranks after a failed step: chips with a device actor gone,
        and chips with one that did not answer within ``timeout_s`` (as ``Pod``'s)."""
        from pod.runtime.coordinator import Pod

        dead, hung = Pod.failed_chips(self, timeout_s)  # per device: its actors
        per_chip = self.mesh.devices_per_chip
        return (sorted({d // per_chip for d in dead}),
                sorted({d // per_chip for d in hung} - {d // per_chip for d in dead}))

    def replace_chips(self, ranks: Any) -> float:
        """New actors for every device (a sharded slice restarts as a unit; the
        survivors hold links to the dead and may sit in the failed collective); their
        state is the initial one until ``load``. Returns wall seconds."""
        kill_actors(self.actors)
        return self._start_actors()

    def set_chip_slowdowns(self, factors: dict[int, float]) -> None:
        """Stragglers: chip rank -> factor >= 1 for the op records of its devices (every
        device of a v2 / v3 chip); chips not named run at 1. Only changes are sent.

        Raises:
            ClusterError: a device failed.
        """
        from pod.runtime.coordinator import Pod

        per_chip = self.mesh.devices_per_chip
        want = {d: float(factors.get(d // per_chip, 1.0)) for d in range(self.mesh.size)}
        changed = [d for d, f in want.items() if f != self._slowdowns.get(d, 1.0)]
        Pod._get_all(self, [self.actors[d].set_compute_slowdown.remote(want[d]) for d in changed])
        self._slowdowns = {d: f for d, f in want.items() if f != 1.0}

    def shutdown(self) -> None:
        """Stop the actors (and the local Ray cluster if this pod started it)."""
        kill_actors(self.actors)
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
            part = self.program.batch_slice(int(x.shape[0]), self.coords[d])
            refs.append(actor.step.remote(step, x[part], y[part], self.seed, base, trace))
        reports = Pod._get_all(self, refs)  # every ref; the first error is the cause
        self.last_reports = reports
        spec = device_chip_spec(self.chip)
        return combine_sharded_reports(
            step, reports, self.costs, global_batch=int(x.shape[0]),
            peak_flops_per_s=spec.peak_bf16_flops_per_s * self.mesh.size,  # a device x devices
            core_peak_flops_per_s=spec.core.peak_bf16_flops_per_s, model_flops=model_flops,
            wall=time.perf_counter() - t0, ici_link_bytes=self.costs.link_bytes(reports[0].calls))

    def local_params(self) -> list[dict[str, np.ndarray]]:
        """Every device's parameter shards, by device id."""
        return ray.get([a.local_params.remote() for a in self.actors])

    def shards(self) -> list[Any]:
        """Every device's state (the program's shard), by device id."""
        return ray.get([a.shard.remote() for a in self.actors])

    def load(self, params: dict[str, np.ndarray], opt_state: dict[str, np.ndarray]) -> None:
        """Every device takes its shard of whole-model parameters and optimizer state
        (``ShardedChipActor.load``).

        Raises:
            ClusterError: a device failed.
        """
        from pod.runtime.coordinator import Pod

        refs = (ray.put(dict(params)), ray.put(dict(opt_state)))
        Pod._get_all(self, [a.load.remote(*refs) for a in self.actors])

    def assemble(self, *, opt_state: bool = False) -> dict[str, np.ndarray]:
        """The whole model's parameters (or optimizer state) from the devices' shards
        (the program's ``assemble``: data replica 0's)."""
        return self.program.assemble(self.shards(), opt_state=opt_state)

    def replicas_identical(self) -> bool:
        """Whether the data replicas hold bit-identical shards: every device's digest
        equals that of the device at the same (fsdp, tensor) of data replica 0."""
        digests = ray.get([a.digest.remote() for a in self.actors])
        first = {(c.fsdp, c.tensor): digests[d] for d, c in enumerate(self.coords)
                 if c.data == 0}
        return all(digests[d] == first[(c.fsdp, c.tensor)] for d, c in enumerate(self.coords))

    def evaluate(self, x: np.ndarray, y: np.ndarray) -> float:
        """The program's eval-mode loss over the batch ``x``, ``y`` (split as a
        training batch; the global figure is the devices' mean, ``global_loss``).

        Raises:
            ClusterError: a device failed.
        """
        from pod.runtime.coordinator import Pod

        base = self._run_base
        self._run_base += RUNS_PER_STEP
        refs = [actor.evaluate.remote(*(a[self.program.batch_slice(int(x.shape[0]), c)]
                                        for a in (x, y)), base)
                for actor, c in zip(self.actors, self.coords)]
        return float(np.mean(Pod._get_all(self, refs)))


class ShardedTrainingPod:
    """A training plan's sharded pod: the transformer's device program
    (``pod.workloads.sharded.ShardedTransformer``) on one ``ShardedChipActor`` per
    device, fed the plan's batches (``batch_indices``, as the data-parallel ``Pod``).

    What ``pod.commands.train`` needs of a pod: ``start``, ``step``, ``evaluate``,
    ``replicas_identical``, ``snapshot`` (a checkpoint of the assembled whole
    model), ``restore`` (``--resume`` and recovery: the checkpoint re-sharded onto
    the devices), ``apply_faults``, ``kill_chips``, ``failed_chips``,
    ``replace_chips`` (faults), ``shutdown``.

    Args:
        plan: a checked plan whose mesh has fsdp or tensor axes (transformer model).
        ray_address: a cluster to join (None: a local one).

    Raises:
        ValueError: tensor does not split the model's heads and MLP (the plan
            refuses that first).
    """

    #: test examples of the evaluation batch at most (cut to a multiple of data x fsdp)
    EVAL_EXAMPLES = 256

    def __init__(self, plan: Any, *, ray_address: str | None = None) -> None:
        from pod.workloads import build_optimizer
        from pod.workloads.sharded import ShardedTransformer

        self.plan = plan
        training = plan.scenario.training
        self.optimizer = build_optimizer(training.optimizer.name, **training.optimizer.options())
        self.program = ShardedTransformer(plan.model, plan.mesh.sizes, self.optimizer,
                                          sequence_parallel=training.sequence_parallel)
        costs = plan.collective_costs
        self.pod = ShardedPod(plan.mesh, plan.pod.chip, self.program, costs, training.seed,
                              ray_address=ray_address, precision=training.precision,
                              mxu_model=plan.scenario.pod.mxu_model,
                              activation_bytes=int(plan.memory.get("activations", 0)))
        self.last_trace = None

    def start(self) -> float:
        """Start the device actors; wall seconds they took."""
        return self.pod.start()

    def shutdown(self) -> None:
        """Stop the actors (and a local Ray cluster this pod started)."""
        self.pod.shutdown()

    def apply_faults(self, step: int) -> None:
        """Put the plan's stragglers (``slow_chip``: every device of the chip) and link
        faults (``slow_link``, ``fail_link``, costed by ``plan.collective_costs_at``) in
        force for zero-based ``step``.

        Raises:
            ClusterError: a device failed.
        """
        self.pod.costs = self.plan.collective_costs_at(step)
        self.pod.set_chip_slowdowns(self.plan.faults.compute_slowdowns(step))

    def kill_chips(self, ranks: Any) -> None:
        """Kill the device actors of these chips (an injected fault)."""
        self.pod.kill_chips(ranks)

    def failed_chips(self, timeout_s: float = 10.0) -> tuple[list[int], list[int]]:
        """(dead, hung) chip ranks after a failed step (``ShardedPod.failed_chips``)."""
        return self.pod.failed_chips(timeout_s)

    def replace_chips(self, ranks: Any) -> float:
        """New actors for every device (``ShardedPod.replace_chips``); ``restore`` then
        loads the checkpoint to go back to. Returns wall seconds."""
        return self.pod.replace_chips(ranks)

    def step(self, step: int, trace: bool = False) -> StepStats:
        """One sharded training step on the plan's batch of ``step`` (zero-based).

        Raises:
            ClusterError: a device failed.
        """
        from pod.config.plan import batch_indices

        plan, data = self.plan, self.plan.dataset
        idx = batch_indices(data.x_train.shape[0], plan.global_batch, step,
                            plan.scenario.training.seed)
        return self.pod.step(step, data.x_train[idx], data.y_train[idx],
                             model_flops=plan.model.model_flops_per_example() * plan.global_batch)

    def evaluate(self) -> Any:
        """Eval-mode loss over the first examples of the test split (at most
        ``EVAL_EXAMPLES``, a multiple of data x fsdp); accuracy is not computed
        by the sharded program (NaN)."""
        from pod.runtime.actor import Evaluation

        data, shards = self.plan.dataset, self.program.batch_shards
        n = min(len(data.x_test), self.EVAL_EXAMPLES) // shards * shards
        if n == 0:
            return Evaluation(float("nan"), float("nan"))
        return Evaluation(self.pod.evaluate(data.x_test[:n], data.y_test[:n]), float("nan"))

    def replicas_identical(self) -> bool:
        """Whether every data replica holds bit-identical shards."""
        return self.pod.replicas_identical()

    def restore(self, checkpoint: Any) -> None:
        """Shard a checkpoint's whole model (``snapshot``'s) onto the devices and check it.

        The checkpoint holds the parameters and optimizer state assembled from data
        replica 0; each device takes its tensor slice and fsdp chunk of them
        (``ShardedTransformer.shard_params``, padding zeros as a run keeps them), so
        a resumed run continues bit for bit where the checkpointed one was.

        Raises:
            CheckpointError: after the load, the shards assembled again differ from
                the checkpoint's digests, or the data replicas differ.
        """
        from pod.errors import CheckpointError
        from pod.state.checkpoint import params_digest

        self.pod.load(checkpoint.params, checkpoint.optimizer_state)
        shards = self.pod.shards()
        got = (params_digest(self.program.assemble(shards)),
               params_digest(self.program.assemble(shards, opt_state=True)))
        want = (checkpoint.digests.get("params") or params_digest(checkpoint.params),
                checkpoint.digests.get("optimizer_state")
                or params_digest(checkpoint.optimizer_state))
        if got != want or not self.pod.replicas_identical():
            raise CheckpointError(f"restore: the devices do not hold the checkpoint's parameters "
                                  f"and optimizer state after loading step {checkpoint.step}")

    def snapshot(self) -> list[Any]:
        """One ``Snapshot`` of the whole model assembled from the shards (data
        replica 0's; ``replicas_identical`` says whether the others agree), as
        ``pod.state.resume.pod_checkpoint`` takes it."""
        from pod.runtime.actor import Snapshot
        from pod.state.checkpoint import params_digest

        shards = self.pod.shards()
        params = self.program.assemble(shards)
        opt_state = self.program.assemble(shards, opt_state=True)
        return [Snapshot(digests=((params_digest(params), params_digest(opt_state)),),
                         model_state=({},), params=params, optimizer_state=opt_state)]
