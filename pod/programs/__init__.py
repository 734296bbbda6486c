"""Device programs: what every device of a mesh runs, one SPMD program per model.

- ``contract``: the ``DeviceProgram`` protocol and the values it passes
  (``DeviceCoords``, ``DeviceShard``, ``StepResult``, ``EvalSums``,
  ``DeviceMemory``); ``memory``: what a program holds in HBM, by phase;
- ``collectives``: collectives over one mesh axis (``DeviceCollectives``), the
  in-process ``LocalMesh`` and the timing-only ``ShapeCollectives``;
- ``replicated``: data parallelism for any ``Model`` (gradient buckets
  allreduced over ``data``);
- ``transformer``: the transformer on ``{data, fsdp, tensor}``; its FSDP
  chunks in ``fsdp``, its tensor-parallel collectives in ``tensor``;
- ``pipeline``: the transformer pipelined over a ``stage`` axis (its stages
  sharded as ``transformer`` shards the whole model); its schedules (GPipe,
  1F1B, circular) in ``pipeline_schedule``.

``build_program`` picks the program of a model. No Ray here: the runtime
(``pod.runtime``) runs these programs on actors, threads or one timing-only
device.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pod.programs.collectives import (
    AXES,
    CollectiveCall,
    CollectivesBase,
    DeviceCollectives,
    LocalMesh,
    ShapeCollectives,
)
from pod.programs.contract import (
    DeviceCoords,
    DeviceMemory,
    DeviceProgram,
    DeviceShard,
    EvalSums,
    StepResult,
)
from pod.programs.fsdp import flat_chunk, pack_chunks, unpack_gathered
from pod.programs.pipeline import PipelinedTransformer, run_ticks, stage_layers
from pod.programs.pipeline_schedule import (
    SCHEDULES,
    PipelineSchedule,
    PipeOp,
    bubble_fraction,
    build_schedule,
    check_pipeline,
)
from pod.programs.replicated import ReplicatedProgram, combine_buckets
from pod.programs.transformer import (
    ParamLayout,
    ShardedTransformer,
    check_tensor_split,
    device_param_elements,
    param_layout,
)

__all__ = ["AXES", "CollectiveCall", "CollectivesBase", "DeviceCollectives", "LocalMesh",
           "ShapeCollectives", "DeviceCoords", "DeviceProgram", "DeviceShard", "EvalSums",
           "StepResult", "DeviceMemory", "ReplicatedProgram", "ShardedTransformer", "build_program",
           "check_tensor_split", "combine_buckets", "flat_chunk", "pack_chunks",
           "unpack_gathered", "ParamLayout", "device_param_elements", "param_layout",
           "PipelinedTransformer", "run_ticks", "stage_layers", "SCHEDULES", "PipelineSchedule",
           "PipeOp", "bubble_fraction", "build_schedule", "check_pipeline"]


def build_program(model, sizes: Mapping[str, int], optimizer, *, sequence_parallel: bool = False,
                  bucket_elements: int | None = None, microbatches: int | None = None,
                  pipeline_schedule: str = "gpipe", pipeline_repeats: int = 1,
                  pipeline_fsdp_ag_once: bool = False) -> DeviceProgram:
    """The device program of ``model`` on a mesh of these axis sizes.

    The transformer runs the sharded program on any mesh (on ``{data: N}`` it is
    data parallelism), the pipelined one on a mesh with a ``stage`` axis; any other
    model runs the replicated program (``{data: N}`` only). The sharded and the
    replicated program reduce their gradients in the same buckets
    (:func:`combine_buckets` of ``model.gradient_buckets()``): one gradient reducer.

    Args:
        model: a ``pod.workloads.Model``.
        sizes: mesh axis -> size.
        optimizer: the optimizer.
        sequence_parallel: Megatron sequence parallelism (the transformer).
        bucket_elements: the gradient buckets hold at most this many elements
            (``combine_buckets``; XLA's combiner threshold; a larger layer is a
            bucket of its own); None: one bucket after the backward pass (no
            overlap); the pipeline's stages each over their own layers.
        microbatches: the pipeline's microbatches (None: the stages, MaxText's
            default); pipeline_schedule, pipeline_repeats: its schedule and repeats;
            pipeline_fsdp_ag_once: its stages gather their fsdp shards once per step.

    Raises:
        ValueError: a mesh the model's program cannot run (one line).
    """
    from pod.workloads.transformer import TransformerModel

    if isinstance(model, TransformerModel):
        stages = int(sizes.get("stage", 1))
        if stages > 1:
            return PipelinedTransformer(model, sizes, optimizer,
                                        microbatches=microbatches or stages,
                                        schedule=pipeline_schedule, repeats=pipeline_repeats,
                                        sequence_parallel=sequence_parallel,
                                        fsdp_ag_once=pipeline_fsdp_ag_once,
                                        bucket_elements=bucket_elements)
        key = (model.config, bucket_elements)  # a value: equal configs, equal buckets
        buckets = _BUCKETS.get(key)
        if buckets is None:
            if len(_BUCKETS) >= 256:
                _BUCKETS.clear()
            buckets = _BUCKETS[key] = _buckets(model, bucket_elements)
        return ShardedTransformer(model, sizes, optimizer, sequence_parallel=sequence_parallel,
                                  buckets=buckets)
    return ReplicatedProgram(model, sizes, optimizer, buckets=_buckets(model, bucket_elements))


#: (a transformer's config, bucket elements) -> its gradient buckets (``_buckets``): a plan
#: search builds thousands of programs of a few configs
_BUCKETS: dict[tuple[Any, int | None], tuple[tuple[tuple[str, ...], int], ...]] = {}


def _buckets(model, bucket_elements: int | None) -> tuple[tuple[tuple[str, ...], int], ...]:
    """The model's gradient buckets of at most ``bucket_elements`` elements (None: one
    bucket of every layer)."""
    layers = model.gradient_buckets()
    cap = sum(n for _, n in layers) if bucket_elements is None else bucket_elements
    return combine_buckets(layers, cap)
