"""What a pipelined scenario needs checked and planned: its figures against the mesh and
the model, and one device's HBM with its stage's layers and microbatches in flight.

A mesh with a ``stage`` axis pipelines the transformer
(``pod.programs.pipeline``): ``training.microbatches`` (default: the stages,
MaxText's ``num_pipeline_microbatches: -1``), ``training.pipeline_schedule``,
``training.pipeline_repeats`` and ``training.pipeline_fsdp_ag_once``. Every
mistake is one line naming the field, the value and what is allowed
(``build_plan`` raises them, so ``validate`` does).
"""

from __future__ import annotations

from typing import Any

from pod.config.mesh import (
    _FLOAT32_BYTES,
    _GATHER_BYTES,
    Mesh,
    _gib,
    format_axes,
    fsdp_buffer_bytes,
)
from pod.errors import HBMPlanError, ScenarioError

__all__ = ["pipeline_microbatches", "check_pipeline_plan", "pipeline_memory_plan",
           "ag_once_buffer_bytes"]

_F32 = 4


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
            (``pod.programs.pipeline_schedule.check_pipeline``); layers that do
            not split into stage x repeats chunks; a global batch that does not
            split into data x fsdp x microbatches.
    """
    from pod.programs.pipeline_schedule import check_pipeline

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


def _chunk_activation_bytes(model: Any, chunk: list[int], precision: str, tensor: int
                            ) -> tuple[int, int]:
    """(kept, transient) bytes per example of one chunk of layers on one of ``tensor``
    devices, as ``TransformerModel.activation_memory`` counts the whole model (its
    blocks' ``activation_bytes`` under their remat policy and their
    ``transient_bytes``; the token ids on the first chunk; the final norm's x_hat and
    1/sigma, the output layer's input and, as transient, the logits and their
    gradient on the last; the activation dtype of ``precision``)."""
    from pod.workloads.model import activation_bytes_per_element
    from pod.workloads.transformer import TransformerBlock

    local = model._local(tensor)                                         # noqa: SLF001
    bpe, cfg = activation_bytes_per_element(precision), model.config
    t, c, last = cfg.sequence_length, cfg.embed_dim, len(model.layers) - 1
    kept, transient = 0, 0
    for i in chunk:
        layer, shape = local.layers[i], local._shapes[i]                # noqa: SLF001
        if isinstance(layer, TransformerBlock):
            kept += layer.activation_bytes(shape, bpe, tensor)[0]
            transient = max(transient, layer.transient_bytes(shape, bpe, tensor))
    if 0 in chunk:
        kept += 4 * t                                                    # int32 token ids
    if last in chunk:
        kept += 2 * -(-t * c * bpe // tensor) + -(-t * 4 // tensor)
        transient = max(transient, -(-t * cfg.vocabulary // tensor) * 2 * bpe)
    return kept, transient


def ag_once_buffer_bytes(stage_params: int, largest_layer: int, fsdp: int,
                         precision: str) -> int:
    """The FSDP buffers of a stage that gathers its weights once per step
    (``pipeline_fsdp_ag_once``): all its ``stage_params`` (tensor-local, whole over
    fsdp) in the gather dtype, held for the step, and two layers' whole float32
    gradients being reduce-scattered (as ``fsdp_buffer_bytes``). Without fsdp there
    is nothing to gather: ``fsdp_buffer_bytes``."""
    if fsdp == 1:
        return fsdp_buffer_bytes(largest_layer, fsdp, precision)
    return (stage_params * _GATHER_BYTES.get(precision, 2)
            + 2 * largest_layer * _FLOAT32_BYTES)


def _stage_buffer_bytes(program: Any, stage: int, fsdp: int, precision: str) -> int:
    """The FSDP buffers of one device of ``stage``: two layers' (``fsdp_buffer_bytes``),
    or with ``pipeline_fsdp_ag_once`` the stage's gathered weights, held for the step
    (:func:`ag_once_buffer_bytes`)."""
    largest = program.largest_stage_layer(stage)
    if not program.fsdp_ag_once:
        return fsdp_buffer_bytes(largest, fsdp, precision)
    return ag_once_buffer_bytes(program.stage_gradient_bytes(stage) // _F32, largest, fsdp,
                                precision)


def pipeline_memory_plan(model: Any, optimizer: Any, training: Any, mesh: Mesh,
                         capacity_bytes: int, precision: str = "bf16") -> dict[str, int]:
    """One device's HBM on a pipelined mesh: the largest of the stages' plans.

    Per stage ``s`` of the program (``pod.programs.pipeline.PipelinedTransformer``),
    with ``b`` the examples of a microbatch:

    - params: ``4 p_s``, its stage's parameter chunks (split over fsdp and tensor
      inside the stage; a tied table on the first and last stage);
    - grads: ``4 g_s``, its gradient accumulator: the stage's tensor-local
      arrays, whole over fsdp (accumulated over the microbatches, reduced once
      per step: MaxText's ``pipeline_fsdp_ag_once``; DeepSpeed likewise keeps
      ZeRO's gradient partitioning out of pipelines);
    - optimizer_state: the optimizer's float32 slots x ``p_s``;
    - activations: the microbatch-chunks in flight on the stage
      (``PipelineSchedule.in_flight``: GPipe M, 1F1B ``min(S - s, M)``, circular
      M R) [GPipe] [1F1B] [MaxText] x ``b`` x a chunk's kept bytes per example
      (:func:`_chunk_activation_bytes`, the bytes ``pod.config.mesh``'s plan
      counts for the whole model);
    - workspace: the FSDP buffers of the stage's largest layer
      (``pod.config.mesh.fsdp_buffer_bytes``), one layer's backward working set
      for a microbatch (``b`` x the chunk's transient), and the two permute
      buffers (a microbatch's activations forward and their gradient back, in
      the activation dtype); with ``pipeline_fsdp_ag_once``, :func:`ag_once_buffer_bytes`.

    Args:
        model: the TransformerModel.
        optimizer: its optimizer (``slots``: float32 arrays per parameter).
        training: the scenario's training section (global batch, microbatches,
            schedule, repeats, sequence_parallel).
        mesh: the mesh, with a stage axis.
        capacity_bytes: HBM of one device.
        precision: the training precision (MXU and activation dtype).

    Returns:
        Bytes per item and ``total`` (the stage with the largest total).

    Raises:
        HBMPlanError: the total exceeds the capacity; one line starting
            ``pod.mesh:`` with the stage's items and what to change.
    """
    from pod.programs.pipeline import PipelinedTransformer
    from pod.workloads.model import activation_bytes_per_element

    micro = pipeline_microbatches(training, mesh)
    program = PipelinedTransformer(model, mesh.sizes, optimizer, microbatches=micro,
                                   schedule=training.pipeline_schedule,
                                   repeats=training.pipeline_repeats,
                                   sequence_parallel=training.sequence_parallel,
                                   fsdp_ag_once=training.pipeline_fsdp_ag_once)
    fsdp, tensor = mesh.axis_size("fsdp"), mesh.axis_size("tensor")
    b = training.global_batch // (mesh.axis_size("data") * fsdp) // micro
    cfg = model.config
    buffers = 2 * b * cfg.sequence_length * cfg.embed_dim * activation_bytes_per_element(precision)
    best: dict[str, int] | None = None
    for s in range(program.stages):
        chunks = [_chunk_activation_bytes(model, program.chunks[v], precision, tensor)
                  for v in range(s, len(program.chunks), program.stages)]
        local = program.stage_param_elements(s)
        items = {"params": _F32 * local, "grads": program.stage_gradient_bytes(s),
                 "optimizer_state": _F32 * len(optimizer.slots) * local,
                 "activations": program.schedule.in_flight(s) * b * max(k for k, _ in chunks),
                 "workspace": (_stage_buffer_bytes(program, s, fsdp, precision)
                               + b * max(t for _, t in chunks) + buffers)}
        items["total"] = sum(items.values())
        if best is None or items["total"] > best["total"]:
            best = items
    assert best is not None
    if best["total"] > capacity_bytes:
        raise HBMPlanError(
            f"pod.mesh: {format_axes(mesh.sizes)} with {micro} microbatches "
            f"({training.pipeline_schedule}) needs {_gib(best['total'])} per device (params "
            f"{_gib(best['params'])}, grads {_gib(best['grads'])}, optimizer state "
            f"{_gib(best['optimizer_state'])}, activations {_gib(best['activations'])}, "
            f"workspace {_gib(best['workspace'])}) and does not fit {_gib(capacity_bytes)}; use "
            "more stages, fsdp or tensor, 1f1b with more microbatches, or remat",
            tag="total", requested_bytes=best["total"], free_bytes=capacity_bytes,
            capacity_bytes=capacity_bytes, memory_plan=best)
    return best
