"""What every pod back-end shares: the plan's program, the batch split, the step's
figures, evaluation, checkpoints and the replica check. No Ray here.

A pod runs one training plan's device program (``pod.programs``) on every
device of its mesh. Three back-ends implement the few abstract methods that
move work to devices (``_step_devices``, ``_evaluate_devices``, ``_snapshot``,
``_load``, ``_digests``, ``_set_slowdowns``) and the chips' life (``start``,
``shutdown``, ``kill_chips``, ``failed_chips``, ``replace_chips``): the Ray pod
(``pod.runtime.pod.Pod``: an actor per chip, the ICI transport), the in-process
pod (``pod.runtime.local.LocalPod``: threads and ``LocalMesh``) and the
timing-only pod (``pod.runtime.timing.TimingPod``: one representative device per
pipeline stage, shapes only), so one ``Run`` (``pod.commands.train``) drives
each. Everything else is here, written once: which examples each device gets,
how a step's reports become its ``StepStats`` (``pod.report.clock``), what the
test figures are, how a checkpoint is taken from the devices and put back, and
whether the data replicas agree bit for bit.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from interconnect.calibration import SLICE_STEP_JITTER
from interconnect.dcn import slice_wait_seconds
from pod.config.plan import TrainingPlan, batch_indices
from pod.config.sharding import DeviceGroups, device_chip_spec, device_groups
from pod.errors import CheckpointError
from pod.program_factory import training_program
from pod.programs import DeviceProgram, EvalSums
from pod.report.clock import (
    DeviceReport,
    StatsMemo,
    StepContext,
    combine_device_reports,
    sustained_mxu_fraction,
)
from pod.report.stats import HOST_DISPATCH_SECONDS, StepStats, maxtext_flops
from pod.runtime.device import device_coords
from pod.state.checkpoint import mean_replica_state, params_digest

__all__ = ["PodBase", "Evaluation", "plan_program", "step_context", "chip_devices"]


class Evaluation:
    """Test loss (mean per prediction) and accuracy (0..1) over the evaluated examples;
    both NaN when no example was evaluated."""

    def __init__(self, sums: EvalSums) -> None:
        self.sums = sums
        n = sums.count
        self.loss = sums.loss_sum / n if n else float("nan")
        self.accuracy = sums.correct / n if n else float("nan")

    def __repr__(self) -> str:
        return (f"Evaluation(loss={self.loss!r}, accuracy={self.accuracy!r}, "
                f"count={self.sums.count})")


def plan_program(plan: TrainingPlan) -> DeviceProgram:
    """The plan's device program (``pod.program_factory.training_program``, the one the
    plan's memory came from): the sharded transformer or the replicated program, either
    with the plan's gradient buckets."""
    from pod.workloads import build_optimizer

    training = plan.training
    optimizer = build_optimizer(training.optimizer.name, **training.optimizer.options())
    return training_program(plan.model, plan.mesh.sizes, optimizer, training)


def step_context(plan: TrainingPlan) -> StepContext:
    """The fixed figures that turn a plan's device reports into its steps' figures."""
    training, chip = plan.training, plan.topology.chip
    per_example = plan.model.model_flops_per_example()
    config = getattr(plan.model, "config", None)
    return StepContext(
        global_batch=plan.global_batch,
        model_flops=None if per_example is None else int(per_example) * plan.global_batch,
        device_peak_flops_per_s=device_chip_spec(chip).peak_bf16_flops_per_s,
        devices=plan.mesh.size, devices_per_chip=plan.mesh.devices_per_chip,
        host_to_chip_bytes_per_s=chip.host_to_chip_bytes_per_s,
        dispatch_seconds=HOST_DISPATCH_SECONDS if training.host_dispatch == "per_step" else 0.0,
        overlap=bool(training.overlap),
        ici_link_bandwidth_bytes_per_s=plan.ici.link.bandwidth_bytes_per_s,
        tokens_per_example=int(getattr(config, "sequence_length", 0) or 0),
        sustained_mxu_fraction=_sustained_fraction(chip),
        slice_wait_fraction=slice_wait_seconds(1.0, plan.topology.slices, SLICE_STEP_JITTER),
        slice_axis=next(iter(plan.mesh.dcn_sizes), ""),
        prefetch_layers=(1 if plan.device_memory is None
                         else plan.device_memory.prefetch_layers),
        **maxtext_flops(plan.model, plan.global_batch / plan.mesh.size))


