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

import time
from typing import Any

import numpy as np

from pod.config.plan import TrainingPlan, batch_indices
from pod.config.sharding import device_groups
from pod.programs import AXES, ShapeCollectives
from pod.report.clock import DeviceReport, combine_device_reports
from pod.report.stats import StepStats
from pod.runtime.base import plan_program, step_context
from pod.runtime.device import Device

__all__ = ["TimingPod"]


class TimingPod:
    """A pod that only accounts time: one in-process device stands for all.

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

    def __init__(self, plan: TrainingPlan, *, tape: Any = None) -> None:
        self.plan = plan
        self.tape = tape
        self.program = plan_program(plan)
        self.context = step_context(plan)
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
        self.last_report: DeviceReport | None = None
        self.last_reports: list[DeviceReport] = []
        self.last_comms: list[ShapeCollectives | None] = []

    @property
    def algorithm(self) -> str:
        """The allreduce algorithm of a data axis over the whole pod."""
        return self.plan.ici.algorithm

    def _examples(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """The representative device's examples (their values do not matter, only shapes)."""
        plan, data = self.plan, self.plan.dataset
        b, n = plan.per_device_batch, int(data.x_train.shape[0])
        if plan.global_batch <= n:
            idx = batch_indices(n, plan.global_batch, step, plan.training.seed)[:b]
        else:  # a batch bigger than the data set: costs depend on shapes only
            idx = np.arange(b) % n
        return data.x_train[idx], data.y_train[idx]

    def step(self, step: int = 0, *, trace: bool = False,
             known: dict[int, DeviceReport] | None = None) -> StepStats:
        """Account one training step of the whole pod.

        Args:
            step: zero-based step number (selects the link faults in force).
            trace: keep the representative devices' op rows (``last_reports``' ``trace``).
            known: reports of this step already made (``device_reports(only=...)``), by
                index in ``devices``: not made again.

        Returns:
            Its statistics: simulated figures of the pod (every device's clock is
            the representative's), wall seconds of this host's accounting.
        """
        t0 = time.perf_counter()
        x, y = self._examples(step)
        reports = self.device_reports(step, trace=trace, known=known)
        per_chip = self.plan.mesh.devices_per_chip
        return combine_device_reports(
            step, reports, self.plan.collective_costs_at(step), self.context,
            infeed_bytes=per_chip * int(x.nbytes + y.nbytes),
            wall_seconds=time.perf_counter() - t0,
            replicate=self.plan.mesh.size // len(reports))

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
        x, y = self._examples(step)
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
            reports.append(device.step(comm, x, y, step, seed, trace=trace))
            comms.append(comm)
        self.last_comms = comms
        if only is None:
            self.last_reports = reports
            self.last_report = reports[self.devices.index(self.device)]
        return reports
