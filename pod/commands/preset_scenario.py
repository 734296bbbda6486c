"""The scenario of a model preset named where a scenario is expected (``tpu-pod describe
llama3.1-8b``, ``pod.describe("gpt3-175b")``): ``pod.config.presets.describe_scenario`` on
the smallest v5p slice and layout whose HBM plan holds it (each candidate planned as
``validate`` plans it: the first ``MAX_SLICES`` candidate slices, each with the layouts of
``DESCRIBE_LAYOUTS``), unless the command line sets the pod."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from pod.commands.sweep import _batch_shards  # the batch axes' devices, as sweeps count them
from pod.config.overrides import Override, as_overrides, scenario_with_overrides
from pod.config.plan import build_plan
from pod.config.presets import DESCRIBE_LAYOUTS, candidate_slices, describe_scenario, get_preset
from pod.config.scenario import Scenario
from pod.errors import USER_ERRORS, HBMPlanError

__all__ = ["preset_scenario"]

#: Candidate slices tried, smallest first (each costs a plan, about a second).
MAX_SLICES = 3
#: Overrides that choose the pod themselves: no search.
_POD_KEYS = ("pod", "pod.slice", "pod.chip", "pod.chips", "pod.topology")


def preset_scenario(name: str, overrides: Iterable[str | Override] | Mapping[str, Any] | None = ()
                    ) -> Scenario:
    """The preset's describe scenario with ``overrides``, on the smallest v5p slice that
    fits (the largest candidate if none does: its plan then says why).

    Raises:
        ScenarioError: an unknown preset, a mixture of experts, a bad override (one line).
    """
    items = as_overrides(overrides)
    if any(o.key in _POD_KEYS or o.key.startswith("pod.mesh") for o in items):
        return _one_per_device(scenario_with_overrides(describe_scenario(name), items,
                                                       source=name), items)
    preset = get_preset(name)
    first = None
    for slice_name in candidate_slices(preset)[:MAX_SLICES]:
        for mesh in DESCRIBE_LAYOUTS:
            if preset.kv_heads % mesh.get("tensor", 1):
                continue
            scenario = _one_per_device(scenario_with_overrides(
                describe_scenario(name, slice_name, mesh), items, source=name), items)
            first = first or scenario
            try:
                build_plan(scenario, timing_only=True, sharded_ok=True)
            except HBMPlanError:
                continue
            except USER_ERRORS:
                return scenario  # not a question of size: planning it again says what
            return scenario
    # the first candidate slice with the first layout (no tensor split) always set it
    assert first is not None
    return first  # none fits: describe shows the smallest's plan and why


def _one_per_device(scenario: Scenario, items: tuple[Override, ...]) -> Scenario:
    """One sequence per device of the batch axes (data x fsdp of the scenario's mesh), unless
    the overrides set the global batch."""
    if any(o.key in ("training", "training.global_batch") for o in items):
        return scenario
    try:
        shards = _batch_shards(scenario)
    except USER_ERRORS:
        return scenario  # a bad pod or mesh: planning it says so
    return scenario.with_overrides(training__global_batch=shards)
