"""``Pod``: places the chip actors and runs one data-parallel step of a plan.

One step (docs/ARCHITECTURE.md, "One training step"): split the global
batch into one slice per chip (the chip splits it over its TensorCores) and
make one call per chip (``ChipActor.train_step``): ``compute``, the chip's
part of the allreduce schedule chip to chip (handed to every chip once at
start-up, ``install_schedule``), ``apply``; then combine the chips' reports
(``combine_reports``). The driver waits on every chip, so an ``IciError`` on
any chip is seen (and a chip whose collective failed never applies).

The pod decides nothing: the allreduce algorithm, its cost at every step and
the fault plan come from the ``TrainingPlan`` (``pod.config.plan``).
"""

from __future__ import annotations

import secrets
import time
from typing import Any, Callable, Sequence

import numpy as np
import ray

from interconnect import Schedule, ScheduleCost, build_collective
from pod.config.plan import TrainingPlan, batch_indices
from pod.errors import USER_ERRORS, CheckpointError, ChipFailureError, ClusterError
from pod.report.stats import HOST_DISPATCH_SECONDS, StepStats, overlapped_end
from pod.runtime.admission import ACTOR_CPUS
from pod.runtime.actor import ApplyReport, ChipActor, ComputeReport, Evaluation, Snapshot
from pod.runtime.cluster import ensure_ray, kill_actors, shutdown_ray
from pod.runtime.collective import install_schedule, split_chunks
from pod.state.checkpoint import mean_replica_state, params_digest

__all__ = ["Pod", "combine_reports", "chip_arguments"]

# Each chip actor reserves a token CPU share, so that a pod of many chips fits on
# a few cores (the emulation is not CPU-bound per actor); placement groups need a
# non-zero resource per bundle. 0.001: 2,000 chips per advertised CPU (0.01 refused
# a v5e-256 on a 2-core machine: 2.56 CPUs of bundles). Admission checks it.
_ACTOR_CPUS = ACTOR_CPUS
_PLACEMENT_TIMEOUT_S = 60.0


def combine_reports(plan: TrainingPlan, step: int, computed: Sequence[ComputeReport],
                    applied: Sequence[ApplyReport], ici_cost: ScheduleCost, wall: float,
                    infeed_bytes: int, replicate: int = 1) -> StepStats:
    """Combine the chips' reports of one step into its statistics.

    Args:
        plan: the training plan.
        step: zero-based step number.
        computed: ``ChipActor.compute`` reports, one per chip reported.
        applied: ``ChipActor.apply`` reports, same chips.
        ici_cost: the allreduce's cost at this step (``plan.ici.cost_at``).
        wall: wall seconds of the step.
        infeed_bytes: bytes of one chip's share of the batch.
        replicate: how many chips each report stands for (timing-only
            mode reports one representative chip for the whole pod).

    Returns:
        The step's statistics.
    """
    chip = plan.pod.chip
    hbm_used, hbm_peak = {}, {}
    for r, out in enumerate(applied):
        for c, mem in enumerate(out.hbm):
            hbm_used[(r, c)] = mem.used_bytes
            hbm_peak[(r, c)] = mem.peak_bytes
    losses = [loss for out in computed for loss in out.losses]
    training = plan.scenario.training
    hardware = replicate * int(sum(sum(out.mxu_flops) for out in computed))
    infeed = infeed_bytes / chip.host_to_chip_bytes_per_s
    compute = max(max(out.compute_seconds) for out in computed)
    local_reduce = max(out.local_reduce_seconds for out in computed)
    update = max(max(out.update_seconds) for out in applied)
    exposed, link_bytes, ici_seconds, spans = _allreduce_path(plan, step, computed, compute,
                                                               local_reduce, ici_cost)
    exposed_infeed = (max(0.0, infeed - (compute + exposed + update)) if training.overlap
                      else infeed)
    return StepStats(
        step=step,
        loss=float(np.mean(losses)),
        global_batch=plan.global_batch,
        infeed_seconds=infeed,
        compute_seconds=compute,
        local_reduce_seconds=local_reduce,
        ici_seconds=ici_seconds,
        update_seconds=update,
        dispatch_seconds=HOST_DISPATCH_SECONDS if training.host_dispatch == "per_step" else 0.0,
        exposed_infeed_seconds=exposed_infeed,
        exposed_allreduce_seconds=exposed,
        allreduce_buckets=spans,
        model_flops=_model_flops(plan, hardware),
        hardware_flops=hardware,
        peak_flops_per_s=plan.pod.peak_bf16_flops_per_s,
        wall_seconds=wall,
        hbm_used_bytes=hbm_used,
        hbm_peak_bytes=hbm_peak,
        hbm_capacity_bytes=chip.core.hbm_bytes,
        ici_link_bytes={f"{a}->{b}": int(v) for (a, b), v in link_bytes.items()},
        core_mxu_flops={(r, c): int(f) for r, out in enumerate(computed)
                        for c, f in enumerate(out.mxu_flops)},
        core_peak_flops_per_s=chip.core.peak_bf16_flops_per_s,
        ici_link_bandwidth_bytes_per_s=plan.ici.link.bandwidth_bytes_per_s,
        chip_compute_seconds={r: max(out.compute_seconds) for r, out in enumerate(computed)},
        compute_bound_seconds=_slowest_bounds((out.compute_seconds, out.bound_seconds)
                                              for out in computed),
        update_bound_seconds=_slowest_bounds((out.update_seconds, out.bound_seconds)
                                             for out in applied),
    )


