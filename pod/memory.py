"""One device's memory in a training step, as XLA's buffer assignment holds it.

A device program (``pod.programs``) reports what it holds on one device for a
training step (``DeviceProgram.memory(per_device_batch, precision)``), item by
item; ``pod.config.fit`` decides whether it fits the device's HBM and, when it
does not, what would. This module is the value they pass: it imports nothing of
either, so that ``pod.config`` can read a program's memory without importing a
program (issue 31: config asks the program through the contract).

The items (bytes per device; [XLA] ``compiled.memory_analysis()``: the
arguments, the outputs not aliased to them and the temporaries of a jitted
train step, whose sum is what must fit):

- ``parameters_bytes``: the device's shards of the parameters, in their storage
  dtype (MaxText ``weight_dtype``: float32 master weights by default);
- ``optimizer_state_bytes``: the optimizer's state of those shards;
- ``gradients_bytes``: the sharded gradients the update reads (one per
  parameter shard, in the parameters' dtype), live from backward on;
- ``activations_bytes``: what forward keeps in HBM for backward under the remat
  policy; ``host_activations_bytes`` what it keeps in host memory (remat
  offload), which is not in the HBM total;
- ``workspace``: the live working set at the step's peak, by item (the copy of
  the weights in the compute dtype; the FSDP gathers in flight, the prefetched
  ones among them; one block's backward working set; the logits or their
  gradient; an expert axis's all-to-all buffers; a pipeline's stage buffers).

Parameters, optimizer state and the gradients' update are the arguments and
the donated outputs of the step (aliased: counted once); the rest is XLA's
temporary allocation.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["DeviceMemory", "MEMORY_ITEMS", "format_bytes"]

#: The items of a memory table (``DeviceMemory.items``), in order, and their total.
MEMORY_ITEMS = ("params", "grads", "optimizer_state", "activations", "workspace", "total")

_GIB, _MIB = 2**30, 2**20


def format_bytes(nbytes: float) -> str:
    """Bytes for a one-line message: "9.1 GiB" (one decimal, ".0" dropped), or "30.5 MiB"
    below 1 GiB."""
    value, unit = (nbytes / _GIB, "GiB") if nbytes >= _GIB else (nbytes / _MIB, "MiB")
    return f"{value:.1f}".removesuffix(".0") + f" {unit}"


@dataclass(frozen=True)
class DeviceMemory:
    """One device's memory in a training step (module docstring), bytes.

    Attributes:
        parameters_bytes: the device's parameter shards.
        gradients_bytes: the device's gradient shards.
        optimizer_state_bytes: the optimizer's state of its shards.
        activations_bytes: what forward keeps in HBM for backward (remat policy).
        host_activations_bytes: what forward keeps in host memory (remat offload);
            not in :attr:`total_bytes`.
        workspace: (item, bytes) of the live working set at the step's peak, in
            the order the program names them; items of 0 bytes are left out.
        prefetch_layers: layers whose FSDP all-gather runs ahead of the layer
            computing (0: each gather waits for its own layer; the clock reads
            it, ``pod.report.clock``).
        prefetch_layer_bytes: bytes one more gather ahead holds (a gathered weight
            array): what a plan that is tight saves per prefetch it drops; 0
            without FSDP.
        peak: the phase of the step the figures are taken at (forward, loss,
            backward, or a pipeline stage); empty when not said.

    Raises:
        ValueError: a negative figure.
    """

    parameters_bytes: int
    gradients_bytes: int
    optimizer_state_bytes: int
    activations_bytes: int
    host_activations_bytes: int = 0
    workspace: tuple[tuple[str, int], ...] = ()
    prefetch_layers: int = 0
    prefetch_layer_bytes: int = 0
    peak: str = ""

    def __post_init__(self) -> None:
        figures = {"parameters_bytes": self.parameters_bytes,
                   "gradients_bytes": self.gradients_bytes,
                   "optimizer_state_bytes": self.optimizer_state_bytes,
                   "activations_bytes": self.activations_bytes,
                   "host_activations_bytes": self.host_activations_bytes,
                   "prefetch_layers": self.prefetch_layers,
                   "prefetch_layer_bytes": self.prefetch_layer_bytes,
                   **{f"workspace {name}": n for name, n in self.workspace}}
        for name, value in figures.items():
            if int(value) != value or value < 0:
                raise ValueError(f"DeviceMemory: {name} must be a whole number >= 0, got {value!r}")
        object.__setattr__(self, "workspace", tuple((str(k), int(v)) for k, v in self.workspace
                                                    if v))

    @property
    def workspace_bytes(self) -> int:
        """The live working set at the peak, every item summed."""
        return sum(n for _, n in self.workspace)

    @property
    def total_bytes(self) -> int:
        """HBM of the device at the step's peak: every item but the host's."""
        return (self.parameters_bytes + self.gradients_bytes + self.optimizer_state_bytes
                + self.activations_bytes + self.workspace_bytes)

    def items(self) -> dict[str, int]:
        """The memory table: params, grads, optimizer_state, activations, workspace
        (summed) and total, bytes (``MEMORY_ITEMS``; ``TrainingPlan.memory``)."""
        return dict(zip(MEMORY_ITEMS, (self.parameters_bytes, self.gradients_bytes,
                                       self.optimizer_state_bytes, self.activations_bytes,
                                       self.workspace_bytes, self.total_bytes), strict=True))

    def rows(self) -> Iterator[tuple[str, int]]:
        """(item, bytes) for a table: the items of :meth:`items` with the workspace's
        parts after it (indented) and the host's activations, if any, after the total."""
        for name, nbytes in self.items().items():
            yield name, nbytes
            if name == "workspace":
                yield from ((f"  {part}", n) for part, n in self.workspace)
        if self.host_activations_bytes:
            yield "host activations (offloaded)", self.host_activations_bytes

    def summary(self) -> str:
        """The items for a one-line message: "params 4.1 GiB, grads 4.1 GiB, optimizer
        state 8.2 GiB, activations 512 MiB, workspace 3.2 GiB"."""
        names = {"optimizer_state": "optimizer state"}
        return ", ".join(f"{names.get(k, k)} {format_bytes(v)}" for k, v in self.items().items()
                         if k != "total")
