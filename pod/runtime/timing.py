"""Timing-only mode: the simulated step of a pod, without actors or Ray.

Every replica of a data-parallel step does the same work on same-shaped
data, so one representative chip tells the cost of all of them: it runs
exactly the code a chip actor runs (``ChipActor.compute`` and ``apply``,
in-process) with its TensorCores' MXU products switched off
(``TensorCore.execute = False``: every op is still recorded and costed from
its shapes, but the products return zeros); the ICI allreduce's cost is the
plan's (``plan.ici``), the same the functional pod uses, and the reports are
combined by the same ``combine_reports``. So a timing-only step and a
functional step of the same scenario report identical simulated times
(tested), and a sweep can reach full pods that no host could emulate
functionally.

What timing-only mode does not give: a loss (the products are zeros),
bit-identity checks, or test accuracy.
"""

from __future__ import annotations

import time

import numpy as np

from pod.config.plan import TrainingPlan, batch_indices
from pod.report.stats import StepStats
from pod.runtime.actor import ChipActor
from pod.runtime.coordinator import chip_arguments, combine_reports

__all__ = ["TimingPod"]


class TimingPod:
    """A pod that only accounts time: one in-process chip stands for all.

    Args:
        plan: the checked training plan (its ICI cost and algorithm are used
            as they are).

    Raises:
        HBMOutOfMemoryError: the model does not fit (as in a functional run).
    """

    def __init__(self, plan: TrainingPlan) -> None:
        self.plan = plan
        args, kwargs = chip_arguments(plan, 0, in_process=True)
        self.actor = ChipActor(*args, **kwargs)  # the representative chip
        for core in self.actor.chip.cores:
            core.execute = False  # costs depend on shapes only: skip the MXU products

    @property
    def algorithm(self) -> str:
        """The allreduce algorithm the pod uses."""
        return self.plan.ici.algorithm

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
        computed = self.actor.compute(step, x, y, seed)
        # the in-process chip has no collective: its buffer stands for the reduced one
        applied = self.actor.apply(step)
        wall = time.perf_counter() - t0
        return combine_reports(plan, step, [computed], [applied], plan.ici.cost_at(step), wall,
                               x.nbytes + y.nbytes, replicate=plan.pod.chips)
