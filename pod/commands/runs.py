"""The ``Run`` of a plan, on any mesh (``pod.commands.train``)."""

from __future__ import annotations

from typing import Any

from pod.commands.train import Run
from pod.config.plan import TrainingPlan

__all__ = ["make_run", "run_training"]


def make_run(plan: TrainingPlan, **options: Any) -> Run:
    """The ``Run`` of a plan (``Run``'s keyword arguments): one for every mesh."""
    return Run(plan, **options)


def run_training(plan: TrainingPlan, **options: Any) -> dict[str, Any]:
    """Train the plan and write the results (``make_run(plan, ...).run()``).

    Returns:
        The summary dict, also written to ``output_dir / "summary.json"``.
    """
    return make_run(plan, **options).run()