def _slowest_bounds(reports) -> dict[str, float]:
    """The seconds-by-bound of the slowest core among (per-core seconds, per-core
    bound seconds) pairs ({} when the reports carry none)."""
    best, out = -1.0, {}
    for seconds, bounds in reports:
        for s, b in zip(seconds, bounds):
            if s > best:
                best, out = s, dict(b)
    return out


def _model_flops(plan: TrainingPlan, hardware_flops: int) -> int:
    """The step's model FLOPs: the model's own count where recomputation makes the
    recorded MXU FLOPs (hardware FLOPs) larger, else the recorded ones."""
    per_example = plan.model.model_flops_per_example()
    return hardware_flops if per_example is None else int(per_example) * plan.global_batch


def _allreduce_path(plan: TrainingPlan, step: int, computed: Sequence[ComputeReport],
                    compute: float, local_reduce: float, ici_cost: ScheduleCost
                    ) -> tuple[float, dict[tuple[int, int], float], float, tuple]:
    """The allreduce's exposed seconds, its bytes per directed link, its ICI seconds
    and, with overlap, each bucket's (layers, start, end) from the forward pass's start.

    Without overlap: one allreduce after the backward pass, all of it exposed.
    With overlap (``plan.ici.buckets``): each bucket is reduced (its share of the
    on-chip reduce, then its own ICI allreduce) once every core of every chip has
    finished its layers' gradients, one bucket after another
    (``overlapped_end``); what runs past the end of the backward pass is exposed.
    """
    buckets, costs = plan.ici.buckets, plan.ici.bucket_costs_at(step)
    if not costs:
        return local_reduce + ici_cost.seconds, dict(ici_cost.link_bytes), ici_cost.seconds, ()
    ready = []
    for layers, _ in buckets:
        ready.append(max(ends.get(layer, compute) for out in computed
                         for ends in out.grad_ready_seconds for layer in layers))
    total = sum(n for _, n in buckets)
    seconds = [local_reduce * n / total + c.seconds for (_, n), c in zip(buckets, costs)]
    end = overlapped_end(ready, seconds)
    spans, t = [], 0.0
    for (layers, _), r, s in zip(buckets, ready, seconds):
        start = max(t, r)
        t = start + s
        spans.append((layers, start, t))
    link_bytes: dict[tuple[int, int], float] = {}
    for c in costs:
        for link, nbytes in c.link_bytes.items():
            link_bytes[link] = link_bytes.get(link, 0.0) + nbytes
    return max(0.0, end - compute), link_bytes, sum(c.seconds for c in costs), tuple(spans)


