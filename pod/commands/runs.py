"""The ``Run`` of a plan: data-parallel (``pod.commands.train``) or sharded
(``pod.commands.sharded_run``), as its ``pod.mesh`` says."""

from __future__ import annotations

from typing import Any

from pod.commands.sharded_run import ShardedRun
from pod.commands.train import Run
from pod.config.plan import TrainingPlan

__all__ = ["make_run", "run_training"]


def make_run(plan: TrainingPlan, **options: Any) -> Run:
    """A ``ShardedRun`` when the plan's ``pod.mesh`` has fsdp or tensor axes, else
    the data-parallel ``Run`` (``Run``'s keyword arguments)."""
    if plan.mesh is not None and not plan.mesh.is_data_parallel:
        return ShardedRun(plan, **options)
    return Run(plan, **options)


def run_training(plan: TrainingPlan, **options: Any) -> dict[str, Any]:
    """Train the plan and write the results (``make_run(plan, ...).run()``).

    Returns:
        The summary dict, also written to ``output_dir / "summary.json"``.
    """
    return make_run(plan, **options).run()
