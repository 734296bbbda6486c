"""What a pipelined scenario needs checked: its figures against the mesh and the model
(its device's HBM is the program's, ``PipelinedTransformer.memory``, fitted by
``pod.config.fit``).

A mesh with a ``stage`` axis pipelines the transformer
(``pod.programs.pipeline``): ``training.microbatches`` (default: the stages,
MaxText's ``num_pipeline_microbatches: -1``), ``training.pipeline_schedule``,
``training.pipeline_repeats`` and ``training.pipeline_fsdp_ag_once``. Every
mistake is one line naming the field, the value and what is allowed
(``build_plan`` raises them, so ``validate`` does).
"""

from __future__ import annotations

from typing import Any

from pod.config.mesh import Mesh, format_axes
from pod.errors import ScenarioError
from pod.program_factory import check_pipeline

__all__ = ["pipeline_microbatches", "check_pipeline_plan"]


def _show(value: Any) -> str:
    """A field's value as the YAML says it (true / false for a bool)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def pipeline_microbatches(training: Any, mesh: Mesh) -> int:
    """The microbatches of a step: ``training.microbatches``, or the stages."""
    return int(training.microbatches or mesh.axis_size("stage"))


def check_pipeline_plan(scenario: Any, mesh: Mesh, model: Any) -> None:
    """A pipelined scenario's figures fit its mesh and model.

    Raises:
        ScenarioError: one line: pipeline fields without a stage axis (a sweep
            clears them on its stage-less points); a stage axis on a model
            other than the transformer; stages over the DCN; a bad schedule, repeats or
            microbatches
            (``pod.program_factory.check_pipeline``); layers that do
            not split into stage x repeats chunks; a global batch that does not
            split into data x fsdp x microbatches.
    """
    training, stages = scenario.training, mesh.axis_size("stage")
    axes = format_axes(mesh.sizes)
    if stages == 1:
        given = [f"{f} {_show(getattr(training, f))}" for f, default in
                 (("microbatches", None), ("pipeline_schedule", "gpipe"), ("pipeline_repeats", 1),
                  ("pipeline_fsdp_ag_once", False))
                 if getattr(training, f) != default]
        if given:
            field = given[0].split()[0]
            raise ScenarioError(f"training.{field}: {given[0].split(' ', 1)[1]} needs pipeline "
                                f"stages; pod.mesh {axes} has no stage axis: add one (e.g. "
                                "stage: 2) or remove the pipeline fields")
        return
    if mesh.dcn_size("stage") > 1:
        raise ScenarioError(f"pod.dcn_mesh: stage {mesh.dcn_size('stage')} puts pipeline stages "
                            "in different slices, which is not modelled yet; keep stage in "
                            "pod.mesh (one slice) and data or fsdp over the DCN")
    config = getattr(model, "config", None)
    if scenario.model.name != "transformer" or config is None:
        raise ScenarioError(f"pod.mesh: {axes} has a stage axis, but {scenario.model.name} has "
                            "no layers to split into pipeline stages; only the transformer "
                            "pipelines: remove stage")
    micro = pipeline_microbatches(training, mesh)
    try:
        check_pipeline(training.pipeline_schedule, stages, micro, training.pipeline_repeats)
    except ValueError as err:
        field = ("pipeline_repeats" if "repeats" in str(err) and "circular schedule needs" not
                 in str(err) else "microbatches")
        raise ScenarioError(f"training.{field}: {err}") from None
    chunks = stages * training.pipeline_repeats
    if config.layers % chunks:
        fit = ", ".join(str(d) for d in range(1, config.layers + 1) if config.layers % d == 0)
        raise ScenarioError(f"pod.mesh: {axes}: the transformer's {config.layers} layers do not "
                            f"split into stage {stages} x pipeline_repeats "
                            f"{training.pipeline_repeats} = {chunks} equal chunks; stage x "
                            f"pipeline_repeats must divide the layers: {fit}")
    unit = mesh.axis_size("data") * mesh.axis_size("fsdp") * micro
    if training.global_batch % unit:
        lower = training.global_batch // unit * unit
        near = f"{lower} or {lower + unit}" if lower else f"{unit}"
        raise ScenarioError(f"training.global_batch: {training.global_batch} does not split "
                            f"into data x fsdp = {unit // micro} devices x {micro} microbatches "
                            f"(pod.mesh {axes}); use a multiple of {unit} such as {near}")