def _sustained_fraction(chip) -> float:
    """e1 / e0 of ``chip``: its sustained MXU budget against a fresh op's rate
    (``pod.report.clock.sustained_clock``)."""
    return sustained_mxu_fraction(chip.core)


def chip_devices(plan: TrainingPlan) -> list[list[tuple[int, DeviceGroups]]]:
    """Per chip rank, its devices and their groups (device ``d`` on chip ``d // n``,
    n the devices per chip)."""
    per_chip = plan.mesh.devices_per_chip
    return [[(d, device_groups(plan.mesh, d)) for d in range(r * per_chip, (r + 1) * per_chip)]
            for r in range(plan.topology.chips)]


class PodBase(abc.ABC):
    """The back-end-independent part of a pod (module docstring); a pod is also a context
    manager (``start`` on entry, ``shutdown`` on exit).

    Args:
        plan: the checked plan.

    Attributes:
        plan, program, context: the plan, its program, its ``StepContext``.
        costs: the collective costs in force (``apply_faults`` changes them).
        coords: each device's ``DeviceCoords``, by device id (made at first use).
        last_reports: the last step's device reports (tests, the trace).
        computes: whether the devices compute values (a loss, test figures, state to
            checkpoint); False for the timing-only pod.
        replicate: how many devices each device report stands for (1: every device
            reports; the timing-only pod's representatives stand for the rest).
    """

    computes = True
    replicate = 1

    def __init__(self, plan: TrainingPlan) -> None:
        self.plan = plan
        self.program = plan_program(plan)
        self.context = step_context(plan)
        self.costs = plan.collective_costs
        self.last_reports: list[DeviceReport] = []
        self._slowdowns: dict[int, float] = {}
        self._stats_memo = StatsMemo()  # a step that clocks as the last one reuses its figures

    @functools.cached_property
    def coords(self) -> list[Any]:
        """Each device's ``DeviceCoords``, by device id."""
        plan = self.plan
        return [device_coords(device_groups(plan.mesh, d)) for d in range(plan.mesh.size)]

    def __enter__(self) -> PodBase:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # -- what a back-end provides ------------------------------------------------------

    @abc.abstractmethod
    def start(self, check: Callable[[], None] | None = None) -> float:
        """Bring the devices up (initial state); wall seconds it took. ``check`` is called
        between the stages of a long start (a run's interrupt check)."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Let the devices go (and what ``start`` started)."""

    @abc.abstractmethod
    def _step_devices(self, step: int, xs: list[np.ndarray], ys: list[np.ndarray],
                      trace: bool) -> list[DeviceReport]:
        """One training step of every device (of ``_inputs``' devices) on its examples."""

    @abc.abstractmethod
    def _evaluate_devices(self, xs: list[np.ndarray], ys: list[np.ndarray]) -> list[EvalSums]:
        """Every device's evaluation sums over its test examples, by device id."""

    @abc.abstractmethod
    def _snapshot(self, full: Sequence[bool]) -> list[Any]:
        """Every device's ``DeviceSnapshot`` (its whole state where ``full``)."""

    @abc.abstractmethod
    def _load(self, params: dict, opt_state: dict, model_states: Sequence[dict | None]
              ) -> list[tuple[str, str]]:
        """Load the whole model onto every device (each its shard); their digests."""

    @abc.abstractmethod
    def _digests(self) -> list[tuple[str, str]]:
        """Every device's (parameters, optimizer state) digests, by device id."""

    @abc.abstractmethod
    def _set_slowdowns(self, factors: dict[int, float]) -> None:
        """Slow these chips' compute by these factors (1: back to normal)."""

    @abc.abstractmethod
    def kill_chips(self, ranks: Any) -> None:
        """An injected fault: these chips fail (the next step raises ``ClusterError``)."""

    @abc.abstractmethod
    def failed_chips(self, timeout_s: float = 10.0) -> tuple[list[int], list[int]]:
        """(dead, hung) chip ranks."""

    @abc.abstractmethod
    def replace_chips(self, ranks: Any) -> float:
        """New devices (initial state) for these chips; wall seconds."""

    # -- a step ------------------------------------------------------------------------

    def batch(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """The global batch of zero-based ``step`` (``batch_indices``)."""
        data = self.plan.dataset
        idx = batch_indices(data.x_train.shape[0], self.plan.global_batch, step,
                            self.plan.training.seed)
        return data.x_train[idx], data.y_train[idx]

    def split(self, x: np.ndarray, y: np.ndarray, *, evaluation: bool = False
              ) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Each device's examples of a batch (or of an evaluation set), by device id."""
        n = int(x.shape[0])
        cut = self.program.eval_slice if evaluation else self.program.batch_slice
        parts = [cut(n, c) for c in self.coords]
        return [x[p] for p in parts], [y[p] for p in parts]

    def _inputs(self, step: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """The examples of ``step`` for the devices ``_step_devices`` runs: every device's
        share of the global batch, by device id."""
        return self.split(*self.batch(step))

    def infeed_bytes(self, xs: Sequence[np.ndarray], ys: Sequence[np.ndarray]) -> int:
        """Bytes of the busiest chip's share of the batch (its devices' examples)."""
        per_chip: dict[int, int] = {}
        n = self.plan.mesh.devices_per_chip
        for d, (x, y) in enumerate(zip(xs, ys, strict=False)):
            per_chip[d // n] = per_chip.get(d // n, 0) + int(x.nbytes + y.nbytes)
        return max(per_chip.values(), default=0)

    def step(self, step: int, trace: bool = False) -> StepStats:
        """One training step of the whole pod on the plan's batch of ``step``, with the
        plan's faults of that step in force (``apply_faults``).

        Raises:
            ClusterError: a device failed (its first error).
        """
        t0 = time.perf_counter()
        self.apply_faults(step)
        xs, ys = self._inputs(step)
        reports = self._step_devices(step, xs, ys, trace)
        self.last_reports = reports
        return combine_device_reports(step, reports, self.costs, self.context,
                                      infeed_bytes=self.infeed_bytes(xs, ys),
                                      wall_seconds=time.perf_counter() - t0,
                                      replicate=self.replicate, memo=self._stats_memo)

    def evaluate(self) -> Evaluation:
        """Test loss and accuracy over the test split (each device its part:
        ``program.eval_slice``; devices that share predictions count once)."""
        data = self.plan.dataset
        xs, ys = self.split(data.x_test, data.y_test, evaluation=True)
        sums = self._evaluate_devices(xs, ys)
        return Evaluation(EvalSums.total(s for s, c in zip(sums, self.coords, strict=False)
                                         if self.program.counts_eval(c)))

    # -- faults --------------------------------------------------------------------------

    def apply_faults(self, step: int) -> None:
        """Put the plan's stragglers (``slow_chip``: every device of the chip) and link
        faults (their collectives' costs) in force for zero-based ``step``."""
        self.costs = self.plan.collective_costs_at(step)
        want = {int(r): float(f) for r, f in self.plan.faults.compute_slowdowns(step).items()}
        if want != self._slowdowns:
            changed = {r: want.get(r, 1.0) for r in set(want) | set(self._slowdowns)
                       if want.get(r, 1.0) != self._slowdowns.get(r, 1.0)}
            self._set_slowdowns(changed)
            self._slowdowns = want

    # -- checkpoints and replicas ---------------------------------------------------------

    def replicas_identical(self) -> bool | None:
        """Whether the data replicas hold bit-identical state: every device's digests
        equal those of the device at the same place (stage, fsdp, expert, tensor, ...) of data
        replica 0 (None: not checked, a pod that does not compute)."""
        digests = self._digests()
        first = {_place(c): digests[d] for d, c in enumerate(self.coords) if c.data == 0}
        return all(digests[d] == first[_place(c)] for d, c in enumerate(self.coords))

    def checkpoint_state(self) -> dict[str, Any]:
        """What a checkpoint holds of the devices: the whole model assembled from data
        replica 0's shards, its digests, and every device's model state.

        Raises:
            CheckpointError: the data replicas differ (a checkpoint of one of them
                would silently drop the others); names the first differing device.
        """
        snaps = self._snapshot([c.data == 0 for c in self.coords])
        first = {_place(c): s.digests
                 for s, c in zip(snaps, self.coords, strict=False) if c.data == 0}
        for s, c in zip(snaps, self.coords, strict=False):
            if s.digests != first[_place(c)]:
                raise CheckpointError(f"device {s.device} differs from its data replica 0 "
                                      f"({s.digests[0][:12]} != {first[_place(c)][0][:12]}); "
                                      "replicas are not bit-identical, refusing to checkpoint "
                                      "one of them")
        shards = [s.shard for s in snaps if s.shard is not None]
        params = self.program.assemble(shards)
        opt_state = self.program.assemble(shards, opt_state=True)
        n = self.plan.mesh.devices_per_chip
        replicas = [[s.model_state for s in snaps[r * n:(r + 1) * n]]
                    for r in range(len(snaps) // n)]
        return {"params": params, "optimizer_state": opt_state,
                "digests": {"params": params_digest(params),
                            "optimizer_state": params_digest(opt_state)},
                "replica_model_state": replicas,
                "model_state": mean_replica_state(replicas, self.plan.model.state_shapes)}

    def restore(self, checkpoint: Any) -> None:
        """Load a checkpoint's whole model onto the devices (each its shard; each its own
        model state where the checkpoint has one per device) and check the result.

        Raises:
            CheckpointError: the checkpoint's model states do not match the devices,
                or the shards assembled again differ from the checkpoint's digests.
        """
        states = _device_model_states(checkpoint, len(self.coords))
        self._load(dict(checkpoint.params), dict(checkpoint.optimizer_state), states)
        state = self.checkpoint_state()
        want = (checkpoint.digests.get("params") or params_digest(checkpoint.params),
                checkpoint.digests.get("optimizer_state")
                or params_digest(checkpoint.optimizer_state))
        if (state["digests"]["params"], state["digests"]["optimizer_state"]) != want:
            raise CheckpointError(f"restore: the devices do not hold the checkpoint's parameters "
                                  f"and optimizer state after loading step {checkpoint.step}")


def _place(coords: Any) -> Any:
    """A device's place in its data replica: its coordinates but ``data``."""
    return dataclasses.replace(coords, data=0)


def _device_model_states(checkpoint: Any, devices: int) -> list[dict | None]:
    """Each device's model state from a checkpoint: its own (``replica_model_state``,
    one per device; a checkpoint of an earlier version kept them per [chip][core],
    flattened in device order), else the checkpoint's ``model_state`` for all.

    Raises:
        CheckpointError: a per-device list of another length.
    """
    replicas = checkpoint.replica_model_state or []
    flat = [s for item in replicas for s in (item if isinstance(item, list) else [item])]
    if not flat:
        return [dict(checkpoint.model_state) or None] * devices
    if len(flat) != devices:
        raise CheckpointError(f"the checkpoint holds model state for {len(flat)} devices; this "
                              f"pod has {devices}")
    return [dict(s) for s in flat]
