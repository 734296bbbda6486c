"""Timing-only mode: the simulated step of a pod of any size, from one representative
device, in this process, without Ray (this module never imports it).

Every device of a mesh runs the same program on arrays of the same shapes
(the batch and every shard split evenly), and each collective is costed over
every group of its axis at once (``pod.config.sharding.MeshCollectiveCosts``),
so one device's clock is every device's. A pipeline's stages run different
layers: one device per stage stands for its stage (the stage group of device
0), and their clocks run together as a functional step's do. The representative device is a
``pod.runtime.device.Device`` with ``execute = False``: the program records
every op from its shapes (``chip.TensorCore`` with its MXU products off,
``pod.workloads.layers.vector_op``) and moves no data that costs nothing (zero
views, ``ShapeCollectives``). Its report goes through the one clock
(``pod.report.clock.combine_device_reports``) with ``replicate`` = the mesh's
devices. So a timing-only step and a functional step of the same scenario
report the same simulated figures (tested record for record), and a
175B-class model on thousands of chips costs a step in about a second.

What timing-only mode does not give: a loss (the products are zeros),
bit-identity checks, or test accuracy.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from pod.config.plan import TrainingPlan, batch_indices
from pod.config.sharding import device_groups
from pod.errors import CheckpointError, ScenarioError
from pod.programs import AXES, EvalSums, ShapeCollectives
from pod.report.clock import DeviceReport
from pod.report.stats import StepStats
from pod.runtime.base import Evaluation, PodBase
from pod.runtime.device import Device

__all__ = ["TimingPod"]


class TimingPod(PodBase):
    """A pod that only accounts time: one in-process device per pipeline stage stands for
    all (module docstring). A ``PodBase`` back-end, so a ``Run`` drives it as it drives
    the Ray and the in-process pods; what it does not compute it says: a step's loss is
    NaN, an evaluation counts no example, ``replicas_identical`` is None, and there is no
    state to checkpoint or chip to kill. A slow chip (``faults: slow_chip``) slows the
    representatives by the largest factor in force: a step waits for its slowest chip.

    Args:
        plan: the checked training plan.
        tape: a ``pod.programs.replay.LayerTape``: the layers' passes are replayed from it
            when the same pass ran before (in this step, an earlier one, or another
            plan's), which gives the same records and calls; None: every op is run.

    Attributes:
        device: the representative device (device 0).
        devices: the representative devices: device 0 and the other stages of its
            pipeline (just device 0 without a stage axis).
        last_report: device 0's last step's ``DeviceReport``.
        last_reports: every representative's.

    Raises:
        HBMOutOfMemoryError: the device's state does not fit (as in a functional run).
    """

    computes = False

    def __init__(self, plan: TrainingPlan, *, tape: Any = None) -> None:
        super().__init__(plan)
        self.tape = tape
        training = plan.training
        self.groups = device_groups(plan.mesh, 0)
        self.devices = [Device(plan.topology.chip, d, device_groups(plan.mesh, d), self.program,
                               training.seed, devices_per_chip=plan.mesh.devices_per_chip,
                               precision=training.precision,
                               mxu_model=plan.scenario.pod.mxu_model,
                               activation_bytes=int(plan.memory.get("activations", 0)),
                               execute=False)
                        for d in self.groups.ring["stage"]]
        self.device = self.devices[self.groups.ring["stage"].index(0)]
        self.replicate = plan.mesh.size // len(self.devices)
        self.last_report: DeviceReport | None = None
        self.last_comms: list[ShapeCollectives | None] = []
        self._factors: dict[int, float] = {}
        self._known: dict[int, DeviceReport] | None = None

    @property
    def algorithm(self) -> str:
        """The allreduce algorithm of a data axis over the whole pod."""
        return self.plan.ici.algorithm

    # -- the back-end of PodBase ----------------------------------------------------------

    def start(self, check: Callable[[], None] | None = None) -> float:
        """Nothing to start: the representatives exist from the constructor (0 s)."""
        if check is not None:
            check()
        return 0.0

    def shutdown(self) -> None:
        """Nothing to stop."""

    def _inputs(self, step: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """The representatives' examples (their values do not matter, only shapes): one
        device's share of the batch of ``step``, each."""
        plan, data = self.plan, self.plan.dataset
        b, n = plan.per_device_batch, int(data.x_train.shape[0])
        if plan.global_batch <= n:
            idx = batch_indices(n, plan.global_batch, step, plan.training.seed)[:b]
        else:  # a batch bigger than the data set: costs depend on shapes only
            idx = np.arange(b) % n
        x, y = data.x_train[idx], data.y_train[idx]
        return [x] * len(self.devices), [y] * len(self.devices)

    def infeed_bytes(self, xs: Sequence[np.ndarray], ys: Sequence[np.ndarray]) -> int:
        """A chip's share of the batch: its devices' examples (every chip's is the same)."""
        return self.plan.mesh.devices_per_chip * int(xs[0].nbytes + ys[0].nbytes)

    def _step_devices(self, step: int, xs: list[np.ndarray], ys: list[np.ndarray],
                      trace: bool) -> list[DeviceReport]:
        return self._reports(step, xs, ys, trace, None, self._known)

    def step(self, step: int = 0, trace: bool = False, *,
             known: dict[int, DeviceReport] | None = None) -> StepStats:
        """Account one training step of the whole pod (``PodBase.step``): its simulated
        figures (every device's clock is a representative's), the wall seconds of this
        host's accounting, and a NaN loss (nothing is computed).

        Args:
            step: zero-based step number (selects the faults in force).
            trace: keep the representatives' op records for a trace.
            known: reports of this step already made (``device_reports(only=...)``), by
                index in ``devices``: not made again.
        """
        self._known = known
        try:
            stats = super().step(step, trace)
        finally:
            self._known = None
        return dataclasses.replace(stats, loss=math.nan)

    def device_reports(self, step: int = 0, *, trace: bool = False,
                       only: int | None = None,
                       known: dict[int, DeviceReport] | None = None) -> list[DeviceReport]:
        """The representative devices' reports of one step (:meth:`step` without the
        clock: their op records and collective calls, not yet placed in time).

        Args:
            step: zero-based step number.
            trace: keep the op rows (``DeviceReport.trace``).
            only: the step of ``devices[only]`` alone (one stage of a pipeline).
            known: reports already made, by index in ``devices`` (taken as they are: the
                devices' steps do not depend on each other).

        Attributes set:
            last_comms: each reported device's collectives of the step, in order (None
                for a known report).
        """
        xs, ys = self._inputs(step)
        return self._reports(step, xs, ys, trace, only, known)

    def _reports(self, step: int, xs: list[np.ndarray], ys: list[np.ndarray], trace: bool,
                 only: int | None, known: dict[int, DeviceReport] | None
                 ) -> list[DeviceReport]:
        """``device_reports`` on the examples ``xs``, ``ys`` (by index in ``devices``)."""
        seed = self.plan.training.seed
        reports: list[DeviceReport] = []
        comms: list[ShapeCollectives | None] = []
        for i in range(len(self.devices)) if only is None else [only]:
            if known and i in known:
                reports.append(known[i])
                comms.append(None)
                continue
            device = self.devices[i]
            groups = device.groups
            comm = ShapeCollectives({a: groups.axis_size(a) for a in AXES},
                                    {a: groups.ring_index(a) for a in AXES}, tape=self.tape)
            reports.append(device.step(comm, xs[i], ys[i], step, seed, trace))
            comms.append(comm)
        self.last_comms = comms
        if only is None:
            self.last_reports = reports
            self.last_report = reports[self.devices.index(self.device)]
        return reports

    def evaluate(self) -> Evaluation:
        """No example is evaluated (nothing is computed): NaN test figures."""
        return Evaluation(EvalSums(0.0, 0, 0))

    def replicas_identical(self) -> None:
        """Not checked: no device holds values."""
        return None

    def _evaluate_devices(self, xs: list[np.ndarray], ys: list[np.ndarray]) -> list[EvalSums]:
        return [EvalSums(0.0, 0, 0) for _ in xs]

    def _snapshot(self, full: Sequence[bool]) -> list[Any]:
        raise CheckpointError("a timing-only pod holds no parameters to checkpoint")

    def _load(self, params: dict, opt_state: dict, model_states: Sequence[dict | None]
              ) -> list[tuple[str, str]]:
        raise CheckpointError("a timing-only pod holds no parameters to restore")

    def _digests(self) -> list[tuple[str, str]]:
        return []

    def _set_slowdowns(self, factors: dict[int, float]) -> None:
        self._factors.update(factors)
        slowest = max(self._factors.values(), default=1.0)
        for device in self.devices:
            device.set_compute_slowdown(slowest)

    def kill_chips(self, ranks: Any) -> None:
        raise ScenarioError("faults: a timing-only run has no chip to kill (kill_chip and "
                            "kill_host need a functional run)")

    def failed_chips(self, timeout_s: float = 10.0) -> tuple[list[int], list[int]]:
        return [], []

    def replace_chips(self, ranks: Any) -> float:
        return 0.0