def chip_arguments(plan: TrainingPlan, rank: int, *, in_process: bool = False
                   ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The ``ChipActor`` arguments of one rank of a plan: (args, kwargs).

    ``in_process``: a chip in the driver (timing-only), whose BLAS threads
    are not pinned to one (no other actor shares the cores).
    """
    scenario = plan.scenario
    opt = scenario.training.optimizer
    return ((plan.pod.chip, rank, plan.model, opt.name, opt.options(), scenario.training.seed,
             plan.pod.tensorcores),
            {"numerics": True, "limit_threads": not in_process,
             "precision": scenario.training.precision, "mxu_model": scenario.pod.mxu_model})


class Pod:
    """An emulated TPU pod running one training plan.

    Use as a context manager, or call ``start`` and ``shutdown``.

    Args:
        plan: the checked training plan (``pod.config.plan.build_plan``).
        ray_address: a cluster to join; defaults to the scenario's
            ``ray.address``, then ``RAY_ADDRESS``, then a local cluster.
        core_threads: run each chip's TensorCores in parallel threads
            (``ChipActor``); None: when the cluster has a CPU per TensorCore.
            The results are the same bits either way.

    Raises:
        ClusterError: Ray could not start, or a chip actor died.
    """

    def __init__(self, plan: TrainingPlan, *, ray_address: str | None = None,
                 core_threads: bool | None = None) -> None:
        self.plan = plan
        self.core_threads = core_threads
        self.ray_address = ray_address or plan.scenario.ray.address
        self.actors: list[Any] = []
        self.last_trace: dict[str, Any] | None = None
        self.placement: Any = None
        # the secret every chip of this pod presents on its ICI links (pod/runtime/ici.py)
        self.ici_key = secrets.token_bytes(16)
        self._owns_ray = False
        self.ici_cost = plan.ici.cost_at(0)
        self._schedule: Schedule | None = None
        self._wire: Schedule | None = None
        self._slowdowns: dict[int, float] = {}
        # chip actors are named chip-<rank> (``ray list actors``) in a namespace of this
        # pod's own, so two pods on one cluster never collide; a replacement actor is
        # chip-<rank>-restart-<n> (the dead one's name may not be released yet)
        self.namespace = f"tpu-pod-{plan.scenario.name}-{secrets.token_hex(4)}"
        self._restarts: dict[int, int] = {}

    @property
    def schedule(self) -> Schedule:
        """The allreduce schedule the actors run (built on first use)."""
        if self._schedule is None:
            self._schedule = build_collective("allreduce", self.plan.pod.torus,
                                              self.plan.num_params, 4, self.plan.ici.algorithm)
        return self._schedule

    @property
    def wire_schedule(self) -> Schedule:
        """The schedule as the chips run it: ``schedule`` with large chunks cut into
        pieces (``split_chunks``; the same sums, bit for bit)."""
        if self._wire is None:
            self._wire = split_chunks(self.schedule)
        return self._wire

    # -- lifecycle ---------------------------------------------------------------

    def __enter__(self) -> "Pod":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def start(self, check: Callable[[], None] | None = None) -> float:
        """Start (or join) Ray and create one actor per chip.

        Args:
            check: called once Ray is up and once the hosts are placed: a run's
                interrupt check, so a SIGTERM during start-up stops it there
                rather than after every actor is up.

        Returns:
            Wall seconds the actors took to come up.
        """
        check = check or (lambda: None)
        self._owns_ray = ensure_ray(self.ray_address,
                                    dashboard=self.plan.scenario.ray.dashboard)
        check()
        t0 = time.perf_counter()
        self.placement = self._place_hosts()
        if self.core_threads is None:
            cpus = ray.cluster_resources().get("CPU", 1)
            self.core_threads = cpus >= self.plan.pod.tensorcores
        check()
        self.actors = [self._new_actor(rank) for rank in range(self.plan.pod.chips)]
        self._get([a.set_chunk_bounds.remote(self.wire_schedule.chunk_bounds) for a in self.actors])
        self._install_collective()
        return time.perf_counter() - t0

    def _install_collective(self) -> None:
        """Hand every chip its part of the allreduce and its peers' link addresses
        (once; again after chips are replaced)."""
        addresses = self._get([a.ici_address.remote(self.ici_key) for a in self.actors])
        self._get(install_schedule(self.actors, self.wire_schedule, addresses))

    def host_of(self, rank: int) -> int:
        """The TPU host a chip belongs to: ranks in blocks of the chip's chips_per_host."""
        return rank // self.plan.pod.chip.chips_per_host

    def _place_hosts(self) -> Any:
        """One placement-group bundle per TPU host, spread over the Ray nodes.

        A bundle lives on one node, so the chips of a host share a node (as the
        chips of a real TPU host share its PCIe and DCN); SPREAD puts hosts on
        different nodes where the cluster has them. Each chip actor asks for a
        token CPU share (``_ACTOR_CPUS``) so that many chips fit on few cores.
        """
        from ray.util.placement_group import placement_group

        hosts = self.host_of(self.plan.pod.chips - 1) + 1
        per_host = [sum(1 for r in range(self.plan.pod.chips) if self.host_of(r) == h)
                    for h in range(hosts)]
        group = placement_group([{"CPU": _ACTOR_CPUS * n} for n in per_host], strategy="SPREAD")
        try:
            ray.get(group.ready(), timeout=_PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise ClusterError(
                f"ray: could not place {hosts} TPU hosts of {self.plan.pod.chip.chips_per_host} "
                f"chips within {_PLACEMENT_TIMEOUT_S:.0f} s; the cluster has "
                f"{ray.cluster_resources().get('CPU', 0):g} CPUs") from None
        return group

    def _new_actor(self, rank: int) -> Any:
        """Start the chip actor of one rank in its host's bundle, named ``chip-<rank>``
        (``chip-<rank>-restart-<n>`` for its n-th replacement) in this pod's namespace."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(placement_group=self.placement,
                                                    placement_group_bundle_index=self.host_of(rank))
        restarts = self._restarts.get(rank, 0)
        name = f"chip-{rank}" + (f"-restart-{restarts}" if restarts else "")
        remote = ray.remote(ChipActor).options(num_cpus=_ACTOR_CPUS, max_concurrency=1,
                                               scheduling_strategy=strategy, name=name,
                                               namespace=self.namespace)
        args, kwargs = chip_arguments(self.plan, rank)
        return remote.remote(*args, **kwargs, core_threads=bool(self.core_threads))

    def shutdown(self) -> None:
        """Stop the actors, and the local Ray cluster if this pod started it."""
        kill_actors(self.actors)
        self.actors = []
        if self.placement is not None:
            try:
                from ray.util.placement_group import remove_placement_group
                remove_placement_group(self.placement)
            except Exception:  # noqa: BLE001 - cluster already gone
                pass
            self.placement = None
        if self._owns_ray:
            shutdown_ray()
            self._owns_ray = False

    # -- training ----------------------------------------------------------------

    def step(self, step: int, trace: bool = False) -> StepStats:
        """Run one data-parallel training step.

        Args:
            step: zero-based step number (selects the batch and the dropout streams).
            trace: keep every op record of this step in ``last_trace`` (for
                ``pod.report.trace``).

        Returns:
            The step's statistics (simulated and wall).

        Raises:
            ClusterError: a chip failed (``ChipFailureError`` if its actor
                died; ``IciError`` if its collective did not complete). No
                chip applies a partly reduced buffer: a chip whose collective
                failed refuses to apply.
        """
        plan = self.plan
        data = plan.dataset
        seed = plan.scenario.training.seed
        t0 = time.perf_counter()
        idx = batch_indices(data.x_train.shape[0], plan.global_batch, step, seed)
        x, y = data.x_train[idx], data.y_train[idx]
        per_chip = plan.per_chip_batch
        run_id = secrets.randbits(63)  # the step's collective, the same on every chip
        # one call per chip: compute, its part of the allreduce chip to chip, apply
        reports = self._get_all([actor.train_step.remote(step, x[r * per_chip:(r + 1) * per_chip],
                                                         y[r * per_chip:(r + 1) * per_chip],
                                                         seed, run_id, trace)
                                 for r, actor in enumerate(self.actors)])
        computed = [r.compute for r in reports]
        applied = [r.apply for r in reports]
        wall = time.perf_counter() - t0
        self.last_trace = {
            "compute": [out.trace for out in computed],
            "local_reduce": [out.local_reduce_trace for out in computed],
            "update": [out.trace for out in applied],
        } if trace else None
        infeed_bytes = x[:per_chip].nbytes + y[:per_chip].nbytes
        return combine_reports(plan, step, computed, applied, self.ici_cost, wall, infeed_bytes)

    def evaluate(self) -> Evaluation:
        """Test loss and accuracy of chip 0, core 0's replica on the test split.

        A model with state (BatchNorm running averages, kept per replica from
        its own shards) is evaluated on the mean of every replica's state, as
        Keras reads a sync-on-read MEAN variable outside the replicas."""
        data = self.plan.dataset
        state = self.model_state_mean() if self.plan.model.state_shapes else None
        return self._get(self.actors[0].evaluate.remote(data.x_test, data.y_test, 512, state))

    def model_state_mean(self) -> dict[str, np.ndarray]:
        """The mean over every replica of the model state, float32."""
        cores = self.plan.pod.chip.tensorcores
        states = self._get([a.get_model_state.remote(c) for a in self.actors for c in range(cores)])
        return mean_replica_state(states, self.plan.model.state_shapes)

    def digests(self) -> list[list[str]]:
        """SHA-256 of every replica's parameters, [chip][core]."""
        return self._get([a.digests.remote() for a in self.actors])

    def replicas_identical(self) -> bool:
        """True when every core of every chip holds bit-identical parameters."""
        flat = [d for chip in self.digests() for d in chip]
        return len(set(flat)) == 1

    def params(self, chip: int = 0, core: int = 0) -> dict[str, np.ndarray]:
        """A copy of one replica's parameters."""
        return self._get(self.actors[chip].get_params.remote(core))

    def node_ids(self) -> list[str]:
        """The Ray node of each chip actor, by rank."""
        return self._get([a.node_id.remote() for a in self.actors])

    # -- faults and checkpoints (pod/faults.py, pod/checkpoint.py) -----------------

    def apply_faults(self, step: int) -> None:
        """Put the plan's stragglers and link faults in force for zero-based ``step``
        (those started by then; a rollback to an earlier step takes them back out)."""
        faults = self.plan.faults
        if not faults.faults:
            return
        want = faults.compute_slowdowns(step)
        changed = {r: want.get(r, 1.0) for r in set(want) | set(self._slowdowns)
                   if want.get(r, 1.0) != self._slowdowns.get(r, 1.0)}
        if changed:
            self._get([self.actors[r].set_compute_slowdown.remote(f) for r, f in changed.items()])
            self._slowdowns = {r: f for r, f in want.items() if f != 1.0}
        self.ici_cost = self.plan.ici.cost_at(step)

    def kill_chips(self, ranks: Any) -> None:
        """Kill these chips' actors (``ray.kill``, no restart): an injected fault."""
        for r in ranks:
            ray.kill(self.actors[r], no_restart=True)

    def failed_chips(self, timeout_s: float = 10.0) -> tuple[list[int], list[int]]:
        """Which chips a failed step left unusable: a cheap call to each.

        Returns:
            (dead, hung): ranks whose actor is gone (a Ray actor error), and
            ranks that did not answer within ``timeout_s`` (alive but stuck, e.g.
            in a collective waiting for a dead peer's chunks); both need a new
            actor.
        """
        refs = [a.node_id.remote() for a in self.actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        ready = set(ready)
        dead, hung = [], []
        for rank, ref in enumerate(refs):
            if ref not in ready:
                hung.append(rank)
                continue
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError:
                dead.append(rank)
        return dead, hung

    def replace_chips(self, ranks: Any) -> float:
        """Start new actors for these ranks, each in its host's placement-group bundle.

        Returns:
            Wall seconds until the new actors answered.
        """
        t0 = time.perf_counter()
        for r in ranks:
            try:
                ray.kill(self.actors[r], no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
            self._restarts[r] = self._restarts.get(r, 0) + 1
            self.actors[r] = self._new_actor(r)
            self._slowdowns.pop(r, None)
        self._get([self.actors[r].set_chunk_bounds.remote(self.wire_schedule.chunk_bounds)
                   for r in ranks])
        self._install_collective()  # the new chips' addresses, to every chip
        return time.perf_counter() - t0

    def snapshot(self) -> list[Snapshot]:
        """Every chip's ``ChipActor.snapshot``, by rank; chip 0's with its parameters
        and optimizer state."""
        return self._get([a.snapshot.remote(r == 0) for r, a in enumerate(self.actors)])

    def restore(self, checkpoint: Any) -> None:
        """Load a ``pod.state.checkpoint.Checkpoint`` into every chip and check the result.

        Raises:
            CheckpointError: the checkpoint's replica layout does not match this pod,
                or a chip's parameters after the load differ from the checkpoint's
                digest.
        """
        chips, cores = self.plan.pod.chips, self.plan.pod.chip.tensorcores
        replicas = checkpoint.replica_model_state or [[checkpoint.model_state] * cores] * chips
        if len(replicas) != chips or any(len(c) != cores for c in replicas):
            raise CheckpointError(f"the checkpoint holds model state for {len(replicas)} chips; "
                                  f"this pod has {chips} chips of {cores} TensorCores")
        params = ray.put(dict(checkpoint.params))
        opt = ray.put(dict(checkpoint.optimizer_state))
        digests = self._get([a.restore.remote(params, opt, replicas[r])
                             for r, a in enumerate(self.actors)])
        expected = checkpoint.digests.get("params") or params_digest(checkpoint.params)
        bad = [(r, c) for r, chip in enumerate(digests) for c, d in enumerate(chip) if d != expected]
        if bad:
            raise CheckpointError(f"restore: chip {bad[0][0]} core {bad[0][1]} does not hold the "
                                  f"checkpoint's parameters after loading step {checkpoint.step}")

    # -- helpers -------------------------------------------------------------------

    @staticmethod
    def _get(refs: Any) -> Any:
        """``ray.get`` with a chip's failure turned into one clear error."""
        try:
            return ray.get(refs)
        except ray.exceptions.RayError as err:
            raise _chip_error(err) from None

    def _get_all(self, refs: list[Any]) -> list[Any]:
        """Wait for every ref; on a failure, raise once every ref has settled or
        its chip is gone, so no error is left unread and no chip is still
        mid-step: the first dead chip's error if a chip died (its peers' link
        errors follow from it), else the first error in the refs' order."""
        try:
            return ray.get(refs)
        except ray.exceptions.RayError as err:
            first = err
        dead = None
        # settle the rest (a chip waiting on a dead peer ends with its IciError)
        for ref in refs:
            try:
                ray.get(ref, timeout=_SETTLE_TIMEOUT_S)
            except ray.exceptions.GetTimeoutError:
                break  # stuck: recovery replaces every actor
            except ray.exceptions.RayActorError as err:
                dead = dead or err
            except ray.exceptions.RayError:
                pass  # read, so Ray does not report it as unhandled
        raise _chip_error(dead or first) from None


#: how long a failed step waits for the other chips' calls to end (they hold the error
#: of a peer that died: the ICI link closes at once, so this is rarely reached)
_SETTLE_TIMEOUT_S = 5.0


def _chip_error(err: Exception) -> Exception:
    """The error a chip's failed call stands for, one line with its cause.

    A user error raised inside an actor (a scenario, chip or interconnect
    error) is itself; a dead actor is a ``ChipFailureError``; any other
    exception keeps its type name and message: ``chip actor failed:
    IciError: chip 2: ...``.
    """
    if isinstance(err, ray.exceptions.RayTaskError):
        cause = getattr(err, "cause", None)
        if isinstance(cause, USER_ERRORS):
            return cause
        if cause is not None:
            text = (str(cause).strip().splitlines() or [""])[0]
            return ClusterError(f"a chip actor failed: {type(cause).__name__}: {text}")
    if isinstance(err, ray.exceptions.RayActorError):
        return ChipFailureError(f"a chip actor died: {_first_line(err)}")
    return ClusterError(f"a chip actor call failed: {_first_line(err)}")


def _first_line(err: Exception) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]
