"""The device program of a model on a mesh with a scenario's training options: the one
place where the plan (``pod.config``) and the programs (``pod.programs``) meet.

``pod.config`` never imports ``pod.programs`` (issue 31; DESIGN.md: config asks a
program for its memory through the contract). ``build_plan`` takes a
:data:`ProgramFactory` (this module's :func:`training_program` unless given one), builds
the plan's program with it, asks it whether it runs on the mesh (its constructor's
one-line ``ValueError``) and for its memory (``DeviceProgram.memory``); the runtime
builds the program it runs with the same function (``pod.runtime.base.plan_program``).
The pipeline's schedule names and checks are re-exported for the scenario's fields.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from pod.programs import SCHEDULES, DeviceProgram, build_program, check_pipeline

__all__ = ["ProgramFactory", "training_program", "PIPELINE_SCHEDULES", "check_pipeline"]

#: The pipeline schedules a scenario may name (``training.pipeline_schedule``).
PIPELINE_SCHEDULES = SCHEDULES

#: (model, mesh axis sizes, optimizer, the scenario's training section) -> the device
#: program; raises ValueError (one line) for a mesh the model's program cannot run.
ProgramFactory = Callable[[Any, Mapping[str, int], Any, Any], DeviceProgram]


def training_program(model: Any, sizes: Mapping[str, int], optimizer: Any,
                     training: Any) -> DeviceProgram:
    """The device program of ``model`` on a mesh of these axis sizes, with the training
    section's options (``pod.programs.build_program``): sequence parallelism, the
    gradient buckets (``training.overlap_bucket_bytes`` / 4 float32 elements with
    overlap, else one bucket), the pipeline's microbatches (default: the stages),
    schedule, repeats and ``pipeline_fsdp_ag_once``.

    Raises:
        ValueError: a mesh the program cannot run (one line).
    """
    stages = int(sizes.get("stage", 1))
    return build_program(model, sizes, optimizer,
                         sequence_parallel=bool(training.sequence_parallel),
                         bucket_elements=(training.overlap_bucket_bytes // 4
                                          if training.overlap else None),
                         microbatches=int(training.microbatches or stages),
                         pipeline_schedule=training.pipeline_schedule,
                         pipeline_repeats=training.pipeline_repeats,
                         pipeline_fsdp_ag_once=training.pipeline_fsdp_ag_once)
