"""An XLA HLO module as a program the emulated pod runs (issue 30).

- :mod:`~pod.hlo.module`: parse the text XLA prints (``parse_hlo``).
- :mod:`~pod.hlo.frames`: an op's stack frames: the user's own line, its call chain.
- :mod:`~pod.hlo.groups`: replica groups in every form, and a collective's cost
  on its actual device groups (ICI, and the DCN across slices).
- :mod:`~pod.hlo.ops`: what one op costs on a TensorCore (the chip model).
- :mod:`~pod.hlo.program`: the step as events (loops unrolled by their trip
  counts, async windows).
- :mod:`~pod.hlo.step`: the events on the project's clock (``cost_module``).
- :mod:`~pod.hlo.memory`: HBM at the step's peak from the schedule.
- :mod:`~pod.hlo.report`: summary.json, layers.csv, the trace, the table.

No jax and no ray here: ``pod.frontends`` captures a JAX step as HLO text.
"""

from pod.hlo.groups import CollectiveCost, CollectiveModel, parse_pairs, parse_replica_groups
from pod.hlo.module import HloComputation, HloInstruction, HloModule, Shape, parse_hlo
from pod.hlo.program import Program, flatten, trip_count
from pod.hlo.step import HloMemory, HloStep, cost_module

__all__ = ["parse_hlo", "HloModule", "HloComputation", "HloInstruction", "Shape",
           "parse_replica_groups", "parse_pairs", "CollectiveCost", "CollectiveModel",
           "Program", "flatten", "trip_count", "HloStep", "HloMemory", "cost_module",
           "is_tpu_compiled"]


def is_tpu_compiled(module: HloModule) -> bool:
    """A module XLA compiled for a TPU: its layouts carry TPU tiles (``T(8,128)``) or
    its ops XLA's TPU cost estimates; else (CPU, GPU, or not compiled) it is costed
    approximately."""
    if ":T(" in module.attrs.get("entry_computation_layout", ""):
        return True
    return any(instr.estimated_cycles is not None for _, instr in module.instructions())
