"""Timing-only mode: the simulated step of a pod, without actors or Ray.

Every replica of a data-parallel step does the same work on same-shaped
data, so one representative chip tells the cost of all of them: it runs
exactly the code a chip actor runs (``ChipActor.compute`` and ``apply``,
in-process) with its TensorCores' MXU products switched off
(``TensorCore.execute = False``: every op is still recorded and costed from
its shapes, but the products return zeros), and the ICI allreduce is costed
by the same code the functional pod uses (``Pod``'s constructor costs it
without starting Ray).
The statistics are combined by the same ``Pod.step_stats``. So a timing-only
step and a functional step of the same scenario report identical simulated
times (tested), and a sweep can reach full pods that no host could emulate
functionally.

What timing-only mode does not give: a loss (the products are zeros),
bit-identity checks, or test accuracy.
"""

from __future__ import annotations

import time

import numpy as np

from pod.actor import ChipActor
from pod.coordinator import Pod
from pod.plan import TrainingPlan, batch_indices
from pod.stats import StepStats

__all__ = ["TimingPod"]


class TimingPod:
    """A pod that only accounts time: one in-process chip stands for all.

    Args:
        plan: the checked training plan.

    Raises:
        HBMOutOfMemoryError: the model does not fit (as in a functional run).
        TopologyError: the allreduce cannot be routed (failed links).
    """

    def __init__(self, plan: TrainingPlan) -> None:
        self.plan = plan
        self.pod = Pod(plan)  # schedule and ICI cost; no Ray until start(), never called here
        scenario = plan.scenario
        opt = scenario.training.optimizer
        self.chip = ChipActor(plan.pod.chip, 0, plan.model, opt.name, opt.options(),
                              scenario.training.seed, plan.pod.tensorcores,
                              numerics=True, limit_threads=False, put_chunks=False,
                              precision=scenario.training.precision)
        for core in self.chip.chip.cores:
            core.execute = False  # costs depend on shapes only: skip the MXU products

    @property
    def algorithm(self) -> str:
        """The allreduce algorithm the pod uses."""
        return self.pod.allreduce_algorithm

    def step(self, step: int = 0) -> StepStats:
        """Account one training step of the whole pod.

        Args:
            step: zero-based step number (selects the representative batch).

        Returns:
            The step's statistics: simulated figures for the whole pod, wall
            seconds of this host's accounting, HBM of the representative chip.
        """
        plan = self.plan
        data = plan.dataset
        seed = plan.scenario.training.seed
        t0 = time.perf_counter()
        per_chip = plan.per_chip_batch
        n = data.x_train.shape[0]
        if plan.global_batch <= n:
            idx = batch_indices(n, plan.global_batch, step, seed)[:per_chip]
        else:  # a batch bigger than the data set: costs depend on shapes only
            idx = np.arange(per_chip) % n
        x, y = data.x_train[idx], data.y_train[idx]
        computed = self.chip.compute(step, x, y, seed)
        applied = self.chip.apply(step)
        wall = time.perf_counter() - t0
        return self.pod.step_stats(step, [computed], [applied], wall, x.nbytes + y.nbytes,
                                   replicate=plan.pod.chips)
