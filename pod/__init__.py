"""tpu-pod-emulator: a TPU pod on an ordinary machine (or a Ray cluster of them).

The public Python API (``__all__``); importing ``pod`` is cheap: Ray is
imported only when a run starts.

- ``run(scenario, *, steps, output_dir, quiet, metrics_port, in_process, progress)
  -> RunResult``:
  train on an emulated pod; ``RunResult.summary``, ``.history``,
  ``.to_pandas()``, ``.plot()``.
- ``validate(scenario) -> TrainingPlan``: everything ``run`` would check.
- ``describe(scenario) -> Description``: the plan, the HBM plan, the model summary.
- ``sweep(scenario, *, output_dir, mode) -> rows``: a scaling experiment.
- ``plan(model, *, slices, tokens_per_step, ...) -> rows``: which layout is fastest.
- ``load(scenario) -> Scenario``: a path, YAML text or a dict, checked.
- ``start_cluster() -> Cluster`` / ``stop_cluster()``: one Ray cluster kept warm for
  every run of the process (a notebook's), instead of one started per run.
- ``build_plan``, ``TrainingPlan``, ``Scenario``, ``Run``, ``TimingPod``: the
  layers underneath (docs/ARCHITECTURE.md); ``workloads``: layers, models,
  optimizers and datasets for custom models.
- Errors: ``EmulatorError`` and its tree (``pod.errors``); ``USER_ERRORS``.

A scenario is a path to a YAML file, a YAML string, a dict or a ``Scenario``.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "run", "validate", "describe", "sweep", "plan", "load", "RunResult", "Description",
    "start_cluster", "stop_cluster", "Cluster",
    "Scenario", "TrainingPlan", "build_plan", "Run", "TimingPod", "workloads",
    "EmulatorError", "ScenarioError", "USER_ERRORS",
]

_WHERE = {
    "run": "pod.api", "validate": "pod.api", "describe": "pod.api", "sweep": "pod.api",
    "plan": "pod.api", "load": "pod.api", "RunResult": "pod.api", "Description": "pod.api",
    "start_cluster": "pod.api", "stop_cluster": "pod.api", "Cluster": "pod.api",
    "Scenario": "pod.config.scenario", "TrainingPlan": "pod.config.plan",
    "build_plan": "pod.config.plan", "Run": "pod.commands.train",
    "TimingPod": "pod.runtime.timing", "EmulatorError": "pod.errors",
    "ScenarioError": "pod.errors", "USER_ERRORS": "pod.errors",
}


def __getattr__(name: str) -> Any:
    """Import a public name on first use (PEP 562), so ``import pod`` stays light."""
    if name == "workloads":
        return importlib.import_module("pod.workloads")
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'pod' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
