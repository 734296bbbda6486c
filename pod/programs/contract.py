"""The device-program contract: what every device of a mesh runs, on any back-end.

A device program is one SPMD program: every device of a ``{data, fsdp, tensor}``
mesh runs the same code on its own shard of the state and of the batch, and
exchanges arrays only through a ``pod.programs.collectives.DeviceCollectives``
(collectives over one mesh axis). The same program runs on three back-ends,
as SimPy's processes run in its environments and ASTRA-sim's collectives over
its network API:

- Ray chip actors with the ICI transport (``pod.runtime.pod.Pod``);
- threads in this process meeting at barriers (``pod.runtime.local.LocalPod``,
  ``pod.programs.collectives.LocalMesh``), for tests and notebooks;
- one representative device with shapes only (``pod.runtime.timing.TimingPod``,
  ``core.execute = False`` and ``ShapeCollectives``), for pods of any size.

Two programs implement it: :class:`pod.programs.replicated.ReplicatedProgram`
(any ``Model`` on a ``{data: N}`` mesh: forward, backward, the gradients
allreduced over ``data`` in buckets as the backward pass produces them, the
optimizer) and :class:`pod.programs.transformer.ShardedTransformer` (the
transformer on any ``{data, fsdp, tensor}`` mesh: FSDP gathers and
reduce-scatters, Megatron tensor parallelism). ``build_program`` picks one.

Conventions every program keeps:

- a step's op records are indexed from the step's start (the device takes
  the core's records before it), and every collective call's ``after_record``
  is ``len(core.records)`` when its input is ready, so the clock
  (``pod.report.clock``) can lay compute and collectives on one timeline;
- ``StepResult.update_start`` is the index of the optimizer's first record: the
  clock starts the update once every gradient collective has ended;
- on a timing-only core (``core.execute`` False) the program moves no data
  that costs nothing on the chip (zero views), and records the same ops and
  calls as a functional step (tests compare them record for record);
- a program reports what one device holds in HBM for a step
  (``memory(per_device_batch, precision) -> DeviceMemory``, ``pod.memory``;
  built from ``pod.programs.memory``): the plan (``pod.config``) asks it
  there and never reads a program's layout itself.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from pod.memory import DeviceMemory
from pod.programs.collectives import DeviceCollectives

__all__ = ["DeviceCoords", "DeviceShard", "StepResult", "EvalSums", "DeviceProgram",
           "DeviceMemory"]


@dataclass(frozen=True, order=True)
class DeviceCoords:
    """A device's place in the mesh: its position along each axis (ring order,
    ``DeviceCollectives.axis_index``). The pipeline ``stage`` and ``expert`` axes
    come last so that ``DeviceCoords(data, fsdp, tensor)`` keeps its meaning."""

    data: int = 0
    fsdp: int = 0
    tensor: int = 0
    stage: int = 0
    expert: int = 0

    @classmethod
    def of(cls, comm: DeviceCollectives) -> DeviceCoords:
        """The coordinates ``comm`` reports."""
        return cls(**{a: comm.axis_index(a) for a in ("data", "stage", "fsdp", "expert",
                                                      "tensor")})


@dataclass(frozen=True)
class DeviceShard:
    """What one device keeps between steps.

    Attributes:
        coords: the device's coordinates.
        params: parameter name -> this device's part (the whole array for a
            replicated program; a 1-D fsdp chunk of the tensor-local array for the
            sharded transformer, float32, or bf16 under ``weight_dtype: bfloat16``).
        opt_state: the optimizer's state of those parts, keyed as
            ``Optimizer.init`` keys it ("<key>/<slot>").
        model_state: non-trainable state (BatchNorm running averages, per
            device: each replica moves them with its own shard of the batch).
    """

    coords: DeviceCoords
    params: Mapping[str, np.ndarray]
    opt_state: Mapping[str, np.ndarray]
    model_state: Mapping[str, np.ndarray] = field(default_factory=dict)


@dataclass(frozen=True)
class StepResult:
    """One device's training step.

    Attributes:
        loss: the mean loss over this device's predictions (float).
        shard: the updated DeviceShard.
        update_start: index in the step's op records of the optimizer's first
            op: what comes from there on waits for every gradient collective.
        router_loads: each MoE layer's routing of this device's tokens
            (``pod.workloads.moe.RouterLoad``), in layer order; empty for a
            dense model (and routed counts empty on a timing-only core).
    """

    loss: float
    shard: DeviceShard
    update_start: int
    router_loads: tuple[Any, ...] = ()


@dataclass(frozen=True)
class EvalSums:
    """One device's evaluation: sums, so that devices and batches add up.

    Attributes:
        loss_sum: the sum of the losses of its predictions.
        correct: predictions whose argmax is the label.
        count: predictions (examples, or tokens for a sequence model).
    """

    loss_sum: float
    correct: int
    count: int

    def __add__(self, other: EvalSums) -> EvalSums:
        return EvalSums(self.loss_sum + other.loss_sum, self.correct + other.correct,
                        self.count + other.count)

    @staticmethod
    def total(parts: Iterable[EvalSums]) -> EvalSums:
        """The sum of several devices' (or batches') sums."""
        out = EvalSums(0.0, 0, 0)
        for p in parts:
            out = out + p
        return out


@runtime_checkable
class DeviceProgram(Protocol):
    """What every device of a mesh runs (module docstring).

    Attributes:
        sizes: {"data", "fsdp", "tensor"} -> size.
        batch_shards: devices that see different examples (data x fsdp).
    """

    sizes: dict[str, int]

    @property
    def batch_shards(self) -> int:
        """Devices that see different examples."""

    def init_local(self, seed: int, coords: DeviceCoords) -> DeviceShard:
        """The device's shard of the model initialised from ``seed``."""

    def shape_shard(self, coords: DeviceCoords) -> DeviceShard:
        """A timing-only shard: read-only zero views of the right sizes."""

    def load_local(self, params: Mapping[str, np.ndarray], opt_state: Mapping[str, np.ndarray],
                   coords: DeviceCoords, model_state: Mapping[str, np.ndarray] | None = None
                   ) -> DeviceShard:
        """The device's shard of whole-model arrays (a checkpoint's); the inverse of
        ``assemble``."""

    def assemble(self, shards: Iterable[DeviceShard], *, opt_state: bool = False
                 ) -> dict[str, np.ndarray]:
        """The whole model's parameters (or optimizer state) from the shards of
        one data replica."""

    def batch_slice(self, global_batch: int, coords: DeviceCoords) -> slice:
        """The examples of a global batch this device trains on."""

    def eval_slice(self, num_examples: int, coords: DeviceCoords) -> slice:
        """The examples of an evaluation set this device evaluates."""

    def counts_eval(self, coords: DeviceCoords) -> bool:
        """Whether this device's ``EvalSums`` count towards the total (devices that
        share their predictions with others, e.g. along tensor, count once)."""

    def train_step(self, core: Any, comm: DeviceCollectives, shard: DeviceShard,
                   x: np.ndarray, y: np.ndarray, step: int, *, rng: Any = None) -> StepResult:
        """One training step of one device (``step`` counts from 1)."""

    def evaluate(self, core: Any, comm: DeviceCollectives, shard: DeviceShard,
                 x: np.ndarray, y: np.ndarray) -> EvalSums:
        """Eval-mode sums over this device's examples."""

    def memory(self, per_device_batch: int, precision: str = "bf16", *,
               prefetch_layers: int = 1) -> DeviceMemory:
        """One device's HBM in a training step of ``per_device_batch`` examples under
        ``precision``, at the step's peak; ``prefetch_layers``: the layers an FSDP
        gather runs ahead (programs without FSDP ignore it)."""
